"""What this host's run directory holds: the brokers serving from it and stale entries.

A broker holds its channel's lock file (``paths.try_lock``) for as long as it runs, and
removes its files when it exits.  A broker that was killed leaves them: its lock file (held by
nobody), address file, shutdown token file, ipc socket file, direct-link socket and
shared-memory segments.  Those
are *stale*; ``zchannel stat`` lists them and ``zchannel clean`` removes them (``clean``).
A socket file is never a stale entry while a process listens at it or a live broker's address
names it: another broker may have taken over the address of a killed one.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from zchannel.broker.host import paths
from zchannel.broker.host.procs import pid_alive
from zchannel.broker.shm.segment import SHM_DIR, list_segments, run_prefix
from zchannel.broker.transport import direct_framing


@dataclass
class HostBroker:
    """A channel with a live broker (or live replicas) in the run directory."""

    name: str
    address: str | None
    locks: list[str]  # the lock names held: NAME and/or NAME.replicaI


@dataclass
class StaleEntry:
    """The leftovers of a channel without a live broker (absolute paths)."""

    name: str
    files: list[str] = field(default_factory=list)
    locks: list[str] = field(default_factory=list)  # lock names among ``files``
    live: bool = False  # the channel runs (replicas): only its free lock files are stale
    # the socket files among ``files`` and their ``paths.socket_identity`` when listed: one
    # made there since (a broker that took the address over) is not removed
    sockets: dict[str, tuple[int, int]] = field(default_factory=dict)

    def add(self, paths_found: Iterable[str]) -> None:
        """List ``paths_found`` (the identity of each socket file among them too)."""
        for path in paths_found:
            self.files.append(path)
            made = paths.socket_identity(path)
            if made is not None:
                self.sockets[path] = made


def lock_holder(lock_name: str) -> int | None:
    """The pid of the broker that holds the lock of ``lock_name``: the one it wrote in the
    lock file, while the lock is held (None when that cannot be told)."""
    if not _held(lock_name, paths.flocked_inodes()):
        return None
    pid = paths.read_lock_holder(lock_name)
    return pid if pid is not None and pid_alive(pid) else None


def _held(lock_name: str, flocked: set[int] | None) -> bool:
    """Whether a process holds the lock file of ``lock_name`` (never creates it)."""
    path = paths.lock_path(lock_name)
    if flocked is not None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        return st.st_ino in flocked
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops a lock we took
    return False


def _channel_of(lock_name: str) -> str:
    """The channel a lock name is of: the distributed channel of a replica's
    (``paths.replica_channel``), else the channel of that name."""
    return paths.replica_channel(lock_name) or lock_name


def _address_files(address: str | None) -> list[str]:
    """The socket files of an ipc address (the socket, its direct-link socket and its gate's
    files) that are there; a path holding anything but a socket (a file the user put there
    since) is no broker's to remove."""
    ipc = paths.ipc_path(address or "")
    if not ipc or ipc.startswith("@"):
        return []
    link = direct_framing.link_path(ipc)
    return [p for p in (ipc, link, *(paths.gate_paths(ipc) or ()))
            if p and paths.socket_identity(p) is not None]


def _left_at(address: str | None, taken: set[str]) -> list[str]:
    """The socket files a broker that is gone left at ``address`` (``_address_files``): none
    while a process listens there (a broker took the address over, or the path names another
    broker's socket), and none that a live broker's address names (``taken``)."""
    files = [path for path in _address_files(address) if path not in taken]
    if files and address and not paths.nothing_listens(address):
        return []
    return files


def _listening(path: str) -> bool:
    """Whether a process listens at the socket file ``path`` (True when that cannot be told)."""
    return not paths.nothing_listens(f"ipc://{path}")


def scan() -> tuple[list[HostBroker], list[StaleEntry]]:
    """The live brokers and the stale entries of the run directory (and of ``/dev/shm``)."""
    rd = paths.run_dir()
    found = _RunDirFiles.read(rd)
    names = found.names
    prefix = run_prefix(str(rd))
    # channel name -> its lock names (the channel's, or its replicas') -> their segments
    segments: dict[str, dict[str, list[str]]] = {}
    for seg in list_segments(prefix):
        lock_name = seg[len(prefix):].split("+", 1)[0]
        name = _channel_of(lock_name)
        segments.setdefault(name, {}).setdefault(lock_name, []).append(os.path.join(SHM_DIR, seg))
        names.setdefault(name, [])
    flocked = paths.flocked_inodes()
    held = {name: [lock for lock in sorted(locks) if _held(lock, flocked)]
            for name, locks in names.items()}
    taken = {path for name in names if held[name] for path in _channel_addresses(name)}
    live: list[HostBroker] = []
    stale: list[StaleEntry] = []
    claimed: set[str] = set()  # socket files that belong to a known channel
    for name in sorted(names):
        broker, leftover = _channel_files(name, sorted(names[name]), held[name], taken, claimed,
                                          segments.get(name, {}))
        if broker is not None:
            live.append(broker)
        if leftover.files:
            stale.append(leftover)
    for name, path in found.tmp_files:
        pid = path.name.rsplit(".", 2)[-2]
        if not (pid.isdigit() and pid_alive(int(pid))):
            _add(stale, name, str(path))
    for lock_name, path in found.tokens:
        if not _held(lock_name, flocked):
            _add(stale, _channel_of(lock_name), str(path))
    for path in found.sockets:  # a socket no channel's address names: a broker's left there
        if str(path) not in claimed and not _listening(str(path)):
            _add(stale, path.name.split(".sock")[0], str(path))
    return live, stale


