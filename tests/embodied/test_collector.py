"""The embodied_trajectory collector and dispatcher, driven in-process."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from zchannel.broker import DEFAULT_KEY
from zchannel.broker.host.toml import tomllib
from zchannel.embodied.advantages import compute_advantages, to_training_batch
from zchannel.embodied.collector import TrajectoryCollector, TrajectoryDispatcher
from zchannel.embodied.modes import route_source_rows
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.trajectory import ActorBatch, EpisodeShard, Trajectory
from zchannel.embodied.types import (
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectorySource,
)
from zchannel.hooks import ChannelContext, Collector, Dispatcher, registered

from .conftest import make_plan

T, F = True, False
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def hooks(plan, consumers=None):
    if consumers is None:
        consumers = tuple(f"actor:{i}" for i in range(plan.actor_world_size))
    ctx = ChannelContext(name="trajectory", consumers=tuple(consumers), options=plan.to_options())
    collector, dispatcher = TrajectoryCollector(), TrajectoryDispatcher()
    collector.setup(ctx)
    dispatcher.setup(ctx)
    return collector, dispatcher, ctx


def put(collector, part):
    """Run one put through the collector; every output must go to DEFAULT_KEY."""
    pairs = list(collector.collect(part, "ignored-input-key"))
    assert all(len(p) == 2 and p[0] == DEFAULT_KEY == "default_queue" for p in pairs)
    return [item for _, item in pairs]


def key(step=0, epoch=0, rank=0, chunk=0, stage=0):
    return TrajectoryKey(step, epoch, rank, stage, chunk)


def parts(plan, k, *, rank_pos=None, dones=None, next_obs=None, external=False, episode_data=None):
    """Both halves of chunk ``k``; values encode (epoch, chunk, global env column)."""
    B, C, A = plan.source_batch_size, plan.num_action_chunks, plan.action_dim
    D = C * A
    pos = k.env_rank if rank_pos is None else rank_pos
    cols = (torch.arange(B, dtype=torch.float32) + pos * B).reshape(B, 1)
    tag = 1000 * k.epoch_id + 100 * k.chunk_id
    sources = [TrajectorySource(k, B, 0)]
    obs = {"states": cols.expand(B, 3).clone(), "task_descriptions": ["task"] * B}
    if external:
        policy = PolicyPart(sources, obs, external_actions=(tag + cols).expand(B, D).clone())
    else:
        policy = PolicyPart(
            sources,
            obs,
            output=PolicyOutput(
                forward_inputs={"action": (tag + cols).expand(B, D).clone()},
                prev_logprobs=torch.full((B, D), -0.5),
                prev_values=0.1 * cols + 0.01 * k.chunk_id,
                versions=torch.full((B, D), 3.0),
            ),
        )
    if dones is None:
        dones = torch.zeros(B, C, dtype=torch.bool)
    zeros = torch.zeros(B, C, dtype=torch.bool)
    transition = EnvTransition(
        rewards=((cols * 7 + k.chunk_id * 3) % 5).expand(B, C).clone(),
        dones=dones,
        terminations=dones,
        truncations=zeros,
        episode_data=episode_data,
    )
    last = k.chunk_id == plan.num_chunks - 1
    env = EnvPart(
        sources,
        transition,
        next_obs=next_obs,
        final_prev_values=(0.1 * cols + 1.0) if last else None,
        bootstrap_values=(0.1 * cols + 1.0)[:, :1] if last else None,
        initial_transition=(
            EnvTransition(dones=zeros, terminations=zeros, truncations=zeros)
            if k.chunk_id == 0
            else None
        ),
    )
    return policy, env


def feed(collector, plan, keys, **kw):
    outputs = []
    for k in keys:
        policy, env = parts(plan, k, **kw)
        outputs += put(collector, policy)
        outputs += put(collector, env)
    return outputs


def assert_empty(collector):
    j = collector.joiner
    assert not j.policy_parts and not j.env_parts and not j.fragments
    assert not collector.mode.scopes


# ---------------------------------------------------------------------------------------------
# registration, setup, configs


def test_hooks_are_registered_and_need_options():
    assert registered(Collector)["embodied_trajectory"] is TrajectoryCollector
    assert registered(Dispatcher)["embodied_trajectory"] is TrajectoryDispatcher
    assert TrajectoryDispatcher.needs_item is True
    for hook in (TrajectoryCollector(), TrajectoryDispatcher()):
        with pytest.raises(ValueError, match="options"):
            hook.setup(ChannelContext(name="t", options={}))
    with pytest.raises(ValueError, match="decoupled"):
        TrajectoryCollector().setup(
            ChannelContext(name="t", options={**make_plan().to_options(), "decoupled": True})
        )


@pytest.mark.parametrize("name", ["rollout", "pipeline", "lerobot"])
def test_config_files_parse_into_plans(name):
    with open(CONFIGS / f"embodied_{name}.toml", "rb") as fh:
        config = tomllib.load(fh)
    plan = TrajectoryPlan.from_options(config["options"])
    assert plan.mode == name
    hooks_ = config["hooks"]
    assert hooks_["collector"] == hooks_["dispatcher"] == "embodied_trajectory"
    assert hooks_["consumers"] == {"actor": plan.actor_world_size}
    assert hooks_["producers"] == ["rollout"]
    assert isinstance(config["channel"]["name"], str)
    assert isinstance(config["channel"]["maxsize"], int)
    hooks(plan)  # valid for both hooks


# ---------------------------------------------------------------------------------------------
# rollout mode


def test_minimal_flow():
    plan = make_plan()
    collector, dispatcher, _ = hooks(plan)
    k = key()
    policy, env = parts(plan, k)
    assert put(collector, policy) == []
    env = EnvPart(
        env.sources,
        env.transition,
        requires_inference=True,
        initial_transition=env.initial_transition,
    ).complete(next_obs=None, next_rlt_obs=None, final_prev_values=torch.tensor([[2.0]]))
    (traj,) = put(collector, env)
    assert isinstance(traj, Trajectory)
    assert traj.prev_values.reshape(-1).tolist() == pytest.approx([0.0, 2.0])
    assert dispatcher.route(traj, DEFAULT_KEY) == "actor:0"
    assert_empty(collector)


GOLDEN = dict(gamma=0.5, auto_reset=True)


def golden_parts(k):
    policy = PolicyPart(
        [TrajectorySource(k, 1, 0)],
        {"states": torch.zeros(1, 2)},
        output=PolicyOutput(
            forward_inputs={"action": torch.tensor([[1.0]])},
            prev_logprobs=torch.tensor([[0.0]]),
            prev_values=torch.tensor([[0.0]]),
            versions=torch.tensor([[7.0]]),
        ),
    )
    env = EnvPart(
        [TrajectorySource(k, 1, 0)],
        EnvTransition(
            rewards=torch.tensor([[1.0]]),
            dones=torch.tensor([[T]]),
            truncations=torch.tensor([[T]]),
            terminations=torch.tensor([[F]]),
        ),
        bootstrap_values=torch.tensor([[4.0]]),
        final_prev_values=torch.tensor([[5.0]]),
        initial_transition=EnvTransition(
            dones=torch.tensor([[F]]),
            truncations=torch.tensor([[F]]),
            terminations=torch.tensor([[F]]),
        ),
    )
    return policy, env


@pytest.mark.parametrize("env_first", [False, True])
def test_golden_trajectory_both_orders(env_first):
    collector, _, _ = hooks(make_plan(**GOLDEN))
    policy, env = golden_parts(key())
    first, second = (env, policy) if env_first else (policy, env)
    assert put(collector, first) == []
    (traj,) = put(collector, second)
    assert traj.actions.tolist() == [[[1.0]]]
    assert traj.rewards.tolist() == [[[3.0]]]
    assert traj.prev_values.tolist() == [[[0.0]], [[5.0]]]
    assert traj.dones.tolist() == [[[F]], [[T]]]
    assert traj.truncations.tolist() == [[[F]], [[T]]]
    assert traj.terminations.tolist() == [[[F]], [[F]]]
    assert traj.versions.tolist() == [[[7.0]]]
    assert traj.prev_logprobs.tolist() == [[[0.0]]]
    assert traj.forward_inputs["action"].tolist() == [[[1.0]]]
    assert traj.intervene_flags.tolist() == [[[F]]]


def test_golden_two_epochs_and_no_prev_infos():
    collector, _, _ = hooks(make_plan(rollout_epochs=2, **GOLDEN))
    out = []
    for e in (1, 0):  # epochs arrive out of order
        for part in golden_parts(key(epoch=e)):
            out += put(collector, part)
    (traj,) = out
    assert traj.dones.reshape(-1).tolist() == [F, T, F, T]
    assert traj.prev_values.reshape(-1).tolist() == [0, 5, 0, 5]

    collector, _, _ = hooks(make_plan(collect_prev_infos=False, **GOLDEN))
    policy, env = golden_parts(key())
    put(collector, policy)
    (traj,) = put(collector, env)
    assert traj.prev_logprobs is None and traj.prev_values is None


def test_out_of_order_arrival_gives_same_trajectory():
    plan = make_plan(num_chunks=3, rollout_epochs=2, source_batch_size=2, num_action_chunks=2)
    keys = [key(epoch=e, chunk=c) for e in range(2) for c in range(3)]
    (in_order,) = feed(hooks(plan)[0], plan, keys)
    collector = hooks(plan)[0]
    out = []
    halves = [h for k in keys for h in parts(plan, k)]
    for i in (7, 0, 11, 3, 1, 10, 4, 8, 2, 9, 6, 5):  # halves interleaved, chunks out of order
        out += put(collector, halves[i])
    (shuffled,) = out
    batch_a, batch_b = Trajectory.to_batch([in_order]), Trajectory.to_batch([shuffled])
    for name, value in batch_a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, batch_b[name]), name
    assert in_order.actions[:, 0, 0].tolist() == [0, 100, 200, 1000, 1100, 1200]


def test_rollout_sources_flush_independently_and_deal_least_loaded():
    plan = make_plan(num_sources=2, source_batch_size=4, num_chunks=2, actor_world_size=4)
    collector, dispatcher, _ = hooks(plan)
    out0 = feed(collector, plan, [key(rank=0, chunk=c) for c in range(2)])
    assert len(out0) == plan.shards_per_source == 2
    assert [t.actions.shape[1] for t in out0] == [2, 2]
    assert out0[0].actions[0, :, 0].tolist() == [0, 1] and out0[1].actions[0, :, 0].tolist() == [
        2,
        3,
    ]
    assert len(collector.mode.scopes) == 0
    assert feed(collector, plan, [key(rank=1, chunk=0)]) == []
    assert len(collector.mode.scopes) == 1
    out1 = feed(collector, plan, [key(rank=1, chunk=1)])
    assert len(out1) == 2
    routes = [dispatcher.route(t, DEFAULT_KEY) for t in out0 + out1]
    assert routes == ["actor:0", "actor:1", "actor:2", "actor:3"]
    assert_empty(collector)


def test_duplicate_key_in_open_scope_raises():
    plan = make_plan(num_chunks=2)
    collector, _, _ = hooks(plan)
    feed(collector, plan, [key(chunk=0)])
    policy, env = parts(plan, key(chunk=0))
    put(collector, policy)
    with pytest.raises(ValueError, match="duplicate trajectory event"):
        put(collector, env)
    # Completing the scope flushes it and forgets everything, including the duplicate halves.
    assert len(feed(collector, plan, [key(chunk=1)])) == 1
    assert_empty(collector)
    # A closed scope is forgotten: the same key opens a new scope.
    assert feed(collector, plan, [key(chunk=0)]) == []


def test_failed_emit_keeps_halves_and_state():
    plan = make_plan(collect_transitions=True)
    collector, _, _ = hooks(plan)
    policy, env = parts(plan, key())
    put(collector, policy)
    with pytest.raises(ValueError, match="next_obs"):
        put(collector, env)
    assert key() in collector.joiner.policy_parts and key() in collector.joiner.env_parts
    assert not collector.mode.scopes
    fixed = parts(plan, key(), next_obs={"states": torch.ones(1, 3), "task_descriptions": ["t"]})[1]
    (traj,) = put(collector, fixed)
    assert set(traj.curr_obs) == {"states"} and set(traj.next_obs) == {"states"}
    assert traj.next_obs["states"].shape == (1, 1, 3)
    assert_empty(collector)


def test_an_observation_leaf_that_cannot_stack_fails_its_own_put():
    """With collect_transitions a trajectory stacks observations step by step: a list (other
    than task_descriptions) is refused at the put that brings it, not at the scope's flush."""
    plan = make_plan(num_chunks=2, collect_transitions=True)
    collector, _, _ = hooks(plan)
    nxt = {"states": torch.ones(1, 3)}
    policy, env = parts(plan, key(chunk=0), next_obs=nxt)
    put(collector, env)
    policy.obs["extra"] = ["not", "stackable"]
    with pytest.raises(TypeError, match="curr_obs.extra is a list"):
        put(collector, policy)
    assert not collector.mode.scopes
    policy.obs["extra"] = np.array(["a str array"])  # cannot travel to the actors
    with pytest.raises(TypeError, match="curr_obs.extra is a numpy array of dtype <U11"):
        put(collector, policy)
    del policy.obs["extra"]
    assert put(collector, policy) == []
    (traj,) = feed(collector, plan, [key(chunk=1)], next_obs=nxt)
    assert traj.curr_obs["states"].shape == (2, 1, 3)
    assert_empty(collector)


