"""The broker's side of the transport seam: its clients' addresses and how a message reaches
each, over the ROUTER socket or over a same-host direct link.

A client's address (bytes) is its ZeroMQ routing id, or for a direct link one made up by the
listener (``direct_broker.ADDRESS_PREFIX`` and a serial number; a ZeroMQ peer whose routing id
has that form is refused).  The broker's
loop (``server/loop.py``) knows clients only by address: it sends a message with ``send(address,
parts)``, whichever transport the client came by, and hands the direct links' bytes to
``read``, which cuts them into messages (``direct_framing.Reader``) for it to handle.  ``Peers`` knows
nothing of records, queues or shared memory: those ride inside the messages.
"""

from __future__ import annotations

import logging
import time

import zmq
from zchannel.broker.server.admission import PeerGuard
from zchannel.broker.transport import direct_broker, direct_framing
from zchannel.broker.transport.sockets import send_message

log = logging.getLogger("zchannel.broker")


class Peers:
    """The ROUTER socket and, beside it, the listener of direct links (None: none)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.listener: direct_broker.Listener | None = None
        self.guard: PeerGuard | None = None  # the connection budget (server/admission.py)
        # the poll set changed: links came or went, or a full socket holds bytes back
        self.poll_dirty = True
        self.accepting = True  # the listener is polled (False: the budget is used up)
        self._paused_until = 0.0  # no accept before then (the process ran out of descriptors)

    def send(self, address: bytes, parts: list) -> bool:
        """Send one message (``[header, *frames]``) to the client at ``address``; False when it
        cannot be reached (a direct link that broke is dropped: the broker then requeues what it
        held and ends the client)."""
        listener = self.listener
        if listener is not None:
            peer = listener.by_address.get(address)
            if peer is not None:
                if not peer.send(parts):
                    listener.drop(peer)
                    self.poll_dirty = True
                    return False
                if peer.out:
                    self.poll_dirty = True
                return True
            if direct_broker.is_link_address(address):
                return False  # a direct link that is gone
        try:
            send_message(self.sock, [address, *parts], nonblock=True)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise
        return True

    def greeted(self, address: bytes) -> None:
        """The client at ``address`` said hello (a direct link that never does is closed)."""
        listener = self.listener
        if listener is not None and address in listener.by_address:
            listener.by_address[address].greeted = True

    def expired(self, address: bytes, now: float) -> None:
        """The client at ``address`` expired: a direct link of it must say hello again within
        an expiry (a live client registers again) or is closed, with what it holds (a message
        read in part included)."""
        listener = self.listener
        peer = listener.by_address.get(address) if listener is not None else None
        if peer is not None:
            peer.greeted, peer.since = False, now

    def poll_set(self, base: list) -> list:
        """``base``, the listener while it accepts, and the direct links (with ``POLLOUT``
        where a full socket held bytes back)."""
        self.poll_dirty = False
        listener = self.listener
        if listener is None:
            return list(base)
        head = [(listener.fd, zmq.POLLIN)] if self.accepting else []
        return base + head + [
            (fd, zmq.POLLIN | (zmq.POLLOUT if p.out else 0))
            for fd, p in listener.by_fd.items()
        ]

    def accept(self) -> list[direct_broker.Peer]:
        """Accept the waiting direct links the connection budget has room for; with none (or
        no descriptor left) the listener is left alone until ``resume`` finds room: the links
        wait in its backlog, or their clients fall back to ZeroMQ."""
        listener = self.listener
        assert listener is not None
        guard = self.guard
        room = guard.room() if guard is not None else 1 << 30
        peers = listener.accept(room) if room > 0 else []
        if self.guard is not None:
            self.guard.direct = len(listener.by_fd)
            self.guard.links_changed()
        if room <= len(peers) or listener.starved:
            self.accepting = False
            self.poll_dirty = True
            self._paused_until = time.monotonic() + (0.1 if listener.starved else 0.0)
            log.warning("direct links wait: %s", "no descriptor left" if listener.starved else
                        f"max_clients ({guard.max_clients if guard else room}) connections held")
        return peers

    def resume(self, now: float) -> None:
        """Poll the listener again once the budget has room (the loop's heartbeat tick)."""
        if not self.accepting and now >= self._paused_until and (
                self.guard is None or self.guard.room() > 0):
            self.accepting = True
            self.poll_dirty = True

    def read(self, peer: direct_broker.Peer) -> tuple[bool, bool]:
        """Read a ready link until its socket is empty, or for at most ``direct_broker.READ_BUDGET``
        bytes (the other clients wait meanwhile; a loop turn per read would cost more than the
        read), one read of ``direct_framing.READ_BYTES`` at most at a time (the budget is
        checked between reads: a large message takes several turns); the messages it completed
        wait in ``peer.reader.messages``.  ``(alive, got bytes)``: False when the link is gone
        (end of stream, an error, broken framing)."""
        reader = peer.reader
        alive = True
        budget = direct_broker.READ_BUDGET
        try:
            while alive and budget > 0:
                n = reader.read(peer.fd)
                alive = n > 0
                budget -= n
        except BlockingIOError:
            pass
        except (OSError, direct_framing.FramingError) as exc:
            if isinstance(exc, direct_framing.FramingError):
                log.warning("closed a direct link that broke the framing: %s", exc)
            alive = False
        return alive, budget < direct_broker.READ_BUDGET

    def drop(self, peer: direct_broker.Peer) -> None:
        """Close a direct link (gone, or silent since it was accepted)."""
        assert self.listener is not None
        self.listener.drop(peer)
        self.poll_dirty = True
        if self.guard is not None:
            self.guard.direct = len(self.listener.by_fd)
            self.guard.links_changed()

    def close(self) -> None:
        """Close the direct links and their listener (the broker closes the ROUTER socket)."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
