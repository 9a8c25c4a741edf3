"""``Channel``: the handle through which workers put and get items.

``Channel.create`` starts a broker process (``starting.py``), or attaches to the live one
serving the name; ``Channel.connect`` attaches to an existing broker by name or address.  Every
operation is a request to the broker over this process's connection to it (``connection.py``),
which all the handles of the process to that broker share (``sharing.py``); ``async_op=True``
returns a ``Work`` handle instead of waiting.  ``local=True`` gives an in-process channel with
the same API (``local.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from zchannel.broker import codec, paths, sharing
from zchannel.broker.checks import check_peek_count, check_target_weight
from zchannel.broker.connection import CLOSED, Connection
from zchannel.broker.core import check_key, check_timeout, check_weight
from zchannel.broker.errors import (
    BrokerStartError,
    BrokerUnavailable,
    ChannelError,
    ChannelNotFound,
)
from zchannel.broker.groups import expand_groups
from zchannel.broker.metrics import check_port
from zchannel.broker.protocol import (
    ACK,
    FULL,
    GET,
    GET_BATCH,
    INLINE_BODY,
    PEEK,
    PUT,
    QSIZE,
    SHUTDOWN,
    STATS,
)
from zchannel.broker.security import client_keys
from zchannel.broker.shm.client import client_submit as shm_submit
from zchannel.broker.shm.client import client_undo as shm_undo
from zchannel.broker.starting import START_TIMEOUT_S, hook_for_child, hook_label, spawn_broker
from zchannel.broker.work import Delivery, Work
from zchannel.hooks import Collector, Dispatcher, check_consumer_id

log = logging.getLogger("zchannel.client")

DEFAULT_KEY = "default_queue"
"""The key of operations that name none."""

_open_handles: weakref.WeakSet[Channel] = weakref.WeakSet()
# os.getpid() on every request is a system call; a forked child updates the cached value.
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


def _worker_identity(current_worker: Any) -> str | None:
    """The consumer id ``connect``'s ``current_worker`` stands for (see ``Channel.connect``)."""
    if current_worker is None or isinstance(current_worker, str):
        return current_worker
    identity = getattr(current_worker, "identity", None)
    if isinstance(identity, str):
        return identity
    group, rank = getattr(current_worker, "group_name", None), getattr(current_worker, "rank", None)
    if isinstance(group, str) and isinstance(rank, int) and not isinstance(rank, bool):
        return f"{group}:{rank}"
    raise TypeError(
        "current_worker is a consumer id 'group:rank', or an object with an identity str or "
        f"with group_name (str) and rank (int) attributes, not {type(current_worker).__name__}: "
        "zchannel has no Worker class, a handle acts for the consumer id it is given")


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")  # zchannel never imports ray unless the process did
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


def _identity(identity: str | None) -> str | None:
    if identity is None:
        identity = os.environ.get("ZCHANNEL_IDENTITY") or None
    return None if identity is None else check_consumer_id(identity)


