"""The client's side of the same-host shared-memory path (``docs/shm.md``), one ``ShmClient``
per ``Connection``: it proves same-host at hello (reads the token of the broker's probe segment
and sends it back), owns the producer's ``Pool``, lends slots to producers that write their
tensors in place (``Channel.empty_shm``), maps the segments named in replies, decodes items
whose slots it receives (copies out into ``CopyOuts``' recycled buffers) and sends ``shm_rel``
records for them (``Releases``: none is lost while the broker re-registers this client).
``client_submit`` encodes a put through the pool.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from zchannel.broker.host.environ import env_flag
from zchannel.broker.host.procs import pid_namespace
from zchannel.broker.shm.pool import Pool, check_reserve
from zchannel.broker.shm.segment import (
    DEFAULT_POOL_BYTES,
    MAGIC,
    NAME_RE,
    PREFIX_RE,
    SHM_DIR,
    Segment,
)
from zchannel.broker.wire import arrays, codec
from zchannel.broker.wire.argchecks import check_switch
from zchannel.broker.wire.protocol import HelloInfo, Put, ShmHello, ShmRelease, shm_offer

# Copy-out buffers a consumer keeps for reuse (their pages stay mapped: ``CopyOuts``): at most
# OUT_CACHE of one size, of the OUT_CACHE_SIZES sizes recycled last, and OUT_CACHE_BYTES in all
# per connection (a larger buffer is freed with its copy).
OUT_CACHE = 4
OUT_CACHE_SIZES = 16
OUT_CACHE_BYTES = 256 << 20
# Hold ids per ``shm_rel`` record when releases kept back go out together (``Releases.resume``):
# a record far below the broker's header limit (``MAX_HEADER_BYTES``, 1 MiB).
RELEASE_IDS_PER_RECORD = 4096
# The release of slots this large or larger goes at once (the I/O thread woken for it): a
# size class of them holds few slots (``pool.CLASS_BYTES``: 32 of 4 MiB, 8 of 16 MiB), and a
# producer whose pool is full waits for each; copying one out takes long enough that a
# message of its own costs little.  Smaller slots' releases ride with the consumer's next
# message (within ``LAZY_S``): a message and a broker turn less per item (docs/shm.md).
RELEASE_AT_ONCE_BYTES = 4 << 20
MAPPED_SEGMENTS = 64  # a consumer keeps at most this many segments mapped (views keep theirs)
# A consumer looks for cached segments the broker has unlinked (their producer left) at most
# this often: at a mapping of a segment not cached (UNLINKED_MISS_S) or of one cached
# (UNLINKED_HIT_S).  A look costs one ``stat`` per cached segment, never one per item.
UNLINKED_MISS_S = 0.1
UNLINKED_HIT_S = 1.0


def env_enabled() -> bool:
    """``ZCHANNEL_SHM=0|off|false|no`` turns the shared-memory path off in this process
    (``1|on|true|yes`` or unset: on; any other value: ``ValueError`` naming the variable)."""
    return env_flag("ZCHANNEL_SHM", True)


env_enabled()  # a malformed ZCHANNEL_SHM fails at import, as connection/tuning.py's settings do


def check_shm_switch(shm: Any) -> bool | None:
    """A handle's ``shm=``: None (on unless ``ZCHANNEL_SHM=0``), True or False, else
    ``TypeError`` naming it (a ``"false"`` read from a config file is truthy: taken as it is, it
    would switch shared memory on)."""
    return check_switch(shm, "shm", " (None: on unless ZCHANNEL_SHM=0)")


class ShmClient:
    """The shared-memory side of one ``Connection`` (see the module docstring)."""

    def __init__(self, conn: Any, enabled: bool | None = None) -> None:
        self.conn = conn
        enabled = check_shm_switch(enabled)
        self.enabled = env_enabled() if enabled is None else enabled
        self.pool: Pool | None = None  # set while same-host is proven for the current hello
        self.mapped: OrderedDict[str, Segment] = OrderedDict()
        self.lock = threading.Lock()
        self.unlinked_at = 0.0  # when ``_drop_unlinked`` last looked (``time.monotonic``)
        self.copies = CopyOuts()
        self.releases = Releases(conn)
        self.reserved: dict[int, int] = {}  # nbytes -> slots asked for with reserve()
        # the completed gets whose replies hold slots (``Work``s, converted by their first
        # reader): read before this connection says bye, when the broker gives those slots
        # back to their producers (``read_unread``); a result not read by then fails
        self.unread: weakref.WeakSet[Any] = weakref.WeakSet()
        self.let_go = False

    # -- hello (I/O thread) --------------------------------------------------------------------

    @property
    def out_cache(self) -> OrderedDict[int, list[np.ndarray]]:
        """The free copy-out buffers by size (``CopyOuts``)."""
        return self.copies.free

    def end_session(self) -> None:
        """The broker no longer knows this connection (it expired it, or it restarted): puts
        go as frames until a new hello proves same-host again (a put with slots that reached
        the broker before that proof would be refused), and releases wait for that proof
        (``Releases``)."""
        self.releases.end_session()
        old, self.pool = self.pool, None
        if old is not None:
            old.close()

    def stale(self, refs: list) -> bool:
        """Whether the slots ``refs`` of a put come from the pool of an earlier session (the
        broker was restarted or expired this connection since they were taken): the broker
        of this session would refuse them."""
        pool = self.pool
        return pool is None or any(ref[0] not in pool.by_name for ref in refs)

    def on_hello(self, info: HelloInfo) -> None:
        """A broker answered ``hello``: drop the pool of the previous session, and if the broker
        offers shared memory, prove same-host by echoing its probe's token; then send the
        releases kept back since the previous session ended (``Releases.resume``)."""
        self.end_session()
        proven = False
        try:
            proven = self._prove(info)
        finally:  # whatever happened, releases are no longer kept back
            self.releases.resume(proven)

    def _prove(self, info: HelloInfo) -> bool:
        """Prove same-host to the broker that answered ``hello`` with ``info`` (``shm_hi``) and
        make this session's pool; False when there is no shared memory with it."""
        offer = shm_offer(info.shm)
        if not self.enabled or offer is None:
            return False
        probe, prefix = offer.probe, offer.prefix
        # a broker that names no pool budget means the default; a budget of 0 turns it off
        threshold = offer.threshold
        budget = DEFAULT_POOL_BYTES if offer.pool is None else offer.pool
        if budget == 0:
            return False  # this client's puts go as frames (as with shm=False)
        if not (isinstance(prefix, str) and PREFIX_RE.match(prefix) and isinstance(threshold, int)
                and threshold > 0 and isinstance(budget, int) and isinstance(probe, str)
                and NAME_RE.match(probe) and probe.startswith(prefix)):
            return False
        try:
            with open(os.path.join(SHM_DIR, probe), "rb") as f:
                data = f.read(64)
        except OSError:
            return False  # another host (or another /dev/shm): frames
        if len(data) < 24 or data[:8] != MAGIC:
            return False
        self.conn.send_unanswered(ShmHello(id=0, token=data[8:24], pid=os.getpid(),
                                              pid_ns=pid_namespace()), now=True)
        pool = self.pool = Pool(prefix, threshold, budget, self.conn.hb * self.conn.liveness)
        if self.reserved:  # a new session (broker restarted): reserve again, off this thread
            wanted = dict(self.reserved)
            threading.Thread(target=lambda: [pool.reserve(n, k) for n, k in wanted.items()],
                             daemon=True, name="zchannel-shm-reserve").start()
        return True

    def reserve(self, nbytes: int, slots: int) -> int:
        """``Channel.reserve_shm``: the slots of ``nbytes`` the pool now holds (0: no shared
        memory with this broker)."""
        check_reserve(nbytes, slots)
        self.reserved[nbytes] = max(slots, self.reserved.get(nbytes, 0))
        pool = self.pool
        return 0 if pool is None else pool.reserve(nbytes, slots)

    def empty(self, shape: Any, dtype: Any) -> Any:
        """``Channel.empty_shm``: ``empty_array`` in this connection's pool."""
        return empty_array(self.pool, shape, dtype)

    def read_unread(self) -> None:
        """Before the connection says bye (or closes): read every completed get whose reply
        holds slots and that nobody read yet (its item copied out, or its error kept in it).
        From here on a result read for the first time fails: its slots are the broker's
        again, and another item may be in them."""
        read: set[int] = set()
        while not self.let_go:
            with self.lock:  # a caller reading the link may add one meanwhile
                works = [w for w in self.unread if id(w) not in read]
                if not works:
                    self.let_go = True
                    return
            for work in works:
                read.add(id(work))
                try:
                    work.result()
                except Exception:  # the error stays with the Work, for its reader
                    pass

    def close(self) -> None:
        """The connection closed: its pool, mappings, copy-out buffers and releases go."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()
        self.mapped.clear()
        self.copies.close()
        self.releases.close()

    def after_fork(self) -> None:
        """In a forked child (``Connection.after_fork``): this connection is the parent's, and
        so are its slots.  The pool's lent arrays stay the parent's (``Pool.after_fork``: a
        child dropping its copy of one, or exiting, frees nothing), views the child drops
        release nothing (``Releases.after_fork``), and the locks are new (a parent's thread
        may have held one at the fork)."""
        self.lock = threading.Lock()
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.after_fork()
        self.releases.after_fork()
        self.copies.after_fork()

    # -- consumer side -------------------------------------------------------------------------

    def _map(self, name: str) -> Segment:
        now = time.monotonic()
        with self.lock:
            seg = self.mapped.get(name)
            if seg is not None:
                self.mapped.move_to_end(name)
        if now - self.unlinked_at >= (UNLINKED_MISS_S if seg is None else UNLINKED_HIT_S):
            self.unlinked_at = now
            self._drop_unlinked()
        if seg is not None:
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

    def _drop_unlinked(self) -> None:
        """Forget the cached segments whose file the broker unlinked (their producer left and
        nothing held their slots): the cache alone would keep their memory allocated in
        ``/dev/shm`` until this connection closes.  Nothing is unmapped explicitly: a
        ``copy=False`` view of a slot holds the segment's ``mmap`` (a buffer export), so the
        mapping goes when the last view of it is collected, or at once when none exists."""
        with self.lock:
            cached = list(self.mapped.values())
        gone = [seg for seg in cached if seg.unlinked()]
        if gone:
            with self.lock:
                for seg in gone:
                    if self.mapped.get(seg.name) is seg:
                        del self.mapped[seg.name]

    def copy_out(self, view: np.ndarray) -> np.ndarray:
        """An owned copy of a slot (``CopyOuts.copy``)."""
        return self.copies.copy(view)

    def release(self, hold_ids: list[int], at_once: bool = True) -> None:
        """Tell the broker these slots are no longer used here (no reply; any thread):
        ``at_once``, the I/O thread woken for it (the producer of the slots may be waiting
        for them, its pool at its limit, while this consumer works on what it got), else
        with this connection's next message, which goes within ``LAZY_S``
        (``RequestQueue.send_unanswered``).  Kept until the broker is known to have it
        (``Releases``)."""
        if hold_ids:
            self.releases.send(hold_ids, at_once)

    def _slot(self, entry: Any) -> np.ndarray:
        if hold_id(entry) is None:
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
        if not isinstance(entries, list):
            raise ValueError("malformed shared-memory references")
        holds: list[int] = []
        views: list[np.ndarray] = []
        largest = 0  # bytes of the largest slot copied out here
        shm_copy = copy is not False
        try:
            for entry in entries:
                if isinstance(entry, int) and not isinstance(entry, bool):
                    if not 0 < entry < len(frames):
                        raise ValueError(f"shared-memory frame index {entry} out of range")
                    views.append(np.frombuffer(memoryview(frames[entry]), dtype=np.uint8))
                    shm_copy = bool(copy)  # frames: the usual copy semantics
                    continue
                hid = hold_id(entry)
                if hid is not None:
                    holds.append(hid)
                view = self._slot(entry)
                if copy is False:  # the view keeps the slot until it is garbage collected
                    weakref.finalize(view, self.release, [holds.pop()])
                    views.append(view)
                else:
                    views.append(self.copy_out(view))
                    largest = max(largest, view.nbytes)
                    shm_copy = False  # copied already
            return codec.decode_frames(frames, copy, views, shm_copy)
        finally:
            # copied out (or failed): the slots go back now, large ones at once
            self.release(holds, largest >= RELEASE_AT_ONCE_BYTES)


class Releases:
    """The ``shm_rel`` records of one connection, kept until the broker is known to have them.

    A broker that expired this client while its process still runs (stopped past the heartbeat
    expiry: SIGSTOP, a debugger, swapping) keeps the holds of its views for that process and
    makes them this client's again only when it proves the same host again (``shm_hi``,
    ``shm/holds.py``).  A release that reaches the broker in between is dropped there: one sent
    before this client learnt it expired (the broker no longer knows it), or after its new
    hello but before ``shm_hi`` (its new session holds nothing yet).  The slots would stay held
    until the process ends.  So a release is kept here until it is known to have arrived in a
    live session, and one that may not have is sent again once the next session is proven:

    - each release sent is kept with a *mark*: an id drawn from the connection's request ids
      (``ids``, which the connection sets) after the record was queued, so that no request
      takes it.  Requests are queued as they draw their ids, and go out in queue order: one
      with a larger id went out after the release, and the broker answering it (rather than
      telling this client it expired) handled the release before it, from this live client.
      So the reply to request ``rid`` settles every release marked below ``rid``
      (``answered``);
    - when the session ends (``end_session``: the broker expired this client, the link broke, a
      new hello was answered), the releases not settled yet are kept back, and so is every
      release made from then on, until the next session has sent ``shm_hi``: they go right after
      it (``resume``).  One the broker did handle goes twice: the broker ignores a hold id it
      does not hold, and hold ids are never used twice.

    The client holding them (rather than the broker remembering releases of ids a client does
    not hold) is what covers both gaps: a release sent while the broker no longer knew this
    client never reached anything that could remember it."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.ids: Iterator[int] = iter(())  # the connection's request ids (it sets them)
        # finalizers release (any thread, also while this thread holds the lock: a collection)
        self.lock = threading.RLock()
        self.sent: deque[tuple[int, list[int]]] = deque()  # (mark, hold ids), not yet settled
        self.held: list[int] | None = None  # hold ids kept back until shm_hi (None: sent now)
        self.ended = False  # the connection closed, or this is a forked child's copy

    def send(self, hold_ids: list[int], at_once: bool) -> None:
        """Send a release of ``hold_ids`` (``ShmClient.release``), or keep it back while no
        session is proven."""
        with self.lock:
            if self.ended:
                return
            if self.held is not None:
                self.held.extend(hold_ids)
                return
            self.conn.send_unanswered(ShmRelease(id=0, holds=hold_ids), soon=at_once)
            self.sent.append((next(self.ids), hold_ids))

    def answered(self, rid: int) -> None:
        """The broker answered request ``rid``: the releases marked below it reached it."""
        sent = self.sent
        if sent and sent[0][0] < rid:
            with self.lock:
                while sent and sent[0][0] < rid:
                    sent.popleft()

    def answered_items(self, items: list) -> None:
        """An ``items`` record answered the gets its entries ``(rid, body, lease)`` name: the
        releases marked below the last of them reached the broker (``answered``)."""
        if self.sent:
            self.answered(max(entry[0] for entry in items))

    def end_session(self) -> None:
        """The session ended: what is not settled, and every release from now on, waits for
        the next session's ``shm_hi`` (``resume``)."""
        with self.lock:
            held = self.held if self.held is not None else []
            for _, hold_ids in self.sent:
                held.extend(hold_ids)
            self.sent.clear()
            self.held = held

    def resume(self, proven: bool) -> None:
        """The hello was answered and, if ``proven``, ``shm_hi`` sent (on the socket, by this
        thread): send the releases kept back, right behind it.  Not proven, the broker makes
        no holds this client's again: they are dropped."""
        with self.lock:
            held, self.held = self.held, None
            if not proven or not held or self.ended:
                return
            for start in range(0, len(held), RELEASE_IDS_PER_RECORD):
                chunk = held[start : start + RELEASE_IDS_PER_RECORD]
                self.conn.send_unanswered(ShmRelease(id=0, holds=chunk), now=True)
                self.sent.append((next(self.ids), chunk))

    def close(self) -> None:
        """The connection closed (its bye drops this client's holds): nothing more is sent."""
        with self.lock:
            self.ended = True
            self.sent.clear()
            self.held = None

    def after_fork(self) -> None:
        """In a forked child: the releases are the parent's; the child's send none."""
        self.lock = threading.RLock()
        self.ended = True
        self.sent.clear()
        self.held = None


