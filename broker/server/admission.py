"""How many connections a broker serves at once, and what it does with more: its descriptor
budget (docs/security.md, "Descriptor budget").

Every connection costs the broker a file descriptor, and libzmq aborts the whole process when
its ipc listener cannot get one (``accept`` failing with ``EMFILE`` is an assertion in
``ipc_listener.cpp``; its tcp listener skips the connection).  So the broker

- raises its soft ``RLIMIT_NOFILE`` to the hard limit when it starts (``raise_fd_limit``);
- serves at most ``max_clients`` connections (ZeroMQ peers and direct links together): by
  default the limit minus a reserve (``client_budget``) that covers its own descriptors
  (sockets, shared-memory segments, files) and the connections libzmq accepts before the
  guard sees them;
- refuses the others: ``PeerGuard``, a thread reading the ROUTER socket's monitor, counts the
  connections libzmq accepts (``EVENT_ACCEPTED``), closes (``shutdown``) each one beyond
  the budget at once, with a log line, and, on an ipc address, closes its ``IpcGate`` while
  the budget is used up: the address's path then names a socket nobody accepts on, so that
  no new connection reaches libzmq at all (and refused peers do not come back every 100 ms)
  until connections leave; the direct-link listener stops accepting meanwhile too
  (connections wait in its backlog, or the clients fall back to ZeroMQ).  The guard also
  recounts the process's open descriptors now and then, so that anything else holding them
  (many shared-memory segments) makes it refuse sooner.

libzmq accepts in its own thread, so the guard sees a connection only after it was accepted:
what libzmq accepts before the guard runs is what the reserve is for.  Closing the gate early
(at ``max_clients``, not at the descriptor limit) keeps that burst bounded by libzmq's listen
backlog plus what arrives while the guard waits to run.

The guard owns the socket's one monitor (libzmq keeps one per socket), so it also collects the
handshake failures the broker logs (``transport/curve_broker.py``, ``BrokerHandshakes``) and wakes the
loop for them through ``wake_fd``.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import threading
import time
from collections import deque

import zmq
from zchannel.broker.host import paths
from zchannel.broker.transport.sockets import HANDSHAKE_FAILED, monitor, read_events

log = logging.getLogger("zchannel.broker")

RESERVE_MIN, RESERVE_MAX = 128, 4096  # descriptors kept for the broker itself (clamped)
SOFT_CAP = 1 << 20  # the soft limit asked for at most (a hard limit may be unlimited)
FLOOR = 64  # free descriptors below which every new connection is refused
RECOUNT_S = 1.0  # how often the guard recounts the process's open descriptors (at most)


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard limit (at most ``SOFT_CAP`` and the
    kernel's ``nr_open``); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = SOFT_CAP if hard == resource.RLIM_INFINITY else min(hard, SOFT_CAP)
    try:
        with open("/proc/sys/fs/nr_open") as f:
            target = min(target, int(f.read()))
    except (OSError, ValueError):
        pass
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the descriptor limit from %d to %d: %s", soft, target, exc)
    return soft


def client_budget(limit: int, max_clients: int) -> int:
    """The connections a broker with descriptor ``limit`` serves at once: ``max_clients``
    (0: as many as the limit allows), at most the limit minus the reserve (a quarter of it,
    128 to 4096 descriptors)."""
    reserve = min(RESERVE_MAX, max(RESERVE_MIN, limit // 4))
    allowed = max(1, limit - reserve)
    if max_clients and max_clients > allowed:
        log.warning("max_clients %d lowered to %d: the descriptor limit is %d (raise it with "
                    "ulimit -n, or LimitNOFILE= under systemd)", max_clients, allowed, limit)
    return min(max_clients, allowed) if max_clients else allowed


def open_fds() -> int:
    """The descriptors this process has open now."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less listdir's own
    except OSError:
        return 0


