"""What a trajectory step keeps of its observations: the dicts without the keys a trajectory
drops, each leaf checked to stack step by step and to travel to the actors (a tensor, a numeric
or bool numpy array, None, or a dict of them), so that a leaf that cannot fails the put that
brings it rather than the flush of its scope (docs/embodied.md, "Transitions")."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

DROPPED_OBS_KEYS = ("task_descriptions",)
"""Observation keys a trajectory does not keep."""


def kept_observations(obs: dict[str, Any], name: str) -> dict[str, Any]:
    """``obs`` without the keys a trajectory drops, its leaves checked: a trajectory stacks
    them step by step (``TypeError`` at the put that brings a leaf that cannot stack, rather
    than at the flush)."""
    kept = {k: v for k, v in obs.items() if k not in DROPPED_OBS_KEYS}
    _check_stackable(kept, name, 0)
    return kept


_MAX_OBS_DEPTH = 32


def _check_stackable(values: dict[Any, Any], name: str, depth: int) -> None:
    """``TypeError`` unless every leaf of ``values`` is a tensor, a numpy array of a dtype that
    travels (numeric or bool) or None."""
    if depth >= _MAX_OBS_DEPTH:
        raise TypeError(f"{name!r} nests dicts deeper than {_MAX_OBS_DEPTH} levels.")
    for key, value in values.items():
        if isinstance(value, dict):
            _check_stackable(value, f"{name}.{key}", depth + 1)
        elif isinstance(value, np.ndarray):
            if not _travels(value.dtype):
                raise TypeError(
                    f"{name}.{key} is a numpy array of dtype {value.dtype}: a trajectory's "
                    "observation arrays must be numeric or bool (they travel to the actors)."
                )
        elif value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{name}.{key} is a {type(value).__name__}: a trajectory's observation leaves "
                "must be tensors, numpy arrays or dicts of them (only 'task_descriptions' is "
                "dropped)."
            )


def _travels(dtype: np.dtype) -> bool:
    """Whether a numpy array of ``dtype`` travels: bool, integers, floats up to 64 bits and
    complex up to 128 (what the channel's codec sends)."""
    kind, size = dtype.kind, dtype.itemsize
    return kind in "biu" or kind == "f" and size <= 8 or kind == "c" and size <= 16


__all__ = ["DROPPED_OBS_KEYS", "kept_observations"]
