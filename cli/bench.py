"""``zchannel bench``: bounded load on a channel broker, compared with baselines in the same run.

Every scenario starts a broker (or uses ``--address``) and producer/consumer worker processes
(``spawn``), releases them together after a readiness handshake, checks every item on arrival
(content and sequence numbers; see ``bench_baselines.PayloadFactory``) and prints one row per
case: items/s, MB/s, p50/p99 latency, the broker's peak RSS (``VmHWM``) and the ratio to the
baseline measured on the same payloads (medians over ``--repeat`` runs; the report, its
legend and the progress display are ``bench_report``).  A content mismatch, a lost or a
duplicated item fails the run (exit 1).

Latency columns: end-to-end (put issued -> item received, from the send time stamped in the
item) for streaming cases; request -> reply for ``put_only`` (the put acknowledgement),
``get_only`` (the get) and ``batch`` (one ``get_batch``).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import click
import click.core
import numpy as np
from zchannel.broker import Channel, ChannelError, Work
from zchannel.broker.starting import child_environ
from zchannel.broker.toml import tomllib
from zchannel.cli.bench_baselines import (
    PAYLOAD_TYPES,
    SEQ_SHIFT,
    WORKER_DEADLINE_S,
    Mismatch,
    PayloadFactory,
    Tally,
    Workers,
    mp_consumer_worker,
    mp_producer_worker,
    part_sizes,
    ray_available,
    read_proc_status,
    run_ray_baselines,
    verify_seqs,
    zmq_consumer_worker,
    zmq_echo_client_worker,
    zmq_echo_worker,
    zmq_producer_worker,
    zmq_proxy_worker,
)
from zchannel.cli.bench_report import (
    Progress,
    Result,
    TargetResult,
    print_report,
    set_ratio,
    write_json,
)
from zchannel.cli.bench_trajectory import TrajectoryCase, chunk_bytes, run_trajectory_case
from zchannel.hooks import register_collector
from zchannel.hooks.builtin import FlattenBatch

SCENARIOS = (
    "quick",
    "channel",
    "put_only",
    "get_only",
    "random_key",
    "batch",
    "hooks",
    "all",
    "targets",
    "trajectory",
    "shm",
)
ALL_SCENARIOS = ("channel", "put_only", "get_only", "random_key", "batch", "hooks")
BATCH_ITEMS = 64
HOOK_BATCH = 8  # items per put in the hooks scenario (flattened by the collector)
DEFAULT_KEYS = 128
MAX_BYTES_PER_CASE = 1 << 30  # large payloads: at most this many bytes per case
MAX_INFLIGHT_BYTES = 256 << 20  # large payloads: window capped to this many bytes per worker
GET_TIMEOUT_S = 0.1  # consumers poll with this get timeout once the stream may be over
MIB = 1 << 20


@register_collector("bench_flatten")
class BenchFlatten(FlattenBatch):
    """``flatten_batch`` under a name whose module registers ``BenchSample``: used for the
    ``dataclass`` payload, whose tag the broker must know to decode the body."""


# -- data model -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One measurement: a scenario with its payload, process counts and transport."""

    scenario: str
    ptype: str = "bytes"
    size: int = 64
    messages: int = 20000
    producers: int = 1
    consumers: int = 1
    transport: str = "ipc"
    window: int = 64
    keys: int = 1
    hooks: bool = False
    label: str = ""
    shm: bool = True  # same-host shared memory for large arrays/tensors (docs/shm.md)
    maxsize: int = 0  # the channel's maxsize (0: unbounded)
    max_bytes: int = MAX_BYTES_PER_CASE  # payload bytes per case (``bounded``)
    max_inflight: int = MAX_INFLIGHT_BYTES  # payload bytes in flight per worker (``bounded``)
    reserve: bool = True  # producers preallocate their shared-memory slots (``reserve_shm``)
    in_slot: bool = False  # producers write each tensor in a slot (``empty_shm``), no put copy
    compare: bool = True  # measured against the --baseline transport (else against another case)

    @property
    def name(self) -> str:
        extra = f" keys={self.keys}" if self.scenario == "random_key" else ""
        extra += " +hooks" if self.hooks else (" nohooks" if self.scenario == "hooks" else "")
        return (
            self.label
            or f"{self.scenario} {self.ptype} {fmt_size(self.size)} "
            f"{self.producers}P/{self.consumers}C w{self.window}{extra}"
        )


class BenchFailure(click.ClickException):
    """A run that must exit non-zero (a mismatch, a worker failure)."""

    exit_code = 1