def test_dealing_counts_outlive_an_idle_key_drop_unless_even():
    """Least-loaded dealing counts items dealt so far: the broker dropping the idle key (a
    source that flushes long after the others) forgets them only when they are even."""
    plan = make_plan(num_sources=2, source_batch_size=2, actor_world_size=4)
    collector, dispatcher, _ = hooks(plan)
    out0 = feed(collector, plan, [key(rank=0)])
    assert [dispatcher.route(t, DEFAULT_KEY) for t in out0] == ["actor:0", "actor:1"]
    dispatcher.key_dropped(DEFAULT_KEY)  # idle for key_grace seconds
    out1 = feed(collector, plan, [key(rank=1)])
    assert [dispatcher.route(t, DEFAULT_KEY) for t in out1] == ["actor:2", "actor:3"]
    dispatcher.key_dropped(DEFAULT_KEY)  # even now: forgotten
    assert dispatcher.stats()["keys_with_state"] == 0
    out2 = feed(collector, plan, [key(step=1, rank=0)])
    assert [dispatcher.route(t, DEFAULT_KEY) for t in out2] == ["actor:0", "actor:1"]


def test_multi_key_put_is_atomic():
    """A PolicyPart spanning two sources: one bad chunk fails the whole put."""
    plan = make_plan(num_sources=2, actor_world_size=2, collect_transitions=True)
    collector, _, _ = hooks(plan)
    k0, k1 = key(rank=0), key(rank=1)
    p0, _ = parts(plan, k0)
    p1, _ = parts(plan, k1)
    nxt = {"states": torch.ones(1, 3)}
    put(collector, parts(plan, k0, next_obs=nxt)[1])
    put(collector, parts(plan, k1)[1])  # lacks next_obs
    merged = PolicyPart(
        [TrajectorySource(k0, 1, 0), TrajectorySource(k1, 1, 0)],
        {"states": torch.cat([p0.obs["states"], p1.obs["states"]])},
        output=PolicyOutput.merge([p0.output, p1.output]),
    )
    with pytest.raises(ValueError, match="next_obs"):
        put(collector, merged)
    assert not collector.mode.scopes  # chunk k0 was not committed either
    assert set(collector.joiner.policy_parts) == {k0, k1} == set(collector.joiner.env_parts)
    (t1,) = put(collector, parts(plan, k1, next_obs=nxt)[1])
    assert t1.actions.reshape(-1).tolist() == [1.0]
    (t0,) = put(collector, p0)  # re-pushing a half retries k0
    assert t0.actions.reshape(-1).tolist() == [0.0]
    assert_empty(collector)


