"""The runners on Ray: env, rollout and actor workers as Ray actor groups (optional extra ``ray``).

``run_on_ray(cfg, nodes=N)`` launches the three ``Worker`` groups (``env``, ``rollout``,
``actor``), creates the run's channels on the driver exactly as RLinf's embodied runner does,
with ``producers=[rollout_group]`` and ``consumers=[actor_group]`` for the trajectory channel
(so it is placed on the rollout's node by the seed's rule, as a Ray-managed broker every node
reaches), and hands the channel handles to the group methods, where they bind to each worker.
With ``nodes > 1`` and no Ray running, it starts a simulated cluster of that many nodes on this
machine (``ray.cluster_utils.Cluster``); the env group is pinned to node 1, the rollout to node
1 and the actors to node 2 (modulo the node count), the driver stays on node 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

try:
    import ray
except ModuleNotFoundError as exc:  # an optional extra: name it
    raise ModuleNotFoundError(
        f"zchannel.embodied.ray_runner needs Ray ({exc}): pip install 'zchannel[ray]'",
        name=exc.name) from exc
from zchannel.embodied.groups import Worker, WorkerError
from zchannel.embodied.runners import RunConfig, actor_worker, env_worker, rollout_worker, run


class EnvWorker(Worker):
    def run_env(self, data: dict, channels: dict) -> None:
        env_worker(data, self.rank, channels)


class RolloutWorker(Worker):
    def run_rollout(self, data: dict, channels: dict) -> None:
        rollout_worker(data, self.rank, channels)


class ActorWorker(Worker):
    def run_actor(self, data: dict, channels: dict) -> None:
        actor_worker(data, self.rank, channels)


class _GroupWorkers:
    """The running group calls, seen by the driver like local worker processes."""

    def __init__(self, calls: dict[str, Any], groups: list) -> None:
        self.calls, self.groups = calls, groups
        self.procs: dict[str, Any] = {}

    def dead(self) -> dict[str, str]:
        return {f"{group}:{rank}": why for group, call in self.calls.items()
                for rank, why in call.failures().items()}

    def abort(self) -> None:
        for group in self.groups:
            group.shutdown()
        self.groups = []

    def stop(self, timeout: float = 30.0) -> None:
        for call in self.calls.values():
            try:
                call.wait(timeout)
            except (WorkerError, TimeoutError):
                pass
        for group in self.groups:
            group.shutdown()
        self.groups = []


class RayLauncher:
    def __init__(self, cfg: RunConfig, nodes: int) -> None:
        alive = len([n for n in ray.nodes() if n.get("Alive")])
        self.env = EnvWorker.create_group().launch(cfg.envs, name="env", ray=True,
                                                   node_ranks=[1 % alive])
        self.rollout = RolloutWorker.create_group().launch(1, name="rollout", ray=True,
                                                           node_ranks=[1 % alive])
        self.actor = None  # lerobot mode records on the driver: no actors
        if cfg.mode != "lerobot":
            self.actor = ActorWorker.create_group().launch(cfg.actors, name="actor", ray=True,
                                                           node_ranks=[2 % alive])

    def groups(self) -> tuple[list, list | None]:
        return [self.rollout], None if self.actor is None else [self.actor]

    def start(self, cfg: RunConfig, data: dict, channels: dict) -> _GroupWorkers:
        calls = {"env": self.env.run_env(data, channels),
                 "rollout": self.rollout.run_rollout(data, channels)}
        groups = [self.env, self.rollout]
        if self.actor is not None:
            calls["actor"] = self.actor.run_actor(data, channels)
            groups.append(self.actor)
        return _GroupWorkers(calls, groups)


def run_on_ray(cfg: RunConfig, on_step: Callable[[dict], None] | None = None,
               nodes: int = 1) -> dict:
    """``runners.run`` with Ray worker groups (starting a local or simulated cluster if no Ray
    is connected; it is shut down at the end)."""
    cluster = None
    started = False
    if not ray.is_initialized():
        if nodes > 1:
            from ray.cluster_utils import Cluster

            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
            for _ in range(nodes - 1):
                cluster.add_node(num_cpus=1)
            ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
            cluster.wait_for_nodes()
        else:
            # address="local": a new local cluster, never one another process of this machine
            # started (ray.init() without an address joins the latest one it finds)
            ray.init(address="local", num_cpus=2, include_dashboard=False,
                     logging_level=logging.ERROR,
                     log_to_driver=False)
        started = True
    try:
        return run(cfg, on_step, launcher=RayLauncher(cfg, nodes))
    finally:
        if started:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()


__all__ = ["ActorWorker", "EnvWorker", "RayLauncher", "RolloutWorker", "run_on_ray"]
