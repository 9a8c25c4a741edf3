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

from zchannel.broker.transport.direct_framing import (
    IOV_MAX,
    FramingError,
    Reader,
    byte_view,
    close_fds,
    iovec,
    link_path,
    nbytes,
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
        self._fd_arg = (self.fd,)  # ``map``'s first iterable in ``send`` (the number never changes)
        os.set_inheritable(self.fd, False)
        self.up = False
        self.closed = False
        self.last_read = 0.0  # when bytes last came from the broker (monotonic)
        self.gone = False  # the last reconnect found nothing listening (the broker is gone)
        self.reader = Reader(1 << 20, 1 << 40)
        # the message being written (``_write_out``): its buffers (None: none), size, the
        # bytes of it written and where that is among its buffers (index, bytes before it)
        self.out: list | None = None
        self.out_total = self.out_done = 0
        self.out_at = (0, 0)
        self.written: list[int] = []  # the count of a write, recorded by the call that writes
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
        self.out = None  # (a new stream: no part of a message of the last one)
        self.written.clear()
        self.up = True
        return True

    def drop(self) -> None:
        """The socket broke: park the descriptor on the idle eventfd (a new stream starts with
        no part of a message of this one)."""
        self.out = None
        self.written.clear()
        if self.up:
            self.up = False
            os.dup2(self._idle, self.fd, inheritable=False)

    def send(self, parts: list) -> bool:
        """Send one message (blocking up to ``stall_s`` while the socket is full); False, and
        the link down, when it cannot.  The rest of a message an interruption (a signal
        handler's exception) cut short goes out first: the stream stays in step."""
        if not self.up or self.out is not None and not self._write_out():
            return False
        bufs, total = iovec(parts)
        self.out, self.out_total, self.out_done, self.out_at = bufs, total, 0, (0, 0)
        written = self.written
        try:  # most messages go out whole in this one call
            written.extend(map(os.writev, self._fd_arg, (bufs[:IOV_MAX],)))
        except BlockingIOError:
            pass
        except OSError:
            self.drop()
            return False
        if written and written[0] == total:
            del written[0]  # (no call between the two: done once)
            self.out = None
            return True
        return self._write_out()

    def _write_out(self) -> bool:
        """Write the rest of ``out``; False, and the link down, when the socket breaks or makes
        no progress for ``stall_s`` (judged on progress: a large message may take longer to go
        out while the broker is busy, and the broker is alive as long as it takes bytes).  A
        write's count is recorded by the call that writes (``written``) and applied with no
        call in between: an interruption loses no count."""
        written = self.written
        stalled_since = 0.0
        poller = None
        while True:
            if written:  # (the count of the last write, also one an interruption left)
                self.out_done += written[0]
                del written[0]
            if self.out_done >= self.out_total:
                self.out = None
                return True
            out = self.out
            rest = out if out is not None and not self.out_done and len(out) <= IOV_MAX \
                else self._rest()
            try:
                written.extend(map(os.writev, self._fd_arg, (rest,)))
                stalled_since = 0.0
                continue
            except BlockingIOError:
                pass
            except OSError:
                self.drop()
                return False
            now = time.monotonic()
            if not stalled_since:
                stalled_since = now
            elif now - stalled_since >= self.stall_s:
                self.drop()
                return False
            if poller is None:
                poller = select.poll()
                poller.register(self.fd, select.POLLOUT)
            poller.poll(max(1, int((stalled_since + self.stall_s - now) * 1000)))

    def _rest(self) -> list:
        """The buffers of ``out`` not written yet (at most ``IOV_MAX``)."""
        bufs, done = self.out, self.out_done
        assert bufs is not None
        if not done:
            return bufs[:IOV_MAX]
        i, before = self.out_at
        while True:
            size = nbytes(bufs[i])
            if done - before < size:
                break
            before += size
            i += 1
        self.out_at = (i, before)  # one store: an interruption leaves a true one
        return [byte_view(bufs[i])[done - before :], *bufs[i + 1 : i + IOV_MAX]]

    def recv(self, ready: bool = False) -> tuple[bytes, list] | None:
        """One message as ``(header, frames)`` if there is one (non-blocking), else None."""
        reader = self.reader
        messages = reader.messages
        while not messages:
            if not self.up:
                return None
            try:
                if not reader.read(self.fd):
                    self.drop()
                    return None
                self.last_read = time.monotonic()  # life, even within a long message
            except BlockingIOError:
                if not messages:  # (finishing what an interruption left may have made one)
                    return None
            except (OSError, FramingError):
                self.drop()
                return None
        parts = messages[0]
        del messages[0]  # no call between reading it and taking it: an interruption loses none
        return parts[0], parts[1:]

    def buffered(self) -> bool:
        # one read cuts several messages: the rest wait here; and bytes an interruption left
        # uncut wait for the next read, whether or not more come
        reader = self.reader
        return bool(reader.messages) or self.up and (reader.dirty or bool(reader.counts))

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
