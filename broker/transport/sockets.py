"""ZeroMQ sockets as the transports use them: a client's DEALER socket, the multipart sends and
non-blocking receives of both ends, without copying large frames, and socket monitors (the
handshake events both ends watch)."""

from __future__ import annotations

import itertools
import os
import struct
import uuid
from typing import Any

import zmq

# Plain ints: pyzmq's enum flags cost an enum operation per frame on the hot path.
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)


def client_socket(curve: Any = None) -> zmq.Socket:
    """A client's DEALER socket, not connected yet: unbounded queues (the client keeps its own
    in-flight limit), no linger, reconnecting every 0.1-1 s; ``curve``: the client's
    ``curve.CurveKeys`` (``ValueError`` for key files without their key)."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0),
                              (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 1000)):
            sock.setsockopt(option, value)
        if curve is not None:
            curve.apply(sock)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def send_message(sock: zmq.Socket, parts: list, nonblock: bool = False) -> None:
    """Send a multipart message without copying large frames (small ones are copied by pyzmq
    anyway, below its copy threshold)."""
    flags = _NOBLOCK if nonblock else 0
    last = len(parts) - 1
    send = sock.send
    for i, part in enumerate(parts):
        send(part, flags if i == last else flags | _SNDMORE, copy=False)


def _recv_frames(sock: zmq.Socket, flags: int) -> list[zmq.Frame]:
    """A frame received with ``flags`` and the rest of its message, none of them copied."""
    recv = sock.recv
    frame = recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = recv(0, copy=False)
        frames.append(frame)
    return frames


def _waiting(sock: zmq.Socket, ready: bool) -> bool:
    # A zero-timeout poll is cheaper than the zmq.Again raised by an empty non-blocking recv.
    return ready or bool(zmq.zmq_poll([(sock, _POLLIN)], 0))


def recv_message(sock: zmq.Socket, ready: bool = False) -> list[zmq.Frame] | None:
    """Receive one multipart message without blocking (None if there is none); ``ready``: a
    poll just said one is there."""
    if not _waiting(sock, ready):
        return None
    try:
        return _recv_frames(sock, _NOBLOCK)
    except zmq.Again:  # only after ``ready``, which a poll should not have said falsely
        return None


_RCVMORE = int(zmq.RCVMORE)


def recv_reply(sock: zmq.Socket, ready: bool = False) -> tuple[bytes, list[zmq.Frame]] | None:
    """Like ``recv_message``, as (header, frames): the header (small) copied, the frames after
    it not."""
    if not _waiting(sock, ready):
        return None
    try:
        header = sock.recv(_NOBLOCK)
    except zmq.Again:  # only after ``ready``, which a poll should not have said falsely
        return None
    return header, _recv_frames(sock, 0) if sock.getsockopt(_RCVMORE) else []

# the handshake failures a socket monitor reports
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_EVENT = struct.Struct("=HI")
_monitor_ids = itertools.count(1)


def monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket receiving ``events`` of ``sock``, at an inproc address of its own (pyzmq's
    default names it after the socket's descriptor number, which a socket made after a closed
    one reuses while libzmq may still hold the old endpoint: its events were then lost)."""
    address = f"inproc://zchannel-monitor-{os.getpid()}-{next(_monitor_ids)}"
    return sock.get_monitor_socket(events, addr=address)


def read_events(mon: zmq.Socket) -> list[tuple[int, int]]:
    """The (event, value) pairs waiting on a monitor socket."""
    events: list[tuple[int, int]] = []
    while True:
        try:
            frames = mon.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return events
        if len(frames) == 2 and len(frames[0]) == _EVENT.size:
            events.append(_EVENT.unpack(frames[0]))
