"""Transport types of ``zchannel.embodied``: keys, env/policy halves, requests (docs/embodied.md).

Every tensor given to these types, including leaves nested in dicts and lists, is stored detached,
on CPU and contiguous (``to_cpu_contiguous`` in ``__post_init__``).  Flag tensors are stored as
bool and ``versions`` as float32.  All dataclasses here are registered with zchannel's serializer
on import, so they travel as tagged msgpack maps and decode to the same class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, TypeVar

import torch
from zchannel.broker import register_type
from zchannel.embodied.batch import (
    merge_batch_values,
    merge_episode_data,
    split_batch_value,
    split_episode_data,
    to_cpu_contiguous,
)

SourceID = tuple[int, int]
"""``(env_rank, stage_id)``: one logical source."""

COLUMN_STRIDE = 1_000_000
"""The rollout tags row ``row`` of env rank ``r`` with the global column ``r·COLUMN_STRIDE + row``."""


_T = TypeVar("_T")


def _present(values: list[_T | None], what: str) -> list[_T]:
    """``values`` when none is None, else ``ValueError`` (a fragment lacks ``what``)."""
    present = [v for v in values if v is not None]
    if len(present) != len(values):
        raise ValueError(f"Cannot merge fragments where some lack {what}.")
    return present


def _as_bool(value: Any) -> Any:
    """A bool view of a flag tensor (other values unchanged)."""
    if isinstance(value, torch.Tensor) and value.dtype != torch.bool:
        return value.bool()
    return value


def as_float32(value: Any) -> Any:
    """A ``versions`` tensor as float32 (the rule of every type here); None as it is."""
    if isinstance(value, torch.Tensor) and value.dtype != torch.float32:
        return value.float()
    return value


def _convert_fields(obj: Any, *, flags: Sequence[str] = (), skip: Sequence[str] = ()) -> None:
    """Move every field of dataclass ``obj`` to CPU/contiguous/detached; make ``flags`` bool."""
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        value = to_cpu_contiguous(getattr(obj, f.name))
        if f.name in flags:
            value = _as_bool(value)
        object.__setattr__(obj, f.name, value)


def _single_source(sources: list[TrajectorySource], what: str) -> list[TrajectorySource]:
    if len(sources) != 1:
        raise ValueError(
            f"{what} fragments must merge into exactly one logical source, got {len(sources)}: "
            f"{sources!r}."
        )
    return sources


def _check_sources(sources: Any, what: str) -> list[TrajectorySource]:
    sources = list(sources)
    for source in sources:
        if not isinstance(source, TrajectorySource):
            raise TypeError(f"{what}.sources must hold TrajectorySource, not {source!r}.")
    return sources


# ---------------------------------------------------------------------------------------------
# Identity


@dataclass(frozen=True, order=True)
class TrajectoryKey:
    """One action chunk of one logical source: ``(step, epoch, env_rank, stage, chunk)``."""

    step_id: int
    """Training step."""
    epoch_id: int
    """Rollout epoch within the step, in ``[0, rollout_epochs)``."""
    env_rank: int
    """Rank of the env worker (with ``stage_id``, the logical source)."""
    stage_id: int
    """Pipeline stage of the env worker."""
    chunk_id: int
    """Action chunk within the epoch, in ``[0, num_chunks)``."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"TrajectoryKey.{f.name} must be an int, not {value!r}.")

    @property
    def source(self) -> SourceID:
        """The logical source ``(env_rank, stage_id)``."""
        return (self.env_rank, self.stage_id)


