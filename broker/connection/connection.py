"""The client side of the wire: one transport to the broker owned by one I/O thread.

User threads hand requests to the I/O thread (a deque and an eventfd wake-up) and wait on
``Work`` handles, which the I/O thread completes when replies arrive.  Requests queued together
are coalesced into one message.  A blocking call (``call``) skips the two thread hand-offs when
the socket is free: it takes the socket lock, sends, polls for its reply without sleeping for
up to ``SPIN_US``, then waits for it in ``poll`` for a short while (``DRIVE_S``), completing
every reply it reads, and hands the socket back.  Whoever holds the socket lock
(``Line.sock_lock``) is the only thread touching the socket (zmq sockets are not thread-safe): the
I/O thread waits on the socket's notification fd, not on the socket.  The I/O thread also keeps
the heartbeat: when the broker is silent for ``liveness`` intervals every pending request fails
with ``BrokerUnavailable``; when a broker answers again the connection comes back by itself
(``connection/liveness.py``).  On a connection made with ``revives`` (a handle's:
``connection/sharing.py``) a call made while it is down waits for that within its own budget
(``connection/revival.py``); on any other (a broker's link to a peer) it fails at once.

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

``Connection`` holds one part per responsibility, each in its own module and each given what
it uses through its constructor: ``connection/line.py`` (``Line``, what every part shares: the
transport -- the DEALER socket or the direct link behind the seam of ``transport/seam.py``,
chosen at connect time --, the socket lock and its holder, the wake-up eventfd, the state and
its condition, the heartbeat and the times of the last traffic), ``connection/requestqueue.py``
(the request queue, coalescing, the requests in flight, flow control),
``connection/waiting.py`` (``call``, ``wait_for``: callers that read the socket themselves),
``connection/liveness.py`` (hello, bye, heartbeats, expiry, relinking, the CURVE handshake) and
``connection/iothread.py`` (the I/O thread's loop and its last acts).  A part that must call
back into the connection gets the callback explicitly (``read_one``/``read_all``: the reply
path; ``issue``: ``request``).  This module keeps the choice of transport
(``open_transport``), the public surface and the path of an incoming message (``_recv_one``,
``_on_message``, ``_on_reply``, ``_deliver_items``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from zchannel.broker.connection.batching import on_batch_reply
from zchannel.broker.connection.flowcontrol import Flow
from zchannel.broker.connection.iothread import IOThread
from zchannel.broker.connection.line import CLOSED, DOWN, UP, Line
from zchannel.broker.connection.liveness import Liveness
from zchannel.broker.connection.requestqueue import Convert, RequestQueue
from zchannel.broker.connection.revival import Revival
from zchannel.broker.connection.tuning import SEND_RUN, direct_enabled
from zchannel.broker.connection.waiting import Waiting
from zchannel.broker.connection.work import _DONE, Work
from zchannel.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    ChannelError,
    error_from_wire,
)
from zchannel.broker.host import paths
from zchannel.broker.shm.client import ShmClient, reply_hold_ids
from zchannel.broker.transport import direct
from zchannel.broker.transport.seam import Transport, ZmqTransport
from zchannel.broker.wire.protocol import (
    EXPIRED,
    BadRecord,
    HelloInfo,
    ItemEntry,
    ProtocolError,
    Reply,
    Request,
    hello_info,
    unpack_replies,
)

log = logging.getLogger("zchannel.client")

# How long a close waits for the I/O thread.
JOIN_S = 5.0
# A message's delivery interrupted (``_recv_one``): tries to deliver the rest, each of which
# another interruption may cut short too.
REDELIVERIES = 8

__all__ = ["CLOSED", "DOWN", "UP", "Connection", "Convert", "Flow", "JOIN_S", "open_transport",
           "running"]

# connections whose I/O thread may still run (sharing.close_all stops them at interpreter exit)
running: weakref.WeakSet[Connection] = weakref.WeakSet()


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


class Connection:
    """A connection to one broker address (see the module docstring)."""

    def __init__(self, address: str, identity: str | None = None, heartbeat_interval: float = 1.0,
                 liveness: int = 3, max_inflight: int = 1024, curve: Any = None,
                 shm: bool | None = None, revives: bool = False) -> None:
        self.address = address
        self.identity = identity
        self.broker_info = HelloInfo()
        self.held_back = 0  # requests held back to go out with later ones (``request``)
        # retry-safe puts: this connection's producer id, the same across its reconnects; its
        # puts' request ids are their sequence numbers (broker/server/producers.py)
        self.producer = os.urandom(16)
        self.pid = os.getpid()
        self.shm = ShmClient(self, shm)  # same-host shared-memory path (broker/shm/client.py)
        self.converters: dict[tuple[type, bool | None, bool], Convert] = {}  # by op, copy, ack
        try:
            # A same-host broker's direct link when there is one (broker/transport/direct.py),
            # else ZeroMQ; the link only beside shared memory: large arrays then bypass the
            # link, and libzmq's I/O threads move large frames faster than a Python loop
            # (docs/decisions.md)
            transport = open_transport(address, curve, heartbeat_interval * liveness,
                                       self.shm.enabled and direct_enabled())
        except BaseException:  # bad key files: nothing of this connection stays open
            self.shm.close()
            raise
        line = self._line = Line(transport, heartbeat_interval, liveness)
        requests = self._requests = RequestQueue(line, address, max_inflight, self.shm,
                                                 self.request)
        self.shm.releases.ids = requests.ids  # its marks are request ids (shm.client.Releases)
        if revives:  # a handle's: a call made while it is down waits for the broker (revival.py)
            requests.revive = Revival(line, address)
        self._waiting = Waiting(line, requests, self._recv_one)
        if line.callers_read:  # a thread waiting on a Work reads the link itself
            requests.reader = self._waiting
        self._liveness = Liveness(line, requests, address, identity, self.producer,
                                  self._recv_all)
        requests.relink_now = self._liveness.relink_now
        self._io = IOThread(line, requests, self._liveness, self._waiting, self._recv_all,
                            self.shm, lambda: running.discard(self), f"zchannel-io {address}")
        # what the paths run per request and per reply use, bound once
        self._queue = requests.queue
        self._pending = requests.pending
        self._inflight = requests.inflight
        self._callers_read = line.callers_read
        running.add(self)
        self._io.start()

    @property
    def transport(self) -> Transport:
        """The DEALER socket or the direct link (``transport/seam.py``)."""
        return self._line.transport

    @property
    def state(self) -> str:
        """``connecting``, ``up``, ``down`` or ``closed``."""
        return self._line.state

    @property
    def hb(self) -> float:
        """The heartbeat interval (the broker's, once it said hello)."""
        return self._line.hb

    @property
    def liveness(self) -> int:
        """Heartbeat intervals of silence after which the broker counts as gone."""
        return self._line.liveness

    @property
    def closing(self) -> bool:
        """Whether ``stop`` asked the I/O thread to end."""
        return self._line.closing

    @property
    def refused(self) -> AuthenticationFailed | ProtocolError | None:
        """Why the CURVE handshake, or the peer's answer to the hello, was refused (None: no)."""
        return self._liveness.refused

    @property
    def io_turns(self) -> int:
        """Wake-ups of the I/O thread (tests check that a stream needs few)."""
        return self._io.turns

    @property
    def direct(self) -> bool:
        """Whether this connection runs over a same-host direct link (else ZeroMQ)."""
        return self._callers_read

    def wait_up(self, timeout: float) -> bool:
        """Wait until the broker answered the hello; False on timeout, or at once when the
        handshake or the answer was refused (``refused`` then says why)."""
        deadline = time.monotonic() + timeout
        line, liveness = self._line, self._liveness
        with line.state_cv:
            while line.state != UP:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or line.state == CLOSED or liveness.refused is not None:
                    return False
                line.state_cv.wait(remaining)
        return True

    def request(self, rec: Request, frames: list, convert: Convert | None = None,
                cancellable: bool = False, room: bool = True, owner: Any = None,
                async_op: bool = False) -> Work:
        """Send one request; the returned ``Work`` completes with ``convert(reply, frames)``
        (or the reply's ``r`` field) or with the reply's error.  ``owner``: the share of the
        handle that issues it (``sharing.Share``; its close withdraws the request).
        ``async_op``: nobody waits for it now; on an event loop's thread, a request that finds
        no room waits for it in its ``Work`` (``connection/flowcontrol.py``)."""
        work = self._requests.enqueue(rec, frames, convert, cancellable, room, owner, async_op)
        if work._state or type(work._tag) is not int:  # failed already, or waits for room
            return work
        line = self._line
        if self._callers_read:
            if self._pending and len(self._queue) < SEND_RUN and self._io.lazy \
                    and not line.sock_lock.locked():
                # replies are due and threads read them: the request waits for the next wait
                # (or the I/O thread's look within LAZY_S) and goes out with those after it
                self.held_back += 1
                return work
            # a direct link costs one system call to send on: the caller sends, and wakes
            # the I/O thread only when it sleeps without watching the link
            if line.run_if_free(self._requests.send_queued) and not self._queue:
                if self._io.idle:
                    line.wake_io()
                return work
        # A caller issuing many async requests holds the GIL, so the I/O thread would only
        # send them once the caller blocks; sending full runs from here lets the broker work
        # on one run while the caller issues the next.
        if len(self._queue) >= SEND_RUN:
            line.run_if_free(self._requests.send_queued)
        line.wake_io()
        return work

    def call(self, rec: Request, frames: list, convert: Convert | None = None,
             cancellable: bool = False, owner: Any = None) -> Work:
        """``request`` for a caller that waits for the result at once: on a connection that is
        up, it sends and reads replies itself if no other thread has the socket (``Waiting``)."""
        if self._line.state != UP:
            return self.request(rec, frames, convert, cancellable, owner=owner)
        return self._waiting.call(rec, frames, convert, cancellable, owner)

    def send_unanswered(self, rec: Request, now: bool = False, soon: bool = False) -> None:
        """Send ``rec``, a record the broker does not answer (``RequestQueue.send_unanswered``)."""
        self._requests.send_unanswered(rec, now, soon, self._callers_read and self._io.lazy)

    def requests_of(self, owner: Any) -> list[tuple[int, Work, bool]]:
        """``(id, Work, is a put)`` of the outstanding requests of ``owner`` (None: all)."""
        return self._requests.requests_of(owner)

    def drop_waiting(self, owner: Flow) -> None:
        """Fail the requests of ``owner`` (a closed share) that wait for room in their
        ``Work`` (``connection/flowcontrol.py``) with ``ChannelError``."""
        if owner.deferred:
            self._requests.flows.drop(owner, ChannelError("this channel handle is closed"))

    def flush(self) -> None:
        """Send what is queued now (requests of closed owners are dropped)."""
        self._requests.flush()

    def forget(self, rid: int, exc: BaseException) -> None:
        """Fail request ``rid`` with ``exc`` unless its reply came (a later reply is dropped)."""
        self._requests.forget(rid, exc)

    def broker_gone(self) -> bool:
        """Down, or (ZeroMQ over ipc) nothing listens at the broker's path any more."""
        return self._liveness.broker_gone()

    def silent_for(self, now: float) -> float:
        """Seconds since anything came from the broker (``Liveness.silent_for``)."""
        return self._liveness.silent_for(now)

    def stop(self, bye: bool = True) -> None:
        """Ask the I/O thread to end: it says bye (``bye``), fails what is left and closes the
        descriptors last.  Waiting for put acknowledgements is the caller's (``sharing``)."""
        line = self._line
        if os.getpid() == self.pid and not line.closing:
            self._io.say_bye = bye
            line.closing = True
            line.signal()

    def holds_socket(self) -> bool:
        """Whether the caller is the I/O thread or drives the socket (a done-callback or a
        finalizer can run there): it must not wait for replies or for the I/O thread."""
        return threading.get_ident() in (self._io.thread.ident, self._line.holder)

    def join(self, timeout: float = JOIN_S) -> None:
        """Wait for the I/O thread to end (unless ``holds_socket``: it needs the socket)."""
        if os.getpid() == self.pid and not self.holds_socket():
            self._io.thread.join(timeout)

    def close(self, bye: bool = True) -> None:
        """``stop`` and ``join``.  Idempotent."""
        self.stop(bye)
        self.join()

    def after_fork(self) -> None:
        """In a forked child: ``after_fork`` of the ``Line``, ``RequestQueue`` and ``ShmClient``."""
        self._line.after_fork()
        self._requests.after_fork()
        self.shm.after_fork()

    def _recv_all(self) -> None:
        while self._recv_one():
            pass

    def _recv_one(self, ready: bool = False) -> bool:
        """Read and complete one message if there is one; False if there was none.
        ``ready``: a poll just said one is there."""
        line = self._line
        message = line.transport.recv(ready)
        if message is None:
            if not line.transport.up and line.state == UP:  # the broker closed the link
                now = time.monotonic()
                if now >= self._liveness.relink_at:
                    self._liveness.relink(now)
            return False
        try:
            self._on_message(*message)
        except BaseException:  # interrupted: the replies still awaited are delivered first
            _redeliver(self._on_message, message)
            raise
        return True

    def _on_message(self, header: bytes, frames: list, again: bool = False) -> None:
        """Deliver the replies of one message.  ``again``: its delivery was interrupted;
        deliver only the replies whose requests still wait for them (a request stays in
        ``pending`` until delivered, ``connection/inflight.py``: none is lost or delivered
        twice)."""
        self._line.last_recv = time.monotonic()
        try:
            records = unpack_replies(header, len(frames))
        except ProtocolError as exc:  # unreadable: it may answer any request in flight
            records = [BadRecord(None, None, 0, exc)]
        pos = 0
        for rec in records:
            if isinstance(rec, BadRecord):
                self._liveness.malformed(rec.id, rec.error)
            else:
                self._on_reply(rec, frames[pos : pos + rec.nf], again)
            pos += rec.nf

    def _on_reply(self, rec: Reply, frames: list, again: bool = False) -> None:
        if (rid := rec.id) is None:
            if rec.items is not None:
                _deliver_items(self._requests, self.shm, rec.items)
            elif rec.op == EXPIRED and not again:
                self._on_expired()
            elif rec.next_bytes is not None:  # a notice: a large message comes next
                self._liveness.announced(rec.next_bytes)
            return
        # ids come from one counter: a hello's or a bye's is never in flight as a request
        inflight = self._inflight
        pending = self._pending.get(rid)  # (it stays there until delivered: inflight.py)
        if pending is None:
            if not (self._requests.batches and on_batch_reply(self._requests, rec)) \
                    and not again:
                self._on_hello_or_bye(rid, rec)
                self.shm.release(reply_hold_ids(rec.slots))  # an answer nobody awaits: its slots go
            return
        inflight.release(rid, pending[3])
        self.shm.releases.answered(rid)  # the releases queued before it reached the broker
        work, convert, is_put, _ = pending
        if work._state:  # completed by a delivery an interruption cut short
            work._wake()
        elif rec.error is not None:
            work.set_exception(error_from_wire(rec.error))
        elif convert is not None:  # converted by its first reader
            work._finish(_DONE, (rec, frames),
                         _released_if_dropped(work, convert, rec, self.shm, again))
        else:
            work._finish(_DONE, None if is_put else rec.result)  # a put's result is None
        inflight.delivered(rid)

    def _on_expired(self) -> None:
        """The broker expired this client (silent too long, or a broker restarted): register."""
        log.warning("the broker at %s expired this client: registering again", self.address)
        self._requests.fail_all(BrokerUnavailable("the broker expired this client (silent too "
                                                  "long, or it restarted); request dropped"))
        self.shm.end_session()
        self._liveness.send_hello()

    def _on_hello_or_bye(self, rid: int, rec: Reply) -> None:
        """The answer to a bye (the broker withdrew this connection's parked requests) or to a
        hello (the connection is up, or refused: an error); a reply to a request forgotten
        meanwhile is dropped."""
        liveness = self._liveness
        if rid == liveness.bye_id:
            liveness.bye_id = None
        elif rid == liveness.hello_id:
            if rec.error is not None:  # another protocol version, say: the connection is refused
                return liveness.hello_refused(error_from_wire(rec.error))
            self.broker_info = hello_info(rec.result)
            liveness.adopt_heartbeat(self.broker_info)
            self.shm.on_hello(self.broker_info)
            if self._line.state != UP:
                self._line.set_state(UP)


def _redeliver(on_message: Callable[..., None], message: tuple[bytes, list]) -> None:
    """An interruption (a signal handler's exception: Ctrl-C in the main thread) cut the
    delivery of ``message`` short (``Connection._recv_one``): deliver its replies still
    awaited (``on_message(..., again=True)``) before the interruption goes on; again while
    interruptions cut that short too, ``REDELIVERIES`` times at most."""
    for _ in range(REDELIVERIES):
        try:
            on_message(*message, again=True)
            return
        except BaseException:  # interrupted again
            continue


def _deliver_items(requests: RequestQueue, shm: ShmClient, items: list[ItemEntry]) -> None:
    """An ``items`` record: complete each get it answers as a reply of the get's own id
    with its inline item would (an id no longer awaited is dropped).  A converter's
    ``inline`` (a get's) converts the entry's body and lease, with no ``Reply`` made."""
    pending_of, inflight = requests.pending, requests.inflight
    shm.releases.answered_items(items)  # those queued before these gets reached it
    last: Convert | None = None
    inline: Any = None
    for rid, body, lease in items:
        pending = pending_of.get(rid)  # (it stays there until delivered: inflight.py)
        if pending is None:
            continue
        inflight.release(rid, pending[3])
        work, convert = pending[0], pending[1]
        if convert is not last:  # the gets of one record share their converter
            last, inline = convert, getattr(convert, "inline", None)
        if work._state:  # completed by a delivery an interruption cut short
            work._wake()
        elif inline is not None:
            work._finish(_DONE, (body, lease), inline)
        elif convert is not None:
            work._finish(_DONE, (Reply(id=rid, body=body, lease=lease), []), convert)
        else:
            work._finish(_DONE, None)
        inflight.delivered(rid)


def _released_if_dropped(work: Work, convert: Convert, rec: Reply, shm: ShmClient,
                         again: bool = False) -> Convert:
    """``convert`` of reply ``rec`` to ``work``; when the reply names slots held for this
    consumer, they are released if ``work`` is collected unread (docs/shm.md), and the
    conversion disarms that (it releases them itself, or hands them to its views).  The
    connection reads it before it says bye (``ShmClient.read_unread``); a first read after
    that fails (``ChannelError``): its slots went back to the broker.  ``again``: a delivery
    an interruption cut short may have armed one already: it is disarmed (only one holds)."""
    holds = reply_hold_ids(rec.slots)
    if not holds:
        return convert
    if again:
        for ref in weakref.getweakrefs(work):
            armed = getattr(ref, "__callback__", None)
            if isinstance(armed, weakref.finalize) and (armed.peek() or (0, 0))[1] == shm.release:
                armed.detach()
    dropped = weakref.finalize(work, shm.release, holds)
    with shm.lock:  # read before the connection says bye (ShmClient.read_unread)
        shm.unread.add(work)
    tried: list[bool] = []

    def converting(*args: Any) -> Any:
        dropped.detach()
        if shm.let_go:
            raise ChannelError("this channel handle closed before the item was read: its "
                               "shared-memory slots went back to the broker, and the item "
                               "with them")
        if tried:  # a read interrupted (KeyboardInterrupt): it gave the slots back, or not yet
            shm.release(holds)  # (a hold released already is ignored)
            raise ChannelError("reading this item out of shared memory was interrupted, and "
                               "its slots went back to the broker: the item is lost")
        tried.append(True)
        return convert(*args)
    return converting
