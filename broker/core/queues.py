"""The per-key queues of one channel and their limits, and the deadlines of the queue core.

``KeyedQueues`` holds every key's shared queue and the private queues of its consumers
(``KeyState`` in ``core/state.py``), the byte count of what the channel holds, and the limits that
make a put wait: ``maxsize`` items per queue, ``max_bytes`` in the channel, ``max_keys`` keys.
A key nothing uses any more is dropped ``key_grace`` seconds after it went idle.  ``Deadlines``
is the one timer heap of the core: parked requests, leases and idle keys.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from zchannel.broker.core.state import FRAME_OVERHEAD, ITEM_OVERHEAD, Item, KeyState
from zchannel.broker.core.statelog import StateLog
from zchannel.broker.wire.argchecks import check_key

KEY_GRACE_S = 30.0

# where a put's items go: (key, private consumer or None for the shared queue, item)
Outputs = list[tuple[Any, str | None, Item]]


# entries the deadline heap may hold before it drops those of ended objects
DEADLINES_KEPT = 4096


class Deadlines:
    """A heap of (deadline, object): what ``QueueCore.tick`` expires, in deadline order.

    An object whose ``alive`` attribute is False (a get served before its deadline, a lease
    acknowledged) has nothing left to expire; its entry is dropped when the heap grows past
    twice what it held after the last drop (and past ``DEADLINES_KEPT``), so the heap holds
    at most about twice the live deadlines however long the timeouts (a stream of gets each
    waiting with ``timeout=60`` would otherwise keep a minute of served gets)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._limit = DEADLINES_KEPT

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, deadline: float, obj: Any) -> None:
        """Expire ``obj`` at ``deadline``: a finite float (``ValueError`` otherwise; a NaN at
        the root would compare false with every deadline and stall them all)."""
        if not -math.inf < deadline < math.inf:
            raise ValueError(f"a deadline must be a finite number, got {deadline!r}")
        heap = self._heap
        heapq.heappush(heap, (deadline, next(self._seq), obj))
        if len(heap) > self._limit:
            kept = [entry for entry in heap if getattr(entry[2], "alive", True)]
            heapq.heapify(kept)
            self._heap = kept
            self._limit = max(DEADLINES_KEPT, 2 * len(kept))

    def next(self) -> float | None:
        """The earliest deadline, or None when nothing waits for one."""
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> Iterator[Any]:
        """Pop the objects whose deadline is ``now`` or earlier, also those added meanwhile."""
        while self._heap and self._heap[0][0] <= now:
            yield heapq.heappop(self._heap)[2]


