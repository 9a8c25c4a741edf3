"""The queue core of one channel: keyed queues, weights, backpressure, private queues and
stealing, independent of any transport.

``QueueCore`` is what the broker's event loop (``server/loop.py``) and the in-process local channel
(``handle/local.py``) drive.  It is single-threaded and built from parts with one job each:

- ``KeyedQueues`` (``core/queues.py``): the shared and private queues of every key, the bytes they
  hold, ``maxsize``/``max_bytes``/``max_keys``, and idle keys; ``Deadlines``, the timer heap;
- ``HookPipeline`` (``core/hookpipeline.py``): the collector and dispatcher and their context;
- ``Consumers`` (``core/consumers.py``): the declared and joined consumers;
- ``LeaseBook`` (``core/leases.py``): deliveries waiting for an ``ack``;
- ``Waiters`` (``core/waiters.py``): parked gets, get_batches and puts, and the rules that serve them.

This class checks each request, hands it to those parts, and carries out what concerns several
of them: consumers joining and leaving (a departed consumer's private items are dealt again),
leases ending, deliveries that could not be sent, and deadlines.  Its callers give it
``reply(client, rid, ...)``, which sends the outcome of a request, and ``decode_item`` /
``encode_item``, which turn the transport's item payloads into values for hooks and back, and
``slots_viewed`` (a broker's shared memory: ``HookPipeline.collect``); the core never looks
into a payload itself.  Every request ends in exactly one call of ``reply`` —
a result or an error — unless the client withdrew it or went away.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

from zchannel.broker.core.consumers import Consumers
from zchannel.broker.core.hookpipeline import HookPipeline
from zchannel.broker.core.leases import LeaseBook
from zchannel.broker.core.queues import (
    KEY_GRACE_S,
    Deadlines,
    KeyedQueues,
    Outputs,
    merge_in_put_order,
)
from zchannel.broker.core.state import (
    KEY_OVERHEAD,
    REQUEST_OVERHEAD,
    Client,
    Item,
    KeyState,
    Lease,
    Parked,
)
from zchannel.broker.core.statelog import StateLog
from zchannel.broker.core.waiters import SendReply, SendRun, Waiters, found_nothing, take_run
from zchannel.broker.wire.argchecks import check_key, check_target_weight, check_weight
from zchannel.hooks import Collector, Dispatcher

log = logging.getLogger("zchannel.broker")


class QueueCore:
    """Queues, waiters and hooks of one channel (see the module docstring)."""

    def __init__(
        self,
        *,
        name: str,
        maxsize: int = 0,
        collector: Collector,
        dispatcher: Dispatcher,
        producers: tuple[str, ...] = (),
        consumers: tuple[str, ...] = (),
        options: dict | None = None,
        reply: SendReply,
        decode_item: Callable[[Item], Any],
        encode_item: Callable[[Any, int | float], Item],
        lease_timeout: float = 30.0,
        max_bytes: int = 0,
        max_keys: int = 100_000,
        key_grace: float = KEY_GRACE_S,
        request_overhead: int = REQUEST_OVERHEAD,
        key_overhead: int = KEY_OVERHEAD,
        reply_run: SendRun | None = None,
        slots_viewed: Callable[[Item], bool] | None = None,
    ) -> None:
        self.name = name
        self.reply = reply
        self.started = time.time()
        self.deadlines = Deadlines()
        self.queues = KeyedQueues(maxsize=maxsize, max_bytes=max_bytes, max_keys=max_keys,
                                  key_grace=key_grace, deadlines=self.deadlines)
        self.roster = Consumers(consumers)
        self.hooks = HookPipeline(
            name=name, maxsize=maxsize, collector=collector, dispatcher=dispatcher,
            producers=producers, options=options, roster=self.roster, decode_item=decode_item,
            encode_item=encode_item, max_bytes=max_bytes, slots_viewed=slots_viewed)
        self.lease_book = LeaseBook(lease_timeout=lease_timeout, queues=self.queues,
                                    deadlines=self.deadlines)
        self.waiters = Waiters(queues=self.queues, hooks=self.hooks, leases=self.lease_book,
                               deadlines=self.deadlines, reply=reply,
                               request_overhead=request_overhead, key_overhead=key_overhead,
                               reply_run=reply_run)
        self.log: StateLog | None = None

    def attach_log(self, log: StateLog) -> None:
        """Tell ``log`` (a journal, ``core/statelog.py``) every change of the items from now on."""
        self.log = self.waiters.log = self.hooks.log = log
        self.queues.log = log if log.limited else None  # its room limits puts

    # -- what the broker, its metrics and its stats read -----------------------------------------

    @property
    def keys(self) -> dict[Any, KeyState]:
        return self.queues.keys

    @property
    def bytes_held(self) -> int:
        return self.queues.bytes_held

    @property
    def leases(self) -> dict[int, Lease]:
        return self.lease_book.leases

    @property
    def consumers(self) -> dict:
        return self.roster.consumers

    # -- requests --------------------------------------------------------------------------------

    def put(self, client: Client, rid: int, key: Any, item: Item, timeout: float | None,
            nowait: bool) -> bool | Parked:
        """Check, collect and route a put, then store it or let it wait (``Waiters.put``):
        True if it was stored now, False if it failed now (replied), or the ``Parked`` that
        waits for room (its ``on_end`` is called when it ends)."""
        hooks, queues = self.hooks, self.queues
        try:
            if rid in client.parked:
                raise _duplicate_id(rid)
            key = check_key(key)
            check_weight(item.weight)
            if hooks.passthrough and not hooks.deals:  # no hooks at work: the common case
                routed: Outputs = [(key, None, item)]
                if key not in queues.keys:
                    queues.check_new_keys((key,))
            else:
                routed = hooks.routed(hooks.collect(item, key, item.weight), item.origin)
                queues.check_new_keys({k for k, _, _ in routed})
        except Exception as exc:
            self.reply(client, rid, error=exc)
            return False
        return self.waiters.put(client, rid, key, routed, timeout, nowait)

    def get(self, client: Client, rid: int, key: Any, timeout: float | None, nowait: bool,
            ack: bool = False, batch_target: int | float = 0) -> None:
        """A get (``batch_target`` 0) or a get_batch of that target weight.  One of a key the
        broker does not hold that may not wait (``nowait``, or a ``timeout`` of 0) finds
        nothing, and makes no key: only a get that waits holds one."""
        waits = not nowait and (timeout is None or timeout > 0)
        try:
            key = _checked_get(self, client, rid, key, batch_target, waits)
            self._join(client)
        except Exception as exc:
            self.reply(client, rid, error=exc)
            return
        new_key = key not in self.queues.keys
        if new_key and not waits:  # no items, no private queue to steal from
            self.reply(client, rid, error=found_nothing(key, None, nowait))
            return
        self.waiters.get(client, rid, self.queues.state(key), timeout, nowait, ack, batch_target,
                         new_key)

    def take_run(self, client: Client, rids: list[int], key: Any, timeout: float | None = None,
                 park: bool = False) -> int:
        """The common case of plain gets ``rids`` (no ``ack``, their ``timeout`` checked) of
        the checked ``key``: served at once from its shared queue when nobody else waits on
        it and, with ``park``, those it does not cover parked in order (``waiters.take_run``),
        exactly as ``get`` would serve or park each; how many (0: none, nothing changed --
        the rest take ``get`` one by one)."""
        ks = self.queues.keys.get(key)
        parked = client.parked
        if ks is None or self.hooks.deals or (parked and any(rid in parked for rid in rids)) \
                or (client.identity is not None and client.consumer is None):
            return 0  # a new key or consumer, dealing or a duplicate id: ``get`` sees to each
        return take_run(self.waiters, client, rids, ks, timeout, park)

    def ack(self, client: Client, rid: int, lease_id: Any) -> None:
        try:
            lease = self.lease_book.held(lease_id, client)
        except ValueError as exc:
            self.reply(client, rid, error=exc)
            return
        error = _unacked(self.log, lease.item)
        if error is not None:  # not recorded: the lease stays open
            self.reply(client, rid, error=error)
            return
        self.queues.bytes_held -= self.lease_book.end(lease).nbytes
        self.reply(client, rid)
        self.waiters.admit_putters()
        ks = self.queues.keys.get(lease.key)
        if ks is not None:  # its last lease may have kept the key in use
            self.queues.mark_idle(ks)

    def cancel(self, client: Client, rid: int, target_rid: Any) -> None:
        """Withdraw ``client``'s waiting request ``target_rid``: the result says whether it
        was still waiting."""
        req = client.parked.get(target_rid) if isinstance(target_rid, int) else None
        if req is None or not req.alive:
            self.reply(client, rid, result=False)
            return
        self.waiters.withdraw(req)
        self.reply(client, rid, result=True)

    def client_gone(self, client: Client) -> None:
        """Withdraw a departed handle's parked requests, return its leases, and let it leave."""
        if client.gone:
            return
        client.gone = True
        # the newest first: withdrawing one serves the getters behind it, which would take
        # items for this departed handle if they were its own
        for req in reversed(list(client.parked.values())):
            self.waiters.withdraw(req)
        found = [self.lease_book.find(lease_id) for lease_id in client.leases]  # issue order
        leases = [lease for lease in found if lease is not None and self.lease_book.is_open(lease)]
        # the deliveries it took from its own queue go back to it: if it leaves, they go to
        # the head of the queues they are dealt to (known by identity: a steal may take one)
        returned = {id(lease.item) for lease in leases
                    if lease.origin is not None and lease.origin == client.consumer}
        self._return_leases(leases)
        self._leave(client, returned)

    def requeue(self, client: Client | None, origin: tuple[Any, str | None], items: list[Item],
                lease_id: int | None) -> None:
        """A delivery could not reach ``client``: ``hand_back`` of that one delivery."""
        self.hand_back([(client, origin, items, lease_id)])

    def hand_back(self, deliveries: list[tuple]) -> None:
        """Deliveries that could not reach their client (``(client, origin, items, lease id)``
        in the order they were made; also the items a durable channel's journal held when its
        broker started): their items go back to the head of their queues, the last first, so
        that each queue has them in the order it gave them (those of a consumer that left are
        dealt again by put order, as never delivered: ``_deal_again``); then the getters
        waiting on those keys are served, each key once (served after each, a getter would take
        a later item before an earlier one of its key)."""
        touched: dict[int, KeyState] = {}
        for _, origin, items, lease_id in reversed(deliveries):
            ks = _put_back(self, origin, items, lease_id)
            touched[id(ks)] = ks
        for ks in reversed(touched.values()):  # the queue of the first delivery first
            self.waiters.serve(ks)

    # -- consumers and leases --------------------------------------------------------------------

    def _join(self, client: Client) -> None:  # HookError: ``observe`` raised, it did not join
        joined = self.roster.join(client)
        if joined is None:
            return
        self.hooks.consumer_joined(client, joined)
        for ks in list(self.queues.keys.values()):
            if ks.private.get(joined):
                self.waiters.serve(ks)

    def _leave(self, client: Client, returned: AbstractSet[int] = frozenset()) -> None:
        """``client`` is gone; if it was its consumer's last handle, the consumer leaves: its
        private items (``_deal_again``; ``returned``: its leases' items' ids), then the puts
        waiting for room in its queues, are dealt again before getters are served (serving
        admits waiting puts: one still routed to it would be stored for nobody)."""
        departed = self.roster.leave(client)
        if departed is None:
            return
        self.hooks.consumer_left(departed)
        touched = [ks for ks in list(self.queues.keys.values()) if ks.private.get(departed)]
        for ks in touched:
            _deal_again(self, ks, ks.take_all(ks.private[departed]), departed, returned)
        self.waiters.reroute_putters(departed, self.hooks.route_again)
        for ks in touched:
            self.waiters.serve(ks)
        self.waiters.admit_putters()

    def _return_leases(self, leases: list[Lease]) -> None:
        """Unacknowledged deliveries (``leases``, in the order they were issued) go back to the
        head of their queues, the first issued in front, so that a queue has them in the order
        it gave them; then the waiting getters of those queues are served."""
        touched: dict[int, KeyState] = {}
        for lease in reversed(leases):
            if not self.lease_book.is_open(lease):
                continue
            item = self.lease_book.end(lease)
            ks = self.queues.state(lease.key)
            origin = lease.origin
            if origin is not None and not self.roster.listed(origin):  # dealt again
                origin = self.hooks.route_again(item, ks.key, origin)
            ks.put_back(self.queues.queue(ks, origin), [item])
            touched[id(ks)] = ks
        for ks in reversed(touched.values()):  # the queue of the first lease first
            self.waiters.serve(ks)

    # -- deadlines -------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        return self.deadlines.next()

    def tick(self, now: float | None = None) -> None:
        """Expire due deadlines: parked requests time out, leases lapse, idle keys go."""
        now = time.monotonic() if now is None else now
        while True:
            lapsed: list[Lease] = []  # in deadline order: the order they were issued
            for obj in self.deadlines.due(now):
                if isinstance(obj, Parked):
                    if obj.alive:
                        self.waiters.expire(obj)
                elif isinstance(obj, Lease):
                    lapsed.append(obj)
                elif isinstance(obj, KeyState):
                    if self.queues.drop_if_idle(obj, now):
                        self.hooks.notify(self.hooks.dispatcher.key_dropped, obj.key)
            if not lapsed:
                return
            # they go back together (their queues keep their order); what that delivers
            # anew under a lease already due lapses in the next round
            self._return_leases(lapsed)

    def drop_idle_key(self, key: Any) -> bool:
        """Forget ``key`` if it holds nothing and nobody waits on it (it moved to another
        replica); False, and nothing changes, otherwise."""
        ks = self.keys.get(key)
        if ks is not None:
            if not ks.idle():
                return False
            del self.keys[key]
            self.hooks.notify(self.hooks.dispatcher.key_dropped, key)
        return True

    # -- queries ---------------------------------------------------------------------------------

    def qsize(self, key: Any, consumer: str | None = None) -> int:
        return self.queues.qsize(key, consumer)

    def peek(self, key: Any, n: int, consumer: str | None = None) -> list[Item]:
        """Up to ``n`` items at the head of ``key``'s queue, left in place (``KeyedQueues.peek``)."""
        return self.queues.peek(key, n, consumer)

    def full(self, key: Any, consumer: str | None = None) -> bool:
        return self.queues.full(key, consumer)

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "maxsize": self.queues.maxsize,
            "keys": self.queues.key_stats(),
            "consumers": list(self.hooks.ctx.consumers),
            "producers": list(self.hooks.ctx.producers),
            "bytes_held": self.queues.bytes_held,
            "leases": len(self.lease_book.leases),
            "uptime_s": round(time.time() - self.started, 3),
            **self.hooks.stats(),
        }


