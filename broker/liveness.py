"""Liveness of a client connection: heartbeats, a broker that went silent or away, a direct
link the broker closed, a refused CURVE handshake.  ``Liveness`` is that part of
``connection.Connection``; its I/O thread (or a thread holding its socket) runs it.
"""

from __future__ import annotations

import logging

from zchannel.broker import paths
from zchannel.broker.errors import BrokerUnavailable
from zchannel.broker.protocol import CLIENT_HEARTBEAT

log = logging.getLogger("zchannel.client")

CONNECTING, UP, DOWN, CLOSED = "connecting", "up", "down", "closed"
# How often a handle whose direct link broke tries to connect it again.
RELINK_S = 0.1
# How often a wait on a silent broker checks whether anything still listens at its ipc path.
GONE_CHECK_S = 0.1


class Liveness:
    """The liveness part of ``Connection`` (its attributes are the connection's)."""

    def broker_gone(self) -> bool:
        """Down, or (ZeroMQ over ipc) nothing listens at the broker's path any more."""
        return self.state != UP or (self._link is None and paths.nothing_listens(self.address))

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

    def _relink(self, now: float) -> None:
        """The broker closed the direct link: connect again.  Nothing listening at its path means
        the broker is gone: pending requests fail now with ``BrokerUnavailable``, not at the
        heartbeat expiry (a restarted broker is found by the next tries, every ``RELINK_S``)."""
        self._relink_at = now + RELINK_S
        link = self._link
        if link.reconnect():
            if self.state != UP:
                self._send_hello()
        elif link.gone and self.state == UP:
            log.info("the broker at %s is gone (nothing listens at %s)", self.address, link.path)
            self._set_state(DOWN)
            self._fail_all(BrokerUnavailable(
                f"the broker at {self.address} is gone (it closed the direct link and nothing "
                f"listens at {link.path})"))

    def _keepalive(self, now: float) -> None:
        link = self._link
        if link is not None and not link.up and now >= self._relink_at:
            self._relink(now)
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
            self._send([CLIENT_HEARTBEAT], [])