class PeerGuard:
    """The ZeroMQ connections of a broker's ROUTER socket, counted from its monitor by a thread
    that refuses those beyond the budget (see the module docstring).  ``direct`` is the number
    of direct links (set by the loop); ``close`` stops the thread before the monitor socket
    closes."""

    def __init__(self, sock: zmq.Socket, address: str, max_clients: int, limit: int) -> None:
        self.max_clients = max_clients
        self.gate: IpcGate | None = None  # set by ``bound`` for an ipc address
        self.limit = limit
        self.direct = 0  # direct links, counted by the loop
        self.refused = 0  # connections refused (closed at once) since the start
        self._open: set[int] = set()  # descriptors of the accepted ZeroMQ connections
        self._dropped: set[int] = set()  # ... of those refused, until libzmq closed them
        self._local = _local_address(address)
        self._failures: deque[tuple[int, int]] = deque()
        self._others = 0  # descriptors not of connections, at the last recount
        self._recounted = 0.0
        self._monitor = monitor(sock, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        self._sock = sock
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # handshake failures
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="zchannel-peer-guard", daemon=True)
        self._thread.start()

    def bound(self, address: str) -> None:
        """The socket is bound at ``address`` (a tcp port 0 became a port; an ipc path gets
        its gate)."""
        self._local = _local_address(address)
        ipc = paths.ipc_path(address)
        files = paths.gate_paths(ipc) if ipc else None
        if ipc and files is not None:
            try:
                self.gate = IpcGate(ipc, *files)
            except OSError as exc:  # no hard link to a socket here: refusing still works
                log.warning("no gate for %s (%s): refused peers may come back at once", ipc, exc)
        self._check_gate()

    def _check_gate(self) -> None:
        """Close the gate when the budget is used up, open it again below 90 % of it."""
        gate = self.gate
        if gate is None:
            return
        held = len(self._open) - len(self._dropped) + self.direct
        if not gate.closed and held >= self.max_clients:
            gate.shut()
            log.warning("%s refuses new connections: max_clients (%d) connections held",
                        gate.path, self.max_clients)
        elif gate.closed and held < max(1, self.max_clients * 9 // 10):
            gate.open()
            log.info("%s accepts connections again (%d held)", gate.path, held)

    def links_changed(self) -> None:
        """The loop accepted or dropped direct links (``direct`` is current)."""
        self._check_gate()

    @property
    def connections(self) -> int:
        """Connections held now (ZeroMQ ones the guard has not refused, and direct links)."""
        return len(self._open) - len(self._dropped) + self.direct

    def room(self) -> int:
        """How many more connections may come now."""
        return self.max_clients - len(self._open) - self.direct

    def take_failures(self) -> list[tuple[int, int]]:
        """The handshake failures seen since the last call (the loop, woken by ``wake_fd``)."""
        try:
            os.eventfd_read(self.wake_fd)
        except BlockingIOError:
            pass
        out = []
        while self._failures:
            out.append(self._failures.popleft())
        return out

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._stop_r in ready:
                return
            failed = False
            for event, value in read_events(self._monitor):
                if event == zmq.EVENT_ACCEPTED:
                    self._accepted(value)
                elif event == zmq.EVENT_DISCONNECTED:
                    self._open.discard(value)
                    self._dropped.discard(value)
                    self._check_gate()
                else:
                    self._failures.append((event, value))
                    failed = True
            if failed:
                os.eventfd_write(self.wake_fd, 1)

    def _accepted(self, fd: int) -> None:
        self._open.add(fd)
        over = len(self._open) + self.direct > self.max_clients
        if not over:
            now = time.monotonic()
            if now - self._recounted >= RECOUNT_S or self._others + len(self._open) \
                    + self.direct >= self.limit - FLOOR:
                self._recounted = now  # what else holds descriptors (segments, files)
                self._others = max(0, open_fds() - len(self._open) - self.direct)
            over = self._others + len(self._open) + self.direct >= self.limit - FLOOR
        self._check_gate()
        if over and _refuse(fd, self._local):
            self._dropped.add(fd)
            self.refused += 1
            log.warning("refused a connection: %d connections, max_clients %d (descriptor "
                        "limit %d); it may come back when others leave", len(self._open) - 1
                        + self.direct, self.max_clients, self.limit)

    def close(self) -> None:
        """Stop the thread, then close the monitor (before the socket closes)."""
        os.write(self._stop_w, b"x")
        self._thread.join(10.0)
        if not self._sock.closed:
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        for fd in (self._stop_r, self._stop_w, self.wake_fd):
            os.close(fd)
        if self.gate is not None:
            self.gate.remove()
            self.gate = None


class IpcGate:
    """Which socket an ipc address's path names: the broker's (open) or a stand-in nobody
    accepts on (closed), switched atomically with hard links and ``rename`` (thread-safe).

    ``real`` is a second name of the broker's socket, ``stand_in`` the stand-in's path and
    ``tmp`` where each is linked before it replaces ``path``: the path always names a socket
    that listens, so clients never see it gone.  Connections to the stand-in wait in its
    backlog (beyond it, clients retry later); opening the gate closes them, and their
    clients reconnect to the broker."""

    def __init__(self, path: str, real: str, stand_in: str, tmp: str) -> None:
        self.path, self.real, self.stand_in, self.tmp = path, real, stand_in, tmp
        self.closed = False
        self._lock = threading.Lock()
        for name in (real, stand_in, tmp):  # a broker's left there (else FileExistsError)
            paths.clear_socket_file(name)
        os.link(path, real)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(stand_in)
            os.chmod(stand_in, 0o600)
            self._sock.listen(16)
            self._sock.setblocking(False)
        except OSError:
            self.remove()
            raise

    def shut(self) -> None:
        with self._lock:
            if not self.closed:
                self._point(self.stand_in)
                self.closed = True

    def open(self) -> None:
        with self._lock:
            if self.closed:
                self._point(self.real)
                self.closed = False
                while True:  # those that waited at the stand-in: closed, they reconnect
                    try:
                        self._sock.accept()[0].close()
                    except OSError:
                        break

    def _point(self, target: str) -> None:
        _unlink(self.tmp)
        os.link(target, self.tmp)
        os.replace(self.tmp, self.path)

    def remove(self) -> None:
        """Remove the gate's files, the path naming the broker's socket again if it was shut
        (the path itself stays: its owner removes it, when it is still that socket)."""
        with self._lock:  # (only while the path is still the stand-in: nothing else is replaced)
            stand_in = paths.socket_identity(self.stand_in)
            if self.closed and stand_in and paths.socket_identity(self.path) == stand_in:
                try:
                    self._point(self.real)
                except OSError:
                    pass
            self.closed = False
        self._sock.close()
        for name in (self.real, self.stand_in, self.tmp):
            _unlink(name)


def _unlink(path: str) -> None:
    """Remove the socket file at ``path`` (the gate's own); anything else there is left."""
    if paths.socket_identity(path) is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _local_address(address: str) -> object:
    """What ``getsockname`` says on a connection the socket bound at ``address`` accepted: the
    ipc path, or the tcp port."""
    ipc = paths.ipc_path(address)
    if ipc is not None:
        return ipc
    hp = paths.tcp_host_port(address)
    return hp[1] if hp else None


def _refuse(fd: int, local: object) -> bool:
    """Shut down the connection libzmq accepted as ``fd`` (libzmq then closes it and reports
    it disconnected); False when ``fd`` is no longer such a connection (it was closed, and the
    number reused by then), so that nothing else is touched."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False  # not a socket (any more)
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False  # a listening socket
        name = sock.getsockname()
        if sock.family == socket.AF_UNIX:
            ours = isinstance(name, str) and name == local
        else:
            ours = isinstance(name, tuple) and name[1] == local
        if not ours:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()  # the descriptor stays libzmq's
