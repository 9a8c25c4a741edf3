"""TrajectoryPlan: fields, derived geometry, options round trip and validation."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from zchannel.embodied.plan import TrajectoryPlan

BASE = {
    "mode": "rollout",
    "num_sources": 2,
    "source_batch_size": 8,
    "num_chunks": 4,
    "rollout_epochs": 1,
    "actor_world_size": 4,
    "num_action_chunks": 2,
    "action_dim": 7,
}
REQUIRED = tuple(BASE)


def plan(**overrides):
    return TrajectoryPlan.from_options({**BASE, **overrides})


def rejects(field: str, **overrides) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        plan(**overrides)


# -- defaults, derived properties, round trip (checklist 1) ------------------------------------


def test_spec_example_geometry_and_defaults():
    p = plan()
    assert p.shards_per_source == 2
    assert p.items_per_actor == 1
    assert p.total_envs == 16
    assert p.source_batch_size // p.shards_per_source == 4
    assert p.adv_type == "gae" and p.gamma == 1.0 and p.gae_lambda == 1.0
    assert p.group_size == 8 and p.normalize_advantages is True
    assert p.reward_type == "chunk_level" and p.bootstrap_type == "standard"
    assert p.auto_reset is False and p.ignore_terminations is False
    assert p.env_reward_weight == 0.0 and p.reward_weight == 1.0
    assert p.collect_prev_infos is True and p.collect_transitions is False
    assert p.enable_rlt is False and p.max_episode_length == 0
    assert p.micro_batch_size is None and p.shuffle is True and p.seed == 0
    assert p.rewards_lower_bound is None and p.rewards_upper_bound is None
    assert p.lerobot_only_success is False and p.lerobot_fps == 10


def test_plan_is_frozen_keyword_only_and_hashable():
    p = plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.mode = "pipeline"  # type: ignore[misc]
    with pytest.raises(TypeError):
        TrajectoryPlan("rollout", 1, 1, 1, 1, 1, 1, 1)  # type: ignore[misc]
    assert hash(p) == hash(plan())


def test_rollout_example_s3_aw2():
    p = plan(num_sources=3, source_batch_size=4, actor_world_size=2)
    assert p.shards_per_source == 2
    assert p.items_per_actor == 3


def test_pipeline_actor_width():
    p = plan(
        mode="pipeline",
        num_sources=3,
        source_batch_size=4,
        actor_world_size=2,
        num_chunks=2,
        micro_batch_size=4,
    )
    assert p.actor_width == 6


ALL_MODES = [
    dict(),
    dict(
        adv_type="grpo",
        group_size=4,
        gamma=0.99,
        gae_lambda=0.95,
        auto_reset=True,
        rewards_lower_bound=0.1,
        rewards_upper_bound=0.9,
        reward_type="action_level",
    ),
    dict(mode="pipeline", micro_batch_size=4, shuffle=False, seed=3, bootstrap_type="always"),
    dict(
        mode="lerobot",
        lerobot_only_success=True,
        lerobot_fps=30.0,
        adv_type="raw",
        group_size=3,
        max_episode_length=100,
    ),
]


@pytest.mark.parametrize("overrides", ALL_MODES)
def test_options_round_trip_through_msgpack(overrides):
    p = plan(**overrides)
    options = p.to_options()
    assert set(options) == {f.name for f in dataclasses.fields(TrajectoryPlan)}
    assert TrajectoryPlan.from_options(options) == p
    wire = msgpack.unpackb(msgpack.packb(options), raw=False)
    assert TrajectoryPlan.from_options(wire) == p


def test_int_is_accepted_as_float_and_stored_as_float():
    p = plan(
        gamma=1, env_reward_weight=2, rewards_lower_bound=0, rewards_upper_bound=1, group_size=4
    )
    assert isinstance(p.gamma, float) and p.gamma == 1.0
    assert isinstance(p.env_reward_weight, float)
    assert isinstance(p.rewards_lower_bound, float)


def test_micro_batch_options_ignored_outside_pipeline():
    p = plan(micro_batch_size=3, shuffle=False, seed=11)
    assert p.micro_batch_size == 3


# -- field validation (checklist 2) -----------------------------------------------------------


def test_rejects_unknown_key():
    rejects("decoupled", decoupled=True)


@pytest.mark.parametrize("field", REQUIRED)
def test_rejects_missing_required_field(field):
    options = {k: v for k, v in BASE.items() if k != field}
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        TrajectoryPlan.from_options(options)


@pytest.mark.parametrize(
    "field,value",
    [
        ("mode", "decoupled"),
        ("adv_type", "opd"),
        ("adv_type", "grpo_video"),
        ("adv_type", "grpo_dynamic"),
        ("adv_type", "GAE"),
        ("reward_type", "token_level"),
        ("bootstrap_type", "never"),
        ("mode", 1),
    ],
)
def test_rejects_bad_enum(field, value):
    rejects(field, **{field: value})


@pytest.mark.parametrize(
    "field", ["num_sources", "num_chunks", "group_size", "seed", "max_episode_length", "action_dim"]
)
def test_rejects_bool_as_int(field):
    rejects(field, **{field: True})


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_sources", 2.0),
        ("num_chunks", "4"),
        ("source_batch_size", None),
        ("gamma", True),
        ("gamma", "0.5"),
        ("reward_weight", None),
        ("shuffle", 1),
        ("auto_reset", "yes"),
        ("micro_batch_size", 2.0),
        ("rewards_lower_bound", "low"),
        ("lerobot_fps", True),
    ],
)
def test_rejects_wrong_type(field, value):
    rejects(field, **{field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_sources", 0),
        ("source_batch_size", -1),
        ("num_chunks", 0),
        ("rollout_epochs", 0),
        ("actor_world_size", 0),
        ("num_action_chunks", 0),
        ("action_dim", 0),
        ("group_size", 0),
        ("gamma", 1.5),
        ("gae_lambda", -0.1),
        ("gamma", float("nan")),
        ("max_episode_length", -1),
        ("micro_batch_size", 0),
    ],
)
def test_rejects_out_of_range(field, value):
    rejects(field, **{field: value})


def test_rejects_bad_lerobot_fps_in_lerobot_mode():
    for fps in (0, -1.0, float("inf")):
        rejects("lerobot_fps", mode="lerobot", lerobot_fps=fps)


def test_rejects_non_mapping_options():
    with pytest.raises(ValueError):
        TrajectoryPlan.from_options(None)  # type: ignore[arg-type]


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="group_size"):
        TrajectoryPlan(**BASE, adv_type="grpo")


# -- cross-field rules (checklist 3) -----------------------------------------------------------


def test_grpo_group_straddling_rollout_shards_names_group_size():
    rejects("group_size", adv_type="grpo")  # 8 does not divide 4
    assert plan(adv_type="grpo", group_size=4).group_size == 4
    assert plan(adv_type="grpo", group_size=2).group_size == 2


@pytest.mark.parametrize("adv_type", ["reinpp", "raw"])
def test_group_estimators_must_not_straddle(adv_type):
    rejects("group_size", adv_type=adv_type, group_size=3)
    assert plan(adv_type=adv_type, group_size=4).adv_type == adv_type


def test_reward_bound_needs_unstraddled_groups_even_for_gae():
    rejects("group_size", rewards_lower_bound=0.1)
    rejects("group_size", rewards_upper_bound=0.9)
    assert plan(rewards_upper_bound=0.9, group_size=2).rewards_upper_bound == 0.9


def test_gae_without_bounds_ignores_group_size():
    assert plan(group_size=3).group_size == 3


def test_grpo_needs_group_size_two():
    rejects("group_size", adv_type="grpo", group_size=1)
    assert plan(adv_type="reinpp", group_size=1).group_size == 1


def test_pipeline_group_must_divide_gcd_of_source_and_actor_width():
    # S=3, B=4, AW=2: actor_width 6, gcd(4, 6) = 2.
    geometry = dict(
        mode="pipeline",
        num_sources=3,
        source_batch_size=4,
        actor_world_size=2,
        num_chunks=2,
        micro_batch_size=4,
    )
    rejects("group_size", adv_type="grpo", group_size=4, **geometry)
    assert plan(adv_type="grpo", group_size=2, **geometry).group_size == 2


def test_lerobot_mode_skips_group_straddling():
    assert plan(mode="lerobot", adv_type="grpo").group_size == 8


@pytest.mark.parametrize("mode", ["rollout", "pipeline"])
def test_lerobot_fields_rejected_outside_lerobot(mode):
    extra = {"micro_batch_size": 4} if mode == "pipeline" else {}
    rejects("lerobot_only_success", mode=mode, lerobot_only_success=True, **extra)
    rejects("lerobot_fps", mode=mode, lerobot_fps=30, **extra)
    # Passing the defaults explicitly is fine.
    assert plan(mode=mode, lerobot_only_success=False, lerobot_fps=10.0, **extra).mode == mode


def test_pipeline_requires_micro_batch_size():
    rejects("micro_batch_size", mode="pipeline")


def test_pipeline_rejects_indivisible_envs_among_actors():
    rejects(
        "actor_world_size",
        mode="pipeline",
        num_sources=3,
        source_batch_size=1,
        actor_world_size=2,
        micro_batch_size=1,
    )


def test_pipeline_rejects_indivisible_micro_batches():
    # N * actor_width = 4 * 4 = 16 rows per actor.
    rejects("micro_batch_size", mode="pipeline", micro_batch_size=3)
    assert plan(mode="pipeline", micro_batch_size=16).micro_batch_size == 16


def test_rollout_rejects_source_batch_not_divisible_by_shards():
    rejects("source_batch_size", source_batch_size=7)  # shards_per_source = 2
    # lerobot mode yields possibly empty episode shards: no divisibility rule.
    assert plan(mode="lerobot", source_batch_size=7).source_batch_size == 7


def test_rejects_inverted_reward_bounds():
    rejects("rewards_lower_bound", rewards_lower_bound=0.9, rewards_upper_bound=0.1, group_size=4)
    assert plan(rewards_lower_bound=0.5, rewards_upper_bound=0.5, group_size=4)


@settings(max_examples=150, deadline=None)
@given(
    mode=st.sampled_from(["rollout", "pipeline", "lerobot"]),
    S=st.integers(1, 4),
    B=st.integers(1, 8),
    N=st.integers(1, 4),
    AW=st.integers(1, 6),
    adv=st.sampled_from(["gae", "grpo", "reinpp", "raw"]),
    g=st.integers(1, 4),
    mbs=st.one_of(st.none(), st.integers(1, 8)),
)
def test_any_accepted_plan_round_trips(mode, S, B, N, AW, adv, g, mbs):
    options = {
        **BASE,
        "mode": mode,
        "num_sources": S,
        "source_batch_size": B,
        "num_chunks": N,
        "actor_world_size": AW,
        "adv_type": adv,
        "group_size": g,
        "micro_batch_size": mbs,
    }
    try:
        p = TrajectoryPlan.from_options(options)
    except ValueError as exc:
        assert str(exc).startswith("TrajectoryPlan.")
        return
    assert TrajectoryPlan.from_options(msgpack.unpackb(msgpack.packb(p.to_options()))) == p
    if mode == "rollout":
        assert B % p.shards_per_source == 0
    if mode == "pipeline":
        assert (N * p.actor_width) % mbs == 0
