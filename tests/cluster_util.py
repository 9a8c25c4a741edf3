"""Helpers for distributed-channel tests: cluster files and free loopback ports."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time


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
