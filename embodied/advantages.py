"""Actor-side training-batch construction and advantage estimation (docs/embodied.md).

``to_training_batch`` turns a list of ``Trajectory`` shards into one training batch: it merges
their batches, folds the epochs into the batch dimension (docs/embodied.md), computes the loss mask
(step 3) and applies the reward filter (step 4).  ``compute_advantages`` adds ``advantages``
(and ``returns`` for gae) with one of the estimators gae, grpo, reinpp or raw and, when the
plan asks for it, the per-actor normalisation: ``"pooled"`` (the default, as the collector's
pipeline mode and RLinf's pipeline path: every estimator, population variance) or
``"rlinf_actor"`` (as RLinf's embodied actor: gae only, unbiased std + 1e-5).  Both the pipeline mode of the collector and every
non-pipeline consumer use exactly these two functions.

The functions only read attributes of ``plan`` (``TrajectoryPlan`` or any object with the same
attribute names).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.trajectory import Trajectory

__all__ = [
    "ADV_EPS_GRPO",
    "ADV_EPS_NORM",
    "ADV_EPS_REINPP",
    "NORMALIZATIONS",
    "apply_reward_filter",
    "compute_advantages",
    "compute_gae_advantages",
    "compute_group_scores",
    "compute_grpo_advantages",
    "compute_loss_mask",
    "compute_raw_advantages",
    "compute_reinpp_advantages",
    "normalize_advantages",
    "normalize_advantages_unbiased",
    "to_training_batch",
]

ADV_EPS_GRPO = 1e-6
"""Added to the group standard deviation by grpo."""
ADV_EPS_REINPP = 1e-8
"""Lower bound of reinpp's masked variance."""
ADV_EPS_NORM = 1e-5
"""Added to the variance by the pooled normalisation, to the std by the ``rlinf_actor`` one."""

_REWARD_TYPES = ("action_level", "chunk_level")


# ------------------------------------------------------------------------------------------
# to_training_batch


def to_training_batch(trajectories: Sequence[Any], plan: TrajectoryPlan) -> dict[str, Any]:
    """Build one actor's training batch from trajectory shards (docs/embodied.md).

    Concatenates the shards with ``Trajectory.to_batch``, merges the epochs into the batch
    dimension (``[T', E'·W, …]``), adds ``loss_mask``/``loss_mask_sum`` unless
    ``plan.auto_reset`` or ``plan.ignore_terminations``, and applies the reward filter when a
    reward bound is set.

    Raises ``ValueError`` for an empty list, for a batch whose epochs cannot be merged, for
    malformed ``dones``/``rewards`` and when the reward-filter width is not divisible by
    ``plan.group_size``.
    """
    if isinstance(trajectories, Trajectory):
        trajectories = [trajectories]
    trajectories = list(trajectories)
    if not trajectories:
        raise ValueError("to_training_batch needs at least one trajectory.")
    batch = Trajectory.to_batch(trajectories)
    return _finish_training_batch(batch, plan)


def _finish_training_batch(batch: dict[str, Any], plan: TrajectoryPlan) -> dict[str, Any]:
    """Steps 2-4 of ``to_training_batch`` on a ``to_batch`` dict: epochs, loss mask, reward filter."""
    batch = _merge_epochs(batch)
    if not plan.auto_reset and not plan.ignore_terminations:
        loss_mask, loss_mask_sum = compute_loss_mask(batch["dones"], plan.reward_type)
        batch["loss_mask"] = loss_mask
        batch["loss_mask_sum"] = loss_mask_sum
    lower, upper = plan.rewards_lower_bound, plan.rewards_upper_bound
    if lower is not None or upper is not None:
        apply_reward_filter(
            batch,
            group_size=plan.group_size,
            lower=lower,
            upper=upper,
            reward_type=plan.reward_type,
        )
    return batch


