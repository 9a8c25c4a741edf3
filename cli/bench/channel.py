"""The channel under test: the broker (``Target``), its producer and consumer workers (run in
spawned processes) and one run of a streaming case (``run_channel_stream``) or of puts then
gets (``run_put_get``).

Latency: end-to-end (put issued -> item received, from the send time stamped in the item) for
streaming cases; request -> reply for ``put_only`` (the put acknowledgement), ``get_only`` (the
get) and ``batch`` (one ``get_batch``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
from zchannel.broker import Channel, Work
from zchannel.cli.bench.cases import MIB, Case, Measured, cpu_figures, split
from zchannel.cli.bench.payloads import (
    SEQ_SHIFT,
    PayloadFactory,
    Tally,
    checked_stream,
    lost_items,
    verify_consumers,
)
from zchannel.cli.bench.workers import (
    GET_TIMEOUT_S,
    WORKER_DEADLINE_S,
    Workers,
    read_proc_cpu_ns,
    read_proc_status,
)
from zchannel.hooks import register_collector
from zchannel.hooks.builtin import FlattenBatch

BATCH_ITEMS = 64
HOOK_BATCH = 8  # items per put in the hooks scenario (flattened by the collector)


@register_collector("bench_flatten")
class BenchFlatten(FlattenBatch):
    """``flatten_batch`` under a name whose module registers ``BenchSample``: used for the
    ``dataclass`` payload, whose tag the broker must know to decode the body."""


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
        self.journal: str | None = None
        if address:
            self.handle = Channel.connect(address)
            self.address = address
        else:
            name = f"bench-{uuid.uuid4().hex[:12]}"
            addr = f"ipc://{tmpdir}/{name}.sock" if case.transport == "ipc" else "tcp://127.0.0.1:0"
            extra: dict[str, Any] = {}
            if case.journal:  # a fresh journal on the disk of the run's temporary directory
                self.journal = tempfile.mkdtemp(prefix="journal-", dir=tmpdir)
                extra = {"journal": self.journal, "fsync": case.journal}
            spread = case.brokers > 1
            if spread:  # replicas on this host, keys spread over them by hash
                extra.update(distributed=True,
                             options={"cluster": cluster_file(tmpdir, name, case.brokers)})
            self.owned = Channel.create(
                name,
                address=None if spread else addr,
                collector=collector,
                dispatcher=dispatcher,
                consumers=consumers,
                shm_threshold=None if case.shm else 0,
                maxsize=case.maxsize,
                **extra,
            )
            self.handle = self.owned
            self.address = self.owned.address
        self.key_prefix = f"bench-{uuid.uuid4().hex[:8]}"
        stats = self.handle.stats()
        replicas = stats.get("replicas") or []
        pids = [int(r.get("pid") or 0) for r in replicas] if replicas else [stats.get("pid")]
        self.pids = [int(p) for p in pids if p]

    def peak_rss(self) -> int | None:
        """The peak RSS of the broker (the sum over the replicas of a spread channel)."""
        return _total(read_proc_status(p, "VmHWM") for p in self.pids)

    def cpu_ns(self) -> int | None:
        """The broker's CPU time so far (user + system, ns; summed over the replicas)."""
        return _total(read_proc_cpu_ns(p) for p in self.pids)

    def rss(self) -> int | None:
        return _total(read_proc_status(p, "VmRSS") for p in self.pids)

    def close(self) -> None:
        if self.owned is not None:
            self.owned.shutdown()
        else:
            self.handle.close()
        if self.journal is not None:
            shutil.rmtree(self.journal, ignore_errors=True)


def _total(values: Any) -> int | None:
    """The sum of ``values`` (None if there is none or one is unknown)."""
    got = list(values)
    return None if not got or any(v is None for v in got) else sum(got)


