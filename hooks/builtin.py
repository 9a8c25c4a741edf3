"""Built-in hooks: the ``flatten_batch`` collector and the four built-in dispatchers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from zchannel.hooks.base import Collector, Dispatcher, consumer_sort_key
from zchannel.hooks.registry import register_collector, register_dispatcher


@register_collector("flatten_batch")
class FlattenBatch(Collector):
    """One output per element of a list or tuple put (other items pass through unchanged);
    each output weighs what the whole put weighed (``put([a, b, c], 5)`` stores three items of
    weight 5).

    This is also the smallest example of a collector: ``collect`` is a generator of
    ``(key, item)`` pairs, and it may change the key or yield nothing to drop the item.
    """

    def collect(self, item: Any, key: Any) -> Iterator[tuple[Any, Any]]:
        if isinstance(item, (list, tuple)):
            for element in item:
                yield key, element
        else:
            yield key, item


@register_dispatcher("shared")
class SharedDispatcher(Dispatcher):
    """Every item stays in its key's shared queue: any consumer takes any item."""

    needs_item = False


class _CountingDispatcher(Dispatcher):
    """Per-key dealing state shared by the built-in dealing dispatchers."""

    needs_item = False

    def setup(self, ctx) -> None:
        super().setup(ctx)
        self._dealt: dict[Any, dict[str, int]] = {}

    def key_dropped(self, key: Any) -> None:
        self._dealt.pop(key, None)

    def _count(self, key: Any, consumer: str) -> str:
        counts = self._dealt.setdefault(key, {})
        counts[consumer] = counts.get(consumer, 0) + 1
        return consumer

    def stats(self) -> dict[str, Any]:
        return {"keys_with_state": len(self._dealt)}


@register_dispatcher("round_robin")
class RoundRobinDispatcher(_CountingDispatcher):
    """Present consumers in id order, dealt in rotation, per key."""

    def setup(self, ctx) -> None:
        super().setup(ctx)
        self._last: dict[Any, str] = {}

    def key_dropped(self, key: Any) -> None:
        super().key_dropped(key)
        self._last.pop(key, None)

    def route(self, item: Any, key: Any) -> str | None:
        consumers = self.ctx.consumers
        if not consumers:
            return None
        last = self._last.get(key)
        choice = consumers[0]
        if last is not None:
            last_sort = consumer_sort_key(last)
            for consumer in consumers:
                if consumer_sort_key(consumer) > last_sort:
                    choice = consumer
                    break
        self._last[key] = choice
        return self._count(key, choice)


@register_dispatcher("least_loaded")
class LeastLoadedDispatcher(_CountingDispatcher):
    """To the consumer with the fewest items dealt so far for that key; ties to the first id."""

    def route(self, item: Any, key: Any) -> str | None:
        consumers = self.ctx.consumers
        if not consumers:
            return None
        counts = self._dealt.get(key, {})
        choice = min(consumers, key=lambda c: counts.get(c, 0))  # min keeps the first on ties
        return self._count(key, choice)


@register_dispatcher("least_loaded_stealing")
class LeastLoadedStealingDispatcher(LeastLoadedDispatcher):
    """As ``least_loaded``; a starved consumer takes the oldest item of the deepest peer."""

    def rebalance(self, key: Any, starved: str, depths: dict[str, int]) -> str | None:
        donor, deepest = None, 0
        for consumer in sorted(depths, key=consumer_sort_key):
            depth = depths[consumer]
            if consumer != starved and depth > deepest:
                donor, deepest = consumer, depth
        return donor
