"""What every part of a connection shares: its line to the broker.

``Line`` holds the transport and who may touch it (the socket lock and its holder), the
descriptors' closed flags, the wake-up eventfd of the I/O thread (and its lock), the
connection's state (and the condition that announces it), the broker's heartbeat interval and
liveness, the times of the last message sent and received, whether a hello is due at once, and
the broker's last notice of a large message.
``Connection`` (``connection/connection.py``) makes one and gives it to each of its parts; a
part reads and writes these fields and calls these methods, nothing else of another part.

Whoever holds ``sock_lock`` is the only thread touching the transport (zmq sockets are not
thread-safe); ``holder`` says which user thread it is (0: none, or the I/O thread).  The I/O
thread closes the transport and the eventfd as its last act, holding the locks every other
thread takes before it touches them (``close_fds``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from zchannel.broker.transport.seam import Transport
from zchannel.broker.wire.protocol import NOTICE_BYTES, client_notice, pack_header

CONNECTING, UP, DOWN, CLOSED = "connecting", "up", "down", "closed"
_AT_ONCE = (False,)  # ``sock_lock.acquire``'s argument in ``take``: do not block
# the thread Python runs signal handlers in (a forked child's: the thread that forked)
_main = [threading.main_thread().ident]
os.register_at_fork(after_in_child=lambda: _main.__setitem__(0, threading.get_ident()))


class Line:
    """A connection's transport, its locks, wake-up, state and traffic times (module docstring)."""

    __slots__ = ("transport", "callers_read", "readable", "pid", "hb", "liveness", "state",
                 "state_cv", "sock_lock", "holder", "took", "io_ident", "fds_closed", "closing", "wake", "wake_lock",
                 "wake_closed", "woken", "last_recv", "last_send", "hello_due",
                 "announced_at", "arrival_s")

    def __init__(self, transport: Transport, hb: float, liveness: int) -> None:
        self.transport = transport
        # callers send and read it themselves (the direct link; see waiting.py)
        self.callers_read = transport.callers_read
        # what a poll waits on for replies: the socket, or the link's descriptor
        self.readable = transport.readable
        self.pid = os.getpid()  # the process whose threads may use it
        # the heartbeat interval and liveness: the broker's once it said hello
        # (``Liveness.adopt_heartbeat``); the broker is dead after ``hb * liveness`` of silence
        self.hb = hb
        self.liveness = liveness
        self.state = CONNECTING
        self.state_cv = threading.Condition()
        self.sock_lock = threading.Lock()
        self.holder = 0  # the user thread that holds sock_lock (close() must not join then)
        self.took: list[bool] = []  # what ``take``'s acquire returned, in the main thread
        self.io_ident = 0  # the I/O thread's (set when it starts)
        self.fds_closed = False  # the I/O thread closed the transport (under sock_lock)
        self.closing = False  # the I/O thread was asked to end (``Connection.stop``)
        self.wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # closed by the I/O thread as its last act, under this lock: a wake-up written later
        # must not reach a descriptor that reused the number (``signal``)
        self.wake_lock = threading.Lock()
        self.wake_closed = False
        self.woken = False  # an eventfd wake-up is pending (saves a system call per request)
        self.last_recv = time.monotonic()  # life from the broker (``Liveness.silent_for``)
        self.last_send = 0.0
        # a caller waits for the broker to answer again (``connection/revival.py``): the I/O
        # thread's next turn relinks a broken direct link and says hello, whenever it last did
        self.hello_due = False
        # the broker's last notice (``protocol.NOTICE_BYTES``): when it came (``last_recv``
        # then) and how long its message may take to arrive (``Liveness.life``)
        self.announced_at = 0.0
        self.arrival_s = 0.0

    def set_state(self, state: str) -> None:
        """Change the state and wake every thread waiting on ``state_cv``."""
        with self.state_cv:
            self.state = state
            self.state_cv.notify_all()

    def send(self, records: list, frames: list) -> bool:
        """One message (``records`` in its header, then ``frames``), by the socket's holder;
        False when it is lost so (the transport broke: ``Transport.send``)."""
        sent = self.transport.send([pack_header(records), *frames])
        self.last_send = time.monotonic()
        return sent

    def announce(self, nbytes: int) -> None:
        """Before a message of ``nbytes`` of frames (by the socket's holder): over ZeroMQ, which
        hands a message over only whole, one of at least ``NOTICE_BYTES`` goes right behind a
        notice naming them (over a direct link, bytes arriving are life already)."""
        if nbytes >= NOTICE_BYTES and not self.callers_read:
            self.transport.send([pack_header([client_notice(nbytes)])])

    def reads_here(self) -> bool:
        """Whether the calling thread reads this line's replies now (the I/O thread, or a user
        thread driving the socket): a callback or a signal handler running there must not
        wait for a reply, which only this thread could read."""
        return threading.get_ident() in (self.holder, self.io_ident)

    def take(self) -> bool:
        """Take the socket for this (user) thread if it is free and still open.  The caller
        gives it back in a ``finally`` it entered before the call (``give_back``): in the main
        thread, where signal handlers run, an interruption (a signal handler's exception, which
        comes when a call returns) right after the lock was acquired must not leave it taken,
        so there the acquire's result is recorded by the call that makes it (``took``)."""
        me = threading.get_ident()
        if me != _main[0]:
            if not self.sock_lock.acquire(blocking=False):
                return False
            if self.fds_closed:
                self.sock_lock.release()
                return False
            self.holder = me
            return True
        took = self.took
        took.extend(map(self.sock_lock.acquire, _AT_ONCE))
        if not took[-1]:
            del took[-1]
            return False
        if self.fds_closed:
            self.give()
            return False
        self.holder = me
        del took[-1]  # (no call between the two: ``holder`` says it from here on)
        return True

    def run_if_free(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` with the socket taken if it is free and open (True), else not (False)."""
        taken = False
        try:  # entered before the socket is taken: an interruption never leaves it taken
            taken = self.take()
            if taken:
                fn()
            return taken
        finally:
            if taken:  # given back before any call (an interruption comes at calls)
                self.holder = 0
                self.sock_lock.release()
            else:
                self.give_back()

    def give_back(self) -> None:
        """In a ``finally`` whose ``take`` returned False: give the socket back if that take
        acquired it before an interruption cut it short (never when this thread held it
        already: a take made then fails).  A ``take`` that returned True is given back with
        no call before the release (``run_if_free``): this one's call could be interrupted."""
        took = self.took
        if took and threading.get_ident() == _main[0]:
            if took[-1]:
                self.give()
            else:
                del took[:]

    def give(self) -> None:
        """Give back the socket ``take`` took."""
        took = self.took
        if took:
            del took[:]  # (no call before the release)
        self.holder = 0
        self.sock_lock.release()

    def wake_io(self) -> None:
        """Make sure the I/O thread wakes (once per batch: it re-arms before each round)."""
        if not self.woken:
            self.woken = True
            self.signal()

    def signal(self) -> None:
        """Write a wake-up, unless the I/O thread closed the eventfd (it ended)."""
        with self.wake_lock:
            if not self.wake_closed:
                os.eventfd_write(self.wake, 1)

    def close_fds(self) -> None:
        """Close the transport and the wake-up eventfd (with the socket lock taken, or before
        any thread could use them)."""
        self.fds_closed = True
        self.transport.close()
        self.close_wake()

    def close_wake(self) -> None:
        """Close the wake-up eventfd (a wake-up written later finds it closed)."""
        with self.wake_lock:
            if not self.wake_closed:
                self.wake_closed = True
                os.close(self.wake)

    def after_fork(self) -> None:
        """In a forked child: the I/O thread did not come along, so nothing may wait for it;
        fresh locks (a parent's thread may have held them at the fork), the transport left to
        the parent and the child's copy of the eventfd closed."""
        self.closing = True
        self.wake_lock = threading.Lock()
        self.sock_lock = threading.Lock()
        self.took = []
        self.fds_closed = True
        self.transport.close_after_fork()
        if not self.wake_closed:
            self.wake_closed = True
            os.close(self.wake)
