"""Locality of a distributed channel across real network stacks: three network namespaces.

Run as root (it creates namespaces ``zcd<pid>n0..2``, veth pairs to a bridge ``zcd<pid>br``,
and removes them on exit, also on failure)::

    sudo python docs/examples/netns_bench.py --mib 256            # per producer
    sudo python docs/examples/netns_bench.py --mib 1024 --json out.json

One producer/consumer pair per namespace; producer i puts ``--mib`` MiB of tensors on its own keys,
consumer i (same namespace) takes them.  Three set-ups, the same workload:

- ``distributed``: a replica per namespace, clients claim their own node (``ZCHANNEL_NODE``):
  each key lives with its producer, payloads never cross namespaces.
- ``replica0``: the same replicas, but every client claims node 0, so every key binds to replica 0
  (what a channel without locality does).
- ``shared``: one ordinary broker in namespace 0 for everybody.

Bytes that crossed between namespaces are read from the host side of the veth pairs (what a
namespace sent = the host side's ``rx_bytes``).  ``tests/test_netns.py`` uses these helpers.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

WORKER = r"""
import os, sys, time
from zchannel.broker import Channel
role, target, tag, n, nbytes, nkeys = sys.argv[1:7]
n, nbytes, nkeys = int(n), int(nbytes), int(nkeys)
if os.environ.get("ZCD_ARRAYS") == "numpy":  # the tests: same frames, no torch start-up cost
    import numpy as np
    arange = lambda k: np.arange(k, dtype=np.int32)
    full = lambda k, v: np.full((k,), v, dtype=np.int32)
else:
    import torch
    arange = lambda k: torch.arange(k, dtype=torch.int32)
    full = lambda k, v: torch.full((k,), v, dtype=torch.int32)
ch = Channel.connect(target, timeout=30)
keys = [(tag, k) for k in range(nkeys)]
for key in keys:
    ch.qsize(key)  # binds the key now (first touch), outside the timed part
print("ready", getattr(ch, "node", "-"), flush=True)
sys.stdin.readline()  # go
start = time.monotonic()
elems = nbytes // 4
if role == "put":
    base = arange(elems)
    works = []
    for i in range(n):
        t = base if n > 64 else full(elems, i)
        works.append(ch.put(t, key=keys[i % nkeys], async_op=True))
        if len(works) >= 32:
            works.pop(0).wait()
    for w in works:
        w.wait()
else:
    bad = 0
    for i in range(n):
        t = ch.get(key=keys[i % nkeys], timeout=120)
        expected = (elems - 1) if n > 64 else i
        if len(t) != elems or int(t[-1]) != expected:
            bad += 1
    if bad:
        print("bad", bad, flush=True)
        sys.exit(1)
