"""The requests of one connection: the queue of requests not sent yet, their coalescing into
messages, the requests in flight (``pending``, by id) and the flow control of each issuer.

``RequestQueue`` is that part of ``connection.Connection``: it gets the connection's ``Line``
(state, socket lock, ``send``), the broker's address (for errors), ``max_inflight``, the
shared-memory client (a put's slots) and ``issue`` (the connection's ``request``: a cancel is
a request).  A request is queued by the thread that issues it; whoever holds the socket lock
(``Line.sock_lock``: the I/O thread, or a caller sending and reading itself,
``connection/waiting.py``) sends what is queued, coalesced into as few messages as the limits of
``connection/tuning.py`` allow; the reply path (``Connection._on_reply``) gives a request's slot
back to its issuer and takes it out of ``pending`` once its ``Work`` is completed
(``connection/inflight.py``; the flow control itself is ``connection/flowcontrol.py``).
``queue`` and ``pending`` stay the same objects for the connection's life: the other parts
keep references to them.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zchannel.broker.connection.batching import group_records
from zchannel.broker.connection.flowcontrol import (
    Deferred,
    Flow,
    FlowControl,
    in_event_loop,
    may_wait,
)
from zchannel.broker.connection.inflight import InFlight
from zchannel.broker.connection.line import CLOSED, DOWN, Line
from zchannel.broker.connection.tuning import (
    BATCH,
    LONG_KEY,
    MAX_BYTES_PER_MESSAGE,
    MAX_FRAMES_PER_MESSAGE,
    MAX_INLINE_PER_MESSAGE,
    MAX_OPS_PER_MESSAGE,
)
from zchannel.broker.connection.work import SELF_WAIT, CancelledError, Work
from zchannel.broker.errors import BrokerUnavailable, ChannelError
from zchannel.broker.shm.client import ShmClient, client_undo
from zchannel.broker.wire.protocol import (
    NOTICE_BYTES,
    UNSET,
    Cancel,
    ProtocolError,
    Put,
    Request,
)

if TYPE_CHECKING:  # revival.py imports liveness.py, which imports this module: the type alone
    from zchannel.broker.connection.revival import Revival

# a reply converter: (the reply record, its frames) -> the Work's result
Convert = Callable[[Any, list], Any]

# a request in flight: (its Work, its reply converter or None, is it a put, the handle's
# share that issued it or None; see sharing.py)
Pending = tuple[Work, Convert | None, bool, Any]

log = logging.getLogger("zchannel.client")
# unreadable replies of one broker are logged at most this often (with the count so far): each
# fails its request, which says so; a broker sending nothing else must not flood the log
MALFORMED_LOG_S = 10.0


class RequestQueue:
    """The request queue, in-flight table and flow control of ``Connection`` (see the module
    docstring)."""

    def __init__(self, line: Line, address: str, max_inflight: int, shm: ShmClient,
                 issue: Callable[..., Work]) -> None:
        self._line = line
        self.address = address
        self.shm = shm  # a put's shared-memory slots (``client_undo`` reads it)
        self._issue = issue
        self.ids = itertools.count(1)  # request ids (hello and bye take theirs here too)
        self.queue: deque[tuple[Request, list, Pending | None]] = deque()
        self.pending: dict[int, Pending] = {}
        # the id of a ``puts``/``gets`` record -> (is puts, the ids it stands for): batching.py
        self.batches: dict[int, tuple[bool, frozenset[int]]] = {}
        # the part whose ``wait_for`` reads the link for a waiting ``Work`` (``Waiting``, set
        # by the connection when its callers read the link; None: the I/O thread completes it)
        self.reader: Any = None
        # flow control per handle (``Flow``: its share, or the connection's own for requests of
        # no handle); ``_queue_deferred`` queues a request that waited for room in its Work
        self.flows = FlowControl(line, address, max_inflight)
        self.flows.issue = self._queue_deferred
        self.flows.give_back = functools.partial(_give_back, self)
        self.inflight = InFlight(self.pending, self.flows)  # the reply path's (inflight.py)
        # what a request issued while the connection is down does first: wait for the broker
        # to answer again (``revival.Revival``, a handle's connection) or None: fail at once
        self.revive: Revival | None = None
        # ``Liveness.relink_now`` (set by the connection): a broken direct link linked again at
        # once, True when a new link is up (``send_again``)
        self.relink_now: Callable[[], bool] = _no_new_link
        self.malformed_replies = 0  # unreadable replies so far (``fail_unreadable``)
        self.malformed_log_at = 0.0  # when they are logged next

    @property
    def max_inflight(self) -> int:  # (``FlowControl``'s)
        return self.flows.max_inflight

    @max_inflight.setter
    def max_inflight(self, limit: int) -> None:
        self.flows.max_inflight = limit

    def enqueue(self, rec: Request, frames: list, convert: Convert | None,
                cancellable: bool, room: bool = True, owner: Any = None,
                async_op: bool = False) -> Work:
        """Queue ``rec`` (with ``frames``) as a request of ``owner`` (a handle's share; None:
        of no handle), after waiting for room among its ``max_inflight`` outstanding requests
        unless not ``room``; its ``Work``.  ``async_op`` on a thread that runs an event loop:
        the request waits for room in its ``Work`` instead (``connection/flowcontrol.py``).
        On a connection that is down it waits for the broker first (``revive``), or fails;
        ``async_op`` on an event loop's thread, it waits for the broker in its ``Work`` too
        (``Revival.park``)."""
        line = self._line
        if line.state == CLOSED or line.closing or (owner is not None and owner.closed):
            raise ChannelError("this channel handle is closed")
        parked = False
        flows = self.flows
        flow = flows.own if owner is None else owner
        if line.state == DOWN:
            if self.revive is None:
                raise BrokerUnavailable(f"the broker at {self.address} is unavailable")
            parked = async_op and in_event_loop()
            if not parked:
                self.revive(rec, async_op)  # up again, or raised (``connection/revival.py``)
                if flow.deferred:  # those parked before it go first
                    flows.issue_waiting(flow)
        flow.n_issued = next(flow.issued) + 1
        work = Work(self._cancel if cancellable else None)
        work._reader = self.reader
        work._line = line
        pending = (work, convert, type(rec) is Put, owner)
        if parked and self.revive is not None:
            self.revive.park(Deferred(rec, frames, pending, flow.n_issued, flow), flows)
            return work
        # no room: the limit is reached, or requests wait for room already (they go first)
        if room and (flow.n_issued - flow.completed > flows.max_inflight or flow.deferred) \
                and may_wait(rec):
            if async_op and in_event_loop():
                flows.defer(Deferred(rec, frames, pending, flow.n_issued, flow))
                return work
            try:
                flows.wait_for_room(rec, flow)
            except BaseException:
                self.release(owner)  # never issued: give its slot back
                raise
        rid = next(self.ids)  # (``_queue_request``, here without its call)
        rec.id = work._tag = rid
        if frames:
            rec.nf = len(frames)  # 0 by default (docs/protocol.md)
        self.queue.append((rec, frames, pending))
        if line.state == CLOSED:
            # the I/O thread ended after the check above and may have failed the queue before
            # this request joined it: fail it here, or a wait() without a timeout would hang
            work.set_exception(ChannelError("this channel handle is closed"))
        return work

    def _queue_request(self, rec: Request, frames: list, pending: Pending) -> None:
        """Give ``rec`` its id and queue it (a request whose owner closed meanwhile is dropped
        unsent by ``send_queued``)."""
        rid = next(self.ids)
        rec.id = rid
        if frames:
            rec.nf = len(frames)  # 0 by default (docs/protocol.md)
        pending[0]._tag = rid
        self.queue.append((rec, frames, pending))

    def _queue_deferred(self, entry: Deferred) -> BaseException | None:
        """Queue ``entry``, a request that waited for room in its ``Work`` and has it now (in
        time: ``FlowControl``, which holds its lock); the error that fails it unsent instead."""
        line, rec, owner = self._line, entry.rec, entry.pending[3]
        if line.state == CLOSED or line.closing or (owner is not None and owner.closed):
            return ChannelError("this channel handle is closed")
        if line.state == DOWN:
            return BrokerUnavailable(f"the broker at {self.address} went away while this "
                                     "request waited for room; nothing was sent")
        self._queue_request(rec, entry.frames, entry.pending)
        entry.frames = []  # (its timer may hold the entry until it runs)
        return None

    def send_unanswered(self, rec: Request, now: bool = False, soon: bool = False,
                        lazy: bool = False) -> None:
        """Send ``rec``, a record the broker does not answer (``ShmHello``, ``ShmRelease``).
        ``now``: on the socket at once, from the thread that holds it (the I/O thread handling
        the hello reply).  ``soon``: at the I/O thread's next turn, woken for it.  Otherwise
        with the next message, when ``lazy`` (the I/O thread looks again within ``LAZY_S``:
        callers read the link) and the socket is free, else as ``soon``.  Nothing once the
        connection is closing."""
        line = self._line
        if now:
            line.send([rec], [])
            return
        if line.closing or line.state == CLOSED:
            return
        self.queue.append((rec, [], None))
        # Checked after the append: whoever takes the socket from here on sends the queue
        # first (a waiting caller, a caller's request, the I/O thread's turn), and the I/O
        # thread takes it within LAZY_S; a holder now may be asleep in its poll, so it is woken.
        if soon or not lazy or line.sock_lock.locked():
            try:
                line.wake_io()
            except OSError:
                pass

    def release(self, owner: Flow | None) -> None:
        """A request of ``owner`` (None: of no handle) completed: its slot is free."""
        self.flows.release(self.flows.flow_of(owner))

    def _cancel(self, work: Work) -> bool:
        """``work.cancel()``: ask the broker to withdraw its request; whether it did.  The wait
        for the answer ends after the heartbeat expiry at the latest (by then a broker that is
        alive has answered, and one that is not is known gone): False then, and an answer
        that comes later still withdraws the request."""
        if self.flows.withdraw(work):  # it waited for room: never sent
            return True
        line = self._line
        if line.reads_here():  # its answer could only be read by this thread: refused
            raise RuntimeError(SELF_WAIT)  # before the request goes out
        rid = work._tag
        try:
            ask = self._issue(Cancel(id=0, request_id=rid), [])
            ask.add_done_callback(functools.partial(_withdrawn, self, rid))
            return bool(ask.wait(line.hb * line.liveness))
        except (ChannelError, TimeoutError):
            return False

    def requests_of(self, owner: Any) -> list[tuple[int, Work, bool]]:
        """``(id, Work, is a put)`` of the outstanding requests of ``owner`` (None: all)."""
        out = [(rid, p[0], p[2]) for rid, p in list(self.pending.items())
               if owner is None or p[3] is owner]
        out += [(e[0].id, e[2][0], e[2][2]) for e in list(self.queue)
                if e[2] is not None and (owner is None or e[2][3] is owner)]
        return out

    def flush(self) -> None:
        """Send what is queued now (requests of closed owners are dropped, see send_queued)."""
        line = self._line
        with line.sock_lock:
            if not line.fds_closed:
                self.send_queued()

    def forget(self, rid: int, exc: BaseException) -> None:
        """Fail request ``rid`` with ``exc`` unless its reply came (a later reply is dropped)."""
        pending = self.inflight.take_out(rid)
        if pending is not None:
            pending[0].set_exception(exc)

    def send_queued(self) -> None:
        """Send what is queued (by the socket's holder), coalesced into as few messages as the
        limits allow; a request whose handle closed, or a stale put, fails unsent, and so does
        everything queued while the broker is known gone (``DOWN``: its requests in flight were
        failed then, and one sent now would wait for an answer that never comes).  A message
        that finds the direct link broken, which nothing of it crossed, goes again behind the
        hello of a new link (``send_again``)."""
        queue = self.queue
        if self._line.state == DOWN:
            _fail_queued(self)
            return
        if len(queue) == 1:  # the common case of a blocking call: one request, sent alone
            rec, op_frames, pending = queue.popleft()
            if pending is not None:
                if pending[3] is not None and pending[3].closed or self._stale(rec, pending):
                    _drop_unsent(self, rec, pending)
                    return
                self.pending[rec.id] = pending
            if op_frames:
                self._line.announce(_frame_bytes(rec))
            if self._line.send([rec], op_frames) or self._line.transport.up \
                    or not send_again(self, [rec], [rec], op_frames):
                return
            relinked = True  # it goes out below, behind the new link's hello
        else:
            relinked = False
        _send_messages(self, self._line, relinked)

    def _next_message(self, queue: deque) -> tuple[list[Request], list, int]:
        """Take from ``queue`` the requests of one message (within the limits of
        ``connection/tuning.py``), moving them to ``pending``: the records, their frames and
        the frames' bytes.
        Its frames stay within ``MAX_FRAMES_PER_MESSAGE``, the lowest ``max_frames`` of a
        broker, unless its one request has more (a put checked against its broker's own
        ``max_frames``): coalescing never makes a message a broker refuses."""
        records: list[Request] = []
        frames: list = []
        nbytes = 0
        inline = 0  # bytes of inline bodies: they make the header (the broker limits it)
        in_flight = self.pending
        while (queue and len(records) < MAX_OPS_PER_MESSAGE and nbytes < MAX_BYTES_PER_MESSAGE
               and inline < MAX_INLINE_PER_MESSAGE):
            if records and len(frames) + len(queue[0][1]) > MAX_FRAMES_PER_MESSAGE:
                break  # its frames go in the next message: this one stays within max_frames
            rec, op_frames, pending = queue.popleft()
            if pending is not None:
                if pending[3] is not None and pending[3].closed or self._stale(rec, pending):
                    _drop_unsent(self, rec, pending)
                    continue
                in_flight[rec.id] = pending
            records.append(rec)
            if op_frames:
                frames.extend(op_frames)
            if type(rec) is Put:  # only a put carries frames (``sizes``) or a body
                if op_frames:
                    nbytes += sum(rec.sizes or ())
                elif rec.body is not UNSET:
                    inline += len(rec.body)
            key = getattr(rec, "key", None)  # a long key makes the header too
            if type(key) is str:
                if len(key) > LONG_KEY:
                    inline += 4 * len(key)
            elif key is not None and type(key) is not int:
                inline += _key_bytes(key)
        return records, frames, nbytes

    def _stale(self, rec: Request, pending: Pending) -> bool:
        """A put whose shared-memory slots were taken in an earlier session of this
        connection (``ShmClient.stale``): it must not go out in this one."""
        return pending[2] and isinstance(rec, Put) and rec.slots is not None \
            and self.shm.stale(rec.slots)

    def after_fork(self) -> None:
        """In a forked child: the requests in flight or queued are the parent's connection's;
        their ``Work`` copies fail here (with fresh locks: a parent's thread may have held
        theirs at the fork), so that a child waiting on one does not wait forever."""
        exc = ChannelError("this request was made before the process forked: it belongs to "
                           "the parent's connection (the child's handles connect anew)")
        entries = [*self.pending.values(), *(e[2] for e in self.queue if e[2] is not None)]
        self.flows.after_fork()
        if self.revive is not None:
            self.revive.after_fork()
        self.inflight.released.clear()
        self.pending.clear()
        self.queue.clear()
        self.batches.clear()
        for entry in entries:
            entry[0]._lock = threading.Lock()
            entry[0].set_exception(exc)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every request in flight with ``exc`` (each taken out of ``pending`` once: a
        reply read meanwhile completes it instead, never both)."""
        self.batches.clear()
        take_out = self.inflight.take_out
        for rid in list(self.pending):
            entry = take_out(rid)
            if entry is not None:
                entry[0].set_exception(exc)


def _drop_unsent(requests: RequestQueue, rec: Request, pending: Pending,
                 error: BaseException | None = None) -> None:
    """A request whose handle closed before it went out (``ChannelError``), or a put whose
    slots are stale (``BrokerUnavailable``: sent again, it takes new ones), or ``error``:
    never sent, it fails here."""
    client_undo(requests, getattr(rec, "slots", None))  # its shared-memory slots go back to the pool
    requests.release(pending[3])
    if error is not None:
        pending[0].set_exception(error)
    elif pending[3] is not None and pending[3].closed:
        pending[0].set_exception(ChannelError("this channel handle is closed"))
    else:
        pending[0].set_exception(BrokerUnavailable(
            f"the broker at {requests.address} was restarted (or expired this client) while "
            "this put waited to be sent; nothing was stored"))


def _fail_queued(requests: RequestQueue) -> None:
    """Fail what is queued, unsent (the broker is known gone: ``send_queued``)."""
    queue = requests.queue
    while queue:
        rec, _, pending = queue.popleft()
        if pending is not None:
            _drop_unsent(requests, rec, pending, BrokerUnavailable(
                f"the broker at {requests.address} is unavailable (it went away before this "
                "request was sent); nothing was sent"))


def _give_back(requests: RequestQueue, rec: Request) -> None:
    """What ``rec``, failing unsent after it waited in its ``Work``, holds goes back: a put's
    shared-memory slots (``FlowControl.fail``)."""
    client_undo(requests, getattr(rec, "slots", None))


def _send_messages(requests: RequestQueue, line: Line, relinked: bool) -> None:
    """``RequestQueue.send_queued`` for more than one request: message after message.  A
    message that finds the direct link broken goes again on a new one (``send_again``), once
    per call (``relinked``: done already); otherwise it fails, with the rest of the queue."""
    queue, send = requests.queue, line.send
    while queue:
        records, frames, nbytes = requests._next_message(queue)
        if records:
            grouped = group_records(requests, records) if BATCH and len(records) > 1 \
                else records
            if nbytes >= NOTICE_BYTES:
                line.announce(nbytes)
            if send(grouped, frames) or line.transport.up:
                continue
            if relinked or not send_again(requests, records, grouped, frames):
                _fail_queued(requests)
                return
            relinked = True


def send_again(requests: RequestQueue, records: list[Request], grouped: list[Request],
               frames: list) -> bool:
    """A message of ``records`` (sent as ``grouped``: ``batching.group_records``) and ``frames``
    found the direct link broken (a broker that died or closed it while the connection was
    idle): nothing of it was read by a broker.  Its requests are taken back out of
    ``pending``, the link is linked again at once (a hello first, ``Liveness.relink``), and
    they go back to the front of the queue to go out behind that hello (True); with no new link
    up they fail unsent (False).  The unanswered records of the message (shared-memory
    releases) belong to the session that ended with the link: they are dropped."""
    for rec in grouped:
        requests.batches.pop(rec.id, None)
    entries, pos = [], 0
    for rec in records:
        nf = rec.nf
        pending = requests.pending.pop(rec.id, None) if rec.id else None  # (0: unanswered)
        if pending is not None:
            entries.append((rec, frames[pos : pos + nf], pending))
        pos += nf
    if requests.relink_now():
        requests.queue.extendleft(reversed(entries))
        return True
    for rec, _, pending in entries:
        _drop_unsent(requests, rec, pending, BrokerUnavailable(
            f"the direct link to the broker at {requests.address} broke and no broker answers "
            "there now; nothing was sent"))
    return False


def _no_new_link() -> bool:
    """``RequestQueue.relink_now`` of a queue whose connection set none: no new link."""
    return False


def fail_unreadable(requests: RequestQueue, rid: int | None, error: ProtocolError) -> None:
    """A reply from the broker that cannot be read (``error`` says why): the request ``rid``
    fails, or each of the ``puts``/``gets`` record ``rid`` (``batching.py``); without an id
    (a message unreadable whole, an ``items`` record) it may answer any request, so every
    request in flight fails (none waits for an answer that came)."""
    requests.malformed_replies += 1  # (logged at most once per MALFORMED_LOG_S)
    now = time.monotonic()
    if now >= requests.malformed_log_at:
        requests.malformed_log_at = now + MALFORMED_LOG_S
        log.error("a reply from the broker at %s cannot be read (%d so far): %s",
                  requests.address, requests.malformed_replies, error)
    failure = ProtocolError(f"the broker at {requests.address} sent a reply this client "
                            f"cannot read ({error})")
    if rid is None:
        requests.fail_all(failure)
        return
    batch = requests.batches.pop(rid, None)
    for each in batch[1] if batch is not None else (rid,):
        requests.forget(each, failure)


def _withdrawn(requests: RequestQueue, rid: int, ask: Work) -> None:
    """The answer to a cancel of request ``rid`` (``RequestQueue._cancel``): withdrawn, the
    request fails with ``CancelledError`` (no reply of it comes)."""
    if ask.exception() is None and ask.result():
        requests.forget(rid, CancelledError("the broker withdrew the operation"))


def _frame_bytes(rec: Request) -> int:
    """The bytes of the frames of ``rec``, a put (its ``sizes``; 0 when it names none)."""
    sizes = getattr(rec, "sizes", None)
    return sum(sizes) if sizes else 0


def _key_bytes(key: Any) -> int:
    """About the bytes a long ``key`` takes in a header (at most 4 per character; 0 for a short
    one): 512 records of 1024-character keys would pass the broker's ``max_header_bytes``."""
    n = _text_len(key)
    return 4 * n if n > LONG_KEY else 0


def _text_len(key: Any) -> int:
    if isinstance(key, (str, bytes)):
        return len(key)
    if isinstance(key, tuple):
        return sum(_text_len(part) + 1 for part in key)
    return 8
