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
with ``BrokerUnavailable``; when a broker answers again the connection comes back by itself.

Over a direct link (a Unix stream socket to a same-host broker, ``broker/direct.py``) instead
of the DEALER, sending costs one system call, so a caller whose request finds the socket free
sends it itself; and a thread that waits on a ``Work`` reads the link itself (``wait_for``,
like ``call``).  The I/O thread then keeps out of the way: while a thread reads the link, or
did less than ``LAZY_S`` ago, it only looks every ``LAZY_S`` (a stream of waits never wakes it
per reply); a thread that sleeps on a ``Work`` instead, or a done-callback (asyncio), makes it
watch the link at once.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
from zchannel.broker import direct, paths
from zchannel.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    ChannelError,
    ChannelNotFound,
    error_from_wire,
)
from zchannel.broker.protocol import (
    BYE,
    EXPIRED,
    HEARTBEAT,
    HELLO,
    PROTOCOL_VERSION,
    pack_header,
    recv_reply,
    send_message,
)
from zchannel.broker.security import HandshakeWatch
from zchannel.broker.shm import ShmClient
from zchannel.broker.work import _DONE, Work

log = logging.getLogger("zchannel.client")

CONNECTING, UP, DOWN, CLOSED = "connecting", "up", "down", "closed"
_POLLIN = int(zmq.POLLIN)
MAX_OPS_PER_MESSAGE = 512
MAX_BYTES_PER_MESSAGE = 64 << 20
# Inline bodies per message (docs/protocol.md): with 512 records this keeps a header under
# ~100 KiB, far below the broker's max_header_bytes (1 MiB by default)
MAX_INLINE_PER_MESSAGE = 64 << 10
# How long a blocking caller drives the socket itself before leaving its reply to the I/O
# thread (which also keeps the heartbeat, so this stays well below the heartbeat interval).
DRIVE_S = 0.05


def _env_int(name: str, default: int, unit: str) -> int:
    """An int >= 0 from the environment (``ValueError`` naming it otherwise)."""
    text = os.environ.get(name, str(default))
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0 ({unit}), got {text!r}")
    return value


# A blocking call first polls for its reply without sleeping for up to SPIN_US: a reply that
# comes back within it skips two thread wake-ups (on a 2-vCPU VM a raw ZeroMQ round trip takes
# ~100 us with a sleeping recv and ~55 us polling).  A spin that sees its reply scores +1 (up
# to SPIN_SCORE_MAX), one that does not -2; at 0 a handle spins only every SPIN_PROBE-th call
# until a spin sees its reply again (docs/decisions.md).  ZCHANNEL_SPIN_US=0: no spinning.
SPIN_US = _env_int("ZCHANNEL_SPIN_US", 250, "microseconds")
SPIN_PROBE = 32
SPIN_SCORE_MAX = 8


