"""The requests of one connection: the queue of requests not sent yet, their coalescing into
messages, the requests in flight (``_pending``, by id) and the flow control of each issuer.

``RequestQueue`` is that part of ``connection.Connection`` (its attributes are the
connection's; see that module's docstring for the threads and locks).  A request is queued by
the thread that issues it; whoever holds the socket lock (``_sock_lock``: the I/O thread, or a
caller sending and reading itself, ``connection/waiting.py``) sends what is queued, coalesced into as few
messages as the limits of ``connection/tuning.py`` allow; the reply path (``Connection._on_reply``) takes a
request out of ``_pending`` and gives its issuer's slot back (``_release``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from zchannel.broker.connection.batching import group_puts
from zchannel.broker.connection.liveness import CLOSED, DOWN
from zchannel.broker.connection.tuning import (
    BATCH,
    MAX_BYTES_PER_MESSAGE,
    MAX_INLINE_PER_MESSAGE,
    MAX_OPS_PER_MESSAGE,
)
from zchannel.broker.connection.work import CancelledError, Work
from zchannel.broker.errors import BrokerUnavailable, ChannelError
from zchannel.broker.shm.client import client_undo
from zchannel.broker.wire.protocol import UNSET, Cancel, Put, Request, op_of

Convert = Callable[[dict, list], Any]


# a request in flight: (its Work, its reply converter or None, is it a put, the handle's
# share that issued it or None; see sharing.py)
_Pending = tuple[Work, Convert | None, bool, Any]

class Flow:
    """Flow control of one issuer of requests (a handle's share, or the connection itself):
    at most ``max_inflight`` issued and not completed (atomic counters)."""

    __slots__ = ("issued", "n_issued", "completed", "completed_count")

    def __init__(self) -> None:
        self.issued = itertools.count()
        self.n_issued = 0
        self.completed = 0
        self.completed_count = itertools.count(1)


class RequestQueue:
    """The request queue, in-flight table and flow control of ``Connection`` (see the module
    docstring)."""

    def _init_requests(self, max_inflight: int) -> None:
        self._ids = itertools.count(1)
        self._queue: deque[tuple[dict, list, _Pending | None]] = deque()
        self._pending: dict[int, _Pending] = {}
        self._batches: dict[int, frozenset[int]] = {}  # batch id -> its puts' ids (batching.py)
        # Flow control per handle (``Flow``: its share, or this connection's own for requests
        # of no handle).  Callers wait on ``_room`` only when the limit is reached.
        self._max_inflight = max_inflight
        self._flow = Flow()
        self._room = threading.Condition()
        self._room_waiters = 0
        self.held_back = 0  # requests held back to go out with later ones (``request``)

    def _enqueue(self, rec: Request, frames: list, convert: Convert | None,
                 cancellable: bool, room: bool = True, owner: Any = None) -> Work:
        if self.state == CLOSED or self._closing or (owner is not None and owner.closed):
            raise ChannelError("this channel handle is closed")
        if self.state == DOWN:
            raise BrokerUnavailable(f"the broker at {self.address} is unavailable")
        flow = self._flow if owner is None else owner
        flow.n_issued = next(flow.issued) + 1
        if room and flow.n_issued - flow.completed > self._max_inflight:
            try:
                self._wait_for_room(rec, flow)
            except BaseException:
                self._release(owner)  # never issued: give its slot back
                raise
        rid = next(self._ids)
        rec.id = rid
        if frames:
            rec.nf = len(frames)  # 0 by default (docs/protocol.md)
        work = Work(self._cancel if cancellable else None)
        work._tag = rid
        if self._callers_read:
            work._reader = self
        # (a request whose owner closed meanwhile is dropped unsent by _send_queued)
        self._queue.append((rec, frames, (work, convert, type(rec) is Put, owner)))
        if self.state == CLOSED:
            # the I/O thread ended after the check above and may have failed the queue before
            # this request joined it: fail it here, or a wait() without a timeout would hang
            work.set_exception(ChannelError("this channel handle is closed"))
        return work

    def _wait_for_room(self, rec: Request, flow: Flow) -> None:
        """Block until fewer than ``max_inflight`` requests are outstanding.  The wait counts
        against the request's ``timeout``: the rest travels with the request, and
        ``TimeoutError`` (nothing sent) when none is left."""
        timeout = getattr(rec, "timeout", None)
        start = time.monotonic()
        with self._room:
            self._room_waiters += 1
            try:
                while flow.n_issued - flow.completed > self._max_inflight:
                    if self.state in (DOWN, CLOSED):
                        raise BrokerUnavailable(f"the broker at {self.address} is unavailable")
                    wait = self.hb
                    if timeout is not None:
                        remaining = timeout - (time.monotonic() - start)
                        if remaining <= 0:
                            raise TimeoutError(
                                f"{op_of(rec)} timed out waiting for room among this "
                                f"handle's {self._max_inflight} outstanding requests")
                        wait = min(wait, remaining)
                    self._room.wait(wait)
            finally:
                self._room_waiters -= 1
        if timeout is not None:
            rec.timeout = max(0.0, timeout - (time.monotonic() - start))

    def _release(self, owner: Flow | None) -> None:
        """A request of ``owner`` (None: of no handle) completed: its slot is free."""
        flow = self._flow if owner is None else owner
        flow.completed = next(flow.completed_count)
        if self._room_waiters:
            with self._room:
                self._room.notify_all()

    def _cancel(self, work: Work) -> bool:
        try:
            answer = self.request(Cancel(id=0, request_id=work._tag), []).wait()
        except ChannelError:
            return False
        if answer:
            self.forget(work._tag, CancelledError("the broker withdrew the operation"))
        return bool(answer)

    def requests_of(self, owner: Any) -> list[tuple[int, Work, bool]]:
        """``(id, Work, is a put)`` of the outstanding requests of ``owner`` (None: all)."""
        out = [(rid, p[0], p[2]) for rid, p in list(self._pending.items())
               if owner is None or p[3] is owner]
        out += [(e[0].id, e[2][0], e[2][2]) for e in list(self._queue)
                if e[2] is not None and (owner is None or e[2][3] is owner)]
        return out

    def flush(self) -> None:
        """Send what is queued now (requests of closed owners are dropped, see _send_queued)."""
        with self._sock_lock:
            if not self._fds_closed:
                self._send_queued()

    def forget(self, rid: int, exc: BaseException) -> None:
        """Fail request ``rid`` with ``exc`` unless its reply came (a later reply is dropped)."""
        pending = self._pending.pop(rid, None)
        if pending is not None:
            self._release(pending[3])
            pending[0].set_exception(exc)

    def _send_queued(self) -> None:
        queue = self._queue
        if len(queue) == 1:  # the common case of a blocking call: one request, sent alone
            rec, frames, pending = queue.popleft()
            if pending is not None:
                if pending[3] is not None and pending[3].closed or self._stale(rec, pending):
                    self._drop_unsent(rec, pending)
                    return
                self._pending[rec.id] = pending
            self._send([rec], frames)
            return
        while queue:
            records: list[dict] = []
            frames: list = []
            nbytes = 0
            inline = 0  # bytes of inline bodies: they make the header (the broker limits it)
            while (queue and len(records) < MAX_OPS_PER_MESSAGE and nbytes < MAX_BYTES_PER_MESSAGE
                   and inline < MAX_INLINE_PER_MESSAGE):
                rec, op_frames, pending = queue.popleft()
                if pending is not None:
                    if pending[3] is not None and pending[3].closed or self._stale(rec, pending):
                        self._drop_unsent(rec, pending)
                        continue
                    self._pending[rec.id] = pending
                records.append(rec)
                if op_frames:
                    frames.extend(op_frames)
                    nbytes += sum(rec.sizes or ())
                elif type(rec) is Put and rec.body is not UNSET:
                    inline += len(rec.body)
            if records:
                if BATCH and len(records) > 1:
                    records = group_puts(self, records)
                self._send(records, frames)

    def _stale(self, rec: Request, pending: _Pending) -> bool:
        """A put whose shared-memory slots were taken in an earlier session of this
        connection (``ShmClient.stale``): it must not go out in this one."""
        return pending[2] and rec.slots is not None and self.shm.stale(rec.slots)

    def _drop_unsent(self, rec: Request, pending: _Pending) -> None:
        """A request whose handle closed before it went out (``ChannelError``), or a put whose
        slots are stale (``BrokerUnavailable``: sent again, it takes new ones): never sent, it
        fails here."""
        client_undo(self, getattr(rec, "slots", None))  # its shared-memory slots go back to the pool
        self._release(pending[3])
        if pending[3] is not None and pending[3].closed:
            pending[0].set_exception(ChannelError("this channel handle is closed"))
        else:
            pending[0].set_exception(BrokerUnavailable(
                f"the broker at {self.address} was restarted (or expired this client) while "
                "this put waited to be sent; nothing was stored"))

    def _fail_all(self, exc: BaseException) -> None:
        self._batches = {}
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            self._release(entry[3])
            entry[0].set_exception(exc)
