"""The client's transport seam: how one connection sends messages to its broker and reads the
broker's messages, over a ZeroMQ DEALER socket (``ZmqTransport``, here) or over a same-host
direct link (``direct.Link``).

A message is a list of parts, ``[header, *frames]`` (``wire/protocol.py``).  ``Connection``
(``connection/connection.py``) sees only the ``Transport`` interface:

- ``send(parts)``: one message, never blocking on a missing peer (lost if the transport is
  broken, as a message to a broker that went away is);
- ``recv(ready)``: the next message as ``(header, frames)``, or None when none is waiting;
- ``readable``: what a poll waits on for the next message, ``buffered()``: whether one was
  read already (a poll does not see it); ``notify_fd()``: the descriptor the
  I/O thread polls without touching the transport (``connection/connection.py``);
- ``callers_read``: sending and reading cost one system call each, so a calling thread sends
  its request and reads its reply itself (the direct link) instead of handing both to the I/O
  thread (ZeroMQ, whose own I/O threads do that work);
- ``up``, ``reconnect()``, ``gone``, ``last_read``, ``stall_s``: the link's state, which the
  connection's liveness (``connection/liveness.py``) watches; a ZeroMQ socket reconnects by itself and is
  always ``up``;
- ``handshake``: the CURVE handshake still watched (ZeroMQ only; its events socket is polled
  too until it ends);
- ``close()``: give the descriptors back (by the connection's I/O thread, last);
  ``close_after_fork()``: a forked child's copies of them.

``connection.open_transport`` chooses the implementation at connect time.  Neither
implementation is thread-safe: the connection serialises every use under its socket
lock.  Shared-memory slots (``shm.py``) are references inside the records; both transports
carry them alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import zmq
from zchannel.broker.host import paths
from zchannel.broker.transport.curve import HandshakeWatch
from zchannel.broker.transport.sockets import client_socket, recv_reply, send_message


class Transport(ABC):
    """One connection's way to its broker (see the module docstring)."""

    callers_read = False
    readable: Any = None
    handshake: HandshakeWatch | None = None  # a CURVE handshake still watched (ZeroMQ)
    up = True
    gone = False
    last_read = 0.0
    stall_s = 0.0
    where = ""  # what the broker listens at (for messages)

    @abstractmethod
    def send(self, parts: list) -> bool:
        """Send one message, ``[header, *frames]``, without waiting for a peer that is not
        there; False when it is lost so (frames are not copied)."""

    @abstractmethod
    def recv(self, ready: bool = False) -> tuple[Any, list] | None:
        """The next message as ``(header, frames)`` without blocking, or None when none is
        waiting; ``ready``: a poll of ``readable`` just said one is there."""

    @abstractmethod
    def notify_fd(self) -> int:
        """The descriptor that becomes readable when a message may be waiting."""

    def end_handshake(self) -> None:
        """Stop watching the handshake (it succeeded, or was refused)."""
        self.handshake = None

    def buffered(self) -> bool:
        """Whether a message was read already and waits in this process (a poll of
        ``readable`` does not see it: ``recv`` returns it without a system call)."""
        return False

    def reconnect(self) -> bool:
        """Connect again after the broker closed the transport (True: connected now)."""
        return True

    def broker_gone(self) -> bool:
        """Whether nothing listens at the broker's address any more (False: cannot tell)."""
        return False

    def address_removed(self) -> bool:
        """Whether the broker removed its address (a stopped broker's ipc socket file), told
        without connecting to it (False: cannot tell)."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Give the descriptors back (the broker sees the connection end).  Idempotent; the
        caller makes sure no other thread uses the transport any more."""

    @abstractmethod
    def close_after_fork(self) -> None:
        """In a forked child: give back this process's copies of descriptors the parent's
        broker would otherwise see open."""


class ZmqTransport(Transport):
    """A DEALER socket connected to the broker's ROUTER, and until the first CURVE handshake
    ends, the watch of its handshake events (``handshake``; its ``socket`` is polled too)."""

    def __init__(self, address: str, curve: Any = None) -> None:
        self.where = address
        self.sock = client_socket(curve)
        self.handshake: HandshakeWatch | None = None
        try:
            self.handshake = HandshakeWatch(self.sock, address, curve)
            self.sock.connect(address)
        except BaseException:  # bad key files: nothing stays open
            self.close()
            raise
        self.readable = self.sock

    def send(self, parts: list) -> bool:
        try:
            # never blocks with a peer (no high-water mark); without one (libzmq drops the
            # peer for good after a failed handshake) the message is lost, as over a broken
            # link, instead of blocking this thread for ever
            send_message(self.sock, parts, nonblock=True)
        except zmq.Again:
            return False
        return True

    def recv(self, ready: bool = False) -> tuple[bytes, list] | None:
        return recv_reply(self.sock, ready)

    def notify_fd(self) -> int:
        # ZMQ_FD: readable when the socket's state may have changed; it signals again only
        # once the socket was read until empty
        return int(self.sock.getsockopt(zmq.FD))

    def broker_gone(self) -> bool:
        return paths.nothing_listens(self.where)

    def address_removed(self) -> bool:
        return paths.socket_file_removed(self.where)

    def end_handshake(self) -> None:
        """Stop watching the handshake (it succeeded, or was refused)."""
        watch, self.handshake = self.handshake, None
        if watch is not None:
            watch.close()

    def close(self) -> None:
        self.end_handshake()
        self.sock.close(linger=0)

    def close_after_fork(self) -> None:
        pass  # the socket belongs to the parent's context, which a child must not touch
