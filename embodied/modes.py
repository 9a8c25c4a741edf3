"""The output modes of the trajectory collector: rollout, pipeline and lerobot (docs/embodied.md).

A mode groups joined chunks into *scopes* and flushes a scope when all its keys are complete.
Every put is handled in two phases so that it is atomic (docs/embodied.md: "Pairing the halves"):

* ``prepare(chunks)`` computes the put's whole effect on the side — new scope contents, flush
  outputs, advanced shuffle generators, lerobot accumulators — without touching the mode;
* ``commit(prepared)`` installs that effect; it performs no work that can fail.

An error in ``prepare`` therefore leaves the mode exactly as it was.
"""

from __future__ import annotations

import bisect
import copy
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from zchannel.embodied.advantages import compute_advantages, to_training_batch
from zchannel.embodied.batch import to_cpu_contiguous
from zchannel.embodied.joiner import JoinedChunk
from zchannel.embodied.lerobot import LeRobotEpisodeAccumulator
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.trajectory import (
    ActorBatch,
    EpisodeShard,
    Trajectory,
    TrajectoryAccumulator,
    TrajectoryStep,
)
from zchannel.embodied.types import SourceID, TrajectoryKey

EXTERNAL_ACTIONS_MESSAGE = "External policy actions are only supported for online LeRobot DAgger."
PACK_SEPARATOR = "::"
EPISODE_DATA_KEYS = ("chunk_actions", "obs_list", "terminations", "truncations", "infos_list")
_BOUNDARY_KEYS = ("dones", "terminations", "truncations", "prev_values")
# the TrajectoryStep fields a pipeline flush sets aside (StepRows): dicts of [B, ...] leaves,
# the observations and policy inputs, where the camera images are
SET_ASIDE_FIELDS = ("forward_inputs", "curr_obs", "next_obs")

ScopeID = tuple[int, ...]


@dataclass
class Scope:
    """An open scope: its completed keys and the per-source data gathered so far."""

    keys: set[TrajectoryKey] = field(default_factory=set)
    sources: dict[SourceID, Any] = field(default_factory=dict)

    def copy(self) -> Scope:
        """A copy whose containers can be changed without affecting this scope."""
        return Scope(set(self.keys), {sid: _copy_entry(v) for sid, v in self.sources.items()})


def _copy_entry(value: Any) -> Any:
    if isinstance(value, TrajectoryAccumulator):
        return value.copy()
    return list(value)


@dataclass
class PreparedPut:
    """The computed effect of one put, installed by ``OutputMode.commit``."""

    outputs: list[Any] = field(default_factory=list)
    staged: dict[ScopeID, Scope] = field(default_factory=dict)
    flushed: dict[ScopeID, Scope] = field(default_factory=dict)
    side: dict[Any, Any] = field(default_factory=dict)

    @property
    def flushed_keys(self) -> set[TrajectoryKey]:
        """Every key of the scopes this put flushes."""
        return {key for scope in self.flushed.values() for key in scope.keys}


