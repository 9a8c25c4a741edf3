"""zchannel.embodied through a real broker process, with producer and actor processes."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest
import torch
from cluster_util import until_available
from zchannel.broker import Channel, HookError
from zchannel.embodied import PolicyPart, Trajectory, TrajectorySource

from embodied.test_collector import episode_data, hooks, key, make_plan, parts, put

pytestmark = pytest.mark.timeout(120)

PIPE = dict(
    mode="pipeline", num_sources=2, source_batch_size=4, num_chunks=2, rollout_epochs=1,
    actor_world_size=2, num_action_chunks=2, action_dim=1, micro_batch_size=2, gamma=0.9,
    gae_lambda=0.8, seed=7,
)

PRODUCER = """
    import sys
    from embodied.test_collector import key, make_plan, parts
    from zchannel.broker import Channel
    import zchannel.embodied  # registers the transport types
    plan = make_plan(**__import__("json").loads(sys.argv[2]))
    ch = Channel.connect(sys.argv[1])
    rank = int(sys.argv[3])
    halves = []
    for c in range(plan.num_chunks):
        policy, env = parts(plan, key(rank=rank, chunk=c))
        halves += [env, policy] if c % 2 else [policy, env]  # interleaved, env first sometimes
    for p in reversed(halves):  # out of order
        ch.put(p)
    ch.close()
    print("done", flush=True)
"""

ACTOR = """
    import sys, json
    import zchannel.embodied
    from zchannel.broker import Channel
    ch = Channel.connect(sys.argv[1], identity=sys.argv[2])
    out = []
    for _ in range(int(sys.argv[3])):
        item = ch.get(timeout=60)
        out.append({"type": type(item).__name__,
                    "rank": getattr(item, "actor_rank", None),
                    "mb": getattr(item, "micro_batch_index", None),
                    "adv": float(item.data["advantages"].double().sum()) if hasattr(item, "data")
                           else None,
                    "cols": int(item.actions.shape[1]) if hasattr(item, "actions") else None})
    print(json.dumps(out), flush=True)
    ch.close()
