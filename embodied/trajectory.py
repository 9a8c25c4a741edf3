"""Time-major training data: ``TrajectoryStep``, ``Trajectory``, the output items (docs/embodied.md).

A ``TrajectoryStep`` is one joined action chunk for the B environments of a logical source.  The
internal ``TrajectoryAccumulator`` keeps the steps of one scope and materialises them, sorted by
``(epoch_id, chunk_id)``, into a ``Trajectory`` whose tensors are ``[time, batch, ...]``.
``ActorBatch`` (pipeline mode) and ``EpisodeShard`` (lerobot mode) are the other output items.

Every tensor stored by these types, including dict leaves, is detached, on CPU and contiguous.
``TrajectoryStep``, ``Trajectory``, ``ActorBatch`` and ``EpisodeShard`` are registered with
zchannel's serializer at import (tags ``"zchannel.embodied.<Class>"``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import numpy as np
import torch
from zchannel.broker import register_type
from zchannel.embodied.batch import to_cpu_contiguous
from zchannel.embodied.observations import kept_observations
from zchannel.embodied.types import (
    EnvPart,
    PolicyPart,
    TrajectoryKey,
    as_float32,
    assign_history_rewards,
)

RLT_KEYS = ("z_rl", "proprio", "ref_chunk")
"""``forward_inputs`` keys kept as the current RLT transition features."""


@overload
def _bool(value: torch.Tensor) -> torch.Tensor: ...
@overload
def _bool(value: None) -> None: ...
@overload
def _bool(value: torch.Tensor | None) -> torch.Tensor | None: ...
def _bool(value: torch.Tensor | None) -> torch.Tensor | None:
    if value is not None and value.dtype != torch.bool:
        return value.bool()
    return value


def get_model_weights_id(versions: torch.Tensor | None) -> str:
    """A deterministic id of the weight versions that produced a trajectory.

    ``str(uuid5(NAMESPACE_DNS, v.numpy().tobytes().hex()))`` of the float32 CPU tensor ``v``; equal
    versions give equal ids.  ``None`` is treated as ``zeros(1, float32)``.
    """
    if versions is None:
        versions = torch.zeros(1, dtype=torch.float32)
    v = versions.detach().cpu().to(torch.float32).contiguous()
    return str(uuid.uuid5(uuid.NAMESPACE_DNS, v.numpy().tobytes().hex()))



def _step_observations(policy: PolicyPart, env: EnvPart, forward_inputs: dict[str, Any],
                       enable_rlt: bool, collect_transitions: bool
                       ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A step's current and next observations: the RLT features (``enable_rlt``), the
    observations (``collect_transitions``), or neither."""
    transition = env.transition
    if enable_rlt:
        curr_obs = _rlt_current(
            forward_inputs, transition.intervene_actions, transition.intervene_flags
        )
        if env.next_rlt_obs is None:
            raise ValueError("enable_rlt needs EnvPart.next_rlt_obs (the next RLT features).")
        return (kept_observations(curr_obs, "curr_obs"),
                kept_observations(env.next_rlt_obs, "next_obs"))
    if collect_transitions:
        if env.next_obs is None:
            raise ValueError("collect_transitions needs EnvPart.next_obs.")
        return (kept_observations(policy.obs or {}, "curr_obs"),
                kept_observations(env.next_obs, "next_obs"))
    return None, None

# ---------------------------------------------------------------------------------------------
# TrajectoryStep


def _chunk_flags(flags: torch.Tensor, batch: int) -> torch.Tensor:
    """Flags as bool ``[B, C']``; a ``[B]`` tensor becomes ``[B, 1]`` (one flag per chunk)."""
    flags = _bool(flags)
    if flags.dim() == 1:
        flags = flags.reshape(batch, 1)
    if flags.dim() != 2 or flags.shape[0] != batch:
        raise ValueError(
            f"Intervention flags must be [B] or [B, C] for B={batch}, got {tuple(flags.shape)}."
        )
    return flags