class CopyOuts:
    """The owned copies of slots a consumer makes (``copy=None``/``True``), in buffers recycled
    from copies already garbage collected: a fresh buffer faults in every page again, which
    costs several times the copy itself (``docs/decisions.md``).  Kept for reuse: at most
    ``OUT_CACHE`` free buffers of one size, of the ``OUT_CACHE_SIZES`` sizes recycled last, and
    ``OUT_CACHE_BYTES`` in all (the sizes recycled longest ago give theirs up first); a larger
    buffer, or one past these limits, is freed with its copy.  ``close`` frees them all."""

    def __init__(self) -> None:
        # copies are recycled by finalizers: any thread, also inside a copy on this one
        self.lock = threading.RLock()
        self.free: OrderedDict[int, list[np.ndarray]] = OrderedDict()  # size -> free buffers
        self.nbytes = 0  # bytes of the free buffers
        self.closed = False

    def copy(self, view: np.ndarray) -> np.ndarray:
        """An owned copy of ``view`` (a slot's bytes), in a recycled buffer if one is free."""
        n = view.nbytes
        with self.lock:
            free = self.free.get(n)
            owner = free.pop() if free else None
            if owner is not None:
                self.nbytes -= n
        if owner is None:
            owner = np.empty(n, dtype=np.uint8)
        np.copyto(owner, view.reshape(-1).view(np.uint8))
        out = np.frombuffer(owner.data, dtype=np.uint8)  # views of it all share `out`
        weakref.finalize(out, self._recycle, owner)
        return out

    def _recycle(self, owner: np.ndarray) -> None:
        """A copy was collected: keep its buffer for the next copy of its size, within the
        limits."""
        n = owner.nbytes
        if n > OUT_CACHE_BYTES or self.closed:
            return
        fresh: list[np.ndarray] = []  # made outside the lock (an allocation may collect)
        with self.lock:
            if self.closed:
                return
            free = self.free.setdefault(n, fresh)
            self.free.move_to_end(n)
            if len(free) >= OUT_CACHE:
                return
            free.append(owner)
            self.nbytes += n
            while self.free and (self.nbytes > OUT_CACHE_BYTES
                                 or len(self.free) > OUT_CACHE_SIZES):
                oldest = next(iter(self.free))
                buffers = self.free.get(oldest)
                if buffers:
                    buffers.pop()
                    self.nbytes -= oldest
                if not buffers:
                    self.free.pop(oldest, None)

    def close(self) -> None:
        """Free every buffer kept; copies collected later free theirs."""
        with self.lock:
            self.closed = True
            self.free.clear()
            self.nbytes = 0

    def after_fork(self) -> None:
        """In a forked child: a new lock (a parent's thread may have held it at the fork)."""
        self.lock = threading.RLock()


