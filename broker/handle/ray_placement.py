"""Placing brokers with Ray (optional extra ``ray``, imported inside the functions here, which
``Channel.create``/``Channel.connect`` call only when the process uses Ray).

When the creating process is connected to Ray (``ray.is_initialized()``; zchannel never calls
``ray.init()``), ``Channel.create(name, distributed=True)`` starts one broker replica per alive
Ray node, each run by a small actor (``num_cpus=0``, ``NodeAffinitySchedulingStrategy``, owned by
the creator: not detached) that spawns the broker process bound to the node's IP on a free tcp
port.  Any other create on Ray places a single broker: on the i-th node (sorted node ids) for
``node_rank=i``, else on the node of the first producer, else of the first consumer, given as
actor handles or node ids, else on the creator's node.  A single broker is a one-replica
distributed channel (it behaves exactly like a plain one, and its stats say on which node it
runs).

The replica table is published by replica 0's actor, named ``zchannel:<name>`` in the job's Ray
namespace: any process of the job finds it with ``Channel.connect(name)``.  When a node IP is not
loopback (and ``insecure=True`` was not given), the channel gets CURVE keys generated for it: the
brokers admit only the channel's client key; the client key pair and the brokers' public key
travel inside the published table (and inside pickled handles) as z85 text.

The placement lives as long as the creating process: it stays registered here (dropping every
handle does not end the channel) until ``shutdown()`` of the creating handle, or the process's
exit, tears it down: stops the broker processes and kills the actors, whose work directories go
with them.  If Ray is no longer connected then (``ray.shutdown()`` ran first), the actors went
with Ray: only what is on this host is removed (the work directories and ``/dev/shm`` segments
of the brokers that ran here).  If the creator dies, Ray removes its actors and each broker,
which watches its actor process, stops within a second.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
from zchannel.broker.errors import BrokerStartError, BrokerUnavailable, ChannelError
from zchannel.broker.handle.distributed import (
    DistributedChannel,
    connect_home,
    log_ignored_settings,
)
from zchannel.broker.host import paths
from zchannel.broker.host.procs import process_running
from zchannel.broker.server.starting import BrokerProcess, spawn_broker, stop_broker
from zchannel.broker.shm.segment import list_segments, run_prefix, unlink
from zchannel.broker.transport.curve import CurveKeys

log = logging.getLogger("zchannel.client")

ACTOR_PREFIX = "zchannel:"
START_TIMEOUT_S = 120.0
PLACEMENT_NOTICE_S = 2.0  # a create waiting longer for Ray to place its target actor logs it
# a failed broker actor is restarted by Ray (on its node), as often as it fails
MAX_RESTARTS = -1
RESTART_BIND_S = 30.0
STATE_FILE = "actor-state.msgpack"
STOP_TIMEOUT_S = 30.0  # teardown: how long the actors may take to stop their brokers
LOCAL_BROKER_EXIT_S = 5.0  # teardown without Ray: how long a broker of this host may take to end


@dataclass(frozen=True)
class InlineCurveKeys(CurveKeys):
    """Client CURVE keys carried as z85 text (``secret_key`` holds ``public:secret``), so that a
    handle works on every node without key files."""

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = self.secret_key[:40], self.secret_key[41:]  # z85 keys are 40 chars
        sock.curve_publickey = public.encode()
        sock.curve_secretkey = secret.encode()
        sock.curve_serverkey = self.server_public_key.encode()


def _write_cert(path: str, public: bytes, secret: bytes | None) -> None:
    lines = ["metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


class BrokerActor:
    """Runs one broker process on its node (the broker stops when this actor's process dies);
    ``_actor_class()`` makes it a Ray actor class.

    Ray restarts a failed actor (``max_restarts``) on the same node (hard node affinity); the
    restarted actor finds what ``start`` and ``set_info`` were given in its work directory
    (``work_dir``: keyed by the actor id, which Ray keeps across restarts and no other actor,
    of this cluster or another one on the host, has) and starts the broker again on the same
    address, which joins the other replicas like any restarted replica; handles reconnect by
    themselves, and ``Channel.connect`` finds the republished table."""

    def __init__(self, name: str = "", replica: int = 0) -> None:
        import ray

        self.proc: BrokerProcess | None = None
        self.token: str | None = None
        self.info: dict | None = None
        self.workdir = work_dir(str(ray.get_runtime_context().get_actor_id()))  # in an actor: set
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if not restarted:
            shutil.rmtree(self.workdir, ignore_errors=True)
        os.makedirs(self.workdir, mode=0o700, exist_ok=True)
        os.chmod(self.workdir, 0o700)
        os.environ["ZCHANNEL_RUN_DIR"] = os.path.join(self.workdir, "run")
        saved = os.path.join(self.workdir, STATE_FILE)
        if restarted and os.path.exists(saved):
            with open(saved, "rb") as f:
                state = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
            self.info = state.get("info")
            if state.get("config") is not None:
                log.warning("broker actor of %r replica %d restarted: starting its broker again",
                            name, replica)
                self._start(state["config"], state.get("curve"), RESTART_BIND_S)

    def _save(self, **fields: Any) -> None:
        path = os.path.join(self.workdir, STATE_FILE)
        state = {}
        if os.path.exists(path):
            with open(path, "rb") as f:
                state = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
        state.update(fields)
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgpack.packb(state, use_bin_type=True))
        os.replace(path + ".tmp", path)

    def node(self) -> tuple[str, str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def host_and_work_dir(self) -> tuple[str, str]:
        """This actor's host name and work directory (what a creator on the same host removes
        when it tears the channel down without Ray)."""
        return socket.gethostname(), self.workdir

    def where(self) -> tuple[str, str]:
        """This actor's Python and the ``zchannel/broker/__init__.py`` it runs."""
        return sys.executable, os.path.join(os.path.dirname(os.path.dirname(__file__)), "__init__.py")

    def free_port(self, ip: str) -> int:
        with socket.socket() as s:
            s.bind((ip, 0))
            return s.getsockname()[1]

    def pid(self) -> int:
        """The broker process's pid (a call that also waits until a restarted actor is up)."""
        return self.proc.pid if self.proc is not None else -1

    def start(self, config: dict, curve: dict | None) -> tuple[str, int]:
        self._save(config=config, curve=curve)
        return self._start(config, curve, 0.0)

    def _start(self, config: dict, curve: dict | None, retry_s: float) -> tuple[str, int]:
        """Spawn the broker; for up to ``retry_s`` while the previous one (of a failed actor)
        still holds the lock or the address."""
        config = dict(config)
        if curve is not None:
            keys = os.path.join(self.workdir, "keys")
            clients = os.path.join(keys, "clients")
            os.makedirs(clients, mode=0o700, exist_ok=True)
            server_secret = os.path.join(keys, "server.key_secret")
            _write_cert(server_secret, curve["server_public"].encode(), curve["server_secret"].encode())
            _write_cert(os.path.join(clients, "client.key"), curve["client_public"].encode(), None)
            # the replica's links to the other replicas (the replicated binding table)
            client_secret = os.path.join(keys, "client.key_secret")
            _write_cert(client_secret, curve["client_public"].encode(), curve["client_secret"].encode())
            server_public = os.path.join(keys, "server.key")
            _write_cert(server_public, curve["server_public"].encode(), None)
            os.environ["ZCHANNEL_CURVE_SECRET_KEY"] = client_secret
            os.environ["ZCHANNEL_CURVE_SERVER_KEY"] = server_public
            config.update(curve_secret_key=server_secret, curve_public_keys=clients)
        lock_name = f"{config['name']}.replica{config.get('replica', 0)}"
        deadline = time.monotonic() + retry_s
        while True:
            lock_fd = paths.try_lock(lock_name)
            try:
                if lock_fd is None:
                    raise ChannelError(f"a broker for {lock_name!r} already runs in this actor")
                self.proc, address, self.token = spawn_broker(config, lock_fd)
                threading.Thread(target=self._watch, args=(self.proc,), daemon=True,
                                 name="zchannel-broker-watch").start()
                return address, self.proc.pid
            except ChannelError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)  # the failed actor's broker stops within a second
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)

    def _watch(self, proc: BrokerProcess) -> None:
        """Wait for the broker to end; one that ends while this actor still runs it (killed,
        out of memory) ends the actor's process too, so that Ray restarts the actor, which
        starts the broker again on its address (and journal)."""
        code = proc.wait()
        if self.proc is proc:  # not stopped by ``stop``
            log.error("the broker of this actor (pid %d) exited with status %s: restarting "
                      "the actor", proc.pid, code)
            os._exit(1)

    def set_info(self, info: dict) -> None:
        self.info = info
        self._save(info=info)

    def get_info(self) -> dict | None:
        return self.info

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_broker(proc, grace_s=10.0)
        shutil.rmtree(self.workdir, ignore_errors=True)


