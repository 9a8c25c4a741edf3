"""PPO on the actor side: training rows from either output mode, and the clipped update.

``training_rows`` turns what an actor received into flat rows with the same packed names in both
modes: rollout-mode ``Trajectory`` shards go through ``to_training_batch`` and
``compute_advantages`` (the functions pipeline mode runs inside the broker), pipeline-mode
``ActorBatch`` micro-batches already hold them.  ``ppo_update`` runs clipped PPO with a value
loss on those rows, with the options of CleanRL's ``ppo.py`` (per-minibatch advantage
normalisation, clipped value loss, learning-rate annealing through the caller, an optional KL
stop): ``PPOConfig.cleanrl()`` gives its hyperparameters.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from zchannel.embodied.advantages import compute_advantages, to_training_batch
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.trajectory import ActorBatch, Trajectory

ROW_FIELDS = ("actions", "prev_logprobs", "advantages", "returns")


@dataclass(frozen=True)
class PPOConfig:
    """Clipped PPO.  The loss is ``pg − entropy_coef·entropy + value_coef·0.5·(V − R)²`` (CleanRL's
    form; ``clip_vloss`` takes the larger of the plain and the clipped value error).
    ``minibatch_adv_norm``: normalise advantages in each minibatch (CleanRL) instead of once per
    batch in ``compute_advantages`` (the plan's ``normalize_advantages``; a run sets it off
    when this is on).  ``anneal_lr``: the actor decays the learning rate linearly to 0 over the
    run.  ``target_kl``: stop the epochs of a step once the approximate KL passes it.

    Every field is checked when the config is made (``ValueError`` naming it): ``epochs`` and
    ``minibatches`` ints >= 1; ``lr``, ``clip`` and ``target_kl`` (unless None) finite and
    > 0; ``value_coef``, ``entropy_coef`` and ``adam_eps`` finite and >= 0; ``max_grad_norm``
    > 0 (``inf``: no clipping); the three switches bools."""

    lr: float = 3e-3
    clip: float = 0.2
    epochs: int = 4
    minibatches: int = 4
    value_coef: float = 1.0
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    adam_eps: float = 1e-8
    anneal_lr: bool = False
    minibatch_adv_norm: bool = False
    clip_vloss: bool = False
    target_kl: float | None = None

    def __post_init__(self) -> None:
        for name in ("epochs", "minibatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise _invalid(name, value, "an int >= 1")
        for name, positive in (("lr", True), ("clip", True), ("value_coef", False),
                               ("entropy_coef", False), ("adam_eps", False)):
            value = getattr(self, name)
            if not _finite(value) or value < 0 or (positive and value == 0):
                raise _invalid(name, value, f"a finite number {'>' if positive else '>='} 0")
        if not (_finite(self.max_grad_norm) or self.max_grad_norm == math.inf) \
                or self.max_grad_norm <= 0:
            raise _invalid("max_grad_norm", self.max_grad_norm, "a number > 0 (inf: no clipping)")
        if self.target_kl is not None and (not _finite(self.target_kl) or self.target_kl <= 0):
            raise _invalid("target_kl", self.target_kl, "None or a finite number > 0")
        for name in ("anneal_lr", "minibatch_adv_norm", "clip_vloss"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, getattr(self, name), "a bool")

    @classmethod
    def cleanrl(cls, **overrides: Any) -> PPOConfig:
        """CleanRL ``ppo.py``'s defaults (lr 2.5e-4 annealed, 4 epochs × 4 minibatches, clip
        0.2, entropy 0.01, value 0.5 with clipping, grad norm 0.5, Adam eps 1e-5, advantages
        normalised per minibatch)."""
        return cls(**{**dict(lr=2.5e-4, clip=0.2, epochs=4, minibatches=4, value_coef=0.5,
                             entropy_coef=0.01, max_grad_norm=0.5, adam_eps=1e-5,
                             anneal_lr=True, minibatch_adv_norm=True, clip_vloss=True),
                      **overrides})


def _finite(value: Any) -> bool:
    """Whether ``value`` is a finite real number (not a bool)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))


def _invalid(name: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"PPOConfig.{name} must be {expected}, got {value!r}")