def _put_back(core: QueueCore, origin: tuple[Any, str | None], items: list[Item],
              lease_id: int | None) -> KeyState:
    """The items of one delivery that did not reach its client back at the head of the queue
    ``origin`` names (dealt again by put order if its consumer left), its lease ended; their
    key's state."""
    key, consumer = origin
    lease = core.lease_book.find(lease_id)
    if lease is not None:
        core.lease_book.end(lease)
    else:
        for item in items:
            core.queues.bytes_held += item.nbytes
        if core.log is not None:
            core.log.returned(items)
    ks = core.queues.state(key)
    if consumer is not None and not core.roster.known(consumer):
        _deal_again(core, ks, items, consumer)
    else:
        ks.put_back(core.queues.queue(ks, consumer), items)
    return ks


def _checked_get(core: QueueCore, client: Client, rid: int, key: Any,
                 batch_target: int | float, waits: bool) -> Any:
    """The checked key of a get of ``client`` (``batch_target``: of a get_batch), or the error
    that refuses it: a duplicate id, a bad key or target, a new key past ``max_keys`` (for one
    that ``waits``: one that may not holds no key), no identity on a channel that deals."""
    if rid in client.parked:
        raise _duplicate_id(rid)
    key = check_key(key)
    if batch_target:
        check_target_weight(batch_target)
    if waits and key not in core.queues.keys:
        core.queues.check_new_keys((key,))
    if core.hooks.deals and client.identity is None:
        raise ValueError(
            f"channel {core.name!r} deals items to consumers: a consumer needs an "
            "identity (identity='group:rank' or ZCHANNEL_IDENTITY)"
        )
    return key


