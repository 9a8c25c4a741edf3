"""The client side of a distributed channel: one handle, one broker replica per node.

``DistributedChannel`` is a channel handle (a ``Channel`` to ``isinstance``: ``broker/channel.py``)
whose operations go to the replica its key is bound to, each through a ``BrokerChannel``
(``client.py``) of that replica.
The first operation of any kind on a key asks the binder (the lowest-index live replica; every
replica holds the replicated table: ``broker/binding.py``) to bind the key (first toucher wins,
permanent: to the replica of the caller's node); the handle caches the binding, so every later
operation on that key goes straight to its replica over this process's connection to that
replica (shared with the process's other handles, ``sharing.py``).  All per-key semantics
(ordering, backpressure, hooks, errors, ``BrokerUnavailable``) are those of the replica that
holds the key.  ``stats()`` aggregates over the replicas.

Where the replica table comes from: a cluster file (``broker/cluster.py``; ``create_from_cluster``
and ``connect_from_cluster`` here), Ray (``broker/ray_placement.py``, which builds this handle from
the table its actors publish), or the hello reply of any replica (``from_handle``: so
``Channel.connect`` of any replica's address or name yields this handle).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np
from zchannel.broker import cluster, paths
from zchannel.broker.checks import check_target_weight
from zchannel.broker.client import DEFAULT_KEY, BrokerChannel
from zchannel.broker.core import check_key, check_timeout, check_weight
from zchannel.broker.errors import BrokerUnavailable, ChannelError
from zchannel.broker.protocol import Bind
from zchannel.broker.security import replica_client_keys
from zchannel.broker.starting import START_TIMEOUT_S, spawn_broker
from zchannel.broker.work import Delivery, Work
from zchannel.hooks import consumer_sort_key

log = logging.getLogger("zchannel.client")

_SUM_FIELDS = ("bytes_held", "leases", "clients", "puts", "gets", "delivered")
STATS_CONNECT_S = 3.0
# binding a key: how long one replica may take to accept a connection, the pause before asking
# again (a replica joins, the binder changes), when to try a replica that was unavailable, and
# the limit for the whole (generous: a failover
# takes one heartbeat expiry, a join as long)
BIND_CONNECT_S = 3.0
BIND_RETRY_S = 0.02
BIND_RECHECK_S = 0.5  # a replica found unavailable is asked again after this (it may be back)
BIND_DEADLINE_S = 30.0


class DistributedChannel(BrokerChannel):
    """A handle of a channel served by several broker replicas (see the module docstring)."""

    def __init__(self, name: str | None, replicas: list[dict[str, Any]], *,
                 identity: str | None = None, curve_keys: Any = None,
                 subs: dict[int, BrokerChannel] | None = None, owner: bool = False,
                 ray_owner: Any = None) -> None:
        self._replicas = cluster.from_table(replicas)
        self._node = cluster.local_node(self._replicas)
        local = [i for i, r in enumerate(self._replicas) if r.node == self._node]
        self._home = local[0] if local else 0
        super().__init__(name, self._replicas[self._home].address, identity=identity,
                         curve_keys=curve_keys)
        self._subs: dict[int, BrokerChannel] = dict(subs or {})
        self._subs_lock = threading.Lock()
        self._bindings: dict[Any, int] = {}
        self._binder = 0  # the replica that answered the last binding request
        self._owner = owner
        self.created = owner
        self._ray_owner = ray_owner  # the Ray placement (actors) this handle created

    @classmethod
    def from_handle(cls, handle: BrokerChannel) -> DistributedChannel:
        """Turn a plain handle connected to one replica into the distributed handle."""
        info = handle._conn.broker_info
        dist = cls(handle._name or info.name, info.replicas,
                   identity=handle._explicit_identity, curve_keys=handle._curve_keys,
                   subs={int(info.replica or 0): handle})
        return dist

    # -- routing ------------------------------------------------------------------------

    @property
    def replicas(self) -> list[dict[str, Any]]:
        """The replica table: ``[{"node", "address", "hostnames"}, ...]`` (index = replica)."""
        return [r.as_dict() for r in self._replicas]

    @property
    def node(self) -> str:
        """This process's node (``ZCHANNEL_NODE``, the Ray node id, or the hostname)."""
        return self._node

    def _connect_home(self, timeout: float) -> DistributedChannel:
        """Connect to this node's replica now (``ChannelNotFound`` if it does not answer in
        ``timeout``; the handle is closed then)."""
        try:
            self._sub(self._home)._connection(timeout=timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _sub(self, index: int) -> BrokerChannel:
        sub = self._subs.get(index)
        if sub is not None:
            return sub
        if self._closed:
            raise ChannelError("this channel handle is closed")
        with self._subs_lock:
            sub = self._subs.get(index)
            if sub is None:
                sub = BrokerChannel(self._name, self._replicas[index].address,
                              identity=self._explicit_identity,
                              curve_keys=replica_client_keys(self._curve_keys,
                                                             self._replicas[index].server_key))
                self._subs[index] = sub
            return sub

    def replica_of(self, key: Any = DEFAULT_KEY) -> int:
        """The index of the replica ``key`` is bound to, binding it now (first touch) if this
        handle has not seen it yet."""
        key = check_key(key)
        index = self._bindings.get(key)
        if index is not None:
            return index
        index = 0 if len(self._replicas) == 1 else self._bind(key)
        self._bindings[key] = index
        return index

    def _bind(self, key: Any) -> int:
        """Ask the binder (``broker/binding.py``) for ``key``'s replica: start with the last
        binder, follow redirects, go on to the next replica when one is unavailable; wait
        while a replica joins.  ``BrokerUnavailable`` when every replica failed in a row or no
        answer came within ``BIND_DEADLINE_S``."""
        n = len(self._replicas)
        deadline = time.monotonic() + BIND_DEADLINE_S
        target, unavailable, last_error = self._binder, 0, None
        failed: dict[int, float] = {}  # replica -> when it was last found unavailable
        while True:
            answer = None
            try:
                sub = self._sub(target)
                sub._connection(timeout=BIND_CONNECT_S)
                answer = sub._submit(Bind(id=0, key=key, node=self._node)).wait(
                    max(0.0, deadline - time.monotonic()))
                unavailable = 0
            except BrokerUnavailable as exc:
                unavailable, last_error = unavailable + 1, exc
                failed[target] = time.monotonic()
                target = (target + 1) % n
                if unavailable >= n:
                    raise BrokerUnavailable(f"no replica of {self._name!r} answers to bind "
                                            f"{key!r}: {last_error}") from exc
            except TimeoutError:
                pass
            if isinstance(answer, int) and not isinstance(answer, bool):
                if not 0 <= answer < n:
                    raise ChannelError(f"replica {target} bound {key!r} to an unknown replica "
                                       f"{answer!r}")
                self._binder = target
                return answer
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(f"no replica of {self._name!r} bound {key!r} within "
                                        f"{BIND_DEADLINE_S}s")
            redirect = answer.get("binder") if isinstance(answer, dict) else None
            if isinstance(redirect, int) and 0 <= redirect < n and redirect != target \
                    and time.monotonic() - failed.get(redirect, -1e9) >= BIND_RECHECK_S:
                target = redirect
            elif answer is not None:
                time.sleep(BIND_RETRY_S)  # a replica joins, or the binder changes: ask again

    def node_of(self, key: Any = DEFAULT_KEY) -> str:
        """The node whose replica holds ``key`` (binds it on first touch, like any operation)."""
        return self._replicas[self.replica_of(key)].node

    def _for(self, key: Any) -> BrokerChannel:
        return self._sub(self.replica_of(key))

    # -- operations ---------------------------------------------------------------------

    def put(self, item: Any, weight: int | float = 0, key: Any = DEFAULT_KEY,
            async_op: bool = False, timeout: float | None = None) -> Work | None:
        check_weight(weight)
        check_timeout(timeout)
        return self._for(key).put(item, weight, key, async_op, timeout)

    def put_nowait(self, item: Any, weight: int | float = 0, key: Any = DEFAULT_KEY) -> None:
        check_weight(weight)
        self._for(key).put_nowait(item, weight, key)

    def get(self, key: Any = DEFAULT_KEY, async_op: bool = False, timeout: float | None = None,
            *, ack: bool = False, copy: bool | None = None) -> Any:
        check_timeout(timeout)
        index = self.replica_of(key)
        result = self._sub(index).get(key, async_op, timeout, ack=ack, copy=copy)
        if not ack:
            return result
        if async_op:
            return result.then(lambda d: self._tag(d, index))
        return self._tag(result, index)

    def get_nowait(self, key: Any = DEFAULT_KEY, *, ack: bool = False, copy: bool | None = None) -> Any:
        index = self.replica_of(key)
        result = self._sub(index).get_nowait(key, ack=ack, copy=copy)
        return self._tag(result, index) if ack else result

    def get_batch(self, target_weight: int | float, key: Any = DEFAULT_KEY,
                  async_op: bool = False, timeout: float | None = None, *,
                  copy: bool | None = None) -> list | Work:
        check_target_weight(target_weight)
        check_timeout(timeout)
        return self._for(key).get_batch(target_weight, key, async_op, timeout, copy=copy)

    def qsize(self, key: Any = DEFAULT_KEY, consumer: str | None = None) -> int:
        return self._for(key).qsize(key, consumer)

    def full(self, key: Any = DEFAULT_KEY, consumer: str | None = None) -> bool:
        return self._for(key).full(key, consumer)

    def peek(self, key: Any = DEFAULT_KEY, n: int = 1, *, consumer: str | None = None,
             weights: bool = False) -> list:
        """``Channel.peek`` on the replica holding ``key`` (an unbound key is bound to this
        node's replica first, as by any operation)."""
        return self._for(key).peek(key, n, consumer=consumer, weights=weights)

    def reserve_shm(self, nbytes: int, slots: int) -> int:
        """``Channel.reserve_shm`` on this node's replica (where this process's keys live)."""
        return self._sub(self._home).reserve_shm(nbytes, slots)

    def empty_shm(self, shape: Any, dtype: Any = np.float32) -> Any:
        """``Channel.empty_shm`` on this node's replica (where this process's keys live; a put
        of it to a key of another replica copies it, as any array)."""
        return self._sub(self._home).empty_shm(shape, dtype)

    def _tag(self, delivery: Delivery, index: int) -> Delivery:
        # lease ids are per replica: fold the replica index into the id the caller sees
        return Delivery(delivery.item, delivery.lease_id * len(self._replicas) + index)

    def ack(self, delivery: Delivery) -> None:
        if not isinstance(delivery, Delivery):
            raise TypeError("ack() takes the Delivery returned by get(..., ack=True)")
        n = len(self._replicas)
        lease = delivery.lease_id
        if isinstance(lease, bool) or not isinstance(lease, int) or lease < 0:
            raise ValueError(f"unknown lease {lease!r}")
        self._sub(lease % n).ack(Delivery(delivery.item, lease // n))

    def stats(self, *, exclude_self: bool = False) -> dict:
        """The replicas' stats merged: keys (each with its ``node``), consumers, summed counters,
        and ``replicas``: one summary per replica (``error`` for one that does not answer)."""
        parts: list[dict] = []
        summaries: list[dict] = []
        for i, r in enumerate(self._replicas):
            summary: dict[str, Any] = {"replica": i, "node": r.node, "address": r.address}
            try:
                sub = self._sub(i)
                sub._connection(timeout=STATS_CONNECT_S)  # a dead replica must not hold stats up
                s = sub.stats(exclude_self=exclude_self)
            except (BrokerUnavailable, ChannelError) as exc:
                summary["error"] = f"{type(exc).__name__}: {exc}"
                summaries.append(summary)
                continue
            parts.append(s)
            summary.update(pid=s.get("pid"), bytes_held=s.get("bytes_held", 0),
                           keys=len(s.get("keys") or {}), clients=s.get("clients", 0),
                           uptime_s=s.get("uptime_s"))
            for name in ("bound_keys", "binding"):
                if name in s:
                    summary[name] = s[name]
            summaries.append(summary)
        if not parts:
            raise BrokerUnavailable(f"no replica of channel {self._name!r} answers")
        first = parts[0]
        out = {k: v for k, v in first.items() if k not in ("replica", "node", "bound_keys", "binding")}
        keys: dict = {}
        consumers: set = set()
        for s in parts:
            keys.update(s.get("keys") or {})
            consumers.update(s.get("consumers") or ())
        out["keys"] = keys
        out["consumers"] = sorted(consumers, key=consumer_sort_key)
        for name in _SUM_FIELDS:
            out[name] = sum(s.get(name, 0) or 0 for s in parts)
        out["uptime_s"] = max(s.get("uptime_s", 0) for s in parts)
        home = next((s for s in parts if s.get("replica") == self._home), first)
        out["address"], out["pid"] = home.get("address"), home.get("pid")
        out["metrics"] = home.get("metrics")  # each replica serves its own (metrics_port)
        out["node"] = self._node
        out["replicas"] = summaries
        return out

    # -- lifetime -----------------------------------------------------------------------

    def _each_sub(self) -> list[BrokerChannel]:
        with self._subs_lock:
            return list(self._subs.values())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in self._each_sub():
            try:
                sub.close()
            except Exception:
                log.exception("closing a replica handle failed")
        self._give_back()  # the home replica's share, if this handle took one itself

    def shutdown(self) -> None:
        """Stop the replicas this handle's ``create`` started (and their Ray actors)."""
        if not self._owner or self._creator_pid != os.getpid():
            raise PermissionError("only the handle that created the channel's brokers may shut them down")
        for sub in self._each_sub():
            try:
                if sub._proc is not None:
                    sub.shutdown()
                else:
                    sub.close()
            except Exception:
                log.exception("stopping a replica failed")
        self._closed = True
        self._give_back(settle_puts=False, withdraw=False)
        if self._ray_owner is not None:
            owner, self._ray_owner = self._ray_owner, None
            owner.teardown()
        self._owner = False

    def __exit__(self, *exc: Any) -> None:
        if self._owner and self._creator_pid == os.getpid():
            self.shutdown()
        else:
            self.close()

    def __reduce__(self) -> Any:
        return (_unpickle, (self._name, self.replicas, self._explicit_identity, self._curve_keys))

    def __repr__(self) -> str:
        return (f"DistributedChannel(name={self._name!r}, replicas={len(self._replicas)}, "
                f"node={self._node!r}, created={self.created})")


def _unpickle(name: str | None, replicas: list, identity: str | None,
              curve_keys: Any) -> DistributedChannel:
    return DistributedChannel(name, replicas, identity=identity, curve_keys=curve_keys)


# -- creating and finding distributed channels ---------------------------------------------


def create_from_cluster(config: dict, path: str, *, identity: str | None,
                        curve_keys: Any) -> DistributedChannel:
    """Start the replicas of the cluster file that live on this process's node (other nodes
    start theirs with ``zchannel broker NAME --cluster FILE --replica I``) and connect."""
    name = config["name"]
    cl = cluster.load(path, name)
    node = cluster.local_node(cl.replicas)
    table = cl.table()
    subs: dict[int, BrokerChannel] = {}
    errors: list[BaseException] = []

    def start(i: int, r: cluster.Replica) -> None:
        lock_fd = paths.try_lock(f"{name}.replica{i}")
        if lock_fd is None:
            return  # a live replica (or one being started) holds it: connect to it
        rconfig = dict(config, address=r.address, replica=i, replicas=table,
                       insecure=bool(config.get("insecure")) or cl.insecure)
        try:
            proc, real_address, token = spawn_broker(rconfig, lock_fd)
        except BaseException as exc:
            paths.release_lock(f"{name}.replica{i}", lock_fd)
            errors.append(exc)
            return
        os.close(lock_fd)  # the replica holds it now
        subs[i] = BrokerChannel(name, real_address, identity=identity, curve_keys=curve_keys,
                          _proc=proc, _token=token)

    try:
        # the node's replicas start in parallel (each is a child process, as in create())
        threads = [threading.Thread(target=start, args=(i, r)) for i, r in enumerate(cl.replicas)
                   if r.node == node]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        handle = DistributedChannel(name, table, identity=identity, curve_keys=curve_keys,
                                    subs=subs, owner=bool(subs))
        handle._sub(handle._home)._connection(timeout=START_TIMEOUT_S)  # this node's replica
        if not subs:
            handle._log_attached()
    except BaseException:
        for sub in subs.values():
            sub._kill_broker()
        raise
    return handle


def connect_from_cluster(name: str, *, identity: str | None,
                         timeout: float) -> DistributedChannel | None:
    """A handle of channel ``name`` from the cluster file of ``$ZCHANNEL_CLUSTER``; None if
    there is none or it does not serve the name.  ``ChannelNotFound`` if this node's replica
    does not answer within ``timeout``."""
    path = cluster.find_file()
    if not path:
        return None
    try:
        cl = cluster.load(path, name)
    except ValueError:
        return None
    return DistributedChannel(name, cl.table(), identity=identity)._connect_home(timeout)


__all__ = ["DistributedChannel", "connect_from_cluster", "create_from_cluster"]
