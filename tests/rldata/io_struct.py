"""Reasoning RL items: rollout requests, sequence groups and rollout results."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


class FinishReason(str, enum.Enum):
    ABORT = "abort"
    STOP = "stop"
    LENGTH = "length"


@dataclass
class RolloutRequest:
    """Prompts for a rollout server: ``n`` completions for each input."""

    n: int
    input_ids: list[list[int]]
    image_data: list[list[bytes]]
    answers: list[list[str] | dict]
    multi_modal_inputs: list[dict | None]


@dataclass
class SeqGroupInfo:
    """One prompt expanded into ``group_size`` sequences; the completion state is kept in fields
    the constructor does not take (``init=False``), reset by ``__post_init__``."""

    id: int
    input_ids: list[int]
    answer: list[str] | dict
    group_size: int
    idx_completed: set[int] = field(init=False, compare=False)
    idx_aborted: set[int] = field(init=False, compare=False)
    results: list[Any] = field(init=False, compare=False)
    image_data: list | None = None

    def __post_init__(self) -> None:
        assert self.group_size > 0, "group_size must be greater than 0"
        self.idx_completed = set()
        self.idx_aborted = set()
        self.results = [None] * self.group_size

    def record(self, idx: int, reason: FinishReason, output_ids: list[int]) -> None:
        (self.idx_aborted if reason is FinishReason.ABORT else self.idx_completed).add(idx)
        self.results[idx] = {"output_ids": output_ids, "finish_reason": reason}

    def __hash__(self) -> int:
        return self.id


@dataclass(kw_only=True)
class RolloutResult:
    """A batch of completions with their rewards and log-probabilities."""

    num_sequence: int
    group_size: int
    prompt_lengths: list[int]
    prompt_ids: list[list[int]]
    response_lengths: list[int]
    response_ids: list[list[int]]
    is_end: list[bool]
    rewards: list[float] | torch.Tensor | None = None
    finish_reasons: list[FinishReason] = field(default_factory=list)
    prev_logprobs: torch.Tensor | None = None
    ref_logprobs: list[torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return self.num_sequence // self.group_size


class Timing:
    """A namespace, not a dataclass: the dataclass nested in it is registered (``Timing.Span``)."""

    @dataclass
    class Span:
        name: str
        seconds: float