"""


def _expected_pipeline(plan):
    collector = hooks(plan)[0]
    out = []
    for r in range(plan.num_sources):
        for c in range(plan.num_chunks):
            policy, env = parts(plan, key(rank=r, chunk=c))
            out += put(collector, policy) + put(collector, env)
    return out


def test_pipeline_actor_batches_through_broker(workers, channels):
    plan = make_plan(**PIPE)
    ch = Channel.create("traj", collector="embodied_trajectory", dispatcher="embodied_trajectory",
                        producers=["rollout"], consumers={"actor": 2}, options=plan.to_options())
    channels.append(ch)
    expected = _expected_pipeline(plan)
    per_actor = plan.num_chunks * plan.actor_width // plan.micro_batch_size
    actors = [workers.start(ACTOR, ch.address, f"actor:{a}", str(per_actor)) for a in range(2)]
    producers = [workers.start(PRODUCER, ch.address, json.dumps(PIPE), str(r)) for r in range(2)]
    for p in producers:
        assert workers.finish(p).strip() == "done"
    for a, proc in enumerate(actors):
        got = json.loads(workers.finish(proc))
        assert all(g["type"] == "ActorBatch" and g["rank"] == a for g in got)
        assert [g["mb"] for g in got] == list(range(per_actor))
        mine = [b for b in expected if b.actor_rank == a]
        for g, e in zip(got, mine, strict=True):
            assert g["adv"] == pytest.approx(float(e.data["advantages"].double().sum()), abs=1e-6)
    stats = ch.stats()
    assert stats["collector_stats"]  # the collector reports its state to `zchannel stat`


def test_rollout_trajectories_dealt_least_loaded(workers, channels):
    options = dict(PIPE, mode="rollout", micro_batch_size=None)
    plan = make_plan(**options)
    ch = trajectory_channel(channels, "trajroll", plan, actors=2)
    producers = [workers.start(PRODUCER, ch.address, json.dumps(options), str(r)) for r in range(2)]
    for p in producers:
        assert workers.finish(p).strip() == "done"
    # 2 sources x shards_per_source(1) = 2 trajectories, one per actor (least loaded)
    assert ch.stats()["keys"]["default_queue"]["private"] == {"actor:0": 1, "actor:1": 1}
    actors = [workers.start(ACTOR, ch.address, f"actor:{a}", "1") for a in range(2)]
    for proc in actors:
        got = json.loads(workers.finish(proc))
        assert got[0]["type"] == "Trajectory" and got[0]["cols"] == plan.source_batch_size


def test_failed_put_reaches_putter_as_hook_error(channels):
    plan = make_plan(**PIPE)
    ch = trajectory_channel(channels, "trajbad", plan, actors=2)
    bad = PolicyPart([TrajectorySource(key(epoch=5), 4, 0)], {"s": torch.zeros(4)},
                     external_actions=torch.zeros(4, 2))
    with pytest.raises(HookError) as info:
        ch.put(bad)
    assert info.value.exc_type == "ValueError"
    with pytest.raises(HookError):
        ch.put("not a trajectory part")
    policy, env = parts(plan, key(rank=0, chunk=0))
    ch.put(policy)  # the broker carries on


def test_lerobot_unfinished_episode_carries_across_steps(channels):
    plan = make_plan(mode="lerobot", num_chunks=2, actor_world_size=2, num_action_chunks=2)
    ch = trajectory_channel(channels, "trajlerobot", plan, actors=2)
    actors = [Channel.connect("trajlerobot", identity=f"actor:{a}") for a in range(2)]
    try:
        for step, last_done in ((0, False), (1, True)):
            for c in range(plan.num_chunks):
                done = last_done and c == plan.num_chunks - 1
                policy, env = parts(plan, key(step=step, chunk=c), external=True,
                                    episode_data=episode_data(done))
                ch.put(env)
                ch.put(policy)
            shards = [actor.get(timeout=10) for actor in actors]
            assert [type(s).__name__ for s in shards] == ["EpisodeShard", "EpisodeShard"]
            assert all(s.step_id == step for s in shards)
            episodes = [e for s in shards for e in s.episodes]
            if step == 0:
                assert episodes == []  # not finished yet: it stays in the broker's accumulator
            else:
                (episode,) = episodes  # 2 steps x 2 chunks x 2 frames, in one episode
                assert [f["frame_index"] for f in episode] == list(range(8))
                assert episode[-1]["next.done"] and episode[0]["episode_index"] == 0
    finally:
        for actor in actors:
            actor.close()


def test_fragment_outside_the_batch_waits_then_is_refused_as_non_contiguous(channels):
    # fragments whose sizes sum below B wait; at B their offsets must tile [0, B)
    plan = make_plan(mode="rollout", source_batch_size=2)
    ch = trajectory_channel(channels, "trajfrag", plan, actors=1)
    policy, env = parts(plan, key())
    head, _ = policy.split([1, 1])
    k = policy.sources[0].key
    outside = PolicyPart([TrajectorySource(k, 1, 2)], {"states": policy.obs["states"][1:]},
                         policy.output.split([1, 1])[1])
    ch.put(outside)  # total 1 < B: waits
    with pytest.raises(HookError, match="Non-contiguous trajectory fragments") as info:
        ch.put(head)  # total B, offsets [0, 2]
    assert info.value.exc_type == "ValueError"
    ch.put(env)
    ch.put(policy)  # a whole part still joins: the broker carries on and nothing was lost
    actor = Channel.connect("trajfrag", identity="actor:0")
    channels.append(actor)
    assert isinstance(actor.get(timeout=30), Trajectory)


def test_a_value_of_the_wrong_shape_is_refused_at_the_put(channels):
    # values are [B, 1] (per chunk) or [B, C] (per action): another shape is refused when put,
    # naming the field, and nothing the channel held is lost
    plan = make_plan(mode="rollout", source_batch_size=2, num_chunks=1, num_action_chunks=2)
    ch = trajectory_channel(channels, "trajvalues", plan, actors=1)
    policy, env = parts(plan, key())
    wide = dataclasses.replace(policy.output, prev_values=torch.zeros(2, 3))
    with pytest.raises(HookError, match="output.prev_values") as info:
        ch.put(PolicyPart(policy.sources, policy.obs, wide))
    assert info.value.exc_type == "ValueError" and "[2, 1] or [2, 2]" in str(info.value)
    flat = dataclasses.replace(env, final_prev_values=torch.zeros(2))
    with pytest.raises(HookError, match="final_prev_values"):
        ch.put(flat)
    ch.put(env)
    ch.put(policy)
    actor = Channel.connect("trajvalues", identity="actor:0")
    channels.append(actor)
    assert isinstance(actor.get(timeout=30), Trajectory)


def test_a_lerobot_episode_open_across_steps_survives_a_broker_crash(channels, tmp_path):
    """LeRobot mode on a durable channel: an episode open when its first step flushed, the
    broker SIGKILLed, the episode ended after the restart -- the shard holds all its frames,
    those of the step before the crash too (they are rebuilt from the journaled puts)."""
    plan = make_plan(mode="lerobot", num_chunks=2, num_action_chunks=2)
    ch, actor = _durable_lerobot(channels, "trajcrash", plan, tmp_path)
    _open_step(ch, actor, plan, 0)
    assert ch.stats()["journal"]["collector_inputs"] == 4  # the open episode's puts
    # the episode open since step 0 (4 frames before the crash) ends in step 1's first chunk
    assert _crash_and_end(ch, actor, plan, 1) == [[0, 1], [0, 1, 2, 3, 4, 5]]
    assert ch.stats()["journal"]["collector_inputs"] == 0  # the episode ended: none kept


def test_a_lerobot_episode_longer_than_a_snapshot_comes_back_from_the_state(channels, tmp_path):
    """An episode open over many training steps keeps the LeRobot collector holding state:
    the journal writes the collector's state (``state_dict``) instead of keeping every put, and
    after a SIGKILL the restarted broker loads it -- the episode ends with all its frames."""
    plan = make_plan(mode="lerobot", num_chunks=2, num_action_chunks=2)
    ch, actor = _durable_lerobot(channels, "trajstate", plan, tmp_path)
    big = {"states": torch.zeros(1, 16384)}  # 64 KiB per env part: a state every ~32 steps
    steps = 0
    while ch.stats()["journal"]["collector_states"] < 2:
        _open_step(ch, actor, plan, steps, next_obs=big)
        steps += 1
        assert steps < 200, ch.stats()["journal"]
    journal = ch.stats()["journal"]
    assert journal["collector_inputs"] < 4 * steps // 2, journal  # not every put since step 0
    assert _crash_and_end(ch, actor, plan, steps) == [[0, 1], list(range(4 * steps + 2))]


def _durable_lerobot(channels: list, name: str, plan, tmp_path) -> tuple[Channel, Channel]:
    """A durable trajectory channel ``name`` of ``plan`` and its one actor's handle."""
    ch = Channel.create(name, collector="embodied_trajectory", dispatcher="embodied_trajectory",
                        consumers={"actor": 1}, options=plan.to_options(),
                        journal=tmp_path / "j")
    channels.append(ch)
    actor = Channel.connect(name, identity="actor:0")
    channels.append(actor)
    return ch, actor


