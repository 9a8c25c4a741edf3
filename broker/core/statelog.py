"""``StateLog``: what the queue core tells a record of its state (a durable channel's journal,
``broker/journal/``) at the points where items enter and leave it.

The core knows nothing of files: it calls these methods, and a log that cannot record a change
raises, which the core turns into the error reply of the request that made it (nothing of that
request changes).  Without a log (``QueueCore.log`` None) none of this runs.

The order of the calls is the order of the changes, and the log may rely on it:

- ``stored(outputs)`` before a put's items enter their queues (a put that waited for room:
  when it is admitted); raising refuses the put.  The last output carries the put's
  ``Item.origin`` (producer and sequence of a retry-safe put; opaque to the core), which the
  log keeps with it, so that a broker started again knows the put was stored;
- ``stored_each(outputs)``: ``stored`` of each output as a put of its own, in order, as one
  call; how many were recorded (all, or those before the first refused, whose error is not
  raised: the caller records that put again to answer it);
- ``taken(items)`` when a plain ``get`` / ``get_batch`` takes items out of the queues; the
  reply is sent after this call, at the end of the loop turn (``returned`` cancels it if the
  reply could not be sent);
- ``leased(item)`` when a ``get(ack=True)`` leases an item (it stays the channel's until
  ``acked``; a lease that lapses or whose handle goes puts it back, which changes nothing
  for the log);
- ``acked(item)`` before an ``ack`` ends its lease; raising leaves the lease open and is the
  ack's error;
- ``returned(items)`` when items taken by a delivery that could not be sent go back to
  their queue;
- ``unstored(outputs)`` when a put that waited for room ends without being stored (timed out,
  withdrawn): what the log kept of its outputs meanwhile is not needed;
- ``room(nbytes)``: whether the log has room for a put of ``nbytes`` now (a put waits while it
  has not, as for ``max_bytes``), asked only when ``limited``; ``fits(nbytes)``: whether it
  could ever have;
- ``collected(item, key, holds_state, outputs, snapshot)``: a collector that keeps state
  between puts (``Collector.holds_state``) took a put that yielded ``outputs`` items (before
  they are stored); the log keeps the puts since ``holds_state`` was last False (and those
  outputs stored), to rebuild the collector's state.  ``snapshot`` (None: not now) returns the
  collector's state as an item (``Collector.state_dict``; None if that failed), offered when
  the put yielded nothing: the log may keep it in place of the puts taken up to this one (and
  then keeps the outputs of the puts that wait for room, which that state has consumed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from zchannel.broker.core.state import Item

# (key, private consumer or None, item): where a put's items go (``queues.Outputs``)
Output = tuple[Any, str | None, Item]


class StateLog(Protocol):
    """The calls the queue core makes to a record of its state (see the module docstring)."""

    limited: bool  # whether ``room`` may say no (puts then check it)

    def stored(self, outputs: Sequence[Output]) -> None: ...

    def stored_each(self, outputs: Sequence[Output]) -> int: ...

    def taken(self, items: Sequence[Item]) -> None: ...

    def leased(self, item: Item) -> None: ...

    def acked(self, item: Item) -> None: ...

    def returned(self, items: Sequence[Item]) -> None: ...

    def unstored(self, outputs: Sequence[Output]) -> None: ...

    def room(self, nbytes: int) -> bool: ...

    def too_large(self, nbytes: int) -> str | None: ...

    def collected(self, item: Item, key: Any, holds_state: bool, outputs: int,
                  snapshot: Callable[[], Item | None] | None = None) -> None: ...
