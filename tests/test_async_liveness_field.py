"""Asynchronous calls made in a coroutine while the broker is paused (SIGSTOP: a hung broker,
whose socket still accepts connections but which answers nothing), with real broker
processes, over the direct link and over ZeroMQ; and timeouts no float holds.

- Once the connection is down, issuing an ``async_op=True`` call never stalls the event loop:
  the call returns its ``Work`` at once, and the wait for the broker to answer again happens
  in it, failing with ``BrokerUnavailable`` when the call's timeout (at most 2 s) runs out.
- Such calls go out, in call order, once the broker answers again; ``cancel()`` withdraws one
  and ``close()`` fails one with ``ChannelError``; a put that fails so gives its shared-memory
  slots back.
- A timeout that is an int (or a ``Fraction``) beyond every float is a ``ValueError`` naming
  the timeout, as NaN and infinities are, on broker and local channels alike.
"""

from __future__ import annotations

import asyncio
import fractions
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import exited
from zchannel.broker import BrokerUnavailable, Channel, ChannelError, shm
from zchannel.broker.connection.line import DOWN, UP
from zchannel.broker.connection.work import CancelledError, Work

# generous deadlines for what a loaded machine may take (never slept out)
DEADLINE_S = 60.0
# the longest stall of the event loop a paused broker may cause: far below the 2 s a call made
# while the connection is down waits for the broker (what stalled it, call after call)
MAX_STALL_S = 1.0


class PausableBroker:
    """A ``zchannel broker`` process at an ipc address in the test's run dir: ``pause()``
    (SIGSTOP) and ``resume()`` (SIGCONT) it; ``close()`` resumes and ends it by its PID."""

    def __init__(self, run_dir: str) -> None:
        self.address = f"ipc://{run_dir}/paused.sock"
        self.proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker",
                                      "paused", "--address", self.address],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().startswith("ready ")
        self.paused = False

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False

    def close(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            if not exited(self.proc.pid, DEADLINE_S):
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=DEADLINE_S)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(params=["direct", "zeromq"])
def broker(request, run_dir, monkeypatch) -> Iterator[PausableBroker]:
    """A pausable broker; its clients use the direct link, or ZeroMQ (``ZCHANNEL_DIRECT=0``)."""
    if request.param == "zeromq":
        monkeypatch.setenv("ZCHANNEL_DIRECT", "0")
    proc = PausableBroker(run_dir)
    try:
        yield proc
    finally:
        proc.close()


def _connected(broker: PausableBroker) -> Channel:
    """A handle on ``broker`` whose connection is up (a connection of its own)."""
    handle = Channel.connect(broker.address, identity="c:7")
    assert handle.qsize("k") == 0
    assert handle._conn.state == UP
    return handle


async def _down(handle: Channel) -> None:
    """Wait (on the loop) until the paused broker's silence brought the connection down."""
    deadline = time.monotonic() + DEADLINE_S
    while handle._conn.state != DOWN:
        assert time.monotonic() < deadline, "the connection did not go down"
        await asyncio.sleep(0.02)


async def _outcome(work: Work) -> object:
    """What ``work`` completes with: its result, or its error."""
    try:
        return await asyncio.wait_for(work.async_wait(), DEADLINE_S)
    except (ChannelError, TimeoutError, CancelledError) as exc:
        return exc


class LoopStalls:
    """A ticker coroutine on the running loop: the longest gap between its wake-ups beyond
    its own sleep (``longest``, from the last ``reset``)."""

    TICK_S = 0.01

    def __init__(self) -> None:
        self.longest = 0.0
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.TICK_S)
            now = time.monotonic()
            self.longest = max(self.longest, now - last - self.TICK_S)
            last = now

    def reset(self) -> None:
        self.longest = 0.0

    def stop(self) -> None:
        self._task.cancel()


def test_async_calls_while_the_broker_is_paused_never_stall_the_event_loop(broker):
    """The reviewer's case: while the broker is paused and the connection down, each
    ``async_op=True`` call made in a coroutine returned only after blocking the loop for 2 s
    and raised ``BrokerUnavailable`` itself.  Now each returns its ``Work`` at once, the loop
    keeps turning, and the ``Work`` fails with ``BrokerUnavailable``."""
    handle = _connected(broker)

    async def calls_while_paused() -> tuple[float, list[object]]:
        stalls = LoopStalls()
        try:
            broker.pause()
            await _down(handle)
            stalls.reset()
            issued: list[object] = []
            for timeout in (0.5, 0.5, None, 0.0, 0.5):
                try:
                    issued.append(handle.get(key="k", async_op=True, timeout=timeout))
                except ChannelError as exc:  # raised by the call itself
                    issued.append(f"raised at the call: {exc!r}")
                await asyncio.sleep(5 * LoopStalls.TICK_S)  # the other coroutines' turn
            outcomes = [await _outcome(w) if isinstance(w, Work) else w for w in issued]
            return stalls.longest, outcomes
        finally:
            stalls.stop()

    try:
        longest, outcomes = asyncio.run(calls_while_paused())
    finally:
        broker.resume()
        handle.close()
    assert longest < MAX_STALL_S, f"the event loop stalled {longest:.2f}s"
    assert all(isinstance(o, (BrokerUnavailable, TimeoutError)) for o in outcomes), outcomes


