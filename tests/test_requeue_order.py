"""Deliveries a broker could not send go back to the head of their queue in their order.

A turn of the broker may serve several parked gets of one client (a ``puts`` record of n
items meets n gets waiting): n deliveries in that client's outbox. If the client then cannot
be reached (its link broke, ZeroMQ says the peer is gone), ``Sessions`` hands every delivery
back to the core, each to the head of its queue. Handed back first to last, the last would
end up in front: the key's FIFO order reversed for the next consumer. The broker's own
``Sessions`` and ``QueueCore`` are driven here directly, with the replies a turn made still
in the outbox (the moment a real broker's send fails; which turn a dead peer's send fails in
is up to the kernel and libzmq, so no socket test can pick it)."""

from __future__ import annotations

import pytest
from conftest import wait_until
from zchannel.broker import Channel
from zchannel.broker.core.queuecore import QueueCore
from zchannel.broker.core.state import ITEM_OVERHEAD, Client, Item
from zchannel.broker.core.waiters import take_heads
from zchannel.broker.server.config import BrokerConfig
from zchannel.broker.server.metrics import Counters
from zchannel.broker.server.sessions import Sessions
from zchannel.broker.shm.broker import ShmBroker
from zchannel.hooks import Collector, Dispatcher


def _broker_parts(run_dir: str) -> tuple[Sessions, QueueCore]:
    shm = ShmBroker("requeue", run_dir, threshold=0)  # shared memory off: nothing is made
    sessions = Sessions(BrokerConfig(name="requeue"), shm, Counters())
    core = QueueCore(name="requeue", collector=Collector(), dispatcher=Dispatcher(),
                     reply=sessions.reply, reply_run=sessions.reply_run,
                     decode_item=lambda item: item.payload,
                     encode_item=lambda value, weight: Item([value], weight, 1))
    sessions.core = core
    return sessions, core


def _item(body: bytes) -> Item:
    return Item([body], 1, len(body) + ITEM_OVERHEAD)


def _key_of_four(run_dir: str) -> tuple[Sessions, QueueCore, Client]:
    """The broker's parts with key ``k`` holding a, b, c and d, and a consumer that reads
    ``items`` records (both clients registered)."""
    sessions, core = _broker_parts(run_dir)
    producer = Client(address=b"producer")
    consumer = Client(address=b"consumer", items=True)
    sessions.clients.update({consumer.address: consumer, producer.address: producer})
    for rid, body in enumerate((b"a", b"b", b"c", b"d"), start=1):
        core.put(producer, rid, "k", _item(body), None, False)
    return sessions, core, consumer


def test_deliveries_of_one_turn_go_back_in_their_order(run_dir):
    sessions, core = _broker_parts(run_dir)
    consumer = Client(address=b"consumer", items=True)
    producer = Client(address=b"producer")
    sessions.clients.update({consumer.address: consumer, producer.address: producer})
    for rid in (1, 2, 3):  # three gets wait on an empty key
        core.get(consumer, rid, "k", None, False)
    assert sorted(consumer.parked) == [1, 2, 3]
    for rid, body in zip((11, 12, 13), (b"first", b"second", b"third"), strict=True):
        assert core.put(producer, rid, "k", _item(body), None, False) is True  # serves a get
    assert core.qsize("k") == 0
    out = sessions._out.pop(consumer.address)
    assert [items[0].payload[0] for _, _, items, _ in out.deliveries] == [
        b"first", b"second", b"third"]

    sessions._end_client(consumer.address, out.deliveries)  # the consumer could not be reached

    assert consumer.address not in sessions.clients
    assert [item.payload[0] for item in core.peek("k", 3)] == [b"first", b"second", b"third"]
    later = Client(address=b"later", items=True)
    sessions.clients[later.address] = later
    for rid in (21, 22, 23):
        core.get(later, rid, "k", None, False)
    entries = sessions._out[later.address].records[0].items
    assert [(rid, body) for rid, body, _ in entries] == [
        (21, b"first"), (22, b"second"), (23, b"third")]


def test_a_batch_and_single_gets_of_one_turn_go_back_in_their_order(run_dir):
    """A get_batch's delivery holds several items; with single gets after it in the same turn,
    all of them come back in the order they were taken."""
    sessions, core, consumer = _key_of_four(run_dir)
    core.get(consumer, 10, "k", None, False, batch_target=2)  # takes a and b
    core.get(consumer, 11, "k", None, False)  # c
    core.get(consumer, 12, "k", None, False)  # d
    assert core.qsize("k") == 0
    sessions._end_client(consumer.address, sessions._out.pop(consumer.address).deliveries)
    assert [item.payload[0] for item in core.peek("k", 4)] == [b"a", b"b", b"c", b"d"]


def test_a_run_of_gets_served_at_once_goes_back_in_its_order(run_dir):
    """A ``gets`` record served in one pass (``QueueCore.take_run``) answers its gets as entries
    of one ``items`` record, in order, and counts as one delivery, handed back whole."""
    sessions, core, consumer = _key_of_four(run_dir)
    assert core.take_run(consumer, [30, 31, 32], "k") == 3
    out = sessions._out[consumer.address]
    assert [(rid, body) for rid, body, _ in out.records[-1].items] == [
        (30, b"a"), (31, b"b"), (32, b"c")]
    assert len(out.deliveries) == 1
    core.get(consumer, 33, "k", None, False)  # the last item, a get alone: the same record
    assert [rid for rid, _, _ in out.records[-1].items] == [30, 31, 32, 33]
    sessions._end_client(consumer.address, sessions._out.pop(consumer.address).deliveries)
    assert [item.payload[0] for item in core.peek("k", 4)] == [b"a", b"b", b"c", b"d"]