# -- helpers ----------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str | int) -> int:
    """``64``, ``64B``, ``1KB``, ``16MB``, ``1GiB`` -> bytes (binary multiples)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise click.BadParameter(f"{text!r}: expected a size like 64B, 1KB, 16MB, 1GB")
    unit = m.group(2).lower()[:1]
    if unit == "b":
        unit = ""
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 16:
        raise click.BadParameter(f"{text!r}: payloads are at least 16 bytes (the item header)")
    return value


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal counts."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def bounded(case: Case) -> Case:
    """Cap messages and window of large payloads (bytes per case, bytes in flight)."""
    nbytes = max(case.size, 1)
    messages = min(case.messages, max(8, case.max_bytes // nbytes))
    window = max(1, min(case.window, case.max_inflight // nbytes))
    return dataclasses.replace(case, messages=messages, window=window)


def percentiles(lat_ns: np.ndarray) -> tuple[float, float]:
    if lat_ns.size == 0:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(lat_ns, [50, 99])
    return float(p50) / 1e3, float(p99) / 1e3


def machine_description() -> dict[str, Any]:
    """CPU count and model, kernel, and the versions that matter."""
    import zmq

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover
        torch_version = None
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "mem_total_gb": round(mem / (1 << 30), 1) if mem else None,
        "loadavg": os.getloadavg(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "numpy": np.__version__,
    }


# -- the channel under test -------------------------------------------------------------------


class Target:
    """The broker measured: one started for the case (``create``), or ``--address``."""

    def __init__(
        self,
        case: Case,
        address: str | None,
        tmpdir: str,
        collector: Any = None,
        dispatcher: Any = None,
        consumers: list[str] | None = None,
    ) -> None:
        self.owned: Channel | None = None
        if address:
            self.handle = Channel.connect(address)
            self.address = address
        else:
            name = f"bench-{uuid.uuid4().hex[:12]}"
            addr = f"ipc://{tmpdir}/{name}.sock" if case.transport == "ipc" else "tcp://127.0.0.1:0"
            self.owned = Channel.create(
                name,
                address=addr,
                collector=collector,
                dispatcher=dispatcher,
                consumers=consumers,
                shm_threshold=None if case.shm else 0,
                maxsize=case.maxsize,
            )
            self.handle = self.owned
            self.address = self.owned.address
        self.key_prefix = f"bench-{uuid.uuid4().hex[:8]}"
        self.pid = int(self.handle.stats().get("pid") or 0)

    def peak_rss(self) -> int | None:
        return read_proc_status(self.pid, "VmHWM") if self.pid else None

    def rss(self) -> int | None:
        return read_proc_status(self.pid, "VmRSS") if self.pid else None

    def close(self) -> None:
        if self.owned is not None:
            self.owned.shutdown()
        else:
            self.handle.close()


# -- channel workers (run in spawned processes) -----------------------------------------------


def _key(spec: dict, index: int) -> Any:
    sched = spec.get("schedule")
    if sched is None:
        return spec["key"]
    return f"{spec['key']}-p{spec['pidx']}-k{int(sched[index])}"


def channel_producer(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """Puts ``n`` items (``group`` per put for the hooks scenario) with ``window`` in flight;
    records each put's request -> acknowledgement time."""
    ch = Channel.connect(spec["address"])
    window, group, n = spec["window"], spec.get("group", 1), spec["n"]
    fac = PayloadFactory(spec["ptype"], spec["size"], ring=(window + 1) * group)
    if spec.get("shm_slots"):
        for nbytes in set(fac.parts):  # 0 (nothing made) below the broker's shm threshold
            ch.reserve_shm(nbytes, spec["shm_slots"])
    base = spec["pidx"] << SEQ_SHIFT
    inflight: deque = deque()
    lat: list[int] = []
    ready()
    go_wait()
    t_start = time.monotonic_ns()
    for i in range(0, n, group):
        if len(inflight) >= window:
            work, t0 = inflight.popleft()
            work.wait(WORKER_DEADLINE_S)
            lat.append(time.monotonic_ns() - t0)
        if spec.get("in_slot"):
            item = fac.make_in(ch.empty_shm, base | i, i)
        elif group == 1:
            item = fac.make(base | i, i)[0]
        else:
            item = [fac.make(base | j, j)[0] for j in range(i, min(n, i + group))]
        t0 = time.monotonic_ns()
        inflight.append((ch.put(item, weight=1, key=_key(spec, i), async_op=True), t0))
    for work, t0 in inflight:
        work.wait(WORKER_DEADLINE_S)
        lat.append(time.monotonic_ns() - t0)
    t_end = time.monotonic_ns()
    ch.close()
    return {
        "t_start": t_start,
        "t_end": t_end,
        "count": n,
        "lat_ns": np.asarray(lat, dtype=np.int64),
    }


