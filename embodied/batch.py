"""Batch helpers: split and merge batch-first values and lerobot episode data (docs/embodied.md).

A *batch value* is None, a tensor or numpy array ``[B, ...]``, a list of B items, a dict of batch
values, or a scalar (``bool``, ``int``, ``float``, ``str``, numpy scalar) describing the whole
batch.  Scalars are repeated by ``split_batch_value`` and must agree in ``merge_batch_values``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

SCALAR_TYPES = (bool, int, float, str, np.generic)
EPISODE_STEP_KEYS = ("obs_list", "infos_list")


def to_cpu_contiguous(value: Any) -> Any:
    """Return ``value`` with every tensor detached, on CPU and contiguous (clean tensors are
    returned as they are).

    Recurses into dicts, lists and tuples (rebuilding them); any other object, including numpy
    arrays and dataclass instances, is returned unchanged.
    """
    if isinstance(value, torch.Tensor):
        if (
            not value.requires_grad
            and value.device.type == "cpu"
            and value.is_contiguous()
            and not value.is_conj()
            and not value.is_neg()
        ):
            return value  # already clean: keep the object
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if tensor.is_conj():
            tensor = tensor.resolve_conj()
        if tensor.is_neg():
            tensor = tensor.resolve_neg()
        return tensor.contiguous()
    if isinstance(value, dict):
        return {k: to_cpu_contiguous(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu_contiguous(v) for v in value]
    if isinstance(value, tuple):
        return tuple(to_cpu_contiguous(v) for v in value)
    return value


def _check_sizes(sizes: Sequence[int]) -> list[int]:
    sizes = list(sizes)
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"Split sizes must be non-negative ints, got {sizes!r}.")
    return sizes


def split_batch_value(value: Any, sizes: Sequence[int]) -> list[Any]:
    """Split ``value`` along its batch dimension into ``len(sizes)`` shards.

    None gives ``[None] * n``; tensors are split on dim 0 (each piece contiguous), numpy arrays on
    axis 0, lists are sliced, dicts are split per key and scalars are repeated.  Raises
    ``ValueError`` when the batch length differs from ``sum(sizes)`` and ``TypeError`` for any
    other type.
    """
    sizes = _check_sizes(sizes)
    if value is None:
        return [None] * len(sizes)
    if isinstance(value, SCALAR_TYPES):
        return [value] * len(sizes)
    if isinstance(value, dict):
        per_key = {k: split_batch_value(v, sizes) for k, v in value.items()}
        return [{k: parts[i] for k, parts in per_key.items()} for i in range(len(sizes))]
    if isinstance(value, (torch.Tensor, np.ndarray, list)):
        length = len(value) if isinstance(value, list) else (value.shape[0] if value.ndim else -1)
        if length != sum(sizes):
            raise ValueError(
                f"Cannot split a batch of {length} rows into sizes {sizes} (sum {sum(sizes)})."
            )
        if isinstance(value, torch.Tensor):
            return [piece.contiguous() for piece in torch.split(value, sizes, dim=0)]
        bounds = np.cumsum([0, *sizes]).tolist()
        return [value[bounds[i] : bounds[i + 1]] for i in range(len(sizes))]
    raise TypeError(f"Cannot split a batch value of type {type(value).__name__}.")


def _batch_kind(values: list[Any]) -> type:
    """The container type all ``values`` share (tensor, array, list or dict); ``TypeError``
    for another type or a mix."""
    first = values[0]
    kind = next(
        (t for t in (torch.Tensor, np.ndarray, list, dict) if isinstance(first, t)),
        None,
    )
    if kind is None:
        raise TypeError(f"Cannot merge batch values of type {type(first).__name__}.")
    for other in values[1:]:
        if not isinstance(other, kind):
            raise TypeError(
                f"Cannot merge batch values of types {type(first).__name__} "
                f"and {type(other).__name__}."
            )
    return kind


def merge_batch_values(values: Sequence[Any]) -> Any:
    """Concatenate batch values along the batch dimension; the inverse of ``split_batch_value``.

    Raises ``ValueError`` for an empty list, a mix of None and present values, dicts with
    different keys or conflicting scalars, and ``TypeError`` for mixed or unsupported types.
    """
    values = list(values)
    if not values:
        raise ValueError("Cannot merge an empty list of batch values.")
    present = [v is not None for v in values]
    if not any(present):
        return None
    if not all(present):
        raise ValueError("Cannot merge present and absent batch values.")
    first = values[0]
    if isinstance(first, SCALAR_TYPES):
        for other in values[1:]:
            if type(other) is not type(first) or other != first:
                raise ValueError(f"Cannot merge conflicting scalar values {first!r} and {other!r}.")
        return first
    kind = _batch_kind(values)
    if kind is torch.Tensor:
        return torch.cat(values, dim=0)
    if kind is np.ndarray:
        return np.concatenate(values, axis=0)
    if kind is list:
        return [item for value in values for item in value]
    keys = set(first)
    for other in values[1:]:
        if set(other) != keys:
            raise ValueError(
                f"Cannot merge dicts with different keys: {sorted(map(str, keys))} "
                f"and {sorted(map(str, other))}."
            )
    return {k: merge_batch_values([v[k] for v in values]) for k in first}


def split_episode_data(data: dict[str, Any], sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Split lerobot episode data on the batch dimension (never on the step dimension).

    Each element of ``obs_list`` and ``infos_list`` is split separately; a single info dict and
    every other entry go through ``split_batch_value``.  Raises as ``split_batch_value`` does.
    """
    sizes = _check_sizes(sizes)
    if not isinstance(data, dict):
        raise TypeError(f"Episode data must be a dict, not {type(data).__name__}.")
    shards: list[dict[str, Any]] = [{} for _ in sizes]
    for key, value in data.items():
        if key in EPISODE_STEP_KEYS and isinstance(value, list):
            per_step = [split_batch_value(step, sizes) for step in value]
            parts = [[step[i] for step in per_step] for i in range(len(sizes))]
        else:
            parts = split_batch_value(value, sizes)
        for shard, part in zip(shards, parts, strict=True):
            shard[key] = part
    return shards


def merge_episode_data(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merge episode data split by ``split_episode_data``; absent keys stay absent.

    Raises ``ValueError("… different chunk lengths")`` when step lists differ in length, and
    ``ValueError`` when the parts have different keys or mix step lists with single dicts.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("Cannot merge an empty list of episode data.")
    keys = list(parts[0])
    for part in parts[1:]:
        if set(part) != set(keys):
            raise ValueError(
                f"Cannot merge episode data with different keys: {sorted(keys)} and {sorted(part)}."
            )
    merged: dict[str, Any] = {}
    for key in keys:
        values = [part[key] for part in parts]
        is_list = [isinstance(v, list) for v in values]
        if key in EPISODE_STEP_KEYS and any(is_list):
            if not all(is_list):
                raise ValueError(f"Cannot merge episode {key} lists with single values.")
            if len({len(v) for v in values}) != 1:
                raise ValueError(
                    f"Cannot merge episode {key} with different chunk lengths: "
                    f"{[len(v) for v in values]}."
                )
            merged[key] = [merge_batch_values(step) for step in zip(*values, strict=True)]
        else:
            merged[key] = merge_batch_values(values)
    return merged
