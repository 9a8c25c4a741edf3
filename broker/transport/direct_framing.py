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
# Messages up to half of SCRATCH are read in place into a link's read buffer and copied out.
# The buffer is taken at the link's first read, FIRST_BUFFER bytes, and doubled whenever a
# message not yet whole fills it (``Reader._make_room``); ``Reader.rest`` gives it back when
# the link goes quiet, and closing the link does: an idle or closed link holds no buffer.
SCRATCH = 256 << 10
FIRST_BUFFER = 16 << 10
# A larger message is read straight into the buffers of its parts: a part of SMALL_PART bytes or
# more into a buffer of its own (handed out as it is, not copied), the smaller parts between
# them into shared buffers of RUN_BYTES at most, copied out of them when the message is whole.
SMALL_PART = 64 << 10
RUN_BYTES = 1 << 20
# Large messages cross the socket in pieces of its send buffer, each piece a wake-up of the
# reader and then of the writer: ask for 4 MiB (the kernel caps it at net.core.wmem_max).
SOCKET_BUFFER = 4 << 20
# Bytes one read of a large message asks for at most.  A read of a stream socket goes on
# copying for as long as the writer keeps writing, so one read offered a whole message could
# take all of it (a broker reading 300 MiB in one call serves no other client for ~1 s): each
# read is offered this many bytes of buffers, which keeps it to a few milliseconds.
READ_BYTES = 4 << 20


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
    """A message of more than ``SCRATCH // 2`` bytes while it is read: its parts' buffers in stream
    order (``pieces``: a buffer and None for a part with a buffer of its own, or a buffer and
    the lengths of the small parts it holds back to back), their size (``total``) and how much
    of it is read (``filled``: the one number a read changes, so that an interruption leaves no
    half-made change).  ``MemoryError`` when the buffers cannot be allocated."""

    __slots__ = ("pieces", "total", "filled", "made", "next_piece", "_at")

    def __init__(self, lens: tuple[int, ...]) -> None:
        pieces: list[Any] = []  # (buffer, run) each, None once ``parts`` let it go
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
        self.total = sum(lens)
        self.filled = 0
        self.made: list = []  # the parts ``parts`` made so far (of pieces before ``next_piece``)
        self.next_piece = 0
        self._at = (0, 0)  # (piece index, bytes before it): where ``filled`` was last found

    def head(self) -> memoryview:
        """The unfilled bytes of the piece ``filled`` is in (``filled < total``)."""
        pieces = self.pieces
        i, before = self._at
        while True:
            buf = pieces[i][0]
            if self.filled - before < buf.nbytes:
                break
            before += buf.nbytes
            i += 1
        self._at = (i, before)  # one store: an interruption leaves a true one
        return buf.data[self.filled - before :]

    def head_buffers(self, limit: int) -> list[memoryview]:
        """The next ``limit`` unfilled bytes (fewer at the end of the message), in stream
        order, in at most ``IOV_MAX`` buffers."""
        head = self.head()
        if head.nbytes >= limit:
            return [head[:limit]]
        views = [head]
        room = limit - head.nbytes
        i = self._at[0]
        for piece in self.pieces[i + 1 : i + IOV_MAX]:
            buf = piece[0].data
            if buf.nbytes >= room:
                views.append(buf[:room])
                break
            views.append(buf)
            room -= buf.nbytes
        return views

    def fill(self, data: memoryview) -> None:
        """Copy ``data`` (the next bytes of the message) into the unfilled buffers."""
        while data.nbytes:
            head = self.head()
            n = min(head.nbytes, data.nbytes)
            head[:n] = data[:n]
            data = data[n:]
            self.filled += n

    def parts(self) -> list:
        """The whole message's parts: the large ones as writable views of their own buffers,
        the small ones (and the header) as ``bytes`` (each shared buffer is let go once its
        parts are copied out: the message is not held twice).  Interrupted, a second call goes
        on where the first stopped."""
        pieces = self.pieces
        made = self.made
        while self.next_piece < len(pieces):
            k = self.next_piece
            buf, run = pieces[k]
            if run is None:
                out = [buf.data]
            else:
                view, pos, out = buf.data, 0, []
                for n in run:
                    out.append(bytes(view[pos : pos + n]))
                    pos += n
            # the parts, the piece let go and the next piece: no call between them, so an
            # interruption (a signal handler runs at calls) comes before or after all three
            made += out
            pieces[k] = None
            self.next_piece = k + 1
        if type(made[0]) is not bytes:
            made[0] = bytes(made[0])  # the header: decoded at once
        return made


