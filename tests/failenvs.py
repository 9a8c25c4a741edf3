"""A Gymnasium env that fails after a few steps, for the runners' error path
(``gym:failenvs:FailsAfterSteps-v0``; the workers import this module from ``PYTHONPATH``)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class FailsAfterSteps(gym.Env):
    """Three-float observations, one-float actions; its sixth step raises ``RuntimeError``."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.steps += 1
        if self.steps > 5:
            raise RuntimeError("the simulator lost its connection")
        return np.zeros(3, np.float32), 0.0, False, False, {}


gym.register("FailsAfterSteps-v0", entry_point=FailsAfterSteps)
