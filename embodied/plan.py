"""``TrajectoryPlan``: the single configuration object of ``zchannel.embodied`` (docs/embodied.md).

The channel carries the plan as its ``options`` dict (``plan.to_options()``); hooks rebuild it with
``TrajectoryPlan.from_options(ctx.options)``.  Every field is checked at construction; an invalid
value raises ``ValueError`` whose message starts with ``TrajectoryPlan.<field>``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Mode = Literal["rollout", "pipeline", "lerobot"]
AdvType = Literal["gae", "grpo", "reinpp", "raw"]
RewardType = Literal["action_level", "chunk_level"]
BootstrapType = Literal["standard", "always"]

MODES: tuple[str, ...] = ("rollout", "pipeline", "lerobot")
ADV_TYPES: tuple[str, ...] = ("gae", "grpo", "reinpp", "raw")
REWARD_TYPES: tuple[str, ...] = ("action_level", "chunk_level")
BOOTSTRAP_TYPES: tuple[str, ...] = ("standard", "always")
INTERVENTION_PRECEDENCES: tuple[str, ...] = ("model", "env")

# Estimators whose per-column group scores require groups to stay inside one output shard.
GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "reinpp", "raw")

_ENUMS: dict[str, tuple[str, ...]] = {
    "mode": MODES,
    "adv_type": ADV_TYPES,
    "reward_type": REWARD_TYPES,
    "bootstrap_type": BOOTSTRAP_TYPES,
    "intervention_precedence": INTERVENTION_PRECEDENCES,
}
# name -> minimum value (inclusive); ``None`` means any int.
_INTS: dict[str, int | None] = {
    "num_sources": 1,
    "source_batch_size": 1,
    "num_chunks": 1,
    "rollout_epochs": 1,
    "actor_world_size": 1,
    "num_action_chunks": 1,
    "action_dim": 1,
    "group_size": 1,
    "max_episode_length": 0,
    "seed": None,
}
_UNIT_FLOATS = ("gamma", "gae_lambda")
_FLOATS = ("env_reward_weight", "reward_weight")
_OPTIONAL_FLOATS = ("rewards_lower_bound", "rewards_upper_bound")
_BOOLS = (
    "normalize_advantages",
    "auto_reset",
    "ignore_terminations",
    "collect_prev_infos",
    "collect_transitions",
    "enable_rlt",
    "shuffle",
    "lerobot_only_success",
    "deal_by_shard",
)
_LEROBOT_DEFAULTS: dict[str, Any] = {"lerobot_only_success": False, "lerobot_fps": 10}


def _fail(name: str, message: str) -> ValueError:
    return ValueError(f"TrajectoryPlan.{name}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class TrajectoryPlan:
    """Geometry, estimator and output-mode settings of one trajectory channel (docs/embodied.md).

    Raises ``ValueError`` naming the offending field for a wrong type, an out-of-range or unknown
    value, or an inconsistent geometry.  Ints given for float fields are stored as floats.
    """

    mode: Mode
    """What the collector hands out: Trajectory shards, ActorBatch items or EpisodeShards."""
    num_sources: int
    """S: logical sources, one per ``(env_rank, stage_id)``."""
    source_batch_size: int
    """B: environments in one source."""
    num_chunks: int
    """N: action chunks per source per rollout epoch."""
    rollout_epochs: int
    """E: rollout epochs per training step."""
    actor_world_size: int
    """AW: actor consumers (ranks ``0..AW-1``)."""
    num_action_chunks: int
    """C: actions per chunk."""
    action_dim: int
    """A: width of one action."""
    adv_type: AdvType = "gae"
    """Advantage estimator."""
    gamma: float = 1.0
    """Discount (also scales the truncation bootstrap)."""
    gae_lambda: float = 1.0
    """GAE λ."""
    group_size: int = 8
    """Consecutive environment columns per group (grpo, reinpp, raw, reward filter)."""
    normalize_advantages: bool = True
    """Whiten advantages over one actor's batch, last."""
    reward_type: RewardType = "chunk_level"
    """One advantage per action slot, or one per chunk."""
    bootstrap_type: BootstrapType = "standard"
    """Terminals that get the truncation bootstrap: truncations, or every done."""
    auto_reset: bool = False
    """Environments reset inside an epoch: no loss mask, bootstrap at truncations."""
    ignore_terminations: bool = False
    """No loss mask from dones."""
    env_reward_weight: float = 0.0
    """Weight of the env reward when a reward-model output is present."""
    reward_weight: float = 1.0
    """Weight of the reward-model output."""
    collect_prev_infos: bool = True
    """Keep ``prev_logprobs``, ``prev_values`` and the final values."""
    collect_transitions: bool = False
    """Keep ``curr_obs``/``next_obs`` (otherwise they stay ``{}``)."""
    enable_rlt: bool = False
    """Keep compact RLT features as the transitions."""
    max_episode_length: int = 0
    """Copied into ``Trajectory.max_episode_length`` (0: unknown)."""
    micro_batch_size: int | None = None
    """Pipeline mode: rows per ActorBatch (required there)."""
    shuffle: bool = True
    """Pipeline mode: shuffle rows before cutting micro-batches."""
    seed: int = 0
    """Pipeline mode: actor a's shuffle generator is seeded ``seed + a``."""
    rewards_lower_bound: float | None = None
    """Reward filter: mask groups whose mean reward is below (None: unbounded)."""
    rewards_upper_bound: float | None = None
    """Reward filter: mask groups whose mean reward is above (None: unbounded)."""
    lerobot_only_success: bool = False
    """LeRobot mode: keep only successful, terminated episodes."""
    lerobot_fps: float = 10
    """LeRobot mode: ``timestamp = frame_index / lerobot_fps``."""
    deal_by_shard: bool = False
    """Rollout mode: shard i of env rank r goes to actor rank ``(r·shards_per_source + i) mod
    AW`` while that actor is present (read from the rows' ``column`` tags), not least-loaded:
    which actor trains which shard then does not depend on which source flushed first (the
    runners set it for ``reproducible=True``)."""
    intervention_precedence: str = "model"
    """Whose intervention flags a chunk keeps when the env intervened and the model flagged
    too: ``"model"`` (the model's flags overwrite the env's; actions stay the executed ones) or
    ``"env"`` (the env's executed intervention wins, as in RLinf; the runners use this)."""

    def __post_init__(self) -> None:
        self._check_fields()
        self._check_geometry()

    # -- derived geometry ------------------------------------------------------------------

    @property
    def total_envs(self) -> int:
        """S·B: environment columns over all sources."""
        return self.num_sources * self.source_batch_size

    @property
    def shards_per_source(self) -> int:
        """lcm(S, AW) / S: output shards each source's trajectory is split into."""
        return math.lcm(self.num_sources, self.actor_world_size) // self.num_sources

    @property
    def items_per_actor(self) -> int:
        """lcm(S, AW) / AW: items each actor takes per training step."""
        return math.lcm(self.num_sources, self.actor_world_size) // self.actor_world_size

    @property
    def actor_width(self) -> int:
        """S·B / AW: environment columns per actor (pipeline mode).

        Raises ``ValueError`` when S·B is not divisible by AW.
        """
        if self.total_envs % self.actor_world_size:
            raise _fail(
                "actor_world_size",
                f"{self.total_envs} environments cannot be divided among "
                f"{self.actor_world_size} actors",
            )
        return self.total_envs // self.actor_world_size

    @property
    def action_chunk_dim(self) -> int:
        """D = C·A: the flattened action width of one chunk."""
        return self.num_action_chunks * self.action_dim

    # -- options -----------------------------------------------------------------------------

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> TrajectoryPlan:
        """Build a plan from a mapping of field names to values.

        Raises ``ValueError`` naming the field for an unknown key, a missing required field or
        any invalid value (see the class docstring).
        """
        if not isinstance(options, Mapping):
            raise ValueError(
                f"TrajectoryPlan options must be a mapping, not {type(options).__name__}"
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in options:
            if key not in fields:
                raise ValueError(f"TrajectoryPlan.{key}: unknown option {key!r}")
        for name, f in fields.items():
            missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if missing and name not in options:
                raise _fail(name, "required option is missing")
        return cls(**dict(options))

    def to_options(self) -> dict[str, Any]:
        """A plain, msgpack-able dict with every field; ``from_options`` inverts it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # -- validation --------------------------------------------------------------------------

    def _check_fields(self) -> None:
        for name, choices in _ENUMS.items():
            value = getattr(self, name)
            if not isinstance(value, str) or value not in choices:
                raise _fail(name, f"{value!r} is not one of {', '.join(choices)}")
        for name, minimum in _INTS.items():
            value = getattr(self, name)
            if not _is_int(value):
                raise _fail(name, f"expected an int, got {type(value).__name__} {value!r}")
            if minimum is not None and value < minimum:
                raise _fail(name, f"must be >= {minimum}, got {value}")
        for name in _BOOLS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise _fail(name, f"expected a bool, got {type(value).__name__} {value!r}")
        self._check_floats()
        mbs = self.micro_batch_size
        if mbs is not None and (not _is_int(mbs) or mbs < 1):
            raise _fail("micro_batch_size", f"expected None or an int >= 1, got {mbs!r}")
        fps = self.lerobot_fps
        if not _is_number(fps) or not math.isfinite(fps) or fps <= 0:
            raise _fail("lerobot_fps", f"expected a finite number > 0, got {fps!r}")

    def _check_floats(self) -> None:
        """The float fields checked (and made floats): numbers, not NaN, unit ones in [0, 1]."""
        for name in _UNIT_FLOATS + _FLOATS + _OPTIONAL_FLOATS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FLOATS:
                continue
            if not _is_number(value) or math.isnan(value):
                raise _fail(name, f"expected a float, got {type(value).__name__} {value!r}")
            if name in _UNIT_FLOATS and not 0.0 <= value <= 1.0:
                raise _fail(name, f"must be in [0, 1], got {value}")
            object.__setattr__(self, name, float(value))

    def _check_geometry(self) -> None:
        if self.mode != "lerobot":
            for name, default in _LEROBOT_DEFAULTS.items():
                if getattr(self, name) != default:
                    raise _fail(name, f"is only supported in lerobot mode, not {self.mode!r}")
        B = self.source_batch_size
        if self.mode == "pipeline":
            if self.micro_batch_size is None:
                raise _fail("micro_batch_size", "is required in pipeline mode")
            width = self.actor_width  # raises naming actor_world_size
            rows = self.num_chunks * width
            if rows % self.micro_batch_size:
                raise _fail(
                    "micro_batch_size",
                    f"{self.micro_batch_size} does not divide the {rows} rows "
                    "(num_chunks * actor_width) of one actor's epoch",
                )
            shard_width = math.gcd(B, width)
        else:
            shard_width = B // self.shards_per_source
            if self.mode == "rollout" and B % self.shards_per_source:
                raise _fail(
                    "source_batch_size",
                    f"{B} is not divisible by shards_per_source={self.shards_per_source}",
                )
        if self.adv_type == "grpo" and self.group_size < 2:
            raise _fail("group_size", "grpo needs group_size >= 2")
        bounded = self.rewards_lower_bound is not None or self.rewards_upper_bound is not None
        grouped = self.adv_type in GROUP_ESTIMATORS or bounded
        if self.mode != "lerobot" and grouped and shard_width % self.group_size:
            raise _fail(
                "group_size",
                f"groups of {self.group_size} would straddle output shards "
                f"{shard_width} environments wide",
            )
        lower, upper = self.rewards_lower_bound, self.rewards_upper_bound
        if lower is not None and upper is not None and lower > upper:
            raise _fail(
                "rewards_lower_bound",
                f"{lower} is greater than rewards_upper_bound={upper}",
            )
