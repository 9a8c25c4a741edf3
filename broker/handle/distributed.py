"""The client side of a distributed channel: one handle, one broker replica per node.

``DistributedChannel`` is a channel handle (a ``Channel`` to ``isinstance``: ``broker/handle/channel.py``)
whose operations go to the replica its key is bound to, each through a ``BrokerChannel``
(``handle/broker_channel.py``) of that replica.
The first operation of any kind on a key asks the binder (the lowest-index live replica; every
replica holds the replicated table: ``broker/cluster/binding.py``) to bind the key (first toucher wins,
permanent, unless opt-in stealing moves the key while it is empty, ``broker/cluster/moving.py``: to the
replica of the caller's node); the handle caches the binding (``handle/routing.py``; corrected when a
replica answers ``KeyMoved``), so every later operation on that key goes straight to its replica
over this process's connection to that replica (shared with the process's other handles, ``connection/sharing.py``).  All per-key semantics
(ordering, backpressure, hooks, errors, ``BrokerUnavailable``) are those of the replica that
holds the key.  ``stats()`` aggregates over the replicas.

Where the replica table comes from: a cluster file (``broker/cluster/clusterfile.py``; ``create_from_cluster``
and ``connect_from_cluster`` here), Ray (``broker/handle/ray_placement.py``, which builds this handle from
the table its actors publish), or the hello reply of any replica (``from_handle``: so
``Channel.connect`` of any replica's address or name yields this handle).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, overload

import numpy as np
from msgspec import UnsetType
from zchannel.broker.cluster import clusterfile
from zchannel.broker.connection import sharing
from zchannel.broker.connection.tuning import connect_budget
from zchannel.broker.connection.work import Delivery, Work
from zchannel.broker.errors import BrokerUnavailable, ChannelError, ChannelNotFound
from zchannel.broker.handle.base import clean_after_dead_broker
from zchannel.broker.handle.broker_channel import DEFAULT_KEY, BrokerChannel
from zchannel.broker.handle.keeper import BrokerKeeper
from zchannel.broker.handle.routing import KeyRouting
from zchannel.broker.host import paths
from zchannel.broker.server.config import DEFAULT_LEASE_TIMEOUT
from zchannel.broker.server.starting import START_TIMEOUT_S, hook_label, spawn_broker
from zchannel.broker.transport.curve import replica_client_keys
from zchannel.broker.wire.argchecks import check_target_weight, check_timeout, check_weight
from zchannel.hooks import consumer_sort_key, expand_consumers

log = logging.getLogger("zchannel.client")

_SUM_FIELDS = ("bytes_held", "leases", "clients", "puts", "gets", "delivered")
# per-replica stats that go to stats()["replicas"][i] only
_REPLICA_FIELDS = ("bound_keys", "binding", "live_replicas", "keys_given", "moves_asked")
STATS_CONNECT_S = 3.0
NO_LOCAL_REPLICA_WAIT_S = 10.0  # create() on a node without a replica: wait for the others
CONNECT_SLICE_S = 1.0  # connect(): how long to wait for one replica before trying the next


class ReplicaChannel(BrokerChannel):
    """The handle of one replica inside a ``DistributedChannel``: a ``BrokerChannel`` that,
    once per hello of the broker it reaches, checks that the broker is replica ``index`` of
    the channel (its hello's name and replica index); ``ChannelError`` naming ``source`` (the
    cluster file, or where the table came from) and both channels otherwise, before anything
    is sent to it -- a broker of another channel at a listed address is never used."""

    def __init__(self, name: str | None, address: str, index: int, source: str | None, *,
                 identity: str | None = None, curve_keys: Any = None,
                 shm: bool | None = None) -> None:
        super().__init__(name, address, identity=identity, curve_keys=curve_keys, shm=shm)
        self._replica_index = index
        self._table_source = source
        self._checked_hello: Any = None  # the broker_info of the last hello that was checked

    def _acquired(self, timeout: float = 10.0) -> sharing.Share:
        share = super()._acquired(timeout)
        info = share.conn.broker_info
        if info is not self._checked_hello:
            problem = replica_mismatch(info, self._name, self._replica_index)
            if problem is not None:
                self._give_back(settle_puts=False, withdraw=False)
                raise ChannelError(
                    f"{self._table_source or 'the replica table'} does not match the running "
                    f"channel {self._name!r}: it lists {self._address} as replica "
                    f"{self._replica_index}, but the broker there {problem}; nothing was sent "
                    "to it")
            self._checked_hello = info
        return share


def replica_mismatch(info: Any, name: str | None, index: int) -> str | None:
    """What is wrong with a broker whose hello is ``info`` as replica ``index`` of channel
    ``name``, and the remedy (None: nothing; a ``name`` of None matches any channel)."""
    if name is not None and info.name != name:
        return (f"serves channel {info.name!r}; give each channel its own addresses ({{name}} "
                "in a cluster file's addresses)")
    if isinstance(info.replica, UnsetType):
        return f"serves channel {info.name!r} alone, not as a replica"
    if info.replica != index:
        return (f"is replica {info.replica} of channel {info.name!r}, not replica {index}; "
                "give every process the same cluster file (or connect by address)")
    return None


class DistributedChannel(BrokerChannel):
    """A handle of a channel served by several broker replicas (see the module docstring);
    ``source``: where its replica table came from (a cluster file), for error messages."""

    def __init__(self, name: str | None, replicas: list[dict[str, Any]], *,
                 identity: str | None = None, curve_keys: Any = None,
                 subs: dict[int, BrokerChannel] | None = None, owner: bool = False,
                 ray_owner: Any = None, shm: bool | None = None,
                 source: str | None = None) -> None:
        self._replicas = clusterfile.from_table(replicas)
        self._node = clusterfile.local_node(self._replicas)
        local = [i for i, r in enumerate(self._replicas) if r.node == self._node]
        self._home = local[0] if local else 0
        super().__init__(name, self._replicas[self._home].address, identity=identity,
                         curve_keys=curve_keys, shm=shm)
        self._subs: dict[int, BrokerChannel] = dict(subs or {})
        self._subs_lock = threading.Lock()
        self._routing = KeyRouting(self._replicas, self._node, name, self._sub)
        self._owner = owner
        self.created = owner
        self._ray_owner = ray_owner  # the Ray placement (actors) this handle created
        self._via: int | None = None  # the replica this handle was connected through, if any
        self._source = source

    @classmethod
    def from_handle(cls, handle: BrokerChannel) -> DistributedChannel:
        """Turn a plain handle connected to one replica into the distributed handle."""
        info = handle._connection().broker_info
        if isinstance(info.replicas, UnsetType):
            raise ChannelError(f"the broker at {handle._address} is not a replica")
        dist = cls(handle._name or info.name, info.replicas,
                   identity=handle._explicit_identity, curve_keys=handle._curve_keys,
                   subs={int(info.replica or 0): handle}, shm=handle._shm)
        dist._via = int(info.replica or 0)
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

    def _sub(self, index: int) -> BrokerChannel:
        sub = self._subs.get(index)
        if sub is not None:
            return sub
        if self._closed:
            raise ChannelError("this channel handle is closed")
        with self._subs_lock:
            sub = self._subs.get(index)
            if sub is None:
                sub = ReplicaChannel(self._name, self._replicas[index].address, index,
                                     self._source, identity=self._explicit_identity,
                                     curve_keys=replica_client_keys(
                                         self._curve_keys, self._replicas[index].server_key),
                                     shm=self._shm)
                sub._probes_before_connecting = True  # a dead replica's keys fail at once
                self._subs[index] = sub
            return sub

    # -- operations ---------------------------------------------------------------------

    def replica_of(self, key: Any = DEFAULT_KEY) -> int:
        """The index of the replica ``key`` is bound to, binding it now (first touch) if this
        handle has not seen it yet."""
        return self._routing.replica_of(key)

    def node_of(self, key: Any = DEFAULT_KEY) -> str:
        """The node whose replica holds ``key`` (binds it on first touch, like any operation)."""
        return self._routing.node_of(key)

    # the overloads of BrokerChannel.put and get_batch (None / the items, or a Work)
    @overload
    def put(self, item: Any, weight: int | float = ..., key: Any = ...,
            async_op: Literal[False] = ..., timeout: float | None = ...) -> None: ...
    @overload
    def put(self, item: Any, weight: int | float, key: Any, async_op: Literal[True],
            timeout: float | None = ...) -> Work: ...
    @overload
    def put(self, item: Any, weight: int | float = ..., key: Any = ..., *,
            async_op: Literal[True], timeout: float | None = ...) -> Work: ...
    @overload
    def put(self, item: Any, weight: int | float = ..., key: Any = ...,
            async_op: bool = ..., timeout: float | None = ...) -> Work | None: ...

    def put(self, item: Any, weight: int | float = 0, key: Any = DEFAULT_KEY,
            async_op: bool = False, timeout: float | None = None) -> Work | None:
        check_weight(weight)
        check_timeout(timeout)
        return self._routing.on(key, lambda sub, _: sub.put(item, weight, key, async_op, timeout),
                                connect_s=connect_budget(timeout, async_op), async_op=async_op)

    def put_nowait(self, item: Any, weight: int | float = 0, key: Any = DEFAULT_KEY) -> None:
        check_weight(weight)
        self._routing.on(key, lambda sub, _: sub.put_nowait(item, weight, key))

    def get(self, key: Any = DEFAULT_KEY, async_op: bool = False, timeout: float | None = None,
            *, ack: bool = False, copy: bool | None = None) -> Any:
        check_timeout(timeout)

        def call(sub: BrokerChannel, index: int) -> Any:
            result = sub.get(key, async_op, timeout, ack=ack, copy=copy)
            if not ack:
                return result
            if async_op:
                return result.then(lambda d: self._tag(d, index))
            return self._tag(result, index)

        return self._routing.on(key, call, connect_s=connect_budget(timeout, async_op),
                                async_op=async_op)

    def get_nowait(self, key: Any = DEFAULT_KEY, *, ack: bool = False, copy: bool | None = None) -> Any:
        def call(sub: BrokerChannel, index: int) -> Any:
            result = sub.get_nowait(key, ack=ack, copy=copy)
            return self._tag(result, index) if ack else result

        return self._routing.on(key, call)

    @overload
    def get_batch(self, target_weight: int | float, key: Any = ...,
                  async_op: Literal[False] = ..., timeout: float | None = ..., *,
                  copy: bool | None = ...) -> list[Any]: ...
    @overload
    def get_batch(self, target_weight: int | float, key: Any, async_op: Literal[True],
                  timeout: float | None = ..., *, copy: bool | None = ...) -> Work: ...
    @overload
    def get_batch(self, target_weight: int | float, key: Any = ..., *,
                  async_op: Literal[True], timeout: float | None = ...,
                  copy: bool | None = ...) -> Work: ...
    @overload
    def get_batch(self, target_weight: int | float, key: Any = ...,
                  async_op: bool = ..., timeout: float | None = ..., *,
                  copy: bool | None = ...) -> list[Any] | Work: ...

    def get_batch(self, target_weight: int | float, key: Any = DEFAULT_KEY,
                  async_op: bool = False, timeout: float | None = None, *,
                  copy: bool | None = None) -> list[Any] | Work:
        check_target_weight(target_weight)
        check_timeout(timeout)
        return self._routing.on(key, lambda sub, _: sub.get_batch(target_weight, key, async_op, timeout,
                                                          copy=copy),
                                connect_s=connect_budget(timeout, async_op), async_op=async_op)

    def qsize(self, key: Any = DEFAULT_KEY, consumer: str | None = None) -> int:
        return self._routing.on(key, lambda sub, _: sub.qsize(key, consumer))

    def full(self, key: Any = DEFAULT_KEY, consumer: str | None = None) -> bool:
        return self._routing.on(key, lambda sub, _: sub.full(key, consumer))

    def peek(self, key: Any = DEFAULT_KEY, n: int = 1, *, consumer: str | None = None,
             weights: bool = False) -> list[Any]:
        """``Channel.peek`` on the replica holding ``key`` (an unbound key is bound to this
        node's replica first, as by any operation)."""
        return self._routing.on(key, lambda sub, _: sub.peek(key, n, consumer=consumer, weights=weights))

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

    def stats(self, *, exclude_self: bool = False) -> dict[str, Any]:
        """The replicas' stats merged: keys (each with its ``node``), consumers, summed counters,
        and ``replicas``: one summary per replica (``error`` for one that does not answer).
        ``ChannelError`` once this handle is closed, as every other call."""
        if self._closed:
            raise ChannelError("this channel handle is closed")
        # every replica at once: a dead one (its connection wait) holds up none of the others
        with ThreadPoolExecutor(max_workers=len(self._replicas)) as pool:
            answers = list(pool.map(lambda i: self._replica_stats(i, exclude_self),
                                    range(len(self._replicas))))
        summaries = [summary for summary, _ in answers]
        parts = [s for _, s in answers if s is not None]
        if not parts:
            raise BrokerUnavailable(f"no replica of channel {self._name!r} answers")
        first = parts[0]
        out = {k: v for k, v in first.items() if k not in ("replica", "node", *_REPLICA_FIELDS)}
        keys: dict[str, Any] = {}
        consumers: set[Any] = set()
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

    def _replica_stats(self, i: int, exclude_self: bool) -> tuple[dict[str, Any],
                                                                 dict[str, Any] | None]:
        """Replica ``i``'s summary for ``stats()["replicas"]`` and its stats (None, and an
        ``error`` in the summary, when it does not answer)."""
        r = self._replicas[i]
        summary: dict[str, Any] = {"replica": i, "node": r.node, "address": r.address}
        try:
            sub = self._sub(i)
            sub._connection(timeout=STATS_CONNECT_S)  # a dead replica must not hold stats up
            s = sub.stats(exclude_self=exclude_self)
        except (BrokerUnavailable, ChannelError) as exc:
            summary["error"] = f"{type(exc).__name__}: {exc}"
            return summary, None
        summary.update(pid=s.get("pid"), bytes_held=s.get("bytes_held", 0),
                       keys=len(s.get("keys") or {}), clients=s.get("clients", 0),
                       uptime_s=s.get("uptime_s"))
        for name in _REPLICA_FIELDS:
            if name in s:
                summary[name] = s[name]
        return summary, s

    # -- lifetime -----------------------------------------------------------------------

    def _each_sub(self) -> list[BrokerChannel]:
        with self._subs_lock:
            return list(self._subs.values())

    def close(self) -> None:
        """Close every replica handle, then give back the home replica's share (each is
        idempotent: what an interruption left undone, the next call does)."""
        self._closed = True
        for sub in self._each_sub():
            try:
                sub.close()
            except Exception:
                log.exception("closing a replica handle failed")
        self._give_back()  # the home replica's share, if this handle took one itself

    def shutdown(self, token: str | None = None) -> None:
        """Stop the replicas this handle's ``create`` started (and their Ray actors); only
        that handle may; again, nothing.  With a replica's shutdown ``token`` (``zchannel
        broker stop NAME.replicaI`` reads it), a handle connected through that replica's
        address stops that replica alone, and is closed."""
        if self._stopped_broker:
            return
        if token is not None and self._via is not None:
            self._subs[self._via].shutdown(token=token)
            self._stopped_broker = True
            self.close()
            return
        if not self._owns_broker():
            raise PermissionError("only the handle that created the channel's brokers may shut them down")
        died = False  # a replica it started was killed: its files wait for the others' end
        for sub in self._each_sub():
            try:
                proc = sub._proc
                if proc is not None:
                    sub.shutdown()  # waits for the process: its exit status is known after
                    died = died or proc.poll() not in (None, 0)
                else:
                    sub.close()
            except Exception:
                log.exception("stopping a replica failed")
        if died and self._name is not None:
            clean_after_dead_broker(self._name, tuple(r.address for r in self._replicas))
        self._closed = True
        self._give_back(settle_puts=False, withdraw=False)
        if self._ray_owner is not None:
            owner, self._ray_owner = self._ray_owner, None
            owner.teardown()
        self._owner = False
        self._stopped_broker = True

    def _owns_broker(self) -> bool:
        return self._owner and self._creator_pid == os.getpid()

    def __reduce__(self) -> Any:
        return (_unpickle, (self._name, self.replicas, self._explicit_identity, self._curve_keys,
                            self._shm, self._source))

    def __repr__(self) -> str:
        return (f"DistributedChannel(name={self._name!r}, replicas={len(self._replicas)}, "
                f"node={self._node!r}, created={self.created})")


def _unpickle(name: str | None, replicas: list[Any], identity: str | None,
              curve_keys: Any, shm: bool | None = None,
              source: str | None = None) -> DistributedChannel:
    """A pickled handle again (``shm``, ``source``: absent from pickles of older versions)."""
    return DistributedChannel(name, replicas, identity=identity, curve_keys=curve_keys, shm=shm,
                              source=source)


# -- creating and finding distributed channels ---------------------------------------------


def connect_home(channel: DistributedChannel, timeout: float) -> int:
    """Connect ``channel`` to this node's replica now, else (it is down) to any other replica:
    the channel is served while one answers (new keys of this node bind to a live replica);
    the index of the replica that answered, or ``ChannelNotFound`` if none answers in
    ``timeout`` (the handle is closed then)."""
    replicas = channel._replicas
    order = [channel._home] + [i for i in range(len(replicas)) if i != channel._home]
    deadline = time.monotonic() + timeout
    try:
        while True:
            for i in order:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChannelNotFound(
                        f"no replica of channel {channel._name!r} answered within {timeout}s "
                        f"({', '.join(r.address for r in replicas)})")
                try:
                    channel._sub(i)._connection(timeout=min(left, CONNECT_SLICE_S))
                except ChannelNotFound:
                    continue
                return i
    except BaseException:
        channel.close()
        raise


def check_table(channel: DistributedChannel, source: str | None, index: int) -> None:
    """``ChannelError`` naming ``source`` (a cluster file) when replica ``index`` serves another
    channel (a file whose addresses lack ``{name}`` lists the same replicas for every name)
    or another replica table than ``channel``'s (a mismatched file would otherwise send
    binding requests to a replica that is not the binder); the handle is closed then."""
    try:
        info = channel._sub(index)._connection().broker_info  # (ReplicaChannel checks it)
    except ChannelError:
        channel.close()
        raise
    if channel._name is not None and info.name != channel._name:
        channel.close()
        raise ChannelError(
            f"{source} does not describe channel {channel._name!r}: its replica {index} at "
            f"{channel._replicas[index].address} serves channel {info.name!r}; give this "
            "channel a cluster file of its own, or put {name} in the file's addresses (or "
            "[cluster] name) so that one file serves several channels")
    theirs = None if isinstance(info.replicas, UnsetType) else [
        (r.node, r.address) for r in clusterfile.from_table(info.replicas)]
    ours = [(r.node, r.address) for r in channel._replicas]
    if theirs != ours or info.replica != index:
        channel.close()
        raise ChannelError(
            f"{source} does not match the running channel {channel._name!r}: it lists "
            f"{ours} and names {ours[index][1]} replica {index}, but that broker is replica "
            f"{info.replica} of {theirs}; give every process the same cluster file (or connect "
            "by address)")


def create_from_cluster(config: dict[str, Any], path: str, *, identity: str | None,
                        curve_keys: Any) -> DistributedChannel:
    """Start the replicas of the cluster file that live on this process's node (other nodes
    start theirs with ``zchannel broker NAME --cluster FILE --replica I``) and connect."""
    name = config["name"]
    cl = clusterfile.load(path, name)
    node = clusterfile.local_node(cl.replicas)
    table = cl.table()
    subs: dict[int, BrokerChannel] = {}
    errors: list[BaseException] = []
    curve = replica_curve_settings(cl, [i for i, r in enumerate(cl.replicas) if r.node == node],
                                   curve_keys)

    def start(i: int, r: clusterfile.Replica) -> None:
        lock_fd = paths.try_lock(f"{name}.replica{i}")
        if lock_fd is None:
            return  # a live replica (or one being started) holds it: connect to it
        rconfig = dict(config, address=r.address, replica=i, replicas=table,
                       insecure=bool(config.get("insecure")) or cl.insecure, steal=cl.steal,
                       **curve.get(i, {}))
        try:
            proc, real_address, token = spawn_broker(rconfig, lock_fd)
        except BaseException as exc:
            paths.release_lock(f"{name}.replica{i}", lock_fd)
            errors.append(exc)
            return
        os.close(lock_fd)  # the replica holds it now
        keys = replica_client_keys(curve_keys, r.server_key)
        sub = subs[i] = ReplicaChannel(name, real_address, i, path, identity=identity,
                                       curve_keys=keys)._adopt(proc, token)
        # watched: reaped and logged when it dies, started again if durable (handle/keeper.py)
        sub._keeper = BrokerKeeper(f"{name}.replica{i}", dict(rconfig, address=real_address),
                                   proc, sub._broker_restarted,
                                   restart=config.get("journal") is not None)

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
                                    subs=subs, owner=bool(subs), source=path)
        reached = handle._home
        if threads:
            handle._sub(reached)._connection(timeout=START_TIMEOUT_S)  # this node's replica
        else:  # nothing to start here: a client of the other nodes' replicas
            reached = _connect_without_local_replica(handle, cl, node)
        check_table(handle, path, reached)
        if not subs:
            handle._log_attached()
    except BaseException:
        for sub in subs.values():
            sub._kill_broker()
        raise
    return handle


