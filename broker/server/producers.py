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
A forgotten window leaves its highest sequence behind (``Producers.forgotten``, as many): a
producer that comes back gets a window whose sequences up to that one are ``TOO_OLD``, so that
a late retry is refused rather than stored a second time.

Memory: a live window is a ``WINDOW``-bit bitmap (2 KiB), one per connected producer (bounded
by the clients the broker serves).  A departed window is kept compressed (``ProducerWindow.
pack``: tens of bytes for a real producer's bits), and the departed windows and forgotten
sequences together cost at most ``DEPARTED_BYTES`` by the estimates ``PACKED_COST`` (plus the
compressed bits) and ``FORGOTTEN_COST``: past it, the sequences forgotten first go, then the
departed windows that expire first are forgotten, so that a client saying hello with ever new
producer ids cannot grow the broker without bound.
"""

from __future__ import annotations

import time
import zlib
from collections import OrderedDict
from typing import Any

from zchannel.broker.core.sequences import WINDOW, SequenceBits
from zchannel.broker.core.state import Client, Parked

MAX_PRODUCERS = 1 << 16
DEPARTED_BYTES = 8 << 20  # departed windows and forgotten sequences, all together
# measured resident bytes (with a margin) of a departed window besides its compressed bits
# (the window, its producer id, its entries in ``windows`` and ``departed``), and of one
# forgotten sequence (its producer id, the int, its ``forgotten`` entry)
PACKED_COST = 720
FORGOTTEN_COST = 240

# what ``ProducerWindow.begin`` says of a put's sequence
NEW, DUPLICATE, WAITING, TOO_OLD = 0, 1, 2, 3


class ProducerWindow(SequenceBits):
    """The stored sequences of one producer among the last ``WINDOW`` (a bit each), and its
    puts that wait for room (see the module docstring).  While ``packed`` holds its bits
    compressed, ``bits`` is empty and nothing may mark or read them (a departed window)."""

    __slots__ = ("producer", "pending", "sessions", "expires", "floor", "packed")

    def __init__(self, producer: bytes, floor: int = 0) -> None:
        super().__init__(high=floor)
        self.producer = producer
        self.floor = floor  # sequences up to this one were forgotten: TOO_OLD
        self.pending: dict[int, Parked] = {}  # sequence -> its put waiting for room
        self.sessions = 0  # clients using it now
        self.expires = 0.0  # with no session: when it is forgotten
        self.packed: bytes | None = None

    def pack(self) -> None:
        """Keep the bits compressed (a window without sessions or waiting puts)."""
        if self.packed is None and not self.pending:
            self.packed = zlib.compress(self.bits, 1)
            self.bits = bytearray()

    def unpack(self) -> None:
        """The bits as they were before ``pack`` (a session uses the window again)."""
        if self.packed is not None:
            self.bits = bytearray(zlib.decompress(self.packed, bufsize=WINDOW >> 3))
            self.packed = None

    def cost(self) -> int:
        """The bytes this window counts while it is departed (an estimate, see the module
        docstring)."""
        return PACKED_COST + len(self.packed if self.packed is not None else self.bits)

    def begin(self, seq: int) -> int:
        """A put of sequence ``seq`` arrived: ``NEW`` (marked stored at once: the caller
        ``unmark``s it if the put is not stored now), ``DUPLICATE`` (stored already),
        ``WAITING`` (the put of that sequence still waits for room) or ``TOO_OLD`` (before
        the window: the broker cannot tell)."""
        if seq > self.high:
            self.mark(seq)
            return NEW
        if seq <= self.high - WINDOW or seq <= self.floor:
            return TOO_OLD
        if self.pending and seq in self.pending:
            return WAITING
        if self.marked(seq):
            return DUPLICATE
        self.mark(seq)
        return NEW

    def wait(self, seq: int, req: Parked) -> None:
        """The put of ``seq`` waits for room as ``req``; its end marks it or not."""
        self.unmark(seq)
        self.pending[seq] = req

        def ended(stored: bool) -> None:
            self.pending.pop(seq, None)
            if stored:
                self.mark(seq)

        req.on_end = ended


class Producers:
    """The windows of the broker's producers, by producer id (see the module docstring)."""

    def __init__(self, grace: float, limit: int = MAX_PRODUCERS,
                 departed_bytes: int = DEPARTED_BYTES) -> None:
        self.grace = grace
        self.limit = limit
        self.departed_bytes = departed_bytes
        self.windows: dict[bytes, ProducerWindow] = {}
        # the windows without a session, by producer id, in the order they expire (they all
        # expire ``grace`` after their last session ended): eviction and sweeps take the
        # first ones without scanning every window
        self.departed: OrderedDict[bytes, ProducerWindow] = OrderedDict()
        # producer id -> the highest sequence of its forgotten window (oldest first)
        self.forgotten: OrderedDict[bytes, int] = OrderedDict()
        self.kept_bytes = 0  # what departed windows and forgotten sequences count
        self.duplicates = 0  # puts acknowledged without being stored again

    def attach(self, client: Client, producer: Any) -> None:
        """``client`` said hello as ``producer`` (None: a client without retry-safe puts)."""
        if not isinstance(producer, bytes):
            return
        window = self.windows.get(producer)
        if window is None:
            floor = self._recall(producer)  # before an eviction may push it out
            if len(self.windows) >= self.limit:
                self._evict()
            window = self.windows[producer] = ProducerWindow(producer, floor)
        elif self.departed.pop(producer, None) is not None:
            self.kept_bytes -= window.cost()
            window.unpack()
        window.sessions += 1
        client.producer = window

    def restore(self, stored: dict[bytes, SequenceBits], now: float | None = None) -> None:
        """The stored sequences a durable channel's journal kept (``journal/sequences.py``):
        a window for each producer, kept ``grace`` seconds for it to say hello again."""
        expires = (time.monotonic() if now is None else now) + self.grace
        for producer, seen in stored.items():
            if producer in self.windows or len(self.windows) >= self.limit:
                continue
            window = self.windows[producer] = ProducerWindow(producer)
            window.high, window.bits[:] = seen.high, seen.bits
            window.expires = expires
            self._depart(window)

    def detach(self, client: Client, now: float | None = None) -> None:
        """``client``'s session ended: its window is kept ``grace`` seconds after the last."""
        window = client.producer
        if window is None:
            return
        client.producer = None
        window.sessions -= 1
        if window.sessions <= 0:
            window.expires = (time.monotonic() if now is None else now) + self.grace
            self._depart(window)

    def sweep(self, now: float) -> None:
        """Forget the windows whose producer left more than ``grace`` seconds ago (one with a
        put still waiting for room stays until that put ends)."""
        gone = []
        for producer, window in self.departed.items():
            if window.expires > now:
                break
            if not window.pending:
                gone.append(producer)
        for producer in gone:
            self._forget(self.departed[producer])

    def _depart(self, window: ProducerWindow) -> None:
        """``window`` has no session any more: packed, last in ``departed``, counted, within
        ``departed_bytes`` (``_trim``).  A window evicted while it was live (``_evict``) is
        forgotten already."""
        producer = window.producer
        if self.windows.get(producer) is not window:
            return
        if self.departed.pop(producer, None) is not None:  # a second detach: counted once
            self.kept_bytes -= window.cost()
        window.pack()
        self.departed[producer] = window
        self.kept_bytes += window.cost()
        self._trim()

    def _trim(self) -> None:
        """Within ``departed_bytes``: the sequences forgotten first go, then the departed
        windows that expire first are forgotten."""
        while self.kept_bytes > self.departed_bytes and (self.forgotten or self.departed):
            if self.forgotten:
                self._drop_forgotten()
            else:
                self._forget(next(iter(self.departed.values())))

    def _recall(self, producer: bytes) -> int:
        """The highest sequence of ``producer``'s forgotten window (0: none), forgotten now."""
        floor = self.forgotten.pop(producer, None)
        if floor is None:
            return 0
        self.kept_bytes -= FORGOTTEN_COST
        return floor

    def _forget(self, window: ProducerWindow) -> None:
        """Drop ``window`` (departed or live), keeping its highest sequence (at most ``limit``
        of them)."""
        producer = window.producer
        if self.windows.get(producer) is window:
            del self.windows[producer]
        if self.departed.pop(producer, None) is not None:
            self.kept_bytes -= window.cost()
        if self.forgotten.pop(producer, None) is not None:
            self.kept_bytes -= FORGOTTEN_COST
        self.forgotten[producer] = window.high
        self.kept_bytes += FORGOTTEN_COST
        while len(self.forgotten) > self.limit:
            self._drop_forgotten()

    def _drop_forgotten(self) -> None:
        """Forget the sequence forgotten first."""
        self.forgotten.popitem(last=False)
        self.kept_bytes -= FORGOTTEN_COST

    def _evict(self) -> None:
        """Room for one more window: the departed producer that expires first goes (with none
        departed, the oldest window: more live producers than the limit)."""
        if self.departed:
            self._forget(next(iter(self.departed.values())))
        else:
            self._forget(next(iter(self.windows.values())))
        self._trim()
