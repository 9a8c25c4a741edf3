"""A broker's configuration (``BrokerConfig``), its files (TOML) and their merge with
command-line flags.

A file has up to three tables::

    [channel]                 # name, address, maxsize, lease_timeout, heartbeat_interval,
    name = "samples"          # liveness, max_bytes, max_keys, max_message_bytes, max_frames,
                              # max_header_bytes, insecure, key_grace, curve_secret_key,
                              # metrics_port, metrics_address, token_file,
                              # curve_admin_keys, max_clients, producer_grace,
                              # journal, fsync, fsync_interval, max_journal_bytes,
                              # sched_batch, ...
    maxsize = 64
    journal = "/var/lib/zchannel"   # a durable channel (docs/durability.md)

    [hooks]                   # collector, dispatcher, consumers, producers, imports, types
    collector = "flatten_batch"
    dispatcher = "round_robin"
    consumers = { actor = 3 } # or a list of ids
    producers = ["rollout"]

    [options]                 # free-form, handed to the hooks as ctx.options
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zchannel.broker.host import paths
from zchannel.broker.host.toml import read_toml
from zchannel.broker.server.metrics import check_port
from zchannel.broker.shm.segment import DEFAULT_POOL_BYTES, DEFAULT_THRESHOLD
from zchannel.broker.wire import arrays
from zchannel.broker.wire.limits import MIN_JOURNAL_LIMIT, check_settings
from zchannel.broker.wire.protocol import MAX_FRAMES, MAX_HEADER_BYTES
from zchannel.hooks.base import (
    MAX_CONSUMER_ID,
    MAX_CONSUMERS,
    check_groups,
    expand_consumers,
)

DEFAULT_LEASE_TIMEOUT = 30.0  # seconds an unacknowledged delivery is held


@dataclass
class BrokerConfig:
    """Everything a broker is started with (CLI flags, a TOML file, or ``Channel.create``)."""

    name: str
    address: str | None = None
    maxsize: int = 0
    collector: Any = None
    dispatcher: Any = None
    producers: list[str] = field(default_factory=list)
    consumers: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    imports: list[str] = field(default_factory=list)
    # [tag, "module:qualname"] of the classes to register for the wire (a creator's own)
    types: list[list[str]] = field(default_factory=list)
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT
    heartbeat_interval: float = 1.0
    liveness: int = 3
    max_bytes: int = 0
    max_keys: int = 100_000
    allowed_dtypes: list[str] | None = None
    max_rank: int | None = None
    max_message_bytes: int = 0
    max_frames: int = MAX_FRAMES
    max_header_bytes: int = MAX_HEADER_BYTES
    shm_threshold: int = DEFAULT_THRESHOLD  # same-host shared memory (docs/shm.md); 0 = off
    shm_pool_bytes: int = DEFAULT_POOL_BYTES
    direct: bool = True  # same-host clients of an ipc address skip libzmq (broker/transport/direct_broker.py)
    sched_batch: bool = True  # the loop runs under Linux's SCHED_BATCH (broker/host/scheduling.py)
    key_grace: float = 30.0
    insecure: bool = False
    curve_secret_key: str | None = None
    curve_public_keys: str | None = None
    parent_pid: int | None = None
    lock_fd: int | None = None
    token: str | None = None  # the shutdown token (random when None; docs/security.md)
    token_file: str | None = None  # ... or read from this file
    curve_admin_keys: str | None = None  # public key file(s) that may shut the broker down
    max_clients: int = 0  # connections served at once; 0 = from the descriptor limit
    producer_grace: float = 60.0  # seconds a producer's put sequences outlive its session
    # distributed channels (broker/cluster/replica.py): a cluster file or the replica table, and our index
    cluster: str | None = None
    replica: int | None = None
    replicas: list[dict[str, Any]] | None = None
    steal: bool = False  # move empty keys to idle replicas (cluster file ``steal = true``)
    # Prometheus metrics over HTTP (broker/server/metrics.py); None = off, 0 = any free port
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"
    # a durable channel (broker/journal/, docs/durability.md): the journal's directory, None = none
    journal: str | None = None
    fsync: str = "interval"  # always | interval | never
    fsync_interval: float = 0.01  # seconds: the group commit of the interval policy
    max_journal_bytes: int = 0  # puts wait while the journal would take more disk (0: no limit)
    journal_segment_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        check_settings(vars(self))
        check_types(vars(self))
        if self.address is not None:
            refuse_abstract_ipc(self.address)
        if self.metrics_port is not None:
            check_port(self.metrics_port)
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, got "
                             f"{self.fsync!r}")
        if not isinstance(self.types, list) or not all(
                isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t)
                for t in self.types):
            raise ValueError("types must be a list of [tag, 'module:qualname'] pairs, got "
                             f"{self.types!r}")
        self.producers = check_groups(self.producers)
        if self.journal is not None:
            if not isinstance(self.journal, str) or not self.journal or "\0" in self.journal:
                raise ValueError(f"journal must be a directory path (not empty, no NUL "
                                 f"character), got {self.journal!r}")
            self.journal = os.path.expanduser(self.journal)  # (a config file's "~/...")
        if self.journal is not None and 0 < self.max_journal_bytes < MIN_JOURNAL_LIMIT:
            raise ValueError(f"max_journal_bytes must be 0 (no limit) or at least "
                             f"{MIN_JOURNAL_LIMIT} (a segment and its removals' margin), got "
                             f"{self.max_journal_bytes}")
        if self.curve_public_keys is not None and self.curve_secret_key is None:
            raise ValueError("curve_public_keys (the clients' keys let in) needs the broker's "
                             "own key pair: give curve_secret_key (--curve-secret-key FILE) too")


FSYNC_POLICIES = ("always", "interval", "never")

_CHANNEL_KEYS = {
    "name", "address", "maxsize", "lease_timeout", "heartbeat_interval", "liveness",
    "max_bytes", "max_keys", "max_message_bytes", "max_frames", "max_header_bytes", "insecure",
    "key_grace", "curve_secret_key", "curve_public_keys", "allowed_dtypes", "max_rank",
    "shm_threshold", "shm_pool_bytes", "direct", "metrics_port", "metrics_address",
    "token_file", "curve_admin_keys", "max_clients", "producer_grace",
    "journal", "fsync", "fsync_interval", "max_journal_bytes", "journal_segment_bytes",
    "sched_batch",
}
_HOOK_KEYS = {"collector", "dispatcher", "consumers", "producers", "imports", "types"}


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _passes(check: Callable[[Any], Any], value: Any) -> bool:
    """Whether ``value`` passes ``check``, one of the hooks' checks (``TypeError`` /
    ``ValueError`` when it does not): a file is held to what ``Channel.create`` takes."""
    try:
        check(value)
    except (TypeError, ValueError):
        return False
    return True


def _is_consumers(value: Any) -> bool:
    """None, a list of consumer ids (``group:rank``) or a table of groups to counts:
    what ``expand_consumers`` takes."""
    return value is None or isinstance(value, (list, dict)) and _passes(expand_consumers, value)


def _is_groups(value: Any) -> bool:
    """A list of producer group names (what ``check_groups`` takes)."""
    return isinstance(value, list) and _passes(check_groups, value)


def _is_hook(value: Any) -> bool:
    """What names a hook: None, a name or ``module:ClassName``, a class or an instance (or an
    instance's wire form, a table: ``entry.hook_from_wire``) — not a number, a bool or a list
    (a file's typo)."""
    return not isinstance(value, (bool, int, float, list, tuple))


def _str(what: str, optional: bool = True) -> tuple[Any, str]:
    """The check of a str field (``optional``: or None), and ``what`` it is."""
    return (lambda v: isinstance(v, str) or (optional and v is None)), what


def _path(what: str) -> tuple[Any, str]:
    """The check of an optional path field (a file, a directory, an address): None, or a
    non-empty str without a NUL character -- an empty one is refused, not taken as unset (a
    template whose variable expanded to nothing would otherwise drop a setting, such as the
    clients' public keys, without a word) -- and ``what`` it is."""
    return ((lambda v: v is None or (isinstance(v, str) and v != "" and "\0" not in v)),
            f"{what}, not empty (leave the key out to set none) and without a NUL character")


_FLAG = (lambda v: type(v) is bool, "true or false")
# The fields whose type ``check_types`` checks (the numeric ones are ``check_settings``'s): a
# value of another type must name its field, not act as another (``"false"`` as true, a
# number as a file descriptor).
_TYPES: dict[str, tuple[Any, str]] = {
    "name": _str("a str", optional=False),
    "address": _path("a str (an address: ipc://PATH or tcp://HOST:PORT)"),
    "insecure": _FLAG, "direct": _FLAG, "sched_batch": _FLAG, "steal": _FLAG,
    "curve_secret_key": _path("a str naming a file (the broker's NAME.key_secret)"),
    "curve_public_keys": _path("a str naming a directory (of the clients' NAME.key files)"),
    "token_file": _path("a str naming a file (the shutdown token's)"),
    "curve_admin_keys": _path("a str naming a file or a directory (of NAME.key files)"),
    "cluster": _path("a str naming a file (a cluster file)"),
    "token": _str("a str"),
    "metrics_address": _str("a str (a host)", optional=False),
    "producers": (_is_groups, f"a list of str (group names: [A-Za-z0-9._-] characters, at "
                              f"most {MAX_CONSUMER_ID - 1} each, e.g. 'rollout')"),
    "imports": (_is_str_list, "a list of module names (str)"),
    "allowed_dtypes": (lambda v: v is None or _is_str_list(v), "a list of dtype names (str)"),
    "max_rank": (lambda v: v is None or (type(v) is int and v >= 0), "an int >= 0"),
    "consumers": (_is_consumers, "a list of consumer ids ('group:rank', e.g. 'actor:0') or a "
                                 "table of group = count (an int >= 0), declaring "
                                 f"{MAX_CONSUMERS} consumers at most"),
    "collector": (_is_hook, "a hook name, 'module:ClassName', a class or an instance"),
    "dispatcher": (_is_hook, "a hook name, 'module:ClassName', a class or an instance"),
    "options": (lambda v: isinstance(v, dict), "a table"),
}


def check_types(fields: dict[str, Any]) -> None:
    """``ValueError`` naming the first field of ``_TYPES`` whose value is of another type."""
    for name, (ok, what) in _TYPES.items():
        if name in fields and not ok(fields[name]):
            raise ValueError(f"{name} must be {what}, got {fields[name]!r}")


def refuse_abstract_ipc(address: str) -> None:
    """``ValueError`` naming ``address`` when it is a Linux abstract socket (``ipc://@NAME``):
    a broker serves an ipc address only as a socket file, which its mode (0600) keeps to its
    owner and which clients and ``zchannel stat`` / ``clean`` find; an abstract socket has no
    file permissions (any local user could connect) and no file."""
    if (paths.ipc_path(address) or "").startswith("@"):
        raise ValueError(f"address {address} is a Linux abstract socket, which a broker does not "
                         "serve (it has no file permissions: any local user could connect, and "
                         "no socket file clients find); give ipc://PATH, a socket file only "
                         "its owner may open")


def check_dtype_names(dtypes: list[str]) -> None:
    """``ValueError`` naming the ``allowed_dtypes`` entries a broker does not decode (what
    ``arrays.restrict`` refuses as the broker starts), checked before it starts."""
    arrays.torch_module()  # builds the table of torch dtype names
    unknown = [d for d in dtypes if d not in arrays.NP_DTYPES and d not in arrays.TORCH_DTYPES]
    if unknown:
        raise ValueError(f"allowed_dtypes names unknown or not allowed dtypes {unknown}: give "
                         "numpy dtype.str values ('<f4', '|b1') or torch dtype names "
                         "('float32', 'bfloat16') of numeric and bool dtypes")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a broker TOML file into ``BrokerConfig`` fields; unknown keys are a ``ValueError``."""
    data = read_toml(path)
    fields: dict[str, Any] = {}
    unknown = set(data) - {"channel", "hooks", "options"}
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {sorted(unknown)}")
    for table in data:
        if not isinstance(data[table], dict):
            raise ValueError(f"{path}: [{table}] must be a table, got {data[table]!r}")
    for table, allowed in (("channel", _CHANNEL_KEYS), ("hooks", _HOOK_KEYS)):
        section = data.get(table, {})
        bad = set(section) - allowed
        if bad:
            raise ValueError(f"{path}: unknown key(s) {sorted(bad)} in [{table}]")
        fields.update(section)
    if "options" in data:
        fields["options"] = dict(data["options"])
    return fields


def build_config(file: str | Path | None = None, **overrides: Any) -> BrokerConfig:
    """A ``BrokerConfig`` from an optional file, with non-None ``overrides`` taking precedence."""
    fields = read_config_file(file) if file else {}
    from_file = set(fields)
    for key, value in overrides.items():
        if value is None or value == () or value == []:
            continue
        if key == "options":
            fields["options"] = {**fields.get("options", {}), **value}
        else:
            fields[key] = value
            from_file.discard(key)
    if not fields.get("name"):
        raise ValueError("a broker needs a channel name (argument NAME or [channel] name)")
    try:
        config = BrokerConfig(**fields)
        if config.allowed_dtypes is not None:  # (else checked only as the broker starts)
            check_dtype_names(config.allowed_dtypes)
        return config
    except (ValueError, TypeError) as exc:
        # the checks name the setting first ("maxsize must be ..."): one the file set is
        # named with the file
        if type(exc) in (ValueError, TypeError) and str(exc).split(" ", 1)[0] in from_file:
            raise type(exc)(f"{file}: {exc}") from None
        raise


def lock_name_of(name: str, cluster: str | None = None, replicas: Any = None,
                 replica: int | None = None) -> str:
    """The name a broker's channel lock and run-directory files go by: the channel's, or
    ``NAME.replicaI`` for replica ``I`` of a distributed channel (``cluster`` or ``replicas``)."""
    if cluster is not None or replicas is not None:
        return f"{name}.replica{replica}"
    return name