@dataclass(frozen=True)
class TrajectorySource:
    """``size`` rows of the source batch of ``key``, starting at row ``offset``."""

    key: TrajectoryKey
    size: int
    offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.key, TrajectoryKey):
            raise TypeError(f"TrajectorySource.key must be a TrajectoryKey, not {self.key!r}.")
        for name in ("size", "offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TrajectorySource.{name} must be an int >= 0, not {value!r}.")

    @staticmethod
    def split(
        sources: Sequence[TrajectorySource], split_sizes: Sequence[int]
    ) -> list[list[TrajectorySource]]:
        """Deal the rows of ``sources`` (in order) into shards of ``split_sizes`` rows.

        Empty ``sources`` give one empty list per split.  Raises ``ValueError`` unless the source
        sizes sum to ``sum(split_sizes)``.
        """
        sources, split_sizes = list(sources), list(split_sizes)
        if not sources:
            return [[] for _ in split_sizes]
        total = sum(s.size for s in sources)
        if total != sum(split_sizes):
            raise ValueError(
                f"Source sizes do not match split sizes: sources hold {total} rows, "
                f"splits ask for {sum(split_sizes)} ({split_sizes})."
            )
        shards: list[list[TrajectorySource]] = []
        index, consumed = 0, 0
        for need in split_sizes:
            shard: list[TrajectorySource] = []
            while need > 0:
                source = sources[index]
                take = min(need, source.size - consumed)
                if take > 0:
                    shard.append(TrajectorySource(source.key, take, source.offset + consumed))
                    consumed += take
                    need -= take
                if consumed == source.size:
                    index, consumed = index + 1, 0
            shards.append(shard)
        return shards

    @staticmethod
    def merge(groups: Sequence[Sequence[TrajectorySource]]) -> list[TrajectorySource]:
        """Flatten ``groups`` in order, coalescing contiguous neighbours of the same key."""
        merged: list[TrajectorySource] = []
        for group in groups:
            for source in group:
                prev = merged[-1] if merged else None
                if (
                    prev is not None
                    and prev.key == source.key
                    and prev.offset + prev.size == source.offset
                ):
                    merged[-1] = TrajectorySource(prev.key, prev.size + source.size, prev.offset)
                else:
                    merged.append(source)
        return merged


# ---------------------------------------------------------------------------------------------
# EnvTransition and rewards

_TRANSITION_FLAGS = ("dones", "terminations", "truncations", "intervene_flags", "rlt_switch_flags")
_TRANSITION_DICT_FIELDS = (
    "dones",
    "terminations",
    "truncations",
    "rewards",
    "intervene_actions",
    "intervene_flags",
    "rlt_switch_flags",
)


def assign_history_rewards(
    steps_rewards: Sequence[torch.Tensor],
    model_outputs: Sequence[torch.Tensor | None],
    assign_lengths: Sequence[Sequence[int] | None],
    reward_weight: float,
) -> list[torch.Tensor]:
    """Apply delayed reward-model outputs to earlier steps (docs/embodied.md: "Rewards"), on copies.

    The three lists describe the accumulator's steps whose rewards are not None, sorted by
    ``(epoch_id, chunk_id)``: ``steps_rewards[i]`` is ``[B, C]``, and step i's transition has
    ``reward_model_output`` ``model_outputs[i]`` (``[B, C]``) and ``reward_assign_lengths``
    ``assign_lengths[i]``.  For each step i with lengths and each env b with length L, the row
    ``reward_weight * model_outputs[i][b]`` is added to steps ``i-1 … i-(min(L, i+1)-1)``.
    Returns new tensors; the inputs are not modified.  Raises ``ValueError`` when a step has
    lengths but no model output, or lengths/rows that do not match the batch.
    """
    if not len(steps_rewards) == len(model_outputs) == len(assign_lengths):
        raise ValueError("History rewards need one model output and one length list per step.")
    out = [rewards.clone() for rewards in steps_rewards]
    for i, lengths in enumerate(assign_lengths):
        if lengths is None:
            continue
        model = model_outputs[i]
        if model is None:
            raise ValueError(
                f"reward_assign_lengths is set on step {i} without a reward_model_output."
            )
        if len(lengths) != model.shape[0] or len(lengths) != out[i].shape[0]:
            raise ValueError(
                f"reward_assign_lengths has {len(lengths)} entries for a batch of "
                f"{out[i].shape[0]} environments."
            )
        for b, length in enumerate(lengths):
            for o in range(1, min(int(length), i + 1)):
                target = out[i - o]
                target[b] += (reward_weight * model[b]).to(target.dtype)
    return out


