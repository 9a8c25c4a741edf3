"""Packers kept for a whole process, safe to share between threads with either msgpack build.

msgpack's C packer packs a value without calling back into Python (none of these has a
``default``), so one packer serves every thread.  Its pure-Python fallback (``msgpack.fallback``:
where no wheel with the extension exists, or with ``MSGPACK_PUREPYTHON=1``) keeps the bytes
being packed in the packer while it works, so threads sharing one interleave their output: there
each thread gets a packer of its own.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack

C_EXTENSION = msgpack.Packer.__module__ != "msgpack.fallback"


class ThreadPackers:
    """One ``msgpack.Packer(**options)`` per thread, used like a packer (``pack``,
    ``pack_array_header``)."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._local = threading.local()

    def _own(self) -> Any:
        packer = getattr(self._local, "packer", None)
        if packer is None:
            packer = self._local.packer = msgpack.Packer(**self._options)
        return packer

    def pack(self, obj: Any) -> bytes:
        return self._own().pack(obj)

    def pack_array_header(self, n: int) -> bytes:
        return self._own().pack_array_header(n)


def shared_packer(**options: Any) -> Any:
    """A packer of ``options`` (no ``default``: nothing may call back into Python) that every
    thread may use at once: msgpack's C packer itself, else a ``ThreadPackers``."""
    if "default" in options:
        raise ValueError("a shared packer takes no default: it would run inside the packer")
    return msgpack.Packer(**options) if C_EXTENSION else ThreadPackers(**options)
