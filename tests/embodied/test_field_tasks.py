"""What users' own Gymnasium tasks report reaches recording and training: the recording info
of a lerobot run (success, expert interventions), an env's executed expert actions in the
trajectory PPO trains on (in the policy's action space, whatever the env's Box bounds or
Discrete start), an RGBA camera refused before a dataset run starts, a task module in the
working directory found by ``zchannel demo embodied``, a Discrete observation outside its space
refused naming it.  The tasks live in a module written to ``tmp_path`` that the workers import
through ``PYTHONPATH``; the runs start real env, rollout and actor processes over brokers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

gymnasium = pytest.importorskip("gymnasium")

from zchannel.embodied.envs import ChunkedEnv, make_env  # noqa: E402
from zchannel.embodied.runners import RunConfig, run  # noqa: E402
from zchannel.embodied.spaces import ObservationError  # noqa: E402

pytestmark = pytest.mark.timeout(240)

MODULE = "fieldtasks"
TASKS = textwrap.dedent('''
    """Tasks of the embodied field tests (written by tests/embodied/test_field_tasks.py)."""
    import os

    import gymnasium as gym
    import numpy as np
    from gymnasium import spaces
    from zchannel.embodied.models import ActorCritic


    class Teleop(gym.Env):
        """An expert always takes over and executes ``expert`` (in the env's action space);
        the task counts as solved once reached; episodes of 4 steps."""

        observation_space = spaces.Box(-1, 1, (2,), np.float32)

        def __init__(self, low=-1.0, high=1.0, expert=0.5, discrete_start=None):
            if discrete_start is None:
                self.action_space = spaces.Box(low, high, (1,), np.float32)
                self.expert = np.array([expert], np.float32)
            else:
                self.action_space = spaces.Discrete(3, start=discrete_start)
                self.expert = int(expert)
            self.t = 0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return np.zeros(2, np.float32), {}

        def step(self, action):
            self.t += 1
            expert = self.expert.copy() if isinstance(self.expert, np.ndarray) else self.expert
            info = {"intervene_action": expert, "intervene_flag": True,
                    "success_once": True}
            return np.zeros(2, np.float32), 0.0, False, self.t >= 4, info


    class RGBACam(gym.Env):
        """An RGBA camera; its first step leaves the file $FIELD_STEPPED (a worker ran)."""

        observation_space = spaces.Box(0, 255, (16, 16, 4), np.uint8)
        action_space = spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return np.zeros((16, 16, 4), np.uint8), {}

        def step(self, action):
            self.t += 1
            open(os.environ["FIELD_STEPPED"], "a").close()
            return np.zeros((16, 16, 4), np.uint8), 1.0, False, self.t >= 5, {}


    class BadDiscrete(gym.Env):
        """A Discrete(4) observation whose steps return ``value``."""

        observation_space = spaces.Discrete(4)
        action_space = spaces.Discrete(2)

        def __init__(self, value=-1):
            self.value = value

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return 0, {}

        def step(self, action):
            return self.value, 0.0, False, False, {}


    gym.register("FieldTeleop-v0", entry_point=Teleop)
    gym.register("FieldRGBA-v0", entry_point=RGBACam)
    gym.register("FieldBadDiscrete-v0", entry_point=BadDiscrete)


    class Spy(ActorCritic):
        """Writes every action the actor's PPO update re-scores to $FIELD_SPY."""

        def evaluate(self, forward_inputs, actions):
            with open(os.environ["FIELD_SPY"], "a") as f:
                f.write(" ".join(f"{x:.4f}" for x in actions.reshape(-1).tolist()) + "\\n")
            return super().evaluate(forward_inputs, actions)


    def spy(spec, cfg):
        return Spy(spec, cfg.num_action_chunks)
''')


@pytest.fixture
def tasks(tmp_path, monkeypatch):
    """The task module in ``tmp_path``, importable here and in the workers."""
    (tmp_path / f"{MODULE}.py").write_text(TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    return tmp_path


def test_a_lerobot_run_records_the_gym_envs_intervention_and_success(tasks):
    """GymVectorEnv passes the recording info on: every frame is the expert's action, marked
    as an intervention, of an episode that succeeded (``success_once``)."""
    cfg = RunConfig(env=f"gym:{MODULE}:FieldTeleop-v0", mode="lerobot", envs=1, env_batch=2,
                    num_chunks=4, num_action_chunks=1, steps=1)
    episodes = run(cfg)["recorded_episodes"]
    frames = [frame for episode in episodes for frame in episode]
    assert len(episodes) == 2 and len(frames) == 8
    assert [bool(f["intervention"]) for f in frames] == [True] * 8
    assert [round(float(f["action"][0]), 4) for f in frames] == [0.5] * 8
    assert [bool(f["next.success"]) for f in frames] == [True] * 8


@pytest.mark.parametrize("kwargs, expected", [
    ({"expert": 0.5}, [0.5]),  # Box(-1, 1): the env's and the policy's spaces agree
    ({"low": -2.0, "high": 2.0, "expert": 1.0}, [0.5]),  # Box(-2, 2): 1.0 is the policy's 0.5
    ({"low": 0.0, "high": 10.0, "expert": 2.5}, [-0.5]),
    ({"discrete_start": 5, "expert": 6}, [1.0]),  # Discrete(3, start=5): index 1
])
def test_an_env_intervention_lands_in_the_transition_in_the_policys_space(tasks, kwargs,
                                                                           expected):
    env = ChunkedEnv(make_env(f"gym:{MODULE}:FieldTeleop-v0", 2, kwargs), 2)
    env.reset(seed=0)
    out = env.step_chunk(torch.zeros(2, 2))
    transition = out.transition
    assert transition.intervene_flags is not None and transition.intervene_actions is not None
    assert transition.intervene_flags.tolist() == [[True, True], [True, True]]
    assert transition.intervene_actions.shape == (2, 2, 1)
    assert transition.intervene_actions.reshape(-1).tolist() == pytest.approx(expected * 4)


def test_ppo_trains_on_the_executed_expert_action_of_a_rescaled_box(tasks, monkeypatch):
    """Box(-2, 2), the expert executes 1.0: the actor's PPO update re-scores the policy-space
    0.5 (what the policy would have emitted for it), never the policy's own samples."""
    spy = tasks / "spy.txt"
    monkeypatch.setenv("FIELD_SPY", str(spy))
    cfg = RunConfig(env=f"gym:{MODULE}:FieldTeleop-v0", policy=f"{MODULE}:spy", envs=1,
                    env_batch=4, num_chunks=8, num_action_chunks=1, steps=1,
                    env_kwargs={"low": -2.0, "high": 2.0, "expert": 1.0})
    run(cfg)
    trained = sorted({float(x) for line in spy.read_text().split("\n") for x in line.split()})
    assert trained == [0.5]


def test_a_dataset_run_refuses_an_rgba_camera_before_any_worker_starts(tasks, monkeypatch):
    stepped = tasks / "stepped"
    monkeypatch.setenv("FIELD_STEPPED", str(stepped))
    cfg = RunConfig(env=f"gym:{MODULE}:FieldRGBA-v0", mode="lerobot", envs=1, env_batch=2,
                    steps=3, dataset=str(tasks / "ds"))
    with pytest.raises(ValueError, match=r"image 'main_images' .* has 4 channels") as err:
        run(cfg)
    assert "1 or 3 channels" in str(err.value)
    assert not stepped.exists(), "an env worker stepped before the refusal"
    assert not (tasks / "ds").exists()


def test_the_demo_imports_a_task_module_of_the_working_directory(tmp_path):
    """The console script (``sys.path[0]`` is its ``bin`` folder) finds ``mytasks.py`` in the
    working directory, in this process and in its workers, without ``PYTHONPATH``."""
    (tmp_path / "mytasks.py").write_text(textwrap.dedent('''
        import gymnasium as gym
        gym.register("FieldMine-v0", entry_point="gymnasium.envs.classic_control:CartPoleEnv",
                     max_episode_steps=20)
    '''))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = os.path.join(os.path.dirname(sys.executable), "zchannel")
    proc = subprocess.run([script, "demo", "embodied", "--env", "gym:mytasks:FieldMine-v0",
                           "--steps", "1", "--envs", "1", "--env-batch", "2", "--quiet"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "No module named" not in proc.stderr


@pytest.mark.parametrize("value", [-1, 4])
def test_a_discrete_observation_outside_its_space_is_refused(tasks, value):
    """-1 (a "no observation" sentinel) would be the one-hot of class 3, 4 an IndexError."""
    env = ChunkedEnv(make_env(f"gym:{MODULE}:FieldBadDiscrete-v0", 1, {"value": value}), 1)
    env.reset(seed=0)
    with pytest.raises(ObservationError, match=rf"observation '<observation>': {value} is not "
                                               r"in its space Discrete\(4\)"):
        env.step_chunk(torch.zeros(1, 1))


def test_a_negative_seed_is_refused_before_anything_starts():
    """Gymnasium refuses negative seeds in the env worker, after the workers started: the run
    configuration and the CLI refuse them first, naming the rule."""
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        RunConfig(seed=-1)
    script = os.path.join(os.path.dirname(sys.executable), "zchannel")
    proc = subprocess.run([script, "demo", "embodied", "--seed", "-1"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--seed" in proc.stderr
