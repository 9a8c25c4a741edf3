"""Appending records to a journal's segments, and keeping them on disk as its fsync policy says.

``SegmentStore`` owns the segment files of one journal (oldest first; the last one is written).
Records go in at the end of the current segment, each in space reserved when it is appended
(a full segment is followed by a new, preallocated one: a full disk refuses the record that
needed it, and nothing else).  Small records gather in a buffer written at the next
``commit`` (before the broker sends its replies) or after ``BUFFER_BYTES``; records with large
frames are written at once with ``pwritev``, straight from the frames.

The fsync policies (``docs/durability.md``):

- ``always``: ``commit`` writes the buffer and ``fdatasync``s every file written since the last
  one before the replies go: a put or an ack is answered once it is on disk;
- ``interval``: the replies go after the write; a ``Syncer`` thread ``fdatasync``s what was
  written at most ``interval`` seconds after it was (group commit, deadline in the broker's
  loop: ``due``/``tick``);
- ``never``: written, and never synced by the journal (the OS writes it back).

Every put keeps ``margin`` bytes of its segment free for removal records and, on the disk,
room for the removal of every item the journal holds (``REMOVAL_BYTES`` each) and for the
first segment of a broker started again on the journal, so that a full disk still lets
consumers take (and acknowledge) what is queued, also after a restart.  Removal records may
use all of that but the restart's room; compaction's copies and lease records (which only
count redeliveries: ``append_spare``) use none of it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence, Sized
from typing import Any

from zchannel.broker.errors import JournalError
from zchannel.broker.journal import format as fmt
from zchannel.broker.journal.segments import JournalDir, SegmentFile, write_all
from zchannel.broker.journal.syncing import JournalFailed, Syncing

log = logging.getLogger("zchannel.journal")

POLICIES = ("always", "interval", "never")
SEGMENT_BYTES = 64 << 20
BUFFER_BYTES = 256 << 10  # the buffer of small records is written once it holds this much
DIRECT_BYTES = 64 << 10  # records at least this large are written at once, from their frames
REMOVAL_BYTES = 32  # the disk a put keeps for the removal record of each item held


class SegmentStore:
    """The segment files of one journal, the record buffer and the fsync policy."""

    def __init__(self, jdir: JournalDir, *, policy: str, interval: float, segment_bytes: int,
                 kind: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.dir = jdir
        self.policy = policy
        self.interval = interval
        self.segment_bytes = segment_bytes
        # the removals' margin of a segment of ``segment_bytes``; ``margin``: the current one's
        self.full_margin = min(1 << 20, max(4096, segment_bytes // 16))
        self.margin = self.full_margin
        self.kind = kind
        self.crc = fmt.checksum_of(kind)
        self.segments: list[SegmentFile] = []
        self.read_back: list[str] = []  # segments read at the start, not synced since
        self.disk_bytes = 0  # what the segments take on disk (allocated)
        self.next_seq = 1
        self.buf = bytearray()
        self.buf_at = 0  # offset of the buffer in the current segment
        self.buf_since = 0.0  # when the buffer's oldest record came
        self.sync = Syncing(jdir, policy, interval)
        # the records of the whole tables every new segment starts with
        self.tables: Callable[[], list[bytes]] | None = None
        self.reserve = DiskReserve()  # the disk kept for removals and a restart

    @property
    def failed(self) -> BaseException | None:
        """The write or sync error that made the journal fail (None: none)."""
        return self.sync.failed

    # -- segments ----------------------------------------------------------------------------

    @property
    def current(self) -> SegmentFile:
        return self.segments[-1]

    def adopt(self, seg: SegmentFile) -> None:
        """A segment read at start: it is kept (and removed once its items are gone)."""
        self.segments.append(seg)
        self.read_back.append(seg.path)
        self.disk_bytes += seg.allocated
        self.next_seq = max(self.next_seq, seg.seq + 1)

    def start(self, limit: int = 0) -> None:
        """Open a new segment to write in (after the recovered ones); with a ``limit`` on the
        journal's disk use, no larger than the room the recovered ones leave under it (down
        to the least a segment takes: the removals it is for may pass the limit).  It may
        take the room the journal kept for a restart: this is the restart."""
        self._roll(0, room=limit - self.staying() if limit else None, restarting=True)

    def _roll(self, need: int, for_put: bool = False, room: int | None = None,
              restarting: bool = False) -> None:
        """Continue in a new segment, of at least ``need`` free bytes after the tables it starts
        with (``JournalError`` on a full disk: the current one stays).  On a disk too full for
        a segment of ``segment_bytes``, a smaller one, down to the tables and this record; its
        removals' margin is a sixteenth of it (at least a page); none larger than ``room``
        (down to that least).  A put (``for_put``) leaves ``DiskReserve.for_puts`` free; other
        records (removals: they are what makes room) leave ``DiskReserve.for_restart``, the
        room a broker started again on this journal needs, which only that start
        (``restarting``) takes."""
        if self.segments:
            self.flush_buffer()
        head = self.tables() if self.tables is not None else []
        tables = sum(map(len, head))
        own = need + tables + 4096
        least = own + self.full_margin
        largest = max(self.segment_bytes, least)
        if room is not None:
            largest = max(least, min(largest, room))
        keep = (self.reserve.for_puts(tables, 1) if for_put else 0 if restarting
                else self.reserve.for_restart(tables))
        sizes, disk_free = _fitting(self.dir, [largest, least, own], keep, for_put)
        sync = self.policy != "never"
        seg: SegmentFile | None = None
        for size in sorted(set(sizes), reverse=True):
            try:
                seg = self.dir.make(self.next_seq, size, self.kind, sync)
                break
            except JournalError:
                if size <= min(sizes):
                    raise
        assert seg is not None
        self.next_seq += 1
        if self.segments:
            self._seal(self.current)
        self.segments.append(seg)
        self.disk_bytes += seg.allocated
        self.reserve.rolled(disk_free, _pages(seg.allocated), tables)
        self.margin = min(self.full_margin, max(4096, seg.allocated // 16))
        for record in head:  # the room for them was counted above
            self.append([record], len(record))
        seg.head = seg.used

    def _seal(self, seg: SegmentFile) -> None:
        """``seg`` is written no more: give its unused preallocated space back."""
        if seg.fd is None:  # read at start: trimmed then
            return
        try:
            os.ftruncate(seg.fileno(), seg.used)
            self.disk_bytes -= seg.allocated - seg.used
            self.reserve.spared(seg.allocated - seg.used)
            seg.allocated = seg.used
        except OSError as exc:
            log.warning("could not trim journal segment %s: %s", seg.path, exc)
        self.sync.retire(seg)

    def room_for(self, nbytes: int, limit: int, current_stays: bool = False) -> bool:
        """Whether a put record of ``nbytes`` fits in ``limit`` bytes of disk now: in the
        current segment, or in a new one beside the segments that stay once it is made
        (``staying``; ``current_stays``: records are about to go into the current one)."""
        if self.segments and self.current.free - self.margin >= nbytes:
            return True
        return self.staying(current_stays) + max(
            self.segment_bytes, nbytes + self.full_margin + 4096) <= limit

    def staying(self, current_stays: bool = False) -> int:
        """The disk the segments take, but for the oldest ones that hold nothing any more
        (they go once a new segment is made): the current one too, unless ``current_stays``."""
        staying = self.disk_bytes
        keep = self.segments[-1] if current_stays and self.segments else None
        for seg in self.segments:
            if seg.live or seg is keep:
                break
            staying -= seg.allocated
        return staying

    def drop_dead_prefix(self) -> int:
        """Remove the oldest segments while none of their items is left (never the current
        one); how many went."""
        dropped = 0
        while len(self.segments) > 1 and self.segments[0].live == 0:
            seg = self.segments.pop(0)
            self.dir.remove(seg)
            self.disk_bytes -= seg.allocated
            self.reserve.spared(seg.allocated)
            self.sync.removed(seg)
            dropped += 1
        return dropped

    # -- appending ---------------------------------------------------------------------------

    def _reserve(self, nbytes: int, for_put: bool) -> tuple[SegmentFile, int]:
        seg = self.current
        if self._short(seg.free, nbytes, 1) if for_put else seg.free < nbytes:
            self._roll(nbytes, for_put)
            seg = self.current
        offset = seg.used
        seg.used += nbytes
        return seg, offset

    def _short(self, free: int, nbytes: int, new_items: int) -> bool:
        """Whether ``free`` bytes of the current segment lack room for a record of ``nbytes``
        that keeps the removals' margin and ``DiskReserve.for_puts`` of ``new_items`` more."""
        return free - self.margin < nbytes or self.reserve.short(free - nbytes, new_items)

    def ensure_room(self, nbytes: int, puts: int) -> None:
        """Make sure the current segment has ``nbytes`` free for a record of ``puts`` puts,
        beside the removals' margin and ``DiskReserve.for_puts``, continuing in a new one if not
        (``JournalError`` on a full disk)."""
        seg = self.segments[-1]
        if self._short(seg.allocated - seg.used, nbytes, puts):
            self._roll(nbytes, True)

    def append(self, parts: Sequence[Any], nbytes: int, for_put: bool = False) -> SegmentFile:
        """Append a record (its ``parts``, ``nbytes`` in all); the segment it went to.
        ``JournalError`` if no space could be had for it (nothing was written)."""
        if self.sync.failed is not None:
            raise JournalFailed(f"the journal failed: {self.sync.failed}")
        if nbytes < DIRECT_BYTES:  # into the buffer (``_reserve`` inlined: once per item)
            seg = self.segments[-1]
            free = seg.allocated - seg.used
            if self._short(free, nbytes, 1) if for_put else free < nbytes:
                self._roll(nbytes, for_put)  # writes the buffer, then the new segment's tables
                seg = self.segments[-1]
            offset = seg.used
            seg.used = offset + nbytes
            buf = self.buf
            if not buf:
                self.buf_at, self.buf_since = offset, time.monotonic()
            for part in parts:
                buf += part
            if len(buf) >= BUFFER_BYTES:
                self.flush_buffer()
            return seg
        self.flush_buffer()
        seg, offset = self._reserve(nbytes, for_put)
        if self.buf:  # a new segment's tables, buffered by the roll: they come before it
            self.flush_buffer()
        try:
            write_all(seg.fileno(), parts, offset)
        except OSError as exc:
            # what was written of it goes (its segment's data end before it: zeros), and the
            # next record starts a new segment
            self._truncate_at(seg, offset)
            seg.used = seg.allocated
            raise JournalError(f"the journal could not write a record of {nbytes} bytes to "
                               f"{seg.path}: {exc.strerror or exc}") from None
        seg.written = offset + nbytes
        self.sync.wrote(seg)
        return seg

    def append_spare(self, parts: Sequence[Any], nbytes: int) -> bool:
        """Append a record the journal can do without, only where it takes none of the room
        kept for removals and a restart: beside the current segment's removals' margin, or in
        a new segment made as for a put.  False (nothing written) where the disk has no such
        room."""
        seg = self.segments[-1]
        if self._short(seg.allocated - seg.used, nbytes, 0):
            try:
                self._roll(nbytes, True)
            except JournalError:
                return False
        self.append(parts, nbytes)
        return True

    def _truncate_at(self, seg: SegmentFile, offset: int) -> None:
        try:
            os.ftruncate(seg.fileno(), offset)
        except OSError:
            pass

    def flush_buffer(self) -> None:
        """Write the buffered records (``JournalFailed`` if the disk refuses)."""
        buf = self.buf
        if not buf:
            return
        seg = self.current
        try:
            done = os.pwrite(seg.fileno(), buf, self.buf_at)
            if done < len(buf):  # a short write: the rest
                write_all(seg.fileno(), [memoryview(buf)[done:]], self.buf_at + done)
        except OSError as exc:
            self.sync.failed = exc
            raise JournalFailed(f"the journal could not write to {seg.path}: "
                                f"{exc.strerror or exc}") from None
        seg.written = self.buf_at + len(buf)
        self.buf = bytearray()
        self.sync.wrote(seg)

    # -- syncing (journal/syncing.py) --------------------------------------------------------

    def commit(self) -> None:
        """Before replies are sent: write the buffer; with ``always``, sync all that was written."""
        self.flush_buffer()
        if self.policy == "always":
            self.sync.sync_all()

    def sync_now(self) -> None:
        """Write the buffer and (unless ``never``) sync everything written, now: compaction's
        copies are on disk before the segment they come from is removed; the segments read
        at the start too (the broker that wrote them may have died before it synced them)."""
        self.flush_buffer()
        if self.policy != "never":
            while self.read_back:
                try:
                    _sync_file(self.read_back[-1])
                except OSError as exc:
                    self.sync.failed = exc
                    raise JournalFailed(f"the journal could not sync its files: {exc}") from None
                self.read_back.pop()
            self.sync.sync_all()

    def due(self) -> float | None:
        """When ``tick`` has something to do (None: nothing waits)."""
        due = self.sync.due()
        if self.buf:
            due = min(due or math.inf, self.buf_since + self.interval)
        return due

    def tick(self, now: float) -> None:
        """Write a buffer older than the interval; with ``interval``, take a finished sync in
        and start the next one when it is due (``JournalFailed`` if one failed)."""
        if self.buf and now - self.buf_since >= self.interval:
            self.flush_buffer()
        self.sync.tick(now)

    def lag(self, now: float) -> float:
        """Seconds the oldest write not yet on disk has waited (0 when all is synced)."""
        return self.sync.lag(now, self.buf_since if self.buf else None)

    def close(self) -> None:
        """Write and (unless ``never``) sync what is buffered, stop the sync thread, close the
        files.  After a failure only the files are closed."""
        try:
            if self.failed is None:
                self.flush_buffer()
        except JournalError as exc:
            log.error("the journal could not write its buffer while closing: %s", exc)
        self.sync.close(self.segments)
        if self.segments and self.failed is None:
            cur = self.current
            try:  # the unused preallocated space of the last segment
                with open(cur.path, "r+b") as f:
                    f.truncate(cur.used)
            except OSError:
                pass