def work_dir(actor_id: str) -> str:
    """The work directory of the broker actor ``actor_id`` (mode 0700: its broker's run files,
    the channel's CURVE keys, what a restarted actor starts from): ``<tmp>/zchannel-ray-<uid>-
    <actor id>``, short enough that the run directory's socket paths stay under the ipc limit."""
    return os.path.join(tempfile.gettempdir(), f"zchannel-ray-{os.getuid()}-{actor_id}")


@dataclass(frozen=True)
class LocalRemains:
    """What a broker actor leaves on its host when Ray kills it: its work directory, and the
    ``/dev/shm`` segments of its broker (``pid``), named after the run directory inside."""

    host: str
    workdir: str
    pid: int

    def remove(self, deadline: float) -> None:
        """Remove them once the broker ended (it watches its actor: within a second), waiting
        for it until ``deadline`` (``time.monotonic()``); nothing on another host."""
        if self.host != socket.gethostname():
            return
        while self.pid > 0 and process_running(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        for segment in list_segments(run_prefix(os.path.join(self.workdir, "run"))):
            unlink(segment)
        shutil.rmtree(self.workdir, ignore_errors=True)


class RayPlacement:
    """The actors of one channel, owned by the creating handle and kept in this module's
    registry until ``teardown`` (the handle's ``shutdown()``, else the process's exit), so the
    channel lives as long as the creating process, as a broker started off Ray does."""

    def __init__(self, actors: list) -> None:
        self.actors = actors
        self.remains: list[LocalRemains] = []  # filled once the brokers started
        self.pid = os.getpid()
        _placements.add(self)

    def teardown(self) -> None:
        """Stop the brokers and kill the actors (their work directories go with them; those of
        an actor that could not stop its broker are removed here if they are on this host);
        without Ray (``ray.shutdown()`` ran first: the actors went with it) remove what is on
        this host only.  Never starts Ray."""
        import ray

        _placements.discard(self)
        actors, self.actors = self.actors, []
        if not ray.is_initialized():
            deadline = time.monotonic() + LOCAL_BROKER_EXIT_S
            for remains in self.remains:
                remains.remove(deadline)
            return
        deadline = time.monotonic() + STOP_TIMEOUT_S
        failed = []  # the actors that did not stop their broker (e.g. their node is lost)
        for i, ref in enumerate([a.stop.remote() for a in actors]):
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                failed.append(i)
        if failed:
            log.warning("stopping the broker actors %s failed; killing them", failed)
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        deadline = time.monotonic() + LOCAL_BROKER_EXIT_S
        for i in failed:
            if i < len(self.remains):
                self.remains[i].remove(deadline)


_placements: set[RayPlacement] = set()  # this process's placements not torn down yet


@atexit.register
def teardown_all() -> None:
    """Tear down the placements this process created (a forked child leaves its parent's
    alone), as their creating handles' ``shutdown()`` would: at interpreter exit, and before
    a process Ray would kill (a worker group's actor, ``WorkerGroup.shutdown``) goes."""
    for placement in list(_placements):
        if placement.pid == os.getpid():
            try:
                placement.teardown()
            except Exception:
                log.exception("tearing down a Ray placement failed")


@functools.cache
def _actor_class() -> Any:
    """``BrokerActor`` as a Ray actor class (made once, when a channel is first placed)."""
    import ray

    return ray.remote(num_cpus=0)(BrokerActor)


def _alive_nodes() -> list[str]:
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def _placed_node(actor_id: str) -> str | None:
    """The node of the live actor ``actor_id`` as Ray's state has it, or None (not placed,
    restarting, dead)."""
    import ray._private.state as state

    entry = state.actors(actor_id=actor_id) or {}
    node = (entry.get("Address") or {}).get("NodeID")
    return node if node and entry.get("State") in ("ALIVE", 2) else None


def _node_of(given_as: str, target: Any, channel: str) -> str:
    """The node id of the placement target ``target`` of channel ``channel`` (``given_as``:
    ``"producers"`` or ``"consumers"``, the argument that gave it): a node id, or an actor
    handle once Ray placed the actor.  A wait for that is logged (after
    ``PLACEMENT_NOTICE_S``), and ends after ``START_TIMEOUT_S`` with ``BrokerStartError``;
    an actor that died or that Ray cannot place is a ``ValueError`` naming it.  No Ray
    exception escapes."""
    if isinstance(target, str):
        return target
    import ray

    actor_id = target._actor_id.hex()
    what = f"channel {channel!r}: the actor {actor_id} given in {given_as}= (its node places the broker)"
    started = time.monotonic()
    ready: Any = target.__ray_ready__.remote()
    noticed = False
    while True:
        node = _placed_node(actor_id)
        if node is not None:
            return node
        waited = time.monotonic() - started
        if waited >= START_TIMEOUT_S:
            raise BrokerStartError(f"{what} was not placed on a node by Ray within the start "
                                   f"timeout of {START_TIMEOUT_S:g} s (it waits for resources "
                                   "no node has free, or its node is not up)", "Timeout")
        if not noticed and waited >= PLACEMENT_NOTICE_S:
            log.warning("%s is not placed on a node yet (Ray has not scheduled it: it may wait "
                        "for resources); waiting for it up to %g s", what, START_TIMEOUT_S)
            noticed = True
        if ready is None:  # was up, but Ray's state does not say where yet: ask again
            time.sleep(0.05)
            ready = target.__ray_ready__.remote()
        done, _ = ray.wait([ready], timeout=min(0.5, START_TIMEOUT_S - waited))
        if done:
            ready = _actor_ready(ready, target, what)


def _actor_ready(ready: Any, target: Any, what: str) -> Any:
    """None when the finished ``__ray_ready__`` call ``ready`` of actor ``target`` says the
    actor is up; a new such call while Ray restarts it; ``ValueError`` (``what`` died or
    cannot be placed) or ``BrokerStartError`` for Ray's other errors."""
    import ray

    try:
        ray.get(ready)
    except ray.exceptions.ActorUnavailableError:  # being restarted: ask again
        return target.__ray_ready__.remote()
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError) as exc:
        raise ValueError(f"{what} is dead or cannot be placed, so it cannot place the channel "
                         f"({type(exc).__name__}: {_in_one_line(exc)}); give a live actor, a "
                         "node id, or none") from exc
    except ray.exceptions.RayError as exc:
        raise BrokerStartError(f"{what} could not be reached ({type(exc).__name__}: "
                               f"{_in_one_line(exc)})", type(exc).__name__) from exc
    return None