def _merge_epochs(batch: dict[str, Any]) -> dict[str, Any]:
    """Fold the epochs of a time-major batch into its batch dimension (docs/embodied.md).

    ``E' = rows(dones) − rows(actions)``.  Every tensor or numpy array leaf (also inside
    nested dicts) ``[E'·T', W, …]`` becomes ``[T', E'·W, …]`` of its own type; column
    ``e·W + w`` is env ``w`` of epoch ``e``.  Other values (e.g. None) are kept as they are.
    Returns a new dict; the input is not modified.

    Raises ``ValueError`` when ``dones`` or ``actions`` is missing, when ``E' < 1``, or when an
    array leaf has fewer than two dims or a row count not divisible by ``E'``.
    """
    dones, actions = batch.get("dones"), batch.get("actions")
    if not isinstance(dones, torch.Tensor) or not isinstance(actions, torch.Tensor):
        raise ValueError("A training batch needs 'dones' and 'actions' tensors to merge epochs.")
    if dones.dim() < 1 or actions.dim() < 1:
        raise ValueError("'dones' and 'actions' must have a time dimension.")
    epochs = dones.shape[0] - actions.shape[0]
    if epochs < 1:
        raise ValueError(
            f"Cannot merge epochs: dones has {dones.shape[0]} rows and actions "
            f"{actions.shape[0]}; every epoch must add one boundary row."
        )
    return _merge_epochs_dict(batch, epochs, prefix="")


