"""Cross-replica stealing of a distributed channel, opt-in (``steal = true`` in the cluster
file): keys move between replicas, only while empty.

Every key lives on one replica, and all its consumers (their private queues included) are
served there, so stealing *within* a key is the dispatcher's business on that replica.  Across
replicas, ``steal`` moves whole keys: once per heartbeat the binder (``broker/cluster/binding.py``)
looks at every live replica's load -- ``backlog`` (items queued) and ``starved`` (gets parked on
empty keys) -- and when one replica is **idle** (its consumers wait and it holds nothing) while
another is **backed up** (at least ``MOVE_BACKLOG`` items queued), it asks the backed-up one to
give one key to the idle one.  The giver picks a key that is empty at that moment (no items, no
leases out, no parked gets or puts: ``KeyState.idle``) and was active most recently, rebinds it
in its own table at once -- from then on it answers every operation on that key with
``KeyMoved`` -- and sends the new binding to every other live replica (a ``learn`` that
overwrites).  The receiver serves the key once it learned the binding; until then it too
answers ``KeyMoved`` (naming the old replica), and handles retry after a short pause.

So a key is never served by two replicas, and its FIFO order is kept: everything put before the
move was taken before it, everything after it goes to the new replica.  Items are never stolen;
a key that never empties never moves.  ``docs/decisions.md`` says why.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from zchannel.broker.cluster.binding import BindingTable
from zchannel.broker.connection.connection import UP
from zchannel.broker.errors import ChannelError, KeyMoved
from zchannel.broker.wire.protocol import (
    KEYED_TYPES,
    Learn,
    Load,
    LoadAnswer,
    Release,
    Request,
    key_from_wire,
    load_answer,
)

log = logging.getLogger("zchannel.broker")

# items a replica holds queued before it counts as backed up (an idle replica may then take a key)
MOVE_BACKLOG = 8


def choose_move(loads: dict[int, LoadAnswer]) -> tuple[int, int] | None:
    """(giver, taker) for one move, or None: the replica with the deepest backlog (at least
    ``MOVE_BACKLOG``) gives to the idle replica (nothing queued, gets parked) with the most
    parked gets."""
    idle = [i for i, load in loads.items() if load.backlog == 0 and load.starved > 0]
    busy = [i for i, load in loads.items() if load.backlog >= MOVE_BACKLOG]
    if not idle or not busy:
        return None
    giver = max(busy, key=lambda i: (loads[i].backlog, -i))
    taker = max(idle, key=lambda i: (loads[i].starved, -i))
    return giver, taker


class KeyMover:
    """Replica ``bindings.index``'s part in moving keys (see the module docstring)."""

    def __init__(self, bindings: BindingTable, core: Callable[[], Any]) -> None:
        self.bindings = bindings
        self._core = core  # the replica's QueueCore, once it serves
        self._loads: dict[int, Any] = {}  # peer -> pending load request (binder only)
        self._release: Any = None  # the pending release request (binder only)
        self._untold: dict[int, list] = {}  # peer -> moves (bindings) it has not acknowledged
        self._untold_lock = threading.Lock()  # the links' I/O threads add to it
        self.given = 0  # keys this replica gave away
        self.asked = 0  # moves this replica asked for (as the binder)

    # -- every replica ---------------------------------------------------------------------

    def check(self, rec: Request) -> None:
        """``KeyMoved`` for an operation on a key this replica does not hold (any more)."""
        if not isinstance(rec, KEYED_TYPES):
            return
        key = key_from_wire(rec.key)
        try:
            bound = self.bindings.table.get(key)
        except TypeError:
            return  # not a key: the operation itself says why
        if bound is not None and bound != self.bindings.index:
            raise KeyMoved(f"key {key!r} is on replica {bound}, not on replica "
                           f"{self.bindings.index}", bound)

    def load(self) -> LoadAnswer:
        """This replica's ``backlog`` (items queued) and ``starved`` (gets parked on empty keys)."""
        backlog = starved = 0
        for ks in self._core().keys.values():
            depth = ks.depth()
            backlog += depth
            if not depth:
                starved += len(ks.getters)
        return LoadAnswer(backlog=backlog, starved=starved)

    def release(self, to: Any) -> bool:
        """Give one empty key of this replica to replica ``to`` (see the module docstring);
        False when none is empty now."""
        b = self.bindings
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < len(b.replicas) \
                or to == b.index:
            raise ValueError(f"cannot give a key to replica {to!r}")
        core = self._core()
        mine = [ks for ks in core.keys.values() if ks.idle() and b.table.get(ks.key) == b.index]
        for ks in sorted(mine, key=lambda ks: ks.idle_since or 0.0, reverse=True):
            if core.drop_idle_key(ks.key):
                b.table[ks.key] = to
                for i in range(len(b.replicas)):
                    if i != b.index:
                        self._tell(i, [[ks.key, to]])
                self.given += 1
                log.info("replica %d gave the empty key %r to the idle replica %d", b.index,
                         ks.key, to)
                return True
        return False

    def _tell(self, peer: int, entries: list) -> None:
        """Send moves to ``peer`` (a ``learn`` that overwrites); sent again every heartbeat
        until it acknowledged them: a receiver that missed its move would answer ``KeyMoved``
        naming this replica for ever."""
        try:
            work = self.bindings.peer(peer).request(Learn(id=0, entries=entries, force=True), [])
        except ChannelError:
            self._untell(peer, entries)
            return

        def done(work: Any) -> None:  # runs in the link's I/O thread
            if work.exception() is not None:
                self._untell(peer, entries)

        work.add_done_callback(done)

    def _untell(self, peer: int, entries: list) -> None:
        with self._untold_lock:
            self._untold.setdefault(peer, []).extend(entries)

    def handle(self, rec: Load | Release) -> Any:
        if isinstance(rec, Load):
            return self.load()
        return self.release(rec.to)

    # -- the binder ------------------------------------------------------------------------

    def _answered_loads(self) -> dict[int, Any]:
        """The loads the replicas asked last tick answered since (taken out of ``_loads``)."""
        loads = {}
        for i, work in list(self._loads.items()):
            if work.done():
                del self._loads[i]
                if work.exception() is None:
                    load = load_answer(work.result())
                    if load is not None:
                        loads[i] = load
        return loads

    def tick(self) -> None:
        """Every heartbeat: tell moves again to replicas that missed them; on the binder,
        gather the loads (asked last tick) and start one move."""
        b = self.bindings
        with self._untold_lock:
            due = [(peer, self._untold.pop(peer)) for peer in list(self._untold)
                   if b.peer(peer).state == UP]
        for peer, entries in due:
            self._tell(peer, entries)
        if not b.ready or b.binder() != b.index:
            self._loads.clear()
            return
        loads = {b.index: self.load(), **self._answered_loads()}
        for i in b.live_peers():
            if i not in self._loads:
                try:
                    self._loads[i] = b.peer(i).request(Load(id=0), [])
                except Exception:  # a link that went down meanwhile: asked again next tick
                    pass
        if self._release is not None and not self._release.done():
            return  # one move at a time
        self._release = None
        plan = choose_move(loads)
        if plan is None:
            return
        giver, taker = plan
        self.asked += 1
        if giver == b.index:
            self.release(taker)
        else:
            try:
                self._release = b.peer(giver).request(Release(id=0, to=taker), [])
            except Exception:
                pass

    def stats(self) -> dict:
        return {"keys_given": self.given, "moves_asked": self.asked}


__all__ = ["MOVE_BACKLOG", "KeyMover", "choose_move"]
