"""The requests of one connection: the queue of requests not sent yet, their coalescing into
messages, the requests in flight (``pending``, by id) and the flow control of each issuer.

``RequestQueue`` is that part of ``connection.Connection``: it gets the connection's ``Line``
(state, socket lock, ``send``), the broker's address (for errors), ``max_inflight``, the
shared-memory client (a put's slots) and ``issue`` (the connection's ``request``: a cancel is
a request).  A request is queued by the thread that issues it; whoever holds the socket lock
(``Line.sock_lock``: the I/O thread, or a caller sending and reading itself,
``connection/waiting.py``) sends what is queued, coalesced into as few messages as the limits of
``connection/tuning.py`` allow; the reply path (``Connection._on_reply``) takes a request out of
``pending`` and gives its issuer's slot back (``release``).  ``queue`` and ``pending`` stay the
same objects for the connection's life: the other parts keep references to them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from zchannel.broker.connection.batching import group_records
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
    UNSET,
    Cancel,
    Get,
    GetBatch,
    ProtocolError,
    Put,
    Request,
    op_of,
)


def may_wait(rec: Request) -> bool:
    """Whether the broker may hold ``rec`` waiting (a put, get or get_batch that is not
    ``nowait``): only those wait for room among ``max_inflight`` outstanding requests.  The
    others (``*_nowait``, ``qsize``, ``full``, ``stats``, ``ack``...) are answered at once, so
    they go out even when the handle's outstanding gets are all waiting for items."""
    return isinstance(rec, (Put, Get, GetBatch)) and not rec.nowait


# a reply converter: (the reply record, its frames) -> the Work's result
Convert = Callable[[Any, list], Any]

# a request in flight: (its Work, its reply converter or None, is it a put, the handle's
# share that issued it or None; see sharing.py)
Pending = tuple[Work, Convert | None, bool, Any]

