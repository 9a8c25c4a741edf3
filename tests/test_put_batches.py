"""Puts coalesced into ``puts`` records (``PutBatch``): the broker handles the puts of a batch in
order exactly as single puts (per-key FIFO, ``maxsize`` backpressure, retry-safe sequences,
errors per put) and answers the batch with one record listing the puts it stored; a malformed
batch is a ``ValueError`` reply to the batch's id, nothing of it stored, the broker unharmed.
The client coalesces runs of queued puts (``ZCHANNEL_BATCH``, on by default)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import msgpack
import pytest
import zmq
from zchannel.broker import Channel
from zchannel.broker.connection import batching
from zchannel.broker.wire import codec
from zchannel.broker.wire.protocol import (
    MAX_BATCH_PUTS,
    PROTOCOL_VERSION,
    ProtocolError,
    Put,
    PutBatch,
    Stats,
    batch_answer,
    pack_header,
)


@contextlib.contextmanager
def raw_dealer(ch: Channel, producer: bytes | None = None,
               items: bool = False) -> Iterator[zmq.Socket]:
    """A bare DEALER registered on ``ch``'s broker (with a producer id: retry-safe puts;
    ``items``: it reads ``items`` records)."""
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(ch.address)
    hello = {"op": "hello", "id": 1, "v": PROTOCOL_VERSION}
    if producer is not None:
        hello["pr"] = producer
    if items:
        hello["it"] = True
    try:
        raw.send_multipart([pack_header([hello])])
        assert raw.poll(10_000), "no hello reply"
        raw.recv_multipart()
        yield raw
    finally:
        raw.close()


def body(value: object) -> bytes:
    return codec.encode(value)[0]


def put(rid: int, key: str, value: object, **extra: object) -> dict:
    return {"op": "put", "id": rid, "k": key, "b": body(value), **extra}


def exchange(raw: zmq.Socket, records: list, frames: tuple = ()) -> list[dict]:
    """Send one message and return the records of the reply message."""
    raw.send_multipart([pack_header(records), *frames])
    assert raw.poll(10_000), "no reply"
    return msgpack.unpackb(raw.recv_multipart()[0])


def test_a_batch_is_stored_in_order_and_answered_by_one_record(channels):
    ch = Channel.create("batch-order")
    channels.append(ch)
    big = codec.encode(b"f" * 4096)[0]  # travels as a frame of the batch
    with raw_dealer(ch) as raw:
        batch = {"op": "puts", "id": 10, "nf": 1, "p": [
            put(2, "k", "a"), {"op": "put", "id": 3, "k": "k", "nf": 1}, put(4, "other", "c"),
            put(5, "k", "d"),
        ]}
        assert exchange(raw, [batch], (big,)) == [{"id": 10, "r": [2, 3, 4, 5]}]
    assert [ch.get("k", timeout=5) for _ in range(3)] == ["a", b"f" * 4096, "d"]
    assert ch.get("other", timeout=5) == "c"
    stats = ch.stats()
    assert stats["put_batches"] == 1 and stats["puts"] == 4


def _getters(ch: Channel, key: str) -> int:
    return ch.stats()["keys"].get(key, {}).get("getters", 0)


@pytest.mark.parametrize("trailing_weight", [0, 1])
def test_a_batch_gives_waiting_getters_what_single_puts_would(channels, trailing_weight):
    """A get_batch of weight 2 and a get wait; one record puts a, b (weight 1), c and d: the
    get_batch completes at b and takes a, b -- not c, even when c weighs 0 (a get_batch takes
    the zero-weight items right behind its last counted one only if they are there when it
    completes, and with single puts c comes after) --, the get takes c and d stays queued."""
    ch = Channel.create(f"batch-serves-{trailing_weight}")
    channels.append(ch)
    consumer = Channel.connect(ch.address)
    try:
        batch = consumer.get_batch(2, key="k", async_op=True, timeout=60)
        single = consumer.get(key="k", async_op=True, timeout=60)
        # a call on the same connection is answered after the gets sent before it: both wait
        assert consumer.qsize("k") == 0 and _getters(ch, "k") == 2
        with raw_dealer(ch) as raw:
            record = {"op": "puts", "id": 10, "p": [
                put(2, "k", "a", w=1), put(3, "k", "b", w=1), put(4, "k", "c", w=trailing_weight),
                put(5, "k", "d", w=1)]}
            assert exchange(raw, [record]) == [{"id": 10, "r": [2, 3, 4, 5]}]
        assert batch.wait(30) == ["a", "b"]
        assert single.wait(30) == "c"
        assert ch.qsize("k") == 1 and ch.get("k", timeout=5) == "d"
    finally:
        consumer.close()


def test_a_bad_put_in_a_batch_fails_alone(channels):
    ch = Channel.create("batch-errors")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        batch = {"op": "puts", "id": 10, "p": [
            put(2, "k", 1), {"op": "put", "id": 3, "k": [[[[[["deep"]]]]]], "b": body(2)},
            {"op": "put", "id": 4, "k": "k", "b": b"\x00" * 600}, put(5, "k", 3),
        ]}
        replies = {rec["id"]: rec for rec in exchange(raw, [batch])}
    assert replies[10] == {"id": 10, "r": [2, 5]}
    assert replies[3]["e"][0] in ("TypeError", "ValueError")
    assert replies[4]["e"][0] == "ValueError" and "inline" in replies[4]["e"][1]
    assert [ch.get("k", timeout=5) for _ in range(2)] == [1, 3] and ch.qsize("k") == 0


@pytest.mark.parametrize("batch, frames", [
    ({"op": "puts", "id": 10, "p": []}, ()),  # no put
    ({"op": "puts", "id": 10, "p": "not a list"}, ()),
    ({"op": "puts", "id": 10, "p": [{"op": "get", "id": 2, "k": "k"}]}, ()),  # not a put
    ({"op": "puts", "id": 10, "p": [put(2, "k", 1), {"op": "put", "id": "x", "k": "k"}]}, ()),
    ({"op": "puts", "id": 10, "p": [put(2, "k", 1, w=-1)]}, ()),  # a field out of bounds
    ({"op": "puts", "id": 10, "p": [put(2, "k", 1), 7]}, ()),  # a put that is not a map
    # frames: the batch's nf against its puts' (both ways)
    ({"op": "puts", "id": 10, "nf": 1, "p": [put(2, "k", 1)]}, (b"x",)),
    ({"op": "puts", "id": 10, "nf": 1, "p": [{"op": "put", "id": 2, "k": "k", "nf": 2}]},
     (b"x",)),
    # more puts than a batch may hold
    ({"op": "puts", "id": 10, "p": [put(i, "k", 0) for i in range(2, MAX_BATCH_PUTS + 3)]}, ()),
])
def test_a_malformed_batch_is_refused_whole(channels, batch, frames):
    ch = Channel.create("batch-hostile")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        (rec,) = exchange(raw, [batch], frames)
        assert rec["id"] == 10 and rec["e"][0] == "ValueError", rec
        # the broker serves this client and others as before; nothing of the batch was stored
        assert exchange(raw, [put(99, "k", "after")]) == [{"id": 99}]
    assert ch.get("k", timeout=5) == "after" and ch.qsize("k") == 0


def test_a_put_that_must_wait_holds_back_the_ones_behind_it(channels):
    ch = Channel.create("batch-full", maxsize=2)
    channels.append(ch)
    with raw_dealer(ch) as raw:
        batch = {"op": "puts", "id": 10, "p": [put(i, "k", i) for i in range(2, 6)]}
        assert exchange(raw, [batch]) == [{"id": 10, "r": [2, 3]}]  # 4 and 5 wait for room
        with pytest.raises(TimeoutError):
            ch.put("late", key="k", timeout=0)  # nothing overtakes the waiting puts
        assert ch.get("k", timeout=5) == 2
        assert raw.poll(10_000)
        assert msgpack.unpackb(raw.recv_multipart()[0]) == [{"id": 4}]
        assert ch.get("k", timeout=5) == 3
        assert raw.poll(10_000)
        assert msgpack.unpackb(raw.recv_multipart()[0]) == [{"id": 5}]
    assert [ch.get("k", timeout=5) for _ in range(2)] == [4, 5]


def test_a_batch_sent_again_is_stored_once(channels):
    ch = Channel.create("batch-retry")
    channels.append(ch)
    producer = os.urandom(16)
    with raw_dealer(ch, producer) as raw:
        batch = {"op": "puts", "id": 10, "p": [put(i, "k", i) for i in range(2, 5)]}
        assert exchange(raw, [batch]) == [{"id": 10, "r": [2, 3, 4]}]
    with raw_dealer(ch, producer) as raw:  # the same producer after a reconnect
        retry = {"op": "puts", "id": 20, "p": [put(30 + i, "k", i, sq=i) for i in range(2, 6)]}
        assert exchange(raw, [retry]) == [{"id": 20, "r": [32, 33, 34, 35]}]
    assert [ch.get("k", timeout=5) for _ in range(4)] == [2, 3, 4, 5] and ch.qsize("k") == 0
    assert ch.stats()["duplicate_puts"] == 3


def test_the_client_reads_a_batch_reply_strictly():
    ids = frozenset({2, 3, 4})
    assert batch_answer([4, 2], ids) == [4, 2] and batch_answer([], ids) == []
    for bad in (None, "2", [5], [2, 2], [True], [2.0], [2, 3, 4, 5], {"r": 2}):
        with pytest.raises(ProtocolError):
            batch_answer(bad, ids)


class _FakeRequests:
    """What ``batching`` uses of a connection's request queue, to check how it groups records."""

    def __init__(self) -> None:
        self.ids = iter(range(100, 200))
        self.batches: dict[int, tuple[bool, frozenset[int]]] = {}


