"""Transport types, batch helpers and rewards."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from zchannel.broker.wire.codec import encode
from zchannel.embodied.batch import (
    merge_batch_values,
    merge_episode_data,
    split_batch_value,
    split_episode_data,
)
from zchannel.embodied.types import (
    EnvOutput,
    EnvPart,
    EnvTransition,
    PolicyInput,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectoryPart,
    TrajectorySource,
    assign_history_rewards,
)

from .conftest import assert_same, roundtrip

K0 = TrajectoryKey(0, 0, 0, 0, 0)
K1 = TrajectoryKey(0, 0, 0, 0, 1)
T, F = True, False


def flags(rows):
    return torch.tensor(rows, dtype=torch.bool)


def transition(B=2, C=2, seed=0, **extra):
    g = torch.Generator().manual_seed(seed)
    return EnvTransition(
        rewards=torch.rand(B, C, generator=g),
        dones=torch.zeros(B, C, dtype=torch.bool),
        terminations=torch.zeros(B, C, dtype=torch.bool),
        truncations=torch.zeros(B, C, dtype=torch.bool),
        **extra,
    )


def policy_output(B=2, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return PolicyOutput(
        forward_inputs={
            "action": torch.rand(B, D, generator=g),
            "tokens": torch.arange(B * 3).view(B, 3),
        },
        prev_logprobs=torch.rand(B, D, generator=g),
        prev_values=torch.rand(B, 1, generator=g),
        versions=torch.full((B, D), 3.0),
    )


# -- identity (checklist 6) -------------------------------------------------------------------


def test_key_is_frozen_hashable_and_positional():
    key = TrajectoryKey(1, 2, 3, 4, 5)
    assert (key.step_id, key.epoch_id, key.env_rank, key.stage_id, key.chunk_id) == (1, 2, 3, 4, 5)
    assert key.source == (3, 4)
    assert {key: 1}[TrajectoryKey(1, 2, 3, 4, 5)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.chunk_id = 0  # type: ignore[misc]


def test_source_split_and_merge_example():
    sources = [TrajectorySource(K0, 2, 0), TrajectorySource(K1, 2, 0)]
    shards = TrajectorySource.split(sources, [1, 3])
    assert shards == [
        [TrajectorySource(K0, 1, 0)],
        [TrajectorySource(K0, 1, 1), TrajectorySource(K1, 2, 0)],
    ]
    assert TrajectorySource.merge(shards) == sources


def test_source_split_respects_offsets_and_empty_sources():
    shards = TrajectorySource.split([TrajectorySource(K0, 3, 2)], [2, 1])
    assert shards == [[TrajectorySource(K0, 2, 2)], [TrajectorySource(K0, 1, 4)]]
    assert TrajectorySource.split([], [2, 3]) == [[], []]


def test_source_split_rejects_mismatched_sums():
    with pytest.raises(ValueError, match="Source sizes do not match"):
        TrajectorySource.split([TrajectorySource(K0, 2)], [1, 2])


def test_source_merge_keeps_non_contiguous_or_foreign_neighbours():
    a, b = TrajectorySource(K0, 1, 0), TrajectorySource(K0, 1, 2)
    assert TrajectorySource.merge([[a], [b]]) == [a, b]
    c = TrajectorySource(K1, 1, 1)
    assert TrajectorySource.merge([[a, c]]) == [a, c]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=5), st.data())
def test_source_split_merge_round_trip(spec, data):
    sources = [
        TrajectorySource(TrajectoryKey(0, 0, 0, 0, i), size, off)
        for i, (off, size) in enumerate(spec)
    ]
    total = sum(s.size for s in sources)
    cuts = sorted(data.draw(st.lists(st.integers(0, total), max_size=4)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    shards = TrajectorySource.split(sources, sizes)
    assert [sum(s.size for s in shard) for shard in shards] == sizes
    assert TrajectorySource.merge(shards) == sources


# -- batch helpers (checklist 7, 8) -----------------------------------------------------------


def test_scalars_repeat_and_survive_split_merge():
    info = {"record_reset": True, "x": torch.arange(3)}
    shards = split_batch_value(info, [1, 2])
    assert [s["record_reset"] for s in shards] == [True, True]
    assert shards[0]["x"].tolist() == [0] and shards[1]["x"].tolist() == [1, 2]
    merged = merge_batch_values(shards)
    assert merged["record_reset"] is True
    assert merged["x"].tolist() == [0, 1, 2]


def test_conflicting_scalars_raise():
    with pytest.raises(ValueError, match="conflicting scalar"):
        merge_batch_values([{"record_reset": True}, {"record_reset": False}])
    with pytest.raises(ValueError, match="conflicting scalar"):
        merge_batch_values([1, True])


def test_present_and_absent_raise_and_all_none_is_none():
    with pytest.raises(ValueError, match="Cannot merge present and absent batch values."):
        merge_batch_values([torch.zeros(1), None])
    assert merge_batch_values([None, None]) is None
    assert split_batch_value(None, [1, 2, 3]) == [None, None, None]
    with pytest.raises(ValueError):
        merge_batch_values([])


def test_numpy_lists_and_nested_leaves_survive():
    value = {
        "img": np.arange(24, dtype=np.uint8).reshape(4, 3, 2),
        "nested": {"t": torch.arange(8.0).view(4, 2).t().t(), "mask": np.array([T, F, T, T])},
        "task_descriptions": ["a", "b", "c", "d"],
        "name": "env",
        "step": 3,
        "scale": 0.5,
        "none": None,
    }
    shards = split_batch_value(value, [1, 0, 3])
    assert shards[1]["img"].shape == (0, 3, 2)
    assert shards[2]["task_descriptions"] == ["b", "c", "d"]
    assert all(s["name"] == "env" and s["step"] == 3 for s in shards)
    assert all(s["nested"]["t"].is_contiguous() for s in shards)
    assert_same(merge_batch_values(shards), value)


def test_split_rejects_wrong_lengths_and_types():
    with pytest.raises(ValueError):
        split_batch_value(torch.zeros(3), [1, 1])
    with pytest.raises(ValueError):
        split_batch_value([1, 2, 3], [2, 2])
    with pytest.raises(TypeError):
        split_batch_value({1, 2}, [1, 1])
    with pytest.raises(TypeError):
        split_batch_value(object(), [1])
    with pytest.raises(TypeError):
        merge_batch_values([torch.zeros(1), np.zeros(1)])
    with pytest.raises(ValueError):
        merge_batch_values([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])


leaves = st.one_of(
    st.builds(lambda w: ("tensor", w), st.integers(1, 3)),
    st.builds(lambda w: ("array", w), st.integers(1, 3)),
    st.just(("list", 0)),
    st.sampled_from(
        [("scalar", True), ("scalar", 7), ("scalar", "s"), ("scalar", 1.5), ("none", 0)]
    ),
)
structures = st.recursive(
    leaves, lambda inner: st.dictionaries(st.sampled_from("abcd"), inner, max_size=3)
)


def build(structure, B, rng):
    if isinstance(structure, dict):
        return {k: build(v, B, rng) for k, v in structure.items()}
    kind, arg = structure
    if kind == "tensor":
        return torch.tensor(rng.random((B, arg)), dtype=torch.float32)
    if kind == "array":
        return rng.integers(0, 9, size=(B, arg)).astype(np.int16)
    if kind == "list":
        return [f"item{i}" for i in range(B)]
    if kind == "scalar":
        return arg
    return None


@settings(max_examples=100, deadline=None)
@given(structures, st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_batch_split_merge_round_trip(structure, sizes):
    value = build(structure, sum(sizes), np.random.default_rng(0))
    shards = split_batch_value(value, sizes)
    assert len(shards) == len(sizes)
    assert_same(merge_batch_values(shards), value)


def episode_data(B=3, steps=2, mask=False, single_info=False):
    data = {
        "chunk_actions": torch.arange(B * 2 * 1, dtype=torch.float32).view(B, 2, 1),
        "obs_list": [
            {"states": torch.full((B, 2), float(s)), "task_descriptions": ["t"] * B}
            for s in range(steps)
        ],
        "terminations": torch.zeros(B, 2, dtype=torch.bool),
        "truncations": False,
        "infos_list": {"record_reset": True, "x": torch.arange(B)}
        if single_info
        else [
            {"success": torch.zeros(B, dtype=torch.bool), "segment_advance": False}
            for _ in range(steps)
        ],
    }
    if mask:
        data["valid_action_mask"] = torch.ones(B, 2, dtype=torch.bool)
    return data


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("single_info", [False, True])
def test_episode_data_split_keeps_steps_and_round_trips(mask, single_info):
    data = episode_data(mask=mask, single_info=single_info)
    shards = split_episode_data(data, [1, 2])
    for shard, size in zip(shards, [1, 2], strict=True):
        assert len(shard["obs_list"]) == 2
        assert all(o["states"].shape == (size, 2) for o in shard["obs_list"])
        assert shard["truncations"] is False
        assert ("valid_action_mask" in shard) == mask
        if single_info:
            assert shard["infos_list"]["record_reset"] is True
        else:
            assert len(shard["infos_list"]) == 2
    merged = merge_episode_data(shards)
    assert_same(merged, data)


def test_episode_data_rejects_different_chunk_lengths():
    a, b = split_episode_data(episode_data(B=2), [1, 1])
    b["obs_list"] = b["obs_list"][:1]
    with pytest.raises(ValueError, match="different chunk lengths"):
        merge_episode_data([a, b])


# -- EnvTransition and rewards (checklist 18, 19) ---------------------------------------------


def test_transition_to_dict_and_with_trajectory_data():
    t = transition(intervene_flags=flags([[F, T], [F, F]]))
    assert list(t.to_dict()) == [
        "dones",
        "terminations",
        "truncations",
        "rewards",
        "intervene_actions",
        "intervene_flags",
        "rlt_switch_flags",
    ]
    data = episode_data(B=2)
    t2 = t.with_trajectory_data(
        reward_model_output=torch.ones(2, 2), reward_assign_lengths=[1, 2], episode_data=data
    )
    assert t2 is not t and t.reward_model_output is None
    assert t2.reward_assign_lengths == [1, 2] and t2.episode_data is not None
    assert t2.rewards is t.rewards


def test_transition_split_merge_round_trip_and_partial_episode_data():
    t = transition(B=3, reward_assign_lengths=[1, 2, 3], episode_data=episode_data(B=3))
    parts = t.split([2, 1])
    assert parts[1].reward_assign_lengths == [3]
    assert parts[0].episode_data["obs_list"][0]["states"].shape == (2, 2)
    assert_same(EnvTransition.merge(parts), t)
    bare = transition(B=1)
    with pytest.raises(ValueError, match="Cannot merge partial episode data."):
        EnvTransition.merge([parts[0], bare])


REWARD_KW = dict(env_reward_weight=0.0, reward_weight=1.0, bootstrap_type="standard", gamma=0.5)


def bootstrap_transition(truncated=T, terminated=F):
    return EnvTransition(
        rewards=torch.tensor([[1.0]]),
        truncations=flags([[truncated]]),
        terminations=flags([[terminated]]),
        dones=flags([[truncated or terminated]]),
    )


def test_rewards_bootstrap_gamma_example():
    t = bootstrap_transition()
    boot = torch.tensor([[4.0]])
    r = t.compute_rewards(bootstrap_values=boot, auto_reset=True, **REWARD_KW)
    assert r.tolist() == [[3.0]]
    assert t.rewards.tolist() == [[1.0]]  # the input is not modified
    off = t.compute_rewards(bootstrap_values=boot, auto_reset=False, **REWARD_KW)
    assert off.tolist() == [[1.0]]
    part = EnvPart([TrajectorySource(K1, 1)], t, bootstrap_values=boot)
    assert part.compute_rewards(auto_reset=True, **REWARD_KW).tolist() == [[3.0]]


def test_rewards_standard_vs_always():
    t = bootstrap_transition(truncated=F, terminated=T)
    boot = torch.tensor([[4.0]])
    kw = {**REWARD_KW, "auto_reset": True}
    assert t.compute_rewards(bootstrap_values=boot, **kw).tolist() == [[1.0]]
    kw["bootstrap_type"] = "always"
    assert t.compute_rewards(bootstrap_values=boot, **kw).tolist() == [[3.0]]


def test_rewards_bootstrap_only_last_slot_of_terminal_envs():
    t = EnvTransition(
        rewards=torch.zeros(3, 2),
        truncations=flags([[F, T], [T, F], [F, F]]),
        dones=flags([[F, T], [T, F], [F, F]]),
    )
    boot = torch.tensor([[2.0], [5.0], [7.0]])
    r = t.compute_rewards(bootstrap_values=boot, auto_reset=True, **{**REWARD_KW, "gamma": 1.0})
    assert r.tolist() == [[0.0, 2.0], [0.0, 0.0], [0.0, 0.0]]
    none = t.compute_rewards(bootstrap_values=None, auto_reset=True, **REWARD_KW)
    assert none.tolist() == [[0.0, 0.0]] * 3


def test_rewards_model_mixing_and_storage():
    t = EnvTransition(
        rewards=torch.tensor([[1.0, 2.0]]),
        reward_model_output=torch.tensor([[10.0, 20.0]], dtype=torch.float64),
    )
    r = t.compute_rewards(
        bootstrap_values=None,
        auto_reset=False,
        **{**REWARD_KW, "env_reward_weight": 0.5, "reward_weight": 2.0},
    )
    assert r.dtype == torch.float32
    assert r.tolist() == [[20.5, 41.0]]
    plain = EnvTransition(rewards=torch.tensor([[1.0, 2.0]]))
    r2 = plain.compute_rewards(
        bootstrap_values=None, auto_reset=False, **{**REWARD_KW, "env_reward_weight": 0.5}
    )
    assert r2.tolist() == [[1.0, 2.0]]  # env_reward_weight only applies with a model output
    assert r2.untyped_storage().data_ptr() != plain.rewards.untyped_storage().data_ptr()
    assert (
        EnvTransition().compute_rewards(bootstrap_values=None, auto_reset=True, **REWARD_KW) is None
    )


HISTORY_KEYS = [TrajectoryKey(0, 0, 0, 0, c) for c in range(3)]
HISTORY_MODEL = [[1.0, 1.0], [0.0, 0.0], [4.0, 6.0]]


def history_transitions():
    return {
        key: EnvTransition(
            rewards=torch.zeros(2, 1),
            reward_model_output=torch.tensor(HISTORY_MODEL[key.chunk_id]).view(2, 1),
            reward_assign_lengths=[3, 2] if key.chunk_id == 2 else None,
        )
        for key in HISTORY_KEYS
    }


def materialise(arrivals):
    """What the accumulator does: sort by (epoch, chunk), compute rewards, assign history."""
    ordered = sorted(arrivals, key=lambda kt: (kt[0].epoch_id, kt[0].chunk_id))
    kw = dict(
        bootstrap_values=None,
        env_reward_weight=0.0,
        reward_weight=1.0,
        auto_reset=False,
        bootstrap_type="standard",
        gamma=1.0,
    )
    rewards = [t.compute_rewards(**kw) for _, t in ordered]
    return EnvTransition.assign_history_rewards(
        rewards,
        [t.reward_model_output for _, t in ordered],
        [t.reward_assign_lengths for _, t in ordered],
        1.0,
    )


@pytest.mark.parametrize("seed", range(6))
def test_history_rewards_example_any_arrival_order(seed):
    arrivals = list(history_transitions().items())
    random.Random(seed).shuffle(arrivals)
    out = materialise(arrivals)
    assert [r.view(-1).tolist() for r in out] == [[5.0, 1.0], [4.0, 6.0], [4.0, 6.0]]


def test_history_rewards_work_on_copies_and_need_model_output():
    base = [torch.zeros(2, 1) for _ in range(3)]
    out = assign_history_rewards(base, [None, None, torch.ones(2, 1)], [None, None, [2, 1]], 2.0)
    assert [r.view(-1).tolist() for r in out] == [[0.0, 0.0], [2.0, 0.0], [0.0, 0.0]]
    assert all(r.abs().sum() == 0 for r in base)
    with pytest.raises(ValueError):
        assign_history_rewards(base, [None, None, None], [None, None, [2, 1]], 1.0)
    with pytest.raises(ValueError):
        assign_history_rewards(base, [None, None, torch.ones(2, 1)], [None, None, [2]], 1.0)


# -- EnvOutput --------------------------------------------------------------------------------


def test_env_output_properties_and_prepare_observations():
    t = transition(intervene_flags=flags([[F, T], [F, F]]), rlt_switch_flags=flags([T, F]))
    out = EnvOutput(obs={"states": torch.zeros(2, 3)}, transition=t)
    for name in (
        "rewards",
        "dones",
        "terminations",
        "truncations",
        "intervene_actions",
        "intervene_flags",
        "rlt_switch_flags",
    ):
        assert getattr(out, name) is getattr(t, name)
    assert EnvOutput(obs={}).transition.rewards is None
    assert [f.name for f in dataclasses.fields(EnvOutput)] == [
        "obs",
        "transition",
        "final_obs",
        "env_infos",
    ]
    prepared = EnvOutput.prepare_observations(
        {
            "main_images": torch.zeros(2, 4, 4, 3, dtype=torch.uint8),
            "states": torch.ones(2, 3),
            "task_descriptions": ("a", "b"),
        }
    )
    assert prepared["wrist_images"] is None and prepared["extra_view_images"] is None
    assert prepared["task_descriptions"] == ["a", "b"]
    assert prepared["main_images"].shape == (2, 4, 4, 3)


# -- EnvPart (checklist 9, 10) ----------------------------------------------------------------


def test_env_part_complete_keeps_identity_and_bootstrap():
    initial = EnvTransition(dones=flags([[F, F]]))
    t = transition(B=1)
    part = EnvPart(
        [TrajectorySource(K0, 1)], t, requires_inference=True, initial_transition=initial
    )
    done = part.complete(
        next_obs={"states": torch.ones(1, 2)},
        next_rlt_obs=None,
        final_prev_values=torch.tensor([[4.0, 5.0]]),
    )
    assert done.transition is t and done.initial_transition is initial
    assert done.requires_inference is False
    assert done.final_prev_values.tolist() == [[4.0, 5.0]]
    assert done.bootstrap_values.tolist() == [[4.0]]
    assert done.bootstrap_values.is_contiguous()
    assert done.next_obs["states"].tolist() == [[1.0, 1.0]]
    assert part.requires_inference is True  # the original is unchanged
    bare = part.complete(next_obs=None, next_rlt_obs={"z_rl": torch.zeros(1, 2)})
    assert bare.final_prev_values is None and bare.bootstrap_values is None
    assert bare.next_rlt_obs["z_rl"].shape == (1, 2)


def full_env_part(key=K0, B=2, requires_inference=True):
    return EnvPart(
        [TrajectorySource(key, B, 0)],
        transition(B=B),
        requires_inference=requires_inference,
        next_obs={"states": torch.arange(B * 2, dtype=torch.float32).view(B, 2)},
        final_prev_values=torch.arange(B * 2, dtype=torch.float32).view(B, 2),
        bootstrap_values=torch.arange(B, dtype=torch.float32).view(B, 1),
        initial_transition=EnvTransition(dones=torch.zeros(B, 2, dtype=torch.bool)),
    )


def test_env_part_split_merge_example():
    part = full_env_part()
    a, b = part.split([1, 1])
    assert a.sources == [TrajectorySource(K0, 1, 0)] and b.sources == [TrajectorySource(K0, 1, 1)]
    assert a.requires_inference and b.requires_inference
    assert a.transition.rewards.shape == (1, 2) and a.initial_transition.dones.shape == (1, 2)
    assert b.next_obs["states"].tolist() == [[2.0, 3.0]]
    assert_same(EnvPart.merge([a, b]), part)
    assert [p.sources for p in part.split()] == [[TrajectorySource(K0, 2, 0)]]


def test_env_part_split_across_sources_uses_source_sizes():
    part = EnvPart([TrajectorySource(K0, 1, 1), TrajectorySource(K1, 2, 0)], transition(B=3))
    a, b = part.split()
    assert a.sources == [TrajectorySource(K0, 1, 1)] and b.sources == [TrajectorySource(K1, 2, 0)]
    assert b.transition.rewards.shape == (2, 2)


def test_env_part_merge_errors():
    a, b = full_env_part().split([1, 1])
    flipped = dataclasses.replace(b, requires_inference=False)
    with pytest.raises(ValueError, match="Conflicting terminal-inference state"):
        EnvPart.merge([a, flipped])
    partial = dataclasses.replace(b, initial_transition=None)
    with pytest.raises(ValueError, match="Incomplete initial-state fragments"):
        EnvPart.merge([a, partial])
    foreign = full_env_part(key=K1, B=1)
    with pytest.raises(ValueError, match="one logical source"):
        EnvPart.merge([a, foreign])
    with pytest.raises(ValueError, match="one logical source"):
        EnvPart.merge([b, a])  # out of order: offsets 1, 0 do not coalesce


# -- PolicyOutput, PolicyPart (checklist 11) --------------------------------------------------


def test_policy_output_has_no_actions_and_defaults():
    assert "actions" not in {f.name for f in dataclasses.fields(PolicyOutput)}
    assert PolicyOutput().forward_inputs == {}
    assert PolicyOutput(forward_inputs=None).forward_inputs == {}
    with pytest.raises(TypeError):
        PolicyOutput(torch.zeros(1))  # type: ignore[misc]  # keyword-only
    out = PolicyOutput(
        versions=torch.ones(2, 2, dtype=torch.float64), intervene_flags=torch.tensor([[1, 0]])
    )
    assert out.versions.dtype == torch.float32 and out.intervene_flags.dtype == torch.bool


def test_policy_output_split_merge():
    out = policy_output(B=3)
    parts = out.split([1, 2])
    assert parts[1].forward_inputs["tokens"].shape == (2, 3)
    assert_same(PolicyOutput.merge(parts), out)


def test_policy_part_needs_exactly_one_of_output_and_external_actions():
    src = [TrajectorySource(K0, 2)]
    with pytest.raises(ValueError, match="exactly one of output and external_actions."):
        PolicyPart(src, {})
    with pytest.raises(ValueError, match="exactly one of output and external_actions."):
        PolicyPart(src, {}, output=policy_output(), external_actions=torch.zeros(2, 4))
    assert PolicyPart(src, {}, output=policy_output()).inferred
    assert not PolicyPart(src, {}, external_actions=torch.zeros(2, 4)).inferred
    assert isinstance(PolicyPart(src, {}, output=policy_output()), TrajectoryPart)


def test_policy_part_split_merge():
    part = PolicyPart(
        [TrajectorySource(K0, 1, 1), TrajectorySource(K1, 2, 0)],
        {"states": torch.rand(3, 2), "task_descriptions": ["a", "b", "c"]},
        output=policy_output(B=3),
    )
    a, b = part.split()
    assert a.sources == [TrajectorySource(K0, 1, 1)] and b.obs["task_descriptions"] == ["b", "c"]
    c, d = b.split([1, 1])
    assert_same(PolicyPart.merge([c, d]), b)
    with pytest.raises(ValueError, match="one logical source"):
        PolicyPart.merge([a, b])
    external = PolicyPart(
        [TrajectorySource(K1, 1, 1)],
        {"states": torch.rand(1, 2), "task_descriptions": ["x"]},
        external_actions=torch.zeros(1, 4),
    )
    with pytest.raises(ValueError, match="inferred and external"):
        PolicyPart.merge([c, external])


# -- PolicyInput (checklist 12) ---------------------------------------------------------------


def test_policy_input_merge_example():
    p = full_env_part(B=2)
    first = PolicyInput(
        obs={"states": torch.zeros(2, 3)},
        intervene_flags=torch.ones(2, 2, dtype=torch.bool),
        sources=[TrajectorySource(K1, 2)],
        env_parts=[p],
        request_sizes=[2],
    )
    k2 = TrajectoryKey(0, 0, 1, 0, 1)
    second = PolicyInput(
        obs={"states": torch.ones(3, 3)},
        sources=[TrajectorySource(k2, 3)],
        env_parts=[None],
        request_sizes=[3],
    )
    merged = PolicyInput.merge([first, second])
    assert merged.obs["states"].shape == (5, 3)
    assert merged.intervene_flags.shape == (5, 2) and merged.intervene_flags.dtype == torch.bool
    assert merged.intervene_flags[:2].all() and not merged.intervene_flags[2:].any()
    assert merged.rlt_switch_flags is None
    assert merged.env_parts[0] is p and merged.env_parts[1] is None
    assert merged.request_sizes == [2, 3]
    assert merged.sources == [TrajectorySource(K1, 2), TrajectorySource(k2, 3)]
    assert merged.requires_inference and merged.is_last is False


def test_policy_input_zero_fill_batch_from_images_or_tasks():
    def images(n):
        return {"main_images": torch.zeros(n, 2, 2, 3), "task_descriptions": ["t"] * n}

    a = PolicyInput(obs=images(2), rlt_switch_flags=torch.ones(2))
    b = PolicyInput(obs=images(1))
    assert PolicyInput.merge([b, a]).rlt_switch_flags.tolist() == [0.0, 1.0, 1.0]
    c = PolicyInput(obs={"task_descriptions": ["x", "y"]}, rlt_switch_flags=torch.ones(2))
    d = PolicyInput(obs={"task_descriptions": ["z"]})
    assert PolicyInput.merge([c, d]).rlt_switch_flags.tolist() == [1.0, 1.0, 0.0]


def test_policy_input_merge_rejects_mixed_inference():
    a = PolicyInput(obs={"states": torch.zeros(1, 1)})
    b = PolicyInput(obs={"states": torch.zeros(1, 1)}, external_actions=torch.zeros(1, 4))
    assert not b.requires_inference
    with pytest.raises(ValueError):
        PolicyInput.merge([a, b])


def test_policy_input_split():
    p = full_env_part(B=3)
    req = PolicyInput(
        obs={"states": torch.rand(3, 2)},
        intervene_flags=torch.zeros(3, 2, dtype=torch.bool),
        sources=[TrajectorySource(K1, 3)],
        env_parts=[p],
        request_sizes=[3],
        is_last=True,
    )
    a, b = req.split([1, 2])
    assert a.sources == [TrajectorySource(K1, 1, 0)] and b.sources == [TrajectorySource(K1, 2, 1)]
    assert a.request_sizes == [1] and b.request_sizes == [2]
    assert b.env_parts[0].sources == [TrajectorySource(K0, 2, 1)]
    assert a.is_last and b.is_last and b.intervene_flags.shape == (2, 2)
    bootstrap = PolicyInput(
        obs={"states": torch.rand(2, 2)},
        sources=[TrajectorySource(K0, 2)],
        env_parts=[None],
        request_sizes=[2],
    )
    assert [s.env_parts for s in bootstrap.split([1, 1])] == [[None], [None]]
    with pytest.raises(ValueError):
        PolicyInput.merge([a, b]).split([1, 2])  # two env parts


# -- construction invariants (checklist 5) ----------------------------------------------------


def messy(*shape):
    """A non-contiguous tensor that requires grad."""
    base = torch.rand(*reversed(shape), requires_grad=True)
    return base.t() if len(shape) == 2 else base


def assert_clean(value, path="value"):
    if isinstance(value, torch.Tensor):
        assert value.device.type == "cpu", path
        assert value.is_contiguous(), path
        assert not value.requires_grad and value.grad_fn is None, path
    elif isinstance(value, dict):
        for k, v in value.items():
            assert_clean(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_clean(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            assert_clean(getattr(value, f.name), f"{path}.{f.name}")


def messy_objects():
    t = EnvTransition(
        rewards=messy(2, 3),
        dones=messy(2, 3) > 0.5,
        reward_model_output=messy(2, 3),
        episode_data={
            "obs_list": [{"states": messy(2, 4), "deep": {"x": messy(2, 2)}}],
            "chunk_actions": messy(2, 3),
        },
    )
    src = [TrajectorySource(K0, 2)]
    out = PolicyOutput(
        forward_inputs={"action": messy(2, 4), "nested": {"z": messy(2, 2)}},
        prev_logprobs=messy(2, 4),
        prev_values=messy(2, 1),
        versions=messy(2, 4),
    )
    return [
        t,
        EnvOutput(
            obs={"states": messy(2, 4), "cams": {"wrist": messy(2, 3)}},
            transition=t,
            final_obs={"states": messy(2, 4)},
            env_infos={"ep": {"r": messy(2, 2)}},
        ),
        EnvPart(
            src,
            t,
            next_obs={"states": messy(2, 4)},
            next_rlt_obs={"z_rl": messy(2, 3)},
            bootstrap_values=messy(2, 1),
            final_prev_values=messy(2, 2),
        ),
        out,
        PolicyPart(src, {"states": messy(2, 4), "nested": {"x": [messy(2, 2)]}}, output=out),
        PolicyPart(src, {"states": messy(2, 4)}, external_actions=messy(2, 4)),
        PolicyInput(
            obs={"states": messy(2, 4)},
            rlt_switch_flags=messy(2, 2),
            intervene_flags=messy(2, 2) > 0,
            external_actions=messy(2, 4),
        ),
    ]


@pytest.mark.parametrize("obj", messy_objects(), ids=lambda o: type(o).__name__)
def test_tensors_are_contiguous_cpu_and_detached(obj):
    assert_clean(obj)


def test_transition_flags_become_bool():
    t = EnvTransition(dones=torch.tensor([[1, 0]]), intervene_flags=torch.tensor([[0.0, 1.0]]),
                      rlt_switch_flags=torch.tensor([1, 0]))
    assert t.dones.dtype == torch.bool and t.intervene_flags.dtype == torch.bool
    assert t.rlt_switch_flags.dtype == torch.bool and t.rlt_switch_flags.tolist() == [True, False]


def test_policy_input_flags_become_bool():
    """Flags are bool on every type that carries them, ``rlt_switch_flags`` too."""
    k = TrajectoryKey(0, 0, 0, 0, 1)
    got = PolicyInput(obs={"states": torch.ones(2, 3)}, sources=[TrajectorySource(k, 2)],
                      env_parts=[None], request_sizes=[2],
                      rlt_switch_flags=torch.tensor([0, 2]), intervene_flags=torch.ones(2, 1))
    assert got.rlt_switch_flags.dtype == torch.bool and got.rlt_switch_flags.tolist() == [False, True]
    assert got.intervene_flags.dtype == torch.bool


# -- serialization ----------------------------------------------------------------------------


def wire_objects():
    big = torch.rand(256, 128)  # 128 KiB: travels as its own buffer
    t = transition(
        B=2,
        intervene_actions=torch.rand(2, 2, 3, dtype=torch.float64),
        intervene_flags=flags([[F, T], [T, T]]),
        rlt_switch_flags=torch.tensor([1, 0], dtype=torch.int8),
        reward_model_output=torch.rand(2, 2),
        reward_assign_lengths=[1, 2],
        episode_data=episode_data(B=2),
    )
    obs = {
        "states": torch.rand(2, 3),
        "img": np.zeros((2, 4, 4, 3), dtype=np.uint8),
        "task_descriptions": ["a", "b"],
        "pair": (1, 2),
        "big": big[:2].expand(2, 128),
    }
    part = EnvPart(
        [TrajectorySource(K0, 2)],
        t,
        next_obs=obs,
        requires_inference=True,
        next_rlt_obs={"z_rl": torch.rand(2, 5)},
        bootstrap_values=torch.rand(2, 1),
        final_prev_values=torch.rand(2, 2),
        initial_transition=EnvTransition(dones=flags([[F, F], [F, F]])),
    )
    out = policy_output(B=2)
    out.forward_inputs["big"] = big
    return [
        K0,
        TrajectorySource(K1, 3, 1),
        t,
        EnvOutput(
            obs=obs, transition=t, final_obs={"states": torch.rand(2, 3)}, env_infos={"x": 1.5}
        ),
        out,
        PolicyPart([TrajectorySource(K0, 2)], obs, output=out),
        PolicyPart([TrajectorySource(K0, 2)], obs, external_actions=torch.rand(2, 2, 2)),
        part,
        PolicyInput(
            obs=obs,
            intervene_flags=flags([[F, T], [T, F]]),
            sources=[TrajectorySource(K0, 2)],
            env_parts=[part, None],
            request_sizes=[2, 0],
            is_last=True,
        ),
    ]


@pytest.mark.parametrize("obj", wire_objects(), ids=lambda o: type(o).__name__)
def test_codec_round_trip(obj):
    decoded = roundtrip(obj)
    assert type(decoded) is type(obj)
    assert_same(decoded, obj)


def test_registered_tags():
    body, _ = encode(K0)
    assert b"zchannel.embodied.TrajectoryKey" in body
