"""Embodied RL items: env outputs, chunk results and trajectories."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from rldata.io_struct import FinishReason  # imported, not defined here: not registered as ours


class EnvStatus(enum.IntEnum):
    RUNNING = 0
    DONE = 1
    TRUNCATED = 2


class Phase(enum.Enum):
    ROLLOUT = enum.auto()
    TRAIN = enum.auto()
    EVAL = "eval"


class Sensors(enum.Flag):
    RGB = enum.auto()
    DEPTH = enum.auto()
    PROPRIO = enum.auto()


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Names one action chunk; frozen and hashable, so a dict key too."""

    step_id: int
    env_rank: int
    chunk_id: int = 0


@dataclass(frozen=True, slots=True)
class Stamp:
    """A frozen, slotted class with a field computed by ``__post_init__`` (``init=False``)."""

    key: ChunkKey
    version: int
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", f"{self.key.step_id}.{self.key.chunk_id}@{self.version}")


@dataclass(kw_only=True)
class EnvOutput:
    """Environment output for a chunk step; ``__post_init__`` moves tensors to the CPU."""

    obs: dict[str, Any]
    final_obs: dict[str, Any] | None = None
    dones: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    status: EnvStatus = EnvStatus.RUNNING

    def __post_init__(self) -> None:
        self.obs = {k: v.cpu().contiguous() if isinstance(v, torch.Tensor) else v
                    for k, v in self.obs.items()}
        if self.dones is not None:
            self.dones = self.dones.cpu().contiguous()


@dataclass(kw_only=True)
class ChunkStepResult:
    actions: torch.Tensor | None = None
    prev_logprobs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    dones: torch.Tensor | None = None
    forward_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    versions: torch.Tensor | None = None
    finish_reasons: list[FinishReason] = field(default_factory=list)


@dataclass
class Trajectory:
    max_episode_length: int = 0
    model_weights_id: str = ""
    actions: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    steps: list[ChunkStepResult] = field(default_factory=list)
    curr_obs: dict[str, Any] = field(default_factory=dict)
    key: ChunkKey | None = None
    phase: Phase = Phase.ROLLOUT


@dataclass
class EmbodiedTrajectory(Trajectory):
    """Inherits Trajectory's fields and adds its own."""

    sensors: Sensors = Sensors.RGB
    intervene_flags: torch.Tensor | None = None


class EvalTrajectory(Trajectory):
    """A subclass without the decorator: a dataclass with Trajectory's fields."""


@dataclass(slots=True)
class Budget:
    tokens: int
    used: int = field(init=False, default=0)


@dataclass
class LazyStats:
    """``cache`` is never set unless used: an instance may travel without it."""

    count: int
    cache: dict = field(init=False, repr=False)
