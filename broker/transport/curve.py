"""CURVE on the client's end: its key settings (``CurveKeys``) and the handshake events of its
socket.

A CURVE mismatch is told apart from a missing broker by the socket's handshake events
(``zmq_socket_monitor``): a client fails at once with ``AuthenticationFailed`` naming the cause
(``HandshakeWatch``).  Key files: ``transport/curve_keys.py``; the broker's end (its ZAP
authenticator, the refusals it logs): ``transport/curve_broker.py``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth
from zchannel.broker.errors import AuthenticationFailed
from zchannel.broker.host import paths
from zchannel.broker.transport.curve_keys import load_key_file
from zchannel.broker.transport.sockets import HANDSHAKE_FAILED, monitor, read_events


@dataclass(frozen=True)
class CurveKeys:
    """A client's CURVE settings: its own secret file and the broker's public file."""

    secret_key: str
    server_public_key: str

    def load(self) -> tuple[bytes, bytes, bytes]:
        """(public, secret, server public) keys; ``ValueError`` naming a file that does not
        hold what it should."""
        public, secret = load_key_file(self.secret_key, "the client's CURVE key pair")
        if secret is None:
            raise ValueError(f"{self.secret_key} holds no secret key: a client needs its own "
                             "NAME.key_secret file (zchannel keygen)")
        server_public, _ = load_key_file(self.server_public_key, "the broker's CURVE public key")
        return public, secret, server_public

    def apply(self, sock: zmq.Socket) -> None:
        public, secret, server_public = self.load()
        try:
            sock.curve_publickey = public
            sock.curve_secretkey = secret
            sock.curve_serverkey = server_public
        except zmq.ZMQError as exc:
            raise ValueError(f"malformed CURVE key in {self.secret_key} or "
                             f"{self.server_public_key}: {exc}") from None


@dataclass(frozen=True)
class ReplicaCurveKeys(CurveKeys):
    """A client's key pair file and one broker's public key as z85 text (a replica's, from a
    distributed channel's replica table; a broker's of this host, from its token file)."""

    def load(self) -> tuple[bytes, bytes, bytes]:
        public, secret = load_key_file(self.secret_key, "the client's CURVE key pair")
        if secret is None:
            raise ValueError(f"{self.secret_key} holds no secret key")
        return public, secret, self.server_public_key.encode()


# how a Python program gives a client its keys (``KeySettings``)
_PYTHON_REMEDY = ("pass curve_keys=(own .key_secret, broker's .key), set "
                  "ZCHANNEL_CURVE_SECRET_KEY and ZCHANNEL_CURVE_SERVER_KEY, or connect to a "
                  "distributed channel through its cluster file ($ZCHANNEL_CLUSTER)")


@dataclass(frozen=True)
class KeySettings:
    """The settings a client's keys are given by, as its CURVE errors name them: a Python
    program's (``curve_keys=`` or the environment variables), or a command's (``command``:
    ``name_key_settings``): ``secret`` this client's key pair file's, ``server`` the
    broker's public key file's."""

    secret: str = "ZCHANNEL_CURVE_SECRET_KEY"
    server: str = "ZCHANNEL_CURVE_SERVER_KEY"
    command: bool = False

    def without_server_key(self, where: str, secret_file: str) -> str:
        """The error of a client that has its own key pair but not the broker's public key."""
        if not self.command:
            return (f"authentication failed: {where} requires CURVE keys and this client has "
                    f"only its own ({self.secret}), not the broker's public key: "
                    f"{_PYTHON_REMEDY}")
        return (f"authentication failed: {where} requires CURVE keys and this client has only "
                f"its own key pair ({self.secret} {secret_file}), not the broker's public key: "
                f"give {self.server} FILE (the broker's NAME.key)")

    def without_keys(self, where: str) -> str:
        """The error of a client without keys at a broker that requires them."""
        remedy = (f"give {self.secret} FILE (this client's NAME.key_secret) and {self.server} "
                  "FILE (the broker's NAME.key)" if self.command else _PYTHON_REMEDY)
        return (f"authentication failed: {where} requires CURVE keys and this client has none: "
                f"{remedy}")

    def with_keys(self, where: str, secret_file: str) -> str:
        """The error of a client with keys at a broker without CURVE."""
        remedy = (f"connect without {self.secret} and {self.server}" if self.command else
                  "connect without curve_keys (and unset ZCHANNEL_CURVE_SECRET_KEY / "
                  "ZCHANNEL_CURVE_SERVER_KEY)")
        return (f"authentication failed: {where} does not use CURVE and this client has keys "
                f"({secret_file}): {remedy}")


_settings = KeySettings()


def name_key_settings(secret: str, server: str) -> None:
    """Name ``secret`` and ``server`` in this process's CURVE errors as the settings of this
    client's key pair file and of the broker's public key file -- a command's options or
    variables (``--curve-secret-key``, ``ZCHANNEL_CURVE_SECRET_KEY`` when that is where the
    command read it; ``--curve-server-key``) -- and their remedies in those terms, instead of
    a Python program's ``curve_keys=``, until ``reset_key_settings``."""
    global _settings
    _settings = KeySettings(secret, server, command=True)


def reset_key_settings() -> None:
    """Name a Python program's settings in CURVE errors again (``name_key_settings`` undone:
    a command run inside a Python process, as a test's, leaves nothing behind)."""
    global _settings
    _settings = KeySettings()


