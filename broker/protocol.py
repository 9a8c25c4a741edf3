"""The wire protocol between clients (DEALER) and a broker (ROUTER), written once.

A message is ``[header, *frames]``.  The header is msgpack: a list of *records*, one per
operation (clients and the broker coalesce several operations into one message).  Record ``i``
owns the next ``record["nf"]`` frames.  See ``docs/protocol.md`` for the full description.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgpack
import zmq

PROTOCOL_VERSION = 1

# Request operations (client -> broker).
HELLO, BYE, HEARTBEAT = "hello", "bye", "hb"
PUT, GET, GET_BATCH = "put", "get", "get_batch"
QSIZE, FULL, STATS, ACK, CANCEL, SHUTDOWN = "qsize", "full", "stats", "ack", "cancel", "shutdown"
PEEK = "peek"  # copies of head items, left in place (docs/protocol.md)
REQUEST_OPS = frozenset(
    {HELLO, BYE, HEARTBEAT, PUT, GET, GET_BATCH, QSIZE, FULL, STATS, ACK, CANCEL, SHUTDOWN, PEEK}
)
# Broker -> client records without a request id.
EXPIRED = "expired"

# An item body of at most this many bytes (and no other frame) travels inside its record, as
# field ``b``, instead of as a frame of its own: one frame less to send and receive per small
# item on each side (docs/protocol.md).
INLINE_BODY = 512

# Default limits (the broker's are configurable).
MAX_HEADER_BYTES = 1 << 20
MAX_FRAMES = 65536
MAX_RECORDS = 4096


class ProtocolError(ValueError):
    """A message that does not follow the protocol."""


# Plain ints: pyzmq's enum flags cost an enum operation per frame on the hot path.
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)


def client_socket(curve: Any = None) -> zmq.Socket:
    """A client's DEALER socket, not connected yet: unbounded queues (the client keeps its own
    in-flight limit), no linger, reconnecting every 0.1-1 s; ``curve``: the client's
    ``security.CurveKeys`` (``ValueError`` for key files without their key)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
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


_packer = msgpack.Packer(use_bin_type=True)


def pack_header(records: list[dict[str, Any]]) -> bytes:
    return _packer.pack(records)


def unpack_header(data: bytes | memoryview, nframes: int, max_bytes: int = MAX_HEADER_BYTES) -> list[dict]:
    """Decode and check a header against the ``nframes`` frames that follow it."""
    if len(data) > max_bytes:
        raise ProtocolError(f"header of {len(data)} bytes exceeds the header limit ({max_bytes})")
    try:
        records = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise ProtocolError(f"malformed header: {type(exc).__name__}: {exc}") from None
    if not isinstance(records, list) or not records or len(records) > MAX_RECORDS:
        raise ProtocolError("a header is a non-empty list of records")
    total = 0
    for record in records:
        if type(record) is not dict:  # msgpack gives exact types; this loop is per operation
            raise ProtocolError("a header record is a map")
        nf = record.get("nf", 0)
        if type(nf) is not int or nf < 0:  # bool is not int here
            raise ProtocolError("record field nf must be an int >= 0")
        total += nf
    if total != nframes:
        raise ProtocolError(f"header declares {total} frames but the message has {nframes}")
    return records


def key_from_wire(value: Any) -> Any:
    """Keys travel as msgpack, tuples as arrays (a key is never a list): arrays become tuples."""
    if isinstance(value, list):
        return tuple(key_from_wire(v) for v in value)
    return value
