"""Env seeds and evaluation: every sub-env of every env worker starts from its own seed (and runs
with different seeds share none), the demo's evaluations use distinct seeds too, and
``evaluate`` weighs every env's first episode equally, however short its episodes are."""

from __future__ import annotations

import functools
import json
import threading

import numpy as np
import pytest

gymnasium = pytest.importorskip("gymnasium")

from click.testing import CliRunner  # noqa: E402
from gymnasium import spaces  # noqa: E402
from zchannel.cli import demo  # noqa: E402
from zchannel.cli.main import main as cli  # noqa: E402
from zchannel.embodied import runners  # noqa: E402
from zchannel.embodied.policy import RandomPolicy  # noqa: E402
from zchannel.embodied.runners import (  # noqa: E402
    RunConfig,
    build_policy,
    evaluate,
    run,
)

pytestmark = pytest.mark.timeout(120)


class SeedProbe(gymnasium.Env):
    """Records every seed it is reset with (``seeds``, shared by all instances of a process);
    episodes of 3 steps, reward 1 per step."""

    observation_space = spaces.Box(-1, 1, (2,), np.float32)
    action_space = spaces.Box(-1, 1, (1,), np.float32)
    seeds: list[int] = []
    lock = threading.Lock()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            with self.lock:
                self.seeds.append(seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(2, np.float32), 1.0, self.t >= 3, False, {}


class LengthBySeed(gymnasium.Env):
    """An env reset with an even seed has episodes of 1 step and never succeeds, one reset with
    an odd seed episodes of ``long`` steps that succeed; reward 1 per step."""

    observation_space = spaces.Box(-1, 1, (1,), np.float32)
    action_space = spaces.Box(-1, 1, (1,), np.float32)

    def __init__(self, long=8):
        self.long, self.length, self.t = long, 1, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.length = 1 if seed % 2 == 0 else self.long
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        done = self.t >= self.length
        return np.zeros(1, np.float32), 1.0, done, False, {"success": done and self.length > 1}


class NeverEnds(SeedProbe):
    """SeedProbe whose episodes never end."""

    def step(self, action):
        return np.zeros(2, np.float32), 1.0, False, False, {}


gymnasium.register("ZchannelSeedProbe-v0", entry_point=SeedProbe)
gymnasium.register("ZchannelNeverEnds-v0", entry_point=NeverEnds)
gymnasium.register("ZchannelLengthBySeed-v0", entry_point=LengthBySeed)


def test_every_sub_env_of_every_env_worker_gets_its_own_seed():
    """3 env workers of 4 envs (threads of an in-process run): 12 distinct seeds, the block
    ``(seed * envs + rank) * env_batch + i`` of this run's seed, so a run with another seed gets
    other ones."""
    SeedProbe.seeds.clear()
    cfg = RunConfig(env="gym:ZchannelSeedProbe-v0", transport="inproc", envs=3, env_batch=4,
                    steps=1, num_chunks=1, seed=1)
    run(cfg)
    seeds = sorted(SeedProbe.seeds)
    assert len(seeds) == len(set(seeds)) == 12, seeds
    assert seeds == list(range(1 * 3 * 4, 2 * 3 * 4))


def _demo_evaluation(tmp_path, monkeypatch, seed: int, env: str = "gym:ZchannelSeedProbe-v0",
                     *options: str) -> dict:
    """The demo's end-of-run evaluation on ``env`` (``run`` replaced by one record and the
    initial weights, so no workers start); the ``--json`` file's ``evaluation`` and, under
    ``"output"``, what the demo printed."""
    def one_step_run(cfg, on_step, ray_nodes):
        on_step({"step": 0, "policy_lag": 0, "mean_return": None})
        return {"final_weights": build_policy(cfg).state_dict(), "wall_s": 0.0,
                "placement": None, "config": cfg.to_dict(), "episodes": [], "rollout": {}}

    monkeypatch.setattr(demo, "_run_demo", one_step_run)
    path = tmp_path / f"run{seed}.json"
    result = CliRunner().invoke(cli, ["demo", "embodied", "--env", env, "--env-batch", "4",
                                      "--steps", "1", "--seed", str(seed), "--quiet", "--json",
                                      str(path), *options])
    assert result.exit_code == 0, result.output
    return {**json.loads(path.read_text())["evaluation"], "output": result.output}


def test_the_demo_evaluates_on_distinct_env_seeds(tmp_path, monkeypatch):
    """3 evaluations of 4 envs each: 12 distinct sub-env seeds, the trained and the random
    policy on the same ones, none shared with the evaluations of a run with another seed."""
    seen = []
    for seed in (0, 1):
        SeedProbe.seeds.clear()
        evaluation = _demo_evaluation(tmp_path, monkeypatch, seed)
        assert len(evaluation["seeds"]) == 3
        sub_env_seeds = sorted(SeedProbe.seeds)  # the trained policy's, then the random one's
        assert sub_env_seeds[::2] == sub_env_seeds[1::2], sub_env_seeds
        assert len(set(sub_env_seeds)) == 12, sub_env_seeds
        seen.append(set(sub_env_seeds))
    assert not seen[0] & seen[1]


def test_evaluate_counts_the_first_episode_of_each_env_once():
    """Env 0 (seed 0) finishes an episode every step (return 1, no success), env 1 (seed 1)
    one in 8 steps (return 8, success): each env's first episode counts once, so the mean
    return is 4.5 and the success rate 0.5, not dominated by env 0's many short episodes."""
    cfg = RunConfig(env="gym:ZchannelLengthBySeed-v0", env_batch=2, num_action_chunks=2)
    result = evaluate(cfg, RandomPolicy(1, 2, seed=0), episodes_seed=0)
    assert result == {"mean_return": 4.5, "success_rate": 0.5, "episodes": 2, "unfinished": 0}


def test_evaluate_leaves_out_an_env_without_a_finished_episode():
    cfg = RunConfig(env="gym:ZchannelLengthBySeed-v0", env_kwargs={"long": 1000}, env_batch=2,
                    num_action_chunks=2)
    result = evaluate(cfg, RandomPolicy(1, 2, seed=0), episodes_seed=0, max_chunks=3)
    assert result == {"mean_return": 1.0, "success_rate": 0.0, "episodes": 1, "unfinished": 1}



def test_an_evaluation_without_a_finished_episode_has_no_return():
    cfg = RunConfig(env="gym:ZchannelNeverEnds-v0", env_batch=2, num_action_chunks=2)
    result = evaluate(cfg, RandomPolicy(1, 2, seed=0), episodes_seed=0, max_chunks=3)
    assert result == {"mean_return": None, "success_rate": None, "episodes": 0, "unfinished": 2}


def test_the_demo_says_when_no_evaluation_episode_finished(tmp_path, monkeypatch):
    """Not a return of 0.00: the table line, the JSON (null) and the plot (no random-policy
    line) say there is none."""
    pytest.importorskip("matplotlib")
    # a never-ending env runs every evaluation to the chunk limit: 2,000 chunks, 6 times over
    monkeypatch.setattr(runners, "evaluate", functools.partial(runners.evaluate, max_chunks=20))
    plot = tmp_path / "never.png"
    evaluation = _demo_evaluation(tmp_path, monkeypatch, 0, "gym:ZchannelNeverEnds-v0",
                                  "--plot", str(plot))
    assert evaluation["trained_return"] is None and evaluation["random_return"] is None
    assert evaluation["trained_success"] is None and evaluation["random_success"] is None
    assert "trained policy: no episode finished   random policy: no episode finished" in \
        evaluation["output"]
    assert "(24 evaluation envs finished no episode" in evaluation["output"]
    assert plot.stat().st_size > 0
