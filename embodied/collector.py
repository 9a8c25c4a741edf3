"""The ``embodied_trajectory`` broker hooks: ``TrajectoryCollector`` and ``TrajectoryDispatcher``.

The collector joins the policy and environment halves of each action chunk (``ChunkJoiner``),
hands the joined chunks to the plan's output mode (``zchannel.embodied.modes``) and yields the
mode's outputs on ``DEFAULT_KEY``.  A put is atomic: its outputs are computed on the side, and the
mode state, the joiner acknowledgements and the scope clean-up are committed only when all of
them succeeded (docs/embodied.md: "Pairing the halves").

The dispatcher deals ``ActorBatch`` items to the consumer of their rank (rank-bound, even when that
consumer left) and every other item least-loaded.

Importing this module imports the whole ``zchannel.embodied`` package first (Python runs a
package's ``__init__`` before its modules), so every transport type is registered with the
serializer (it is the target of the ``zchannel.hooks`` entry point).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from zchannel.broker import DEFAULT_KEY
from zchannel.embodied.checks import check_part
from zchannel.embodied.collector_state import collector_state, load_collector_state
from zchannel.embodied.joiner import ChunkJoiner
from zchannel.embodied.modes import (
    EXTERNAL_ACTIONS_MESSAGE,
    OutputMode,
    PreparedPut,
    held_bytes,
    make_mode,
)
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.trajectory import ActorBatch, Trajectory
from zchannel.embodied.types import COLUMN_STRIDE, EnvPart, PolicyPart, TrajectoryKey
from zchannel.hooks import (
    ChannelContext,
    Collector,
    Dispatcher,
    register_collector,
    register_dispatcher,
)

HOOK_NAME = "embodied_trajectory"


def plan_from_context(ctx: ChannelContext) -> TrajectoryPlan:
    """The ``TrajectoryPlan`` carried as the channel's options.

    Raises ``ValueError`` when the options are missing or empty, or invalid (naming the field).
    """
    options = getattr(ctx, "options", None)
    if not options:
        raise ValueError(
            f"The {HOOK_NAME!r} hooks need the channel options of a TrajectoryPlan "
            "(options=plan.to_options())."
        )
    if not isinstance(options, Mapping):
        raise ValueError(f"Channel options must be a mapping, not {type(options).__name__}.")
    return TrajectoryPlan.from_options(options)


def consumer_rank(consumer_id: str) -> int:
    """The integer after the last ``:`` of a consumer id (``"actor:2"`` → 2).

    Raises ``ValueError`` when the id has no integer rank.
    """
    _, sep, rank = str(consumer_id).rpartition(":")
    if not sep or not rank.isdigit():
        raise ValueError(f"Consumer id {consumer_id!r} has no integer rank ('group:rank').")
    return int(rank)


@register_collector(HOOK_NAME)
class TrajectoryCollector(Collector):
    """Turns PolicyPart/EnvPart puts into Trajectory, ActorBatch or EpisodeShard items.

    See docs/embodied.md.

    ``collect`` raises ``ValueError`` for a foreign item, a key outside ``[0, E) × [0, N)``,
    external policy actions outside lerobot mode, a duplicate key in an open scope, joiner
    errors and anything the output mode rejects; the put then changes nothing except that
    a valid half stays stored in the joiner.
    """

    def setup(self, ctx: ChannelContext) -> None:
        """Build the plan from ``ctx.options``, the joiner and the mode state."""
        self.ctx = ctx
        self.plan = plan_from_context(ctx)
        self.joiner = ChunkJoiner(self.plan.source_batch_size)
        self.mode: OutputMode = make_mode(self.plan)

    def collect(self, item: Any, key: Any) -> Iterator[tuple[Any, Any]]:
        """Push ``item`` into the joiner and yield ``(DEFAULT_KEY, output)`` for its flushes.

        The input ``key`` is ignored.
        """
        self._check_item(item)
        chunks = self.joiner.push(item)
        outputs: list[Any] = []
        if chunks:
            prepared = self.mode.prepare(chunks)
            self._commit(chunks, prepared)
            outputs = prepared.outputs
        for output in outputs:
            yield DEFAULT_KEY, output

    def holds_state(self) -> bool:
        """Halves waiting for their other half, fragments, open scopes or (LeRobot mode)
        episodes open across training steps: a durable channel keeps (and replays at a
        restart) the puts since none was held."""
        joiner = self.joiner
        return bool(joiner.policy_parts or joiner.env_parts or joiner.fragments
                    or self.mode.scopes or self.mode.holds_side_state())

    def state_dict(self) -> dict[str, Any]:
        """Halves, fragments, open scopes and the mode's side state (generators, LeRobot
        accumulators) as a value the channel carries: a durable channel's journal writes it
        in place of the puts taken so far (``embodied/collector_state.py``)."""
        return collector_state(self.joiner, self.mode)

    def load_state_dict(self, state: Any) -> None:
        """Take back a ``state_dict`` of a collector of the same plan; ``ValueError`` naming
        what does not fit (nothing changes then)."""
        load_collector_state(self.joiner, self.mode, state)

    def _check_item(self, item: Any) -> None:
        if not isinstance(item, (PolicyPart, EnvPart)):
            raise ValueError(
                f"Unexpected trajectory part {type(item).__module__}.{type(item).__qualname__}: "
                "the embodied_trajectory collector accepts PolicyPart and EnvPart items only."
            )
        plan = self.plan
        for source in item.sources:
            k = source.key
            if not (0 <= k.epoch_id < plan.rollout_epochs and 0 <= k.chunk_id < plan.num_chunks):
                raise ValueError(
                    f"Trajectory key {k} is outside the plan: epoch_id must be in "
                    f"[0, {plan.rollout_epochs}) and chunk_id in [0, {plan.num_chunks})."
                )
        if isinstance(item, PolicyPart) and not item.inferred and plan.mode != "lerobot":
            raise ValueError(EXTERNAL_ACTIONS_MESSAGE)
        check_part(item, plan, strict=False)  # shapes, naming the key and the field

    def _commit(self, chunks: list[Any], prepared: PreparedPut) -> None:
        """Install a prepared put: mode state, acknowledgements, flushed-scope clean-up."""
        self.mode.commit(prepared)
        for chunk in chunks:
            self.joiner.acknowledge(chunk.key)
        flushed = prepared.flushed_keys
        if flushed:
            self._forget_keys(flushed)

    def _forget_keys(self, keys: set[TrajectoryKey]) -> None:
        """Drop every joiner half and fragment buffer left for the keys of flushed scopes."""
        for key in keys:
            self.joiner.acknowledge(key)
        for fragment_key in [fk for fk in self.joiner.fragments if fk[1] in keys]:
            del self.joiner.fragments[fragment_key]

    def stats(self) -> dict[str, Any]:
        """Open scopes, stored halves and bytes held (msgpack-able; shown by ``zchannel stat``)."""
        joiner = self.joiner
        held = [joiner.policy_parts, joiner.env_parts, joiner.fragments]
        return {
            "mode": self.plan.mode,
            "open_scopes": len(self.mode.scopes),
            "pending_keys": sum(len(s.keys) for s in self.mode.scopes.values()),
            "policy_parts": len(joiner.policy_parts),
            "env_parts": len(joiner.env_parts),
            "fragment_buffers": len(joiner.fragments),
            "held_bytes": held_bytes([*held, *self.mode.held_objects()]),
        }


@register_dispatcher(HOOK_NAME)
class TrajectoryDispatcher(Dispatcher):
    """Deals ``ActorBatch`` items by rank and every other item least-loaded (docs/embodied.md).

    ``ActorBatch`` items are rank-bound: ``route`` returns the consumer id of ``actor_rank``
    fixed at setup (pipeline mode), also after that consumer left, so they wait for it.  Other
    items go to the present consumer with the fewest items dealt so far for the key (ties to the
    smallest id), or to the shared queue when no consumer is present.
    """

    needs_item = True

    def setup(self, ctx: ChannelContext) -> None:
        """Build the plan; in pipeline mode map ranks 0..AW−1 to the declared consumer ids.

        Raises ``ValueError`` for missing options or, in pipeline mode, unless ``ctx.consumers``
        holds exactly one id per rank ``0..actor_world_size−1`` and no other rank.
        """
        super().setup(ctx)
        self.plan = plan_from_context(ctx)
        self._dealt: dict[Any, dict[str, int]] = {}
        self._rank_ids: dict[int, str] = {}
        if self.plan.mode == "pipeline":
            self._rank_ids = self._ranks_of(tuple(ctx.consumers))

    def _ranks_of(self, consumers: tuple[str, ...]) -> dict[int, str]:
        world = self.plan.actor_world_size
        ranks: dict[int, str] = {}
        for consumer in consumers:
            rank = consumer_rank(consumer)
            if rank in ranks or not 0 <= rank < world:
                raise ValueError(
                    f"Pipeline mode needs exactly one consumer per rank 0..{world - 1}; got "
                    f"{list(consumers)} (declare consumers={{'actor': {world}}})."
                )
            ranks[rank] = consumer
        if len(ranks) != world:
            raise ValueError(
                f"Pipeline mode needs exactly one consumer per rank 0..{world - 1}; got "
                f"{list(consumers)} (declare consumers={{'actor': {world}}})."
            )
        return ranks

    def route(self, item: Any, key: Any) -> str | None:
        """The consumer id for ``item`` (see the class docstring), or None for the shared queue."""
        if isinstance(item, ActorBatch):
            bound = self._rank_ids.get(item.actor_rank)
            if bound is not None:
                return bound
            for consumer in self.ctx.consumers:
                if consumer_rank(consumer) == item.actor_rank:
                    return consumer
            return None
        consumers = self.ctx.consumers
        if not consumers:
            return None
        bound = self._shard_consumer(item) if self.plan.deal_by_shard else None
        if bound is not None:
            return bound
        counts = self._dealt.setdefault(key, {})
        choice = min(consumers, key=lambda c: counts.get(c, 0))
        counts[choice] = counts.get(choice, 0) + 1
        return choice

    def _shard_consumer(self, item: Any) -> str | None:
        """``deal_by_shard``: the present consumer of rank ``(r·k + i) mod AW`` for shard i of
        env rank r (k shards per source), read from the shard's first ``column`` tag
        (``r·10^6 + row``); None (least-loaded) for an item without tags or when that rank
        is absent (its shards are then dealt among the present ones)."""
        column = item.forward_inputs.get("column") if isinstance(item, Trajectory) else None
        if not isinstance(column, torch.Tensor) or column.numel() == 0:
            return None
        env_rank, row = divmod(int(column.reshape(-1)[0]), COLUMN_STRIDE)
        k = self.plan.shards_per_source
        rank = (env_rank * k + row // (self.plan.source_batch_size // k)) \
            % self.plan.actor_world_size
        return next((c for c in self.ctx.consumers if consumer_rank(c) == rank), None)

    def key_dropped(self, key: Any) -> None:
        """Forget the dealing counts of an idle key when they are even (each consumer present
        or counted dealt as many items): least-loaded dealing then goes on as before.  Uneven
        counts stay (a source that flushes after the broker dropped the idle key still deals
        its shards to the consumers that got fewer, however long the pause)."""
        counts = self._dealt.get(key)
        if counts is None:
            return
        dealt = {counts.get(c, 0) for c in (*counts, *self.ctx.consumers)}
        if len(dealt) <= 1:
            del self._dealt[key]

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.plan.mode,
            "rank_bound": {str(r): c for r, c in sorted(self._rank_ids.items())},
            "keys_with_state": len(self._dealt),
        }


__all__ = [
    "HOOK_NAME",
    "TrajectoryCollector",
    "TrajectoryDispatcher",
    "consumer_rank",
    "plan_from_context",
]
