"""Liveness of a client connection: hello and bye, heartbeats, a broker that went silent or
away, a direct link the broker closed, a refused CURVE handshake.  ``Liveness`` is that part of
``connection.Connection`` (its attributes are the connection's); its I/O thread (or a thread
holding its socket) runs it.
"""

from __future__ import annotations

import logging
import time

import zmq
from zchannel.broker.errors import BrokerUnavailable
from zchannel.broker.wire.protocol import CLIENT_HEARTBEAT, PROTOCOL_VERSION, Bye, Hello, HelloInfo

log = logging.getLogger("zchannel.client")

CONNECTING, UP, DOWN, CLOSED = "connecting", "up", "down", "closed"
# How often a handle whose direct link broke tries to connect it again.
RELINK_S = 0.1
# How often a wait on a silent broker checks whether anything still listens at its ipc path.
GONE_CHECK_S = 0.1
# Closing: how long the I/O thread waits for the broker's answer to bye (an answer means the
# broker withdrew this connection's parked requests).
BYE_WAIT_S = 1.0

_POLLIN = int(zmq.POLLIN)


class Liveness:
    """The liveness part of ``Connection`` (its attributes are the connection's)."""

    def broker_gone(self) -> bool:
        """Down, or (ZeroMQ over ipc) nothing listens at the broker's path any more."""
        return self.state != UP or self.transport.broker_gone()

    def _watch_handshake(self) -> bool:
        """Read the handshake events (I/O thread, holding the socket); True once watching
        ended: a handshake succeeded, or one was refused (which fails every request)."""
        watch = self.transport.handshake
        refused = watch.check()
        if refused is None and not watch.done:
            return False
        self.transport.end_handshake()
        if refused is not None:
            self.refused = refused
            self._fail_all(refused)
            with self._state_cv:
                self._state_cv.notify_all()
        return True

    def _relink(self, now: float) -> None:
        """The broker closed the direct link: connect again.  Nothing listening at its path means
        the broker is gone: pending requests fail now with ``BrokerUnavailable``, not at the
        heartbeat expiry (a restarted broker is found by the next tries, every ``RELINK_S``)."""
        self._relink_at = now + RELINK_S
        link = self.transport
        if link.reconnect():
            if self.state != UP:
                self._send_hello()
        elif link.gone and self.state == UP:
            log.info("the broker at %s is gone (nothing listens at %s)", self.address, link.where)
            self._set_state(DOWN)
            self._fail_all(BrokerUnavailable(
                f"the broker at {self.address} is gone (it closed the direct link and nothing "
                f"listens at {link.where})"))

    def silent_for(self, now: float) -> float:
        """Seconds since anything came from the broker, read now: what waits unread is read
        first when no other thread holds the socket (an idle connection's I/O thread reads
        heartbeats only at its next tick).  The broker is dead once this exceeds the expiry
        (``hb * liveness``), whether or not the I/O thread has noticed yet."""
        if self._sock_lock.acquire(blocking=False):
            try:
                if not self._fds_closed and self.state != CLOSED and self.transport is not None:
                    self._recv_all()
            finally:
                self._sock_lock.release()
        return now - self._last_life()

    def _last_life(self) -> float:
        transport = self.transport
        return max(self._last_recv, transport.last_read if transport is not None else 0.0)

    def _expiry_due(self) -> float:
        """Seconds until the broker's silence exceeds the expiry (``hb * liveness``)."""
        return self._last_life() + self.hb * self.liveness - time.monotonic()

    def _keepalive(self, now: float) -> None:
        link = self.transport
        if not link.up and now >= self._relink_at:
            self._relink(now)
        # life is any bytes from the broker, not only whole messages: a reply of many large
        # frames takes a while to arrive, and the broker's heartbeats queue behind it
        silent = now - max(self._last_recv, link.last_read)
        if self.state in (UP, CONNECTING) and silent > self.hb * self.liveness:
            self._recv_all()  # what waits unread (this thread was held up) is life too
            silent = now - max(self._last_recv, link.last_read)
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
            self._send([CLIENT_HEARTBEAT], [])

    def _send_hello(self) -> None:
        self._hello_id = next(self._ids)
        self._send([Hello(id=self._hello_id, identity=self.identity, version=PROTOCOL_VERSION,
                          producer=self.producer)], [])

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
                if not self.transport.up:
                    return  # the broker closed the link: it saw this connection end
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                if zmq.zmq_poll(poll_set, int(min(remaining, GONE_CHECK_S) * 1000) + 1):
                    self._recv_all()
                elif self.broker_gone():
                    return

    def _adopt_heartbeat(self, info: HelloInfo) -> None:
        """Both sides keep the broker's heartbeat interval and liveness (its hello reply
        says them): a broker set to expire clients sooner (or later) is judged the same way."""
        hb, liveness = info.hb, info.liveness
        if (isinstance(hb, (int, float)) and not isinstance(hb, bool) and 0 < hb <= 3600
                and isinstance(liveness, int) and not isinstance(liveness, bool)
                and 1 <= liveness <= 1000):
            self.hb, self.liveness = float(hb), liveness
            self.transport.stall_s = self.hb * liveness
