"""The queue state machine of one channel, independent of any transport.

``QueueCore`` owns the per-key queues, the parked getters and putters, leases, consumers and the
hook pipeline.  It is single-threaded: the broker's event loop (``server.py``) and the in-process
local channel (``local.py``) drive it and give it two functions, ``reply`` (send the result of a
request) and ``codec`` (decode/encode items for hooks).  Every request ends in exactly one call
of ``reply`` — a result or an error — unless the client withdrew it or went away.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

from zchannel.broker.checks import (  # noqa: F401 - check_timeout is re-exported
    check_key,
    check_target_weight,
    check_timeout,
    check_weight,
    exceeds,
    reaches,
)
from zchannel.broker.errors import HookError, QueueEmpty, QueueFull
from zchannel.broker.records import Client, Consumer, Item, KeyState, Lease, Request
from zchannel.hooks import (
    ChannelContext,
    Collector,
    Dispatcher,
    consumer_sort_key,
)

log = logging.getLogger("zchannel.broker")

KEY_GRACE_S = 30.0


Reply = Callable[..., bool]


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
        reply: Reply,
        decode_item: Callable[[Item], Any],
        encode_item: Callable[[Any, int], Item],
        lease_timeout: float = 30.0,
        max_bytes: int = 0,
        max_keys: int = 100_000,
        key_grace: float = KEY_GRACE_S,
    ) -> None:
        self.name = name
        self.maxsize = maxsize
        self.collector = collector
        self.dispatcher = dispatcher
        self.reply = reply
        self.decode_item = decode_item
        self.encode_item = encode_item
        self.lease_timeout = lease_timeout
        self.max_bytes = max_bytes
        self.max_keys = max_keys
        self.key_grace = key_grace
        self.keys: dict[Any, KeyState] = {}
        self.consumers: dict[str, Consumer] = {c: Consumer(declared=True) for c in consumers}
        self.declared = frozenset(consumers)
        self.putters: deque[Request] = deque()
        self.leases: dict[int, Lease] = {}
        self.bytes_held = 0
        self.started = time.time()
        self._timers: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._lease_ids = itertools.count(1)
        self.passthrough = type(collector).collect is Collector.collect
        self.deals = dispatcher.deals
        self.ctx = ChannelContext(
            name=name,
            maxsize=maxsize,
            producers=tuple(producers),
            consumers=self._present(),
            options=dict(options or {}),
        )
        collector.setup(self.ctx)
        dispatcher.setup(self.ctx)

    # -- consumers ---------------------------------------------------------------------------

    def _present(self) -> tuple[str, ...]:
        present = [c for c, st in self.consumers.items() if st.declared or st.handles]
        return tuple(sorted(present, key=consumer_sort_key))

    def _join(self, client: Client) -> None:
        cid = client.identity
        if cid is None or client.consumer is not None:
            return
        client.consumer = cid
        state = self.consumers.get(cid)
        if state is None:
            state = self.consumers[cid] = Consumer(declared=False)
            state.handles = 1
            self.ctx.consumers = self._present()
            self._call_hook(self.dispatcher.observe, cid)
            for ks in list(self.keys.values()):
                if ks.private.get(cid):
                    self._serve(ks)
        else:
            state.handles += 1

    def _leave(self, client: Client) -> None:
        cid = client.consumer
        if cid is None:
            return
        client.consumer = None
        state = self.consumers[cid]
        state.handles -= 1
        if state.handles > 0:
            return
        # A consumer that made contact and left is no longer present, declared or not.
        del self.consumers[cid]
        self.ctx.consumers = self._present()
        self._call_hook(self.dispatcher.forget, cid)
        for ks in list(self.keys.values()):
            queue = ks.private.get(cid)
            if queue:
                items = list(queue)
                queue.clear()
                for item in items:
                    self._redeal(ks, cid, item)
                self._serve(ks)
        self._admit_putters()

    def _redeal(self, ks: KeyState, departed: str, item: Item) -> None:
        try:
            target = self._route(item, ks.key)
        except HookError as exc:
            log.warning("re-dealing an item of %r failed (%s): it goes to the shared queue", ks.key, exc)
            target = None
        self._queue(ks, target).append(item)

    def _call_hook(self, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("dispatcher hook %s failed", getattr(fn, "__name__", fn))

    # -- keys and queues ---------------------------------------------------------------------

    def _ks(self, key: Any) -> KeyState:
        ks = self.keys.get(key)
        if ks is None:
            ks = self.keys[key] = KeyState(key)
        ks.idle_since = None
        return ks

    def _check_new_keys(self, keys: Any) -> None:
        """Raise ``ValueError`` naming the limit if ``keys`` would pass ``max_keys``."""
        if self.max_keys and len(self.keys) + len(keys) > self.max_keys:
            new = [k for k in keys if k not in self.keys]
            if len(self.keys) + len(new) > self.max_keys:
                raise ValueError(f"the broker holds {len(self.keys)} keys: the max_keys limit "
                                 f"({self.max_keys}) is reached")

    def _queue(self, ks: KeyState, consumer: str | None) -> deque[Item]:
        if consumer is None:
            return ks.shared
        queue = ks.private.get(consumer)
        if queue is None:
            queue = ks.private[consumer] = deque()
        return queue

    def _mark_idle(self, ks: KeyState) -> None:
        if ks.idle_since is None and ks.idle():
            ks.idle_since = time.monotonic()
            self._add_timer(ks.idle_since + self.key_grace, ks)

    # -- timers ------------------------------------------------------------------------------

    def _add_timer(self, deadline: float, obj: Any) -> None:
        heapq.heappush(self._timers, (deadline, next(self._seq), obj))

    def next_deadline(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    def tick(self, now: float | None = None) -> None:
        """Expire due deadlines: parked requests time out, leases lapse, idle keys go."""
        now = time.monotonic() if now is None else now
        while self._timers and self._timers[0][0] <= now:
            _, _, obj = heapq.heappop(self._timers)
            if isinstance(obj, Request):
                if obj.alive:
                    self._expire_request(obj)
            elif isinstance(obj, Lease):
                if self.leases.get(obj.lease_id) is obj:
                    self._return_lease(obj)
            elif isinstance(obj, KeyState):
                ks = self.keys.get(obj.key)
                if ks is obj and ks.idle() and ks.idle_since is not None:
                    if now - ks.idle_since >= self.key_grace - 1e-6:
                        del self.keys[ks.key]
                        self._call_hook(self.dispatcher.key_dropped, ks.key)

    # -- hooks pipeline ----------------------------------------------------------------------

    def _value(self, item: Item) -> Any:
        if not item.decoded:
            item.value = self.decode_item(item)
            item.decoded = True
        return item.value

    def _route(self, item: Item, key: Any) -> str | None:
        if not self.deals:
            return None
        value = self._value(item) if self.dispatcher.needs_item else None
        try:
            target = self.dispatcher.route(value, key)
        except Exception as exc:
            raise _hook_error(exc) from None
        if target is None:
            return None
        if not isinstance(target, str):
            raise HookError(
                f"Dispatcher.route returned {type(target).__name__}, expected a consumer id or None",
                "TypeError",
            )
        if target not in self.consumers and target not in self.declared:
            log.warning("route returned unknown consumer %r: the item goes to the shared queue", target)
            return None
        return target

    def _collect(self, item: Item, key: Any, weight: int) -> list[tuple[Any, Item]]:
        if self.passthrough:
            return [(key, item)]
        value = self._value(item)  # a decode error is the putter's ValueError, not a HookError
        outputs: list[tuple[Any, Item]] = []
        try:
            produced = self.collector.collect(value, key)
            for out in produced if produced is not None else ():
                if not isinstance(out, tuple) or len(out) not in (2, 3):
                    raise TypeError(
                        "Collector.collect must yield (key, item) or (key, item, weight) tuples, "
                        f"got {type(out).__name__}"
                    )
                out_key = check_key(out[0])
                out_weight = check_weight(out[2]) if len(out) == 3 else weight
                if out[1] is value and out_weight == weight:
                    outputs.append((out_key, item))
                else:
                    outputs.append((out_key, self.encode_item(out[1], out_weight)))
        except Exception as exc:
            raise _hook_error(exc) from None
        return outputs

    # -- put ---------------------------------------------------------------------------------

    def put(
        self,
        client: Client,
        rid: int,
        key: Any,
        item: Item,
        timeout: float | None,
        nowait: bool,
    ) -> None:
        try:
            if rid in client.parked:
                raise _duplicate_id(rid)
            key = check_key(key)
            check_weight(item.weight)
            if self.passthrough and not self.deals:  # no hooks at work: the common case
                routed = [(key, None, item)]
                if key not in self.keys:
                    self._check_new_keys((key,))
            else:
                outputs = self._collect(item, key, item.weight)
                routed = [(k, self._route(it, k), it) for k, it in outputs]
                self._check_new_keys({k for k, _, _ in routed})
        except Exception as exc:
            self.reply(client, rid, error=exc)
            return
        req = Request(client, rid, "put", key, None, outputs=routed)
        if not routed:
            self.reply(client, rid)
            return
        if self._admissible(req, self._waiting_targets() if self.putters else set()):
            self._enqueue(req)
            self.reply(client, rid)
            return
        if self.max_bytes and self._put_bytes(req) > self.max_bytes:
            self.reply(client, rid, error=ValueError(
                f"put of {self._put_bytes(req)} bytes exceeds the broker's max_bytes limit "
                f"({self.max_bytes})"))
            return
        if nowait:
            self.reply(client, rid, error=_queue_full(self, req))
            return
        if timeout is not None and timeout <= 0:
            self.reply(client, rid, error=TimeoutError("put timed out: the queue is full"))
            return
        self._park(req, timeout)
        self.putters.append(req)
        for k in {k for k, _, _ in routed}:
            self._ks(k).putters += 1

    @staticmethod
    def _put_bytes(req: Request) -> int:
        return sum(it.nbytes for _, _, it in req.outputs)

    def _targets(self, req: Request) -> set[tuple[Any, str | None]]:
        return {(k, c) for k, c, _ in req.outputs}

    def _waiting_targets(self) -> set[tuple[Any, str | None]]:
        waiting: set[tuple[Any, str | None]] = set()
        for p in self.putters:
            waiting |= self._targets(p)
        return waiting

    def _admissible(self, req: Request, blocked: set) -> bool:
        if not (blocked or self.max_bytes or self.maxsize > 0):
            return True  # unbounded channel, nobody waiting: the common case
        targets = self._targets(req)
        if blocked and targets & blocked:
            return False
        if self.max_bytes and self.bytes_held and self.bytes_held + self._put_bytes(req) > self.max_bytes:
            return False
        if self.maxsize <= 0:
            return True
        for k, c in targets:
            ks = self.keys.get(k)
            if ks is None:
                continue
            queue = ks.shared if c is None else ks.private.get(c)
            if queue is not None and len(queue) >= self.maxsize:
                return False
        return True

    def _enqueue(self, req: Request) -> None:
        touched: dict[Any, KeyState] = {}
        for k, c, item in req.outputs:
            ks = touched.get(k)
            if ks is None:
                ks = touched[k] = self._ks(k)
            self._queue(ks, c).append(item)
            self.bytes_held += item.nbytes
        for ks in touched.values():
            self._serve(ks)

    def _admit_putters(self) -> None:
        if not self.putters:
            return
        blocked: set = set()
        admitted = False
        for req in list(self.putters):
            if not req.alive:
                continue
            if self._admissible(req, blocked):
                self._unpark_putter(req)
                self._enqueue(req)
                self.reply(req.client, req.rid)
                admitted = True
            else:
                blocked |= self._targets(req)
        if admitted:
            self._admit_putters()

    def _unpark_putter(self, req: Request) -> None:
        self._unpark(req)
        try:
            self.putters.remove(req)
        except ValueError:
            pass
        for k in {k for k, _, _ in req.outputs}:
            ks = self.keys.get(k)
            if ks is not None:
                ks.putters -= 1
                self._mark_idle(ks)

    # -- get ---------------------------------------------------------------------------------

    def get(
        self,
        client: Client,
        rid: int,
        key: Any,
        timeout: float | None,
        nowait: bool,
        ack: bool = False,
        batch_target: int | float = 0,
    ) -> None:
        try:
            if rid in client.parked:
                raise _duplicate_id(rid)
            key = check_key(key)
            if batch_target:
                check_target_weight(batch_target)
            self._check_new_keys((key,))
            if self.deals and client.identity is None:
                raise ValueError(
                    f"channel {self.name!r} deals items to consumers: a consumer needs an "
                    "identity (identity='group:rank' or ZCHANNEL_IDENTITY)"
                )
        except Exception as exc:
            self.reply(client, rid, error=exc)
            return
        self._join(client)
        ks = self._ks(key)
        if not (batch_target or ack or self.deals or ks.getters) and ks.shared:
            # the common case (a plain get of a shared queue nobody else waits on): the head
            # item at once, without a Request record
            item = ks.shared.popleft()
            self.bytes_held -= item.nbytes
            self.reply(client, rid, items=[item], origin=(key, None))
            if self.putters:
                self._admit_putters()
            self._mark_idle(ks)
            return
        req = Request(client, rid, "batch" if batch_target else "get", key, None,
                      target=batch_target, ack=ack)
        ks.getters.append(req)
        self._serve(ks)
        if not req.alive:
            return
        if nowait or (timeout is not None and timeout <= 0):
            self._expire_request(req, nowait=nowait)
            return
        self._park(req, timeout)

    def _park(self, req: Request, timeout: float | None) -> None:
        req.client.parked[req.rid] = req
        if timeout is not None:
            req.deadline = time.monotonic() + timeout
            self._add_timer(req.deadline, req)

    def _unpark(self, req: Request) -> None:
        req.alive = False
        req.client.parked.pop(req.rid, None)

    def _remove_getter(self, req: Request) -> KeyState | None:
        self._unpark(req)
        ks = self.keys.get(req.key)
        if ks is not None:
            try:
                ks.getters.remove(req)
            except ValueError:
                pass
        return ks

    @staticmethod
    def _batch_take(queue: deque[Item], target: int | float, final: bool) -> int:
        """How many head items a get_batch of ``target`` takes now (0 = not complete yet)."""
        total = 0
        for n, item in enumerate(queue):
            if exceeds(total + item.weight, target):
                return n or 1
            total += item.weight
            if reaches(total, target):
                n += 1
                while n < len(queue) and queue[n].weight == 0:
                    n += 1
                return n
        return len(queue) if final else 0

    def _serve(self, ks: KeyState) -> None:
        """Hand items to waiting getters of ``ks`` in arrival order, then try steals."""
        if not ks.getters:
            self._mark_idle(ks)
            return
        blocked: set[str | None] = set()
        starving: list[Request] = []
        for req in list(ks.getters):
            if not (ks.shared or ks.private or self.deals):
                break  # nothing left to hand out, nothing to steal: the rest keep waiting
            consumer = req.client.consumer
            private = ks.private.get(consumer) if consumer is not None else None
            if private:
                origin, queue = consumer, private
            elif ks.shared:
                origin, queue = None, ks.shared
            else:
                starving.append(req)
                continue
            if origin in blocked:
                continue
            n = self._batch_take(queue, req.target, False) if req.kind == "batch" else 1
            if n == 0:
                blocked.add(origin)
                continue
            self._deliver(req, ks, origin, queue, n)
        if starving and self.deals:
            self._steal(ks, starving, blocked)
        if self.putters:
            self._admit_putters()
        self._mark_idle(ks)

    def _steal(self, ks: KeyState, starving: list[Request], blocked: set) -> None:
        for req in starving:
            if not req.alive or req.kind != "get":
                continue
            starved = req.client.consumer
            if starved is None:
                continue
            depths = {c: len(ks.private.get(c) or ()) for c in self.ctx.consumers}
            depths.update({c: len(q) for c, q in ks.private.items() if c not in depths})
            if not any(d for c, d in depths.items() if c != starved):
                return
            try:
                donor = self.dispatcher.rebalance(ks.key, starved, depths)
            except Exception:
                log.exception("Dispatcher.rebalance failed")
                return
            if donor is None or donor == starved or donor in blocked:
                continue
            queue = ks.private.get(donor)
            if queue:
                self._deliver(req, ks, donor, queue, 1)

    def _deliver(self, req: Request, ks: KeyState, origin: str | None, queue: deque[Item], n: int) -> None:
        items = [queue.popleft() for _ in range(n)]
        self._remove_getter(req)
        lease_id = None
        if req.ack and req.kind == "get":
            lease_id = next(self._lease_ids)
            lease = Lease(lease_id, ks.key, origin, items[0], req.client,
                          time.monotonic() + self.lease_timeout)
            self.leases[lease_id] = lease
            req.client.leases.add(lease_id)
            ks.leases += 1
            self._add_timer(lease.deadline, lease)
        else:
            for item in items:
                self.bytes_held -= item.nbytes
        self.reply(req.client, req.rid, items=items, batch=req.kind == "batch", lease=lease_id,
                   origin=(ks.key, origin))

    def requeue(self, client: Client, origin: tuple[Any, str | None], items: list[Item],
                lease_id: int | None) -> None:
        """A delivery could not reach ``client``: its items go back to the head of their queue."""
        key, consumer = origin
        if lease_id is not None and lease_id in self.leases:
            self._drop_lease(self.leases[lease_id])
        else:
            for item in items:
                self.bytes_held += item.nbytes
        ks = self._ks(key)
        if consumer is not None and consumer not in self.consumers and consumer not in self.declared:
            for item in items:
                self._redeal(ks, consumer, item)
        else:
            self._queue(ks, consumer).extendleft(reversed(items))
        self._serve(ks)

    def _expire_request(self, req: Request, nowait: bool = False) -> None:
        if req.kind == "put":
            self._unpark_putter(req)
            self.reply(req.client, req.rid, error=_queue_full(self, req) if nowait
                       else TimeoutError("put timed out: a target queue stayed full"))
            self._admit_putters()
            return
        ks = self.keys.get(req.key)
        if req.kind == "batch" and ks is not None:
            consumer = req.client.consumer
            private = ks.private.get(consumer) if consumer is not None else None
            origin, queue = (consumer, private) if private else (None, ks.shared)
            n = self._batch_take(queue, req.target, True)
            if n:
                self._deliver(req, ks, origin, queue, n)
                self._serve(ks)  # getters it held back may take the rest now, or steal
                self._admit_putters()  # it freed room for waiting puts
                return
        self._remove_getter(req)
        if nowait:
            self.reply(req.client, req.rid, error=QueueEmpty(f"no item for key {req.key!r}"))
        else:
            self.reply(req.client, req.rid, error=TimeoutError(f"get timed out on key {req.key!r}"))
        if ks is not None:
            self._serve(ks)

    # -- leases ------------------------------------------------------------------------------

    def ack(self, client: Client, rid: int, lease_id: Any) -> None:
        lease = self.leases.get(lease_id) if isinstance(lease_id, int) else None
        if lease is None:
            self.reply(client, rid, error=ValueError(
                f"unknown lease {lease_id!r}: already acknowledged, expired or never issued"))
            return
        self._drop_lease(lease)
        self.bytes_held -= lease.item.nbytes
        self.reply(client, rid)
        self._admit_putters()

    def _drop_lease(self, lease: Lease) -> None:
        del self.leases[lease.lease_id]
        lease.client.leases.discard(lease.lease_id)
        ks = self.keys.get(lease.key)
        if ks is not None:
            ks.leases -= 1

    def _return_lease(self, lease: Lease) -> None:
        """An unacknowledged delivery goes back to the head of its queue."""
        self._drop_lease(lease)
        ks = self._ks(lease.key)
        origin = lease.origin
        if origin is not None and origin not in self.consumers:
            self._redeal(ks, origin, lease.item)
            # _redeal appends; move it to the head of wherever it went
            for queue in (ks.shared, *ks.private.values()):
                if queue and queue[-1] is lease.item:
                    queue.pop()
                    queue.appendleft(lease.item)
                    break
        else:
            self._queue(ks, origin).appendleft(lease.item)
        self._serve(ks)

    # -- cancellation and client lifetime -----------------------------------------------------

    def cancel(self, client: Client, rid: int, target_rid: Any) -> None:
        req = client.parked.get(target_rid) if isinstance(target_rid, int) else None
        if req is None or not req.alive:
            self.reply(client, rid, result=False)
            return
        self._withdraw(req)
        self.reply(client, rid, result=True)

    def _withdraw(self, req: Request) -> None:
        if req.kind == "put":
            self._unpark_putter(req)
            self._admit_putters()
        else:
            ks = self._remove_getter(req)
            if ks is not None:
                self._serve(ks)

    def drop_idle_key(self, key: Any) -> bool:
        """Forget ``key`` if it holds nothing and nobody waits on it (it moved to another
        replica); False, and nothing changes, otherwise."""
        ks = self.keys.get(key)
        if ks is not None:
            if not ks.idle():
                return False
            del self.keys[key]
            self._call_hook(self.dispatcher.key_dropped, key)
        return True

    def client_gone(self, client: Client) -> None:
        """Withdraw a departed handle's parked requests, return its leases, and let it leave."""
        if client.gone:
            return
        client.gone = True
        for req in list(client.parked.values()):
            self._withdraw(req)
        for lease_id in list(client.leases):
            lease = self.leases.get(lease_id)
            if lease is not None:
                self._return_lease(lease)
        self._leave(client)

    # -- queries -----------------------------------------------------------------------------

    def qsize(self, key: Any, consumer: str | None = None) -> int:
        ks = self.keys.get(check_key(key))
        if ks is None:
            return 0
        if consumer is None:
            return ks.depth()
        return len(ks.shared) + len(ks.private.get(consumer) or ())

    def peek(self, key: Any, n: int, consumer: str | None = None) -> list[Item]:
        """Up to ``n`` items at the head of ``key``'s queue, left in place: the shared queue,
        or what ``consumer``'s gets would take next (its private queue, then the shared one)."""
        ks = self.keys.get(check_key(key))
        if ks is None:
            return []
        private = ks.private.get(consumer) if consumer is not None else None
        items = list(itertools.islice(private, n)) if private else []
        items.extend(itertools.islice(ks.shared, n - len(items)))
        return items

    def full(self, key: Any, consumer: str | None = None) -> bool:
        key = check_key(key)  # a bad key is an error also where nothing can be full
        if self.maxsize <= 0:
            return False
        ks = self.keys.get(key)
        if ks is None:
            return False
        queue = ks.shared if consumer is None else ks.private.get(consumer)
        return bool(queue) and len(queue) >= self.maxsize

    def stats(self) -> dict[str, Any]:
        keys = {}
        for key, ks in self.keys.items():
            keys[key] = {
                "depth": ks.depth(),
                "weight": min(2**63 - 1, sum(i.weight for i in ks.shared)
                              + sum(i.weight for q in ks.private.values() for i in q)),
                "private": {c: len(q) for c, q in ks.private.items() if q},
                "getters": len(ks.getters),
                "putters": ks.putters,
                "leases": ks.leases,
                "node": None,
            }
        return {
            "name": self.name,
            "maxsize": self.maxsize,
            "keys": keys,
            "consumers": list(self.ctx.consumers),
            "producers": list(self.ctx.producers),
            "bytes_held": self.bytes_held,
            "leases": len(self.leases),
            "uptime_s": round(time.time() - self.started, 3),
            "collector": _hook_name(self.collector),
            "dispatcher": _hook_name(self.dispatcher),
            "collector_stats": _safe_stats(self.collector),
            "dispatcher_stats": _safe_stats(self.dispatcher),
        }


def _duplicate_id(rid: int) -> ValueError:
    # a second waiting request under one id could be neither told apart nor withdrawn
    return ValueError(f"request id {rid} is already used by a waiting request of this client")


def _queue_full(core: QueueCore, req: Request) -> Exception:
    return QueueFull(f"a target queue of key {req.key!r} is full (maxsize {core.maxsize})")


def _hook_error(exc: BaseException) -> HookError:
    if isinstance(exc, HookError):
        return exc
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return HookError(f"{type(exc).__name__}: {exc}", type(exc).__name__, tb)


def _hook_name(hook: Any) -> str:
    return getattr(type(hook), "hook_name", None) or f"{type(hook).__module__}:{type(hook).__qualname__}"


def _safe_stats(hook: Any) -> dict:
    try:
        return dict(hook.stats())
    except Exception:
        log.exception("hook stats() failed")
        return {}