class DiskReserve:
    """The disk a journal keeps free for the removal of the items it holds and for a restart
    (``docs/durability.md``, "A nearly full disk"), and what it knows of the disk beside its
    segments."""

    def __init__(self) -> None:
        self.live: Sized = ()  # the items the journal holds (``LiveSet.entries``)
        self.tables = 0  # the size of the tables the current segment began with
        self.spare: int | None = None  # the disk free beside the segments (None: unknown)
        # ``spare`` less the room kept for restarts (``for_puts`` but its removals): what the
        # current segment's free bytes and this may give the removals (unknown: ``roomy``)
        self.budget = 0
        # ``short`` is False while the journal holds at most this many items (a quick test)
        self.roomy = sys.maxsize

    @staticmethod
    def for_restart(tables: int) -> int:
        """The disk a broker started again on this journal needs for its first segment."""
        return tables + 2 * 4096

    def for_puts(self, tables: int, new_items: int) -> int:
        """The disk a put leaves free (``new_items``: those it adds): room for a restart, for
        the tables of the segments the removals may need, and for the removal of every item."""
        return 2 * self.for_restart(tables) + REMOVAL_BYTES * (len(self.live) + new_items)

    def short(self, left_in_segment: int, new_items: int) -> bool:
        """Whether ``new_items`` more items, leaving ``left_in_segment`` bytes free in the
        current segment, would leave less than ``for_puts`` with the disk beside it (once per
        put: ``budget`` holds the rest of that sum)."""
        items = len(self.live) + new_items
        return items > self.roomy and left_in_segment + self.budget < REMOVAL_BYTES * items

    def rolled(self, disk_free: int | None, taken: int, tables: int) -> None:
        """A new segment took ``taken`` bytes of the ``disk_free`` (None: unknown) there were,
        and began with ``tables`` bytes of tables."""
        self.spare = None if disk_free is None else max(0, disk_free - taken)
        self.tables = tables
        self._rebudget()

    def spared(self, nbytes: int) -> None:
        """The segments gave ``nbytes`` of disk back."""
        if self.spare is not None:
            self.spare += nbytes
            self._rebudget()

    def _rebudget(self) -> None:
        spare = self.spare
        if spare is None:
            self.budget, self.roomy = 0, sys.maxsize
        else:
            self.budget = spare - 2 * self.for_restart(self.tables)
            self.roomy = self.budget // REMOVAL_BYTES


def _fitting(jdir: JournalDir, sizes: list[int], keep: int,
             for_put: bool) -> tuple[list[int], int | None]:
    """Of the segment ``sizes`` (the largest first, the least a record needs last), those the
    disk holds beside ``keep`` bytes, with three quarters of what it holds when that is
    smaller than the largest; and the disk's free bytes (None when unknown: all of them).
    ``JournalError`` when not even the least fits."""
    try:
        stat = os.statvfs(jdir.path)
    except OSError:
        return sizes, None
    disk_free = stat.f_bavail * stat.f_frsize
    least = sizes[-1]
    sizes = [*sizes, max(least, min(sizes[0], (disk_free - keep) * 3 // 4))]
    fitting = [size for size in sizes if _pages(size) + keep <= disk_free]
    if not fitting:
        raise jdir.no_room(f"a segment of {least} bytes", (
            " (beside the room kept for the removal of the items held and a restart)"
            if for_put else " (beside the room kept for a restart)" if keep else ""))
    return fitting, disk_free


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (what a file of them takes on disk, about)."""
    return -(-nbytes // 4096) * 4096


def _sync_file(path: str) -> None:
    """``fdatasync`` the file at ``path`` (``OSError`` if that fails)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)
