"""The call forms of RLinf's Channel that zchannel keeps (the seed's call forms; a failed
create, get_nowait's exceptions, attaching, stat): create's positional order,
connect(name, current_worker), is_local, created, peek and ``zchannel stat --peek``, Work.then,
float weights and targets, QueueEmpty/QueueFull, the errors of a failed create — each against
a broker process, a local channel and a distributed one where the form applies to all three."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import queue
import socket
import threading
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import wait_until
from zchannel.broker import (
    BrokerStartError,
    Channel,
    ChannelError,
    HookError,
    QueueEmpty,
    QueueFull,
    Work,
)
from zchannel.cli.main import main
from zchannel.embodied.groups import Worker

pytestmark = pytest.mark.timeout(90)

SHM_SIZE = 2 << 20  # bytes: above the 1 MiB shared-memory threshold


def _create(make, channels, *args, **kwargs):
    """``Channel.create`` called directly (positional forms), torn down like ``make``'s."""
    ch = Channel.create(*args, **kwargs)
    channels.append(ch)
    return ch


# -- create / connect / is_local / created / repr ---------------------------------------------


def test_create_takes_rlinfs_positional_order(make, channels):
    ch = _create(make, channels, "pos", 2, make.distributed, None, make.local)
    assert ch.is_local is make.local
    assert ch.created is True
    ch.put("a")
    ch.put("b")
    assert ch.full()  # maxsize=2 arrived as the second positional argument
    with pytest.raises(QueueFull):
        ch.put_nowait("c")
    assert [ch.get(), ch.get()] == ["a", "b"]


def test_create_refuses_misplaced_positional_arguments():
    with pytest.raises(TypeError, match="distributed must be a bool"):
        Channel.create("misplaced", 0, "tcp://127.0.0.1:0")
    with pytest.raises(TypeError, match="local must be a bool"):
        Channel.create("misplaced", 0, False, None, "yes")
    with pytest.raises(ValueError, match="node_rank"):
        Channel.create("misplaced", 0, False, -1)
    with pytest.raises(TypeError):  # a sixth positional argument: the rest is keyword-only
        Channel.create("misplaced", 0, False, None, False, "ipc:///tmp/x.sock")


@dataclass
class _Worker:
    group_name: str
    rank: int


@dataclass
class _Named:
    identity: str


def test_connect_with_current_worker(make):
    ch = make("cw", dispatcher="round_robin", consumers=["actor:0", "actor:1"])
    by_id = Channel.connect("cw", "actor:1")
    by_worker = Channel.connect("cw", _Worker("actor", 0))
    by_identity = Channel.connect("cw", current_worker=_Named("actor:1"))
    try:
        assert by_id.identity == "actor:1" and by_worker.identity == "actor:0"
        assert by_identity.identity == "actor:1"
        assert by_id.created is False and by_id.is_local is make.local
        ch.put("s0")
        ch.put("s1")  # dealt in rotation: s0 to actor:0, s1 to actor:1
        assert by_worker.get(timeout=10) == "s0"
        assert by_id.get(timeout=10) == "s1"
        same = Channel.connect("cw", "actor:0", identity="actor:0")  # both, agreeing: fine
        same.close()
    finally:
        for h in (by_id, by_worker, by_identity):
            h.close()
    with pytest.raises(ValueError, match="give one of them"):
        Channel.connect("cw", "actor:0", identity="actor:1")
    with pytest.raises(TypeError, match="worker_name"):
        Channel.connect("cw", 3.5)
    # RLinf's own call (worker.py): the name as a keyword, and zchannel's Worker as the worker
    worker = Worker()
    worker._zchannel_setup("actor", 1, 2)
    as_rlinf = Channel.connect(name="cw", current_worker=worker)
    try:
        assert as_rlinf.identity == "actor:1"
    finally:
        as_rlinf.close()
    with pytest.raises(TypeError, match="not both"):
        Channel.connect("cw", name="other")
    with pytest.raises(ValueError):
        Channel.connect("cw", "not an id")


