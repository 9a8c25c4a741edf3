"""Gets coalesced into ``gets`` records (``GetRun``): one record stands for several gets of one
client with the same options, on one key or each on its own key; the broker handles each exactly as a ``get`` of its
own id (served, parked, timed out, cancelled, answered under that id) and answers the record
with an empty success; a malformed record is a ``ValueError`` reply to its id, none of its
gets handled, the broker unharmed.  The client coalesces runs of queued alike gets
(``ZCHANNEL_BATCH``, on by default)."""

from __future__ import annotations

import msgpack
import pytest
from test_put_batches import exchange, put, raw_dealer
from zchannel.broker import Channel
from zchannel.broker.connection import batching
from zchannel.broker.wire import codec
from zchannel.broker.wire.protocol import MAX_BATCH_PUTS, Get, GetRun, Put, Stats, pack_header

pytestmark = pytest.mark.timeout(120)


def gets(rid: int, key: str, ids: list, **extra: object) -> dict:
    return {"op": "gets", "id": rid, "k": key, "g": ids, **extra}


def value(rec: dict) -> object:
    return codec.decode(rec["b"], [])


def test_a_gets_record_serves_each_get_under_its_own_id(channels):
    ch = Channel.create("gets-order")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        assert exchange(raw, [put(2, "k", "a"), put(3, "k", "b")]) == [{"id": 2}, {"id": 3}]
        replies = exchange(raw, [gets(10, "k", [4, 5, 6])])
        # two items there: two gets served (each its own record), the third parked
        assert [r["id"] for r in replies] == [4, 5, 10] and "e" not in replies[2]
        assert [value(r) for r in replies[:2]] == ["a", "b"]
        assert ch.qsize("k") == 0
        ch.put("c", key="k")
        assert raw.poll(10_000)
        (late,) = msgpack.unpackb(raw.recv_multipart()[0])
        assert late["id"] == 6 and value(late) == "c"
    stats = ch.stats()
    assert stats["get_runs"] == 1 and stats["gets"] >= 3


def test_each_get_of_a_record_has_its_own_lease_and_error(channels):
    ch = Channel.create("gets-leases")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        exchange(raw, [put(2, "k", "a"), put(3, "k", "b")])
        replies = exchange(raw, [gets(10, "k", [4, 5], ack=True)])
        leases = [r["lease"] for r in replies if r["id"] in (4, 5)]
        assert len(set(leases)) == 2
        # nowait: each get of the record fails alone with QueueEmpty
        replies = {r["id"]: r for r in exchange(raw, [gets(11, "k", [6, 7], nw=True)])}
        assert replies[6]["e"][0] == replies[7]["e"][0] == "QueueEmpty" and "e" not in replies[11]
        # a get under the id of a parked one is refused alone, the others are handled
        exchange(raw, [gets(12, "k", [8])])  # parked
        replies = {r["id"]: r for r in exchange(raw, [gets(13, "k", [8, 9])])}
        assert replies[8]["e"][0] == "ValueError" and "e" not in replies[13]
        for lease in leases:
            assert exchange(raw, [{"op": "ack", "id": 20 + lease % 7, "lease": lease}])[0].get(
                "e") is None


def test_queued_items_serve_the_head_gets_of_a_record_in_order(channels):
    ch = Channel.create("gets-at-once")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        for i, v in enumerate("abcde"):
            exchange(raw, [put(2 + i, "k", v)])
        replies = exchange(raw, [gets(20, "k", list(range(30, 37)))])
        # five items: the first five gets take them in order, the other two park
        assert [r["id"] for r in replies] == [30, 31, 32, 33, 34, 20]
        assert [value(r) for r in replies[:5]] == list("abcde")
        assert ch.qsize("k") == 0 and ch.stats()["gets"] == 7
        ch.put("f", key="k")
        ch.put("g", key="k")
        got = []
        while len(got) < 2:
            assert raw.poll(10_000)
            got += msgpack.unpackb(raw.recv_multipart()[0])
        assert [(r["id"], value(r)) for r in got] == [(35, "f"), (36, "g")]


def recv_records(raw, n: int) -> list[dict]:
    """The next ``n`` reply records, over as many messages as they take."""
    got: list[dict] = []
    while len(got) < n:
        assert raw.poll(10_000), f"got {got}, waiting for {n}"
        got += msgpack.unpackb(raw.recv_multipart()[0])
    return got


