"""The I/O thread of one connection: it sends what callers queued, keeps the heartbeat, reads
the broker's messages while no caller does, and at the end closes the connection's descriptors.

``IOThread`` is that part of ``connection.Connection`` (its attributes are the connection's;
the module docstring of ``connection/connection.py`` describes the threads, the locks and the shutdown
order).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

import zmq
from zchannel.broker.connection.liveness import CLOSED, UP
from zchannel.broker.connection.parts import ConnectionParts
from zchannel.broker.connection.tuning import LAZY_MS, LAZY_S
from zchannel.broker.errors import ChannelError

log = logging.getLogger("zchannel.client")

_POLLIN = int(zmq.POLLIN)

# connections whose I/O thread may still run (sharing.close_all stops them at interpreter exit)
running: weakref.WeakSet[IOThread] = weakref.WeakSet()


class IOThread(ConnectionParts):
    """The I/O thread's loop and its last acts (see the module docstring)."""

    def _run(self) -> None:
        transport = self.transport
        # This thread waits without touching the socket: a zmq socket is not thread-safe and a
        # blocking caller (``call``) may be using it.  It polls the socket's notification fd
        # (ZMQ_FD: readable when the socket's state may have changed) and reads the socket only
        # under ``_sock_lock``, always until it is empty (which re-arms ZMQ_FD).  That fd is
        # polled only while this thread waits for replies; an idle handle's incoming heartbeats
        # are read at the next tick, and a caller driving the socket is not raced for its reply.
        with self._sock_lock:
            notify_fd = transport.notify_fd()
            self._send_hello()
            self._recv_all()  # re-arms ZMQ_FD after the send
        idle_poll = [(self._wake, _POLLIN)]
        busy_poll: list[tuple[Any, int]] = [(notify_fd, _POLLIN), (self._wake, _POLLIN)]
        if transport.handshake is not None:  # until the first handshake ends (not connecting: idle)
            busy_poll.append((transport.handshake.socket, _POLLIN))
        now = time.monotonic()
        self._last_recv = now
        self._last_send = 0.0
        try:
            while not self._closing:
                busy, timeout = self._turn_plan()
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
                    if not woken and self._callers_read:
                        continue  # a reader has the link; look again in LAZY_S
                    # a blocking caller drives the socket (``_drive``, which polls the eventfd
                    # too): pass the wake-up on to it, so that queued requests go out now
                    os.eventfd_write(self._wake, 1)
                    self._sock_lock.acquire()
                try:
                    if transport.handshake is not None and self._watch_handshake():
                        busy_poll = busy_poll[:2]
                    self._socket_turn()
                finally:
                    self._sock_lock.release()
            if self._bye and self.state == UP:
                self._say_bye()
        except Exception:  # pragma: no cover - a bug here must not hang callers
            log.exception("zchannel I/O thread failed")
        finally:
            self._last_acts()

    def _turn_plan(self) -> tuple[bool, int]:
        """Whether this turn watches the socket (busy) and how long it sleeps (ms)."""
        self.io_turns += 1
        self._io_idle = True  # before the test: a request that misses it wakes us
        self._io_lazy = False
        busy = bool(self._pending or self._queue or self.state != UP)
        timeout = int(self.hb * 500)  # the broker's interval once it said hello
        if self._pending and self.state == UP:  # fail them when the expiry ends, not later
            timeout = min(timeout, max(1, int(1000 * self._expiry_due()) + 1))
        if LAZY_MS and self._callers_read and not self._sleepers and (
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
        return busy, timeout

    def _socket_turn(self) -> None:
        """With the socket held: send what is queued, keep the heartbeat, read what came."""
        if self._queue:
            self._send_queued()
        self._keepalive(time.monotonic())
        # last, after every send: ZMQ_FD only signals again once the socket was
        # read until empty (a send may consume a pending notification)
        self._recv_all()

    def _last_acts(self) -> None:
        """The I/O thread's end: closed state, what is left failed, the descriptors closed."""
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
        """Close the transport and the wake-up eventfd (with the socket lock taken, or before
        any thread could use them)."""
        self._fds_closed = True
        self.transport.close()
        self._close_wake()

    def _close_wake(self) -> None:
        """Close the wake-up eventfd (a wake-up written later finds it closed)."""
        with self._wake_lock:
            if not self._wake_closed:
                self._wake_closed = True
                os.close(self._wake)
