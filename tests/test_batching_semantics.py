"""The queue semantics with request coalescing on (``puts`` and ``gets`` records, the default)
and off (``ZCHANNEL_BATCH=0``): per-key FIFO, ``maxsize`` backpressure, a consumer never gets
more items than it has gets outstanding, acknowledgements and redelivery, dispatch to private
queues, and cancels and timeouts of gets that travelled in one record.  Real brokers, real
sockets; the ``batching`` fixture switches this process's client (the counters of ``stats``
show which records the broker saw)."""

from __future__ import annotations

import pytest
from zchannel.broker import Channel, Delivery
from zchannel.broker.connection import requestqueue

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=[True, False], ids=["batch-on", "batch-off"])
def batching(request, monkeypatch) -> bool:
    monkeypatch.setattr(requestqueue, "BATCH", request.param)
    monkeypatch.setenv("ZCHANNEL_BATCH", "1" if request.param else "0")
    return request.param


def gets_together(handle: Channel, n: int, **kwargs: object) -> list:
    """``n`` async gets of ``handle`` queued while nobody may send, so that they leave in one
    message (one ``gets`` record when batching is on), then sent."""
    handle.qsize(kwargs.get("key", "k"))  # connected and registered
    conn = handle._connection()
    with conn._line.sock_lock:
        works = [handle.get(async_op=True, **kwargs) for _ in range(n)]
    conn.flush()
    return works


def _saw_runs(ch: Channel, batching: bool) -> None:
    stats = ch.stats()
    if batching:  # the gets (puts: tests/test_put_batches.py) travelled in runs
        assert stats["get_runs"] > 0, stats
    else:
        assert stats["get_runs"] == 0 and stats["put_batches"] == 0, stats


def test_fifo_per_key_and_no_more_items_than_gets(channels, batching):
    ch = Channel.create(f"sem-fifo-{batching}")
    channels.append(ch)
    works = [ch.put(i, key="ab"[i % 2], async_op=True) for i in range(60)]
    for w in works:
        w.wait(30)
    consumer = Channel.connect(ch.address)
    try:
        taken = gets_together(consumer, 20, key="a")
        assert [w.wait(30) for w in taken] == list(range(0, 40, 2))
        assert ch.qsize("a") == 10 and ch.qsize("b") == 30  # credit: only what was asked
        more = gets_together(consumer, 40, key="b")
        assert [w.wait(30) for w in more[:30]] == list(range(1, 60, 2))
        assert not any(w.done() for w in more[30:])  # parked, in order, for later items
        for i in range(10):
            ch.put(100 + i, key="b")
        assert [w.wait(30) for w in more[30:]] == list(range(100, 110))
        assert [consumer.get(key="a", timeout=5) for _ in range(10)] == list(range(40, 60, 2))
    finally:
        consumer.close()
    _saw_runs(ch, batching)


def test_maxsize_holds_with_runs_of_puts_and_gets(channels, batching):
    ch = Channel.create(f"sem-max-{batching}", maxsize=3)
    channels.append(ch)
    producer = Channel.connect(ch.address)
    try:
        puts = [producer.put(i, key="k", async_op=True) for i in range(12)]
        puts[2].wait(30)
        assert ch.full("k") and ch.qsize("k") == 3
        assert not any(w.done() for w in puts[3:])  # the rest wait for room, in order
        got: list = []
        while len(got) < 12:
            run = gets_together(ch, 4, key="k")
            got += [w.wait(30) for w in run]
            assert ch.qsize("k") <= 3
        assert got == list(range(12))
        for w in puts:
            w.wait(30)
    finally:
        producer.close()
    _saw_runs(ch, batching)


def test_each_delivery_its_own_lease_and_redelivery(channels, batching):
    ch = Channel.create(f"sem-ack-{batching}", lease_timeout=5)
    channels.append(ch)
    for w in [ch.put(i, key="k", async_op=True) for i in range(6)]:
        w.wait(30)
    first = Channel.connect(ch.address)
    try:
        deliveries = [w.wait(30) for w in gets_together(first, 6, key="k", ack=True)]
        assert all(isinstance(d, Delivery) for d in deliveries)
        assert [d.item for d in deliveries] == list(range(6))
        assert len({d.lease_id for d in deliveries}) == 6
        for d in deliveries[::2]:
            first.ack(d)
        assert ch.qsize("k") == 0
    finally:
        first.close()
    # the unacknowledged deliveries come back once their leases expire (5 s)
    again = [w.wait(30) for w in gets_together(ch, 3, key="k")]
    assert sorted(again) == [1, 3, 5] and ch.qsize("k") == 0
    _saw_runs(ch, batching)


def test_dispatch_to_private_queues(channels, batching):
    ch = Channel.create(f"sem-deal-{batching}", dispatcher="round_robin",
                        consumers=["c:0", "c:1"])
    channels.append(ch)
    for w in [ch.put(i, key="k", async_op=True) for i in range(8)]:
        w.wait(30)
    zero = Channel.connect(ch.address, identity="c:0")
    one = Channel.connect(ch.address, identity="c:1")
    try:
        a = [w.wait(30) for w in gets_together(zero, 4, key="k")]
        b = [w.wait(30) for w in gets_together(one, 4, key="k")]
        assert sorted(a + b) == list(range(8)) and len(a) == len(b) == 4
        assert a == sorted(a) and b == sorted(b) and set(a) != set(b)
        assert ch.qsize("k", consumer="c:0") == ch.qsize("k", consumer="c:1") == 0
    finally:
        zero.close()
        one.close()
    _saw_runs(ch, batching)


def test_cancel_and_timeout_of_gets_sent_together(channels, batching):
    ch = Channel.create(f"sem-cancel-{batching}")
    channels.append(ch)
    consumer = Channel.connect(ch.address)
    try:
        # a cancelled get took nothing: the items go to the gets still waiting, then stay
        run = gets_together(consumer, 4, key="k")
        assert ch.qsize("k") == 0 and not any(w.done() for w in run)
        assert run[1].cancel() and run[2].cancel()
        for i in range(4):
            ch.put(i, key="k")
        assert [run[0].wait(30), run[3].wait(30)] == [0, 1]
        assert ch.qsize("k") == 2
        # a get that timed out at the broker took nothing either
        timed = gets_together(consumer, 3, key="t", timeout=0.2)
        for w in timed:
            with pytest.raises(TimeoutError):
                w.wait(30)
        ch.put("x", key="t")
        assert ch.qsize("t") == 1
        # a get whose item was sent already cannot be withdrawn: the Work keeps the item
        served = gets_together(consumer, 2, key="k")
        assert [w.wait(30) for w in served] == [2, 3]
        assert not served[0].cancel() and served[0].result() == 2
        # a cancel racing the item: either withdrawn (the item stays queued) or the Work has it
        ch.put("race", key="r")
        racing = gets_together(consumer, 2, key="r")
        withdrawn = [w.cancel() for w in racing]
        outcomes = [w.wait(30) for w, gone in zip(racing, withdrawn, strict=True) if not gone]
        assert outcomes.count("race") + ch.qsize("r") == 1
    finally:
        consumer.close()
    assert ch.stats()["get_runs"] > 0 if batching else ch.stats()["get_runs"] == 0
