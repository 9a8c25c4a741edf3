"""CURVE on the broker's end: its server socket and ZAP authenticator (``secure_server``), the
admins' keys, and the refused clients it logs, each once (``RefusalLog``, ``BrokerHandshakes``).
Key files: ``transport/curve_keys.py``; the client's end: ``transport/curve.py``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zchannel.broker.transport.curve_keys import load_key_file
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger("zchannel.broker")



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
    if public_keys_dir is not None and not Path(public_keys_dir).is_dir():
        raise ValueError(f"--curve-public-keys {public_keys_dir} is not a directory")
    auth = _Authenticator(sock.context, refusals)
    auth.start()
    if public_keys_dir is not None:  # each key file read as the broker's own is (regular, bounded)
        files = sorted(Path(public_keys_dir).glob("*.key"))
        auth.allow_any = False
        auth.certs["*"] = dict.fromkeys(
            (load_key_file(str(f), "a client's CURVE public key")[0] for f in files), True)
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


class BrokerHandshakes:
    """The handshake failures of a broker's socket, reported to a ``RefusalLog``: ``check``
    takes the (event, value) pairs of its monitor (``HANDSHAKE_FAILED`` events; the broker's peer guard
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
