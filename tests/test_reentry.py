"""What runs inside a handle's own reading of replies, and what interrupts it: done-callbacks
that raise or call back into the channel, awaits whose event loop closed, ``KeyboardInterrupt``
during a blocking get, and a forked child holding a request of its parent.  Each either works
or fails with an error naming the cause; none hangs, loses an item or stops the connection."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest
from conftest import wait_until
from zchannel.broker import Channel, ChannelError

pytestmark = pytest.mark.timeout(120)


def _getters(ch: Channel, key: str) -> int:
    return ch.stats()["keys"].get(key, {}).get("getters", 0)


def test_a_callback_that_raises_stops_nothing_else(make_remote):
    ch = make_remote("cbraise")
    failing = ch.get(key="k", async_op=True, timeout=60)
    failing.add_done_callback(lambda _: 1 / 0)
    bystander = ch.get(key="k", async_op=True, timeout=60)
    puts = [ch.put(i, key="k", async_op=True) for i in range(2)]
    assert ch.qsize("other") == 0  # this thread reads the replies, the callback's among them
    assert sorted([failing.wait(30), bystander.wait(30)]) == [0, 1]
    assert [p.wait(30) for p in puts] == [None, None]
    ch.put("still", key="k")
    assert ch.get(key="k", timeout=30) == "still"


def test_an_await_whose_loop_closed_completes_without_harm(make_remote):
    """The await was cancelled (``wait_for`` timed out) and its loop closed: the operation goes
    on, as documented, and its completion disturbs no other request."""
    ch = make_remote("closedloop")
    orphan = ch.get(key="k", async_op=True, timeout=60)

    async def give_up() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(orphan, 0.05)

    asyncio.run(give_up())
    behind = ch.get(key="k", async_op=True, timeout=60)
    puts = [ch.put(i, key="k", async_op=True) for i in range(2)]
    assert ch.qsize("other") == 0
    assert sorted([orphan.wait(30), behind.wait(30)]) == [0, 1]
    assert [p.wait(30) for p in puts] == [None, None] and ch.qsize("k") == 0


@pytest.mark.parametrize("call", ["qsize", "get_nowait", "get"])
def test_a_blocking_call_in_a_callback_is_refused_not_a_hang(make_remote, call):
    ch = make_remote(f"cbcall{call}")
    other = Channel.connect(ch.name)
    seen: dict = {}
    done = threading.Event()

    def callback(_work) -> None:
        try:
            seen["value"] = {"qsize": lambda: other.qsize("k2"),
                             "get_nowait": lambda: other.get_nowait(key="k2"),
                             "get": lambda: other.get(key="k2", timeout=5)}[call]()
        except BaseException as exc:  # noqa: BLE001 - reported below
            seen["error"] = exc
        finally:
            done.set()

    try:
        other.put(1, key="k2")
        pending = other.get(key="k", async_op=True, timeout=60)
        pending.add_done_callback(callback)
        ch.put(42, key="k")
        assert pending.wait(30) == 42 and done.wait(30)
        if "error" in seen:  # it ran where this connection's replies are read
            assert isinstance(seen["error"], RuntimeError) and "would wait for itself" in str(
                seen["error"])
        other.put(7, key="k3")
        assert other.get(key="k3", timeout=30) == 7  # the connection goes on
    finally:
        other.close()


def test_keyboard_interrupt_in_a_blocking_get_withdraws_it(make_remote):
    """Ctrl-C while ``get`` waits: the get is withdrawn at the broker, so the next item goes to
    the next get instead of to a request nobody waits for."""
    ch = make_remote("sigintget")
    producer = Channel.connect(ch.name)
    interrupter = threading.Thread(target=lambda: (
        wait_until(lambda: _getters(producer, "k") == 1, timeout=60),
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)))
    try:
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            ch.get(key="k", timeout=60)
        interrupter.join(60)
        wait_until(lambda: _getters(producer, "k") == 0, timeout=30)
        producer.put("A", key="k")
        producer.put("B", key="k")
        assert [ch.get(key="k", timeout=30) for _ in range(2)] == ["A", "B"]
    finally:
        interrupter.join(60)
        producer.close()


def test_keyboard_interrupt_in_a_blocking_put_withdraws_it(make_remote):
    """Ctrl-C while ``put`` waits for room: the put is withdrawn at the broker and stores
    nothing (a retry would have stored the item twice)."""
    ch = make_remote("sigintput", maxsize=1)
    consumer = Channel.connect(ch.name)
    ch.put("A", key="k")
    interrupter = threading.Thread(target=lambda: (
        wait_until(lambda: consumer.stats()["keys"]["k"]["putters"] == 1, timeout=60),
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)))
    try:
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            ch.put("B", key="k", timeout=60)
        interrupter.join(60)
        wait_until(lambda: consumer.stats()["keys"]["k"]["putters"] == 0, timeout=30)
        assert consumer.get(key="k", timeout=30) == "A"
        assert consumer.qsize("k") == 0  # B was not stored when A left
    finally:
        interrupter.join(60)
        consumer.close()


@pytest.mark.parametrize("how", ["cancel", "wait", "then"])
def test_waiting_for_a_pending_work_in_a_callback_is_refused_not_a_hang(make_remote, how):
    """``Work.cancel()`` (which waits for the broker's answer) or ``wait()`` of another pending
    Work in a done-callback or ``then()``: a ``RuntimeError`` where the callback runs on the
    thread that reads the replies, never a connection that stops reading (and heartbeats)."""
    ch = make_remote(f"cbwait{how}")
    other = ch.get(key="b", async_op=True, timeout=60)
    first = ch.get(key="a", async_op=True, timeout=60)
    seen: dict = {}
    done = threading.Event()

    def inner(_work) -> None:
        try:
            seen["value"] = other.cancel() if how == "cancel" else other.wait(5)
        except BaseException as exc:  # noqa: BLE001 - reported below
            seen["error"] = exc
        finally:
            done.set()

    if how == "then":
        chained = first.then(lambda _: other.wait(5))
    else:
        first.add_done_callback(inner)
    feeder = Channel.connect(ch.name)
    try:
        feeder.put("x", key="a")
        assert first.wait(30) == "x"
        if how == "then":
            with pytest.raises((RuntimeError, TimeoutError)) as info:
                chained.wait(30)
            error = info.value
        else:
            assert done.wait(30)
            error = seen.get("error")
        if error is not None:  # it ran where the replies are read (else it waited elsewhere)
            assert isinstance(error, RuntimeError) and "would wait for itself" in str(error)
        assert feeder.qsize("b") == 0  # the connection goes on
        feeder.put("y", key="b")
        if how != "cancel" or error is not None:  # refused: the get still waits for "y"
            assert other.wait(30) == "y"
    finally:
        feeder.close()


def test_a_callback_that_exits_stops_nothing_else(make_remote):
    """A done-callback that raises ``SystemExit`` (or ``KeyboardInterrupt``) is logged like any
    other: the thread that completed its Work goes on reading the rest of the message."""
    ch = make_remote("cbexit")
    exiting = ch.get(key="a", async_op=True, timeout=60)
    exiting.add_done_callback(lambda _: (_ for _ in ()).throw(SystemExit(1)))
    bystander = ch.get(key="b", async_op=True, timeout=60)
    feeder = Channel.connect(ch.name)
    try:
        feeder.put("x", key="a")
        feeder.put("y", key="b")
        assert exiting.wait(30) == "x" and bystander.wait(30) == "y"
        ch.put("still", key="c")
        assert ch.get(key="c", timeout=30) == "still"
    finally:
        feeder.close()


def test_a_forked_child_waiting_on_its_parents_request_gets_an_error(make_remote):
    ch = make_remote("forkwork")
    parked = ch.get(key="k", async_op=True, timeout=60)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its copy of the parent's request fails at once
        try:
            parked.wait(30)
            os.write(write, b"returned")
        except ChannelError as exc:
            os.write(write, b"ok" if "before the process forked" in str(exc) else b"other")
        except BaseException:  # noqa: BLE001 - told to the parent
            os.write(write, b"raised")
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 64) == b"ok"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    ch.put("x", key="k")
    assert parked.wait(30) == "x"  # the parent's own goes on
