"""The ``embodied_trajectory`` collector's state as a value a channel carries
(``TrajectoryCollector.state_dict`` / ``load_state_dict``): a durable channel's journal writes it
now and then in place of the puts the collector took (docs/durability.md, Hook state).

It holds the joiner's stored halves and fragment buffers, the open scopes (their completed keys
and, per source, the steps gathered or the LeRobot records), and the output mode's side state:
the pipeline mode's shuffle generators, the LeRobot mode's accumulators (each environment's open
episode and the count of episodes emitted).  What the collector built itself is written as
plain tuples, lists, sets and dicts, which the channel's codec keeps as they are; the parts,
steps, tensors and frames are shared, not copied (the collector never changes them in place
once they are stored).
"""

from __future__ import annotations

from typing import Any

from zchannel.embodied.joiner import ChunkJoiner
from zchannel.embodied.modes import OutputMode, Scope
from zchannel.embodied.trajectory import TrajectoryAccumulator
from zchannel.embodied.types import EnvPart, PolicyPart

VERSION = 1
_KINDS: dict[str, type] = {"policy": PolicyPart, "env": EnvPart}
_KIND_NAMES = {kind: name for name, kind in _KINDS.items()}


def collector_state(joiner: ChunkJoiner, mode: OutputMode) -> dict[str, Any]:
    """The state of a collector made of ``joiner`` and ``mode``."""
    return {
        "version": VERSION,
        "mode": mode.name,
        "policy_parts": list(joiner.policy_parts.items()),
        "env_parts": list(joiner.env_parts.items()),
        "fragments": [(_KIND_NAMES[kind], key, list(parts))
                      for (kind, key), parts in joiner.fragments.items()],
        "scopes": [(sid, set(scope.keys),
                    [(source, _gathered(value)) for source, value in scope.sources.items()])
                   for sid, scope in mode.scopes.items()],
        "side": mode.side_state(),
    }


def load_collector_state(joiner: ChunkJoiner, mode: OutputMode, state: Any) -> None:
    """Put ``state`` (``collector_state`` of a collector of the same plan, as the channel
    decoded it) into ``joiner`` and ``mode``, which were just set up.

    Raises ``ValueError`` naming what does not fit: another version or output mode, or a
    malformed state (nothing is changed then).
    """
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise ValueError(f"not an embodied_trajectory collector state of version {VERSION}")
    if state.get("mode") != mode.name:
        raise ValueError(f"a state of the {state.get('mode')!r} mode for the {mode.name!r} mode")
    try:
        policy_parts = dict(state["policy_parts"])
        env_parts = dict(state["env_parts"])
        fragments = {(_KINDS[kind], key): list(parts) for kind, key, parts in state["fragments"]}
        scopes = {tuple(sid): Scope(set(keys), {tuple(source): _rebuilt(value)
                                                for source, value in sources})
                  for sid, keys, sources in state["scopes"]}
        side = state["side"]
        mode.load_side_state(side)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: torch
        raise ValueError(f"a malformed embodied_trajectory collector state: "
                         f"{type(exc).__name__}: {exc}") from None
    joiner.policy_parts, joiner.env_parts, joiner.fragments = policy_parts, env_parts, fragments
    mode.scopes = scopes


def _gathered(value: Any) -> tuple[str, list[Any]]:
    """What a scope gathered for one source: the steps of a ``TrajectoryAccumulator``, or
    the LeRobot mode's records."""
    if isinstance(value, TrajectoryAccumulator):
        return "steps", [(e.key, e.step, e.reward_model_output, e.reward_assign_lengths)
                         for e in value.entries]
    return "records", list(value)


def _rebuilt(gathered: Any) -> Any:
    kind, entries = gathered
    if kind == "records":
        return [tuple(record) for record in entries]
    if kind != "steps":
        raise ValueError(f"unknown scope entries {kind!r}")
    accumulator = TrajectoryAccumulator()
    for key, step, reward_model_output, lengths in entries:
        accumulator.append(key, step, reward_model_output=reward_model_output,
                           reward_assign_lengths=lengths)
    return accumulator