def test_collect_rejects_bad_items():
    plan = make_plan(num_chunks=2, rollout_epochs=2)
    collector, _, _ = hooks(plan)
    with pytest.raises(ValueError, match="Unexpected trajectory part"):
        put(collector, {"not": "a part"})
    for bad in (key(chunk=2), key(epoch=2)):
        with pytest.raises(ValueError, match="outside the plan"):
            put(collector, parts(plan, bad)[0])
    with pytest.raises(ValueError, match="only supported for online LeRobot DAgger"):
        put(collector, parts(plan, key(), external=True)[0])
    assert_empty(collector)


def test_stats_are_msgpackable():
    plan = make_plan(num_chunks=2, source_batch_size=2)
    collector, dispatcher, _ = hooks(plan)
    feed(collector, plan, [key(chunk=0)])
    put(collector, parts(plan, key(chunk=1))[0])
    stats = collector.stats()
    msgpack.packb(stats)
    msgpack.packb(dispatcher.stats())
    assert stats["open_scopes"] == 1 and stats["policy_parts"] == 1
    assert stats["held_bytes"] > 0


# ---------------------------------------------------------------------------------------------
# pipeline mode


def pipe_plan(**kw):
    options = dict(
        mode="pipeline",
        num_sources=2,
        source_batch_size=4,
        num_chunks=2,
        rollout_epochs=2,
        actor_world_size=4,
        num_action_chunks=2,
        action_dim=1,
        micro_batch_size=2,
    )
    options.update(kw)
    return make_plan(**options)