@dataclass(eq=False)
class EnvTransition:
    """What the environment reported for one chunk; every field is batch-first and optional."""

    rewards: torch.Tensor | None = None
    dones: torch.Tensor | None = None
    terminations: torch.Tensor | None = None
    truncations: torch.Tensor | None = None
    intervene_actions: torch.Tensor | None = None
    intervene_flags: torch.Tensor | None = None
    rlt_switch_flags: torch.Tensor | None = None
    reward_model_output: torch.Tensor | None = None
    reward_assign_lengths: list[int] | None = None
    episode_data: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.reward_assign_lengths is not None:
            self.reward_assign_lengths = [int(n) for n in self.reward_assign_lengths]
        _convert_fields(self, flags=_TRANSITION_FLAGS)

    assign_history_rewards = staticmethod(assign_history_rewards)

    def with_trajectory_data(
        self,
        *,
        reward_model_output: torch.Tensor | None,
        reward_assign_lengths: list[int] | None,
        episode_data: dict[str, Any] | None,
    ) -> EnvTransition:
        """A copy with the three trajectory-only fields set."""
        return dataclasses.replace(
            self,
            reward_model_output=reward_model_output,
            reward_assign_lengths=reward_assign_lengths,
            episode_data=episode_data,
        )

    def to_dict(self) -> dict[str, Any]:
        """The seven env fields: dones, terminations, truncations, rewards, intervene_actions,
        intervene_flags and rlt_switch_flags."""
        return {name: getattr(self, name) for name in _TRANSITION_DICT_FIELDS}

    def split(self, sizes: Sequence[int]) -> list[EnvTransition]:
        """Split every field on the batch (``episode_data`` with ``split_episode_data``)."""
        sizes = list(sizes)
        columns: dict[str, list[Any]] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "episode_data" and value is not None:
                columns[f.name] = split_episode_data(value, sizes)
            else:
                columns[f.name] = split_batch_value(value, sizes)
        return [EnvTransition(**{k: v[i] for k, v in columns.items()}) for i in range(len(sizes))]

    @classmethod
    def merge(cls, parts: Sequence[EnvTransition]) -> EnvTransition:
        """Concatenate transitions on the batch.

        Raises ``ValueError("Cannot merge partial episode data.")`` when only some parts carry
        episode data, and as ``merge_batch_values`` does for any other field.
        """
        parts = list(parts)
        if not parts:
            raise ValueError("Cannot merge an empty list of transitions.")
        episodes = [p.episode_data for p in parts]
        present = [e is not None for e in episodes]
        if any(present) and not all(present):
            raise ValueError("Cannot merge partial episode data.")
        fields = {
            f.name: merge_batch_values([getattr(p, f.name) for p in parts])
            for f in dataclasses.fields(cls)
            if f.name != "episode_data"
        }
        episode_data = merge_episode_data(_present(episodes, "episode data")) if all(present) \
            else None
        return cls(**fields, episode_data=episode_data)

    def compute_rewards(
        self,
        *,
        bootstrap_values: torch.Tensor | None,
        env_reward_weight: float,
        reward_weight: float,
        auto_reset: bool,
        bootstrap_type: str,
        gamma: float,
    ) -> torch.Tensor | None:
        """The chunk's training rewards ``[B, C]`` (docs/embodied.md: "Rewards"), as a new tensor.

        None without rewards.  With a reward-model output the rewards are
        ``env_reward_weight * rewards + reward_weight * reward_model_output``.  With
        ``bootstrap_values``, ``auto_reset`` and dones, the last slot of each terminal env (its
        truncations for ``"standard"``, its dones for ``"always"``) gains
        ``gamma * bootstrap_values``.  History rewards (step 4) are applied by the accumulator
        through ``assign_history_rewards``.
        """
        if self.rewards is None:
            return None
        if self.reward_model_output is not None:
            mixed = env_reward_weight * self.rewards + reward_weight * self.reward_model_output
            r = mixed.to(self.rewards.dtype)
        else:
            r = self.rewards.clone()
        if bootstrap_values is not None and auto_reset and self.dones is not None:
            if bootstrap_type not in ("standard", "always"):
                raise ValueError(f"Unknown bootstrap_type {bootstrap_type!r}.")
            terminal = self.truncations if bootstrap_type == "standard" else self.dones
            if terminal is not None:
                mask = terminal[:, -1].bool()
                bonus = gamma * bootstrap_values.to(r.dtype)[mask].reshape(-1)
                r[mask, -1] += bonus
        return r


