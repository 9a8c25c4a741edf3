"""Two RLinf-style example hooks, in an importable module (see run_seed_example.py; "seed"
in these names refers to the original design document zchannel was built from, which used
this example).

actor:0 gets s0 s3, actor:1 s1 s4, actor:2 s2 s5 — once with the built-ins
(``flatten_batch`` + ``round_robin``) and once with these classes of its own, which live in an
importable module (here: this file, imported as ``seed_hooks``) and are registered under names of
their own because ``flatten_batch`` is a built-in.
"""

from __future__ import annotations

from zchannel.hooks import Collector, Dispatcher, register_collector, register_dispatcher


@register_collector("seed_flatten_batch")
class FlattenBatchCollector(Collector):
    """Emit each sample in an incoming batch as one queue item."""

    def collect(self, item, key):
        for sample in item:
            yield key, sample


@register_dispatcher("even")
class EvenDispatcher(Dispatcher):
    """Assign items to consumers in a fixed rotation."""

    def setup(self, ctx):
        self.consumers = sorted(ctx.consumers)
        self.next_consumer = 0

    def route(self, item, key):
        if not self.consumers:
            return None
        consumer = self.consumers[self.next_consumer % len(self.consumers)]
        self.next_consumer += 1
        return consumer

