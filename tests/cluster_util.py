"""Helpers for distributed-channel tests: cluster files, free loopback ports and a simulated
three-node Ray cluster."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from zchannel.broker import BrokerUnavailable


def wait_connected(ch, timeout: float = 60.0) -> None:
    """Block until the broker behind ``ch`` answered its connection's hello again (the I/O
    thread wakes ``Connection.wait_up`` when it does: a broker started anew at the address).
    A connection that ended is replaced at the handle's next call, which waits for that hello
    itself."""
    conn = ch._conn
    if conn is not None and conn.state != "closed":
        assert conn.wait_up(timeout) or conn.state == "closed", \
            f"no broker answered at {ch.address} within {timeout}s"


def until_available(ch, call, timeout: float = 60.0):
    """``call()`` again while it raises ``BrokerUnavailable`` (the broker of ``ch`` is being
    started again, or was stopped), what a user's retry loop does: each retry waits for the
    broker to answer again (``wait_connected``); ``call``'s result, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except BrokerUnavailable:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"the broker was unavailable for {timeout}s"
            wait_connected(ch, remaining)


def write_cluster(directory: str, nodes: tuple[str, ...] = ("n0", "n0", "n0"),
                  addresses: list[str] | None = None, file_name: str = "cluster.toml") -> str:
    """A cluster file with one replica per entry of ``nodes``; ipc addresses in ``directory``
    (one file serves every channel name through ``{name}``) unless ``addresses`` are given."""
    if addresses is None:
        addresses = [f"ipc://{directory}/{{name}}-r{i}.sock" for i in range(len(nodes))]
    lines = []
    for node, address in zip(nodes, addresses, strict=True):
        lines += ["[[replica]]", f'node = "{node}"', f'address = "{address}"', ""]
    path = os.path.join(directory, file_name)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def free_tcp_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago (the kernel does not hand them out
    again right away)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Replicas:
    """Replica processes started with ``zchannel broker NAME --cluster FILE --replica I``;
    killed by PID at teardown."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, name: str, cluster_file: str, indices, *args: str,
              env: dict | None = None, prefix: tuple[str, ...] = (), timeout: float = 60) -> None:
        started = []
        for i in indices:
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "zchannel.cli.main", "broker", name,
                 "--cluster", cluster_file, "--replica", str(i), *args],
                stdout=subprocess.PIPE, env={**os.environ, **(env or {})},
                cwd=os.path.dirname(os.path.abspath(__file__)),
            )
            self.procs[i] = proc
            started.append(proc)
        deadline = time.monotonic() + timeout
        for proc in started:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline().decode() if ready else ""
            if not line.startswith("ready "):
                raise RuntimeError(f"replica {proc.args} did not start: {line!r}")

    def kill(self, index: int) -> None:
        proc = self.procs[index]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout:
            proc.stdout.close()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout and not proc.stdout.closed:
                proc.stdout.close()


def audit(reader: Any, acked: list, views: list[dict], kills: dict[int, list[float]],
          got: list = ()) -> dict:
    """Check a distributed channel after a failure run and count.  ``acked``: (key, item,
    monotonic time the put was issued) of every acknowledged put -- the issuer may see an
    acknowledgement only after the broker that sent it was seen gone, but never one of a put
    issued after that; ``views``: each handle's
    key -> replica; ``kills``: replica -> when it was killed (gone); ``got``: (key, item) taken
    during the run.  Asserted: every handle saw the replica a fresh lookup by ``reader`` gives;
    no replica holds a key bound to another; ``reader`` drains every key; nothing delivered
    twice or without an acknowledged put; every acknowledged item delivered unless its replica
    was killed after the put was issued.  Returns ops, lost, duplicates, delivered, keys."""
    keys = {key for view in views for key in view}
    bound = {key: reader.replica_of(key) for key in keys}
    for view in views:  # every handle saw the same replica for every key
        for key, index in view.items():
            assert bound[key] == index, (key, index, bound[key])
    for i in range(len(reader.replicas)):  # no replica served a key bound to another one
        # a replica restarted since ``reader`` last used it answers its first request
        # ``expired`` (BrokerUnavailable, docs/guarantees.md): ask again, as a user would
        sub = reader._sub(i)
        for key in until_available(sub, sub.stats)["keys"]:
            if key not in bound:  # touched by a get only (every put to it failed)
                bound[key] = reader.replica_of(key)
            assert bound[key] == i, ("served by", i, key, bound[key])
    delivered: Counter = Counter(got)
    for key in sorted(keys, key=repr):
        n = reader.qsize(key)
        while n:
            delivered.update((key, item) for item in reader.get_batch(n, key, timeout=30))
            n = reader.qsize(key)
    lost = []
    for key, item, t in acked:
        if (key, item) not in delivered:
            # allowed only when the key's replica was killed after the put was issued
            assert any(k > t for k in kills.get(bound[key], ())), \
                ("lost", key, item, t, bound[key], kills)
            lost.append((key, item))
    assert set(delivered) <= {(key, item) for key, item, _ in acked}  # nothing unacknowledged
    duplicates = sum(c - 1 for c in delivered.values())
    assert duplicates == 0, [k for k, c in delivered.items() if c > 1][:10]
    return {"ops": len(acked), "lost": len(lost), "duplicates": duplicates,
            "delivered": len(delivered), "keys": len(keys)}


@contextlib.contextmanager
def ray_three_nodes(prefix: str, node_resources: bool = False) -> Iterator[Any]:
    """A simulated three-node Ray cluster (``ray.cluster_utils.Cluster``, one CPU a node) with
    ``ZCHANNEL_RUN_DIR`` set to a fresh directory that the cluster's worker processes inherit;
    the test is skipped, with Ray's reason, when Ray cannot start one here.  ``node_resources``:
    node ``i`` also offers the custom resource ``node<i>`` (to pin actors to it)."""
    import ray  # optional: the callers skip when it is not installed
    from ray.cluster_utils import Cluster

    def resources(i: int) -> dict:
        return {"resources": {f"node{i}": 1}} if node_resources else {}

    run_dir = tempfile.mkdtemp(prefix=prefix)
    saved = {name: os.environ.get(name) for name in ("ZCHANNEL_RUN_DIR", "PYTHONPATH")}
    os.environ["ZCHANNEL_RUN_DIR"] = run_dir
    c = None
    try:
        try:  # Ray itself, not zchannel: a machine that cannot run it skips with the reason
            c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **resources(0)})
            for i in (1, 2):
                c.add_node(num_cpus=1, **resources(i))
            ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
            c.wait_for_nodes()
        except Exception as exc:
            pytest.skip(f"ray could not start a local 3-node cluster here: {type(exc).__name__}: {exc}")
        finally:  # the cluster's processes inherited the run dir; the caller's is back
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        yield c
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)


class SharedRayCluster:
    """One simulated three-node Ray cluster (``ray_three_nodes`` with node resources) for the
    tests that use it one after another: ``get`` starts it for the first of them, ``close``
    shuts it down after the last (tests/conftest.py runs them next to each other and closes it
    when the next test does not use it), so that a run of such tests pays for one start."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._cluster: Any = None

    def get(self) -> Any:
        if self._stack is None:
            stack = contextlib.ExitStack()
            self._cluster = stack.enter_context(ray_three_nodes("zcr-", node_resources=True))
            self._stack = stack
        return self._cluster

    def close(self) -> None:
        stack, self._stack, self._cluster = self._stack, None, None
        if stack is not None:
            stack.close()