def _merge_epochs_dict(values: dict[str, Any], epochs: int, prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            out[name] = _merge_epochs_dict(value, epochs, prefix=f"{path}.")
        elif isinstance(value, (torch.Tensor, np.ndarray)):
            out[name] = _merge_epochs_leaf(value, epochs, path)
        else:
            out[name] = value
    return out


def _merge_epochs_leaf(value: Any, epochs: int, path: str) -> Any:
    """One tensor or numpy array leaf ``[E'·T', W, …]`` as a contiguous ``[T', E'·W, …]`` of
    the same type."""
    if value.ndim < 2:
        raise ValueError(f"Cannot merge epochs of {path!r}: expected [time, batch, ...].")
    rows, width = value.shape[0], value.shape[1]
    if rows % epochs:
        raise ValueError(
            f"Cannot merge epochs of {path!r}: {rows} rows are not divisible by {epochs} epochs."
        )
    merged = value
    if epochs > 1:
        rest = tuple(value.shape[2:])
        per_epoch = rows // epochs
        merged = value.reshape(epochs, per_epoch, width, *rest).swapaxes(0, 1)
        merged = merged.reshape(per_epoch, epochs * width, *rest)
    if isinstance(merged, np.ndarray):
        return np.ascontiguousarray(merged)
    return merged.contiguous()


# ------------------------------------------------------------------------------------------
# to_training_batch step 3: loss mask


def _check_reward_type(reward_type: str) -> None:
    if reward_type not in _REWARD_TYPES:
        raise ValueError(f"reward_type must be one of {_REWARD_TYPES}, not {reward_type!r}.")


def _flatten_time_major(x: torch.Tensor) -> torch.Tensor:
    """``[rows, W, k] -> [rows·k, W]`` with flat row ``t = row·k + slot``."""
    rows, width, k = x.shape
    return x.permute(0, 2, 1).reshape(rows * k, width)


def _unflatten_time_major(x: torch.Tensor, k: int) -> torch.Tensor:
    """``[rows·k, W] -> [rows, W, k]``, the inverse of ``_flatten_time_major``."""
    n, width = x.shape
    return x.reshape(n // k, k, width).permute(0, 2, 1).contiguous()


def compute_loss_mask(
    dones: torch.Tensor, reward_type: str = "action_level"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss mask from the boundary dones ``[N+1, W, C]`` (docs/embodied.md: "The training batch").

    A step is valid until the first done *before* it (the step that ends the episode is still
    valid).  Returns ``(loss_mask, loss_mask_sum)``: bool ``[N, W, C]`` and int64 ``[N, W, C]``
    (the per-column count of valid entries), or for ``chunk_level`` the mask any'ed over slots
    and the sum's last slot, both ``[N, W, 1]``.

    Raises ``ValueError`` for a tensor that is not 3-D with at least two rows, or an unknown
    ``reward_type``.
    """
    _check_reward_type(reward_type)
    if not isinstance(dones, torch.Tensor) or dones.dim() != 3 or dones.shape[0] < 2:
        shape = tuple(dones.shape) if isinstance(dones, torch.Tensor) else type(dones).__name__
        raise ValueError(f"compute_loss_mask expects dones [N+1, W, C], got {shape}.")
    rows, width, slots = dones.shape
    n_steps = rows - 1
    flat = _flatten_time_major(dones.to(torch.bool))[-(n_steps * slots + 1) :]
    valid = (torch.cumsum(flat.to(torch.int64), dim=0) == 0)[:-1]
    loss_mask = valid.reshape(n_steps, slots, width).permute(0, 2, 1).contiguous()
    counts = loss_mask.sum(dim=(0, 2), dtype=torch.int64)
    loss_mask_sum = counts.view(1, width, 1).expand(n_steps, width, slots).contiguous()
    if reward_type == "chunk_level":
        loss_mask = loss_mask.any(dim=-1, keepdim=True)
        loss_mask_sum = loss_mask_sum[..., -1:].contiguous()
    return loss_mask, loss_mask_sum


# ------------------------------------------------------------------------------------------
# to_training_batch step 4: reward filter


def apply_reward_filter(
    batch: dict[str, Any],
    *,
    group_size: int,
    lower: float | None,
    upper: float | None,
    reward_type: str,
) -> dict[str, Any]:
    """Mask out groups whose mean masked reward sum lies outside ``[lower, upper]`` (in place).

    ``ρ_w = Σ_{t,c} rewards·loss_mask`` (the mask if present); groups are ``group_size``
    consecutive columns; a group is kept iff ``lower ≤ mean ≤ upper`` (a None bound is
    unbounded).  The keep mask is AND'ed into ``loss_mask``, or becomes ``loss_mask``
    broadcast to ``[N, W, C]`` (action_level) / ``[N, W, 1]`` (chunk_level).
    ``loss_mask_sum`` is left unchanged.  Returns the batch.

    Raises ``ValueError`` when rewards are missing or not ``[N, W, C]``, or when W is not
    divisible by ``group_size``.
    """
    _check_reward_type(reward_type)
    rewards = batch.get("rewards")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 3:
        raise ValueError("The reward filter needs rewards [N, W, C].")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}.")
    n_steps, width, slots = rewards.shape
    if width % group_size:
        raise ValueError(
            f"The reward filter needs the batch width {width} to be divisible by "
            f"group_size {group_size}."
        )
    loss_mask = batch.get("loss_mask")
    weighted = rewards.to(torch.float64)
    if loss_mask is not None:
        weighted = weighted * loss_mask.to(torch.float64)
    per_env = weighted.sum(dim=(0, 2))
    means = per_env.view(width // group_size, group_size).mean(dim=1)
    keep = torch.ones_like(means, dtype=torch.bool)
    if lower is not None:
        keep &= means >= lower
    if upper is not None:
        keep &= means <= upper
    keep_cols = keep.repeat_interleave(group_size).view(1, width, 1)
    if loss_mask is not None:
        batch["loss_mask"] = (loss_mask.to(torch.bool) & keep_cols).contiguous()
    else:
        k = 1 if reward_type == "chunk_level" else slots
        batch["loss_mask"] = keep_cols.expand(n_steps, width, k).contiguous()
    return batch


# ------------------------------------------------------------------------------------------
# estimators on flat [n, W] tensors


def compute_group_scores(rewards: torch.Tensor, dones: torch.Tensor) -> torch.Tensor:
    """Return of each column's first episode in the window: ``s ← s·(1 − d[t+1]) + r[t]``.

    ``rewards`` is ``[n, W]`` and ``dones`` ``[n+1, W]`` (``d[t+1]`` closes step t).
    Returns ``[W]`` in the rewards' dtype.
    """
    n = rewards.shape[0]
    not_done = 1.0 - dones.to(rewards.dtype)
    score = rewards.new_zeros(rewards.shape[1])
    for t in range(n - 1, -1, -1):
        score = score * not_done[t + 1] + rewards[t]
    return score


def _check_groups(width: int, group_size: int) -> None:
    if group_size < 1 or width % group_size:
        raise ValueError(
            f"Group scores need the batch width {width} to be divisible by group_size {group_size}."
        )


def compute_gae_advantages(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    values: torch.Tensor | None,
    *,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE on flat ``r [n,W]``, ``d [n+1,W]`` and ``v [n+1,W]``; returns ``(advantages, returns)``.

    ``δ_t = r_t + γ·v_{t+1}·(1−d_{t+1}) − v_t`` and ``A_t = δ_t + γλ·(1−d_{t+1})·A_{t+1}``;
    ``returns = A + v[:n]``.  Without values (critic-free) γ = λ = 1 and ``δ_t = r_t``, so both
    results are the reward-to-go.
    """
    n = rewards.shape[0]
    not_done = 1.0 - dones.to(rewards.dtype)
    advantages = torch.zeros_like(rewards)
    last = rewards.new_zeros(rewards.shape[1])
    if values is None:
        for t in range(n - 1, -1, -1):
            last = rewards[t] + not_done[t + 1] * last
            advantages[t] = last
        return advantages, advantages.clone()
    values = values.to(rewards.dtype)
    coef = gamma * gae_lambda
    for t in range(n - 1, -1, -1):
        delta = rewards[t] + gamma * values[t + 1] * not_done[t + 1] - values[t]
        last = delta + coef * not_done[t + 1] * last
        advantages[t] = last
    return advantages, advantages + values[:n]


def compute_grpo_advantages(
    rewards: torch.Tensor, dones: torch.Tensor, mask: torch.Tensor, *, group_size: int
) -> torch.Tensor:
    """GRPO: ``A_w = (s_w − mean_G)/(std_G + 1e-6)`` (unbiased std), ``A[t,w] = A_w·m[t,w]``.

    Raises ``ValueError`` when W is not divisible by ``group_size``.
    """
    width = rewards.shape[1]
    _check_groups(width, group_size)
    scores = compute_group_scores(rewards, dones).to(torch.float64)
    groups = scores.view(width // group_size, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, unbiased=True, keepdim=True)
    per_env = ((groups - mean) / (std + ADV_EPS_GRPO)).reshape(width)
    return (per_env.unsqueeze(0) * mask.to(torch.float64)).to(rewards.dtype)


def compute_reinpp_advantages(
    rewards: torch.Tensor, dones: torch.Tensor, mask: torch.Tensor, *, group_size: int
) -> torch.Tensor:
    """REINFORCE++: the score placed on every step up to the last masked one, whitened.

    ``q[t,w] = s_w`` for ``t ≤ e_w`` (the last t with ``m[t,w]``, n−1 if none), else 0;
    ``A = (q − μ)·rsqrt(max(σ², 1e-8))`` with μ, σ² the masked mean and mean squared deviation.
    No baseline, no KL term.  Raises ``ValueError`` when W is not divisible by ``group_size``.
    """
    n, width = rewards.shape
    _check_groups(width, group_size)
    if n == 0:
        return rewards.new_zeros(rewards.shape)
    scores = compute_group_scores(rewards, dones).to(torch.float64)
    m = mask.to(torch.bool)
    steps = torch.arange(n).unsqueeze(1).expand(n, width)
    last = torch.where(m, steps, torch.full_like(steps, -1)).amax(dim=0)
    last = torch.where(last < 0, torch.full_like(last, n - 1), last)
    q = torch.where(steps <= last.unsqueeze(0), scores.unsqueeze(0), torch.zeros_like(scores))
    mf = m.to(torch.float64)
    count = mf.sum().clamp_min(1.0)
    mu = (q * mf).sum() / count
    var = (((q - mu) ** 2) * mf).sum() / count
    return ((q - mu) * torch.rsqrt(var.clamp_min(ADV_EPS_REINPP))).to(rewards.dtype)


def compute_raw_advantages(
    rewards: torch.Tensor, dones: torch.Tensor, mask: torch.Tensor, *, group_size: int
) -> torch.Tensor:
    """Raw scores: ``A[t,w] = s_w·m[t,w]``.  Raises ``ValueError`` for an indivisible width."""
    _check_groups(rewards.shape[1], group_size)
    scores = compute_group_scores(rewards, dones)
    return scores.unsqueeze(0) * mask.to(rewards.dtype)


# ------------------------------------------------------------------------------------------
# normalisation


def normalize_advantages(
    advantages: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Whiten advantages with float64 statistics over the masked entries (docs/embodied.md).

    ``mean = sum/max(count,1)``, ``var = sumsq/count − mean²`` (population variance) and
    ``adv ← (adv − mean)·rsqrt(max(var,0) + 1e-5)`` on every entry, returned as float32.
    ``loss_mask`` is broadcast to the advantages; None selects every entry.  With no selected
    entry the advantages are returned unchanged.
    """
    adv64 = advantages.to(torch.float64)
    if loss_mask is None:
        weight = torch.ones_like(adv64)
    else:
        weight = torch.broadcast_to(loss_mask.to(torch.bool), adv64.shape).to(torch.float64)
    count = weight.sum()
    if count.item() == 0:
        return advantages
    total = (adv64 * weight).sum()
    total_sq = (adv64 * adv64 * weight).sum()
    mean = total / count.clamp_min(1.0)
    var = total_sq / count - mean * mean
    scale = torch.rsqrt(var.clamp_min(0.0) + ADV_EPS_NORM)
    return ((adv64 - mean) * scale).to(torch.float32).contiguous()


def normalize_advantages_unbiased(
    advantages: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Whiten advantages as RLinf's embodied actor does for gae (``safe_normalize`` of
    ``rlinf/algorithms/utils.py``): ``(adv − mean) / (std + 1e-5)`` on every entry, with the mean
    and the **unbiased** standard deviation of the masked entries (float64, returned as
    float32).  With no selected entry the advantages are unchanged; with one, its std counts as
    0 (RLinf's gives NaN there).
    """
    adv64 = advantages.to(torch.float64)
    if loss_mask is None:
        selected = adv64.reshape(-1)
    else:
        selected = adv64[torch.broadcast_to(loss_mask.to(torch.bool), adv64.shape)]
    if selected.numel() == 0:
        return advantages
    std = selected.std() if selected.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return ((adv64 - selected.mean()) / (std + ADV_EPS_NORM)).to(torch.float32).contiguous()


NORMALIZATIONS = ("pooled", "rlinf_actor")
"""``compute_advantages(normalization=...)``: ``"pooled"`` whitens every estimator with the
population variance (``normalize_advantages``); ``"rlinf_actor"`` whitens gae only, with the
unbiased std (``normalize_advantages_unbiased``), and leaves grpo, reinpp and raw as their
estimator gives them."""


# ------------------------------------------------------------------------------------------
# compute_advantages


def _as_steps(x: torch.Tensor, name: str, rows: int, width: int, k: int) -> torch.Tensor:
    """Check ``x`` is ``[rows, W, k]`` (a last dim of 1 is expanded to k for masks)."""
    if x.dim() != 3 or x.shape[0] != rows or x.shape[1] != width:
        raise ValueError(f"{name} must be [{rows}, {width}, {k}], got {tuple(x.shape)}.")
    if x.shape[2] != k:
        if x.shape[2] != 1:
            raise ValueError(f"{name} must have last dim {k} (or 1), got {tuple(x.shape)}.")
        x = x.expand(rows, width, k)
    return x


def _checked_inputs(batch: dict[str, Any], plan: TrajectoryPlan,
                    normalization: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_advantages``' rewards and dones, with its settings checked."""
    _check_reward_type(plan.reward_type)
    if plan.adv_type not in ("gae", "grpo", "reinpp", "raw"):
        raise ValueError(f"Unknown advantage estimator {plan.adv_type!r}.")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}.")
    rewards = batch.get("rewards")
    dones = batch.get("dones")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 3:
        raise ValueError("compute_advantages needs rewards [N, W, C].")
    if not isinstance(dones, torch.Tensor) or dones.dim() != 3:
        raise ValueError("compute_advantages needs dones [N+1, W, C].")
    n_chunks, width, _ = rewards.shape
    if dones.shape[0] != n_chunks + 1 or dones.shape[1] != width:
        raise ValueError(
            f"dones must have {n_chunks + 1} rows and width {width}, got {tuple(dones.shape)}."
        )
    return rewards, dones


def _per_step(rewards: torch.Tensor, dones: torch.Tensor, loss_mask: Any,
              reward_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Rewards, dones and loss mask per reward step (one per chunk for chunk-level rewards:
    summed, max'ed), and ``k``, the steps per chunk."""
    n_chunks, width, slots = rewards.shape
    if reward_type == "chunk_level":
        rewards = rewards.sum(dim=-1, keepdim=True)
        dones = dones.any(dim=-1, keepdim=True)
        if loss_mask is not None:
            loss_mask = _as_steps(loss_mask, "loss_mask", n_chunks, width, loss_mask.shape[-1])
            loss_mask = loss_mask.to(torch.bool).any(dim=-1, keepdim=True)
        return rewards, dones, loss_mask, 1
    if dones.shape[2] != slots:
        raise ValueError(f"dones must have last dim {slots}, got {tuple(dones.shape)}.")
    if loss_mask is not None:
        loss_mask = _as_steps(loss_mask, "loss_mask", n_chunks, width, slots).to(torch.bool)
    return rewards, dones, loss_mask, slots


def _gae_values(prev_values: Any, n_chunks: int, width: int, k: int,
                reward_type: str) -> torch.Tensor | None:
    """The batch's ``prev_values`` checked against ``[N+1, W, k]`` (None: critic-free)."""
    if prev_values is None:
        return None
    if (
        not isinstance(prev_values, torch.Tensor)
        or prev_values.dim() != 3
        or prev_values.shape[0] != n_chunks + 1
        or prev_values.shape[1] != width
        or prev_values.shape[2] != k
    ):
        shape = getattr(prev_values, "shape", None)
        raise ValueError(
            f"prev_values must be [{n_chunks + 1}, {width}, {k}] for "
            f"{reward_type} rewards, got {tuple(shape) if shape is not None else shape}."
        )
    return prev_values


def compute_advantages(batch: dict[str, Any], plan: TrajectoryPlan, *,
                       normalization: str = "pooled") -> dict[str, Any]:
    """Add ``advantages`` (and ``returns`` for gae) ``[N, W, k]`` to ``batch`` and return it.

    Reads ``rewards [N,W,C]``, ``dones [N+1,W,C]``, ``prev_values [N+1,W,k]`` (gae, optional:
    critic-free without) and ``loss_mask`` (optional, all ones when absent) from the batch;
    ``k = 1`` for ``plan.reward_type == "chunk_level"`` (rewards summed, dones/mask max'ed over
    slots), else ``k = C``.  The estimator is ``plan.adv_type`` (gae, grpo, reinpp, raw); the
    per-actor normalisation is applied last when ``plan.normalize_advantages``, in the style
    ``normalization`` names (``NORMALIZATIONS``).

    Raises ``ValueError`` for missing or mis-shaped rewards/dones/prev_values/loss_mask, an
    unknown estimator or reward type, and a width not divisible by ``plan.group_size`` for the
    group estimators.
    """
    rewards, dones = _checked_inputs(batch, plan, normalization)
    n_chunks, width, _ = rewards.shape
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    rewards, dones, loss_mask, k = _per_step(rewards.to(dtype), dones.to(torch.bool),
                                             batch.get("loss_mask"), plan.reward_type)
    n = n_chunks * k
    r = _flatten_time_major(rewards)
    d = _flatten_time_major(dones)[-(n + 1) :]
    if loss_mask is None:
        m = torch.ones(n, width, dtype=torch.bool)
    else:
        m = _flatten_time_major(loss_mask)

    adv_type = plan.adv_type
    returns: torch.Tensor | None = None
    if adv_type == "gae":
        v = _gae_values(batch.get("prev_values"), n_chunks, width, k, plan.reward_type)
        if v is not None:
            v = _flatten_time_major(v.to(dtype))[: n + 1]
        adv, ret = compute_gae_advantages(r, d, v, gamma=plan.gamma, gae_lambda=plan.gae_lambda)
        returns = _unflatten_time_major(ret, k)
    elif adv_type == "grpo":
        adv = compute_grpo_advantages(r, d, m, group_size=plan.group_size)
    elif adv_type == "reinpp":
        adv = compute_reinpp_advantages(r, d, m, group_size=plan.group_size)
    else:
        adv = compute_raw_advantages(r, d, m, group_size=plan.group_size)

    advantages = _unflatten_time_major(adv, k)
    if plan.normalize_advantages and normalization == "pooled":
        advantages = normalize_advantages(advantages, loss_mask)
    elif plan.normalize_advantages and adv_type == "gae":
        advantages = normalize_advantages_unbiased(advantages, loss_mask)
    batch["advantages"] = advantages
    if returns is not None:
        batch["returns"] = returns
    return batch
