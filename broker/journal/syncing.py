"""Getting a journal's writes onto the disk as its fsync policy says (``journal/store.py``
appends; this module syncs): which segment files were written since their last sync, the
``always`` sync before replies, the ``interval`` jobs handed to the sync thread
(``segments.Syncer``), the lag of what is not on disk yet, and closing the files of sealed and
removed segments once no sync uses them."""

from __future__ import annotations

import itertools
import logging
import os
import time

from zchannel.broker.errors import JournalError
from zchannel.broker.journal.segments import JournalDir, SegmentFile, Syncer, SyncJob

log = logging.getLogger("zchannel.journal")


class JournalFailed(JournalError):
    """Writing or syncing a segment failed after space for it was reserved (an I/O error):
    what the journal holds is no longer known, so the broker stops without answering the
    requests of its last turn (a restarted broker recovers what reached the disk)."""


class Syncing:
    """The sync state of one journal's files under its policy (see the module docstring)."""

    def __init__(self, jdir: JournalDir, policy: str, interval: float) -> None:
        self.dir = jdir
        self.policy = policy
        self.interval = interval
        self.dirty: dict[SegmentFile, None] = {}  # written since the last sync
        self.dirty_since: float | None = None
        self.dir_dirty = False  # a segment was made or removed
        self.closing: list[SegmentFile] = []  # sealed or removed: closed once no sync uses them
        self.syncer = Syncer(jdir.dir_fd) if policy == "interval" and jdir.dir_fd is not None \
            else None
        self.job: SyncJob | None = None
        self._jobs = itertools.count(1)
        self.syncs = 0
        self.last_sync_s = 0.0
        self.failed: BaseException | None = None

    def wrote(self, seg: SegmentFile) -> None:
        """``seg`` was written to (its ``written`` is up to date)."""
        if self.policy == "never":
            return
        if seg not in self.dirty:
            self.dirty[seg] = None
        if self.dirty_since is None:
            self.dirty_since = time.monotonic()

    def retire(self, seg: SegmentFile) -> None:
        """``seg`` is written no more: close its file once it is synced."""
        if seg not in self.closing:
            self.closing.append(seg)
        self.close_unused()

    def removed(self, seg: SegmentFile) -> None:
        """``seg``'s file was removed: the directory changed, what was written to it need not
        reach the disk, and its file closes (once no running sync uses it)."""
        self.dir_dirty = self.policy != "never"
        self.dirty.pop(seg, None)
        self.retire(seg)

    def sync_all(self) -> None:
        """``fdatasync`` every file written since the last sync, and the directory if it
        changed, now (``JournalFailed`` if that fails)."""
        job = self.job  # handed to the sync thread, maybe not synced yet: synced here too
        in_flight = [fd for _, fd, _ in job.files] if job is not None else []
        directory = self.dir_dirty or (job is not None and job.directory)
        if not (self.dirty or directory or in_flight):
            return
        started = time.monotonic()
        try:
            for fd in in_flight:
                os.fdatasync(fd)
            for seg in self.dirty:
                os.fdatasync(seg.fileno())
                seg.synced = seg.written
            if directory and self.dir.dir_fd is not None:
                os.fsync(self.dir.dir_fd)
        except OSError as exc:
            self.failed = exc
            raise JournalFailed(f"the journal could not sync its files: {exc}") from None
        self.last_sync_s = time.monotonic() - started
        self.syncs += 1
        self.dirty.clear()
        self.dirty_since = None
        self.dir_dirty = False
        self.close_unused()

    def due(self) -> float | None:
        """When ``tick`` has a sync to start or to look at (``interval`` only)."""
        if self.syncer is None:
            return None
        if self.job is not None:
            return time.monotonic() + max(self.interval / 4, 0.001)
        return None if self.dirty_since is None else self.dirty_since + self.interval

    def tick(self, now: float) -> None:
        """Take a finished sync in, and start the next one when it is due (``interval``)."""
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
            self.last_sync_s = syncer.last_seconds
            self.syncs += 1
            self.job = None
            self.close_unused()
        if self.job is None and self.dirty_since is not None \
                and now - self.dirty_since >= self.interval:
            self.job = SyncJob(next(self._jobs), [(s, s.fileno(), s.written) for s in self.dirty
                                                  if s.fd is not None], self.dir_dirty)
            self.dirty.clear()
            self.dirty_since = None
            self.dir_dirty = False
            syncer.submit(self.job)

    def lag(self, now: float, buffered_since: float | None) -> float:
        """Seconds the oldest write not yet on disk has waited (0 when all is synced)."""
        if self.policy == "never":
            return 0.0
        since = [t for t in (self.dirty_since, self.job.started if self.job else None,
                             buffered_since) if t is not None]
        return now - min(since) if since else 0.0

    def close_unused(self) -> None:
        """Close the files of sealed and removed segments that no sync needs any more."""
        in_job = {id(s) for s, _, _ in self.job.files} if self.job is not None else set()
        keep = []
        for seg in self.closing:
            if seg.fd is None:
                continue
            if seg in self.dirty or id(seg) in in_job:
                keep.append(seg)
                continue
            os.close(seg.fd)
            seg.fd = None
        self.closing = keep

    def close(self, segments: list[SegmentFile]) -> None:
        """Sync what is written (unless ``never``, or after a failure), stop the sync thread,
        close every file."""
        try:
            if self.failed is None:
                if self.syncer is not None:
                    self.syncer.wait_idle()
                if self.policy != "never":
                    for seg in segments:
                        if seg.fd is not None and seg.synced < seg.written:
                            os.fdatasync(seg.fd)
        except OSError as exc:
            log.error("the journal could not sync its files while closing: %s", exc)
        finally:
            if self.syncer is not None:
                self.syncer.stop()
            for seg in segments + self.closing:
                if seg.fd is not None:
                    os.close(seg.fd)
                    seg.fd = None
