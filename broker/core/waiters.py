"""Gets and puts that wait: who is served, in which order, and when a wait ends.

``Waiters`` matches the requests of one channel with its queues.  Getters of a key are served in
arrival order, each from its consumer's private queue and the shared queue, whichever head was
put first (``KeyedQueues.source``); a ``get_batch`` takes head items (of both queues, in put
order: ``merged_batch_take``) until the next one would exceed its target weight (at least one)
or the total reaches it (plus the weight-0 items right behind), keeps its place until then and
holds back later getters of the queues it takes from.  A getter with nothing to take may steal
one item from the private queue the dispatcher's ``rebalance`` names.  A put that does not fit
(``maxsize``, ``max_bytes``, or an earlier waiting put to the same queue) waits; waiting puts
are admitted in arrival order as room appears.  Every request ends in exactly one call of ``reply``.

Waiting costs memory too: with ``max_bytes`` set, the requests waiting at one time count up to
``max_bytes`` more (``REQUEST_OVERHEAD`` each, plus a put's items, plus ``KEY_OVERHEAD`` for
each key the request made: one that held nothing before); one that would pass it is refused
with a ``ValueError`` instead of waiting.  So a broker holds at most about twice ``max_bytes``
in items and waiting requests.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from zchannel.broker.core.hookpipeline import HookPipeline
from zchannel.broker.core.leases import LeaseBook
from zchannel.broker.core.queues import Deadlines, KeyedQueues, Outputs, merged
from zchannel.broker.core.state import (
    KEY_OVERHEAD,
    REQUEST_OVERHEAD,
    Client,
    Item,
    KeyState,
    Parked,
)
from zchannel.broker.core.statelog import StateLog
from zchannel.broker.errors import HookError, QueueEmpty, QueueFull
from zchannel.broker.wire.argchecks import exceeds, reaches

log = logging.getLogger("zchannel.broker")

# reply(client, rid, *, result=, error=, items=, batch=, lease=, origin=): the transport sends
# the outcome of request ``rid`` to ``client`` (``sessions.Sessions.reply``, ``local._LocalBroker._reply``)
SendReply = Callable[..., None]
# ``(client, rids, items, origins)``: plain gets ``rids`` answered with ``items``, one each,
# taken from the queues ``origins`` names (``(key, private consumer or None)``, one per item)
SendRun = Callable[[Client, list[int], list[Item], list[tuple[Any, str | None]]], None]



class Waiters:
    """The parked getters and putters of one channel and the rules that serve them."""

    def __init__(self, *, queues: KeyedQueues, hooks: HookPipeline, leases: LeaseBook,
                 deadlines: Deadlines, reply: SendReply, request_overhead: int = REQUEST_OVERHEAD,
                 key_overhead: int = KEY_OVERHEAD, reply_run: SendRun | None = None) -> None:
        self.queues = queues
        self.hooks = hooks
        self.leases = leases
        self.deadlines = deadlines
        self.reply = reply
        # the replies of a run of gets at once (``take_run``); by default one reply each
        self.reply_run: SendRun = reply_run or functools.partial(reply_each, reply)
        self.putters: deque[Parked] = deque()
        self.put_targets: dict[tuple[Any, str | None], int] = {}  # queue -> puts waiting for it
        self.log: StateLog | None = None  # a durable channel's journal (``core/statelog.py``)
        self.waiting_bytes = 0  # what the waiting requests count against max_bytes
        self.admitting = False  # in ``admit_putters`` (a journal's ``on_room`` may call it)
        self.admit_again = False
        self.request_overhead = request_overhead  # what each of them counts, items aside
        self.key_overhead = key_overhead  # and each key it made

    # -- puts ------------------------------------------------------------------------------------

    def put(self, client: Client, rid: int, key: Any, outputs: Outputs, timeout: float | None,
            nowait: bool) -> bool | Parked:
        """Store the checked and routed ``outputs`` of a put (True), refuse it (False, with its
        error replied), or let it wait for room (the parked ``Parked``)."""
        queues = self.queues
        if not outputs:
            self.reply(client, rid)
            return True
        if self.hooks.deals:  # (only a channel with private queues has two queues to order)
            queues.number(outputs)
        if queues.admits(outputs, self.put_targets.keys()):
            if self.log is not None:
                error = _unlogged(self.log, outputs)
                if error is not None:  # nothing is stored
                    self.reply(client, rid, error=error)
                    return False
            for ks in queues.store(outputs):
                if ks.getters:  # else nothing to serve, and the key holds an item: not idle
                    self.serve(ks)
            self.reply(client, rid)
            return True
        req = Parked(client, rid, "put", key, None, outputs=outputs)
        never = queues.never_fits(outputs)
        if never:
            self.reply(client, rid, error=ValueError(never))
            return False
        if nowait or (timeout is not None and timeout <= 0):
            self.reply(client, rid, error=self._put_refused(req, nowait, parked=False))
            return False
        new_keys = sum(k not in queues.keys for k in {k for k, _, _ in outputs})
        if not self._may_wait(req, self.request_overhead + queues.outputs_bytes(outputs)
                              + new_keys * self.key_overhead):
            return False
        self._park_putter(req, timeout)
        return req

    def _park_putter(self, req: Parked, timeout: float | None) -> None:
        self._park(req, timeout)
        self.putters.append(req)
        _count(self.put_targets, self.queues.targets(req.outputs), 1)
        for k in {k for k, _, _ in req.outputs}:
            self.queues.state(k).putters += 1

    def admit_putters(self) -> None:
        """Admit the waiting puts that fit now, in arrival order (a put waits while an earlier
        waiting put targets one of its queues): the scan ends once every queue a waiting put
        targets is held by an earlier one, so a long line of puts waiting for one full queue
        costs each get a look at its head, not at the whole line."""
        if not self.putters:
            return
        if self.admitting:  # a journal freed room while it recorded one of these puts
            self.admit_again = True
            return
        self.admitting = True
        try:
            again = _admit_fitting(self)
        finally:
            self.admitting = False
        if again or self.admit_again:
            self.admit_again = False
            self.admit_putters()

    def reroute_putters(self, departed: str,
                        route: Callable[[Item, Any, str], str | None]) -> None:
        """Waiting puts with outputs routed to the consumer that ``departed``: those outputs
        are routed again (``route(item, key, departed)``), in arrival order."""
        for req in self.putters:
            if req.alive and any(c == departed for _, c, _ in req.outputs):
                old = self.queues.targets(req.outputs)
                req.outputs = [(k, route(it, k, departed) if c == departed else c, it)
                               for k, c, it in req.outputs]
                new = self.queues.targets(req.outputs)
                _count(self.put_targets, old - new, -1)
                _count(self.put_targets, new - old, 1)

    def _unpark_putter(self, req: Parked, stored: bool = False) -> None:
        """A waiting put ends: admitted (``stored``), timed out or withdrawn.  It lets go of
        its items (its entry in the deadline heap may stay until its deadline)."""
        self._unpark(req)
        if req.on_end is not None:
            req.on_end(stored)
        try:
            self.putters.remove(req)
        except ValueError:
            return  # ended before
        if not stored and self.log is not None:
            self.log.unstored(req.outputs)
        _count(self.put_targets, self.queues.targets(req.outputs), -1)
        for k in {k for k, _, _ in req.outputs}:
            ks = self.queues.keys.get(k)
            if ks is not None:
                ks.putters -= 1
                self.queues.mark_idle(ks)
        req.outputs = []

    def _put_refused(self, req: Parked, nowait: bool, parked: bool = True) -> Exception:
        """The error of a put that does not fit and may wait no longer, naming why it does not
        fit (an earlier waiting put, ``max_bytes``, the journal, ``maxsize``): ``QueueFull`` for
        ``nowait``, else ``TimeoutError``.  ``parked``: ``req`` waits (its targets count in
        ``put_targets``)."""
        own = self.queues.targets(req.outputs) if parked else set()
        blocked = {t for t, n in self.put_targets.items() if n > (t in own)}
        why = self.queues.why_full(req.key, req.outputs, blocked)
        return QueueFull(why) if nowait else TimeoutError(f"put timed out: {why}")

    def _may_wait(self, req: Parked, cost: int) -> bool:
        """Whether ``req`` may wait, costing ``cost`` bytes of the ``max_bytes`` budget of
        waiting requests; if not, it gets its ``ValueError`` reply here."""
        limit = self.queues.max_bytes
        if limit and self.waiting_bytes + cost > limit:
            what = "put" if req.kind == "put" else "get"
            self.reply(req.client, req.rid, error=ValueError(
                f"this {what} cannot wait: it would take {cost} bytes of the broker's "
                f"max_bytes limit ({limit}), and the requests waiting already take "
                f"{self.waiting_bytes} (a waiting request counts {self.request_overhead} bytes, "
                f"a put its item's too, a get of a new key {self.key_overhead} more); retry "
                "later, or raise max_bytes"))
            return False
        req.cost = cost
        self.waiting_bytes += cost
        return True

    # -- gets ------------------------------------------------------------------------------------

    def get(self, client: Client, rid: int, ks: KeyState, timeout: float | None, nowait: bool,
            ack: bool, batch_target: int | float, new_key: bool = False) -> None:
        """Serve a checked get (``batch_target`` 0) or get_batch of ``ks``, or let it wait
        (``new_key``: ``ks`` was made for it)."""
        if not (batch_target or ack or self.hooks.deals or ks.getters) and ks.shared:
            # the common case (a plain get of a shared queue nobody else waits on): the head
            # item at once, without a Parked record (``take_run`` serves a run of such gets the
            # same way; one get alone stays inline here: the run's lists cost ~1.8 us more)
            self.serve_head(client, rid, ks)
            return
        req = Parked(client, rid, "batch" if batch_target else "get", ks.key, None,
                      target=batch_target, ack=ack)
        ks.getters.append(req)
        self.serve(ks)
        if not req.alive:
            return
        if nowait or (timeout is not None and timeout <= 0):
            self.expire(req, nowait=nowait)
            return
        if not self._may_wait(req, self.request_overhead + new_key * self.key_overhead):
            self._remove_getter(req)
            self.queues.let_go(ks, new_key)  # a key made for it goes with it
            return
        self._park(req, timeout)

    def serve_head(self, client: Client, rid: int, ks: KeyState) -> None:
        """Answer plain get ``rid`` of ``client`` with the head item of ``ks``'s shared queue,
        which holds items no getter waits for (the common case of ``get``)."""
        item = ks.shared.popleft()
        self.queues.bytes_held -= item.nbytes
        if self.log is not None:
            self.log.taken((item,))
        self.reply(client, rid, items=[item], origin=(ks.key, None))
        if self.putters:
            self.admit_putters()
        self.queues.mark_idle(ks)

    def _park(self, req: Parked, timeout: float | None) -> None:
        req.client.parked[req.rid] = req
        if timeout is not None:
            req.deadline = time.monotonic() + timeout
            self.deadlines.add(req.deadline, req)

    def _unpark(self, req: Parked) -> None:
        req.alive = False
        req.client.parked.pop(req.rid, None)
        self.waiting_bytes -= req.cost
        req.cost = 0
        req.scan = None  # a get_batch's scan names its head item: not kept till the deadline

    def _remove_getter(self, req: Parked) -> KeyState | None:
        self._unpark(req)
        ks = self.queues.keys.get(req.key)
        if ks is not None:
            getters = ks.getters
            if getters and getters[0] is req:  # served in arrival order: the common case
                getters.popleft()
            else:
                with contextlib.suppress(ValueError):
                    getters.remove(req)
        return ks

    def serve(self, ks: KeyState) -> None:
        """Hand items to waiting getters of ``ks`` in arrival order, then try steals."""
        getters = ks.getters
        if not getters:
            self.queues.mark_idle(ks)
            return
        deals = self.hooks.deals
        if not deals and not ks.private and _serve_plain_gets(self, ks):
            return
        blocked: set[str | None] = set()
        starving: list[Parked] = []
        for req in list(ks.getters):
            if not (ks.shared or ks.private or deals):
                break  # nothing left to hand out, nothing to steal: the rest keep waiting
            if req.kind == "batch" and _draws_both(ks, req):
                _serve_merged_batch(self, req, ks, blocked)
                continue
            source = self.queues.source(ks, req.client.consumer)
            if source is None:
                starving.append(req)
                continue
            origin, queue = source
            if origin in blocked:
                continue
            n = _batch_take_resumed(req, ks, queue) if req.kind == "batch" else 1
            if n == 0:
                blocked.add(origin)
                continue
            self._deliver(req, ks, origin, queue, n)
        if starving and deals:
            _steal(self, ks, starving, blocked)
        if self.putters:
            self.admit_putters()
        self.queues.mark_idle(ks)

    def _deliver(self, req: Parked, ks: KeyState, origin: str | None, queue: deque[Item],
                 n: int) -> None:
        self._hand(req, ks, origin, [queue.popleft()] if n == 1
                   else [queue.popleft() for _ in range(n)])

    def _hand(self, req: Parked, ks: KeyState, origin: str | None, items: list[Item]) -> None:
        """Answer getter ``req`` with ``items`` taken from the queue ``origin`` names (a batch
        taken from both of its consumer's queues names the private one: undelivered, back there)."""
        self._remove_getter(req)
        lease_id = None
        if req.ack and req.kind == "get":
            lease_id = self.leases.issue(req.client, ks, origin, items[0])
            if self.log is not None:
                self.log.leased(items[0])
        else:
            for item in items:
                self.queues.bytes_held -= item.nbytes
            if self.log is not None:
                self.log.taken(items)
        self.reply(req.client, req.rid, items=items, batch=req.kind == "batch", lease=lease_id,
                   origin=(ks.key, origin))

    # -- the end of a wait -----------------------------------------------------------------------

    def expire(self, req: Parked, nowait: bool = False) -> None:
        """``req`` reached its deadline (or asked ``nowait``): a get_batch takes what it can,
        any other request gets its timeout (or ``QueueFull``/``QueueEmpty``) error."""
        if req.kind == "put":
            error = self._put_refused(req, nowait)  # before its items are let go
            self._unpark_putter(req)
            self.reply(req.client, req.rid, error=error)
            self.admit_putters()
            return
        ks = self.queues.keys.get(req.key)
        if req.kind == "batch" and ks is not None and _taken_at_deadline(self, req, ks):
            self.serve(ks)  # getters it held back may take the rest now, or steal
            self.admit_putters()  # it freed room for waiting puts
            return
        self._remove_getter(req)
        self.reply(req.client, req.rid, error=found_nothing(req.key, ks, nowait))
        if ks is not None:
            self.serve(ks)

    def withdraw(self, req: Parked) -> None:
        """The client cancelled ``req`` or went away: it ends without a reply."""
        if req.kind == "put":
            self._unpark_putter(req)
            self.admit_putters()
        else:
            ks = self._remove_getter(req)
            if ks is not None:
                self.serve(ks)


def _admit_fitting(waiters: Waiters) -> bool:
    """One pass of ``admit_putters``: whether it admitted a put (room may have changed)."""
    blocked: set = set()
    admitted = False
    waiting = waiters.put_targets
    for req in list(waiters.putters):
        if len(blocked) >= len(waiting) and blocked.issuperset(waiting):
            break
        if not req.alive:
            continue
        outputs = req.outputs
        if waiters.queues.admits(outputs, blocked):
            error = _unlogged(waiters.log, outputs)
            waiters._unpark_putter(req, stored=error is None)
            admitted = True
            if error is not None:
                waiters.reply(req.client, req.rid, error=error)
                continue
            for ks in waiters.queues.store(outputs):
                waiters.serve(ks)
            waiters.reply(req.client, req.rid)
        else:
            blocked |= waiters.queues.targets(outputs)
    return admitted


def _steal(waiters: Waiters, ks: KeyState, starving: list[Parked], blocked: set) -> None:
    """Each starving get of ``ks`` takes the oldest item of the donor the dispatcher's
    ``rebalance`` names, if any; a ``rebalance`` that raises ends that get with its
    ``HookError``."""
    for req in starving:
        if not req.alive or req.kind != "get":
            continue
        starved = req.client.consumer
        if starved is None:
            continue
        depths = {c: len(ks.private.get(c) or ()) for c in waiters.hooks.ctx.consumers}
        depths.update({c: len(q) for c, q in ks.private.items() if c not in depths})
        if not any(d for c, d in depths.items() if c != starved):
            return
        try:
            donor = waiters.hooks.rebalance(ks.key, starved, depths)
        except HookError as exc:
            waiters._remove_getter(req)
            waiters.reply(req.client, req.rid, error=exc)
            continue
        if donor is None or donor == starved or donor in blocked:
            continue
        queue = ks.private.get(donor)
        if queue:
            waiters._deliver(req, ks, donor, queue, 1)


def take_run(waiters: Waiters, client: Client, rids: list[int], ks: KeyState,
             timeout: float | None = None, park: bool = False) -> int:
    """Plain gets ``rids`` of ``client`` (no ``ack``, ``timeout`` checked) on ``ks`` served at
    once from its shared queue, in order, each as ``Waiters.get``'s common case serves one
    (nobody else waits on the key, no dealing), and with ``park`` those its items do not cover
    parked in order behind any getters waiting already (``park_run``, when the queue is
    empty): how many of them, from the first (0: nothing changed)."""
    if waiters.hooks.deals:
        return 0
    n = 0 if ks.getters else min(len(rids), len(ks.shared))
    if n:
        _answer_run(waiters, client, rids[:n], ks)
        if waiters.putters:
            waiters.admit_putters()
        waiters.queues.mark_idle(ks)
    if park and n < len(rids):
        n += park_run(waiters, client, rids[n:], ks, timeout)
    return n


def take_heads(waiters: Waiters, client: Client, rids: list[int], keys: list[Any],
               start: int) -> int:
    """The common case of plain gets (no ``ack``) of a ``gets`` record naming a key per get, as
    they came off the wire: from ``rids[start]`` on, the gets of a str or int key whose shared
    queue holds items nobody else waits for, served at once and in order as ``Waiters.get``
    would serve each (``serve_head``), answered as one run; how many, stopping at the first
    get of any other case (a new key, dealing, waiting getters, a duplicate id:
    ``QueueCore.get`` then sees to it).  A key found among the queues' keys was checked when
    it was made."""
    if waiters.hooks.deals or (client.identity is not None and client.consumer is None):
        return 0
    known, parked = waiters.queues.keys, client.parked
    items: list[Item] = []
    states: list[KeyState] = []
    end = start
    while end < len(rids):
        key = keys[end]
        if type(key) is not str and type(key) is not int:
            break
        ks = known.get(key)
        if ks is None or not ks.shared or ks.getters or rids[end] in parked:
            break
        items.append(ks.shared.popleft())
        states.append(ks)
        end += 1
    if items:
        _answer_taken(waiters, client, rids[start:end], items, [(ks.key, None) for ks in states])
        if waiters.putters:
            waiters.admit_putters()
        mark_idle = waiters.queues.mark_idle
        for ks in states:
            mark_idle(ks)
    return end - start


def park_run(waiters: Waiters, client: Client, rids: list[int], ks: KeyState,
             timeout: float | None) -> int:
    """Park plain gets ``rids`` of ``client`` (no ``ack``, ``timeout`` checked) on ``ks``, whose
    shared queue is empty, in order, each as ``Waiters.get`` parks one: its own ``Parked``
    record, place among the key's getters and deadline; how many (0, nothing changed, when the
    queue holds items, items are dealt, a ``max_bytes`` limit may refuse a wait, or a
    ``timeout`` of 0 means the gets may not wait at all)."""
    if (ks.shared or ks.private or waiters.hooks.deals or waiters.queues.max_bytes
            or (timeout is not None and timeout <= 0)):
        return 0
    ks.idle_since = None  # in use again, as ``KeyedQueues.state`` makes it for a single get
    getters, cost = ks.getters, waiters.request_overhead
    for rid in rids:
        req = Parked(client, rid, "get", ks.key, None)
        getters.append(req)
        waiters._may_wait(req, cost)  # always True here: no ``max_bytes`` limit
        waiters._park(req, timeout)
    return len(rids)


def reply_each(reply: SendReply, client: Client, rids: list[int], items: list[Item],
               origins: list[tuple[Any, str | None]]) -> None:
    """Answer plain gets ``rids`` with ``items``, one reply each, in order: the ``SendRun`` of a
    transport that has no way of its own to answer a run (``Waiters.reply_run``)."""
    for rid, item, origin in zip(rids, items, origins, strict=True):
        reply(client, rid, items=[item], origin=origin)


def _serve_plain_gets(waiters: Waiters, ks: KeyState) -> bool:
    """The common case: gets and get_batches of the shared queue, served in arrival order
    (``serve`` does the same for a snapshot of all getters; one client's plain gets at the
    head are answered as one run, ``_deliver_get_run``); True when nothing is left to serve.
    A get_batch the queue does not complete yet holds back the getters behind it."""
    shared, getters = ks.shared, ks.getters
    while shared and getters:
        req = getters[0]
        if req.kind == "get":
            if req.ack or len(shared) == 1 or len(getters) == 1:
                waiters._deliver(req, ks, None, shared, 1)
            else:
                _deliver_get_run(waiters, ks)
            continue
        n = _batch_take_resumed(req, ks, shared)
        if n == 0:
            break
        waiters._deliver(req, ks, None, shared, n)
    if waiters.putters:
        waiters.admit_putters()
    waiters.queues.mark_idle(ks)
    return True


def _deliver_get_run(waiters: Waiters, ks: KeyState) -> None:
    """Serve the plain gets without ``ack`` of one client at the head of ``ks.getters`` with
    head items of the shared queue, as many as it holds, answered as one run (``reply_run``),
    as ``_deliver`` would serve each in turn."""
    getters = ks.getters
    client = getters[0].client
    rids: list[int] = []
    limit = len(ks.shared)
    while getters and len(rids) < limit:
        req = getters[0]
        if req.kind != "get" or req.ack or req.client is not client:
            break
        getters.popleft()
        waiters._unpark(req)
        rids.append(req.rid)
    _answer_run(waiters, client, rids, ks)


def _answer_run(waiters: Waiters, client: Client, rids: list[int], ks: KeyState) -> None:
    """Answer plain gets ``rids`` of ``client`` with as many head items of ``ks``'s shared
    queue, in order, as one run (``reply_run``)."""
    popleft = ks.shared.popleft
    items = [popleft() for _ in rids]
    _answer_taken(waiters, client, rids, items, [(ks.key, None)] * len(items))


def _answer_taken(waiters: Waiters, client: Client, rids: list[int], items: list[Item],
                  origins: list[tuple[Any, str | None]]) -> None:
    """Answer plain gets ``rids`` of ``client`` with ``items``, taken from the queues
    ``origins`` names, as one run (``reply_run``): they leave the bytes held, and a durable
    channel's journal is told they were taken."""
    waiters.queues.bytes_held -= sum(item.nbytes for item in items)
    if waiters.log is not None:
        waiters.log.taken(items)
    waiters.reply_run(client, rids, items, origins)


def batch_take(queue: deque[Item], target: int | float, final: bool) -> int:
    """How many head items a get_batch of ``target`` takes now (0 = not complete yet)."""
    if type(target) is int:
        n, _ = _int_batch_take(queue, target)
        if n is not None:
            return n or (len(queue) if final else 0)
    n, _ = _float_batch_take(queue, target)
    return n or (len(queue) if final else 0)


def _tail(queue: deque[Item], start: int) -> Iterable[Item]:
    """The items of ``queue`` from index ``start`` on, in order, at a cost of their number (a
    deque's ``islice`` walks from the head: resuming a scan there made every put to a key with
    a waiting get_batch cost the whole queue)."""
    if not start:
        return queue
    tail = list(itertools.islice(reversed(queue), len(queue) - start))
    tail.reverse()
    return tail


def _float_batch_take(queue: deque[Item], target: int | float, start: int = 0,
                      total: int | float = 0) -> tuple[int, int | float]:
    """``batch_take`` with the float rules, counting on from head item ``start`` whose
    predecessors weigh ``total``: (the count, 0 while the queue does not reach ``target``;
    the total weight counted)."""
    for n, item in enumerate(_tail(queue, start), start):
        if exceeds(total + item.weight, target):
            return n or 1, total
        total += item.weight
        if reaches(total, target):
            n += 1
            while n < len(queue) and queue[n].weight == 0:
                n += 1
            return n, total
    return 0, total


def _int_batch_take(queue: deque[Item], target: int, start: int = 0,
                    total: int = 0) -> tuple[int | None, int]:
    """``batch_take`` of an int ``target`` over int weights, without the float slack, counting
    on from head item ``start`` whose predecessors weigh ``total``: (the count, 0 while the
    queue does not reach ``target``; the total weight counted), or (None, 0) at the first
    weight that is not an int (the caller then scans with the float rules)."""
    for n, item in enumerate(_tail(queue, start), start):
        weight = item.weight
        if type(weight) is not int:
            return None, 0
        total += weight
        if total > target:
            return n or 1, total
        if total >= target:
            n += 1
            while n < len(queue) and queue[n].weight == 0:
                n += 1
            return n, total
    return 0, total


def _batch_take_resumed(req: Parked, ks: KeyState, queue: deque[Item]) -> int:
    """``batch_take(queue, req.target, False)`` for a waiting get_batch that remembers how far
    it counted (``req.scan``) while the queue falls short: the next call counts only the items
    appended since.  The scan holds while the queue's head item and ``ks.requeued`` are
    unchanged (then items were only appended); else it counts from the head again."""
    if not queue:
        return 0
    target = req.target
    head = queue[0]
    start: int = 0
    total: int | float = 0
    floats = type(target) is not int
    scan = req.scan
    if scan is not None and scan[0] is queue and scan[1] == ks.requeued and scan[2] is head:
        start, total, floats = scan[3], scan[4], scan[5]
    n: int | None = None
    if not floats:  # an int target, every weight counted so far an int
        n, total = _int_batch_take(queue, int(target), start, int(total))
        if n is None:  # a weight that is not an int: the float rules, from the head
            floats, start, total = True, 0, 0
    if n is None:
        n, total = _float_batch_take(queue, target, start, total)
    req.scan = (queue, ks.requeued, head, len(queue), total, floats) if n == 0 else None
    return n


def _unlogged(log: StateLog | None, outputs: Outputs) -> Exception | None:
    """Record a put's items in the journal ``log`` (if any) before they are stored: None, or the
    error that kept the journal from recording them (the put's error: nothing is stored)."""
    if log is None:
        return None
    try:
        log.stored(outputs)
    except Exception as exc:
        return exc
    return None


def _count(counts: dict[Any, int], targets: Iterable[Any], step: int) -> None:
    """Add ``step`` to the count of each of ``targets`` in ``counts`` (a count that reaches 0
    is removed)."""
    for target in targets:
        n = counts.get(target, 0) + step
        if n > 0:
            counts[target] = n
        else:
            counts.pop(target, None)


def _waits_ahead(queues: KeyedQueues, ks: KeyState, req: Parked,
                 origins: set[str | None]) -> bool:
    """Whether a getter of ``ks`` that came before ``req`` waits on a queue ``origins`` names
    (``_waits_on``)."""
    for other in ks.getters:
        if other is req:
            return False
        if not origins.isdisjoint(_waits_on(queues, ks, other)):
            return True
    return False


def _waits_on(queues: KeyedQueues, ks: KeyState, req: Parked) -> set[str | None]:
    """The queues (their origins) getter ``req`` of ``ks`` takes its next items from: its
    consumer's private queue and the shared one for a get_batch that draws on both
    (``_draws_both``), else the one ``KeyedQueues.source`` names (none if both are empty)."""
    if req.kind == "batch" and _draws_both(ks, req):
        return {req.client.consumer, None}
    source = queues.source(ks, req.client.consumer)
    return set() if source is None else {source[0]}


def _draws_both(ks: KeyState, req: Parked) -> bool:
    """Whether get_batch ``req`` takes from two queues of ``ks``: its consumer's private queue
    and the shared queue both hold items (it takes them in put order: ``merged_batch_take``)."""
    consumer = req.client.consumer
    return consumer is not None and bool(ks.shared) and bool(ks.private.get(consumer))


def merged_batch_take(private: deque[Item], shared: deque[Item], target: int | float,
                      final: bool) -> list[bool]:
    """What a consumer's get_batch of ``target`` takes now from its ``private`` queue and the
    ``shared`` queue, both holding items: ``batch_take`` of the two in the order its gets
    would take them (``queues.merged``), as whether each item taken comes from ``private``
    (empty: not complete yet).  It counts both queues from their heads each time."""
    pairs = list(merged(private, shared))
    n = batch_take(deque(item for _, item in pairs), target, final)
    return [mine for mine, _ in pairs[:n]]


def _take_merged(waiters: Waiters, req: Parked, ks: KeyState, sides: list[bool]) -> None:
    """Answer get_batch ``req`` with the head items of its consumer's private queue (``True``
    in ``sides``) and of the shared queue (``False``), in that order."""
    consumer = req.client.consumer
    private, shared = ks.private[consumer], ks.shared  # type: ignore[index]
    req.scan = None
    waiters._hand(req, ks, consumer, [(private if mine else shared).popleft() for mine in sides])


def _serve_merged_batch(waiters: Waiters, req: Parked, ks: KeyState, blocked: set) -> None:
    """``serve`` of a get_batch that draws on its consumer's private queue and the shared
    queue (``_draws_both``): served once it completes over both, unless an earlier getter holds
    back either queue (``blocked``); while it waits it holds back later getters of both."""
    both = {req.client.consumer, None}
    sides = [] if not blocked.isdisjoint(both) else merged_batch_take(
        ks.private[req.client.consumer], ks.shared, req.target, False)  # type: ignore[index]
    if not sides:
        blocked |= both
        return
    _take_merged(waiters, req, ks, sides)


def found_nothing(key: Any, ks: KeyState | None, nowait: bool) -> Exception:
    """The error of a get of ``key`` (its state ``ks``; None: the broker holds no such key)
    that found nothing it may take and may wait no longer: ``QueueEmpty`` naming why for
    ``nowait`` (``_no_item_for``), else ``TimeoutError``."""
    if nowait:
        return QueueEmpty(_no_item_for(key, ks))
    return TimeoutError(f"get timed out on key {key!r}")


def _no_item_for(key: Any, ks: KeyState | None) -> str:
    """A ``get_nowait``'s ``QueueEmpty`` message: the key holds no item, or none this get may
    take now (gets waiting on it come first; other consumers' private queues are theirs)."""
    if ks is None or not ks.depth():
        return f"no item for key {key!r}"
    held = f"no item for key {key!r} that this get may take now: the key holds {ks.depth()} item(s)"
    if not ks.getters:
        return f"{held}, in other consumers' private queues"
    batch = any(g.kind == "batch" for g in ks.getters)
    return (f"{held}, and {len(ks.getters)} earlier get(s) waiting on it come first"
            + (" (a get_batch waits until its target weight is met)" if batch else ""))


def _taken_at_deadline(waiters: Waiters, req: Parked, ks: KeyState) -> bool:
    """A get_batch of ``ks`` at its deadline (or ``nowait``) takes what it can, as
    ``batch_take`` with ``final`` (``merged_batch_take`` when it draws on two queues): whether
    it took items.  Getters of a queue are served in arrival order: when one that came earlier
    still waits on a queue it takes from, it takes nothing."""
    queues = waiters.queues
    consumer = req.client.consumer
    if _draws_both(ks, req):
        if _waits_ahead(queues, ks, req, {consumer, None}):
            return False
        _take_merged(waiters, req, ks, merged_batch_take(
            ks.private[consumer], ks.shared, req.target, True))  # type: ignore[index]
        return True
    origin, queue = queues.source(ks, consumer) or (None, ks.shared)
    if _waits_ahead(queues, ks, req, {origin}):
        return False
    n = batch_take(queue, req.target, True)
    if n:
        waiters._deliver(req, ks, origin, queue, n)
    return bool(n)