# ---------------------------------------------------------------------------------------------
# EnvOutput

_OBSERVATION_KEYS = ("main_images", "wrist_images", "extra_view_images", "states")


@dataclass(eq=False)
class EnvOutput:
    """One environment step's output: observations, transition, final observations and infos."""

    obs: dict[str, Any] | None = None
    transition: EnvTransition = field(default_factory=EnvTransition)
    final_obs: dict[str, Any] | None = None
    env_infos: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.transition is None:
            self.transition = EnvTransition()
        if self.env_infos is None:
            self.env_infos = {}
        _convert_fields(self)

    @property
    def rewards(self) -> torch.Tensor | None:
        return self.transition.rewards

    @property
    def dones(self) -> torch.Tensor | None:
        return self.transition.dones

    @property
    def terminations(self) -> torch.Tensor | None:
        return self.transition.terminations

    @property
    def truncations(self) -> torch.Tensor | None:
        return self.transition.truncations

    @property
    def intervene_actions(self) -> torch.Tensor | None:
        return self.transition.intervene_actions

    @property
    def intervene_flags(self) -> torch.Tensor | None:
        return self.transition.intervene_flags

    @property
    def rlt_switch_flags(self) -> torch.Tensor | None:
        return self.transition.rlt_switch_flags

    @staticmethod
    def prepare_observations(obs: dict[str, Any] | None) -> dict[str, Any]:
        """The policy-facing view of ``obs``: ``main_images``, ``wrist_images``,
        ``extra_view_images``, ``states`` and ``task_descriptions`` (a list); missing keys (or
        ``obs`` None) give None."""
        obs = obs or {}
        prepared = {key: to_cpu_contiguous(obs.get(key)) for key in _OBSERVATION_KEYS}
        tasks = obs.get("task_descriptions")
        prepared["task_descriptions"] = None if tasks is None else list(tasks)
        return prepared


# ---------------------------------------------------------------------------------------------
# EnvPart

_ENV_PART_BATCHED = ("next_obs", "next_rlt_obs", "bootstrap_values", "final_prev_values")