print("done", round(time.monotonic() - start, 4), flush=True)
ch.close()
"""


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True)


class Namespaces:
    """Three namespaces on one bridge; ``close()`` removes everything it created."""

    def __init__(self, prefix: str | None = None, count: int = 3) -> None:
        self.prefix = prefix or f"zcd{os.getpid()}"
        self.count = count
        self.names = [f"{self.prefix}n{i}" for i in range(count)]
        self.bridge = f"{self.prefix}br"
        self.host_veths = [f"{self.prefix}h{i}" for i in range(count)]
        pid = os.getpid()
        self.subnet = f"10.{100 + pid % 100}.{(pid // 100) % 250}"
        self.ips = [f"{self.subnet}.{i + 1}" for i in range(count)]
        self.created: list[tuple[str, str]] = []

    def __enter__(self) -> Namespaces:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.created.append(("link", self.bridge))
        sh("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            sh("ip", "netns", "add", ns)
            self.created.append(("netns", ns))
            host = self.host_veths[i]
            sh("ip", "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.created.append(("link", host))
            sh("ip", "link", "set", host, "master", self.bridge)
            sh("ip", "link", "set", host, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ips[i]}/24", "dev", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        # wait until every namespace reaches every other one (bridge ports come up asynchronously)
        for i in range(self.count):
            self._probe(i)

    def _probe(self, target: int, port: int = 5699, timeout: float = 20) -> None:
        """Every namespace opens a tcp connection to namespace ``target`` (no ping needed)."""
        server = subprocess.Popen(
            ["ip", "netns", "exec", self.names[target], sys.executable, "-c",
             "import socket, sys\ns = socket.socket()\n"
             "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
             f"s.bind(('{self.ips[target]}', {port})); s.listen(8)\nprint('ready', flush=True)\n"
             f"for _ in range({self.count}):\n    s.accept()[0].close()\n"],
            stdout=subprocess.PIPE)
        try:
            assert read_line(server, timeout) == "ready"
            client = ("import socket, time\n"
                      f"end = time.monotonic() + {timeout!r}\nwhile True:\n"
                      "    try:\n"
                      f"        socket.create_connection(({self.ips[target]!r}, {port}), timeout=1).close()\n"
                      "        break\n"
                      "    except OSError:\n        if time.monotonic() > end: raise\n"
                      "        time.sleep(0.05)\n")
            for ns in self.names:
                out = sh("ip", "netns", "exec", ns, sys.executable, "-c", client, check=False)
                if out.returncode != 0:
                    raise RuntimeError(f"{ns} cannot reach {self.ips[target]}: {out.stderr[-300:]}")
            server.wait(timeout=timeout)
        finally:
            if server.poll() is None:
                os.kill(server.pid, signal.SIGKILL)
                server.wait()
            server.stdout.close()

    def close(self) -> None:
        for kind, name in reversed(self.created):
            if kind == "netns":
                sh("ip", "netns", "del", name, check=False)
            else:
                sh("ip", "link", "del", name, check=False)
        self.created.clear()

    def crossing_bytes(self) -> int:
        """Bytes every namespace has sent onto the bridge so far."""
        total = 0
        for host in self.host_veths:
            with open(f"/sys/class/net/{host}/statistics/rx_bytes") as f:
                total += int(f.read())
        return total

    def popen(self, i: int, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Run ``argv`` in namespace ``i`` as if on a host of its own: ``ip netns exec`` gives it
        a private mount namespace, where a fresh tmpfs on /dev/shm hides the host's segments,
        so zchannel's same-host handshake (docs/shm.md) fails and data goes as frames over the
        veths, as between real hosts.  Where that mount is refused, shared memory is switched
        off instead (``ZCHANNEL_SHM=0``)."""
        shell = ('mount -t tmpfs -o size=4g zcshm /dev/shm 2>/dev/null || export ZCHANNEL_SHM=0; '
                 'exec "$@"')
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], "sh", "-c", shell, "sh",
                                 *argv], env={**os.environ, **(env or {})}, **kw)