log = logging.getLogger("zchannel.client")
# unreadable replies of one broker are logged at most this often (with the count so far): each
# fails its request, which says so; a broker sending nothing else must not flood the log
MALFORMED_LOG_S = 10.0


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
        # Flow control per handle (``Flow``: its share, or this connection's own for requests
        # of no handle).  Callers wait on ``_room`` only when the limit is reached.
        self.max_inflight = max_inflight
        self._flow = Flow()
        self._room = threading.Condition()
        self._room_waiters = 0
        self.malformed_replies = 0  # unreadable replies so far (``malformed``), logged when due
        self._malformed_log_at = 0.0

    def enqueue(self, rec: Request, frames: list, convert: Convert | None,
                 cancellable: bool, room: bool = True, owner: Any = None) -> Work:
        line = self._line
        if line.state == CLOSED or line.closing or (owner is not None and owner.closed):
            raise ChannelError("this channel handle is closed")
        if line.state == DOWN:
            raise BrokerUnavailable(f"the broker at {self.address} is unavailable")
        flow = self._flow if owner is None else owner
        flow.n_issued = next(flow.issued) + 1
        if room and flow.n_issued - flow.completed > self.max_inflight and may_wait(rec):
            try:
                self._wait_for_room(rec, flow)
            except BaseException:
                self.release(owner)  # never issued: give its slot back
                raise
        rid = next(self.ids)
        rec.id = rid
        if frames:
            rec.nf = len(frames)  # 0 by default (docs/protocol.md)
        work = Work(self._cancel if cancellable else None)
        work._tag = rid
        work._reader = self.reader
        work._line = line
        # (a request whose owner closed meanwhile is dropped unsent by send_queued)
        self.queue.append((rec, frames, (work, convert, type(rec) is Put, owner)))
        if line.state == CLOSED:
            # the I/O thread ended after the check above and may have failed the queue before
            # this request joined it: fail it here, or a wait() without a timeout would hang
            work.set_exception(ChannelError("this channel handle is closed"))
        return work

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

    def _wait_for_room(self, rec: Request, flow: Flow) -> None:
        """Block until fewer than ``max_inflight`` requests are outstanding.  The wait counts
        against the request's ``timeout``: the rest travels with the request, and
        ``TimeoutError`` (nothing sent) when none is left."""
        timeout = rec.timeout if isinstance(rec, (Put, Get, GetBatch)) else None
        start = time.monotonic()
        line = self._line
        with self._room:
            self._room_waiters += 1
            try:
                while flow.n_issued - flow.completed > self.max_inflight:
                    if line.state in (DOWN, CLOSED):
                        raise BrokerUnavailable(f"the broker at {self.address} is unavailable")
                    wait = line.hb
                    if timeout is not None:
                        remaining = timeout - (time.monotonic() - start)
                        if remaining <= 0:
                            raise TimeoutError(
                                f"{op_of(rec)} timed out waiting for room among this "
                                f"handle's {self.max_inflight} outstanding requests")
                        wait = min(wait, remaining)
                    self._room.wait(wait)
            finally:
                self._room_waiters -= 1
        if timeout is not None and isinstance(rec, (Put, Get, GetBatch)):
            rec.timeout = max(0.0, timeout - (time.monotonic() - start))

    def release(self, owner: Flow | None) -> None:
        """A request of ``owner`` (None: of no handle) completed: its slot is free."""
        flow = self._flow if owner is None else owner
        flow.completed = next(flow.completed_count)
        if self._room_waiters:
            with self._room:
                self._room.notify_all()

    def _cancel(self, work: Work) -> bool:
        if self._line.reads_here():  # its answer could only be read by this thread: refused
            raise RuntimeError(SELF_WAIT)  # before the request goes out
        try:
            answer = self._issue(Cancel(id=0, request_id=work._tag), []).wait()
        except ChannelError:
            return False
        if answer:
            self.forget(work._tag, CancelledError("the broker withdrew the operation"))
        return bool(answer)

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

    def malformed(self, rid: int | None, error: ProtocolError) -> None:
        """A reply from the broker that cannot be read (``error`` says why): the request
        ``rid`` fails, or each of the ``puts``/``gets`` record ``rid`` (``batching.py``);
        without an id (a message unreadable whole, an ``items`` record) it may answer any
        request, so every request in flight fails (none waits for an answer that came)."""
        self.malformed_replies += 1  # (logged at most once per MALFORMED_LOG_S)
        now = time.monotonic()
        if now >= self._malformed_log_at:
            self._malformed_log_at = now + MALFORMED_LOG_S
            log.error("a reply from the broker at %s cannot be read (%d so far): %s", self.address,
                      self.malformed_replies, error)
        failure = ProtocolError(f"the broker at {self.address} sent a reply this client cannot "
                                f"read ({error})")
        if rid is None:
            self.fail_all(failure)
            return
        batch = self.batches.pop(rid, None)
        for each in batch[1] if batch is not None else (rid,):
            self.forget(each, failure)

    def forget(self, rid: int, exc: BaseException) -> None:
        """Fail request ``rid`` with ``exc`` unless its reply came (a later reply is dropped)."""
        pending = self.pending.pop(rid, None)
        if pending is not None:
            self.release(pending[3])
            pending[0].set_exception(exc)

    def send_queued(self) -> None:
        """Send what is queued (by the socket's holder), coalesced into as few messages as the
        limits allow; a request whose handle closed, or a stale put, fails unsent, and so does
        everything queued while the broker is known gone (``DOWN``: its requests in flight were
        failed then, and one sent now would wait for an answer that never comes)."""
        queue = self.queue
        if self._line.state == DOWN:
            self._fail_queued()
            return
        if len(queue) == 1:  # the common case of a blocking call: one request, sent alone
            rec, op_frames, pending = queue.popleft()
            if pending is not None:
                if pending[3] is not None and pending[3].closed or self._stale(rec, pending):
                    self._drop_unsent(rec, pending)
                    return
                self.pending[rec.id] = pending
            self._line.send([rec], op_frames)
            return
        send = self._line.send
        while queue:
            records, frames = self._next_message(queue)
            if records:
                if BATCH and len(records) > 1:
                    records = group_records(self, records)
                send(records, frames)

    def _next_message(self, queue: deque) -> tuple[list[Request], list]:
        """Take from ``queue`` the requests of one message (within the limits of
        ``connection/tuning.py``), moving them to ``pending``: the records and their frames.
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
                    self._drop_unsent(rec, pending)
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
        return records, frames

    def _stale(self, rec: Request, pending: Pending) -> bool:
        """A put whose shared-memory slots were taken in an earlier session of this
        connection (``ShmClient.stale``): it must not go out in this one."""
        return pending[2] and isinstance(rec, Put) and rec.slots is not None \
            and self.shm.stale(rec.slots)

    def _drop_unsent(self, rec: Request, pending: Pending,
                     error: BaseException | None = None) -> None:
        """A request whose handle closed before it went out (``ChannelError``), or a put whose
        slots are stale (``BrokerUnavailable``: sent again, it takes new ones), or ``error``:
        never sent, it fails here."""
        client_undo(self, getattr(rec, "slots", None))  # its shared-memory slots go back to the pool
        self.release(pending[3])
        if error is not None:
            pending[0].set_exception(error)
        elif pending[3] is not None and pending[3].closed:
            pending[0].set_exception(ChannelError("this channel handle is closed"))
        else:
            pending[0].set_exception(BrokerUnavailable(
                f"the broker at {self.address} was restarted (or expired this client) while "
                "this put waited to be sent; nothing was stored"))

    def _fail_queued(self) -> None:
        """Fail what is queued, unsent (the broker is known gone: ``send_queued``)."""
        queue = self.queue
        while queue:
            rec, _, pending = queue.popleft()
            if pending is not None:
                self._drop_unsent(rec, pending, BrokerUnavailable(
                    f"the broker at {self.address} is unavailable (it went away before this "
                    "request was sent); nothing was sent"))

    def after_fork(self) -> None:
        """In a forked child: the requests in flight or queued are the parent's connection's;
        their ``Work`` copies fail here (with fresh locks: a parent's thread may have held
        theirs at the fork), so that a child waiting on one does not wait forever."""
        exc = ChannelError("this request was made before the process forked: it belongs to "
                           "the parent's connection (the child's handles connect anew)")
        entries = [*self.pending.values(), *(e[2] for e in self.queue if e[2] is not None)]
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
        pending = self.pending
        for rid in list(pending):
            entry = pending.pop(rid, None)
            if entry is not None:
                self.release(entry[3])
                entry[0].set_exception(exc)


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
