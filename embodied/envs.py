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
a random goal; reward is the distance gained (x10) plus 1 on success.  ``GymVectorEnv``
(``zchannel.embodied.gymenv``) adapts a Gymnasium vector env (optional extra ``gym``).
Every env describes its observations and actions with an ``EnvSpec`` (``spec``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from zchannel.embodied.gymenv import GymVectorEnv, make_gym_env
from zchannel.embodied.normalize import RewardScaler
from zchannel.embodied.spaces import (
    FINAL_MASK,
    FINAL_OBS,
    RECORDED_INFO_KEYS,
    EnvSpec,
    ObservationError,
    RewardError,
    box_spec,
    check_observation,
)
from zchannel.embodied.types import EnvOutput, EnvTransition


@runtime_checkable
class VectorEnv(Protocol):
    """A batch of ``num_envs`` environments stepped together (Gymnasium vector-env convention)."""

    num_envs: int
    action_dim: int
    state_dim: int
    spec: EnvSpec

    def reset(self, seed: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        ...

    def step(self, actions: torch.Tensor) -> tuple[
        dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]
    ]:
        ...


@dataclass
class EpisodeStats:
    """Every finished episode an env worker saw (reset by ``take``): its undiscounted return
    (before any reward scaling), length, success, and ``at``: the worker's env-step count when it
    finished (``num_envs`` per low-level step)."""

    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    successes: list[bool] = field(default_factory=list)
    at: list[int] = field(default_factory=list)

    def take(self) -> dict[str, list]:
        out: dict[str, list] = {"returns": self.returns, "lengths": self.lengths, "successes": self.successes,
               "at": self.at}
        self.returns, self.lengths, self.successes, self.at = [], [], [], []
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
        self.spec = box_spec(self.state_dim, self.action_dim)
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
    """Executes action chunks ``[B, C, A]`` on a ``VectorEnv`` and keeps episode statistics.

    ``reward_scaler`` (optional) scales the rewards put into the transition; the statistics
    keep the env's own rewards.  Every observation is checked against ``env.spec``
    (``ObservationError`` naming the key), its float values (and those of each finished
    sub-env's final observation) must be finite (``ObservationError`` naming the env, the
    sub-env, the observation leaf, its episode step and the chunk slot) and every reward must
    be finite (``RewardError`` naming the same, raised before the reward reaches the statistics
    or the transition).  ``name`` (default: the env's class name) names
    the env in those errors.  ``record_episodes`` attaches each chunk's ``episode_data``
    (lerobot mode).  An env that reports an expert intervention (``info["intervene_action"]``
    with ``info["intervene_flag"]``) gets it into the transition's ``intervene_actions`` /
    ``intervene_flags``, so the trajectory holds the action that was executed."""

    def __init__(self, env: VectorEnv, num_action_chunks: int, *,
                 reward_scaler: RewardScaler | None = None,
                 record_episodes: bool = False, name: str | None = None) -> None:
        if num_action_chunks < 1:
            raise ValueError("num_action_chunks must be >= 1")
        self.env, self.chunks = env, num_action_chunks
        self.name = name or type(env).__name__
        self.record_episodes = record_episodes
        self.num_envs = env.num_envs
        self.spec: EnvSpec | None = getattr(env, "spec", None)
        self.reward_scaler = reward_scaler
        self.stats = EpisodeStats()
        self.env_steps = 0
        self._ret = torch.zeros(env.num_envs)
        self._len = torch.zeros(env.num_envs, dtype=torch.long)
        self.obs: dict[str, torch.Tensor] | None = None

    def _checked(self, obs: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
                 when: Callable[[int], str] = lambda b: "at the reset of its episode",
                 ) -> dict[str, torch.Tensor]:
        """``obs`` checked against the spec, and its float values (those of the sub-envs
        ``rows``, default all) finite: ``ObservationError`` naming the env, the sub-env, the
        observation leaf and ``when(sub_env)``."""
        if self.spec is not None:
            check_observation(obs, self.spec, self.num_envs)
        for key, value in obs.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            flat = value.reshape(self.num_envs, -1)
            bad = ~torch.isfinite(flat)
            if rows is not None:
                bad &= rows.reshape(-1, 1)
            if bool(bad.any()):
                b, column = (int(i) for i in torch.nonzero(bad)[0])
                raise ObservationError(
                    f"env {self.name!r}: sub-env {b} returned the non-finite observation "
                    f"{self._leaf_name(key, column)!r} value {float(flat[b, column])} "
                    f"{when(b)}; observations must be finite (non-finite sub-envs: "
                    f"{torch.nonzero(bad.any(dim=1)).flatten().tolist()})")
        return obs

    def _leaf_name(self, key: str, column: int) -> str:
        """The observation leaf of column ``column`` of ``obs[key]`` (the env's
        ``state_names`` for ``states``, when it has them)."""
        names = getattr(self.env, "state_names", None)
        if key == "states" and names is not None and column < len(names):
            return str(names[column])
        return f"{key}[{column}]"

    def _check_step(self, obs: dict[str, torch.Tensor], reward: torch.Tensor,
                    done: torch.Tensor, info: dict[str, Any], slot: int) -> None:
        """Check one low-level step before the episode counters move: the reward finite, the
        observation checked, and so the observation each finished sub-env ended in."""
        self._check_reward(reward, slot)

        def at_step(b: int) -> str:
            return (f"at step {int(self._len[b]) + 1} of its episode (slot {slot} of the "
                    "action chunk)")

        if bool(done.any()) and isinstance(info.get(FINAL_OBS), dict):
            ended = torch.as_tensor(info.get(FINAL_MASK, done), dtype=torch.bool).reshape(-1)
            self._checked(info[FINAL_OBS], ended & done, at_step)
        self._checked(obs, None, lambda b: f"at the reset after {at_step(b)}" if done[b]
                      else at_step(b))  # (a finished sub-env's observation is its reset's)

    def _check_reward(self, reward: torch.Tensor, slot: int) -> None:
        bad = ~torch.isfinite(reward)
        if bool(bad.any()):
            b = int(torch.nonzero(bad).flatten()[0])
            raise RewardError(f"env {self.name!r}: sub-env {b} returned the non-finite reward "
                              f"{float(reward[b])} at step {int(self._len[b]) + 1} of its "
                              f"episode (slot {slot} of the action chunk); rewards must be "
                              f"finite (non-finite sub-envs: "
                              f"{torch.nonzero(bad).flatten().tolist()})")

    def reset(self, seed: int | None = None) -> dict[str, torch.Tensor]:
        obs, _ = self.env.reset(seed=seed)
        self.obs = self._checked(obs)
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
        expert = torch.zeros(B, C, actions.shape[-1])  # env-reported interventions
        intervened = torch.zeros(B, C, dtype=torch.bool)
        reported = False
        for c in range(C):
            if self.record_episodes:
                obs_list.append({k: v.clone() if isinstance(v, torch.Tensor) else v
                                 for k, v in (self.obs or {}).items()})
            obs, reward, term, trunc, info = self.env.step(actions[:, c])
            reward = torch.as_tensor(reward, dtype=torch.float32).reshape(B)
            term = torch.as_tensor(term, dtype=torch.bool).reshape(B)
            # a terminal state reached on a time limit's last step (Gymnasium's TimeLimit says
            # both) is terminal: it must not be bootstrapped as a truncation is
            trunc = torch.as_tensor(trunc, dtype=torch.bool).reshape(B) & ~term
            done = term | trunc
            self._check_step(obs, reward, done, info, c)
            if self.record_episodes:
                infos_list.append({k: info[k] for k in RECORDED_INFO_KEYS if k in info})
            self.env_steps += B
            self._ret += reward
            self._len += 1
            if self.reward_scaler is not None:
                reward = self.reward_scaler(reward, done)
            rewards[:, c], terms[:, c], truncs[:, c] = reward, term, trunc
            if "intervene_action" in info and "intervene_flag" in info:
                reported = True
                expert[:, c] = torch.as_tensor(info["intervene_action"],
                                               dtype=torch.float32).reshape(B, -1)
                intervened[:, c] = torch.as_tensor(info["intervene_flag"]).reshape(B).bool()
            if bool(done.any()):
                success = torch.as_tensor(info.get("success", term)).reshape(B)
                for b in torch.nonzero(done).flatten().tolist():
                    self.stats.returns.append(float(self._ret[b]))
                    self.stats.lengths.append(int(self._len[b]))
                    self.stats.successes.append(bool(success[b]))
                    self.stats.at.append(self.env_steps)
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
                                   truncations=truncs, episode_data=episode_data,
                                   intervene_actions=expert if reported else None,
                                   intervene_flags=intervened if reported else None)
        return EnvOutput(obs=self.obs, transition=transition, final_obs=final_obs)


def make_env(name: str, num_envs: int, env_kwargs: dict[str, Any] | None = None,
             obs_map: dict[str, str | None] | None = None) -> VectorEnv:
    """``"point_reach"`` (``env_kwargs``: ``max_steps``, ``speed``, ``radius``) or ``"gym:<id>"``
    (a Gymnasium vector env, extra ``gym``: ``env_kwargs`` go to ``gymnasium.make_vec``,
    ``obs_map`` names image keys; ``zchannel.embodied.gymenv``)."""
    if name == "point_reach":
        if obs_map:
            raise ValueError("obs_map applies to gym: environments only")
        return PointReach(num_envs, **dict(env_kwargs or {}))
    if name.startswith("gym:"):
        return make_gym_env(name[4:], num_envs, env_kwargs, obs_map)
    raise ValueError(f"unknown env {name!r}: expected 'point_reach' or 'gym:<id>'")


__all__ = ["RECORDED_INFO_KEYS", "ChunkedEnv", "EpisodeStats", "GymVectorEnv", "ObservationError",
           "PointReach", "RewardError", "VectorEnv", "make_env"]
