"""CURVE key files, which both ends read: ZeroMQ certificate files
(``zmq.auth.create_certificates``), ``NAME.key`` holding a public key and ``NAME.key_secret``
the key pair (``zchannel keygen`` writes them).  A broker is given its secret file and a
directory of the public files of the clients it lets in (``transport/curve_broker.py``); a
client is given its own secret file and the broker's public file (``transport/curve.py``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import zmq
import zmq.auth


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


def keygen(directory: str, name: str) -> tuple[str, str]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (mode 0600) into ``directory``.  They are
    made in a private directory inside it (mode 0700) and moved in once the secret file is
    0600: pyzmq writes them with the umask's mode, which another user could open meanwhile."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".keygen-") as private:
        made_public, made_secret = zmq.auth.create_certificates(private, name)
        os.chmod(made_secret, 0o600)
        public = os.path.join(directory, os.path.basename(made_public))
        secret = os.path.join(directory, os.path.basename(made_secret))
        os.replace(made_public, public)
        os.replace(made_secret, secret)
    return public, secret
