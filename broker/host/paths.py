"""Where a channel's files live: run directory, default ipc address, lock and address files."""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import json
import os
import pwd
import re
import socket
import stat
from pathlib import Path

from zchannel.broker.errors import ChannelNotFound, UnsafeRunDir
from zchannel.broker.host.procs import process_running

NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
IPC_PATH_LIMIT = 107


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(
            f"invalid channel name {name!r}: 1-64 characters of [A-Za-z0-9._-]"
        )
    return name


def run_dir() -> Path:
    """The directory of this user's channel files (sockets, locks, address files), created
    with mode 0700: ``run_dir_path()`` -- ``$ZCHANNEL_RUN_DIR`` (its last component alone is
    created: its parent must exist), else ``$XDG_RUNTIME_DIR/zchannel`` when
    ``$XDG_RUNTIME_DIR`` is a directory of this user, else ``/tmp/zchannel-<uid>``.

    ``UnsafeRunDir`` when it cannot be made, or is not this user's alone (``check_run_dir``)."""
    named = _named_run_dir()
    if named is not None:
        return _private_dir(named, parents=False)
    return _private_dir(run_dir_path())


def run_dir_path() -> Path:
    """Where ``run_dir`` is, an absolute path, neither made nor checked here (``zchannel stat``
    and ``zchannel clean --dry-run`` report a missing one without making it)."""
    named = _named_run_dir()
    if named is not None:
        return named
    if _own_dir(os.environ.get("XDG_RUNTIME_DIR")):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "zchannel"
    return _tmp_dir()


def _named_run_dir() -> Path | None:
    """``$ZCHANNEL_RUN_DIR`` as an absolute path (None: not set).  A relative one is resolved
    against the working directory once, the first time it is read, and the variable is set to
    the absolute path: the ipc addresses made there (the address file's, the one a broker
    announces) then name the same socket from any working directory, and this process after
    a ``chdir`` and the processes it starts (which inherit the variable) use the same
    directory.  Symbolic links are kept, not resolved (``check_run_dir`` checks a link's
    owner)."""
    base = os.environ.get("ZCHANNEL_RUN_DIR")
    if not base:
        return None
    if not os.path.isabs(base):
        base = os.environ["ZCHANNEL_RUN_DIR"] = os.path.abspath(base)
    return Path(base)


def _tmp_dir() -> Path:
    return Path(f"/tmp/zchannel-{os.getuid()}")


# what a refused run directory's message offers besides removing it: another directory
YOURS = "a directory of yours with mode 0700, or a new path in one: zchannel makes it so"
ELSEWHERE = f"set ZCHANNEL_RUN_DIR to {YOURS}"


def _private_dir(path: Path, parents: bool = True) -> Path:
    """``path``, created with mode 0700 if missing -- with its missing parents (``parents``,
    zchannel's default locations), or alone (``$ZCHANNEL_RUN_DIR``: never a tree of the
    user's mistyping); ``UnsafeRunDir`` when it cannot be made, or unless it is this user's
    alone (``check_run_dir``)."""
    if not os.path.lexists(path):
        named = "" if parents else " (ZCHANNEL_RUN_DIR)"
        try:
            path.mkdir(mode=0o700, parents=parents)
        except FileExistsError:  # made meanwhile: check_run_dir looks at what it is
            pass
        except FileNotFoundError:
            raise UnsafeRunDir(
                f"run directory {path}{named} cannot be made: its parent {path.parent} does "
                f"not exist (zchannel makes the last component only); create the parent, or "
                f"{ELSEWHERE}") from None
        except OSError as exc:
            raise UnsafeRunDir(f"run directory {path}{named} cannot be made "
                               f"({exc.strerror}): {ELSEWHERE}") from None
    check_run_dir(path)
    return path