def test_async_calls_made_while_the_broker_is_paused_go_out_in_order_once_it_answers(broker):
    """A put and then a get made in a coroutine while the connection is down wait in their
    ``Work``s; the broker resumed, they go out in that order: the get takes the put's item."""
    handle = _connected(broker)

    async def put_then_get() -> tuple[object, object]:
        broker.pause()
        await _down(handle)
        put = handle.put("made while paused", key="k", async_op=True, timeout=30)
        get = handle.get(key="k", async_op=True, timeout=30)
        assert not put.done() and not get.done()
        broker.resume()
        return await _outcome(put), await _outcome(get)

    try:
        put_result, got = asyncio.run(put_then_get())
        assert put_result is None
        assert got == "made while paused"
        assert handle.qsize("k") == 0
    finally:
        broker.resume()
        handle.close()


def test_an_async_call_waiting_for_a_paused_broker_is_withdrawn_or_failed_by_close(broker):
    """While it waits in its ``Work`` for the broker, ``cancel()`` withdraws the call (True,
    ``CancelledError``) and the handle's ``close()`` fails it with ``ChannelError``."""
    handle = _connected(broker)

    async def cancel_and_close() -> tuple[bool, object, object]:
        broker.pause()
        await _down(handle)
        cancelled = handle.get(key="k", async_op=True)
        withdrawn = cancelled.cancel()
        closed = handle.get(key="k", async_op=True)
        handle.close()
        return withdrawn, await _outcome(cancelled), await _outcome(closed)

    try:
        withdrawn, cancel_outcome, close_outcome = asyncio.run(cancel_and_close())
    finally:
        broker.resume()
        handle.close()
    assert withdrawn is True
    assert isinstance(cancel_outcome, CancelledError), cancel_outcome
    assert type(close_outcome) is ChannelError and "closed" in str(close_outcome)


def _slots_used(pool) -> int:
    return sum(int((seg.states == shm.USED).sum()) for seg in pool.by_name.values())


def test_a_shared_memory_put_failing_while_it_waits_for_a_paused_broker_gives_its_slots_back(
        broker):
    """A put of an array in shared memory, made in a coroutine while the connection is down,
    holds its slot while it waits in its ``Work``; when it fails unsent, the slot is free."""
    handle = _connected(broker)
    pool = handle._connection().shm.pool
    assert pool is not None

    async def put_while_paused() -> tuple[int, object]:
        broker.pause()
        await _down(handle)
        work = handle.put(np.ones(1 << 20, np.uint8), key="k", async_op=True, timeout=0.5)
        held = _slots_used(pool)
        return held, await _outcome(work)

    try:
        held, outcome = asyncio.run(put_while_paused())
    finally:
        broker.resume()
    try:
        assert held == 1
        assert isinstance(outcome, BrokerUnavailable), outcome
        assert _slots_used(pool) == 0
    finally:
        handle.close()


@pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])
def test_a_timeout_no_float_holds_is_a_value_error_naming_it(local, make_remote):
    """``timeout=10**400`` raised ``OverflowError: int too large to convert to float``; now it
    is the ``ValueError`` every other out-of-range timeout gets, naming the timeout and the
    value's size (an int past 4300 digits cannot even be written out)."""
    ch = make_remote(f"huge-{int(local)}", local=local)
    huge = [10**400, -(10**400), 10**5000, fractions.Fraction(10**400, 3)]
    calls = {
        "get": lambda t: ch.get(key="k", timeout=t),
        "get async": lambda t: ch.get(key="k", async_op=True, timeout=t),
        "put": lambda t: ch.put(1, key="k", timeout=t),
        "get_batch": lambda t: ch.get_batch(1, key="k", timeout=t),
    }
    for call in calls.values():
        for timeout in huge:
            with pytest.raises(ValueError, match=r"^timeout must be None or a finite number of "
                                                 r"seconds >= 0 and <= 1\.79769e\+308 "):
                call(timeout)
    assert ch.qsize("k") == 0  # nothing was sent or stored
    ch.put("fine", key="k", timeout=1e300)
    assert ch.get(key="k", timeout=30) == "fine"


def test_a_weight_or_count_too_large_to_write_out_is_named_in_its_value_error(make_remote):
    """An int past the 4300 digits Python writes out made the weight's and ``peek``'s error
    messages fail themselves (a ``ValueError`` naming no argument); now they name it."""
    ch = make_remote("huge-weights", local=True)
    with pytest.raises(ValueError, match=r"^weight must be .*, got an int of about 5001 digits"):
        ch.put(1, weight=10**5000)
    with pytest.raises(ValueError, match=r"^target_weight must be .*, got an int of about 5001"):
        ch.get_batch(10**5000)
    with pytest.raises(ValueError, match=r"^n must be an int in \[1, 1024\], got an int of "):
        ch.peek(key="k", n=10**5000)


@pytest.mark.parametrize("setting", [{"lease_timeout": 10**400}, {"maxsize": 10**5000}])
def test_a_channel_setting_too_large_for_a_float_is_a_value_error_naming_it(setting):
    (name, value), = setting.items()
    with pytest.raises(ValueError, match=rf"{name} must be .* got an int of about \d+ digits"):
        Channel.create("huge-setting", local=True, **setting)


def test_a_connect_timeout_too_large_to_write_out_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"connect needs a timeout: .* got an int of about 5001"):
        Channel.connect("nobody-at-all", timeout=10**5000)
