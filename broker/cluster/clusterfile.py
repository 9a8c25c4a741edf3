"""Cluster files and node detection for distributed channels (no Ray import: ``ray_connected``
and the node id only look at a ``ray`` the process imported itself).

A cluster file (TOML) lists the replicas of a distributed channel, in order (every replica holds
the key-binding table; the lowest-index live one decides new bindings: ``broker/cluster/binding.py``)::

    [cluster]
    name = "samples"          # optional: the only channel this file serves
    insecure = false          # optional: let replicas bind non-loopback tcp without CURVE
    steal = false             # optional: empty keys move to idle replicas (broker/cluster/moving.py)
    server_keys = ["keys/replica0.key", "keys/replica1.key"]   # optional: CURVE (below)
    client_keys = "keys/clients"

    [[replica]]
    node = "node-a"           # node name (a process's node: $ZCHANNEL_NODE, else its hostname)
    address = "tcp://10.0.0.1:5555"
    hostnames = ["node-a.example.com"]   # optional aliases matched against the hostname

    [[replica]]
    node = "node-b"
    address = "tcp://10.0.0.2:5555"

``server_keys`` (one public key file per replica, in order) and ``client_keys`` (the directory
of the public keys let in: clients' and replicas') turn CURVE on: each replica is started with
its own key pair (``--curve-secret-key``), admits only those keys, and talks to the other
replicas with its own key pair; clients learn each replica's public key from the table.  Paths
are relative to the file.  ``zchannel keygen DIR --replicas N`` writes such a set.

An ``address`` may contain ``{name}``, replaced by the channel name, so that one file serves
several channels (``ipc:///run/zc/{name}-0.sock``); a relative ipc path is relative to the
file, as key paths are.  Several replicas may share a node: keys of
that node are then spread over them by a stable hash of the key.

The file is found through ``options={"cluster": FILE}`` given to ``Channel.create``, the
``ZCHANNEL_CLUSTER`` environment variable, or ``zchannel broker --cluster FILE``.  Clients that
connect to any replica also receive the table in the broker's hello reply, so they need no file.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq.auth
from zchannel.broker.host import paths
from zchannel.broker.host.shipped import resolve
from zchannel.broker.host.toml import read_toml

ENV_CLUSTER = "ZCHANNEL_CLUSTER"
ENV_NODE = "ZCHANNEL_NODE"
MAX_REPLICAS = 1024  # replicas a cluster file may list (each replica links to every other)


@dataclass(frozen=True)
class Replica:
    node: str
    address: str
    hostnames: tuple[str, ...] = ()
    server_key: str | None = None  # the replica's CURVE public key (z85), when CURVE is on

    def as_dict(self) -> dict[str, Any]:
        row = {"node": self.node, "address": self.address, "hostnames": list(self.hostnames)}
        if self.server_key:
            row["server_key"] = self.server_key
        return row


@dataclass
class Cluster:
    replicas: list[Replica]
    name: str | None = None
    insecure: bool = False
    source: str | None = None
    client_keys: str | None = None  # directory of the public keys let in (CURVE)
    extra: dict[str, Any] = field(default_factory=dict)
    server_key_files: list[str] = field(default_factory=list)  # CURVE: public key file per replica
    steal: bool = False  # empty keys move to idle replicas (broker/cluster/moving.py)

    def table(self) -> list[dict[str, Any]]:
        return [r.as_dict() for r in self.replicas]

    def secret_key_file(self, index: int) -> str | None:
        """The key pair file of replica ``index``: ``NAME.key_secret`` next to its public
        ``server_keys`` file ``NAME.key`` (as ``zchannel keygen --replicas`` writes them);
        None when the file does not turn CURVE on."""
        if not self.server_key_files:
            return None
        public = self.server_key_files[index]
        return public.removesuffix(".key") + ".key_secret"


def _replica(path: str | os.PathLike, i: int, row: dict[str, Any], name: str | None) -> Replica:
    """Row ``i`` of the file's ``[[replica]]``s, ``{name}`` in its address replaced and a
    relative ipc path made absolute against the file's directory (``_absolute_ipc``);
    ``ValueError`` naming the file and the replica for a malformed row (``check_address``)."""
    if not isinstance(row, dict):
        raise ValueError(f"{path}: replica {i} must be a table ([[replica]]), got {row!r}")
    bad = set(row) - {"node", "address", "hostnames"}
    if bad or "node" not in row or "address" not in row:
        raise ValueError(f"{path}: replica {i} needs node and address (and only hostnames besides)")
    node, address = row["node"], row["address"]
    for field_name, value in (("node", node), ("address", address)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{path}: replica {i}: {field_name} must be a non-empty string, "
                             f"got {value!r}")
    if "{name}" in address:
        if name is None:
            raise ValueError(f"{path}: replica {i}: address {address!r} needs a channel name")
        address = address.replace("{name}", name)
    problem = check_address(address)
    if problem is not None:
        raise ValueError(f"{path}: replica {i}: address {address!r} {problem}")
    hostnames = row.get("hostnames") or []
    if not isinstance(hostnames, list) or not all(isinstance(h, str) for h in hostnames):
        raise ValueError(f"{path}: replica {i}: hostnames must be a list of str, got {hostnames!r}")
    return Replica(node, _absolute_ipc(path, address), tuple(hostnames))


def check_address(address: str) -> str | None:
    """What is wrong with ``address`` as a replica's address (None: nothing): it is
    ``ipc://PATH`` with a path, or ``tcp://HOST:PORT`` with a host other than ``*`` and a port
    in 1-65535 (port 0 would make the replica serve at a random port no other process can
    find in the file)."""
    if address.startswith("ipc://"):
        return None if address[len("ipc://"):] else "has no socket path"
    try:
        host_port = paths.tcp_host_port(address)
    except ValueError as exc:
        return f"is not usable: {exc}"
    if host_port is None:
        return "must be ipc://PATH or tcp://HOST:PORT"
    host, port = host_port
    if not host or host == "*":
        return "names no host a client can connect to"
    if port == 0:
        return "has port 0 (a random port): give the port the replica serves at"
    return None


def address_identity(address: str) -> str:
    """The form of ``address`` two spellings of one address share, for finding replicas listed
    twice without a name lookup: a tcp host in lower case, ``localhost`` as ``127.0.0.1``, an
    IP literal in its canonical form; an ipc path normalised.  Other host names are compared as
    written."""
    host_port = paths.tcp_host_port(address)
    if host_port is None:
        socket_path = paths.ipc_path(address)
        return address if socket_path is None else "ipc://" + os.path.normpath(socket_path)
    host, port = host_port
    host = host.lower()
    if host == "localhost":
        host = "127.0.0.1"
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


def _absolute_ipc(path: str | os.PathLike, address: str) -> str:
    """``address`` with a relative ipc path resolved against the directory of the cluster
    file ``path`` (as its key paths are), so that every process finds the same socket
    whatever its working directory; other addresses (absolute or abstract ``@`` ipc paths,
    tcp) unchanged."""
    if not address.startswith("ipc://"):
        return address
    socket_path = address[len("ipc://"):]
    if not socket_path or socket_path.startswith(("/", "@")):
        return address
    return "ipc://" + str(Path(path).resolve().parent / socket_path)


def load(path: str | os.PathLike, name: str | None = None) -> Cluster:
    """Read a cluster file; ``{name}`` in addresses is replaced by the channel ``name``.
    ``ValueError`` naming the file when it cannot be read or is malformed."""
    return parse(path, read_cluster_toml(path), name)


def read_cluster_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The tables of cluster file ``path``; ``ValueError`` naming it when it cannot be read
    (missing, a directory, no permission) or is not valid TOML."""
    try:
        return read_toml(path)
    except OSError as exc:
        raise ValueError(f"cannot read the cluster file {path}: {exc.strerror or exc}") from None


