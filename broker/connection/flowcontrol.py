"""Flow control of a connection's issuers of requests: each issuer (a handle's share, or the
connection itself for requests of no handle) has at most ``max_inflight`` requests issued and
not completed.

A request the broker may hold waiting (``may_wait``) that finds its issuer's limit reached
waits for room.  A blocking caller waits in its own thread (``FlowControl.wait_for_room``).  An
asynchronous request (``async_op=True``) made on the thread that runs an asyncio event loop
must not block that loop -- the replies that make room may be the loop's to consume -- so it
waits in its ``Work`` instead (``FlowControl.defer``): the request is queued as soon as a slot
frees, in the order it was made, and its ``timeout`` counts from the call (``TimeoutError``, as
a blocking caller's, when it runs out first).  ``cancel()`` withdraws it while it waits, and
the handle's ``close`` fails it with ``ChannelError``.  A request is queued by
``RequestQueue`` (``connection/requestqueue.py``), which owns the ``FlowControl`` of its
connection and gives it ``issue``: the function that queues a waiting request once it has
room, and ``give_back``: what a request that fails unsent gives back (a put's shared-memory
slots).

Such a request made while its connection is down waits in its ``Work`` for the broker to answer
again first (``Deferred.revive_by``, set by ``connection/revival.py``, whose watcher thread
moves it on: ``move_parked``): it stays at the front of its issuer's waiting requests, the
ones made after it behind it, until the connection is up (then it waits for room like the
others) or its time runs out (``BrokerUnavailable``, nothing sent).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

from zchannel.broker.connection.line import CLOSED, DOWN, Line
from zchannel.broker.connection.tuning import CONNECT_MIN_S
from zchannel.broker.connection.work import CancelledError, Work
from zchannel.broker.errors import BrokerUnavailable
from zchannel.broker.wire.protocol import Get, GetBatch, Put, Request, op_of


def may_wait(rec: Request) -> bool:
    """Whether the broker may hold ``rec`` waiting (a put, get or get_batch that is not
    ``nowait``): only those wait for room among ``max_inflight`` outstanding requests.  The
    others (``*_nowait``, ``qsize``, ``full``, ``stats``, ``ack``...) are answered at once, so
    they go out even when the handle's outstanding gets are all waiting for items."""
    return isinstance(rec, (Put, Get, GetBatch)) and not rec.nowait


