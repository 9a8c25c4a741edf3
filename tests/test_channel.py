"""Channel semantics, each against a broker process and against a local channel."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from conftest import wait_until
from zchannel.broker import DEFAULT_KEY, Channel, ChannelError, Delivery, QueueEmpty, Work
from zchannel.broker.wire.protocol import op_of

pytestmark = pytest.mark.timeout(60)


def test_put_get_default_key(make):
    ch = make()
    assert ch.put("a") is None
    assert ch.qsize() == 1 and ch.qsize(DEFAULT_KEY) == 1
    assert not ch.empty()
    assert ch.get() == "a"
    assert ch.empty()


def test_operations_table(make):
    ch = make(maxsize=2)
    assert ch.qsize("missing") == 0 and ch.empty("missing") and not ch.full("missing")
    ch.put_nowait(1, key="k")
    ch.put(2, key="k", weight=5)
    assert ch.full("k")
    with pytest.raises(asyncio.QueueFull):
        ch.put_nowait(3, key="k")
    assert ch.qsize("k") == 2  # the failed put_nowait enqueued nothing
    with pytest.raises(TimeoutError):
        ch.put(3, key="k", timeout=0.1)
    assert ch.qsize("k") == 2
    stats = ch.stats()
    assert stats["keys"]["k"]["depth"] == 2
    assert stats["keys"]["k"]["weight"] == 5
    assert ch.get_nowait("k") == 1
    assert ch.get("k", timeout=1) == 2
    with pytest.raises(asyncio.QueueEmpty):
        ch.get_nowait("k")
    with pytest.raises(TimeoutError):
        ch.get("k", timeout=0.1)


def test_async_put_order(make):
    ch = make()
    works = [ch.put(i, async_op=True) for i in range(1000)]
    assert all(isinstance(w, Work) for w in works)
    for w in works:
        assert w.wait(timeout=30) is None
    assert [ch.get() for _ in range(1000)] == list(range(1000))


def test_thousand_keys(make):
    ch = make()
    works = [ch.put(("k", i), key=("k", i), async_op=True) for i in range(1000)]
    for w in works:
        w.wait(timeout=30)
    gets = [ch.get(key=("k", i), async_op=True) for i in reversed(range(1000))]
    assert [g.wait(timeout=30) for g in gets] == [("k", i) for i in reversed(range(1000))]
    assert ch.stats()["keys"][("k", 7)]["depth"] == 0


def test_key_types(make):
    ch = make()
    for key in ["s", 3, b"b", ("t", 1, b"x"), -5]:
        ch.put(key, key=key)
        assert ch.get(key=key) == key
    for bad in [True, 1.5, ["list"], None]:
        with pytest.raises((TypeError, ValueError)):
            ch.put(1, key=bad)
    # the size limits: 1024 characters of a str, 1024 bytes, 64 bits, 64 parts, 4 levels; a
    # tuple key's parts and its str and bytes lengths counted in all, nested tuples' included
    edge = ["s" * 1024, b"b" * 1024, 2**64 - 1, -(2**63), tuple(range(64)), ((((1,),),),),
            (tuple(range(31)), tuple(range(31))), ("s" * 512, (b"b" * 512,))]
    for key in edge:
        ch.put("edge", key=key)
        assert ch.get(key=key, timeout=10) == "edge"
    for bad, error in (("s" * 1025, ValueError), (b"b" * 1025, ValueError), (2**64, ValueError),
                       (-(2**63) - 1, ValueError), (tuple(range(65)), ValueError),
                       ((((((1,),),),),), TypeError),
                       ((tuple(range(32)), tuple(range(32))), ValueError),
                       (("s" * 512, (b"b" * 513,)), ValueError)):
        with pytest.raises(error):
            ch.put(1, key=bad)
        assert ch.qsize() == 0


def test_pending_get_does_not_swallow_other_reply(make):
    ch = make()
    waiting = ch.get(key="empty", async_op=True)
    ch.put("x", key="other")
    assert ch.get(key="other", timeout=5) == "x"
    assert not waiting.done()
    ch.put("late", key="empty")
    assert waiting.wait(timeout=5) == "late"


def test_blocking_put_unblocks_after_get(make):
    ch = make(maxsize=1)
    ch.put("first")
    second = ch.put("second", async_op=True)
    with pytest.raises(TimeoutError):
        second.wait(timeout=0.2)  # still pending: the queue is full
    assert not second.done()
    assert ch.get() == "first"
    second.wait(timeout=5)
    assert ch.get() == "second"


def test_full_key_never_blocks_another_key(make):
    ch = make(maxsize=1)
    ch.put(1, key="a")
    blocked = ch.put(2, key="a", async_op=True)
    ch.put(3, key="b", timeout=5)
    assert ch.get(key="b", timeout=5) == 3
    assert not blocked.done()
    assert ch.get(key="a") == 1
    blocked.wait(timeout=5)


@pytest.mark.parametrize(
    "weights,target,expected",
    [
        ([1, 2, 3], 3, [[0, 1], [2]]),  # spec example: target 3 -> first two; then [3] alone
        ([5, 1], 3, [[0], [1]]),  # an overweight head comes alone
        ([1, 2, 0, 0, 1], 3, [[0, 1, 2, 3], [4]]),  # weight-0 items ride along
    ],
)
def test_get_batch(make, weights, target, expected):
    ch = make()
    for i, w in enumerate(weights):
        ch.put(i, weight=w)
    got = [ch.get_batch(target, timeout=5) for _ in expected[:1]]
    if len(expected) > 1:
        got.append(ch.get_batch(expected and 2 if weights == [1, 2, 3] else target, timeout=0.3))
    assert got == expected


def test_get_batch_timeouts(make):
    ch = make()
    with pytest.raises(TimeoutError):
        ch.get_batch(3, timeout=0.1)  # nothing at all
    ch.put("a", weight=1)
    assert ch.get_batch(3, timeout=0.2) == ["a"]  # partial batch on timeout
    with pytest.raises(ValueError):
        ch.get_batch(0)


def test_get_batch_keeps_its_place(make):
    ch = make()
    batch = ch.get_batch(4, async_op=True)
    later = ch.get(async_op=True)
    ch.put("x", weight=1)
    ch.put("y", weight=3)
    assert batch.wait(timeout=5) == ["x", "y"]
    assert not later.done()
    ch.put("z")
    assert later.wait(timeout=5) == "z"


def test_timed_out_get_leaves_queue_untouched(make):
    ch = make()
    with pytest.raises(TimeoutError):
        ch.get(timeout=0.1)
    ch.put("kept")
    assert ch.qsize() == 1
    assert ch.get() == "kept"


def test_bad_arguments(make):
    ch = make()
    with pytest.raises(ValueError):
        ch.put(1, weight=-1)
    with pytest.raises(ValueError):
        ch.put(1, weight=True)
    with pytest.raises(ValueError):
        ch.get(timeout=-1)
    with pytest.raises(ValueError):
        Channel.create("bad name!")
    with pytest.raises(ValueError):
        Channel.create("x" * 65)


def test_get_nowait_behind_a_waiting_get_batch_names_why(make):
    """Items held but promised to an earlier waiting get_batch: ``get_nowait``'s
    ``QueueEmpty`` says so instead of claiming the key holds nothing."""
    ch = make()
    batch = ch.get_batch(10, async_op=True, timeout=60)
    for i in range(3):
        ch.put(i, weight=1)
    assert wait_until(lambda: ch.qsize() == 3, timeout=30)
    with pytest.raises(QueueEmpty, match=r"holds 3 item\(s\), and 1 earlier get\(s\) waiting"):
        ch.get_nowait()
    for i in range(3, 10):
        ch.put(i, weight=1)
    assert batch.wait(60) == list(range(10))


@pytest.mark.parametrize("local", [True, False], ids=["local", "broker"])
def test_create_options_are_checked_by_name(local, run_dir):
    """``options`` is a dict of str keys and sendable values: anything else is refused by
    name before a broker starts, never turned into a dict."""
    for options, match in (([("a", 1)], "options must be a dict"), ("s", "options must be a dict"),
                           ({1: 2}, "options keys must be str"),
                           ({"a": object()}, "options cannot be sent to the broker")):
        with pytest.raises(TypeError, match=match):
            Channel.create("badoptions", local=local, options=options)
    ch = Channel.create("goodoptions", local=local, options={"a": {"b": [1, 2]}})
    try:
        ch.put("item")
        assert ch.get(timeout=30) == "item"
    finally:
        ch.shutdown()


def _roundtrip_values():
    from payloads import Sample

    return [
        "str",
        b"bytes",
        None,
        True,
        3.5,
        -(2**62),
        [1, (2, (3, "x")), {"a": [None, b"z"]}],
        {"nested": {"t": (1, 2)}, 5: "int key"},
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        [torch.ones(3), torch.zeros(2, 2, dtype=torch.int64)],
        {"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.tensor([True, False])},
        Sample(torch.arange(5), ["x", torch.ones(2)], {"t": torch.zeros(1)}),
        torch.arange(20, dtype=torch.float16).reshape(4, 5).t(),  # non-contiguous
        torch.tensor(7.0),  # 0-d
        torch.zeros(0, 3),  # empty
        torch.ones(300, 300, dtype=torch.bfloat16),  # its own frame
        torch.randn(200, 100)[:, ::3],  # strided slice of a large tensor
        torch.tensor([1 + 2j], dtype=torch.complex64),
        np.arange(10, dtype=np.int16),
        np.ones((256, 256), dtype=np.float32),  # its own frame
        np.float32(2.5),
        np.array([True, False]),
        bytes(range(256)) * 300,  # large bytes travel as a buffer
    ]


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.contiguous(), b)
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(
            _equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__
        )
    return type(a) is type(b) and a == b


def test_roundtrip_values(make):
    ch = make()
    values = _roundtrip_values()
    for i, value in enumerate(values):
        ch.put(value, key=i)
    for i, value in enumerate(values):
        got = ch.get(key=i, timeout=10)
        assert _equal(value, got), (i, value, got)


def test_received_tensors_are_writable_views(make_remote):
    ch = make_remote()
    ch.put(torch.zeros(100_000))
    got = ch.get()
    got += 1  # writable: the receive buffer belongs to this process
    assert float(got.sum()) == 100_000
    ch.put(torch.ones(4))
    copied = ch.get(copy=True)
    assert torch.equal(copied, torch.ones(4))


def test_unregistered_dataclass_is_type_error(make_remote):
    from payloads import Unregistered

    ch = make_remote()
    with pytest.raises(TypeError, match="serializable"):
        ch.put(Unregistered())
    with pytest.raises(TypeError):
        ch.put(object())
    with pytest.raises(TypeError):
        ch.put(np.array(["a"], dtype=object))
    assert ch.qsize() == 0


def test_unsendable_items_are_type_errors_everywhere(make):
    """docs/channel.md: anything outside the item types is a TypeError at put -- also on a local
    channel (no serialization there, but the same API).  (The full table: tests/test_values.py.)"""
    from payloads import Sample, Unregistered

    ch = make("unsendable")
    bad = [object(), {1, object()}, np.array(["a"], dtype=object), Unregistered(),
           [1, (2, {"x": object()})], {object(): 1}, Sample(torch.arange(2), [object()], {})]
    for item in bad:
        with pytest.raises(TypeError):
            ch.put(item)
        with pytest.raises(TypeError):
            ch.put_nowait(item)
    assert ch.qsize() == 0
    value = [2**64 - 1, -(2**63), bytearray(b"ab"), np.float32(1.5)]
    ch.put(value)
    got = ch.get(timeout=5)
    assert got[:2] == value[:2] and type(got[2]) is bytes and got[2] == b"ab"
    assert type(got[3]) is np.float32 and got[3] == 1.5
    if make.local:
        ref = [torch.ones(2)]
        ch.put(ref)
        assert ch.get(timeout=5) is ref  # still passed by reference


def test_three_threads_share_one_handle(make):
    ch = make()
    errors = []

    def producer(tid: int) -> None:
        try:
            for i in range(200):
                ch.put((tid, i), key=tid)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    for tid in range(3):
        assert [ch.get(key=tid) for _ in range(200)] == [(tid, i) for i in range(200)]


def test_close_while_threads_issue_requests_leaves_nothing_pending(make_remote):
    """Requests racing a close() either raise or end with an error; none is left pending (a
    wait() without a timeout would hang on it)."""
    ch = make_remote("racing-close")
    handle = Channel.connect(ch.address)
    handle.put("warm")  # connected before the threads start
    works, stop, many = [], threading.Event(), threading.Event()

    def issue() -> None:
        while not stop.is_set():
            try:
                works.append(handle.get(key="empty", async_op=True))  # parks: no items
            except ChannelError:
                return  # closed: refused at once
            if len(works) >= 200:
                many.set()

    threads = [threading.Thread(target=issue) for _ in range(4)]
    for t in threads:
        t.start()
    many.wait(10)  # the close races the requests either way: 200 issued, or 10 s of them
    handle.close()
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert all(not t.is_alive() for t in threads)
    for work in works:
        with pytest.raises(ChannelError):
            work.wait(10)


def test_a_blocking_call_waiting_for_its_reply_lets_other_threads_send(brokers, run_dir,
                                                                       monkeypatch, request):
    """A thread blocked in get() on an empty queue holds the handle's socket while it waits;
    a put from another thread on the same handle must go out at once, not when some message
    (a broker heartbeat, after up to a second) or the end of the get's drive window
    (``DRIVE_S``, made 60 s here) lets the getter look at its queue again."""
    from zchannel.broker.connection import connection, line, requestqueue, tuning, waiting

    monkeypatch.setattr(waiting, "DRIVE_S", 60.0)
    monkeypatch.setattr(tuning, "SPIN_US", 0)  # the getter waits in _drive, not _spin
    events: list[str] = []
    Conn, Queue, Line = connection.Connection, requestqueue.RequestQueue, line.Line
    enqueue, send, on_message = Queue.enqueue, Line.send, Conn._on_message

    def logged_enqueue(self, rec, *args, **kwargs):
        events.append(f"queued {op_of(rec)}")
        return enqueue(self, rec, *args, **kwargs)

    def logged_send(self, records, frames):
        events.extend(f"sent {op_of(r)}" for r in records)
        send(self, records, frames)

    def logged_on_message(self, header, frames):
        events.append("received")
        on_message(self, header, frames)

    monkeypatch.setattr(Queue, "enqueue", logged_enqueue)
    monkeypatch.setattr(Line, "send", logged_send)
    monkeypatch.setattr(Conn, "_on_message", logged_on_message)
    # no heartbeat in the test's time: a message arriving (on a loaded machine, a heartbeat can
    # come between the put's queueing and its sending) would let the getter look at its queue;
    # the broker's interval is the connection's too (its hello reply says it)
    address = f"ipc://{run_dir}/drive-window.sock"
    brokers.start(name="drive-window", address=address, heartbeat_interval=60.0)
    ch = Channel.connect(address)
    request.addfinalizer(ch.close)
    assert ch._connection().broker_info.hb == 60.0
    ch.put("warm")
    assert ch.get() == "warm"
    conn = ch._connection()
    assert conn._waiting.spin_s == 0.0  # a connection made now reads tuning.SPIN_US
    got: list = []
    getter = threading.Thread(target=lambda: got.append(ch.get(key="late", timeout=20)))
    events.clear()
    getter.start()
    # the getter (or, now and then, the I/O thread) holds the socket while the get waits
    wait_until(lambda: "sent get" in events and conn._line.sock_lock.locked(), timeout=10,
               interval=0.001)
    ch.put("item", key="late")
    getter.join(timeout=30)
    assert got == ["item"]
    after = events[events.index("queued put") + 1 :]
    assert [e for e in after if e in ("sent put", "received")][0] == "sent put", events


def test_blocking_calls_stop_spinning_while_their_replies_are_slow(make_remote, monkeypatch):
    """A blocking call spins up to SPIN_US for its reply; calls whose replies keep coming later
    (gets that time out on an empty queue) stop spinning after 4 misses and then spin only
    every SPIN_PROBE-th call, so a handle waiting for data does not burn a core."""
    from zchannel.broker.connection import tuning, waiting

    ch = make_remote("spin")
    ch.put("warm")
    assert ch.get() == "warm"
    conn = ch._connection()
    conn._waiting.spin_s = 200e-6  # also on a machine with one CPU (where it would be 0)
    conn._waiting.spin_score = tuning.SPIN_SCORE_MAX  # as new, whatever the warm-up calls scored
    # the spin decision of each call that took the socket itself (a call made while the I/O
    # thread reads replies leaves them to it: no decision, no probe count)
    decisions: list[bool] = []
    read_for = waiting.Waiting._read_for

    def recording(self, work, limit, spin=None):
        if spin is not None:
            decisions.append(spin)
        return read_for(self, work, limit, bool(spin))

    monkeypatch.setattr(waiting.Waiting, "_read_for", recording)
    for _ in range(400):  # until 37 calls decided, on a loaded machine too
        with pytest.raises(TimeoutError):
            ch.get(key="empty", timeout=0.005)  # each reply comes >= 5 ms later: a miss
        if len(decisions) >= 37:
            break
    # 4 misses take the score from 8 to 0; then probes at the 1st and 33rd call after that
    # (the probe counter only counts calls made at score 0)
    expected = [True] * 5 + [False] * 31 + [True]
    assert decisions[:37] == expected
    assert conn._waiting.spin_score == 0


def test_spin_setting_is_checked():
    code = "import zchannel.broker.connection.connection"
    for bad in ("-1", "fast"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "ZCHANNEL_SPIN_US": bad}, timeout=60)
        assert proc.returncode != 0
        assert "ZCHANNEL_SPIN_US must be an int >= 0" in proc.stderr
    proc = subprocess.run([sys.executable, "-c", code + "; print(zchannel.broker.connection.tuning.SPIN_US)"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ZCHANNEL_SPIN_US": "0"})
    assert proc.stdout.strip() == "0"


def test_a_process_on_one_cpu_does_not_spin():
    """Pinned to one CPU, a spinning caller would only hold the CPU its reply needs."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from zchannel.broker.connection import tuning; print(tuning.spin_seconds())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ZCHANNEL_SPIN_US": "250"})
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) == 0.0
    if len(os.sched_getaffinity(0)) > 1:
        code = "from zchannel.broker.connection import tuning; print(tuning.spin_seconds())"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "ZCHANNEL_SPIN_US": "250"})
        assert float(proc.stdout) == 250e-6


