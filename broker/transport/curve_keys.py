"""CURVE key files, which both ends read: ZeroMQ certificate files
(``zmq.auth.create_certificates``), ``NAME.key`` holding a public key and ``NAME.key_secret``
the key pair (``zchannel keygen`` writes them).  A broker is given its secret file and a
directory of the public files of the clients it lets in (``transport/curve_broker.py``); a
client is given its own secret file and the broker's public file (``transport/curve.py``).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

import zmq
import zmq.auth

log = logging.getLogger("zchannel.security")
_warned_about: set[str] = set()  # the files warn_if_others_can_read named already


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
    if secret is not None:
        warn_if_others_can_read(path, "secret key file")
    return public, secret


def warn_if_others_can_read(path: str, what: str) -> None:
    """Log a warning when the file at ``path`` (a secret: a CURVE key pair, a shutdown token)
    gives its group or other users any access, as ssh does for a private key; it is used
    all the same (``zchannel keygen`` writes 0600).  Once per file and process."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    if mode & 0o077 and path not in _warned_about:
        _warned_about.add(path)
        log.warning("%s %s has mode %04o: other users may read it; chmod 600 %s", what, path,
                    mode, path)


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
