"""The short cuts of the per-item paths refuse and serve exactly what the general paths do:
timeouts checked without the numbers ABCs, getters served from the head of their queue (and
one withdrawn from the middle), several records of one message from one client; a ``Work``
completed without a gate unless a thread sleeps on it; small bytes decoded alike from bytes
and from a view."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np
import pytest
from zchannel.broker.connection.work import _DONE, Work, _wait_timeout
from zchannel.broker.wire import codec
from zchannel.broker.wire.argchecks import MAX_TIMEOUT, check_timeout


@pytest.mark.parametrize("value", [0, 0.0, 1, 2.5, MAX_TIMEOUT, np.float64(0.5), np.int64(3)])
def test_check_timeout_accepts_numbers_in_range_as_floats(value):
    got = check_timeout(value)
    assert type(got) is float and got == float(value)


@pytest.mark.parametrize("value", [True, False, -1, -0.5, math.nan, math.inf, -math.inf,
                                   MAX_TIMEOUT * 2, "1", [1]])
def test_check_timeout_refuses_what_is_no_timeout(value):
    with pytest.raises(ValueError, match="timeout must be None or a finite number"):
        check_timeout(value)


def test_wait_timeout_fast_path_matches_the_general_rule():
    assert _wait_timeout(None) is None
    assert _wait_timeout(3) == 3.0 and type(_wait_timeout(3)) is float
    assert _wait_timeout(0.25) == 0.25
    assert _wait_timeout(-1) == 0.0  # negative: do not wait
    assert _wait_timeout(-0.5) == 0.0
    assert _wait_timeout(math.inf) is None  # beyond what a lock can wait: no limit
    assert _wait_timeout(np.float64(0.5)) == 0.5
    for bad in (True, math.nan, "1"):
        with pytest.raises(ValueError):
            _wait_timeout(bad)


def test_waiting_getters_served_in_arrival_order_after_one_withdrawn(make):
    """Gets parked on an empty key get the items in the order they asked, also when one in the
    middle was cancelled (it leaves from the middle of the waiting line, the others from its
    head)."""
    ch = make("order")
    first = ch.get(key="k", async_op=True, timeout=60)
    middle = ch.get(key="k", async_op=True, timeout=60)
    last = ch.get(key="k", async_op=True, timeout=60)
    assert middle.cancel() is True
    ch.put("a", key="k")
    ch.put("b", key="k")
    assert first.wait(timeout=30) == "a"
    assert last.wait(timeout=30) == "b"
    ch.put("c", key="k")
    assert ch.get(key="k", timeout=30) == "c"  # the cancelled get took nothing
    assert ch.qsize("k") == 0


def test_stream_of_small_items_keeps_per_key_fifo_and_counts(make):
    """Many small puts and gets in flight at once (coalesced into messages of many records):
    every item arrives once, in order per key, and the queue ends empty."""
    ch = make("stream")
    n = 2000
    puts = [ch.put(i.to_bytes(4, "big") * 16, weight=1, key=("k", i % 3), async_op=True)
            for i in range(n)]
    gets = {k: [ch.get(key=("k", k), async_op=True, timeout=60) for _ in range(len(range(k, n, 3)))]
            for k in range(3)}
    for work in puts:
        assert work.wait(timeout=60) is None
    for k, works in gets.items():
        got = [int.from_bytes(w.wait(timeout=60)[:4], "big") for w in works]
        assert got == list(range(k, n, 3))
        assert ch.qsize(("k", k)) == 0


# -- Work: one lock, its gate made only for a thread that sleeps ------------------------------


def test_work_completed_before_any_wait_never_makes_a_gate():
    work = Work()
    work.set_result(5)
    assert work.wait(0) == 5 and work._gate is None


def _waits_in_threads(work: Work, n: int, complete: Callable[[], None]) -> list:
    """What ``work.wait(30)`` returned in each of ``n`` threads, all started (met at a barrier)
    before ``complete()`` completes ``work``."""
    got: list = []
    started = threading.Barrier(n + 1)

    def waiter() -> None:
        started.wait(30)
        got.append(work.wait(30))

    threads = [threading.Thread(target=waiter) for _ in range(n)]
    for thread in threads:
        thread.start()
    started.wait(30)
    complete()
    for thread in threads:
        thread.join(30)
    return got


def test_work_wakes_every_sleeper_and_a_timed_out_wait_leaves_it_pending():
    work = Work()
    with pytest.raises(TimeoutError):
        work.wait(0.01)
    assert not work.done()
    assert _waits_in_threads(work, 4, lambda: work.set_result("done")) == ["done"] * 4


def test_work_failure_reaches_a_sleeper_and_a_lazy_result_converts_once():
    failing = Work()
    errors: list = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(KeyError, failing.wait, 30)))
    thread.start()
    failing.set_exception(KeyError("gone"))
    thread.join(30)
    assert len(errors) == 1
    calls: list = []
    lazy = Work()
    lazy._finish(_DONE, (3, 4), lambda a, b: calls.append(1) or a + b)
    assert lazy.wait() == 7 and lazy.result() == 7 and calls == [1]


def test_a_failed_lazy_conversion_raises_the_same_error_on_every_read():
    calls: list = []

    def convert(body: bytes) -> bytes:
        calls.append(1)
        raise ValueError(f"cannot decode {body!r}")

    work = Work()
    work._finish(_DONE, (b"bad",), convert)
    for read in (work.wait, work.result, lambda: work.wait(0)):
        with pytest.raises(ValueError, match="cannot decode"):
            read()
    assert calls == [1] and isinstance(work.exception(), ValueError) and work.done()


def test_readers_racing_on_a_lazy_result_all_get_the_converted_value():
    for _ in range(50):
        work = Work()
        got = _waits_in_threads(
            work, 3, lambda w=work: w._finish(_DONE, (20, 22), lambda a, b: a + b))
        assert got == [42, 42, 42]


def test_work_wait_refuses_a_bad_timeout_even_when_done():
    work = Work()
    work.set_result(5)
    assert work.wait(0) == 5 and work.wait(2.5) == 5 and work.wait(-1) == 5
    for bad in (float("nan"), "1", True):
        with pytest.raises(ValueError):
            work.wait(bad)


@pytest.mark.parametrize("item", [b"", b"x" * 64, b"y" * 255, b"z" * 300])
def test_decode_of_a_small_bytes_body_is_the_same_from_bytes_and_from_a_view(item):
    body, buffers = codec.encode(item)
    assert not buffers
    for form in (bytes(body), memoryview(bytes(body))):
        got = codec.decode_frames([form], None)
        assert got == item and type(got) is bytes


def test_decode_of_a_truncated_bin8_view_is_a_clear_error():
    with pytest.raises(ValueError):
        codec.decode(memoryview(b"\xc4\x05ab"))
