"""The client side of the wire: one transport to the broker owned by one I/O thread.

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
(``connection/liveness.py``).

Over a direct link (a Unix stream socket to a same-host broker, ``broker/transport/direct.py``) instead
of the DEALER, sending costs one system call, so a caller whose request finds the socket free
sends it itself; and a thread that waits on a ``Work`` reads the link itself (``wait_for``,
like ``call``).  The I/O thread then keeps out of the way: while a thread reads the link, or
did less than ``LAZY_S`` ago, it only looks every ``LAZY_S`` (a stream of waits never wakes it
per reply); a thread that sleeps on a ``Work`` instead, or a done-callback (asyncio), makes it
watch the link at once.

Shutdown (``stop``; ``connection/sharing.py`` shares a connection among a process's handles): the I/O
thread says bye, fails what is left and, as its last act, closes the socket or link and its
wake-up eventfd, holding the locks every other thread takes before it touches them.  No
finalizer closes a descriptor (one run at exit could close it under a polling thread).

``Connection`` is made of one part per responsibility, each in its own module and all sharing
the connection's attributes: ``transport/seam.py`` (the seam: the DEALER socket or the direct link
behind one interface, chosen at connect time; the connection holds it as ``transport``),
``connection/requestqueue.py`` (the request queue, coalescing, the requests in flight, flow control),
``connection/waiting.py`` (``call``, ``wait_for``: callers that read the socket themselves, and wake-ups of
the I/O thread), ``connection/liveness.py`` (hello, bye, heartbeats, expiry, relinking, the CURVE
handshake) and ``connection/iothread.py`` (the I/O thread's loop and its last acts).  This module keeps the
choice of transport (``open_transport``), the public surface and the path of an incoming
message (``_recv_one``, ``_on_message``, ``_on_reply``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from zchannel.broker.connection.batching import on_batch_reply
from zchannel.broker.connection.iothread import IOThread, running
from zchannel.broker.connection.liveness import CLOSED, CONNECTING, DOWN, UP, Liveness
from zchannel.broker.connection.requestqueue import Convert, Flow, RequestQueue
from zchannel.broker.connection.tuning import SEND_RUN, direct_enabled
from zchannel.broker.connection.tuning import (
    SPIN_US as SPIN_US,
)
from zchannel.broker.connection.waiting import Waiting
from zchannel.broker.connection.work import _DONE, Work
from zchannel.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    error_from_wire,
)
from zchannel.broker.host import paths
from zchannel.broker.shm.client import ShmClient
from zchannel.broker.transport import direct
from zchannel.broker.transport.seam import Transport, ZmqTransport
from zchannel.broker.wire.protocol import (
    EXPIRED,
    HelloInfo,
    ProtocolError,
    Reply,
    Request,
    hello_info,
    pack_header,
    unpack_replies,
)

log = logging.getLogger("zchannel.client")

# How long a close waits for the I/O thread.
JOIN_S = 5.0

__all__ = ["CLOSED", "DOWN", "UP", "Connection", "Convert", "Flow", "JOIN_S", "open_transport",
           "running"]


def open_transport(address: str, curve: Any, stall_s: float, direct_ok: bool) -> Transport:
    """A same-host broker's direct link when there is one and ``direct_ok`` (never with CURVE),
    else a DEALER socket connected to ``address`` (``ValueError`` for bad key files)."""
    if curve is None and direct_ok:
        path = direct.link_path(paths.ipc_path(address) or "")
        if path is not None and os.path.exists(path):
            try:
                return direct.Link(path, stall_s=stall_s)
            except OSError:  # no broker listening there (yet): ZeroMQ connects when one is
                pass
    return ZmqTransport(address, curve)


class Connection(IOThread, Liveness, Waiting, RequestQueue):
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
        self._last_recv = time.monotonic()  # life from the broker (``Liveness.silent_for``)
        self.broker_info = HelloInfo()
        self._init_requests(max_inflight)
        self._init_waiting()
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
        self.io_turns = 0  # I/O thread wake-ups (tests check that a stream needs few)
        self._io_idle = True  # the I/O thread sleeps without watching the socket (see _run)
        self._io_lazy = False  # the I/O thread looks again within LAZY_S (see _run)
        self._closing = False
        self._bye = True  # the I/O thread says bye when it stops (close(bye=False): it does not)
        self._bye_id: int | None = None  # the bye awaiting its answer
        self._hello_id = 0
        # retry-safe puts: this connection's producer id, the same across its reconnects; its
        # puts' request ids are their sequence numbers (broker/server/producers.py)
        self.producer = os.urandom(16)
        self.pid = os.getpid()
        self.shm = ShmClient(self, shm)  # same-host shared-memory path (broker/shm/client.py)
        self.converters: dict[tuple[type, bool | None], Convert] = {}  # reply decoders (client.py)
        self._relink_at = 0.0
        # a CURVE mismatch fails the connection at once (broker/transport/curve.py); set by the I/O
        # thread, which alone reads the transport's ``handshake``
        self.refused: AuthenticationFailed | None = None
        self.transport: Transport | None = None
        try:
            # A same-host broker's direct link when there is one (broker/transport/direct.py), else
            # ZeroMQ; the link only beside shared memory: large arrays then bypass the link, and
            # libzmq's I/O threads move large frames faster than a Python loop
            # (docs/decisions.md)
            self.transport = open_transport(address, curve, self.hb * self.liveness,
                                            self.shm.enabled and direct_enabled())
        except BaseException:  # bad key files: nothing of this connection stays open
            self._close_fds()
            self.shm.close()
            raise
        # callers send and read it themselves (the direct link; see waiting.py)
        self._callers_read = self.transport.callers_read
        # what a poll waits on for replies: the socket, or the link's descriptor
        self._readable: Any = self.transport.readable
        self._thread = threading.Thread(target=self._run, name=f"zchannel-io {address}", daemon=True)
        running.add(self)
        self._thread.start()

    @property
    def direct(self) -> bool:
        """Whether this connection runs over a same-host direct link (else ZeroMQ)."""
        return self._callers_read

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
        if self._callers_read:
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

    def send_unanswered(self, rec: Request, now: bool = False) -> None:
        """Send ``rec``, a record the broker does not answer (``ShmHello``, ``ShmRelease``).
        ``now``: on the socket at once, from the thread that holds it (the I/O thread handling
        the hello reply).  Otherwise from any thread, with the next message; nothing once the
        connection is closing."""
        if now:
            self._send([rec], [])
            return
        if self._closing or self.state == CLOSED:
            return
        queue = self._queue
        # No wake-up of the I/O thread when one is due anyway: whoever holds the socket (the
        # I/O thread, or a blocking caller driving it) drains the queue whenever it reads a
        # reply of a request still outstanding, or at the I/O thread's next tick, so the
        # record then rides along with the next message.
        woken = bool(queue) or bool(self._pending)
        queue.append((rec, [], None))
        if not woken:
            try:
                self._wake_io()
            except OSError:
                pass

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

    def _set_state(self, state: str) -> None:
        with self._state_cv:
            self.state = state
            self._state_cv.notify_all()

    def _send(self, records: list, frames: list) -> None:
        self.transport.send([pack_header(records), *frames])  # lost if it broke
        self._last_send = time.monotonic()

    def _recv_all(self) -> None:
        while self._recv_one():
            pass

    def _recv_one(self, ready: bool = False) -> bool:
        """Read and complete one message if there is one; False if there was none.
        ``ready``: a poll just said one is there."""
        message = self.transport.recv(ready)
        if message is None:
            if not self.transport.up and self.state == UP:  # the broker closed the link
                now = time.monotonic()
                if now >= self._relink_at:
                    self._relink(now)
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
                self.shm.end_session()
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
            if self._batches:
                on_batch_reply(self, rec)
            return
        self._release(pending[3])
        work, convert, _, _ = pending
        if rec.error is not None:
            work.set_exception(error_from_wire(rec.error))
        elif convert is not None:
            work._finish(_DONE, (rec, frames), convert)  # converted by its first reader
        else:
            work._finish(_DONE, rec.result)