def _in_one_line(exc: BaseException) -> str:
    """Ray's error ``exc`` in one line: its first line and, when it has more, its last (Ray
    puts the actor's details between, and why it died last)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return " ... ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)


def split_targets(producers: Any, consumers: Any) -> tuple[Any, Any, list[tuple[str, Any]]]:
    """Take Ray actor handles and node ids out of ``producers`` / ``consumers`` (they are
    placement targets, not group names or consumer ids): ``(argument, target)`` pairs,
    producers' targets first."""
    import ray

    nodes = set(_alive_nodes())
    targets: list[tuple[str, Any]] = []

    def split(values: Any, given_as: str) -> Any:
        if values is None or isinstance(values, (str, dict)) or not hasattr(values, "__iter__"):
            return values
        if hasattr(values, "items"):
            return values
        kept = []
        for v in values:
            if isinstance(v, ray.actor.ActorHandle) or (isinstance(v, str) and v in nodes):
                targets.append((given_as, v))
            else:
                kept.append(v)
        return kept

    return split(producers, "producers"), split(consumers, "consumers"), targets


def _handle(name: str, info: dict, identity: str | None,
            owner: RayPlacement | None = None, shm: bool | None = None) -> DistributedChannel:
    curve = info.get("curve")
    keys = None if curve is None else InlineCurveKeys(
        f"{curve['client_public']}:{curve['client_secret']}", curve["server_public"])
    return DistributedChannel(name, info["replicas"], identity=identity, curve_keys=keys,
                              owner=owner is not None, ray_owner=owner, shm=shm)


