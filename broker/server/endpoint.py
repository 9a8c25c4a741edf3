"""Where a broker is found on its host: the channel lock, the ROUTER socket (with CURVE when
configured, and the guard of its connection budget reading its monitor), the direct-link listener beside it, and the files that
name them (address file, ipc socket file) or hold its shutdown token (``NAME.token``).

``Endpoint`` takes the lock when made (or adopts ``config.lock_fd``), binds in ``bind``, and
undoes both: ``close`` closes the sockets and removes the address file and the socket files
it made (nothing but a socket file is ever removed: ``clear_address``), ``release_lock`` last
of all lets a successor start.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import zmq
from zchannel.broker.connection.tuning import MAX_BYTES_PER_MESSAGE
from zchannel.broker.host import paths
from zchannel.broker.server import rundir
from zchannel.broker.server.admission import PeerGuard
from zchannel.broker.server.config import BrokerConfig, refuse_abstract_ipc
from zchannel.broker.server.peers import Peers
from zchannel.broker.transport import direct_broker, direct_framing
from zchannel.broker.transport.curve_broker import BrokerHandshakes, RefusalLog, secure_server
from zchannel.broker.transport.curve_keys import load_key_file

log = logging.getLogger("zchannel.broker")


def already_served(name: str, lock_name: str) -> str:
    """The error of a second broker for ``name``: where the running one is (pid, address)."""
    pid, address = rundir.lock_holder(lock_name), paths.read_address(name)
    where = ", ".join(part for part in (f"pid {pid}" if pid else "",
                                        f"at {address}" if address else "") if part)
    return (f"a broker already serves channel {name!r} on this host"
            + (f" ({where})" if where else "")
            + "; stop it, or choose another name (zchannel stat lists this host's brokers)")


def clear_address(address: str) -> None:
    """Make room for a socket at ``address``: an ipc path's socket file a broker that is gone
    left there is removed.  ``ZMQError`` (``EADDRINUSE``) when a process listens at it -- the
    channel lock keeps brokers of one name apart, not brokers of two names given one address
    -- and ``FileExistsError`` when the path is not a socket (a regular file, a directory, a
    symbolic link: ``paths.clear_socket_file``); nothing but a socket file is ever removed.
    ``ValueError`` for a Linux abstract socket (``ipc://@NAME``: ``refuse_abstract_ipc``)."""
    ipc = paths.ipc_path(address)
    if not ipc:
        return
    refuse_abstract_ipc(address)
    if paths.socket_identity(ipc) is not None and not paths.nothing_listens(address):
        raise zmq.ZMQError(zmq.EADDRINUSE, f"cannot bind {address}: Address already in use "
                           "(a process listens at that socket file)")
    paths.clear_socket_file(ipc, address)


class Endpoint:
    """The lock, socket and files of one broker serving channel ``config.name``."""

    def __init__(self, config: BrokerConfig, lock_name: str, fd_limit: int,
                 max_clients: int) -> None:
        self.config = config
        self.fd_limit, self.max_clients = fd_limit, max_clients  # server/admission.py
        self._lock_name = lock_name
        self._lock_fd = config.lock_fd
        if self._lock_fd is None:
            self._lock_fd = paths.try_lock(lock_name)
            if self._lock_fd is None:
                raise RuntimeError(already_served(config.name, lock_name))
        paths.write_lock_holder(self._lock_fd)  # for the error of a second broker of the name
        self.sock: zmq.Socket | None = None
        self.peers: Peers | None = None  # the clients' transports (set by bind)
        self._auth = None
        self._made: tuple[int, int] | None = None  # the socket file bind made (its identity)
        self.handshakes: BrokerHandshakes | None = None  # its security handshakes (set by bind)
        self.guard: PeerGuard | None = None  # its connection budget (set by bind)
        self.token_file: Path | None = None  # where the shutdown token is kept (set by bind)
        self.refusals = RefusalLog()  # refused handshakes, each logged once (broker/transport/curve_broker.py)
        try:
            self.address = (config.address if config.address is not None
                            else paths.default_address(config.name))
            refuse_abstract_ipc(self.address)  # (a replica's, from its cluster file)
            paths.check_bind_address(
                self.address, secure=config.curve_secret_key is not None
                and config.curve_public_keys is not None, insecure=config.insecure)
        except BaseException:
            self.release_lock()
            raise

    def bind(self, token: str) -> str:
        """Bind the socket, write the address file and the shutdown ``token``'s file (readable
        by its owner only), and log what the address exposes (``paths.bind_warnings``).
        ``ZMQError`` for a busy address, ``FileExistsError`` for an ipc path that is not a
        socket (``clear_address``), ``ValueError`` for bad key files: ``close()`` then removes
        what was made."""
        ctx: zmq.Context = zmq.Context.instance()
        sock = self.sock = ctx.socket(zmq.ROUTER)
        peers = self.peers = Peers(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, direct_broker.MAX_QUEUED_MESSAGES)  # a client not reading
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        if self.config.max_message_bytes:
            sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        if self.config.curve_secret_key is not None:
            self._auth = secure_server(sock, self.config.curve_secret_key,
                                       self.config.curve_public_keys, self.refusals)
        self.handshakes = BrokerHandshakes(self._auth is not None, self.refusals)
        # counts the connections from the first one on (before bind), refuses beyond the budget
        self.guard = peers.guard = PeerGuard(sock, self.address, self.max_clients,
                                                  self.fd_limit)
        ipc = paths.ipc_path(self.address)
        clear_address(self.address)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as exc:  # a busy address: say which
            reason = zmq.strerror(exc.errno or 0)
            raise zmq.ZMQError(exc.errno, f"cannot bind {self.address}: {reason}") from None
        if self.address.startswith("tcp://"):
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if ipc:  # the socket file this broker made, and alone removes (``close``)
            self._made = paths.socket_identity(ipc)
            os.chmod(ipc, 0o600)
        self.guard.bound(self.address)
        # beside shared memory only (see transport.open_transport); never around CURVE
        link = direct_framing.link_path(ipc) if ipc and self.config.direct and self._auth is None \
            and self.config.shm_threshold > 0 else None
        if link is not None:
            limit = self.config.max_message_bytes
            try:
                peers.listener = direct_broker.Listener(
                    link, self.config.max_frames + 1, self.config.max_header_bytes, limit,
                    # a client coalesces requests up to MAX_BYTES_PER_MESSAGE, then one more
                    limit + MAX_BYTES_PER_MESSAGE + self.config.max_header_bytes if limit else 0)
            except OSError as exc:  # clients then use ZeroMQ only
                log.warning("no direct link at %s: %s", link, exc)
        paths.write_address(self.config.name, self.address)
        secret_file = self.config.curve_secret_key if self._auth is not None else None
        self.token_file = paths.write_token_file(  # (the public key: for broker stop and stat)
            self._lock_name, self.address, token,
            load_key_file(secret_file, "the broker's CURVE key pair")[0].decode()
            if secret_file is not None else None)
        for warning in paths.bind_warnings(
                self.address, self._auth is not None and self.config.curve_public_keys is not None,
                encrypted=self._auth is not None):
            log.warning("%s", warning)
        return self.address

    def close(self) -> None:
        """Close the sockets and remove the address file and the socket file ``bind`` made
        (the lock stays held)."""
        if self.sock is None:
            return
        if self.guard is not None:  # its thread stops before the monitor and socket close
            self.guard.close()
            self.guard = None
        self.sock.close(linger=0)
        self.sock = None
        if self.peers is not None:
            self.peers.close()
        if self._auth is not None:
            self._auth.stop()
        paths.remove_address(self.config.name, self.address)
        paths.remove_token_file(self._lock_name)
        ipc = paths.ipc_path(self.address)
        if ipc:  # only the socket bind made: never a file that took its path meanwhile
            paths.remove_socket_file(ipc, self._made)

    def release_lock(self) -> None:
        """Release the channel lock: a successor may start."""
        if self._lock_fd is not None:
            paths.release_lock(self._lock_name, self._lock_fd)
            self._lock_fd = None