def hold_id(entry: Any) -> int | None:
    """The hold id of a reply's same-host ``sm`` entry ``[segment, slot, nbytes, hold]``
    (None: another form, or a malformed one)."""
    if isinstance(entry, list) and len(entry) == 4 and isinstance(entry[3], int):
        return entry[3]
    return None


def reply_hold_ids(slots: Any) -> list[int]:
    """The hold ids a reply's ``sm`` (a list of entries per item) names."""
    if not isinstance(slots, list):
        return []
    return [hid for item in slots if isinstance(item, list) for entry in item
            if (hid := hold_id(entry)) is not None]


def _dims(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}")
        if d < 0:
            raise ValueError(f"shape must not have negative dimensions, got {shape!r}")
    return tuple(int(d) for d in dims)


def empty_array(pool: Pool | None, shape: Any, dtype: Any) -> Any:
    """An uninitialised array of ``shape`` and ``dtype`` (a numpy dtype; a torch dtype gives a
    CPU tensor) in a slot lent by ``pool`` (``Pool.lend``: a put sends the slot itself), or a
    plain ``numpy.empty`` / ``torch.empty`` without a pool, below its threshold, or with no
    slot free in time.  ``TypeError`` for a dtype or rank no put accepts (the encoder's
    own checks) or a shape that is not ints, ``ValueError`` for a negative dimension."""
    dims = _dims(shape)
    arrays.check_rank(len(dims))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        arrays.torch_dtype_name(dtype)  # (the encoder's check: what no put accepts is refused)
        nbytes = math.prod(dims) * arrays.tensor_itemsize(dtype)
        view = pool.lend(nbytes) if pool is not None else None
        if view is None:
            return torch.empty(dims, dtype=dtype)
        return arrays.tensor_over(view, dtype, dims)
    try:
        kind = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a numpy or torch dtype, got {dtype!r}") from None
    arrays.check_numpy_dtype(kind)
    view = pool.lend(math.prod(dims) * kind.itemsize) if pool is not None else None
    if view is None:
        return np.empty(dims, dtype=kind)
    return view.view(kind).reshape(dims)


