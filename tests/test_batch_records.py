"""Small items of a get_batch inside its reply record: a client whose hello says it reads
``items`` records (``it``) gets a get_batch of small items (one frame of at most
``INLINE_BODY`` bytes each, no shared memory) as one record whose ``bs`` lists their bodies in
order, with no frame and no ``n``; any other batch, or any other client, gets the items as
frames.  The decoder refuses a ``bs`` that is not a list of 1-4096 bodies of at most
``INLINE_BODY`` bytes, and the client refuses a ``bs`` reply that also has frames or ``n``."""

from __future__ import annotations

import msgpack
import pytest
import zmq
from test_get_runs import value
from test_item_records import items_dealer
from test_put_batches import body, exchange, put, raw_dealer
from zchannel.broker import Channel
from zchannel.broker.handle.broker_channel import _batch_converter
from zchannel.broker.wire.protocol import (
    INLINE_BODY,
    MAX_BATCH_PUTS,
    BadRecord,
    ProtocolError,
    Reply,
    pack_header,
    unpack_replies,
)

pytestmark = pytest.mark.timeout(120)


def batch_reply(raw: zmq.Socket, rid: int) -> tuple[dict, list[bytes]]:
    """Send get_batch ``rid`` (key ``k``, target 2) and return its reply record and frames
    (heartbeats skipped)."""
    raw.send_multipart([pack_header([{"op": "get_batch", "id": rid, "k": "k", "tw": 2}])])
    while True:
        assert raw.poll(10_000), "no reply"
        header, *frames = raw.recv_multipart()
        for rec in msgpack.unpackb(header):
            if rec.get("id") == rid:
                return rec, frames


def test_a_batch_of_small_items_is_one_record_of_bodies(channels):
    ch = Channel.create("bs-small")
    channels.append(ch)
    with items_dealer(ch) as raw:
        exchange(raw, [put(2, "k", "a", w=1), put(3, "k", [1, 2], w=2), put(4, "k", "c", w=3)])
        (rec,) = exchange(raw, [{"op": "get_batch", "id": 5, "k": "k", "tw": 3}])
        assert rec["id"] == 5 and "n" not in rec and "nf" not in rec
        assert [value({"b": b}) for b in rec["bs"]] == ["a", [1, 2]]
        (rec,) = exchange(raw, [{"op": "get_batch", "id": 6, "k": "k", "tw": 1}])
        assert rec["bs"] == [body("c")]  # a head heavier than the target comes alone
    assert ch.stats()["delivered"] == 3


def test_a_client_that_did_not_ask_gets_frames(channels):
    ch = Channel.create("bs-old")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        exchange(raw, [put(2, "k", "a", w=1), put(3, "k", "b", w=1)])
        rec, frames = batch_reply(raw, 4)
        assert "bs" not in rec and rec["n"] == [1, 1] and rec["nf"] == 2
        assert [value({"b": f}) for f in frames] == ["a", "b"]


def test_a_batch_with_a_large_item_keeps_its_frames(channels):
    ch = Channel.create("bs-large")
    channels.append(ch)
    big = body(b"x" * (INLINE_BODY * 4))
    with items_dealer(ch) as raw:
        exchange(raw, [put(2, "k", "a", w=1), {"op": "put", "id": 3, "k": "k", "w": 1, "nf": 1}],
                 (big,))
        rec, frames = batch_reply(raw, 4)
        assert "bs" not in rec and rec["n"] == [1, 1] and len(frames) == 2
        assert value({"b": frames[1]}) == b"x" * (INLINE_BODY * 4)


def test_a_consumer_takes_batches_in_order(channels):
    ch = Channel.create("bs-client")
    channels.append(ch)
    works = [ch.get_batch(64, key="k", async_op=True, timeout=30) for _ in range(4)]
    for i in range(256):
        ch.put(i, weight=1, key="k", async_op=True)
    batches = [w.wait(timeout=30) for w in works]
    assert [len(b) for b in batches] == [64] * 4
    assert [x for b in batches for x in b] == list(range(256))
    ch.put({"big": b"y" * (INLINE_BODY * 2)}, weight=1, key="k")
    ch.put("small", weight=1, key="k")
    assert ch.get_batch(2, key="k", timeout=30) == [{"big": b"y" * (INLINE_BODY * 2)}, "small"]
    assert ch.stats()["delivered"] == 258


@pytest.mark.parametrize("bodies", [
    [],  # no body
    ["x"],  # a str body
    [b"x", 1],
    [None],
    [b"x" * (INLINE_BODY + 1)],  # a body too long to be inline
    "not a list",
    {b"x": 1},
    [b"x"] * (MAX_BATCH_PUTS + 1),  # more bodies than a record holds
])
def test_a_malformed_bs_is_refused(bodies):
    data = msgpack.packb([{"id": 1, "bs": bodies}, {"id": 3}], use_bin_type=True)
    bad, good = unpack_replies(data, 0)  # the record fails alone (its request, client-side)
    assert isinstance(bad, BadRecord) and bad.id == 1 and isinstance(bad.error, ProtocolError)
    assert isinstance(good, Reply) and good.id == 3


def test_bs_round_trips():
    rec = Reply(id=7, bodies=[b"a", b"", b"x" * INLINE_BODY])
    (back,) = unpack_replies(pack_header([rec]), 0)
    assert back.id == 7 and back.bodies == [b"a", b"", b"x" * INLINE_BODY] and back.counts is None


@pytest.mark.parametrize("extra", [{"counts": [1]}, {"nf": 1}, {"slots": [None]}])
def test_a_bs_reply_with_frames_counts_or_slots_is_refused(extra):
    rec = Reply(id=1, bodies=[body("a")], **extra)
    frames = [body("b")] if "nf" in extra else []
    with pytest.raises(ValueError, match="malformed reply"):
        _batch_converter(None)(rec, frames)
    assert _batch_converter(None)(Reply(id=1, bodies=[body("a")]), []) == ["a"]
