"""A NaN or inf observation value stops the env with an ``ObservationError`` naming the env, the
sub-env, the observation leaf and the step, before the policy sees it or it trains NaN weights:
mid-episode, in the observation an episode ended in, and at a reset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gymnasium = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402
from zchannel.embodied import ChunkedEnv, ObservationError, PointReach  # noqa: E402
from zchannel.embodied.gymenv import GymVectorEnv  # noqa: E402

EPISODE = 4  # low-level steps per episode


class _BadAt(gymnasium.Env):
    """Dict observation {"pos": Box(2), "vel": Box(3)}, finite except ``vel[1] = bad`` at
    episode step ``at`` (0: the reset) of the sub-env with ``bad_env``; episodes of
    ``EPISODE`` steps."""

    observation_space = spaces.Dict({"pos": spaces.Box(-1, 1, (2,), np.float32),
                                     "vel": spaces.Box(-1, 1, (3,), np.float32)})
    action_space = spaces.Discrete(2)

    def __init__(self, at: int, bad_env: bool, bad: float) -> None:
        self.at, self.bad_env, self.bad, self.t = at, bad_env, bad, 0

    def _obs(self):
        vel = np.zeros(3, np.float32)
        if self.bad_env and self.t == self.at:
            vel[1] = self.bad
        return {"pos": np.zeros(2, np.float32), "vel": vel}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, self.t >= EPISODE, False, {}


def _chunked(at: int, bad: float = float("nan")) -> ChunkedEnv:
    """Three sub-envs, sub-env 1 the bad one; chunks of 2 steps."""
    vec = gymnasium.vector.SyncVectorEnv([lambda i=i: _BadAt(at, i == 1, bad) for i in range(3)])
    return ChunkedEnv(GymVectorEnv(vec), 2, name="bad-obs")


def _step_until_error(env: ChunkedEnv) -> ObservationError:
    with pytest.raises(ObservationError) as err:
        env.reset(seed=0)
        for _ in range(EPISODE):
            env.step_chunk(torch.zeros(3, 2, 1))
    return err.value


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_observation_names_the_env_the_sub_env_the_leaf_and_the_step(bad):
    env = _chunked(at=2, bad=bad)
    message = str(_step_until_error(env))
    assert (f"env 'bad-obs': sub-env 1 returned the non-finite observation 'vel' value {bad} "
            "at step 2 of its episode (slot 1 of the action chunk); observations must be "
            "finite (non-finite sub-envs: [1])") == message
    assert env.stats.returns == []  # no statistics of the bad step


def test_a_non_finite_observation_an_episode_ended_in_is_refused():
    """The final observation (bootstrapped from on a truncation) is checked, not only the
    reset one returned in its place."""
    message = str(_step_until_error(_chunked(at=EPISODE)))
    assert "sub-env 1 returned the non-finite observation 'vel' value nan at step 4 of its " \
           "episode (slot 1 of the action chunk)" in message


def test_a_non_finite_observation_at_a_reset_is_refused():
    message = str(_step_until_error(_chunked(at=0)))
    assert "sub-env 1 returned the non-finite observation 'vel' value nan at the reset of " \
           "its episode;" in message


class _NaNState(PointReach):
    """PointReach (no leaf names) whose sub-env 0 has a NaN in state column 3 after step 1."""

    def step(self, actions):
        obs, reward, term, trunc, info = super().step(actions)
        obs["states"][0, 3] = float("nan")
        return obs, reward, term, trunc, info


def test_an_env_without_leaf_names_names_the_column():
    env = ChunkedEnv(_NaNState(2), 1, name="reach")
    env.reset(seed=0)
    with pytest.raises(ObservationError, match=r"env 'reach': sub-env 0 returned the non-finite "
                       r"observation 'states\[3\]' value nan at step 1 of its episode"):
        env.step_chunk(torch.zeros(2, 1, PointReach.action_dim))
