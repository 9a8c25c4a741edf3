"""Worker groups as ``producers=`` / ``consumers=`` of ``Channel.create`` (duck-typed).

A *worker group* is any object with a method ``zchannel_group()`` returning
``(name, worker_ids, placement_targets)``: the group's name (``"actor"``), its stable consumer
ids (``["actor:0", "actor:1"]``) and its placement targets (Ray actor handles, or an empty list
for local processes).  ``expand_groups`` replaces a group given as a producer by its name and as a
consumer by its ids; its placement targets follow it in the same list, where the Ray placement
(``ray_placement.split_targets``) takes them out: producers' targets first, so a channel is placed
on the first producer's node, else the first consumer's.  ``zchannel.embodied.groups.WorkerGroup``
implements the protocol; the broker package never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def is_group(value: Any) -> bool:
    return callable(getattr(value, "zchannel_group", None))


def _expand(values: Any, as_consumers: bool) -> Any:
    if values is None or isinstance(values, (str, Mapping)) or not isinstance(values, Iterable):
        return values
    values = list(values)
    if not any(is_group(v) for v in values):
        return values
    out: list = []
    for value in values:
        if not is_group(value):
            out.append(value)
            continue
        name, ids, targets = value.zchannel_group()
        out.extend(list(ids) if as_consumers else [name])
        out.extend(targets)
    return out


def expand_groups(producers: Any, consumers: Any) -> tuple[Any, Any]:
    """``producers`` and ``consumers`` with every worker group expanded (see the module doc)."""
    return _expand(producers, False), _expand(consumers, True)


__all__ = ["expand_groups", "is_group"]
