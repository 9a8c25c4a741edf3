"""The broker side of a distributed channel: one replica's view of the cluster.

Every replica holds the replicated key-binding table (``broker/cluster/binding.py``: key -> replica
index; first toucher wins, permanent) and answers ``bind`` requests, deciding them when it is
the binder, redirecting otherwise.  Every replica checks its collector's outputs: an output whose
key is unbound binds to this replica, an output for a key bound elsewhere fails the put with
``HookError``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from zchannel.broker.cluster import clusterfile
from zchannel.broker.cluster.binding import BindingTable
from zchannel.broker.cluster.clusterfile import Replica, from_table
from zchannel.broker.cluster.moving import KeyMover
from zchannel.broker.core.hookpipeline import collected, hook_name
from zchannel.broker.errors import BrokerUnavailable, ChannelError, HookError
from zchannel.broker.transport.curve import ReplicaCurveKeys, client_keys
from zchannel.broker.wire.argchecks import check_key
from zchannel.broker.wire.protocol import (
    Bind,
    HelloInfo,
    Learn,
    Load,
    Release,
    Request,
    Sync,
    bind_answer,
)
from zchannel.hooks import Collector

log = logging.getLogger("zchannel.broker")

# a collector output's binding round trip blocks this replica's loop: stay well inside the
# clients' liveness window (3 s)
BIND_TIMEOUT_S = 2.0


class ReplicaState:
    """Replica ``index`` of a channel whose replicas are ``table`` (dicts: node, address)."""

    def __init__(self, name: str, index: int, table: list[dict[str, Any]],
                 curve_keys: Any = None, heartbeat_interval: float = 1.0,
                 liveness: int = 3, secret_key: str | None = None, steal: bool = False) -> None:
        self.name = name
        self.index = index
        self.replicas: list[Replica] = from_table(table)
        if not 0 <= index < len(self.replicas):
            raise ValueError(f"replica {index} is not in the cluster's {len(self.replicas)} replicas")
        self.node = self.replicas[index].node
        shared = client_keys(curve_keys)

        def curve_for(peer: int) -> Any:
            # cluster-file CURVE: this replica's own key pair, the peer's public key
            server_key = self.replicas[peer].server_key
            if server_key and secret_key:
                return ReplicaCurveKeys(secret_key, server_key)
            return shared

        self.bindings = BindingTable(name, index, self.replicas, curve_for,
                                     heartbeat_interval, liveness)
        self._core: Any = None
        # cross-replica stealing (opt-in): empty keys move to idle replicas (broker/cluster/moving.py)
        self.mover = KeyMover(self.bindings, lambda: self._core) if steal else None

    @property
    def table(self) -> dict[Any, int]:
        return self.bindings.table

    @property
    def address(self) -> str:
        return self.replicas[self.index].address

    def describe(self, info: HelloInfo) -> HelloInfo:
        """Add to the hello reply what a client needs to route every key."""
        info.replica, info.node = self.index, self.node
        info.replicas = [r.as_dict() for r in self.replicas]
        return info

    def start(self, core: Any) -> None:
        """Called once the broker serves (``core``: its queues): link to the other replicas and
        learn the table."""
        self._core = core
        self.bindings.start()

    def tick(self) -> None:
        """Every heartbeat: the binding table's upkeep; key moves (``steal``)."""
        self.bindings.tick()
        if self.mover is not None:
            self.mover.tick()

    def handle(self, rec: Bind | Learn | Sync | Load | Release) -> Any:
        if isinstance(rec, (Load, Release)):
            if self.mover is None:
                raise ValueError(f"channel {self.name!r} does not move keys (steal is off)")
            return self.mover.handle(rec)
        return self.bindings.handle(rec)

    def check_key(self, rec: Request) -> None:
        """``KeyMoved`` for an operation on a key this replica gave away (``steal`` only)."""
        if self.mover is not None:
            self.mover.check(rec)

    def bind(self, key: Any, node: Any = None, replica: Any = None) -> Any:
        return self.bindings.bind(key, node, replica)

    # -- every replica -------------------------------------------------------------------

    def owner(self, key: Any) -> int:
        """The replica ``key`` is bound to; an unbound key binds to this replica (asking the
        binder, for at most ``BIND_TIMEOUT_S``; ``BrokerUnavailable`` then)."""
        bound = self.table.get(key)
        if bound is not None:
            return bound
        deadline = time.monotonic() + BIND_TIMEOUT_S
        target = None
        while True:
            answer = self.bindings.bind(key, replica=self.index, sender=self.index) \
                if target is None else self._ask(target, key, deadline)
            if isinstance(answer, int) and not isinstance(answer, bool):
                self.table.setdefault(key, answer)
                return self.table[key]
            told = bind_answer(answer)
            target = told.redirect() if told is not None else None  # None: retry (joining)
            if target == self.index:
                target = None
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(
                    f"no replica of {self.name!r} could bind the collector output key {key!r} "
                    f"within {BIND_TIMEOUT_S}s")
            if target is None:
                time.sleep(0.02)  # joining, or the binder just changed: ask again shortly

    def _ask(self, target: int, key: Any, deadline: float) -> Any:
        try:
            work = self.bindings.peer(target).request(
                Bind(id=0, key=key, replica=self.index, sender=self.index), [])
            return work.wait(max(0.0, deadline - time.monotonic()))
        except (ChannelError, TimeoutError):
            return None

    def check_outputs(self, key: Any) -> None:
        owner = self.owner(key)
        if owner != self.index:
            r = self.replicas[owner]
            raise HookError(
                f"collector output key {key!r} is bound to replica {owner} (node {r.node!r}), "
                f"not to this replica {self.index} (node {self.node!r}): a collector may only "
                "produce keys that live on its own replica",
                "KeyBoundElsewhere",
            )

    def annotate(self, stats: dict) -> dict:
        for ks in (stats.get("keys") or {}).values():
            ks["node"] = self.node
        stats["replica"] = self.index
        stats["node"] = self.node
        stats["bound_keys"] = len(self.table)
        stats["binding"] = "binder" if self.bindings.ready and \
            self.bindings.binder() == self.index else ("ready" if self.bindings.ready else "joining")
        stats["live_replicas"] = self.bindings.live_replicas()
        if self.mover is not None:
            stats.update(self.mover.stats())
        return stats

    def close(self) -> None:
        self.bindings.close()


