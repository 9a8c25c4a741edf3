"""The consumer side: actor workers that train on the trajectory channel's output.

Each actor ``actor:<rank>`` takes its items for training step ``k`` with ``get(ack=True)``
(rollout mode: its ``items_per_actor`` Trajectory shards; pipeline mode: its micro-batches),
runs PPO from the step's common weights, and shares the result with its peers on the sync
channel: a *contribution* ``(rank, seq, ids, rows, state)`` put on every live peer's key
``("contrib", k, peer)``.  The step's weights are the row-weighted mean of the contributions
that together cover every item of the step exactly once (items are identified by their
training-step and column tags), so the group needs no collective library and survives a peer's
death: a SIGKILLed actor's unacknowledged and undelivered items are re-dealt by the broker to
the survivors, who train on them as extra contributions until the step is covered.  The lowest
contributing rank publishes the new weights (version ``k + 1``) to the rollout and the step's
metrics to the driver.  Deliveries are acknowledged only after their contribution is out.
An actor trains on its items in column order (not arrival order), so a run's losses do not
depend on timing; its metrics carry ``rows_digest``, a hash of the rows it trained on.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import time
from typing import Any

import torch
from zchannel.embodied.pipeline import WeightPublisher
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.ppo import PPOConfig, ppo_update, training_rows
from zchannel.embodied.trajectory import ActorBatch, Trajectory

ACTOR_METRICS = "actor_metrics"


def members_key(rank: int) -> str:
    """Where the driver tells actor ``rank`` about departed peers (``("dead", peer)``)."""
    return f"members:{rank}"


def item_step(item: Any) -> int:
    if isinstance(item, ActorBatch):
        return item.step_id
    if isinstance(item, Trajectory):
        return int(item.forward_inputs["step_id"][0, 0, 0])
    raise TypeError(f"unexpected item on the trajectory channel: {type(item).__name__}")


def item_ids(item: Any) -> frozenset:
    """The identities an item covers: env columns (rollout) or (epoch, rank, micro-batch)."""
    if isinstance(item, ActorBatch):
        return frozenset({(item.epoch_id, item.actor_rank, item.micro_batch_index)})
    return frozenset(int(c) for c in item.forward_inputs["column"][0, :, 0].tolist())


def ids_per_step(plan: TrajectoryPlan) -> int:
    if plan.mode == "pipeline":
        if plan.micro_batch_size is None:
            raise ValueError("a pipeline plan needs micro_batch_size")
        per_actor = plan.num_chunks * plan.actor_width // plan.micro_batch_size
        return plan.rollout_epochs * plan.actor_world_size * per_actor
    return plan.num_sources * plan.source_batch_size


def items_per_actor_step(plan: TrajectoryPlan) -> int:
    if plan.mode == "pipeline":
        return ids_per_step(plan) // plan.actor_world_size
    return plan.items_per_actor


class Actor:
    """One actor worker of a group of ``world`` actors."""

    def __init__(self, policy: torch.nn.Module, plan: TrajectoryPlan, cfg: PPOConfig, *,
                 rank: int, world: int, trajectory: Any, sync: Any, weights: WeightPublisher,
                 seed: int = 0, poll_s: float = 0.2,
                 normalization: str = "rlinf_actor", total_steps: int | None = None) -> None:
        self.policy, self.plan, self.cfg = policy, plan, cfg
        self.rank, self.live = rank, set(range(world))
        self.trajectory, self.sync, self.weights = trajectory, sync, weights
        self.total_steps = total_steps  # for cfg.anneal_lr
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr, eps=cfg.adam_eps)
        self.generator = torch.Generator().manual_seed(seed * 1000 + rank)
        self.version = 0
        self.poll_s = poll_s
        self.normalization = normalization  # of rollout-mode advantages (training_rows)
        self._stash: list[Any] = []  # deliveries of later steps
        self._seq = 0

    # -- items -------------------------------------------------------------------------------

    def _take(self, step: int, done_ids: set, timeout: float | None) -> Any:
        """A delivery of ``step`` not yet covered, or None after ``timeout`` (0: no wait)."""
        for i, delivery in enumerate(self._stash):
            if item_step(delivery.item) == step:
                return self._stash.pop(i)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if timeout == 0:
                    delivery = self.trajectory.get_nowait(ack=True)
                else:
                    left = self.poll_s if deadline is None else max(0.0, deadline - time.monotonic())
                    delivery = self.trajectory.get(ack=True, timeout=min(left, self.poll_s))
            except (asyncio.QueueEmpty, TimeoutError):
                self._poll_members()
                if timeout == 0 or (deadline is not None and time.monotonic() >= deadline):
                    return None
                continue
            s = item_step(delivery.item)
            if s > step:
                self._stash.append(delivery)
            elif s < step or item_ids(delivery.item) & done_ids:
                self.trajectory.ack(delivery)  # a re-delivery of trained data
            else:
                return delivery

    def _gather(self, step: int, need: int, received: dict) -> list:
        """This actor's deliveries of ``step``: ``items_per_actor_step`` of them, or fewer once
        they and the contributions of peers (collected into ``received``) cover the step's
        ``need`` ids -- dealing does not know steps, so when the rollout runs ahead a peer may
        be dealt, and train, a share of this step that was this actor's count."""
        done: set = set()
        mine: list = []
        while len(mine) < items_per_actor_step(self.plan):
            got = self._take(step, done, self.poll_s)
            if got is not None:
                mine.append(got)
                done |= item_ids(got.item)
                continue
            while True:
                try:
                    c = self.sync.get_nowait(key=("contrib", step, self.rank))
                except asyncio.QueueEmpty:
                    break
                received[(c["rank"], c["seq"])] = c
            if len(_cover(received)[1] | done) >= need:
                break
        return mine

    def _poll_members(self) -> None:
        while True:
            try:
                kind, peer = self.sync.get_nowait(key=members_key(self.rank))
            except asyncio.QueueEmpty:
                return
            if kind == "dead":
                self.live.discard(peer)

    # -- one step ----------------------------------------------------------------------------

    def _contribute(self, step: int, base: dict, deliveries: list) -> dict:
        self.policy.load_state_dict(base)
        deliveries = sorted(deliveries, key=lambda d: min(item_ids(d.item)))
        items = [d.item for d in deliveries]
        rows = training_rows(items, self.plan, normalization=self.normalization)
        if self.cfg.anneal_lr and self.total_steps:
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.lr * (1.0 - step / self.total_steps)
        stats: dict[str, Any] = dict(ppo_update(self.policy, self.optimizer, rows, self.cfg,
                                                self.generator))
        stats["rows_digest"] = rows_digest(rows)
        versions = [float(item_versions(item).min()) for item in items]
        contribution = {
            "rank": self.rank, "seq": self._seq,
            "ids": sorted(set().union(*(item_ids(i) for i in items))),
            "rows": int(rows["actions"].shape[0]),
            "state": {k: v.detach().clone() for k, v in self.policy.state_dict().items()},
            "stats": stats, "lag": step - min(versions), "items": len(items),
        }
        self._seq += 1
        for peer in sorted(self.live):
            self.sync.put(contribution, key=("contrib", step, peer))
        self._ack_all(deliveries)
        return contribution

    def _ack_all(self, deliveries: list) -> None:
        """Acknowledge ``deliveries`` (trained, here or by a peer)."""
        for d in deliveries:
            try:
                self.trajectory.ack(d)
            except ValueError as exc:
                if "lease" not in str(exc):
                    raise
                # the lease expired while this (starved) actor trained: the broker deals the
                # item again, and _take acknowledges that re-delivery as already trained

    def train_step(self, step: int) -> dict:
        """Train on step ``step``; returns this step's metrics (as published by the leader)."""
        t0 = time.monotonic()
        base = copy.deepcopy(self.policy.state_dict())
        need = ids_per_step(self.plan)
        received: dict[tuple[int, int], dict] = {}
        mine = self._gather(step, need, received)
        if len(_cover(received)[1]) >= need:  # peers trained all of it, these too
            self._ack_all(mine)
        elif mine:
            self._contribute(step, base, mine)
        while True:
            chosen, covered = _cover(received)
            if len(covered) >= need:
                break
            try:
                c = self.sync.get(key=("contrib", step, self.rank), timeout=self.poll_s)
                received[(c["rank"], c["seq"])] = c
                continue
            except TimeoutError:
                pass
            self._poll_members()
            extra = self._take(step, covered, 0)  # a dead peer's items, re-dealt to us
            if extra is not None:
                self._contribute(step, base, [extra])
        total = sum(c["rows"] for c in chosen)
        state = {k: sum(c["state"][k] * (c["rows"] / total) for c in chosen) for k in base}
        self.policy.load_state_dict(state)
        self.version = step + 1
        leader = min(c["rank"] for c in chosen)
        metrics = {
            "step": step, "version": self.version, "leader": leader,
            "lag": max(c["lag"] for c in chosen),
            "contributions": len(chosen), "train_s": time.monotonic() - t0,
            **{k: sum(c["stats"][k] * c["rows"] for c in chosen) / total
               for k in chosen[0]["stats"] if k != "rows_digest"},
            "rows_digest": "+".join(c["stats"]["rows_digest"] for c in chosen),
        }
        if leader == self.rank:
            metrics["weight_bytes"] = self.weights.publish(self.policy.state_dict(), self.version)
            self.sync.put(metrics, key=ACTOR_METRICS)
        return metrics


def rows_digest(rows: dict[str, torch.Tensor]) -> str:
    """A short hash of training rows (names, dtypes, shapes and bytes, in name order)."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(rows):
        value = rows[name].contiguous()
        h.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
        h.update(value.numpy().tobytes() if value.dtype != torch.bfloat16
                 else value.float().numpy().tobytes())
    return h.hexdigest()


def item_versions(item: Any) -> torch.Tensor:
    if isinstance(item, ActorBatch):
        return item.data["versions"]
    return item.versions


def _cover(received: dict) -> tuple[list[dict], set]:
    """Contributions in (rank, seq) order, skipping any that overlaps one already taken."""
    chosen: list[dict] = []
    covered: set = set()
    for key in sorted(received):
        ids = set(received[key]["ids"])
        if ids & covered:
            continue
        chosen.append(received[key])
        covered |= ids
    return chosen, covered


__all__ = ["ACTOR_METRICS", "Actor", "ids_per_step", "item_ids", "item_step", "members_key",
           "rows_digest"]
