"""What both ends of a same-host direct link share: where a broker listens for links, the
framing of a message on the stream and the reader that cuts the stream into messages.

A broker bound to ``ipc://PATH`` also listens on the Unix stream socket ``PATH.d``
(``link_path``).  Framing: a message is ``count`` (u32, little-endian), ``count`` part lengths
(u64), then the parts; part 0 is the header.  The reader checks the count, every length and
their sum against its limits before it allocates anything for the message (the sum, without a
limit of its own, against the host's memory: a message larger than that cannot be held); a
stream that breaks them is closed (as libzmq drops a peer that breaks ``ZMQ_MAXMSGSIZE``), and
so is one whose message the allocator refuses.  No part the reader hands out keeps alive more
memory than its own bytes: a part the broker keeps as a queued item must not hold the rest of
its message (the other items, consumed long ago) with it.  The client's end is
``transport/direct.py``, the broker's ``transport/direct_broker.py``.
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
# A larger message is read straight into the buffers of its parts: a part of SMALL_PART bytes or
# more into a buffer of its own (handed out as it is, not copied), the smaller parts between
# them into shared buffers of RUN_BYTES at most, copied out of them when the message is whole.
SMALL_PART = 64 << 10
RUN_BYTES = 1 << 20
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


class LargeMessage:
    """A message larger than the scratch buffer while it is read: its parts' buffers in stream
    order (``pieces``: a buffer and None for a part with a buffer of its own, or a buffer and
    the lengths of the small parts it holds back to back) and the views of them still to be
    filled (``unfilled``).  ``MemoryError`` when the buffers cannot be allocated."""

    __slots__ = ("pieces", "unfilled")

    def __init__(self, lens: tuple[int, ...]) -> None:
        pieces: list[tuple[np.ndarray, tuple[int, ...] | None]] = []
        run: list[int] = []
        run_bytes = 0
        for n in lens:
            if n < SMALL_PART and run_bytes + n <= RUN_BYTES:
                run.append(n)
                run_bytes += n
                continue
            if run:
                pieces.append((np.empty(run_bytes, np.uint8), tuple(run)))
            run, run_bytes = [], 0
            if n < SMALL_PART:
                run, run_bytes = [n], n
            else:  # not zero-filled, unlike a bytearray
                pieces.append((np.empty(n, np.uint8), None))
        if run:
            pieces.append((np.empty(run_bytes, np.uint8), tuple(run)))
        self.pieces = pieces
        self.unfilled: deque[memoryview] = deque(buf.data for buf, _ in pieces if buf.nbytes)

    def fill(self, data: memoryview) -> None:
        """Copy ``data`` (the next bytes of the message) into the unfilled buffers."""
        unfilled = self.unfilled
        while data.nbytes:
            head = unfilled[0]
            n = min(head.nbytes, data.nbytes)
            head[:n] = data[:n]
            data = data[n:]
            advance(unfilled, n)

    def parts(self) -> list:
        """The whole message's parts: the large ones as writable views of their own buffers,
        the small ones (and the header) as ``bytes`` (each shared buffer is let go once its
        parts are copied out: the message is not held twice)."""
        parts: list = []
        pieces = self.pieces
        self.pieces = []
        pieces.reverse()
        while pieces:
            buf, run = pieces.pop()
            if run is None:
                parts.append(buf.data)
                continue
            view, pos = buf.data, 0
            for n in run:
                parts.append(bytes(view[pos : pos + n]))
                pos += n
        if type(parts[0]) is not bytes:
            parts[0] = bytes(parts[0])  # the header: decoded at once
        return parts


class Reader:
    """Cuts a byte stream into messages: lists of parts, ``bytes`` for a small part (all the
    parts of a message that fits the scratch buffer) and a writable ``memoryview`` of a buffer
    of its own for a large one (``LargeMessage``)."""

    def __init__(self, max_parts: int, max_header: int, max_part: int = 0,
                 max_total: int = 0) -> None:
        self.max_parts = max_parts
        self.max_header = max_header
        self.max_part = max_part  # 0: no limit
        self.max_total = max_total or host_memory()  # all parts of one message
        self.buf = bytearray(SCRATCH)
        self.start = self.end = 0
        self.big: LargeMessage | None = None  # the large message being read
        self.messages: deque[list] = deque()

    def read(self, fd: int) -> int:
        """Read what the socket has (one system call) and cut the messages it completes into
        ``messages``; the bytes read, 0 at end of stream.  ``BlockingIOError`` when nothing is
        there; ``FramingError`` on a broken stream."""
        big = self.big
        if big is not None:
            n = os.readv(fd, head_buffers(big.unfilled))
            if n == 0:
                return 0
            advance(big.unfilled, n)
            if not big.unfilled:
                self.big = None
                self.messages.append(big.parts())
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
            try:
                big = LargeMessage(lens)
            except MemoryError:
                raise FramingError(f"no memory for a message of {total} bytes") from None
            have = min(total, avail - prefix)
            with memoryview(buf) as view:
                big.fill(view[start + prefix : start + prefix + have])
            self.start += prefix + have
            if have == total:
                self.messages.append(big.parts())
                continue
            self.big = big
            break
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end > len(buf) - 4096:
            self._compact()


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
