"""The Gymnasium adapter's spaces and the policies a user starts from: every action kind and
observation layout converts both ways, unsupported spaces are refused by name, log-probabilities
are correct (tanh with its Jacobian), and bad observations are errors naming the key."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

gymnasium = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402
from zchannel.embodied.envs import ChunkedEnv, make_env  # noqa: E402
from zchannel.embodied.gymenv import GymVectorEnv, ObservationCheck  # noqa: E402
from zchannel.embodied.models import ActorCritic  # noqa: E402
from zchannel.embodied.normalize import ObsNormalizer, RewardScaler  # noqa: E402
from zchannel.embodied.spaces import (  # noqa: E402
    ActionSpec,
    EnvSpec,
    ObservationError,
    check_observation,
)

TOY = "gym:zchannel.embodied.toyenvs:SpacesToy-v0"
CAMERAS = "gym:zchannel.embodied.toyenvs:TwoCameraReach-v0"
KINDS = [("discrete", "dict"), ("multi_discrete", "tuple"), ("multi_binary", "box"),
         ("box", "dict")]


class _Env(gymnasium.Env):
    """An env with the given spaces (observations sampled from the space)."""

    def __init__(self, observation_space, action_space):
        self.observation_space, self.action_space = observation_space, action_space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        assert self.action_space.contains(action), action
        return self.observation_space.sample(), 0.0, False, False, {}


def _vec(observation_space, action_space, n=2):
    return gymnasium.vector.SyncVectorEnv([lambda: _Env(observation_space, action_space)] * n)


@pytest.mark.parametrize("action,obs", KINDS)
def test_every_action_kind_and_layout_round_trips(action, obs):
    env = make_env(TOY, 3, {"action": action, "obs": obs})
    spec = env.spec
    assert spec.action.kind == action and not spec.images
    expected_states = {"dict": 9, "tuple": 2, "box": 0}[obs] + {
        "discrete": 1, "multi_discrete": 3, "multi_binary": 4, "box": 2}[action]
    assert spec.state_dim == expected_states  # Discrete obs one-hot (9), MultiBinary 2 bits
    policy = ActorCritic(spec, num_action_chunks=2)
    chunked = ChunkedEnv(env, 2)
    chunked.reset(seed=0)
    for _ in range(6):  # 12 steps: every episode (8 steps) ends once, auto-reset in between
        out = policy(chunked.obs)
        assert out.forward_inputs["action"].shape == (3, 2 * spec.action.dim)
        logp, value, entropy = policy.evaluate(out.forward_inputs, out.forward_inputs["action"])
        assert torch.allclose(logp, out.prev_logprobs, atol=1e-5)
        assert value.shape == (3, 1) and entropy.shape == (3,)
        chunked.step_chunk(out.forward_inputs["action"])
    assert chunked.stats.lengths == [8, 8, 8]
    if spec.action.discrete:  # the env asserts its action space contains every action
        index = out.forward_inputs["action"].reshape(3, 2, -1)
        assert (index == index.round()).all() and (index >= 0).all()
        assert (index < torch.tensor(spec.action.nvec)).all()


def test_actions_reach_the_env_in_its_own_form():
    env = make_env(TOY, 2, {"action": "discrete"})
    assert env.to_space(torch.tensor([[0.0], [3.0]])).tolist() == [1, 4]  # Discrete(4, start=1)
    md = make_env(TOY, 2, {"action": "multi_discrete"})
    out = md.to_space(torch.tensor([[2.0, 1.0, 3.0], [0.0, 0.0, 0.0]]))
    assert out.dtype == md.action_space.dtype and out.shape == (2, 3)
    mb = make_env(TOY, 2, {"action": "multi_binary"})
    assert mb.to_space(torch.ones(2, 4)).dtype == np.int8
    box = make_env(TOY, 2, {"action": "box"})  # Box(-2, 2): [-1, 1] maps onto the bounds
    assert box.to_space(torch.tensor([[-1.0, 1.0], [0.0, 5.0]])).tolist() == [[-2, 2], [0, 2]]
    with pytest.raises(ValueError, match="outside the action space"):
        env.to_space(torch.tensor([[4.0], [0.0]]))
    with pytest.raises(ValueError, match="1 numbers per env"):
        md.to_space(torch.zeros(2, 1))


def test_an_integer_box_action_takes_one_equal_bin_of_the_range_per_integer():
    """Box(0, 3, int64): [-1, 1] is cut into four equal bins, one per integer (the last one
    closed at 1.0); the env's own check passes (``_Env.step``)."""
    env = GymVectorEnv(_vec(spaces.Box(-1, 1, (2,), np.float32),
                            spaces.Box(0, 3, (1,), np.int64), n=9))
    out = env.to_space(torch.linspace(-1, 1, 9).reshape(9, 1))
    assert out.dtype == np.int64 and out.shape == (9, 1)
    assert out.flatten().tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 3]  # 0.5 starts the last bin
    nearly = GymVectorEnv(_vec(spaces.Box(-1, 1, (2,), np.float32),
                               spaces.Box(-2, 2, (2,), np.int8), n=2))
    mapped = nearly.to_space(torch.tensor([[0.99, -0.99], [0.3, -0.3]]))
    assert mapped.dtype == np.int8 and mapped.tolist() == [[2, -2], [1, -1]]
    env.step(torch.linspace(-1, 1, 9).reshape(9, 1))