class Procs:
    """Processes started here, stopped by PID."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def add(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
            for s in (p.stdin, p.stdout):
                if s:
                    s.close()
        self.procs.clear()


def read_line(proc: subprocess.Popen, timeout: float = 120) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"process {proc.pid} printed nothing within {timeout}s")
    return proc.stdout.readline().decode().strip()


def python_env(workdir: str) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tests = os.path.join(repo, "tests")
    return {"PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)}


def start_brokers(nets: Namespaces, procs: Procs, workdir: str, name: str, mode: str,
                  port: int = 5700) -> tuple[list[str], str | None]:
    """Start the brokers of ``mode``; the address each namespace's clients use and the cluster
    file (None for the shared broker)."""
    if mode == "shared":
        address = f"tcp://{nets.ips[0]}:{port}"
        env = dict(python_env(workdir), ZCHANNEL_RUN_DIR=os.path.join(workdir, "run-shared"))
        p = procs.add(nets.popen(0, [sys.executable, "-m", "zchannel.cli.main", "broker", name,
                                     "--address", address, "--insecure", "--maxsize", "8"],
                                 env=env, stdout=subprocess.PIPE, cwd=workdir))
        line = read_line(p, 60)
        assert line.startswith("ready"), line
        return [address] * nets.count, None
    path = os.path.join(workdir, f"{name}.toml")
    with open(path, "w") as f:
        f.write("[cluster]\ninsecure = true\n\n")
        for i, ns in enumerate(nets.names):
            f.write(f'[[replica]]\nnode = "{ns}"\naddress = "tcp://{nets.ips[i]}:{port}"\n\n')
    started = []
    for i in range(nets.count):
        env = dict(python_env(workdir), ZCHANNEL_RUN_DIR=os.path.join(workdir, f"run-{i}"))
        started.append(procs.add(nets.popen(
            i, [sys.executable, "-m", "zchannel.cli.main", "broker", name, "--cluster", path,
                "--replica", str(i), "--maxsize", "8"],
            env=env, stdout=subprocess.PIPE, cwd=workdir)))
    for p in started:
        line = read_line(p, 60)
        assert line.startswith("ready"), line
    return [f"tcp://{ip}:{port}" for ip in nets.ips], path


def run_workload(nets: Namespaces, workdir: str, mode: str, nbytes_per_producer: int,
                 tensor_bytes: int = 4 << 20, nkeys: int = 4, concurrent: bool = True,
                 check_held: bool = False, numpy_arrays: bool = False) -> dict:
    """One producer and one consumer per namespace; returns seconds, MB/s, crossing bytes and
    (``check_held``: producers first, then stats, then consumers) bytes held per replica."""
    name = f"bench-{mode}"
    procs = Procs()
    try:
        addresses, cluster_file = start_brokers(nets, procs, workdir, name, mode)
        n = max(1, nbytes_per_producer // tensor_bytes)
        workers: list[tuple[str, subprocess.Popen]] = []
        for i in range(nets.count):
            node = nets.names[0] if mode == "replica0" else nets.names[i]
            env = dict(python_env(workdir), ZCHANNEL_NODE=node,
                       ZCHANNEL_RUN_DIR=os.path.join(workdir, f"client-{i}"),
                       ZCD_ARRAYS="numpy" if numpy_arrays else "torch")
            for role in ("get", "put"):
                p = procs.add(nets.popen(
                    i, [sys.executable, "-c", textwrap.dedent(WORKER), role, addresses[i],
                        f"p{i}", str(n), str(tensor_bytes), str(nkeys)],
                    env=env, stdout=subprocess.PIPE, stdin=subprocess.PIPE, cwd=workdir))
                workers.append((role, p))
        for _, p in workers:
            line = read_line(p, 60)
            assert line.startswith("ready"), line
        before = nets.crossing_bytes()
        held = None
        putters = [p for role, p in workers if role == "put"]
        getters = [p for role, p in workers if role == "get"]
        phases = [putters + getters] if concurrent else [putters, getters]
        start = time.monotonic()
        for k, phase in enumerate(phases):
            for p in phase:
                p.stdin.write(b"go\n")
                p.stdin.flush()
            for p in phase:
                line = read_line(p, 600)
                assert line.startswith("done"), line
            if k == 0 and not concurrent and check_held:
                held = held_per_broker(nets, addresses, workdir)
        elapsed = time.monotonic() - start
        for _, p in workers:
            p.wait(timeout=60)
            assert p.returncode == 0
        crossed = nets.crossing_bytes() - before
        payload = n * tensor_bytes * nets.count
        return {"mode": mode, "seconds": round(elapsed, 3), "payload_bytes": payload,
                "MB_per_s": round(payload / elapsed / 1e6, 1), "crossing_bytes": crossed,
                "held_per_broker": held}
    finally:
        procs.stop_all()


def held_per_broker(nets: Namespaces, addresses: list[str], workdir: str) -> dict:
    """``{node: bytes_held}`` from the channel's aggregated stats, read from namespace 0."""
    code = ("import json, sys\nfrom zchannel.broker import Channel\n"
            "ch = Channel.connect(sys.argv[1])\ns = ch.stats()\n"
            "print(json.dumps({r.get('node', '-'): r.get('bytes_held') for r in "
            "s.get('replicas', [{'node': 'shared', 'bytes_held': s['bytes_held']}])}))\n"
            "ch.close()\n")
    out = subprocess.run(["ip", "netns", "exec", nets.names[0], sys.executable, "-c", code,
                          addresses[0]], capture_output=True, text=True, timeout=60, cwd=workdir,
                         env={**os.environ, **python_env(workdir),
                              "ZCHANNEL_RUN_DIR": os.path.join(workdir, "stat")})
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB each producer puts")
    ap.add_argument("--tensor-mib", type=int, default=4, help="MiB per tensor")
    ap.add_argument("--modes", default="distributed,replica0,shared")
    ap.add_argument("--json", dest="json_out", help="write the results here too")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="zcd-bench-") as workdir, Namespaces() as nets:
        for mode in args.modes.split(","):
            r = run_workload(nets, workdir, mode, args.mib << 20, args.tensor_mib << 20)
            results.append(r)
            print(f"{mode:12s} {r['payload_bytes'] / 2**20:8.0f} MiB in {r['seconds']:7.2f}s "
                  f"= {r['MB_per_s']:7.1f} MB/s   crossed namespaces: "
                  f"{r['crossing_bytes'] / 2**20:9.2f} MiB", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
