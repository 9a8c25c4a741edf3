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
  threshold), created on first use and reused; a call copies an array into a free slot.  When
  every slot of a class at its limit is in use, the put waits for the broker to free one
  (backpressure: bounded shared memory per producer), for up to the handle's heartbeat expiry;
  after that, or with no shared memory, it returns None and the array goes as a frame (the pool
  never fails a put).
- ``ShmClient`` (one per ``Connection``): proves same-host at hello (reads the token of the
  broker's probe segment and sends it back), owns the ``Pool``, maps the segments named in
  replies, decodes items whose slots it receives and sends ``shm_rel`` records for them.
- ``ShmBroker`` (in the broker, ``broker/shm_broker.py``): the probe, the segments it mapped, ``Hold`` references (one per
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
from zchannel.broker import codec

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
# A size class grows by itself to this much (and MAX_SLOTS slots), ``reserve`` beyond: puts
# wait for freed slots beyond it (backpressure), and a stream runs as fast in 8 slots of
# 16 MiB as in 32, without faulting in 384 MiB more (docs/decisions.md, "Bursts of large
# tensors").
CLASS_BYTES = 128 << 20
MIN_CLASS_SLOTS = 4  # a class of very large tensors still holds this many slots
OUT_CACHE = 4  # copy-out buffers of one size a consumer keeps for reuse (pages stay mapped)
MAPPED_SEGMENTS = 64  # a consumer keeps at most this many segments mapped (views keep theirs)
# A put that finds every slot of its class in use (the class at its limit) waits for the
# broker to free one, polling the segments' state bytes (sleeping up to SLOT_POLL_MAX_S between
# looks), for up to its handle's heartbeat expiry (docs/shm.md, "Backpressure").
SLOT_POLL_MAX_S = 0.001
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
    to ``_cap`` slots per class and ``budget`` bytes per pool.  The next segment is made in
    a background thread as soon as half of a class's slots are in use, so that a producer
    filling its pipeline does not stall on creating (and faulting in) hundreds of MiB; a put
    that finds every slot in use waits for a segment being made, or makes one itself, or, with
    the class at its limit, waits for the broker to free a slot (``_wait_free``).
    """

    def __init__(self, prefix: str, threshold: int, budget: int = DEFAULT_POOL_BYTES,
                 slot_wait: float = 3.0) -> None:
        self.prefix, self.threshold, self.budget = prefix, threshold, budget
        self.slot_wait = slot_wait  # the longest a put waits for a free slot (_wait_free)
        self.lock = threading.Lock()
        self.classes: dict[int, list[Segment]] = {}  # size class -> its segments
        self.by_name: dict[str, Segment] = {}
        self.reserved: dict[int, int] = {}  # size class -> slots asked for with reserve()
        self.growing: dict[int, threading.Event] = {}  # size class -> set when its growth ended
        self.total = 0  # bytes of the segments made or being made
        self.announced: set[str] = set()  # segments named in a put sent to the broker
        self.fallbacks = 0
        self.stalled: set[int] = set()  # classes whose last wait for a free slot timed out
        self.failed = False  # a segment could not be created: no more attempts
        self.closed = False

    def _cap(self, size: int) -> int:
        """The most slots a size class may hold: ``CLASS_BYTES`` worth (at least
        ``MIN_CLASS_SLOTS``), or what ``reserve`` asked for; at most ``MAX_SLOTS``."""
        return min(MAX_SLOTS, max(MIN_CLASS_SLOTS, CLASS_BYTES // size,
                                  self.reserved.get(size, 0)))

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
        self.stalled.discard(size)
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

    def __call__(self, data: Any, nbytes: int, wait: float | None = None) -> list | None:
        """Copy ``data`` (a C-contiguous array or tensor bytes) into a free slot: the slot
        reference ``[segment, slot, nbytes]``, or None (below the threshold, or no slot free
        within ``wait`` seconds, by default ``slot_wait``)."""
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
            got = self._wait_free(size, self.slot_wait if wait is None else wait)
        if got is None:
            with self.lock:
                self.fallbacks += 1
            return None
        seg, slot = got
        dst = seg.view(slot, nbytes)
        src = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        np.copyto(dst, src.reshape(-1).view(np.uint8))
        return [seg.name, slot, nbytes]

    def _wait_free(self, size: int, wait: float) -> tuple[Segment, int] | None:
        """Every slot of a full class is in use: wait for the broker to free one (backpressure
        on a producer faster than its consumers) for up to ``wait`` seconds.  None when none
        came back in that time (nothing consumes: the item goes as a frame, and so do the
        following ones, without waiting, until a slot is free again)."""
        if size in self.stalled or wait <= 0:
            return None
        deadline = time.monotonic() + wait
        pause = 50e-6
        while not self.closed and not self.failed:
            time.sleep(pause)
            with self.lock:
                if self.closed:
                    break
                got = self._take(size)
                if got is not None:
                    return got
                if time.monotonic() >= deadline:
                    self.stalled.add(size)
                    break
            pause = min(2 * pause, SLOT_POLL_MAX_S)
        return None

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
        pool = self.pool = Pool(prefix, threshold, budget, self.conn.hb * self.conn.liveness)
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
        np.copyto(owner, view.reshape(-1).view(np.uint8))
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


class _Alloc:
    """A pool whose puts wait at most ``wait`` seconds for a free slot (``Pool.__call__``)."""

    __slots__ = ("pool", "wait")

    def __init__(self, pool: Pool, wait: float | None) -> None:
        self.pool, self.wait = pool, wait

    def __call__(self, data: Any, nbytes: int) -> list | None:
        return self.pool(data, nbytes, self.wait)

    def undo(self, refs: list) -> None:
        self.pool.undo(refs)


def client_submit(conn: Any, item: Any, rec: dict | None = None) -> tuple[bytes, list, list | None]:
    """Encode ``item`` for a put: ``(body, buffers, slot refs or None)``.  A put (``rec``) with
    ``nw`` never waits for a free slot, one with a timeout ``t`` at most that long."""
    pool = conn.shm.pool if conn.shm is not None else None
    if pool is None:
        body, buffers = codec.encode(item)
        return body, buffers, None
    alloc: Any = pool
    if rec is not None and (rec.get("nw") or rec.get("t") is not None):
        alloc = _Alloc(pool, 0.0 if rec.get("nw") else min(pool.slot_wait, rec["t"]))
    body, buffers, refs = codec.encode_shm(item, alloc)
    if refs:
        pool.sent(refs)
    return body, buffers, refs or None


def client_undo(conn: Any, refs: list | None) -> None:
    """A put whose slots were taken is not sent after all: free them."""
    pool = conn.shm.pool if refs and conn.shm is not None else None
    if pool is not None:
        pool.undo(refs)
