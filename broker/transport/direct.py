"""The same-host direct link: the wire protocol over a Unix stream socket, without libzmq.

A broker bound to ``ipc://PATH`` also listens on the Unix stream socket ``PATH.d``; a client of
that address connects there when it can (and falls back to its ZeroMQ DEALER when it cannot).
The records and frames are exactly those of the ZeroMQ path (``wire/protocol.py``); only the framing
differs, and a message costs one system call on each side instead of two wake-ups of libzmq's
I/O threads (docs/decisions.md, "The direct link").

Framing: a message is ``count`` (u32, little-endian), ``count`` part lengths (u64), then the
parts; part 0 is the header.  The reader checks the count, every length and their sum against
its limits before it allocates anything for the message (the sum, without a limit of its own,
against the host's memory: a message larger than that cannot be held); a stream that breaks
them is closed (as libzmq drops a peer that breaks ``ZMQ_MAXMSGSIZE``), and so is one whose
message the allocator refuses.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import time
from collections import deque
from typing import Any

import numpy as np
from zchannel.broker.transport.seam import Transport

_COUNT = struct.Struct("<I")
IOV_MAX = 1024
SCRATCH = 256 << 10  # messages up to half of this are read in place and copied out
READ_BUDGET = 32 << 20  # bytes the broker reads from one link per loop turn at most
# The broker's address of a link's client: never a ZeroMQ routing id (a client's is 16 random
# bytes, one libzmq makes up 5 starting with \x00).
ADDRESS_PREFIX = b"\x00D"
# Large messages cross the socket in pieces of its send buffer, each piece a wake-up of the
# reader and then of the writer: ask for 4 MiB (the kernel caps it at net.core.wmem_max).
SOCKET_BUFFER = 4 << 20


def _tune(sock: socket.socket) -> None:
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


def _byte_view(part: Any) -> memoryview:
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
            n = os.readv(fd, [memoryview(buf)[filled:]])
            if n == 0:
                return 0
            filled += n
            if filled < buf.nbytes:
                self.big = (buf, filled, lens)
                return n
            self.big = None
            self.messages.append(_slices(memoryview(buf), lens))
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
            if lens[0] > self.max_header:
                raise FramingError(f"a header of {lens[0]} bytes (limit {self.max_header})")
            if self.max_part and max(lens) > self.max_part:
                raise FramingError(f"a part of {max(lens)} bytes (limit {self.max_part})")
            total = sum(lens)
            if total > self.max_total:
                raise FramingError(f"a message of {total} bytes (limit {self.max_total})")
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
                self.messages.append(_slices(memoryview(big), lens))
                continue
            self.big = (big, have, lens)
            break
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end > len(buf) - 4096:
            self._compact()


def _slices(view: memoryview, lens: tuple[int, ...]) -> list:
    parts: list = []
    pos = 0
    for n in lens:
        parts.append(view[pos : pos + n])
        pos += n
    parts[0] = bytes(parts[0])  # the header: small, and decoded at once
    return parts


def _iovec(parts: list) -> tuple[list, int]:
    """The buffers of one framed message (its prefix, then ``parts``) and their total size."""
    sizes = [_byte_view(p).nbytes for p in parts]
    prefix = struct.pack(f"<I{len(parts)}Q", len(parts), *sizes)
    return [prefix, *parts], len(prefix) + sum(sizes)


def _advance(bufs: deque, n: int) -> None:
    """Drop the first ``n`` bytes of ``bufs`` (what a ``writev`` wrote)."""
    while n:
        head = bufs[0]
        size = len(head) if type(head) is bytes else _byte_view(head).nbytes
        if n >= size:
            n -= size
            bufs.popleft()
        else:
            bufs[0] = _byte_view(head)[n:]
            n = 0


class Link(Transport):
    """A client's direct link to its broker, one of the two ``transport.Transport``s: a stream
    socket behind a file descriptor whose number never changes (a poll set can hold it).  While
    the link is down that descriptor is an eventfd that never becomes readable; ``reconnect``
    puts a new socket behind it.  Not thread-safe: the caller serialises
    (``Connection._sock_lock``), and only ``close`` gives the descriptors back (no finalizer
    does: it could run while a thread still polls them).  Sending and reading cost one system
    call each: callers read it themselves (``callers_read``)."""

    callers_read = True

    def __init__(self, path: str, stall_s: float) -> None:
        self.path = self.where = path
        self.stall_s = stall_s  # a send that cannot progress this long: the broker is gone
        self._idle = os.eventfd(0, os.EFD_CLOEXEC)
        self.fd = self.readable = os.dup(self._idle)
        os.set_inheritable(self.fd, False)
        self.up = False
        self.closed = False
        self.last_read = 0.0  # when bytes last came from the broker (monotonic)
        self.gone = False  # the last reconnect found nothing listening (the broker is gone)
        self.reader = Reader(1 << 20, 1 << 40)
        if not self.reconnect():
            self.close()
            raise ConnectionError(f"no direct link at {path}")

    def reconnect(self) -> bool:
        """Connect a new socket (at once, or False; then ``gone`` tells whether nothing listens
        at the path: a broker that stopped or was killed)."""
        if self.closed:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _tune(sock)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            self.gone = isinstance(exc, (ConnectionRefusedError, FileNotFoundError))
            return False
        self.gone = False
        sock.setblocking(False)
        os.dup2(sock.fileno(), self.fd, inheritable=False)
        sock.close()
        self.reader = Reader(1 << 20, 1 << 40)
        self.up = True
        return True

    def drop(self) -> None:
        """The socket broke: park the descriptor on the idle eventfd."""
        if self.up:
            self.up = False
            os.dup2(self._idle, self.fd, inheritable=False)

    def send(self, parts: list) -> bool:
        """Send one message (blocking up to ``stall_s`` while the socket is full); False, and
        the link down, when it cannot."""
        if not self.up:
            return False
        bufs, total = _iovec(parts)
        try:
            n = os.writev(self.fd, bufs[:IOV_MAX])
        except BlockingIOError:
            n = 0
        except OSError:
            self.drop()
            return False
        if n == total:
            return True
        rest = deque(bufs)
        _advance(rest, n)
        # a stall is judged on progress: a large message may take longer than stall_s to go
        # out while the broker is busy, and the broker is alive as long as it takes bytes
        deadline = time.monotonic() + self.stall_s
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT)
        while rest:
            try:
                n = os.writev(self.fd, _head(rest))
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.drop()
                    return False
                poller.poll(max(1, int(remaining * 1000)))
                continue
            except OSError:
                self.drop()
                return False
            _advance(rest, n)
            deadline = time.monotonic() + self.stall_s
        return True

    def recv(self, ready: bool = False) -> tuple[bytes, list] | None:
        """One message as ``(header, frames)`` if there is one (non-blocking), else None."""
        messages = self.reader.messages
        while not messages:
            if not self.up:
                return None
            try:
                if not self.reader.read(self.fd):
                    self.drop()
                    return None
                self.last_read = time.monotonic()  # life, even within a long message
            except BlockingIOError:
                return None
            except (OSError, FramingError):
                self.drop()
                return None
        parts = messages.popleft()
        return parts[0], parts[1:]

    def buffered(self) -> bool:
        return bool(self.reader.messages)  # one read cuts several messages: the rest wait here

    def notify_fd(self) -> int:
        return self.fd

    def close(self) -> None:
        """Close the socket (the broker sees the end of the stream) and both descriptors.  The
        caller makes sure that no other thread uses them any more (the connection's I/O thread
        calls this last, holding the socket lock).  Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.up = False
        _close_fds(self.fd, self._idle)

    def close_after_fork(self) -> None:
        self.close()  # a parent's link must end when the parent closes it, not with its children


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _head(bufs: deque) -> list:
    return [bufs[i] for i in range(min(len(bufs), IOV_MAX))]