class Reader:
    """Cuts a byte stream into messages: lists of parts, ``bytes`` for a small part (all the
    parts of a message of at most ``SCRATCH // 2`` bytes, read in place into the read buffer)
    and a writable ``memoryview`` of a buffer of its own for a large one (``LargeMessage``).
    With a ``header_budget``, it reads nothing more once the messages cut and not yet taken
    hold that many bytes of headers (their reader handles them first).

    A Python signal handler (Ctrl-C's ``KeyboardInterrupt``) runs in the main thread between
    two bytecodes, right after a call returns among others, and what it raises leaves the
    function there: bytes a read returned but not yet counted would be lost, and the stream
    out of step from then on.  So the read's count is recorded by the C call that reads
    (``counts``, one ``list.extend`` around ``os.readv``), applied with no call in between
    (``_absorb``), and the cutting into messages (``_settle``) picks up where an interruption
    left it; ``unsettled`` says whether one left work that no new byte will prompt.  Reading
    again finishes it."""

    def __init__(self, max_parts: int, max_header: int, max_part: int = 0,
                 max_total: int = 0, header_budget: int = 0) -> None:
        self.max_parts = max_parts
        self.max_header = max_header
        self.max_part = max_part  # 0: no limit
        self.max_total = max_total or host_memory()  # all parts of one message
        self.header_budget = header_budget  # 0: no limit
        self.buf = bytearray()  # the read buffer: none before the first read (``_make_room``)
        self.start = self.end = 0
        self.big: LargeMessage | None = None  # the large message being read
        self.messages: deque[list] = deque()
        self.header_bytes = 0  # of the messages cut since ``messages`` was last empty
        self.counts: list[int] = []  # bytes of reads not yet absorbed (one at most)
        self.dirty = False  # bytes absorbed and not yet cut into messages
        self.busy = False  # it read since the last ``rest_if_quiet``

    def unsettled(self) -> bool:
        """Whether an interruption left read bytes not yet cut into messages."""
        return self.dirty or bool(self.counts)

    def read(self, fd: int) -> int:
        """Read what the socket has (one system call, ``READ_BYTES`` at most) and cut the
        messages it completes into ``messages``; the bytes read, 0 at end of stream.
        ``BlockingIOError`` when nothing is there, or when the messages not yet taken reached
        the header budget; ``FramingError`` on a broken stream.  First it finishes what an
        interruption left (then the bytes it absorbs count as read)."""
        counts = self.counts
        if counts:  # a read an interruption cut short of being counted
            n = self._absorb()
            if n:
                self._settle()
            return n
        if self.dirty:  # bytes an interruption left uncut
            self._settle()
        self.busy = True
        if not self.messages:
            self.header_bytes = 0
        elif self.header_budget and self.header_bytes >= self.header_budget:
            raise BlockingIOError("the messages read are not handled yet")
        if self.big is not None:
            counts.extend(map(os.readv, (fd,), (self.big.head_buffers(READ_BYTES),)))
            n = self._absorb()
            if n:
                self._settle()
            return n
        # the read buffer (most reads): as ``_absorb`` and ``_settle``, without their calls
        if self.end == len(self.buf):
            self._make_room()
        # the count is recorded by the call that reads (``map`` calls ``os.readv``)
        counts.extend(map(os.readv, (fd,), ([memoryview(self.buf)[self.end :]],)))
        n = counts[0]
        self.end += n
        self.dirty = True
        del counts[0]
        if n:
            self._cut()
        self.dirty = False
        return n

    def _absorb(self) -> int:
        """Apply the recorded count of the last read: the bytes it added (0: end of stream).
        Nothing but loads and stores from reading the count to dropping it."""
        counts = self.counts
        n = counts[0]
        if self.big is not None:
            self.big.filled += n
        else:
            self.end += n
        self.dirty = True
        del counts[0]
        return n

    def _settle(self) -> None:
        """Cut the absorbed bytes into messages: complete the large message, or cut the
        read buffer (each step leaves a state the next call goes on from)."""
        big = self.big
        if big is not None:
            if big.filled == big.total:
                parts = big.parts()
                self.big = None  # with the append: no call between them
                self.messages.append(parts)
                self.header_bytes += len(parts[0])
        else:
            self._cut()
        self.dirty = False

    def _compact(self) -> None:
        """Move the bytes held (a message not yet whole) to the front of the read buffer."""
        avail = self.end - self.start
        if self.start:
            self.buf[:avail] = self.buf[self.start : self.end]
            self.start, self.end = 0, avail

    def _make_room(self) -> None:
        """Room in the full read buffer for the next read: the bytes it holds moved to its
        front, or, when they fill all of it (a message not yet whole; nothing, before the
        first read), into a buffer twice its size (``FIRST_BUFFER`` at first).  A message
        read in place is at most ``SCRATCH // 2`` bytes after its part lengths, so the buffer
        grows past ``SCRATCH`` only for the part lengths of a message of many parts."""
        buf = self.buf
        avail = self.end - self.start
        if avail < len(buf):
            self._compact()
            return
        grown = bytearray(max(FIRST_BUFFER, 2 * len(buf)))
        with memoryview(buf) as view:
            grown[:avail] = view[self.start : self.end]
        self.buf, self.start, self.end = grown, 0, avail  # one step: no call between them

    def rest_if_quiet(self) -> int:
        """Give back the read buffer (``rest``) if nothing was read since the last call (the
        broker calls it every half heartbeat interval); the bytes given back."""
        if self.busy:
            self.busy = False
            return 0
        if len(self.buf) > self.end - self.start and not self.unsettled():
            return self.rest()
        return 0

    def rest(self) -> int:
        """Give back the read buffer, keeping only the bytes it holds (a message not yet
        whole) in a buffer of their size; the next read takes a buffer again.  The bytes
        given back."""
        size, held = len(self.buf), self.end - self.start
        kept = bytearray(memoryview(self.buf)[self.start : self.end]) if held else bytearray()
        self.buf, self.start, self.end = kept, 0, held  # one step: no call between them
        return size - held

    def close(self) -> int:
        """Give back every buffer: the read buffer, a large message's and the messages not
        taken (the stream is closed); the read buffer's bytes."""
        size = len(self.buf)
        self.buf, self.start, self.end, self.big = bytearray(), 0, 0, None
        self.messages.clear()
        return size

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
        """Cut the complete messages of the read buffer into ``messages``, and start the
        large message whose beginning it holds.  Each message taken moves ``start`` in the
        same step as it joins ``messages`` (or ``big``): an interruption never takes one twice
        or loses one."""
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
                self.header_bytes += lens[0]
                continue
            try:
                big = LargeMessage(lens)
            except MemoryError:
                raise FramingError(f"no memory for a message of {total} bytes") from None
            have = min(total, avail - prefix)
            with memoryview(buf) as view:
                big.fill(view[start + prefix : start + prefix + have])
            if have == total:
                parts = big.parts()
                self.start += prefix + have
                self.messages.append(parts)
                self.header_bytes += lens[0]
                continue
            self.start += prefix + have
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


def nbytes(buf: Any) -> int:
    """The size of a buffer of a message's ``iovec``."""
    return len(buf) if type(buf) is bytes else byte_view(buf).nbytes


def advance(bufs: deque, n: int) -> None:
    """Drop the first ``n`` bytes of ``bufs`` (what a ``writev`` wrote)."""
    while n:
        head = bufs[0]
        size = nbytes(head)
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