@dataclass(eq=False)
class EnvPart:
    """The environment-owned half of one action chunk of one or more logical sources."""

    sources: list[TrajectorySource]
    transition: EnvTransition
    """Rewards, done flags and interventions of the chunk, batch-first ``[B, C]``."""
    _: KW_ONLY
    next_obs: dict[str, Any] | None = None
    """The observation after the chunk (kept with ``collect_transitions``)."""
    requires_inference: bool = False
    """Rollout must run terminal inference before publishing (``complete`` clears it)."""
    next_rlt_obs: dict[str, Any] | None = None
    bootstrap_values: torch.Tensor | None = None
    """``[B, 1]`` V(terminal obs): the truncation bootstrap added with ``auto_reset``."""
    final_prev_values: torch.Tensor | None = None
    """Last chunk of an epoch: V(obs after the epoch), the last row of ``prev_values``."""
    initial_transition: EnvTransition | None = None
    """Chunk 0 only (required there): the done flags before the epoch's first action."""

    def __post_init__(self) -> None:
        self.sources = _check_sources(self.sources, "EnvPart")
        if not isinstance(self.transition, EnvTransition):
            raise TypeError(
                f"EnvPart.transition must be an EnvTransition, not {self.transition!r}."
            )
        if self.initial_transition is not None and not isinstance(
            self.initial_transition, EnvTransition
        ):
            raise TypeError("EnvPart.initial_transition must be an EnvTransition or None.")
        self.requires_inference = bool(self.requires_inference)
        _convert_fields(self, skip=("sources", "transition", "initial_transition"))

    def complete(
        self,
        *,
        next_obs: dict[str, Any] | None,
        next_rlt_obs: dict[str, Any] | None,
        final_prev_values: torch.Tensor | None = None,
    ) -> EnvPart:
        """A completed copy: no inference pending, the given next observations, and
        ``bootstrap_values = final_prev_values[:, :1]`` (None without final values).
        ``transition`` and ``initial_transition`` are shared with ``self``."""
        bootstrap = None if final_prev_values is None else final_prev_values[:, :1]
        return dataclasses.replace(
            self,
            sources=list(self.sources),
            requires_inference=False,
            next_obs=next_obs,
            next_rlt_obs=next_rlt_obs,
            final_prev_values=final_prev_values,
            bootstrap_values=bootstrap,
        )

    def split(self, split_sizes: Sequence[int] | None = None) -> list[EnvPart]:
        """Split into shards of ``split_sizes`` rows (default: one shard per source).

        Raises ``ValueError`` when the sizes do not sum to the part's source rows.
        """
        sizes = list(split_sizes) if split_sizes is not None else [s.size for s in self.sources]
        sources = TrajectorySource.split(self.sources, sizes)
        transitions = self.transition.split(sizes)
        initials = (
            self.initial_transition.split(sizes)
            if self.initial_transition is not None
            else [None] * len(sizes)
        )
        batched = {
            name: split_batch_value(getattr(self, name), sizes) for name in _ENV_PART_BATCHED
        }
        return [
            EnvPart(
                sources[i],
                transitions[i],
                requires_inference=self.requires_inference,
                initial_transition=initials[i],
                **{name: values[i] for name, values in batched.items()},
            )
            for i in range(len(sizes))
        ]

    @classmethod
    def merge(cls, fragments: Sequence[EnvPart]) -> EnvPart:
        """Concatenate fragments (in the given order) into one part of one logical source.

        Raises ``ValueError`` when the sources do not coalesce to one logical source, when
        ``requires_inference`` differs ("Conflicting terminal-inference state"), when only some
        fragments carry ``initial_transition`` ("Incomplete initial-state fragments"), or when a
        field is present on some fragments only.
        """
        fragments = list(fragments)
        if not fragments:
            raise ValueError("Cannot merge an empty list of EnvPart fragments.")
        sources = _single_source(TrajectorySource.merge([f.sources for f in fragments]), "EnvPart")
        if len({f.requires_inference for f in fragments}) != 1:
            raise ValueError("Conflicting terminal-inference state among EnvPart fragments.")
        initials = [f.initial_transition for f in fragments]
        if any(i is None for i in initials) and any(i is not None for i in initials):
            raise ValueError("Incomplete initial-state fragments: some lack initial_transition.")
        initial = None if initials[0] is None else \
            EnvTransition.merge(_present(initials, "an initial transition"))
        return cls(
            sources,
            EnvTransition.merge([f.transition for f in fragments]),
            requires_inference=fragments[0].requires_inference,
            initial_transition=initial,
            **{
                name: merge_batch_values([getattr(f, name) for f in fragments])
                for name in _ENV_PART_BATCHED
            },
        )

    def compute_rewards(self, **kwargs: Any) -> torch.Tensor | None:
        """``transition.compute_rewards`` with this part's ``bootstrap_values``."""
        return self.transition.compute_rewards(bootstrap_values=self.bootstrap_values, **kwargs)


# ---------------------------------------------------------------------------------------------
# PolicyOutput, PolicyPart

_POLICY_OUTPUT_FIELDS = ("forward_inputs", "prev_logprobs", "prev_values", "intervene_flags")


@dataclass(eq=False, kw_only=True)
class PolicyOutput:
    """What inference produced for a batch, kept for training.  It has no ``actions`` field:
    ``forward_inputs["action"]`` is the executed model action ``[B, D]``."""

    forward_inputs: dict[str, Any] = field(default_factory=dict)
    prev_logprobs: torch.Tensor | None = None
    prev_values: torch.Tensor | None = None
    intervene_flags: torch.Tensor | None = None
    versions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.forward_inputs is None:
            self.forward_inputs = {}
        if not isinstance(self.forward_inputs, dict):
            raise TypeError("PolicyOutput.forward_inputs must be a dict.")
        _convert_fields(self, flags=("intervene_flags",))
        self.versions = as_float32(self.versions)

    def split(self, sizes: Sequence[int]) -> list[PolicyOutput]:
        """Split every field on the batch."""
        sizes = list(sizes)
        columns = {
            f.name: split_batch_value(getattr(self, f.name), sizes)
            for f in dataclasses.fields(self)
        }
        return [PolicyOutput(**{k: v[i] for k, v in columns.items()}) for i in range(len(sizes))]

    @classmethod
    def merge(cls, parts: Sequence[PolicyOutput]) -> PolicyOutput:
        """Concatenate outputs on the batch; raises as ``merge_batch_values`` does."""
        parts = list(parts)
        if not parts:
            raise ValueError("Cannot merge an empty list of policy outputs.")
        return cls(
            **{
                f.name: merge_batch_values([getattr(p, f.name) for p in parts])
                for f in dataclasses.fields(cls)
            }
        )