class KeyedQueues:
    """Every key's queues, the bytes they hold, and the limits a put must fit in."""

    def __init__(self, *, maxsize: int, max_bytes: int, max_keys: int, key_grace: float,
                 deadlines: Deadlines) -> None:
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.max_keys = max_keys
        self.key_grace = key_grace
        self.deadlines = deadlines
        self.keys: dict[Any, KeyState] = {}
        self.bytes_held = 0  # items queued or delivered under a lease not yet acknowledged
        self.log: StateLog | None = None  # a durable channel's journal: its room limits puts too
        self._order = itertools.count(1)  # the put order of items (``number``, ``Item.seq``)

    def state(self, key: Any) -> KeyState:
        """The queues of ``key`` (created on first use); the key is in use again."""
        ks = self.keys.get(key)
        if ks is None:
            ks = self.keys[key] = KeyState(key)
        ks.idle_since = None
        return ks

    def check_new_keys(self, keys: Any) -> None:
        """Raise ``ValueError`` naming the limit if ``keys`` would pass ``max_keys``."""
        if self.max_keys and len(self.keys) + len(keys) > self.max_keys:
            new = [k for k in keys if k not in self.keys]
            if len(self.keys) + len(new) > self.max_keys:
                raise ValueError(f"the broker holds {len(self.keys)} keys and this request "
                                 f"would add {len(new)} more: the max_keys limit "
                                 f"({self.max_keys}) is reached")

    @staticmethod
    def queue(ks: KeyState, consumer: str | None) -> deque[Item]:
        """The shared queue of ``ks`` (``consumer`` None) or ``consumer``'s private one."""
        if consumer is None:
            return ks.shared
        queue = ks.private.get(consumer)
        if queue is None:
            queue = ks.private[consumer] = deque()
        return queue

    @staticmethod
    def source(ks: KeyState, consumer: str | None) -> tuple[str | None, deque[Item]] | None:
        """Where ``consumer``'s next get takes from (the queue's origin and the queue): of its
        private queue and the key's shared one, the one whose head was put first
        (``put_order``; the private one on a tie), so that a consumer gets a key's items in put
        order (items put while no consumer was present wait in the shared queue, as do items
        read back from a durable channel's journal, and items dealt to it since were put after
        them); None when both are empty."""
        private = ks.private.get(consumer) if consumer is not None else None
        shared = ks.shared
        if private:
            if shared and put_order(shared[0]) < put_order(private[0]):
                return None, shared
            return consumer, private
        return (None, shared) if shared else None

    def mark_idle(self, ks: KeyState) -> None:
        """Start the grace period of a key nothing uses (no items, waiters or leases)."""
        if ks.idle_since is None and ks.idle():
            ks.idle_since = time.monotonic()
            # one deadline per key at a time: a stream whose queue empties after every get
            # would push one per item otherwise, each kept for the grace period
            if not ks.idle_timer:
                ks.idle_timer = True
                self.deadlines.add(ks.idle_since + self.key_grace, ks)

    def let_go(self, ks: KeyState, made: bool) -> None:
        """A request that did not wait is done with ``ks``: a key ``made`` for it (it held
        nothing before) that is still idle is forgotten at once, as if it had never been made;
        any other key starts its grace period if idle (``mark_idle``)."""
        if made and ks.idle() and self.keys.get(ks.key) is ks:
            del self.keys[ks.key]
        else:
            self.mark_idle(ks)

    def drop_if_idle(self, ks: KeyState, now: float) -> bool:
        """Forget ``ks`` if it is still the state of its key and stayed idle for the grace
        period; True if it went.  (Its deadline came: a key idle again since then gets the
        deadline of that idle period.)"""
        ks.idle_timer = False
        if self.keys.get(ks.key) is not ks or not ks.idle() or ks.idle_since is None:
            return False
        if now - ks.idle_since < self.key_grace - 1e-6:
            ks.idle_timer = True
            self.deadlines.add(ks.idle_since + self.key_grace, ks)
            return False
        del self.keys[ks.key]
        return True

    # -- backpressure ----------------------------------------------------------------------------

    @staticmethod
    def targets(outputs: Outputs) -> set[tuple[Any, str | None]]:
        return {(k, c) for k, c, _ in outputs}

    @staticmethod
    def outputs_bytes(outputs: Outputs) -> int:
        return sum(it.nbytes for _, _, it in outputs)

    def admits(self, outputs: Outputs, blocked: AbstractSet[tuple[Any, str | None]]) -> bool:
        """Whether a put of ``outputs`` fits now: none of its target queues is in ``blocked``
        (an earlier put waits for it) or full, and ``max_bytes`` (and the journal, if the
        channel has one) leaves room for it."""
        if not (blocked or self.max_bytes or self.maxsize > 0 or self.log is not None):
            return True  # unbounded channel, nobody waiting: the common case
        targets = self.targets(outputs)
        if blocked and targets & blocked:
            return False
        if self.max_bytes and self.bytes_held + self.outputs_bytes(outputs) > self.max_bytes:
            return False  # (one larger than max_bytes never fits: never_fits refuses it)
        if self.log is not None and not self.log.room(self.outputs_bytes(outputs)):
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

    def never_fits(self, outputs: Outputs) -> str | None:
        """Why a put of ``outputs`` could never fit (larger than ``max_bytes``, or than a
        durable channel's ``max_journal_bytes`` allows), or None."""
        nbytes = self.outputs_bytes(outputs)
        if self.max_bytes and nbytes > self.max_bytes:
            return f"put of {nbytes} bytes exceeds the broker's max_bytes limit ({self.max_bytes})"
        return self.log.too_large(nbytes) if self.log is not None else None

    def why_full(self, key: Any, outputs: Outputs,
                 blocked: AbstractSet[tuple[Any, str | None]] = frozenset()) -> str:
        """Why a put of ``outputs`` under ``key`` does not fit now: an earlier put waits for
        one of its target queues (``blocked``), ``max_bytes``, the journal's
        ``max_journal_bytes``, or a full target queue (named)."""
        held = sorted(self.targets(outputs) & blocked, key=repr)
        if held:
            return (f"an earlier put waits for room and targets the queue of {_queue_name(*held[0])} "
                    "too: puts into a queue are stored in the order they came")
        if self.log is not None and not self.log.room(self.outputs_bytes(outputs)):
            return "the journal holds max_journal_bytes: no room for this put"
        if self.max_bytes and self.bytes_held \
                and self.bytes_held + self.outputs_bytes(outputs) > self.max_bytes:
            return (f"the broker holds {self.bytes_held} bytes of items, and this put would "
                    f"pass its max_bytes limit ({self.max_bytes}; an item counts its payload "
                    f"plus {ITEM_OVERHEAD} bytes, and {FRAME_OVERHEAD} per frame after its first)")
        for k, c in sorted(self.targets(outputs), key=repr):
            ks = self.keys.get(k)
            queue = None if ks is None else ks.shared if c is None else ks.private.get(c)
            if queue is not None and 0 < self.maxsize <= len(queue):
                return f"the queue of {_queue_name(k, c)} is full (maxsize {self.maxsize})"
        return f"a target queue of key {key!r} is full (maxsize {self.maxsize})"

    def number(self, outputs: Outputs) -> None:
        """Number the items of a put that arrived in put order (``Item.seq``), whether it is
        stored now or waits for room: a put stored while an earlier one waits comes after it."""
        for _, _, item in outputs:
            item.seq = next(self._order)

    def store(self, outputs: Outputs) -> list[KeyState]:
        """Add a put's items to their queues (``add_in_put_order``); the states of the keys
        it touched."""
        if len(outputs) == 1:  # the common case: one item, one queue
            k, c, item = outputs[0]
            ks = self.state(k)
            queue = ks.shared if c is None else self.queue(ks, c)
            if item.seq and queue and queue[-1].seq > item.seq:  # (``add_in_put_order``)
                merge_in_put_order(ks, queue, [item])
            else:
                queue.append(item)
            self.bytes_held += item.nbytes
            return [ks]
        touched: dict[Any, KeyState] = {}
        for k, c, item in outputs:
            found = touched.get(k)
            if found is None:
                found = touched[k] = self.state(k)
            add_in_put_order(found, self.queue(found, c), item)
            self.bytes_held += item.nbytes
        return list(touched.values())

    # -- queries ---------------------------------------------------------------------------------

    def qsize(self, key: Any, consumer: str | None = None) -> int:
        ks = self.keys.get(check_key(key))
        if ks is None:
            return 0
        if consumer is None:
            return ks.depth()
        return len(ks.shared) + len(ks.private.get(consumer) or ())

    def peek(self, key: Any, n: int, consumer: str | None = None) -> list[Item]:
        """Up to ``n`` items at the head of ``key``'s queue, left in place: the shared queue,
        or what ``consumer``'s gets would take next (its private queue and the shared one in
        put order, as ``source`` chooses: ``merged``)."""
        ks = self.keys.get(check_key(key))
        if ks is None:
            return []
        private = ks.private.get(consumer) if consumer is not None else None
        if not private:
            return list(itertools.islice(ks.shared, n))
        return [item for _, item in itertools.islice(merged(private, ks.shared), n)]

    def full(self, key: Any, consumer: str | None = None) -> bool:
        key = check_key(key)  # a bad key is an error also where nothing can be full
        if self.maxsize <= 0:
            return False
        ks = self.keys.get(key)
        if ks is None:
            return False
        queue = ks.shared if consumer is None else ks.private.get(consumer)
        if not queue:
            return False
        return len(queue) >= self.maxsize

    def key_stats(self) -> dict[Any, dict[str, Any]]:
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
        return keys


