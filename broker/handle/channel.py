"""``Channel``, the public handle type, and the factory that chooses what serves a channel.

``Channel.create`` and ``Channel.connect`` pick one of:

- an in-process channel (``local=True``): ``LocalChannel`` (``handle/local.py``);
- one broker process: ``Channel`` itself (its operations are ``BrokerChannel``'s, ``handle/broker_channel.py``;
  ``create`` starts the broker with ``server/starting.py`` or attaches to the live one of that name);
- broker replicas: ``DistributedChannel`` (``handle/distributed.py``), from a cluster file, or placed by
  Ray (``handle/ray_placement.py``) when the process is connected to Ray.

This module sits above all of them, so they never import it: ``LocalChannel`` and
``DistributedChannel`` subclass ``BrokerChannel`` and are registered here as virtual subclasses
of ``Channel``, so that every handle the factory returns is a ``Channel`` to ``isinstance``.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABCMeta
from collections.abc import Iterable, Mapping
from typing import Any, cast

from zchannel.broker.cluster import clusterfile
from zchannel.broker.core.hookpipeline import registered_name
from zchannel.broker.errors import (
    BrokerStartError,
    BrokerUnavailable,
    ChannelNotFound,
)
from zchannel.broker.handle import ray_placement
from zchannel.broker.handle.broker_channel import BrokerChannel
from zchannel.broker.handle.distributed import (
    DistributedChannel,
    connect_from_cluster,
    create_from_cluster,
    log_ignored_settings,
)
from zchannel.broker.handle.keeper import BrokerKeeper
from zchannel.broker.handle.local import LocalChannel
from zchannel.broker.handle.workergroups import expand_groups
from zchannel.broker.host import paths
from zchannel.broker.server.config import DEFAULT_LEASE_TIMEOUT, FSYNC_POLICIES, BrokerConfig
from zchannel.broker.server.metrics import check_port, require_prometheus
from zchannel.broker.server.starting import (
    START_TIMEOUT_S,
    hook_for_child,
    hook_label,
    spawn_broker,
)
from zchannel.broker.shm.client import check_shm_switch
from zchannel.broker.transport.curve import client_keys
from zchannel.broker.wire import codec
from zchannel.broker.wire.argchecks import check_timeout, shown
from zchannel.broker.wire.classtags import registrations
from zchannel.broker.wire.limits import check_settings
from zchannel.broker.wire.protocol import UNSET
from zchannel.hooks import Collector, Dispatcher, check_consumer_id, expand_consumers
from zchannel.hooks.base import check_groups

log = logging.getLogger("zchannel.client")


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
    worker_name = getattr(current_worker, "worker_name", None)  # zchannel.embodied.groups.Worker
    if isinstance(worker_name, str):
        return worker_name
    raise TypeError(
        "current_worker is a consumer id 'group:rank', or an object with an identity str, with "
        "group_name (str) and rank (int) attributes or with a worker_name str ('group:rank', "
        f"as zchannel.embodied.groups.Worker), not {type(current_worker).__name__}")


def _check_connect_timeout(timeout: Any) -> None:
    """``connect``'s timeout: a finite number of seconds >= 0 — not None, as elsewhere, because
    a connect that finds no broker must end."""
    try:
        if timeout is not None and check_timeout(timeout) is not None:
            return
    except ValueError:
        pass
    raise ValueError("connect needs a timeout: a finite number of seconds >= 0 (not None, a "
                     f"bool, NaN or infinite), got {shown(timeout)}")


def _connect_target(name_or_address: str | None, name: str | None) -> str:
    """What ``connect`` attaches to: ``name_or_address``, or RLinf's keyword ``name=``."""
    if name is not None:
        if name_or_address is not None and name_or_address != name:
            raise TypeError("give the channel as name_or_address or as name=, not both")
        return name
    if name_or_address is None:
        raise TypeError("connect() needs the channel's name or address")
    return name_or_address


def _as_channel(handle: BrokerChannel) -> Channel:
    """``handle`` as the ``Channel`` it is: ``LocalChannel`` and ``DistributedChannel`` are
    registered as virtual subclasses of ``Channel`` (below), which a type checker cannot see."""
    return cast(Channel, handle)


