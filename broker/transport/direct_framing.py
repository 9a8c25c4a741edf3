"""What both ends of a same-host direct link share: where a broker listens for links, the
framing of a message on the stream and the reader that cuts the stream into messages.

A broker bound to ``ipc://PATH`` also listens on the Unix stream socket ``PATH.d``
(``link_path``).  Framing: a message is ``count`` (u32, little-endian), ``count`` part lengths
(u64), then the parts; part 0 is the header.  The reader checks the count, every length and
their sum against its limits before it allocates anything for the message (the sum, without a
limit of its own, against the host's memory: a message larger than that cannot be held); a
stream that breaks them is closed (as libzmq drops a peer that breaks ``ZMQ_MAXMSGSIZE``), and
so is one whose message the allocator refuses.  The client's end is ``transport/direct.py``,
the broker's ``transport/direct_broker.py``.
"""

from __future__ import annotations

import os
import socket
import struct
from collections import deque
from typing import Any

import numpy as np

_COUNT = struct.Struct("<I")
IOV_MAX = 1024
SCRATCH = 256 << 10  # messages up to half of this are read in place and copied out
# Large messages cross the socket in pieces of its send buffer, each piece a wake-up of the
# reader and then of the writer: ask for 4 MiB (the kernel caps it at net.core.wmem_max).
SOCKET_BUFFER = 4 << 20


def tune_socket(sock: socket.socket) -> None:
    """Ask for ``SOCKET_BUFFER`` bytes of send and receive buffer (best effort)."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


def link_path(ipc_path: str) -> str | None:
    """Where the broker of ``ipc://ipc_path`` listens for direct links (None: it does not)."""
    if not ipc_path or ipc_path.startswith("@"):
        return None
    path = ipc_path + ".d"
    return path if len(path.encode()) <= 107 else None


class FramingError(ValueError):
    """A direct-link stream that does not follow the framing or breaks a limit."""


def host_memory() -> int:
    """The bytes of memory of this host (no message can be larger)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - Linux has both
        return 1 << 40


def byte_view(part: Any) -> memoryview:
    """``part`` as a flat view of bytes."""
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Reader:
    """Cuts a byte stream into messages (lists of parts: ``bytes`` for parts of messages that
    fit the scratch buffer, writable ``memoryview`` slices of one buffer for larger ones)."""

    def __init__(self, max_parts: int, max_header: int, max_part: int = 0,
                 max_total: int = 0) -> None:
        self.max_parts = max_parts
        self.max_header = max_header
        self.max_part = max_part  # 0: no limit
        self.max_total = max_total or host_memory()  # all parts of one message
        self.buf = bytearray(SCRATCH)
        self.start = self.end = 0
        self.big: tuple[np.ndarray, int, tuple[int, ...]] | None = None  # buffer, filled, lengths
        self.messages: deque[list] = deque()

    def read(self, fd: int) -> int:
        """Read what the socket has (one system call) and cut the messages it completes into
        ``messages``; the bytes read, 0 at end of stream.  ``BlockingIOError`` when nothing is
        there; ``FramingError`` on a broken stream."""
        if self.big is not None:
            buf, filled, lens = self.big
            n = os.readv(fd, [buf.data[filled:]])
            if n == 0:
                return 0
            filled += n
            if filled < buf.nbytes:
                self.big = (buf, filled, lens)
                return n
            self.big = None
            self.messages.append(slices(buf.data, lens))
            return n
        if self.end == len(self.buf):
            self._compact()
        n = os.readv(fd, [memoryview(self.buf)[self.end :]])
        if n == 0:
            return 0
        self.end += n
        self._cut()
        return n

    def _compact(self) -> None:
        avail = self.end - self.start
        if self.start:
            self.buf[:avail] = self.buf[self.start : self.end]
            self.start, self.end = 0, avail
        if avail == len(self.buf):  # a prefix larger than the scratch buffer (many parts)
            self.buf.extend(bytes(len(self.buf)))

    def _checked_total(self, lens: tuple[int, ...]) -> int:
        """The bytes of a message of parts ``lens``; ``FramingError`` past a limit."""
        if lens[0] > self.max_header:
            raise FramingError(f"a header of {lens[0]} bytes (limit {self.max_header})")
        if self.max_part and max(lens) > self.max_part:
            raise FramingError(f"a part of {max(lens)} bytes (limit {self.max_part})")
        total = sum(lens)
        if total > self.max_total:
            raise FramingError(f"a message of {total} bytes (limit {self.max_total})")
        return total

    def _cut(self) -> None:
        buf = self.buf
        while True:
            start, avail = self.start, self.end - self.start
            if avail < 4:
                break
            (count,) = _COUNT.unpack_from(buf, start)
            if not 1 <= count <= self.max_parts:
                raise FramingError(f"a message of {count} parts (limit {self.max_parts})")
            prefix = 4 + 8 * count
            if avail < prefix:
                break
            lens = struct.unpack_from(f"<{count}Q", buf, start + 4)
            total = self._checked_total(lens)
            if prefix + total <= SCRATCH // 2:
                if avail < prefix + total:
                    break
                view = memoryview(buf)
                pos = start + prefix
                parts = []
                for n in lens:
                    parts.append(bytes(view[pos : pos + n]))
                    pos += n
                view.release()
                self.start = pos
                self.messages.append(parts)
                continue
            # a large message: its own buffer, read into directly (its parts are not copied again)
            try:
                big = np.empty(total, np.uint8)  # not zero-filled, unlike a bytearray
            except MemoryError:
                raise FramingError(f"no memory for a message of {total} bytes") from None
            have = min(total, avail - prefix)
            big[:have] = np.frombuffer(buf, np.uint8, have, start + prefix)
            self.start += prefix + have
            if have == total:
                self.messages.append(slices(big.data, lens))
                continue
            self.big = (big, have, lens)
            break
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end > len(buf) - 4096:
            self._compact()


def slices(view: memoryview, lens: tuple[int, ...]) -> list:
    parts: list = []
    pos = 0
    for n in lens:
        parts.append(view[pos : pos + n])
        pos += n
    parts[0] = bytes(parts[0])  # the header: small, and decoded at once
    return parts


def iovec(parts: list) -> tuple[list, int]:
    """The buffers of one framed message (its prefix, then ``parts``) and their total size."""
    sizes = [byte_view(p).nbytes for p in parts]
    prefix = struct.pack(f"<I{len(parts)}Q", len(parts), *sizes)
    return [prefix, *parts], len(prefix) + sum(sizes)


def advance(bufs: deque, n: int) -> None:
    """Drop the first ``n`` bytes of ``bufs`` (what a ``writev`` wrote)."""
    while n:
        head = bufs[0]
        size = len(head) if type(head) is bytes else byte_view(head).nbytes
        if n >= size:
            n -= size
            bufs.popleft()
        else:
            bufs[0] = byte_view(head)[n:]
            n = 0


def close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def head_buffers(bufs: deque) -> list:
    return [bufs[i] for i in range(min(len(bufs), IOV_MAX))]
