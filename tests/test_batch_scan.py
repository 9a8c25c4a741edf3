"""A waiting get_batch counts its queue as items arrive: it remembers how far it counted and
counts on from there while only appends happened, and counts from the head again when its
queue's head changed (an item returned to the head, another getter took the head).  The items it
takes and their order are those of a count from the head: at most the target weight (at least
one item), the weight-0 items right behind, the float rules at the first weight that is not an
int."""

from __future__ import annotations

from collections import deque

import pytest
from zchannel.broker.core.state import Client, Item, KeyState, Parked
from zchannel.broker.core.waiters import _batch_take_resumed, batch_take

pytestmark = pytest.mark.timeout(120)


def test_a_waiting_batch_counts_one_put_at_a_time(make):
    ch = make("scan-one")
    work = ch.get_batch(5, key="k", async_op=True, timeout=30)
    for i in range(3):
        ch.put(f"x{i}", weight=2, key="k")  # the third would pass 5: the batch takes two
    assert work.wait(timeout=30) == ["x0", "x1"]
    assert ch.get(key="k", timeout=30) == "x2"


def test_weight_zero_items_behind_the_target_come_with_it(make):
    ch = make("scan-zero")
    work = ch.get_batch(3, key="k", async_op=True, timeout=30)
    for name, weight in (("a", 1), ("b", 1), ("z", 0), ("c", 1), ("y", 0)):
        ch.put(name, weight=weight, key="k")
    # served as "c" arrives: the weight-0 items behind it then ("y" came later) are none
    assert work.wait(timeout=30) == ["a", "b", "z", "c"]
    assert ch.get(key="k", timeout=30) == "y"


def test_a_float_weight_falls_back_to_the_float_rules(make):
    ch = make("scan-float")
    work = ch.get_batch(2, key="k", async_op=True, timeout=30)
    for name, weight in (("a", 1), ("b", 0.5), ("c", 0.5), ("d", 1)):
        ch.put(name, weight=weight, key="k")
    assert work.wait(timeout=30) == ["a", "b", "c"]
    assert ch.get(key="k", timeout=30) == "d"


def test_an_item_returned_to_the_head_is_counted_first(make):
    ch = make("scan-lease", lease_timeout=0.5)
    ch.put("a", weight=1, key="k")
    leased = ch.get(key="k", ack=True, timeout=30)
    assert leased.item == "a"
    for name in ("b", "c", "d"):
        ch.put(name, weight=1, key="k")
    # counted b, c, d (3 of 4) and waits; the lease ends unacknowledged and "a" goes back to
    # the head: the batch counts from the head again and takes it first
    work = ch.get_batch(4, key="k", async_op=True, timeout=30)
    assert work.wait(timeout=30) == ["a", "b", "c", "d"]


def test_the_batch_after_a_served_one_counts_its_own_queue(make):
    ch = make("scan-two")
    first = ch.get_batch(3, key="k", async_op=True, timeout=30)
    second = ch.get_batch(3, key="k", async_op=True, timeout=30)
    for i in range(7):
        ch.put(i, weight=1, key="k", async_op=True)
    assert first.wait(timeout=30) == [0, 1, 2]
    assert second.wait(timeout=30) == [3, 4, 5]
    assert ch.get(key="k", timeout=30) == 6


def _items(weights):
    return [Item([b"x"], w, 100) for w in weights]


@pytest.mark.parametrize("weights", [
    [1] * 10, [2, 2, 2], [1, 0, 1, 0, 0, 3, 1], [3, 0, 0, 1], [7], [1, 1, 0.5, 0.5, 1],
    [0, 0, 1, 1, 1, 1, 1], [4, 1], [1, 2, 1, 1],
])
@pytest.mark.parametrize("target", [1, 3, 4, 5, 1.5, 4.0])
def test_the_remembered_count_agrees_with_a_count_from_the_head(weights, target):
    """Items appended one at a time (and the head taken or an item put back at the head in
    between): the remembered count takes what a count from the head takes, every time."""
    queue: deque[Item] = deque()
    ks = KeyState("k", shared=queue)
    req = Parked(Client("c"), 1, "batch", "k", None, target=target)
    for i, item in enumerate(_items(weights)):
        queue.append(item)
        if i == 3 and len(queue) > 1:  # another getter took the head; it comes back later
            taken = queue.popleft()
            assert _batch_take_resumed(req, ks, queue) == batch_take(queue, target, False)
            ks.put_back(queue, [taken])
        assert _batch_take_resumed(req, ks, queue) == batch_take(queue, target, False)


def test_a_queue_changed_behind_the_same_head_is_counted_again():
    """The head leaves and comes back with another item behind it: same head, same length, a
    different weight counted; ``requeued`` tells the remembered count it is stale."""
    head, light, heavy = _items([1, 1, 3])
    queue: deque[Item] = deque([head, light])
    ks = KeyState("k", shared=queue)
    req = Parked(Client("c"), 1, "batch", "k", None, target=4)
    assert _batch_take_resumed(req, ks, queue) == 0  # counted 2 of 4
    queue.popleft()
    queue.popleft()
    ks.put_back(queue, [head, heavy])  # the queue is head, heavy now: 4
    assert _batch_take_resumed(req, ks, queue) == batch_take(queue, 4, False) == 2


class _WalkCounting(deque):
    """A deque that counts the walks from its head (``iter``): a scan resumed from the head."""

    walks = 0

    def __iter__(self):
        self.walks += 1
        return super().__iter__()


@pytest.mark.parametrize("target", [1, 1.0])
def test_each_append_costs_the_items_appended_not_the_queue(target):
    """A get_batch waiting on a key whose items weigh 0 never completes: each put re-counted
    the whole queue (a deque's ``islice`` walks from the head; a float target or weight was
    counted from the head every time), so 60,000 weight-0 puts behind one parked
    ``get_batch(1)`` took 5 s of the broker's loop, and 20,000 behind ``get_batch(1.0)`` 6 s,
    growing with the square of the queue.  The count resumes from the tail: the queue is
    walked from its head once, not once per put."""
    queue = _WalkCounting()
    ks = KeyState("k", shared=queue)
    req = Parked(Client("c"), 1, "batch", "k", None, target=target)
    for item in _items([0] * 2_000):
        queue.append(item)
        assert _batch_take_resumed(req, ks, queue) == 0
    assert queue.walks <= 1
    queue.append(Item([b"x"], 1, 100))
    assert _batch_take_resumed(req, ks, queue) == batch_take(queue, target, False) == 2_001
