"""Shared-memory segments: what the producer, the broker and the consumer share (``docs/shm.md``).

A segment is one file in ``/dev/shm``: a 4 KiB header (magic, slot size, slot count, creator
pid; one state byte per slot at ``STATES_OFFSET``; per slot at ``FREED_OFFSET`` when the broker
last freed it) and ``nslots`` slots of ``slot_size`` bytes.  Only the producer flips a slot's
state FREE -> USED (when it puts an item in it); only the broker flips USED -> FREE (when
nothing references the slot any more), so no round trip is needed per item.

Segment names: ``zc+<run>+<channel>+...`` where ``run`` is a hash of the broker's run directory
(``+`` never occurs in a channel name) and ``channel`` the channel's name, or
``<name>.replica<i>`` for replica ``i`` of a distributed channel (the name of its lock), so
brokers of other run directories, other channels or other replicas on this host never touch
each other's segments, and a broker removes at start (stale, after a SIGKILL) and at
stop every segment of its own prefix.  This module also names the two records of the path
(``shm_hi``, ``shm_rel``).
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import secrets
import stat
import struct
from typing import Any

import numpy as np

SHM_DIR = "/dev/shm"
MAGIC = b"ZCSHM001"
HEADER_BYTES = 4096
STATES_OFFSET = 64
FREED_OFFSET = 1024  # one uint64 per slot: when the broker last freed it (a broker-wide count)
MAX_SLOTS = 64  # per segment, and per size class of a pool
FREE, USED = 0, 1
_FREE_BYTE = bytes([FREE])
DEFAULT_THRESHOLD = 1 << 20
DEFAULT_POOL_BYTES = 1 << 30  # per producer connection, all size classes together
_HEAD = struct.Struct("<8sQQQ")  # magic, slot_size, nslots, creator pid

# the channel part: a channel name (1-64 characters), or a replica's ``<name>.replica<i>``
NAME_RE = re.compile(r"^zc\+[0-9a-f]{10}\+[A-Za-z0-9._-]{1,80}\+[A-Za-z0-9._-]{1,64}\Z")
PREFIX_RE = re.compile(r"^zc\+[0-9a-f]{10}\+[A-Za-z0-9._-]{1,80}\+\Z")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def run_prefix(run_dir: str) -> str:
    """The segment name prefix of every channel served from ``run_dir``."""
    return f"zc+{hashlib.sha1(os.path.realpath(run_dir).encode()).hexdigest()[:10]}+"


def prefix_for(name: str, run_dir: str) -> str:
    """The segment name prefix of channel ``name`` served from ``run_dir``."""
    return f"{run_prefix(run_dir)}{name}+"


def list_segments(prefix: str) -> list[str]:
    """Names of the segments in ``/dev/shm`` that start with ``prefix`` and are files of this
    user (another user's file of that name is none of ours: never listed, mapped or removed)."""
    try:
        names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except OSError:
        return []
    return [n for n in names if _own_file(os.path.join(SHM_DIR, n))]


def _own_file(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def unlink(name: str) -> None:
    """Remove segment ``name`` from ``/dev/shm`` (gone already: nothing)."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except OSError:
        pass


def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


def _populate(mm: mmap.mmap, advice: int) -> None:
    """Map every page of ``mm`` now (best effort: kernels before 5.14 lack the advice).  Through
    libc when it can: ``mmap.madvise`` holds the GIL, for ~70 ms per 256 MiB here."""
    if _MADVISE is not None:
        addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        _MADVISE(addr, len(mm), advice)
        return
    try:
        mm.madvise(advice)
    except (OSError, ValueError):
        pass


class Segment:
    """A mapped segment (any side)."""

    __slots__ = ("name", "mm", "slot_size", "nslots", "states", "freed", "ident", "__weakref__")

    def __init__(self, name: str, mm: mmap.mmap, slot_size: int, nslots: int,
                 ident: tuple[int, int] | None = None) -> None:
        self.name, self.mm, self.slot_size, self.nslots = name, mm, slot_size, nslots
        self.ident = ident  # (st_dev, st_ino) of the file mapped (``unlinked``)
        self.states = np.frombuffer(mm, dtype=np.uint8, count=nslots, offset=STATES_OFFSET)
        self.freed = np.frombuffer(mm, dtype=np.uint64, count=nslots, offset=FREED_OFFSET)

    @classmethod
    def create(cls, prefix: str, slot_size: int, nslots: int) -> Segment:
        """Create, allocate and fault in a new segment of ``nslots`` free slots (``OSError``
        when ``/dev/shm`` cannot hold it)."""
        name = f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        size = HEADER_BYTES + slot_size * nslots
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, never SIGBUS later
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            unlink(name)
            raise
        os.close(fd)
        _populate(mm, _MADV_POPULATE_WRITE)  # map every page now, not on the hot path
        _HEAD.pack_into(mm, 0, MAGIC, slot_size, nslots, os.getpid())
        return cls(name, mm, slot_size, nslots)

    @classmethod
    def open(cls, name: str) -> Segment:
        """Map an existing segment; ``ValueError`` if it is missing or malformed."""
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError(f"invalid shared-memory segment name {name!r}")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(f"cannot open shared-memory segment {name!r}: {exc}") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():  # another user's file: it could be cut short under us
                raise ValueError(f"shared-memory segment {name!r} belongs to another user")
            size = st.st_size
            if size < HEADER_BYTES:
                raise ValueError(f"shared-memory segment {name!r} is too small")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, slot_size, nslots, _ = _HEAD.unpack_from(mm, 0)
        if (magic != MAGIC or not 0 < nslots <= MAX_SLOTS or slot_size <= 0
                or slot_size % 4096 or HEADER_BYTES + slot_size * nslots > size):
            raise ValueError(f"shared-memory segment {name!r} has a malformed header")
        return cls(name, mm, slot_size, nslots, (st.st_dev, st.st_ino))

    def unlinked(self) -> bool:
        """Whether the file this segment maps is no longer in ``/dev/shm`` (unlinked, or its
        name now names another file): one ``stat``.  Its memory stays allocated as long as it
        is mapped.  False for a segment made by ``create`` (not recorded) or when ``stat``
        fails otherwise."""
        if self.ident is None:
            return False
        try:
            st = os.stat(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return (st.st_dev, st.st_ino) != self.ident

    def has_free(self) -> bool:
        """Whether a slot's state byte says FREE (one search of the state bytes: no lock, no
        numpy; a slot lent to its producer may still be in use, ``Pool._take`` decides)."""
        return self.mm.find(_FREE_BYTE, STATES_OFFSET, STATES_OFFSET + self.nslots) >= 0

    def view(self, slot: int, nbytes: int) -> np.ndarray:
        """A writable uint8 array over the first ``nbytes`` of ``slot`` (a fresh base array, so
        that a finalizer on it fires only when every view derived from it is gone)."""
        return np.frombuffer(self.mm, dtype=np.uint8, count=nbytes,
                             offset=HEADER_BYTES + slot * self.slot_size)