def test_threads_mix_blocking_and_async_calls_on_one_handle(make_remote):
    """Blocking calls drive the socket themselves when it is free and hand it back to the I/O
    thread otherwise: every reply must reach its caller, in order per thread and key."""
    ch = make_remote("mix")
    # a small in-flight limit: blocking callers must wait for room without holding the socket
    # (regression: a caller waiting for room while driving the socket deadlocked the handle)
    ch._connection()._requests.max_inflight = 16
    n, errors, got = 300, [], {}

    def sync_producer(tid: int) -> None:
        for i in range(n):
            ch.put((tid, i), key=("k", tid))

    def async_producer(tid: int) -> None:
        works = [ch.put((tid, i), key=("k", tid), async_op=True) for i in range(n)]
        for w in works:
            w.wait(30)

    def consumer(tid: int) -> None:
        got[tid] = [ch.get(key=("k", tid), timeout=30) for _ in range(n)]

    def run(fn, tid):
        try:
            fn(tid)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(consumer, t)) for t in range(4)]
    threads += [threading.Thread(target=run, args=(sync_producer, t)) for t in (0, 1)]
    threads += [threading.Thread(target=run, args=(async_producer, t)) for t in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert all(not t.is_alive() for t in threads)
    for tid in range(4):
        assert got[tid] == [(tid, i) for i in range(n)]
    assert ch.qsize(("k", 0)) == 0 and ch.stats()["bytes_held"] == 0


def test_waiting_for_inflight_room_counts_against_timeout(make_remote):
    """docs/channel.md: issuing past ``max_inflight`` blocks the caller, counted against
    its timeout -- a call whose timeout passes while it waits for room raises TimeoutError
    (nothing sent) instead of blocking for ever."""
    ch = make_remote("room")
    producer = Channel.connect("room")
    conn = ch._connection()
    conn._requests.max_inflight = 8
    parked = [ch.get(key="k", async_op=True) for _ in range(8)]  # all 8 slots taken
    with pytest.raises(TimeoutError):
        ch.get(key="other", timeout=0.2)
    with pytest.raises(TimeoutError):
        ch.put("never sent", key="other", timeout=0.2)
    with pytest.raises(TimeoutError):
        ch.get_batch(1, key="other", timeout=0)
    for i in range(8):
        producer.put(i, key="k")
    assert sorted(w.wait(timeout=10) for w in parked) == list(range(8))
    # the failed calls gave their slots back and changed nothing in the broker
    assert producer.qsize("other") == 0
    works = [ch.put(i, weight=1, key="again", async_op=True) for i in range(8)]
    assert [w.wait(timeout=10) for w in works] == [None] * 8
    assert ch.get_batch(8, key="again", timeout=5) == list(range(8))
    producer.close()


def test_asyncio_consumer_keeps_loop_running(make):
    ch = make()

    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                if ticks == 5:  # reached only if the loop runs while the get is pending
                    ch.put("hello", async_op=True)
                await asyncio.sleep(0.01)  # gives the loop back: each tick is a turn of it

        task = asyncio.create_task(ticker())
        work = ch.get(async_op=True)
        value = await work
        stop.set()
        await task
        also = ch.put("again", async_op=True)
        await also.async_wait()
        return value, ticks, ch.get()

    value, ticks, again = asyncio.run(main())
    assert value == "hello" and again == "again"
    assert ticks >= 5  # the loop ran while the get was pending


def test_cancelling_await_does_not_cancel_operation(make):
    ch = make()

    async def main():
        work = ch.get(async_op=True)
        task = asyncio.ensure_future(work.async_wait())
        await asyncio.sleep(0)  # the task runs up to its wait for the reply
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ch.put("still delivered")
        return await work

    assert asyncio.run(main()) == "still delivered"


def test_awaits_given_up_leave_nothing_behind_on_the_pending_work(make):
    """``asyncio.wait_for(work, t)`` timing out again and again on one pending ``Work``: each
    given-up await takes its wake-up callback (holding its future and loop) back with it;
    a later await still gets the item."""
    ch = make()

    async def main():
        work = ch.get(async_op=True)
        before = len(work._callbacks or [])  # (a distributed channel's chains its replica's)
        for _ in range(200):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(work, 0.0001)
        added = len(work._callbacks or []) - before
        ch.put("at last")
        return added, await work

    assert asyncio.run(main()) == (0, "at last")


def test_work_cancel(make):
    ch = make()
    pending = ch.get(async_op=True)
    assert pending.cancel() is True
    with pytest.raises(concurrent.futures.CancelledError):  # (docs/errors.md)
        pending.wait(timeout=5)
    ch.put("x")
    assert ch.get(timeout=5) == "x"  # the cancelled get did not swallow it
    done = ch.put("y", async_op=True)
    done.wait(timeout=5)
    assert done.cancel() is False


def test_shutdown_fails_other_handles_with_broker_unavailable(make):
    """docs/channel.md: a broker that went away reaches the caller as BrokerUnavailable (never a hang) --
    for a local channel too (its "broker" is the shut-down in-process state)."""
    from zchannel.broker import BrokerUnavailable

    ch = make("gone")
    other = Channel.connect("gone")
    pending = other.get(async_op=True)
    ch.shutdown()
    with pytest.raises(BrokerUnavailable):
        pending.wait(timeout=30)
    with pytest.raises(BrokerUnavailable):
        other.put("after", timeout=30)
    other.close()


def test_ack_redelivers_unacknowledged(make):
    ch = make(lease_timeout=2.0)  # long enough to see the lease before it lapses, loaded
    ch.put("a")
    first = ch.get(ack=True)
    assert isinstance(first, Delivery) and first.item == "a"
    assert ch.stats()["leases"] == 1
    # not acknowledged: after the lease it is delivered again (the waiting get receives it)
    again = ch.get(ack=True, timeout=30)
    assert again.item == "a" and again.lease_id != first.lease_id
    ch.ack(again)
    assert ch.stats()["leases"] == 0
    with pytest.raises(ValueError):
        ch.ack(first)  # its lease lapsed: the item was delivered again, not acknowledged
    ch.put("b")
    assert ch.get(timeout=5) == "b"
    with pytest.raises(ValueError):
        ch.ack(again)  # already acknowledged


def test_connect_and_identity(make):
    ch = make()
    other = Channel.connect("ch", identity="actor:0")
    try:
        assert other.identity == "actor:0"
        other.put("via other")
        assert ch.get() == "via other"
    finally:
        other.close()
    for bad in ("bad id", "actor:1\n", "actor:\u0663", "actor:"):  # a newline, a non-ASCII digit
        with pytest.raises(ValueError, match="consumer id"):
            Channel.connect("ch", identity=bad)


def test_context_manager_closes(make):
    with make("ctx") as ch:
        ch.put(1)
        assert ch.get() == 1


def test_calls_answered_at_once_go_out_while_every_slot_holds_a_waiting_get(make_remote):
    """A handle whose ``max_inflight`` (1024) outstanding requests are all gets waiting for
    items still sends what the broker answers at once: ``*_nowait``, ``qsize``, ``full``,
    ``stats``. A put that may wait waits for a slot (counted against its timeout)."""
    ch = make_remote("inflight")
    gets = [ch.get(key="later", async_op=True, timeout=60) for _ in range(1024)]
    with pytest.raises(QueueEmpty):
        ch.get_nowait(key="other")
    ch.put_nowait("x", key="other")
    assert ch.qsize(key="other") == 1 and not ch.full(key="other")
    assert ch.get_nowait(key="other") == "x"
    assert ch.stats()["keys"]["later"]["getters"] == 1024
    with pytest.raises(TimeoutError, match="outstanding requests"):
        ch.put("y", key="later", timeout=0.2)
    feeder = Channel.connect(ch.address)
    try:
        feeder.put("first", key="later")
        assert gets[0].wait(10) == "first"
    finally:
        feeder.close()


def test_create_takes_the_brokers_heartbeat_settings():
    """``Channel.create(heartbeat_interval=..., liveness=...)`` sets the broker's heartbeats,
    which its clients take from its hello; out-of-range values and either with ``local=True``
    (no heartbeats there) are a ``ValueError`` before any broker starts."""
    with pytest.raises(ValueError, match="need a broker process"):
        Channel.create("hb-local", local=True, liveness=5)
    with pytest.raises(ValueError, match="liveness must be an int >= 1 and <= 1000"):
        Channel.create("hb-zero", liveness=0)
    ch = Channel.create("hb-set", heartbeat_interval=0.5, liveness=9)
    try:
        info = ch._connection().broker_info
        assert (info.hb, info.liveness) == (0.5, 9)
    finally:
        ch.shutdown()
