"""Several gets answered in one ``items`` record: a client whose hello says it reads them
(``it``) gets the small items of its gets served in one turn as one record, each entry a get's
own id, its inline body and its lease; every get is still its own delivery (its own lease,
requeued alone if the client goes).  A client that did not say so gets a record per get.  The
client decodes every entry's fields before it completes any get: a malformed ``items`` record
drops its whole message (``ProtocolError``)."""

from __future__ import annotations

from contextlib import AbstractContextManager

import msgpack
import pytest
import zmq
from test_get_runs import gets, value
from test_put_batches import body, exchange, put, raw_dealer
from zchannel.broker import Channel, Delivery
from zchannel.broker.connection import tuning
from zchannel.broker.wire.protocol import (
    INLINE_BODY,
    ITEMS,
    MAX_BATCH_PUTS,
    PROTOCOL_VERSION,
    BadRecord,
    Hello,
    ProtocolError,
    Reply,
    pack_header,
    unpack_replies,
    unpack_requests,
)

pytestmark = pytest.mark.timeout(120)


def items_dealer(ch: Channel) -> AbstractContextManager[zmq.Socket]:
    """A bare DEALER registered on ``ch``'s broker as a client that reads ``items`` records."""
    return raw_dealer(ch, items=True)


def test_the_gets_served_in_one_turn_share_one_items_record(channels):
    ch = Channel.create("items-turn")
    channels.append(ch)
    with items_dealer(ch) as raw:
        exchange(raw, [put(2, "k", "a"), put(3, "k", "b"), put(4, "k", [1, 2])])
        replies = exchange(raw, [gets(10, "k", [5, 6, 7, 8])])
        # three items there: one record answers gets 5, 6, 7 in order; 8 is parked
        assert replies[0]["op"] == ITEMS and [e[0] for e in replies[0]["i"]] == [5, 6, 7]
        assert [value({"b": e[1]}) for e in replies[0]["i"]] == ["a", "b", [1, 2]]
        assert all(e[2] is None for e in replies[0]["i"]) and replies[1] == {"id": 10}
        # the parked get is answered later, in an items record of its own turn
        ch.put("c", key="k")
        assert raw.poll(10_000)
        (late,) = msgpack.unpackb(raw.recv_multipart()[0])
        assert late["op"] == ITEMS and late["i"] == [[8, body("c"), None]]
    stats = ch.stats()
    assert stats["item_records"] == 2 and stats["delivered"] == 4


def test_each_entry_has_its_own_lease(channels):
    ch = Channel.create("items-leases")
    channels.append(ch)
    with items_dealer(ch) as raw:
        exchange(raw, [put(2, "k", "a"), put(3, "k", "b")])
        replies = exchange(raw, [gets(10, "k", [4, 5], ack=True)])
        leases = [e[2] for e in replies[0]["i"]]
        assert len(set(leases)) == 2 and all(type(lease) is int for lease in leases)
        # one lease acknowledged, the other returned when the client goes: its item is back
        assert exchange(raw, [{"op": "ack", "id": 20, "lease": leases[0]}]) == [{"id": 20}]
        raw.send_multipart([pack_header([{"op": "bye", "id": 21}])])
        assert raw.poll(10_000)
        raw.recv_multipart()
    assert ch.get("k", timeout=10) == "b" and ch.qsize("k") == 0


def test_a_client_that_did_not_ask_gets_a_record_per_get(channels):
    ch = Channel.create("items-old")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        exchange(raw, [put(2, "k", "a"), put(3, "k", "b")])
        replies = exchange(raw, [gets(10, "k", [4, 5])])
        assert [r.get("id") for r in replies] == [4, 5, 10] and "i" not in replies[0]
    assert ch.stats()["item_records"] == 0


def test_large_items_and_errors_keep_their_own_records(channels):
    ch = Channel.create("items-mixed")
    channels.append(ch)
    big = b"x" * (INLINE_BODY * 4)
    with items_dealer(ch) as raw:
        exchange(raw, [put(2, "k", "a"), {"op": "put", "id": 3, "k": "k", "nf": 1},
                       put(4, "k", "c")], (big,))
        replies = exchange(raw, [gets(10, "k", [5, 6, 7])])
        # a, then the frame-carrying item under its id, then c: the order of the gets holds
        assert replies[0]["op"] == ITEMS and [e[0] for e in replies[0]["i"]] == [5]
        assert replies[1]["id"] == 6 and replies[1]["nf"] == 1
        assert replies[2]["op"] == ITEMS and [e[0] for e in replies[2]["i"]] == [7]
        replies = exchange(raw, [gets(11, "k", [8, 9], nw=True)])
        assert [r["id"] for r in replies[:2]] == [8, 9] and replies[0]["e"][0] == "QueueEmpty"


def test_a_consumer_takes_its_items_from_items_records_in_order(channels):
    ch = Channel.create("items-client")
    channels.append(ch)
    works = [ch.get("k", async_op=True) for _ in range(200)]
    for i in range(200):
        ch.put(i, key="k", async_op=True)
    assert [w.wait(timeout=30) for w in works] == list(range(200))
    for i in range(50):
        ch.put({"n": i}, key="acked", async_op=True)
    got = [ch.get("acked", async_op=True, ack=True) for _ in range(50)]
    deliveries = [w.wait(timeout=30) for w in got]
    assert all(isinstance(d, Delivery) for d in deliveries)
    assert [d.item["n"] for d in deliveries] == list(range(50))
    assert len({d.lease_id for d in deliveries}) == 50
    for d in deliveries:
        ch.ack(d)
    stats = ch.stats()
    assert stats["delivered"] == 250
    if tuning.BATCH:  # the client's hello asks for items records
        assert 0 < stats["item_records"] < 250
    else:  # ZCHANNEL_BATCH=0: a record per get
        assert stats["item_records"] == 0


@pytest.mark.parametrize("items", [
    [[1, b"x"]],  # an entry of two fields
    [[1, b"x", None, 4]],  # of four
    [[-1, b"x", None]],  # a negative id
    [[True, b"x", None]],  # a bool id
    [[1.0, b"x", None]],
    [[1, "x", None]],  # a str body
    [[1, b"x" * (INLINE_BODY + 1), None]],  # a body too long to be inline
    [[1, b"x", -2]],  # a negative lease
    [[1, b"x", "lease"]],
    "not a list",
    [[i, b"x", None] for i in range(MAX_BATCH_PUTS + 1)],  # more entries than a record holds
])
def test_a_malformed_items_record_is_refused(items):
    data = msgpack.packb([{"op": ITEMS, "i": items}, {"id": 3}], use_bin_type=True)
    bad, good = unpack_replies(data, 0)  # no id: the client fails every request in flight
    assert isinstance(bad, BadRecord) and bad.id is None and isinstance(bad.error, ProtocolError)
    assert isinstance(good, Reply) and good.id == 3


def test_an_items_record_round_trips():
    rec = Reply(op=ITEMS, items=[(1, b"a", None), (2, b"", 7)])
    (back,) = unpack_replies(pack_header([rec]), 0)
    assert back.op == ITEMS and back.items == [(1, b"a", None), (2, b"", 7)] and back.id is None


def test_a_hello_whose_it_is_not_a_bool_is_refused():
    for bad in (1, "yes", None, [True]):
        (record,) = unpack_requests(
            msgpack.packb([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION, "it": bad}]), 0)
        assert type(record) is BadRecord and "it" in str(record.error), bad
    (ok,) = unpack_requests(msgpack.packb([{"op": "hello", "id": 1, "v": 1, "it": True}]), 0)
    assert type(ok) is Hello and ok.items is True
