"""The client side of the wire: one DEALER socket owned by one I/O thread.

User threads hand requests to the I/O thread (a deque and an eventfd wake-up) and wait on
``Work`` handles, which the I/O thread completes when replies arrive.  Requests queued together
are coalesced into one message.  A blocking call (``call``) skips the two thread hand-offs when
the socket is free: it takes the socket lock, sends, polls for its reply without sleeping for
up to ``SPIN_US``, then waits for it in ``poll`` for a short while (``DRIVE_S``), completing
every reply it reads, and hands the socket back.  Whoever holds
``_sock_lock`` is the only thread touching the socket (zmq sockets are not thread-safe): the
I/O thread waits on the socket's notification fd, not on the socket.  The I/O thread also keeps
the heartbeat: when the broker is silent for ``liveness`` intervals every pending request fails
with ``BrokerUnavailable``; when a broker answers again the connection comes back by itself
(``liveness.py``).

Over a direct link (a Unix stream socket to a same-host broker, ``broker/direct.py``) instead
of the DEALER, sending costs one system call, so a caller whose request finds the socket free
sends it itself; and a thread that waits on a ``Work`` reads the link itself (``wait_for``,
like ``call``).  The I/O thread then keeps out of the way: while a thread reads the link, or
did less than ``LAZY_S`` ago, it only looks every ``LAZY_S`` (a stream of waits never wakes it
per reply); a thread that sleeps on a ``Work`` instead, or a done-callback (asyncio), makes it
watch the link at once.

Shutdown (``stop``; ``sharing.py`` shares a connection among a process's handles): the I/O
thread says bye, fails what is left and, as its last act, closes the socket or link and its
wake-up eventfd, holding the locks every other thread takes before it touches them.  No
finalizer closes a descriptor (one run at exit could close it under a polling thread).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
from zchannel.broker import direct, paths
from zchannel.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    ChannelError,
    error_from_wire,
)
from zchannel.broker.liveness import CLOSED, CONNECTING, DOWN, GONE_CHECK_S, UP, Liveness
from zchannel.broker.protocol import (
    EXPIRED,
    PROTOCOL_VERSION,
    UNSET,
    Bye,
    Cancel,
    Hello,
    HelloInfo,
    ProtocolError,
    Put,
    Reply,
    Request,
    client_socket,
    hello_info,
    op_of,
    pack_header,
    recv_reply,
    send_message,
    unpack_replies,
)
from zchannel.broker.security import HandshakeWatch
from zchannel.broker.shm.client import ShmClient, client_undo
from zchannel.broker.tuning import (
    DRIVE_S,
    LAZY_MS,
    LAZY_S,
    MAX_BYTES_PER_MESSAGE,
    MAX_INLINE_PER_MESSAGE,
    MAX_OPS_PER_MESSAGE,
    SEND_RUN,
    SPIN_PROBE,
    SPIN_SCORE_MAX,
    direct_enabled,
    spin_seconds,
)
from zchannel.broker.tuning import (
    SPIN_US as SPIN_US,
)
from zchannel.broker.work import _DONE, CancelledError, Work

log = logging.getLogger("zchannel.client")

_POLLIN = int(zmq.POLLIN)
# Closing: how long the I/O thread waits for the broker's answer to bye (an answer means the
# broker withdrew this connection's parked requests), how often a wait on a silent broker checks
# whether anything still listens at its ipc path, and how long a close waits for the I/O thread.
BYE_WAIT_S = 1.0
JOIN_S = 5.0


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


# connections whose I/O thread may still run (sharing.close_all stops them at interpreter exit)
running: weakref.WeakSet[Connection] = weakref.WeakSet()


class Connection(Liveness):
    """A connection to one broker address (see the module docstring)."""

    def __init__(
        self,
        address: str,
        identity: str | None = None,
        heartbeat_interval: float = 1.0,
        liveness: int = 3,
        max_inflight: int = 1024,
        curve: Any = None,
        shm: bool | None = None,
    ) -> None:
        self.address = address
        self.identity = identity
        self.hb = heartbeat_interval
        self.liveness = liveness
        self.state = CONNECTING
        self.broker_info = HelloInfo()
        self._ids = itertools.count(1)
        self._queue: deque[tuple[dict, list, _Pending | None]] = deque()
        self._pending: dict[int, _Pending] = {}
        # Flow control per handle (``Flow``: its share, or this connection's own for requests
        # of no handle).  Callers wait on ``_room`` only when the limit is reached.
        self._max_inflight = max_inflight
        self._flow = Flow()
        self._room = threading.Condition()
        self._room_waiters = 0
        self._state_cv = threading.Condition()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # closed by the I/O thread as its last act, under this lock: a wake-up written later
        # must not reach a descriptor that reused the number (``_wake_io``)
        self._wake_lock = threading.Lock()
        self._wake_closed = False
        self._sock_lock = threading.Lock()
        self._holder = 0  # the user thread that holds _sock_lock (close() must not join then)
        self._fds_closed = False  # the I/O thread closed the socket or link (under _sock_lock)
        self._woken = False  # an eventfd wake-up is pending (saves a system call per request)
        self._read_end = 0.0  # when a waiting thread last stopped reading the link
        self._sleepers = 0  # threads asleep in wait_for (the I/O thread then watches the link)
        self._sleepers_lock = threading.Lock()
        self.io_turns = 0  # I/O thread wake-ups (tests check that a stream needs few)
        self.held_back = 0  # requests held back to go out with later ones (``request``)
        self._io_idle = True  # the I/O thread sleeps without watching the socket (see _run)
        self._io_lazy = False  # the I/O thread looks again within LAZY_S (see _run)
        self._spin_s = spin_seconds()
        self._spin_score = SPIN_SCORE_MAX  # a hit adds 1, a miss takes 2; spin while > 0
        self._calls = itertools.count()
        self._closing = False
        self._bye = True  # the I/O thread says bye when it stops (close(bye=False): it does not)
        self._bye_id: int | None = None  # the bye awaiting its answer
        self._hello_id = 0
        self.pid = os.getpid()
        self.shm = ShmClient(self, shm)  # same-host shared-memory path (broker/shm/client.py)
        self.converters: dict[tuple[type, bool | None], Convert] = {}  # reply decoders (client.py)
        self._relink_at = 0.0
        self._sock: Any = None
        # a CURVE mismatch fails the connection at once (broker/security.py); set by the I/O
        # thread, which alone reads ``_handshake``
        self.refused: AuthenticationFailed | None = None
        self._handshake: HandshakeWatch | None = None
        self._link: direct.Link | None = None
        try:
            # A same-host broker's direct link when there is one (broker/direct.py), else ZeroMQ.
            self._link = self._open_link(address) if curve is None else None
            if self._link is None:
                self._sock = client_socket(curve)
                self._handshake = HandshakeWatch(self._sock, address, curve)
                self._sock.connect(address)
        except BaseException:  # bad key files: nothing of this connection stays open
            self._close_fds()
            self.shm.close()
            raise
        # what a poll waits on for replies: the socket, or the link's descriptor
        self._readable: Any = self._sock if self._link is None else self._link.fd
        self._thread = threading.Thread(target=self._run, name=f"zchannel-io {address}", daemon=True)
        running.add(self)
        self._thread.start()

    def _open_link(self, address: str) -> direct.Link | None:
        path = direct.link_path(paths.ipc_path(address) or "")
        # only beside shared memory: large arrays then bypass the link, and libzmq's I/O
        # threads move large frames faster than a Python loop (docs/decisions.md)
        if path is None or not self.shm.enabled or not direct_enabled() \
                or not os.path.exists(path):
            return None
        try:
            return direct.Link(path, stall_s=self.hb * self.liveness)
        except OSError:  # no broker listening there (yet): ZeroMQ connects when one is
            return None

    # -- user-thread side --------------------------------------------------------------------

    def wait_up(self, timeout: float) -> bool:
        """Wait until the broker answered the hello; False on timeout, or at once when the
        handshake was refused (``refused`` then says why)."""
        deadline = time.monotonic() + timeout
        with self._state_cv:
            while self.state != UP:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.state == CLOSED or self.refused is not None:
                    return False
                self._state_cv.wait(remaining)
        return True

    def request(self, rec: Request, frames: list, convert: Convert | None = None,
                cancellable: bool = False, room: bool = True, owner: Any = None) -> Work:
        """Send one request; the returned ``Work`` completes with ``convert(reply, frames)``
        (or the reply's ``r`` field) or with the reply's error.  ``owner``: the share of the
        handle that issues it (``sharing.Share``; its close withdraws the request)."""
        work = self._enqueue(rec, frames, convert, cancellable, room, owner)
        if work._state:  # failed already: the handle closed meanwhile
            return work
        if self._link is not None:
            if self._pending and len(self._queue) < SEND_RUN and self._io_lazy \
                    and not self._sock_lock.locked():
                # replies are due and threads read them: the request waits for the next wait
                # (or the I/O thread's look within LAZY_S) and goes out with those after it
                self.held_back += 1
                return work
            if self._take():
                # a direct link costs one system call to send on: the caller sends, and wakes
                # the I/O thread only when it sleeps without watching the link
                try:
                    self._send_queued()
                finally:
                    self._give()
                if not self._queue:
                    if self._io_idle:
                        self._wake_io()
                    return work
        # A caller issuing many async requests holds the GIL, so the I/O thread would only
        # send them once the caller blocks; sending full runs from here lets the broker work
        # on one run while the caller issues the next.
        if len(self._queue) >= SEND_RUN and self._take():
            try:
                self._send_queued()
            finally:
                self._give()
        self._wake_io()
        return work

    def _take(self) -> bool:
        """Take the socket for this (user) thread if it is free and still open."""
        if not self._sock_lock.acquire(blocking=False):
            return False
        if self._fds_closed:
            self._sock_lock.release()
            return False
        self._holder = threading.get_ident()
        return True

    def _give(self) -> None:
        self._holder = 0
        self._sock_lock.release()

    def _wake_io(self) -> None:
        """Make sure the I/O thread wakes (once per batch: it re-arms before each round)."""
        if not self._woken:
            self._woken = True
            self._signal()

    def _signal(self) -> None:
        """Write a wake-up, unless the I/O thread closed the eventfd (it ended)."""
        with self._wake_lock:
            if not self._wake_closed:
                os.eventfd_write(self._wake, 1)

    def call(self, rec: Request, frames: list, convert: Convert | None = None,
             cancellable: bool = False, owner: Any = None) -> Work:
        """``request`` for a caller that waits for the result at once.

        When no other thread holds the socket, the caller sends its request and reads replies
        itself, spinning for up to ``SPIN_US`` and then sleeping in ``poll`` for up to
        ``DRIVE_S`` (a sync round trip without waking the I/O thread twice); whatever is still
        pending after that is completed by the I/O thread as usual."""
        if self.state != UP:
            return self.request(rec, frames, convert, cancellable, owner=owner)
        # queued first: waiting for room (max_inflight) must not hold the socket, or the
        # replies that make room could never be read
        work = self._enqueue(rec, frames, convert, cancellable, owner=owner)
        if work._state:  # failed already: the handle closed meanwhile
            return work
        if not self._take():
            self._wake_io()
            return work
        spin = bool(self._spin_s) and (
            self._spin_score > 0 or next(self._calls) % SPIN_PROBE == 0)
        self._read_for(work, DRIVE_S, spin)
        return work

    def _read_for(self, work: Work, limit: float, spin: bool = False) -> None:
        """With ``_sock_lock`` taken by the caller (released here): send what is queued, read
        replies until ``work`` completes (spinning first if ``spin``), for up to ``limit``."""
        took_wake = False
        try:
            self._send_queued()
            if spin:
                self._spin(work)
            if work._state == 0:
                took_wake = self._drive(work, limit)
        finally:  # also when interrupted (KeyboardInterrupt): the request stays pending
            self._read_end = time.monotonic()
            self._give()
            if took_wake or self._queue or (self._pending and self._link is None):
                # the I/O thread takes over the rest (this caller may have consumed the
                # socket's notification edge, so it must look at the socket itself)
                self._wake_io()

    def _spin(self, work: Work) -> None:
        """Poll for ``work``'s reply without sleeping, for up to ``SPIN_US``."""
        poll_set = [(self._readable, _POLLIN)]
        poll = zmq.zmq_poll
        end = time.perf_counter() + self._spin_s
        while work._state == 0 and not self._closing:
            if poll(poll_set, 0):
                self._recv_one(ready=True)
            elif time.perf_counter() >= end:
                self._spin_score = max(0, self._spin_score - 2)
                return
            if self._queue:  # other threads' requests go out at once, not after this reply
                self._send_queued()
        self._spin_score = min(SPIN_SCORE_MAX, self._spin_score + 1)

    def wait_for(self, work: Work, timeout: float | None) -> None:
        """``Work.wait`` over a direct link: unless another thread has the socket, read the link
        until ``work`` completes, for up to ``DRIVE_S``; then (or else) sleep until the I/O
        thread completes it, for the rest of ``timeout``.  Replies that come while nobody reads
        are the I/O thread's once ``LAZY_S`` passed without a reader."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        if self.state == UP and not self._closing and os.getpid() == self.pid and self._take():
            limit = DRIVE_S if deadline is None else min(DRIVE_S, deadline - time.monotonic())
            self._read_for(work, max(0.0, limit))
            if work._state:
                return
        # sleep on the gate: the I/O thread must watch the link now, not in LAZY_S
        with self._sleepers_lock:
            self._sleepers += 1
        try:
            self._wake_io()
            remaining = -1 if deadline is None else max(0.0, deadline - time.monotonic())
            if work._gate.acquire(timeout=remaining):
                work._gate.release()
        finally:
            with self._sleepers_lock:
                self._sleepers -= 1

    def watch(self) -> None:
        """Make the I/O thread watch the direct link now (a Work got a done-callback, e.g. an
        asyncio await: no thread may come to read its reply)."""
        self._read_end = 0.0
        self._wake_io()

    def _drive(self, work: Work, limit: float = DRIVE_S) -> bool:
        """Wait for ``work``'s reply for up to ``limit``, reading replies and sending what
        other threads queue meanwhile: their wake-up of the I/O thread wakes this caller too
        (the I/O thread, finding the socket taken, writes it again for this caller).  True if
        it took such a wake-up: the caller passes it on when it lets the socket go."""
        sock, wake = self._readable, self._wake
        poll_set = [(sock, _POLLIN), (wake, _POLLIN)]
        took_wake = False
        deadline = time.monotonic() + limit
        while work._state == 0 and not self._closing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for obj, _ in zmq.zmq_poll(poll_set, int(remaining * 1000.0) + 1):
                if obj != wake:
                    self._recv_one(ready=True)
                else:
                    try:
                        os.eventfd_read(wake)
                    except BlockingIOError:  # the I/O thread read it first
                        pass
                    self._woken = False
                    took_wake = True
            if self._queue:
                self._send_queued()
        return took_wake

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
        if self._link is not None:
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

    def stop(self, bye: bool = True) -> None:
        """Ask the I/O thread to end: it says bye (``bye``), fails what is left and closes the
        descriptors last.  Waiting for put acknowledgements is the caller's (``sharing``)."""
        if os.getpid() == self.pid and not self._closing:
            self._bye = bye
            self._closing = True
            self._signal()

    def holds_socket(self) -> bool:
        """Whether the caller is the I/O thread or drives the socket (a done-callback or a
        finalizer can run there): it must not wait for replies or for the I/O thread."""
        return threading.get_ident() in (self._thread.ident, self._holder)

    def join(self, timeout: float = JOIN_S) -> None:
        """Wait for the I/O thread to end (unless ``holds_socket``: it needs the socket)."""
        if os.getpid() == self.pid and not self.holds_socket():
            self._thread.join(timeout)

    def close(self, bye: bool = True) -> None:
        """``stop`` and ``join``.  Idempotent."""
        self.stop(bye)
        self.join()

    # -- I/O thread --------------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._sock
        # This thread waits without touching the socket: a zmq socket is not thread-safe and a
        # blocking caller (``call``) may be using it.  It polls the socket's notification fd
        # (ZMQ_FD: readable when the socket's state may have changed) and reads the socket only
        # under ``_sock_lock``, always until it is empty (which re-arms ZMQ_FD).  That fd is
        # polled only while this thread waits for replies; an idle handle's incoming heartbeats
        # are read at the next tick, and a caller driving the socket is not raced for its reply.
        with self._sock_lock:
            notify_fd = sock.getsockopt(zmq.FD) if self._link is None else self._link.fd
            self._send_hello()
            self._recv_all()  # re-arms ZMQ_FD after the send
        idle_poll = [(self._wake, _POLLIN)]
        busy_poll = [(notify_fd, _POLLIN), (self._wake, _POLLIN)]
        if self._handshake is not None:  # until the first handshake ends (not connecting: idle)
            busy_poll.append((self._handshake.socket, _POLLIN))
        now = time.monotonic()
        self._last_recv = now
        self._last_send = 0.0
        try:
            while not self._closing:
                self.io_turns += 1
                self._io_idle = True  # before the test: a request that misses it wakes us
                self._io_lazy = False
                busy = self._pending or self._queue or self.state != UP
                timeout = int(self.hb * 500)  # the broker's interval once it said hello
                if LAZY_MS and self._link is not None and not self._sleepers and (
                    self._sock_lock.locked() or time.monotonic() - self._read_end < LAZY_S
                ):
                    # waiting threads read the link: look again in LAZY_S (also with nothing
                    # due now: in a stream the next request comes at once); requests held
                    # back meanwhile (``request``) go out then at the latest
                    busy, timeout = False, LAZY_MS
                    self._io_idle = False
                    if self._queue and not self._sock_lock.locked():
                        timeout = 0  # held back before this turn: out now
                    else:
                        self._io_lazy = True
                elif busy:
                    self._io_idle = False
                zmq.zmq_poll(busy_poll if busy else idle_poll, timeout)
                try:
                    os.eventfd_read(self._wake)
                    woken = True
                except BlockingIOError:
                    woken = False
                # cleared after the read: a wake-up written before it is consumed here, and the
                # request behind it is seen below; one written after it stays pending
                self._woken = False
                if not self._sock_lock.acquire(blocking=False):
                    if not woken and self._link is not None:
                        continue  # a reader has the link; look again in LAZY_S
                    # a blocking caller drives the socket (``_drive``, which polls the eventfd
                    # too): pass the wake-up on to it, so that queued requests go out now
                    os.eventfd_write(self._wake, 1)
                    self._sock_lock.acquire()
                try:
                    if self._handshake is not None and self._watch_handshake():
                        busy_poll = busy_poll[:2]
                    if self._queue:
                        self._send_queued()
                    self._keepalive(time.monotonic())
                    # last, after every send: ZMQ_FD only signals again once the socket was
                    # read until empty (a send may consume a pending notification)
                    self._recv_all()
                finally:
                    self._sock_lock.release()
            if self._bye and self.state == UP:
                self._say_bye()
        except Exception:  # pragma: no cover - a bug here must not hang callers
            log.exception("zchannel I/O thread failed")
        finally:
            self._set_state(CLOSED)
            self._fail_all(ChannelError("this channel handle is closed"))
            self.shm.close()
            while self._queue:
                _, _, pending = self._queue.popleft()
                if pending is not None:
                    self._release(pending[3])
                    pending[0].set_exception(ChannelError("this channel handle is closed"))
            with self._sock_lock:  # a blocking caller may still be reading it
                self._close_fds()
            running.discard(self)

    def _close_fds(self) -> None:
        """Close the socket or link and the wake-up eventfd (with the socket lock taken, or
        before any thread could use them)."""
        self._fds_closed = True
        if self._link is not None:
            self._link.close()
        elif self._sock is not None:
            if self._handshake is not None:
                self._handshake.close()
                self._handshake = None
            self._sock.close(linger=0)
        with self._wake_lock:
            if not self._wake_closed:
                self._wake_closed = True
                os.close(self._wake)

    def _say_bye(self) -> None:
        """Say bye and wait (at most ``BYE_WAIT_S``, less when the broker is gone) for the answer:
        the broker then withdrew this connection's parked requests (no item goes to them)."""
        with self._sock_lock:  # whoever drove the socket left it on seeing _closing
            self._send_queued()
            self._bye_id = next(self._ids)
            self._send([Bye(id=self._bye_id)], [])
            deadline = time.monotonic() + BYE_WAIT_S
            poll_set = [(self._readable, _POLLIN)]
            while self._bye_id is not None and self.state == UP:
                if self._link is not None and not self._link.up:
                    return  # the broker closed the link: it saw this connection end
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                if zmq.zmq_poll(poll_set, int(min(remaining, GONE_CHECK_S) * 1000) + 1):
                    self._recv_all()
                elif self.broker_gone():
                    return

    def _set_state(self, state: str) -> None:
        with self._state_cv:
            self.state = state
            self._state_cv.notify_all()

    def _send(self, records: list, frames: list) -> None:
        if self._link is not None:
            self._link.send([pack_header(records), *frames])  # lost if the link broke
        else:
            try:
                # never blocks with a peer (no high-water mark); without one (libzmq drops the
                # peer for good after a failed handshake) the message is lost, as over a broken
                # link, instead of blocking this thread for ever
                send_message(self._sock, [pack_header(records), *frames], nonblock=True)
            except zmq.Again:
                pass
        self._last_send = time.monotonic()

    def _send_hello(self) -> None:
        self._hello_id = next(self._ids)
        self._send([Hello(id=self._hello_id, identity=self.identity, version=PROTOCOL_VERSION)], [])

    def _send_queued(self) -> None:
        queue = self._queue
        if len(queue) == 1:  # the common case of a blocking call: one request, sent alone
            rec, frames, pending = queue.popleft()
            if pending is not None:
                if pending[3] is not None and pending[3].closed:
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
                    if pending[3] is not None and pending[3].closed:
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
                self._send(records, frames)

    def _drop_unsent(self, rec: Request, pending: _Pending) -> None:
        """A request whose handle closed before it went out: never sent, it fails here."""
        client_undo(self, getattr(rec, "slots", None))  # its shared-memory slots go back to the pool
        self._release(pending[3])
        pending[0].set_exception(ChannelError("this channel handle is closed"))

    def _recv_all(self) -> None:
        while self._recv_one():
            pass

    def _recv_one(self, ready: bool = False) -> bool:
        """Read and complete one message if there is one; False if there was none.
        ``ready``: a poll just said one is there."""
        if self._link is not None:
            parts = self._link.recv()
            if parts is None:
                if not self._link.up and self.state == UP:
                    now = time.monotonic()
                    if now >= self._relink_at:
                        self._relink(now)
                return False
            self._on_message(parts[0], parts[1:])
            return True
        message = recv_reply(self._sock, ready)
        if message is None:
            return False
        self._on_message(*message)
        return True

    def _on_message(self, header: bytes, frames: list) -> None:
        self._last_recv = time.monotonic()
        try:
            records = unpack_replies(header)
        except ProtocolError as exc:
            log.warning("dropped a malformed reply from the broker: %s", exc)
            return
        pos = 0
        for rec in records:
            nf = rec.nf
            self._on_reply(rec, frames[pos : pos + nf])
            pos += nf

    def _on_reply(self, rec: Reply, frames: list) -> None:
        rid = rec.id
        if rid is None:
            if rec.op == EXPIRED:
                log.warning("the broker at %s expired this client: registering again", self.address)
                self._fail_all(BrokerUnavailable("the broker expired this client (it was silent "
                                                 "too long); the request was dropped"))
                self._send_hello()
            return
        if rid == self._bye_id:
            self._bye_id = None
            return
        if rid == self._hello_id:
            self.broker_info = hello_info(rec.result)
            self._adopt_heartbeat(self.broker_info)
            self.shm.on_hello(self.broker_info)
            if self.state != UP:
                self._set_state(UP)
            return
        pending = self._pending.pop(rid, None)
        if pending is None:
            return
        self._release(pending[3])
        work, convert, _, _ = pending
        if rec.error is not None:
            work.set_exception(error_from_wire(rec.error))
        elif convert is not None:
            work._finish(_DONE, (rec, frames), convert)  # converted by its first reader
        else:
            work._finish(_DONE, rec.result)

    def _adopt_heartbeat(self, info: HelloInfo) -> None:
        """Both sides keep the broker's heartbeat interval and liveness (its hello reply
        says them): a broker set to expire clients sooner (or later) is judged the same way."""
        hb, liveness = info.hb, info.liveness
        if (isinstance(hb, (int, float)) and not isinstance(hb, bool) and 0 < hb <= 3600
                and isinstance(liveness, int) and not isinstance(liveness, bool)
                and 1 <= liveness <= 1000):
            self.hb, self.liveness = float(hb), liveness
            if self._link is not None:
                self._link.stall_s = self.hb * liveness

    def _fail_all(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            self._release(entry[3])
            entry[0].set_exception(exc)