def _lookup(name: str) -> dict | None:
    """The replica table replica 0's actor publishes, or None if Ray knows no such actor.
    ``BrokerUnavailable`` naming Ray's error when that actor does not answer (it is gone for
    good: killed, its node lost, while the other replicas may still serve); while Ray restarts
    it, it is asked again (up to the start timeout).  No Ray exception escapes."""
    import ray

    try:
        actor = ray.get_actor(ACTOR_PREFIX + name)
    except ValueError:
        return None
    except ray.exceptions.RayError as exc:
        raise _unavailable(name, exc) from exc
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return ray.get(actor.get_info.remote(), timeout=START_TIMEOUT_S)
        except ray.exceptions.ActorUnavailableError as exc:  # being restarted: ask again
            if time.monotonic() >= deadline:
                raise _unavailable(name, exc) from exc
            time.sleep(0.2)
        except ray.exceptions.RayError as exc:  # e.g. ActorDiedError, ActorUnschedulableError
            raise _unavailable(name, exc) from exc


def _unavailable(name: str, exc: BaseException) -> BrokerUnavailable:
    return BrokerUnavailable(
        f"channel {name!r}: its replica table lives on replica 0's broker actor "
        f"{ACTOR_PREFIX}{name}, which does not answer ({type(exc).__name__}: {exc}); handles "
        "made before keep working with the live replicas")


