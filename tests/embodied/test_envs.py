"""The env side: PointReach, action chunks with same-step auto-reset, the Gymnasium adapter."""

from __future__ import annotations

import pytest
import torch
from zchannel.embodied import ChunkedEnv, PointReach, VectorEnv, make_env


def test_point_reach_follows_the_vector_env_convention():
    env = PointReach(4, max_steps=3)
    assert isinstance(env, VectorEnv)
    obs, _ = env.reset(seed=1)
    assert obs["states"].shape == (4, 4)
    again, _ = PointReach(4, max_steps=3).reset(seed=1)
    assert torch.equal(obs["states"], again["states"])  # seeded
    for _ in range(3):
        obs, reward, term, trunc, info = env.step(torch.zeros(4, 2))
        assert reward.shape == term.shape == trunc.shape == (4,)
    assert bool((term | trunc).all())  # the third step ends every episode
    assert info["final_observation"]["states"].shape == (4, 4)
    assert info["_final_observation"].all()
    assert not torch.equal(info["final_observation"]["states"], obs["states"])  # reset happened


def test_chunk_boundary_override_holds_the_finished_observation():
    chunked = ChunkedEnv(PointReach(2, max_steps=2), num_action_chunks=2)
    chunked.reset(seed=0)
    out = chunked.step_chunk(torch.zeros(2, 2, 2))
    t = out.transition
    assert t.rewards.shape == t.dones.shape == (2, 2)
    assert t.truncations[:, 1].all() and not t.dones[:, 0].any()
    assert out.final_obs is not None  # finished on the last slot: the boundary override
    assert not torch.equal(out.final_obs["states"], out.obs["states"])
    assert chunked.stats.lengths == [2, 2]
    out = chunked.step_chunk(torch.zeros(2, 4))  # [B, C·A] is accepted too
    assert out.obs["states"].shape == (2, 4)


def test_unknown_env_is_refused():
    with pytest.raises(ValueError, match="unknown env 'cartpole'"):
        make_env("cartpole", 2)


def test_gymnasium_vector_env_adapter():
    gymnasium = pytest.importorskip("gymnasium")
    vec = gymnasium.make_vec("Pendulum-v1", num_envs=2, vectorization_mode="sync",
                             max_episode_steps=5)
    env = make_env("gym:Pendulum-v1", 2)
    assert env.state_dim == 3 and env.action_dim == 1
    chunked = ChunkedEnv(type(env)(vec), num_action_chunks=2)
    chunked.reset(seed=0)
    finals = 0
    for _ in range(10):
        out = chunked.step_chunk(torch.zeros(2, 2, 1))
        finals += out.final_obs is not None
    assert chunked.stats.lengths == [5] * 8  # finished envs reset in the same step
    assert finals == 2  # episodes ending on a chunk's last slot give the override


def test_a_terminal_state_on_the_time_limits_last_step_is_no_truncation():
    """Gymnasium's TimeLimit says terminated and truncated both when an episode ends on its
    last allowed step: the state is terminal, and a truncation would have it bootstrapped
    (gamma * V(final observation) added to its reward)."""
    gymnasium = pytest.importorskip("gymnasium")
    lake = {"desc": ["SG"], "is_slippery": False}  # moving right reaches the goal at once
    vec = gymnasium.make_vec("FrozenLake-v1", num_envs=2, vectorization_mode="sync",
                             max_episode_steps=1, **lake)
    env = make_env("gym:FrozenLake-v1", 2, lake)
    raw = type(env)(vec)
    raw.reset(seed=0)
    _, _, term, trunc, _ = raw.step(torch.full((2, 1), 2.0))
    assert term.all() and trunc.all()  # what Gymnasium reports
    vec = gymnasium.make_vec("FrozenLake-v1", num_envs=2, vectorization_mode="sync",
                             max_episode_steps=1, **lake)
    chunked = ChunkedEnv(type(env)(vec), num_action_chunks=1)
    chunked.reset(seed=0)
    t = chunked.step_chunk(torch.full((2, 1, 1), 2.0)).transition
    assert t.terminations.all() and not t.truncations.any() and t.dones.all()
    rewards = t.compute_rewards(bootstrap_values=torch.full((2, 1), 100.0),
                                env_reward_weight=1.0, reward_weight=1.0, auto_reset=True,
                                bootstrap_type="standard", gamma=0.9)
    assert torch.equal(rewards, t.rewards)  # nothing bootstrapped onto the terminal reward