@dataclass(eq=False)
class PolicyPart:
    """The policy-owned half of an action chunk: the pre-action observation and either the
    inferred ``output`` or ``external_actions`` (``[B,C,A]`` or ``[B,D]``), exactly one."""

    sources: list[TrajectorySource]
    obs: dict[str, Any] | None
    output: PolicyOutput | None = None
    external_actions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.sources = _check_sources(self.sources, "PolicyPart")
        if (self.output is None) == (self.external_actions is None):
            raise ValueError("PolicyPart needs exactly one of output and external_actions.")
        if self.output is not None and not isinstance(self.output, PolicyOutput):
            raise TypeError(f"PolicyPart.output must be a PolicyOutput, not {self.output!r}.")
        _convert_fields(self, skip=("sources", "output"))

    @property
    def inferred(self) -> bool:
        """True when the actions came from inference (``output`` is set)."""
        return self.output is not None

    def split(self, split_sizes: Sequence[int] | None = None) -> list[PolicyPart]:
        """Split into shards of ``split_sizes`` rows (default: one fragment per source)."""
        sizes = list(split_sizes) if split_sizes is not None else [s.size for s in self.sources]
        sources = TrajectorySource.split(self.sources, sizes)
        obs = split_batch_value(self.obs, sizes)
        outputs = self.output.split(sizes) if self.output is not None else [None] * len(sizes)
        actions = split_batch_value(self.external_actions, sizes)
        return [
            PolicyPart(sources[i], obs[i], output=outputs[i], external_actions=actions[i])
            for i in range(len(sizes))
        ]

    @classmethod
    def merge(cls, fragments: Sequence[PolicyPart]) -> PolicyPart:
        """Concatenate fragments (in order) into one part of one logical source.

        Raises ``ValueError`` when inferred and external fragments are mixed or the sources do
        not coalesce to one logical source.
        """
        fragments = list(fragments)
        if not fragments:
            raise ValueError("Cannot merge an empty list of PolicyPart fragments.")
        if len({f.inferred for f in fragments}) != 1:
            raise ValueError("Cannot merge inferred and external PolicyPart fragments.")
        sources = _single_source(
            TrajectorySource.merge([f.sources for f in fragments]), "PolicyPart"
        )
        inferred = fragments[0].inferred
        return cls(
            sources,
            merge_batch_values([f.obs for f in fragments]),
            output=PolicyOutput.merge(_present([f.output for f in fragments], "an output"))
            if inferred else None,
            external_actions=None
            if inferred
            else merge_batch_values([f.external_actions for f in fragments]),
        )


TrajectoryPart = PolicyPart | EnvPart
"""The only items the trajectory collector accepts."""


# ---------------------------------------------------------------------------------------------
# PolicyInput

_INPUT_FLAGS = ("rlt_switch_flags", "intervene_flags")


def _obs_batch_size(obs: dict[str, Any] | None) -> int:
    """Batch size of an observation dict: ``states``, then ``main_images``, then
    ``len(task_descriptions)``; ``ValueError`` when none is present."""
    obs = obs or {}
    for key in ("states", "main_images"):
        value = obs.get(key)
        if value is not None and getattr(value, "ndim", 0) > 0:
            return int(value.shape[0])
    tasks = obs.get("task_descriptions")
    if tasks is not None:
        return len(tasks)
    raise ValueError(
        "Cannot infer the batch size of a PolicyInput: obs has no states, main_images or "
        "task_descriptions."
    )