def _checked_create_args(
    name: str, maxsize: Any, distributed: Any, node_rank: Any, local: Any,
    identity: str | None, producers: Iterable[str] | None,
    consumers: Iterable[str] | Mapping[str, int] | None, metrics_port: int | None,
    journal: Any, settings: dict[str, Any],
) -> tuple[Any, list[str], list[Any]]:
    """``create``'s arguments checked (``ValueError``/``TypeError`` naming the first wrong
    one; ``settings``: the numeric ones, by their broker setting's range, local or not): the
    producers, the declared consumer ids, and on Ray the placement targets among them (actor
    handles, node ids)."""
    paths.check_name(name)
    check_settings({"maxsize": maxsize, **settings})
    for flag, value in (("distributed", distributed), ("local", local)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {value!r} (create's positional "
                            "order is name, maxsize, distributed, node_rank, local)")
    if node_rank is not None and (isinstance(node_rank, bool) or not isinstance(node_rank, int)
                                  or node_rank < 0):
        raise ValueError(f"node_rank must be None or an int >= 0, got {node_rank!r}")
    if identity is not None:
        check_consumer_id(identity)
    producers, consumers = expand_groups(producers, consumers)  # worker groups (groups.py)
    targets: list[Any] = []  # Ray placement: actor handles / node ids among producers, consumers
    if not local and (producers or consumers) and clusterfile.ray_connected():
        producers, consumers, targets = ray_placement.split_targets(producers, consumers)
    declared = list(expand_consumers(consumers))
    if producers is not None:
        producers = check_groups(producers)
    if local and metrics_port is not None:
        raise ValueError("metrics_port needs a broker process (local=False)")
    if local and journal is not None:
        raise ValueError("a journal needs a broker process (local=False)")
    return producers, declared, targets


def _checked_options(options: Any) -> dict[str, Any]:
    """``create``'s ``options`` (settings for the channel's hooks) as a new dict: None, or a
    mapping of str keys to values a broker can receive (msgpack-able, as items are)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict of hook settings (str keys), got "
                        f"{type(options).__name__} {options!r:.80}")
    checked = dict(options)
    for key in checked:
        if not isinstance(key, str):
            raise TypeError(f"options keys must be str, got {type(key).__name__} {key!r:.80}")
    try:
        codec.encode(checked)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"options cannot be sent to the broker: {exc}") from exc
    return checked


def _journal_settings(journal: Any, fsync: Any, fsync_interval: Any, max_journal_bytes: Any,
                      local: bool) -> dict[str, Any]:
    """The journal's entries of a broker's configuration (none without ``journal``; the fsync
    settings not given take their defaults).  ``ValueError`` for an ``fsync`` that is no
    policy, and for fsync settings given without ``journal`` (they would do nothing: the
    channel would not be durable; a ``local`` one cannot be); ``TypeError``/``ValueError``
    for a ``journal`` that is no directory path.  The numbers' ranges are checked with the
    other settings."""
    if fsync is not None and fsync not in FSYNC_POLICIES:
        raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
    given = {"fsync": fsync, "fsync_interval": fsync_interval,
             "max_journal_bytes": max_journal_bytes}
    if journal is None:
        named = [setting for setting, value in given.items() if value is not None]
        if named:
            raise ValueError(
                f"{', '.join(named)} set(s) the journal of a durable channel: " + (
                    "a local channel has none (a journal needs a broker process: local=False, "
                    "and journal=DIR)" if local else
                    "give journal=DIR too (without a journal the channel is not durable, and "
                    "they would do nothing)"))
        return {}
    if fsync_interval is not None and (fsync or BrokerConfig.fsync) != "interval":
        raise ValueError(f"fsync_interval sets how often the journal syncs under "
                         f"fsync='interval': with fsync={fsync!r} it would do nothing")
    where = os.fspath(journal) if isinstance(journal, (str, os.PathLike)) else None
    if not isinstance(where, str):
        raise TypeError(f"journal must be a directory path (a str or an os.PathLike of "
                        f"one), got {journal!r}")
    if not where or "\0" in where:
        raise ValueError(f"journal must be a directory path (not empty, no NUL "
                         f"character), got {where!r}")
    defaults = {"fsync": BrokerConfig.fsync, "fsync_interval": BrokerConfig.fsync_interval,
                "max_journal_bytes": BrokerConfig.max_journal_bytes}
    return {"journal": os.path.abspath(os.path.expanduser(where)),
            **{setting: defaults[setting] if value is None else value
               for setting, value in given.items()}}


def _broker_config(name: str, maxsize: int, address: str | None, *, collector: Any,
                   dispatcher: Any, producers: Any, consumers: list[str],
                   options: Mapping[str, Any] | None, curve_keys: Any, insecure: bool,
                   lease_timeout: float, shm_threshold: int | None, metrics_port: int | None,
                   journal_settings: dict[str, Any], heartbeats: dict[str, Any]) -> dict[str, Any]:
    """The configuration a broker process starts with (checked: the bind address against
    ``insecure``, the hooks importable by the child, the options msgpack-able).  ``address``
    None: chosen where each broker starts (on Ray, on its node: nothing of this host's run
    directory is used); ``journal_settings``: ``_journal_settings``'s; ``heartbeats``: the
    ``heartbeat_interval`` and ``liveness`` given (the broker's defaults for the others)."""
    server_keys = dict(curve_keys) if isinstance(curve_keys, Mapping) else {}
    if address is not None:
        paths.check_bind_address(
            address, secure=bool(server_keys.get("server_secret_key")
                                 and server_keys.get("public_keys")),
            insecure=insecure)
    imports: list[str] = []
    config = {
        "name": name, "address": address, "maxsize": maxsize,
        "collector": hook_for_child(collector, imports, Collector),
        "dispatcher": hook_for_child(dispatcher, imports, Dispatcher),
        "producers": list(producers or ()), "consumers": consumers,
        "options": dict(options or {}), "lease_timeout": float(lease_timeout),
        "insecure": bool(insecure), "imports": sorted(set(imports)),
        "curve_secret_key": server_keys.get("server_secret_key"),
        "curve_public_keys": server_keys.get("public_keys"),
    }
    if collector is not None or dispatcher is not None:  # the broker may decode items
        config["types"] = registrations()
    if shm_threshold is not None:  # same-host shared memory (docs/shm.md); 0 = off
        config["shm_threshold"] = shm_threshold
    if metrics_port is not None:
        config["metrics_port"] = check_port(metrics_port)
        require_prometheus("metrics_port")  # before a broker starts (it would refuse to)
    config.update(journal_settings)  # a durable channel (docs/durability.md)
    config.update(heartbeats)
    BrokerConfig(**config)  # wrong values fail here, not in the broker
    codec.encode(config)  # options must be msgpack-able: fail here, not in the child
    return config


def _create_local(name: str, maxsize: int, *, collector: Any, dispatcher: Any,
                  producers: Any, consumers: list[str], options: dict[str, Any],
                  identity: str | None, lease_timeout: float) -> Channel:
    """``Channel.create(..., local=True)`` with its arguments checked: the in-process channel
    ``name`` (made now, or attached to, logging what of the arguments it ignores)."""
    if LocalChannel.lookup(name) is None and _broker_serves(name):
        raise ValueError(f"a broker on this host serves channel {name!r}: one name is one "
                         "channel (Channel.create or Channel.connect reaches it; give a "
                         "local channel another name)")
    local_handle = LocalChannel.create_local(
        name, maxsize, collector=collector, dispatcher=dispatcher,
        producers=list(producers or ()), consumers=consumers, options=dict(options or {}),
        identity=identity, lease_timeout=lease_timeout,
    )
    if not local_handle.created:  # attached: what it ignores is logged, as a broker's
        log_ignored_settings(
            local_handle, {"name": name, "maxsize": maxsize, "consumers": consumers,
                           "producers": producers, "lease_timeout": lease_timeout},
            local_handle._broker.core.queues.maxsize,
            {"collector": _local_hook_label(collector),
             "dispatcher": _local_hook_label(dispatcher)})
    return _as_channel(local_handle)


def _local_hook_label(spec: Any) -> str | None:
    """A hook given to a local ``create`` (a name, a class or an instance), named as the
    channel's ``stats()`` names it."""
    if spec is None or isinstance(spec, str):
        return hook_label(spec)
    cls = spec if isinstance(spec, type) else type(spec)
    return registered_name(cls) or f"{cls.__module__}:{cls.__qualname__}"


class Channel(BrokerChannel, metaclass=ABCMeta):
    """A handle on a named channel: per-key FIFO queues served by a broker process (or by
    broker replicas, or in this process with ``local=True``).

    Make one with ``Channel.create`` (starts the broker, or attaches to the live broker of that
    name) or ``Channel.connect``; a handle may be pickled to other processes.  The behaviour of
    every operation is described in ``docs/channel.md``.

    ``created`` is True on the handle whose ``Channel.create`` started the broker, False on
    one that attached to a running broker, on ``connect`` handles and on unpickled copies.
    ``repr()``/``str()`` are cheap and never touch the network; ``peek`` shows items.
    """

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
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
        shm_threshold: int | None = None,
        heartbeat_interval: float | None = None,
        liveness: int | None = None,
        metrics_port: int | None = None,
        journal: str | os.PathLike[str] | None = None,
        fsync: str | None = None,
        fsync_interval: float | None = None,
        max_journal_bytes: int | None = None,
    ) -> Channel:
        """Start a broker for ``name`` and return a connected handle (``created`` True); if a
        live broker already serves the name, attach to it (``created`` False, a warning on the
        ``zchannel.client`` logger names its pid, address and items held; its settings win and
        differing arguments are logged).  ``local=True`` makes an in-process channel instead;
        ``distributed=True`` a broker replica per node (of the cluster file, or of the Ray
        cluster when the process is connected to Ray, where every channel is placed by Ray:
        ``docs/distributed.md``).

        The first five parameters keep RLinf's positional order (``name, maxsize,
        distributed, node_rank, local``); the rest are keyword-only.  Wrong arguments are
        ``ValueError``/``TypeError``, also those the starting broker finds (an unknown hook
        name); a broker that cannot start with valid arguments (busy address) is
        ``BrokerStartError`` (``docs/errors.md``).

        ``heartbeat_interval`` (seconds; default 1.0) and ``liveness`` (default 3): the broker's
        heartbeats, which its clients take from its hello reply; a peer silent for
        ``heartbeat_interval × liveness`` is taken for gone (docs/channel.md, "Heartbeats").
        Raise them for a broker whose hooks work long in one turn.  A local channel has no
        heartbeats: either is a ``ValueError`` with ``local=True``.

        ``metrics_port``: the broker serves Prometheus metrics on ``127.0.0.1:metrics_port``
        (0 = any free port; ``stats()["metrics"]`` has the URL; needs ``zchannel[metrics]``).

        ``journal``: a directory; the channel is durable (``docs/durability.md``): its broker
        records every put and removal there and, started again on it, serves what was not
        taken.  ``fsync`` says when a record is on disk: ``"always"`` (before the reply),
        ``"interval"`` (the default: within ``fsync_interval`` seconds, default 0.01) or
        ``"never"`` (when the OS writes it).  ``max_journal_bytes`` (default 0: none) makes
        puts wait while the journal would take more disk.  These three need ``journal``
        (without it they are a ``ValueError``: they would do nothing).  A journaled broker
        that dies is started again by this process, on the same address and journal, until
        the creating handle's ``shutdown()`` (its ``close()`` leaves the broker serving, and
        watched) or this process's exit.

        On Ray each broker binds its node's IP on a free port, chosen on that node:
        ``address`` is then a ``ValueError``.
        """
        options = _checked_options(options)
        heartbeats = {setting: value for setting, value in (
            ("heartbeat_interval", heartbeat_interval), ("liveness", liveness))
            if value is not None}
        if local and heartbeats:
            raise ValueError(f"{' and '.join(heartbeats)} need a broker process (local=False): "
                             "a local channel has no heartbeats")
        producers, declared, targets = _checked_create_args(
            name, maxsize, distributed, node_rank, local, identity, producers, consumers,
            metrics_port, journal,
            {"lease_timeout": lease_timeout, **heartbeats,
             **{setting: value for setting, value in (
                 ("fsync_interval", fsync_interval), ("max_journal_bytes", max_journal_bytes),
                 ("shm_threshold", shm_threshold)) if value is not None}})
        journal_settings = _journal_settings(journal, fsync, fsync_interval, max_journal_bytes,
                                             local)
        if local:
            return _create_local(name, maxsize, collector=collector, dispatcher=dispatcher,
                                 producers=producers, consumers=declared, options=options,
                                 identity=identity, lease_timeout=lease_timeout)
        if LocalChannel.lookup(name) is not None:  # connect(name) here would find that one
            raise ValueError(f"this process has a local channel named {name!r}: one name is one "
                             "channel (Channel.create(..., local=True) or Channel.connect "
                             "reaches it; give a broker channel another name)")
        on_ray = clusterfile.ray_connected()  # then every channel is Ray-placed (ray_placement.py)
        if on_ray and address is not None:
            raise ValueError(f"address={address!r} cannot be used on Ray: each broker Ray places "
                             "binds its node's IP on a free tcp port, chosen on that node "
                             "(docs/distributed.md, 'On Ray'); leave address out")
        config = _broker_config(
            name, maxsize, None if on_ray else address or paths.default_address(name),
            collector=collector, dispatcher=dispatcher, producers=producers, consumers=declared,
            options=options, curve_keys=curve_keys, insecure=insecure,
            lease_timeout=lease_timeout, shm_threshold=shm_threshold,
            metrics_port=metrics_port, journal_settings=journal_settings, heartbeats=heartbeats)
        if on_ray:
            return _as_channel(ray_placement.create(
                config, distributed=distributed, node_rank=node_rank, targets=targets,
                identity=identity, curve_keys=curve_keys))
        if distributed:  # replicas from a cluster file (distributed.py)
            path = clusterfile.find_file(config.get("options"))
            if path:
                spread = create_from_cluster(config, path, identity=identity,
                                             curve_keys=curve_keys)
                if not spread.created:  # attached: this node's replica says what it ignores
                    log_ignored_settings(spread._sub(spread._home), config)
                return _as_channel(spread)
            log.info("distributed=True without Ray or a cluster file: one local replica")
        if node_rank is not None:
            log.info("node_rank=%s ignored: the channel is not placed by Ray", node_rank)
        return cls._attach_or_spawn(config, identity=identity, curve_keys=curve_keys)

    @classmethod
    def _attach_or_spawn(cls, config: dict[str, Any], *, identity: str | None,
                         curve_keys: Any) -> Channel:
        """A handle on the live broker of ``config["name"]`` (another process holds its lock:
        attach, warning), else one on the broker started now with ``config``."""
        name = config["name"]
        client_keys(curve_keys)  # this handle's own CURVE keys: wrong ones fail before a start
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
                    log_ignored_settings(handle, config)
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
        spawned = cls(name, real_address, identity=identity, curve_keys=curve_keys)._adopt(
            proc, token)
        try:
            spawned._connection(timeout=START_TIMEOUT_S)
        except BaseException:
            spawned._kill_broker()
            raise
        # watched: reaped and logged when it dies, started again if durable (handle/keeper.py)
        spawned._keeper = BrokerKeeper(name, dict(config, address=real_address), proc,
                                       spawned._broker_restarted,
                                       restart=config.get("journal") is not None)
        return spawned

    @classmethod
    def connect(cls, name_or_address: str | None = None, current_worker: Any = None, *,
                identity: str | None = None, timeout: float = 10.0, curve_keys: Any = None,
                shm: bool | None = None, name: str | None = None) -> Channel:
        """Attach to a running broker by channel name or ``ipc://``/``tcp://`` address.

        ``current_worker`` (RLinf's second positional argument) names the consumer this handle
        acts for and becomes its ``identity``: a ``"group:rank"`` str, or an object with an
        ``identity`` str, with ``group_name`` and ``rank`` attributes, or with a ``worker_name``
        str (``zchannel.embodied.groups.Worker``).  None keeps ``identity=``, else
        ``ZCHANNEL_IDENTITY``.  ``name=`` is RLinf's keyword for ``name_or_address``.
        ``shm=False`` keeps this handle off the same-host shared-memory path (default: on when
        the broker offers it, unless ``ZCHANNEL_SHM=0``; see ``docs/shm.md``); anything but
        None, True or False is a ``TypeError``.
        Raises ``ChannelNotFound`` (quickly when nothing can be listening) if no broker answers.
        """
        check_shm_switch(shm)
        name_or_address = _connect_target(name_or_address, name)
        _check_connect_timeout(timeout)
        worker_identity = _worker_identity(current_worker)
        if worker_identity is not None:
            if identity is not None and identity != worker_identity:
                raise ValueError(f"current_worker stands for {worker_identity!r} but "
                                 f"identity={identity!r}: give one of them")
            identity = worker_identity
        if identity is not None:
            check_consumer_id(identity)
        address: str | None
        if paths.is_address(name_or_address):
            name, address = None, name_or_address
        else:
            name = paths.check_name(name_or_address)
            local = LocalChannel.lookup(name)
            if local is not None:
                return _as_channel(local.new_handle(identity))
            address = _address_on_this_host(name)
            if address is None or _cluster_file_serves(name, address):
                # a distributed channel: cluster file (also where a replica's .addr is on this
                # host: the file holds each replica's server key), else Ray
                found = connect_from_cluster(name, identity=identity, timeout=timeout, shm=shm)
                on_ray = found is None and clusterfile.ray_connected()
                if on_ray:
                    found = ray_placement.connect(name, identity=identity, timeout=timeout,
                                                  shm=shm)
                if found is not None:
                    return _as_channel(found)
                raise ChannelNotFound(f"no channel named {name!r} on this host" + (
                    " nor on Ray (no actor 'zchannel:" + name + "' in this job's namespace: "
                    "never created, still starting, or its replica 0 gone)" if on_ray else "")
                    + _stale_address_note(name))
        keys = client_keys(curve_keys)
        if keys is not None:
            keys.load()  # a key file that does not hold its key: ValueError naming it, first
        paths.probe(address)
        handle = cls(name, address, identity=identity, curve_keys=curve_keys, shm=shm)
        # a channel's broker names itself in its lock file: the connection must be to that one
        handle._broker_pid = None if name is None else paths.read_lock_holder(name)
        handle._connection(timeout=timeout)
        if name is not None:
            _check_serves(handle, name)
        if handle._connection().broker_info.replicas is not UNSET:  # a replica: route per key (distributed.py)
            return _as_channel(DistributedChannel.from_handle(handle))
        return handle


def _address_on_this_host(name: str) -> str | None:
    """The address in ``name``'s ``.addr`` file while a broker of the channel holds its lock
    (its own or a replica's); when its writer stopped or died, the address of another live
    replica of that (distributed) channel on this host, if any.  A killed broker's file names
    an address another broker may have taken over: it is not followed (``paths.nobody_serves``)
    unless nothing listens there (``paths.probe`` then says the socket file is left)."""
    address = paths.read_address(name)
    if address is None or _gone(address):
        return _replica_on_this_host(name) or address
    if paths.nobody_serves(name):
        return _replica_on_this_host(name)
    return address


def _stale_address_note(name: str) -> str:
    """What a ``ChannelNotFound`` for ``name`` adds when a killed broker's ``.addr`` file of
    that name is left ("" when there is none)."""
    try:
        address = paths.read_address(name)
        if address is None or not paths.nobody_serves(name):
            return ""
    except OSError:
        return ""
    return (f" (its address file {paths.addr_path(name)} is left from a broker that is gone: "
            f"nobody holds the channel's lock, and {address} may be another broker's now; "
            "`zchannel clean` removes the file)")


def _check_serves(handle: Channel, name: str) -> None:
    """``ChannelNotFound`` (the handle closed) unless the broker ``handle`` said hello to
    serves channel ``name``: the run directory's files may name an address that another
    channel's broker took over."""
    served = handle._connection().broker_info.name
    if served != name:
        handle.close()
        raise ChannelNotFound(
            f"no broker serves channel {name!r} at {handle.address}, where this host's run "
            f"directory says it is: the broker there serves channel {served!r}")


def _broker_serves(name: str) -> bool:
    """Whether a live broker on this host serves channel ``name`` (``connect(name)`` would
    reach it)."""
    try:
        address = paths.read_address(name)
        return address is not None and not _gone(address) and not paths.nobody_serves(name)
    except OSError:  # no usable run directory (UnsafeRunDir too): no broker found by name here
        return False


def _gone(address: str) -> bool:
    """Whether nothing can be listening at ``address`` (``paths.probe``)."""
    try:
        paths.probe(address)
    except ChannelNotFound:
        return True
    return False


def _replica_on_this_host(name: str) -> str | None:
    """The address of a live replica of distributed channel ``name`` on this host (several
    replicas on one host share one ``.addr`` file: the last one written, removed when that
    replica stops); None if there is none."""
    return next((a for a in paths.replica_addresses(name) if not _gone(a)), None)


def _cluster_file_serves(name: str, address: str) -> bool:
    """Whether ``$ZCHANNEL_CLUSTER`` describes channel ``name`` with a replica at ``address``
    (the ``.addr`` file of a replica on this host): connect through the file then."""
    cl = clusterfile.load_found(name)
    return cl is not None and any(r.address == address for r in cl.replicas)


Channel.register(LocalChannel)
Channel.register(DistributedChannel)
