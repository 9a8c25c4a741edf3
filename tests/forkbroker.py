"""A broker launcher for crash tests: one spawned process imports the broker once, then forks a
broker child for each start, so that a broker killed at random serves again within tens of
milliseconds instead of the seconds a fresh interpreter takes to import numpy and zmq on a
loaded machine.  (What restarts a durable channel's broker for users is ``handle/keeper.py``;
``tests/test_durable.py`` tests that one.)"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import signal
import time
from typing import Any


def _serve(conn: Any) -> None:
    from zchannel.broker.server.config import BrokerConfig
    from zchannel.broker.server.entry import run_broker

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed brokers are reaped by the kernel
    while True:
        try:
            fields = conn.recv()
        except EOFError:
            return
        if fields is None:
            return
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the broker
            try:
                os.setsid()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.dup2(w, 1)
                os.close(r)
                os.close(w)
                code = run_broker(BrokerConfig(**fields, parent_pid=os.getppid()))
            except BaseException as exc:  # noqa: BLE001 - reported on its stdout
                os.write(1, f"error {type(exc).__name__}: {exc}\n".encode())
                code = 1
            os._exit(code)
        os.close(w)
        line = b""
        deadline = time.monotonic() + 60
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], 1.0)
            if ready:
                chunk = os.read(r, 4096)
                if not chunk:
                    break
                line += chunk
        os.close(r)
        conn.send((pid, line.decode(errors="replace").strip()))


class ForkBroker:
    """Starts brokers (``BrokerConfig`` fields) as forks of one prepared process, kills them,
    and at ``close`` kills the ones still running."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self._proc.start()
        self.running: list[int] = []  # started and not killed here

    def start(self, **fields: Any) -> int:
        """Start a broker; its pid once it printed ``ready`` (``RuntimeError`` otherwise)."""
        self._conn.send(fields)
        pid, line = self._conn.recv()
        if not line.startswith("ready "):
            raise RuntimeError(f"broker did not start: {line!r}")
        self.running.append(pid)
        return pid

    def kill(self, pid: int, sig: int = signal.SIGKILL, wait: bool = True) -> None:
        """Send ``sig`` (SIGKILL: a crash) to a broker started here and (``wait``) wait until it
        is gone, so that a broker started next on the same journal finds its files closed."""
        if pid in self.running:
            self.running.remove(pid)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if wait:
            wait_gone(pid)

    def close(self) -> None:
        for pid in list(self.running):
            self.kill(pid)
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Wait until process ``pid`` (a child of ``ForkBroker``'s server, which lets the kernel
    reap them) is gone: only then are all its files closed, and its locks free."""
    try:
        fd = os.pidfd_open(pid)  # readable once the process has exited (its files closed)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    if not ready:
        raise TimeoutError(f"process {pid} did not end")
