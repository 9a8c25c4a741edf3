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
from zchannel.broker.host.regularfile import read_regular_file
from zmq.utils.z85 import Z85CHARS

log = logging.getLogger("zchannel.security")
_warned_about: set[str] = set()  # the files warn_if_others_can_read named already
# a certificate file zchannel keygen writes takes ~300 bytes; one larger than this is no key file
MAX_KEY_FILE_BYTES = 64 << 10


def load_key_file(path: str, what: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of a certificate file; ``ValueError`` naming the file and
    ``what`` it should hold when it is missing, unreadable, not a regular file, larger than
    ``MAX_KEY_FILE_BYTES`` or holds no key.  Nothing is opened before the file is known to be
    a regular file, nor more than ``MAX_KEY_FILE_BYTES`` read (``host/regularfile.py``)."""
    try:
        data = read_regular_file(path, MAX_KEY_FILE_BYTES, "a CURVE key file")
    except OSError as exc:
        reason = "no such file" if not os.path.exists(path) else (exc.strerror or str(exc))
        raise ValueError(f"cannot read {what} from {path}: {reason}") from None
    except ValueError as exc:
        raise ValueError(f"cannot read {what}: {exc}") from None
    public, secret = certificate_keys(data)
    if public is None or not _is_key(public) or (secret is not None and not _is_key(secret)):
        raise ValueError(f"cannot read {what} from {path}: not a CURVE certificate "
                         "(zchannel keygen writes them)")
    if secret is not None:
        warn_if_others_can_read(path, "secret key file")
    return public, secret


def certificate_keys(data: bytes) -> tuple[bytes | None, bytes | None]:
    """The (public, secret) keys a ZeroMQ certificate file's text ``data`` holds, each None when
    it has no such line; read as ``zmq.auth.load_certificate`` reads a file: the first
    ``public-key`` and ``secret-key`` lines, their value unquoted, ``#`` lines skipped."""
    public = secret = None
    for raw in data.splitlines():
        line = raw.strip()
        if line.startswith(b"#"):
            continue
        if line.startswith(b"public-key") and public is None:
            public = line.split(b"=", 1)[-1].strip(b" \t'\"")
        elif line.startswith(b"secret-key") and secret is None:
            secret = line.split(b"=", 1)[-1].strip(b" \t'\"")
    return public, secret


def _is_key(key: bytes) -> bool:
    """Whether ``key`` is a CURVE key in Z85 text: 40 characters of its alphabet."""
    return len(key) == 40 and all(c in Z85CHARS for c in key)


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