def cluster_file(tmpdir: str, name: str, brokers: int) -> str:
    """A cluster file of ``brokers`` replicas of ``name`` on this host (ipc sockets in
    ``tmpdir``): ``Channel.create(distributed=True)`` starts them all and spreads the keys
    over them by hash (docs/distributed.md)."""
    node = socket.gethostname()
    lines = [f'[cluster]\nname = "{name}"\n']
    for i in range(brokers):
        lines.append(f'[[replica]]\nnode = "{node}"\naddress = "ipc://{tmpdir}/{name}-{i}.sock"\n')
    path = os.path.join(tmpdir, f"{name}.cluster.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


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
    consumer = _Consumer(spec)
    ready()
    go_wait()
    return consumer.run()


class _Consumer:
    """One consumer process of a stream: its requests in flight, what it got and when it
    stops (all consumers together got ``total``, or its scheduled keys are done)."""

    def __init__(self, spec: dict) -> None:
        self.ch = Channel.connect(spec["address"], identity=spec.get("identity"))
        self.fac = PayloadFactory(spec["ptype"], spec["size"])
        self.counts, self.slot, self.total = spec["counts"], spec["slot"], spec["total"]
        self.alone = len(self.counts) == 1
        self.batch = spec.get("batch", 0)
        self.key = spec["key"]
        self.keys: list[Any] | None = None
        if spec.get("schedules"):
            self.keys = [
                _key({"key": self.key, "schedule": s, "pidx": p}, i)
                for p, s in spec["schedules"]
                for i in range(len(s))
            ]
        self.window = spec["window"]
        # views of the slots (copy=False): a full compare would read each item once more, so
        # those are checked by their header and last 4 KiB (PayloadFactory.check)
        self.copy = False if spec.get("views") else None
        self.request_latency = spec.get("request_latency", False)
        self.tally = Tally()
        self.req_lat: list[int] = []
        self.inflight: deque = deque()
        self.issued = self.n = self.summed_at = 0
        self.asked = 0  # items this consumer's get_batches asked for
        self.stopping = False
        # window 1: the latency of the blocking call a user makes, not of a Work
        self.sync = self.window == 1 and self.request_latency and self.keys is None and not self.batch

    def issue(self) -> None:
        """One more request in flight."""
        ch, key = self.ch, self.key
        # the request's start is read only when request latencies are recorded: a stream's
        # consumer then does per item what the baselines' consumers do (take, check, count)
        t0 = time.monotonic_ns() if self.request_latency else 0
        target = 0  # the items a get_batch asked for
        if self.sync:
            work = Work()
            try:
                work.set_result(ch.get(key=key, timeout=GET_TIMEOUT_S))
            except TimeoutError as exc:
                work.set_exception(exc)
        elif self.keys is not None:
            work = ch.get(key=self.keys[self.issued], async_op=True, timeout=WORKER_DEADLINE_S)
        elif self.batch:
            # alone, it asks for the stream's end, as a user who knows its length does: a
            # batch asking past it would wait out its timeout for items that never come
            target = min(self.batch, self.total - self.asked) if self.alone else self.batch
            self.asked += target
            work = ch.get_batch(target, key=key, async_op=True, timeout=GET_TIMEOUT_S)
        else:
            work = ch.get(key=key, async_op=True, timeout=GET_TIMEOUT_S, copy=self.copy)
        self.issued += 1
        self.inflight.append((work, t0, target))

    def run(self) -> dict:
        """Keep ``window`` requests in flight until done; the tally (and request latencies)."""
        keys, inflight = self.keys, self.inflight
        deadline = time.monotonic() + WORKER_DEADLINE_S
        self.tally.t_start = time.monotonic_ns()
        while True:
            while (not self.stopping and len(inflight) < self.window
                   and (keys is None or self.issued < len(keys))
                   and not (self.batch and self.alone and self.asked >= self.total)):
                self.issue()
            if not inflight:
                break
            work, t0, target = inflight.popleft()
            try:
                got = work.wait(WORKER_DEADLINE_S)
            except TimeoutError:
                self.asked -= target  # a get_batch that timed out took nothing: ask again
                self._timed_out(deadline)
                continue
            if target:  # one that timed out with part of its target took that part: ask again
                self.asked -= target - len(got)
            self._received(got, t0)
        self.ch.close()
        result = self.tally.result()
        if self.request_latency:
            result["lat_ns"] = np.asarray(self.req_lat, dtype=np.int64)
        return result

    def _timed_out(self, deadline: float) -> None:
        """A request timed out: stop if everything was got, fail past the deadline."""
        if sum(self.counts) >= self.total or (self.keys is not None and self.n >= len(self.keys)):
            self.stopping = True
        elif time.monotonic() > deadline:
            raise lost_items("consumer", self.n, sum(self.counts), self.total) from None

    def _received(self, got: Any, t0: int) -> None:
        """Check and count what a request got; stop when all consumers got everything."""
        now = time.monotonic_ns()
        for item in got if self.batch else (got,):
            seq, t_sent = self.fac.check(item, full=self.copy is None)
            self.tally.add(seq, t_sent, now)
            self.n += 1
        n = self.n
        if self.request_latency:
            self.req_lat.append(now - t0)
        self.counts[self.slot] = n
        # summing the shared counters costs ~2 us (ctypes): alone, n says it; with peers, look
        # every 16 items (a late stop only issues gets that time out after the last item)
        if self.alone:
            done = n >= self.total
        elif n - self.summed_at >= 16:
            self.summed_at, done = n, sum(self.counts) >= self.total
        else:
            done = False
        if done or (self.keys is not None and n >= len(self.keys)):
            self.stopping = True


def producer_specs(
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
            for spec in producer_specs(
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
                    "views": case.views,
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
            cpu0 = target.cpu_ns()
            t_go = w.go()
            results = w.collect(case.producers + case.consumers)
            cpu1 = target.cpu_ns()
        seconds, lat = checked_stream(results, per_prod, t_go)
        extra = cpu_figures(
            results, case.messages, None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        )
        if case.scenario == "batch":
            extra["batches"] = int(lat.size)  # one latency per batch a consumer got
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
            for spec in producer_specs(fill, target.address, key):
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
        verify_consumers(cons, per_prod)
        t_get = (max(r["t_end"] for r in cons) - t_go) / 1e9
        lat = np.concatenate([r["lat_ns"] for r in cons])
        get = Measured(
            case.messages, max(t_get, 1e-9), lat, target.peak_rss(), {"put_seconds": t_put}
        )
        return put, get
    finally:
        target.close()
