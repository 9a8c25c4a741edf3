"""The broker side of a distributed channel: one replica's view of the cluster.

Replica 0 holds the key-binding table (key -> replica index; first toucher wins, permanent) and
answers ``bind`` requests.  Every replica checks its collector's outputs: an output whose key is
unbound binds to this replica, an output for a key bound elsewhere fails the put with
``HookError``.  Other replicas ask replica 0 over an ordinary client connection and
cache the answers (bindings never change, so the cache is never stale).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from zchannel.broker.cluster import Replica, choose_replica, from_table
from zchannel.broker.errors import BrokerUnavailable, HookError
from zchannel.hooks import Collector

log = logging.getLogger("zchannel.broker")

BIND = "bind"
# the round trip blocks this replica's loop: stay well inside the clients' liveness window (3 s)
BIND_TIMEOUT_S = 2.0


class ReplicaState:
    """Replica ``index`` of a channel whose replicas are ``table`` (dicts: node, address)."""

    def __init__(self, name: str, index: int, table: list[dict[str, Any]],
                 curve_keys: Any = None) -> None:
        self.name = name
        self.index = index
        self.replicas: list[Replica] = from_table(table)
        if not 0 <= index < len(self.replicas):
            raise ValueError(f"replica {index} is not in the cluster's {len(self.replicas)} replicas")
        self.node = self.replicas[index].node
        self.table: dict[Any, int] = {}  # replica 0: the binding table; others: a cache
        self._curve_keys = curve_keys
        self._conn = None
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self.replicas[self.index].address

    def info(self) -> dict[str, Any]:
        """What the hello reply carries: enough for a client to route every key."""
        return {"replica": self.index, "replicas": [r.as_dict() for r in self.replicas],
                "node": self.node}

    # -- replica 0 -----------------------------------------------------------------------

    def bind(self, key: Any, node: Any = None, replica: Any = None) -> int:
        """Replica 0: the replica ``key`` is bound to, binding it now if it is unbound (to
        ``replica`` if given, else to the replica of ``node``)."""
        if self.index != 0:
            raise ValueError("only replica 0 binds keys")
        from zchannel.broker.core import check_key

        key = check_key(key)
        bound = self.table.get(key)
        if bound is None:
            if replica is not None:
                if isinstance(replica, bool) or not isinstance(replica, int) \
                        or not 0 <= replica < len(self.replicas):
                    raise ValueError(f"no replica {replica!r}")
                bound = replica
            else:
                if node is not None and not isinstance(node, str):
                    raise TypeError("node must be a str")
                bound = choose_replica(self.replicas, node, key)
            self.table[key] = bound
        return bound

    # -- every replica -------------------------------------------------------------------

    def owner(self, key: Any) -> int:
        """The replica ``key`` is bound to; an unbound key binds to this replica."""
        bound = self.table.get(key)
        if bound is not None:
            return bound
        if self.index == 0:
            return self.bind(key, replica=0)
        bound = self._ask_replica0(key)
        self.table[key] = bound
        return bound

    def _ask_replica0(self, key: Any) -> int:
        from zchannel.broker.connection import Connection
        from zchannel.broker.security import client_keys

        with self._lock:
            if self._conn is None:
                self._conn = Connection(self.replicas[0].address,
                                        curve=client_keys(self._curve_keys))
            conn = self._conn
        if not conn.wait_up(BIND_TIMEOUT_S):
            raise BrokerUnavailable(f"replica 0 of {self.name!r} ({self.replicas[0].address}) "
                                    "does not answer: cannot bind a collector output key")
        return conn.request({"op": BIND, "k": key, "replica": self.index}, []).wait(BIND_TIMEOUT_S)

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
        if self.index == 0:
            stats["bound_keys"] = len(self.table)
        return stats

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


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
        from zchannel.broker.core import check_key

        produced = self.inner.collect(item, key)
        for out in produced if produced is not None else ():
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
    name = getattr(inner_cls, "hook_name", None) or f"{inner_cls.__module__}:{inner_cls.__qualname__}"
    cls = type(f"Bound{inner_cls.__name__}", (_BindingCollector,), {"hook_name": name})
    return cls(collector, state)




def replica_state(config: Any) -> ReplicaState:
    """Fill a ``BrokerConfig`` of a replica from its cluster file (address, insecure) and return
    the replica's state."""
    from zchannel.broker import cluster

    if config.replica is None:
        raise ValueError("a replica needs its index (--replica I)")
    if config.replicas is None:
        loaded = cluster.load(config.cluster, config.name)
        config.replicas = loaded.table()
        if loaded.insecure:
            config.insecure = True
    state = ReplicaState(config.name, config.replica, config.replicas)
    if config.address is None:
        config.address = state.address
    elif config.address != state.address:
        raise ValueError(f"replica {config.replica} is at {state.address} in the cluster file, "
                         f"not {config.address}")
    return state


__all__ = ["BIND", "ReplicaState", "replica_state", "wrap_collector"]
