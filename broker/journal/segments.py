"""The files of a journal: its directory and lock, its segment files, and the thread that
syncs them.

A journal of channel ``NAME`` in directory ``DIR`` is the files ``DIR/NAME.<seq>.zcj`` (ten
digits of sequence number: they sort in the order they were written) and the lock file
``DIR/NAME.zcj-lock``, which the broker holds (``flock``) while it uses them: a second broker
on the same journal is refused with an error naming the directory.  Other files in ``DIR`` are
never touched, so channels may share a directory.

Every segment is preallocated (``posix_fallocate``) when it is made, so a full disk is found
then — the put that needed the segment fails, nothing else — and never while writing into it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zchannel.broker.errors import JournalError
from zchannel.broker.journal import format as fmt

log = logging.getLogger("zchannel.journal")

IOV_MAX = 512  # parts per writev call (Linux allows 1024)


@dataclass(eq=False)
class SegmentFile:
    """One segment file and what the journal knows of it."""

    seq: int
    path: str
    fd: int | None
    allocated: int  # bytes the file takes on disk (preallocated)
    used: int  # bytes written or reserved for records
    live: int = 0  # items of this segment still in the channel
    live_bytes: int = 0
    head: int = 0  # bytes of its start (preamble, ``SEGMENT`` and ``TABLE`` records): never freed
    written: int = 0  # bytes handed to the file (the rest of ``used`` waits in the buffer)
    synced: int = 0  # bytes known to be on disk
    recovered: bool = False  # read at start (not written by this broker)

    @property
    def free(self) -> int:
        return self.allocated - self.used

    def fileno(self) -> int:
        """Its open file (only segments written by this broker are open, until sealed)."""
        assert self.fd is not None, f"{self.path} is not open"
        return self.fd


def write_all(fd: int, parts: Sequence[Any], offset: int) -> int:
    """Write ``parts`` at ``offset`` of ``fd`` (``os.pwritev``, at most ``IOV_MAX`` parts a
    call, again after a short write); the bytes written."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    total = 0
    while views:
        n = os.pwritev(fd, views[:IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "write returned nothing")
        offset += n
        total += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total


class JournalDir:
    """A journal's directory: its lock, the names of its segments, making and removing them."""

    def __init__(self, directory: str, name: str) -> None:
        self.path = os.path.abspath(directory)
        self.name = name
        self.lock_fd: int | None = None
        self.dir_fd: int | None = None
        self.lock_path = os.path.join(self.path, f"{name}.zcj-lock")
        self._held = False
        try:
            if os.path.lexists(self.path) and not os.path.isdir(self.path):
                raise NotADirectoryError(errno.ENOTDIR, "it is not a directory")
            os.makedirs(self.path, exist_ok=True)
            self.dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            self.close()
            raise JournalError(f"journal directory {self.path!r} of channel {name!r} cannot be "
                               f"used: {exc.strerror or exc} (it must be a writable "
                               "directory)") from None
        try:
            self._lock()
        except OSError as exc:
            self.close()
            raise JournalError(f"the lock file {self.lock_path!r} of the journal of channel "
                               f"{name!r} cannot be used: {exc.strerror or exc} (it must be a "
                               "regular file, not a directory or a symbolic link; move it "
                               "away)") from None
        if not self._held:
            self.close()
            raise JournalError(f"the journal of channel {name!r} in {self.path!r} is in use by "
                               "another broker")
        if not os.access(self.path, os.W_OK):
            self.close()
            raise JournalError(f"journal directory {self.path!r} of channel {name!r} is not "
                               "writable")

    def _lock(self) -> None:
        """Take the lock file (``flock``); a file its holder removed meanwhile is not the
        lock any more: open the path again."""
        while True:
            # never through a symbolic link: it would make (and lock) a file elsewhere
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.lock_path))
            except FileNotFoundError:
                same = False
            if same:
                self.lock_fd, self._held = fd, True
                return
            os.close(fd)

    def segment_path(self, seq: int) -> str:
        return os.path.join(self.path, f"{self.name}.{seq:010d}{fmt.SUFFIX}")

    def listing(self) -> list[tuple[int, str]]:
        """The segments of this journal on disk, ``(seq, path)`` in order."""
        found = []
        prefix = self.name + "."
        for entry in os.listdir(self.path):
            if not (entry.startswith(prefix) and entry.endswith(fmt.SUFFIX)):
                continue
            middle = entry[len(prefix) : -len(fmt.SUFFIX)]
            if len(middle) == 10 and middle.isdigit():
                found.append((int(middle), os.path.join(self.path, entry)))
        return sorted(found)

    def no_room(self, what: str, more: str = "") -> JournalError:
        """The error of a full disk: no room for ``what`` (``more``: said after the cause)."""
        return JournalError(f"the journal of channel {self.name!r} in {self.path!r} has no "
                            f"room for {what}: no space left on device{more}")

    def head(self, seq: int, kind: int) -> bytes:
        """What a new segment ``seq`` starts with: its preamble and ``SEGMENT`` record."""
        return fmt.preamble(kind) + fmt.record(fmt.checksum_of(kind), fmt.SEGMENT, fmt.pack(
            {"channel": self.name, "seq": seq, "created": time.time(), "version": fmt.VERSION}))

    def make(self, seq: int, size: int, kind: int, sync: bool) -> SegmentFile:
        """A new segment of ``size`` bytes (preallocated), its preamble and ``SEGMENT`` record
        written; ``JournalError`` naming the cause (a full disk) if it cannot be made."""
        path = self.segment_path(seq)
        head = self.head(seq, kind)
        size = max(size, len(head))
        fd = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.posix_fallocate(fd, 0, size)
            write_all(fd, [head], 0)
            if sync:
                os.fdatasync(fd)
                if self.dir_fd is not None:
                    os.fsync(self.dir_fd)
        except OSError as exc:
            if fd is not None:
                os.close(fd)
                _unlink(path)
            if exc.errno == errno.ENOSPC:
                raise self.no_room(f"a segment of {size} bytes") from None
            raise JournalError(f"the journal of channel {self.name!r} in {self.path!r} could "
                               f"not make segment {path!r}: {exc.strerror or exc}") from None
        return SegmentFile(seq, path, fd, size, len(head), written=len(head),
                           synced=len(head) if sync else 0)

    def remove(self, seg: SegmentFile) -> None:
        """Remove ``seg``'s file.  Its file is emptied first: a removed file still open (a sync
        in flight uses it) would keep its disk space until it closes, and a put may need that
        space at once."""
        if seg.fd is not None:
            try:
                os.ftruncate(seg.fd, 0)
            except OSError as exc:
                log.debug("could not empty journal segment %s: %s", seg.path, exc)
        _unlink(seg.path)

    def close(self) -> None:
        """Let the lock go (its file removed while held: a starter that opened it sees it
        gone) and close the directory."""
        if self._held and self.lock_fd is not None:
            self._held = False
            try:
                if os.path.samestat(os.fstat(self.lock_fd), os.stat(self.lock_path)):
                    os.unlink(self.lock_path)
            except OSError:
                pass
        for attr in ("dir_fd", "lock_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                setattr(self, attr, None)
                os.close(fd)  # closing the lock file lets the lock go


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass
class SyncJob:
    """The files one ``fdatasync`` round covers, and up to where each was written then."""

    number: int
    files: list[tuple[SegmentFile, int, int]]  # segment, its fd, bytes written at the time
    directory: bool
    started: float = field(default_factory=time.monotonic)


class Syncer:
    """``fdatasync`` in a thread of its own, one job at a time, for the ``interval`` policy.

    The loop hands it the files written since the last job (``submit``) and keeps serving
    while the disk writes: on the VM of ``docs/durability.md`` an ``fdatasync`` of a few KiB
    took 2.5 ms (median) to 9 ms (p90), a quarter to all of a 10 ms interval, had the loop
    waited for it.  The loop reads the result (``finished``) on a later turn; it closes a
    file only once no job uses it.  An ``fdatasync`` that fails is kept in ``error``: the
    journal then stops the broker (``JournalFailed``)."""

    def __init__(self, dir_fd: int) -> None:
        self.dir_fd = dir_fd
        self._cv = threading.Condition()
        self._job: SyncJob | None = None
        self._done: SyncJob | None = None
        self._running = True
        self.error: OSError | None = None
        self.last_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="zchannel-journal-sync", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._job is not None

    def submit(self, job: SyncJob) -> None:
        with self._cv:
            assert self._job is None
            self._job = job
            self._cv.notify()

    def finished(self) -> SyncJob | None:
        """The job that completed since the last call (None: none)."""
        if self._done is None:  # asked every loop turn: no lock while nothing finished
            return None
        with self._cv:
            done, self._done = self._done, None
            return done

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._running and self._job is None:
                    self._cv.wait()
                job = self._job
                if job is None:
                    return
            started = time.monotonic()
            try:
                for _, fd, _ in job.files:
                    os.fdatasync(fd)
                if job.directory:
                    os.fsync(self.dir_fd)
            except OSError as exc:
                self.error = exc
            with self._cv:
                self.last_seconds = time.monotonic() - started
                self._job = None
                self._done = job
                self._cv.notify_all()

    def wait_idle(self) -> None:
        with self._cv:
            while self._job is not None:
                self._cv.wait()

    def stop(self) -> None:
        """Finish the job under way and end the thread (before the files it syncs close)."""
        with self._cv:
            self._running = False
            self._cv.notify_all()
        self._thread.join()