def apply_interventions(
    actions: torch.Tensor | None, intervene_actions: torch.Tensor, flags: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Replace model actions by expert actions where the environment intervened (docs/embodied.md).

    ``actions`` is ``[B, D]``; ``intervene_actions`` is ``[B, C, A]`` or ``[B, D]``; ``flags`` is
    bool ``[B, C']`` or ``[B]`` (then one flag per chunk).  Returns new tensors
    ``(actions [B, D], intervene_flags [B, D])``, or ``(None, None)`` when ``actions`` is None.
    Raises ``ValueError`` when ``flags`` is None or shapes do not fit.
    """
    if flags is None:
        raise ValueError("Environment intervention actions need intervene_flags.")
    if actions is None:
        return None, None
    batch = actions.shape[0]
    f = _chunk_flags(flags, batch)
    slots = f.shape[1]
    try:
        model = actions.reshape(batch, slots, -1)
        expert = intervene_actions.reshape(batch, slots, -1).to(actions.dtype)
        mask = f.reshape(batch, slots, 1)
        merged = torch.where(mask, expert, model).reshape(actions.shape)
    except RuntimeError as exc:
        raise ValueError(
            f"Intervention shapes do not fit: actions {tuple(actions.shape)}, intervene_actions "
            f"{tuple(intervene_actions.shape)}, flags {tuple(f.shape)}: {exc}"
        ) from None
    expanded = mask.expand(batch, slots, model.shape[2]).reshape(actions.shape)
    return merged.contiguous(), expanded.contiguous()


def expand_model_flags(flags: torch.Tensor, actions_shape: torch.Size) -> torch.Tensor:
    """Model-side flags ``[B, C]`` (or ``[B]``) expanded per action slot to bool ``[B, D]``."""
    batch, width = actions_shape[0], actions_shape[1]
    f = _chunk_flags(flags, batch)
    slots = f.shape[1]
    if width % slots:
        raise ValueError(
            f"Model intervene_flags {tuple(f.shape)} do not divide action width {width}."
        )
    return f.reshape(batch, slots, 1).expand(batch, slots, width // slots).reshape(batch, width)


def _rlt_current(
    forward_inputs: dict[str, Any],
    intervene_actions: torch.Tensor | None,
    flags: torch.Tensor | None,
) -> dict[str, Any]:
    """Deep copies of the RLT features, with env interventions written into ``ref_chunk``."""
    missing = [k for k in RLT_KEYS if k not in forward_inputs]
    if missing:
        raise ValueError(
            f"enable_rlt needs forward_inputs keys {list(RLT_KEYS)}; missing {missing}."
        )
    curr = {k: copy.deepcopy(forward_inputs[k]) for k in RLT_KEYS}
    ref = curr["ref_chunk"]
    if intervene_actions is not None and isinstance(ref, torch.Tensor):
        if flags is None:
            raise ValueError("Environment intervention actions need intervene_flags.")
        batch = ref.shape[0]
        f = _chunk_flags(flags, batch)
        slots = f.shape[1]
        expert = intervene_actions.reshape(batch, slots, -1)
        width = expert.shape[2]
        if ref.numel() % (batch * width) or ref.numel() // (batch * width) < slots:
            raise ValueError(
                f"ref_chunk {tuple(ref.shape)} cannot hold {slots} intervention slots of {width}."
            )
        view = ref.reshape(batch, -1, width).clone()
        head = view[:, :slots]
        view[:, :slots] = torch.where(f.reshape(batch, slots, 1), expert.to(ref.dtype), head)
        curr["ref_chunk"] = view.reshape(ref.shape)
    return curr


@dataclass(eq=False)
class TrajectoryStep:
    """One joined action chunk for the B environments of a logical source (docs/embodied.md).

    Per-chunk fields are batch-first: ``actions`` ``[B, D]``, ``intervene_flags`` bool ``[B, D]``
    (all False by default when actions exist), ``prev_logprobs``, ``prev_values``, ``versions``,
    flags ``[B, C]`` and ``rewards`` ``[B, C]``.  ``initial_*`` are set on chunk 0 only and
    ``final_prev_values`` on the epoch's last chunk only.
    """

    actions: torch.Tensor | None = None
    intervene_flags: torch.Tensor | None = None
    prev_logprobs: torch.Tensor | None = None
    prev_values: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    dones: torch.Tensor | None = None
    truncations: torch.Tensor | None = None
    terminations: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    forward_inputs: dict[str, Any] = field(default_factory=dict)
    curr_obs: dict[str, Any] | None = None
    next_obs: dict[str, Any] | None = None
    initial_dones: torch.Tensor | None = None
    initial_truncations: torch.Tensor | None = None
    initial_terminations: torch.Tensor | None = None
    final_prev_values: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.forward_inputs is None:
            self.forward_inputs = {}
        for f in dataclasses.fields(self):
            setattr(self, f.name, to_cpu_contiguous(getattr(self, f.name)))
        for name in _FLAG_FIELDS + ("intervene_flags",):
            setattr(self, name, _bool(getattr(self, name)))
        self.versions = as_float32(self.versions)
        if self.intervene_flags is None and isinstance(self.actions, torch.Tensor):
            self.intervene_flags = torch.zeros(self.actions.shape, dtype=torch.bool)

    def apply_interventions(
        self, intervene_actions: torch.Tensor, intervene_flags: torch.Tensor | None
    ) -> TrajectoryStep:
        """Replace this step's model actions by the expert's where the flags are set:
        ``actions``, ``intervene_flags`` and ``forward_inputs["action"]`` are updated in place
        (``forward_inputs["model_action"]`` is dropped); returns ``self``.  No-op without
        actions; ``ValueError`` without flags or for shapes that do not fit."""
        actions, flags = apply_interventions(self.actions, intervene_actions, intervene_flags)
        if actions is not None:
            self.actions, self.intervene_flags = actions, flags
            if "action" in self.forward_inputs:
                self.forward_inputs["action"] = actions
            self.forward_inputs.pop("model_action", None)
        return self

    def add_reward(self, env_id: int, reward: torch.Tensor | float) -> None:
        """Add ``reward`` (a ``[C]`` row or a scalar) to env ``env_id``'s rewards.

        The rewards tensor is replaced by an updated copy (storage shared with others is never
        modified).  Raises ``ValueError`` if the step has no rewards.
        """
        if self.rewards is None:
            raise ValueError("Cannot add a reward to a step without rewards.")
        rewards = self.rewards.clone()
        rewards[env_id] += torch.as_tensor(reward, dtype=rewards.dtype)
        self.rewards = rewards

    @classmethod
    def from_parts(
        cls,
        policy: PolicyPart,
        env: EnvPart,
        *,
        rewards: torch.Tensor | None,
        collect_prev_infos: bool,
        collect_transitions: bool,
        enable_rlt: bool,
        include_final_value: bool,
        intervention_precedence: str = "model",
    ) -> TrajectoryStep:
        """Build the step of one joined chunk (docs/embodied.md); the parts are never modified.

        Where the env reports an intervention (``transition.intervene_actions``), the expert's
        actions replace the model's where flagged, and the env's flags become
        ``intervene_flags``.  The model's flags (``output.intervene_flags``) then take part by
        ``intervention_precedence``: ``"model"`` (the contract's default) lets them overwrite the
        flags, actions unchanged; ``"env"`` applies them first, so that where the env reports an
        intervention what was executed wins, as in RLinf (its
        ``EmbodiedTrajectoryBuilder.update_last_actions`` runs after
        ``mark_last_step_with_intervene_flags``).  Raises ``ValueError`` for an external
        (non-inferred) policy part, intervention actions without flags, missing RLT features or
        next observations.
        """
        output = policy.output
        if output is None:
            raise ValueError(
                "A training trajectory needs an inferred policy output; external policy actions "
                "are only supported for online LeRobot DAgger."
            )
        transition = env.transition
        forward_inputs = dict(output.forward_inputs)
        actions = forward_inputs.get("action")
        intervene_flags = None
        model_flags = output.intervene_flags
        if model_flags is not None and actions is not None and intervention_precedence == "env":
            intervene_flags = expand_model_flags(model_flags, actions.shape)
        if transition.intervene_actions is not None:
            new_actions, new_flags = apply_interventions(
                actions, transition.intervene_actions, transition.intervene_flags
            )
            if new_actions is not None:
                actions, intervene_flags = new_actions, new_flags
                forward_inputs["action"] = actions
                forward_inputs.pop("model_action", None)
        if model_flags is not None and actions is not None \
                and intervention_precedence == "model":
            intervene_flags = expand_model_flags(model_flags, actions.shape)

        curr_obs, next_obs = _step_observations(policy, env, forward_inputs, enable_rlt,
                                                collect_transitions)

        initial = env.initial_transition
        return cls(
            actions=actions,
            intervene_flags=intervene_flags,
            prev_logprobs=output.prev_logprobs if collect_prev_infos else None,
            prev_values=output.prev_values if collect_prev_infos else None,
            versions=output.versions,
            dones=transition.dones,
            truncations=transition.truncations,
            terminations=transition.terminations,
            rewards=rewards,
            forward_inputs=forward_inputs,
            curr_obs=curr_obs,
            next_obs=next_obs,
            initial_dones=None if initial is None else initial.dones,
            initial_truncations=None if initial is None else initial.truncations,
            initial_terminations=None if initial is None else initial.terminations,
            final_prev_values=(
                env.final_prev_values if include_final_value and collect_prev_infos else None
            ),
        )


_FLAG_FIELDS = (
    "dones",
    "truncations",
    "terminations",
    "initial_dones",
    "initial_truncations",
    "initial_terminations",
)

# ---------------------------------------------------------------------------------------------
# Trajectory

_PER_CHUNK_FIELDS = ("actions", "intervene_flags", "rewards", "prev_logprobs", "versions")
_BOUNDARY_FIELDS = ("terminations", "truncations", "dones")
_DICT_FIELDS = ("forward_inputs", "curr_obs", "next_obs")
TENSOR_FIELDS = (
    "actions",
    "intervene_flags",
    "rewards",
    "terminations",
    "truncations",
    "dones",
    "prev_logprobs",
    "prev_values",
    "versions",
)


def _stack(name: str, values: list[Any]) -> Any:
    """Stack batch-first values on a new dim 0 (tensors, numpy arrays, dicts leaf by leaf)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    first = values[0]
    try:
        if isinstance(first, torch.Tensor):
            return torch.stack(values, dim=0)
        if isinstance(first, np.ndarray):
            return np.stack(values, axis=0)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"Cannot stack the steps' {name!r}: {exc}") from None
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for v in values for k in v))
        out = {}
        for k in keys:
            stacked = _stack(f"{name}.{k}", [v.get(k) for v in values])
            if stacked is not None:
                out[k] = stacked
        return out
    raise TypeError(
        f"Cannot stack {name!r} values of type {type(first).__name__}: trajectory dict leaves "
        "must be tensors, numpy arrays or dicts of them."
    )


