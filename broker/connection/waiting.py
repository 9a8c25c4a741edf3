"""Threads that wait for replies of one connection, and read them themselves when they can.

``Waiting`` is that part of ``connection.Connection``: it gets the connection's ``Line`` (the
socket lock, the wake-up of the I/O thread), its ``RequestQueue`` and ``read_one`` (the
connection's reply path: read and complete one message).  A blocking call (``call``) takes the
socket lock when it is free, sends its request, polls for the reply without sleeping for up to
``SPIN_US``, then in ``poll`` for up to ``DRIVE_S`` (``_drive``), completing every reply it
reads, and hands the socket back to the I/O thread.  Over a transport whose callers read it
themselves (the direct link, ``transport/seam.py``) a thread waiting on a ``Work`` does the
same (``wait_for``); one that sleeps on it instead, or a done-callback (``watch``), makes the
I/O thread watch the link at once (the I/O thread reads ``sleepers`` and ``read_end``).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zchannel.broker.connection.line import UP, Line
from zchannel.broker.connection.requestqueue import Convert, RequestQueue
from zchannel.broker.connection.tuning import DRIVE_S, SPIN_PROBE, SPIN_SCORE_MAX, spin_seconds
from zchannel.broker.connection.work import Work
from zchannel.broker.wire.protocol import Request

log = logging.getLogger("zchannel.client")

_POLLIN = int(zmq.POLLIN)


class Waiting:
    """Callers that send and read the socket themselves (see the module docstring)."""

    def __init__(self, line: Line, requests: RequestQueue, read_one: Callable[..., bool]) -> None:
        self._line = line
        self._requests = requests
        self._queue = requests.queue
        self._pending = requests.pending
        self._read_one = read_one
        self.read_end = 0.0  # when a waiting thread last stopped reading the link
        self.sleepers = 0  # threads asleep in wait_for (the I/O thread then watches the link)
        self._sleepers_lock = threading.Lock()
        self.spin_s = spin_seconds()
        self.spin_score = SPIN_SCORE_MAX  # a hit adds 1, a miss takes 2; spin while > 0
        self._calls = itertools.count()

    def call(self, rec: Request, frames: list, convert: Convert | None = None,
             cancellable: bool = False, owner: Any = None) -> Work:
        """``Connection.call`` on a connection that is up: the caller sends its request and,
        when no other thread holds the socket, reads replies itself, spinning for up to
        ``SPIN_US`` and then sleeping in ``poll`` for up to ``DRIVE_S`` (a sync round trip
        without waking the I/O thread twice); whatever is still pending after that is
        completed by the I/O thread as usual."""
        if self._line.reads_here():
            raise RuntimeError("a blocking channel call in a done-callback, then() or a signal "
                               "handler that runs while this thread reads the connection's "
                               "replies would wait for itself: make it with async_op=True, or "
                               "from another thread")
        # queued first: waiting for room (max_inflight) must not hold the socket, or the
        # replies that make room could never be read
        work = self._requests.enqueue(rec, frames, convert, cancellable, owner=owner)
        if work._state:  # failed already: the handle closed meanwhile
            return work
        spin = bool(self.spin_s) and (
            self.spin_score > 0 or next(self._calls) % SPIN_PROBE == 0)
        try:
            if not self._read_for(work, DRIVE_S, spin):
                self._line.wake_io()
        except BaseException:
            withdraw(work)
            raise
        return work

    def _read_for(self, work: Work, limit: float, spin: bool = False) -> bool:
        """Take the socket if it is free (False if not, at once), send what is queued, read
        replies until ``work`` completes (spinning first if ``spin``), for up to ``limit``,
        and give the socket back."""
        took_wake = taken = False
        line = self._line
        try:  # entered before the socket is taken: an interruption never leaves it taken
            taken = line.take()
            if not taken:
                return False
            self._requests.send_queued()
            if spin:
                self._spin(work)
            if work._state == 0:
                took_wake = self._drive(work, limit)
            self.read_end = time.monotonic()
        finally:  # also when interrupted (KeyboardInterrupt): ``withdraw`` then sees to it
            if taken:  # given back before any call (an interruption comes at calls)
                line.holder = 0
                line.sock_lock.release()
                if took_wake or self._queue or (self._pending and not line.callers_read):
                    # the I/O thread takes over the rest (this caller may have consumed the
                    # socket's notification edge, so it must look at the socket itself)
                    line.wake_io()
            else:
                line.give_back()
        return True

    def _spin(self, work: Work) -> None:
        """Poll for ``work``'s reply without sleeping, for up to ``SPIN_US``."""
        line = self._line
        poll_set = [(line.readable, _POLLIN)]
        poll = zmq.zmq_poll
        buffered = line.transport.buffered
        read_one = self._read_one
        queue = self._queue
        end = time.perf_counter() + self.spin_s
        while work._state == 0 and not line.closing:
            if buffered():  # read already (no poll sees it)
                read_one()
            elif poll(poll_set, 0):
                read_one(ready=True)
            elif time.perf_counter() >= end:
                self.spin_score = max(0, self.spin_score - 2)
                return
            if queue:  # other threads' requests go out at once, not after this reply
                self._requests.send_queued()
        self.spin_score = min(SPIN_SCORE_MAX, self.spin_score + 1)

    def wait_for(self, work: Work, timeout: float | None) -> None:
        """``Work.wait`` over a direct link: unless another thread has the socket, read the link
        until ``work`` completes, for up to ``DRIVE_S``; then (or else) sleep until the I/O
        thread completes it, for the rest of ``timeout``.  Replies that come while nobody reads
        are the I/O thread's once ``LAZY_S`` passed without a reader."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        line = self._line
        if line.state == UP and not line.closing and os.getpid() == line.pid:
            limit = DRIVE_S if deadline is None else min(DRIVE_S, deadline - time.monotonic())
            if self._read_for(work, max(0.0, limit)) and work._state:
                return
        # sleep on the gate: the I/O thread must watch the link now, not in LAZY_S
        with self._sleepers_lock:
            self.sleepers += 1
        try:
            line.wake_io()
            remaining = -1 if deadline is None else max(0.0, deadline - time.monotonic())
            work._sleep(remaining)
        finally:
            with self._sleepers_lock:
                self.sleepers -= 1

    def watch(self) -> None:
        """Make the I/O thread watch the direct link now (a Work got a done-callback, e.g. an
        asyncio await: no thread may come to read its reply)."""
        self.read_end = 0.0
        self._line.wake_io()

    def _drive(self, work: Work, limit: float = DRIVE_S) -> bool:
        """Wait for ``work``'s reply for up to ``limit``, reading replies and sending what
        other threads queue meanwhile: their wake-up of the I/O thread wakes this caller too
        (the I/O thread, finding the socket taken, writes it again for this caller).  True if
        it took such a wake-up: the caller passes it on when it lets the socket go."""
        line = self._line
        sock, wake = line.readable, line.wake
        poll_set = [(sock, _POLLIN), (wake, _POLLIN)]
        took_wake = False
        buffered = line.transport.buffered
        read_one = self._read_one
        queue = self._queue
        deadline = time.monotonic() + limit
        while work._state == 0 and not line.closing:
            if buffered():  # messages one read cut already: no poll would see them
                read_one()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for obj, _ in zmq.zmq_poll(poll_set, int(remaining * 1000.0) + 1):
                if obj != wake:
                    read_one(ready=True)
                else:
                    try:
                        os.eventfd_read(wake)
                    except BlockingIOError:  # the I/O thread read it first
                        pass
                    line.woken = False
                    took_wake = True
            if queue:
                self._requests.send_queued()
        return took_wake


def withdraw(work: Work) -> None:
    """A blocking call was interrupted (``KeyboardInterrupt``, or an exception a signal handler
    raised) while its request waits: withdraw it at the broker if it may be (a get, a put
    waiting for room), so that no later item goes to a get nobody waits for; the interruption
    is what the caller sees."""
    if work.done():
        return
    try:
        work.cancel()
    except Exception:
        log.debug("could not withdraw an interrupted request", exc_info=True)
