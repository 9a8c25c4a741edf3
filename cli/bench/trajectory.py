"""``zchannel bench --scenario trajectory``: the ``embodied_trajectory`` collector in a broker.

Producers (one per source rank) put ``PolicyPart`` + ``EnvPart`` halves of every chunk of
``steps`` global steps; consumers with identities ``actor:i`` get the outputs (``Trajectory`` in
rollout mode, ``ActorBatch`` in pipeline mode) and count them.  The plain path puts the same
halves (the same bytes) through a channel without hooks, and its consumers count the halves.
The collector row's ratio is collector / plain chunks/s.  The command loads this module only
for this scenario (it imports ``zchannel.embodied``, which registers the transport types).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import click
import torch
from zchannel.broker import Channel
from zchannel.cli.bench.cases import MIB, Case
from zchannel.cli.bench.payloads import Mismatch, lost_items
from zchannel.cli.bench.report import Result, set_ratio
from zchannel.cli.bench.runner import Runner
from zchannel.cli.bench.workers import (
    GET_TIMEOUT_S,
    WORKER_DEADLINE_S,
    Workers,
    read_proc_status,
)
from zchannel.embodied import (
    ActorBatch,
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    Trajectory,
    TrajectoryKey,
    TrajectoryPlan,
    TrajectorySource,
)


@dataclasses.dataclass(frozen=True)
class TrajectoryCase:
    """One collector set-up: plan options, image size and how many global steps to stream."""

    mode: str = "rollout"
    num_sources: int = 2
    batch: int = 64  # B, envs per source
    chunks: int = 8  # N
    action_chunks: int = 8  # C
    action_dim: int = 7  # A
    actors: int = 2  # AW
    image: int = 64  # observation 3 x image x image uint8 per env
    steps: int = 8
    micro_batch_size: int | None = None
    window: int = 8

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = dict(
            mode=self.mode,
            num_sources=self.num_sources,
            source_batch_size=self.batch,
            num_chunks=self.chunks,
            rollout_epochs=1,
            actor_world_size=self.actors,
            num_action_chunks=self.action_chunks,
            action_dim=self.action_dim,
            gamma=0.99,
            gae_lambda=0.95,
        )
        if self.mode == "pipeline":
            opts["micro_batch_size"] = self.micro_batch_size or self.default_micro_batch()
        return opts

    def default_micro_batch(self) -> int:
        """The largest of 64, 32, ... dividing one actor's rows (num_chunks * actor_width)."""
        rows = self.chunks * self.num_sources * self.batch // self.actors
        mbs = 64
        while rows % mbs:
            mbs //= 2
        return mbs

    @property
    def total_chunks(self) -> int:
        return self.num_sources * self.steps * self.chunks

    def plan(self) -> Any:
        return TrajectoryPlan.from_options(self.options())

    def expected_outputs(self) -> int:
        """Outputs of the collector over all steps."""
        plan = self.plan()
        if self.mode == "pipeline":
            per_actor = plan.num_chunks * plan.actor_width // plan.micro_batch_size
            return self.steps * self.actors * per_actor
        return self.steps * self.num_sources * plan.shards_per_source

    @property
    def label(self) -> str:
        mbs = f" mbs={self.options()['micro_batch_size']}" if self.mode == "pipeline" else ""
        return (
            f"trajectory {self.mode} S={self.num_sources} B={self.batch} N={self.chunks} "
            f"C={self.action_chunks} A={self.action_dim} AW={self.actors}{mbs}"
        )