def _map_leaves(value: Any, fn: Callable[[Any], Any], name: str) -> Any:
    """Apply ``fn`` to every tensor/array leaf of ``value`` (dicts recursively)."""
    if value is None:
        return None
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_leaves(v, fn, f"{name}.{k}") for k, v in value.items()}
    raise TypeError(f"Trajectory field {name!r} holds a {type(value).__name__}, not a tensor.")


def _split_dim1(value: Any, sizes: list[int], name: str) -> list[Any]:
    """Split a tensor/array/dict on dim 1 into contiguous pieces."""
    if value is None:
        return [None] * len(sizes)
    if isinstance(value, torch.Tensor):
        return [p.contiguous() for p in torch.split(value, sizes, dim=1)]
    if isinstance(value, np.ndarray):
        bounds = np.cumsum(sizes)[:-1]
        return [np.ascontiguousarray(p) for p in np.split(value, bounds, axis=1)]
    if isinstance(value, dict):
        per_key = {k: _split_dim1(v, sizes, f"{name}.{k}") for k, v in value.items()}
        return [{k: parts[i] for k, parts in per_key.items()} for i in range(len(sizes))]
    raise TypeError(f"Cannot split trajectory field {name!r} of type {type(value).__name__}.")


def _cat_dim1(values: list[Any], name: str) -> Any:
    """Concatenate present tensors/arrays on dim 1; dicts by the union of their keys."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    first = values[0]
    try:
        if isinstance(first, torch.Tensor):
            return torch.cat(values, dim=1)
        if isinstance(first, np.ndarray):
            return np.concatenate(values, axis=1)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"Cannot concatenate trajectories' {name!r}: {exc}") from None
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _cat_dim1([v.get(k) for v in values], f"{name}.{k}") for k in keys}
    raise TypeError(f"Cannot concatenate trajectory field {name!r} of type {type(first).__name__}.")


@dataclass(eq=False)
class Trajectory:
    """Time-major training data of one or more environment columns (docs/embodied.md).

    Per-chunk tensors are ``[T, W, ...]`` with T = E·N; boundary flags (``dones``,
    ``truncations``, ``terminations``) and ``prev_values`` have N+1 rows per epoch.  Dict fields
    hold ``[T, W, ...]`` leaves.
    """

    max_episode_length: int = 0
    model_weights_id: str = ""
    actions: torch.Tensor | None = None
    intervene_flags: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    terminations: torch.Tensor | None = None
    truncations: torch.Tensor | None = None
    dones: torch.Tensor | None = None
    prev_logprobs: torch.Tensor | None = None
    prev_values: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    forward_inputs: dict[str, Any] = field(default_factory=dict)
    curr_obs: dict[str, Any] = field(default_factory=dict)
    next_obs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in TENSOR_FIELDS + _DICT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _DICT_FIELDS:
                value = {}
            setattr(self, name, to_cpu_contiguous(value))
        for name in _BOUNDARY_FIELDS + ("intervene_flags",):
            setattr(self, name, _bool(getattr(self, name)))
        self.versions = as_float32(self.versions)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_steps(
        cls, steps: Sequence[TrajectoryStep], *, max_episode_length: int = 0
    ) -> Trajectory:
        """Stack time-ordered steps into a trajectory (docs/embodied.md: "The trajectory layout").

        Per-chunk fields stack to ``[T, B, ...]`` (None skipped); boundary fields append
        ``initial_X`` (if present) then ``X`` per step; ``prev_values`` appends ``prev_values``
        then ``final_prev_values`` (if present).  Raises ``ValueError`` when shapes differ.
        """
        steps = list(steps)
        fields: dict[str, Any] = {}
        for name in _PER_CHUNK_FIELDS:
            fields[name] = _stack(name, [getattr(s, name) for s in steps])
        for name in _BOUNDARY_FIELDS:
            rows: list = []
            for s in steps:
                rows.extend((getattr(s, f"initial_{name}"), getattr(s, name)))
            fields[name] = _stack(name, rows)
        values: list = []
        for s in steps:
            values.extend((s.prev_values, s.final_prev_values))
        fields["prev_values"] = _stack("prev_values", values)
        for name in _DICT_FIELDS:
            fields[name] = _stack(name, [getattr(s, name) for s in steps]) or {}
        return cls(
            max_episode_length=max_episode_length,
            model_weights_id=get_model_weights_id(fields["versions"]),
            **fields,
        )

    # -- batch geometry ----------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """``shape[1]`` of the first tensor field, else of the first tensor in a dict field.

        Raises ``ValueError`` when the trajectory holds no tensor.
        """
        for name in TENSOR_FIELDS:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                return int(value.shape[1])
        for name in _DICT_FIELDS:
            leaf = _first_leaf(getattr(self, name))
            if leaf is not None:
                return int(leaf.shape[1])
        raise ValueError("A trajectory without tensors has no batch size.")

    def split(self, n_or_sizes: int | Sequence[int]) -> list[Trajectory]:
        """Split the batch (dim 1) into ``n`` equal shards or shards of the given sizes.

        Tensors and dict leaves are split and made contiguous; ``int``/``str`` fields are copied.
        Raises ``ValueError`` for an indivisible batch or sizes not summing to the batch, and
        ``TypeError`` for a field of another type.
        """
        batch = self.batch_size
        if isinstance(n_or_sizes, int) and not isinstance(n_or_sizes, bool):
            n = n_or_sizes
            if n < 1 or batch % n:
                raise ValueError(f"Cannot split a batch of {batch} into {n} equal shards.")
            sizes = [batch // n] * n
        elif isinstance(n_or_sizes, bool):
            raise TypeError("split takes a number of shards or a sequence of sizes, not a bool")
        else:
            sizes = [int(s) for s in n_or_sizes]
            if any(s < 0 for s in sizes) or sum(sizes) != batch:
                raise ValueError(f"Split sizes {sizes} do not sum to the batch size {batch}.")
        columns: dict[str, list[Any]] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, str)) and not isinstance(value, bool):
                columns[f.name] = [value] * len(sizes)
            elif value is None or isinstance(value, (torch.Tensor, dict)):
                columns[f.name] = _split_dim1(value, sizes, f.name)
            else:
                raise TypeError(f"Cannot split Trajectory.{f.name} of type {type(value).__name__}.")
        return [
            Trajectory(**{name: parts[i] for name, parts in columns.items()})
            for i in range(len(sizes))
        ]

    @staticmethod
    def to_batch(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
        """Concatenate trajectories on the batch (dim 1) into a plain dict.

        Tensor fields of the first trajectory are concatenated over the non-None values; the dict
        fields over the union of their keys.  Non-tensor fields are dropped.  Raises
        ``ValueError`` for an empty list or incompatible shapes.
        """
        trajectories = list(trajectories)
        if not trajectories:
            raise ValueError("Trajectory.to_batch needs at least one trajectory.")
        first = trajectories[0]
        batch: dict[str, Any] = {}
        for name in TENSOR_FIELDS:
            if isinstance(getattr(first, name), torch.Tensor):
                batch[name] = _cat_dim1([getattr(t, name) for t in trajectories], name)
        for name in _DICT_FIELDS:
            batch[name] = _cat_dim1([getattr(t, name) for t in trajectories], name) or {}
        return batch

    # -- interventions -----------------------------------------------------------------------

    def extract_intervene_traj(
        self, mode: Literal["any", "all"] = "any"
    ) -> list[Trajectory] | None:
        """One single-column trajectory per env column with intervened rows (docs/embodied.md).

        The row mask ``[T, B]`` is ``intervene_flags.any(-1)`` (or ``all``).  Per-chunk fields keep
        the masked rows; boundary fields keep every epoch-boundary row and row ``e(N+1)+j+1`` where
        ``mask[eN+j]``; ``prev_values`` keeps row ``e(N+1)+j`` where ``mask[eN+j]`` and each epoch's
        final row.  Returns None when no flag is set.  Raises ``ValueError`` for a bad ``mode``.
        """
        if mode not in ("any", "all"):
            raise ValueError(f"extract_intervene_traj mode must be 'any' or 'all', not {mode!r}.")
        flags = self.intervene_flags
        if flags is None or not bool(flags.any()):
            return None
        mask = flags.any(-1) if mode == "any" else flags.all(-1)  # [T, B]
        T = mask.shape[0]
        epochs = self._epoch_count(T)
        N = T // epochs if epochs else T
        boundary_rows = torch.arange(epochs * (N + 1)) if epochs else torch.arange(0)
        j = boundary_rows % (N + 1)
        e = boundary_rows // (N + 1)
        out = []
        for b in range(mask.shape[1]):
            col = mask[:, b]
            if not bool(col.any()):
                continue
            chunk_rows = torch.nonzero(col).reshape(-1)
            step_of = (e * N + j - 1).clamp(min=0, max=max(T - 1, 0))
            keep_flags = torch.nonzero((j == 0) | ((j > 0) & col[step_of])).reshape(-1)
            step_of_value = (e * N + j).clamp(max=max(T - 1, 0))
            keep_values = torch.nonzero((j == N) | ((j < N) & col[step_of_value])).reshape(-1)

            def take(value: Any, rows: torch.Tensor, b: int = b) -> Any:
                if isinstance(value, np.ndarray):
                    return np.ascontiguousarray(value[rows.numpy()][:, b : b + 1])
                return value.index_select(0, rows)[:, b : b + 1].contiguous()

            fields: dict[str, Any] = {
                "max_episode_length": self.max_episode_length,
                "model_weights_id": self.model_weights_id,
            }
            for name in _PER_CHUNK_FIELDS:
                fields[name] = _map_leaves(
                    getattr(self, name), functools.partial(take, rows=chunk_rows), name
                )
            for name in _BOUNDARY_FIELDS:
                fields[name] = _map_leaves(
                    getattr(self, name), functools.partial(take, rows=keep_flags), name
                )
            fields["prev_values"] = _map_leaves(
                self.prev_values, functools.partial(take, rows=keep_values), "prev_values"
            )
            for name in _DICT_FIELDS:
                fields[name] = _map_leaves(
                    getattr(self, name), functools.partial(take, rows=chunk_rows), name
                )
            out.append(Trajectory(**fields))
        return out

    def _epoch_count(self, T: int) -> int:
        """E = boundary rows − per-chunk rows (0 when there is no boundary field)."""
        for name in _BOUNDARY_FIELDS + ("prev_values",):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                epochs = value.shape[0] - T
                if epochs < 1 or T % epochs:
                    raise ValueError(
                        f"Trajectory.{name} has {value.shape[0]} rows, which does not fit "
                        f"{T} chunk rows with one boundary row per epoch."
                    )
                return int(epochs)
        return 0


def _first_leaf(value: Any) -> torch.Tensor | np.ndarray | None:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value
    if isinstance(value, dict):
        for v in value.values():
            leaf = _first_leaf(v)
            if leaf is not None:
                return leaf
    return None


# ---------------------------------------------------------------------------------------------
# Accumulation (internal)


@dataclass(frozen=True)
class _Entry:
    key: TrajectoryKey
    step: TrajectoryStep
    reward_model_output: torch.Tensor | None
    reward_assign_lengths: list[int] | None


class TrajectoryAccumulator:
    """The steps of one scope and one logical source, in arrival order (internal).

    ``append`` stores ``(key, step, transition extras)`` without copying; ``to_trajectory``
    sorts by ``(epoch_id, chunk_id)``, applies history rewards to copies and stacks.
    Accumulators are cheap to ``copy`` (the entries are shared), which the collector uses to
    compute a put's effect before committing it.
    """

    def __init__(self, entries: Sequence[_Entry] = ()) -> None:
        self.entries: list[_Entry] = list(entries)

    def __len__(self) -> int:
        return len(self.entries)

    def copy(self) -> TrajectoryAccumulator:
        """A new accumulator sharing the stored steps."""
        return TrajectoryAccumulator(self.entries)

    def append(
        self,
        key: TrajectoryKey,
        step: TrajectoryStep,
        *,
        reward_model_output: torch.Tensor | None = None,
        reward_assign_lengths: Sequence[int] | None = None,
    ) -> None:
        """Store a step with its transition's reward-model output and assign lengths.

        Raises ``ValueError`` when ``reward_assign_lengths`` is set on a step without rewards,
        without a reward-model output, or with a length other than the step's batch.
        """
        lengths = None if reward_assign_lengths is None else [int(n) for n in reward_assign_lengths]
        if lengths is not None:
            if step.rewards is None:
                raise ValueError(f"reward_assign_lengths is set on {key}, whose rewards are None.")
            if reward_model_output is None:
                raise ValueError(
                    f"reward_assign_lengths is set on {key} without a reward_model_output."
                )
            if len(lengths) != step.rewards.shape[0]:
                raise ValueError(
                    f"reward_assign_lengths of {key} has {len(lengths)} entries for "
                    f"{step.rewards.shape[0]} environments."
                )
        self.entries.append(_Entry(key, step, reward_model_output, lengths))

    def sorted_steps(self, reward_weight: float) -> list[TrajectoryStep]:
        """The steps in ``(epoch_id, chunk_id)`` order, with history rewards applied to copies."""
        entries = sorted(self.entries, key=lambda e: (e.key.epoch_id, e.key.chunk_id))
        steps = [e.step for e in entries]
        rewarded = [i for i, e in enumerate(entries) if e.step.rewards is not None]
        if any(entries[i].reward_assign_lengths is not None for i in rewarded):
            new_rewards = assign_history_rewards(
                [r for i in rewarded if (r := entries[i].step.rewards) is not None],
                [entries[i].reward_model_output for i in rewarded],
                [entries[i].reward_assign_lengths for i in rewarded],
                reward_weight,
            )
            for i, rewards in zip(rewarded, new_rewards, strict=True):
                steps[i] = copy.copy(steps[i])
                steps[i].rewards = rewards
        return steps

    def to_trajectory(
        self, *, max_episode_length: int = 0, reward_weight: float = 1.0
    ) -> Trajectory:
        """Materialise the stored steps (sorted, history rewards applied) as a Trajectory."""
        return Trajectory.from_steps(
            self.sorted_steps(reward_weight), max_episode_length=max_episode_length
        )


# ---------------------------------------------------------------------------------------------
# Output items of the pipeline and lerobot modes


@dataclass(eq=False)
class ActorBatch:
    """One training micro-batch for the actor of rank ``actor_rank`` (pipeline mode).

    ``data`` maps packed keys (``"parent::child"``) to tensors whose dim 0 is the micro-batch.
    """

    actor_rank: int
    step_id: int
    epoch_id: int
    micro_batch_index: int
    data: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.data = to_cpu_contiguous(dict(self.data or {}))


@dataclass(eq=False)
class EpisodeShard:
    """Completed LeRobot episodes of one source and training step (lerobot mode).

    ``episodes`` is a list of episodes, each a list of frame dicts; it may be empty.
    """

    step_id: int
    env_rank: int
    stage_id: int
    shard_index: int
    episodes: list[list[dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.episodes = to_cpu_contiguous(list(self.episodes or []))


for _cls in (TrajectoryStep, Trajectory, ActorBatch, EpisodeShard):
    register_type(_cls, name=f"zchannel.embodied.{_cls.__name__}")
del _cls
