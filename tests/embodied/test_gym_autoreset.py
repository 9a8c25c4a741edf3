"""The Gymnasium adapter in each of Gymnasium's autoreset modes (NextStep, SameStep, Disabled)
gives the trajectory Gymnasium's own sub-envs give when stepped one by one: the observation a
finished env ended in as ``info["final_observation"]``, the reset observation returned, the
step's success, and one reset per finished episode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gymnasium = pytest.importorskip("gymnasium")

from zchannel.embodied.envs import make_env  # noqa: E402
from zchannel.embodied.spaces import FINAL_MASK, FINAL_OBS  # noqa: E402

TOY_ID = "zchannel.embodied.toyenvs:TwoCameraReach-v0"
NUM_ENVS, SEED, MAX_STEPS, STEPS = 3, 11, 6, 24
GAINS = (8.0, -1.0, 3.0)  # env 0 and 2 head for the goal (successes), env 1 away (truncations)


def _actions(states: np.ndarray) -> np.ndarray:
    """Deterministic actions from the states ``[B, 4]`` (position, goal - position), in
    quarters: the adapter's Box mapping of [-1, 1] onto the bounds keeps them exact."""
    gains = np.asarray(GAINS, np.float32).reshape(-1, 1)
    return (np.round(np.clip(states[:, 2:] * gains, -1, 1) * 4) / 4).astype(np.float32)


def _converted(obs: dict) -> dict[str, np.ndarray]:
    """One sub-env's observation in the adapter's layout."""
    return {"states": obs["state"], "main_images": obs["main"], "wrist_images": obs["wrist"]}


def _reference():
    """Gymnasium's own sub-envs stepped one by one, reset as soon as an episode ends: per step
    (obs after the step, reward, terminated, truncated, success, final obs or None)."""
    envs = [gymnasium.make(TOY_ID, max_steps=MAX_STEPS) for _ in range(NUM_ENVS)]
    obs = [_converted(env.reset(seed=SEED + i)[0]) for i, env in enumerate(envs)]
    first = [dict(o) for o in obs]
    steps = []
    for _ in range(STEPS):
        actions = _actions(np.stack([o["states"] for o in obs]))
        row = []
        for i, env in enumerate(envs):
            raw, reward, term, trunc, info = env.step(actions[i])
            final = None
            if term or trunc:
                final = _converted(raw)
                raw, _ = env.reset()
            obs[i] = _converted(raw)
            row.append((obs[i], reward, term, trunc, bool(info["success"]), final))
        steps.append(row)
    return first, steps


@pytest.mark.parametrize("mode", ["NextStep", "SameStep", "Disabled"])
def test_every_autoreset_mode_gives_gymnasiums_own_trajectory(mode):
    first, steps = _reference()
    env = make_env(f"gym:{TOY_ID}", NUM_ENVS, {"max_steps": MAX_STEPS,
                                               "vector_kwargs": {"autoreset_mode": mode}})
    assert env.autoreset_mode == mode
    resets = [0] * NUM_ENVS
    for i, sub in enumerate(env.env.envs):  # count every reset of each sub-env
        def counted(*args, _reset=sub.reset, _i=i, **kwargs):
            resets[_i] += 1
            return _reset(*args, **kwargs)
        sub.reset = counted
    obs, _ = env.reset(seed=SEED)
    for key in ("states", "main_images", "wrist_images"):
        assert np.array_equal(obs[key].numpy(), np.stack([o[key] for o in first])), key
    episodes = 0
    for t, row in enumerate(steps):
        obs, reward, term, trunc, info = env.step(torch.from_numpy(_actions(obs["states"].numpy())))
        where = f"{mode}, step {t}"
        assert term.tolist() == [r[2] for r in row], where
        assert trunc.tolist() == [r[3] for r in row], where
        assert reward.tolist() == pytest.approx([r[1] for r in row]), where
        assert info["success"].dtype == torch.bool, where
        assert info["success"].tolist() == [r[4] for r in row], where
        done = [r[5] is not None for r in row]
        episodes += sum(done)
        for key in ("states", "main_images", "wrist_images"):
            assert np.array_equal(obs[key].numpy(), np.stack([r[0][key] for r in row])), \
                (where, key)
            if any(done):
                final = info[FINAL_OBS][key].numpy()
                for i in np.flatnonzero(done):
                    assert np.array_equal(final[i], row[i][5][key]), (where, key, i)
        if any(done):
            assert info[FINAL_MASK].tolist() == done, where
        else:
            assert FINAL_OBS not in info, where
    assert episodes >= 4 and any(r[4] for row in steps for r in row)  # successes and ends
    finished = [sum(row[i][5] is not None for row in steps) for i in range(NUM_ENVS)]
    assert resets == [1 + n for n in finished]  # the first reset and one per episode


def test_an_unknown_autoreset_mode_is_refused_by_name():
    vec = gymnasium.make_vec("CartPole-v1", num_envs=1, vectorization_mode="sync")
    vec.metadata = {**vec.metadata, "autoreset_mode": "Sometimes"}
    with pytest.raises(ValueError, match=r"metadata\['autoreset_mode'\] is 'Sometimes', "
                                         r"expected one of \['NextStep', 'SameStep', 'Disabled'\]"):
        type(make_env("gym:CartPole-v1", 1))(vec)
    vec.close()
