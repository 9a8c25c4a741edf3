"""Leases: deliveries of ``get(ack=True)`` that wait for their consumer's acknowledgement.

A leased item is out of its queue but still counted in the channel's bytes; an ``ack`` ends the
lease, and a lease that lapses or whose handle goes away puts the item back at the head of its
queue (``QueueCore`` does that part).
"""

from __future__ import annotations

import itertools
import secrets
import time
from typing import Any

from zchannel.broker.core.queues import Deadlines, KeyedQueues
from zchannel.broker.core.state import Client, Item, KeyState, Lease

_ENDED = Item(None, 0, 0)  # what an ended lease holds instead of its item


class LeaseBook:
    """The open leases of one channel, by lease id."""

    def __init__(self, *, lease_timeout: float, queues: KeyedQueues, deadlines: Deadlines) -> None:
        self.lease_timeout = lease_timeout
        self.queues = queues
        self.deadlines = deadlines
        self.leases: dict[int, Lease] = {}
        # from a random start: an ack that reaches a restarted broker (a durable channel's, which
        # holds the item again) never ends the lease of another delivery by chance
        self._ids = itertools.count(secrets.randbits(40) + 1)

    def issue(self, client: Client, ks: KeyState, origin: str | None, item: Item) -> int:
        """Lease ``item`` (taken from ``origin``'s queue of ``ks``) to ``client``: its id."""
        lease_id = next(self._ids)
        lease = Lease(lease_id, ks.key, origin, item, client, time.monotonic() + self.lease_timeout)
        self.leases[lease_id] = lease
        client.leases[lease_id] = None
        ks.leases += 1
        self.deadlines.add(lease.deadline, lease)
        return lease_id

    def find(self, lease_id: Any) -> Lease | None:
        """The open lease ``lease_id`` (any value a client sent), or None."""
        return self.leases.get(lease_id) if isinstance(lease_id, int) else None

    def held(self, lease_id: Any, client: Client) -> Lease:
        """The open lease ``lease_id`` of ``client`` (an ``ack``'s), else ``ValueError`` saying
        why: leases belong to the connection that got the delivery."""
        lease = self.find(lease_id)
        if lease is None:
            raise ValueError(
                f"unknown lease {lease_id!r}: already acknowledged, expired or never issued")
        if lease.client is not client:
            raise ValueError(f"lease {lease_id!r} is held by another connection: a delivery is "
                             f"acknowledged through a handle of the process and identity that "
                             f"got it")
        return lease

    def is_open(self, lease: Lease) -> bool:
        return self.leases.get(lease.lease_id) is lease

    def end(self, lease: Lease) -> Item:
        """Close ``lease`` (acknowledged, lapsed, returned) and return its item: the lease lets
        go of it (its entry in the deadline heap may stay until its deadline); its bytes stay
        the caller's to count."""
        del self.leases[lease.lease_id]
        lease.alive = False
        item, lease.item = lease.item, _ENDED
        lease.client.leases.pop(lease.lease_id, None)
        ks = self.queues.keys.get(lease.key)
        if ks is not None:
            ks.leases -= 1
        return item
