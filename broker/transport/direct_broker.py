"""The broker's end of the same-host direct link: the listening socket beside the broker's
``ipc://`` path and one ``Peer`` per client link (the client's end is ``transport/direct.py``;
the framing and the reader are ``transport/direct_framing.py``).
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections import deque

from zchannel.broker.host import paths
from zchannel.broker.host.heap import trim_heap
from zchannel.broker.transport.direct_framing import (
    IOV_MAX,
    Reader,
    advance,
    head_buffers,
    iovec,
    tune_socket,
)

READ_BUDGET = 32 << 20  # bytes the broker reads from one link per loop turn at most
# Header bytes of the messages the broker takes from one link per loop turn at most (more only
# by what the read that reached it brought), and from its ZeroMQ socket (``server/loop.py``):
# decoding a header costs up to ~50 ns a byte (a key of a million empty lists), where an
# item's bytes cost well under 1, so READ_BUDGET alone let one link's headers hold the loop
# for seconds.
HEADER_BUDGET = 1 << 20
# Read buffers given back (links gone quiet or closed) after which the broker hands freed heap
# pages back to the OS (glibc keeps them otherwise: 1,000 links that said hello and closed
# kept the broker's RSS 16 MB higher).
TRIM_BYTES = 8 << 20
# The broker's address of a link's client: the prefix and an 8-byte serial.  A zchannel client's
# ZeroMQ routing id is 16 random bytes and one libzmq makes up is 5 starting with \x00; a peer
# that chose one of this form is refused (``is_link_address``), so that it cannot speak as a link.
ADDRESS_PREFIX = b"\x00D"
ADDRESS_BYTES = len(ADDRESS_PREFIX) + 8
# Messages the broker queues for one client that does not read them, at most (over ZeroMQ the
# ROUTER's SNDHWM, over a direct link ``Peer.send``): past it the client is ended and the
# items of its unsent replies go back to their queues.  A zchannel client reads all the time
# and has at most 1,024 requests outstanding (each answered in one message at most), so only
# a client that stopped reading gets there.
MAX_QUEUED_MESSAGES = 2048
# Buffers (frames, headers) queued for one client at most, likewise: messages of many small
# frames hold far more memory than their count says.
MAX_QUEUED_BUFFERS = 1 << 20


def is_link_address(routing_id: bytes) -> bool:
    """Whether ``routing_id`` has the form of a direct link's address."""
    return len(routing_id) == ADDRESS_BYTES and routing_id.startswith(ADDRESS_PREFIX)


class Peer:
    """The broker's end of one direct link."""

    __slots__ = ("sock", "fd", "address", "reader", "out", "since", "greeted", "ends",
                 "queued", "written")

    def __init__(self, sock: socket.socket, address: bytes, reader: Reader) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.address = address
        self.reader = reader
        self.out: deque = deque()  # bytes not yet written (the socket was full)
        self.since = time.monotonic()  # accepted then
        self.greeted = False  # it said hello (a link that never does is closed after expiry)
        # where each message not yet written whole ends, in bytes queued since the link began
        self.ends: deque[int] = deque()
        self.queued = self.written = 0  # bytes queued, bytes written, since the link began

    def send(self, parts: list) -> bool:
        """Queue one message and write what the socket takes now; False if the peer is gone,
        or if ``MAX_QUEUED_MESSAGES`` messages (``MAX_QUEUED_BUFFERS`` buffers) already wait
        for it (it stopped reading)."""
        bufs, total = iovec(parts)
        out = self.out
        if out and (len(self.ends) >= MAX_QUEUED_MESSAGES or len(out) >= MAX_QUEUED_BUFFERS):
            return False
        self.queued += total
        if self.out:
            self.out.extend(bufs)
            self.ends.append(self.queued)
            return True
        try:
            n = os.writev(self.fd, bufs[:IOV_MAX])
        except BlockingIOError:
            n = 0
        except OSError:
            return False
        self.written += n
        if n < total:
            self.out.extend(bufs)
            advance(self.out, n)
            self.ends.append(self.queued)
        return True

    def write_out(self) -> bool:
        """Write queued bytes (the socket said it has room); False if the peer is gone."""
        while self.out:
            try:
                n = os.writev(self.fd, head_buffers(self.out))
            except BlockingIOError:
                return True
            except OSError:
                return False
            advance(self.out, n)
            self.written += n
            ends = self.ends
            while ends and ends[0] <= self.written:
                ends.popleft()
        return True


class Listener:
    """The broker's listening socket for direct links and its peers (by fd and by address).
    ``FileExistsError`` when ``path`` is taken by something other than a socket file (it is
    left alone)."""

    def __init__(self, path: str, max_parts: int, max_header: int, max_part: int,
                 max_total: int = 0) -> None:
        # a socket file there is stale (the broker holds the channel lock and its own address);
        # anything else is not the broker's: FileExistsError, and no direct link
        paths.clear_socket_file(path)
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.made = paths.socket_identity(path)  # ``close`` removes this file only
        os.chmod(path, 0o600)
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        self.limits = (max_parts, max_header, max_part, max_total)
        self.by_fd: dict[int, Peer] = {}
        self.by_address: dict[bytes, Peer] = {}
        self._serial = 0
        self.starved = False  # the last accept ran out of descriptors
        self.given_back = 0  # bytes of read buffers given back since the heap was last trimmed

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
            tune_socket(sock)
            self._serial += 1
            address = ADDRESS_PREFIX + self._serial.to_bytes(8, "little")
            peer = Peer(sock, address, Reader(*self.limits, header_budget=HEADER_BUDGET))
            self.by_fd[peer.fd] = peer
            self.by_address[address] = peer
            peers.append(peer)
        return peers

    def drop(self, peer: Peer) -> None:
        """Close a link and give back its buffers."""
        self.by_fd.pop(peer.fd, None)
        self.by_address.pop(peer.address, None)
        peer.out.clear()
        self.given_back += peer.reader.close()
        peer.sock.close()

    def rest_quiet(self) -> None:
        """Give back the read buffers of the links that sent nothing since the last call
        (``Reader.rest_if_quiet``; the broker calls it every half heartbeat interval), and
        the heap's free pages to the OS once ``TRIM_BYTES`` of them were given back."""
        given_back = self.given_back
        for peer in self.by_fd.values():
            given_back += peer.reader.rest_if_quiet()
        self.given_back = given_back
        if given_back >= TRIM_BYTES:
            self.given_back = 0
            trim_heap()

    def close(self) -> None:
        for peer in list(self.by_fd.values()):
            self.drop(peer)
        self.sock.close()
        paths.remove_socket_file(self.path, self.made)
