"""``SequenceBits``: which of the last ``WINDOW`` sequence numbers of one producer are marked.

A bit per sequence in a ring of ``WINDOW`` bits, and the highest sequence seen: the bits cover
``(high - WINDOW, high]``.  Marking a sequence above ``high`` moves the window up and clears the
bits of the sequences it skipped (their slots held older ones).  The broker's window of a
producer's stored puts (``server/producers.py``) and a durable channel's journal of them
(``journal/sequences.py``) are both made of it.
"""

from __future__ import annotations

WINDOW = 1 << 14  # sequences a window spans (a client's retry must fall within them)
_MASK = WINDOW - 1


class SequenceBits:
    """The marked sequences among the last ``WINDOW`` (see the module docstring)."""

    __slots__ = ("high", "bits")

    def __init__(self, high: int = 0, bits: bytes | None = None) -> None:
        self.high = high  # the highest sequence seen; bits cover (high - WINDOW, high]
        self.bits = bytearray(WINDOW >> 3) if bits is None else bytearray(bits)
        if len(self.bits) != WINDOW >> 3:
            raise ValueError(f"a sequence window has {WINDOW >> 3} bytes, not {len(self.bits)}")

    def mark(self, seq: int) -> None:
        """``seq`` is marked (a sequence older than the window is not kept)."""
        high = self.high
        if seq > high:
            if seq - high > 1:
                self._clear(high + 1, seq)
            self.high = seq
        elif seq <= high - WINDOW:
            return
        i = seq & _MASK
        self.bits[i >> 3] |= 1 << (i & 7)

    def mark_rising(self, seqs: list[int]) -> None:
        """``mark`` each of ``seqs``, which rise and are all above ``high`` (a run of new puts)."""
        bits, high = self.bits, self.high
        for seq in seqs:
            if seq - high > 1:
                self._clear(high + 1, seq)
            i = seq & _MASK
            bits[i >> 3] |= 1 << (i & 7)
            high = seq
        self.high = high

    def marked(self, seq: int) -> bool:
        """Whether ``seq`` is marked (False for one above ``high`` or before the window)."""
        if seq > self.high or seq <= self.high - WINDOW:
            return False
        i = seq & _MASK
        return bool(self.bits[i >> 3] & (1 << (i & 7)))

    def unmark(self, seq: int) -> None:
        if seq > self.high - WINDOW:
            i = seq & _MASK
            self.bits[i >> 3] &= ~(1 << (i & 7)) & 0xFF

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
