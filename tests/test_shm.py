"""Same-host shared-memory path (docs/shm.md): real brokers, real sockets, real /dev/shm."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from conftest import wait_until
from zchannel.broker import BrokerUnavailable, Channel, shm
from zchannel.broker.shm.pool import SLOT_WAIT_CUT
from zchannel.broker.shm.segment import Segment
from zchannel.broker.wire import arrays

pytestmark = pytest.mark.timeout(60)

T = 64 * 1024  # test threshold: small slots keep the suite light
MIB = 1 << 20


def _segments(ch_or_prefix) -> list[str]:
    prefix = ch_or_prefix if isinstance(ch_or_prefix, str) else ch_or_prefix.stats()["shm"]["prefix"]
    return shm.list_segments(prefix)


def _probes(prefix: str, names: list[str]) -> list[bool]:
    """Which of the segment ``names`` are a broker's probe (``PREFIXprobe-RANDOM``)."""
    return [n.startswith(f"{prefix}probe-") for n in names]


def _shm_stats(ch) -> dict:
    return ch.stats()["shm"]


def _raw(nbytes: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8).copy()


def _np_values() -> list[np.ndarray]:
    out = []
    for i, (_name, dtype) in enumerate(sorted(arrays.NP_DTYPES.items())):
        raw = _raw(2 * T, i)
        if dtype.kind == "b":
            raw %= 2
        out.append(raw.view(dtype).reshape(4, -1))
    out.append(np.arange(3 * T, dtype=np.float32).reshape(3 * 64, -1).T)  # non-contiguous
    out.append(np.arange(4 * T, dtype=np.int16)[::2])  # strided
    return out


def _torch_values() -> list[torch.Tensor]:
    arrays.torch_module()
    out = []
    for i, (_name, dtype) in enumerate(sorted(arrays.TORCH_DTYPES.items())):
        raw = torch.from_numpy(_raw(2 * T, 100 + i))
        if dtype == torch.bool:
            raw %= 2
        out.append(raw.view(dtype).reshape(2, -1))
    out.append(torch.arange(T, dtype=torch.float32).reshape(256, -1).t())  # non-contiguous
    out.append(torch.ones(T, dtype=torch.bfloat16)[::1].reshape(-1, 8)[:, 2:6])  # strided slice
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == b.tobytes())


@pytest.mark.parametrize("copy", [None, False, True])
def test_every_dtype_round_trips_through_shm(make_remote, copy):
    ch = make_remote("rt", shm_threshold=T)
    values = _np_values() + _torch_values()
    for i, v in enumerate(values):
        ch.put({"i": i, "v": v, "small": np.ones(3)}, key=i)
    assert _shm_stats(ch)["slots_in"] == len(values)  # every one of them took a slot
    got = [ch.get(key=i, timeout=10, copy=copy) for i in range(len(values))]
    for i, (v, g) in enumerate(zip(values, got, strict=True)):
        assert g["i"] == i and _same(v, g["v"]), (i, v.dtype)
    held = _shm_stats(ch)["consumer_holds"]
    assert held == (len(values) if copy is False else 0)
    del got, g
    gc.collect()
    st = _shm_stats(ch)  # releases travel before this request on the same handle
    assert st["consumer_holds"] == 0 and st["slots_used"] == 0 and st["bytes_held"] == 0


def test_tcp_to_a_local_address_uses_shm_and_batches(make_remote):
    ch = make_remote("tcp", address="tcp://127.0.0.1:0", shm_threshold=T)
    ts = [torch.full((T,), float(i)) for i in range(5)]
    for t in ts:
        ch.put(t, weight=1)
    assert _shm_stats(ch)["slots_in"] == 5
    batch = ch.get_batch(5, timeout=10)
    assert all(torch.equal(a, b) for a, b in zip(ts, batch, strict=True))
    assert _shm_stats(ch)["slots_used"] == 0


