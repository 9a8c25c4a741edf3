"""A worked example of hooks, runnable: six samples, three consumers.

    python docs/examples/run_seed_example.py

prints which consumer received which sample and checks actor:0 s0 s3 / actor:1 s1 s4 /
actor:2 s2 s5, with the built-ins (flatten_batch, round_robin) and with RLinf-style classes of
its own (seed_hooks.py: FlattenBatchCollector, EvenDispatcher). "seed" in these names refers to
the original design document zchannel was built from, which used this example; nothing here
needs it (docs/hooks.md, "An RLinf-style worked example").

``seed_hooks`` is imported from this file's folder (``sys.path[0]`` of a script), and so does
the broker ``Channel.create`` starts: it gets this process's ``sys.path``.
"""

from __future__ import annotations

import seed_hooks
from zchannel.broker import Channel


def run(name: str, collector: object, dispatcher: object) -> dict[str, list[str]]:
    with Channel.create(name, collector=collector, dispatcher=dispatcher,
                        producers=["rollout"], consumers={"actor": 3}) as channel:
        channel.put(["s0", "s1", "s2", "s3", "s4", "s5"])
        dealt = {}
        for rank in range(3):
            identity = f"actor:{rank}"
            actor = Channel.connect(name, identity=identity)
            dealt[identity] = [actor.get(timeout=10), actor.get(timeout=10)]
            actor.close()
        return dealt


if __name__ == "__main__":
    expected = {"actor:0": ["s0", "s3"], "actor:1": ["s1", "s4"], "actor:2": ["s2", "s5"]}
    builtins = run("seed-builtins", "flatten_batch", "round_robin")
    seed = run("seed-classes", seed_hooks.FlattenBatchCollector, seed_hooks.EvenDispatcher)
    print("built-ins:", builtins)
    print("seed classes:", seed)
    assert builtins == expected and seed == expected