def spin_seconds() -> float:
    """How long a blocking call of this process spins: ``SPIN_US``, or 0 when the process may
    run on one CPU only (its reply can then only come while it does not run)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return SPIN_US / 1e6 if cpus > 1 else 0.0


# Queued async requests a caller sends itself when the socket is free (see ``request``).
SEND_RUN = 16
# How often a handle whose direct link broke tries to connect it again.
RELINK_S = 0.1


# Over a direct link a thread waiting for a reply reads the link itself (``wait_for``).  When
# it stops, the I/O thread takes over only after LAZY_S without a reader, looking every LAZY_S:
# a stream whose waits follow each other then never wakes the I/O thread per reply, and its
# async requests go out together at the next wait, LAZY_S later at most (``request``).
# ZCHANNEL_LAZY_MS=0: the I/O thread always watches and nothing is held back.
LAZY_MS = _env_int("ZCHANNEL_LAZY_MS", 20, "milliseconds")
LAZY_S = LAZY_MS / 1000


def direct_enabled() -> bool:
    """Whether handles of this process use direct links (``ZCHANNEL_DIRECT=0``: never)."""
    return os.environ.get("ZCHANNEL_DIRECT", "1").strip() not in ("0", "false", "no", "off")

Convert = Callable[[dict, list], Any]


# a request in flight: (its Work, its reply converter or None, is it a put)
_Pending = tuple[Work, Convert | None, bool]


class Connection:
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
        self.broker_info: dict[str, Any] = {}
        self._ids = itertools.count(1)
        self._queue: deque[tuple[dict, list, _Pending | None]] = deque()
        self._pending: dict[int, _Pending] = {}
        # Flow control: requests issued minus requests completed.  ``_issued`` is an atomic
        # counter; ``_completed`` is written by the I/O thread only.  Callers wait on
        # ``_room`` only when the limit is reached.
        self._max_inflight = max_inflight
        self._issued = itertools.count()
        self._n_issued = 0
        self._completed = 0
        self._completed_count = itertools.count(1)
        self._room = threading.Condition()
        self._room_waiters = 0
        self._state_cv = threading.Condition()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # closed with this object, not when the I/O thread ends: a thread may still write a
        # wake-up then, which must not reach a descriptor that reused the number
        weakref.finalize(self, os.close, self._wake)
        self._sock_lock = threading.Lock()
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
        self._hello_id = 0
        self.pid = os.getpid()
        self.shm = ShmClient(self, shm)  # same-host shared-memory path (broker/shm.py)
        self.converters: dict[tuple[str, bool | None], Convert] = {}  # reply decoders (client.py)
        # A same-host broker's direct link when there is one (broker/direct.py), else ZeroMQ.
        self._link = self._open_link(address) if curve is None else None
        self._relink_at = 0.0
        self._sock: Any = None
        # a CURVE mismatch fails the connection at once (broker/security.py); set by the I/O
        # thread, which alone reads ``_handshake``
        self.refused: AuthenticationFailed | None = None
        self._handshake: HandshakeWatch | None = None
        if self._link is None:
            ctx = zmq.Context.instance()
            self._sock = ctx.socket(zmq.DEALER)
            try:
                self._sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
                self._sock.setsockopt(zmq.SNDHWM, 0)
                self._sock.setsockopt(zmq.RCVHWM, 0)
                self._sock.setsockopt(zmq.LINGER, 0)
                self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
                self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
                if curve is not None:
                    curve.apply(self._sock)
                self._handshake = HandshakeWatch(self._sock, address, curve)
                self._sock.connect(address)
            except BaseException:  # bad key files: nothing of this connection stays open
                if self._handshake is not None:
                    self._handshake.close()
                self._sock.close(linger=0)
                self.shm.close()
                raise
        # what a poll waits on for replies: the socket, or the link's descriptor
        self._readable: Any = self._sock if self._link is None else self._link.fd
        self._thread = threading.Thread(target=self._run, name=f"zchannel-io {address}", daemon=True)
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

    def request(self, rec: dict, frames: list, convert: Convert | None = None,
                cancellable: bool = False, room: bool = True) -> Work:
        """Send one request; the returned ``Work`` completes with ``convert(reply, frames)``
        (or the reply's ``r`` field) or with the reply's error."""
        work = self._enqueue(rec, frames, convert, cancellable, room)
        if work._state:  # failed already: the handle closed meanwhile
            return work
        if self._link is not None:
            if self._pending and len(self._queue) < SEND_RUN and self._io_lazy \
                    and not self._sock_lock.locked():
                # replies are due and threads read them: the request waits for the next wait
                # (or the I/O thread's look within LAZY_S) and goes out with those after it
                self.held_back += 1
                return work
            if self._sock_lock.acquire(blocking=False):
                # a direct link costs one system call to send on: the caller sends, and wakes
                # the I/O thread only when it sleeps without watching the link
                try:
                    self._send_queued()
                finally:
                    self._sock_lock.release()
                if not self._queue:
                    if self._io_idle:
                        self._wake_io()
                    return work
        # A caller issuing many async requests holds the GIL, so the I/O thread would only
        # send them once the caller blocks; sending full runs from here lets the broker work
        # on one run while the caller issues the next.
        if len(self._queue) >= SEND_RUN and self._sock_lock.acquire(blocking=False):
            try:
                self._send_queued()
            finally:
                self._sock_lock.release()
        self._wake_io()
        return work

    def _wake_io(self) -> None:
        """Make sure the I/O thread wakes (once per batch: it re-arms before each round)."""
        if not self._woken:
            self._woken = True
            os.eventfd_write(self._wake, 1)

    def call(self, rec: dict, frames: list, convert: Convert | None = None,
             cancellable: bool = False) -> Work:
        """``request`` for a caller that waits for the result at once.

        When no other thread holds the socket, the caller sends its request and reads replies
        itself, spinning for up to ``SPIN_US`` and then sleeping in ``poll`` for up to
        ``DRIVE_S`` (a sync round trip without waking the I/O thread twice); whatever is still
        pending after that is completed by the I/O thread as usual."""
        if self.state != UP:
            return self.request(rec, frames, convert, cancellable)
        # queued first: waiting for room (max_inflight) must not hold the socket, or the
        # replies that make room could never be read
        work = self._enqueue(rec, frames, convert, cancellable)
        if work._state:  # failed already: the handle closed meanwhile
            return work
        if not self._sock_lock.acquire(blocking=False):
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
            self._sock_lock.release()
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
        if self.state == UP and not self._closing and os.getpid() == self.pid \
                and self._sock_lock.acquire(blocking=False):
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

    def _enqueue(self, rec: dict, frames: list, convert: Convert | None,
                 cancellable: bool, room: bool = True) -> Work:
        if self.state == CLOSED or self._closing:
            raise ChannelError("this channel handle is closed")
        if self.state == DOWN:
            raise BrokerUnavailable(f"the broker at {self.address} is unavailable")
        self._n_issued = next(self._issued) + 1
        if room and self._n_issued - self._completed > self._max_inflight:
            try:
                self._wait_for_room(rec)
            except BaseException:
                self._release()  # never issued: give its slot back
                raise
        rid = next(self._ids)
        rec["id"] = rid
        if frames:
            rec["nf"] = len(frames)  # 0 by default (docs/protocol.md)
        work = Work(self._cancel if cancellable else None)
        work._tag = rid
        if self._link is not None:
            work._reader = self
        self._queue.append((rec, frames, (work, convert, rec["op"] == "put")))
        if self.state == CLOSED:
            # the I/O thread ended after the check above and may have failed the queue before
            # this request joined it: fail it here, or a wait() without a timeout would hang
            work.set_exception(ChannelError("this channel handle is closed"))
        return work

    def _wait_for_room(self, rec: dict) -> None:
        """Block until fewer than ``max_inflight`` requests are outstanding.  The wait counts
        against the request's ``timeout`` (``rec["t"]``): the rest travels with the request, and
        ``TimeoutError`` (nothing sent) when none is left."""
        timeout = rec.get("t")
        start = time.monotonic()
        with self._room:
            self._room_waiters += 1
            try:
                while self._n_issued - self._completed > self._max_inflight:
                    if self.state in (DOWN, CLOSED):
                        raise BrokerUnavailable(f"the broker at {self.address} is unavailable")
                    wait = self.hb
                    if timeout is not None:
                        remaining = timeout - (time.monotonic() - start)
                        if remaining <= 0:
                            raise TimeoutError(
                                f"{rec.get('op')} timed out waiting for room among this "
                                f"handle's {self._max_inflight} outstanding requests")
                        wait = min(wait, remaining)
                    self._room.wait(wait)
            finally:
                self._room_waiters -= 1
        if timeout is not None:
            rec["t"] = max(0.0, timeout - (time.monotonic() - start))

    def _release(self) -> None:
        # next() on a count is atomic, so a cancel in a user thread cannot lose an increment
        self._completed = next(self._completed_count)
        if self._room_waiters:
            with self._room:
                self._room.notify_all()

    def _cancel(self, work: Work) -> bool:
        rid = work._tag
        try:
            answer = self.request({"op": "cancel", "rid": rid}, []).wait()
        except ChannelError:
            return False
        if answer:
            entry = self._pending.pop(rid, None)
            if entry is not None:
                self._release()
            from concurrent.futures import CancelledError

            work.set_exception(CancelledError("the broker withdrew the operation"))
        return bool(answer)

    def close(self, timeout: float | None = None, bye: bool = True) -> None:
        """Wait (at most the heartbeat expiry) for put acknowledgements, withdraw parked
        requests (``bye``), and close the socket.  Idempotent."""
        if self._closing or self.state == CLOSED:
            return
        if os.getpid() != self.pid:
            self._closing = True
            return  # a forked child never touches its parent's socket
        limit = self.hb * self.liveness if timeout is None else timeout
        deadline = time.monotonic() + limit
        while self.state == UP and time.monotonic() < deadline and (
            self._queue or any(p[2] for p in list(self._pending.values()))
        ):
            time.sleep(0.005)
        if self.state == UP and bye:
            try:
                # past the in-flight limit: a handle full of parked gets must still say bye
                self.request({"op": BYE}, [], room=False).wait(
                    max(0.05, deadline - time.monotonic()))
            except (ChannelError, TimeoutError):
                pass
        self._closing = True
        os.eventfd_write(self._wake, 1)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)

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
        except Exception:  # pragma: no cover - a bug here must not hang callers
            log.exception("zchannel I/O thread failed")
        finally:
            self._set_state(CLOSED)
            self._fail_all(ChannelError("this channel handle is closed"))
            self.shm.close()
            while self._queue:
                _, _, pending = self._queue.popleft()
                if pending is not None:
                    self._release()
                    pending[0].set_exception(ChannelError("this channel handle is closed"))
            with self._sock_lock:  # a blocking caller may still be reading it
                if self._link is not None:
                    self._link.close()
                else:
                    if self._handshake is not None:
                        self._handshake.close()
                    sock.close(linger=0)

    def _watch_handshake(self) -> bool:
        """Read the handshake events (I/O thread, holding the socket); True once watching
        ended: a handshake succeeded, or one was refused (which fails every request)."""
        watch = self._handshake
        refused = watch.check()
        if refused is None and not watch.done:
            return False
        self._handshake = None
        watch.close()
        if refused is not None:
            self.refused = refused
            self._fail_all(refused)
            with self._state_cv:
                self._state_cv.notify_all()
        return True

    def _set_state(self, state: str) -> None:
        with self._state_cv:
            self.state = state
            self._state_cv.notify_all()

    def _send(self, records: list[dict], frames: list) -> None:
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
        self._send([{"op": HELLO, "id": self._hello_id, "ident": self.identity,
                     "v": PROTOCOL_VERSION}], [])

    def _send_queued(self) -> None:
        queue = self._queue
        if len(queue) == 1:  # the common case of a blocking call: one request, sent alone
            rec, frames, pending = queue.popleft()
            if pending is not None:
                self._pending[rec["id"]] = pending
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
                    self._pending[rec["id"]] = pending
                records.append(rec)
                if op_frames:
                    frames.extend(op_frames)
                    nbytes += sum(rec.get("fs") or ())
                elif "b" in rec:
                    inline += len(rec["b"])
            self._send(records, frames)

    def _recv_all(self) -> None:
        while self._recv_one():
            pass

    def _recv_one(self, ready: bool = False) -> bool:
        """Read and complete one message if there is one; False if there was none.
        ``ready``: a poll just said one is there."""
        if self._link is not None:
            parts = self._link.recv()
            if parts is None:
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
            records = msgpack.unpackb(header, raw=False, strict_map_key=False)
        except Exception:
            log.warning("dropped a malformed reply from the broker")
            return
        pos = 0
        for rec in records:
            nf = rec.get("nf", 0)
            self._on_reply(rec, frames[pos : pos + nf])
            pos += nf

    def _on_reply(self, rec: dict, frames: list) -> None:
        rid = rec.get("id")
        if rid is None:
            op = rec.get("op")
            if op == EXPIRED:
                log.warning("the broker at %s expired this client: registering again", self.address)
                self._fail_all(BrokerUnavailable("the broker expired this client (it was silent "
                                                 "too long); the request was dropped"))
                self._send_hello()
            return
        if rid == self._hello_id:
            self.broker_info = rec.get("r") or {}
            self._adopt_heartbeat(self.broker_info)
            self.shm.on_hello(self.broker_info)
            if self.state != UP:
                self._set_state(UP)
            return
        pending = self._pending.pop(rid, None)
        if pending is None:
            return
        self._release()
        work, convert, _ = pending
        if "e" in rec:
            work.set_exception(error_from_wire(rec["e"]))
        elif convert is not None:
            work._finish(_DONE, (rec, frames), convert)  # converted by its first reader
        else:
            work._finish(_DONE, rec.get("r"))

    def _adopt_heartbeat(self, info: dict) -> None:
        """Both sides keep the broker's heartbeat interval and liveness (its hello reply
        says them): a broker set to expire clients sooner (or later) is judged the same way."""
        hb, liveness = info.get("hb"), info.get("liveness")
        if (isinstance(hb, (int, float)) and not isinstance(hb, bool) and 0 < hb <= 3600
                and isinstance(liveness, int) and not isinstance(liveness, bool)
                and 1 <= liveness <= 1000):
            self.hb, self.liveness = float(hb), liveness
            if self._link is not None:
                self._link.stall_s = self.hb * liveness

    def _fail_all(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            self._release()
            entry[0].set_exception(exc)

    def _keepalive(self, now: float) -> None:
        link = self._link
        if link is not None and not link.up and now >= self._relink_at:
            # the broker closed the link (it stopped, or died): connect to its successor, if
            # there is one yet; the heartbeat rules below decide as they do for ZeroMQ
            self._relink_at = now + RELINK_S
            if link.reconnect() and self.state != UP:
                self._send_hello()
        # life is any bytes from the broker, not only whole messages: a reply of many large
        # frames takes a while to arrive, and the broker's heartbeats queue behind it
        silent = now - max(self._last_recv, link.last_read if link is not None else 0.0)
        if self.state in (UP, CONNECTING) and silent > self.hb * self.liveness:
            self._recv_all()  # what waits unread (this thread was held up) is life too
            silent = now - max(self._last_recv, link.last_read if link is not None else 0.0)
        if self.state in (UP, CONNECTING) and silent > self.hb * self.liveness:
            if self.state == UP:
                log.warning("the broker at %s is silent for %.1fs: unavailable", self.address, silent)
            self._set_state(DOWN)
            self._fail_all(BrokerUnavailable(
                f"the broker at {self.address} did not answer for {silent:.1f}s"))
        if self.state == DOWN:
            if now - self._last_send >= self.hb:
                self._send_hello()
        elif now - self._last_send >= self.hb:
            self._send([{"op": HEARTBEAT, "id": 0}], [])


def probe(address: str) -> None:
    """Raise ``ChannelNotFound`` at once when nothing can be listening at ``address``."""
    from zchannel.broker import paths

    ipc = paths.ipc_path(address)
    if ipc is not None:
        if not os.path.exists(ipc):
            raise ChannelNotFound(f"no broker at {address} (no socket file)")
        return
    hp = paths.tcp_host_port(address)
    if hp is None:
        raise ValueError(f"address must be ipc://PATH or tcp://HOST:PORT, got {address!r}")
    import socket

    try:
        with socket.create_connection(hp, timeout=2.0):
            pass
    except ConnectionRefusedError:
        raise ChannelNotFound(f"no broker at {address} (connection refused)") from None
    except OSError:
        pass  # unreachable or slow: let the hello decide
