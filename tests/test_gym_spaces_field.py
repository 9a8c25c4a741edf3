"""Gymnasium spaces at their edges, through the env adapter (``zchannel.embodied.gymenv``):

- a Tuple observation returned as a list (valid in Gymnasium) steps like a tuple, in process and
  through a runner's env workers; a malformed Dict or Tuple observation (a missing or extra key,
  a value that is not a dict, a tuple of the wrong length) is an ``ObservationError`` naming the
  leaf, never a bare ``KeyError`` / ``IndexError`` / ``TypeError``;
- Discrete / MultiDiscrete observations are one-hot encoded in ``B x n`` floats (no ``n x n``
  identity per step), and a leaf wider than 65,536 one-hot columns is refused when the env is
  made;
- a finite float64 observation beyond float32's range is reported as such, with the env's value,
  not as the ``inf`` of the cast;
- Discrete / MultiDiscrete actions of more than 2**24 classes (float32 chunks would round their
  indices) are refused when the env is made, and the largest index below the bound arrives
  exactly.

The envs are registered on import: the runner's env workers (spawned) import this module by its
name, ``gym:test_gym_spaces_field:<EnvId>``."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

gymnasium = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402
from zchannel.embodied import ActionSpec, ChunkedEnv, ObservationError  # noqa: E402
from zchannel.embodied.envs import make_env  # noqa: E402
from zchannel.embodied.gymenv import GymVectorEnv, ObservationCheck  # noqa: E402
from zchannel.embodied.runners import RunConfig, run  # noqa: E402

TUPLE_SPACE = spaces.Tuple((spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(4)))
EPISODE = 3  # low-level steps per episode of the envs below


class TupleObs(gymnasium.Env):
    """A Tuple(Box(3), Discrete(4)) observation, given as a ``list`` when ``as_list`` (what
    Gymnasium's ``Tuple.contains`` accepts); the values follow the step count."""

    metadata = {"render_modes": []}
    observation_space = TUPLE_SPACE
    action_space = spaces.Discrete(2)

    def __init__(self, as_list: bool = True) -> None:
        self.as_list, self.t = as_list, 0

    def _obs(self):
        obs = (np.full(3, self.t / 10, np.float32), np.int64(self.t % 4))
        return list(obs) if self.as_list else obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, False, self.t >= EPISODE, {}


gymnasium.register("ListTuple-v0", entry_point=TupleObs)


class Malformed(gymnasium.Env):
    """Returns ``bad`` (a callable of the good observation) instead of the observation at
    episode step ``at`` (0: the reset)."""

    metadata = {"render_modes": []}
    action_space = spaces.Discrete(2)

    def __init__(self, space, bad, at: int) -> None:
        self.observation_space, self.bad, self.at, self.t = space, bad, at, 0
        self.observation_space.seed(0)

    def _obs(self):
        good = self.observation_space.sample()
        return self.bad(good) if self.t == self.at else good

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 0.0, False, self.t >= EPISODE, {}


class WideAction(gymnasium.Env):
    """A Discrete(2**25 + 3) action."""

    metadata = {"render_modes": []}
    observation_space = spaces.Box(-1, 1, (2,), np.float32)
    action_space = spaces.Discrete(2**25 + 3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, False, False, {}


gymnasium.register("WideAction-v0", entry_point=WideAction)


class Fixed(gymnasium.Env):
    """Observation ``obs()`` every step (no env checker: ``SyncVectorEnv`` directly), actions
    of ``action_space`` recorded in ``taken``."""

    metadata = {"render_modes": []}

    def __init__(self, observation_space, obs, action_space=None) -> None:
        self.observation_space, self.obs = observation_space, obs
        self.action_space = action_space or spaces.Discrete(2)
        self.taken: list = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.obs(), {}

    def step(self, action):
        self.taken.append(action)
        return self.obs(), 0.0, False, False, {}


def _vec(make, n: int = 2):
    """``n`` sub-envs made by ``make``, each checked as ``make_gym_env`` checks them."""
    return gymnasium.vector.SyncVectorEnv([lambda: ObservationCheck(make())] * n)


def _chunked(make, n: int = 2) -> ChunkedEnv:
    return ChunkedEnv(GymVectorEnv(_vec(make, n)), 1, name="spaces")


def _run_episode(env: ChunkedEnv) -> list[torch.Tensor]:
    """Reset and step one episode; the ``states`` of each observation."""
    states = [env.reset(seed=0)["states"].clone()]
    for _ in range(EPISODE):
        states.append(env.step_chunk(torch.zeros(env.num_envs, 1, 1)).obs["states"].clone())
    return states


# -- Dict / Tuple observations -------------------------------------------------------------


def test_a_tuple_observation_given_as_a_list_steps_like_the_tuple():
    """Gymnasium accepts a list for a Tuple space (``Tuple.contains``, its vector envs): so
    does the adapter, with the same states as for the tuple."""
    assert TUPLE_SPACE.contains(list(TUPLE_SPACE.sample()))
    as_list = _run_episode(_chunked(lambda: TupleObs(as_list=True)))
    as_tuple = _run_episode(_chunked(lambda: TupleObs(as_list=False)))
    for got, want in zip(as_list, as_tuple, strict=True):
        assert torch.equal(got, want)
    assert torch.allclose(as_list[1], torch.tensor([[0.1, 0.1, 0.1, 0, 1, 0, 0]] * 2))


NESTED = spaces.Dict({"arm": spaces.Dict({"grip": spaces.Discrete(2),
                                          "pos": spaces.Box(-1, 1, (3,), np.float32)}),
                      "pair": spaces.Tuple((spaces.Discrete(3), spaces.Box(-1, 1, (2,),
                                                                           np.float32)))})


def _without_grip(obs):
    return {"arm": {"pos": obs["arm"]["pos"]}, "pair": obs["pair"]}


def _with_extra(obs):
    return {**obs, "zz": np.zeros(1, np.float32)}


def _arm_not_a_dict(obs):
    return {"arm": obs["arm"]["pos"], "pair": obs["pair"]}


def _short_pair(obs):
    return {"arm": obs["arm"], "pair": obs["pair"][:1]}


def _pair_an_int(obs):
    return {"arm": obs["arm"], "pair": 7}


MALFORMED = [
    (_without_grip, r"observation 'arm/grip' is missing: the env's dict 'arm' has the keys "
                    r"\['pos'\], its space \['grip', 'pos'\]"),
    (_with_extra, r"observation '<observation>': the keys \['zz'\] are not in its space"),
    (_arm_not_a_dict, r"observation 'arm': expected a dict with the keys \['grip', 'pos'\], "
                      r"got an array of float32 \[3\]"),
    (_short_pair, r"observation 'pair': expected a tuple \(or list\) of 2 entries, got a tuple "
                  r"of length 1"),
    (_pair_an_int, r"observation 'pair': expected a tuple \(or list\) of 2 entries, got the "
                   r"int 7"),
]


@pytest.mark.parametrize("at", [0, 2], ids=["at-reset", "at-step"])
@pytest.mark.parametrize("bad, message", MALFORMED,
                         ids=["missing-key", "extra-key", "not-a-dict", "short-tuple",
                              "not-a-tuple"])
def test_a_malformed_dict_or_tuple_observation_is_an_observation_error_naming_it(bad, message,
                                                                                 at):
    env = _chunked(lambda: Malformed(NESTED, bad, at))
    with pytest.raises(ObservationError, match=message):
        _run_episode(env)


@pytest.mark.timeout(120)
def test_a_run_over_a_tuple_observation_given_as_a_list_completes():
    """The same env through the sync runner's env workers, rollout and actor (real brokers):
    the run completes and saw its episodes (it ended with ``WorkerDied: … TypeError``)."""
    cfg = RunConfig(env="gym:test_gym_spaces_field:ListTuple-v0", envs=1, env_batch=2,
                    steps=1, num_chunks=4, num_action_chunks=1, seed=0)
    result = run(cfg)
    assert [r["step"] for r in result["records"]] == [0]
    assert result["records"][0]["episodes"] > 0


# -- Discrete / MultiDiscrete observations --------------------------------------------------


@pytest.mark.parametrize("space, index, columns", [
    (spaces.Discrete(4096, start=-5), lambda t: np.int64(t * 1000 - 5),
     lambda t: [t * 1000]),
    (spaces.MultiDiscrete([[3000, 5], [7, 1000]], start=[[1, 0], [0, -2]]),
     lambda t: np.array([[t + 1, t], [t, t - 2]], np.int64),
     lambda t: [t, 3000 + t, 3005 + t, 3012 + t]),
], ids=["discrete", "multi-discrete"])
def test_index_observations_are_one_hot_without_an_identity_matrix(space, index, columns):
    """The states of a step are the one-hot columns of the index (``start`` removed, one block
    per sub-space in order), and encoding them allocates about ``B x width`` floats, not the
    ``width x width`` identity (64 MB for Discrete(4096))."""
    steps = {"t": 0}
    env = GymVectorEnv(_vec(lambda: Fixed(space, lambda: index(steps["t"]))))
    width = env.spec.state_dim
    for t in (0, 1, 3):
        steps["t"] = t
        tracemalloc.start()
        try:
            obs, *_ = env.step(torch.zeros(2, 1))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        want = np.zeros(width, np.float32)
        want[columns(t)] = 1
        assert obs["states"].shape == (2, width)
        assert (obs["states"].numpy() == want).all()
        assert peak < 1_000_000, f"{peak} bytes traced to encode {width} columns for 2 envs"


@pytest.mark.parametrize("space, name", [
    (spaces.Dict({"token": spaces.Discrete(65537), "x": spaces.Box(-1, 1, (2,))}), "token"),
    (spaces.MultiDiscrete([40000, 30000]), "<observation>"),
])
def test_a_one_hot_leaf_wider_than_the_bound_is_refused_when_the_env_is_made(space, name):
    env = Fixed(space, space.sample)
    with pytest.raises(ValueError, match=rf"observation leaf '{name}' is .*: its one-hot "
                       r"encoding would be \d+ float32 columns of states per env, more than "
                       r"the 65536 zchannel encodes"):
        GymVectorEnv(_vec(lambda: env))


def test_a_one_hot_leaf_at_the_bound_is_carried_and_a_wider_one_can_be_dropped():
    at_bound = GymVectorEnv(_vec(lambda: Fixed(spaces.Discrete(65536), lambda: np.int64(65535))))
    assert at_bound.spec.state_dim == 65536
    assert at_bound.reset(seed=0)[0]["states"][:, -1].tolist() == [1.0, 1.0]
    space = spaces.Dict({"token": spaces.Discrete(1 << 20), "x": spaces.Box(-1, 1, (2,))})
    dropped = GymVectorEnv(_vec(lambda: Fixed(space, space.sample)), obs_map={"token": None})
    assert dropped.spec.state_dim == 2


# -- float64 observations beyond float32 ----------------------------------------------------


def test_a_float64_observation_beyond_float32_range_is_named_with_the_envs_value():
    """The env's 1e300 is finite: the error says it is beyond float32's range and gives it,
    instead of the ``inf`` zchannel's own cast made of it."""
    space = spaces.Dict({"far": spaces.Box(-np.inf, np.inf, (3,), np.float64)})
    steps = {"t": 0}

    def obs():
        far = np.zeros(3)
        if steps["t"] == 2:
            far[1] = -1e300
        return {"far": far}

    env = _chunked(lambda: Fixed(space, obs), n=1)
    env.reset(seed=0)
    env.step_chunk(torch.zeros(1, 1, 1))
    steps["t"] = 2
    with pytest.raises(ObservationError) as err:
        env.step_chunk(torch.zeros(1, 1, 1))
    message = str(err.value)
    assert "non-finite" not in message and "inf" not in message.replace("-1e+300", ""), message
    assert message.startswith("observation 'far': sub-env 0 returned the value -1e+300 (entry 1 "
                              "of the leaf), beyond the range of float32 (+-3.4028235e+38)")


def test_float64_values_float32_holds_pass_and_an_infinite_one_is_non_finite():
    """The largest float32 as a float64 arrives; an inf the env returned is still the env's
    non-finite value."""
    space = spaces.Box(-np.inf, np.inf, (2,), np.float64)
    big = float(np.finfo(np.float32).max)
    env = _chunked(lambda: Fixed(space, lambda: np.array([big, -big])), n=1)
    assert env.reset(seed=0)["states"].tolist() == [[big, -big]]
    env = _chunked(lambda: Fixed(space, lambda: np.array([np.inf, 0.0])), n=1)
    with pytest.raises(ObservationError, match="returned the non-finite observation "
                       "'<observation>' value inf"):
        env.reset(seed=0)


# -- Discrete / MultiDiscrete actions --------------------------------------------------------


@pytest.mark.parametrize("space", [spaces.Discrete(2**24 + 1),
                                   spaces.MultiDiscrete([3, 2**25 + 3])],
                         ids=["discrete", "multi-discrete"])
def test_an_action_index_of_more_than_2_24_classes_is_refused_when_the_env_is_made(space):
    """float32 chunks round such indices (2**25 + 2 arrives as 2**25): the env would get
    another action than the policy's without any error."""
    with pytest.raises(ValueError, match=r"action space .* cannot be carried: an index of "
                       r"\d+ classes, more than the 16777216 \(2\*\*24\) whose indices float32 "
                       r"action chunks hold exactly"):
        GymVectorEnv(_vec(lambda: Fixed(spaces.Box(-1, 1, (2,)), lambda: np.zeros(2, np.float32),
                                         action_space=space)))


def test_an_action_spec_of_more_than_2_24_classes_is_refused():
    """For envs that build their own ``EnvSpec`` (and specs read back with ``from_dict``)."""
    with pytest.raises(ValueError, match=r"16777217 classes in one action index"):
        ActionSpec("discrete", 1, nvec=(2**24 + 1,))
    assert ActionSpec("discrete", 1, nvec=(2**24,)).nvec == (2**24,)


def test_the_largest_index_of_a_2_24_class_action_arrives_exactly():
    made = []

    def make():
        made.append(Fixed(spaces.Box(-1, 1, (2,)), lambda: np.zeros(2, np.float32),
                          action_space=spaces.Discrete(2**24, start=-3)))
        return made[-1]

    env = GymVectorEnv(_vec(make, n=1))
    env.reset(seed=0)
    chunk = torch.tensor([[float(2**24 - 1)]], dtype=torch.float32)
    env.step(chunk)
    assert [int(a) for a in made[0].taken] == [2**24 - 1 - 3]


def test_make_env_refuses_a_too_wide_action_index():
    """``make_env`` (what the runners and the demo call) refuses it as a ``ValueError``, the
    demo's usage error."""
    with pytest.raises(ValueError, match=r"Discrete\(33554435\) cannot be carried"):
        make_env("gym:test_gym_spaces_field:WideAction-v0", 1)