def _channel_addresses(name: str) -> list[str]:
    """The socket files at channel ``name``'s addresses: the one its ``.addr`` file names and
    its default one (``_address_files``)."""
    if not paths.NAME_RE.match(name):
        return []
    return _address_files(paths.read_address(name)) + _address_files(paths.default_address(name))


@dataclass
class _RunDirFiles:
    """The files of the run directory, by kind."""

    names: dict[str, list[str]] = field(default_factory=dict)  # channel name -> its locks
    tmp_files: list[tuple[str, Path]] = field(default_factory=list)
    sockets: list[Path] = field(default_factory=list)
    tokens: list[tuple[str, Path]] = field(default_factory=list)

    @classmethod
    def read(cls, rd: Path) -> _RunDirFiles:
        found = cls()
        for entry in sorted(rd.iterdir()):
            fname = entry.name
            if fname.endswith(".lock"):
                lock_name = fname[: -len(".lock")]
                found.names.setdefault(_channel_of(lock_name), []).append(lock_name)
            elif fname.endswith(".addr"):
                found.names.setdefault(fname[: -len(".addr")], [])
            elif fname.endswith(".tmp") and ".addr." in fname:
                found.tmp_files.append((fname.split(".addr.")[0], entry))
            elif fname.endswith((".sock", ".sock.d", ".sock.z", ".sock.g", ".sock.t")):
                found.sockets.append(entry)
            elif fname.endswith(".token"):  # a shutdown token: NAME or NAME.replicaI
                found.tokens.append((fname[: -len(".token")], entry))
        return found


def _channel_files(name: str, locks: list[str], held: list[str], taken: set[str],
                   claimed: set[str], segments: dict[str, list[str]]
                   ) -> tuple[HostBroker | None, StaleEntry]:
    """Channel ``name``'s live broker (None: none of its ``locks`` is ``held``) and its stale
    files; the socket files its addresses name are added to ``claimed``, and those a live
    broker uses (``taken``, or a process listens there: ``_left_at``) are never stale.
    ``segments``: its shared-memory segments by the lock name of the broker that made them (a
    replica's own): those of a broker whose lock is held are live."""
    address = paths.read_address(name) if paths.NAME_RE.match(name) else None
    claimed.update(_channel_addresses(name))
    leftover = StaleEntry(name, live=bool(held))
    leftover.locks = [lock for lock in locks if lock not in held]
    leftover.add(str(paths.lock_path(lock)) for lock in leftover.locks)
    dead_segments = [seg for lock, segs in sorted(segments.items()) if lock not in held
                     for seg in segs]
    if held:
        leftover.add(dead_segments)  # a replica that died while others serve
        return HostBroker(name, address, held), leftover
    if paths.addr_path(name).exists():
        leftover.add([str(paths.addr_path(name))])
    own = set(_left_at(address, taken))
    if paths.NAME_RE.match(name):
        own.update(_left_at(paths.default_address(name), taken))
    leftover.add(sorted(own) + dead_segments)
    return None, leftover


def _add(stale: list[StaleEntry], name: str, path: str) -> None:
    for entry in stale:
        if entry.name == name:
            entry.add([path])
            return
    entry = StaleEntry(name)
    entry.add([path])
    stale.append(entry)


def clean() -> list[str]:
    """Remove every stale entry; the paths removed.  A channel's files are removed while
    holding its lock (taken, or created and taken), so a broker that starts meanwhile either
    waits for it or keeps its files; lock files go last (``paths.release_lock``)."""
    removed: list[str] = []
    for entry in scan()[1]:
        removed += _clean(entry)
    return removed


def clean_channel(name: str, addresses: tuple[str, ...] = ()) -> list[str]:
    """Remove the stale entries of channel ``name`` only (its broker, started by this process,
    died without removing them: SIGKILL, OOM); the paths removed.  Live brokers keep theirs.
    ``addresses``: the channel's ipc addresses outside its default place (a cluster file's
    replicas), whose socket files go too when no broker of the channel runs."""
    removed: list[str] = []
    for entry in scan()[1]:
        if entry.name == name:
            if not entry.live:
                entry.add(f for a in addresses for f in _left_at(a, set())
                          if f not in entry.files)
            removed += _clean(entry)
    return removed


def _clean(entry: StaleEntry) -> list[str]:
    locks = list(entry.locks)
    if not entry.live and paths.NAME_RE.match(entry.name) and entry.name not in locks:
        locks.append(entry.name)  # no lock file: hold one while removing the rest
    held: list[tuple[str, int]] = []
    removed: list[str] = []
    try:
        for lock in locks:
            fd = paths.try_lock(lock)
            if fd is None:
                return []  # a broker took it since the scan: leave the channel alone
            held.append((lock, fd))
        lock_files = {str(paths.lock_path(lock)) for lock in locks}
        for path in entry.files:
            if path not in lock_files and not entry.live and _still_stale(entry, path):
                try:
                    os.unlink(path)
                    removed.append(path)
                except FileNotFoundError:
                    pass
                except PermissionError:  # not this user's to remove: left alone
                    pass
        while held:
            lock, fd = held.pop()
            existed = lock in entry.locks
            paths.release_lock(lock, fd)
            if existed:
                removed.append(str(paths.lock_path(lock)))
    finally:
        for _, fd in held:
            os.close(fd)
    return removed


def _still_stale(entry: StaleEntry, path: str) -> bool:
    """Whether ``path`` of ``entry`` may be removed now: any file but a socket file; a socket
    file only while it is the one listed and nothing listens at it (a broker of another name
    may have taken the address over since: the channel's lock does not keep it out)."""
    made = entry.sockets.get(path)
    if made is None:
        return paths.socket_identity(path) is None
    return paths.socket_identity(path) == made and not _listening(path)
