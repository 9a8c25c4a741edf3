"""The env side of the embodied pipeline: the ``VectorEnv`` protocol, action chunks, a toy task.

``VectorEnv`` follows the Gymnasium vector-env convention with same-step auto-reset:
``reset(seed=...) -> (obs, info)`` and ``step(actions [B, A]) -> (obs, reward [B], terminated [B],
truncated [B], info)``; an env that finishes is reset inside that ``step`` and the observation it
finished in is in ``info["final_observation"]`` (rows of ``info["_final_observation"]``).
Observations are dicts of batch-first tensors (``{"states": [B, S]}``).

``ChunkedEnv`` executes one action chunk ``[B, C, A]`` as C low-level steps and returns an
``EnvOutput`` whose transition has ``[B, C]`` rewards and flags and whose ``final_obs`` is the
post-chunk observation with the rows of envs that finished on the chunk's last slot replaced by
the observation they finished in (the boundary the rollout bootstraps from).  With
``record_episodes=True`` (lerobot mode) the transition also carries ``episode_data``: the
executed chunk, the observation each low-level action was chosen on (so LeRobot frames pair an
observation with the action taken in it) and each step's recording info
(``RECORDED_INFO_KEYS``: success and intervention flags).

``PointReach`` is a simulator-free task: a point in the plane moves by a clipped velocity towards
a random goal; reward is the distance gained (x10) plus 1 on success.  ``GymVectorEnv`` adapts a
Gymnasium vector env (optional extra ``gym``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from zchannel.embodied.types import EnvOutput, EnvTransition

FINAL_OBS = "final_observation"
FINAL_MASK = "_final_observation"
# the info keys a recorded step keeps (lerobot mode): success, expert intervention, recording
RECORDED_INFO_KEYS = ("success", "success_once", "success_at_end", "intervene_action",
                      "intervene_flag", "record_reset", "pre_record", "segment_advance")


@runtime_checkable
class VectorEnv(Protocol):
    """A batch of ``num_envs`` environments stepped together (Gymnasium vector-env convention)."""

    num_envs: int
    action_dim: int
    state_dim: int

    def reset(self, seed: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        ...

    def step(self, actions: torch.Tensor) -> tuple[
        dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]
    ]:
        ...


@dataclass
class EpisodeStats:
    """Finished-episode counters an env worker reports (reset by ``take``)."""

    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    successes: list[bool] = field(default_factory=list)

    def take(self) -> dict[str, list]:
        out = {"returns": self.returns, "lengths": self.lengths, "successes": self.successes}
        self.returns, self.lengths, self.successes = [], [], []
        return out


class PointReach:
    """B points reaching random goals in [-1, 1]^2; episodes of ``max_steps`` low-level steps.

    Observation ``states`` ``[B, 4]``: position and goal - position.  Action ``[B, 2]`` in
    [-1, 1], scaled by ``speed``.  Success (termination) when the distance falls below ``radius``.
    """

    state_dim = 4
    action_dim = 2

    def __init__(self, num_envs: int, *, max_steps: int = 16, speed: float = 0.15,
                 radius: float = 0.15) -> None:
        if num_envs < 1 or max_steps < 1:
            raise ValueError("PointReach needs num_envs >= 1 and max_steps >= 1")
        self.num_envs, self.max_steps, self.speed, self.radius = num_envs, max_steps, speed, radius
        self.gen = torch.Generator().manual_seed(0)
        self.pos = torch.zeros(num_envs, 2)
        self.goal = torch.zeros(num_envs, 2)
        self.t = torch.zeros(num_envs, dtype=torch.long)

    def _obs(self) -> dict[str, torch.Tensor]:
        return {"states": torch.cat([self.pos, self.goal - self.pos], dim=1)}

    def _reset_rows(self, rows: torch.Tensor) -> None:
        n = int(rows.sum())
        if n:
            self.pos[rows] = torch.rand(n, 2, generator=self.gen) * 2 - 1
            self.goal[rows] = torch.rand(n, 2, generator=self.gen) * 2 - 1
            self.t[rows] = 0

    def reset(self, seed: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if seed is not None:
            self.gen.manual_seed(seed)
        self._reset_rows(torch.ones(self.num_envs, dtype=torch.bool))
        return self._obs(), {}

    def step(self, actions: torch.Tensor) -> tuple[
        dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]
    ]:
        actions = torch.as_tensor(actions, dtype=torch.float32).reshape(self.num_envs, 2)
        before = (self.goal - self.pos).norm(dim=1)
        self.pos = (self.pos + self.speed * actions.clamp(-1, 1)).clamp(-1.5, 1.5)
        after = (self.goal - self.pos).norm(dim=1)
        self.t += 1
        terminated = after < self.radius
        truncated = (self.t >= self.max_steps) & ~terminated
        reward = 10.0 * (before - after) + terminated.float()
        info: dict[str, Any] = {"success": terminated.clone()}
        done = terminated | truncated
        if bool(done.any()):
            info[FINAL_OBS] = self._obs()
            info[FINAL_MASK] = done.clone()
            self._reset_rows(done)
        return self._obs(), reward, terminated, truncated, info


def _where_rows(mask: torch.Tensor, new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """``old`` with the rows selected by ``mask`` taken from ``new`` (tensor leaves only)."""
    out = dict(old)
    for name, value in new.items():
        if isinstance(value, torch.Tensor) and name in old:
            shape = (-1,) + (1,) * (value.dim() - 1)
            out[name] = torch.where(mask.reshape(shape), value, old[name])
    return out


class ChunkedEnv:
    """Executes action chunks ``[B, C, A]`` on a ``VectorEnv`` and keeps episode statistics."""

    def __init__(self, env: VectorEnv, num_action_chunks: int, *,
                 record_episodes: bool = False) -> None:
        if num_action_chunks < 1:
            raise ValueError("num_action_chunks must be >= 1")
        self.env, self.chunks = env, num_action_chunks
        self.record_episodes = record_episodes
        self.num_envs = env.num_envs
        self.stats = EpisodeStats()
        self._ret = torch.zeros(env.num_envs)
        self._len = torch.zeros(env.num_envs, dtype=torch.long)
        self.obs: dict[str, torch.Tensor] | None = None

    def reset(self, seed: int | None = None) -> dict[str, torch.Tensor]:
        self.obs, _ = self.env.reset(seed=seed)
        self._ret.zero_()
        self._len.zero_()
        return self.obs

    def step_chunk(self, actions: torch.Tensor) -> EnvOutput:
        """Run C low-level steps; ``actions`` is ``[B, C, A]`` or ``[B, C·A]``."""
        B, C = self.num_envs, self.chunks
        actions = torch.as_tensor(actions).reshape(B, C, -1)
        rewards = torch.zeros(B, C)
        terms = torch.zeros(B, C, dtype=torch.bool)
        truncs = torch.zeros(B, C, dtype=torch.bool)
        final_obs = None
        obs_list: list[dict[str, Any]] = []
        infos_list: list[dict[str, Any]] = []
        for c in range(C):
            if self.record_episodes:
                obs_list.append({k: v.clone() if isinstance(v, torch.Tensor) else v
                                 for k, v in (self.obs or {}).items()})
            obs, reward, term, trunc, info = self.env.step(actions[:, c])
            if self.record_episodes:
                infos_list.append({k: info[k] for k in RECORDED_INFO_KEYS if k in info})
            reward = torch.as_tensor(reward, dtype=torch.float32).reshape(B)
            term = torch.as_tensor(term, dtype=torch.bool).reshape(B)
            trunc = torch.as_tensor(trunc, dtype=torch.bool).reshape(B)
            rewards[:, c], terms[:, c], truncs[:, c] = reward, term, trunc
            self._ret += reward
            self._len += 1
            done = term | trunc
            if bool(done.any()):
                success = info.get("success", term)
                for b in torch.nonzero(done).flatten().tolist():
                    self.stats.returns.append(float(self._ret[b]))
                    self.stats.lengths.append(int(self._len[b]))
                    self.stats.successes.append(bool(torch.as_tensor(success).reshape(B)[b]))
                self._ret[done] = 0.0
                self._len[done] = 0
                if c == C - 1 and FINAL_OBS in info:
                    mask = torch.as_tensor(info.get(FINAL_MASK, done), dtype=torch.bool)
                    final_obs = _where_rows(mask.reshape(B), info[FINAL_OBS], obs)
            self.obs = obs
        episode_data = None
        if self.record_episodes:
            episode_data = {"chunk_actions": actions.clone(), "obs_list": obs_list,
                            "terminations": terms, "truncations": truncs,
                            "infos_list": infos_list}
        transition = EnvTransition(rewards=rewards, dones=terms | truncs, terminations=terms,
                                   truncations=truncs, episode_data=episode_data)
        return EnvOutput(obs=self.obs, transition=transition, final_obs=final_obs)


class GymVectorEnv:
    """Adapts a Gymnasium vector env with a flat Box observation and Box action space.

    Observations become ``{"states": float32 [B, S]}``; the adapter applies same-step auto-reset
    itself (it resets finished sub-envs by stepping Gymnasium's next-step auto-reset at once), so
    ``info["final_observation"]`` follows the ``VectorEnv`` convention.
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self.num_envs = int(env.num_envs)
        self.state_dim = int(np.prod(env.single_observation_space.shape))
        self.action_dim = int(np.prod(env.single_action_space.shape))
        self._low = torch.as_tensor(env.single_action_space.low, dtype=torch.float32)
        self._high = torch.as_tensor(env.single_action_space.high, dtype=torch.float32)

    def _states(self, obs: Any) -> dict[str, torch.Tensor]:
        return {"states": torch.as_tensor(np.asarray(obs), dtype=torch.float32)
                .reshape(self.num_envs, self.state_dim)}

    def reset(self, seed: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        obs, info = self.env.reset(seed=seed)
        return self._states(obs), info

    def step(self, actions: torch.Tensor) -> tuple[
        dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]
    ]:
        a = torch.as_tensor(actions, dtype=torch.float32).reshape(self.num_envs, self.action_dim)
        a = self._low + (a.clamp(-1, 1) + 1) * 0.5 * (self._high - self._low)
        obs, reward, term, trunc, info = self.env.step(a.numpy())
        term = torch.as_tensor(np.asarray(term), dtype=torch.bool)
        trunc = torch.as_tensor(np.asarray(trunc), dtype=torch.bool)
        out_info: dict[str, Any] = {"success": term.clone()}
        done = term | trunc
        states = self._states(obs)
        if bool(done.any()):
            # Gymnasium >= 1.0 resets on the next step(); reset the finished rows now instead.
            out_info[FINAL_OBS] = states
            out_info[FINAL_MASK] = done
            reset_obs, _ = self.env.reset(options={"reset_mask": done.numpy()})
            states = _where_rows(done, self._states(reset_obs), states)
        return states, torch.as_tensor(np.asarray(reward), dtype=torch.float32), term, trunc, out_info


def make_env(name: str, num_envs: int) -> VectorEnv:
    """``"point_reach"`` or ``"gym:<id>"`` (a Gymnasium vector env; extra ``gym``)."""
    if name == "point_reach":
        return PointReach(num_envs)
    if name.startswith("gym:"):
        try:
            import gymnasium
        except ImportError:
            raise RuntimeError(
                "gym: environments need gymnasium; install the extra: pip install 'zchannel[gym]'"
            ) from None
        return GymVectorEnv(gymnasium.make_vec(name[4:], num_envs=num_envs,
                                               vectorization_mode="sync"))
    raise ValueError(f"unknown env {name!r}: expected 'point_reach' or 'gym:<id>'")


__all__ = ["RECORDED_INFO_KEYS", "ChunkedEnv", "EpisodeStats", "GymVectorEnv", "PointReach", "VectorEnv", "make_env"]