def test_the_gets_of_a_record_on_an_empty_key_wait_each_with_its_own_deadline(channels):
    ch = Channel.create("gets-parked-run")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        exchange(raw, [put(2, "k", "a")])
        assert ch.get("k", timeout=5) == "a"  # the key stays known, its queue empty
        # all four wait: the record's own id is answered at once, nothing else
        assert exchange(raw, [gets(20, "k", [30, 31, 32, 33], t=60)]) == [{"id": 20}]
        assert ch.stats()["gets"] >= 4
        # one of them is cancelled: it ends without a reply, the others keep their places
        raw.send_multipart([pack_header([{"op": "cancel", "id": 21, "rid": 31}])])
        assert recv_records(raw, 1) == [{"id": 21, "r": True}]
        for v in "bcd":
            ch.put(v, key="k")
        got = recv_records(raw, 3)
        assert [(r["id"], value(r)) for r in got] == [(30, "b"), (32, "c"), (33, "d")]
        # a record whose gets wait with a short timeout: each times out under its own id
        assert exchange(raw, [gets(40, "k", [41, 42], t=0.2)]) == [{"id": 40}]
        expired = recv_records(raw, 2)
        assert sorted(r["id"] for r in expired) == [41, 42]
        assert all(r["e"][0] == "TimeoutError" for r in expired)
        ch.put("e", key="k")
        assert ch.get("k", timeout=5) == "e"  # nothing waits any more: the item stayed


def test_a_get_whose_id_is_parked_elsewhere_is_refused_alone_with_items_queued(channels):
    ch = Channel.create("gets-parked-id")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        exchange(raw, [put(2, "k", "a"), put(3, "k", "b")])
        exchange(raw, [gets(10, "other", [8])])  # parked: "other" holds nothing
        replies = {r["id"]: r for r in exchange(raw, [gets(11, "k", [8, 9])])}
        assert replies[8]["e"][0] == "ValueError" and value(replies[9]) == "a"
        assert ch.qsize("k") == 1


def test_a_waiting_get_batch_holds_back_a_gets_record_behind_it(channels):
    ch = Channel.create("gets-behind-batch")
    channels.append(ch)
    with raw_dealer(ch) as first, raw_dealer(ch) as second:
        exchange(first, [put(2, "k", "a", w=1)])
        # a get_batch of weight 3 waits (one item of weight 1 is queued)
        first.send_multipart([pack_header([{"op": "get_batch", "id": 5, "k": "k", "tw": 3}])])
        assert not first.poll(200)
        exchange(second, [put(3, "k", "b", w=1)])
        # the second client's gets come behind the waiting get_batch: nothing for them yet
        second.send_multipart([pack_header([gets(10, "k", [11, 12])])])
        (ack,) = msgpack.unpackb(second.recv_multipart()[0]) if second.poll(10_000) else [None]
        assert ack == {"id": 10}
        exchange(second, [put(4, "k", "c", w=1)])  # completes the batch
        assert first.poll(10_000)
        (batch,) = msgpack.unpackb(first.recv_multipart()[0])
        assert batch["id"] == 5
        assert ch.qsize("k") == 0


@pytest.mark.parametrize("record", [
    gets(10, "k", []),  # no get
    gets(10, "k", "not a list"),
    gets(10, "k", [2, 2]),  # a get twice
    gets(10, "k", [2, 10]),  # the record's own id
    gets(10, "k", [2, True]),  # not an int
    gets(10, "k", [2, 3.0]),
    gets(10, "k", [2], t=-1),  # a field out of bounds
    gets(10, "k", [2], nw=1),  # not a bool
    gets(10, "k", list(range(11, MAX_BATCH_PUTS + 12))),  # more gets than a record may hold
])
def test_a_malformed_gets_record_is_refused_whole(channels, record):
    ch = Channel.create("gets-hostile")
    channels.append(ch)
    ch.put("kept", key="k")
    with raw_dealer(ch) as raw:
        replies = exchange(raw, [record])
        assert [r["id"] for r in replies] == [10] and replies[0]["e"][0] == "ValueError", replies
        # the broker serves this client as before; none of the record's gets took an item
        assert exchange(raw, [put(99, "k", "after")]) == [{"id": 99}]
    assert [ch.get("k", timeout=5) for _ in range(2)] == ["kept", "after"]


