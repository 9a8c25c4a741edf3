"""CURVE authentication: key files, the broker's ZAP authenticator, client socket settings.

Key files are ZeroMQ certificate files (``zmq.auth.create_certificates``): ``NAME.key`` holds a
public key, ``NAME.key_secret`` the key pair.  A broker is given its secret file and a directory
of the public files of the clients it lets in; a client is given its own secret file and the
broker's public file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

log = logging.getLogger("zchannel.broker")


@dataclass(frozen=True)
class CurveKeys:
    """A client's CURVE settings: its own secret file and the broker's public file."""

    secret_key: str
    server_public_key: str

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = zmq.auth.load_certificate(self.secret_key)
        if secret is None:
            raise ValueError(f"{self.secret_key} holds no secret key")
        server_public, _ = zmq.auth.load_certificate(self.server_public_key)
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = server_public


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


class _AuthLog:
    """zmq.auth reports denials at debug level; a broker logs them as warnings."""

    def __getattr__(self, name: str) -> Any:
        return getattr(log, name)

    def debug(self, msg: str, *args: Any) -> None:
        try:
            text = msg % args if args else msg
        except (TypeError, ValueError):
            text = msg
        if "DENIED" in text:
            log.warning("authentication: %s", text)


def secure_server(sock: zmq.Socket, secret_key_file: str, public_keys_dir: str | None) -> Any:
    """Make ``sock`` a CURVE server and start a ZAP authenticator admitting the clients whose
    public key files are in ``public_keys_dir``; returns the authenticator (stop it at exit)."""
    from zmq.auth.thread import ThreadAuthenticator

    public, secret = zmq.auth.load_certificate(secret_key_file)
    if secret is None:
        raise ValueError(f"{secret_key_file} holds no secret key")
    auth = ThreadAuthenticator(sock.context, log=_AuthLog())
    auth.start()
    if public_keys_dir:
        if not Path(public_keys_dir).is_dir():
            raise ValueError(f"--curve-public-keys {public_keys_dir} is not a directory")
        auth.configure_curve(domain="*", location=str(public_keys_dir))
    else:
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def keygen(directory: str, name: str) -> tuple[str, str]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (mode 0600) into ``directory``."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return public, secret
