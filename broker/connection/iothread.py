"""The I/O thread of one connection: it sends what callers queued, keeps the heartbeat, reads
the broker's messages while no caller does, and at the end closes the connection's descriptors.

``IOThread`` is that part of ``connection.Connection``: it gets the connection's ``Line``, its
``RequestQueue``, ``Liveness`` and ``Waiting`` parts, ``read_all`` (the connection's reply
path: read and complete every message waiting), the shared-memory client (closed among its
last acts) and ``ended`` (called last, when the thread is done).  The module docstring of
``connection/connection.py`` describes the threads, the locks and the shutdown order.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zchannel.broker.connection.line import CLOSED, UP, Line
from zchannel.broker.connection.liveness import Liveness
from zchannel.broker.connection.requestqueue import RequestQueue
from zchannel.broker.connection.tuning import LAZY_MS, LAZY_S
from zchannel.broker.connection.waiting import Waiting
from zchannel.broker.errors import ChannelError
from zchannel.broker.shm.client import ShmClient

log = logging.getLogger("zchannel.client")

_POLLIN = int(zmq.POLLIN)


class IOThread:
    """The I/O thread's loop and its last acts (see the module docstring)."""

    def __init__(self, line: Line, requests: RequestQueue, liveness: Liveness, waiting: Waiting,
                 read_all: Callable[[], None], shm: ShmClient, ended: Callable[[], None],
                 name: str) -> None:
        self._line = line
        self._requests = requests
        self._queue = requests.queue
        self._pending = requests.pending
        self._liveness = liveness
        self._waiting = waiting
        self._read_all = read_all
        self._shm = shm
        self._ended = ended
        self.turns = 0  # wake-ups (tests check that a stream needs few)
        self.idle = True  # it sleeps without watching the socket (see _run)
        self.lazy = False  # it looks again within LAZY_S (see _run)
        self.say_bye = True  # it says bye when it stops (close(bye=False): it does not)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self.thread.start()

    def _run(self) -> None:
        line = self._line
        line.io_ident = threading.get_ident()
        transport = line.transport
        liveness = self._liveness
        # This thread waits without touching the socket: a zmq socket is not thread-safe and a
        # blocking caller (``call``) may be using it.  It polls the socket's notification fd
        # (ZMQ_FD: readable when the socket's state may have changed) and reads the socket only
        # under ``Line.sock_lock``, always until it is empty (which re-arms ZMQ_FD).  That fd is
        # polled only while this thread waits for replies; an idle handle's incoming heartbeats
        # are read at the next tick, and a caller driving the socket is not raced for its reply.
        # the broker's silence counts from here; set before the first read, whose replies (and
        # a notice of a large message among them, ``Liveness.announced``) are life after it
        line.last_recv = time.monotonic()
        with line.sock_lock:
            notify_fd = transport.notify_fd()
            liveness.send_hello()
            self._read_all()  # re-arms ZMQ_FD after the send
        wake = line.wake
        idle_poll = [(wake, _POLLIN)]
        busy_poll: list[tuple[Any, int]] = [(notify_fd, _POLLIN), (wake, _POLLIN)]
        if transport.handshake is not None:  # until the first handshake ends (not connecting: idle)
            busy_poll.append((transport.handshake.socket, _POLLIN))
        line.last_send = 0.0
        callers_read = line.callers_read
        try:
            while not line.closing:
                busy, timeout = self._turn_plan()
                zmq.zmq_poll(busy_poll if busy else idle_poll, timeout)
                try:
                    os.eventfd_read(wake)
                    woken = True
                except BlockingIOError:
                    woken = False
                # cleared after the read: a wake-up written before it is consumed here, and the
                # request behind it is seen below; one written after it stays pending
                line.woken = False
                sock_lock = line.sock_lock
                if not sock_lock.acquire(blocking=False):
                    if not woken and callers_read:
                        continue  # a reader has the link; look again in LAZY_S
                    # a blocking caller drives the socket (``_drive``, which polls the eventfd
                    # too): pass the wake-up on to it, so that queued requests go out now
                    os.eventfd_write(wake, 1)
                    sock_lock.acquire()
                try:
                    if transport.handshake is not None and liveness.watch_handshake():
                        busy_poll = busy_poll[:2]
                    self._socket_turn()
                finally:
                    sock_lock.release()
            if line.state == UP:
                self._shm.read_unread()  # before bye gives their slots back
            if self.say_bye and line.state == UP:
                liveness.say_bye()
        except Exception:  # pragma: no cover - a bug here must not hang callers
            log.exception("zchannel I/O thread failed")
        finally:
            self._last_acts()

    def _turn_plan(self) -> tuple[bool, int]:
        """Whether this turn watches the socket (busy) and how long it sleeps (ms)."""
        line = self._line
        waiting = self._waiting
        self.turns += 1
        self.idle = True  # before the test: a request that misses it wakes us
        self.lazy = False
        busy = bool(self._pending or self._queue or line.state != UP)
        timeout = int(line.hb * 500)  # the broker's interval once it said hello
        if self._pending and line.state == UP:  # fail them when the expiry ends, not later
            timeout = min(timeout, max(1, int(1000 * self._liveness.expiry_due()) + 1))
        # queued since the last turn's send and nobody else to send it (requests held back by
        # ``Connection.request``, a record that rides with the next message, from
        # ``RequestQueue.send_unanswered``): out now
        due = bool(self._queue) and not line.sock_lock.locked()
        if LAZY_MS and line.callers_read and not waiting.sleepers and (
            line.sock_lock.locked() or time.monotonic() - waiting.read_end < LAZY_S
        ):
            # waiting threads read the link: look again in LAZY_S (also with nothing
            # due now: in a stream the next request comes at once); requests held
            # back meanwhile (``Connection.request``) go out then at the latest
            busy, timeout = False, LAZY_MS
            self.idle = False
            self.lazy = not due
        elif busy:
            self.idle = False
        if due:
            timeout = 0
        return busy, timeout

    def _socket_turn(self) -> None:
        """With the socket held: send what is queued, keep the heartbeat, read what came."""
        if self._queue:
            self._requests.send_queued()
        self._liveness.keepalive(time.monotonic())
        # last, after every send: ZMQ_FD only signals again once the socket was
        # read until empty (a send may consume a pending notification)
        self._read_all()

    def _last_acts(self) -> None:
        """The I/O thread's end: closed state, what is left failed, the descriptors closed."""
        line = self._line
        requests = self._requests
        line.set_state(CLOSED)
        requests.fail_all(ChannelError("this channel handle is closed"))
        self._shm.read_unread()
        self._shm.close()
        queue = self._queue
        while queue:
            _, _, pending = queue.popleft()
            if pending is not None:
                requests.release(pending[3])
                pending[0].set_exception(ChannelError("this channel handle is closed"))
        with line.sock_lock:  # a blocking caller may still be reading it
            line.close_fds()
        self._ended()
