"""Opening and reading a small file zchannel is given by path — a configuration or cluster file
(``host/toml.py``), a CURVE key file (``transport/curve_keys.py``), a shutdown token file
(``server/loop.py``) — checked before anything is read.

Only a regular file is opened: a FIFO (which would block until a writer comes), a socket or a
device such as ``/dev/zero`` (which never ends) is refused after a ``stat``, never opened.
``read_regular_file`` also refuses a file larger than its reader's limit, from its size, and
never reads more than the limit (a file that grows meanwhile is refused too).
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

__all__ = ["open_regular_file", "read_regular_file"]


def open_regular_file(path: str | os.PathLike, what: str) -> BinaryIO:
    """The regular file at ``path``, open for reading in binary mode.  ``ValueError`` naming
    the file and ``what`` it should be (``"a CURVE key file"``) when it is not a regular file;
    ``OSError`` when it cannot be opened (missing, no permission; ``IsADirectoryError`` for a
    directory)."""
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(21, "Is a directory", str(path))
    if not stat.S_ISREG(mode):
        raise _not_regular(path, what)
    # O_NONBLOCK: a FIFO put in its place since the stat is opened without waiting for a writer
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise _not_regular(path, what)
    return f


def read_regular_file(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of the regular file at ``path`` (``open_regular_file``), at most ``limit`` of
    them: ``ValueError`` naming the file and ``what`` it should be when it is larger."""
    with open_regular_file(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes: not {what} zchannel reads")
    return data


def _not_regular(path: str | os.PathLike, what: str) -> ValueError:
    return ValueError(f"{path} is not a regular file (a FIFO, a socket or a device): {what} is "
                      "read only from a regular file")