def in_event_loop() -> bool:
    """Whether the calling thread runs an asyncio event loop now."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Flow:
    """Flow control of one issuer of requests (a handle's share, or the connection itself):
    at most ``max_inflight`` issued and not completed (atomic counters), and its requests
    waiting for room in their ``Work`` (``deferred``, made at the first)."""

    __slots__ = ("issued", "n_issued", "completed", "completed_count", "deferred")

    def __init__(self) -> None:
        self.issued = itertools.count()
        self.n_issued = 0
        self.completed = 0
        self.completed_count = itertools.count(1)
        self.deferred: deque[Deferred] | None = None


class Deferred:
    """A request waiting for room in its ``Work`` (``FlowControl.defer``): its record, frames
    and in-flight entry (``requestqueue.Pending``), its number among its issuer's requests
    (``seq``: it has room when at most ``max_inflight`` of them are not completed), its issuer
    and when it was made; ``revive_by``: 0, or until when it waits for the broker to answer
    again (made while the connection was down: ``connection/revival.py``)."""

    __slots__ = ("rec", "frames", "pending", "seq", "flow", "start", "revive_by")

    def __init__(self, rec: Request, frames: list, pending: tuple, seq: int, flow: Flow) -> None:
        self.rec = rec
        self.frames = frames
        self.pending = pending
        self.seq = seq
        self.flow = flow
        self.start = time.monotonic()
        self.revive_by = 0.0


class FlowControl:
    """The flow control of one connection (see the module docstring)."""

    def __init__(self, line: Line, address: str, max_inflight: int) -> None:
        self._line = line
        self.address = address
        self.max_inflight = max_inflight
        self.own = Flow()  # the connection's own requests (of no handle)
        self._room = threading.Condition()  # callers wait on it only when the limit is reached
        self.room_waiters = 0
        # queues a deferred request that has room: None, or the error that fails it unsent
        # (set by the ``RequestQueue``; called with ``_room`` held)
        self.issue: Callable[[Deferred], BaseException | None] = lambda entry: None
        # gives back what a request that fails unsent holds (set by the ``RequestQueue``)
        self.give_back: Callable[[Request], None] = _holds_nothing

    def flow_of(self, owner: Flow | None) -> Flow:
        return self.own if owner is None else owner

    def wait_for_room(self, rec: Request, flow: Flow) -> None:
        """Block until fewer than ``max_inflight`` requests are outstanding.  The wait counts
        against the request's ``timeout``: the rest travels with the request, and
        ``TimeoutError`` (nothing sent) when none is left."""
        timeout = rec.timeout if isinstance(rec, (Put, Get, GetBatch)) else None
        start = time.monotonic()
        line = self._line
        with self._room:
            self.room_waiters += 1
            try:
                while flow.n_issued - flow.completed > self.max_inflight:
                    if line.state in (DOWN, CLOSED):
                        raise BrokerUnavailable(f"the broker at {self.address} is unavailable")
                    wait = line.hb
                    if timeout is not None:
                        remaining = timeout - (time.monotonic() - start)
                        if remaining <= 0:
                            raise self.no_room(rec)
                        wait = min(wait, remaining)
                    self._room.wait(wait)
            finally:
                self.room_waiters -= 1
        if timeout is not None and isinstance(rec, (Put, Get, GetBatch)):
            rec.timeout = max(0.0, timeout - (time.monotonic() - start))

    def no_room(self, rec: Request) -> TimeoutError:
        return TimeoutError(f"{op_of(rec)} timed out waiting for room among this handle's "
                            f"{self.max_inflight} outstanding requests")

    def unanswered(self, entry: Deferred) -> BrokerUnavailable:
        """The error of ``entry`` whose time to wait for the broker ran out (its timeout, at
        most the connect budget: ``connection/revival.py``) with the connection still down."""
        return BrokerUnavailable(
            f"the broker at {self.address} is unavailable: it did not answer again within the "
            f"{entry.revive_by - entry.start:.3g}s this {op_of(entry.rec)} waited for it (its "
            f"timeout, at most {CONNECT_MIN_S:g}s); nothing was sent")

    def _late(self, entry: Deferred) -> BrokerUnavailable | TimeoutError:
        """The error of ``entry`` whose timeout ran out before it was sent: it waited for the
        broker to answer again (``unanswered``), or for room (``no_room``)."""
        if entry.revive_by and self._line.state == DOWN:
            return self.unanswered(entry)
        return self.no_room(entry.rec)

    def fail(self, entry: Deferred, error: BaseException) -> None:
        """Fail ``entry``, never sent and out of its issuer's waiting requests, with ``error``:
        what it holds goes back first (``give_back``; its frames too: its timer may hold the
        entry until it runs)."""
        self.give_back(entry.rec)
        entry.frames = []
        entry.pending[0].set_exception(error)

    def release(self, flow: Flow) -> None:
        """A request of ``flow`` completed: its slot is free (for a request waiting in its
        ``Work`` first, then for a blocked caller)."""
        flow.completed = next(flow.completed_count)
        self.after_release(flow)

    def after_release(self, flow: Flow) -> None:
        """``release`` after the count: the slot to a waiting request, or a blocked caller."""
        if flow.deferred:
            self.issue_waiting(flow)
        if self.room_waiters:
            with self._room:
                self._room.notify_all()

    def defer(self, entry: Deferred) -> None:
        """Let ``entry`` wait for room in its ``Work`` (the caller runs an event loop, see the
        module docstring); its ``timeout`` runs on that loop."""
        flow = entry.flow
        with self._room:
            entry.pending[0]._tag = entry  # its id once it is queued (``withdraw`` reads it)
            if flow.deferred is None:
                flow.deferred = deque()
            flow.deferred.append(entry)
        timeout = getattr(entry.rec, "timeout", None)
        if timeout is not None:
            asyncio.get_running_loop().call_later(timeout, self._expire, entry)
        self.issue_waiting(flow)  # room may have come meanwhile

    def issue_waiting(self, flow: Flow) -> None:
        """Queue ``flow``'s requests waiting in their ``Work`` that have room now, in order; one
        that waits for the broker to answer again (its connection down) holds back those
        after it."""
        failed = []
        issued = False
        line = self._line
        with self._room:
            deferred = flow.deferred
            while deferred and deferred[0].seq - flow.completed <= self.max_inflight:
                if deferred[0].revive_by and line.state == DOWN and not line.closing:
                    break  # (``move_parked`` moves it on)
                entry = deferred.popleft()
                error = self._timed_out(entry) or self.issue(entry)
                if error is None:
                    issued = True
                else:  # never sent: its slot is free for the next one
                    failed.append((entry, error))
                    flow.completed = next(flow.completed_count)
        if issued:
            line.wake_io()
        for entry, error in failed:
            self.fail(entry, error)

    def _timed_out(self, entry: Deferred) -> BrokerUnavailable | TimeoutError | None:
        """The error of ``entry`` if its timeout ran out while it waited (``_late``; its timer on
        the event loop has not run yet); else None, and what is left goes with it."""
        rec = entry.rec
        if isinstance(rec, (Put, Get, GetBatch)) and rec.timeout is not None:
            left = rec.timeout - (time.monotonic() - entry.start)
            if left <= 0:
                return self._late(entry)
            rec.timeout = left
        return None

    def _take_out(self, entry: Deferred) -> bool:
        """Take ``entry`` out of its issuer's waiting requests (its slot is free); False if it
        is not there any more (it was queued, or failed)."""
        flow = entry.flow
        with self._room:
            if not flow.deferred or entry not in flow.deferred:
                return False
            flow.deferred.remove(entry)
            flow.completed = next(flow.completed_count)
        return True

    def _expire(self, entry: Deferred) -> None:
        """``entry``'s timeout ran out while it waited for room (on its event loop)."""
        if self._take_out(entry):
            self.fail(entry, self._late(entry))
            self.issue_waiting(entry.flow)

    def withdraw(self, work: Work) -> bool:
        """Withdraw ``work``'s request if it waits for room in it (``CancelledError``); False
        when it does not (it was queued: the broker withdraws it, if anyone)."""
        with self._room:  # a request that gets room is given its id with this held
            entry = work._tag
        if not isinstance(entry, Deferred) or not self._take_out(entry):
            return False
        self.fail(entry, CancelledError("the operation was withdrawn before it was sent"))
        self.issue_waiting(entry.flow)
        return True

    def drop(self, flow: Flow, exc: BaseException) -> None:
        """Fail ``flow``'s requests waiting for room with ``exc`` (its handle closed)."""
        with self._room:
            entries = list(flow.deferred or ())
            if flow.deferred:
                flow.deferred.clear()
            for _ in entries:
                flow.completed = next(flow.completed_count)
        for entry in entries:
            self.fail(entry, exc)

    def move_parked(self, flow: Flow, failure: BaseException | None = None) -> bool:
        """Move on ``flow``'s requests that wait for the broker to answer again (``revive_by``;
        ``connection/revival.py``'s watcher calls this): with the connection up (or closing),
        they wait only for room now, and go out if they have it; while it is down, those whose
        time ran out fail (``unanswered``), and every one with ``failure`` when it is set
        (nothing listens at the address).  Whether any still waits for the broker."""
        line = self._line
        up = line.state != DOWN or line.closing
        now = time.monotonic()
        failed = []
        with self._room:
            deferred = flow.deferred or deque()
            kept: deque[Deferred] = deque()
            for entry in deferred:
                if entry.revive_by and up:
                    entry.revive_by = 0.0
                elif entry.revive_by and (failure is not None or now >= entry.revive_by):
                    failed.append(entry)
                    flow.completed = next(flow.completed_count)
                    continue
                kept.append(entry)
            if failed:
                deferred.clear()
                deferred.extend(kept)
            waiting = not up and any(entry.revive_by for entry in deferred)
        for entry in failed:
            self.fail(entry, failure or self.unanswered(entry))
        self.issue_waiting(flow)
        return waiting

    def parked(self, flow: Flow) -> bool:
        """Whether a request of ``flow`` waits for the broker to answer again."""
        with self._room:
            return any(entry.revive_by for entry in flow.deferred or ())

    def after_fork(self) -> None:
        """In a forked child: a fresh condition (a parent's thread may have held it)."""
        self._room = threading.Condition()


def _holds_nothing(rec: Request) -> None:
    """``FlowControl.give_back`` until its ``RequestQueue`` sets it: nothing to give back."""