def parse(path: str | os.PathLike, data: dict[str, Any], name: str | None = None) -> Cluster:
    """The cluster of file ``path``'s tables ``data`` (``load``)."""
    unknown = set(data) - {"cluster", "replica"}
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {sorted(unknown)}")
    head = data.get("cluster", {})
    if not isinstance(head, dict):
        raise ValueError(f"{path}: [cluster] must be a table, got {head!r}")
    bad = set(head) - {"name", "insecure", "server_keys", "client_keys", "steal"}
    if bad:
        raise ValueError(f"{path}: unknown key(s) {sorted(bad)} in [cluster]")
    file_name = _file_name(path, head, name)
    rows = data.get("replica") or []
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: a cluster file lists at least one [[replica]]")
    if len(rows) > MAX_REPLICAS:
        raise ValueError(f"{path}: {len(rows)} replicas listed, at most {MAX_REPLICAS}")
    replicas = [_replica(path, i, row, name or file_name) for i, row in enumerate(rows)]
    _check_distinct(path, replicas)
    here = Path(path).resolve().parent
    server_keys = head.get("server_keys")
    client_dir = head.get("client_keys")
    if (server_keys is None) != (client_dir is None):
        raise ValueError(f"{path}: server_keys and client_keys go together in [cluster]")
    if server_keys is not None:
        if not isinstance(server_keys, list) or len(server_keys) != len(replicas) \
                or not all(isinstance(k, str) for k in server_keys):
            raise ValueError(f"{path}: server_keys lists one public key file per replica "
                             f"({len(replicas)})")
        if not isinstance(client_dir, str):
            raise ValueError(f"{path}: client_keys is a directory name, not {client_dir!r}")
        key_files = [str(here / key_file) for key_file in server_keys]
        replicas = [Replica(r.node, r.address, r.hostnames, public_key_z85(key_file))
                    for r, key_file in zip(replicas, key_files, strict=True)]
        client_dir = str(here / client_dir)
        if not Path(client_dir).is_dir():
            raise ValueError(f"{path}: client_keys {client_dir} is not a directory")
    return Cluster(replicas, name=file_name or name, insecure=_flag(head, "insecure", path),
                   source=str(path), client_keys=client_dir,
                   server_key_files=key_files if server_keys is not None else [],
                   steal=_flag(head, "steal", path))


