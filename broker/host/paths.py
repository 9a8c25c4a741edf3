"""Where a channel's files live: run directory, default ipc address, lock and address files."""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import os
import re
import socket
from pathlib import Path

from zchannel.broker.errors import ChannelNotFound

NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
IPC_PATH_LIMIT = 107


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(
            f"invalid channel name {name!r}: 1-64 characters of [A-Za-z0-9._-]"
        )
    return name


def run_dir() -> Path:
    """``$ZCHANNEL_RUN_DIR``, else ``$XDG_RUNTIME_DIR/zchannel``, else ``/tmp/zchannel-<uid>``;
    created with mode 0700."""
    base = os.environ.get("ZCHANNEL_RUN_DIR")
    if base:
        path = Path(base)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "zchannel"
    else:
        path = Path(f"/tmp/zchannel-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.chmod(path, 0o700)
    except PermissionError:
        pass
    return path


def default_address(name: str) -> str:
    path = str(run_dir() / f"{name}.sock")
    if len(path) > IPC_PATH_LIMIT:
        digest = hashlib.sha1(name.encode()).hexdigest()[:16]
        path = str(run_dir() / f"{digest}.sock")
        if len(path) > IPC_PATH_LIMIT:
            path = f"/tmp/zchannel-{os.getuid()}-{digest}.sock"
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


def is_address(text: str) -> bool:
    return text.startswith(("ipc://", "tcp://"))


def ipc_path(address: str) -> str | None:
    return address[len("ipc://"):] if address.startswith("ipc://") else None


def tcp_host_port(address: str) -> tuple[str, int] | None:
    if not address.startswith("tcp://"):
        return None
    rest = address[len("tcp://"):]
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    try:
        return host, int(port)
    except ValueError:
        return None


def probe(address: str) -> None:
    """Raise ``ChannelNotFound`` at once when nothing can be listening at ``address``."""
    ipc = ipc_path(address)
    if ipc is not None:
        if not os.path.exists(ipc):
            raise ChannelNotFound(f"no broker at {address} (no socket file)")
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


def nothing_listens(address: str) -> bool:
    """True when ``address`` is an ipc path at which no process listens any more (no socket
    file, or the connection is refused): the broker that served it stopped or was killed.
    False for tcp and whenever it cannot tell."""
    path = ipc_path(address)
    if not path or path.startswith("@"):
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
    """Refuse a non-loopback tcp bind without CURVE keys unless ``insecure``; the error ends
    with ``remedy``, in the terms of the caller's user (the Python arguments by default, the
    command's flags for the CLI)."""
    hp = tcp_host_port(address)
    if hp is None:
        if not address.startswith("ipc://"):
            raise ValueError(f"address must be ipc://PATH or tcp://HOST:PORT, got {address!r}")
        return
    host, _ = hp
    if host in ("*", "0.0.0.0", "::") or not is_loopback_host(host):
        if not (secure or insecure):
            raise ValueError(
                f"refusing to bind {address} (not loopback) without CURVE keys: {remedy}")