def _own_dir(path: str | None) -> bool:
    """Whether ``path`` is an absolute path of a directory owned by this user
    (``$XDG_RUNTIME_DIR`` left set by ``sudo`` or ``su`` names another user's; a relative one
    is invalid, as the XDG Base Directory specification says, and ignored)."""
    if not path or not os.path.isabs(path):
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def _default_location(path: Path) -> bool:
    """Whether ``path`` is one of zchannel's own run directories (``/tmp/zchannel-<uid>``,
    ``$XDG_RUNTIME_DIR/zchannel``), which a refusal may tell to remove; any other is a
    directory the user named (``$ZCHANNEL_RUN_DIR``: ``/etc``, ``/tmp``...), never so."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return path == _tmp_dir() or bool(xdg) and path == Path(str(xdg)) / "zchannel"


def check_run_dir(path: Path) -> None:
    """Refuse (``UnsafeRunDir``) a run directory that is not this user's alone: it must be a
    directory owned by this user (as must a symbolic link naming it), and its mode must give
    others nothing.  Another user could otherwise replace a broker's socket or address file
    and receive the next connection (``docs/security.md``).  Nothing is changed: files
    planted while the directory was open stay planted, so a wider mode is refused rather
    than narrowed.  The message offers removing it only for zchannel's own default
    locations (``_default_location``); a directory the user named is theirs to keep: the
    fix is another ``ZCHANNEL_RUN_DIR``."""
    uid = os.getuid()
    if _default_location(path):
        fix = f"remove it (rm -r {path}) if no broker of yours runs there, or {ELSEWHERE}"
        widened = (f"remove it (rm -r {path}) if no broker of yours runs there, or check its "
                   f"files and chmod 700 it, or {ELSEWHERE}")
        foreign = f"ask them (or root) to remove it, or {ELSEWHERE}"
    else:
        fix = foreign = f"choose another ZCHANNEL_RUN_DIR ({YOURS})"
        widened = (f"{fix}; a directory you made for zchannel alone may be used once you have "
                   "checked its files and made it mode 0700")
    try:
        link = os.lstat(path)
        st = os.stat(path)
    except OSError as exc:
        raise UnsafeRunDir(f"run directory {path} cannot be used ({exc.strerror}): "
                           f"{fix}") from None
    if stat.S_ISLNK(link.st_mode) and link.st_uid != uid:
        raise UnsafeRunDir(
            f"run directory {path} is a symbolic link owned by {_owner(link.st_uid)}, not by "
            f"this user ({_owner(uid)}): its owner can point it elsewhere; {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRunDir(f"run directory {path} is not a directory: {fix}")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != uid:
        raise UnsafeRunDir(
            f"run directory {path} is owned by {_owner(st.st_uid)} with mode {mode:04o}, not "
            f"by this user ({_owner(uid)}): its owner could replace a broker's socket and "
            f"receive the next connection; {foreign}")
    if mode & 0o077:
        raise UnsafeRunDir(
            f"run directory {path} (owned by {_owner(uid)}) has mode {mode:04o}: other users "
            f"may have placed files in it (a socket, an address file); {widened}")


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def default_address(name: str) -> str:
    path = str(run_dir() / f"{name}.sock")
    if len(path) > IPC_PATH_LIMIT:
        digest = hashlib.sha1(name.encode()).hexdigest()[:16]
        path = str(run_dir() / f"{digest}.sock")
        if len(path) > IPC_PATH_LIMIT:  # a run directory with a long path: the short one
            path = str(_private_dir(_tmp_dir()) / f"{digest}.sock")
    return f"ipc://{path}"


def lock_path(name: str) -> Path:
    return run_dir() / f"{name}.lock"


def addr_path(name: str) -> Path:
    return run_dir() / f"{name}.addr"


def try_lock(name: str) -> int | None:
    """Open and ``flock`` the channel's lock file without blocking; the fd, or None if held.

    A holder removes the file before it lets go (``release_lock``), so a lock taken on a file
    that is no longer the one at the path is worthless: it is dropped and the path opened again
    (flock, then check the inode)."""
    path = lock_path(name)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # its holder removed it between our open and our flock


def write_lock_holder(fd: int) -> None:
    """Write this process's pid into the lock file it holds through ``fd`` (a broker names
    itself there; the lock alone would name the process that took it, which may be the
    broker's creator)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def read_lock_holder(name: str) -> int | None:
    """The pid written in the lock file of ``name`` (``write_lock_holder``), or None."""
    try:
        text = lock_path(name).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def release_lock(name: str, fd: int) -> None:
    """Remove the lock file of ``name`` while still holding it through ``fd``, then close
    ``fd`` (a starter that opened the old file sees it is gone: ``try_lock``)."""
    path = lock_path(name)
    try:
        if _same_file(fd, path):
            path.unlink()
    finally:
        os.close(fd)