def _file_name(path: str | os.PathLike, head: dict[str, Any], name: str | None) -> str | None:
    """The file's ``[cluster] name`` (None: it serves any channel); ``ValueError`` when it is
    not a non-empty str, or is not ``name``."""
    file_name = head.get("name")
    if not isinstance(file_name, (str, type(None))) or file_name == "":
        raise ValueError(f"{path}: [cluster] name is a channel name, not {file_name!r}")
    if file_name is not None and name is not None and file_name != name:
        raise ValueError(f"{path} describes channel {file_name!r}, not {name!r}")
    return file_name


def _check_distinct(path: str | os.PathLike, replicas: list[Replica]) -> None:
    """``ValueError`` naming the file and both replicas when two list one address (as
    ``address_identity`` compares them): two brokers cannot serve one address."""
    first_of: dict[str, int] = {}  # address_identity -> the first replica listing it
    for i, r in enumerate(replicas):
        j = first_of.setdefault(address_identity(r.address), i)
        if j != i:
            raise ValueError(f"{path}: each replica has an address of its own; listed more "
                             f"than once: replica {j} ({replicas[j].address}) and replica {i} "
                             f"({r.address})")


def _flag(head: dict, name: str, path: Any) -> bool:
    value = head.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{path}: [cluster] {name} is true or false, not {value!r}")
    return value


def public_key_z85(path: str | os.PathLike) -> str:
    """The public key of a ZeroMQ certificate file, as z85 text."""
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the CURVE public key {path}: {exc}") from exc
    return public.decode()