def test_mixed_shm_and_frame_consumers(make_remote, workers):
    ch = make_remote("mixed", shm_threshold=T)
    frames_only = Channel.connect("mixed", shm=False)
    try:
        ts = [torch.randn(T // 4 * 3) for _ in range(6)]
        for t in ts:
            ch.put(t)
        got = []
        for i in range(6):
            handle = frames_only if i % 2 else ch
            got.append(handle.get(timeout=10, copy=False if i == 3 else None))
        assert all(torch.equal(a, b) for a, b in zip(ts, got, strict=True))
        st = _shm_stats(ch)
        assert st["slots_in"] == 6 and st["converted"] == 3 and st["clients"] == 1
        # a consumer process with shm switched off by environment
        ch.put(ts[0])
        proc = workers.start("""
            import torch
            from zchannel.broker import Channel
            ch = Channel.connect("mixed")
            t = ch.get(timeout=10)
            print(float(t.sum()), ch._connection().shm.pool is None, flush=True)
            ch.close()
        """, env={"ZCHANNEL_SHM": "0"})
        total, no_pool = workers.finish(proc).split()
        assert float(total) == pytest.approx(float(ts[0].sum()), rel=1e-5) and no_pool == "True"
        del got
        gc.collect()
        assert _shm_stats(ch)["slots_used"] == 0
    finally:
        frames_only.close()


def test_pool_exhaustion_falls_back_to_frames(make_remote):
    ch = make_remote("exhaust", shm_threshold=T)
    n = shm.MAX_SLOTS + 6
    ts = [torch.full((T // 4,), float(i)) for i in range(n)]
    for t in ts:
        ch.put(t)  # nothing consumed: the pool of the 64 KiB class runs out
    st = _shm_stats(ch)
    assert st["slots_in"] == shm.MAX_SLOTS and st["slots_used"] == shm.MAX_SLOTS
    assert ch._connection().shm.pool.fallbacks == 6
    for t in ts:
        assert torch.equal(ch.get(timeout=10), t)
    assert _shm_stats(ch)["slots_used"] == 0
    ch.put(ts[0])  # slots come back to the pool
    assert _shm_stats(ch)["slots_in"] == shm.MAX_SLOTS + 1
    assert torch.equal(ch.get(timeout=10), ts[0])


def test_a_put_at_the_pool_limit_takes_the_slot_a_get_frees(make_remote, monkeypatch):
    """A put that finds every slot of its class in use (the class at its limit) waits, looking
    at the slots' state bytes, and takes the slot a get frees meanwhile: no frame fallback."""
    ch = make_remote("waitfree", shm_threshold=T)
    pool = ch._connection().shm.pool
    pool.slot_wait = 120.0  # a loaded machine: the wait must end with the slot, not time out
    n = shm.MAX_SLOTS
    ts = [torch.full((T // 4,), float(i)) for i in range(n + 1)]
    for t in ts[:n]:
        ch.put(t)
    assert _shm_stats(ch)["slots_used"] == n
    looking = threading.Event()
    has_free = Segment.has_free

    def seen_looking(seg: Segment) -> bool:
        looking.set()
        return has_free(seg)

    monkeypatch.setattr(Segment, "has_free", seen_looking)
    errors: list[BaseException] = []

    def put_last() -> None:
        try:
            ch.put(ts[n], timeout=120)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    putter = threading.Thread(target=put_last)
    putter.start()
    assert looking.wait(60), "the put did not wait for a free slot"
    assert torch.equal(ch.get(timeout=30), ts[0])  # copied out: its slot goes back
    putter.join(120)
    assert not putter.is_alive() and not errors
    assert pool.fallbacks == 0 and _shm_stats(ch)["slots_in"] == n + 1
    for t in ts[1:]:
        assert torch.equal(ch.get(timeout=30), t)
    assert _shm_stats(ch)["slots_used"] == 0


def test_waits_that_get_no_slot_get_shorter_and_ones_that_do_longer(make_remote):
    """Slots held by items nobody takes yet (a collector keeping a step's chunks until the step
    is complete): each wait that ends without a slot makes the class's next wait
    ``SLOT_WAIT_CUT`` times shorter, so a producer does not wait the full ``slot_wait`` per
    item; a wait that gets a slot doubles it again (backpressure on a fast producer)."""
    ch = make_remote("waitcut", shm_threshold=T)
    pool = ch._connection().shm.pool
    pool.slot_wait = 0.4
    n = shm.MAX_SLOTS
    ts = [torch.full((T // 4,), float(i)) for i in range(n + 3)]
    for t in ts[:n]:
        ch.put(t)
    ch.put(ts[n])  # no slot within slot_wait: a frame
    (size,) = pool.wait_s
    assert pool.wait_s[size] == pytest.approx(0.4 / SLOT_WAIT_CUT) and pool.fallbacks == 1
    assert torch.equal(ch.get(timeout=30), ts[0])  # one slot comes back
    wait_until(lambda: _shm_stats(ch)["slots_used"] == n - 1)
    ch.put(ts[n + 1])  # takes it, no wait
    ch.put(ts[n + 2])  # waits the shorter time, then a frame
    assert pool.wait_s[size] == pytest.approx(0.4 / SLOT_WAIT_CUT**2) and pool.fallbacks == 2
    assert torch.equal(ch.get(timeout=30), ts[1])
    wait_until(lambda: _shm_stats(ch)["slots_used"] == n - 1)
    ch.put(ts[0])  # the class is full again, and nothing waits for the stall to clear:
    pool.slot_wait, pool.wait_s[size] = 120.0, 30.0  # a loaded machine must not time out
    putter = threading.Thread(target=ch.put, args=(ts[1],))
    putter.start()
    wait_until(lambda: size not in pool.stalled)
    assert torch.equal(ch.get(timeout=30), ts[2])  # frees a slot while the put waits
    putter.join(120)
    assert not putter.is_alive() and pool.fallbacks == 2
    assert pool.wait_s[size] == 60.0  # a wait that got its slot: twice as long next time
    got = [ch.get(timeout=30) for _ in range(n + 2)]
    assert sorted(float(t[0]) for t in got) == sorted(float(t[0]) for t in ts[3 : n + 3] + ts[:2])


def test_pool_grows_ahead_of_need_and_never_falls_back(make_remote):
    ch = make_remote("grow", shm_threshold=T)
    pool = ch._connection().shm.pool
    item = 4 * MIB  # a size class whose first segment holds 8 slots
    first = shm.FIRST_SEGMENT_BYTES // item
    ts = [torch.full((item // 4,), float(i)) for i in range(2 * first)]
    for t in ts[: first // 2]:
        ch.put(t)
    # half of the class in use: its next segment is made in the background, before any put
    # needs it (so a producer filling its pipeline does not stall on it)
    wait_until(lambda: len(pool.by_name) == 2, timeout=10)
    (small, big) = sorted(pool.by_name.values(), key=lambda s: s.nslots)
    assert (small.nslots, big.nslots) == (first, first)
    for t in ts[first // 2 :]:
        ch.put(t)
    st = _shm_stats(ch)
    assert pool.fallbacks == 0 and st["slots_in"] == st["slots_used"] == 2 * first
    for t in ts:
        assert torch.equal(ch.get(timeout=10), t)
    assert _shm_stats(ch)["slots_used"] == 0


def test_reserve_shm_preallocates_the_pool(make_remote):
    ch = make_remote("reserve", shm_threshold=T)
    pool = ch._connection().shm.pool
    assert ch.reserve_shm(4 * MIB, 12) == 12
    (seg,) = pool.by_name.values()  # made now, before any put, in one segment
    assert (seg.nslots, seg.slot_size) == (12, 4 * MIB)
    assert ch.reserve_shm(4 * MIB + 1, 3) == 3  # the 8 MiB class, exactly as asked
    assert ch.reserve_shm(3 * MIB, 5) == 12  # the same class as 4 MiB, which holds 12 already
    ts = [torch.full((MIB,), float(i)) for i in range(12)]
    for t in ts[:11]:
        ch.put(t)
    # a reserved class does not grow ahead at half use (its owner said what it keeps in
    # flight), only once its last free slot is taken
    assert [s.nslots for s in pool.classes[4 * MIB]] == [12] and 4 * MIB not in pool.growing
    ch.put(ts[11])
    wait_until(lambda: [s.nslots for s in pool.classes[4 * MIB]] == [12, 12], timeout=10)
    assert pool.fallbacks == 0 and _shm_stats(ch)["slots_in"] == 12
    for t in ts:
        assert torch.equal(ch.get(timeout=10), t)
    assert ch.reserve_shm(T // 2, 4) == 0  # below the threshold: frames
    for bad in ((0, 1), (MIB, 0), (True, 1), (MIB, 2.0)):
        with pytest.raises(ValueError):
            ch.reserve_shm(*bad)
    frames_only = Channel.connect(ch.address, shm=False)
    try:
        assert frames_only.reserve_shm(4 * MIB, 2) == 0
    finally:
        frames_only.close()
    local = Channel.create("reserve-local", local=True)
    try:
        assert local.reserve_shm(4 * MIB, 2) == 0
    finally:
        local.shutdown()


def _lent(pool) -> list[tuple]:
    """(segment, slot, sent) of the slots lent by ``pool`` whose arrays still exist."""
    return [tuple(entry) for entry in pool.lent.values()]


def _used(pool) -> int:
    return sum(int((s.states == shm.USED).sum()) for s in pool.by_name.values())


def test_empty_shm_is_a_slot_that_a_put_sends_without_a_copy(make_remote):
    """A producer writes its item in a slot lent by ``empty_shm``; the put sends that slot
    itself (no second slot, no copy), and the consumer reads what was written there."""
    ch = make_remote("inplace", shm_threshold=T)
    pool = ch._connection().shm.pool
    assert ch.reserve_shm(2 * T, 4) == 4
    a = ch.empty_shm((2, T // 4), np.float32)
    assert isinstance(a, np.ndarray) and a.shape == (2, T // 4) and a.dtype == np.float32
    ((seg, slot, sent),) = _lent(pool)
    assert not sent and a.ctypes.data == seg.view(slot, 1).ctypes.data  # the slot's memory
    a[:] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    ch.put({"obs": a, "step": 3})
    assert _lent(pool) == [(seg, slot, True)] and _used(pool) == 1  # no other slot taken
    assert _shm_stats(ch)["slots_in"] == 1
    got = ch.get(timeout=10)
    assert got["step"] == 3 and np.array_equal(got["obs"], a)
    # the broker freed the slot, but `a` still exists: no other put may take it
    wait_until(lambda: _shm_stats(ch)["slots_used"] == 0, timeout=10)
    b = np.full(T // 2, 7, np.float32)
    ch.put(b)
    assert _used(pool) == 1 and seg.states[slot] == shm.FREE
    assert np.array_equal(ch.get(timeout=10), b)
    wait_until(lambda: _shm_stats(ch)["slots_used"] == 0, timeout=10)
    # a second put of the same array copies it, into another slot, as for any array
    ch.put(a)
    assert _used(pool) == 1 and seg.states[slot] == shm.FREE
    assert np.array_equal(ch.get(timeout=10), a)
    del a, got
    gc.collect()
    assert _lent(pool) == [] and not pool.pins[seg.name].any()


def test_empty_shm_tensors_unsent_and_dropped_slots(make_remote):
    ch = make_remote("inplace2", shm_threshold=T)
    pool = ch._connection().shm.pool
    t = ch.empty_shm((4, T // 8), torch.bfloat16)
    assert isinstance(t, torch.Tensor) and t.shape == (4, T // 8) and t.dtype == torch.bfloat16
    t.copy_(torch.randn(4, T // 8).to(torch.bfloat16))
    # a put that fails to encode keeps the slot lent to `t`, unsent: the next put sends it
    with pytest.raises(TypeError):
        ch.put([t, object()])
    ((seg, slot, sent),) = _lent(pool)
    assert not sent and seg.states[slot] == shm.USED
    ch.put([t])
    assert _lent(pool) == [(seg, slot, True)] and _used(pool) == 1
    assert torch.equal(ch.get(timeout=10)[0], t)
    # dropped without a put: the slot goes back to the pool
    u = ch.empty_shm(T, np.uint8)
    ((useg, uslot, _),) = [e for e in _lent(pool) if e[:2] != (seg, slot)]
    assert useg.states[uslot] == shm.USED
    del u
    gc.collect()
    assert useg.states[uslot] == shm.FREE and len(_lent(pool)) == 1


def test_empty_shm_without_shared_memory_is_a_plain_array(make_remote):
    ch = make_remote("inplace-off", shm_threshold=0)
    a = ch.empty_shm(5)  # float32 by default
    assert isinstance(a, np.ndarray) and a.shape == (5,) and a.dtype == np.float32
    small = make_remote("inplace-small", shm_threshold=T)
    b = small.empty_shm((3, 4), torch.int64)  # below the threshold
    assert b.shape == (3, 4) and b.dtype == torch.int64 and small._connection().shm.pool.lent == {}
    b.fill_(9)
    small.put(b)
    assert torch.equal(small.get(timeout=10), b)
    local = Channel.create("inplace-local", local=True)
    try:
        assert local.empty_shm((2, 2), np.int16).dtype == np.int16
    finally:
        local.shutdown()
    for bad, exc in (((2,), TypeError), ((-1, 3), ValueError), ("ab", TypeError),
                     ((2.0,), TypeError)):
        with pytest.raises(exc):
            ch.empty_shm(bad, object if bad == (2,) else np.float32)


def _broker_process(name: str, address: str) -> subprocess.Popen:
    """``zchannel broker NAME`` at ``address`` with the tests' shared-memory threshold, once it
    said it is ready (the caller kills it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "zchannel.cli.main", "broker", name, "--address", address,
         "--shm-threshold", str(T)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("ready ")
    return proc


def _end_brokers(procs: list[subprocess.Popen], name: str, run_dir: str) -> None:
    """Kill the broker processes of ``procs`` still running (by PID) and remove the shared
    memory segments of channel ``name`` they left."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for segment in shm.list_segments(shm.prefix_for(name, run_dir)):
        os.unlink(os.path.join(shm.SHM_DIR, segment))


def test_reserve_shm_is_kept_across_a_broker_restart(run_dir):
    address = f"ipc://{run_dir}/reserve.sock"

    def start() -> subprocess.Popen:
        return _broker_process("reserve2", address)

    procs = [start()]
    ch = None
    try:
        ch = Channel.connect(address)
        assert ch.reserve_shm(4 * MIB, 6) == 6
        first_pool = ch._connection().shm.pool
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        procs.append(start())

        def reserved_again() -> bool:
            pool = ch._connection().shm.pool
            return (pool is not None and pool is not first_pool
                    and sum(s.nslots for s in pool.classes.get(4 * MIB, [])) == 6)

        wait_until(reserved_again, timeout=20)
        ch.put(torch.ones(MIB), timeout=10)
        assert torch.equal(ch.get(timeout=10), torch.ones(MIB))
        assert _shm_stats(ch)["slots_in"] == 1
    finally:
        if ch is not None:
            ch.close()
        _end_brokers(procs, "reserve2", run_dir)


def test_copy_false_view_keeps_its_slot_until_collected(make_remote):
    ch = make_remote("view", shm_threshold=T)
    pool_of = ch._connection().shm
    ch.put(torch.full((T // 4,), 7.0))
    view = ch.get(timeout=10, copy=False)
    part = view[10:20].view(torch.int32)  # a derived view shares the slot
    del view
    gc.collect()
    assert _shm_stats(ch)["consumer_holds"] == 1
    (seg,) = pool_of.pool.by_name.values()
    held = [i for i in range(seg.nslots) if seg.states[i] == shm.USED]
    assert len(held) == 1
    for i in range(3 * shm.MAX_SLOTS):  # cycle the pool several times: the held slot is skipped
        ch.put(torch.full((T // 4,), float(i)))
        assert float(ch.get(timeout=10)[0]) == float(i)
        assert seg.states[held[0]] == shm.USED
    assert torch.equal(part.view(torch.float32), torch.full((10,), 7.0))
    del part
    gc.collect()
    st = _shm_stats(ch)
    assert st["consumer_holds"] == 0 and st["slots_used"] == 0
    assert seg.states[held[0]] == shm.FREE  # the broker gave it back to the producer


def all_of(works: list):
    """Whether every ``Work`` of ``works`` is done (a poll that reads none of them)."""
    return lambda: all(w.done() for w in works)


def test_a_get_work_dropped_unread_gives_its_slots_back(make_remote):
    """An async get whose ``Work`` completes and is collected without being read gives its
    slots back; they are not held for the life of the connection."""
    ch = make_remote("dropped", shm_threshold=T)
    for i in range(3):
        ch.put(torch.full((T // 4,), float(i)))
    works = [ch.get(timeout=10, async_op=True) for _ in range(3)]
    all_done = all_of(works)
    assert wait_until(all_done, 10)
    assert _shm_stats(ch)["consumer_holds"] == 3
    works.clear()
    del all_done
    gc.collect()
    assert wait_until(lambda: _shm_stats(ch)["consumer_holds"] == 0, 10)
    assert _shm_stats(ch)["slots_used"] == 0


def test_a_view_from_an_earlier_broker_releases_nothing_of_the_next(run_dir):
    """Hold ids are not reused by the next broker of a channel: a ``copy=False`` view from the
    broker that died, dropped, does not free the slot of a live view from the new one."""
    address = f"ipc://{run_dir}/holds.sock"

    def start() -> subprocess.Popen:
        return _broker_process("holds", address)

    def answers(handle) -> bool:
        try:
            handle.qsize()
            return True
        except BrokerUnavailable:
            return False

    procs = [start()]
    handles = []
    try:
        producer = Channel.connect(address)
        consumer = Channel.connect(address, identity="c:0")
        handles += [producer, consumer]
        producer.put(np.full(T, 1, np.uint8))
        old = consumer.get(copy=False, timeout=10)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        procs.append(start())
        assert wait_until(lambda: answers(producer) and answers(consumer), 20)
        producer.put(np.full(T, 2, np.uint8))
        new = consumer.get(copy=False, timeout=10)
        del old
        gc.collect()
        consumer.qsize()  # the release of the old view goes out before this request
        for _ in range(4):  # a freed slot would be taken by these
            producer.put(np.full(T, 3, np.uint8))
        assert (new == 2).all()
        assert _shm_stats(consumer)["consumer_holds"] == 1
    finally:
        for handle in handles:
            handle.close()
        _end_brokers(procs, "holds", run_dir)


def test_a_consumer_stopped_past_its_expiry_keeps_its_views(make_remote, workers):
    """A consumer whose process was stopped (SIGSTOP) until the broker expired it keeps the
    slots of its ``copy=False`` views: they are not reused meanwhile, and once it registered
    again its view's release frees them."""
    ch = make_remote("stalled", shm_threshold=T)
    consumer = workers.start(
        """
        import gc, sys, time
        from zchannel.broker import BrokerUnavailable, Channel
        ch = Channel.connect(sys.argv[1], identity="c:0")
        view = ch.get(copy=False, timeout=30)
        print("got", int(view[0]), flush=True)
        sys.stdin.readline()  # stopped and resumed meanwhile

        def registered_again():
            deadline = time.monotonic() + 30
            while True:
                try:
                    return ch.qsize()
                except BrokerUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

        registered_again()
        print("kept", bool((view == 1).all()), flush=True)
        del view
        gc.collect()
        ch.qsize()  # the release goes out before this request
        print("released", flush=True)
        sys.stdin.readline()
        """,
        ch.address,
    )
    ch.put(np.full(T, 1, np.uint8))
    assert workers.wait_line(consumer) == "got 1"
    clients = ch.stats()["clients"]
    os.kill(consumer.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: ch.stats()["clients"] == clients - 1, 30), "never expired"
        assert _shm_stats(ch)["consumer_holds"] == 1
        for _ in range(4):  # a freed slot would be taken by these
            ch.put(np.full(T, 2, np.uint8))
    finally:
        os.kill(consumer.pid, signal.SIGCONT)
    consumer.stdin.write(b"\n")
    assert workers.wait_line(consumer) == "kept True"
    assert workers.wait_line(consumer) == "released"
    assert wait_until(lambda: _shm_stats(ch)["consumer_holds"] == 0, 10)


def test_a_leased_delivery_is_copied_out_so_a_redelivery_is_the_item_as_put(make_remote):
    """A get with ``ack`` copies shared-memory slots out even with ``copy=False``: the broker
    keeps the slot for a redelivery until the ack, so a writable view of it would turn what a
    second consumer (or the journal) gets into what the first one wrote."""
    ch = make_remote("leasedview", shm_threshold=T, lease_timeout=0.5)
    ch.put(torch.full((T // 4,), 7.0))
    got = ch.get(timeout=10, ack=True, copy=False)
    got.item.fill_(-1.0)  # an owned copy: the slot the lease keeps is untouched
    again = ch.get(timeout=30, ack=True)  # the lease lapses: the item comes again
    assert again.lease_id != got.lease_id
    assert torch.equal(again.item, torch.full((T // 4,), 7.0))
    ch.ack(again)
    assert wait_until(lambda: _shm_stats(ch)["slots_used"] == 0, timeout=30)


def test_hooks_see_slot_views_and_outputs_stay_valid(make_remote):
    ch = make_remote("hooks", shm_threshold=T, collector="flatten_batch", dispatcher="round_robin",
                     consumers=["a:0"])
    consumer = Channel.connect("hooks", identity="a:0")
    try:
        ts = [torch.full((T // 4,), float(i)) for i in range(4)]
        ch.put(ts)  # flattened by the broker: outputs are re-encoded from views of the slots
        for _ in range(4):
            ch.put(torch.full((T // 4,), -1.0))  # cycle the producer's pool meanwhile
        got = [consumer.get(timeout=10) for _ in range(8)]
        assert all(torch.equal(a, b) for a, b in zip(ts, got[:4], strict=True))
        assert wait_until(lambda: _shm_stats(ch)["slots_used"] == 0)
    finally:
        consumer.close()


@pytest.mark.parametrize("collector", ["hookmods:Duplicate", "hookmods:KeepsLast", "hookmods:Unchanged"])
def test_a_writable_view_of_a_collector_output_changes_no_other_output(make_remote, collector):
    """An output that is the put unchanged reuses its slot only while nothing else the
    collector left views that slot: a ``copy=False`` view is writable and private, so writing
    into it must change neither a second output of the same put nor what the collector
    keeps and yields later."""
    ch = make_remote("alias", shm_threshold=T, collector=collector)
    other = Channel.connect("alias")
    try:
        first_key = "in" if collector != "hookmods:Duplicate" else "a"
        ch.put(np.full(T, 1, np.uint8), key="in")
        view = ch.get(first_key, timeout=10, copy=False)
        view[:] = 7  # private to this consumer
        if collector == "hookmods:Duplicate":
            assert (other.get("b", timeout=10) == 1).all()
        elif collector == "hookmods:KeepsLast":
            ch.put(np.full(T, 2, np.uint8), key="in")
            assert (other.get("old", timeout=10) == 1).all()
            assert (other.get("in", timeout=10) == 2).all()
        else:  # nothing else views it: the output keeps the put's slot (no copy)
            assert _shm_stats(ch)["consumer_holds"] == 1
        del view
    finally:
        other.close()


def test_byte_limit_and_stat_count_shm_bytes(run_dir):
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "lim",
                             "--shm-threshold", str(T), "--max-bytes", str(3 * MIB)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("ready ")
        ch = Channel.connect("lim")
        try:
            ch.put(torch.zeros(MIB // 4))  # 1 MiB
            ch.put(torch.zeros(MIB // 4))
            st = ch.stats()
            assert st["shm"]["bytes_held"] == 2 * MIB and st["bytes_held"] >= 2 * MIB
            with pytest.raises(TimeoutError):  # a third would pass max_bytes
                ch.put(torch.zeros(MIB // 2), timeout=0.2)
            assert ch.stats()["shm"]["bytes_held"] == 2 * MIB  # the refused put's slot is free
            out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "stat", "lim"],
                                 capture_output=True, text=True, timeout=30).stdout
            assert "shm" in out and f"bytes held {2 * MIB}" in out
            ch.get(timeout=10)
            ch.put(torch.zeros(MIB // 4), timeout=5)
        finally:
            ch.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert not shm.list_segments(shm.prefix_for("lim", run_dir))


def test_sigkill_producer_mid_write_consumer_with_view_and_broker(make_remote, workers, channels,
                                                                  run_dir):
    ch = make_remote("kill", shm_threshold=T)
    prefix = _shm_stats(ch)["prefix"]
    producer = workers.start("""
        import sys, numpy as np, torch
        from zchannel.broker import Channel
        ch = Channel.connect("kill")
        ch.put(torch.full((16384,), 3.0))       # 64 KiB slot, held by the broker
        pool = ch._connection().shm.pool
        pool(np.zeros(1 << 20, np.uint8), 1 << 20)  # mid-write: a slot taken, nothing sent
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    workers.wait_line(producer, "ready")
    assert len(_segments(prefix)) == 3  # probe, the announced segment, the unannounced one
    os.kill(producer.pid, signal.SIGKILL)
    consumer = workers.start("""
        import sys
        from zchannel.broker import Channel
        ch = Channel.connect("kill")
        t = ch.get(timeout=10, copy=False)       # a view of the dead producer's slot
        print("held", float(t[0]), flush=True)
        sys.stdin.readline()
    """)
    assert workers.wait_line(consumer) == "held 3.0"
    assert _shm_stats(ch)["consumer_holds"] == 1
    os.kill(consumer.pid, signal.SIGKILL)
    # both clients expire; the dead producer's segment goes with the last release, and the
    # mid-write one (never named in a put) once the broker finds its creator dead
    assert wait_until(lambda: _shm_stats(ch)["consumer_holds"] == 0 and _shm_stats(ch)["segments"] == 0
                      and _probes(prefix, _segments(prefix)) == [True], timeout=30)
    ch.put(torch.full((16384,), 5.0))  # the broker holds a slot of a live producer too
    os.kill(ch._proc.pid, signal.SIGKILL)
    ch._proc.wait()
    assert len(_segments(prefix)) == 2  # a SIGKILLed broker removes nothing...
    old_live = [n for n in _segments(prefix) if not _probes(prefix, [n])[0]]  # this process's
    ch2 = Channel.create("kill", shm_threshold=T)
    channels.append(ch2)
    # ...the next one makes its probe anew, and keeps the live producer's segment for the
    # grace period (a reply the dead broker sent may name it to a consumer not done with it)
    now = _segments(prefix)
    assert [n for n in now if not _probes(prefix, [n])[0]] == old_live
    assert sum(_probes(prefix, now)) == 1
    ch2.put(torch.full((16384,), 1.0))
    assert float(ch2.get(timeout=10)[0]) == 1.0
    # the first handle reconnects by itself and puts through a fresh pool
    new_pid = ch2.stats()["pid"]
    assert wait_until(lambda: ch._conn.state == "up" and ch._conn.broker_info.pid == new_pid,
                 timeout=20)
    ch.put(torch.full((16384,), 9.0), timeout=10)
    assert float(ch2.get(timeout=10)[0]) == 9.0
    assert _shm_stats(ch2)["slots_in"] == 2
    assert wait_until(lambda: not set(old_live) & set(_segments(prefix)), timeout=60)
    ch2.shutdown()
    assert _segments(prefix) == []


def test_other_run_dirs_segments_are_untouched(make_remote, tmp_path, monkeypatch):
    other = shm.prefix_for("iso", "/tmp/some-other-run-dir")
    fd = os.open(os.path.join(shm.SHM_DIR, f"{other}1234-stale"), os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        ch = make_remote("iso", shm_threshold=T)
        assert _shm_stats(ch)["prefix"] != other
        ch.shutdown()
        assert _segments(other) == [f"{other}1234-stale"]
    finally:
        os.unlink(os.path.join(shm.SHM_DIR, f"{other}1234-stale"))


def test_threshold_zero_is_off(make_remote):
    ch = make_remote("off", shm_threshold=0)
    assert ch._connection().broker_info.shm is None
    ch.put(torch.zeros(MIB))
    assert torch.equal(ch.get(timeout=10), torch.zeros(MIB))
    assert _shm_stats(ch)["slots_in"] == 0 and _segments(_shm_stats(ch)["prefix"]) == []


def test_unsent_put_gives_its_slots_back(make_remote):
    ch = make_remote("undo", shm_threshold=T)
    with pytest.raises(TypeError):
        ch.put({"a": torch.zeros(T), "b": object()})  # the tensor took a slot, then encoding failed
    pool = ch._connection().shm.pool
    assert all(int((s.states == shm.USED).sum()) == 0 for segs in pool.classes.values() for s in segs)
    ch.put({"a": torch.zeros(T)})
    assert torch.equal(ch.get(timeout=10)["a"], torch.zeros(T))


def test_a_put_takes_the_slot_freed_last(make_remote):
    """Slots are reused warmest first: the one the broker freed last, before slots never used
    and before slots freed earlier (their pages are the likeliest to be cached still)."""
    ch = make_remote("lifo", shm_threshold=T)
    pool = ch._connection().shm.pool
    assert ch.reserve_shm(T, 4) == 4
    (seg,) = pool.classes[T]
    ts = [torch.full((T // 4,), float(i)) for i in range(3)]
    for t in ts:
        ch.put(t)
    assert list(seg.states) == [shm.USED, shm.USED, shm.USED, shm.FREE]
    for t in ts:
        assert torch.equal(ch.get(timeout=10), t)
    wait_until(lambda: _shm_stats(ch)["slots_used"] == 0, timeout=10)
    assert list(seg.freed[:3]) == sorted(seg.freed[:3]) and seg.freed[3] == 0
    ch.put(ts[1])
    assert list(seg.states) == [shm.FREE, shm.FREE, shm.USED, shm.FREE]
    assert torch.equal(ch.get(timeout=10), ts[1])


def test_large_tensors_round_trip_through_slot_copies(make_remote):
    """Large items of odd sizes and dtypes are copied into the producer's slots and out of them
    at the consumer; they arrive intact, owned by the consumer."""
    ch = make_remote("big", shm_threshold=T)
    values = [torch.randn((4 << 20) // 4 + 3), torch.arange(6 * MIB + 1, dtype=torch.uint8),
              np.frombuffer(np.random.default_rng(7).bytes(5 * MIB + 7), np.uint8).copy()]
    for v in values:
        ch.put(v)
    assert _shm_stats(ch)["bytes_held"] >= sum(
        v.nbytes if isinstance(v, np.ndarray) else v.numel() * v.element_size() for v in values)
    for v in values:
        got = ch.get(timeout=10)
        if isinstance(v, np.ndarray):
            assert got.flags.writeable and np.array_equal(got, v)
        else:
            assert torch.equal(got, v)


def _broker_tunables(ch) -> bytes:
    """The broker process's GLIBC_TUNABLES as it was started (glibc, parsing it, writes a NUL
    over each ``:`` in /proc's copy, so the entries come as NUL-separated bytes)."""
    with open(f"/proc/{ch.stats()['pid']}/environ", "rb") as f:
        raw = f.read()
    start = raw.find(b"\0GLIBC_TUNABLES=")
    if start < 0:
        return b""
    entries = raw[start + 16:].split(b"\0")
    return b":".join(e for e in entries[:4] if e.startswith(b"glibc."))


def test_brokers_start_with_glibc_streaming_large_copies(make_remote, monkeypatch,
                                                         spawned_brokers):
    """A broker zchannel starts gets glibc's non-temporal copy threshold at 4 MiB in
    GLIBC_TUNABLES (docs/shm.md, "Large copies"), next to the user's own tunables; a threshold
    the user set wins, and ZCHANNEL_GLIBC_TUNABLES=0 leaves the environment alone."""
    monkeypatch.delenv("ZCHANNEL_GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    assert _broker_tunables(make_remote("tun1")) == (
        b"glibc.malloc.arena_max=4:glibc.cpu.x86_non_temporal_threshold=0x400000")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.x86_non_temporal_threshold=0x800000")
    assert _broker_tunables(make_remote("tun2")) == b"glibc.cpu.x86_non_temporal_threshold=0x800000"
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("ZCHANNEL_GLIBC_TUNABLES", "0")
    assert _broker_tunables(make_remote("tun3")) == b""


def test_owned_copies_survive_slot_and_buffer_reuse(make_remote):
    """The default get (copy=True) owns its tensor: later items that reuse the same slot, and
    copy-out buffers recycled from tensors already collected, never write into a tensor the
    user still holds; live tensors never share memory."""
    ch = make_remote("owned", shm_threshold=T)
    pool = ch._connection().shm.pool
    kept: list[tuple[int, torch.Tensor]] = []
    slots_used = set()
    for i in range(12):
        ch.put(torch.full((T // 4,), float(i)))
        slots_used |= {(seg.name, int(j)) for seg in pool.classes[T]
                       for j in np.flatnonzero(seg.states == shm.USED)}
        got = ch.get(timeout=10)
        assert torch.equal(got, torch.full((T // 4,), float(i)))
        if i % 3:  # keep two of three; the third is collected and its buffer recycled
            kept.append((i, got))
        del got
        gc.collect()
        wait_until(lambda: _shm_stats(ch)["slots_used"] == 0, timeout=10)
    assert len(slots_used) == 1  # every put took the slot the previous item freed
    for i, t in kept:
        assert torch.equal(t, torch.full((T // 4,), float(i))), f"item {i} was overwritten"
    assert len({t.data_ptr() for _, t in kept}) == len(kept)
    cache = ch._connection().shm.out_cache
    assert all(len(free) <= shm.client.OUT_CACHE for free in cache.values())


def test_a_stream_sends_its_slot_releases_with_its_requests(make_remote):
    """A consumer returns a slot smaller than ``RELEASE_AT_ONCE_BYTES`` with its next message
    instead of waking its I/O thread for it: a stream of 2,000 shared-memory items wakes the
    consumer's I/O thread far less than once per item (it woke once per item, a switch to
    that thread and back and a message of its own, when every release did; its looks every
    ``LAZY_S`` while the stream runs stay far fewer even on a loaded machine), and the
    producer's pool never runs dry."""
    assert T < shm.client.RELEASE_AT_ONCE_BYTES
    producer = make_remote("shm-release-stream", shm_threshold=T)
    consumer = Channel.connect("shm-release-stream")
    try:
        pconn, cconn = producer._connection(), consumer._connection()
        assert pconn.direct and cconn.direct and pconn.shm.pool is not None
        before = cconn.io_turns
        n, window = 2000, 8
        puts: list = []
        gets: list = []
        got = 0
        for i in range(n):
            puts.append(producer.put(np.full(T, i % 251, dtype=np.uint8), async_op=True))
            gets.append(consumer.get(async_op=True, timeout=30))
            if len(gets) >= window:
                puts.pop(0).wait(30)
                item = gets.pop(0).wait(30)
                assert item.nbytes == T and item[0] == item[-1] == got % 251
                got += 1
        for w in puts:
            w.wait(30)
        for w in gets:
            assert w.wait(30)[0] == got % 251
            got += 1
        assert got == n
        turns = cconn.io_turns - before
        assert turns < n // 4, f"the consumer's I/O thread woke {turns} times for {n} items"
        assert pconn.shm.pool.fallbacks == 0  # every put found a slot: they came back in time
        assert wait_until(lambda: _shm_stats(producer)["slots_used"] == 0, timeout=20)
    finally:
        consumer.close()


def test_a_small_slot_comes_back_with_nothing_else_to_send(run_dir, tmp_path):
    """A small slot's release waits for the consumer's next message, but not for long: with
    gets outstanding and nothing else to send, the I/O thread sends it at its next look
    (within ``LAZY_S``, or at once when it was not looking lazily), not after half a
    heartbeat (a minute here)."""
    with _slow_heartbeat_channel(run_dir, tmp_path, "release-lazy") as ch:
        # read by this thread, converted here: the slot is released
        _release_while_gets_wait(ch, 3.0, io_thread_reads=False)


def test_released_slot_goes_back_while_gets_wait(run_dir, tmp_path, monkeypatch):
    """A consumer whose item was read by the I/O thread (its gets outstanding) copies it out
    later and has nothing else to send: the slot still goes back at once.  With no lazy looks
    (``LAZY_MS`` 0) the release wakes the I/O thread instead of waiting for the consumer's next
    message or the thread's next look (half a heartbeat: a minute here), so a producer whose
    pool is full is not held up by a consumer busy with what it got."""
    from zchannel.broker.connection import iothread

    # The I/O thread always watches the socket (no lazy looks every LAZY_S): a reply is read
    # at once, and with gets still due it sleeps up to half a heartbeat (a minute here).
    monkeypatch.setattr(iothread, "LAZY_MS", 0)
    monkeypatch.setattr(iothread, "LAZY_S", 0.0)
    with _slow_heartbeat_channel(run_dir, tmp_path, "release") as ch:
        _release_while_gets_wait(ch, 7.0, io_thread_reads=True)


@contextlib.contextmanager
def _slow_heartbeat_channel(run_dir, tmp_path, name: str) -> Iterator[Channel]:
    """A handle on broker ``name`` (shared-memory threshold ``T``) whose heartbeat interval is
    120 s: a record left for the I/O thread's next heartbeat look would wait a minute."""
    conf = tmp_path / "b.toml"
    conf.write_text("[channel]\nheartbeat_interval = 120.0\n")
    address = f"ipc://{run_dir}/{name}.sock"
    broker = subprocess.Popen(
        [sys.executable, "-m", "zchannel.cli.main", "broker", name, "--address", address,
         "--shm-threshold", str(T), "--config", str(conf)], stdout=subprocess.PIPE, text=True)
    ch = None
    try:
        assert broker.stdout.readline().startswith("ready ")
        ch = Channel.connect(address)
        assert ch._connection().hb == 120.0
        yield ch
    finally:
        if ch is not None:
            ch.close()
        broker.terminate()
        broker.wait(timeout=30)


def _release_while_gets_wait(ch, value: float, io_thread_reads: bool) -> None:
    """One item of ``value`` gotten with two more gets outstanding and nothing else put: its
    slot comes back once the item is copied out.  ``io_thread_reads``: the I/O thread reads
    the reply before the caller waits (the slot stays in use until the caller converts it)."""
    pool = ch._connection().shm.pool
    ch.put(torch.full((T // 4,), value))
    used = [(seg, int(j)) for seg in pool.classes[T]
            for j in np.flatnonzero(seg.states == shm.USED)]
    assert len(used) == 1  # the item's slot, until the consumer copied it out
    seg, j = used[0]
    works = [ch.get(async_op=True, timeout=300) for _ in range(3)]
    if io_thread_reads:
        assert wait_until(works[0].done, timeout=30)  # read by the I/O thread, not converted yet
        assert seg.states[j] == shm.USED
    got = works[0].wait(30)  # converted here: an owned copy, the slot is not needed any more
    assert torch.equal(got, torch.full((T // 4,), value))
    assert wait_until(lambda: seg.states[j] == shm.FREE, timeout=20), "the slot did not come back"
    assert not works[1].done() and not works[2].done()  # nothing else was put
