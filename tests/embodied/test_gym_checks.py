"""The Gymnasium adapter refuses what it would otherwise misread: uint8 observations laid out
channel-first (C x H x W, or a stack of k H x W frames) and ``info["success"]`` values that are
not bools or numbers, each with an error naming what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gymnasium = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402
from zchannel.embodied.envs import make_env  # noqa: E402
from zchannel.embodied.gymenv import GymVectorEnv  # noqa: E402


class _Env(gymnasium.Env):
    """Observations sampled from ``observation_space``; each step's info is ``{"success":
    success}`` (no key when ``success`` is None); episodes of 2 steps."""

    action_space = spaces.Box(-1, 1, (1,), np.float32)

    def __init__(self, observation_space, success=None):
        self.observation_space, self.success = observation_space, success
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        info = {} if self.success is None else {"success": self.success}
        return self.observation_space.sample(), 0.0, self.t >= 2, False, info


def _vec(observation_space, success=None, n=2):
    return gymnasium.vector.SyncVectorEnv([lambda: _Env(observation_space, success)] * n)


def _uint8(*shape):
    return spaces.Box(0, 255, shape, np.uint8)


@pytest.mark.parametrize("shape", [(4, 32, 48), (3, 32, 32), (1, 24, 24), (8, 84, 84)])
def test_a_channel_first_uint8_observation_is_refused_naming_the_leaf(shape):
    """Frame stacks (k, H, W) and C x H x W images would otherwise become H x W x C images with
    H = k and W channels."""
    obs_space = spaces.Dict({"frames": _uint8(*shape), "state": spaces.Box(-1, 1, (2,))})
    with pytest.raises(ValueError) as err:
        GymVectorEnv(_vec(obs_space))
    message = str(err.value)
    assert "'frames'" in message and str(shape) in message and "channel-first" in message
    assert "obs_map" in message and "moveaxis" in message


def test_the_whole_observation_frame_stack_is_refused():
    """Gymnasium's own pixel pipeline: rendered frames, grayscale, 4 stacked -> (4, H, W)."""
    with pytest.raises(ValueError, match=r"'<observation>' is a uint8 Box of shape \(4, 32, 48\)"):
        GymVectorEnv(_vec(_uint8(4, 32, 48)))


def test_obs_map_carries_a_channel_first_leaf_as_states_or_drops_it():
    obs_space = spaces.Dict({"frames": _uint8(4, 6, 8), "state": spaces.Box(-1, 1, (2,))})
    env = GymVectorEnv(_vec(obs_space), obs_map={"frames": "states"})
    assert env.spec.images == {} and env.spec.state_dim == 4 * 6 * 8 + 2
    obs, _ = env.reset(seed=0)
    assert obs["states"].shape == (2, 4 * 6 * 8 + 2) and obs["states"].dtype == torch.float32
    dropped = GymVectorEnv(_vec(obs_space), obs_map={"frames": None})
    assert dropped.spec.images == {} and dropped.spec.state_dim == 2
    with pytest.raises(ValueError, match="'frames'.*channel-first"):  # not as an image
        GymVectorEnv(_vec(obs_space), obs_map={"frames": "main_images"})


def test_obs_map_carries_a_channels_last_image_as_states():
    """``obs_map={"image": "states"}`` flattens the image into the state vector (it was taken
    for an image key named "states", and the first step failed on its shape)."""
    obs_space = spaces.Dict({"image": _uint8(6, 8, 3), "state": spaces.Box(-1, 1, (2,))})
    env = GymVectorEnv(_vec(obs_space), obs_map={"image": "states"})
    assert env.spec.images == {} and env.spec.state_dim == 6 * 8 * 3 + 2
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"states"} and obs["states"].dtype == torch.float32
    assert obs["states"].shape == (2, 6 * 8 * 3 + 2)
    obs = env.step(torch.zeros(2, 1))[0]
    assert obs["states"].shape == (2, 6 * 8 * 3 + 2)