def create(config: dict, *, distributed: bool, node_rank: int | None,
           targets: list[tuple[str, Any]], identity: str | None,
           curve_keys: Any) -> DistributedChannel:
    """What ``Channel.create`` does on Ray: attach to the channel Ray placed already (logging
    what of ``config`` it ignores, as any attaching create), else place its broker(s) (see the
    module docstring; ``targets``: ``split_targets``'s) and connect to replica 0.
    ``BrokerStartError`` (naming Ray's error) if an actor fails while its broker starts, or
    a placement target is not placed within the start timeout; ``ValueError`` for a placement
    target that is dead."""
    import ray

    name = config["name"]
    if (config.get("options") or {}).get("cluster"):
        log.warning("channel %r: the cluster file %s is ignored: on Ray, Ray places the "
                    "replicas", name, config["options"]["cluster"])
    info = _lookup(name)
    actors: list = []
    if info is None:
        nodes = _placement(name, distributed, node_rank, targets)
        try:  # replica 0's actor holds the name: made first, it settles a race of two creates
            actors.append(_broker_actor(name, 0, nodes[0]))
        except ray.exceptions.ActorAlreadyExistsError:  # another create placed it meanwhile
            info = _published(name)
    if info is not None:  # placed by Ray already: attach
        handle = _handle(name, info, identity)
        handle._log_attached()
        log_ignored_settings(handle._sub(handle._home), config)
        return handle
    try:
        actors += [_broker_actor(name, i, node) for i, node in enumerate(nodes) if i > 0]
    except BaseException:
        RayPlacement(actors).teardown()
        raise
    owner = RayPlacement(actors)
    try:
        info = _start_brokers(owner, config)
        handle = _handle(name, info, identity, owner)
        handle._sub(0)._connection(timeout=START_TIMEOUT_S)
    except ray.exceptions.RayError as exc:  # an actor or its node failed while starting
        owner.teardown()
        raise BrokerStartError(f"channel {name!r}: a broker actor failed while starting "
                               f"({type(exc).__name__}: {exc})", type(exc).__name__) from exc
    except BaseException:
        owner.teardown()
        raise
    return handle