def pipeline_epoch(collector, plan, step=0, epoch=0, ranks=None):
    ranks = range(plan.num_sources) if ranks is None else ranks
    keys = [
        key(step=step, epoch=epoch, rank=r, chunk=c) for r in ranks for c in range(plan.num_chunks)
    ]
    return feed(collector, plan, keys)


def test_source_row_routing_examples():
    assert route_source_rows(0, 4, 2) == [(0, 2), (1, 2)]
    assert route_source_rows(1, 4, 2) == [(2, 2), (3, 2)]
    assert route_source_rows(0, 4, 6) == [(0, 4)]
    assert route_source_rows(1, 4, 6) == [(0, 2), (1, 2)]
    assert route_source_rows(2, 4, 6) == [(1, 4)]


def test_pipeline_waits_for_all_sources_and_flushes_each_epoch():
    plan = pipe_plan()
    collector, _, _ = hooks(plan)
    assert pipeline_epoch(collector, plan, epoch=0, ranks=[0]) == []
    assert pipeline_epoch(collector, plan, epoch=1, ranks=[1]) == []
    out0 = pipeline_epoch(collector, plan, epoch=0, ranks=[1])
    per_actor = plan.num_chunks * plan.actor_width // plan.micro_batch_size
    assert len(out0) == plan.actor_world_size * per_actor == 8
    assert all(isinstance(b, ActorBatch) and b.epoch_id == 0 for b in out0)
    assert [(b.actor_rank, b.micro_batch_index) for b in out0] == [
        (a, m) for a in range(4) for m in range(per_actor)
    ]
    assert set(collector.mode.scopes) == {(0, 1)}
    out1 = pipeline_epoch(collector, plan, epoch=1, ranks=[0])
    assert len(out1) == 8 and all(b.epoch_id == 1 for b in out1)
    assert_empty(collector)