def release_lock_if_held(name: str, fd: int) -> None:
    """``release_lock`` if ``fd`` is still open on the lock file of ``name`` (else nothing, and
    ``fd`` is left alone: closed already, its number may be another file's now)."""
    try:
        held = _same_file(fd, lock_path(name))
    except OSError:
        held = False
    if held:
        release_lock(name, fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def read_address(name: str) -> str | None:
    try:
        text = addr_path(name).read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def write_address(name: str, address: str) -> None:
    tmp = addr_path(name).with_suffix(f".addr.{os.getpid()}.tmp")  # replicas may race here
    tmp.write_text(address + "\n")
    os.replace(tmp, addr_path(name))


def remove_address(name: str, address: str) -> None:
    if read_address(name) == address:
        try:
            addr_path(name).unlink()
        except FileNotFoundError:
            pass


def gate_paths(ipc: str) -> tuple[str, str, str] | None:
    """The files of an ipc address's gate (``server/admission.py``): a second name of the
    broker's socket, the socket that stands in for it while the broker refuses connections,
    and a temporary name; None when the stand-in's path would pass the ipc path limit."""
    if not ipc or ipc.startswith("@") or len((ipc + ".g").encode()) > IPC_PATH_LIMIT:
        return None
    return ipc + ".z", ipc + ".g", ipc + ".t"


def token_path(lock_name: str) -> Path:
    """The file holding the shutdown token of the broker holding lock ``lock_name`` (the
    channel name, or ``NAME.replicaI`` for one replica of a distributed channel)."""
    return run_dir() / f"{lock_name}.token"


def write_token_file(lock_name: str, address: str, token: str,
                     curve_public_key: str | None = None) -> Path:
    """Write ``{"address", "pid", "token"}`` (and the broker's CURVE public key, z85, when it
    has one: ``zchannel broker stop`` and ``stat`` connect with it and the client's own key
    pair) to ``token_path(lock_name)``, readable by its owner only (mode 0600, created so:
    never readable by others, not even for a moment)."""
    path = token_path(lock_name)
    tmp = path.with_suffix(f".token.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        record = {"address": address, "pid": os.getpid(), "token": token}
        if curve_public_key:
            record["curve_public_key"] = curve_public_key
        os.write(fd, json.dumps(record).encode() + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_token_file(lock_name: str) -> dict | None:
    """The ``{"address", "pid", "token"}`` (and ``"curve_public_key"``) a running broker
    wrote (None: no such file).  ``ChannelNotFound`` when the file is left from a broker that
    is gone (``lock_free``: its lock is held by nobody; where that cannot be told, its pid
    runs no more): its address may be another broker's by now."""
    path = token_path(lock_name)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the shutdown token file {path}: {exc}") from None
    if not (isinstance(data, dict) and isinstance(data.get("token"), str)
            and isinstance(data.get("address"), str)):
        raise ValueError(f"{path} is not a shutdown token file")
    gone = _writer_gone(lock_name, data.get("pid"))
    if gone:
        raise ChannelNotFound(
            f"no broker serves {lock_name!r} on this host: its shutdown token file {path} is "
            f"left from a broker that is gone ({gone}), and {data['address']} may be another "
            "broker's now; `zchannel clean` removes the file")
    return data


def _writer_gone(lock_name: str, pid: object) -> str | None:
    """Why the broker that held lock ``lock_name`` (process ``pid``, from its token file) is
    known to be gone, or None: nobody holds the lock, or -- where ``/proc/locks`` cannot tell
    that -- its process runs no more."""
    flocked = flocked_inodes()
    if flocked is not None:
        return "nobody holds its lock" if lock_free(lock_name, flocked) else None
    if isinstance(pid, int) and not process_running(pid):
        return f"its process {pid} runs no more"
    return None


def replica_addresses(name: str) -> list[str]:
    """The addresses of the replicas of distributed channel ``name`` that run on this host, from
    their token files (``NAME.replicaI.token``; a killed replica's file is left: it is skipped,
    as is the file of a channel merely named so: ``replica_channel``).  Each replica serves the
    whole channel (its hello carries the table), so any one of them will do when the ``.addr``
    file's replica is gone."""
    found = []
    for path in sorted(run_dir().glob(f"{check_name(name)}.replica*.token")):
        lock_name = path.name.removesuffix(".token")
        if replica_channel(lock_name) != name:
            continue
        try:
            data = read_token_file(lock_name)
        except (ValueError, ChannelNotFound):
            continue
        pid = data.get("pid") if data else None
        if data is None or not isinstance(pid, int) or not process_running(pid):
            continue
        found.append(data["address"])
    return found


_REPLICA_LOCK = re.compile(r"^(?P<channel>.+)\.replica[0-9]+\Z")


def replica_channel(lock_name: str) -> str | None:
    """The distributed channel whose replica goes by ``lock_name`` (``NAME.replicaI``: its lock,
    token and shared-memory names), None for any other name.  A channel of its own may be named
    like that (``foo.replica0``); its broker writes an address file of that name, which a
    replica never does (the replicas of ``NAME`` write ``NAME.addr``), so a lock name with an
    address file of its own is that channel's, not a replica's."""
    found = _REPLICA_LOCK.match(lock_name)
    if found is None or addr_path(lock_name).exists():
        return None
    return found.group("channel")


def flocked_inodes() -> set[int] | None:
    """The inodes of the files with a lock, from ``/proc/locks`` (None when it cannot be
    read); looking there takes no lock, so it never makes a starter back off.  Every kind of
    lock counts (``flock`` locks show as ``POSIX`` ones on NFS), waiters do not.  Inodes only:
    on an overlay file system the device there differs from ``stat``'s, and a match by chance
    only makes a free lock look held, never the reverse."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = set()
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[1] != "->":
            try:
                found.add(int(parts[5].rsplit(":", 1)[1]))
            except (IndexError, ValueError):
                continue
    return found


def lock_free(lock_name: str, flocked: set[int] | None) -> bool:
    """Whether the lock of ``lock_name`` is known to be held by no broker: its file is missing,
    or no lock is on it (its inode is not among ``flocked``: ``flocked_inodes``) and the pid its
    last holder wrote in it (``write_lock_holder``) runs no more.  False while it is held, and
    when ``flocked`` is None (``/proc/locks`` could not be read: nothing can be told)."""
    if flocked is None:
        return False
    try:
        if os.stat(lock_path(lock_name)).st_ino in flocked:
            return False
    except FileNotFoundError:
        return True
    holder = read_lock_holder(lock_name)
    return holder is None or not process_running(holder)


def nobody_serves(name: str) -> bool:
    """Whether no broker of channel ``name`` runs from this run directory, as its locks tell:
    neither the channel's own nor a replica's (``NAME.replicaI``) is held.  False when that
    cannot be told (``lock_free``).  A broker holds its lock for as long as it runs, so the
    ``.addr`` and token files of a channel that nobody serves are a killed broker's."""
    flocked = flocked_inodes()
    replicas = [path.name.removesuffix(".lock")
                for path in run_dir().glob(f"{check_name(name)}.replica*.lock")]
    return all(lock_free(lock, flocked)
               for lock in [name, *(r for r in replicas if replica_channel(r) == name)])


def remove_token_file(lock_name: str) -> None:
    try:
        token_path(lock_name).unlink()
    except FileNotFoundError:
        pass


def is_address(text: str) -> bool:
    return text.startswith(("ipc://", "tcp://"))


def ipc_path(address: str) -> str | None:
    return address[len("ipc://"):] if address.startswith("ipc://") else None


def tcp_host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp://HOST:PORT`` address (None: not one); ``ValueError`` for a
    port outside 0-65535 (ZeroMQ would take it modulo 65536)."""
    if not address.startswith("tcp://"):
        return None
    rest = address[len("tcp://"):]
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    try:
        number = int(port)
    except ValueError:
        return None
    if not 0 <= number <= 65535:
        raise ValueError(f"address {address!r}: port {number} is not in 0-65535")
    return host, number


def probe(address: str) -> None:
    """Raise ``ChannelNotFound`` at once when nothing can be listening at ``address``."""
    ipc = ipc_path(address)
    if ipc is not None:
        if not os.path.exists(ipc):
            raise ChannelNotFound(f"no broker at {address} (no socket file)")
        if nothing_listens(address):  # a killed broker's socket file stays behind
            raise ChannelNotFound(f"no broker at {address} (its socket file is left from a "
                                  "broker that is gone: nothing listens on it)")
        return
    hp = tcp_host_port(address)
    if hp is None:
        raise ValueError(f"address must be ipc://PATH or tcp://HOST:PORT, got {address!r}")
    try:
        with socket.create_connection(hp, timeout=2.0):
            pass
    except ConnectionRefusedError:
        raise ChannelNotFound(f"no broker at {address} (connection refused)") from None
    except OSError:
        pass  # unreachable or slow: let the hello decide


def socket_file_removed(address: str) -> bool:
    """True when ``address`` is an ipc path whose socket file is gone: the broker that served
    it stopped and removed it (a killed one leaves it: ``nothing_listens`` tells that apart).
    A file-system lookup only; no connection reaches a broker still there.  False for tcp and
    abstract ipc addresses."""
    path = _socket_file(address)
    return path is not None and not os.path.lexists(path)


def _socket_file(address: str) -> str | None:
    """The socket file of an ipc ``address``; None for tcp and abstract ipc addresses."""
    path = ipc_path(address)
    return path if path and not path.startswith("@") else None


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"),
          (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"))


def clear_socket_file(path: str, address: str | None = None) -> None:
    """Make room at ``path`` for a socket (of ``address``, which the error names first): remove
    the socket file a broker that is gone left there (the caller knows nothing listens on it),
    nothing when the path is free.  Anything else there -- a regular file, a directory, a
    symbolic link (never followed) -- is not a broker's to remove: ``FileExistsError`` naming
    ``path`` and what it is."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "a device")
        raise FileExistsError(f"{f'cannot bind {address}: ' if address else ''}{path} exists "
                              f"and is not a socket (it is {kind}): not removing it; choose "
                              "another address")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def socket_identity(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the socket file at ``path`` (None: no socket file there)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def remove_socket_file(path: str, made: tuple[int, int] | None) -> None:
    """Remove the socket file at ``path`` if it is still the one ``made`` identifies
    (``socket_identity`` when it was bound); anything else there, or nothing made, is left."""
    if made is not None and socket_identity(path) == made:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def nothing_listens(address: str) -> bool:
    """True when ``address`` is an ipc path at which no process listens any more (no socket
    file, or the connection is refused): the broker that served it stopped or was killed.
    False for tcp and whenever it cannot tell."""
    path = _socket_file(address)
    if path is None:
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False
    finally:
        sock.close()
    return False


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(
                ipaddress.ip_address(info[4][0]).is_loopback
                for info in socket.getaddrinfo(host, None)
            )
        except (OSError, ValueError):
            return False


INSECURE_REMEDY = ("give curve_keys with a server_secret_key (zchannel keygen), or "
                   "insecure=True on a trusted network")


def check_bind_address(address: str, secure: bool, insecure: bool, *,
                       remedy: str = INSECURE_REMEDY) -> None:
    """Refuse a non-loopback tcp bind without CURVE keys unless ``insecure``; ``secure`` means
    the broker authenticates its clients (its secret key and the directory of the clients'
    public keys: a secret key alone encrypts, but lets any client with a key pair in).  The
    error ends with ``remedy``, in the terms of the caller's user (the Python arguments by
    default, the command's flags for the CLI)."""
    hp = tcp_host_port(address)
    if hp is None:
        if not address.startswith("ipc://"):
            raise ValueError(f"address must be ipc://PATH or tcp://HOST:PORT, got {address!r}")
        return
    host, _ = hp
    if host in ("*", "0.0.0.0", "::") or not is_loopback_host(host):
        if not (secure or insecure):
            raise ValueError(
                f"refusing to bind {address} (not loopback) without CURVE keys (a secret key "
                f"and the clients' public keys): {remedy}")


def bind_warnings(address: str, secure: bool, encrypted: bool = False) -> list[str]:
    """What a broker binding ``address`` warns about: a non-loopback tcp address without
    CURVE (allowed by ``insecure``), a loopback tcp address without CURVE (any local user
    can connect), and CURVE without the clients' public keys (``encrypted`` but not
    ``secure``: any client with a key pair gets in); nothing for ipc or CURVE with the
    clients' keys (``docs/security.md``)."""
    hp = tcp_host_port(address)
    if hp is None or secure:
        return []
    if encrypted:
        return [f"{address} uses CURVE without the clients' public keys (no "
                "--curve-public-keys): traffic is encrypted, but any client with a key pair "
                "can connect and put, get and read items"]
    host, _ = hp
    if host in ("*", "0.0.0.0", "::") or not is_loopback_host(host):
        return [f"{address} is bound without CURVE (insecure): anyone who can reach it can "
                "put, get and read every item; give the broker CURVE keys (zchannel keygen) "
                "unless the network is trusted"]
    return [f"{address} has no authentication (tcp without CURVE): any local user can "
            "connect and put, get and read items; use an ipc address (its directory is this "
            "user's alone) or CURVE keys"]

