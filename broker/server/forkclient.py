"""Starting a broker through the fork server named by ``ZCHANNEL_BROKER_FORKSERVER`` (the
socket of ``python -m zchannel.broker.server.forkserver``), and the handle of such a broker.

``starting.spawn_broker`` uses it when the variable is set; unset (the default) brokers are
started as ``python -m zchannel.broker`` children.  A forked broker is not this process's child:
``ForkedBroker`` gives it the ``subprocess.Popen`` methods zchannel uses (``pid``, ``stdout``,
``poll``, ``wait``, ``terminate``, ``kill``, ``returncode``), waiting on the exit status the
server reports and signalling through a pidfd, so a recycled pid is never signalled.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import threading
from typing import IO

import msgpack
from zchannel.broker.errors import BrokerStartError

ENV = "ZCHANNEL_BROKER_FORKSERVER"
HEADER = struct.Struct("!Q")
STATUS = struct.Struct("!i")  # a broker's exit status on its exit pipe
UNKNOWN_EXIT = -1  # the server went away before reporting the broker's exit status


def forkserver_path() -> str | None:
    """The fork server socket ``ZCHANNEL_BROKER_FORKSERVER`` names, or None (start brokers as
    children)."""
    return os.environ.get(ENV) or None


class ForkedBroker:
    """A broker the fork server started for this process, with the ``Popen`` methods zchannel
    uses on its brokers."""

    def __init__(self, pid: int, stdout: IO[bytes], exit_fd: int) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._exit_fd = exit_fd
        self._lock = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # exited already (its status is on the exit pipe), or no pidfds
            self._pidfd = None

    def poll(self) -> int | None:
        return self._wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"broker {self.pid}", timeout or 0.0)
        return code

    def _wait(self, timeout: float | None) -> int | None:
        # several threads may wait (a durable channel's keeper and ``shutdown``): the exit
        # pipe is read under the lock and closed only with this object
        if self.returncode is not None:
            return self.returncode
        ready, _, _ = select.select([self._exit_fd], [], [], timeout)
        if not ready:
            return None
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            data = os.read(self._exit_fd, STATUS.size)
            if len(data) == STATUS.size:
                (code,) = STATUS.unpack(data)
                if self._pidfd is not None:  # a 0 comes from the broker just before it exits
                    select.select([self._pidfd], [], [], None)
                self.returncode = code
                return code
        # the server is gone without a status: wait for the process itself (its pidfd is
        # readable once it exited, also while it is a zombie nobody reaped yet)
        if self._pidfd is not None:
            if not select.select([self._pidfd], [], [], timeout)[0]:
                return None
        elif self._alive():
            return None
        self.returncode = UNKNOWN_EXIT
        return self.returncode

    def _alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None or self._pidfd is None:
            return
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        for fd in (getattr(self, "_exit_fd", None), getattr(self, "_pidfd", None)):
            if fd is not None:
                os.close(fd)


def spawn_forked(path: str, config_body: bytes, lock_fd: int, env: dict[str, str]) -> ForkedBroker:
    """Ask the fork server at ``path`` for a broker of ``config_body`` (the msgpack config
    ``python -m zchannel.broker`` reads on stdin) holding ``lock_fd``; its handle (the caller
    reads its ``ready`` line on ``stdout``)."""
    out_r, out_w = os.pipe()
    exit_r, exit_w = os.pipe()
    try:
        request = msgpack.packb({"config": config_body, "env": env, "cwd": os.getcwd()})
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            try:
                conn.connect(path)
            except OSError as exc:
                raise BrokerStartError(
                    f"no broker fork server at {path!r} ({ENV}): {exc}; start one "
                    f"(python -m zchannel.broker.server.forkserver {path}) or unset {ENV}",
                    "forkserver") from None
            socket.send_fds(conn, [HEADER.pack(len(request))],
                            [lock_fd, out_w, 2, exit_w])
            conn.sendall(request)
            answer = msgpack.unpackb(_read_all(conn), raw=False)
    except BaseException:
        for fd in (out_r, exit_r):
            os.close(fd)
        raise
    finally:
        for fd in (out_w, exit_w):
            os.close(fd)
    if "pid" not in answer:
        for fd in (out_r, exit_r):
            os.close(fd)
        raise BrokerStartError(f"the broker fork server at {path!r} refused the start: "
                               f"{answer.get('error')}", "forkserver")
    return ForkedBroker(int(answer["pid"]), os.fdopen(out_r, "rb", buffering=0), exit_r)


def _read_all(conn: socket.socket) -> bytes:
    conn.settimeout(60.0)
    parts = []
    while chunk := conn.recv(65536):
        parts.append(chunk)
    return b"".join(parts)