def test_a_uniform_output_reaches_every_integer_of_an_integer_box_equally_often():
    """Uniform outputs over [-1, 1] give each of Box(0, 3, int64)'s integers a quarter of the
    actions (rounding an affine map gave the end values half the share of the others:
    {0: 1/6, 1: 1/3, 2: 1/3, 3: 1/6}); an executed value maps back to the middle of its bin."""
    n = 4000
    env = GymVectorEnv(_vec(spaces.Box(-1, 1, (2,), np.float32),
                            spaces.Box(0, 3, (1,), np.int64), n=n))
    outputs = (torch.arange(n, dtype=torch.float32) + 0.5) / n * 2 - 1
    values, counts = np.unique(env.to_space(outputs.reshape(n, 1)), return_counts=True)
    assert values.tolist() == [0, 1, 2, 3] and counts.tolist() == [n // 4] * 4
    back = GymVectorEnv(_vec(spaces.Box(-1, 1, (2,), np.float32),
                             spaces.Box(0, 3, (1,), np.int64), n=4))
    middles = back.from_space(np.arange(4).reshape(4, 1))
    assert middles.flatten().tolist() == pytest.approx([-0.75, -0.25, 0.25, 0.75])
    assert back.to_space(torch.from_numpy(middles)).flatten().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("action", ["box", "discrete"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_action_is_refused_naming_the_policy_output(action, bad):
    env = make_env(TOY, 2, {"action": action})
    actions = torch.zeros(2, env.action_dim)
    actions[1, 0] = bad
    with pytest.raises(ValueError, match=r"policy output forward_inputs\['action'\] has "
                                         r"non-finite values \[(nan|inf)\] for env rows \[1\]"):
        env.to_space(actions)


def test_two_cameras_keep_their_shape_and_dtype_under_named_keys():
    env = make_env(CAMERAS, 2, {"size": 24})
    assert env.spec.images == {"main_images": (24, 24, 3), "wrist_images": (24, 24, 3)}
    assert env.spec.state_dim == 4
    obs, _ = env.reset(seed=3)
    assert obs["main_images"].dtype == torch.uint8 and obs["main_images"].shape == (2, 24, 24, 3)
    assert obs["wrist_images"].shape == (2, 24, 24, 3) and obs["states"].dtype == torch.float32
    raw, _ = make_env(CAMERAS, 2, {"size": 24}).env.reset(seed=3)
    assert np.array_equal(obs["main_images"].numpy(), raw["main"])  # the very pixels
    # an explicit map: both cameras as one stacked view tensor
    mapped = make_env(CAMERAS, 2, {"size": 24}, obs_map={"main": "extra_view_images",
                                                          "wrist": "extra_view_images"})
    assert mapped.spec.images == {"extra_view_images": (2, 24, 24, 3)}
    assert mapped.reset(seed=3)[0]["extra_view_images"].shape == (2, 2, 24, 24, 3)
    policy = ActorCritic(env.spec, 1)  # the CNN encoder reads both cameras
    out = policy(obs)
    logp, _, _ = policy.evaluate(out.forward_inputs, out.forward_inputs["action"])
    assert torch.allclose(logp, out.prev_logprobs, atol=1e-5)
    assert out.forward_inputs["main_images"].dtype == torch.uint8


def test_pixels_and_agent_pos_like_gym_pusht():
    obs_space = spaces.Dict({"pixels": spaces.Box(0, 255, (12, 12, 3), np.uint8),
                             "agent_pos": spaces.Box(0, 512, (2,), np.float64)})
    env = GymVectorEnv(_vec(obs_space, spaces.Box(0, 512, (2,), np.float32)))
    assert env.spec.images == {"main_images": (12, 12, 3)} and env.spec.state_dim == 2
    obs, _ = env.reset(seed=0)
    assert obs["states"].dtype == torch.float32 and obs["main_images"].dtype == torch.uint8
    env.step(torch.zeros(2, 2))


@pytest.mark.parametrize("obs_space,action_space,match", [
    (spaces.Dict({"text": spaces.Text(5)}), spaces.Discrete(2), r"Text.* at 'text'"),
    (spaces.Box(0, 1, (2,)), spaces.Dict({"a": spaces.Discrete(2)}), "action space Dict"),
    (spaces.Sequence(spaces.Discrete(2)), spaces.Discrete(2), "Sequence"),
])
def test_spaces_that_cannot_be_carried_are_refused_by_name(obs_space, action_space, match):
    with pytest.raises(ValueError, match=match):
        GymVectorEnv(_vec(obs_space, action_space))


def test_env_ids_kwargs_and_errors_name_the_forms_that_work():
    env = make_env("gym:Pendulum-v1", 2, {"max_episode_steps": 3, "g": 9.0})
    assert env.env.envs[0].unwrapped.g == 9.0  # kwargs reach the env
    with pytest.raises(ValueError, match=r"gym:<module>:<EnvId>.*gym_pusht:gym_pusht/PushT-v0"):
        make_env("gym:gym_pusht_missing/PushT-v0", 1)
    with pytest.raises(ValueError, match=r"forms that work: gym:<EnvId>"):
        make_env("gym:NoSuchEnv-v0", 1)
    with pytest.raises(ValueError, match="obs_map names"):
        make_env(CAMERAS, 1, obs_map={"top": "main_images"})


NEEDS_DEPENDENCY = """
import gymnasium


def _make(**kwargs):
    raise gymnasium.error.DependencyNotInstalled('pygame is not installed, run `pip install pygame`')


gymnasium.register("NeedsDependency-v0", entry_point=_make)
"""


def test_a_found_env_that_misses_a_dependency_is_reported_as_that_alone(tmp_path, monkeypatch):
    """An id that resolves but whose env (or module) needs a missing package: its error alone,
    chained, without the hint about the id's forms (a missing pygame read as a misnamed env)."""
    (tmp_path / "needs_dependency_env.py").write_text(NEEDS_DEPENDENCY)
    (tmp_path / "imports_dependency_env.py").write_text("import zchannel_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "needs_dependency_env", raising=False)
    try:
        with pytest.raises(ValueError) as err:
            make_env("gym:needs_dependency_env:NeedsDependency-v0", 1)
        assert str(err.value) == ("gym:needs_dependency_env:NeedsDependency-v0: pygame is not "
                                  "installed, run `pip install pygame`")
        assert isinstance(err.value.__cause__, gymnasium.error.DependencyNotInstalled)
        with pytest.raises(ValueError, match="zchannel_absent_dependency") as err:
            make_env("gym:imports_dependency_env:Any-v0", 1)
        assert "forms that work" not in str(err.value)
        assert isinstance(err.value.__cause__, ModuleNotFoundError)
        with pytest.raises(ValueError, match="forms that work"):  # the id names no env
            make_env("gym:needs_dependency_env:NoSuchEnv-v0", 1)
    finally:
        gymnasium.registry.pop("NeedsDependency-v0", None)
        sys.modules.pop("needs_dependency_env", None)


def test_bad_image_mid_run_names_the_key():
    class Broken(_Env):
        def step(self, action):
            obs, *rest = super().step(action)
            obs["main"] = obs["main"].astype(np.float32)
            return (obs, *rest)

    space = spaces.Dict({"main": spaces.Box(0, 255, (4, 4, 3), np.uint8)})
    vec = gymnasium.vector.SyncVectorEnv(
        [lambda: ObservationCheck(Broken(space, spaces.Discrete(2)))] * 2)
    env = GymVectorEnv(vec)
    env.reset(seed=0)
    with pytest.raises(ObservationError, match=r"'main': expected uint8 \[4, 4, 3\], got float32"):
        env.step(torch.zeros(2, 1))
    spec = EnvSpec(0, ActionSpec("discrete", 1, (2,)), {"main_images": (4, 4, 3)})
    with pytest.raises(ObservationError, match=r"'main_images': expected uint8 \[2, 4, 4, 3\]"):
        check_observation({"main_images": torch.zeros(2, 4, 4, 2, dtype=torch.uint8)}, spec, 2)


def test_tanh_gaussian_log_prob_matches_the_change_of_variables():
    spec = EnvSpec(3, ActionSpec("box", 2, low=(-1.0, -1.0), high=(1.0, 1.0)))
    policy = ActorCritic(spec, 1, init_log_std=0.5)
    obs = {"states": torch.randn(4096, 3)}
    out = policy(obs)
    mean = policy.actor(obs["states"])
    base = torch.distributions.Normal(mean, policy.log_std.exp())
    reference = torch.distributions.TransformedDistribution(
        base, [torch.distributions.transforms.TanhTransform(cache_size=1)])
    u = out.forward_inputs["raw_action"]
    expected = base.log_prob(u) - torch.log1p(-torch.tanh(u).pow(2) + 1e-12)
    inner = (out.forward_inputs["action"].abs() < 0.999).all(-1)  # away from float saturation
    assert torch.allclose(out.prev_logprobs[inner], expected[inner], atol=1e-4)
    assert torch.allclose(out.prev_logprobs[inner],
                          reference.log_prob(out.forward_inputs["action"])[inner], atol=1e-3)
    # an executed action that is not the policy's sample (an intervention) is scored by atanh
    replaced = dict(out.forward_inputs, action=torch.zeros(4096, 2))
    logp, _, _ = policy.evaluate(replaced, replaced["action"])
    assert torch.allclose(logp, base.log_prob(torch.zeros(4096, 2)), atol=1e-5)
    clip = ActorCritic(spec, 1, squash="clip")
    out = clip(obs)
    assert (out.forward_inputs["action"].abs() > 1).any()  # unbounded: the env clips
    entropy = clip.evaluate(out.forward_inputs, out.forward_inputs["action"])[2]
    assert math.isclose(float(entropy[0].detach()), 2 * 0.5 * (1 + math.log(2 * math.pi)),
                        rel_tol=1e-5)  # two unit Gaussians


def test_categorical_heads_sample_their_probabilities():
    spec = EnvSpec(1, ActionSpec("multi_discrete", 2, nvec=(3, 2)))
    policy = ActorCritic(spec, 1)
    policy.generator.manual_seed(0)
    out = policy({"states": torch.zeros(20000, 1)})
    logp_all = policy._logits(policy.features({"states": torch.zeros(1, 1)}))[0, 0]
    actions = out.forward_inputs["action"]
    for dim, n in enumerate((3, 2)):
        freq = torch.bincount(actions[:, dim].long(), minlength=n).float() / len(actions)
        assert torch.allclose(freq, logp_all[dim, :n].exp(), atol=0.02)
    assert (actions[:, 1] < 2).all()  # the padded third class of the second number never comes


def test_normalisers_follow_the_running_statistics():
    norm = ObsNormalizer(2)
    data = torch.randn(1000, 2) * torch.tensor([3.0, 0.5]) + torch.tensor([5.0, -1.0])
    for chunk in data.split(100):
        norm.update(chunk)
    assert torch.allclose(norm.mean.float(), data.mean(0), atol=1e-3)
    assert torch.allclose(norm.var.float(), data.var(0, unbiased=False), rtol=1e-3)
    assert abs(float(norm(data).mean())) < 1e-3
    policy = ActorCritic(EnvSpec(2, ActionSpec("discrete", 1, (2,))), 1, normalize_obs=True)
    assert "normalizer.mean" in policy.state_dict()  # travels with the weights
    policy.update_normalization({"states": data})
    assert torch.allclose(policy.normalizer.mean.float(), data.mean(0), atol=1e-2)
    scaler = RewardScaler(2, gamma=0.9)
    scaled = [scaler(torch.full((2,), 100.0), torch.zeros(2, dtype=torch.bool))
              for _ in range(50)]
    assert float(scaled[-1][0]) < 10.0  # large rewards scaled down by the return's std