class _Alloc:
    """A pool whose puts wait at most ``wait`` seconds for a free slot (``Pool.__call__``)."""

    __slots__ = ("pool", "wait")

    def __init__(self, pool: Pool, wait: float | None) -> None:
        self.pool, self.wait = pool, wait

    def __call__(self, data: Any, nbytes: int) -> list | None:
        return self.pool(data, nbytes, self.wait)

    def undo(self, refs: list) -> None:
        self.pool.undo(refs)


def client_submit(conn: Any, item: Any, rec: Put | None = None) -> tuple[bytes, list, list | None]:
    """Encode ``item`` for a put: ``(body, buffers, slot refs or None)``.  A put (``rec``) with
    ``nowait`` never waits for a free slot, one with a ``timeout`` at most that long."""
    pool = conn.shm.pool if conn.shm is not None else None
    if pool is None:
        body, buffers = codec.encode(item)
        return body, buffers, None
    alloc: Any = pool
    if rec is not None and (rec.nowait or rec.timeout is not None):
        alloc = _Alloc(pool, 0.0 if rec.nowait else min(pool.slot_wait, rec.timeout))
    body, buffers, refs = codec.encode_shm(item, alloc)
    if refs:
        pool.sent(refs)
    return body, buffers, refs or None


def client_undo(conn: Any, refs: list | None) -> None:
    """A put whose slots were taken is not sent after all: free them."""
    pool = conn.shm.pool if refs and conn.shm is not None else None
    if pool is not None:
        pool.undo(refs)
