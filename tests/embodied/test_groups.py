"""Worker groups: RLinf's call forms on local processes and Ray actors; groups as channel
producers/consumers; the seed's placement rule on a simulated 3-node Ray cluster."""

from __future__ import annotations

import sys

import pytest
from zchannel.broker import Channel
from zchannel.broker.handle.workergroups import expand_groups
from zchannel.embodied.groups import Worker, WorkerError


class Echo(Worker):
    def __init__(self, base: int = 0) -> None:
        self.base = base
        self.in_init = self.worker_name, self.rank, self.world_size

    def seen_in_init(self) -> tuple:
        return self.in_init

    def whoami(self) -> tuple:
        return self.worker_name, self.rank, self.world_size, self.base

    def take(self, channel, n: int) -> list:
        out = [channel.get(timeout=30) for _ in range(n)]
        identity = channel.identity
        channel.close()
        return [identity, out]

    def node(self):
        return self._zchannel_node()

    def boom(self) -> None:
        raise RuntimeError("boom on purpose")


class _FakeGroup:
    def zchannel_group(self):
        return "actor", ["actor:0", "actor:1"], []


def test_expand_groups_by_duck_typing():
    producers, consumers = expand_groups([_FakeGroup(), "extra"], [_FakeGroup()])
    assert producers == ["actor", "extra"] and consumers == ["actor:0", "actor:1"]
    assert expand_groups(None, {"actor": 2}) == (None, {"actor": 2})


@pytest.mark.timeout(120)
def test_local_group_calls_and_channel_binding(channels):
    group = Echo.create_group(7).launch(2, name="actor")
    try:
        assert group.worker_ids == ["actor:0", "actor:1"]
        assert group.whoami().wait(60) == [("actor:0", 0, 2, 7), ("actor:1", 1, 2, 7)]
        ch = Channel.create("grp", dispatcher="round_robin", consumers=[group])
        channels.append(ch)
        for i in range(4):
            ch.put(i)
        got = group.take(ch, 2).wait(60)  # the handle binds to each worker's identity
        assert [g[0] for g in got] == ["actor:0", "actor:1"]
        assert sorted(x for g in got for x in g[1]) == [0, 1, 2, 3]
        call = group.boom()
        with pytest.raises(WorkerError, match="(?s)actor:0 failed.*boom on purpose"):
            call.wait(60)
        assert call.done() and set(call.failures()) == {0, 1}  # both ranks, results kept
        assert group.whoami().wait(60)[1][0] == "actor:1"  # the workers go on serving
        with pytest.raises(AttributeError, match="no public method"):
            _ = group.nothing
    finally:
        group.shutdown()


class ConnectsInInit(Worker):
    """Connects its channel in ``__init__``, where its rank and name must already be its own."""

    def __init__(self, channel_name: str) -> None:
        self.ch = self.connect_channel(channel_name)
        self.in_init = self.worker_name, self.rank, self.world_size

    def seen(self) -> tuple:
        return self.in_init, self.ch.identity


@pytest.mark.timeout(120)
def test_rank_and_name_are_set_before_init_runs(channels):
    """Inside ``__init__`` each rank sees its own rank, world size and name, so a channel it
    connects there acts for it (every rank saw rank 0 and ``worker:0``)."""
    channels.append(Channel.create("init-binds"))
    group = ConnectsInInit.create_group("init-binds").launch(3, name="w")
    try:
        assert group.seen().wait(60) == [((f"w:{r}", r, 3), f"w:{r}") for r in range(3)]
    finally:
        group.shutdown()


def test_a_workers_channel_methods_take_rlinfs_parameters(channels):
    """``create_channel(channel_name, maxsize, distributed, node_rank, local)`` and
    ``connect_channel(channel_name)``, as RLinf's ``Worker`` has them; the handles act for the
    worker's ``group:rank``."""
    worker = Echo()
    worker._zchannel_setup("actor", 1, 2)
    ch = worker.create_channel("rlinf-forms", 2, False, None, True)  # local, maxsize 2
    channels.append(ch)
    assert ch.is_local and ch.identity == "actor:1" and ch.stats()["maxsize"] == 2
    other = worker.connect_channel(channel_name="rlinf-forms")
    try:
        assert other.identity == "actor:1" and other.is_local
    finally:
        other.close()


ray = pytest.importorskip("ray")


@pytest.fixture
def cluster(ray_cluster):
    # Ray workers cannot import this test module: its Worker class travels by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield ray_cluster  # the session's shared cluster (tests/conftest.py)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _nodes():
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


@pytest.mark.timeout(300)
def test_seed_placement_rule_and_a_whole_demo_run_on_three_nodes(cluster):
    from zchannel.embodied.ray_runner import RayLauncher
    from zchannel.embodied.runners import RunConfig, run

    nodes = _nodes()
    driver = ray.get_runtime_context().get_node_id()
    rollout = Echo.create_group().launch(1, name="rollout", ray=True, node_ranks=[1])
    actors = Echo.create_group().launch(2, name="actor", ray=True, node_ranks=[2])
    try:
        assert rollout.node().wait(60) == [nodes[1]]
        assert actors.seen_in_init().wait(60) == [("actor:0", 0, 2), ("actor:1", 1, 2)]
        assert actors.node().wait(60) == [nodes[2], nodes[2]]
        placed = {}
        for name, kw in (("by-producer", dict(producers=[rollout], consumers=[actors])),
                         ("by-consumer", dict(consumers=[actors])),
                         ("by-creator", {})):
            ch = Channel.create(name, dispatcher="round_robin" if "consumers" in kw else None,
                                **kw)
            try:
                stats = ch.stats()
                placed[name] = [r["node"] for r in stats["replicas"]]
                if name == "by-producer":
                    assert stats["producers"] == ["rollout"]
                    for i in range(4):
                        ch.put(i)
                    got = actors.take(ch, 2).wait(60)  # handles reach the broker from node 2
                    assert [g[0] for g in got] == ["actor:0", "actor:1"]
            finally:
                ch.shutdown()
        assert placed == {"by-producer": [nodes[1]], "by-consumer": [nodes[2]],
                          "by-creator": [driver]}
    finally:
        rollout.shutdown()
        actors.shutdown()
    cfg = RunConfig(runner="async", steps=3, seed=5)
    result = run(cfg, launcher=RayLauncher(cfg, nodes=3))
    assert [r["step"] for r in result["records"]] == [0, 1, 2]
    assert result["placement"] == [nodes[1]]  # the rollout's node: the first producer's
