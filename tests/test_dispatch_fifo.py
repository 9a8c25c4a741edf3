"""Dealing channels (private per-consumer queues): a consumer's private queue and its key's shared
queue taken together in put order, by ``get``, ``get_batch`` and ``peek``; puts waiting for room in
the queue of a consumer that leaves."""

from __future__ import annotations

import pytest
from conftest import wait_until
from zchannel.broker import Channel, QueueEmpty

pytestmark = pytest.mark.timeout(120)

LOCAL = pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])


def _join(handle, key: str = "elsewhere") -> None:
    """``handle`` joins as a consumer by a get that finds nothing (on another key)."""
    with pytest.raises(QueueEmpty):
        handle.get_nowait(key=key)


def _queue(ch, key: str = "default_queue") -> dict:
    return ch.stats()["keys"][key]


@LOCAL
@pytest.mark.parametrize("dispatcher", ["round_robin", "least_loaded"])
def test_a_put_waiting_for_a_departed_consumers_queue_goes_where_route_sends_it_now(
        channels, local, dispatcher):
    """A consumer leaves while a put waits for room in its private queue and a peer's get
    waits: its items and the waiting put are dealt again among those present (the peer), and
    the put is not stored in the departed consumer's emptied queue, where nobody would take
    it."""
    name = f"strand-{dispatcher}"
    ch = Channel.create(name, maxsize=1, dispatcher=dispatcher, local=local)
    channels.append(ch)
    a0 = Channel.connect(name, identity="a:0")
    a1 = Channel.connect(name, identity="a:1")
    channels.extend([a0, a1])
    _join(a0)
    _join(a1)
    ch.put("x0")  # to a:0
    ch.put("x1")  # to a:1, whose queue is then full
    assert a0.get(timeout=10) == "x0"
    ch.put("x2")  # to a:0 (round_robin's turn, least_loaded's shallowest queue)
    assert a0.get(timeout=10) == "x2"
    assert _queue(ch)["private"] == {"a:1": 1}
    waiting = ch.put("y", async_op=True, timeout=60)  # to a:1: waits for room
    parked = a0.get(async_op=True, timeout=60)  # a:0's queue is empty: its get waits
    assert wait_until(lambda: _queue(ch)["putters"] == 1 and _queue(ch)["getters"] == 1, 30)
    a1.close()  # a:1 leaves
    assert parked.wait(30) == "x1"
    assert waiting.wait(30) is None
    assert a0.get(timeout=30) == "y"
    queue = _queue(ch)
    assert queue["depth"] == 0 and not queue["private"]
    assert ch.stats()["consumers"] == ["a:0"]


@LOCAL
def test_a_consumer_gets_a_keys_items_in_put_order_across_shared_and_private_queues(
        channels, local):
    """Items put while no consumer was present wait in the shared queue, those put after the
    consumer joined are dealt to its private queue: its gets, its peek and its get_batch take
    them in put order (FIFO per key)."""
    ch = Channel.create("fifo", dispatcher="round_robin", local=local)
    channels.append(ch)
    for i in range(3):
        ch.put(i, 1)  # no consumer yet: the shared queue
    a0 = Channel.connect("fifo", identity="a:0")
    channels.append(a0)
    _join(a0)
    for i in range(3, 6):
        ch.put(i, 1)  # dealt to a:0
    assert _queue(ch)["private"] == {"a:0": 3} and _queue(ch)["depth"] == 6
    assert ch.peek(n=6, consumer="a:0") == [0, 1, 2, 3, 4, 5]
    assert [a0.get(timeout=10) for _ in range(2)] == [0, 1]
    assert a0.get_batch(3, timeout=30) == [2, 3, 4]
    for i in range(6, 8):
        ch.put(i, 1)
    ch.put(8, 1)
    assert [a0.get(timeout=10) for _ in range(4)] == [5, 6, 7, 8]


@LOCAL
def test_get_batch_takes_its_private_queue_and_the_shared_queue_together(channels, local):
    """A consumer's get_batch completes once its private queue and the shared queue together
    reach the target: at once, when it waits, and at its deadline; the items it takes free
    room for puts waiting for it (``maxsize``), and no byte stays counted."""
    ch = Channel.create("rrbatch", maxsize=2, dispatcher="round_robin", local=local)
    channels.append(ch)
    ch.put("early0", 1)
    ch.put("early1", 1)  # no consumer yet: the shared queue, now full
    a0 = Channel.connect("rrbatch", identity="a:0")
    channels.append(a0)
    _join(a0)
    ch.put("late0", 1)
    ch.put("late1", 1)  # a:0's private queue, now full
    waiting = ch.put("late2", 1, async_op=True, timeout=60)  # waits for room in it
    assert wait_until(lambda: _queue(ch)["putters"] == 1, 30)
    assert a0.get_batch(4, timeout=60) == ["early0", "early1", "late0", "late1"]
    assert waiting.wait(30) is None  # the batch freed room in a:0's queue
    assert a0.get(timeout=10) == "late2"

    ch.put("early2", 1)
    ch.put("early3", 1)  # a:0 left no item: dealt to a:0
    assert a0.get_batch(2, timeout=60) == ["early2", "early3"]
    batch = a0.get_batch(2, async_op=True)  # waits: nothing queued
    assert wait_until(lambda: _queue(ch)["getters"] == 1, 30)
    ch.put("next0", 1)
    assert _queue(ch)["getters"] == 1  # weight 1 of 2: the batch still waits
    ch.put("next1", 1)
    assert batch.wait(30) == ["next0", "next1"]
    queue = _queue(ch)
    assert queue["depth"] == 0 and queue["getters"] == 0 and queue["putters"] == 0
    assert ch.stats()["bytes_held"] == 0


@LOCAL
def test_a_waiting_get_batch_completes_over_the_shared_and_its_private_queue(channels, local):
    """A get_batch that waits while the shared queue holds part of its target completes when
    items dealt to its consumer's private queue make up the rest, taking them in put order;
    at its deadline one that falls short takes what both queues hold."""
    ch = Channel.create("rrwait", dispatcher="round_robin", local=local)
    channels.append(ch)
    ch.put("early0", 1)
    ch.put("early1", 1)  # no consumer yet: the shared queue
    a0 = Channel.connect("rrwait", identity="a:0")
    channels.append(a0)
    batch = a0.get_batch(4, async_op=True, timeout=60)  # joins; waits for weight 4
    assert wait_until(lambda: _queue(ch)["getters"] == 1, 30)
    ch.put("late0", 1)
    ch.put("late1", 1)  # dealt to a:0
    assert batch.wait(30) == ["early0", "early1", "late0", "late1"]

    ch_b = Channel.create("rrshort", dispatcher="round_robin", local=local)
    channels.append(ch_b)
    ch_b.put("early", 1)
    b0 = Channel.connect("rrshort", identity="b:0")
    channels.append(b0)
    _join(b0)
    ch_b.put("late", 1)  # dealt to b:0
    assert b0.get_batch(10, timeout=0.5) == ["early", "late"]  # its deadline: what both hold
