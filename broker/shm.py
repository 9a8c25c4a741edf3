"""Same-host shared-memory path for large arrays and tensors (see ``docs/shm.md``).

When a client and its broker share a host, arrays and tensors of at least ``shm_threshold``
bytes are copied once into a slot of a preallocated, reused shared-memory segment and travel as
a slot reference instead of a frame.  Everything else about an item is unchanged.

Pieces:

- ``Segment``: one file in ``/dev/shm``: a 4 KiB header (magic, slot size, slot count, one state
  byte per slot, and per slot when the broker last freed it) and ``nslots`` slots of
  ``slot_size`` bytes.  Only the producer flips a slot's state FREE -> USED (when it copies an
  item in; it takes the slot freed last, the warmest); only the broker flips USED -> FREE (when
  nothing references the slot any more).  So no round trip is needed per item.
- ``Pool`` (producer side): segments of one handle, one per size class (powers of two from the
  threshold), created on first use and reused; ``alloc`` copies an array into a free slot or
  returns None (the array then goes as a frame: the pool never blocks nor fails a put).
- ``ShmClient`` (one per ``Connection``): proves same-host at hello (reads the token of the
  broker's probe segment and sends it back), owns the ``Pool``, maps the segments named in
  replies, decodes items whose slots it receives and sends ``shm_rel`` records for them.
- ``ShmBroker`` (in the broker): the probe, the segments it mapped, ``Hold`` references (one per
  item holding a slot, one per consumer delivery), byte accounting, the conversion of slots to
  frames for consumers that are not on the same host, cleanup of dead clients' slots and of
  stale segments.

Segment names: ``zc+<run>+<channel>+...`` where ``run`` is a hash of the broker's run directory
(``+`` never occurs in a channel name), so brokers of other run directories or other channels
never touch each other's segments, and a broker removes at start (stale, after a SIGKILL) and at
stop every segment of its own prefix.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
from zchannel.broker import codec, streamcopy

log = logging.getLogger("zchannel.shm")

SHM_DIR = "/dev/shm"
MAGIC = b"ZCSHM001"
HEADER_BYTES = 4096
STATES_OFFSET = 64
FREED_OFFSET = 1024  # one uint64 per slot: when the broker last freed it (a broker-wide count)
MAX_SLOTS = 64  # per segment, and per size class of a pool
FREE, USED = 0, 1
DEFAULT_THRESHOLD = 1 << 20
DEFAULT_POOL_BYTES = 1 << 30  # per producer handle, all size classes together
FIRST_SEGMENT_BYTES = 32 << 20  # a size class's first segment (more are added on demand)
CLASS_BYTES = 512 << 20  # a size class of a pool holds at most this much (and MAX_SLOTS slots)
OUT_CACHE = 4  # copy-out buffers of one size a consumer keeps for reuse (pages stay mapped)
MAPPED_SEGMENTS = 64  # a consumer keeps at most this many segments mapped (views keep theirs)
_HEAD = struct.Struct("<8sQQQ")  # magic, slot_size, nslots, creator pid

# protocol ops (client -> broker), no reply: see docs/protocol.md
SHM_HELLO, SHM_RELEASE = "shm_hi", "shm_rel"
SHM_OPS = frozenset({SHM_HELLO, SHM_RELEASE})

_NAME_RE = re.compile(r"^zc\+[0-9a-f]{10}\+[A-Za-z0-9._-]{1,64}\+[A-Za-z0-9._-]{1,64}$")
_PREFIX_RE = re.compile(r"^zc\+[0-9a-f]{10}\+[A-Za-z0-9._-]{1,64}\+$")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def run_prefix(run_dir: str) -> str:
    """The segment name prefix of every channel served from ``run_dir``."""
    return f"zc+{hashlib.sha1(os.path.realpath(run_dir).encode()).hexdigest()[:10]}+"


def prefix_for(name: str, run_dir: str) -> str:
    """The segment name prefix of channel ``name`` served from ``run_dir``."""
    return f"{run_prefix(run_dir)}{name}+"


def list_segments(prefix: str) -> list[str]:
    """Names of the segments in ``/dev/shm`` that start with ``prefix``."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except OSError:
        return []


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except OSError:
        pass


