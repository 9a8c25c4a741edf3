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
"""

from __future__ import annotations

import time
from typing import Any

from zchannel.broker.connection.line import CLOSED, DOWN, Line
from zchannel.broker.connection.liveness import RELINK_S
from zchannel.broker.connection.tuning import connect_budget
from zchannel.broker.errors import BrokerUnavailable, ChannelError, ChannelNotFound
from zchannel.broker.host import paths


class Revival:
    """What a request issued on a ``DOWN`` connection does first (see the module docstring):
    ``revival(rec, async_op)`` (``rec`` a request record) returns once the connection is up again, with ``rec.timeout``
    reduced by the wait, or raises (``BrokerUnavailable``; ``ChannelError`` when the connection
    closed meanwhile)."""

    def __init__(self, line: Line, address: str) -> None:
        self._line = line
        self.address = address

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