def make_parts(case: TrajectoryCase, step: int, rank: int, chunk: int) -> tuple[Any, Any]:
    """The ``PolicyPart`` and ``EnvPart`` of one chunk of source ``rank`` (valid halves: GAE
    inputs with ``prev_values``, final and bootstrap values on the epoch's last chunk)."""
    B, C, A = case.batch, case.action_chunks, case.action_dim
    D = C * A
    key = TrajectoryKey(step, 0, rank, 0, chunk)
    sources = [TrajectorySource(key, B, 0)]
    cols = (torch.arange(B, dtype=torch.float32) + rank * B).reshape(B, 1)
    gen = torch.Generator().manual_seed((step * 1000 + rank) * 1000 + chunk)
    images = torch.randint(0, 256, (B, 3, case.image, case.image), dtype=torch.uint8, generator=gen)
    obs = {"main_images": images, "states": cols.expand(B, 8).clone()}
    policy = PolicyPart(
        sources,
        obs,
        output=PolicyOutput(
            forward_inputs={"action": torch.randn(B, D, generator=gen)},
            prev_logprobs=torch.full((B, D), -0.5),
            prev_values=0.1 * cols + 0.01 * chunk,
            versions=torch.full((B, D), float(step)),
        ),
    )
    zeros = torch.zeros(B, C, dtype=torch.bool)
    last = chunk == case.chunks - 1
    env = EnvPart(
        sources,
        EnvTransition(
            rewards=torch.rand(B, C, generator=gen),
            dones=zeros,
            terminations=zeros,
            truncations=zeros,
        ),
        final_prev_values=(0.1 * cols + 1.0) if last else None,
        bootstrap_values=(0.1 * cols + 1.0) if last else None,
        initial_transition=(
            EnvTransition(dones=zeros, terminations=zeros, truncations=zeros)
            if chunk == 0
            else None
        ),
    )
    return policy, env


def part_bytes(part: Any) -> int:
    """Bytes of the tensors of a part (what travels as frames)."""
    total = 0
    stack = [part]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
    return total


def chunk_bytes(case: TrajectoryCase) -> int:
    """Bytes of both halves of one chunk (the last chunk carries a few more)."""
    return (
        sum(part_bytes(p) for c in range(case.chunks) for p in make_parts(case, 0, 0, c))
        // case.chunks
    )