def test_only_runs_of_consecutive_puts_are_grouped():
    conn = _FakeRequests()
    puts = [Put(id=i, key="k", nf=i % 2) for i in range(1, 6)]
    other = Stats(id=50)  # any record that is not a put keeps its place
    out = batching.group_records(conn, [puts[0], puts[1], other, puts[2], puts[3], puts[4]])
    assert [type(r) for r in out] == [PutBatch, Stats, PutBatch]
    assert out[0].puts == puts[:2] and out[0].nf == 1 and out[2].puts == puts[2:]
    assert out[2].nf == 2 and conn.batches == {out[0].id: (True, {1, 2}),
                                               out[2].id: (True, {3, 4, 5})}
    single = batching.group_records(conn, [puts[0], other])
    assert single == [puts[0], other]


# The first 50 puts are issued while this thread holds the socket, so they wait in the queue
# together (a caller sends a put itself when the socket is free, which the scheduling of the
# threads decides); the I/O thread sends them once it is given back.
STREAM = """
import sys, time
from zchannel.broker import Channel
ch = Channel.connect(sys.argv[1])
line = ch._connection()._line
while not line.take():  # the I/O thread may be reading (the hello's reply, a heartbeat)
    time.sleep(0.001)
works = [ch.put(i, key="s", async_op=True) for i in range(50)]
line.give()
works += [ch.put(i, key="s", async_op=True) for i in range(50, 2000)]
for w in works:
    w.wait(60)
ch.close()
"""


@pytest.mark.parametrize("setting", ["1", "0"])
def test_async_puts_travel_in_batches_unless_switched_off(channels, setting):
    ch = Channel.create(f"batch-switch-{setting}")
    channels.append(ch)
    env = {**os.environ, "ZCHANNEL_BATCH": setting}
    subprocess.run([sys.executable, "-c", STREAM, ch.address], env=env, check=True, timeout=120)
    assert [ch.get("s", timeout=5) for _ in range(2000)] == list(range(2000))
    batches = ch.stats()["put_batches"]
    assert (batches > 0) if setting == "1" else (batches == 0)


def test_a_bad_batch_setting_is_refused():
    env = {**os.environ, "ZCHANNEL_BATCH": "maybe"}
    proc = subprocess.run([sys.executable, "-c", "import zchannel.broker"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "ZCHANNEL_BATCH" in proc.stderr