@dataclass(eq=False)
class PolicyInput:
    """One request from Env to Rollout (it never enters the trajectory channel)."""

    obs: dict[str, Any] | None = None
    rlt_switch_flags: torch.Tensor | None = None
    intervene_flags: torch.Tensor | None = None
    sources: list[TrajectorySource] = field(default_factory=list)
    env_parts: list[EnvPart | None] = field(default_factory=list)
    request_sizes: list[int] = field(default_factory=list)
    is_last: bool = False
    external_actions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.sources = _check_sources(self.sources or [], "PolicyInput")
        self.env_parts = list(self.env_parts or [])
        for part in self.env_parts:
            if part is not None and not isinstance(part, EnvPart):
                raise TypeError(f"PolicyInput.env_parts must hold EnvPart or None, not {part!r}.")
        self.request_sizes = [int(n) for n in self.request_sizes or []]
        self.is_last = bool(self.is_last)
        _convert_fields(self, flags=_INPUT_FLAGS, skip=("sources", "env_parts"))

    @property
    def requires_inference(self) -> bool:
        """True unless smooth intervention supplied ``external_actions``."""
        return self.external_actions is None

    def split(self, sizes: Sequence[int]) -> list[PolicyInput]:
        """Split into requests of ``sizes`` envs; shard i gets ``env_parts=[part_i or None]``
        and ``request_sizes=[sizes[i]]``.  Raises ``ValueError`` with more than one env part."""
        sizes = list(sizes)
        if len(self.env_parts) > 1:
            raise ValueError(
                f"Cannot split a PolicyInput carrying {len(self.env_parts)} env parts; "
                "split it before merging requests."
            )
        part = self.env_parts[0] if self.env_parts else None
        parts = part.split(sizes) if part is not None else [None] * len(sizes)
        sources = TrajectorySource.split(self.sources, sizes)
        columns = {
            name: split_batch_value(getattr(self, name), sizes)
            for name in ("obs", "rlt_switch_flags", "intervene_flags", "external_actions")
        }
        return [
            PolicyInput(
                sources=sources[i],
                env_parts=[parts[i]],
                request_sizes=[sizes[i]],
                is_last=self.is_last,
                **{name: values[i] for name, values in columns.items()},
            )
            for i in range(len(sizes))
        ]

    @classmethod
    def merge(cls, inputs: Sequence[PolicyInput]) -> PolicyInput:
        """Concatenate requests: obs and flags on the batch (a missing flag tensor is
        zero-filled), sources via ``TrajectorySource.merge``, ``env_parts`` and
        ``request_sizes`` appended.  Raises ``ValueError`` when inferred and external inputs are
        mixed."""
        inputs = list(inputs)
        if not inputs:
            raise ValueError("Cannot merge an empty list of policy inputs.")
        if len({i.requires_inference for i in inputs}) != 1:
            raise ValueError("Cannot merge inferred and external (intervention) policy inputs.")
        flags = {
            name: _zero_filled([getattr(i, name) for i in inputs], inputs) for name in _INPUT_FLAGS
        }
        return cls(
            obs=merge_batch_values([i.obs for i in inputs]),
            sources=TrajectorySource.merge([i.sources for i in inputs]),
            env_parts=[p for i in inputs for p in i.env_parts],
            request_sizes=[n for i in inputs for n in i.request_sizes],
            is_last=inputs[0].is_last,
            external_actions=merge_batch_values([i.external_actions for i in inputs]),
            **flags,
        )


def _zero_filled(values: list[Any], inputs: list[PolicyInput]) -> torch.Tensor | None:
    """Concatenate flag tensors, filling a missing one with zeros of its input's batch size."""
    template = next((v for v in values if v is not None), None)
    if template is None:
        return None
    filled = [
        v
        if v is not None
        else torch.zeros((_obs_batch_size(i.obs), *template.shape[1:]), dtype=template.dtype)
        for v, i in zip(values, inputs, strict=True)
    ]
    return torch.cat(filled, dim=0)


for _cls in (
    TrajectoryKey,
    TrajectorySource,
    EnvTransition,
    EnvOutput,
    PolicyOutput,
    PolicyPart,
    EnvPart,
    PolicyInput,
):
    register_type(_cls, name=f"zchannel.embodied.{_cls.__name__}")
del _cls