def trajectory_producer(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """Puts both halves of every chunk of its source rank, ``window`` puts in flight."""
    case: TrajectoryCase = spec["case"]
    rank = spec["rank"]
    ch = Channel.connect(spec["address"])
    # distinct steps need distinct parts (keys); built before the clock starts
    halves = [
        half
        for step in range(case.steps)
        for chunk in range(case.chunks)
        for half in make_parts(case, step, rank, chunk)
    ]
    inflight: deque = deque()
    ready()
    go_wait()
    t_start = time.monotonic_ns()
    for half in halves:
        if len(inflight) >= case.window:
            inflight.popleft().wait(WORKER_DEADLINE_S)
        inflight.append(ch.put(half, async_op=True))
    for work in inflight:
        work.wait(WORKER_DEADLINE_S)
    t_end = time.monotonic_ns()
    ch.close()
    return {"t_start": t_start, "t_end": t_end, "count": len(halves)}


def trajectory_consumer(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """Gets (identity ``actor:i``) until all consumers together got ``total`` items; checks
    each item's type (and a Trajectory's / ActorBatch's shape)."""
    case: TrajectoryCase = spec["case"]
    expected: dict[str, type | tuple[type, ...]] = {
        "Trajectory": Trajectory, "ActorBatch": ActorBatch, "parts": (PolicyPart, EnvPart)}
    expect = expected[spec["expect"]]
    ch = Channel.connect(spec["address"], identity=spec["identity"])
    counts, slot, total = spec["counts"], spec["slot"], spec["total"]
    window = 4
    inflight: deque = deque()
    deadline = time.monotonic() + WORKER_DEADLINE_S
    n = 0
    stopping = False
    t_end = 0
    ready()
    go_wait()
    t_start = time.monotonic_ns()
    while True:
        while not stopping and len(inflight) < window:
            inflight.append(ch.get(async_op=True, timeout=GET_TIMEOUT_S))
        if not inflight:
            break
        work = inflight.popleft()
        try:
            item = work.wait(WORKER_DEADLINE_S)
        except TimeoutError:
            if sum(counts) >= total:
                stopping = True
            elif time.monotonic() > deadline:
                raise lost_items(spec["identity"], n, sum(counts), total) from None
            continue
        t_end = time.monotonic_ns()
        if not isinstance(item, expect):
            raise Mismatch(f"{spec['identity']} got a {type(item).__name__}, not {spec['expect']}")
        if isinstance(item, Trajectory):
            if item.actions is None:
                raise Mismatch("a Trajectory without actions")
            width = tuple(item.actions.shape)
            if width[-1] != case.action_chunks * case.action_dim:
                raise Mismatch(f"Trajectory actions of shape {width}")
        n += 1
        counts[slot] = n
        if sum(counts) >= total:
            stopping = True
    ch.close()
    return {"t_start": t_start, "t_end": t_end, "count": n}


def check_counts(cons: list[dict], total: int, what: str) -> None:
    """``Mismatch`` unless the consumers together got exactly ``total`` outputs."""
    got = sum(r["count"] for r in cons)
    if got != total:
        raise Mismatch(f"{what}: received {got} outputs, expected {total}")


def stream_seconds(prod: list[dict], cons: list[dict]) -> float:
    t0 = min(r["t_start"] for r in prod)
    t1 = max(r["t_end"] for r in cons)
    return max(1e-9, (t1 - t0) / 1e9)


def run_trajectory_case(
    case: TrajectoryCase, collector: bool, tmpdir: str, address_for: Callable[[str], str]
) -> dict:
    """One run: ``num_sources`` producers, ``actors`` consumers, through the collector (or a
    plain channel).  Returns chunks, seconds, outputs and the broker's peak RSS."""
    name = f"bench-traj-{'c' if collector else 'p'}-{time.monotonic_ns() % 10**9}"
    kwargs: dict[str, Any] = {}
    if collector:
        kwargs = dict(
            collector="embodied_trajectory",
            dispatcher="embodied_trajectory",
            consumers={"actor": case.actors},
            options=case.plan().to_options(),
        )
    ch = Channel.create(name, address=address_for(name), **kwargs)
    try:
        pid = int(ch.stats().get("pid") or 0)
        total = case.expected_outputs() if collector else 2 * case.total_chunks
        expect = (
            ("ActorBatch" if case.mode == "pipeline" else "Trajectory") if collector else "parts"
        )
        with Workers() as w:
            counts = w.counters(case.actors)
            for r in range(case.num_sources):
                spec = {"name": f"producer-{r}", "address": ch.address, "case": case, "rank": r}
                w.start(trajectory_producer, spec)
            for a in range(case.actors):
                spec = {
                    "name": f"consumer-{a}",
                    "address": ch.address,
                    "identity": f"actor:{a}",
                    "case": case,
                    "expect": expect,
                    "counts": counts,
                    "slot": a,
                    "total": total,
                }
                w.start(trajectory_consumer, spec)
            w.wait_ready()
            w.go()
            results = w.collect(case.num_sources + case.actors)
        prod = [r for r in results if r["name"].startswith("producer")]
        cons = [r for r in results if r["name"].startswith("consumer")]
        check_counts(cons, total, f"{case.mode} {'collector' if collector else 'plain'}")
        rss = read_proc_status(pid, "VmHWM") if pid else None
        return {
            "chunks": case.total_chunks,
            "seconds": stream_seconds(prod, cons),
            "outputs": total,
            "per_consumer": [r["count"] for r in cons],
            "rss_peak": rss,
        }
    finally:
        ch.shutdown()


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
                runner.logged(
                    f"{case.label} {'collector' if collector else 'plain'}", i,
                    functools.partial(run_trajectory_case, case, collector, runner.tmpdir,
                                      address_for),
                )
                for i in range(runner.repeats)
            ]
            runner.tick()
        hooked = _trajectory_row(case, "collector", runs[True], base.transport)
        plain = _trajectory_row(case, "plain", runs[False], base.transport)
        set_ratio(hooked, plain, "chunks/s")
        runner.rows += [hooked, plain]
    runner.note(
        "trajectory rows: items/s = chunks/s (one PolicyPart + one EnvPart per chunk of B envs),"
        " MB/s = bytes of both halves put; outputs counted by consumers actor:i"
    )