def _connect_without_local_replica(handle: DistributedChannel, cl: clusterfile.Cluster,
                                   node: str) -> int:
    """``create`` on a node the file lists no replica on: connect to any replica (its index),
    else a ``ChannelNotFound`` that says this node has none (not only that replica 0 is
    silent)."""
    try:
        return connect_home(handle, NO_LOCAL_REPLICA_WAIT_S)
    except ChannelNotFound as exc:
        raise ChannelNotFound(
            f"{cl.source} lists no replica on this node {node!r} (its nodes: "
            f"{sorted({r.node for r in cl.replicas})}; a process's node is "
            f"${clusterfile.ENV_NODE}, else its hostname), so nothing was started, and "
            f"no replica elsewhere answered within {NO_LOCAL_REPLICA_WAIT_S}s") from exc


def replica_curve_settings(cl: clusterfile.Cluster, local: list[int],
                           curve_keys: Any) -> dict[int, dict[str, str | None]]:
    """The CURVE settings of the replicas ``local`` that this process starts, for a cluster
    file that turns CURVE on (none otherwise): each replica's key pair file (``NAME.key_secret``
    next to its ``server_keys`` file) and the directory of the keys let in -- what
    ``zchannel broker --cluster FILE --replica I --curve-secret-key ...`` is given.  The
    creating handle is a client like any other: it needs its own key pair (``curve_keys=`` or
    ``$ZCHANNEL_CURVE_SECRET_KEY``).  ``ValueError`` naming the missing file."""
    if not cl.server_key_files:
        return {}
    if replica_client_keys(curve_keys, cl.replicas[0].server_key) is None:
        raise ValueError(f"{cl.source} turns CURVE on: the creating process needs a client key "
                         "pair too (curve_keys=(client .key_secret, replica .key) or "
                         "ZCHANNEL_CURVE_SECRET_KEY, e.g. the client.key_secret of "
                         "zchannel keygen --replicas)")
    settings = {}
    for i in local:
        secret = cl.secret_key_file(i)
        if secret is None or not os.path.isfile(secret):
            raise ValueError(f"{cl.source} turns CURVE on: replica {i} needs its key pair file "
                             f"{secret} on this host (zchannel keygen DIR --replicas N writes "
                             "it next to the public key)")
        settings[i] = {"curve_secret_key": secret, "curve_public_keys": cl.client_keys}
    return settings


