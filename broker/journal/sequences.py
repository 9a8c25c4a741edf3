"""``StoredSequences``: the put sequences of each producer whose items a durable channel's journal
holds records of, so that a broker started again on the journal still knows which puts it
stored (retry-safe puts across a restart, ``docs/durability.md``).

Every ``PUT`` (or ``INPUT``) record of a retry-safe put carries its ``[producer, sequence]``
(the meta's ``extra``, ``journal/items.py``), in the same record as the item: a put is either
in the journal with its sequence, or not at all.  The start of every segment holds the whole
table (a ``TABLE`` record named ``producers``: per producer its highest sequence and the bits of
the last ``WINDOW``, zlib-compressed), so that a segment removed takes nothing needed with it:
recovery starts from the last whole table it reads and marks the sequences of the records after
it.  A producer that stored nothing for ``FORGET_S`` seconds is left out of the next tables (its
handle forgot its puts in doubt long before: ``IN_DOUBT_S``, 60 s).
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Any

from zchannel.broker.core.sequences import WINDOW, SequenceBits

_MASK = WINDOW - 1

log = logging.getLogger("zchannel.journal")

TABLE_NAME = "producers"  # the TABLE records of the stored sequences
FORGET_S = 600.0


class StoredSequences:
    """Per producer, the sequences of its puts the journal recorded (see the module
    docstring).  ``mark`` only notes a sequence (it runs for every put), as runs of
    consecutive sequences of one producer: the runs go into the windows when they are read
    (``windows``, ``snapshot``), or once ``SETTLE_AFTER`` wait."""

    SETTLE_AFTER = 1024

    def __init__(self) -> None:
        self._windows: dict[bytes, SequenceBits] = {}
        self._last: dict[bytes, float] = {}  # producer -> when a put of it was last recorded
        self._runs: list[tuple[bytes, int, int]] = []  # noted (producer, first, last), in order
        self._producer: bytes | None = None  # the run being noted
        self._first = self._next = 0  # its first sequence, the one after its last

    def mark(self, origin: Any) -> None:
        """A record of the put ``origin`` (``[producer, sequence]``) was written or read."""
        producer, seq = origin
        if seq == self._next and producer == self._producer:
            self._next = seq + 1
            return
        if self._producer is not None:
            self._runs.append((self._producer, self._first, self._next - 1))
            if len(self._runs) >= self.SETTLE_AFTER:
                self._settle()
        self._producer, self._first, self._next = producer, seq, seq + 1

    def mark_all(self, origins: list[Any]) -> None:
        """``mark`` of each of ``origins`` that is not None, in order."""
        producer, following = self._producer, self._next
        for origin in origins:
            if origin is None:
                continue
            if origin[1] == following and origin[0] == producer:
                following += 1  # the common case: the run goes on
                continue
            self._next = following
            self.mark(origin)
            producer, following = self._producer, self._next
        self._next = following

    def _settle(self) -> None:
        """Mark the noted runs in their producers' windows, in the order they came."""
        if self._producer is not None:
            self._runs.append((self._producer, self._first, self._next - 1))
            self._producer = None
        runs, self._runs = self._runs, []
        if not runs:
            return
        windows, last, now = self._windows, self._last, time.monotonic()
        for producer, first, final in runs:
            window = windows.get(producer)
            if window is None:
                window = windows[producer] = SequenceBits()
            _mark_run(window, first, final)
            last[producer] = now

    def marked(self, origin: Any) -> bool:
        """Whether a record of the put ``origin`` was written or read (as ``mark`` noted)."""
        window = self.windows.get(origin[0])
        return window is not None and window.marked(origin[1])

    @property
    def windows(self) -> dict[bytes, SequenceBits]:
        """Each producer's window of recorded sequences."""
        self._settle()
        return self._windows

    def snapshot(self) -> dict[bytes, list]:
        """The whole table, for the start of a segment: ``producer -> [high, zlib(bits)]``
        (producers silent for ``FORGET_S`` seconds dropped first)."""
        self._settle()
        horizon = time.monotonic() - FORGET_S
        for producer in [p for p, t in self._last.items() if t < horizon]:
            del self._windows[producer], self._last[producer]
        return {p: [w.high, zlib.compress(bytes(w.bits), 1)] for p, w in self._windows.items()}

    def load(self, table: dict[Any, Any]) -> None:
        """Start again from a whole table read back (entries that do not hold together are
        skipped, logged); what was noted before it is in it."""
        self._windows.clear()
        self._last.clear()
        self._runs.clear()
        self._producer = None
        now = time.monotonic()
        for producer, value in table.items():
            try:
                high, packed = value
                window = SequenceBits(high, zlib.decompress(packed, bufsize=WINDOW >> 3))
                if not (isinstance(producer, bytes) and isinstance(high, int) and high >= 0):
                    raise ValueError("not a producer id and a sequence")
            except (TypeError, ValueError, zlib.error) as exc:
                log.error("journal: a producer's stored sequences do not hold together (%s): "
                          "skipped", exc)
                continue
            self._windows[producer] = window
            self._last[producer] = now


def _mark_run(window: SequenceBits, first: int, last: int) -> None:
    """Mark the sequences ``first`` .. ``last`` in ``window``, as marking each in turn does."""
    if last - first < 16:
        for seq in range(first, last + 1):
            window.mark(seq)
        return
    if last > window.high:
        window.mark(last)  # the window moves up to it (the slots of the skipped ones cleared)
    start = max(first, window.high - WINDOW + 1)  # older ones fell out of the window
    bits = window.bits
    seq = start
    while seq <= last and seq & 7:  # the first partial byte
        i = seq & _MASK
        bits[i >> 3] |= 1 << (i & 7)
        seq += 1
    while seq + 8 <= last + 1:  # whole bytes (a run within the window does not wrap mid-byte)
        bits[(seq & _MASK) >> 3] = 0xFF
        seq += 8
    while seq <= last:
        i = seq & _MASK
        bits[i >> 3] |= 1 << (i & 7)
        seq += 1


def origin_of(extra: Any) -> tuple[bytes, int] | None:
    """The ``[producer, sequence]`` a put record carries, checked (None: none, or malformed)."""
    if (isinstance(extra, list) and len(extra) == 2 and isinstance(extra[0], bytes)
            and isinstance(extra[1], int) and extra[1] >= 0):
        return extra[0], extra[1]
    return None
