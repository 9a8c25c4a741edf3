"""The broker fork server: one process that imported the broker once and forks a broker for each
start request, so that ``Channel.create`` skips the interpreter start and imports (numpy, zmq,
msgpack: ~0.5 s on an idle core, seconds on a loaded one) of ``python -m zchannel.broker``.

Run it as ``python -m zchannel.broker.server.forkserver SOCKET`` and set
``ZCHANNEL_BROKER_FORKSERVER=SOCKET`` in the processes that create channels
(``forkclient.spawn_forked`` is the client side; ``docs/channel.md``, "Starting brokers from a
fork server").  It listens on a Unix socket (mode 0600, and it serves only peers of its own
user), imports the modules published under the ``zchannel.hooks`` entry-point group (so a
broker given one of their hook names resolves it without importing them: ``embodied_trajectory``
imports torch, seconds on a loaded machine; a broker looking up a name not registered scans the
group again on its own path), prints ``ready <socket>`` and serves until SIGTERM/SIGINT (it
runs with the ``GLIBC_TUNABLES`` of ``starting.child_environ``, which it execs itself again to
get); brokers it started keep running (each in its own session, watching the process that created it).

A request carries the broker's config and the requester's environment and working directory,
with four descriptors: the channel lock, the pipe the broker prints ``ready``/``error`` on, the
requester's stderr, and a pipe for the broker's exit status (4 bytes,
``os.waitstatus_to_exitcode``): a broker that stops on request writes its 0 there itself as it
exits (so it is known also once this server is gone), and this server writes any other status
once it has reaped the broker.  The answer is the broker's pid.
"""

from __future__ import annotations

import io
import os
import select
import signal
import socket
import struct
import sys
import traceback
from typing import Any

import msgpack
from zchannel.broker.server.entry import main_from_stdin
from zchannel.broker.server.forkclient import STATUS
from zchannel.broker.server.starting import child_environ
from zchannel.broker.wire import codec
from zchannel.hooks import forget_entry_point_scan, load_entry_points

HEADER = struct.Struct("!Q")  # the length of the request body that follows
FDS = 4  # lock, stdout pipe, stderr, exit pipe
MAX_REQUEST = 64 << 20


def recv_exact(conn: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``conn`` (``ConnectionError`` if it closes first)."""
    parts, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the requester closed the connection mid-request")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class ForkServer:
    """Accepts start requests on ``path`` and forks one broker for each; reaps them and reports
    each one's exit status on the pipe its request gave."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.exit_pipes: dict[int, int] = {}  # broker pid -> write end of its exit pipe
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.listener.bind(path)
        finally:
            os.umask(old)
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
        self.stopping = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)

    def _stop(self, *_: Any) -> None:
        self.stopping = True

    def serve(self) -> None:
        listen_fd = self.listener.fileno()
        while not self.stopping:
            try:
                ready, _, _ = select.select([listen_fd, self.wake_r], [], [], 1.0)
            except InterruptedError:
                ready = []
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            self.reap()
            if listen_fd in ready:
                conn, _ = self.listener.accept()
                with conn:
                    self.handle(conn)
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def reap(self) -> None:
        """Collect exited brokers; write each one's exit status on its exit pipe."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fd = self.exit_pipes.pop(pid, None)
            if fd is not None:
                code = os.waitstatus_to_exitcode(status)
                if code != 0:  # (a broker that exited with 0 wrote it itself)
                    try:
                        os.write(fd, STATUS.pack(code))
                    except OSError:
                        pass
                os.close(fd)

    def handle(self, conn: socket.socket) -> None:
        conn.settimeout(30.0)
        fds: list[int] = []
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            head, fds, _, _ = socket.recv_fds(conn, HEADER.size, FDS)
            if uid != os.getuid():
                raise PermissionError(f"peer uid {uid} is not this server's user")
            if len(head) != HEADER.size or len(fds) != FDS:
                raise ValueError("malformed start request")
            (size,) = HEADER.unpack(head)
            if size > MAX_REQUEST:
                raise ValueError(f"start request of {size} bytes")
            request = msgpack.unpackb(recv_exact(conn, size), raw=False)
            pid = self.fork_broker(request, fds, conn)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(msgpack.packb({"error": f"{type(exc).__name__}: {exc}"}))
            except OSError:
                pass
            return
        lock_fd, out_fd, err_fd, exit_fd = fds
        for fd in (lock_fd, out_fd, err_fd):
            os.close(fd)
        self.exit_pipes[pid] = exit_fd
        try:
            conn.sendall(msgpack.packb({"pid": pid}))
        except OSError:
            pass  # the requester is gone; the broker watches its parent_pid and stops

    def fork_broker(self, request: dict, fds: list[int], conn: socket.socket) -> int:
        config = codec.decode(request["config"])
        env, cwd = dict(request["env"]), str(request["cwd"])
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            conn.close()
            code = self._broker_child(config, env, cwd, fds)
        except BaseException as exc:  # noqa: BLE001 - reported as a start error
            traceback.print_exc()
            os.write(1, f"error {type(exc).__name__}: {exc}\n".encode())
        finally:
            if code == 0:  # stopped on request: say so now, this server may be gone by then
                try:
                    os.write(fds[3], STATUS.pack(0))
                except OSError:
                    pass
            os._exit(code)

    def _broker_child(self, config: dict, env: dict, cwd: str, fds: list[int]) -> int:
        lock_fd, out_fd, err_fd, _ = fds  # (the exit pipe stays open: fork_broker writes 0 on it)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a spawned interpreter's
        for fd in (self.wake_r, self.wake_w, *self.exit_pipes.values()):
            os.close(fd)
        self.listener.close()
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        for src, dst in ((null, 0), (out_fd, 1), (err_fd, 2)):
            os.dup2(src, dst)
            os.close(src)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)  # hook modules the requester's path finds
        forget_entry_point_scan()  # plug-ins on the requester's path, found if a name needs them
        config["lock_fd"] = lock_fd
        body, _ = codec.encode(config)
        sys.stdin = io.TextIOWrapper(io.BytesIO(body))
        code = main_from_stdin()
        sys.stdout.flush()
        sys.stderr.flush()
        return code


def main(argv: list[str] | None = None) -> int:
    """``python -m zchannel.broker.server.forkserver SOCKET``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m zchannel.broker.server.forkserver SOCKET\n")
        return 2
    env = child_environ()
    if env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES"):
        # glibc reads its tunables only at exec: start again with those of a spawned broker
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *args], env)
    server = ForkServer(args[0])
    load_entry_points()  # published hooks imported once here, not in every broker naming one
    sys.stdout.write(f"ready {args[0]}\n")
    sys.stdout.flush()
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