def test_a_run_of_gets_of_several_keys_goes_back_to_each_key_in_its_order(run_dir):
    """Gets of a ``gets`` record naming a key per get, served in one pass
    (``waiters.take_heads``), are answered as entries of one ``items`` record in order, and
    each delivery goes back to the head of its own key's queue."""
    sessions, core = _broker_parts(run_dir)
    producer = Client(address=b"producer")
    consumer = Client(address=b"consumer", items=True)
    sessions.clients.update({consumer.address: consumer, producer.address: producer})
    for rid, (key, body) in enumerate((("k", b"a"), ("j", b"x"), ("k", b"b"), ("j", b"y")),
                                      start=1):
        core.put(producer, rid, key, _item(body), None, False)
    # the fourth get finds "k" empty (its items went to the first and third): the run ends there
    assert take_heads(core.waiters, consumer, [40, 41, 42, 43], ["k", "j", "k", "k"], 0) == 3
    out = sessions._out[consumer.address]
    assert [(rid, body) for rid, body, _ in out.records[-1].items] == [
        (40, b"a"), (41, b"x"), (42, b"b")]
    assert [(origin, [it.payload[0] for it in items]) for _, origin, items, _ in out.deliveries] \
        == [(("k", None), [b"a"]), (("j", None), [b"x"]), (("k", None), [b"b"])]
    assert (core.qsize("k"), core.qsize("j")) == (0, 1)

    sessions._end_client(consumer.address, sessions._out.pop(consumer.address).deliveries)

    assert [item.payload[0] for item in core.peek("k", 2)] == [b"a", b"b"]
    assert [item.payload[0] for item in core.peek("j", 2)] == [b"x", b"y"]


def test_a_getter_waiting_on_a_key_takes_its_handed_back_items_in_order(run_dir):
    """Deliveries of one key made in one turn (a keyed run over k, j, k) go back to a key on
    which another client waits: that getter takes the key's first item, not its last (the
    getters of a key are served once all its items are back)."""
    sessions, core = _broker_parts(run_dir)
    producer = Client(address=b"producer")
    consumer = Client(address=b"consumer", items=True)
    other = Client(address=b"other")
    sessions.clients.update({c.address: c for c in (producer, consumer, other)})
    for rid, (key, body) in enumerate((("k", b"a"), ("j", b"x"), ("k", b"b")), start=1):
        core.put(producer, rid, key, _item(body), None, False)
    assert take_heads(core.waiters, consumer, [41, 42, 43], ["k", "j", "k"], 0) == 3
    core.get(other, 7, "k", None, False)  # k is empty now: the get waits
    assert 7 in other.parked

    sessions._end_client(consumer.address, sessions._out.pop(consumer.address).deliveries)

    assert [(rec.id, rec.body) for rec in sessions._out[other.address].records] == [(7, b"a")]
    assert [item.payload[0] for item in core.peek("k", 2)] == [b"b"]
    assert [item.payload[0] for item in core.peek("j", 2)] == [b"x"]


@pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])
def test_a_departed_consumers_unacknowledged_delivery_goes_to_the_head_of_its_new_queue(
        channels, local):
    """A consumer leaves holding a lease on an item of its private queue: the item is dealt
    again to the head of the queue it goes to (before that queue's own items, redelivered),
    and the departed consumer's other items, never delivered, where put order places them
    among that queue's items."""
    ch = Channel.create("lease-leave", local=local, dispatcher="round_robin",
                        consumers={"a": 2})
    channels.append(ch)
    for i in range(6):  # a:0 holds 0, 2, 4; a:1 holds 1, 3, 5
        ch.put(i, key="k")
    a0 = Channel.connect(ch.name, identity="a:0")
    a1 = Channel.connect(ch.name, identity="a:1")
    try:
        assert a0.get("k", timeout=10) == 0
        assert a0.get("k", ack=True, timeout=10).item == 2
        a0.close()
        assert wait_until(lambda: ch.qsize("k", consumer="a:1") == 5, 10)
        assert [x for x in ch.peek("k", 10, consumer="a:1")] == [2, 1, 3, 4, 5]
    finally:
        a1.close()


@pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])
def test_a_get_batch_that_times_out_behind_a_waiting_one_takes_nothing(channels, local):
    """Getters of a queue are served in arrival order: a ``get_batch`` whose timeout comes
    while an earlier ``get_batch`` still waits on the same queue takes nothing (it used to
    take the items the earlier one was waiting to complete its batch with)."""
    ch = Channel.create("batch-order", local=local)
    channels.append(ch)
    ch.put("x", weight=3, key="k")
    first = ch.get_batch(10, key="k", async_op=True, timeout=60)
    assert wait_until(lambda: ch.stats()["keys"]["k"]["getters"] == 1, 10)
    with pytest.raises(TimeoutError):
        ch.get_batch(2, key="k", timeout=0.2)
    with pytest.raises(TimeoutError):
        ch.get_batch(2, key="k", timeout=0)
    ch.put("y", weight=7, key="k")
    assert first.wait(10) == ["x", "y"]
