"""The broker's side of the same-host shared-memory path (``docs/shm.md``): the probe segment
that proves same-host, the producers' segments the broker mapped, ``Hold`` references (one per
item holding a slot, one per consumer delivery), byte accounting, the conversion of slots to
frames for consumers that are not on the same host, and the cleanup of departed clients' slots
and of stale segments."""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
import zmq
from zchannel.broker.host.procs import pid_namespace, process_running
from zchannel.broker.shm.claims import BrokerSegment, check_refs, creator_pid
from zchannel.broker.shm.holds import ConsumerHolds
from zchannel.broker.shm.segment import (
    DEFAULT_POOL_BYTES,
    DEFAULT_THRESHOLD,
    FREE,
    MAGIC,
    SHM_DIR,
    list_segments,
    prefix_for,
    unlink,
)
from zchannel.broker.wire import codec
from zchannel.broker.wire.protocol import Reply, ShmHello, ShmOffer, ShmRelease

log = logging.getLogger("zchannel.shm")

PROVEN_ADDRESSES = 4096  # connections remembered as same-host after their client left


class Hold:
    """One reference to a slot held in the broker (an item, or a consumer's delivery)."""

    __slots__ = ("owner", "seg", "slot", "nbytes", "counted")

    def __init__(self, owner: ShmBroker, seg: BrokerSegment, slot: int, nbytes: int,
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


def _buffer(frame: Any) -> Any:
    """The bytes of a frame (``zmq.Frame`` or bytes-like)."""
    return frame.buffer if isinstance(frame, zmq.Frame) else frame


def _keep(obj: Any) -> None:
    """A finalizer whose only job is to hold ``obj`` until it runs."""


def dead_creator_segments(prefix: str, known: Any, probe: str | None,
                          connected: set[int]) -> list[str]:
    """The segments in ``/dev/shm`` of ``prefix``, other than ``probe`` and those in ``known``,
    whose creator (the pid in their name) no longer runs and is none of the ``connected``
    clients' pids: a producer's segments made but never named in a put (grown in the
    background, reserved, or taken mid-write) when it was killed."""
    out = []
    for name in list_segments(prefix):
        pid = creator_pid(prefix, name)
        if (name != probe and name not in known and pid is not None and pid not in connected
                and not process_running(pid)):
            out.append(name)
    return out


class SlotFrames(list):
    """The frames of a put that also refers to shared-memory slots: the item's payload in the
    queue core (which never looks into it), keeping the slots' ``Hold``s as long as it exists."""

    __slots__ = ("holds", "slot_bytes", "views")

    def __init__(self, frames: list, holds: list[Hold]) -> None:
        super().__init__(frames)
        self.holds = holds
        self.slot_bytes = sum(h.nbytes for h in holds)  # counted in the item's nbytes
        self.views: list[weakref.ref] = []  # the slot views decoding gave hooks (weakly)


class FramedSlots(SlotFrames):
    """The payload of an item whose shared-memory slots are gone (it was recovered from a
    durable channel's journal, ``broker/journal/``): the bytes of each slot are one of its
    frames, so every consumer gets them as frames.  ``framed[i]`` is the index, among the
    item's frames (the body is 0), of the frame that holds the bytes of its slot ``i`` (what a
    reply's ``sm`` says for a slot sent as a frame)."""

    __slots__ = ("framed",)

    def __init__(self, frames: list, framed: list[int]) -> None:
        super().__init__(frames, [])
        self.framed = framed


def _stale_segments(prefix: str, name: str, grace: float) -> list[str]:
    """At a broker's start: remove the segments of ``prefix`` a previous broker of channel
    ``name`` left whose producer is dead; those of live producers, returned, go after
    ``grace`` (a reply the dead broker sent may still name one to a consumer)."""
    stale = list_segments(prefix)
    kept = []
    for seg_name in stale:
        pid = creator_pid(prefix, seg_name)
        if pid is not None and process_running(pid):
            kept.append(seg_name)
        else:
            unlink(seg_name)
    if stale:
        log.info("removed %d stale shared-memory segment(s) of channel %r (%d of live "
                 "producers go in %.0fs)", len(stale) - len(kept), name, len(kept), grace)
    return kept


class ShmBroker:
    """The broker's shared-memory state (see the module docstring).  ``name`` names its
    segments: the channel's name, or ``<name>.replica<i>`` for a replica of a distributed
    channel, so that replicas on one host keep apart."""

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
        self.segments: dict[str, BrokerSegment] = {}
        self.verified: set[Any] = set()  # clients that proved they share our /dev/shm
        # addresses (one per connection) that proved it: a client expired under load and
        # registered again still sends puts with slots before its new proof arrives
        # (with the pid their client gave, or None)
        self.proven: OrderedDict[bytes, int | None] = OrderedDict()
        self.holds = ConsumerHolds()  # slots delivered to consumers, by hold id
        self._freed_count = itertools.count(1)
        self.bytes_held = 0  # slot bytes referenced by items in the broker
        self.consumer_bytes = 0  # slot bytes delivered and not yet released by consumers
        self.converted = 0  # slots sent as frames to consumers not on this host
        self.slots_in = 0  # slots received in puts
        self.probe: str | None = None
        self._token = b""
        # the first departure of a client since ``/dev/shm`` was last scanned for segments of
        # dead producers the broker never heard of (``sweep``), and when that scan was
        self.left_at: float | None = None
        self.scanned_at = -float("inf")
        self.client_pids: dict[Any, int] = {}  # proven clients' pids (``_note_pid``)
        # the pid each proven client gave (as it sees it): the pid its segments' names carry
        self.given_pids: dict[Any, int | None] = {}
        self.foreign_pids = False  # a proven client's pid was not visible here
        # A previous broker of this channel and run dir died: its probe and the segments of
        # dead producers go now; a live producer's go after the grace period (``sweep``), as a
        # reply the dead broker sent may still name one to a consumer that has not mapped it
        self.previous = _stale_segments(self.prefix, name, orphan_grace)
        self.previous_until = time.monotonic() + orphan_grace
        if threshold:
            try:
                self._make_probe()
            except OSError as exc:
                log.warning("shared memory unavailable (%s): large items go as frames", exc)
                self.threshold = 0

    def _make_probe(self) -> None:
        """Write the probe: the magic and a fresh token, in a new file of mode 0600 under a
        random name (``/dev/shm`` is shared by every user: a name known in advance could be
        made first by another user, who would then read the token, or be a symbolic link to
        a file the broker would overwrite)."""
        self._token = secrets.token_bytes(16)
        name = f"{self.prefix}probe-{secrets.token_hex(8)}"
        fd = os.open(os.path.join(SHM_DIR, name),
                     os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, MAGIC + self._token)
        finally:
            os.close(fd)
        self.probe = name

    @property
    def enabled(self) -> bool:
        return bool(self.threshold) and self.probe is not None

    def hello_info(self) -> ShmOffer | None:
        """The ``shm`` field of the hello reply (None: shared memory is off)."""
        if not self.enabled:
            return None
        return ShmOffer(probe=self.probe, prefix=self.prefix, threshold=self.threshold,
                        pool=self.pool_bytes)

    # -- records -------------------------------------------------------------------------------

    def handle(self, client: Any, rec: ShmHello | ShmRelease) -> None:
        """``shm_hi`` (same-host proof) and ``shm_rel`` (slots released) records; no reply."""
        if type(rec) is ShmHello:
            token = rec.token
            if self.enabled and isinstance(token, bytes) and secrets.compare_digest(token, self._token):
                self._note_pid(client, rec.pid, rec.pid_ns)
                pid = rec.pid if type(rec.pid) is int and rec.pid > 0 else None
                self.given_pids[client] = pid
                self.verified.add(client)
                self.proven[client.address] = pid
                while len(self.proven) > PROVEN_ADDRESSES:
                    self.proven.popitem(last=False)
            return
        ids = rec.holds if isinstance(rec, ShmRelease) else None
        if not isinstance(ids, list):
            raise ValueError("shm_rel carries a list of hold ids")
        self.holds.release(client, ids)  # dropping a Hold frees its slot when it was the last

    def _note_pid(self, client: Any, pid: Any, pid_ns: Any) -> None:
        """Remember the pid a proven client gives.  A client that names this process's pid
        namespace sees the same pids: its pid is kept while it runs (one that has exited since
        its hello is simply dead).  A client of another namespace, or one that cannot tell and
        whose pid this process cannot see running, means clients whose pids are not this
        process's share this ``/dev/shm``: from then on no segment is taken for a dead
        producer's by the pid in its name (``sweep``)."""
        if type(pid) is int and pid > 0:
            mine = pid_namespace()
            if mine is not None and pid_ns == mine:
                if process_running(pid):
                    self.client_pids[client] = pid
                    self.holds.adopt(client, pid)
                return
            if pid_ns is None and process_running(pid):
                self.client_pids[client] = pid
                self.holds.adopt(client, pid)
                return
        if not self.foreign_pids:
            self.foreign_pids = True
            log.info("a client's process id is not one this broker can see (another pid "
                     "namespace, or an older client): segments of killed producers that were "
                     "never announced stay until the broker stops")

    def attach_put(self, client: Any, refs: Any, frames: list) -> SlotFrames:
        """The payload of a put of ``frames`` with the slot references ``refs``: the frames and
        a ``Hold`` per slot (their bytes in ``SlotFrames.slot_bytes``).  ``ValueError`` for
        anything that does not check out (``claims.check_refs``): a refused reference records
        nothing, and the slots of the put's references that did check out go back to their
        producer, as a refused put's do."""
        if client not in self.verified and client.address in self.proven:
            self.verified.add(client)  # the same connection: the same host
            self.given_pids[client] = self.proven[client.address]
        if client not in self.verified:
            raise ValueError("shared-memory slots from a client that did not prove it shares "
                             "the broker's host")
        checked = check_refs(refs, client, self.given_pids.get(client), self.segments,
                             self.prefix, self.probe)
        if checked.error is not None:
            for bseg, slot, nbytes in checked.slots:  # a hold dropped at once: FREE again
                Hold(self, bseg, slot, nbytes, True)
            raise checked.error
        self.segments.update(checked.opened)
        holds = [Hold(self, bseg, slot, nbytes, True) for bseg, slot, nbytes in checked.slots]
        self.slots_in += len(holds)
        return SlotFrames(frames, holds)

    def attach_reply(self, client: Any, payload: SlotFrames, rec: Reply, index: int, count: int,
                     frames: list) -> int:
        """Add the slots of ``payload`` (the ``index``-th item of ``count`` in reply ``rec``) to the
        reply: references for a same-host client (a consumer hold each), else the slots' bytes
        as zero-copy frames appended to ``frames``.  Returns the number of frames added."""
        sm = rec.slots
        if sm is None:
            sm = rec.slots = [None] * count
        if isinstance(payload, FramedSlots):  # its frames (already sent) hold the slots' bytes
            sm[index] = list(payload.framed)
            return 0
        entries: list[Any] = []
        if client in self.verified:
            for h in payload.holds:
                hid = self.holds.add(client, Hold(self, h.seg, h.slot, h.nbytes, False))
                entries.append([h.seg.seg.name, h.slot, h.nbytes, hid])
            sm[index] = entries
            return 0
        base = len(payload)
        for j, h in enumerate(payload.holds):
            frames.append(zmq.Frame(h.view(), copy=False))
            entries.append(base + j)
        self.converted += len(payload.holds)
        sm[index] = entries
        return len(entries)

    def decode_item(self, fallback: Any) -> Any:
        """A ``decode_item`` for the core: items with slots decode to views of them (each keeps
        its slot alive while a hook, or a frame made from it, still uses it), their tensors on
        the CPU (``codec.decode``'s ``restore_devices``)."""

        def decode(item: Any) -> Any:
            frames = item.payload
            if not isinstance(frames, SlotFrames):
                return fallback(item)
            body = frames[0]
            body = body.buffer if hasattr(body, "buffer") else body
            if isinstance(frames, FramedSlots):
                slots = [np.frombuffer(_buffer(frames[k]), np.uint8) for k in frames.framed]
            else:
                slots = [h.view() for h in frames.holds]
                frames.views = [r for r in frames.views if r() is not None]
                frames.views.extend(weakref.ref(v) for v in slots)
            return codec.decode(body, frames[1:], shm=slots, shm_copy=False,
                                restore_devices=False)

        return decode

    @staticmethod
    def slots_viewed(item: Any) -> bool:
        """Whether anything still holds a view of ``item``'s slots that decoding gave a hook
        (a collector's state, another output's frames): the item may then not hand its slots
        to a consumer, whose ``copy=False`` view is writable and private."""
        frames = item.payload
        return isinstance(frames, SlotFrames) and any(r() is not None for r in frames.views)

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

    def _remove(self, bseg: BrokerSegment) -> None:
        if self.segments.get(bseg.seg.name) is bseg:
            del self.segments[bseg.seg.name]
        unlink(bseg.seg.name)

    def client_gone(self, client: Any, expired: bool = False) -> None:
        """A client left or died: drop the slots it held as a consumer (an ``expired`` one
        whose process still runs keeps them until it registers again or its process ends:
        its views live on); its own segments go once nothing references them any more."""
        self.verified.discard(client)
        self.given_pids.pop(client, None)
        pid = self.client_pids.pop(client, None)
        stalled = expired and pid is not None and process_running(pid)
        self.holds.client_gone(client, pid if stalled else None)
        now = time.monotonic()
        if self.left_at is None:
            self.left_at = now
        with self.lock:
            for bseg in list(self.segments.values()):
                if bseg.owner is client:
                    bseg.orphan, bseg.owner, bseg.orphan_at = True, None, now
        self.sweep(now)

    def sweep(self, now: float) -> None:
        """Remove departed owners' segments that nothing references past the grace period.
        Once the grace period has passed since a client left (and since the last such scan),
        also remove the segments of this prefix the broker never mapped whose creator is dead
        (``dead_creator_segments``): a live producer's segment not yet named in a put stays.
        Past the grace period after this broker started, remove the segments a previous broker
        of the channel left of producers that were alive then (``previous``)."""
        self.holds.sweep()
        with self.lock:
            for bseg in list(self.segments.values()):
                if (bseg.orphan and now - bseg.orphan_at >= self.orphan_grace
                        and not any(bseg.refs)):
                    self._remove(bseg)
            if self.previous and now >= self.previous_until:
                for seg_name in self.previous:
                    if seg_name not in self.segments:
                        unlink(seg_name)
                self.previous = []
        if (self.left_at is not None and now - self.left_at >= self.orphan_grace
                and now - self.scanned_at >= self.orphan_grace and not self.foreign_pids):
            self.left_at, self.scanned_at = None, now
            dead = dead_creator_segments(self.prefix, self.segments, self.probe,
                                         set(self.client_pids.values()))
            for seg_name in dead:
                unlink(seg_name)
            if dead:
                log.info("removed %d shared-memory segment(s) of dead producers", len(dead))

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
        self.segments.clear()
        for seg_name in list_segments(self.prefix):
            unlink(seg_name)