def connect_from_cluster(name: str, *, identity: str | None, timeout: float,
                         shm: bool | None = None) -> DistributedChannel | None:
    """A handle of channel ``name`` from the cluster file of ``$ZCHANNEL_CLUSTER`` (``shm``:
    its replicas' handles' shared-memory switch); None if there is none or it does not serve
    the name.  ``ChannelNotFound`` if this node's replica does not answer within ``timeout``."""
    cl = clusterfile.load_found(name)
    if cl is None:
        return None
    handle = DistributedChannel(name, cl.table(), identity=identity, shm=shm, source=cl.source)
    check_table(handle, cl.source, connect_home(handle, timeout))
    return handle


def log_ignored_settings(handle: Any, config: dict[str, Any], maxsize: int | None = None,
                         hooks: dict[str, str | None] | None = None) -> None:
    """Log what of ``config`` (``create``'s arguments) the running channel ``handle`` is
    connected to ignores -- maxsize, hooks, declared consumers and producers, journal,
    lease_timeout -- for a ``create`` that attached to a channel running already.
    ``maxsize``: the running channel's (default: what its broker's hello said); ``hooks``: the
    given hooks' labels (default: those of ``config``'s hooks)."""
    if maxsize is None:
        try:
            maxsize = handle._connection().broker_info.maxsize
        except ChannelError:  # only what is logged depends on it
            return
    if hooks is None:
        hooks = {kind: hook_label(config.get(kind)) for kind in ("collector", "dispatcher")}
    if maxsize is not None and maxsize != config["maxsize"]:
        log.warning("channel %r already runs with maxsize=%s; maxsize=%s ignored",
                    config["name"], maxsize, config["maxsize"])
    if not (any(hooks.values()) or config.get("consumers") or config.get("producers")
            or config.get("journal") is not None
            or config.get("lease_timeout", DEFAULT_LEASE_TIMEOUT) != DEFAULT_LEASE_TIMEOUT):
        return  # nothing given that the hello did not already compare
    try:
        running = handle.stats()
    except ChannelError:
        return
    for field, theirs, given in _ignored(config, hooks, running):
        log.warning("channel %r already runs with %s=%s; %s=%s ignored", config["name"],
                    field, theirs, field, given)


