"""Which consumers a channel has: the declared ones and those that joined with a get.

A handle with an identity joins as a consumer on its first get; a consumer is present while it
was declared at creation and has not left, or while at least one of its handles is connected.
Its last handle leaving makes it absent, declared or not (its private items are then re-dealt by
``QueueCore``).
"""

from __future__ import annotations

import bisect

from zchannel.broker.core.state import Client, Consumer
from zchannel.hooks import consumer_sort_key


class Consumers:
    """The consumers of one channel and how many handles each has."""

    def __init__(self, declared: tuple[str, ...]) -> None:
        self.consumers: dict[str, Consumer] = {c: Consumer(declared=True) for c in declared}
        self.declared = frozenset(declared)
        # every listed consumer (each one is present), kept sorted as they come and go: a
        # burst of thousands of joins must not sort them all at each one
        self._sorted = sorted(self.consumers, key=consumer_sort_key)
        self._present: tuple[str, ...] | None = None

    def present(self) -> tuple[str, ...]:
        """The present consumers, sorted by ``(group, int(rank))`` (``ChannelContext.consumers``)."""
        if self._present is None:
            self._present = tuple(self._sorted)
        return self._present

    def listed(self, consumer: str) -> bool:
        """Whether ``consumer`` is declared and has not left, or has a connected handle."""
        return consumer in self.consumers

    def known(self, consumer: str) -> bool:
        """Whether items may be dealt to ``consumer``: listed, or declared at creation."""
        return consumer in self.consumers or consumer in self.declared

    def join(self, client: Client) -> str | None:
        """``client`` gets as a consumer (once per handle): the consumer id if it was not
        listed before (it just appeared), else None."""
        cid = client.identity
        if cid is None or client.consumer is not None:
            return None
        client.consumer = cid
        state = self.consumers.get(cid)
        if state is None:
            state = self.consumers[cid] = Consumer(declared=False)
            state.handles = 1
            bisect.insort(self._sorted, cid, key=consumer_sort_key)
            self._present = None
            return cid
        state.handles += 1
        return None

    def leave(self, client: Client) -> str | None:
        """``client`` is gone: the consumer id if it was its consumer's last handle (the
        consumer is no longer present), else None."""
        cid = client.consumer
        if cid is None:
            return None
        client.consumer = None
        state = self.consumers[cid]
        state.handles -= 1
        if state.handles > 0:
            return None
        # A consumer that made contact and left is no longer present, declared or not.
        del self.consumers[cid]
        del self._sorted[bisect.bisect_left(self._sorted, consumer_sort_key(cid),
                                            key=consumer_sort_key)]
        self._present = None
        return cid
