"""The baselines ``zchannel bench`` measures on the same payloads in the same run: a raw
``zmq.proxy`` ROUTER/DEALER relay (at libzmq's default high-water marks, as a user writes it,
and at the depth in flight of the case), a raw DEALER/ROUTER echo (latency),
``multiprocessing.Queue`` (registered in ``registry.BASELINES``) and, when ``ray`` is
importable, ``ray.util.queue.Queue`` and pipelined Ray actor calls.
"""

from __future__ import annotations

import queue as queue_mod
import tempfile
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq
from zchannel.cli.bench.cases import Case, Measured, cpu_figures, split
from zchannel.cli.bench.payloads import (
    SEQ_SHIFT,
    Mismatch,
    PayloadFactory,
    Tally,
    checked_stream,
    lost_items,
    verify_seqs,
)
from zchannel.cli.bench.registry import Baseline, register_baseline
from zchannel.cli.bench.workers import (
    POLL_S,
    WORKER_DEADLINE_S,
    Workers,
    read_proc_cpu_ns,
    read_proc_status,
    start_consumer,
)

ZERO_COPY_MIN = 64 * 1024  # frames at least this big are sent with copy=False (as the codec does)
ZMQ_DEFAULT_HWM = 1000  # libzmq's default SNDHWM / RCVHWM (messages)


def _bind(sock: zmq.Socket, transport: str, tmpdir: str, name: str) -> str:
    if transport == "ipc":
        sock.bind(f"ipc://{tmpdir}/{name}")
    else:
        sock.bind("tcp://127.0.0.1:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def zmq_proxy_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """The relay: ROUTER (producers) -> ``zmq.proxy`` -> DEALER (consumers).  Runs until killed;
    reports its addresses through ``spec['addr_queue']``."""
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (front, back):
        sock.setsockopt(zmq.SNDHWM, spec["hwm"])
        sock.setsockopt(zmq.RCVHWM, spec["hwm"])
        sock.setsockopt(zmq.LINGER, 0)
    addrs = (
        _bind(front, spec["transport"], spec["tmpdir"], "front"),
        _bind(back, spec["transport"], spec["tmpdir"], "back"),
    )
    spec["addr_queue"].put(addrs)
    ready()
    zmq.proxy(front, back)
    return {}


def zmq_echo_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """A ROUTER that sends every message back to its sender.  Runs until killed."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    spec["addr_queue"].put(_bind(sock, spec["transport"], spec["tmpdir"], "echo"))
    ready()
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def _send_item(sock: zmq.Socket, views: list[np.ndarray], trackers: deque, track_slot: int) -> None:
    large = any(v.nbytes >= ZERO_COPY_MIN for v in views)
    if large:
        tracker = sock.send_multipart(
            views, copy=False, track=True)  # type: ignore[arg-type]  # ndarrays are buffers
        trackers.append((track_slot, tracker))
    else:
        sock.send_multipart([v.tobytes() for v in views])


def zmq_producer_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """A DEALER sending ``n`` items to the relay (ring buffers reused once zmq released them)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, spec["hwm"])
    sock.setsockopt(zmq.LINGER, -1)
    sock.connect(spec["address"])
    window = spec["window"]
    fac = PayloadFactory(spec["ptype"], spec["size"], ring=window + 1)
    base = spec["pidx"] << SEQ_SHIFT
    trackers: deque = deque()
    ready()
    go_wait()
    t_start = time.monotonic_ns()
    for i in range(spec["n"]):
        while trackers and (len(trackers) >= window or trackers[0][0] == i % (window + 1)):
            trackers.popleft()[1].wait()
        _, views = fac.make(base | i, i)
        _send_item(sock, views, trackers, i % (window + 1))
    for _, tracker in trackers:
        tracker.wait()
    t_end = time.monotonic_ns()
    # Stay connected until the consumers got everything: libzmq may drop messages still queued
    # in the proxy when their sender disconnects.
    spec["done"].wait(WORKER_DEADLINE_S)
    sock.close(linger=-1)
    ctx.term()
    return {"t_start": t_start, "t_end": t_end, "count": spec["n"]}


def _counts_done(counts: Any, total: int) -> bool:
    return sum(counts) >= total


def zmq_consumer_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """A DEALER receiving from the relay until all consumers together got ``total`` items."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, spec["hwm"])
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec["address"])
    counts, slot, total = spec["counts"], spec["slot"], spec["total"]
    fac, tally, deadline = start_consumer(spec, ready, go_wait)
    n = 0
    while True:
        if sock.poll(int(POLL_S * 1000)):
            frames = sock.recv_multipart(copy=False)
            now = time.monotonic_ns()
            seq, t_sent = fac.check_views([f.buffer for f in frames[1:]])
            tally.add(seq, t_sent, now)
            n += 1
            counts[slot] = n
        elif _counts_done(counts, total):
            break
        elif time.monotonic() > deadline:
            raise lost_items("relay consumer", n, sum(counts), total)
    sock.close()
    ctx.term()
    return tally.result()