def pack(batch: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dicts flattened to ``"parent::child"`` keys (the ActorBatch naming)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in batch.items():
        if isinstance(value, dict):
            out.update(pack(value, f"{prefix}{name}::"))
        elif isinstance(value, torch.Tensor):
            out[prefix + name] = value
    return out


def training_rows(items: Sequence[Any], plan: TrajectoryPlan, *,
                  normalization: str = "rlinf_actor") -> dict[str, torch.Tensor]:
    """Flat ``[rows, ...]`` tensors (``actions``, ``prev_logprobs``, ``advantages``, ``returns``,
    ``forward_inputs::*``) of one actor's items: Trajectory shards or ActorBatch micro-batches.

    Trajectory shards get their advantages here, normalised as ``normalization`` says
    (``advantages.NORMALIZATIONS``; by default as RLinf's embodied actor does); ActorBatch items
    were normalised in the broker (pooled, as RLinf's pipeline path does)."""
    if not items:
        raise ValueError("training_rows needs at least one item")
    if all(isinstance(item, ActorBatch) for item in items):
        packed = [item.data for item in items]
        return {k: torch.cat([p[k] for p in packed]) for k in packed[0]}
    if not all(isinstance(item, Trajectory) for item in items):
        raise TypeError("an actor's items are all Trajectory or all ActorBatch")
    batch = compute_advantages(to_training_batch(list(items), plan), plan,
                               normalization=normalization)
    flat = pack(batch)
    steps = flat["actions"].shape[0]
    rows = steps * flat["actions"].shape[1]
    out = {}
    for name, value in flat.items():
        if value.shape[0] == steps:  # per-chunk fields (not boundary rows)
            out[name] = value.reshape(rows, *value.shape[2:])
    if "prev_values" in flat:  # V(obs before chunk t): the first N of the N+1 value rows
        out["prev_values"] = flat["prev_values"][:steps].reshape(rows, -1)
    return out


def ppo_update(policy: Any, optimizer: torch.optim.Optimizer, rows: dict[str, torch.Tensor],
               cfg: PPOConfig, generator: torch.Generator) -> dict[str, float]:
    """Clipped PPO over ``rows``; returns mean policy loss, value loss, entropy, clip fraction
    and approximate KL.  Calls ``policy.update_normalization(forward_inputs)`` afterwards when
    the policy has it (running observation statistics)."""
    n = rows["actions"].shape[0]
    inputs = {k.split("::", 1)[1]: v for k, v in rows.items() if k.startswith("forward_inputs::")}
    adv = rows["advantages"].reshape(n, -1).sum(-1)
    old = rows["prev_logprobs"].reshape(n, -1).sum(-1)
    returns = rows.get("returns")
    returns = None if returns is None else returns.reshape(n, -1)[:, 0]
    old_values = rows.get("prev_values")
    old_values = None if old_values is None else old_values.reshape(n, -1)[:, 0]
    size = max(1, n // cfg.minibatches)
    totals = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0, "clip_frac": 0.0,
              "approx_kl": 0.0}
    count = 0
    for _ in range(cfg.epochs):
        perm = torch.randperm(n, generator=generator)
        kls = []
        for start in range(0, n, size):
            idx = perm[start:start + size]
            logp, values, entropy = policy.evaluate({k: v[idx] for k, v in inputs.items()},
                                                    rows["actions"][idx])
            log_ratio = logp.reshape(len(idx), -1).sum(-1) - old[idx]
            ratio = log_ratio.exp()
            a = adv[idx]
            if cfg.minibatch_adv_norm and len(idx) > 1:
                a = (a - a.mean()) / (a.std() + 1e-8)
            policy_loss = -torch.min(ratio * a, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * a).mean()
            loss = policy_loss - cfg.entropy_coef * entropy.mean()
            value_loss = torch.zeros(())
            if values is not None and returns is not None:
                v, r = values.reshape(len(idx), -1)[:, 0], returns[idx]
                error = (v - r).pow(2)
                if cfg.clip_vloss and old_values is not None:
                    v_old = old_values[idx]
                    clipped = v_old + (v - v_old).clamp(-cfg.clip, cfg.clip)
                    error = torch.max(error, (clipped - r).pow(2))
                value_loss = 0.5 * error.mean()
                loss = loss + cfg.value_coef * value_loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            optimizer.step()
            with torch.no_grad():
                approx_kl = float(((ratio - 1) - log_ratio).mean())
            kls.append(approx_kl)
            totals["policy_loss"] += float(policy_loss.detach())
            totals["value_loss"] += float(value_loss.detach())
            totals["entropy"] += float(entropy.mean().detach())
            totals["clip_frac"] += float(((ratio.detach() - 1).abs() > cfg.clip).float().mean())
            totals["approx_kl"] += approx_kl
            count += 1
        if cfg.target_kl is not None and kls[-1] > cfg.target_kl:
            break
    update = getattr(policy, "update_normalization", None)
    if update is not None:
        update(inputs)
    return {k: v / max(count, 1) for k, v in totals.items()}


__all__ = ["ROW_FIELDS", "PPOConfig", "pack", "ppo_update", "training_rows"]