def replica_client_keys(curve_keys: Any, server_key: str | None) -> Any:
    """The CURVE settings for connecting to a replica whose public key is ``server_key`` (z85):
    the client's own key pair file (from ``curve_keys`` or ``ZCHANNEL_CURVE_SECRET_KEY``) with
    that key; ``curve_keys`` unchanged when the replica has none; None without a client key."""
    if not server_key:
        return curve_keys
    if isinstance(curve_keys, dict):  # the replica's key stands for 'server_public_key'
        secret = curve_keys.get("secret_key") or os.environ.get("ZCHANNEL_CURVE_SECRET_KEY")
    else:
        base = client_keys(curve_keys) if curve_keys is not None else None
        secret = base.secret_key if base is not None else os.environ.get("ZCHANNEL_CURVE_SECRET_KEY")
    if not secret:
        return None
    return ReplicaCurveKeys(secret, server_key)


def client_keys(curve_keys: Any) -> CurveKeys | None:
    """Normalise ``curve_keys=`` (a ``CurveKeys``, a mapping or a 2-tuple of file paths), else
    read ``ZCHANNEL_CURVE_SECRET_KEY`` / ``ZCHANNEL_CURVE_SERVER_KEY``; None when neither."""
    if curve_keys is None:
        secret = os.environ.get("ZCHANNEL_CURVE_SECRET_KEY")
        server = os.environ.get("ZCHANNEL_CURVE_SERVER_KEY")
        if secret and server:
            return CurveKeys(secret, server)
        return None
    if isinstance(curve_keys, CurveKeys):
        return curve_keys
    if isinstance(curve_keys, dict):
        missing = [k for k in ("secret_key", "server_public_key") if not curve_keys.get(k)]
        if missing:
            raise ValueError(
                f"curve_keys= has no {' or '.join(repr(k) for k in missing)}: a handle connects "
                "with its own secret key and the broker's public key (a creator passes them "
                "beside 'server_secret_key' and 'public_keys')")
        return CurveKeys(str(curve_keys["secret_key"]), str(curve_keys["server_public_key"]))
    if isinstance(curve_keys, (tuple, list)) and len(curve_keys) == 2:
        return CurveKeys(str(curve_keys[0]), str(curve_keys[1]))
    raise TypeError("curve_keys= takes CurveKeys, {'secret_key', 'server_public_key'} or a 2-tuple")


# the first 11 bytes of a ZMTP 3 greeting: signature and major version; a peer answers with its
# whole greeting (64 bytes, the mechanism name at 12-31) and waits for the rest of ours
_GREETING_START = b"\xff" + bytes(8) + b"\x7f" + b"\x03"


def broker_mechanism(address: str, timeout: float = 1.0) -> str | None:
    """The security mechanism (``"NULL"``, ``"CURVE"``) the ZeroMQ peer at ``address``
    announces in its greeting; None when it cannot be read (nothing there, not ZMTP 3)."""
    ipc, hp = paths.ipc_path(address), paths.tcp_host_port(address)
    try:
        if ipc is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect("\0" + ipc[1:] if ipc.startswith("@") else ipc)
        elif hp is not None:
            sock = socket.create_connection(hp, timeout=timeout)
        else:
            return None
        with sock:
            sock.sendall(_GREETING_START)
            data = b""
            while len(data) < 32:
                chunk = sock.recv(64 - len(data))
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    if len(data) < 32 or data[0] != 0xFF or data[9] & 1 != 1 or data[10] < 3:
        return None
    return data[12:32].rstrip(b"\0").decode("ascii", "replace")


class HandshakeWatch:
    """The handshake events of a client socket until its first handshake succeeds.

    Create it before ``connect``; poll ``socket`` and call ``check()`` when it is readable:
    an ``AuthenticationFailed`` when the broker and this client disagree on CURVE, else None.
    ``close()`` (by the socket's owner thread) once ``done``.
    """

    def __init__(self, sock: zmq.Socket, address: str, curve: CurveKeys | None) -> None:
        self._sock = sock
        self.address = address
        self.curve = curve
        self.socket = monitor(sock, HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.done = False

    def check(self) -> AuthenticationFailed | None:
        for event, value in read_events(self.socket):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.done = True
                return None
            failure = self._failure(event, value)
            if failure is not None:
                return failure
        return None

    def _failure(self, event: int, value: int) -> AuthenticationFailed | None:
        where = f"the broker at {self.address}"
        keys = self.curve
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            key_file = keys.secret_key if keys else "?"
            return AuthenticationFailed(
                f"authentication failed: {where} refused this client key ({key_file}); its "
                "public .key file must be in the broker's --curve-public-keys directory")
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL \
                and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if keys is not None:
                return AuthenticationFailed(_settings.with_keys(where, keys.secret_key))
            own = os.environ.get("ZCHANNEL_CURVE_SECRET_KEY")
            return AuthenticationFailed(_settings.without_server_key(where, own) if own
                                        else _settings.without_keys(where))
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return AuthenticationFailed(
                f"authentication failed: the handshake with {where} failed (ZMTP protocol "
                f"error {value:#x})")
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # the broker closed the connection during the handshake: it refused our CURVE hello
            # (a wrong server key), or it saw a mechanism mismatch before we did and reset the
            # connection; its greeting tells which (a broker that is gone: neither, retry)
            mechanism = broker_mechanism(self.address)
            if keys is not None and mechanism == "CURVE":
                return AuthenticationFailed(
                    f"authentication failed: {where} could not read this client's CURVE hello: "
                    f"the server public key {keys.server_public_key} is not the broker's")
            if mechanism == "CURVE" or (keys is not None and mechanism == "NULL"):
                return self._failure(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                     zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        return None

    def close(self) -> None:
        """Stop watching (the socket's owner thread only)."""
        if not self._sock.closed:
            self._sock.disable_monitor()
        self.socket.close(linger=0)
