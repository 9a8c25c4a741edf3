"""The producer's shared-memory pool (``docs/shm.md``): the segments of one connection (all
handles of a process to one broker), one size class per power of two from the broker's
threshold, created on first use and reused.

A put takes a free slot of its class (the one the broker freed last, the warmest) and copies
the array in; ``lend`` hands out a free slot as an array instead, for a producer that writes its
tensor there itself (``Channel.empty_shm``): putting that array then sends the slot as it is,
with no copy at all.  When every slot of a class at its limit is in use, a put waits for the
broker to free one (backpressure: bounded shared memory per producer), for up to the
connection's heartbeat expiry; after that, or with no shared memory, the pool gives no slot and
the array goes as a frame (the pool never fails a put).  A segment ``/dev/shm`` (or the
process's limits) refused is not the end of shared memory: smaller segments are tried at once,
one as large after a back-off (``SegmentCreator``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import numpy as np
from zchannel.broker.shm.segment import DEFAULT_POOL_BYTES, FREE, MAX_SLOTS, USED, Segment, unlink

log = logging.getLogger("zchannel.shm")

FIRST_SEGMENT_BYTES = 32 << 20  # a size class's first segment (more are added on demand)
# A size class grows by itself to this much (and MAX_SLOTS slots), ``reserve`` beyond: puts
# wait for freed slots beyond it (backpressure), and a stream runs as fast in 8 slots of
# 16 MiB as in 32, without faulting in 384 MiB more (docs/decisions.md, "Bursts of large
# tensors").
CLASS_BYTES = 128 << 20
MIN_CLASS_SLOTS = 4  # a class of very large tensors still holds this many slots
# A put that finds every slot of its class in use (the class at its limit) waits for the
# broker to free one, polling the segments' state bytes (sleeping up to SLOT_POLL_MAX_S between
# looks), for up to its handle's heartbeat expiry (docs/shm.md, "Backpressure").
SLOT_POLL_MAX_S = 0.001
# A wait that ends without a freed slot (a hook holding the items until more come, as the
# trajectory collector does until its step is complete) makes the class's next waits
# SLOT_WAIT_CUT times shorter, down to SLOT_WAIT_MIN_S; a wait that gets a slot doubles them
# again, up to the pool's ``slot_wait``.  So a class whose slots come back (consumers slower
# than the producer) keeps its backpressure, and one whose slots are held does not cost a full
# wait per item (docs/shm.md, "Backpressure").
SLOT_WAIT_CUT = 8
SLOT_WAIT_MIN_S = 0.002
# After a segment could not be created, one of more than half its bytes is tried again only
# RETRY_MIN_S later, a back-off doubled by each further refusal up to RETRY_MAX_S (a failed
# attempt may zero what /dev/shm has left before it fails), and reset once one that large is
# made; smaller segments are tried at once (docs/shm.md, "When /dev/shm is full").
RETRY_MIN_S = 1.0
RETRY_MAX_S = 16.0


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


class SegmentCreator:
    """Creates a pool's segments and keeps the rule for those it could not create: the
    smallest refused (``refused`` bytes of slots, 0: none) since one that large was last made,
    and when segments above half of it may be tried again (``retry_at``).  Thread-safe."""

    __slots__ = ("lock", "refused", "retry_at", "retry_s")

    def __init__(self) -> None:
        self.lock = threading.Lock()  # (taken alone, or inside the pool's lock)
        self.refused = 0
        self.retry_at = 0.0
        self.retry_s = RETRY_MIN_S  # the next back-off

    def allowed(self, size: int) -> int:
        """The most slots of ``size`` bytes a new segment may have now (``MAX_SLOTS``: any)."""
        with self.lock:
            if not self.refused or time.monotonic() >= self.retry_at:
                return MAX_SLOTS
            return self.refused // 2 // size

    def create(self, prefix: str, size: int, nslots: int) -> Segment | None:
        """A new segment of ``nslots`` slots of ``size`` bytes; None (logged) when it cannot
        be created."""
        nbytes = size * nslots
        try:
            seg = Segment.create(prefix, size, nslots)
        except OSError as exc:
            first, retry_s = self.refuse(nbytes)
            (log.warning if first else log.debug)(
                "cannot create a shared-memory segment of %d MiB (%s): items that find no free "
                "slot go as frames; smaller segments are tried at once, one as large in %.0fs",
                nbytes >> 20, exc, retry_s)
            return None
        if self.made(nbytes):
            log.info("shared-memory segments can be made again (one of %d MiB was)",
                     nbytes >> 20)
        return seg

    def refuse(self, nbytes: int) -> tuple[bool, float]:
        """A segment of ``nbytes`` bytes of slots could not be created: whether it is the
        first refusal since segments could last be made (worth a warning), and the seconds
        until one as large is tried again."""
        now = time.monotonic()
        with self.lock:
            first = not self.refused
            if self.refused and now < self.retry_at:  # a smaller one during the back-off
                self.refused = min(self.refused, nbytes)
            else:
                self.refused = nbytes
                self.retry_at = now + self.retry_s
                self.retry_s = min(2 * self.retry_s, RETRY_MAX_S)
            return first, self.retry_at - now

    def made(self, nbytes: int) -> bool:
        """A segment of ``nbytes`` bytes of slots was created; whether that ends the
        refusals (one at least as large as the smallest refused: worth saying)."""
        with self.lock:
            if not self.refused or nbytes < self.refused:
                return False
            self.refused, self.retry_s = 0, RETRY_MIN_S
            return True


class Pool:
    """The segments of one producer connection (see the module docstring).  Thread-safe.

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
        self.lent: dict[int, list] = {}  # address of a lent slot -> [segment, slot, sent]
        self.pins: dict[str, np.ndarray] = {}  # segment -> its slots whose lent array exists
        self.fallbacks = 0
        self.stalled: set[int] = set()  # classes whose last wait for a free slot timed out
        self.wait_s: dict[int, float] = {}  # size class -> its waits' length (``_wait_free``)
        self.creator = SegmentCreator()  # makes segments; backs off after refusals
        self.closed = False

    def _cap(self, size: int) -> int:
        """The most slots a size class may hold: ``CLASS_BYTES`` worth (at least
        ``MIN_CLASS_SLOTS``), or what ``reserve`` asked for; at most ``MAX_SLOTS``."""
        return min(MAX_SLOTS, max(MIN_CLASS_SLOTS, CLASS_BYTES // size,
                                  self.reserved.get(size, 0)))

    def _reserve(self, size: int, want: int | None = None, most: int | None = None) -> int:
        """Slots of the class's next segment, reserving their bytes (under the lock; 0: none
        allowed): doubling the class (at least the first segment's size), or up to ``want``;
        at most ``most``, by default what ``creator`` allows now."""
        have = sum(s.nslots for s in self.classes[size])
        grow = max(have, 2, FIRST_SEGMENT_BYTES // size) if want is None else want - have
        nslots = min(grow, self._cap(size) - have, (self.budget - self.total) // size,
                     self.creator.allowed(size) if most is None else most)
        if nslots < 1 or self.closed:
            return 0
        self.total += size * nslots
        return nslots

    def _make(self, size: int, nslots: int) -> Segment | None:
        """Create a segment (outside the lock) and add it to its class (None: refused)."""
        seg = self.creator.create(self.prefix, size, nslots)
        with self.lock:
            if seg is None:
                self.total -= size * nslots
            elif self.closed:  # closed meanwhile: nobody will use (or announce) it
                unlink(seg.name)
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
            free_now = seg.states == FREE
            pins = self.pins.get(seg.name) if self.pins else None
            if pins is not None:
                free_now &= ~pins  # a lent array still uses it
            idx = np.flatnonzero(free_now)
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
        by ``MAX_SLOTS``, the class and pool byte limits, and by ``/dev/shm``: a refused
        segment is asked again with half the slots, whatever the puts' back-off)."""
        if nbytes < self.threshold:
            return 0
        size = _size_class(nbytes, self.threshold)
        with self.lock:
            self.reserved[size] = max(slots, self.reserved.get(size, 0))
        most = MAX_SLOTS
        while True:
            with self.lock:
                segs = self.classes.setdefault(size, [])
                pending = self.growing.get(size)
                nslots = 0 if pending is not None else self._reserve(size, slots, most)
                if pending is None:
                    if not nslots:  # enough already, or nothing more allowed
                        return sum(s.nslots for s in segs)
                    pending = self.growing[size] = threading.Event()
            if not nslots:
                pending.wait()  # a segment being made: then look again
            elif self._make(size, nslots) is None:  # refused: ask for half as many
                most = nslots // 2

    def _acquire(self, size: int, wait: float | None) -> tuple[Segment, int] | None:
        """A free slot of class ``size``, marked USED: taken, or after waiting for (or making)
        a segment, or for the broker to free one for up to the class's wait (``slot_wait`` at
        first, shorter after waits that got nothing: ``SLOT_WAIT_CUT``) or ``wait`` seconds if
        shorter; None if none came, at once when the class has no slot to wait for."""
        for _ in range(3):  # take; or wait for (or make) a segment and take again
            with self.lock:
                self.classes.setdefault(size, [])
                got = self._take(size)
                if got is not None:
                    return got
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
        if size in self.stalled or (wait is not None and wait <= 0):
            return None  # (no wait: nothing to learn from)
        if not self.classes[size]:
            return None  # the class has no slot (pool budget, /dev/shm): none can be freed
        budget = self.wait_s.get(size, self.slot_wait)
        got = self._wait_free(size, budget if wait is None else min(wait, budget))
        if got is not None:
            self.wait_s[size] = min(self.slot_wait, 2 * budget)
        elif wait is None or wait >= budget:
            self.wait_s[size] = max(SLOT_WAIT_MIN_S, budget / SLOT_WAIT_CUT)
        return got

    def __call__(self, data: Any, nbytes: int, wait: float | None = None) -> list | None:
        """The slot reference ``[segment, slot, nbytes]`` of ``data`` (a C-contiguous array or
        tensor bytes): the slot itself when ``data`` starts at a lent slot not sent yet
        (``lend``), else a free slot it is copied into.  None: below the threshold, or no slot
        free within ``wait`` seconds (by default ``slot_wait``)."""
        if nbytes < self.threshold:
            return None
        src = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        if self.lent:
            ref = self._send_lent(src.ctypes.data, nbytes)
            if ref is not None:
                return ref  # written in place by its producer: nothing to copy
        got = self._acquire(_size_class(nbytes, self.threshold), wait)
        if got is None:
            with self.lock:
                self.fallbacks += 1
            return None
        seg, slot = got
        np.copyto(seg.view(slot, nbytes), src.reshape(-1).view(np.uint8))
        return [seg.name, slot, nbytes]

    # -- slots lent to their producer (Channel.empty_shm) ----------------------------------------

    def lend(self, nbytes: int, wait: float | None = None) -> np.ndarray | None:
        """A free slot as a writable uint8 array of ``nbytes`` bytes, for a producer to write
        an item into (None: below the threshold, or no slot free within ``wait`` seconds).

        The slot stays out of the pool while the array, or anything made from it, exists.
        The first put of the array (or of any array starting at its first byte) sends the slot
        itself; later puts of it copy, as for any array.  Dropped without being put, the slot
        goes back to the pool."""
        if nbytes < self.threshold:
            return None
        got = self._acquire(_size_class(nbytes, self.threshold), wait)
        if got is None:
            return None
        seg, slot = got
        view = seg.view(slot, nbytes)
        address = view.ctypes.data
        with self.lock:
            pins = self.pins.get(seg.name)
            if pins is None:
                pins = self.pins[seg.name] = np.zeros(seg.nslots, dtype=bool)
            pins[slot] = True
            self.lent[address] = [seg, slot, False]
        weakref.finalize(view, self._unlend, address, seg, slot)
        return view

    def _send_lent(self, address: int, nbytes: int) -> list | None:
        """The reference of the lent slot at ``address`` if it was not sent yet (marking it
        sent), else None."""
        with self.lock:
            entry = self.lent.get(address)
            if entry is None or entry[2]:
                return None
            seg, slot, _ = entry
            name = seg.name
            if nbytes > seg.slot_size or self.by_name.get(name) is not seg:
                return None  # a slot of a previous session's pool: copy
            entry[2] = True
        return [name, slot, nbytes]

    def _unlend(self, address: int, seg: Segment, slot: int) -> None:
        """A lent array is gone: its slot may be taken again; one never sent is free."""
        with self.lock:
            entry = self.lent.pop(address, None)
            pins = self.pins.get(seg.name)
            if pins is not None:
                pins[slot] = False
            if entry is not None and not entry[2] and self.by_name.get(seg.name) is seg:
                seg.states[slot] = FREE

    def _wait_free(self, size: int, wait: float) -> tuple[Segment, int] | None:
        """Every slot of a full class is in use: wait for the broker to free one (backpressure
        on a producer faster than its consumers) for up to ``wait`` seconds.  None when none
        came back in that time (nothing consumes: the item goes as a frame, and so do the
        following ones, without waiting, until a slot is free again)."""
        if size in self.stalled or wait <= 0:
            return None
        deadline = time.monotonic() + wait
        pause = 50e-6
        segs = self.classes[size]
        while not self.closed:
            time.sleep(pause)
            pause = min(2 * pause, SLOT_POLL_MAX_S)
            # most looks find every slot still in use: the state bytes say so without the
            # lock and the numpy scan of _take (the list only grows; any() reads it as it is)
            if not any(seg.has_free() for seg in segs) and time.monotonic() < deadline:
                continue
            with self.lock:
                if self.closed:
                    break
                got = self._take(size)
                if got is not None:
                    return got
                if time.monotonic() >= deadline:
                    self.stalled.add(size)
                    break
        return None

    def undo(self, refs: list) -> None:
        """Free slots taken for an item that is not sent (the broker never saw them); a lent
        slot whose array still exists is lent again, not sent."""
        with self.lock:
            for name, slot, _ in refs:
                seg = self.by_name.get(name)
                if seg is None:
                    continue
                pins = self.pins.get(name)
                if pins is None or not pins[slot]:
                    seg.states[slot] = FREE
                    continue
                for entry in self.lent.values():
                    if entry[0] is seg and entry[1] == slot:
                        entry[2] = False

    def sent(self, refs: list) -> None:
        for ref in refs:
            self.announced.add(ref[0])

    def after_fork(self) -> None:
        """In a forked child: the lent slots are the parent's (their finalizers free nothing)."""
        # a parent's thread may have held either lock at the fork
        self.lock, self.creator.lock = threading.Lock(), threading.Lock()
        self.lent.clear()

    def close(self) -> None:
        """Unlink the segments the broker never heard of (it removes the others)."""
        with self.lock:
            self.closed = True  # a segment still being made unlinks itself
        for name in self.by_name:
            if name not in self.announced:
                unlink(name)
        self.classes.clear()
        self.by_name.clear()
