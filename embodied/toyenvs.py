"""Small Gymnasium envs for examples, tests and benchmarks (need the ``gym`` extra).

Importing this module registers them with Gymnasium, so a run names them in Gymnasium's
``module:EnvId`` form (each worker process imports the module itself):

- ``gym:zchannel.embodied.toyenvs:TwoCameraReach-v0`` — a point reaching a goal, seen by two
  cameras: ``Dict(main: uint8 (size, size, 3), wrist: uint8 (size, size, 3), state: Box(4))``,
  action ``Box(-1, 1, (2,))``; the main camera draws the point and the goal on the whole
  plane, the wrist camera the goal's offset around the point.  Reward: distance gained ×10, +1
  on success; 16 steps.  ``size`` (default 16) sets the image side (the benchmark uses 128).
- ``gym:zchannel.embodied.toyenvs:SpacesToy-v0`` — one env per action and observation space
  kind: ``action="discrete" | "multi_discrete" | "multi_binary" | "box"``, ``obs="box" | "dict"
  | "tuple"``.  The observation shows a target action; the reward is the fraction of action
  numbers that match it (Box: 1 − mean distance); 8 steps.  A policy that reads the target
  scores 1 per step, a random one much less.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    import gymnasium
    from gymnasium import spaces
except ImportError:  # pragma: no cover - the module needs the extra
    gymnasium = None
    spaces = None

_ENV_BASE: Any = gymnasium.Env if gymnasium is not None else object


class TwoCameraReach(_ENV_BASE):
    """See the module docstring."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, size: int = 16, max_steps: int = 16) -> None:
        self.size, self.max_steps = size, max_steps
        image = spaces.Box(0, 255, (size, size, 3), np.uint8)
        self.observation_space = spaces.Dict(
            {"main": image, "wrist": image, "state": spaces.Box(-3, 3, (4,), np.float32)})
        self.action_space = spaces.Box(-1, 1, (2,), np.float32)
        self.pos = np.zeros(2, np.float32)
        self.goal = np.zeros(2, np.float32)
        self.t = 0

    def _pixel(self, xy: np.ndarray, scale: float) -> tuple[int, int]:
        i = np.clip(((xy * scale + 1) / 2 * (self.size - 1)).round(), 0, self.size - 2)
        return int(i[1]), int(i[0])

    def _obs(self) -> dict[str, np.ndarray]:
        main = np.zeros((self.size, self.size, 3), np.uint8)
        r, c = self._pixel(self.pos, 1 / 1.5)
        main[r:r + 2, c:c + 2, 0] = 255
        r, c = self._pixel(self.goal, 1 / 1.5)
        main[r:r + 2, c:c + 2, 1] = 255
        wrist = np.zeros_like(main)
        r, c = self._pixel(np.clip(self.goal - self.pos, -1, 1), 1.0)
        wrist[r:r + 2, c:c + 2, 2] = 255
        wrist[:, :, 0] = np.uint8(self.t * 255 // self.max_steps)
        state = np.concatenate([self.pos, self.goal - self.pos]).astype(np.float32)
        return {"main": main, "wrist": wrist, "state": state}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple:
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        self.goal = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        self.t = 0
        return self._obs(), {}

    def step(self, action: np.ndarray) -> tuple:
        before = float(np.linalg.norm(self.goal - self.pos))
        self.pos = np.clip(self.pos + 0.15 * np.clip(action, -1, 1), -1.5, 1.5).astype(np.float32)
        after = float(np.linalg.norm(self.goal - self.pos))
        self.t += 1
        success = after < 0.15
        reward = 10.0 * (before - after) + float(success)
        return self._obs(), reward, success, self.t >= self.max_steps and not success, \
            {"success": success}


class SpacesToy(_ENV_BASE):
    """See the module docstring."""

    metadata: dict[str, Any] = {"render_modes": []}
    ACTIONS = ("discrete", "multi_discrete", "multi_binary", "box")
    OBSERVATIONS = ("box", "dict", "tuple")

    def __init__(self, action: str = "discrete", obs: str = "box", max_steps: int = 8) -> None:
        if action not in self.ACTIONS or obs not in self.OBSERVATIONS:
            raise ValueError(f"SpacesToy: action in {self.ACTIONS}, obs in {self.OBSERVATIONS}")
        self.kind, self.obs_kind, self.max_steps = action, obs, max_steps
        self.action_space = {
            "discrete": spaces.Discrete(4, start=1),
            "multi_discrete": spaces.MultiDiscrete([3, 2, 4]),
            "multi_binary": spaces.MultiBinary(4),
            "box": spaces.Box(-2, 2, (2,), np.float32),
        }[action]
        self.nvec = {"discrete": [4], "multi_discrete": [3, 2, 4], "multi_binary": [2] * 4,
                     "box": []}[action]
        width = 2 if action == "box" else len(self.nvec)
        target = spaces.Box(-4, 4, (width,), np.float32)
        self.observation_space = {
            "box": target,
            "dict": spaces.Dict({"target": target, "clock": spaces.Discrete(max_steps + 1)}),
            "tuple": spaces.Tuple((target, spaces.MultiBinary(2))),
        }[obs]
        self.target = np.zeros(width, np.float32)
        self.t = 0

    def _new_target(self) -> None:
        if self.kind == "box":
            self.target = self.np_random.uniform(-1.5, 1.5, 2).astype(np.float32)
        else:
            self.target = np.array([self.np_random.integers(n) for n in self.nvec], np.float32)

    def _obs(self) -> Any:
        if self.obs_kind == "dict":
            return {"target": self.target.copy(), "clock": self.t}
        if self.obs_kind == "tuple":
            return self.target.copy(), np.array([self.t % 2, 1], np.int8)
        return self.target.copy()

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple:
        super().reset(seed=seed)
        self.t = 0
        self._new_target()
        return self._obs(), {}

    def step(self, action: Any) -> tuple:
        if self.kind == "box":
            reward = 1.0 - float(np.abs(np.asarray(action) - self.target).mean())
        else:
            index = np.asarray(action).reshape(-1) - (1 if self.kind == "discrete" else 0)
            reward = float(np.mean(index == self.target))
        self.t += 1
        self._new_target()
        return self._obs(), reward, False, self.t >= self.max_steps, {}


if gymnasium is not None:
    for _id, _cls in (("TwoCameraReach-v0", TwoCameraReach), ("SpacesToy-v0", SpacesToy)):
        if _id not in gymnasium.registry:
            gymnasium.register(id=_id, entry_point=f"{__name__}:{_cls.__name__}")

__all__ = ["SpacesToy", "TwoCameraReach"]