def zmq_echo_client_worker(
    spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]
) -> dict:
    """Round trips through the echo: ``window`` requests in flight, each reply checked."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec["address"])
    window, n = spec["window"], spec["n"]
    fac = PayloadFactory(spec["ptype"], spec["size"], ring=window + 1)
    tally = Tally()
    trackers: deque = deque()
    ready()
    go_wait()
    tally.t_start = time.monotonic_ns()
    sent = received = 0
    while received < n:
        while sent < n and sent - received < window:
            _, views = fac.make(sent, sent)
            _send_item(sock, views, trackers, sent % (window + 1))
            sent += 1
        frames = sock.recv_multipart(copy=False)
        seq, t_sent = fac.check_views([f.buffer for f in frames])
        tally.add(seq, t_sent)
        received += 1
        while trackers and trackers[0][1].done:
            trackers.popleft()
    sock.close()
    ctx.term()
    return tally.result()


def mp_producer_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """Puts ``n`` fresh items (the queue pickles them later, in its feeder thread), then stays
    until the consumers got every item (``done``): torch's reducers, which ``multiprocessing``
    uses for tensors once torch is imported, send each tensor's shared memory as a descriptor
    its producer hands out (torch.multiprocessing's rule: a producer outlives its tensors'
    consumers)."""
    fac = PayloadFactory(spec["ptype"], spec["size"])
    q = spec["queue"]
    base = spec["pidx"] << SEQ_SHIFT
    ready()
    go_wait()
    t_start = time.monotonic_ns()
    for i in range(spec["n"]):
        q.put(fac.make(base | i, i, fresh=True)[0])
    q.close()
    q.join_thread()
    t_end = time.monotonic_ns()
    spec["done"].wait(WORKER_DEADLINE_S)
    return {"t_start": t_start, "t_end": t_end, "count": spec["n"]}


def mp_consumer_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """Gets from the queue until all consumers together got ``total`` items."""
    q, counts, slot, total = spec["queue"], spec["counts"], spec["slot"], spec["total"]
    fac, tally, deadline = start_consumer(spec, ready, go_wait)
    n = 0
    while True:
        try:
            item = q.get(timeout=POLL_S)
        except queue_mod.Empty:
            if _counts_done(counts, total):
                break
            if time.monotonic() > deadline:
                raise lost_items("mp consumer", n, sum(counts), total) from None
            continue
        seq, t_sent = fac.check(item)
        tally.add(seq, t_sent)
        n += 1
        counts[slot] = n
    return tally.result()


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _ray_workers(ray: Any) -> tuple[Any, Any, Any]:
    """The Ray tasks and actor class of the Ray baselines: a producer and a consumer of a
    ``ray.util.queue.Queue``, and an actor that checks what it is sent."""
    @ray.remote(num_cpus=0)
    def produce(q: Any, ptype: str, size: int, n: int) -> dict:
        fac = PayloadFactory(ptype, size)
        t0 = time.monotonic_ns()
        for i in range(n):
            q.put(fac.make(i, i, fresh=True)[0])
        return {"t_start": t0, "t_end": time.monotonic_ns(), "count": n}

    @ray.remote(num_cpus=0)
    def consume(q: Any, ptype: str, size: int, n: int) -> dict:
        fac = PayloadFactory(ptype, size)
        tally = Tally()
        for _ in range(n):
            tally.add(*fac.check(q.get(timeout=WORKER_DEADLINE_S)))
        return tally.result()

    @ray.remote(num_cpus=0)
    class Sink:
        def __init__(self, ptype: str, size: int) -> None:
            self.fac = PayloadFactory(ptype, size)

        def push(self, item: Any) -> tuple[int, int]:
            return self.fac.check(item)

    return produce, consume, Sink


def run_ray_baselines(
    ptype: str, size: int, n: int, window: int, queue: bool = True
) -> dict[str, dict]:
    """1 producer -> ``ray.util.queue.Queue`` -> 1 consumer (Ray tasks; unless ``queue`` is
    false), and ``n`` pipelined actor calls from the driver (``window`` in flight).  Returns raw
    tallies per variant."""
    import ray
    from ray.util.queue import Queue

    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",  # our own instance, never a cluster another process started here
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    try:
        produce, consume, Sink = _ray_workers(ray)
        out: dict[str, dict] = {}
        if queue:
            q = Queue()
            cons = consume.remote(q, ptype, size, n)
            prod = produce.remote(q, ptype, size, n)
            prod_res, cons_res = ray.get([prod, cons])
            cons_res["t_start"] = prod_res["t_start"]
            out["ray.queue"] = cons_res
        sink = Sink.remote(ptype, size)
        ray.get(sink.push.remote(PayloadFactory(ptype, size).make(0, 0, fresh=True)[0]))
        fac = PayloadFactory(ptype, size)
        tally = Tally()
        inflight: deque = deque()
        for i in range(n):
            if len(inflight) >= window:
                ref = inflight.popleft()
                tally.add(*ray.get(ref))
            inflight.append(sink.push.remote(fac.make(i, i, fresh=True)[0]))
        for ref in inflight:
            tally.add(*ray.get(ref))
        out["ray.actor"] = tally.result()
        return out
    finally:
        if started:
            ray.shutdown()


def default_relay_hwm(case: Case) -> int:
    """The relay's high-water mark as a user writes it: libzmq's default for items under
    ``ZERO_COPY_MIN``; for larger items the depth in flight of the case, so that the relay's
    queues hold what the channel's do, not up to 1000 items per socket (16 GiB of 16 MiB
    tensors)."""
    return ZMQ_DEFAULT_HWM if case.size < ZERO_COPY_MIN else depth_hwm(case)


def depth_hwm(case: Case) -> int:
    """The relay's high-water mark at the case's depth in flight (its window)."""
    return max(2, case.window)


def run_zmq_proxy(case: Case, tmpdir: str, hwm: int | None = None) -> Measured:
    """The raw relay: P producer DEALERs -> zmq.proxy (ROUTER/DEALER) -> C consumer DEALERs,
    each socket at high-water mark ``hwm`` (default: ``default_relay_hwm``)."""
    with Workers() as w:
        addr_q = w.ctx.Queue()
        hwm = default_relay_hwm(case) if hwm is None else hwm
        sub = tempfile.mkdtemp(prefix="zp-", dir=tmpdir)
        w.start(
            zmq_proxy_worker,
            {
                "name": "proxy",
                "transport": case.transport,
                "tmpdir": sub,
                "hwm": hwm,
                "addr_queue": addr_q,
            },
            group="proxy",
        )
        front, back = addr_q.get(timeout=120)
        proxy_pid = w.procs[0].pid
        counts_arr = w.counters(case.consumers)
        per_prod = split(case.messages, case.producers)
        done = w.ctx.Event()
        for p, n in enumerate(per_prod):
            w.start(
                zmq_producer_worker,
                {
                    "name": f"producer-{p}",
                    "address": front,
                    "pidx": p,
                    "n": n,
                    "ptype": case.ptype,
                    "size": case.size,
                    "window": case.window,
                    "hwm": hwm,
                    "done": done,
                },
            )
        for c in range(case.consumers):
            w.start(
                zmq_consumer_worker,
                {
                    "name": f"consumer-{c}",
                    "address": back,
                    "ptype": case.ptype,
                    "size": case.size,
                    "hwm": hwm,
                    "counts": counts_arr,
                    "slot": c,
                    "total": case.messages,
                },
            )
        w.wait_ready()
        cpu0 = read_proc_cpu_ns(proxy_pid)
        t_go = w.go()
        results = w.collect(case.consumers)
        cpu1 = read_proc_cpu_ns(proxy_pid)
        done.set()
        results += w.collect(case.producers)
        rss = read_proc_status(proxy_pid, "VmHWM")
    seconds, lat = checked_stream(results, per_prod, t_go)
    cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    return Measured(case.messages, seconds, lat, rss, cpu_figures(results, case.messages, cpu))


def run_zmq_echo(case: Case, tmpdir: str) -> Measured:
    """Raw DEALER -> ROUTER echo round trips (``window`` in flight), each reply checked."""
    with Workers() as w:
        addr_q = w.ctx.Queue()
        sub = tempfile.mkdtemp(prefix="ze-", dir=tmpdir)
        w.start(
            zmq_echo_worker,
            {"name": "echo", "transport": case.transport, "tmpdir": sub, "addr_queue": addr_q},
            group="echo",
        )
        address = addr_q.get(timeout=120)
        echo_pid = w.procs[0].pid
        w.start(
            zmq_echo_client_worker,
            {
                "name": "client",
                "address": address,
                "ptype": case.ptype,
                "size": case.size,
                "window": case.window,
                "n": case.messages,
            },
        )
        w.wait_ready()
        w.go()
        (res,) = w.collect(1)
        rss = read_proc_status(echo_pid, "VmHWM")
    verify_seqs([res["seqs"]], [case.messages])
    return Measured(case.messages, (res["t_end"] - res["t_start"]) / 1e9, res["lat_ns"], rss)


def run_mp_queue(case: Case, tmpdir: str) -> Measured:
    """``multiprocessing.Queue`` with P producer and C consumer processes."""
    with Workers() as w:
        q = w.ctx.Queue(maxsize=max(2, case.window))
        counts_arr = w.counters(case.consumers)
        per_prod = split(case.messages, case.producers)
        done = w.ctx.Event()
        for p, n in enumerate(per_prod):
            w.start(
                mp_producer_worker,
                {
                    "name": f"producer-{p}",
                    "queue": q,
                    "pidx": p,
                    "n": n,
                    "ptype": case.ptype,
                    "size": case.size,
                    "done": done,
                },
            )
        for c in range(case.consumers):
            w.start(
                mp_consumer_worker,
                {
                    "name": f"consumer-{c}",
                    "queue": q,
                    "ptype": case.ptype,
                    "size": case.size,
                    "counts": counts_arr,
                    "slot": c,
                    "total": case.messages,
                },
            )
        w.wait_ready()
        t_go = w.go()
        results = w.collect(case.consumers)
        done.set()
        results += w.collect(case.producers)
    seconds, lat = checked_stream(results, per_prod, t_go)
    return Measured(case.messages, seconds, lat, extra=cpu_figures(results, case.messages))


def run_copyto(case: Case, tmpdir: str) -> Measured:
    """The copy limit: ``np.copyto`` of each item's bytes into preallocated memory, ``messages``
    times, in this process (a warm-up copy first, so no page is faulted in while timed)."""
    src = np.frombuffer(np.random.default_rng(7).bytes(case.size), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    lat = np.empty(case.messages, dtype=np.int64)
    start = time.monotonic_ns()
    for i in range(case.messages):
        t0 = time.monotonic_ns()
        np.copyto(dst, src)
        lat[i] = time.monotonic_ns() - t0
    seconds = (time.monotonic_ns() - start) / 1e9
    if not np.array_equal(dst[-4096:], src[-4096:]):
        raise Mismatch("np.copyto baseline: the copy differs from its source")
    return Measured(case.messages, max(seconds, 1e-9), lat)


def run_zmq_proxy_at_depth(case: Case, tmpdir: str) -> Measured:
    """The relay with every high-water mark at the case's window (``depth_hwm``)."""
    return run_zmq_proxy(case, tmpdir, hwm=depth_hwm(case))


register_baseline(Baseline(
    "zmq.proxy", run_zmq_proxy,
    "raw zmq.proxy relay: producer DEALERs -> ROUTER/DEALER proxy -> consumer DEALERs, no "
    "broker logic; each row's hwm: libzmq's default (1000) for items under 64 KiB, the "
    "case's window (at least 2) for larger ones, so its queues hold what the channel's do",
    suffix=lambda case: f" hwm={default_relay_hwm(case)}",
))
register_baseline(Baseline(
    "zmq.proxy.depth", run_zmq_proxy_at_depth,
    "the same relay with its high-water marks at the case's window (the same depth in "
    "flight as the channel's)",
    suffix=lambda case: f" hwm={depth_hwm(case)}",
))
register_baseline(Baseline(
    "zmq.echo", run_zmq_echo, "raw DEALER -> ROUTER echo round trips, no broker logic",
    latency="rtt",
))
register_baseline(Baseline(
    "np.copyto", run_copyto,
    "np.copyto of each item's bytes into preallocated memory in one process: the copy limit",
    latency="copy",
))
register_baseline(Baseline(
    "mp", run_mp_queue, "multiprocessing.Queue between the same processes",
))