def test_a_bad_key_fails_each_get_of_the_record(channels):
    ch = Channel.create("gets-badkey")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        replies = {r["id"]: r for r in exchange(raw, [gets(10, [[[[[["deep"]]]]]], [2, 3])])}
    assert replies[2]["e"][0] == "TypeError" and "nested 4 deep at most" in replies[2]["e"][1]
    assert replies[3]["e"] == replies[2]["e"]


def keyed_gets(rid: int, keys: list, ids: list, **extra: object) -> dict:
    return {"op": "gets", "id": rid, "ks": keys, "g": ids, **extra}


def test_a_gets_record_with_a_key_per_get_serves_each_key_in_fifo_order(channels):
    ch = Channel.create("gets-keyed")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        exchange(raw, [put(2, "a", "a1"), put(3, "a", "a2"), put(4, "b", "b1"), put(5, 7, "i1")])
        # a, b, a, an int key, a new key, a again (its queue empty by then): four served at
        # once, in order, the other two parked each on its own key
        replies = exchange(raw, [keyed_gets(20, ["a", "b", "a", 7, "c", "a"],
                                            [30, 31, 32, 33, 34, 35])])
        assert [r["id"] for r in replies] == [30, 31, 32, 33, 20] and "e" not in replies[-1]
        assert [value(r) for r in replies[:4]] == ["a1", "b1", "a2", "i1"]
        assert ch.stats()["gets"] == 6 and ch.stats()["get_runs"] == 1
        ch.put("a3", key="a")
        ch.put("c1", key="c")
        got = recv_records(raw, 2)
        assert sorted((r["id"], value(r)) for r in got) == [(34, "c1"), (35, "a3")]
        # keyed gets behind a waiting one take their turn: the first get of "a" parks, the
        # second waits behind it, each takes one item in arrival order
        assert exchange(raw, [keyed_gets(40, ["a", "b", "a"], [41, 42, 43], t=60)]) == [{"id": 40}]
        for v in ("a4", "a5"):
            ch.put(v, key="a")
        got = recv_records(raw, 2)
        assert [(r["id"], value(r)) for r in got] == [(41, "a4"), (43, "a5")]
        raw.send_multipart([pack_header([{"op": "cancel", "id": 44, "rid": 42}])])
        assert recv_records(raw, 1) == [{"id": 44, "r": True}]
        # parked with a short timeout: each times out under its own id, taking nothing
        assert exchange(raw, [keyed_gets(50, ["a", "c"], [51, 52], t=0.2)]) == [{"id": 50}]
        expired = recv_records(raw, 2)
        assert sorted(r["id"] for r in expired) == [51, 52]
        assert all(r["e"][0] == "TimeoutError" for r in expired)
        ch.put("a6", key="a")
        assert ch.get("a", timeout=5) == "a6"
    assert ch.qsize() == 0


def test_each_keyed_get_of_a_record_has_its_own_error_and_lease(channels):
    ch = Channel.create("gets-keyed-errors")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        exchange(raw, [put(2, "a", "a1"), put(3, "b", "b1")])
        exchange(raw, [keyed_gets(10, ["none"], [8])])  # parked: "none" holds nothing
        # a bad key (too deep, a bool, a float), an id parked already: each refused alone
        replies = {r["id"]: r for r in exchange(raw, [keyed_gets(
            11, [[[[[["deep"]]]]], True, 1.5, "a", "b"], [4, 5, 6, 8, 9])])}
        assert replies[4]["e"][0] == "TypeError" and "nested 4 deep at most" in replies[4]["e"][1]
        assert replies[5]["e"][0] == "TypeError" and replies[6]["e"][0] == "TypeError"
        assert replies[8]["e"][0] == "ValueError" and value(replies[9]) == "b1"
        assert "e" not in replies[11]
        # nowait: each fails alone with QueueEmpty, the others are served
        replies = {r["id"]: r for r in exchange(raw, [keyed_gets(12, ["b", "a"], [13, 14],
                                                                 nw=True)])}
        assert replies[13]["e"][0] == "QueueEmpty" and value(replies[14]) == "a1"
        # ack: each its own lease, of its own key
        exchange(raw, [put(20, "a", "a2"), put(21, "b", "b2")])
        replies = exchange(raw, [keyed_gets(22, ["b", "a"], [23, 24], ack=True)])
        leased = {r["id"]: (r["lease"], value(r)) for r in replies if r["id"] in (23, 24)}
        assert [v for _, v in leased.values()] == ["b2", "a2"]
        assert len({lease for lease, _ in leased.values()}) == 2
        assert ch.stats()["leases"] == 2