def env_enabled() -> bool:
    """``ZCHANNEL_SHM=0|off|false|no`` turns the shared-memory path off in this process."""
    return os.environ.get("ZCHANNEL_SHM", "1").strip().lower() not in ("0", "off", "false", "no")


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

    __slots__ = ("name", "mm", "slot_size", "nslots", "states", "freed", "__weakref__")

    def __init__(self, name: str, mm: mmap.mmap, slot_size: int, nslots: int) -> None:
        self.name, self.mm, self.slot_size, self.nslots = name, mm, slot_size, nslots
        self.states = np.frombuffer(mm, dtype=np.uint8, count=nslots, offset=STATES_OFFSET)
        self.freed = np.frombuffer(mm, dtype=np.uint64, count=nslots, offset=FREED_OFFSET)

    @classmethod
    def create(cls, prefix: str, slot_size: int, nslots: int) -> Segment:
        name = f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        size = HEADER_BYTES + slot_size * nslots
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, never SIGBUS later
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _unlink(name)
            raise
        os.close(fd)
        _populate(mm, _MADV_POPULATE_WRITE)  # map every page now, not on the hot path
        _HEAD.pack_into(mm, 0, MAGIC, slot_size, nslots, os.getpid())
        return cls(name, mm, slot_size, nslots)

    @classmethod
    def open(cls, name: str) -> Segment:
        """Map an existing segment; ``ValueError`` if it is missing or malformed."""
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"invalid shared-memory segment name {name!r}")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except OSError as exc:
            raise ValueError(f"cannot open shared-memory segment {name!r}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ValueError(f"shared-memory segment {name!r} is too small")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, slot_size, nslots, _ = _HEAD.unpack_from(mm, 0)
        if (magic != MAGIC or not 0 < nslots <= MAX_SLOTS or slot_size <= 0
                or slot_size % 4096 or HEADER_BYTES + slot_size * nslots > size):
            raise ValueError(f"shared-memory segment {name!r} has a malformed header")
        return cls(name, mm, slot_size, nslots)

    def view(self, slot: int, nbytes: int) -> np.ndarray:
        """A writable uint8 array over the first ``nbytes`` of ``slot`` (a fresh base array, so
        that a finalizer on it fires only when every view derived from it is gone)."""
        return np.frombuffer(self.mm, dtype=np.uint8, count=nbytes,
                             offset=HEADER_BYTES + slot * self.slot_size)


def check_reserve(nbytes: Any, slots: Any) -> None:
    """The arguments of ``Channel.reserve_shm``: ``ValueError`` unless both are ints > 0."""
    for name, value in (("nbytes", nbytes), ("slots", slots)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be an int > 0, got {value!r}")


def _size_class(nbytes: int, threshold: int) -> int:
    size = max(4096, threshold)
    while size < nbytes:
        size <<= 1
    return (size + 4095) // 4096 * 4096


# ---------------------------------------------------------------------------------------------
# Producer side


class Pool:
    """The segments of one producer handle (see the module docstring).  Thread-safe.

    A size class starts with one small segment and adds segments (doubling its slot count), up
    to ``MAX_SLOTS`` slots per class and ``budget`` bytes per pool.  The next segment is made in
    a background thread as soon as half of a class's slots are in use, so that a producer
    filling its pipeline does not stall on creating (and faulting in) hundreds of MiB; a put
    that finds every slot in use waits for a segment being made, or makes one itself.
    """

    def __init__(self, prefix: str, threshold: int, budget: int = DEFAULT_POOL_BYTES) -> None:
        self.prefix, self.threshold, self.budget = prefix, threshold, budget
        self.lock = threading.Lock()
        self.classes: dict[int, list[Segment]] = {}  # size class -> its segments
        self.by_name: dict[str, Segment] = {}
        self.reserved: dict[int, int] = {}  # size class -> slots asked for with reserve()
        self.growing: dict[int, threading.Event] = {}  # size class -> set when its growth ended
        self.total = 0  # bytes of the segments made or being made
        self.announced: set[str] = set()  # segments named in a put sent to the broker
        self.fallbacks = 0
        self.failed = False  # a segment could not be created: no more attempts
        self.closed = False

    @staticmethod
    def _cap(size: int) -> int:
        """The most slots a size class may hold."""
        return min(MAX_SLOTS, max(2, CLASS_BYTES // size))

    def _reserve(self, size: int, want: int | None = None) -> int:
        """Slots of the class's next segment, reserving their bytes (under the lock; 0: none
        allowed): doubling the class (at least the first segment's size), or up to ``want``."""
        have = sum(s.nslots for s in self.classes[size])
        grow = max(have, 2, FIRST_SEGMENT_BYTES // size) if want is None else want - have
        nslots = min(grow, self._cap(size) - have, (self.budget - self.total) // size)
        if nslots < 1 or self.failed or self.closed:
            return 0
        self.total += size * nslots
        return nslots

    def _make(self, size: int, nslots: int) -> Segment | None:
        """Create a segment (outside the lock) and add it to its class."""
        try:
            seg = Segment.create(self.prefix, size, nslots)
        except OSError as exc:
            seg = None
            log.warning("cannot create a shared-memory segment (%s): large items go as frames", exc)
        with self.lock:
            if seg is None:
                self.failed = True
                self.total -= size * nslots
            elif self.closed:  # closed meanwhile: nobody will use (or announce) it
                _unlink(seg.name)
                seg = None
            else:
                self.by_name[seg.name] = seg
                self.classes[size].append(seg)
            done = self.growing.pop(size, None)
        if done is not None:
            done.set()
        return seg

    def _grow_soon(self, size: int) -> None:
        """Start making the class's next segment in the background (under the lock)."""
        nslots = self._reserve(size)
        if nslots:
            self.growing[size] = threading.Event()
            threading.Thread(target=self._make, args=(size, nslots), daemon=True,
                             name="zchannel-shm-grow").start()

    def _take(self, size: int) -> tuple[Segment, int] | None:
        """The free slot of the class the broker freed last (its pages are the likeliest to
        be in the caches still; a slot never used counts as freed first), marked USED (under
        the lock); None if every slot is in use."""
        segs = self.classes[size]
        best: tuple[int, Segment, int] | None = None
        total = free = 0
        for seg in segs:
            total += seg.nslots
            idx = np.flatnonzero(seg.states == FREE)
            if idx.size:
                free += idx.size
                j = int(idx[np.argmax(seg.freed[idx])])
                when = int(seg.freed[j])
                if best is None or when > best[0]:
                    best = (when, seg, j)
        if best is None:
            return None
        _, seg, i = best
        seg.states[i] = USED
        free -= 1
        # half in use: make room before the pipeline stalls; a class sized with reserve()
        # grows only once its last free slot is taken (its owner said what it keeps in flight)
        if (size not in self.growing and total < self._cap(size)
                and (free == 0 or (2 * free <= total and total > self.reserved.get(size, 0)))):
            self._grow_soon(size)
        return seg, i

    def reserve(self, nbytes: int, slots: int) -> int:
        """Make the size class of ``nbytes`` hold at least ``slots`` slots now (creating and
        faulting in its segments here, not on the puts' path); the slots it then holds (capped
        by ``MAX_SLOTS``, the class and pool byte limits)."""
        if nbytes < self.threshold:
            return 0
        size = _size_class(nbytes, self.threshold)
        with self.lock:
            self.reserved[size] = max(slots, self.reserved.get(size, 0))
        while True:
            with self.lock:
                segs = self.classes.setdefault(size, [])
                pending = self.growing.get(size)
                nslots = 0 if pending is not None else self._reserve(size, slots)
                if pending is None:
                    if not nslots:  # enough already, or nothing more allowed
                        return sum(s.nslots for s in segs)
                    pending = self.growing[size] = threading.Event()
            if nslots:
                self._make(size, nslots)
            else:
                pending.wait()  # a segment being made: then look again

    def __call__(self, data: Any, nbytes: int) -> list | None:
        """Copy ``data`` (a C-contiguous array or tensor bytes) into a free slot: the slot
        reference ``[segment, slot, nbytes]``, or None (below the threshold, pool exhausted)."""
        if nbytes < self.threshold:
            return None
        size = _size_class(nbytes, self.threshold)
        for _ in range(3):  # take; or wait for (or make) a segment and take again
            with self.lock:
                self.classes.setdefault(size, [])
                got = self._take(size)
                if got is not None:
                    break
                pending = self.growing.get(size)
                nslots = 0 if pending is not None else self._reserve(size)
                if pending is None and nslots:
                    pending = self.growing[size] = threading.Event()
            if pending is None:
                break
            if nslots:
                self._make(size, nslots)
            else:
                pending.wait()
        if got is None:
            with self.lock:
                self.fallbacks += 1
            return None
        seg, slot = got
        dst = seg.view(slot, nbytes)
        src = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        streamcopy.copy(dst, src.reshape(-1).view(np.uint8))
        return [seg.name, slot, nbytes]

    def undo(self, refs: list) -> None:
        """Free slots taken for an item that is not sent (the broker never saw them)."""
        for name, slot, _ in refs:
            seg = self.by_name.get(name)
            if seg is not None:
                seg.states[slot] = FREE

    def sent(self, refs: list) -> None:
        for ref in refs:
            self.announced.add(ref[0])

    def close(self) -> None:
        """Unlink the segments the broker never heard of (it removes the others)."""
        with self.lock:
            self.closed = True  # a segment still being made unlinks itself
        for name in self.by_name:
            if name not in self.announced:
                _unlink(name)
        self.classes.clear()
        self.by_name.clear()


class ShmClient:
    """The shared-memory side of one ``Connection`` (see the module docstring)."""

    def __init__(self, conn: Any, enabled: bool | None = None) -> None:
        self.conn = conn
        self.enabled = env_enabled() if enabled is None else bool(enabled)
        self.pool: Pool | None = None  # set while same-host is proven for the current hello
        self.mapped: OrderedDict[str, Segment] = OrderedDict()
        self.lock = threading.Lock()
        self.out_cache: dict[int, list[np.ndarray]] = {}  # nbytes -> free copy-out buffers
        self.reserved: dict[int, int] = {}  # nbytes -> slots asked for with reserve()

    # -- hello (I/O thread) --------------------------------------------------------------------

    def on_hello(self, info: dict) -> None:
        """A broker answered ``hello``: drop the pool of the previous session, and if the broker
        offers shared memory, prove same-host by echoing its probe's token."""
        old, self.pool = self.pool, None
        if old is not None:
            old.close()
        offer = info.get("shm")
        if not self.enabled or not isinstance(offer, dict):
            return
        probe, prefix = offer.get("probe"), offer.get("prefix")
        threshold, budget = offer.get("threshold"), offer.get("pool") or DEFAULT_POOL_BYTES
        if not (isinstance(prefix, str) and _PREFIX_RE.match(prefix) and isinstance(threshold, int)
                and threshold > 0 and isinstance(budget, int) and isinstance(probe, str)
                and _NAME_RE.match(probe) and probe.startswith(prefix)):
            return
        try:
            with open(os.path.join(SHM_DIR, probe), "rb") as f:
                data = f.read(64)
        except OSError:
            return  # another host (or another /dev/shm): frames
        if len(data) < 24 or data[:8] != MAGIC:
            return
        self.conn._send([{"op": SHM_HELLO, "id": 0, "tok": data[8:24]}], [])
        pool = self.pool = Pool(prefix, threshold, budget)
        if self.reserved:  # a new session (broker restarted): reserve again, off this thread
            wanted = dict(self.reserved)
            threading.Thread(target=lambda: [pool.reserve(n, k) for n, k in wanted.items()],
                             daemon=True, name="zchannel-shm-reserve").start()

    def reserve(self, nbytes: int, slots: int) -> int:
        """``Channel.reserve_shm``: the slots of ``nbytes`` the pool now holds (0: no shared
        memory with this broker)."""
        check_reserve(nbytes, slots)
        self.reserved[nbytes] = max(slots, self.reserved.get(nbytes, 0))
        pool = self.pool
        return 0 if pool is None else pool.reserve(nbytes, slots)

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()
        self.mapped.clear()

    # -- consumer side -------------------------------------------------------------------------

    def _map(self, name: str) -> Segment:
        with self.lock:
            seg = self.mapped.get(name)
            if seg is not None:
                self.mapped.move_to_end(name)
                return seg
        # Not populated: mapping all of a 400 MiB segment at once costs ~40 ms before the
        # first item is read (the pipeline stands still meanwhile); first reads of each slot
        # fault its pages in a few at a time (fault-around), while the producer works on.
        seg = Segment.open(name)
        with self.lock:
            self.mapped[name] = seg
            while len(self.mapped) > MAPPED_SEGMENTS:
                self.mapped.popitem(last=False)  # views of it keep its mapping alive
        return seg

    def copy_out(self, view: np.ndarray) -> np.ndarray:
        """An owned copy of a slot, in a buffer recycled from copies already garbage collected
        (a fresh allocation would fault in every page of it again)."""
        n = view.nbytes
        free = self.out_cache.get(n)
        owner = free.pop() if free else np.empty(n, dtype=np.uint8)
        streamcopy.copy(owner, view.reshape(-1).view(np.uint8))
        out = np.frombuffer(memoryview(owner), dtype=np.uint8)  # views of it all share `out`
        weakref.finalize(out, self._recycle, owner)
        return out

    def _recycle(self, owner: np.ndarray) -> None:
        free = self.out_cache.setdefault(owner.nbytes, [])
        if len(free) < OUT_CACHE:
            free.append(owner)
        if len(self.out_cache) > 16:  # many sizes: keep only the newest
            for n in list(self.out_cache)[:-16]:
                self.out_cache.pop(n, None)

    def release(self, hold_ids: list[int]) -> None:
        """Tell the broker these slots are no longer used here (no reply; any thread)."""
        conn = self.conn
        if not hold_ids or conn._closing or conn.state == "closed":
            return
        queue = conn._queue
        # No wake-up of the I/O thread when one is due anyway: whoever holds the socket (the
        # I/O thread, or a blocking caller driving it) drains the queue whenever it reads a
        # reply of a request still outstanding, or at the I/O thread's next tick, so the
        # release then rides along with the next message.
        woken = bool(queue) or bool(conn._pending)
        queue.append(({"op": SHM_RELEASE, "id": 0, "nf": 0, "h": hold_ids}, [], None))
        if not woken:
            try:
                conn._wake_io()
            except OSError:
                pass

    def _slot(self, entry: Any) -> np.ndarray:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[3], int)):
            raise ValueError("malformed shared-memory reference")
        name, slot, nbytes, _ = entry
        seg = self._map(name)
        if not (isinstance(slot, int) and 0 <= slot < seg.nslots and isinstance(nbytes, int)
                and 0 <= nbytes <= seg.slot_size):
            raise ValueError("shared-memory reference out of range")
        return seg.view(slot, nbytes)

    def decode(self, entries: Any, frames: list, copy: bool | None) -> Any:
        """Decode an item of a reply whose ``sm`` entries name its slots: ``[segment, slot,
        nbytes, hold]`` (mapped here) or an int (the index of a frame holding the slot's bytes,
        for a consumer that is not on the broker's host)."""
        from zchannel.broker.client import _decode_frames

        if not isinstance(entries, list):
            raise ValueError("malformed shared-memory references")
        holds: list[int] = []
        views: list[np.ndarray] = []
        shm_copy = copy is not False
        try:
            for entry in entries:
                if isinstance(entry, int) and not isinstance(entry, bool):
                    if not 0 < entry < len(frames):
                        raise ValueError(f"shared-memory frame index {entry} out of range")
                    views.append(np.frombuffer(memoryview(frames[entry]), dtype=np.uint8))
                    shm_copy = bool(copy)  # frames: the usual copy semantics
                    continue
                if isinstance(entry, list) and len(entry) == 4 and isinstance(entry[3], int):
                    holds.append(entry[3])
                view = self._slot(entry)
                if copy is False:  # the view keeps the slot until it is garbage collected
                    weakref.finalize(view, self.release, [holds.pop()])
                    views.append(view)
                else:
                    views.append(self.copy_out(view))
                    shm_copy = False  # copied already
            return _decode_frames(frames, copy, views, shm_copy)
        finally:
            self.release(holds)  # copied out (or failed): the slots go back at once


def client_submit(conn: Any, item: Any) -> tuple[bytes, list, list | None]:
    """Encode ``item`` for a put: ``(body, buffers, slot refs or None)``."""
    pool = conn.shm.pool if conn.shm is not None else None
    if pool is None:
        body, buffers = codec.encode(item)
        return body, buffers, None
    body, buffers, refs = codec.encode_shm(item, pool)
    if refs:
        pool.sent(refs)
    return body, buffers, refs or None


def client_undo(conn: Any, refs: list | None) -> None:
    """A put whose slots were taken is not sent after all: free them."""
    pool = conn.shm.pool if refs and conn.shm is not None else None
    if pool is not None:
        pool.undo(refs)


# ---------------------------------------------------------------------------------------------
# Broker side


class Hold:
    """One reference to a slot held in the broker (an item, or a consumer's delivery)."""

    __slots__ = ("owner", "seg", "slot", "nbytes", "counted")

    def __init__(self, owner: ShmBroker, seg: _BrokerSegment, slot: int, nbytes: int,
                 counted: bool) -> None:
        self.owner, self.seg, self.slot, self.nbytes, self.counted = owner, seg, slot, nbytes, counted
        with owner.lock:
            seg.refs[slot] += 1
            if counted:
                owner.bytes_held += nbytes
            else:
                owner.consumer_bytes += nbytes

    def view(self) -> np.ndarray:
        """A view of the slot's bytes that keeps this hold alive while it (or any view derived
        from it, or a zero-copy frame of it) exists."""
        arr = self.seg.seg.view(self.slot, self.nbytes)
        weakref.finalize(arr, _keep, self)
        return arr

    def __del__(self) -> None:
        try:
            self.owner._drop_ref(self)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _keep(obj: Any) -> None:
    """A finalizer whose only job is to hold ``obj`` until it runs."""


class _BrokerSegment:
    __slots__ = ("seg", "owner", "addr", "refs", "orphan", "orphan_at")

    def __init__(self, seg: Segment, owner: Any) -> None:
        self.seg, self.owner, self.refs, self.orphan = seg, owner, [0] * seg.nslots, False
        self.addr = owner.address  # the owner's routing id (kept across its reconnects)
        self.orphan_at = 0.0


class ShmBroker:
    """The broker's shared-memory state (see the module docstring)."""

    def __init__(self, name: str, run_dir: str, threshold: int = DEFAULT_THRESHOLD,
                 pool_bytes: int = DEFAULT_POOL_BYTES, orphan_grace: float = 6.0) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"shm_threshold must be an int >= 0, got {threshold!r}")
        self.threshold = threshold
        self.pool_bytes = pool_bytes
        # A departed owner's segments stay this long after their last release: a client that
        # was expired (not dead) may still send puts it encoded before it registered again.
        self.orphan_grace = orphan_grace
        self.prefix = prefix_for(name, run_dir)
        self.lock = threading.RLock()  # holds may be dropped by pyzmq's zero-copy free thread
        self.segments: dict[str, _BrokerSegment] = {}
        self.verified: set[Any] = set()  # clients that proved they share our /dev/shm
        self.holds: dict[int, tuple[Any, Hold]] = {}  # consumer deliveries by hold id
        self.client_holds: dict[Any, set[int]] = {}
        self._ids = itertools.count(1)
        self._freed_count = itertools.count(1)
        self.bytes_held = 0  # slot bytes referenced by items in the broker
        self.consumer_bytes = 0  # slot bytes delivered and not yet released by consumers
        self.converted = 0  # slots sent as frames to consumers not on this host
        self.slots_in = 0  # slots received in puts
        self.probe: str | None = None
        self._token = b""
        stale = list_segments(self.prefix)  # a previous broker of this channel and run dir died
        for seg_name in stale:
            _unlink(seg_name)
        if stale:
            log.info("removed %d stale shared-memory segment(s) of channel %r", len(stale), name)
        if threshold:
            try:
                self._make_probe()
            except OSError as exc:
                log.warning("shared memory unavailable (%s): large items go as frames", exc)
                self.threshold = 0

    def _make_probe(self) -> None:
        self._token = secrets.token_bytes(16)
        name = f"{self.prefix}probe"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, MAGIC + self._token)
        finally:
            os.close(fd)
        self.probe = name

    @property
    def enabled(self) -> bool:
        return bool(self.threshold) and self.probe is not None

    def hello_info(self) -> dict | None:
        """The ``shm`` field of the hello reply (None: shared memory is off)."""
        if not self.enabled:
            return None
        return {"probe": self.probe, "prefix": self.prefix, "threshold": self.threshold,
                "pool": self.pool_bytes}

    # -- records -------------------------------------------------------------------------------

    def handle(self, client: Any, op: str, rec: dict) -> None:
        """``shm_hi`` (same-host proof) and ``shm_rel`` (slots released) records; no reply."""
        if op == SHM_HELLO:
            token = rec.get("tok")
            if self.enabled and isinstance(token, bytes) and secrets.compare_digest(token, self._token):
                self.verified.add(client)
            return
        ids = rec.get("h")
        if not isinstance(ids, list):
            raise ValueError("shm_rel carries a list of hold ids")
        mine = self.client_holds.get(client)
        if not mine:
            return
        for hid in ids:
            if isinstance(hid, int) and hid in mine:
                mine.discard(hid)
                self.holds.pop(hid, None)  # dropping the Hold frees the slot when it was the last

    def attach_put(self, client: Any, refs: Any, item: Any) -> None:
        """Turn the slot references of a put into ``Hold``s on ``item`` (``item.shm``) and count
        their bytes in ``item.nbytes``.  ``ValueError`` for anything that does not check out."""
        if client not in self.verified:
            raise ValueError("shared-memory slots from a client that did not prove it shares "
                             "the broker's host")
        if not isinstance(refs, list) or not refs or len(refs) > 4096:
            raise ValueError("malformed shared-memory slot list")
        holds = []
        for ref in refs:
            if not (isinstance(ref, list) and len(ref) == 3):
                raise ValueError("malformed shared-memory slot reference")
            name, slot, nbytes = ref
            if not isinstance(name, str) or not name.startswith(self.prefix) or name == self.probe:
                raise ValueError(f"shared-memory segment {name!r} is not one of this channel")
            bseg = self.segments.get(name)
            if bseg is None:
                bseg = self.segments[name] = _BrokerSegment(Segment.open(name), client)
            if bseg.owner is not client and not (bseg.owner is None and bseg.addr == client.address):
                raise ValueError(f"shared-memory segment {name!r} belongs to another client")
            seg = bseg.seg
            if (isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < seg.nslots
                    or isinstance(nbytes, bool) or not isinstance(nbytes, int)
                    or not 0 < nbytes <= seg.slot_size):
                raise ValueError("shared-memory slot reference out of range")
            if seg.states[slot] != USED or bseg.refs[slot]:
                raise ValueError(f"shared-memory slot {slot} of {name!r} is not a fresh slot")
            holds.append(Hold(self, bseg, slot, nbytes, True))
        item.shm = holds
        self.slots_in += len(holds)
        item.nbytes += sum(h.nbytes for h in holds)

    def attach_reply(self, client: Any, item: Any, rec: dict, index: int, count: int,
                     frames: list) -> int:
        """Add the slots of ``item`` (the ``index``-th of ``count`` in reply ``rec``) to the
        reply: references for a same-host client (a consumer hold each), else the slots' bytes
        as zero-copy frames appended to ``frames``.  Returns the number of frames added."""
        import zmq

        sm = rec.get("sm")
        if sm is None:
            sm = rec["sm"] = [None] * count
        entries: list[Any] = []
        if client in self.verified:
            mine = self.client_holds.setdefault(client, set())
            for h in item.shm:
                hid = next(self._ids)
                self.holds[hid] = (client, Hold(self, h.seg, h.slot, h.nbytes, False))
                mine.add(hid)
                entries.append([h.seg.seg.name, h.slot, h.nbytes, hid])
            sm[index] = entries
            return 0
        base = len(item.payload)
        for j, h in enumerate(item.shm):
            frames.append(zmq.Frame(h.view(), copy=False))
            entries.append(base + j)
        self.converted += len(item.shm)
        sm[index] = entries
        return len(entries)

    def decode_item(self, fallback: Any) -> Any:
        """A ``decode_item`` for the core: items with slots decode to views of them (each keeps
        its slot alive while a hook, or a frame made from it, still uses it)."""

        def decode(item: Any) -> Any:
            if not item.shm:
                return fallback(item)
            frames = item.payload
            body = frames[0]
            body = body.buffer if hasattr(body, "buffer") else body
            return codec.decode(body, frames[1:], shm=[h.view() for h in item.shm], shm_copy=False)

        return decode

    # -- lifetime ------------------------------------------------------------------------------

    def _drop_ref(self, hold: Hold) -> None:
        with self.lock:
            bseg = hold.seg
            bseg.refs[hold.slot] -= 1
            if hold.counted:
                self.bytes_held -= hold.nbytes
            else:
                self.consumer_bytes -= hold.nbytes
            if bseg.refs[hold.slot] == 0:
                bseg.seg.freed[hold.slot] = next(self._freed_count)
                bseg.seg.states[hold.slot] = FREE
                if (bseg.orphan and time.monotonic() - bseg.orphan_at >= self.orphan_grace
                        and not any(bseg.refs)):
                    self._remove(bseg)

    def _remove(self, bseg: _BrokerSegment) -> None:
        if self.segments.get(bseg.seg.name) is bseg:
            del self.segments[bseg.seg.name]
        _unlink(bseg.seg.name)

    def client_gone(self, client: Any) -> None:
        """A client left or died: drop the slots it held as a consumer; its own segments go
        once nothing references them any more."""
        self.verified.discard(client)
        for hid in self.client_holds.pop(client, ()):
            self.holds.pop(hid, None)
        now = time.monotonic()
        with self.lock:
            for bseg in list(self.segments.values()):
                if bseg.owner is client:
                    bseg.orphan, bseg.owner, bseg.orphan_at = True, None, now
        self.sweep(now)

    def sweep(self, now: float) -> None:
        """Remove departed owners' segments that nothing references past the grace period."""
        with self.lock:
            for bseg in list(self.segments.values()):
                if (bseg.orphan and now - bseg.orphan_at >= self.orphan_grace
                        and not any(bseg.refs)):
                    self._remove(bseg)

    def wrap_client_gone(self, core_client_gone: Any) -> Any:
        def client_gone(client: Any) -> None:
            core_client_gone(client)
            self.client_gone(client)

        return client_gone

    def stats(self) -> dict:
        with self.lock:
            used = sum(1 for b in self.segments.values() for r in b.refs if r)
            return {
                "enabled": self.enabled,
                "threshold": self.threshold,
                "prefix": self.prefix,
                "segments": len(self.segments),
                "slots_used": used,
                "bytes_held": self.bytes_held,
                "consumer_bytes": self.consumer_bytes,
                "consumer_holds": len(self.holds),
                "clients": len(self.verified),
                "converted": self.converted,
                "slots_in": self.slots_in,
            }

    def close(self) -> None:
        """The broker stops: remove every segment of this channel (clients keep their
        mappings as long as they use them)."""
        self.holds.clear()
        self.client_holds.clear()
        self.segments.clear()
        for seg_name in list_segments(self.prefix):
            _unlink(seg_name)
