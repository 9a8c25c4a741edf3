"""Interruptions and the lifecycle of handles and their requests: Ctrl-C (SIGINT, Python's
``KeyboardInterrupt``) at any moment of a blocking get over the same-host direct link, or of
``close()``; many asynchronous gets of one asyncio program on one handle; a handle used after
its broker stopped; pickling a ``Work``.  Each either works or fails with an error naming the
cause; none hangs, blocks an event loop or leaves the handle unusable.

The Ctrl-C tests interrupt a worker process they start (it says when it is ready on its
stdout); its handles are checked afterwards by the worker itself, with timeouts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import pickle
import random
import signal
import threading
import time

import pytest
from conftest import wait_until
from zchannel.broker import Channel, ChannelError, ChannelNotFound

pytestmark = pytest.mark.timeout(120)

ITEM = 1 << 19  # 512 KiB: a message larger than the direct link's scratch buffer
N_ITEMS = 1200

# Consumes ``k`` until told to stop, interrupted by SIGINT at random moments, and goes on after
# each.  Its handler raises KeyboardInterrupt, as Python's default one does, while a channel
# call runs (``armed``: the loop around the calls, which Python cannot protect, is not
# interrupted).  "get": blocking gets (an interrupted one is withdrawn; the item on its way, if
# any, is lost); "work": the Work of an async get is waited on again after an interruption of
# its wait (nothing may be lost).  Each item is recorded by the call that returns it (``list.extend`` of
# a ``map``: no interruption between), so that the worker's own code loses none.  Then it
# checks its handle and prints what it saw.
_CONSUMER = r"""
import json, operator, signal, sys, threading
from zchannel.broker import Channel

armed = False

def interrupt(signum, frame):
    if armed:
        raise KeyboardInterrupt

signal.signal(signal.SIGINT, interrupt)
mode, name = sys.argv[1], sys.argv[2]
ch = Channel.connect(name)
assert ch._connection().direct, "not over the direct link"
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
index = operator.itemgetter(slice(-4, None))
one = (0,)
got, kis, stuck, errors = [], 0, 0, []
w, mark = None, 0

def get_one(_):
    return ch.get(key="k", timeout=1)

print("ready", flush=True)
while not stop.is_set():
    try:
        armed = True
        if mode == "get":
            got.extend(map(index, map(get_one, one)))
        else:
            if w is not None and len(got) > mark:  # recorded before an interruption came
                w = None
            if w is None:  # issued uninterrupted: an interrupted call hands over no Work
                armed = False
                mark, w = len(got), ch.get(key="k", async_op=True, timeout=1)
                armed = True
            try:
                got.extend(map(index, map(w.wait, (30,))))
            except TimeoutError as exc:
                stuck += "Work.wait" in str(exc)
            w = None
        armed = False
    except KeyboardInterrupt:
        armed = False
        kis += 1
    except TimeoutError:
        armed = False
    except Exception as exc:
        armed = False
        errors.append(f"{type(exc).__name__}: {exc}")
        w = None
if w is not None and len(got) == mark:  # the last Work: wait for its end
    try:
        got.extend(map(index, (w.wait(30),)))
    except TimeoutError as exc:
        stuck += "Work.wait" in str(exc)
ch.put(b"ping", key="health", timeout=10)
health = ch.get(key="health", timeout=10)
while ch.qsize("k"):
    got.append(index(ch.get(key="k", timeout=10)))
getters = ch.stats()["keys"]["k"].get("getters", 0)
print(json.dumps({"kis": kis, "stuck": stuck, "errors": errors, "health": health.decode(),
                  "getters": getters, "got": [int.from_bytes(i, "little") for i in got]}),
      flush=True)