def put_order(item: Item) -> tuple[int, int]:
    """Where ``item`` stands in its channel's put order: items read back from a durable
    channel's journal (``seq`` 0) first, by journal number, then those of the puts since, in
    the order the puts arrived (``KeyedQueues.number``)."""
    return item.seq, item.jid


def add_in_put_order(ks: KeyState, queue: deque[Item], item: Item) -> None:
    """Append the stored ``item`` to ``queue`` (one of ``ks``'s), unless the item at
    ``queue``'s tail was put after it (a numbered ``item``, ``Item.seq``, whose put order is
    its number): then it goes before the items put after it (``merge_in_put_order``).  That is
    a put that waited for room in the private queue of a consumer that left, dealt again to a
    queue that took later puts meanwhile; every other put arrives behind what its queue holds."""
    if item.seq and queue and queue[-1].seq > item.seq:
        merge_in_put_order(ks, queue, [item])
    else:
        queue.append(item)


def merge_in_put_order(ks: KeyState, queue: deque[Item], items: list[Item]) -> None:
    """Merge ``items`` (of a queue of ``ks`` whose consumer left, in that queue's order) into
    ``queue`` (one of ``ks``'s) by put order (``put_order``), each side keeping its own order.

    The two are merged from their tails, so that the items of each that were never delivered
    (the run at its tail, in put order, behind any deliveries put back at its head) come out
    in put order together, and what was put back stays ahead of the items put after it.  Each
    step places one item of either side: at most ``len(items) + len(queue)`` steps, never an
    insertion per item.  It counts in ``ks.requeued`` (a waiting get_batch's count of
    ``queue`` is stale)."""
    if not items:
        return
    tail: list[Item] = []  # the merged tail, from the last item back
    rest = len(items)
    while rest and queue:
        if put_order(queue[-1]) > put_order(items[rest - 1]):
            tail.append(queue.pop())
        else:
            rest -= 1
            tail.append(items[rest])
    queue.extend(items[:rest])  # (``queue`` was emptied if any are left)
    queue.extend(reversed(tail))
    ks.requeued += 1


def merged(private: deque[Item], shared: deque[Item]) -> Iterator[tuple[bool, Item]]:
    """The items of a consumer's ``private`` queue and of the ``shared`` queue in the order its
    gets take them, each with whether it is ``private``'s: each step the head put first
    (``put_order``; the private one on a tie), each queue's own order kept."""
    ours, theirs = iter(private), iter(shared)
    mine, other = next(ours, None), next(theirs, None)
    while mine is not None and other is not None:
        if put_order(other) < put_order(mine):
            yield False, other
            other = next(theirs, None)
        else:
            yield True, mine
            mine = next(ours, None)
    if mine is not None:
        yield True, mine
        yield from ((True, item) for item in ours)
    if other is not None:
        yield False, other
        yield from ((False, item) for item in theirs)


def _queue_name(key: Any, consumer: str | None) -> str:
    """A queue as an error names it: ``key 'k'``, or ``key 'k', consumer 'a:0'``."""
    return f"key {key!r}" if consumer is None else f"key {key!r}, consumer {consumer!r}"
