"""The records of a channel's queue state: items, clients, parked requests, per-key queues,
leases and consumers (kept by the parts of ``QueueCore``, ``core/queuecore.py``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# What the records of an item, of a waiting request and of a key cost in a broker's memory
# beyond an item's payload, as counted against ``max_bytes`` (measured: 170-240 B per queued
# item, ~370 B per waiting get, ~1 KiB per key; docs/guarantees.md).
ITEM_OVERHEAD = 320
# each frame of an item after its first: a message of many empty frames costs ~200 B a frame
FRAME_OVERHEAD = 256
REQUEST_OVERHEAD = 640
KEY_OVERHEAD = 1536


def item_bytes(payload: int, frames: int) -> int:
    """What an item of ``payload`` bytes in ``frames`` frames counts against ``max_bytes``."""
    return payload + ITEM_OVERHEAD + FRAME_OVERHEAD * max(0, frames - 1)


@dataclass(slots=True, eq=False)
class Item:
    """One queued item.  ``payload`` belongs to the transport and the queue core never looks
    into it: a broker's frames (with any shared-memory slots they refer to), or the object
    itself in a local channel.  ``nbytes`` is what the item counts against ``max_bytes``: in a
    broker ``item_bytes`` of its payload and frames."""

    payload: Any
    weight: int | float
    nbytes: int
    value: Any = None  # the decoded item, when a hook needed it
    decoded: bool = False
    jid: int = 0  # its number in the channel's journal (``StateLog``), 0 without one
    # the (producer, sequence) of the retry-safe put that stored it, for a journal to keep:
    # opaque to the core, which moves it to the last output of a collector; the journal drops
    # it once recorded
    origin: tuple[bytes, int] | None = None
    # its place in the channel's put order, numbered when its put arrived
    # (``KeyedQueues.number``), which tells which of a consumer's private queue and the shared
    # queue holds the item put first (``queues.put_order``); 0 for an item read back from the
    # journal (put before any put since) and on a channel that deals no items (no private
    # queues: nothing to order it against)
    seq: int = 0


@dataclass(eq=False, slots=True)
class Client:
    """One connected handle (a DEALER socket, or a local handle)."""

    address: Any
    identity: str | None = None
    last_seen: float = field(default_factory=time.monotonic)
    parked: dict[int, Parked] = field(default_factory=dict)
    # its open leases' ids, in the order they were issued (values unused: an ordered set)
    leases: dict[int, None] = field(default_factory=dict)
    consumer: str | None = None  # set once the handle joined as a consumer
    gone: bool = False
    user: str | None = None  # its CURVE public key (z85), when the broker checks admin keys
    producer: Any = None  # its put sequences' window (broker/server/producers.py)
    items: bool = False  # it reads ``items`` records (several gets' small items in one record)
    # the broker stalled past its expiry: the client failed its requests, so its gets sent
    # before its next hello are dropped (``Sessions.judged_gone``)
    stale: bool = False


@dataclass(eq=False, slots=True)
class Parked:
    """A parked get, get_batch or put."""

    client: Client
    rid: int
    kind: str  # "get" | "batch" | "put"
    key: Any
    deadline: float | None
    target: int | float = 0  # get_batch target weight
    ack: bool = False
    outputs: list[tuple[Any, str | None, Item]] = field(default_factory=list)
    alive: bool = True
    on_end: Callable[[bool], None] | None = None  # a put's: called with True once stored
    cost: int = 0  # bytes it counts against max_bytes while it waits (Waiters)
    # a waiting get_batch's scan so far (``waiters.batch_take``): the queue, its ``requeued``
    # count, its head item, how many head items were counted, their total weight and whether
    # the float rules apply (a float target or weight)
    scan: tuple[deque[Item], int, Item, int, int | float, bool] | None = None


@dataclass(eq=False, slots=True)
class KeyState:
    key: Any
    shared: deque[Item] = field(default_factory=deque)
    private: dict[str, deque[Item]] = field(default_factory=dict)
    getters: deque[Parked] = field(default_factory=deque)
    putters: int = 0
    leases: int = 0
    idle_since: float | None = None
    idle_timer: bool = False  # a deadline of its grace period is in the core's timer heap
    # counts the times items went back to the head of one of its queues, were merged into one
    # (``queues.merge_in_put_order``), or a queue was emptied other than by takes
    # (``put_back``, ``take_all``): a get_batch's remembered count of a
    # queue (``waiters._batch_take_resumed``) is stale then
    requeued: int = 0

    def depth(self) -> int:
        if not self.private:
            return len(self.shared)
        return len(self.shared) + sum(len(q) for q in self.private.values())

    def idle(self) -> bool:
        if self.shared or self.getters or self.putters or self.leases:
            return False
        return not any(self.private.values())

    def put_back(self, queue: deque[Item], items: list[Item]) -> None:
        """Put ``items`` back at the head of ``queue`` (one of this key's), in their order."""
        queue.extendleft(reversed(items))
        self.requeued += 1

    def take_all(self, queue: deque[Item]) -> list[Item]:
        """Empty ``queue`` (one of this key's): its items, in order."""
        items = list(queue)
        queue.clear()
        self.requeued += 1
        return items


@dataclass(eq=False)
class Lease:
    lease_id: int
    key: Any
    origin: str | None
    item: Item
    client: Client
    deadline: float
    alive: bool = True  # open (``LeaseBook.end`` closes it)


@dataclass
class Consumer:
    declared: bool
    handles: int = 0