def _ignored(config: dict[str, Any], hooks: dict[str, str | None],
             running: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(setting, the running channel's, the given)`` for each given setting of ``config``
    (hooks by their labels ``hooks``) that the running channel's ``stats()`` differs from."""
    declared = list(expand_consumers(config.get("consumers")))
    producers = list(config.get("producers") or ())
    journal = config.get("journal")
    lease_timeout = config.get("lease_timeout", DEFAULT_LEASE_TIMEOUT)
    differences: list[tuple[str, Any, Any]] = [
        (kind, running.get(kind), given) for kind, given in hooks.items()
        if given is not None and given != running.get(kind)]
    if any(c not in (running.get("consumers") or ()) for c in declared):
        differences.append(("consumers", running.get("consumers"), declared))
    if producers and producers != list(running.get("producers") or ()):
        differences.append(("producers", running.get("producers"), producers))
    running_journal = running.get("journal")
    if journal is not None and running_journal is None:
        differences.append(("journal", None, journal))
    elif journal is not None and running_journal is not None:  # directory and fsync policy
        for field, key in (("journal", "directory"), ("fsync", "fsync")):
            if running_journal.get(key) != config[field]:
                differences.append((field, running_journal.get(key), config[field]))
    if running.get("lease_timeout") not in (None, lease_timeout):
        differences.append(("lease_timeout", running.get("lease_timeout"), lease_timeout))
    return differences


__all__ = ["DistributedChannel", "ReplicaChannel", "connect_from_cluster", "create_from_cluster",
           "log_ignored_settings", "replica_curve_settings"]