@pytest.mark.parametrize("shape", [(32, 48, 3), (24, 24, 1), (16, 16, 4), (84, 84, 12),
                                   (4, 4, 4)])
def test_channel_last_uint8_observations_stay_images(shape):
    env = GymVectorEnv(_vec(spaces.Dict({"cam": _uint8(*shape)})))
    assert env.spec.images == {"main_images": shape}


def _success_after_one_step(success):
    env = GymVectorEnv(_vec(spaces.Box(-1, 1, (2,), np.float32), success))
    env.reset(seed=0)
    return env.step(torch.zeros(2, 1))[4]["success"]


@pytest.mark.parametrize("success", ["no", "yes", ("a", 1), [None], np.array("no")])
def test_a_success_flag_that_is_not_a_bool_or_number_is_refused(success):
    with pytest.raises(ValueError, match=r"info\['success'\] has dtype (object|<U2)"):
        _success_after_one_step(success)


@pytest.mark.parametrize("success,expected", [
    (False, [False, False]), (True, [True, True]), (np.bool_(True), [True, True]),
    (np.bool_(False), [False, False]), (0.0, [False, False]), (1.0, [True, True]),
    (np.float32(1.0), [True, True]), (1, [True, True]), (np.int64(0), [False, False]),
])
def test_bool_and_numeric_success_flags_are_read(success, expected):
    assert _success_after_one_step(success).tolist() == expected


def test_no_success_key_reads_as_not_successful():
    assert _success_after_one_step(None).tolist() == [False, False]


def _string_success_env():
    return _Env(spaces.Box(-1, 1, (2,), np.float32), "no")


gymnasium.register("ZchannelStringSuccess-v0", entry_point=_string_success_env)


def test_a_string_success_is_refused_when_a_run_steps_the_env():
    """Through ``make_env``, as an env worker steps it."""
    env = make_env("gym:ZchannelStringSuccess-v0", 2)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"info\['success'\] has dtype object.*'no' \(str\)"):
        env.step(torch.zeros(2, 1))


@pytest.mark.parametrize("target", [5, 1.5, ["main_images"], True])
def test_an_obs_map_target_that_is_not_a_key_is_refused_naming_it(target):
    """Refused when the env is made, not a step later inside the policy."""
    obs_space = spaces.Dict({"cam": _uint8(8, 8, 3), "state": spaces.Box(-1, 1, (2,))})
    with pytest.raises(ValueError, match=r"obs_map maps \{'cam': .*\}: each leaf goes to an "
                       r"image key \(a string"):
        GymVectorEnv(_vec(obs_space), obs_map={"cam": target})


@pytest.mark.parametrize("obs_space, obs_map", [
    (spaces.Box(-1, 1, (0,)), None),
    (spaces.Box(-1, 1, (3,)), {"<observation>": None}),
    (spaces.Dict({"cam": _uint8(8, 8, 3), "state": spaces.Box(-1, 1, (2,))}),
     {"cam": None, "state": None}),
], ids=["empty-box", "only-leaf-dropped", "every-leaf-dropped"])
def test_an_observation_that_gives_the_policy_nothing_is_refused_when_made(obs_space, obs_map):
    """No state column and no image: refused when the env is made (the demo's check before
    anything starts), not later inside the workers' policy."""
    with pytest.raises(ValueError, match="give a policy nothing to see"):
        GymVectorEnv(_vec(obs_space), obs_map=obs_map)


def test_an_action_space_of_no_actions_is_refused_naming_it():
    env = gymnasium.vector.SyncVectorEnv([lambda: _Env(spaces.Box(-1, 1, (2,)))] * 2)
    env.single_action_space = spaces.Box(-1, 1, (0,), np.float32)
    with pytest.raises(ValueError, match=r"action space Box\(.*\) has no action to take"):
        GymVectorEnv(env)
