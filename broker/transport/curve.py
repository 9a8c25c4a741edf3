"""CURVE authentication: key files, the broker's ZAP authenticator, client socket settings.

Key files are ZeroMQ certificate files (``zmq.auth.create_certificates``): ``NAME.key`` holds a
public key, ``NAME.key_secret`` the key pair.  A broker is given its secret file and a directory
of the public files of the clients it lets in; a client is given its own secret file and the
broker's public file.

A CURVE mismatch is told apart from a missing broker by the sockets' handshake events
(``zmq_socket_monitor``): a client fails at once with ``AuthenticationFailed`` naming the cause
(``HandshakeWatch``), and a broker logs each refused client once (``RefusalLog``).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zchannel.broker.errors import AuthenticationFailed
from zchannel.broker.host import paths
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger("zchannel.broker")


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


def load_key_file(path: str, what: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of a certificate file; ``ValueError`` naming the file and
    ``what`` it should hold when it is missing, unreadable or holds no key."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        reason = "no such file" if not os.path.exists(path) else str(exc)
        raise ValueError(f"cannot read {what} from {path}: {reason}") from None
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise ValueError(f"cannot read {what} from {path}: not a CURVE certificate "
                         "(zchannel keygen writes them)")
    return public, secret


@dataclass(frozen=True)
class ReplicaCurveKeys(CurveKeys):
    """A client's key pair file and one replica's public key as z85 text (a distributed channel
    from a cluster file with CURVE: every replica has its own key pair)."""

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = zmq.auth.load_certificate(self.secret_key)
        if secret is None:
            raise ValueError(f"{self.secret_key} holds no secret key")
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = self.server_public_key.encode()


def replica_client_keys(curve_keys: Any, server_key: str | None) -> Any:
    """The CURVE settings for connecting to a replica whose public key is ``server_key`` (z85):
    the client's own key pair file (from ``curve_keys`` or ``ZCHANNEL_CURVE_SECRET_KEY``) with
    that key; ``curve_keys`` unchanged when the replica has none; None without a client key."""
    if not server_key:
        return curve_keys
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
        return CurveKeys(str(curve_keys["secret_key"]), str(curve_keys["server_public_key"]))
    if isinstance(curve_keys, (tuple, list)) and len(curve_keys) == 2:
        return CurveKeys(str(curve_keys[0]), str(curve_keys[1]))
    raise TypeError("curve_keys= takes CurveKeys, {'secret_key', 'server_public_key'} or a 2-tuple")


class RefusalLog:
    """Logs each refused client once: a denied key once per (peer address, key), a handshake
    that failed for another reason (no keys, no CURVE, wrong server key: the broker does not
    learn the peer's address then) once per reason, and again with a count after ``repeat_s``
    while they go on.  A client retries every second or so; the log does not."""

    def __init__(self, repeat_s: float = 60.0) -> None:
        self.repeat_s = repeat_s
        self._seen: set[tuple[str, str]] = set()
        self._since: dict[str, tuple[float, int]] = {}  # reason -> (logged at, refusals since)
        self.refused = 0  # every refusal, logged or not

    def denied_key(self, peer: str, key: str) -> None:
        self.refused += 1
        if (peer, key) not in self._seen:
            self._seen.add((peer, key))
            log.warning("authentication failed: refused client key %s from %s (its public key "
                        "file is not in --curve-public-keys)", key, peer or "?")

    def handshake_failed(self, reason: str) -> None:
        self.refused += 1
        now = time.monotonic()
        logged_at, count = self._since.get(reason, (None, 0))
        if logged_at is None or now - logged_at >= self.repeat_s:
            more = f" ({count} more since the last report)" if count else ""
            log.warning("authentication failed: %s%s", reason, more)
            self._since[reason] = (now, 0)
        else:
            self._since[reason] = (logged_at, count + 1)


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP authenticator, reporting denied CURVE keys to a ``RefusalLog``."""

    def __init__(self, context: zmq.Context, refusals: RefusalLog) -> None:
        super().__init__(context, log=_QuietLog())
        self.refusals = refusals
        self._peer = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._peer = msg[3].decode(errors="replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        if not allowed:
            self.refusals.denied_key(self._peer, z85.encode(client_key).decode())
        return allowed, reason


class _QuietLog:
    """zmq.auth's own messages (debug level) are left out; its errors are kept."""

    def __getattr__(self, name: str) -> Any:
        return getattr(log, name)

    def debug(self, msg: str, *args: Any) -> None:
        pass


def secure_server(sock: zmq.Socket, secret_key_file: str, public_keys_dir: str | None,
                  refusals: RefusalLog) -> Any:
    """Make ``sock`` a CURVE server and start a ZAP authenticator admitting the clients whose
    public key files are in ``public_keys_dir`` (any client with keys when None), reporting
    denied keys to ``refusals``; returns the authenticator (stop it at exit)."""
    public, secret = load_key_file(secret_key_file, "the broker's CURVE key pair")
    if secret is None:
        raise ValueError(f"{secret_key_file} holds no secret key: the broker needs its "
                         "NAME.key_secret file (zchannel keygen)")
    if public_keys_dir and not Path(public_keys_dir).is_dir():
        raise ValueError(f"--curve-public-keys {public_keys_dir} is not a directory")
    auth = _Authenticator(sock.context, refusals)
    auth.start()
    if public_keys_dir:
        auth.configure_curve(domain="*", location=str(public_keys_dir))
    else:
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def admin_keys(path: str) -> frozenset[str]:
    """The public keys (z85 text, as ZeroMQ reports a peer's ``User-Id``) of the clients that
    may stop the broker without its shutdown token: a public key file, or a directory of
    them (``*.key``); ``ValueError`` naming the path when it holds none."""
    files = sorted(Path(path).glob("*.key")) if Path(path).is_dir() else [Path(path)]
    keys = {load_key_file(str(f), "an admin's CURVE public key")[0].decode() for f in files}
    if not keys:
        raise ValueError(f"--curve-admin-keys {path} holds no public key file (NAME.key)")
    return frozenset(keys)


FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_EVENT = struct.Struct("=HI")
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


_monitor_ids = itertools.count(1)


def monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket receiving ``events`` of ``sock``, at an inproc address of its own (pyzmq's
    default names it after the socket's descriptor number, which a socket made after a closed
    one reuses while libzmq may still hold the old endpoint: its events were then lost)."""
    address = f"inproc://zchannel-monitor-{os.getpid()}-{next(_monitor_ids)}"
    return sock.get_monitor_socket(events, addr=address)


def read_events(mon: zmq.Socket) -> list[tuple[int, int]]:
    """The (event, value) pairs waiting on a monitor socket."""
    events = []
    while True:
        try:
            frames = mon.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return events
        if len(frames) == 2 and len(frames[0]) == _EVENT.size:
            events.append(_EVENT.unpack(frames[0]))


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
        self.socket = monitor(sock, FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
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
            if keys is None:
                return AuthenticationFailed(
                    f"authentication failed: {where} requires CURVE keys and this client has "
                    "none: pass curve_keys=(own .key_secret, broker's .key) or set "
                    "ZCHANNEL_CURVE_SECRET_KEY and ZCHANNEL_CURVE_SERVER_KEY")
            return AuthenticationFailed(
                f"authentication failed: {where} does not use CURVE and this client has keys "
                f"({keys.secret_key}): connect without curve_keys (and unset "
                "ZCHANNEL_CURVE_SECRET_KEY / ZCHANNEL_CURVE_SERVER_KEY)")
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


class BrokerHandshakes:
    """The handshake failures of a broker's socket, reported to a ``RefusalLog``: ``check``
    takes the (event, value) pairs of its monitor (``FAILED`` events; the broker's peer guard
    reads the one monitor a socket can have, ``server/admission.py``)."""

    def __init__(self, curve: bool, refusals: RefusalLog) -> None:
        self.curve = curve
        self.refusals = refusals

    def check(self, events: list[tuple[int, int]]) -> None:
        for event, value in events:
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue  # a denied key: the authenticator reported it, with the peer
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL \
                    and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                reason = ("refused a client without CURVE keys (this broker requires them)"
                          if self.curve else
                          "refused a client with CURVE keys (this broker does not use CURVE)")
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL \
                    and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
                reason = ("refused a client whose CURVE hello did not decrypt (it was given "
                          "another server public key)")
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                reason = f"a client's handshake failed (ZMTP protocol error {value:#x})"
            else:
                continue  # a peer that went away mid-handshake: not a refusal
            self.refusals.handshake_failed(reason)


def keygen(directory: str, name: str) -> tuple[str, str]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (mode 0600) into ``directory``."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return public, secret