class _BindingCollector(Collector):
    """Wraps a replica's collector: every output key must live on this replica."""

    def __init__(self, inner: Collector, state: ReplicaState) -> None:
        self.inner = inner
        self.state = state

    def setup(self, ctx: Any) -> None:
        self.inner.setup(ctx)

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def collect(self, item: Any, key: Any):
        for out in collected(self.inner.collect(item, key)):
            # the put's own key was bound to this replica by the client that routed it here
            if isinstance(out, tuple) and len(out) in (2, 3) and out[0] != key:
                self.state.check_outputs(check_key(out[0]))
            yield out


def wrap_collector(collector: Collector, state: ReplicaState) -> Collector:
    """The collector a replica runs; the pass-through collector needs no check (its outputs are
    the put's own key, bound to this replica by the client) and stays undecoded."""
    if type(collector).collect is Collector.collect:
        return collector
    inner_cls = type(collector)
    namespace: dict[str, Any] = {"hook_name": hook_name(collector)}
    # what the broker asks only of collectors that override it (state kept between puts, a
    # journal's snapshots of it) is passed on only when the wrapped one does
    for method in ("holds_state", "state_dict", "load_state_dict"):
        if getattr(inner_cls, method) is not getattr(Collector, method):
            namespace[method] = _passed_on(method)
    cls = type(f"Bound{inner_cls.__name__}", (_BindingCollector,), namespace)
    return cls(collector, state)


def _passed_on(method: str) -> Callable[..., Any]:
    """A method of ``_BindingCollector`` that calls the wrapped collector's ``method``."""
    def call(self: _BindingCollector, *args: Any) -> Any:
        return getattr(self.inner, method)(*args)
    call.__name__ = method
    return call


def replica_state(config: Any) -> ReplicaState:
    """Fill a ``BrokerConfig`` of a replica from its cluster file (address, insecure) and return
    the replica's state."""
    if config.replica is None:
        raise ValueError("a replica needs its index (--replica I)")
    if config.replicas is None:
        loaded = clusterfile.load(config.cluster, config.name)
        config.replicas = loaded.table()
        if loaded.insecure:
            config.insecure = True
        if loaded.client_keys and config.curve_public_keys is None:
            config.curve_public_keys = loaded.client_keys
        if loaded.steal:
            config.steal = True
    state = ReplicaState(config.name, config.replica, config.replicas,
                         heartbeat_interval=config.heartbeat_interval, liveness=config.liveness,
                         secret_key=config.curve_secret_key, steal=config.steal)
    own_key = state.replicas[config.replica].server_key
    if own_key:
        if not config.curve_secret_key:
            raise ValueError(f"the cluster file turns CURVE on: replica {config.replica} needs "
                             "its key pair file (--curve-secret-key)")
        if clusterfile.public_key_z85(config.curve_secret_key) != own_key:
            raise ValueError(f"{config.curve_secret_key} is not the key pair of replica "
                             f"{config.replica} (its public key differs from the cluster file's)")
    if config.address is None:
        config.address = state.address
    elif config.address != state.address:
        raise ValueError(f"replica {config.replica} is at {state.address} in the cluster file, "
                         f"not {config.address}")
    return state


__all__ = ["ReplicaState", "replica_state", "wrap_collector"]
