"""Liveness of a client connection: hello and bye, heartbeats, a broker that went silent or
away, a direct link the broker closed, a refused CURVE handshake, a peer whose answer to the
first hello cannot be read (no zchannel broker).

``Liveness`` is that part of ``connection.Connection``: it gets the connection's ``Line``
(transport, state, heartbeat, traffic times), its ``RequestQueue`` (request ids, what is
queued, failing what is in flight), the identity and producer id its hello carries and
``read_all`` (the connection's reply path: read and complete every message waiting).  Its I/O
thread (or a thread holding its socket) runs it; the reply path reads ``hello_id`` and
``bye_id`` to recognise the answers to them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq
from zchannel.broker.connection.line import CLOSED, CONNECTING, DOWN, UP, Line
from zchannel.broker.connection.requestqueue import RequestQueue, fail_unreadable
from zchannel.broker.connection.tuning import BATCH
from zchannel.broker.errors import AuthenticationFailed, BrokerUnavailable
from zchannel.broker.wire.protocol import (
    CLIENT_HEARTBEAT,
    MIN_HEARTBEAT_S,
    PROTOCOL_VERSION,
    Bye,
    Hello,
    HelloInfo,
    ProtocolError,
    arrival_s,
)

log = logging.getLogger("zchannel.client")

__all__ = ["BYE_WAIT_S", "CLOSED", "CONNECTING", "DOWN", "GONE_CHECK_S", "RELINK_S", "UP",
           "Liveness"]
# How often a handle whose direct link broke tries to connect it again.
RELINK_S = 0.1
# How often a wait on a silent broker checks whether anything still listens at its ipc path.
GONE_CHECK_S = 0.1
# Closing: whether the broker removed its ipc socket file (it stopped: a replica's peer at its
# own shutdown) is looked up after this wait for the answer to bye, then after twice the wait
# before (up to ``GONE_CHECK_S``); a file-system lookup, no connection to the broker.
BYE_FIRST_CHECK_S = 0.005
# Closing: how long the I/O thread waits for the broker's answer to bye (an answer means the
# broker withdrew this connection's parked requests).
BYE_WAIT_S = 1.0

_POLLIN = int(zmq.POLLIN)


class Liveness:
    """The liveness part of ``Connection`` (see the module docstring)."""

    def __init__(self, line: Line, requests: RequestQueue, address: str, identity: str | None,
                 producer: bytes, read_all: Callable[[], None]) -> None:
        self._line = line
        self._requests = requests
        self.address = address
        self.identity = identity
        self.producer = producer
        self._read_all = read_all
        self.hello_id = 0  # the hello awaiting its answer
        self.bye_id: int | None = None  # the bye awaiting its answer
        self.relink_at = 0.0  # when a broken direct link is tried again
        # a CURVE mismatch fails the connection at once (broker/transport/curve.py), and so does
        # an unreadable answer to the first hello (``malformed``); set by the I/O thread (or a
        # thread holding the socket), which alone reads the transport
        self.refused: AuthenticationFailed | ProtocolError | None = None

    def broker_gone(self) -> bool:
        """Down, or (ZeroMQ over ipc) nothing listens at the broker's path any more."""
        line = self._line
        return line.state != UP or line.transport.broker_gone()

    def watch_handshake(self) -> bool:
        """Read the handshake events (I/O thread, holding the socket); True once watching
        ended: a handshake succeeded, or one was refused (which fails every request)."""
        line = self._line
        watch = line.transport.handshake
        if watch is None:  # not watched (any more)
            return True
        refused = watch.check()
        if refused is None and not watch.done:
            return False
        line.transport.end_handshake()
        if refused is not None:
            self.refused = refused
            self._requests.fail_all(refused)
            with line.state_cv:
                line.state_cv.notify_all()
        return True

    def malformed(self, rid: int | None, error: ProtocolError) -> None:
        """A reply that cannot be read (``error`` says why).  Before the first hello was
        answered, whatever answers at the address is no zchannel broker (or one of another
        protocol version): the connection is refused at once with one ``ProtocolError``
        naming the address and ``error`` (what the handle waiting for the hello raises), and
        later replies of that peer are dropped unlogged.  Afterwards the request(s) it answers
        fail (``requestqueue.fail_unreadable``)."""
        line = self._line
        if line.state != CONNECTING:
            fail_unreadable(self._requests, rid, error)
            return
        if self.refused is not None:
            return
        self.refused = ProtocolError(
            f"{self.address} answered the hello with a reply this client cannot read "
            f"({error}): it is no zchannel broker, or one of another protocol version")
        log.debug("%s", self.refused)
        self._requests.fail_all(self.refused)
        with line.state_cv:
            line.state_cv.notify_all()

    def hello_refused(self, error: BaseException) -> None:
        """The broker answered the hello with ``error`` (a protocol version it does not speak):
        the connection is refused with a ``ProtocolError`` naming the address and the broker's
        message (what the handle waiting for the hello raises, and every request since)."""
        if self._line.state != CONNECTING or self.refused is not None:
            return
        self.refused = ProtocolError(f"the broker at {self.address} refused this client's hello: "
                                     f"{type(error).__name__}: {error}")
        self._requests.fail_all(self.refused)
        with self._line.state_cv:
            self._line.state_cv.notify_all()

    def relink(self, now: float) -> None:
        """The broker closed the direct link: connect again.  Nothing listening at its path means
        the broker is gone: pending requests fail now with ``BrokerUnavailable``, not at the
        heartbeat expiry (a restarted broker is found by the next tries, every ``RELINK_S``).
        A new link is a new client to the broker (a closed link ends its client there, and a
        broker started anew at the path knows none): what was in flight on the old one fails
        with ``BrokerUnavailable`` (no answer comes for it), the shared-memory session ends,
        and a hello goes out first, before any request."""
        self.relink_at = now + RELINK_S
        line = self._line
        link = line.transport
        if link.reconnect():
            if line.state == UP:
                log.info("the direct link to the broker at %s broke: registering again",
                         self.address)
                self._requests.fail_all(BrokerUnavailable(
                    f"the direct link to the broker at {self.address} broke before the answer "
                    "came"))
                self._requests.shm.end_session()
            self.send_hello()
        elif link.gone and line.state == UP:
            log.info("the broker at %s is gone (nothing listens at %s)", self.address, link.where)
            line.set_state(DOWN)
            self._requests.fail_all(BrokerUnavailable(
                f"the broker at {self.address} is gone (it closed the direct link and nothing "
                f"listens at {link.where})"))

    def relink_now(self) -> bool:
        """A message found the direct link broken as it went out (``requestqueue.send_again``):
        ``relink`` at once; whether a new link is up (its hello sent)."""
        self.relink(time.monotonic())
        return self._line.transport.up

    def silent_for(self, now: float) -> float:
        """Seconds since anything came from the broker, read now: what waits unread is read
        first when no other thread holds the socket (an idle connection's I/O thread reads
        heartbeats only at its next tick).  The broker is dead once this exceeds the expiry
        (``hb * liveness``), whether or not the I/O thread has noticed yet."""
        self._line.run_if_free(self._read_all_if_open)
        return now - self.life()

    def _read_all_if_open(self) -> None:
        """``_read_all`` (with the socket taken) unless the connection closed meanwhile."""
        line = self._line
        if line.state != CLOSED and line.transport is not None:
            self._read_all()

    def life(self) -> float:
        """When the broker last gave a sign of life: a message, or bytes of one over a direct
        link; past a notice (``announced``) with no message since, the end of the time its
        message may take to arrive (``protocol.arrival_s``) if that is later."""
        line = self._line
        transport = line.transport
        life = max(line.last_recv, transport.last_read if transport is not None else 0.0)
        if line.announced_at >= line.last_recv:  # nothing came since the notice
            life = max(life, line.announced_at + line.arrival_s)
        return life

    def announced(self, nbytes: int) -> None:
        """The broker's notice (just read) of a message of ``nbytes`` it sends next: ZeroMQ
        hands it over only whole, so until it (or anything) arrives, silence counts from the
        end of its crossing at the floor rate (``life``)."""
        line = self._line
        line.announced_at, line.arrival_s = line.last_recv, arrival_s(nbytes)

    def expiry_due(self) -> float:
        """Seconds until the broker's silence exceeds the expiry (``hb * liveness``)."""
        line = self._line
        return self.life() + line.hb * line.liveness - time.monotonic()

    def keepalive(self, now: float) -> None:
        """The I/O thread's turn (holding the socket): relink a broken direct link, judge the
        broker's silence (``DOWN`` after the expiry), send a hello or a heartbeat when due (a
        hello at once when a caller waits for it: ``Line.hello_due``)."""
        line = self._line
        link = line.transport
        if not link.up and (now >= self.relink_at or line.hello_due):
            self.relink(now)
        # life is any bytes from the broker, not only whole messages (a direct link), or a
        # large message announced and still arriving (ZeroMQ): a reply of many large frames
        # takes a while to arrive, and the broker's heartbeats queue behind it
        expiry = line.hb * line.liveness
        if line.state in (UP, CONNECTING) and now - self.life() > expiry:
            self._read_all()  # what waits unread (this thread was held up) is life too
        if line.state in (UP, CONNECTING) and now - self.life() > expiry:
            self._judged_dead(now)
        if line.state == DOWN:
            if line.hello_due or now - line.last_send >= line.hb:
                self.send_hello()
        elif now - line.last_send >= line.hb / 2:
            # this runs every half interval: a heartbeat due at half an interval of silence
            # leaves at most one interval between two (at a whole one, up to one and a half:
            # half the broker's expiry margin gone before this process is ever held up)
            line.send([CLIENT_HEARTBEAT], [])

    def _judged_dead(self, now: float) -> None:
        """The broker's silence passed the expiry (``keepalive``): ``DOWN``, and every request
        in flight fails with ``BrokerUnavailable``."""
        line = self._line
        silent = now - max(line.last_recv, line.transport.last_read)
        late = ""
        if line.announced_at >= line.last_recv:
            late = (f" (a message it announced did not arrive within {line.arrival_s:.1f}s, "
                    "its crossing at the slowest rate waited for, and the expiry)")
        if line.state == UP:
            log.warning("nothing came from the broker at %s for %.1fs%s (it, or this process, "
                        "was held up): unavailable", self.address, silent, late)
        line.set_state(DOWN)
        self._requests.fail_all(BrokerUnavailable(
            f"the broker at {self.address} did not answer for {silent:.1f}s{late}"))

    def send_hello(self) -> None:
        """Send a hello (by the socket's holder); its answer brings the connection up."""
        self._line.hello_due = False
        self.hello_id = next(self._requests.ids)
        self._line.send([Hello(id=self.hello_id, identity=self.identity,
                               version=PROTOCOL_VERSION, producer=self.producer,
                               items=BATCH)], [])

    def say_bye(self) -> None:
        """Say bye and wait (at most ``BYE_WAIT_S``, less when the broker is gone) for the answer:
        the broker then withdrew this connection's parked requests (no item goes to them)."""
        line = self._line
        with line.sock_lock:  # whoever drove the socket left it on seeing ``closing``
            self._requests.send_queued()
            self.bye_id = next(self._requests.ids)
            line.send([Bye(id=self.bye_id)], [])
            start = time.monotonic()
            deadline, next_probe = start + BYE_WAIT_S, start + GONE_CHECK_S
            poll_set = [(line.readable, _POLLIN)]
            wait_s = BYE_FIRST_CHECK_S
            while self.bye_id is not None and line.state == UP:
                if not line.transport.up:
                    return  # the broker closed the link: it saw this connection end
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0:
                    return
                timeout = min(remaining, wait_s, max(0.0, next_probe - now))
                if zmq.zmq_poll(poll_set, int(timeout * 1000) + 1):
                    self._read_all()
                    continue
                if line.transport.address_removed():
                    return  # the broker stopped: no answer comes
                if time.monotonic() >= next_probe:  # every GONE_CHECK_S: a killed broker
                    if self.broker_gone():
                        return
                    next_probe = time.monotonic() + GONE_CHECK_S
                wait_s = min(2 * wait_s, GONE_CHECK_S)

    def adopt_heartbeat(self, info: HelloInfo) -> None:
        """Both sides keep the broker's heartbeat interval and liveness (its hello reply
        says them): a broker set to expire clients sooner (or later) is judged the same way."""
        hb, liveness = info.hb, info.liveness
        if (isinstance(hb, (int, float)) and not isinstance(hb, bool) and MIN_HEARTBEAT_S <= hb <= 3600
                and isinstance(liveness, int) and not isinstance(liveness, bool)
                and 1 <= liveness <= 1000):
            line = self._line
            line.hb, line.liveness = float(hb), liveness
            line.transport.stall_s = line.hb * liveness