class Peer:
    """The broker's end of one direct link."""

    __slots__ = ("sock", "fd", "address", "reader", "out", "since", "greeted")

    def __init__(self, sock: socket.socket, address: bytes, reader: Reader) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.address = address
        self.reader = reader
        self.out: deque = deque()  # bytes not yet written (the socket was full)
        self.since = time.monotonic()  # accepted then
        self.greeted = False  # it said hello (a link that never does is closed after expiry)

    def send(self, parts: list) -> bool:
        """Queue one message and write what the socket takes now; False if the peer is gone."""
        bufs, total = _iovec(parts)
        if self.out:
            self.out.extend(bufs)
            return True
        try:
            n = os.writev(self.fd, bufs[:IOV_MAX])
        except BlockingIOError:
            n = 0
        except OSError:
            return False
        if n < total:
            self.out.extend(bufs)
            _advance(self.out, n)
        return True

    def write_out(self) -> bool:
        """Write queued bytes (the socket said it has room); False if the peer is gone."""
        while self.out:
            try:
                n = os.writev(self.fd, _head(self.out))
            except BlockingIOError:
                return True
            except OSError:
                return False
            _advance(self.out, n)
        return True


class Listener:
    """The broker's listening socket for direct links and its peers (by fd and by address)."""

    def __init__(self, path: str, max_parts: int, max_header: int, max_part: int,
                 max_total: int = 0) -> None:
        if os.path.exists(path):
            os.unlink(path)  # stale: the broker holds the channel lock
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        self.limits = (max_parts, max_header, max_part, max_total)
        self.by_fd: dict[int, Peer] = {}
        self.by_address: dict[bytes, Peer] = {}
        self._serial = 0
        self.starved = False  # the last accept ran out of descriptors

    def accept(self, limit: int = 1 << 30) -> list[Peer]:
        """Accept the waiting links, at most ``limit``; ``starved`` says whether the process
        ran out of descriptors (or memory) meanwhile (the link then waits in the backlog)."""
        peers: list[Peer] = []
        self.starved = False
        while len(peers) < limit:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return peers
            except OSError as exc:  # out of descriptors: the client waits, falls back or retries
                self.starved = exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                             errno.ENOMEM)
                return peers
            sock.setblocking(False)
            _tune(sock)
            self._serial += 1
            address = ADDRESS_PREFIX + self._serial.to_bytes(8, "little")
            peer = Peer(sock, address, Reader(*self.limits))
            self.by_fd[peer.fd] = peer
            self.by_address[address] = peer
            peers.append(peer)
        return peers

    def drop(self, peer: Peer) -> None:
        self.by_fd.pop(peer.fd, None)
        self.by_address.pop(peer.address, None)
        peer.out.clear()
        peer.sock.close()

    def close(self) -> None:
        for peer in list(self.by_fd.values()):
            self.drop(peer)
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
