"""When a journal compacts: copies the records still needed (items, a collector's inputs) out of
its oldest segments to the end, so that those segments can go (``journal._compact`` copies).

A copy is written (and synced) like any record, so compaction runs only when it frees disk:

- the journal takes more than twice the bytes of the records it needs plus two segments, or
  more than three quarters of ``max_journal_bytes``; and
- copying the records of the oldest segments, oldest first, frees at least a quarter of a
  segment (at least ``MIN_RECLAIM``) and copies at most ``MAX_COPIED_PER_FREED`` bytes per
  byte freed.  A segment frees what it takes on disk, less the records it still holds and
  its start (preamble and tables: the segments the copies go to start with them too); a
  segment that holds nothing any more goes as soon as the segments before it went, so
  copying the few records of an old segment frees the empty ones after it as well.

A journal whose segments hold only records still needed is never rewritten.  Once it found
nothing worth copying, or a copy could not be written (no room), compaction looks again only
after a record was removed (an item left, a collector's inputs were let go): without that, a
second look would find the same.  ``docs/durability.md`` (Compaction and disk use).
"""

from __future__ import annotations

from zchannel.broker.journal.store import SegmentStore

COMPACT_BYTES_PER_TICK = 16 << 20  # records copied by one loop turn at most
MIN_RECLAIM = 64 << 10  # a pass frees at least this much (and a quarter of a segment)
MAX_COPIED_PER_FREED = 4  # bytes a pass may copy for each byte it frees, at most


class Compaction:
    """Whether compaction has work (``due``), and what it did (``stats()["journal"]``)."""

    def __init__(self) -> None:
        self.copied_bytes = 0  # bytes of records copied so far
        self.segments_freed = 0  # segments removed once their records were copied
        self._idle_at: int | None = None  # the removals counted when it last found nothing

    def due(self, store: SegmentStore, needed: int, limit: int, removals: int) -> bool:
        """Whether to copy records of the oldest segment now: the journal is large for the
        ``needed`` bytes it holds (or near ``limit``) and copying frees space (module
        docstring); ``removals``: the records removed so far (a count that only grows)."""
        if len(store.segments) < 3 or removals == self._idle_at:
            return False
        if store.disk_bytes <= 2 * needed + 2 * store.segment_bytes \
                and not (limit and store.disk_bytes > limit * 3 // 4):
            return False
        if frees_space(store):
            return True
        self._idle_at = removals
        return False

    def stalled(self, removals: int) -> None:
        """A copy could not be written: look again after the next removal."""
        self._idle_at = removals

    def copied(self, nbytes: int, freed_segments: int) -> None:
        self.copied_bytes += nbytes
        self.segments_freed += freed_segments


def frees_space(store: SegmentStore) -> bool:
    """Whether copying the records still needed out of the oldest segments (never the one
    written now) frees enough for what it copies (module docstring)."""
    least = max(MIN_RECLAIM, store.segment_bytes // 4)
    freed = copied = 0
    for seg in store.segments[:-1]:
        freed += max(0, seg.allocated - seg.head - seg.live_bytes)
        copied += seg.live_bytes
        if freed >= least and copied <= MAX_COPIED_PER_FREED * freed:
            return True
    return False