class OutputMode:
    """Scope bookkeeping shared by the three modes; subclasses define scopes and flushes."""

    name = ""

    def __init__(self, plan: TrajectoryPlan) -> None:
        self.plan = plan
        self.scopes: dict[ScopeID, Scope] = {}

    # -- hooks for subclasses ---------------------------------------------------------------

    def scope_id(self, key: TrajectoryKey) -> ScopeID:
        raise NotImplementedError

    def scope_size(self) -> int:
        """Number of keys that complete a scope."""
        raise NotImplementedError

    def add(self, scope: Scope, chunk: JoinedChunk) -> None:
        """Add the chunk's record to ``scope`` (a private copy); may raise ``ValueError``."""
        raise NotImplementedError

    def flush(self, sid: ScopeID, scope: Scope, side: dict[Any, Any]) -> list[Any]:
        """Outputs of a complete scope; mode state may only change through ``side``."""
        raise NotImplementedError

    def commit_side(self, side: dict[Any, Any]) -> None:  # noqa: B027 - optional override
        """Install side state computed by ``flush`` (must not fail)."""

    def holds_side_state(self) -> bool:
        """Whether side state holds data of earlier puts that later outputs need (beyond the
        open scopes); statistics and generators do not count."""
        return False

    def side_state(self) -> dict[str, Any]:
        """The side state as plain values (``TrajectoryCollector.state_dict``)."""
        return {}

    def load_side_state(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional override
        """Take back what ``side_state`` returned."""

    # -- the two phases ----------------------------------------------------------------------

    def prepare(self, chunks: Iterable[JoinedChunk]) -> PreparedPut:
        """Compute the effect of the put's joined chunks, in order, without changing the mode.

        Raises ``ValueError`` for a key completed twice in an open scope ("duplicate trajectory
        event") and for anything the mode's records or flushes reject.
        """
        prepared = PreparedPut()
        for chunk in chunks:
            sid = self.scope_id(chunk.key)
            scope = prepared.staged.get(sid)
            if scope is None:
                flushed = prepared.flushed.get(sid)
                base = self.scopes.get(sid) if flushed is None else None
                scope = base.copy() if base is not None else Scope()
            if chunk.key in scope.keys or (
                sid in prepared.flushed and chunk.key in prepared.flushed[sid].keys
            ):
                raise ValueError(
                    f"Received a duplicate trajectory event for {chunk.key} while its scope "
                    f"{sid} is open."
                )
            self.add(scope, chunk)
            scope.keys.add(chunk.key)
            if len(scope.keys) >= self.scope_size():
                prepared.outputs.extend(self.flush(sid, scope, prepared.side))
                prepared.staged.pop(sid, None)
                prepared.flushed[sid] = scope
            else:
                prepared.staged[sid] = scope
        return prepared

    def commit(self, prepared: PreparedPut) -> None:
        """Install a prepared put: staged scopes replace the old ones, flushed ones are deleted."""
        for sid in prepared.flushed:
            self.scopes.pop(sid, None)
        self.scopes.update(prepared.staged)
        self.commit_side(prepared.side)

    # -- shared helpers ----------------------------------------------------------------------

    def build_step(self, chunk: JoinedChunk) -> TrajectoryStep:
        """The chunk's TrajectoryStep with its rewards, built without side effects."""
        plan = self.plan
        if not chunk.policy.inferred:
            raise ValueError(EXTERNAL_ACTIONS_MESSAGE)
        rewards = chunk.env.compute_rewards(
            env_reward_weight=plan.env_reward_weight,
            reward_weight=plan.reward_weight,
            auto_reset=plan.auto_reset,
            bootstrap_type=plan.bootstrap_type,
            gamma=plan.gamma,
        )
        last = chunk.key.chunk_id == plan.num_chunks - 1
        if last:
            check_final_value(plan, chunk)
        return TrajectoryStep.from_parts(
            chunk.policy,
            chunk.env,
            rewards=rewards,
            collect_prev_infos=plan.collect_prev_infos,
            collect_transitions=plan.collect_transitions,
            enable_rlt=plan.enable_rlt,
            include_final_value=last,
            intervention_precedence=plan.intervention_precedence,
        )

    def append_step(self, accumulator: TrajectoryAccumulator, chunk: JoinedChunk) -> None:
        """Build the chunk's step and append it with its history-reward data."""
        transition = chunk.env.transition
        accumulator.append(
            chunk.key,
            self.build_step(chunk),
            reward_model_output=transition.reward_model_output,
            reward_assign_lengths=transition.reward_assign_lengths,
        )

    def to_trajectory(self, accumulator: TrajectoryAccumulator) -> Trajectory:
        return accumulator.to_trajectory(
            max_episode_length=self.plan.max_episode_length,
            reward_weight=self.plan.reward_weight,
        )

    def held_objects(self) -> Iterator[Any]:
        """Everything the mode holds, for byte accounting."""
        for scope in self.scopes.values():
            yield from scope.sources.values()


class RolloutMode(OutputMode):
    """Scope ``(step_id, env_rank, stage_id)``; flushes ``shards_per_source`` Trajectories."""

    name = "rollout"

    def scope_id(self, key: TrajectoryKey) -> ScopeID:
        return (key.step_id, key.env_rank, key.stage_id)

    def scope_size(self) -> int:
        return self.plan.rollout_epochs * self.plan.num_chunks

    def add(self, scope: Scope, chunk: JoinedChunk) -> None:
        accumulator = scope.sources.setdefault(chunk.source, TrajectoryAccumulator())
        self.append_step(accumulator, chunk)

    def flush(self, sid: ScopeID, scope: Scope, side: dict[Any, Any]) -> list[Any]:
        (accumulator,) = scope.sources.values()
        return self.to_trajectory(accumulator).split(self.plan.shards_per_source)


class PipelineMode(OutputMode):
    """Scope ``(step_id, epoch_id)`` over all S sources; flushes ActorBatch micro-batches."""

    name = "pipeline"

    def __init__(self, plan: TrajectoryPlan) -> None:
        super().__init__(plan)
        self.generators: dict[int, torch.Generator] = {}

    def scope_id(self, key: TrajectoryKey) -> ScopeID:
        return (key.step_id, key.epoch_id)

    def scope_size(self) -> int:
        return self.plan.num_sources * self.plan.num_chunks

    def add(self, scope: Scope, chunk: JoinedChunk) -> None:
        accumulator = scope.sources.setdefault(chunk.source, TrajectoryAccumulator())
        self.append_step(accumulator, chunk)

    def flush(self, sid: ScopeID, scope: Scope, side: dict[Any, Any]) -> list[Any]:
        """The scope's micro-batches, actor by actor.  The steps' dict fields (the camera
        images) are kept out of the stacking, splitting and shuffling (``StepRows``): each
        micro-batch row of theirs is copied once, from the step it came in."""
        plan = self.plan
        if len(scope.sources) != plan.num_sources:
            raise ValueError(
                f"Pipeline scope {sid} completed {len(scope.keys)} keys from "
                f"{len(scope.sources)} sources; expected exactly {plan.num_sources} sources."
            )
        step_id, epoch_id = sid
        step_rows = StepRows()
        pieces: dict[int, list[Trajectory]] = {}
        for rank, source in enumerate(sorted(scope.sources)):
            steps = scope.sources[source].sorted_steps(plan.reward_weight)
            trajectory = Trajectory.from_steps([step_rows.stand_in(s) for s in steps],
                                               max_episode_length=plan.max_episode_length)
            routes = route_source_rows(rank, plan.source_batch_size, plan.actor_width)
            shards = [trajectory] if len(routes) == 1 else trajectory.split([n for _, n in routes])
            for (actor, _), shard in zip(routes, shards, strict=True):
                pieces.setdefault(actor, []).append(shard)
        outputs: list[Any] = []
        for actor in sorted(pieces):
            batch = compute_advantages(to_training_batch(pieces[actor], plan), plan)
            generator = self._generator(actor, side) if plan.shuffle else None
            outputs.extend(self.micro_batches(actor, step_id, epoch_id, batch, generator,
                                              step_rows))
        return outputs

    def _generator(self, actor: int, side: dict[Any, Any]) -> torch.Generator:
        """The actor's shuffle generator as a side copy (the committed one is never advanced)."""
        generators = side.setdefault("generators", {})
        generator = generators.get(actor)
        if generator is None:
            generator = torch.Generator()
            committed = self.generators.get(actor)
            if committed is None:
                generator.manual_seed(self.plan.seed + actor)
            else:
                generator.set_state(committed.get_state())
            generators[actor] = generator
        return generator

    def commit_side(self, side: dict[Any, Any]) -> None:
        self.generators.update(side.get("generators", {}))

    def side_state(self) -> dict[str, Any]:
        """Each actor's shuffle generator, as its state tensor."""
        return {"generators": [(actor, g.get_state()) for actor, g in self.generators.items()]}

    def load_side_state(self, state: dict[str, Any]) -> None:
        generators: dict[int, torch.Generator] = {}
        for actor, generator_state in state["generators"]:
            generator = torch.Generator()
            generator.set_state(generator_state)
            generators[int(actor)] = generator
        self.generators = generators

    def micro_batches(
        self,
        actor: int,
        step_id: int,
        epoch_id: int,
        batch: dict[str, Any],
        generator: torch.Generator | None,
        step_rows: StepRows | None = None,
    ) -> list[ActorBatch]:
        """Flatten an actor's training batch to rows, permute and cut it into micro-batches
        (views of the permuted rows).  With ``step_rows``, each micro-batch's row ids of the
        leaves it set aside are replaced by their rows (``StepRows.fill``).

        Raises ``ValueError`` for a key containing ``"env_info"``, a leaf that is not
        ``[T_b, actor_width, ...]`` or a row count not divisible by ``micro_batch_size``.
        """
        plan = self.plan
        width = plan.actor_width
        actions = batch.get("actions")
        if not isinstance(actions, torch.Tensor):
            raise ValueError("A pipeline training batch needs an 'actions' tensor.")
        time_rows = int(actions.shape[0])
        n = time_rows * width
        mbs = plan.micro_batch_size
        if mbs is None or n % mbs:
            raise ValueError(
                f"micro_batch_size {mbs} does not divide the {n} rows of actor {actor}."
            )
        if generator is not None:
            perm = torch.randperm(n, generator=generator)
        else:
            perm = torch.arange(n)
        rows = flatten_rows(batch, time_rows, width, perm)
        batches = []
        for m in range(n // mbs):
            data = {k: v[m * mbs : (m + 1) * mbs] for k, v in rows.items()}
            if step_rows is not None:
                data = step_rows.fill(data)
            batches.append(ActorBatch(actor_rank=actor, step_id=step_id, epoch_id=epoch_id,
                                      micro_batch_index=m, data=data))
        return batches


def check_final_value(plan: TrajectoryPlan, chunk: JoinedChunk) -> None:
    """Refuse an epoch's last chunk without ``EnvPart.final_prev_values`` in gae mode when the
    policy reports ``prev_values``: the trajectory's ``prev_values`` would get N rows per epoch
    instead of N+1, and the estimator needs V(obs after the epoch) as its last row."""
    output = chunk.policy.output
    if (plan.adv_type == "gae" and plan.collect_prev_infos and output is not None
            and output.prev_values is not None and chunk.env.final_prev_values is None):
        raise ValueError(
            f"EnvPart.final_prev_values is missing on the epoch's last chunk (key {chunk.key}): "
            f"adv_type='gae' with prev_values needs the value of the observation after the "
            f"epoch there (complete(..., final_prev_values=V[B, 1 or C]))"
        )


def route_source_rows(rank: int, batch: int, width: int) -> list[tuple[int, int]]:
    """``[(actor, rows), ...]``: the non-empty intersections of source ``rank``'s global rows
    ``[rank·B, (rank+1)·B)`` with the actors' rows ``[a·W, (a+1)·W)``, in ascending actor order."""
    start, stop = rank * batch, (rank + 1) * batch
    routes = []
    position = start
    while position < stop:
        actor = position // width
        end = min(stop, (actor + 1) * width)
        routes.append((actor, end - position))
        position = end
    return routes


def flatten_rows(
    batch: dict[str, Any], time_rows: int, width: int, perm: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Pack a ``[T, W, ...]`` batch into ``{"parent::child": [T·W, ...][perm]}``.

    The last time row of the boundary fields (dones, terminations, truncations, prev_values) is
    dropped first.  None values are dropped; numpy leaves become tensors.  Raises ``ValueError``
    for keys containing ``"env_info"`` or leaves of another shape, ``TypeError`` for non-tensor
    leaves.
    """
    out: dict[str, torch.Tensor] = {}

    def visit(value: Any, path: str, top: str) -> None:
        if "env_info" in path.split(PACK_SEPARATOR)[-1]:
            raise ValueError(f"Training batch key {path!r} is an env_info entry; drop it first.")
        if value is None:
            return
        if isinstance(value, dict):
            for k, v in value.items():
                visit(v, f"{path}{PACK_SEPARATOR}{k}", top)
            return
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"Training batch entry {path!r} is a {type(value).__name__}, not a tensor."
            )
        if path in _BOUNDARY_KEYS:
            value = value[:-1]
        if value.dim() < 2 or value.shape[0] != time_rows or value.shape[1] != width:
            raise ValueError(
                f"Training batch entry {path!r} has shape {tuple(value.shape)}; expected "
                f"[{time_rows}, {width}, ...]."
            )
        flat = value.reshape(time_rows * width, *value.shape[2:])
        out[path] = flat.index_select(0, perm)

    for key, value in batch.items():
        visit(value, str(key), str(key))
    return out


class StepRows:
    """The tensors of the steps' ``SET_ASIDE_FIELDS`` (the camera images among them), set
    aside while a pipeline flush stacks, splits, concatenates and shuffles the rest.

    ``stand_in`` puts in each such leaf's place its row ids (int64 ``[B]``, unique over the
    flush), which go through the flush as the leaf would; ``rows`` then stacks a micro-batch's
    rows straight from the steps they came in: each row is copied once, where the flush would
    have copied the images at every stage (stack, split, concatenation, shuffle), and each
    micro-batch holds its own memory of them, freed when it is taken.  Rows are copied with
    numpy where it has the dtype: unlike torch's copies of large tensors, numpy's never start
    intra-op threads, which on a busy host (a broker runs under ``SCHED_BATCH``) wait for each
    other many times longer than the copy takes.
    """

    def __init__(self) -> None:
        # packed key ("forward_inputs::main") -> the steps' leaves and the first row id of each
        self.leaves: dict[str, list[np.ndarray | torch.Tensor]] = {}
        self.firsts: dict[str, list[int]] = {}
        # packed key -> the dtype of its rows: numpy's when every leaf is an array of it
        self.dtypes: dict[str, np.dtype | torch.dtype] = {}
        self.count = 0

    def stand_in(self, step: TrajectoryStep) -> TrajectoryStep:
        """A shallow copy of ``step`` whose ``SET_ASIDE_FIELDS`` tensors and arrays (of at
        least one dim) are their row ids; other values stay (the flush refuses them as before)."""
        stand_in = copy.copy(step)
        for name in SET_ASIDE_FIELDS:
            setattr(stand_in, name, self._row_ids(getattr(step, name), name))
        return stand_in

    def _row_ids(self, value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {k: self._row_ids(v, f"{path}{PACK_SEPARATOR}{k}") for k, v in value.items()}
        if not isinstance(value, (torch.Tensor, np.ndarray)) or value.ndim < 1:
            return value
        first = self.count
        self.leaves.setdefault(path, []).append(_row_source(value))
        self.firsts.setdefault(path, []).append(first)
        self.count += int(value.shape[0])
        return torch.arange(first, self.count)

    def fill(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``data`` (a micro-batch's packed rows) with the row ids of every set-aside leaf
        replaced by its rows (``rows``)."""
        return {k: self.rows(k, v) if k in self.leaves else v for k, v in data.items()}

    def rows(self, path: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (row ids of ``path``) stacked, of the dtype stacking every step's
        leaf would give."""
        leaves, firsts = self.leaves[path], self.firsts[path]
        dtype = self.dtypes.get(path)
        if dtype is None:
            dtype = self.dtypes[path] = _rows_dtype(path, leaves)
        picked = []
        for row_id in ids.tolist():
            step = bisect.bisect_right(firsts, row_id) - 1
            picked.append(leaves[step][row_id - firsts[step]])
        if isinstance(dtype, np.dtype):
            return torch.from_numpy(np.stack(picked))
        return torch.stack([torch.as_tensor(row) for row in picked]).to(dtype)


def _row_source(leaf: torch.Tensor | np.ndarray) -> np.ndarray | torch.Tensor:
    """A step's leaf as what its rows are copied from: a numpy array (a tensor's memory
    shared) where numpy has the dtype, else a CPU tensor (bfloat16, ...)."""
    if isinstance(leaf, np.ndarray):
        return leaf
    tensor = to_cpu_contiguous(leaf)
    try:
        return tensor.numpy()
    except TypeError:
        return tensor


def _rows_dtype(path: str, leaves: list[np.ndarray | torch.Tensor]) -> np.dtype | torch.dtype:
    """The dtype of ``path``'s stacked rows: the arrays' own when every leaf is an array of one
    dtype, else torch's promotion of theirs.  Raises ``ValueError`` when the leaves differ in
    shape past dim 0, as stacking them would."""
    shapes = {tuple(leaf.shape[1:]) for leaf in leaves}
    if len(shapes) > 1:
        raise ValueError(f"Cannot stack the steps' {path!r}: their shapes past the batch "
                         f"dimension differ ({sorted(shapes)}).")
    dtypes = {leaf.dtype for leaf in leaves}
    if len(dtypes) == 1 and all(isinstance(leaf, np.ndarray) for leaf in leaves):
        return dtypes.pop()
    return functools.reduce(torch.promote_types,
                            [torch.as_tensor(leaf[:0]).dtype for leaf in leaves])


def _chunk_arguments(output: Any, rewards: Any, data: dict[str, Any]) -> dict[str, Any]:
    """``LeRobotEpisodeAccumulator.append_chunk``'s arguments for a chunk's policy output,
    rewards and ``episode_data``."""
    return {
        "policy_output": output,
        "rewards": rewards,
        "chunk_actions": data["chunk_actions"],
        "obs_list": data["obs_list"],
        "terminations": data["terminations"],
        "truncations": data["truncations"],
        "infos_list": data["infos_list"],
        "valid_action_mask": data.get("valid_action_mask"),
    }


class LeRobotMode(OutputMode):
    """Scope ``(step_id, env_rank, stage_id)``; flushes ``shards_per_source`` EpisodeShards.

    Each source keeps one ``LeRobotEpisodeAccumulator`` across training steps.  A scope stores
    its chunks' inputs, each checked when it comes (``check_chunk``), and feeds them to the
    accumulator in ``(epoch_id, chunk_id)`` order when it flushes; the flush works on a
    snapshot of the accumulator that replaces it on commit.
    """

    name = "lerobot"

    def __init__(self, plan: TrajectoryPlan) -> None:
        super().__init__(plan)
        self.accumulators: dict[SourceID, LeRobotEpisodeAccumulator] = {}
        self._chunk_checker: LeRobotEpisodeAccumulator | None = None

    def scope_id(self, key: TrajectoryKey) -> ScopeID:
        return (key.step_id, key.env_rank, key.stage_id)

    def scope_size(self) -> int:
        return self.plan.rollout_epochs * self.plan.num_chunks

    def add(self, scope: Scope, chunk: JoinedChunk) -> None:
        transition = chunk.env.transition
        data = transition.episode_data
        if data is None:
            raise ValueError(
                f"LeRobot mode needs episode_data on every chunk's transition; {chunk.key} has none."
            )
        if not isinstance(data, dict):
            raise ValueError(f"episode_data of {chunk.key} must be a dict.")
        missing = [k for k in EPISODE_DATA_KEYS if k not in data]
        if missing:
            raise ValueError(f"episode_data of {chunk.key} is missing {missing}.")
        if not isinstance(data["obs_list"], list):
            raise ValueError(f"episode_data['obs_list'] of {chunk.key} must be a list.")
        output = chunk.policy.output
        self._checker().check_chunk(**_chunk_arguments(output, transition.rewards, data))
        records = scope.sources.setdefault(chunk.source, [])
        records.append((chunk.key, output, transition.rewards, data))

    def _checker(self) -> LeRobotEpisodeAccumulator:
        """An accumulator that only checks chunks (``add``): a malformed chunk fails its own
        put, not the later put that completes its scope."""
        if self._chunk_checker is None:
            self._chunk_checker = self._new_accumulator()
        return self._chunk_checker

    def flush(self, sid: ScopeID, scope: Scope, side: dict[Any, Any]) -> list[Any]:
        plan = self.plan
        step_id, env_rank, stage_id = sid
        source = (env_rank, stage_id)
        accumulators = side.setdefault("accumulators", {})
        accumulator = accumulators.get(source)
        if accumulator is None:
            committed = self.accumulators.get(source)
            accumulator = snapshot(committed) if committed is not None else self._new_accumulator()
            accumulators[source] = accumulator
        records = sorted(scope.sources[source], key=lambda r: (r[0].epoch_id, r[0].chunk_id))
        for _key, output, rewards, data in records:
            accumulator.append_chunk(**_chunk_arguments(output, rewards, data))
        episodes = list(accumulator.drain_episodes())
        k = plan.shards_per_source
        return [
            EpisodeShard(
                step_id=step_id,
                env_rank=env_rank,
                stage_id=stage_id,
                shard_index=i,
                episodes=episodes[i::k],
            )
            for i in range(k)
        ]

    def _new_accumulator(self) -> LeRobotEpisodeAccumulator:
        plan = self.plan
        return LeRobotEpisodeAccumulator(
            num_envs=plan.source_batch_size,
            only_success=plan.lerobot_only_success,
            num_action_chunks=plan.num_action_chunks,
            action_dim=plan.action_dim,
            fps=plan.lerobot_fps,
        )

    def commit_side(self, side: dict[Any, Any]) -> None:
        self.accumulators.update(side.get("accumulators", {}))

    def holds_side_state(self) -> bool:
        """An episode still open on some env: its frames of earlier steps wait for its end."""
        return any(acc.open_episodes for acc in self.accumulators.values())

    def side_state(self) -> dict[str, Any]:
        """Each source's accumulator (its open episodes and the count emitted)."""
        return {"accumulators": [(source, acc.state_dict())
                                 for source, acc in self.accumulators.items()]}

    def load_side_state(self, state: dict[str, Any]) -> None:
        accumulators: dict[SourceID, LeRobotEpisodeAccumulator] = {}
        for source, acc_state in state["accumulators"]:
            accumulator = self._new_accumulator()
            accumulator.load_state_dict(acc_state)
            accumulators[(int(source[0]), int(source[1]))] = accumulator
        self.accumulators = accumulators

    def held_objects(self) -> Iterator[Any]:
        yield from super().held_objects()
        yield from self.accumulators.values()


def snapshot(obj: Any) -> Any:
    """A deep copy of ``obj`` that shares its numpy arrays and tensors.

    Containers and plain objects are copied, so the snapshot can be advanced without changing
    ``obj``, as long as array data is never modified in place.
    """
    memo: dict[int, Any] = {}
    _share_arrays(obj, memo, set())
    return copy.deepcopy(obj, memo)


def _share_arrays(obj: Any, memo: dict[int, Any], seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        memo[id(obj)] = obj
    elif isinstance(obj, dict):
        for value in obj.values():
            _share_arrays(value, memo, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            _share_arrays(value, memo, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        _share_arrays(vars(obj), memo, seen)


MODES: dict[str, type[OutputMode]] = {
    "rollout": RolloutMode,
    "pipeline": PipelineMode,
    "lerobot": LeRobotMode,
}


def make_mode(plan: TrajectoryPlan) -> OutputMode:
    """The output mode object of ``plan.mode``."""
    return MODES[plan.mode](plan)


def _storage_of(obj: torch.Tensor | np.ndarray) -> tuple[tuple[int, int], int]:
    """The identity of the memory under a tensor or array, and its size in bytes."""
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        return (storage.data_ptr(), storage.nbytes()), storage.nbytes()
    base = obj
    while isinstance(base.base, np.ndarray):
        base = base.base
    return (id(base), -1), base.nbytes


def held_bytes(objects: Iterable[Any]) -> int:
    """Bytes of tensor and array data reachable from ``objects`` (each storage counted once)."""
    seen: set[int] = set()
    storages: set[tuple[int, int]] = set()
    total = 0
    stack = list(objects)
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            ident, nbytes = _storage_of(obj)
            if ident not in storages:
                storages.add(ident)
                total += nbytes
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s))
    return total


__all__ = [
    "EXTERNAL_ACTIONS_MESSAGE",
    "LeRobotMode",
    "OutputMode",
    "PipelineMode",
    "PreparedPut",
    "RolloutMode",
    "Scope",
    "flatten_rows",
    "held_bytes",
    "make_mode",
    "route_source_rows",
    "snapshot",
]