class Channel:
    """A handle on a named channel: per-key FIFO queues served by one broker process.

    Make one with ``Channel.create`` (starts the broker, or attaches to the live broker of that
    name) or ``Channel.connect``; a handle may be pickled to other processes.  The behaviour of
    every operation is described in ``docs/channel.md``.

    ``created`` is True on the handle whose ``Channel.create`` started the broker, False on
    one that attached to a running broker, on ``connect`` handles and on unpickled copies.
    ``repr()``/``str()`` are cheap and never touch the network; ``peek`` shows items.
    """

    def __init__(self, name: str | None, address: str, *, identity: str | None = None,
                 curve_keys: Any = None, _proc: subprocess.Popen | None = None,
                 _token: str | None = None, shm: bool | None = None) -> None:
        self._name = name
        self._address = address
        self._explicit_identity = identity
        self._identity: str | None = None
        self._identity_read = False
        self._curve_keys = curve_keys
        self._proc = _proc
        self._token = _token
        self._creator_pid = os.getpid()
        self._share: sharing.Share | None = None  # of this process's connection to the broker
        self._conn_lock = threading.Lock()
        self._closed = False
        self._shm = shm  # same-host shared memory: None = on unless ZCHANNEL_SHM=0
        self.created = _proc is not None
        _open_handles.add(self)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        name: str,
        maxsize: int = 0,
        distributed: bool = False,
        node_rank: int | None = None,
        local: bool = False,
        *,
        address: str | None = None,
        collector: Any = None,
        dispatcher: Any = None,
        producers: Iterable[str] | None = None,
        consumers: Iterable[str] | Mapping[str, int] | None = None,
        options: Mapping[str, Any] | None = None,
        identity: str | None = None,
        curve_keys: Any = None,
        insecure: bool = False,
        lease_timeout: float = 30.0,
        shm_threshold: int | None = None,
        metrics_port: int | None = None,
    ) -> Channel:
        """Start a broker for ``name`` and return a connected handle (``created`` True); if a
        live broker already serves the name, attach to it (``created`` False, a warning on the
        ``zchannel.client`` logger names its pid, address and items held; its settings win and
        differing arguments are logged).

        The first five parameters keep RLinf's positional order (``name, maxsize,
        distributed, node_rank, local``); the rest are keyword-only.  Wrong arguments are
        ``ValueError``/``TypeError``, also those the starting broker finds (an unknown hook
        name); a broker that cannot start with valid arguments (busy address) is
        ``BrokerStartError`` (``docs/errors.md``).

        ``metrics_port``: the broker serves Prometheus metrics on ``127.0.0.1:metrics_port``
        (0 = any free port; ``stats()["metrics"]`` has the URL; needs ``zchannel[metrics]``).
        """
        paths.check_name(name)
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
            raise ValueError(f"maxsize must be an int >= 0, got {maxsize!r}")
        for flag, value in (("distributed", distributed), ("local", local)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r} (create's positional "
                                "order is name, maxsize, distributed, node_rank, local)")
        if node_rank is not None and (isinstance(node_rank, bool) or not isinstance(node_rank, int)
                                      or node_rank < 0):
            raise ValueError(f"node_rank must be None or an int >= 0, got {node_rank!r}")
        if identity is not None:
            check_consumer_id(identity)
        from zchannel.hooks import expand_consumers

        producers, consumers = expand_groups(producers, consumers)  # worker groups (groups.py)
        targets: list = []  # Ray placement: actor handles / node ids among producers, consumers
        if not local and (producers or consumers) and _ray_connected():
            from zchannel.broker.ray_placement import split_targets

            producers, consumers, targets = split_targets(producers, consumers)
        declared = list(expand_consumers(consumers))
        if producers is not None and isinstance(producers, str):
            raise TypeError("producers= takes a list of group names")
        if local and metrics_port is not None:
            raise ValueError("metrics_port needs a broker process (local=False)")
        if local:
            from zchannel.broker.local import LocalChannel

            return LocalChannel.create_local(
                name, maxsize, collector=collector, dispatcher=dispatcher,
                producers=list(producers or ()), consumers=declared, options=dict(options or {}),
                identity=identity, lease_timeout=lease_timeout,
            )
        address = address or paths.default_address(name)
        server_keys = dict(curve_keys) if isinstance(curve_keys, Mapping) else {}
        paths.check_bind_address(address, secure=bool(server_keys.get("server_secret_key")),
                                 insecure=insecure)
        imports: list[str] = []
        config = {
            "name": name, "address": address, "maxsize": maxsize,
            "collector": hook_for_child(collector, imports, Collector),
            "dispatcher": hook_for_child(dispatcher, imports, Dispatcher),
            "producers": list(producers or ()), "consumers": declared,
            "options": dict(options or {}), "lease_timeout": float(lease_timeout),
            "insecure": bool(insecure), "imports": sorted(set(imports)),
            "curve_secret_key": server_keys.get("server_secret_key"),
            "curve_public_keys": server_keys.get("public_keys"),
        }
        if shm_threshold is not None:  # same-host shared memory (docs/shm.md); 0 = off
            config["shm_threshold"] = shm_threshold
        if metrics_port is not None:
            config["metrics_port"] = check_port(metrics_port)
        codec.encode(config)  # options must be msgpack-able: fail here, not in the child
        # cluster file / Ray (distributed.py); on Ray every channel is Ray-placed, by default on
        # the first producer's node, else the first consumer's, else the creator's
        if distributed or node_rank is not None or targets or _ray_connected():
            from zchannel.broker import distributed as _dist

            placed = _dist.create(config, distributed=distributed, node_rank=node_rank,
                                  targets=targets, identity=identity, curve_keys=curve_keys)
            if placed is not None:
                return placed
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            lock_fd = paths.try_lock(name)
            if lock_fd is not None:
                break
            existing = paths.read_address(name)
            if existing:
                try:
                    handle = cls.connect(existing, identity=identity, timeout=2.0,
                                         curve_keys=curve_keys)
                except BrokerUnavailable:
                    handle = None
                if handle is not None:
                    handle._name = name
                    handle._log_attached()
                    handle._warn_differences(config)
                    return handle
            if time.monotonic() > deadline:
                raise BrokerStartError(f"channel {name!r} is locked but no broker answers")
            time.sleep(0.05)  # another process is starting the broker
        try:
            proc, real_address, token = spawn_broker(config, lock_fd)
        except BaseException:
            paths.release_lock(name, lock_fd)  # no broker took it over: no lock file stays
            raise
        os.close(lock_fd)  # the broker holds it now, and removes the file when it exits
        handle = cls(name, real_address, identity=identity, curve_keys=curve_keys,
                     _proc=proc, _token=token)
        try:
            handle._connection(timeout=START_TIMEOUT_S)
        except BaseException:
            handle._kill_broker()
            raise
        return handle

    @classmethod
    def connect(cls, name_or_address: str, current_worker: Any = None, *,
                identity: str | None = None, timeout: float = 10.0, curve_keys: Any = None,
                shm: bool | None = None) -> Channel:
        """Attach to a running broker by channel name or ``ipc://``/``tcp://`` address.

        ``current_worker`` (RLinf's second positional argument) names the consumer this handle
        acts for and becomes its ``identity``: a ``"group:rank"`` str, or an object with an
        ``identity`` str or with ``group_name`` and ``rank`` attributes (zchannel has no Worker
        class).  None keeps ``identity=``, else ``ZCHANNEL_IDENTITY``.
        ``shm=False`` keeps this handle off the same-host shared-memory path (default: on when
        the broker offers it, unless ``ZCHANNEL_SHM=0``; see ``docs/shm.md``).
        Raises ``ChannelNotFound`` (quickly when nothing can be listening) if no broker answers.
        """
        worker_identity = _worker_identity(current_worker)
        if worker_identity is not None:
            if identity is not None and identity != worker_identity:
                raise ValueError(f"current_worker stands for {worker_identity!r} but "
                                 f"identity={identity!r}: give one of them")
            identity = worker_identity
        if identity is not None:
            check_consumer_id(identity)
        if paths.is_address(name_or_address):
            name, address = None, name_or_address
        else:
            name = paths.check_name(name_or_address)
            from zchannel.broker.local import LocalChannel

            local = LocalChannel.lookup(name)
            if local is not None:
                return local.new_handle(identity)
            address = paths.read_address(name)
            if address is None:  # a distributed channel: cluster file or Ray (distributed.py)
                from zchannel.broker.distributed import connect_by_name

                found = connect_by_name(name, identity=identity, timeout=timeout)
                if found is not None:
                    return found
                raise ChannelNotFound(f"no channel named {name!r} on this host")
        keys = client_keys(curve_keys)
        if keys is not None:
            keys.load()  # a key file that does not hold its key: ValueError naming it, first
        paths.probe(address)
        handle = cls(name, address, identity=identity, curve_keys=curve_keys, shm=shm)
        handle._connection(timeout=timeout)
        if "replicas" in handle._conn.broker_info:  # a replica: route per key (distributed.py)
            from zchannel.broker.distributed import DistributedChannel

            return DistributedChannel.from_handle(handle)
        return handle

    def _log_attached(self) -> None:
        """The warning of a ``create`` that attached to a running broker instead of starting
        one (``created`` is False)."""
        try:
            stats = self.stats()
        except ChannelError:
            stats = {}
        held = sum(k.get("depth", 0) for k in (stats.get("keys") or {}).values())
        log.warning("channel %r: attached to the broker already serving it (pid %s at %s, "
                    "%d items held) instead of starting one; its settings win, and shutdown() "
                    "is left to its creator", self._name, stats.get("pid", os.getpid()),
                    stats.get("address") or self._address, held)

    def _warn_differences(self, config: dict) -> None:
        info = self._connection().broker_info
        if info.get("maxsize") is not None and info.get("maxsize") != config["maxsize"]:
            log.warning("channel %r already runs with maxsize=%s; maxsize=%s ignored",
                        config["name"], info.get("maxsize"), config["maxsize"])
        if config["collector"] is None and config["dispatcher"] is None:
            return
        try:
            running = self.stats()
        except ChannelError:
            return
        for kind in ("collector", "dispatcher"):
            given = hook_label(config[kind])
            if given is not None and given != running.get(kind):
                log.warning("channel %r already runs with %s=%s; %s=%s ignored", config["name"],
                            kind, running.get(kind), kind, given)

    # -- connection --------------------------------------------------------------------------

    def _connection(self, timeout: float = 10.0) -> Connection:
        return self._acquired(timeout).conn

    @property
    def _conn(self) -> Connection | None:
        """The connection this handle uses (None before its first use and after ``close``)."""
        share = self._share
        return None if share is None else share.conn

    def _acquired(self, timeout: float = 10.0) -> sharing.Share:
        """This handle's share of the process's connection to its broker, taken at first use
        (and again in a forked child, or after the connection ended)."""
        share = self._share
        if share is not None and share.conn.pid == _pid[0] and share.conn.state != CLOSED:
            return share
        if self._closed:
            raise ChannelError("this channel handle is closed")
        with self._conn_lock:
            share = self._share
            if share is not None:
                if share.conn.pid == os.getpid() and share.conn.state != CLOSED:
                    return share
                self._share = None  # a forked child's copy, or a connection that ended
                share.close(settle_puts=False, withdraw=False, bye=False)
            if self._closed:
                raise ChannelError("this channel handle is closed")
            share = sharing.acquire(self._address, self.identity, client_keys(self._curve_keys),
                                    self._shm)
            if not share.conn.wait_up(timeout):
                share.close(settle_puts=False, withdraw=False)
                if share.conn.refused is not None:  # a CURVE mismatch (AuthenticationFailed)
                    raise share.conn.refused
                raise ChannelNotFound(f"no broker answered at {self._address} within {timeout}s")
            if self._name is None:
                self._name = share.conn.broker_info.get("name")
            self._share = share
            return share

    def _give_back(self, settle_puts: bool = True, withdraw: bool = True, bye: bool = True) -> None:
        """Give this handle's share of the connection back (``sharing.Share.close``)."""
        with self._conn_lock:
            share, self._share = self._share, None
        if share is not None:
            share.close(settle_puts=settle_puts, withdraw=withdraw, bye=bye)

    @property
    def name(self) -> str | None:
        """The channel's name (for a handle connected by address: the name its broker reports)."""
        return self._name

    @property
    def address(self) -> str:
        """The broker's real address (``ipc://…`` or ``tcp://HOST:PORT``)."""
        return self._address

    @property
    def is_local(self) -> bool:
        """True for an in-process channel (``local=True``), False for one served by brokers."""
        return False

    @property
    def identity(self) -> str | None:
        """This handle's consumer id: ``identity=``, else ``ZCHANNEL_IDENTITY`` at first use."""
        if not self._identity_read:
            self._identity = _identity(self._explicit_identity)
            self._identity_read = True
        return self._identity

    # -- requests ----------------------------------------------------------------------------

    def _submit(self, rec: dict, item: Any = None, *, has_item: bool = False,
                copy: bool | None = None, wait: bool = False) -> Work:
        share = self._acquired()
        conn = share.conn
        frames: list = []
        if has_item:
            body, buffers, refs = shm_submit(conn, item, rec)  # refs: shm slots or None
            if not buffers and not refs and len(body) <= INLINE_BODY:
                rec["b"] = body  # a small item rides in its record (no frame)
                sizes = [len(body)]
            elif buffers:
                frames = [body, *buffers]
                rec["fs"] = sizes = [len(body), *(memoryview(b).nbytes for b in buffers)]
            else:
                frames = [body]
                rec["fs"] = sizes = [len(body)]
            if refs:
                rec["sm"] = refs
            limit = conn.broker_info.get("max_message_bytes")
            if limit and sum(sizes) > limit:
                shm_undo(conn, refs)
                raise ValueError(f"item of {sum(sizes)} bytes exceeds the broker's "
                                 f"max_message_bytes limit ({limit})")
        op = rec["op"]
        convert = None
        if op == GET or op == GET_BATCH:
            convert = conn.converters.get((op, copy))
            if convert is None:  # one per connection, op and copy (not a closure per call)
                make = _get_converter if op == GET else _batch_converter
                convert = conn.converters[(op, copy)] = make(copy, conn.shm)
        elif op == STATS:
            convert = _stats_converter
        elif op == PEEK:
            convert = _peek_converter(conn.shm)
        send = conn.call if wait else conn.request
        try:
            return send(rec, frames, convert, cancellable=op in (PUT, GET, GET_BATCH),
                        owner=share)
        except BaseException:
            shm_undo(conn, rec.get("sm"))  # not sent: its slots go back to the pool
            raise

    def put(self, item: Any, weight: int | float = 0, key: Any = DEFAULT_KEY,
            async_op: bool = False, timeout: float | None = None) -> Work | None:
        """Enqueue ``item`` under ``key``; blocks while a target queue is full.

        ``weight``: an int or finite float >= 0 (``ValueError`` otherwise); it never changes
        order.  ``key``: a str, int, bytes or tuple of those (``TypeError`` otherwise).

        Raises ``TimeoutError`` if not admitted by ``timeout``, ``TypeError`` for an item that
        cannot travel, ``HookError`` if a hook fails, ``BrokerUnavailable`` if the broker is gone.
        """
        rec = {"op": PUT, "k": check_key(key), "w": check_weight(weight)}
        if timeout is not None:  # the broker's default: no timeout
            rec["t"] = check_timeout(timeout)
        work = self._submit(rec, item, has_item=True, wait=not async_op)
        return work if async_op else work.wait()

    def put_nowait(self, item: Any, weight: int | float = 0, key: Any = DEFAULT_KEY) -> None:
        """Enqueue without waiting; ``QueueFull`` (nothing enqueued) if a target is full: it
        subclasses both ``asyncio.QueueFull`` and ``queue.Full``."""
        rec = {"op": PUT, "k": check_key(key), "w": check_weight(weight), "nw": True}
        self._submit(rec, item, has_item=True, wait=True).wait()

    def get(self, key: Any = DEFAULT_KEY, async_op: bool = False, timeout: float | None = None,
            *, ack: bool = False, copy: bool | None = None) -> Any:
        """Remove and return the head of this consumer's queue for ``key`` (private, then shared,
        then a steal), waiting while there is none.  ``ack=True`` returns a ``Delivery``."""
        rec = {"op": GET, "k": check_key(key)}
        if timeout is not None:  # the broker's defaults: no timeout, no ack
            rec["t"] = check_timeout(timeout)
        if ack:
            rec["ack"] = True
        work = self._submit(rec, copy=copy, wait=not async_op)
        return work if async_op else work.wait()

    def get_nowait(self, key: Any = DEFAULT_KEY, *, ack: bool = False, copy: bool | None = None) -> Any:
        """Like ``get`` without waiting; ``QueueEmpty`` when nothing is available: it subclasses
        both ``asyncio.QueueEmpty`` and ``queue.Empty``."""
        rec = {"op": GET, "k": check_key(key), "nw": True, "ack": bool(ack)}
        return self._submit(rec, copy=copy, wait=True).wait()

    def get_batch(self, target_weight: int | float, key: Any = DEFAULT_KEY,
                  async_op: bool = False, timeout: float | None = None, *,
                  copy: bool | None = None) -> list | Work:
        """Take head items whose weights add up to at most ``target_weight`` (an int or finite
        float > 0, required), plus weight-0 items right behind; never returns ``[]``: a head
        heavier than the target comes alone (``docs/guarantees.md``).  Float sums within a
        relative 1e-9 of the target count as reaching it (0.1 + 0.2 meets 0.3)."""
        rec = {"op": GET_BATCH, "k": check_key(key), "tw": check_target_weight(target_weight),
               "t": check_timeout(timeout)}
        work = self._submit(rec, copy=copy, wait=not async_op)
        return work if async_op else work.wait()

    def qsize(self, key: Any = DEFAULT_KEY, consumer: str | None = None) -> int:
        """Items queued under ``key``: the shared queue plus every private queue, or plus only
        ``consumer``'s private queue; 0 for an unknown key."""
        rec = {"op": QSIZE, "k": check_key(key), "c": consumer}
        return self._submit(rec, wait=True).wait()

    def empty(self, key: Any = DEFAULT_KEY) -> bool:
        """``qsize(key) == 0``."""
        return self.qsize(key) == 0

    def full(self, key: Any = DEFAULT_KEY, consumer: str | None = None) -> bool:
        """Whether the shared queue of ``key`` (or ``consumer``'s private queue) holds ``maxsize``
        items; never with ``maxsize=0``."""
        rec = {"op": FULL, "k": check_key(key), "c": consumer}
        return self._submit(rec, wait=True).wait()

    def peek(self, key: Any = DEFAULT_KEY, n: int = 1, *, consumer: str | None = None,
             weights: bool = False) -> list:
        """Copies of up to ``n`` (1..1024) items at the head of ``key``'s queue, head first,
        which stay queued: nothing is removed, reordered or leased, and changing a copy
        changes nothing in the channel.  ``[]`` for an empty or unknown key.

        Without ``consumer`` it shows the shared queue; with a consumer id, what that
        consumer's gets would take next (its private queue, then the shared one).
        ``weights=True`` gives ``(item, weight)`` pairs.  For debugging: RLinf's
        ``str(channel)`` listed the default queue, zchannel's ``str()`` never touches the
        network.
        """
        rec = {"op": PEEK, "k": check_key(key), "n": check_peek_count(n)}
        if consumer is not None:
            rec["c"] = check_consumer_id(consumer)
        pairs = self._submit(rec, copy=True, wait=True).wait()
        return [tuple(p) for p in pairs] if weights else [item for item, _ in pairs]

    def stats(self, *, exclude_self: bool = False) -> dict:
        """The broker's state (keys, consumers, counters; ``docs/guarantees.md``).
        ``exclude_self=True`` leaves this handle out of ``clients`` (what ``zchannel stat``
        does, so that an observer does not count itself)."""
        rec: dict[str, Any] = {"op": STATS}
        if exclude_self:
            rec["xs"] = True
        return self._submit(rec, wait=True).wait()

    def reserve_shm(self, nbytes: int, slots: int) -> int:
        """Preallocate shared memory for puts of arrays/tensors of ``nbytes`` bytes: make the
        pool of this handle's connection (shared by the process's handles to the broker) hold
        ``slots`` slots of that size now, so that the first puts do not pay for creating and
        faulting in segments (docs/shm.md).  Returns the slots held (capped by the pool's
        limits); 0 when this handle has no shared memory with its broker (another host,
        ``shm=False``, ``shm_threshold=0``, or ``nbytes`` below the threshold).  Kept for the
        connection's life: a reconnect to a restarted broker reserves again.  ``ValueError``
        for ``nbytes`` or ``slots`` not an int > 0."""
        return self._connection().shm.reserve(nbytes, slots)

    def empty_shm(self, shape: Any, dtype: Any = np.float32) -> Any:
        """An uninitialised array of ``shape`` and ``dtype`` (a numpy dtype; a torch dtype
        gives a CPU tensor) for a producer to build an item in, placed in a free shared-memory
        slot of this handle's connection: put it (alone or inside an item) and the slot itself
        is sent, with no copy into shared memory (docs/shm.md, "Writing in place").

        Without a slot (another host, ``shm=False``, ``shm_threshold=0``, below the threshold,
        a local channel, or no slot free within the heartbeat expiry) it is a plain
        ``numpy.empty`` / ``torch.empty``, which a put sends the usual way: safe to call
        anywhere.  The slot stays with the array while it, or anything made from it, exists.
        Do not write to it after the put (its consumer reads that memory): make a new one for
        the next item.  Only the first put of it sends the slot; a later put copies, as for any
        array.  ``TypeError`` for a dtype that is neither numpy's nor torch's or a shape that
        is not ints, ``ValueError`` for a negative dimension."""
        return self._connection().shm.empty(shape, dtype)

    def ack(self, delivery: Delivery) -> None:
        """Confirm a delivery received with ``get(..., ack=True)``."""
        if not isinstance(delivery, Delivery):
            raise TypeError("ack() takes the Delivery returned by get(..., ack=True)")
        self._submit({"op": ACK, "lease": delivery.lease_id}, wait=True).wait()

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait (at most the heartbeat expiry) for this handle's put acknowledgements, withdraw
        its parked requests, and give back its share of the process's connection to the broker,
        which closes with the last handle using it (``docs/decisions.md``).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._give_back()

    def shutdown(self) -> None:
        """Stop the broker.  Only the handle whose ``create`` started it may
        (``PermissionError`` otherwise)."""
        if self._proc is None or self._creator_pid != os.getpid():
            raise PermissionError("only the handle that created the channel's broker may shut it down")
        proc = self._proc
        try:
            if proc.poll() is None and not self._closed:
                share = self._acquired()  # past the in-flight limit: parked gets must not hold it
                share.conn.request({"op": SHUTDOWN, "token": self._token}, [], room=False,
                                   owner=share).wait(timeout=5.0)
        except (ChannelError, TimeoutError):
            pass
        self._closed = True
        self._give_back(settle_puts=False, withdraw=False, bye=False)  # the broker stops
        try:
            proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self._kill_broker()
        self._proc = None

    def _kill_broker(self) -> None:
        """Stop the broker this handle started: SIGTERM (it removes its files), then SIGKILL
        if it has not exited within 5 s (by PID)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10.0)

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._proc is not None and self._creator_pid == os.getpid():
            self.shutdown()
        else:
            self.close()

    def __reduce__(self) -> Any:
        return (_unpickle, (self._name, self._address, self._explicit_identity, self._curve_keys))

    def __repr__(self) -> str:
        # cheap and local on purpose: no request (RLinf's str() fetched items; see peek())
        state = ", closed" if self._closed else ""
        return (f"{type(self).__name__}(name={self._name!r}, address={self._address!r}, "
                f"identity={self._explicit_identity!r}, created={self.created}{state})")


def _unpickle(name: str | None, address: str, identity: str | None, curve_keys: Any) -> Channel:
    return Channel(name, address, identity=identity, curve_keys=curve_keys)


# -- reply conversion (runs in the waiting thread, not the I/O thread) ------------------------


def _get_converter(copy: bool | None, shm: Any = None):
    def convert(rec: dict, frames: list) -> Any:
        sm = rec.get("sm")  # shared-memory slots of the item (broker/shm.py)
        if sm and sm[0]:
            item = shm.decode(sm[0], frames, copy)
        elif "b" in rec:  # a small item inside its record
            body = rec["b"]
            if type(body) is not bytes or frames:
                raise ValueError("malformed reply: an inline item is bytes, with no frames")
            item = codec.decode(body)
        else:
            item = codec.decode_frames(frames, copy)
        lease = rec.get("lease")
        return Delivery(item, lease) if lease is not None else item

    return convert


def _batch_converter(copy: bool | None, shm: Any = None):
    def convert(rec: dict, frames: list) -> list:
        out, pos = [], 0
        sm = rec.get("sm") or ()  # shared-memory slots per item (broker/shm.py)
        for i, n in enumerate(rec.get("n") or ()):
            if i < len(sm) and sm[i]:
                out.append(shm.decode(sm[i], frames[pos : pos + n], copy))
            else:
                out.append(codec.decode_frames(frames[pos : pos + n], copy))
            pos += n
        return out

    return convert


def _peek_converter(shm: Any = None):
    batch = _batch_converter(True, shm)  # copies: nothing the caller holds points into a slot

    def convert(rec: dict, frames: list) -> list:
        items = batch(rec, frames)
        weights = rec.get("ws") or ()
        if len(weights) != len(items):
            raise ValueError("malformed peek reply: one weight per item")
        return list(zip(items, weights, strict=True))

    return convert


def _stats_converter(rec: dict, frames: list) -> dict:
    return codec.decode_frames(frames, True)


@atexit.register
def _close_all() -> None:
    """At interpreter exit: stop the brokers this process started, then every connection of
    the process, in order (``sharing.close_all``); nothing is left running or open."""
    for handle in list(_open_handles):
        try:
            if handle._proc is not None and handle._creator_pid == os.getpid():
                handle.shutdown()
        except Exception:
            pass
    sharing.close_all()