def from_table(table: Any) -> list[Replica]:
    """The replicas of a ``replicas`` table (from a hello reply or a replica's state): a list
    of maps, each with ``node`` and ``address`` str, ``hostnames`` a list of str and
    ``server_key`` a str or nil; ``ValueError`` naming what is malformed."""
    if not isinstance(table, list) or not table:
        raise ValueError(f"a replicas table is a non-empty list, not {type(table).__name__}")
    out = []
    for i, r in enumerate(table):
        hostnames = r.get("hostnames") or [] if isinstance(r, dict) else None
        if not (isinstance(r, dict) and isinstance(r.get("node"), str)
                and isinstance(r.get("address"), str) and isinstance(hostnames, list)
                and all(isinstance(h, str) for h in hostnames)
                and isinstance(r.get("server_key") or "", str)):
            raise ValueError(f"replica {i} of a replicas table is malformed: {r!r:.200}")
        out.append(Replica(r["node"], r["address"], tuple(hostnames), r.get("server_key") or None))
    return out


def find_file(options: dict | None = None) -> str | None:
    """The cluster file given in ``options["cluster"]``, else ``$ZCHANNEL_CLUSTER``; a path
    that does not exist but names a config shipped with zchannel
    (``configs/cluster_example.toml``) is its installed copy."""
    path = (options or {}).get("cluster") or os.environ.get(ENV_CLUSTER)
    if not path:
        return None
    try:
        return resolve(str(Path(path)))
    except FileNotFoundError:
        return str(Path(path))  # (reading it names the file and the cause)


def load_found(name: str) -> Cluster | None:
    """The cluster file of ``$ZCHANNEL_CLUSTER`` if it describes channel ``name`` (None: no
    variable, or a file whose ``[cluster] name`` is another channel).  ``ValueError`` naming
    the variable, the file and the cause when the file cannot be read or is malformed: a
    variable that names a broken file is a mistake to report, not a channel to skip."""
    path = find_file()
    if not path:
        return None
    try:
        data = read_cluster_toml(path)
        head = data.get("cluster")
        if isinstance(head, dict) and isinstance(head.get("name"), str) and head["name"] != name:
            return None  # the only channel the file serves is another one
        return parse(path, data, name)
    except ValueError as exc:
        raise ValueError(f"${ENV_CLUSTER} names the cluster file {path}, which cannot be "
                         f"used: {exc}") from None


def _hostnames() -> set[str]:
    names = {socket.gethostname()}
    names.add(socket.gethostname().split(".")[0])
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names


def local_node(replicas: list[Replica]) -> str:
    """This process's node: ``$ZCHANNEL_NODE``; else the Ray node id when this process is
    connected to Ray and the replicas are named by node id; else the replica node whose name or
    alias matches the hostname; else the hostname."""
    node = os.environ.get(ENV_NODE)
    if node:
        return node
    nodes = {r.node for r in replicas}
    ray_node = _ray_node_id()
    if ray_node is not None and ray_node in nodes:
        return ray_node
    names = _hostnames()
    for r in replicas:
        if r.node in names or names & set(r.hostnames):
            return r.node
    return socket.gethostname()


def ray_connected() -> bool:
    """True when this process is connected to Ray (zchannel never imports ray unless the process
    did, and never calls ``ray.init()``)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized())
    except Exception:
        return False


def _ray_node_id() -> str | None:
    if not ray_connected():
        return None
    try:
        return sys.modules["ray"].get_runtime_context().get_node_id()
    except Exception:
        return None


def key_hash(key: Any) -> int:
    """A hash of a key that every process computes alike (keys are msgpack-able)."""
    return zlib.crc32(msgpack.packb(key, use_bin_type=True))


def choose_replica(replicas: list[Replica], node: str | None, key: Any) -> int:
    """The replica a key touched first from ``node`` binds to: the node's replica (by key hash
    among several on one node); a node without a replica spreads its keys over all replicas."""
    local = [i for i, r in enumerate(replicas) if r.node == node]
    candidates = local or list(range(len(replicas)))
    return candidates[key_hash(key) % len(candidates)]


__all__ = ["MAX_REPLICAS", "Cluster", "Replica", "address_identity", "check_address",
           "choose_replica", "find_file", "load", "load_found",
           "local_node", "parse", "read_cluster_toml"]
