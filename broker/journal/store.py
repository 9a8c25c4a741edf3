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

Every put keeps ``margin`` bytes of its segment free for removal records, so that a full disk
still lets consumers take (and acknowledge) what is queued.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from zchannel.broker.errors import JournalError
from zchannel.broker.journal import format as fmt
from zchannel.broker.journal.segments import JournalDir, SegmentFile, Syncer, SyncJob, write_all

log = logging.getLogger("zchannel.journal")

POLICIES = ("always", "interval", "never")
SEGMENT_BYTES = 64 << 20
BUFFER_BYTES = 256 << 10  # the buffer of small records is written once it holds this much
DIRECT_BYTES = 64 << 10  # records at least this large are written at once, from their frames


class JournalFailed(JournalError):
    """Writing or syncing a segment failed after space for it was reserved (an I/O error):
    what the journal holds is no longer known, so the broker stops without answering the
    requests of its last turn (a restarted broker recovers what reached the disk)."""


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
        self.margin = min(1 << 20, max(4096, segment_bytes // 16))
        self.kind = kind
        self.crc = fmt.checksum_of(kind)
        self.segments: list[SegmentFile] = []
        self.disk_bytes = 0  # what the segments take on disk (allocated)
        self.next_seq = 1
        self.buf = bytearray()
        self.buf_at = 0  # offset of the buffer in the current segment
        self.buf_since = 0.0  # when the buffer's oldest record came
        self._dirty: dict[SegmentFile, None] = {}  # written since the last sync
        self._dirty_since: float | None = None
        self._dir_dirty = False
        self._closing: list[SegmentFile] = []  # removed or rolled: close once no sync uses them
        self.syncer = Syncer(jdir.dir_fd) if policy == "interval" and jdir.dir_fd is not None else None
        self._job: SyncJob | None = None
        self._jobs = itertools.count(1)
        self.syncs = 0
        self.last_sync_s = 0.0
        self.synced_at = time.monotonic()
        self.failed: BaseException | None = None
        self.on_roll: Callable[[], None] | None = None  # writes the tables into a new segment

    # -- segments ----------------------------------------------------------------------------

    @property
    def current(self) -> SegmentFile:
        return self.segments[-1]

    def adopt(self, seg: SegmentFile) -> None:
        """A segment read at start: it is kept (and removed once its items are gone)."""
        self.segments.append(seg)
        self.disk_bytes += seg.allocated
        self.next_seq = max(self.next_seq, seg.seq + 1)

    def start(self) -> None:
        """Open a new segment to write in (after the recovered ones)."""
        self._roll(0)

    def _roll(self, need: int) -> None:
        """Continue in a new segment, of at least ``need`` free bytes (``JournalError`` on a
        full disk: the current one stays)."""
        if self.segments:
            self.flush_buffer()
        least = need + self.margin + 4096
        sizes = [max(self.segment_bytes, least)]
        try:  # a disk nearly full: a smaller segment, down to this record's own
            free = os.statvfs(self.dir.path)
            sizes.append(max(least, min(sizes[0], free.f_bavail * free.f_frsize * 3 // 4)))
        except OSError:
            pass
        sizes += [least, need + 4096]
        sync = self.policy != "never"
        seg: SegmentFile | None = None
        for size in sorted(set(sizes), reverse=True):
            try:
                seg = self.dir.make(self.next_seq, size, self.kind, sync)
                break
            except JournalError:
                if size <= need + 4096:
                    raise
        assert seg is not None
        self.next_seq += 1
        if self.segments:
            self._seal(self.current)
        self.segments.append(seg)
        self.disk_bytes += seg.allocated
        if self.on_roll is not None:
            self.on_roll()

    def _seal(self, seg: SegmentFile) -> None:
        """``seg`` is written no more: give its unused preallocated space back."""
        if seg.fd is None:  # read at start: trimmed then
            return
        try:
            os.ftruncate(seg.fileno(), seg.used)
            self.disk_bytes -= seg.allocated - seg.used
            seg.allocated = seg.used
        except OSError as exc:
            log.warning("could not trim journal segment %s: %s", seg.path, exc)
        self._closing.append(seg)
        self._close_unused()

    def room_for(self, nbytes: int, limit: int) -> bool:
        """Whether a put record of ``nbytes`` fits in ``limit`` bytes of disk now."""
        if self.segments and self.current.free - self.margin >= nbytes:
            return True
        return self.disk_bytes + max(self.segment_bytes, nbytes + self.margin + 4096) <= limit

    def drop_dead_prefix(self) -> int:
        """Remove the oldest segments while none of their items is left (never the current
        one); how many went."""
        dropped = 0
        while len(self.segments) > 1 and self.segments[0].live == 0:
            seg = self.segments.pop(0)
            self.dir.remove(seg)
            self.disk_bytes -= seg.allocated
            self._dir_dirty = True
            if seg not in self._closing:
                self._closing.append(seg)
            dropped += 1
        if dropped:
            self._close_unused()
        return dropped

    # -- appending ---------------------------------------------------------------------------

    def _reserve(self, nbytes: int, for_put: bool) -> tuple[SegmentFile, int]:
        seg = self.current
        if seg.free - (self.margin if for_put else 0) < nbytes:
            self._roll(nbytes)
            seg = self.current
        offset = seg.used
        seg.used += nbytes
        return seg, offset

    def append(self, parts: Sequence[Any], nbytes: int, for_put: bool = False) -> SegmentFile:
        """Append a record (its ``parts``, ``nbytes`` in all); the segment it went to.
        ``JournalError`` if no space could be had for it (nothing was written)."""
        if self.failed is not None:
            raise JournalFailed(f"the journal failed: {self.failed}")
        if nbytes < DIRECT_BYTES:
            seg, offset = self._reserve(nbytes, for_put)
            if not self.buf:
                self.buf_at, self.buf_since = offset, time.monotonic()
            for part in parts:
                self.buf += part
            if len(self.buf) >= BUFFER_BYTES:
                self.flush_buffer()
            return seg
        self.flush_buffer()
        seg, offset = self._reserve(nbytes, for_put)
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
        self._wrote(seg)
        return seg

    def _truncate_at(self, seg: SegmentFile, offset: int) -> None:
        try:
            os.ftruncate(seg.fileno(), offset)
        except OSError:
            pass

    def _wrote(self, seg: SegmentFile) -> None:
        if self.policy == "never":
            return
        if seg not in self._dirty:
            self._dirty[seg] = None
        if self._dirty_since is None:
            self._dirty_since = time.monotonic()

    def flush_buffer(self) -> None:
        """Write the buffered records (``JournalFailed`` if the disk refuses)."""
        if not self.buf:
            return
        seg = self.current
        try:
            write_all(seg.fileno(), [self.buf], self.buf_at)
        except OSError as exc:
            self.failed = exc
            raise JournalFailed(f"the journal could not write to {seg.path}: "
                                f"{exc.strerror or exc}") from None
        seg.written = self.buf_at + len(self.buf)
        self.buf = bytearray()
        self._wrote(seg)

    # -- syncing -----------------------------------------------------------------------------

    def commit(self) -> None:
        """Before replies are sent: write the buffer; with ``always``, sync all that was written."""
        self.flush_buffer()
        if self.policy == "always":
            self._sync_dirty()

    def sync_now(self) -> None:
        """Write the buffer and (unless ``never``) sync everything written, now: compaction's
        copies are on disk before the segment they come from is removed."""
        self.flush_buffer()
        if self.policy != "never":
            self._sync_dirty()

    def _sync_dirty(self) -> None:
        if self._dirty or self._dir_dirty:
            started = time.monotonic()
            try:
                for seg in self._dirty:
                    os.fdatasync(seg.fileno())
                    seg.synced = seg.written
                if self._dir_dirty and self.dir.dir_fd is not None:
                    os.fsync(self.dir.dir_fd)
            except OSError as exc:
                self.failed = exc
                raise JournalFailed(f"the journal could not sync its files: {exc}") from None
            self._synced(started)
            self._close_unused()

    def _synced(self, started: float) -> None:
        now = time.monotonic()
        self.last_sync_s, self.synced_at = now - started, now
        self.syncs += 1
        self._dirty.clear()
        self._dirty_since = None
        self._dir_dirty = False

    def due(self) -> float | None:
        """When ``tick`` has something to do (None: nothing waits)."""
        times = []
        if self.buf:
            times.append(self.buf_since + self.interval)
        if self.syncer is not None:
            if self._job is not None:
                times.append(time.monotonic() + max(self.interval / 4, 0.001))
            elif self._dirty_since is not None:
                times.append(self._dirty_since + self.interval)
        return min(times) if times else None

    def tick(self, now: float) -> None:
        """Write a buffer older than the interval; with ``interval``, take a finished sync in
        and start the next one when it is due (``JournalFailed`` if one failed)."""
        if self.buf and now - self.buf_since >= self.interval:
            self.flush_buffer()
        syncer = self.syncer
        if syncer is None:
            return
        done = syncer.finished()
        if done is not None:
            if syncer.error is not None:
                self.failed = syncer.error
                raise JournalFailed(f"the journal could not sync its files: {syncer.error}")
            for seg, _, written in done.files:
                seg.synced = max(seg.synced, written)
            self.last_sync_s, self.synced_at = syncer.last_seconds, time.monotonic()
            self.syncs += 1
            self._job = None
            self._close_unused()
        if self._job is None and self._dirty_since is not None \
                and now - self._dirty_since >= self.interval:
            self._job = SyncJob(next(self._jobs), [(s, s.fd, s.written) for s in self._dirty
                                                   if s.fd is not None], self._dir_dirty)
            self._dirty.clear()
            self._dirty_since = None
            self._dir_dirty = False
            syncer.submit(self._job)

    def lag(self, now: float) -> float:
        """Seconds the oldest write not yet on disk has waited (0 when all is synced)."""
        if self.policy == "never":
            return 0.0
        since = [t for t in (self._dirty_since, self._job.started if self._job else None)
                 if t is not None]
        if self.buf:
            since.append(self.buf_since)
        return now - min(since) if since else 0.0

    def _close_unused(self) -> None:
        """Close the files of removed and sealed segments that nothing needs any more."""
        in_job = {id(s) for s, _, _ in self._job.files} if self._job is not None else set()
        keep = []
        for seg in self._closing:
            if seg in self._dirty or id(seg) in in_job or seg.fd is None:
                if seg.fd is not None:
                    keep.append(seg)
                continue
            os.close(seg.fd)
            seg.fd = None
        self._closing = keep

    def close(self) -> None:
        """Write and (unless ``never``) sync what is buffered, stop the sync thread, close the
        files.  After a failure only the files are closed."""
        try:
            if self.failed is None:
                self.flush_buffer()
                if self.syncer is not None:
                    self.syncer.wait_idle()
                if self.policy != "never":
                    for seg in self.segments:
                        if seg.fd is not None and seg.synced < seg.written:
                            os.fdatasync(seg.fd)
        except OSError as exc:
            log.error("the journal could not write or sync its files while closing: %s", exc)
        finally:
            if self.syncer is not None:
                self.syncer.stop()
            for seg in self.segments + self._closing:
                if seg.fd is not None:
                    os.close(seg.fd)
                    seg.fd = None
            if self.segments and self.failed is None:
                cur = self.current
                try:  # the unused preallocated space of the last segment
                    with open(cur.path, "r+b") as f:
                        f.truncate(cur.used)
                except OSError:
                    pass