def _broker_actor(name: str, index: int, node_id: str) -> Any:
    """The broker actor of replica ``index`` on node ``node_id`` (replica 0's is the named
    actor ``zchannel:<name>``: ``ActorAlreadyExistsError`` when the name is taken)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return _actor_class().options(
        name=ACTOR_PREFIX + name if index == 0 else None,
        num_cpus=0,
        max_restarts=MAX_RESTARTS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(name, index)


def _published(name: str) -> dict:
    """The replica table of channel ``name`` once the create that placed it (in another
    process, at the same time) publishes it; ``BrokerStartError`` when it does not within the
    start timeout (that create failed, or is still starting)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        info = _lookup(name)
        if info is not None:
            return info
        if time.monotonic() >= deadline:
            raise BrokerStartError(f"channel {name!r}: another create of this name placed its "
                                   f"actors but published no replica table within "
                                   f"{START_TIMEOUT_S}s", "Timeout")
        time.sleep(0.1)


def _placement(name: str, distributed: bool, node_rank: int | None,
               targets: list[tuple[str, Any]]) -> list[str]:
    """The node ids to place the channel's brokers on (see the module docstring)."""
    import ray

    nodes = _alive_nodes()
    if distributed:
        if node_rank is not None:
            log.info("node_rank=%s ignored: a distributed channel has a replica on every node", node_rank)
        return nodes
    if node_rank is not None:
        if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < len(nodes):
            raise ValueError(f"node_rank={node_rank!r}: the Ray cluster has {len(nodes)} nodes")
        return [nodes[node_rank]]
    if targets:
        given_as, target = targets[0]
        return [_node_of(given_as, target, name)]
    return [ray.get_runtime_context().get_node_id()]


def _start_brokers(owner: RayPlacement, config: dict) -> dict:
    """Start the broker of each of ``owner``'s actors (a free port on its node's IP; CURVE keys
    unless every IP is loopback or ``insecure``), note what each leaves on its host, and
    publish the replica table on replica 0's actor: that table."""
    import ray

    actors = owner.actors
    located = ray.get([a.node.remote() for a in actors], timeout=START_TIMEOUT_S)
    ports = ray.get([a.free_port.remote(ip) for a, (_, ip, _) in zip(actors, located, strict=True)],
                    timeout=START_TIMEOUT_S)
    table = [{"node": node, "address": f"tcp://{ip}:{port}", "hostnames": []}
             for (node, ip, _), port in zip(located, ports, strict=True)]
    secure = not config.get("insecure") and not all(
        paths.is_loopback_host(ip) for _, ip, _ in located)
    curve = None
    if secure:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        curve = {"server_public": server_public.decode(), "server_secret": server_secret.decode(),
                 "client_public": client_public.decode(), "client_secret": client_secret.decode()}
    replicas_cfg = [dict(config, address=row["address"], replica=i, replicas=table)
                    for i, row in enumerate(table)]
    started = ray.get([a.start.remote(cfg, curve) for a, cfg in zip(actors, replicas_cfg, strict=True)],
                      timeout=START_TIMEOUT_S)
    hosts = ray.get([a.host_and_work_dir.remote() for a in actors], timeout=START_TIMEOUT_S)
    owner.remains = [LocalRemains(host, workdir, pid)
                     for (host, workdir), (_, pid) in zip(hosts, started, strict=True)]
    public = None if curve is None else {k: v for k, v in curve.items() if k != "server_secret"}
    info = {"replicas": table, "curve": public}
    ray.get(actors[0].set_info.remote(info), timeout=START_TIMEOUT_S)
    return info


def connect(name: str, *, identity: str | None, timeout: float,
            shm: bool | None = None) -> DistributedChannel | None:
    """A handle of the Ray-placed channel ``name`` (``shm``: its shared-memory switch), or
    None if Ray knows no such channel."""
    info = _lookup(name)
    if info is None:
        return None
    handle = _handle(name, info, identity, shm=shm)
    connect_home(handle, timeout)
    return handle


__all__ = ["BrokerActor", "InlineCurveKeys", "connect", "create", "split_targets", "teardown_all"]
