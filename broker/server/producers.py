"""Retry-safe puts: which put sequences of each producer the broker stored.

A client connection names itself in its hello with a producer id (``Hello.producer``, 16 random
bytes kept across its reconnects); each of its puts has a sequence number, its request id, or
``Put.seq`` for a retry, which reuses the sequence of the put it repeats.  ``ProducerWindow``
remembers, for the last ``WINDOW`` sequences of one producer, which puts were stored: a put
whose sequence was stored already is acknowledged without being stored again.  A window spans
sequences, not only the newest, so that the retry of an older put is told apart from a new put
(docs/guarantees.md, "Retry-safe puts").

A sequence is marked when its put is stored.  A put that waits for room (a full queue) is
``pending`` until it is admitted (marked) or ends without being stored (timeout, withdrawn):
the same sequence arriving meanwhile is refused, never acknowledged.  ``Producers`` keeps the
windows of live sessions and, for ``grace`` seconds after a producer's last session ended, of
departed ones; at most ``MAX_PRODUCERS`` windows (the departed that expire first go first).
"""

from __future__ import annotations

import time
from typing import Any

from zchannel.broker.core.state import Client, Request

WINDOW = 1 << 14  # sequences a window spans (a client's retry must fall within them)
_MASK = WINDOW - 1
MAX_PRODUCERS = 1 << 16

# what ``ProducerWindow.begin`` says of a put's sequence
NEW, DUPLICATE, WAITING, TOO_OLD = 0, 1, 2, 3


class ProducerWindow:
    """The stored sequences of one producer among the last ``WINDOW`` (a bit each), and its
    puts that wait for room (see the module docstring)."""

    __slots__ = ("producer", "high", "bits", "pending", "sessions", "expires")

    def __init__(self, producer: bytes) -> None:
        self.producer = producer
        self.high = 0  # the highest sequence seen; bits cover (high - WINDOW, high]
        self.bits = bytearray(WINDOW >> 3)
        self.pending: dict[int, Request] = {}  # sequence -> its put waiting for room
        self.sessions = 0  # clients using it now
        self.expires = 0.0  # with no session: when it is forgotten

    def begin(self, seq: int) -> int:
        """A put of sequence ``seq`` arrived: ``NEW`` (marked stored at once: the caller
        ``unmark``s it if the put is not stored now), ``DUPLICATE`` (stored already),
        ``WAITING`` (the put of that sequence still waits for room) or ``TOO_OLD`` (before
        the window: the broker cannot tell)."""
        high = self.high
        if seq > high:
            if seq - high > 1:
                self._clear(high + 1, seq)
            self.high = seq
            i = seq & _MASK
            self.bits[i >> 3] |= 1 << (i & 7)
            return NEW
        if seq <= high - WINDOW:
            return TOO_OLD
        if self.pending and seq in self.pending:
            return WAITING
        i = seq & _MASK
        bit = 1 << (i & 7)
        if self.bits[i >> 3] & bit:
            return DUPLICATE
        self.bits[i >> 3] |= bit
        return NEW

    def unmark(self, seq: int) -> None:
        """The put of ``seq`` was not stored (an error, or it waits)."""
        if seq > self.high - WINDOW:
            i = seq & _MASK
            self.bits[i >> 3] &= ~(1 << (i & 7)) & 0xFF

    def wait(self, seq: int, req: Request) -> None:
        """The put of ``seq`` waits for room as ``req``; its end marks it or not."""
        self.unmark(seq)
        self.pending[seq] = req

        def ended(stored: bool) -> None:
            self.pending.pop(seq, None)
            if stored and seq > self.high - WINDOW:
                i = seq & _MASK
                self.bits[i >> 3] |= 1 << (i & 7)

        req.on_end = ended

    def _clear(self, start: int, stop: int) -> None:
        """Forget the sequences ``start`` .. ``stop - 1`` (their slots held older ones)."""
        if stop - start >= WINDOW:
            self.bits[:] = bytes(len(self.bits))
            return
        i, j = start & _MASK, ((stop - 1) & _MASK) + 1
        if i < j:
            self._clear_slots(i, j)
        else:  # wraps around
            self._clear_slots(i, WINDOW)
            self._clear_slots(0, j)

    def _clear_slots(self, i: int, j: int) -> None:
        bits = self.bits
        while i < j and i & 7:
            bits[i >> 3] &= ~(1 << (i & 7)) & 0xFF
            i += 1
        while j > i and j & 7:
            j -= 1
            bits[j >> 3] &= ~(1 << (j & 7)) & 0xFF
        if i < j:
            bits[i >> 3 : j >> 3] = bytes((j - i) >> 3)


class Producers:
    """The windows of the broker's producers, by producer id (see the module docstring)."""

    def __init__(self, grace: float, limit: int = MAX_PRODUCERS) -> None:
        self.grace = grace
        self.limit = limit
        self.windows: dict[bytes, ProducerWindow] = {}
        self.duplicates = 0  # puts acknowledged without being stored again

    def attach(self, client: Client, producer: Any) -> None:
        """``client`` said hello as ``producer`` (None: a client without retry-safe puts)."""
        if not isinstance(producer, bytes):
            return
        window = self.windows.get(producer)
        if window is None:
            if len(self.windows) >= self.limit:
                self._evict()
            window = self.windows[producer] = ProducerWindow(producer)
        window.sessions += 1
        client.producer = window

    def detach(self, client: Client, now: float | None = None) -> None:
        """``client``'s session ended: its window is kept ``grace`` seconds after the last."""
        window = client.producer
        if window is None:
            return
        client.producer = None
        window.sessions -= 1
        if window.sessions <= 0:
            window.expires = (time.monotonic() if now is None else now) + self.grace

    def sweep(self, now: float) -> None:
        """Forget the windows whose producer left more than ``grace`` seconds ago."""
        gone = [p for p, w in self.windows.items()
                if w.sessions <= 0 and w.expires <= now and not w.pending]
        for producer in gone:
            del self.windows[producer]

    def _evict(self) -> None:
        """Room for one more window: the departed producer that expires first goes (with none
        departed, the oldest window: more live producers than the limit)."""
        departed = [w for w in self.windows.values() if w.sessions <= 0]
        victim = min(departed, key=lambda w: w.expires) if departed \
            else next(iter(self.windows.values()))
        del self.windows[victim.producer]
