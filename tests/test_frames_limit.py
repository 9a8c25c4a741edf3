"""A broker's ``max_frames``: told to clients at hello, checked by the client before a put is
sent (and before any of it is copied into shared memory), never passed by the client's
coalescing of requests, and answered by the broker -- not dropped in silence -- when a message
over it still arrives (docs/protocol.md, "Limits")."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq
from conftest import wait_until
from zchannel.broker import Channel
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, hello_info, pack_header

pytestmark = pytest.mark.timeout(240)

DEADLINE_S = 60.0  # generous: a loaded 2-core machine
MAX_FRAMES = 4096  # the lowest max_frames a broker takes
CONFIG = f"[channel]\nmax_frames = {MAX_FRAMES}\n"
T = 256 << 10  # the shared-memory threshold of the brokers here
# 64 KiB: an array of this size travels as a frame of its own (below the shared-memory
# threshold); one array repeated makes many frames of little memory on this side
FRAME = np.zeros(8192)


def _connect(address: str, path: str, monkeypatch, channels: list) -> Channel:
    if path == "zmq":  # as a client on another host: ZeroMQ, no shared memory
        monkeypatch.setenv("ZCHANNEL_DIRECT", "0")
        monkeypatch.setenv("ZCHANNEL_SHM", "0")
    ch = Channel.connect(address)
    channels.append(ch)
    assert ch.qsize() == 0  # (its hello is answered)
    assert ch._connection().direct == (path == "same host")
    return ch


@pytest.mark.parametrize("path", ["zmq", "same host"])
def test_a_put_of_more_frames_than_max_frames_is_refused_at_once(cli_broker, channels,
                                                                 monkeypatch, path):
    """An item of 4100 arrays of 64 KiB (a frame each) and one large array to a broker of
    ``max_frames = 4096``: the put raises a ``ValueError`` naming the limit at once, before
    anything is sent, nothing is stored, the shared-memory slot its large array took is given
    back, and the handle goes on working.
    (The broker dropped the message with a log line only: the put never returned, its
    timeout never fired.)"""
    address = cli_broker("frames", "--shm-threshold", str(T), config=CONFIG)
    ch = _connect(address, path, monkeypatch, channels)
    pool = ch._connection().shm.pool
    item = [FRAME] * 4100 + [np.ones(2 * T, np.uint8)]  # the last takes a slot, or a frame
    frames = 4101 if pool is not None else 4102  # with the item's body
    with pytest.raises(ValueError, match=rf"^item of {frames} frames exceeds the broker's "
                                         rf"max_frames limit \({MAX_FRAMES}\)"):
        work = ch.put(item, timeout=5, async_op=True)
        work.wait(timeout=DEADLINE_S)  # (where the put used to wait for good)
    if pool is not None:  # the slot its large array took is free again
        assert pool.by_name and all(not seg.states.any() for seg in pool.by_name.values())
    assert ch.qsize() == 0
    ch.put([FRAME] * 3, timeout=DEADLINE_S)  # within the limit
    assert len(ch.get(timeout=DEADLINE_S)) == 3
    assert ch._connection().broker_info.max_frames == MAX_FRAMES  # (told at hello)


def test_a_put_over_max_frames_and_max_message_bytes_takes_no_shared_memory(cli_broker,
                                                                          channels):
    """Where the client sizes a same-host put before encoding it (a broker with
    ``max_message_bytes``), an item over ``max_frames`` is refused before any of its arrays is
    copied into shared memory: the pool makes no segment."""
    address = cli_broker("sized", "--shm-threshold", str(T), "--max-message-bytes", str(1 << 40),
                         config=CONFIG)
    ch = Channel.connect(address)
    channels.append(ch)
    assert ch.qsize() == 0
    pool = ch._connection().shm.pool
    assert pool is not None
    with pytest.raises(ValueError, match=rf"^item of 4101 frames exceeds the broker's "
                                         rf"max_frames limit \({MAX_FRAMES}\)"):
        work = ch.put([FRAME] * 4100 + [np.ones(2 * T, np.uint8)], timeout=5, async_op=True)
        work.wait(timeout=DEADLINE_S)
    assert pool.total == 0 and not pool.by_name
    assert ch.qsize() == 0


def test_coalesced_puts_stay_within_max_frames(cli_broker, channels, monkeypatch):
    """Two puts queued together, one of one frame and one of exactly ``max_frames`` frames: the
    client sends them in two messages.  (It put both in one message of 4097 frames, which the
    broker dropped: neither put ever returned.)"""
    address = cli_broker("coalesced", config=CONFIG)
    ch = _connect(address, "zmq", monkeypatch, channels)
    conn = ch._connection()
    line = conn._line
    assert wait_until(line.take, timeout=DEADLINE_S)  # nothing is sent while this thread holds it
    try:
        small = ch.put(b"s" * 1000, async_op=True)  # its body is a frame
        large = ch.put([FRAME] * (MAX_FRAMES - 1), async_op=True)  # body + 4095 buffers
        assert len(conn._queue) == 2
        conn._requests.send_queued()  # both at once, as the queue's holder sends them
    finally:
        line.give()
    small.wait(timeout=DEADLINE_S)
    large.wait(timeout=DEADLINE_S)
    assert ch.qsize() == 2


class _Raw:
    """A bare DEALER speaking the protocol (no zchannel client code on this side)."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.replies: dict[int, dict] = {}

    def send(self, records: list[dict], frames: list[bytes] = ()) -> None:
        self.sock.send_multipart([pack_header(records), *frames])

    def reply(self, rid: int) -> dict:
        """The reply record of ``rid`` (others kept for later calls, heartbeats left out)."""
        while rid not in self.replies:
            assert self.sock.poll(int(DEADLINE_S * 1000)), f"no reply to request {rid}"
            header, *_ = self.sock.recv_multipart()
            for rec in msgpack.unpackb(header, raw=False):
                if "id" in rec:
                    self.replies[rec["id"]] = rec
        return self.replies.pop(rid)


def test_a_message_over_max_frames_is_answered_not_dropped(cli_broker):
    """A message of more frames than ``max_frames`` (from a client that did not check: another
    implementation, or an older one) gets an error reply under each request id its header
    names, and none of its requests is handled; the client is served on.  The hello reply
    names ``max_frames``, and a hello reply without it (an older broker) leaves it unknown."""
    address = cli_broker("answered", config=CONFIG)
    raw = _Raw(address)
    try:
        raw.send([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION}])
        info = raw.reply(1)["r"]
        n = MAX_FRAMES + 1
        raw.send([{"op": "put", "id": 2, "k": "q", "nf": n, "fs": [1] * n},
                  {"op": "qsize", "id": 3, "k": "q"},
                  {"op": "puts", "id": 4, "p": [{"op": "put", "id": 5, "k": "q", "b": b"x"}]}],
                 [b"x"] * n)
        for rid in (2, 3, 4):
            kind, message, _ = raw.reply(rid)["e"]
            assert kind == "ValueError"
            assert f"a message of {n} frames exceeds the broker's max_frames limit " \
                   f"({MAX_FRAMES})" in message
        raw.send([{"op": "qsize", "id": 6, "k": "q"}])
        assert raw.reply(6) == {"id": 6, "r": 0}  # nothing of it was stored
        assert info["max_frames"] == MAX_FRAMES
        assert hello_info(info).max_frames == MAX_FRAMES
        assert hello_info({k: v for k, v in info.items() if k != "max_frames"}).max_frames is None
    finally:
        raw.sock.close()
