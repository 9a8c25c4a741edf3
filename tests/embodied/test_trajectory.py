"""TrajectoryStep, Trajectory, the accumulator and the output items."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from zchannel.embodied.trajectory import (
    ActorBatch,
    EpisodeShard,
    Trajectory,
    TrajectoryAccumulator,
    TrajectoryStep,
    get_model_weights_id,
)
from zchannel.embodied.types import (
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectorySource,
)

from .conftest import assert_same, roundtrip

T, F = True, False


def key(epoch=0, chunk=0, step=0, rank=0, stage=0):
    return TrajectoryKey(step, epoch, rank, stage, chunk)


def flags(*rows):
    return torch.tensor(rows, dtype=torch.bool)


def golden_parts(k, *, value=0.0, final=5.0, version=7.0):
    """The golden chunk: E=N=B=C=A=1."""
    policy = PolicyPart(
        [TrajectorySource(k, 1, 0)],
        {"states": torch.zeros(1, 2)},
        output=PolicyOutput(
            forward_inputs={"action": torch.tensor([[1.0]])},
            prev_logprobs=torch.tensor([[0.0]]),
            prev_values=torch.tensor([[value]]),
            versions=torch.tensor([[version]]),
        ),
    )
    env = EnvPart(
        [TrajectorySource(k, 1, 0)],
        EnvTransition(
            rewards=torch.tensor([[1.0]]),
            dones=flags([T]),
            truncations=flags([T]),
            terminations=flags([F]),
        ),
        bootstrap_values=torch.tensor([[4.0]]),
        final_prev_values=torch.tensor([[final]]),
        initial_transition=EnvTransition(
            dones=flags([F]), truncations=flags([F]), terminations=flags([F])
        ),
    )
    return policy, env


def golden_step(k, *, collect_prev_infos=True, last=True):
    policy, env = golden_parts(k)
    rewards = env.compute_rewards(
        env_reward_weight=0.0,
        reward_weight=1.0,
        auto_reset=True,
        bootstrap_type="standard",
        gamma=0.5,
    )
    return TrajectoryStep.from_parts(
        policy,
        env,
        rewards=rewards,
        collect_prev_infos=collect_prev_infos,
        collect_transitions=False,
        enable_rlt=False,
        include_final_value=last,
    )


# ---------------------------------------------------------------------------------------------
# TrajectoryStep


def intervention_parts(env_flags, model_flags=None):
    k = key(chunk=1)
    policy = PolicyPart(
        [TrajectorySource(k, 1, 0)],
        {"states": torch.zeros(1, 2)},
        output=PolicyOutput(
            forward_inputs={
                "action": torch.tensor([[1.0, 2.0, 3.0, 4.0]]),
                "model_action": torch.tensor([[1.0, 2.0, 3.0, 4.0]]),
            },
            intervene_flags=model_flags,
        ),
    )
    env = EnvPart(
        [TrajectorySource(k, 1, 0)],
        EnvTransition(
            rewards=torch.zeros(1, 2),
            intervene_actions=torch.tensor([[[9.0, 8.0], [7.0, 6.0]]]),
            intervene_flags=env_flags,
        ),
    )
    return policy, env


def build(policy, env, **kw):
    options = dict(
        rewards=env.transition.rewards,
        collect_prev_infos=True,
        collect_transitions=False,
        enable_rlt=False,
        include_final_value=False,
    )
    options.update(kw)
    return TrajectoryStep.from_parts(policy, env, **options)


def test_env_interventions_replace_actions_and_flags():
    policy, env = intervention_parts(flags([F, T]))
    step = build(policy, env)
    assert step.actions.tolist() == [[1, 2, 7, 6]]
    assert step.intervene_flags.tolist() == [[F, F, T, T]]
    assert step.forward_inputs["action"].tolist() == [[1, 2, 7, 6]]
    assert "model_action" not in step.forward_inputs
    # The parts are never modified.
    assert policy.output.forward_inputs["action"].tolist() == [[1, 2, 3, 4]]
    assert "model_action" in policy.output.forward_inputs


def test_model_flags_overwrite_flags_and_keep_actions():
    """The contract's default precedence: env interventions first, then the model's flags
    overwrite ``intervene_flags`` and leave the executed actions."""
    policy, env = intervention_parts(flags([F, T]), model_flags=flags([T, F]))
    step = build(policy, env)
    assert step.actions.tolist() == [[1, 2, 7, 6]]
    assert step.intervene_flags.tolist() == [[T, T, F, F]]


def test_env_intervention_wins_over_model_flags_with_env_precedence():
    """``intervention_precedence="env"``: where the env reports an intervention its flags replace
    the model's for the chunk (what was executed wins, as in RLinf); the model's flags stand
    where the env reports none."""
    policy, env = intervention_parts(flags([F, T]), model_flags=flags([T, F]))
    step = build(policy, env, intervention_precedence="env")
    assert step.actions.tolist() == [[1, 2, 7, 6]]
    assert step.intervene_flags.tolist() == [[F, F, T, T]]
    policy, env = intervention_parts(flags([F, T]), model_flags=flags([T, F]))
    env.transition.intervene_actions = env.transition.intervene_flags = None
    step = build(policy, env, intervention_precedence="env")
    assert step.actions.tolist() == [[1, 2, 3, 4]]
    assert step.intervene_flags.tolist() == [[T, T, F, F]]


def test_env_interventions_with_chunk_flag_and_flat_actions():
    policy, env = intervention_parts(torch.tensor([True]))
    env.transition.intervene_actions = torch.tensor([[9.0, 8.0, 7.0, 6.0]])
    step = build(policy, env)
    assert step.actions.tolist() == [[9, 8, 7, 6]]
    assert step.intervene_flags.tolist() == [[T, T, T, T]]


def test_interventions_need_flags():
    policy, env = intervention_parts(None)
    with pytest.raises(ValueError, match="intervene_flags"):
        build(policy, env)


def test_default_intervene_flags_are_false():
    step = golden_step(key())
    assert step.intervene_flags.dtype == torch.bool
    assert step.intervene_flags.tolist() == [[F]]


def rlt_parts(next_rlt=True, drop=None):
    k = key(chunk=1)
    forward_inputs = {
        "action": torch.zeros(2, 4),
        "z_rl": torch.ones(2, 3),
        "proprio": torch.ones(2, 1),
        "ref_chunk": torch.zeros(2, 6),
    }
    if drop:
        del forward_inputs[drop]
    policy = PolicyPart(
        [TrajectorySource(k, 2, 0)],
        {"states": torch.zeros(2, 2)},
        output=PolicyOutput(forward_inputs=forward_inputs),
    )
    env = EnvPart(
        [TrajectorySource(k, 2, 0)],
        EnvTransition(
            rewards=torch.zeros(2, 2),
            intervene_actions=torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]]),
            intervene_flags=flags([T, F], [F, T]),
        ),
        next_rlt_obs=(
            {
                "z_rl": torch.full((2, 3), 2.0),
                "proprio": torch.zeros(2, 1),
                "ref_chunk": torch.ones(2, 6),
                "task_descriptions": ["a", "b"],
            }
            if next_rlt
            else None
        ),
    )
    return policy, env


def test_rlt_features_with_interventions():
    policy, env = rlt_parts()
    step = build(policy, env, enable_rlt=True)
    assert step.curr_obs["ref_chunk"].tolist() == [[1, 2, 0, 0, 0, 0], [0, 0, 7, 8, 0, 0]]
    assert set(step.curr_obs) == {"z_rl", "proprio", "ref_chunk"}
    assert set(step.next_obs) == {"z_rl", "proprio", "ref_chunk"}
    # Deep copies: the policy's forward inputs are unchanged.
    assert policy.output.forward_inputs["ref_chunk"].abs().sum() == 0
    assert step.curr_obs["z_rl"] is not policy.output.forward_inputs["z_rl"]


@pytest.mark.parametrize("drop", ["z_rl", "proprio", "ref_chunk"])
def test_rlt_missing_features_raise(drop):
    policy, env = rlt_parts(drop=drop)
    with pytest.raises(ValueError, match=drop):
        build(policy, env, enable_rlt=True)


def test_rlt_missing_next_features_raise():
    policy, env = rlt_parts(next_rlt=False)
    with pytest.raises(ValueError, match="next_rlt_obs"):
        build(policy, env, enable_rlt=True)


def test_collect_transitions_stores_obs_without_task_descriptions():
    policy, env = golden_parts(key())
    policy.obs = {"states": torch.ones(1, 2), "task_descriptions": ["pick"]}
    env.next_obs = {"states": torch.full((1, 2), 3.0), "task_descriptions": ["pick"]}
    step = build(policy, env, collect_transitions=True)
    assert set(step.curr_obs) == {"states"} and set(step.next_obs) == {"states"}
    assert step.next_obs["states"].tolist() == [[3.0, 3.0]]
    assert "task_descriptions" in policy.obs  # the part keeps its own dict

    env.next_obs = None
    with pytest.raises(ValueError, match="next_obs"):
        build(policy, env, collect_transitions=True)
    assert build(policy, env).curr_obs is None


def test_external_policy_part_raises():
    k = key()
    policy = PolicyPart([TrajectorySource(k, 1, 0)], {}, external_actions=torch.ones(1, 1))
    _, env = golden_parts(k)
    with pytest.raises(ValueError, match="inferred"):
        build(policy, env)


def test_collect_prev_infos_false_drops_values():
    step = golden_step(key(), collect_prev_infos=False)
    assert step.prev_logprobs is None and step.prev_values is None
    assert step.final_prev_values is None
    assert step.versions is not None


def test_final_value_only_on_last_chunk():
    assert golden_step(key(), last=False).final_prev_values is None
    assert golden_step(key(), last=True).final_prev_values.tolist() == [[5.0]]


def test_add_reward():
    step = golden_step(key())
    before = step.rewards
    step.add_reward(0, 2.0)
    assert step.rewards.tolist() == [[5.0]]
    assert before.tolist() == [[3.0]]
    with pytest.raises(ValueError):
        TrajectoryStep(actions=torch.zeros(1, 1)).add_reward(0, 1.0)


def test_step_tensors_are_cpu_contiguous_detached():
    base = torch.arange(12.0, requires_grad=True).reshape(3, 4)
    step = TrajectoryStep(
        actions=base.t() * 1.0,
        forward_inputs={"nested": {"x": (base * 2).t()}},
        dones=torch.zeros(4, 1),
    )
    for t in (step.actions, step.forward_inputs["nested"]["x"], step.dones):
        assert t.is_contiguous() and t.device.type == "cpu" and not t.requires_grad
    assert step.dones.dtype == torch.bool


# ---------------------------------------------------------------------------------------------
# Trajectory


def test_golden_trajectory():
    traj = Trajectory.from_steps([golden_step(key())])
    assert traj.actions.tolist() == [[[1.0]]]
    assert traj.rewards.tolist() == [[[3.0]]]
    assert traj.prev_values.tolist() == [[[0.0]], [[5.0]]]
    assert traj.dones.tolist() == [[[F]], [[T]]]
    assert traj.truncations.tolist() == [[[F]], [[T]]]
    assert traj.terminations.tolist() == [[[F]], [[F]]]
    assert traj.versions.tolist() == [[[7.0]]]
    assert traj.prev_logprobs.tolist() == [[[0.0]]]
    assert traj.forward_inputs["action"].tolist() == [[[1.0]]]
    assert traj.model_weights_id == get_model_weights_id(traj.versions)


def test_two_epochs_boundary_rows():
    steps = [golden_step(key(epoch=e)) for e in range(2)]
    traj = Trajectory.from_steps(steps)
    assert traj.dones.reshape(-1).tolist() == [F, T, F, T]
    assert traj.prev_values.reshape(-1).tolist() == [0, 5, 0, 5]
    assert traj.actions.shape == (2, 1, 1)


def test_collect_prev_infos_false_trajectory():
    traj = Trajectory.from_steps([golden_step(key(), collect_prev_infos=False)])
    assert traj.prev_logprobs is None and traj.prev_values is None


def numbered_step(k, B=3, C=2, A=1, N=3):
    """A step whose values encode (epoch, chunk, env)."""
    tag = 100 * k.epoch_id + 10 * k.chunk_id
    cols = torch.arange(B, dtype=torch.float32).reshape(B, 1)
    return TrajectoryStep(
        actions=(tag + cols).expand(B, C * A),
        prev_values=(tag + cols),
        versions=torch.full((B, C * A), 3.0),
        rewards=(tag + cols).expand(B, C),
        dones=torch.zeros(B, C, dtype=torch.bool),
        truncations=torch.zeros(B, C, dtype=torch.bool),
        terminations=torch.zeros(B, C, dtype=torch.bool),
        forward_inputs={"action": (tag + cols).expand(B, C * A), "obs": {"x": tag + cols}},
        initial_dones=torch.zeros(B, C, dtype=torch.bool) if k.chunk_id == 0 else None,
        initial_truncations=torch.zeros(B, C, dtype=torch.bool) if k.chunk_id == 0 else None,
        initial_terminations=torch.zeros(B, C, dtype=torch.bool) if k.chunk_id == 0 else None,
        final_prev_values=(tag + 9 + cols) if k.chunk_id == N - 1 else None,
    )


def test_accumulator_sorts_by_epoch_and_chunk():
    keys = [key(epoch=e, chunk=c) for e in range(2) for c in range(3)]
    ordered = TrajectoryAccumulator()
    for k in keys:
        ordered.append(k, numbered_step(k))
    shuffled = TrajectoryAccumulator()
    mixed = list(keys)
    random.Random(3).shuffle(mixed)
    assert mixed != keys
    for k in mixed:
        shuffled.append(k, numbered_step(k))
    a, b = ordered.to_trajectory(), shuffled.to_trajectory()
    assert_same(a, b)
    assert a.actions[:, 0, 0].tolist() == [0, 10, 20, 100, 110, 120]
    assert a.prev_values[:, 0, 0].tolist() == [0, 10, 20, 29, 100, 110, 120, 129]
    assert a.dones.shape == (8, 3, 2)
    assert a.forward_inputs["obs"]["x"].shape == (6, 3, 1)


def test_accumulator_history_rewards_on_copies_any_order():
    """The history-reward example: N=3, B=2, C=1 gives [[5,1],[4,6],[4,6]] whatever the order."""
    outputs = [[1.0, 1.0], [0.0, 0.0], [4.0, 6.0]]
    steps = {}
    for c in range(3):
        k = key(chunk=c)
        steps[k] = TrajectoryStep(
            actions=torch.zeros(2, 1), rewards=torch.tensor(outputs[c]).reshape(2, 1)
        )
    extras = {c: (torch.tensor(outputs[c]).reshape(2, 1), None) for c in range(3)}
    extras[2] = (extras[2][0], [3, 2])
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        acc = TrajectoryAccumulator()
        for c in order:
            k = key(chunk=c)
            acc.append(
                k, steps[k], reward_model_output=extras[c][0], reward_assign_lengths=extras[c][1]
            )
        traj = acc.to_trajectory(reward_weight=1.0)
        assert traj.rewards[:, :, 0].tolist() == [[5, 1], [4, 6], [4, 6]]
    # The stored steps keep their own rewards.
    assert steps[key(chunk=0)].rewards.reshape(-1).tolist() == [1, 1]


def test_accumulator_rejects_bad_history_data():
    acc = TrajectoryAccumulator()
    with pytest.raises(ValueError, match="rewards are None"):
        acc.append(
            key(),
            TrajectoryStep(actions=torch.zeros(1, 1)),
            reward_model_output=torch.zeros(1, 1),
            reward_assign_lengths=[1],
        )
    step = TrajectoryStep(actions=torch.zeros(1, 1), rewards=torch.zeros(1, 1))
    with pytest.raises(ValueError, match="reward_model_output"):
        acc.append(key(), step, reward_assign_lengths=[1])
    with pytest.raises(ValueError, match="entries"):
        acc.append(key(), step, reward_model_output=torch.zeros(1, 1), reward_assign_lengths=[1, 2])
    assert len(acc) == 0


def split_example():
    return Trajectory(
        model_weights_id="w",
        max_episode_length=9,
        actions=torch.arange(4.0).reshape(2, 2, 1),
        dones=torch.tensor([[[F], [T]], [[T], [F]], [[F], [F]]]),
        forward_inputs={"action": torch.arange(4.0).reshape(2, 2, 1), "o": {"n": np.ones((2, 2))}},
    )


def test_split_and_to_batch_example():
    traj = split_example()
    shards = traj.split(2)
    assert [s.actions.shape for s in shards] == [(2, 1, 1)] * 2
    assert [s.dones.shape for s in shards] == [(3, 1, 1)] * 2
    assert all(s.actions.is_contiguous() for s in shards)
    assert all(s.model_weights_id == "w" and s.max_episode_length == 9 for s in shards)
    assert shards[1].forward_inputs["o"]["n"].shape == (2, 1)
    batch = Trajectory.to_batch(shards)
    assert torch.equal(batch["actions"], traj.actions)
    assert torch.equal(batch["dones"], traj.dones)
    assert torch.equal(batch["forward_inputs"]["action"], traj.forward_inputs["action"])
    assert np.array_equal(batch["forward_inputs"]["o"]["n"], traj.forward_inputs["o"]["n"])
    assert "model_weights_id" not in batch and "rewards" not in batch
    assert [s.batch_size for s in traj.split([2, 0])] == [2, 0]


def test_split_rejects_bad_sizes():
    traj = split_example()
    with pytest.raises(ValueError):
        traj.split(3)
    with pytest.raises(ValueError):
        traj.split([1, 2])
    with pytest.raises(ValueError):
        Trajectory().split(1)
    with pytest.raises(ValueError):
        Trajectory.to_batch([])


def test_to_batch_union_of_dict_keys():
    a = Trajectory(actions=torch.zeros(1, 1, 1), curr_obs={"x": torch.zeros(1, 1, 2)})
    b = Trajectory(
        actions=torch.ones(1, 2, 1), curr_obs={"x": torch.ones(1, 2, 2), "y": torch.ones(1, 2)}
    )
    batch = Trajectory.to_batch([a, b])
    assert batch["actions"].shape == (1, 3, 1)
    assert batch["curr_obs"]["x"].shape == (1, 3, 2)
    assert batch["curr_obs"]["y"].shape == (1, 2)


def test_model_weights_id():
    v = torch.full((2, 1, 3), 7.0)
    assert get_model_weights_id(v) == get_model_weights_id(v.clone())
    assert get_model_weights_id(v) != get_model_weights_id(v + 1)
    assert get_model_weights_id(None) == get_model_weights_id(torch.zeros(1))
    assert Trajectory.from_steps([TrajectoryStep(actions=torch.zeros(1, 1))]).model_weights_id == (
        get_model_weights_id(None)
    )


def test_extract_intervene_traj():
    # E=1, N=2, B=2, D=2: env 0 intervened at chunk 1, env 1 never.
    flags_ = torch.zeros(2, 2, 2, dtype=torch.bool)
    flags_[1, 0, 1] = True
    traj = Trajectory(
        actions=torch.arange(8.0).reshape(2, 2, 2),
        intervene_flags=flags_,
        dones=torch.arange(6).reshape(3, 2, 1) % 2 == 0,
        prev_values=torch.arange(6.0).reshape(3, 2, 1),
        forward_inputs={"action": torch.arange(8.0).reshape(2, 2, 2)},
    )
    assert Trajectory(actions=torch.zeros(1, 1, 1)).extract_intervene_traj() is None
    (out,) = traj.extract_intervene_traj("any")
    assert out.actions.tolist() == [[[4.0, 5.0]]]
    assert out.forward_inputs["action"].tolist() == [[[4.0, 5.0]]]
    # boundary rows: row 0 (epoch boundary) and row 2 (closes chunk 1)
    assert out.dones.reshape(-1).tolist() == [T, T]
    # values: row 1 (before chunk 1) and the final row 2
    assert out.prev_values.reshape(-1).tolist() == [2.0, 4.0]
    assert traj.extract_intervene_traj("all") == []
    with pytest.raises(ValueError):
        traj.extract_intervene_traj("some")


# ---------------------------------------------------------------------------------------------
# Wire round trips (acceptance 4, through the codec)


def test_trajectory_step_and_trajectory_roundtrip():
    step = golden_step(key())
    step.curr_obs = {"img": torch.zeros(1, 2, 2, dtype=torch.uint8)}
    assert_same(roundtrip(step), step)
    traj = Trajectory.from_steps([golden_step(key(epoch=e)) for e in range(2)])
    traj.curr_obs = {"big": torch.randn(2, 1, 20000), "arr": np.arange(4).reshape(2, 1, 2)}
    back = roundtrip(traj)
    assert_same(back, traj)
    assert back.model_weights_id == traj.model_weights_id


def test_actor_batch_and_episode_shard_roundtrip():
    batch = ActorBatch(
        actor_rank=1,
        step_id=2,
        epoch_id=0,
        micro_batch_index=3,
        data={"actions": torch.randn(4, 2).t(), "forward_inputs::action": torch.ones(2, 2)},
    )
    assert batch.data["actions"].is_contiguous()
    assert_same(roundtrip(batch), batch)
    frame = {
        "observation.state": np.zeros(3, np.float32),
        "observation.images.main": np.zeros((2, 2, 3), np.uint8),
        "action": np.ones(2, np.float32),
        "next.reward": 1.0,
        "next.done": True,
        "next.success": False,
        "task": "pick",
        "intervention": False,
        "segment_id": 0,
        "frame_index": 0,
        "episode_index": 4,
        "timestamp": 0.0,
    }
    shard = EpisodeShard(step_id=1, env_rank=0, stage_id=0, shard_index=1, episodes=[[frame]])
    assert_same(roundtrip(shard), shard)
    empty = EpisodeShard(step_id=1, env_rank=0, stage_id=0, shard_index=0, episodes=[])
    assert_same(roundtrip(empty), empty)


def test_producer_types_roundtrip():
    policy, env = golden_parts(key())
    env = dataclasses.replace(
        env,
        transition=env.transition.with_trajectory_data(
            reward_model_output=torch.ones(1, 1),
            reward_assign_lengths=[1],
            episode_data={"obs_list": [{"states": torch.zeros(1, 2)}], "infos_list": [{}]},
        ),
    )
    for obj in (policy, env, key(), TrajectorySource(key(), 1, 0), policy.output, env.transition):
        assert_same(roundtrip(obj), obj)


def test_trajectory_tensors_are_cpu_contiguous_detached():
    base = torch.randn(2, 3, 4, requires_grad=True)
    traj = Trajectory(
        actions=base.transpose(0, 1) * 1.0, curr_obs={"x": {"y": base.transpose(1, 2)}}
    )
    for t in (traj.actions, traj.curr_obs["x"]["y"]):
        assert t.is_contiguous() and t.device.type == "cpu" and not t.requires_grad


PUBLIC_API = """TrajectoryPlan TrajectoryKey TrajectorySource SourceID EnvTransition EnvOutput EnvPart
PolicyOutput PolicyPart PolicyInput TrajectoryPart TrajectoryStep Trajectory ActorBatch EpisodeShard
ChunkJoiner JoinedChunk TrajectoryCollector TrajectoryDispatcher LeRobotEpisodeAccumulator
split_batch_value merge_batch_values split_episode_data merge_episode_data get_model_weights_id
compute_loss_mask to_training_batch compute_advantages""".split()


def test_collector_module_import_registers_every_type():
    """The entry-point target alone registers every transport type and both hooks."""
    code = (
        "import zchannel.embodied.collector\n"
        "from zchannel.broker.wire.classtags import TAG_TO_CLS\n"
        "from zchannel.hooks import Collector, Dispatcher, registered\n"
        "print(sorted(t for t in TAG_TO_CLS if t.startswith('zchannel.embodied.')))\n"
        "assert 'embodied_trajectory' in registered(Collector)\n"
        "assert 'embodied_trajectory' in registered(Dispatcher)\n"
    )
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    names = {
        "TrajectoryKey", "TrajectorySource", "EnvTransition", "EnvOutput", "PolicyOutput",
        "PolicyPart", "EnvPart", "PolicyInput", "Trajectory", "ActorBatch", "EpisodeShard",
        "TrajectoryStep",
    }  # fmt: skip
    assert result.stdout.strip() == str(sorted(f"zchannel.embodied.{n}" for n in names))


def test_package_exports_public_api():
    import zchannel.embodied as package

    if getattr(package, "__file__", None) is None:
        pytest.skip(
            "zchannel.embodied resolves to a namespace package: the editable install predates "
            "embodied/__init__.py; re-run `pip install -e .`"
        )
    assert set(PUBLIC_API) <= set(package.__all__)
    for name in PUBLIC_API:
        assert getattr(package, name) is not None


def test_versions_are_float32_in_every_type():
    """``versions`` is float32 on every type, whatever dtype it is given in."""
    step = TrajectoryStep(actions=torch.zeros(1, 1), versions=torch.ones(1, 1, dtype=torch.int32))
    traj = Trajectory(actions=torch.zeros(1, 1, 1),
                      versions=torch.ones(1, 1, 1, dtype=torch.float64))
    out = PolicyOutput(forward_inputs={}, versions=torch.ones(1, 1, dtype=torch.int64))
    assert step.versions.dtype == traj.versions.dtype == out.versions.dtype == torch.float32
    assert step.versions.tolist() == [[1.0]] and traj.versions.tolist() == [[[1.0]]]
    assert TrajectoryStep(actions=torch.zeros(1, 1)).versions is None
