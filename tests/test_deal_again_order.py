"""A consumer of a dealing channel leaves (closes, is killed): the items it was dealt and never
received are dealt again where put order places them, so a consumer that stays still gets a
key's items in put order; the deliveries it had not acknowledged go to the head (redelivered);
a put that waited for room in its queue keeps its place too."""

from __future__ import annotations

import json
import os
import signal
from collections import deque

import pytest
from conftest import wait_until
from zchannel.broker import Channel
from zchannel.broker.core import queues
from zchannel.broker.core.state import Item, KeyState

pytestmark = pytest.mark.timeout(240)

CONSUMERS = ["actor:0", "actor:1", "actor:2"]
PUT = 30  # items 0..29 on key "k": actor:0 is dealt 0, 3, 6, ..., actor:1 1, 4, ..., actor:2 2, 5, ...

# takes one item of key "k" (``ack``: under a lease) and prints it, then waits for a line and
# closes (or is killed meanwhile)
LEAVER = """
import json, sys
from zchannel.broker import Channel
name, identity, ack = sys.argv[1], sys.argv[2], sys.argv[3] == "ack"
handle = Channel.connect(name, identity=identity)
got = handle.get(key="k", ack=ack, timeout=60)
print(json.dumps(got.item if ack else got), flush=True)
sys.stdin.readline()
handle.close()
"""

# takes ``n`` items of key "k" and prints them
SURVIVOR = """
import json, sys
from zchannel.broker import Channel
name, identity, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
handle = Channel.connect(name, identity=identity)
print(json.dumps([handle.get(key="k", timeout=60) for _ in range(n)]), flush=True)
handle.close()
"""


def _gone(ch, consumer: str) -> bool:
    return consumer not in ch.stats()["consumers"]


def _expected_by_the_survivor() -> list[int]:
    """actor:0 took item 0 and closed, actor:2 held item 2 under a lease and left: the lease's
    item first (redelivered), then every item nobody received, in put order."""
    return [2] + [i for i in range(PUT) if i not in (0, 2)]


@pytest.mark.parametrize("dispatcher", ["round_robin", "least_loaded"])
def test_a_consumer_process_that_stays_gets_the_items_of_those_that_left_in_put_order(
        channels, workers, dispatcher):
    """Three consumer processes of a broker channel: one takes an item and closes, one takes
    an item under a lease and is SIGKILLed; the third then gets the lease's item (redelivered,
    at the head) and every other item in put order, none missing or twice."""
    name = f"redeal-{dispatcher}"
    ch = Channel.create(name, dispatcher=dispatcher, consumers=CONSUMERS)
    channels.append(ch)
    for i in range(PUT):
        ch.put(i, key="k")
    closing = workers.start(LEAVER, name, "actor:0", "plain")
    assert json.loads(workers.wait_line(closing)) == 0
    workers.send(closing)
    workers.finish(closing)
    assert wait_until(lambda: _gone(ch, "actor:0"), 60)
    killed = workers.start(LEAVER, name, "actor:2", "ack")
    assert json.loads(workers.wait_line(killed)) == 2
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    assert wait_until(lambda: _gone(ch, "actor:2") and ch.stats()["leases"] == 0, 60)
    survivor = workers.start(SURVIVOR, name, "actor:1", str(PUT - 1))
    assert json.loads(workers.wait_line(survivor, timeout=120)) == _expected_by_the_survivor()
    workers.finish(survivor)
    assert ch.stats()["keys"]["k"]["depth"] == 0


def test_a_local_channels_consumer_that_stays_gets_the_items_of_those_that_left_in_put_order(
        channels):
    """The same on a local channel: one consumer handle takes an item and closes, one closes
    while it holds a lease; the one that stays gets the lease's item, then the rest in put
    order."""
    ch = Channel.create("redeal-local", dispatcher="round_robin", consumers=CONSUMERS, local=True)
    channels.append(ch)
    for i in range(PUT):
        ch.put(i, key="k")
    first = Channel.connect("redeal-local", identity="actor:0")
    assert first.get(key="k", timeout=10) == 0
    first.close()
    holder = Channel.connect("redeal-local", identity="actor:2")
    assert holder.get(key="k", ack=True, timeout=10).item == 2
    holder.close()
    stays = Channel.connect("redeal-local", identity="actor:1")
    channels.append(stays)
    assert ch.stats()["consumers"] == ["actor:1"]
    assert ch.peek(key="k", n=3, consumer="actor:1") == [2, 1, 3]
    assert [stays.get(key="k", timeout=10) for _ in range(PUT - 1)] == _expected_by_the_survivor()


@pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])
def test_a_put_waiting_for_a_departed_consumers_queue_keeps_its_place_in_put_order(
        channels, local):
    """A put waits for room in actor:0's full queue while later puts are stored in actor:1's;
    actor:0 leaves: its items and the waiting put are dealt to actor:1, each where put order
    places it among the items actor:1 holds."""
    name = "redeal-putter"
    ch = Channel.create(name, dispatcher="round_robin", consumers=CONSUMERS[:2], maxsize=3,
                        local=local)
    channels.append(ch)
    first = Channel.connect(name, identity="actor:0")
    stays = Channel.connect(name, identity="actor:1")
    channels.extend([first, stays])
    for i in range(6):  # actor:0 holds 0, 2, 4, actor:1 1, 3, 5
        ch.put(i, key="k")
    assert first.get(key="k", timeout=10) == 0
    ch.put(6, key="k")  # actor:0 holds 2, 4, 6: full
    seven = ch.put(7, key="k", async_op=True, timeout=60)  # actor:1 is full: it waits
    eight = ch.put(8, key="k", async_op=True, timeout=60)  # actor:0 is full: it waits
    assert wait_until(lambda: ch.stats()["keys"]["k"]["putters"] == 2, 60)
    assert stays.get(key="k", timeout=10) == 1
    assert seven.wait(30) is None  # actor:1 holds 3, 5, 7
    assert stays.get(key="k", timeout=10) == 3
    ch.put(9, key="k")  # actor:1 holds 5, 7, 9; 8 still waits for actor:0
    assert ch.stats()["keys"]["k"]["putters"] == 1
    first.close()  # actor:0 leaves: 2, 4, 6 and the waiting 8 go to actor:1
    assert [stays.get(key="k", timeout=30) for _ in range(7)] == [2, 4, 5, 6, 7, 8, 9]
    assert eight.wait(30) is None
    assert ch.stats()["keys"]["k"]["depth"] == 0


def _items(seqs: list[int]) -> list[Item]:
    return [Item(seq, 1, 1, seq=seq) for seq in seqs]


def test_dealt_items_are_merged_by_put_order_and_redelivered_heads_stay_ahead():
    """Each queue: deliveries put back at its head, then the items never delivered in put
    order.  The merge keeps the never-delivered items of both in put order, and each queue's
    redelivered head ahead of the items put after it."""
    ks = KeyState("k")
    queue = deque(_items([10, 5, 7, 9]))  # 10 was delivered and came back
    queues.merge_in_put_order(ks, queue, _items([12, 2, 4, 6, 8]))  # so was 12
    assert [item.seq for item in queue] == [12, 2, 4, 10, 5, 6, 7, 8, 9]
    assert ks.requeued == 1  # a waiting get_batch counts the queue again


def test_merging_a_large_departed_queue_compares_each_item_a_bounded_number_of_times(
        monkeypatch):
    """Merging ``m`` dealt items into a queue of ``n`` takes at most ``n + m`` comparisons
    (two sorted runs merged, never an insertion per item)."""
    calls = 0
    put_order = queues.put_order

    def counted(item: Item) -> tuple[int, int]:
        nonlocal calls
        calls += 1
        return put_order(item)

    monkeypatch.setattr(queues, "put_order", counted)
    n = 50_000
    queue = deque(_items(list(range(1, 2 * n, 2))))  # odd: the queue dealt to
    queues.merge_in_put_order(KeyState("k"), queue, _items(list(range(0, 2 * n, 2))))
    assert [item.seq for item in queue] == list(range(2 * n))
    assert calls <= 2 * (2 * n)  # two put_order calls per comparison
