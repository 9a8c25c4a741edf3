"""Validation of trajectory parts against a plan: a clear error naming the key and the field.

``check_env_part`` / ``check_policy_part`` raise ``ValueError("<Part> <key>: field '<name>' ...")``
for a key outside the plan, a missing required field, a tensor whose shape does not fit
``[B, C]`` / ``[B, D]`` (values: ``[B, 1]`` or ``[B, C]``), non-finite ``transition.rewards`` or
a non-finite policy action.  They change nothing, so a rejected part loses nothing else in
flight.
"""

from __future__ import annotations

from typing import Any

import torch
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.types import EnvPart, PolicyPart, TrajectoryKey


def _check_key(what: str, key: Any, plan: TrajectoryPlan) -> None:
    if not isinstance(key, TrajectoryKey):
        raise ValueError(f"{what}: field 'sources' holds a key {key!r} that is not a "
                         "TrajectoryKey(step_id, epoch_id, env_rank, stage_id, chunk_id)")
    for name, value, bound in (("epoch_id", key.epoch_id, plan.rollout_epochs),
                               ("chunk_id", key.chunk_id, plan.num_chunks)):
        if not 0 <= value < bound:
            raise ValueError(f"{what} {key}: key field '{name}'={value} outside [0, {bound})")


def _rows(part: Any) -> int:
    return sum(source.size for source in part.sources)


def _check_tensor(what: str, name: str, value: Any) -> None:
    """``value`` is a tensor (``ValueError`` naming the field otherwise)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{what}: field '{name}' must be a tensor, got {type(value).__name__}")


def _check_shape(what: str, name: str, value: Any, shape: tuple[int, ...]) -> None:
    if value is None:
        return
    _check_tensor(what, name, value)
    if tuple(value.shape) != shape:
        raise ValueError(f"{what}: field '{name}' has shape {tuple(value.shape)}, expected "
                         f"{shape}")


def _check_finite(what: str, name: str, value: Any) -> None:
    """``value`` (a tensor, already shape-checked, or None) holds no NaN or inf."""
    if value is None or not value.is_floating_point():
        return
    bad = ~torch.isfinite(value)
    if bool(bad.any()):
        rows = torch.nonzero(bad.reshape(bad.shape[0], -1).any(dim=1)).flatten().tolist()
        raise ValueError(f"{what}: field '{name}' has non-finite values "
                         f"{value[bad][:4].tolist()} in rows {rows}; it must be finite")


def check_env_part(part: EnvPart, plan: TrajectoryPlan, *, strict: bool = True) -> None:
    """Raise ``ValueError`` naming the key and field when ``part`` does not fit ``plan``.

    ``strict`` (the rollout's check of what an env sent) also requires ``transition.rewards``
    and ``transition.dones`` outside lerobot mode and the chunk-0 ``initial_transition`` rule;
    the collector checks shapes only (the joiner enforces the initial-state rule at join).
    """
    if not part.sources:
        raise ValueError("EnvPart: field 'sources' is empty")
    for source in part.sources:
        _check_key("EnvPart", source.key, plan)
    key = part.sources[0].key
    what = f"EnvPart {key}"
    B, C = _rows(part), plan.num_action_chunks
    t = part.transition
    if strict and plan.mode != "lerobot":
        for name in ("rewards", "dones"):
            if getattr(t, name) is None:
                raise ValueError(f"{what}: field 'transition.{name}' is missing")
    for name in ("rewards", "dones", "terminations", "truncations"):
        _check_shape(what, f"transition.{name}", getattr(t, name), (B, C))
    _check_finite(what, "transition.rewards", t.rewards)
    _check_value_shape(what, "final_prev_values", part.final_prev_values, B, C)
    if not strict:
        return
    if key.chunk_id == 0 and part.initial_transition is None:
        raise ValueError(f"{what}: field 'initial_transition' is missing on chunk 0")
    if key.chunk_id != 0 and part.initial_transition is not None:
        raise ValueError(f"{what}: field 'initial_transition' is set on chunk {key.chunk_id}")


def check_policy_part(part: PolicyPart, plan: TrajectoryPlan) -> None:
    """Raise ``ValueError`` naming the key and field when ``part`` does not fit ``plan``: the
    action ``output.forward_inputs["action"]`` must be a finite tensor ``[B, C*A]`` (the rows of
    the part's sources, ``num_action_chunks * action_dim``)."""
    if not part.sources:
        raise ValueError("PolicyPart: field 'sources' is empty")
    for source in part.sources:
        _check_key("PolicyPart", source.key, plan)
    what = f"PolicyPart {part.sources[0].key}"
    B, C, A = _rows(part), plan.num_action_chunks, plan.action_dim
    if part.output is None:
        return
    action = part.output.forward_inputs.get("action")  # None: the trajectory has no actions
    name = "output.forward_inputs[\"action\"]"
    if action is not None:
        if not isinstance(action, torch.Tensor):
            raise ValueError(f"{what}: field '{name}' must be a tensor, got "
                             f"{type(action).__name__}")
        if tuple(action.shape) != (B, C * A):
            raise ValueError(f"{what}: field '{name}' has shape {list(action.shape)}, expected "
                             f"[B, C*A] = [{B}, {C}*{A}] = [{B}, {C * A}] (B envs, C "
                             "num_action_chunks, A action_dim)")
        _check_finite(what, name, action)
    if part.output.prev_logprobs is not None and part.output.prev_logprobs.shape[0] != B:
        raise ValueError(f"{what}: field 'output.prev_logprobs' has {part.output.prev_logprobs.shape[0]} rows, expected {B}")
    _check_value_shape(what, "output.prev_values", part.output.prev_values, B, C)


def _check_value_shape(what: str, name: str, value: Any, B: int, C: int) -> None:
    """``value`` (a value-head output, or None) is a tensor ``[B, 1]`` (one value per chunk) or
    ``[B, C]`` (one per action)."""
    if value is None:
        return
    _check_tensor(what, name, value)
    if tuple(value.shape) not in ((B, 1), (B, C)):
        raise ValueError(f"{what}: field '{name}' has shape {list(value.shape)}, expected "
                         f"[B, 1] or [B, C] = [{B}, 1] or [{B}, {C}] (B envs, C "
                         "num_action_chunks)")


def check_part(part: Any, plan: TrajectoryPlan, *, strict: bool = True) -> None:
    """``check_env_part`` or ``check_policy_part``; other types are left to the collector."""
    if isinstance(part, EnvPart):
        check_env_part(part, plan, strict=strict)
    elif isinstance(part, PolicyPart):
        check_policy_part(part, plan)


__all__ = ["check_env_part", "check_part", "check_policy_part"]