def _open_step(ch: Channel, actor: Channel, plan, step: int, **kw) -> None:
    """Put the chunks of ``step`` (no episode ends) and take its shards (no episode in them)."""
    for c in range(2):
        for part in parts(plan, key(step=step, chunk=c), episode_data=episode_data(False), **kw):
            ch.put(part)
    assert all(actor.get(timeout=30).episodes == [] for _ in range(plan.shards_per_source))


def _crash_and_end(ch: Channel, actor: Channel, plan, step: int) -> list[list[int]]:
    """SIGKILL the broker, put the chunks of ``step`` (an episode ends in each), and return the
    frame indexes of the episodes its shards hold, shortest first."""
    os.kill(ch.stats()["pid"], signal.SIGKILL)
    for c in range(2):
        for part in parts(plan, key(step=step, chunk=c), episode_data=episode_data(True)):
            until_available(ch, lambda part=part: ch.put(part, timeout=30))
    shards = [until_available(actor, lambda: actor.get(timeout=30))
              for _ in range(plan.shards_per_source)]
    episodes = sorted((episode for shard in shards for episode in shard.episodes), key=len)
    return [[frame["frame_index"] for frame in episode] for episode in episodes]


def trajectory_channel(channels: list, name: str, plan, actors: int) -> Channel:
    """A channel ``name`` with the trajectory hooks of ``plan`` dealing to ``actors`` actors
    (shut down by the ``channels`` fixture)."""
    ch = Channel.create(name, collector="embodied_trajectory", dispatcher="embodied_trajectory",
                        consumers={"actor": actors}, options=plan.to_options())
    channels.append(ch)
    return ch