@pytest.mark.parametrize("record", [
    keyed_gets(10, ["a", "b"], [2]),  # fewer ids than keys
    keyed_gets(10, ["a"], [2, 3]),  # more ids than keys
    keyed_gets(10, [], [2]),
    keyed_gets(10, "ab", [2, 3]),  # not a list
    keyed_gets(10, ["a", "b"], [2, 3], k="a"),  # one key and a key per get
    keyed_gets(10, ["a"] * (MAX_BATCH_PUTS + 1), list(range(11, MAX_BATCH_PUTS + 12))),
])
def test_a_malformed_keyed_gets_record_is_refused_whole(channels, record):
    ch = Channel.create("gets-keyed-hostile")
    channels.append(ch)
    ch.put("kept", key="a")
    with raw_dealer(ch) as raw:
        replies = exchange(raw, [record])
        assert [r["id"] for r in replies] == [10] and replies[0]["e"][0] == "ValueError", replies
        assert exchange(raw, [put(99, "a", "after")]) == [{"id": 99}]
    assert [ch.get("a", timeout=5) for _ in range(2)] == ["kept", "after"]


def test_async_gets_of_many_keys_keep_fifo_per_key(channels):
    ch = Channel.create("gets-keyed-client")
    channels.append(ch)
    keys = [f"k{i % 50}" for i in range(2000)]
    for i, key in enumerate(keys):
        ch.put((key, i), key=key, async_op=True)
    ch.put("sync", key="end")
    consumer = Channel.connect(ch.address)
    try:
        works = [consumer.get(key=key, async_op=True, timeout=60) for key in keys]
        got = [w.wait(60) for w in works]
        assert [key for key, _ in got] == keys
        per_key: dict = {}
        for key, i in got:
            per_key.setdefault(key, []).append(i)
        assert all(seq == sorted(seq) for seq in per_key.values())
        assert sorted(i for _, i in got) == list(range(2000))
    finally:
        consumer.close()


class _FakeRequests:
    def __init__(self) -> None:
        self.ids = iter(range(100, 200))
        self.batches: dict[int, tuple[bool, frozenset[int]]] = {}


def test_only_runs_of_consecutive_gets_with_like_options_are_grouped():
    reqs = _FakeRequests()
    a = [Get(id=i, key="a") for i in range(1, 4)]
    other_key, tuple_key, list_key = Get(id=4, key="b"), Get(id=5, key=(1,)), Get(id=6, key=[1])
    timed = [Get(id=7, key="a", timeout=1.0), Get(id=8, key="a", timeout=1.0)]
    acked = Get(id=9, key="a", ack=True)
    out = batching.group_records(reqs, [*a, other_key, tuple_key, list_key, *timed, acked,
                                        Put(id=10, key="a"), Stats(id=11)])
    assert [type(r) for r in out] == [GetRun, GetRun, Get, Put, Stats]
    # gets of different keys: each its own key, of its own type (a tuple and a list stay apart)
    assert out[0].ids == [1, 2, 3, 4, 5, 6] and out[0].key is None
    assert out[0].keys == ["a", "a", "a", "b", (1,), [1]]
    assert [type(k) for k in out[0].keys[4:]] == [tuple, list]
    # gets of one key: the key once
    assert out[1].ids == [7, 8] and out[1].key == "a" and out[1].keys is None
    assert out[1].timeout == 1.0
    assert reqs.batches == {out[0].id: (False, {1, 2, 3, 4, 5, 6}), out[1].id: (False, {7, 8})}
    # 1 and 1.0 are not one key: the run names each
    mixed = batching.group_records(reqs, [Get(id=20, key=1), Get(id=21, key=1.0)])
    assert mixed[0].keys == [1, 1.0] and [type(k) for k in mixed[0].keys] == [int, float]