ch.close()
"""


@pytest.mark.parametrize("mode", ["get", "work"])
def test_ctrl_c_at_random_moments_of_direct_link_gets_leaves_the_handle_working(
        make_remote, workers, mode):
    """SIGINT at random moments while a worker takes 512 KiB items over the direct link (the
    link's reader cuts large messages from many reads): afterwards its handle puts and gets
    with timeouts, no item came twice, an interrupted get lost at most the item on its way,
    and an interrupted ``Work.wait`` lost nothing: the stream stayed in step."""
    ch = make_remote(f"ki{mode}")
    consumer = workers.start(_CONSUMER, mode, ch.name)
    workers.wait_line(consumer, "ready", timeout=60)
    produced = threading.Event()

    def produce() -> None:
        try:
            for i in range(N_ITEMS):
                ch.put(bytes(ITEM - 4) + i.to_bytes(4, "little"), key="k", timeout=60)
                if i % 8 == 7:
                    time.sleep(0.002)  # paced: the interruptions fall among the reads
        finally:
            produced.set()

    producer = threading.Thread(target=produce)
    producer.start()
    rng = random.Random(7)
    signals = 0
    try:
        while not produced.is_set() or signals < 200:
            os.kill(consumer.pid, signal.SIGINT)
            signals += 1
            produced.wait(rng.uniform(0.0005, 0.004))
    finally:
        producer.join(120)
    workers.send(consumer, "stop")
    report = json.loads(workers.wait_line(consumer, timeout=90))
    workers.finish(consumer)
    got = report["got"]
    assert report["kis"] > 0, "no SIGINT interrupted the consumer"
    assert report["errors"] == [] and report["stuck"] == 0, report["errors"]
    assert report["health"] == "ping" and report["getters"] == 0
    assert len(got) == len(set(got)), "an item came twice"
    missing = N_ITEMS - len(got)
    if mode == "work":
        assert missing == 0, f"{missing} items lost to {report['kis']} interruptions"
    else:
        assert missing <= report["kis"], f"{missing} items lost to {report['kis']} interruptions"


# A handle (its own connection, or sharing it with another handle) whose put waits for room;
# ``close()`` is interrupted while it waits for that put (a helper thread says when the main
# thread is in that wait); then the worker checks what the interrupted close did.
_CLOSER = r"""
import sys, threading, time
from zchannel.broker import Channel, ChannelError

name, shared = sys.argv[1], sys.argv[2] == "shared"
h = Channel.connect(name, identity="p:1")
keeper = Channel.connect(name, identity="p:1") if shared else None
work = h.put("waiting", key="k", async_op=True)
main = threading.main_thread().ident

def in_settle():
    while not any(f.f_code.co_name == "settle" for f in _stack()):
        time.sleep(0.005)
    print("in-close", flush=True)

def _stack():
    frame = sys._current_frames().get(main)
    while frame is not None:
        yield frame
        frame = frame.f_back

while h.stats()["keys"]["k"].get("putters", 0) != 1:
    time.sleep(0.01)
threading.Thread(target=in_settle, daemon=True).start()
try:
    h.close()
    print("close-returned", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
h.close()
try:
    work.wait(10)
    print("put-stored", flush=True)
except ChannelError as exc:
    print("put-failed", exc, flush=True)
if keeper is not None:
    keeper.put("after", key="other", timeout=10)
    print("keeper", keeper.get(key="other", timeout=10), flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("connection", ["own", "shared"])
def test_ctrl_c_while_close_waits_for_a_put_still_withdraws_it(make_remote, workers,
                                                                connection):
    """Ctrl-C while ``close()`` waits for a put waiting for room: the put is withdrawn all the
    same (it fails with ``ChannelError`` and is never stored), the connection is given back
    (or, shared, stays usable by the other handle), and a second ``close()`` is harmless."""
    ch = make_remote(f"kiclose{connection}", maxsize=1)
    ch.put("fill", key="k")
    closer = workers.start(_CLOSER, ch.name, connection)
    workers.wait_line(closer, "in-close", timeout=60)
    os.kill(closer.pid, signal.SIGINT)
    assert workers.wait_line(closer, timeout=60) == "interrupted"
    assert workers.wait_line(closer, timeout=60).startswith("put-failed this channel handle is closed")
    if connection == "shared":
        assert workers.wait_line(closer, timeout=60) == "keeper after"
    else:  # its only connection: given back (the broker counts this test's handle alone)
        assert wait_until(lambda: ch.stats()["clients"] == 1, timeout=30), ch.stats()["clients"]
    assert ch.stats()["keys"]["k"].get("putters", 0) == 0
    assert ch.get(key="k", timeout=10) == "fill"
    assert ch.qsize("k") == 0, "the withdrawn put was stored"
    workers.send(closer)
    workers.finish(closer)


def test_more_coroutines_than_the_in_flight_limit_await_gets_without_blocking_the_loop(
        make_remote):
    """1100 coroutines each await a get on one handle (past its 1024 outstanding requests)
    while a coroutine of the same loop puts their items through another handle: the loop is
    never blocked, each get gets one item, in the order the gets were made."""
    ch = make_remote("manycoros")
    producer = Channel.connect(ch.name, identity="p:0")
    n = 1100

    async def main() -> list:
        gets = [ch.get(key="k", async_op=True, timeout=30) for _ in range(n)]
        await asyncio.sleep(0)  # the producer runs in this loop: it must get a turn
        for i in range(n):
            producer.put(i, key="k")
        return await asyncio.gather(*gets)

    try:
        assert asyncio.run(main()) == list(range(n))
        assert ch.stats()["keys"]["k"].get("getters", 0) == 0
    finally:
        producer.close()


def test_a_request_waiting_for_room_in_its_work_times_out_is_withdrawn_or_closed(make_remote):
    """A get made on an event loop past the handle's limit waits for room in its Work: its
    ``timeout`` runs out there (``TimeoutError``, nothing sent), ``cancel()`` withdraws it, and
    ``close()`` fails the others with ``ChannelError``; no item goes to any of them."""
    ch = make_remote("roomwait")
    h = Channel.connect(ch.name, identity="c:1")

    async def main() -> tuple:
        parked = [h.get(key="k", async_op=True) for _ in range(1024)]
        late = h.get(key="k", async_op=True, timeout=0.2)
        with pytest.raises(TimeoutError, match="waiting for room"):
            await late
        withdrawn = h.get(key="k", async_op=True)
        cancelled = withdrawn.cancel()
        closed = [h.get(key="k", async_op=True) for _ in range(5)]
        h.close()
        return parked, cancelled, withdrawn, closed

    parked, cancelled, withdrawn, closed = asyncio.run(main())
    assert cancelled is True
    with pytest.raises(concurrent.futures.CancelledError):
        withdrawn.wait(10)
    for work in parked + closed:
        with pytest.raises(ChannelError, match="closed"):
            work.wait(10)
    ch.put("kept", key="k")
    assert ch.get(key="k", timeout=10) == "kept"


def test_a_handle_unpickled_after_its_broker_stopped_fails_at_once_naming_why(make_remote):
    """No socket file: the first call of a handle unpickled after its broker stopped says so
    (as ``Channel.connect`` does), whatever the call: not "no broker answered" after 10 s."""
    ch = make_remote("unpickled")
    blob = pickle.dumps(ch)
    ch.shutdown()  # (its connection, which an unpickled copy here would share, ends with it)
    handle = pickle.loads(blob)
    for call in (lambda: handle.put(1, timeout=0.5), handle.get_nowait,
                 lambda: handle.get(async_op=True, timeout=0.5), handle.qsize):
        with pytest.raises(ChannelNotFound, match="no socket file"):
            call()


def test_a_first_connection_to_a_silent_broker_waits_as_long_as_the_call_allows(make_remote):
    """A broker that is there but does not answer (stopped with SIGSTOP): a new handle's first
    call waits for its hello as long as the call's timeout, at least 2 s, not 10 s."""
    ch = make_remote("silent")
    other = Channel.connect(ch.name, identity="c:9")  # a connection of its own
    blob = pickle.dumps(other)
    other.close()  # (its connection ends: the unpickled copy makes a new one)
    handle = pickle.loads(blob)
    os.kill(ch._proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ChannelNotFound, match=r"within 2\.0s"):
            handle.get(key="k", timeout=0.5)
        with pytest.raises(ChannelNotFound, match=r"within 2\.0s"):
            handle.get(key="k", async_op=True)
    finally:
        os.kill(ch._proc.pid, signal.SIGCONT)
    handle.put("back", key="k", timeout=30)
    assert handle.get(key="k", timeout=30) == "back"
    handle.close()


def test_pickling_a_work_is_a_type_error_saying_why(make_remote):
    ch = make_remote("pickwork")
    work = ch.get(key="k", async_op=True)
    for what in (work, work.then(str)):
        with pytest.raises(TypeError, match="a Work cannot be pickled"):
            pickle.dumps(what)
    assert work.cancel() is True