def channel_consumer(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """Gets (or ``get_batch``es) with ``window`` requests in flight until all consumers
    together received ``total`` items; with a ``schedule`` it gets its producers' keys in
    their order.  Latency: end-to-end, or per request when ``request_latency``."""
    ch = Channel.connect(spec["address"], identity=spec.get("identity"))
    fac = PayloadFactory(spec["ptype"], spec["size"])
    counts, slot, total = spec["counts"], spec["slot"], spec["total"]
    alone = len(counts) == 1
    batch = spec.get("batch", 0)
    key = spec["key"]
    keys: list[Any] | None = None
    if spec.get("schedules"):
        keys = [
            _key({"key": key, "schedule": s, "pidx": p}, i)
            for p, s in spec["schedules"]
            for i in range(len(s))
        ]
    window = spec["window"]
    request_latency = spec.get("request_latency", False)
    tally = Tally()
    req_lat: list[int] = []
    inflight: deque = deque()
    deadline = time.monotonic() + WORKER_DEADLINE_S
    issued = n = summed_at = 0
    stopping = False

    sync = window == 1 and request_latency and keys is None and not batch

    def issue() -> None:
        nonlocal issued
        t0 = time.monotonic_ns()
        if sync:  # window 1: the latency of the blocking call a user makes, not of a Work
            work = Work()
            try:
                work.set_result(ch.get(key=key, timeout=GET_TIMEOUT_S))
            except TimeoutError as exc:
                work.set_exception(exc)
        elif keys is not None:
            work = ch.get(key=keys[issued], async_op=True, timeout=WORKER_DEADLINE_S)
        elif batch:
            work = ch.get_batch(batch, key=key, async_op=True, timeout=GET_TIMEOUT_S)
        else:
            work = ch.get(key=key, async_op=True, timeout=GET_TIMEOUT_S)
        issued += 1
        inflight.append((work, t0))

    ready()
    go_wait()
    tally.t_start = time.monotonic_ns()
    while True:
        while not stopping and len(inflight) < window and (keys is None or issued < len(keys)):
            issue()
        if not inflight:
            break
        work, t0 = inflight.popleft()
        try:
            got = work.wait(WORKER_DEADLINE_S)
        except TimeoutError:
            if sum(counts) >= total or (keys is not None and n >= len(keys)):
                stopping = True
            elif time.monotonic() > deadline:
                raise TimeoutError(
                    f"consumer got {n}; all together {sum(counts)}/{total}"
                ) from None
            continue
        now = time.monotonic_ns()
        for item in got if batch else (got,):
            seq, t_sent = fac.check(item)
            tally.add(seq, t_sent, now)
            n += 1
        if request_latency:
            req_lat.append(now - t0)
        counts[slot] = n
        # summing the shared counters costs ~2 us (ctypes): alone, n says it; with peers, look
        # every 16 items (a late stop only issues gets that time out after the last item)
        if alone:
            done = n >= total
        elif n - summed_at >= 16:
            summed_at, done = n, sum(counts) >= total
        else:
            done = False
        if done or (keys is not None and n >= len(keys)):
            stopping = True
    ch.close()
    result = tally.result()
    if request_latency:
        result["lat_ns"] = np.asarray(req_lat, dtype=np.int64)
    return result


# -- running one case -------------------------------------------------------------------------


@dataclasses.dataclass
class Measured:
    """Raw figures of one run of a case."""

    items: int
    seconds: float
    lat_ns: np.ndarray
    rss_peak: int | None = None
    extra: dict = dataclasses.field(default_factory=dict)


def _stream_figures(prod: list[dict], cons: list[dict], t_go: int) -> tuple[float, np.ndarray]:
    t0 = min([r["t_start"] for r in prod] or [t_go])
    t1 = max(r["t_end"] for r in cons)
    lat = np.concatenate([r["lat_ns"] for r in cons]) if cons else np.zeros(0, np.int64)
    return max(1e-9, (t1 - t0) / 1e9), lat


def _check_all(cons: list[dict], counts: list[int]) -> None:
    verify_seqs([r["seqs"] for r in cons], counts)


def _producer_specs(
    case: Case, address: str, key: str, group: int = 1, schedules: list[np.ndarray] | None = None
) -> list[dict]:
    return [
        {
            "name": f"producer-{p}",
            "address": address,
            "key": key,
            "pidx": p,
            "n": n,
            "ptype": case.ptype,
            "size": case.size,
            "window": case.window,
            "group": group,
            "schedule": None if schedules is None else schedules[p],
            "in_slot": case.in_slot,
            # shared-memory slots a producer preallocates before the clock starts (a real
            # producer does it once at start-up): its puts in flight, the queue, and the gets
            # in flight may all hold one (docs/shm.md, pool sizing)
            "shm_slots": (case.window * group + (case.maxsize or case.window) + case.window + 2)
            if case.shm and case.reserve
            else 0,
        }
        for p, n in enumerate(split(case.messages, case.producers))
    ]


def _schedules(case: Case) -> list[np.ndarray]:
    """Per producer, a shuffled key index for each of its items (each key used evenly)."""
    out = []
    for p, n in enumerate(split(case.messages, case.producers)):
        rng = np.random.default_rng(p)
        out.append(rng.permutation(np.arange(n) % max(1, case.keys)).astype(np.int32))
    return out


def run_channel_stream(case: Case, address: str | None, tmpdir: str) -> Measured:
    """Concurrent producers and consumers (``channel``, ``random_key``, ``batch``, ``hooks``)."""
    collector = dispatcher = None
    identities: list[str | None] = [None] * case.consumers
    if case.hooks:
        collector = f"{__name__}:BenchFlatten" if case.ptype == "dataclass" else "flatten_batch"
        dispatcher = "round_robin"
        identities = [f"bench:{c}" for c in range(case.consumers)]
    target = Target(
        case, address, tmpdir, collector, dispatcher, consumers=[i for i in identities if i] or None
    )
    try:
        with Workers() as w:
            counts_arr = w.counters(case.consumers)
            per_prod = split(case.messages, case.producers)
            schedules = _schedules(case) if case.scenario == "random_key" else None
            key = target.key_prefix
            for spec in _producer_specs(
                case,
                target.address,
                key,
                group=HOOK_BATCH if case.hooks else 1,
                schedules=schedules,
            ):
                w.start(channel_producer, spec)
            for c in range(case.consumers):
                spec = {
                    "name": f"consumer-{c}",
                    "address": target.address,
                    "key": key,
                    "identity": identities[c],
                    "ptype": case.ptype,
                    "size": case.size,
                    "window": case.window,
                    "counts": counts_arr,
                    "slot": c,
                    "total": case.messages,
                }
                if schedules is not None:
                    spec["schedules"] = [
                        (p, schedules[p]) for p in range(case.producers) if p % case.consumers == c
                    ]
                if case.scenario == "batch":
                    spec["batch"] = BATCH_ITEMS
                    spec["window"] = max(2, case.window // 32)
                    spec["request_latency"] = True
                w.start(channel_consumer, spec)
            w.wait_ready()
            t_go = w.go()
            results = w.collect(case.producers + case.consumers)
        prod = [r for r in results if r["name"].startswith("producer")]
        cons = [r for r in results if r["name"].startswith("consumer")]
        _check_all(cons, per_prod)
        seconds, lat = _stream_figures(prod, cons, t_go)
        extra = {}
        if case.scenario == "batch":
            extra["batches"] = int(sum(r["lat_ns"].size for r in cons))
        return Measured(case.messages, seconds, lat, target.peak_rss(), extra)
    finally:
        target.close()


def run_put_get(
    case: Case, address: str | None, tmpdir: str, get_phase: bool = True
) -> tuple[Measured, Measured | None]:
    """Puts alone (``put_only``), then gets from the filled queue (``get_only``)."""
    target = Target(case, address, tmpdir)
    try:
        with Workers() as w:
            counts_arr = w.counters(case.consumers)
            per_prod = split(case.messages, case.producers)
            key = target.key_prefix
            # the fill of a get_only case keeps at least 64 puts in flight (its gets use --window)
            fill = case if not get_phase else dataclasses.replace(case, window=max(64, case.window))
            for spec in _producer_specs(fill, target.address, key):
                w.start(channel_producer, spec, group="put")
            if get_phase:
                for c in range(case.consumers):
                    w.start(
                        channel_consumer,
                        {
                            "name": f"consumer-{c}",
                            "address": target.address,
                            "key": key,
                            "ptype": case.ptype,
                            "size": case.size,
                            "window": case.window,
                            "counts": counts_arr,
                            "slot": c,
                            "total": case.messages,
                            "request_latency": True,
                        },
                        group="get",
                    )
            w.wait_ready()
            t_go = w.go("put")
            prod = w.collect(case.producers)
            t_put = (max(r["t_end"] for r in prod) - min(r["t_start"] for r in prod)) / 1e9
            put = Measured(
                case.messages,
                max(t_put, 1e-9),
                np.concatenate([r["lat_ns"] for r in prod]),
                target.peak_rss(),
            )
            put.extra["broker_rss_filled_mb"] = (target.rss() or 0) / MIB
            if not get_phase:
                return put, None
            w.join("put")  # the gets run alone, as the echo baseline's round trips do
            t_go = w.go("get")
            cons = w.collect(case.consumers)
        _check_all(cons, per_prod)
        t_get = (max(r["t_end"] for r in cons) - t_go) / 1e9
        lat = np.concatenate([r["lat_ns"] for r in cons])
        get = Measured(
            case.messages, max(t_get, 1e-9), lat, target.peak_rss(), {"put_seconds": t_put}
        )
        return put, get
    finally:
        target.close()


# -- baselines --------------------------------------------------------------------------------


def run_zmq_proxy(case: Case, tmpdir: str) -> Measured:
    """The raw relay: P producer DEALERs -> zmq.proxy (ROUTER/DEALER) -> C consumer DEALERs."""
    with Workers() as w:
        addr_q = w.ctx.Queue()
        hwm = max(2, case.window)
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
        t_go = w.go()
        results = w.collect(case.consumers)
        done.set()
        results += w.collect(case.producers)
        rss = read_proc_status(proxy_pid, "VmHWM")
    prod = [r for r in results if r["name"].startswith("producer")]
    cons = [r for r in results if r["name"].startswith("consumer")]
    _check_all(cons, per_prod)
    seconds, lat = _stream_figures(prod, cons, t_go)
    return Measured(case.messages, seconds, lat, rss)


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
        results = w.collect(case.producers + case.consumers)
    prod = [r for r in results if r["name"].startswith("producer")]
    cons = [r for r in results if r["name"].startswith("consumer")]
    _check_all(cons, per_prod)
    seconds, lat = _stream_figures(prod, cons, t_go)
    return Measured(case.messages, seconds, lat)


# -- the runner: cases, repeats, baselines ----------------------------------------------------


def _summarise(case: Case, kind: str, runs: list[Measured], latency: str) -> Result:
    """The median over repeats of each figure."""
    secs = statistics.median(r.seconds for r in runs)
    items_s = statistics.median(r.items / r.seconds for r in runs)
    nbytes = sum(part_sizes(case.ptype, case.size))
    pcts = [percentiles(r.lat_ns) for r in runs]
    rss = [r.rss_peak for r in runs if r.rss_peak]
    extra: dict[str, Any] = {}
    for r in runs:
        for k, v in r.extra.items():
            extra.setdefault(k, []).append(v)
    per_run = [round(r.items / r.seconds, 1) for r in runs]
    return Result(
        case=case.name,
        kind=kind,
        scenario=case.scenario,
        ptype=case.ptype,
        size=case.size,
        producers=case.producers,
        consumers=case.consumers,
        transport=case.transport,
        window=case.window,
        messages=case.messages,
        items_s=items_s,
        mb_s=items_s * nbytes / MIB,
        p50_us=statistics.median(p[0] for p in pcts),
        p99_us=statistics.median(p[1] for p in pcts),
        latency=latency,
        seconds=secs,
        rss_peak_mb=max(rss) / MIB if rss else None,
        repeats=len(runs),
        runs={"items_s": per_run, "p50_us": [round(p[0], 1) for p in pcts],
              "p99_us": [round(p[1], 1) for p in pcts]},
        extra={
            "runs_items_s": per_run,
            **{
                k: statistics.median(v) if all(isinstance(x, (int, float)) for x in v) else v
                for k, v in extra.items()
            },
        },
    )


LATENCY_KIND = {
    "channel": "e2e",
    "random_key": "e2e",
    "hooks": "e2e",
    "batch": "get_batch",
    "put_only": "put",
    "get_only": "get",
}


class Runner:
    """Runs cases with repeats, and the baseline of each case once per distinct set-up."""

    def __init__(
        self, *, address: str | None, baseline: str, repeats: int, tmpdir: str, progress: Any = None
    ) -> None:
        self.address = address
        self.baseline = baseline
        self.repeats = max(1, repeats)
        self.tmpdir = tmpdir
        self.progress = progress
        self.rows: list[Result] = []
        self.notes: list[str] = []
        self._baselines: dict[tuple, Result | None] = {}

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress.update(1)

    def _logged(self, what: str, index: int, fn: Callable[[], Any]) -> Any:
        """``fn()``, run ``index`` of ``what``, shown by the progress display."""
        run = getattr(self.progress, "run", None)
        return fn() if run is None else run(what, index, self.repeats, fn)

    def measure(self, case: Case) -> Result:
        """Run ``case`` (repeats), add its row (and its baseline's row) and return it."""
        return self.measure_together([case])[0]

    def measure_together(
        self, cases: list[Case], baselines_of: list[Case] = (), fresh: bool = False
    ) -> list[Result]:
        """Run ``cases`` in rounds, one run of each per round, ``repeats`` rounds, together with
        the zmq/mp baselines they (and ``baselines_of``) are compared to, where not measured yet
        (``fresh``: measure them again, alongside these cases).

        Interleaving pairs each run with the runs it is compared to in time: on a shared
        machine the rate of every transport drifts by 10-30 % over minutes, and a block of
        repeats of one side then a block of the other puts that drift into the ratio."""
        cases = [bounded(c) for c in cases]
        keys: list[tuple] = []
        for c in [*cases, *(bounded(b) for b in baselines_of)]:
            key = self._baseline_key(c)
            if (
                key is not None
                and key[0] != "ray"
                and (fresh or key not in self._baselines)
                and key not in keys
            ):
                keys.append(key)
        case_runs: list[list] = [[] for _ in cases]
        base_runs: dict[tuple, list[Measured]] = {key: [] for key in keys}
        for i in range(self.repeats):
            for runs, case in zip(case_runs, cases, strict=True):
                runs.append(self._logged(case.name, i, lambda c=case: self._run_case(c)))
            for key in keys:
                base_runs[key].append(self._logged(
                    _baseline_label(*key), i, lambda k=key: self._run_baseline_once(*k)))
        for key in keys:
            self._store_baseline(key, self._summarise_baseline(*key, base_runs[key]))
        return [self._case_result(c, runs) for c, runs in zip(cases, case_runs, strict=True)]

    def _run_case(self, case: Case) -> Any:
        if case.scenario in ("put_only", "get_only"):
            return run_put_get(
                case, self.address, self.tmpdir, get_phase=case.scenario == "get_only"
            )
        return run_channel_stream(case, self.address, self.tmpdir)

    def _case_result(self, case: Case, runs: list) -> Result:
        self._tick()
        if case.scenario in ("put_only", "get_only"):
            chosen = [r[1] if case.scenario == "get_only" else r[0] for r in runs]
            result = _summarise(case, "zchannel", chosen, LATENCY_KIND[case.scenario])
            if case.scenario == "get_only":
                both = [r[0].seconds + r[1].seconds for r in runs]
                result.extra["put_then_get_items_s"] = case.messages / statistics.median(both)
                result.extra["put_items_s"] = statistics.median(
                    r[0].items / r[0].seconds for r in runs
                )
        else:
            result = _summarise(case, "zchannel", runs, LATENCY_KIND[case.scenario])
        base = self.baseline_for(case)
        if base is not None:
            result.baseline = base.case
            p50 = case.scenario == "get_only" and case.window == 1 and base.p50_us > 0
            set_ratio(result, base, "p50" if p50 else "items/s")
        self.rows.append(result)
        return result

    def _baseline_key(self, case: Case) -> tuple | None:
        """(kind, the baseline's own case) for ``case``; None without a baseline."""
        if self.baseline == "none" or not case.compare:
            return None
        kind = self.baseline
        if kind == "zmq":
            kind = "zmq.echo" if case.scenario == "get_only" else "zmq.proxy"
        base_case = dataclasses.replace(
            case, scenario="channel", keys=1, hooks=False, label="", shm=True, maxsize=0,
            in_slot=False,
        )
        if kind == "zmq.echo":
            base_case = dataclasses.replace(
                base_case, producers=1, consumers=1, scenario="get_only"
            )
        if kind == "ray":
            base_case = dataclasses.replace(base_case, producers=1, consumers=1)
        return kind, base_case

    def baseline_for(self, case: Case) -> Result | None:
        """The baseline row for ``case`` (measured once per distinct set-up)."""
        key = self._baseline_key(case)
        if key is None:
            return None
        if key not in self._baselines:
            kind, base_case = key
            if kind == "ray":
                self._store_baseline(key, self._run_ray_baseline(base_case))
            else:
                runs = [self._logged(_baseline_label(kind, base_case), i,
                                     lambda: self._run_baseline_once(kind, base_case))
                        for i in range(self.repeats)]
                self._store_baseline(key, self._summarise_baseline(kind, base_case, runs))
        return self._baselines[key]

    def _store_baseline(self, key: tuple, result: Result | None) -> None:
        self._baselines[key] = result
        if result is not None:
            self.rows.append(result)

    def _run_baseline_once(self, kind: str, case: Case) -> Measured:
        if kind == "zmq.proxy":
            return run_zmq_proxy(case, self.tmpdir)
        if kind == "zmq.echo":
            return run_zmq_echo(case, self.tmpdir)
        if kind == "mp":
            return run_mp_queue(case, self.tmpdir)
        raise click.BadParameter(f"unknown baseline {kind!r}")

    def _summarise_baseline(self, kind: str, case: Case, runs: list[Measured]) -> Result:
        self._tick()
        latency = "rtt" if kind == "zmq.echo" else "e2e"
        label = _baseline_label(kind, case)
        return _summarise(dataclasses.replace(case, label=label), kind, runs, latency)

    def _run_ray_baseline(self, case: Case) -> Result | None:
        if not ray_available():
            self._note("ray baseline skipped: `ray` is not importable (pip install ray)")
            return None
        raw = [
            self._logged("ray", i, lambda: run_ray_baselines(
                case.ptype, case.size, case.messages, case.window))
            for i in range(self.repeats)
        ]
        label = f"{fmt_size(case.size)} {case.producers}P/{case.consumers}C w{case.window}"
        actor = [_ray_measured(r["ray.actor"], case.messages) for r in raw]
        self.rows.append(
            _summarise(
                dataclasses.replace(case, label=f"ray.actor {case.ptype} {label}"),
                "ray.actor",
                actor,
                "e2e",
            )
        )
        runs = [_ray_measured(r["ray.queue"], case.messages) for r in raw]
        self._tick()
        return _summarise(
            dataclasses.replace(case, label=f"ray.queue {case.ptype} {label}"),
            "ray.queue",
            runs,
            "e2e",
        )

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def _baseline_label(kind: str, case: Case) -> str:
    return f"{kind} {case.ptype} {fmt_size(case.size)} {case.producers}P/{case.consumers}C w{case.window}"


def _ray_measured(res: dict, n: int) -> Measured:
    verify_seqs([res["seqs"]], [n])
    return Measured(n, max(1e-9, (res["t_end"] - res["t_start"]) / 1e9), res["lat_ns"])


# -- scenarios --------------------------------------------------------------------------------


def scenario_cases(scenario: str, base: Case, keys: int | None) -> list[Case]:
    """The cases of one scenario, from the options in ``base``."""
    if scenario == "quick":
        small = dataclasses.replace(base, ptype="bytes", size=64, messages=min(base.messages, 5000))
        return [
            dataclasses.replace(small, scenario="channel"),
            dataclasses.replace(small, scenario="get_only", window=1, messages=1000),
            dataclasses.replace(small, scenario="batch"),
            dataclasses.replace(
                base, scenario="channel", ptype="tensor", size=MIB, messages=256, window=8
            ),
        ]
    if scenario == "all":
        return [c for s in ALL_SCENARIOS for c in scenario_cases(s, base, keys)]
    if scenario == "random_key":
        return [
            dataclasses.replace(
                base, scenario="random_key", keys=keys or min(DEFAULT_KEYS, base.messages)
            )
        ]
    if scenario == "hooks":
        consumers = max(2, base.consumers)
        return [
            dataclasses.replace(base, scenario="hooks", consumers=consumers, hooks=False),
            dataclasses.replace(base, scenario="hooks", consumers=consumers, hooks=True),
        ]
    return [dataclasses.replace(base, scenario=scenario)]


def run_scenario(runner: Runner, scenario: str, base: Case, keys: int | None) -> None:
    for case in scenario_cases(scenario, base, keys):
        if case.hooks and runner.address:
            runner._note("hooks case skipped with --address (hooks are the broker's settings)")
            continue
        runner.measure(case)


# -- targets T1-T8 ----------------------------------------------------------------------------


def _target(
    name: str,
    desc: str,
    measured: float,
    reference: float,
    unit: str,
    threshold: float,
    higher: bool = True,
    note: str = "",
) -> TargetResult:
    ratio = measured / reference if reference else float("nan")
    passed = ratio >= threshold if higher else ratio <= threshold
    return TargetResult(
        name, desc, measured, reference, unit, ratio, threshold, higher, passed, note
    )


def measure_rss_target(runner: Runner, tmpdir: str) -> TargetResult:
    """T8: broker RSS holding 1 GiB of 16 MiB tensors, above its idle RSS; then drained and
    every tensor checked."""
    case = Case("put_only", ptype="tensor", size=16 * MIB, messages=64, window=4, shm=False)
    target = Target(case, runner.address, tmpdir)
    try:
        idle = target.rss() or 0
        with Workers() as w:
            counts_arr = w.counters(1)
            for spec in _producer_specs(case, target.address, target.key_prefix):
                w.start(channel_producer, spec, group="put")
            w.start(
                channel_consumer,
                {
                    "name": "consumer-0",
                    "address": target.address,
                    "key": target.key_prefix,
                    "ptype": case.ptype,
                    "size": case.size,
                    "window": 4,
                    "counts": counts_arr,
                    "slot": 0,
                    "total": case.messages,
                },
                group="get",
            )
            w.wait_ready()
            w.go("put")
            w.collect(1)
            held = target.rss() or 0
            peak = target.peak_rss() or 0
            w.go("get")
            (cons,) = w.collect(1)
        verify_seqs([cons["seqs"]], [case.messages])
    finally:
        target.close()
    delta = held - idle
    runner._tick()
    return _target(
        "T8",
        "broker RSS holding 1 GiB of 16 MiB tensors, above idle (GiB)",
        delta / (1 << 30),
        1.0,
        "GiB",
        1.1,
        higher=False,
        note=f"idle {idle / MIB:.0f} MiB, held {held / MIB:.0f} MiB, VmHWM {peak / MIB:.0f} MiB",
    )


def run_targets(runner: Runner, base: Case, tmpdir: str) -> list[TargetResult]:
    """T1-T4 and T6-T8 of the issue (T5, the Ray queue, is ``--baseline ray``)."""
    small = dataclasses.replace(
        base, ptype="bytes", size=64, transport="ipc", producers=1, consumers=1, window=64
    )
    out: list[TargetResult] = []
    saved = runner.baseline
    runner.baseline = "zmq"
    try:
        # 4 GiB per run, as T9: over 1 GiB the start (connections, first allocations) weighs
        # in and single runs of both sides swing by +-20 %
        c1 = Case(
            "channel", ptype="tensor", size=16 * MIB, messages=256, window=8, max_bytes=4 << 30
        )
        t1 = runner.measure(
            dataclasses.replace(
                c1,
                label="T1 channel tensor 16MiB 1P/1C ipc frames",
                shm=False,  # the socket path; T9 measures the shared-memory path
            )
        )
        b1 = runner.baseline_for(bounded(c1))
        out.append(
            _target(
                "T1", "16 MiB tensors 1P->1C ipc, MB/s vs zmq.proxy", t1.mb_s, b1.mb_s, "MB/s", 0.90
            )
        )
        # each target's case runs in rounds with what it is compared to (Runner.measure_together)
        (t2,) = runner.measure_together(
            [
                dataclasses.replace(
                    small, scenario="get_only", label="T2 put(w64) then get(w64) 64B"
                )
            ],
            baselines_of=[dataclasses.replace(small, scenario="channel")],
        )
        b2 = runner.baseline_for(dataclasses.replace(small, scenario="channel"))
        composite = t2.extra["put_then_get_items_s"]
        out.append(
            _target(
                "T2",
                "64 B async puts (w64) then gets, items/s vs zmq.proxy",
                composite,
                b2.items_s,
                "items/s",
                0.30,
                note=f"put phase {t2.extra['put_items_s']:.0f}/s, get phase {t2.items_s:.0f}/s",
            )
        )
        t3 = runner.measure(
            dataclasses.replace(small, scenario="batch", label="T3 get_batch(64) 64B")
        )
        out.append(
            _target(
                "T3",
                "64 B via get_batch (64/batch), items/s vs zmq.proxy",
                t3.items_s,
                b2.items_s,
                "items/s",
                0.30,
            )
        )
        t4 = runner.measure(
            dataclasses.replace(
                small,
                scenario="get_only",
                window=1,
                messages=min(small.messages, 3000),
                label="T4 get latency 64B prefilled",
            )
        )
        b4 = runner.baseline_for(
            bounded(
                dataclasses.replace(
                    small, scenario="get_only", window=1, messages=min(small.messages, 3000)
                )
            )
        )
        out.append(
            _target(
                "T4",
                "get p50 latency, 64 B, prefilled vs raw echo p50 (us)",
                t4.p50_us,
                b4.p50_us,
                "us",
                1.3,
                higher=False,
            )
        )
        one, four = runner.measure_together(
            [
                dataclasses.replace(small, scenario="channel", label="T6 ref channel 64B 1P/1C"),
                dataclasses.replace(
                    small,
                    scenario="channel",
                    producers=4,
                    consumers=4,
                    label="T6 channel 64B 4P/4C",
                ),
            ]
        )
        out.append(
            _target(
                "T6",
                "64 B 4P/4C aggregate items/s vs 1P/1C",
                four.items_s,
                one.items_s,
                "items/s",
                0.8,
            )
        )
        k1, k10k = runner.measure_together(
            [
                dataclasses.replace(
                    small, scenario="random_key", keys=1, label="T7 ref random_key 64B keys=1"
                ),
                dataclasses.replace(
                    small, scenario="random_key", keys=10000, label="T7 random_key 64B keys=10000"
                ),
            ]
        )
        out.append(
            _target(
                "T7",
                "64 B over 10,000 keys vs 1 key, items/s",
                k10k.items_s,
                k1.items_s,
                "items/s",
                0.8,
            )
        )
        out.append(measure_rss_target(runner, tmpdir))
    finally:
        runner.baseline = saved
    out.extend(run_shm_targets(runner))
    return out


def measure_ray_actor(runner: Runner, case: Case) -> Result | None:
    """Pipelined Ray actor calls (``window`` in flight) on ``case``'s payloads, as a row."""
    key = ("ray.actor", case)
    if key in runner._baselines:
        return runner._baselines[key]
    result = None
    if not ray_available():
        runner._note("ray comparison skipped: `ray` is not importable (pip install ray)")
    else:
        raw = [
            runner._logged("ray.actor", i, lambda: run_ray_baselines(
                case.ptype, case.size, case.messages, case.window, queue=False))
            for i in range(runner.repeats)
        ]
        runs = [_ray_measured(r["ray.actor"], case.messages) for r in raw]
        label = f"ray.actor {case.ptype} {fmt_size(case.size)} 1P/1C w{case.window}"
        result = _summarise(dataclasses.replace(case, label=label), "ray.actor", runs, "e2e")
    runner._store_baseline(key, result)
    runner._tick()
    return result


SHM_STEPS = 8  # progress-bar length of the shm targets (cases + baselines)


def run_shm_targets(runner: Runner) -> list[TargetResult]:
    """T9 and T10 of the shared-memory issue: large tensors 1P -> 1C on this host, through
    shared memory (default copy-out consumer), against zmq.proxy and pipelined Ray actor calls
    measured in the same run."""
    saved = runner.baseline
    runner.baseline = "zmq"
    out: list[TargetResult] = []
    try:
        # maxsize = window: a bounded queue, like the baselines' (zmq HWM, Ray's window); the
        # producer's pool then covers every item in flight (see docs/shm.md, pool sizing)
        # 4 GiB per case: a steady state, not the first fill of the producer's pool (creating
        # and faulting in its segments costs the first ~400 MiB; docs/shm.md, pool sizing)
        c9 = bounded(
            Case(
                "channel", ptype="tensor", size=16 * MIB, messages=256, window=8, max_bytes=4 << 30
            )
        )
        # the same stream as a user writes it: default Channel.create (unbounded), nothing
        # reserved, 64 puts and 64 gets in flight (issue 17's burst); same rounds as T9
        c9d = dataclasses.replace(
            c9, window=64, max_inflight=64 * 16 * MIB, reserve=False, compare=False,
            label="T9d shm tensor 16MiB 1P/1C ipc defaults, windows 64",
        )
        # T9 with the producer writing each tensor in its slot (Channel.empty_shm): the put
        # sends the slot, so the row shows the stream without the producer's copy
        t9 = dataclasses.replace(c9, maxsize=8, label="T9 shm tensor 16MiB 1P/1C ipc maxsize=8")
        c9w = dataclasses.replace(t9, in_slot=True, label="T9w shm tensor 16MiB 1P/1C ipc maxsize=8, written in slots")
        # fresh: T1 measured the same zmq.proxy set-up earlier; T9 gets its own, run in rounds
        t9, t9w, t9d = runner.measure_together([t9, c9w, c9d], fresh=True)
        b9 = runner.baseline_for(c9)
        r9 = measure_ray_actor(runner, dataclasses.replace(c9, label=""))
        if r9 is not None:
            out.append(
                _target(
                    "T9",
                    "16 MiB tensors 1P->1C same host (shm, copy-out), MB/s vs Ray pipelined actor calls",
                    t9.mb_s,
                    r9.mb_s,
                    "MB/s",
                    2.0,
                )
            )
        out.append(
            _target(
                "T9",
                "16 MiB tensors 1P->1C same host (shm, copy-out), MB/s vs zmq.proxy",
                t9.mb_s,
                b9.mb_s,
                "MB/s",
                3.0,
            )
        )
        out.append(
            _target(
                "T9d",
                "16 MiB tensors, default settings (windows 64, unbounded, no reserve_shm), "
                "MB/s vs T9 tuned (same rounds)",
                t9d.mb_s,
                t9.mb_s,
                "MB/s",
                0.8,
            )
        )
        c10 = bounded(
            Case("channel", ptype="tensor", size=MIB, messages=4096, window=16, max_bytes=4 << 30)
        )
        t10 = runner.measure(
            dataclasses.replace(c10, maxsize=16, label="T10 shm tensor 1MiB 1P/1C ipc maxsize=16")
        )
        b10 = runner.baseline_for(c10)
        out.append(
            _target(
                "T10",
                "1 MiB tensors 1P->1C same host (shm, copy-out), MB/s vs zmq.proxy",
                t10.mb_s,
                b10.mb_s,
                "MB/s",
                2.0,
            )
        )
    finally:
        runner.baseline = saved
    return out


TARGET_STEPS = 14 + SHM_STEPS  # progress-bar length of the targets suite (cases + baselines)


# -- trajectory collector ---------------------------------------------------------------------

TRAJECTORY_STEPS = 8  # global steps streamed per trajectory case (unless --messages is given)


def trajectory_cases(steps: int, batch: int) -> list[TrajectoryCase]:
    """Rollout and pipeline mode: S=2 sources of B envs, N=8 chunks, C=8, A=7, AW=2."""
    return [
        TrajectoryCase(mode="rollout", batch=batch, steps=steps),
        TrajectoryCase(mode="pipeline", batch=batch, steps=steps),
    ]


def _trajectory_row(case: TrajectoryCase, kind: str, runs: list[dict], transport: str) -> Result:
    secs = statistics.median(r["seconds"] for r in runs)
    chunks_s = statistics.median(r["chunks"] / r["seconds"] for r in runs)
    nbytes = chunk_bytes(case)
    rss = [r["rss_peak"] for r in runs if r["rss_peak"]]
    return Result(
        case=f"{case.label} {kind}",
        kind=kind,
        scenario="trajectory",
        ptype="parts",
        size=nbytes,
        producers=case.num_sources,
        consumers=case.actors,
        transport=transport,
        window=case.window,
        messages=case.total_chunks,
        items_s=chunks_s,
        mb_s=chunks_s * nbytes / MIB,
        p50_us=float("nan"),
        p99_us=float("nan"),
        latency="-",
        seconds=secs,
        rss_peak_mb=max(rss) / MIB if rss else None,
        repeats=len(runs),
        runs={"items_s": [round(r["chunks"] / r["seconds"], 1) for r in runs]},
        extra={
            "runs_chunks_s": [round(r["chunks"] / r["seconds"], 1) for r in runs],
            "outputs": runs[0]["outputs"],
            "per_consumer": runs[0]["per_consumer"],
            "options": case.options(),
            "image": [3, case.image, case.image],
        },
    )


def run_trajectory(runner: Runner, base: Case, steps: int, batch: int) -> None:
    """Each mode through the ``embodied_trajectory`` collector, then the same halves through a
    channel without hooks; the collector row's ratio is collector / plain chunks/s."""
    if runner.address:
        raise click.BadParameter("--scenario trajectory starts its own brokers (no --address)")

    def address_for(name: str) -> str:
        if base.transport == "ipc":
            return f"ipc://{runner.tmpdir}/{name}.sock"
        return "tcp://127.0.0.1:0"

    for case in trajectory_cases(steps, batch):
        runs = {}
        for collector in (True, False):
            runs[collector] = [
                runner._logged(
                    f"{case.label} {'collector' if collector else 'plain'}", i,
                    lambda c=collector, t=case: run_trajectory_case(t, c, runner.tmpdir, address_for),
                )
                for i in range(runner.repeats)
            ]
            runner._tick()
        hooked = _trajectory_row(case, "collector", runs[True], base.transport)
        plain = _trajectory_row(case, "plain", runs[False], base.transport)
        set_ratio(hooked, plain, "chunks/s")
        runner.rows += [hooked, plain]
    runner._note(
        "trajectory rows: items/s = chunks/s (one PolicyPart + one EnvPart per chunk of B envs),"
        " MB/s = bytes of both halves put; outputs counted by consumers actor:i"
    )


# -- the command ------------------------------------------------------------------------------

_OPTION_NAMES = (
    "scenario",
    "payload_type",
    "payload_size",
    "messages",
    "producers",
    "consumers",
    "transport",
    "window",
    "baseline",
    "repeats",
    "keys",
    "address",
    "json_path",
    "trajectory_batch",
    "shm",
)


_CONFIG_ALIASES = {"json": "json_path", "num_producers": "producers",
                   "num_consumers": "consumers", "repeat": "repeats"}


def _apply_config(ctx: click.Context, path: str | None, values: dict[str, Any]) -> dict[str, Any]:
    """Values from ``[bench]`` of a TOML file, for options not given on the command line."""
    if not path:
        return values
    with open(path, "rb") as f:
        table = tomllib.load(f).get("bench", {})
    out = dict(values)
    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        key = _CONFIG_ALIASES.get(key, key)
        if key not in _OPTION_NAMES:
            raise click.BadParameter(f"unknown option {raw_key!r} in [bench] of {path}")
        if ctx.get_parameter_source(key) in (click.core.ParameterSource.DEFAULT, None):
            out[key] = value
    return out


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@click.command()
@click.option(
    "--scenario",
    type=click.Choice(SCENARIOS),
    default="quick",
    show_default=True,
    help="what to measure (quick: a short suite; targets: T1-T4, T6-T10; shm: T9, T9d (defaults vs tuned T9), T10)",
)
@click.option(
    "--payload-type", type=click.Choice(PAYLOAD_TYPES), default="bytes", show_default=True
)
@click.option(
    "--payload-size",
    default="64B",
    show_default=True,
    help="bytes per item: 64, 64B, 4KB, 16MB, 1GB",
)
@click.option(
    "--messages",
    type=click.IntRange(1),
    default=20000,
    show_default=True,
    help="items per case (large payloads are capped at 1 GiB per case)",
)
@click.option("--num-producers", "producers", type=click.IntRange(1, 64), default=1,
              show_default=True, help="producer processes per case")
@click.option("--num-consumers", "consumers", type=click.IntRange(1, 64), default=1,
              show_default=True, help="consumer processes per case")
@click.option("--producers", "old_producers", type=click.IntRange(1, 64),
              help="deprecated spelling of --num-producers (on `zchannel broker`, --producers "
                   "names producer groups)")
@click.option("--consumers", "old_consumers", type=click.IntRange(1, 64),
              help="deprecated spelling of --num-consumers")
@click.option("--transport", type=click.Choice(("ipc", "tcp")), default="ipc", show_default=True)
@click.option(
    "--window",
    type=click.IntRange(1, 1024),
    default=64,
    show_default=True,
    help="asynchronous operations in flight per worker",
)
@click.option(
    "--baseline", type=click.Choice(("zmq", "ray", "mp", "none")), default="zmq", show_default=True
)
@click.option(
    "--repeat",
    "--repeats",
    "repeats",
    type=click.IntRange(1, 20),
    default=3,
    show_default=True,
    help="runs per case (and baseline); the table shows medians and the spread",
)
@click.option(
    "--keys",
    type=click.IntRange(1),
    default=None,
    help="keys of the random_key scenario (default: up to 128)",
)
@click.option(
    "--trajectory-batch",
    type=click.IntRange(1),
    default=64,
    show_default=True,
    help="trajectory scenario: envs per source B (--messages sets the global steps, default 8)",
)
@click.option(
    "--shm",
    type=click.Choice(("on", "off")),
    default="on",
    show_default=True,
    help="same-host shared memory for arrays/tensors >= 1 MiB (off: frames only)",
)
@click.option("--address", default=None, help="measure the running broker at this address")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, writable=True, allow_dash=True),
    help="also write every row (with each repeat) and the machine description to this file; "
    "'-' prints the JSON on stdout and the report on stderr",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    help="a TOML file with a [bench] table of these options",
)
@click.pass_context
def bench(ctx: click.Context, config_path: str | None, **values: Any) -> None:
    """Benchmark a channel broker against raw-ZeroMQ (or mp, Ray) baselines.

    Starts what it needs (or measures --address), runs bounded load, checks every item and
    prints one table with a legend and the ratios in words (docs/benchmarks.md: how to read
    it); exits 1 on a lost, duplicated or corrupted item.  Progress goes to stderr.
    """
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C, so every worker and broker is ended in its finally block
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, previous))
    for old, new in (("old_producers", "producers"), ("old_consumers", "consumers")):
        count = values.pop(old)
        if count is not None:
            click.echo(f"warning: bench --{new} is deprecated; use --num-{new}", err=True)
            if ctx.get_parameter_source(new) is click.core.ParameterSource.DEFAULT:
                values[new] = count
    opts = _apply_config(ctx, config_path, values)
    size = parse_size(opts["payload_size"])
    base = Case(
        "channel",
        ptype=opts["payload_type"],
        size=size,
        messages=int(opts["messages"]),
        producers=int(opts["producers"]),
        consumers=int(opts["consumers"]),
        transport=opts["transport"],
        window=int(opts["window"]),
        shm=opts.get("shm", "on") == "on",
    )
    if not base.shm and "ZCHANNEL_SHM" not in os.environ:
        # brokers started here get shm_threshold=0; with --address the workers (spawned: they
        # inherit the environment) keep off shared memory themselves
        os.environ["ZCHANNEL_SHM"] = "0"
        ctx.call_on_close(lambda: os.environ.pop("ZCHANNEL_SHM", None))
    tunables = child_environ().get("GLIBC_TUNABLES")
    if tunables is not None and tunables != os.environ.get("GLIBC_TUNABLES"):
        # the workers (spawned: they inherit the environment) and the baselines' processes
        # copy as the brokers do (docs/shm.md, "Large copies")
        users_tunables = os.environ.get("GLIBC_TUNABLES")
        os.environ["GLIBC_TUNABLES"] = tunables
        ctx.call_on_close(lambda: _restore_env("GLIBC_TUNABLES", users_tunables))
    scenario = opts["scenario"]
    keys = opts.get("keys")
    machine = machine_description()
    targets: list[TargetResult] = []
    error: str | None = None
    with tempfile.TemporaryDirectory(prefix="zcb-", dir="/tmp") as tmpdir:
        n_steps = {"targets": TARGET_STEPS, "shm": SHM_STEPS, "trajectory": 4}.get(scenario)
        runner = Runner(
            address=opts.get("address"),
            baseline=opts["baseline"],
            repeats=int(opts["repeats"]),
            tmpdir=tmpdir,
        )
        if n_steps is None:  # the cases and their distinct baselines
            cases = [bounded(c) for c in scenario_cases(scenario, base, keys)]
            n_steps = len(cases) + len({runner._baseline_key(c) for c in cases} - {None})
        started = time.monotonic()
        try:
            with Progress(f"zchannel bench {scenario}", n_steps, runner.repeats) as bar:
                runner.progress = bar
                if scenario == "targets":
                    targets = run_targets(runner, base, tmpdir)
                elif scenario == "shm":
                    targets = run_shm_targets(runner)
                elif scenario == "trajectory":
                    given = ctx.get_parameter_source("messages") not in (
                        click.core.ParameterSource.DEFAULT,
                        None,
                    ) or (config_path and "messages" in opts and opts["messages"] != 20000)
                    steps = int(opts["messages"]) if given else TRAJECTORY_STEPS
                    run_trajectory(runner, base, steps, int(opts["trajectory_batch"]))
                else:
                    run_scenario(runner, scenario, base, keys)
        except Mismatch as exc:
            error = f"content check failed: {exc}"
        except (ChannelError, RuntimeError, TimeoutError, OSError) as exc:
            error = f"benchmark failed: {exc}"
        elapsed = time.monotonic() - started
    # with --json - the JSON owns stdout and the report goes to stderr
    out = (lambda line: click.echo(line, err=True)) if opts.get("json_path") == "-" else click.echo
    out(f"zchannel bench {scenario}: {runner.repeats} run(s) per case, medians shown; "
        f"{elapsed:.1f}s")
    out(f"machine: {machine['cpu_count']} CPUs ({machine['cpu_model']}), load average "
        f"{machine['loadavg'][0]:.1f}, python {machine['python']}, torch {machine['torch']}, "
        f"pyzmq {machine['pyzmq']} (libzmq {machine['libzmq']})")
    warnings = print_report(runner.rows, targets, runner.notes, out)
    if opts.get("json_path"):
        options = {k: opts.get(k) for k in _OPTION_NAMES}
        options["payload_bytes"] = size
        write_json(opts["json_path"], machine, options, runner.rows, targets, runner.notes,
                   error is None, error, warnings)
    if error is not None:
        raise BenchFailure(error)