def test_pipeline_scope_from_wrong_number_of_sources_raises():
    plan = pipe_plan(rollout_epochs=1)  # S=2, N=2: a scope completes at 4 keys
    collector, _, _ = hooks(plan)
    feed(collector, plan, [key(rank=0), key(rank=1), key(rank=2, chunk=0)])
    policy, env = parts(plan, key(rank=2, chunk=1))
    put(collector, policy)
    with pytest.raises(ValueError, match="3 sources; expected exactly 2"):
        put(collector, env)


def test_pipeline_three_sources_two_actors_example():
    plan = pipe_plan(num_sources=3, actor_world_size=2, rollout_epochs=1, micro_batch_size=4)
    collector, dispatcher, _ = hooks(plan)
    out = pipeline_epoch(collector, plan)
    assert [b.actor_rank for b in out] == [0, 0, 0, 1, 1, 1]
    assert all(b.data["actions"].shape == (4, 2) for b in out)
    assert [dispatcher.route(b, DEFAULT_KEY) for b in out] == ["actor:0"] * 3 + ["actor:1"] * 3
    # Global columns: actor 0 owns envs 0..5, actor 1 envs 6..11.
    cols0 = torch.cat([b.data["actions"][:, 0] for b in out[:3]]) % 100
    cols1 = torch.cat([b.data["actions"][:, 0] for b in out[3:]]) % 100
    assert set(cols0.tolist()) == set(range(6)) and set(cols1.tolist()) == set(range(6, 12))


