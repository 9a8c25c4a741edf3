"""Threads that wait for replies of one connection, and read them themselves when they can.

``Waiting`` is that part of ``connection.Connection`` (its attributes are the connection's;
see that module's docstring).  A blocking call (``call``) takes the socket lock when it is free,
sends its request, polls for the reply without sleeping for up to ``SPIN_US``, then in ``poll``
for up to ``DRIVE_S`` (``_drive``), completing every reply it reads, and hands the socket back
to the I/O thread.  Over a transport whose callers read it themselves (the direct link,
``transport/seam.py``) a thread waiting on a ``Work`` does the same (``wait_for``); one that sleeps
on it instead, or a done-callback (``watch``), makes the I/O thread watch the link at once.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

import zmq
from zchannel.broker.connection.liveness import UP
from zchannel.broker.connection.parts import ConnectionParts, Convert
from zchannel.broker.connection.tuning import DRIVE_S, SPIN_PROBE, SPIN_SCORE_MAX, spin_seconds
from zchannel.broker.connection.work import Work
from zchannel.broker.wire.protocol import Request

_POLLIN = int(zmq.POLLIN)


class Waiting(ConnectionParts):
    """Callers that send and read the socket themselves, and the wake-ups of the I/O thread
    (see the module docstring)."""

    def _init_waiting(self) -> None:
        self._read_end = 0.0  # when a waiting thread last stopped reading the link
        self._sleepers = 0  # threads asleep in wait_for (the I/O thread then watches the link)
        self._sleepers_lock = threading.Lock()
        self._spin_s = spin_seconds()
        self._spin_score = SPIN_SCORE_MAX  # a hit adds 1, a miss takes 2; spin while > 0
        self._calls = itertools.count()

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
            if took_wake or self._queue or (self._pending and not self._callers_read):
                # the I/O thread takes over the rest (this caller may have consumed the
                # socket's notification edge, so it must look at the socket itself)
                self._wake_io()

    def _spin(self, work: Work) -> None:
        """Poll for ``work``'s reply without sleeping, for up to ``SPIN_US``."""
        poll_set = [(self._readable, _POLLIN)]
        poll = zmq.zmq_poll
        buffered = self.transport.buffered
        end = time.perf_counter() + self._spin_s
        while work._state == 0 and not self._closing:
            if buffered():  # read already (no poll sees it)
                self._recv_one()
            elif poll(poll_set, 0):
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
        buffered = self.transport.buffered
        deadline = time.monotonic() + limit
        while work._state == 0 and not self._closing:
            if buffered():  # messages one read cut already: no poll would see them
                self._recv_one()
                continue
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