def _duplicate_id(rid: int) -> ValueError:
    # a second waiting request under one id could be neither told apart nor withdrawn
    return ValueError(f"request id {rid} is already used by a waiting request of this client")


def _unacked(log: StateLog | None, item: Item) -> Exception | None:
    """Record the ack of a leased ``item`` in the journal ``log`` (if any): None, or the error
    that kept the journal from recording it (the ack's error: the lease stays open)."""
    if log is None:
        return None
    try:
        log.acked(item)
    except Exception as exc:
        return exc
    return None


def _deal_again(core: QueueCore, ks: KeyState, items: list[Item], departed: str,
                returned: AbstractSet[int] = frozenset()) -> None:
    """Deal ``items`` of ``ks`` again (their consumer ``departed``, in its queue's order),
    each to the queue the dispatcher names now, which may be the departed consumer's own (it
    waits for it to come back): those in ``returned`` (ids: deliveries it had not
    acknowledged, redelivered) to the head of their queues, in their order; the others, never
    delivered, where put order places them among the items of their queue
    (``merge_in_put_order``), so that a consumer still gets a key's items in put order."""
    heads: dict[int, tuple[deque[Item], list[Item]]] = {}
    dealt: dict[int, tuple[deque[Item], list[Item]]] = {}
    for item in items:
        target = core.queues.queue(ks, core.hooks.route_again(item, ks.key, departed))
        runs = heads if id(item) in returned else dealt
        runs.setdefault(id(target), (target, []))[1].append(item)
    for target, run in dealt.values():
        merge_in_put_order(ks, target, run)
    for target, back in heads.values():
        ks.put_back(target, back)
