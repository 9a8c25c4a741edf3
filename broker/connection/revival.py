"""A handle's call made while its connection is down waits for the broker to answer again.

A connection is ``DOWN`` once its broker went silent past the expiry, or closed its direct link
with nothing listening at its path (``connection/liveness.py``).  Its I/O thread then relinks a
broken direct link (every ``RELINK_S`` while it turns) and says hello (every heartbeat
interval) by itself; the first hello answered brings the connection ``UP`` again: a broker
started again at the address (a durable channel's keeper, a service manager) serves it from
there.  An idle connection's I/O thread turns only every half heartbeat interval, so a call
made meanwhile does not fail for that: ``Revival`` asks the I/O thread to relink and say hello
at once (``Line.hello_due``) and waits for the answer as long as a handle's first connection
would (``tuning.connect_budget`` of the call's timeout; a ``nowait`` call counts as
``timeout=0``), and that wait counts against the call's timeout.

It fails with ``BrokerUnavailable`` at once when nothing can be listening at the address
(``paths.probe``: no socket file, a killed broker's file with nothing on it, a tcp connection
refused), as soon as nothing listens at the broker's ipc path any more while it waits, and
when the budget runs out.  The thread that reads the connection's replies (the I/O thread, a
callback running there, a caller holding the socket) fails at once too: only it could read the
answer it would wait for.

An ``async_op=True`` call made on the thread that runs an asyncio event loop must not block
that loop (a hung broker would freeze it for the whole budget, call after call): it returns its
``Work`` at once and its request waits in it instead (``park``), behind the requests it made
before, as one waiting for room does (``connection/flowcontrol.py``).  It waits for its
timeout, at most ``connect_budget`` of an asynchronous call, and then fails with
``BrokerUnavailable``, nothing sent; ``cancel()`` withdraws it, the handle's ``close`` fails it
with ``ChannelError``.  A watcher thread, running while such requests wait, does the waiting
for them: it asks the I/O thread for a hello, probes the address (off the loop: a tcp probe
may take a while), and moves them on (``FlowControl.move_parked``) -- out as soon as the
connection is up, failed when their time runs out or nothing listens any more.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from zchannel.broker.connection.flowcontrol import Deferred, Flow, FlowControl
from zchannel.broker.connection.line import CLOSED, DOWN, Line
from zchannel.broker.connection.liveness import RELINK_S
from zchannel.broker.connection.tuning import connect_budget
from zchannel.broker.errors import BrokerUnavailable, ChannelError, ChannelNotFound
from zchannel.broker.host import paths

log = logging.getLogger("zchannel.client")


class Revival:
    """What a request issued on a ``DOWN`` connection does first (see the module docstring):
    ``revival(rec, async_op)`` (``rec`` a request record) returns once the connection is up
    again, with ``rec.timeout`` reduced by the wait, or raises (``BrokerUnavailable``;
    ``ChannelError`` when the connection closed meanwhile); ``park(entry, flows)`` lets an
    asynchronous request made on an event loop's thread wait in its ``Work`` instead."""

    def __init__(self, line: Line, address: str) -> None:
        self._line = line
        self.address = address
        self._lock = threading.Lock()  # guards the two below
        self._parked: dict[int, Flow] = {}  # the issuers of parked requests, by id
        self._watcher: threading.Thread | None = None  # runs while requests are parked

    def __call__(self, rec: Any, async_op: bool) -> None:
        line = self._line
        if line.reads_here():
            raise BrokerUnavailable(f"the broker at {self.address} is unavailable")
        nowait = bool(getattr(rec, "nowait", False))
        timeout = 0.0 if nowait else getattr(rec, "timeout", None)
        budget = connect_budget(timeout, async_op)
        start = time.monotonic()
        self._wait_up(start + budget, budget)
        if timeout is not None and not nowait:
            rec.timeout = max(0.0, timeout - (time.monotonic() - start))

    def _wait_up(self, deadline: float, budget: float) -> None:
        """Ask the I/O thread for a hello now and wait until its answer brought the connection
        up (until ``deadline``, the end of ``budget`` seconds)."""
        line = self._line
        self._listened_to()
        line.hello_due = True
        line.signal()
        while True:
            with line.state_cv:
                if line.state == DOWN:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise BrokerUnavailable(
                            f"the broker at {self.address} is unavailable: it did not answer a "
                            f"hello within {budget:g}s")
                    line.state_cv.wait(min(remaining, RELINK_S))
                state = line.state
            if state == CLOSED or line.closing:
                raise ChannelError("this channel handle is closed")
            if state != DOWN:
                return
            if paths.nothing_listens(self.address):
                raise BrokerUnavailable(f"the broker at {self.address} is gone (nothing "
                                        "listens at its path any more)")
            line.signal()  # a direct link not linked yet is tried again (every ``RELINK_S``)

    def _listened_to(self) -> None:
        """``BrokerUnavailable`` when nothing can be listening at the address (``paths.probe``)."""
        try:
            paths.probe(self.address)
        except ChannelNotFound as exc:
            raise BrokerUnavailable(f"the broker at {self.address} is unavailable: "
                                    f"{exc}") from None

    def park(self, entry: Deferred, flows: FlowControl) -> None:
        """Let ``entry``, a request made on an event loop's thread while the connection is
        down, wait in its ``Work`` for the broker to answer again (see the module docstring):
        for its timeout, at most ``connect_budget`` of an asynchronous call.  Returns at once;
        the first request parked asks for a hello now, and a watcher thread starts for it."""
        timeout = getattr(entry.rec, "timeout", None)
        budget = connect_budget(timeout, async_op=True)
        entry.revive_by = entry.start + (budget if timeout is None else min(timeout, budget))
        flows.defer(entry)  # (first: the watcher sees it from here on)
        with self._lock:
            self._parked[id(entry.flow)] = entry.flow
            if self._watcher is not None:
                return
            watcher = self._watcher = threading.Thread(
                target=self._watch, args=(flows,), daemon=True,
                name=f"zchannel-revival {self.address}")
        line = self._line
        line.hello_due = True
        line.signal()
        watcher.start()

    def _watch(self, flows: FlowControl) -> None:
        """The watcher thread: until no request is parked, wait for the connection to come up
        (every ``RELINK_S`` at most) and move the parked requests on (``flows``: the
        connection's ``FlowControl``)."""
        line = self._line
        try:
            try:
                self._listened_to()
                failure: BrokerUnavailable | None = None
            except BrokerUnavailable as exc:
                failure = exc
            while self._move_parked(flows, failure):
                line.signal()  # a direct link not linked yet is tried again
                with line.state_cv:
                    if line.state == DOWN and not line.closing:
                        line.state_cv.wait(RELINK_S)
                failure = None
                if line.state == DOWN and paths.nothing_listens(self.address):
                    failure = BrokerUnavailable(f"the broker at {self.address} is gone "
                                                "(nothing listens at its path any more)")
        except Exception:  # pragma: no cover - a bug here must not leave requests waiting
            log.exception("zchannel revival watcher failed")
            self._move_parked(flows, BrokerUnavailable(f"the broker at {self.address} is "
                                                       "unavailable"))

    def _move_parked(self, flows: FlowControl, failure: BrokerUnavailable | None) -> bool:
        """One turn of the watcher (``FlowControl.move_parked`` of each issuer with parked
        requests); False once none is left: the watcher ends then."""
        with self._lock:
            issuers = list(self._parked.values())
        for flow in issuers:
            flows.move_parked(flow, failure)
        with self._lock:
            # a request parked after its issuer's turn is seen here, or parks after this
            # (and starts a new watcher, this one having ended)
            self._parked = {key: flow for key, flow in self._parked.items()
                            if flows.parked(flow)}
            if self._parked:
                return True
            self._watcher = None
            return False

    def after_fork(self) -> None:
        """In a forked child: no watcher runs (its parent's is not there), fresh lock."""
        self._lock = threading.Lock()
        self._parked = {}
        self._watcher = None
