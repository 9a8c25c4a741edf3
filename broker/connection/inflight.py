"""The requests in flight of one connection (``pending``, by id) as their replies are delivered,
so that an interruption loses none.

Whichever thread reads the connection delivers the replies it reads.  In the main thread a
Python signal handler (Ctrl-C's ``KeyboardInterrupt``) runs between two bytecodes -- when a
call returns, among others -- and what it raises leaves the delivery there: a request popped
from ``pending`` whose ``Work`` was not completed yet would be lost, and its caller would wait
for ever.  So a request stays in ``pending`` until its ``Work`` is completed (``delivered``),
and a delivery an interruption cut short is made again (``Connection._recv_one``) from it:
completing a ``Work`` twice does nothing.  Its slot is given back before its ``Work`` is
completed (a done-callback may issue a request), once: ``release`` marks it in ``released``
in the same step, and ``take_out`` (a request failed, or forgotten) does not give it again.
"""

from __future__ import annotations

from typing import Any

from zchannel.broker.connection.flowcontrol import FlowControl


class InFlight:
    """What the reply path does with ``pending`` (see the module docstring); ``pending`` and
    ``flows`` are its ``RequestQueue``'s."""

    __slots__ = ("pending", "flows", "released")

    def __init__(self, pending: dict[int, Any], flows: FlowControl) -> None:
        self.pending = pending
        self.flows = flows
        self.released: dict[int, bool] = {}  # requests still pending whose slot is free

    def release(self, rid: int, owner: Any) -> None:
        """Give back the slot of request ``rid`` of ``owner`` (its reply came), once."""
        released = self.released
        if rid in released:
            return
        flows = self.flows
        flow = flows.own if owner is None else owner
        released[rid] = True  # marked and counted with no call between them
        flow.completed = next(flow.completed_count)
        if flow.deferred or flows.room_waiters:
            flows.after_release(flow)

    def delivered(self, rid: int) -> None:
        """Request ``rid``'s ``Work`` is completed: out of ``pending`` (no call here)."""
        pending, released = self.pending, self.released
        if rid in pending:
            del pending[rid]
        if rid in released:
            del released[rid]

    def take_out(self, rid: int) -> Any:
        """Take request ``rid`` out of ``pending`` (it fails, or its reply is not awaited any
        more), its slot given back unless its reply's delivery gave it already; its in-flight
        entry (None: not pending)."""
        entry = self.pending.pop(rid, None)
        if entry is not None:
            if rid in self.released:
                del self.released[rid]
            else:
                self.flows.release(self.flows.flow_of(entry[3]))
        return entry