def test_created_flag_and_repr_without_network(make, channels):
    ch = make("flag")
    assert ch.created is True
    attached = _create(make, channels, "flag", local=make.local, distributed=make.distributed)
    assert attached.created is False
    text = repr(attached)
    assert "flag" in text and "created=False" in text and str(attached) == text
    if not make.local:
        copy = pickle.loads(pickle.dumps(ch))
        assert copy.created is False
        copy.close()
    ch.shutdown()
    # repr and str of a handle whose broker is gone answer at once: they never ask it
    assert "created=True" in repr(ch) and "flag" in str(ch)


def test_create_attaching_to_a_running_broker_is_logged(make, channels, caplog):
    first = make("att")
    first.put("old-1")
    first.put("old-2")
    stats = first.stats()
    with caplog.at_level(logging.WARNING, logger="zchannel.client"):
        second = _create(make, channels, "att", local=make.local, distributed=make.distributed)
    assert second.created is False
    notes = [r for r in caplog.records
             if r.name == "zchannel.client" and "attached to the broker" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    text = notes[0].getMessage()
    pid = os.getpid() if make.local else stats["pid"]
    assert f"pid {pid}" in text and "2 items held" in text
    assert (stats.get("address") or first.address) in text
    assert second.get() == "old-1"  # the same queues


# -- peek -------------------------------------------------------------------------------------


def test_peek_copies_head_items_and_removes_nothing(make):
    ch = make("pk")
    assert ch.peek() == [] and ch.peek("missing", 5) == []
    for i in range(4):
        ch.put({"i": i, "t": torch.full((3,), float(i))}, key="k", weight=i + 0.5)
    head = ch.peek("k")
    assert len(head) == 1 and head[0]["i"] == 0
    three = ch.peek("k", 3)
    assert [v["i"] for v in three] == [0, 1, 2]  # head first
    everything = ch.peek("k", 100, weights=True)  # n beyond the depth: all of them
    assert [(v["i"], w) for v, w in everything] == [(0, 0.5), (1, 1.5), (2, 2.5), (3, 3.5)]
    three[0]["t"].add_(100)  # a copy: the queued item does not change
    three[0]["i"] = -1
    assert ch.qsize("k") == 4
    got = [ch.get("k", timeout=10) for _ in range(4)]
    assert [g["i"] for g in got] == [0, 1, 2, 3]
    assert torch.equal(got[0]["t"], torch.zeros(3))
    for bad in (0, -1, 1025, True, 2.0):
        with pytest.raises(ValueError, match="n must be an int"):
            ch.peek("k", bad)
    with pytest.raises(TypeError):
        ch.peek(1.5)


def test_peek_shows_what_a_consumer_would_take(make):
    ch = make("pkc", dispatcher="round_robin", consumers=["a:0", "a:1"])
    for i in range(4):
        ch.put(i)  # a:0 gets 0, 2; a:1 gets 1, 3
    assert ch.peek(n=5) == []  # nothing left in the shared queue
    assert ch.peek(n=5, consumer="a:1") == [1, 3]
    assert ch.peek(n=1, consumer="a:0") == [0]
    assert ch.qsize() == 4


@pytest.mark.parametrize("path", ["direct", "zeromq", "frames"])
def test_peek_of_shared_memory_items(make_remote, monkeypatch, path):
    ch = make_remote("pkshm")
    tensors = [torch.full((SHM_SIZE // 4,), float(i)) for i in range(3)]
    for t in tensors:
        ch.put(t)
    shm = ch.stats()["shm"]
    assert shm["slots_in"] == 3  # they live in shared-memory slots
    if path == "zeromq":
        monkeypatch.setenv("ZCHANNEL_DIRECT", "0")
    looker = Channel.connect("pkshm", shm=path != "frames")
    try:
        conn = looker._connection()
        assert conn.direct is (path == "direct")
        seen = looker.peek(n=5)
        assert len(seen) == 3 and all(torch.equal(a, b) for a, b in zip(seen, tensors, strict=True))
        seen[0].fill_(-1)  # a copy, not a view of the slot
        del seen
        # the peek's slot holds are released: only the items' own holds remain
        assert wait_until(lambda: looker.stats()["shm"]["consumer_holds"] == 0)
        assert looker.qsize() == 3
        got = [looker.get(timeout=10) for _ in range(3)]
        assert all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))
    finally:
        looker.close()


# -- zchannel stat --peek, and stat does not count itself ----------------------------------------


def test_stat_peek_prints_a_summary_and_leaves_the_items(make_remote):
    ch = make_remote("statpk")
    ch.put({"obs": torch.zeros(4, 84, 84, dtype=torch.uint8), "step": 7}, key="train", weight=2.5)
    ch.put("second item", key="train", weight=1)
    ch.put(np.arange(6, dtype=np.int16), key=7)
    ch.put(torch.ones(SHM_SIZE // 4), key="big")
    runner = CliRunner()
    result = runner.invoke(main, ["stat", "statpk", "--peek", "train", "-n", "5"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    head = lines.index("peek      train: 2 of 2 item(s), head first, left in place")
    assert lines[head + 1].startswith("  [0] weight 2.5  {'obs': Tensor[4x84x84] torch.uint8")
    assert "'step': 7" in lines[head + 1]
    assert lines[head + 2] == "  [1] weight 1  'second item'"
    result = runner.invoke(main, ["stat", "statpk", "--peek", "7"])  # an int key, as printed
    assert result.exit_code == 0, result.output
    assert "  [0] weight 0  ndarray[6] int16" in result.output
    result = runner.invoke(main, ["stat", "statpk", "--peek", "big", "-n", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["peek"] == {"key": "big", "items": [
        {"weight": 0, "summary": f"Tensor[{SHM_SIZE // 4}] torch.float32"}]}
    result = runner.invoke(main, ["stat", "statpk", "--peek", "train", "-n", "0"])
    assert result.exit_code == 2  # -n is 1..1024
    assert ch.qsize("train") == 2 and ch.qsize(7) == 1 and ch.qsize("big") == 1


def test_stat_peek_of_a_consumers_private_queue(make_remote):
    ch = make_remote("statdeal", dispatcher="round_robin", consumers=["a:0", "a:1"])
    for i in range(4):
        ch.put(f"s{i}")  # a:0 gets s0, s2; a:1 gets s1, s3
    runner = CliRunner()
    result = runner.invoke(main, ["stat", "statdeal", "--peek", "default_queue"])
    assert result.exit_code == 0, result.output
    assert "default_queue: 0 of 4 item(s)" in result.output
    assert "--consumer ID shows what ID would take next" in result.output
    result = runner.invoke(main, ["stat", "statdeal", "--peek", "default_queue",
                                  "--consumer", "a:1"])
    assert result.exit_code == 0, result.output
    assert "  [0] weight 0  's1'\n  [1] weight 0  's3'" in result.output
    result = runner.invoke(main, ["stat", "statdeal", "--peek", "default_queue",
                                  "--consumer", "not-an-id"])
    assert result.exit_code == 2 and "not-an-id" in result.output
    assert ch.qsize() == 4


def test_stat_does_not_count_itself(make_remote):
    # a process's handles with one identity share one connection (one client): the two
    # handles and the in-process `stat` below get one each
    ch = make_remote("statself", identity="creator:0")
    other = Channel.connect("statself", identity="other:0")
    try:
        assert other.stats()["clients"] == 2
        assert other.stats(exclude_self=True)["clients"] == 1
        result = CliRunner().invoke(main, ["stat", "statself"])
        assert result.exit_code == 0, result.output
        assert "clients 2 " in result.output  # ch and other, not stat itself
        result = CliRunner().invoke(main, ["stat", "statself", "--json"])
        shown = json.loads(result.output)
        assert shown["clients"] == 2
        # nor among the same-host (shared-memory) clients: those ch and other are, as before
        assert shown["shm"]["clients"] == other.stats()["shm"]["clients"]
        assert other.stats(exclude_self=True)["shm"]["clients"] == \
            other.stats()["shm"]["clients"] - 1
    finally:
        other.close()
    assert ch.stats(exclude_self=True)["clients"] == 0


# -- float weights ------------------------------------------------------------------------------


def test_float_weights_and_targets(make):
    ch = make("fw")
    for w in (0.5, 1.5, 0.25, 2):
        ch.put(w, weight=w)
    assert ch.stats()["keys"]["default_queue"]["weight"] == pytest.approx(4.25)
    assert ch.get_batch(2.0, timeout=5) == [0.5, 1.5]  # reaches the float target
    assert ch.get_batch(1, timeout=5) == [0.25]  # 0.25 + 2 would exceed 1
    assert ch.get_batch(0.5, timeout=5) == [2]  # an overweight head comes alone
    for w in (0.1, 0.2, 0.3):
        ch.put(w, weight=w)
    assert ch.get_batch(0.3, timeout=5) == [0.1, 0.2]  # 0.1 + 0.2 meets 0.3 despite rounding
    ch.put("np", weight=np.float32(0.75))
    ch.put("np-int", weight=np.int64(3))
    ch.put_nowait("nowait", weight=0.125)
    assert ch.peek(n=3, weights=True) == [(0.3, 0.3), ("np", 0.75), ("np-int", 3)]
    assert ch.get_batch(target_weight=4.05, timeout=5) == [0.3, "np", "np-int"]
    for bad in (float("nan"), float("inf"), -0.5, -1, True, "1", None):
        with pytest.raises(ValueError, match="weight must be an int or a finite float"):
            ch.put("x", weight=bad)
        with pytest.raises(ValueError, match="weight must be an int or a finite float"):
            ch.put_nowait("x", weight=bad)
    for bad in (0, 0.0, -1.5, float("nan"), float("inf"), False):
        with pytest.raises(ValueError, match="target_weight must be an int or a finite float"):
            ch.get_batch(bad, timeout=1)
    with pytest.raises(ValueError, match=r"target_weight .* in \(0, 2\*\*53\]"):
        ch.get_batch(1e300, timeout=1)  # finite, but beyond the range of a weight
    with pytest.raises(ValueError, match="never empty"):
        ch.get_batch(0)
    assert ch.get_nowait() == "nowait"  # nothing was lost to the refused calls
    assert ch.empty()


def test_float_weights_with_async_get_batch(make):
    ch = make("fwa")
    work = ch.get_batch(1.0, async_op=True)  # parked until the float total reaches 1.0
    ch.put("a", weight=0.4)
    ch.put("z", weight=0.0)
    assert ch.qsize() == 2 and not work.done()  # 0.4 of 1.0: still waiting
    ch.put("b", weight=0.6)
    assert work.wait(timeout=10) == ["a", "z", "b"]
    ch.put("c", weight=0.7)
    ch.put("d", weight=0.0)  # weight-0 items right behind a reached target ride along
    ch.put("e", weight=0.1)
    assert ch.get_batch(0.7, timeout=5) == ["c", "d"]


def test_collector_outputs_carry_float_weights(make):
    ch = make("fwhook", collector="hookmods:FloatWeights")
    ch.put({"w": 0.25, "i": 0}, weight=5)  # the collector's weight wins over the put's
    ch.put({"w": 0.75, "i": 1})
    assert [(v["i"], w) for v, w in ch.peek(n=2, weights=True)] == [(0, 0.25), (1, 0.75)]
    with pytest.raises(HookError) as info:
        ch.put({"w": float("nan"), "i": 2})
    assert info.value.exc_type == "ValueError" and "finite float" in str(info.value)
    assert [v["i"] for v in ch.get_batch(1.0, timeout=5)] == [0, 1]


def test_key_errors_say_why(make):
    ch = make("keys")
    with pytest.raises(TypeError, match=r"1\.0 == 1 would share a queue"):
        ch.put("x", key=1.0)
    with pytest.raises(TypeError, match="True == 1"):
        ch.put("x", key=True)
    with pytest.raises(TypeError, match="str, int, bytes or tuples"):
        ch.get_nowait(key=("a", 2.5))


# -- Work.then ---------------------------------------------------------------------------------


def test_work_then_chains_results_and_errors(make):
    ch = make("then")
    caller = threading.get_ident()
    ran_on: list[int] = []

    def double(v):
        ran_on.append(threading.get_ident())
        return v * 2

    pending = ch.get(async_op=True)
    chained = pending.then(double).then(lambda v: v + 1)
    assert isinstance(chained, Work) and not chained.done()
    ch.put(20)
    assert chained.wait(timeout=10) == 41
    if not make.local:
        assert ran_on == [ran_on[0]]  # ran once, in the thread that completed the get
    done = ch.put(1, async_op=True)
    done.wait(timeout=10)
    threads: list[int] = []
    after = done.then(lambda _: threads.append(threading.get_ident()) or "put done")
    assert after.done() and threads == [caller]  # already done: fn ran in the calling thread
    assert after.wait(timeout=1) == "put done"
    assert ch.get(async_op=True).then(double).wait(timeout=10) == 2
    # errors propagate: the operation's (fn is not called), or fn's own
    called = []
    failing = ch.get(timeout=0.05, async_op=True).then(called.append)
    with pytest.raises(TimeoutError):
        failing.wait(timeout=10)
    assert called == [] and isinstance(failing.exception(), TimeoutError)
    ch.put("boom")
    broken = ch.get(async_op=True).then(lambda v: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        broken.wait(timeout=10)
    with pytest.raises(TypeError, match="callable"):
        ch.get(async_op=True).then("not callable")


def test_work_then_is_awaitable_and_cancels_the_operation(make):
    ch = make("thena")

    async def run():
        work = ch.get(key="a", async_op=True).then(str.upper)
        ch.put("hi", key="a")
        return await work

    assert asyncio.run(run()) == "HI"
    parked = ch.get(key="b", async_op=True)
    chained = parked.then(lambda v: v)
    assert chained.cancel() is True  # withdraws the parked get
    ch.put("kept", key="b")
    assert ch.qsize("b") == 1 and ch.get("b", timeout=5) == "kept"


# -- QueueEmpty / QueueFull: both except forms ---------------------------------------------------


def test_nowait_errors_are_both_asyncio_and_queue_classes(make):
    ch = make("exc", maxsize=1)
    for form in (asyncio.QueueEmpty, queue.Empty, QueueEmpty):
        with pytest.raises(form):
            ch.get_nowait()
    ch.put_nowait("only")
    for form in (asyncio.QueueFull, queue.Full, QueueFull):
        with pytest.raises(form):
            ch.put_nowait("more")
    try:
        ch.put_nowait("more")
    except queue.Full as exc:  # the stdlib form, as code written against queue.Queue has it
        assert isinstance(exc, asyncio.QueueFull)
    assert ch.get_nowait() == "only"


# -- a failed create: one rule -----------------------------------------------------------------


def test_failed_create_follows_one_rule(channels):
    # wrong arguments: ValueError / TypeError, wherever found (the broker resolves hook names)
    with pytest.raises(ValueError, match="unknown collector 'no_such'") as info:
        Channel.create("bad1", collector="no_such")
    assert not isinstance(info.value, ChannelError)
    with pytest.raises(ValueError, match="No module named"):
        Channel.create("bad2", dispatcher="no_such_module:Thing")
    with pytest.raises(ValueError, match="maxsize"):
        Channel.create("bad3", -1)
    # valid arguments, but the broker cannot start: BrokerStartError (a ChannelError)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(BrokerStartError, match="Address already in use") as info:
            Channel.create("busy", address=f"tcp://127.0.0.1:{port}")
    assert isinstance(info.value, ChannelError) and not isinstance(info.value, ValueError)
    assert info.value.reason == "ZMQError"
    ok = Channel.create("busy", address="tcp://127.0.0.1:0")  # the name is free again
    channels.append(ok)
    assert ok.created