def test_actor_batches_are_rank_bound():
    plan = pipe_plan()
    _, dispatcher, ctx = hooks(plan)
    batch = ActorBatch(actor_rank=1, step_id=0, epoch_id=0, micro_batch_index=0, data={})
    assert dispatcher.route(batch, DEFAULT_KEY) == "actor:1"
    ctx.consumers = ("actor:0", "actor:2", "actor:3")  # actor:1 left
    dispatcher.forget("actor:1")
    assert dispatcher.route(batch, DEFAULT_KEY) == "actor:1"
    ctx.consumers = ("actor:0", "actor:1", "actor:2", "actor:3", "actor:4")  # late joiner
    assert dispatcher.route(batch, DEFAULT_KEY) == "actor:1"
    # Other items are re-dealt least-loaded among the present consumers.
    ctx.consumers = ("actor:0", "actor:2")
    traj = Trajectory(actions=torch.zeros(1, 1, 1))
    assert [dispatcher.route(traj, DEFAULT_KEY) for _ in range(3)] == [
        "actor:0",
        "actor:2",
        "actor:0",
    ]
    ctx.consumers = ()
    assert dispatcher.route(traj, DEFAULT_KEY) is None


@pytest.mark.parametrize(
    "consumers",
    [
        (),
        ("actor:0", "actor:1", "actor:2"),
        ("a:0", "b:0", "a:1", "a:2"),
        tuple(f"actor:{i}" for i in range(5)),
    ],
)
def test_pipeline_dispatcher_needs_one_consumer_per_rank(consumers):
    plan = pipe_plan()
    ctx = ChannelContext(name="t", consumers=consumers, options=plan.to_options())
    with pytest.raises(ValueError, match="one consumer per rank"):
        TrajectoryDispatcher().setup(ctx)


def concat_rows(batches):
    keys = batches[0].data.keys()
    return {k: torch.cat([b.data[k] for b in batches]) for k in keys}


