"""Helpers for distributed-channel tests: cluster files and free loopback ports."""

from __future__ import annotations

import os
import socket


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
