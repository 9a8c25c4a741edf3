"""The client's end of the same-host direct link: the wire protocol over a Unix stream socket,
without libzmq.

A broker bound to ``ipc://PATH`` also listens on the Unix stream socket ``PATH.d``; a client of
that address connects there when it can (and falls back to its ZeroMQ DEALER when it cannot).
The records and frames are exactly those of the ZeroMQ path (``wire/protocol.py``); only the framing
differs, and a message costs one system call on each side instead of two wake-ups of libzmq's
I/O threads (docs/decisions.md, "The direct link").  The framing and the reader both ends use
are ``transport/direct_framing.py``; the broker's end is ``transport/direct_broker.py``.

"""

from __future__ import annotations

import os
import select
import socket
import time
from collections import deque

from zchannel.broker.transport.direct_framing import (
    IOV_MAX,
    FramingError,
    Reader,
    advance,
    close_fds,
    head_buffers,
    iovec,
    link_path,
    tune_socket,
)
from zchannel.broker.transport.seam import Transport

__all__ = ["Link", "link_path"]


class Link(Transport):
    """A client's direct link to its broker, one of the two ``transport.Transport``s: a stream
    socket behind a file descriptor whose number never changes (a poll set can hold it).  While
    the link is down that descriptor is an eventfd that never becomes readable; ``reconnect``
    puts a new socket behind it.  Not thread-safe: the caller serialises
    (``Line.sock_lock`` of its connection), and only ``close`` gives the descriptors back (no finalizer
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
        tune_socket(sock)
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
        bufs, total = iovec(parts)
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
        advance(rest, n)
        # a stall is judged on progress: a large message may take longer than stall_s to go
        # out while the broker is busy, and the broker is alive as long as it takes bytes
        deadline = time.monotonic() + self.stall_s
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT)
        while rest:
            try:
                n = os.writev(self.fd, head_buffers(rest))
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
            advance(rest, n)
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
        close_fds(self.fd, self._idle)

    def close_after_fork(self) -> None:
        self.close()  # a parent's link must end when the parent closes it, not with its children