def test_pipeline_micro_batches_are_deterministic_and_generator_persists():
    plan = pipe_plan(rollout_epochs=1, shuffle=False)
    ordered = hooks(plan)[0]
    flat = [concat_rows(pipeline_epoch(ordered, plan, step=s)[:2]) for s in range(2)]  # actor 0
    # shuffle=False keeps row order t * W_a + w
    W = plan.actor_width
    expected = torch.tensor([100 * t + w for t in range(2) for w in range(W)], dtype=torch.float32)
    assert torch.equal(flat[0]["actions"][:, 0], expected)

    shuffled_plan = pipe_plan(rollout_epochs=1, seed=11)
    runs = []
    for _ in range(2):
        collector = hooks(shuffled_plan)[0]
        runs.append(
            [concat_rows(pipeline_epoch(collector, shuffled_plan, step=s)[:2]) for s in range(2)]
        )
    for a, b in zip(runs[0], runs[1], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    g = torch.Generator().manual_seed(11 + 0)
    n = plan.num_chunks * W
    perms = [torch.randperm(n, generator=g) for _ in range(2)]  # one generator across flushes
    for s in range(2):
        for k, value in flat[s].items():
            assert torch.equal(runs[0][s][k], value[perms[s]]), k


def test_actor_batch_keys_and_shapes():
    plan = pipe_plan(rollout_epochs=1, collect_transitions=True)
    collector = hooks(plan)[0]
    keys = [key(rank=r, chunk=c) for r in range(2) for c in range(2)]
    out = feed(collector, plan, keys, next_obs={"states": torch.zeros(4, 3)})
    data = out[0].data
    for name in (
        "actions",
        "rewards",
        "dones",
        "advantages",
        "returns",
        "prev_logprobs",
        "prev_values",
        "loss_mask",
        "loss_mask_sum",
        "forward_inputs::action",
        "curr_obs::states",
        "next_obs::states",
    ):
        assert name in data, name
    assert not any(isinstance(v, dict) for v in data.values())
    assert data["advantages"].shape == data["returns"].shape
    assert all(v.shape[0] == plan.micro_batch_size for v in data.values())
    assert data["dones"].shape == (2, 2)  # last boundary row dropped, [mbs, C]


def test_pipeline_advantages_equal_actor_side_functions():
    """Pipeline ActorBatches equal compute_advantages(to_training_batch(pieces)) per actor."""
    common = dict(
        num_sources=3,
        source_batch_size=4,
        num_chunks=2,
        rollout_epochs=1,
        actor_world_size=2,
        num_action_chunks=2,
        action_dim=1,
        gamma=0.9,
        gae_lambda=0.8,
    )
    pipe = make_plan(mode="pipeline", micro_batch_size=4, shuffle=False, **common)
    roll = make_plan(mode="rollout", **common)
    dones = torch.tensor([[F, T], [F, F], [F, F], [T, F]])
    keys = [key(rank=r, chunk=c) for r in range(3) for c in range(2)]
    batches = feed(hooks(pipe)[0], pipe, keys, dones=dones)
    shards = feed(hooks(roll)[0], roll, keys, dones=dones)  # 2 shards of 2 envs per source
    pieces = {0: shards[0:3], 1: shards[3:6]}
    for actor in (0, 1):
        expected = compute_advantages(to_training_batch(pieces[actor], roll), roll)
        rows = concat_rows([b for b in batches if b.actor_rank == actor])
        n = 2 * pipe.actor_width
        for name in ("advantages", "returns", "loss_mask", "rewards"):
            value = expected[name]
            assert torch.allclose(rows[name], value.reshape(n, *value.shape[2:])), name
        assert torch.equal(rows["dones"], expected["dones"][:-1].reshape(n, -1))


# ---------------------------------------------------------------------------------------------
# lerobot mode


def episode_data(done):
    return {
        "chunk_actions": torch.tensor([[1.0, 2.0]]),
        "obs_list": [
            {"states": torch.tensor([[10.0, 0.0]])},
            {"states": torch.tensor([[11.0, 0.0]])},
        ],
        "terminations": torch.tensor([[F, done]]),
        "truncations": torch.tensor([[F, F]]),
        "infos_list": [{}, {}],
    }


def test_lerobot_mode():
    plan = make_plan(mode="lerobot", num_chunks=2, actor_world_size=2, num_action_chunks=2)
    collector, dispatcher, _ = hooks(plan)
    k0, k1 = key(chunk=0), key(chunk=1)
    policy, env = parts(plan, k0, external=True)
    put(collector, policy)
    with pytest.raises(ValueError, match="episode_data"):
        put(collector, env)
    assert not collector.mode.scopes
    assert put(collector, parts(plan, k0, external=True, episode_data=episode_data(False))[1]) == []
    out = feed(collector, plan, [k1], episode_data=episode_data(True))  # inferred policy part
    assert len(out) == plan.shards_per_source == 2
    assert all(isinstance(s, EpisodeShard) for s in out)
    assert [s.shard_index for s in out] == [0, 1]
    (episode,) = out[0].episodes
    assert out[1].episodes == []
    assert [f["action"].tolist() for f in episode] == [[1.0], [2.0], [1.0], [2.0]]
    assert episode[-1]["next.done"] and not episode[0]["next.done"]
    assert [f["frame_index"] for f in episode] == [0, 1, 2, 3]
    assert [dispatcher.route(s, DEFAULT_KEY) for s in out] == ["actor:0", "actor:1"]
    assert not collector.mode.scopes
    # The source's accumulator persists across steps: episode_index keeps counting.
    out = feed(
        collector, plan, [key(step=1, chunk=c) for c in range(2)], episode_data=episode_data(True)
    )
    assert [len(s.episodes) for s in out] == [1, 1]  # episodes[i::shards_per_source]
    assert [s.episodes[0][0]["episode_index"] for s in out] == [1, 2]


def test_lerobot_episode_open_across_steps_is_state_a_journal_keeps():
    """An episode still open when its step's scope flushed holds frames of that step: the
    collector holds state (a durable channel keeps the puts it needs) until the episode ends."""
    plan = make_plan(mode="lerobot", num_chunks=2, num_action_chunks=2)
    collector, _, _ = hooks(plan)
    out = feed(collector, plan, [key(chunk=c) for c in range(2)], episode_data=episode_data(False))
    assert out and all(shard.episodes == [] for shard in out)
    assert not collector.mode.scopes and collector.holds_state()
    out = feed(collector, plan, [key(step=1, chunk=c) for c in range(2)],
               episode_data=episode_data(True))
    # the episode open since step 0 ends in step 1's first chunk; its second chunk is one more
    assert [len(episode) for shard in out for episode in shard.episodes] == [6, 2]
    assert not collector.holds_state()


def test_lerobot_malformed_chunk_fails_its_own_put():
    """A chunk is checked when it comes: a malformed one fails its own put (before, it was
    taken and failed the valid put that completed the scope, every time)."""
    plan = make_plan(mode="lerobot", num_chunks=2, num_action_chunks=2)
    collector, _, _ = hooks(plan)
    bad = dict(episode_data(False), chunk_actions=torch.zeros(1, 5))
    policy, env = parts(plan, key(chunk=0), episode_data=bad)
    put(collector, policy)
    with pytest.raises(ValueError, match="chunk_actions"):
        put(collector, env)
    assert not collector.mode.scopes
    # a value only the frame builds would refuse (states that are not numbers): refused too
    texts = dict(episode_data(False), obs_list=[{"states": np.array([["a", "b"]])}] * 2)
    with pytest.raises(ValueError, match="could not convert string to float"):
        put(collector, parts(plan, key(chunk=0), episode_data=texts)[1])
    assert not collector.mode.scopes
    assert feed(collector, plan, [key(chunk=1)], episode_data=episode_data(True)) == []
    (shard,) = put(collector, parts(plan, key(chunk=0), episode_data=episode_data(False))[1])
    assert [len(episode) for episode in shard.episodes] == [4]
    assert_empty(collector)


def test_lerobot_failed_flush_changes_nothing():
    plan = make_plan(mode="lerobot", num_action_chunks=2)
    collector, _, _ = hooks(plan)
    bad = dict(episode_data(True), chunk_actions=torch.zeros(1, 5))
    policy, env = parts(plan, key(), episode_data=bad)
    put(collector, policy)
    with pytest.raises(ValueError):
        put(collector, env)
    assert not collector.mode.scopes and not collector.mode.accumulators
    (shard,) = put(collector, parts(plan, key(), episode_data=episode_data(True))[1])
    assert len(shard.episodes) == 1 and shard.episodes[0][0]["episode_index"] == 0
