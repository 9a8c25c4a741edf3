"""The target suite of ``zchannel bench --targets``: T1-T4 with T2s, T6-T8 (``run_targets``)
and the shared-memory targets T9, T9d and T10 (``run_shm_targets``, also ``--scenario shm``,
which also reports the row T9w: T9 with the producer writing its tensors in slots).

Each target is a ratio of a measured figure to a reference measured in the same run; its pass
mark is data, the ``[targets]`` table of ``configs/bench_targets.toml`` (``load_thresholds``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click
from zchannel.broker.host.shipped import shipped_path
from zchannel.broker.host.toml import read_toml
from zchannel.cli.bench.cases import MIB, Case, bounded
from zchannel.cli.bench.channel import (
    Target,
    channel_consumer,
    channel_producer,
    producer_specs,
)
from zchannel.cli.bench.payloads import verify_seqs
from zchannel.cli.bench.report import Result, TargetResult
from zchannel.cli.bench.runner import Runner, measure_ray_actor
from zchannel.cli.bench.workers import Workers

SHM_STEPS = 10  # progress-bar length of the shm targets (cases + baselines)
TARGET_STEPS = 16 + SHM_STEPS  # progress-bar length of the targets suite (cases + baselines)
TARGETS_FILE = "bench_targets.toml"  # shipped in zchannel.configs (configs/ of a checkout)


@dataclasses.dataclass(frozen=True)
class Threshold:
    """A target's pass mark: its ratio must be >= ``value`` (``higher``) or <= ``value``."""

    value: float
    higher: bool


def default_targets_file() -> Path:
    """``configs/bench_targets.toml`` as installed with the package (``zchannel.configs``)."""
    try:
        return shipped_path(TARGETS_FILE)
    except FileNotFoundError as exc:
        raise click.ClickException(
            f"target thresholds not found ({exc}); pass --config FILE with a [targets] table"
        ) from None


def parse_thresholds(table: Any, source: str) -> dict[str, Threshold]:
    """``{"T1": {"min": 0.9}, "T4": {"max": 1.3}, ...}`` -> thresholds by target name."""
    if not isinstance(table, dict) or not table:
        raise click.ClickException(f"{source}: [targets] must be a table of target thresholds")
    out = {}
    for name, entry in table.items():
        bounds = set(entry) if isinstance(entry, dict) else set()
        value = entry.get("min", entry.get("max")) if len(bounds) == 1 else None
        if bounds not in ({"min"}, {"max"}) or isinstance(value, bool) or not isinstance(
            value, (int, float)
        ):
            raise click.ClickException(
                f"{source}: targets.{name} must be {{ min = NUMBER }} or {{ max = NUMBER }}, "
                f"got {entry!r}"
            )
        if not math.isfinite(value):  # nan never passes, inf always or never
            raise click.ClickException(
                f"{source}: targets.{name} must be a finite number, got {entry!r}")
        out[name] = Threshold(float(value), "min" in bounds)
    return out


def check_target_names(names: Iterable[str], known: Iterable[str], source: str) -> None:
    """A ``ClickException`` naming the first of ``names`` that is not a target of ``known``
    (with the target it may mean, and the list of all)."""
    targets = sorted(known)
    for name in names:
        if name in targets:
            continue
        same = [t for t in targets if t.lower() == name.lower()]
        near = same or difflib.get_close_matches(name, targets, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise click.ClickException(
            f"{source}: unknown target {name!r} in [targets]{hint}; the targets are "
            f"{', '.join(targets)}")


def load_thresholds(path: str | Path | None = None) -> dict[str, Threshold]:
    """The ``[targets]`` table of ``path`` (default: ``default_targets_file()``)."""
    path = Path(path) if path else default_targets_file()
    return parse_thresholds(read_toml(path).get("targets"), str(path))


def _target(
    name: str,
    desc: str,
    measured: float,
    reference: float,
    unit: str,
    thresholds: dict[str, Threshold],
    note: str = "",
    key: str | None = None,
) -> TargetResult:
    """Target ``name``'s result; its threshold is ``thresholds[key or name]``."""
    try:
        mark = thresholds[key or name]
    except KeyError:
        raise click.ClickException(
            f"no threshold for target {key or name!r} in [targets] "
            f"(have: {', '.join(sorted(thresholds))})"
        ) from None
    ratio = measured / reference if reference else float("nan")
    passed = ratio >= mark.value if mark.higher else ratio <= mark.value
    return TargetResult(
        name, desc, measured, reference, unit, ratio, mark.value, mark.higher, passed, note
    )


def measure_rss_target(
    runner: Runner, tmpdir: str, thresholds: dict[str, Threshold]
) -> TargetResult:
    """T8: broker RSS holding 1 GiB of 16 MiB tensors, above its idle RSS; then drained and
    every tensor checked."""
    case = Case("put_only", ptype="tensor", size=16 * MIB, messages=64, window=4, shm=False)
    target = Target(case, runner.address, tmpdir)
    try:
        idle = target.rss() or 0
        with Workers() as w:
            counts_arr = w.counters(1)
            for spec in producer_specs(case, target.address, target.key_prefix):
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
    runner.tick()
    return _target(
        "T8",
        "broker RSS holding 1 GiB of 16 MiB tensors, above idle (GiB)",
        delta / (1 << 30),
        case.messages * case.size / (1 << 30),
        "GiB",
        thresholds,
        note=f"idle {idle / MIB:.0f} MiB, held {held / MIB:.0f} MiB, VmHWM {peak / MIB:.0f} MiB",
    )


def measure_stream_target(
    runner: Runner, small: Case, thresholds: dict[str, Threshold]
) -> list[TargetResult]:
    """T2s: a producer process streams 64 B items with ``window`` async puts in flight while a
    consumer process keeps ``window`` async gets outstanding (default ``Channel.create``,
    nothing reserved), in rounds with the baselines a user compares it with: a fresh zmq.proxy
    relay at libzmq's default high-water marks (T2s), ``multiprocessing.Queue`` (T2s-mp), a
    Redis list in memory where ``redis-server`` is installed, its consumer pipelining 64
    single ``LPOP``s as this one keeps 64 single gets outstanding (T2s-redis) and, as extra
    rows, the relay at the same depth in flight and the Redis list popped 64 items per
    command.  T3b, in the same rounds: ``get_batch(64)`` against the stream's 64 single gets
    outstanding; T3b-redis: that ``get_batch(64)`` stream against the Redis list whose
    consumer also takes 64 items per request (``LPOP key 64``)."""
    stream = dataclasses.replace(
        small,
        scenario="channel",
        producers=1,
        consumers=1,
        reserve=False,
        label=f"T2s stream 64B 1P/1C puts w{small.window} gets w{small.window} defaults",
    )
    batch = dataclasses.replace(
        stream, scenario="batch", compare=False, label="T3b get_batch(64) 64B 1P/1C defaults"
    )
    t2s, t3b = runner.measure_together(
        [stream, batch], fresh=True,
        also=("zmq.proxy.depth", "mp", "redis-mem.single", "redis-mem"),
    )
    desc = (f"64 B stream, {stream.window} async puts and {stream.window} async gets in flight, "
            "items/s vs ")
    out = []
    for name, kind, what in (
        ("T2s", "zmq.proxy", "zmq.proxy at libzmq's default HWM (same rounds)"),
        ("T2s-mp", "mp", "multiprocessing.Queue (same rounds)"),
        ("T2s-redis", "redis-mem.single", "a Redis list in memory, 64 single LPOPs per "
         "pipeline (same rounds)"),
    ):
        base = runner.baseline_for(stream, kind)
        if base is None:  # not measurable here (the runner noted why)
            continue
        out.append(_target(name, desc + what, t2s.items_s, base.items_s, "items/s", thresholds,
                           note=f"{base.case}: {base.items_s:.0f} items/s"))
    out.append(_target(
        "T3b", "64 B via get_batch(64) vs 64 single async gets outstanding, items/s (same "
        "rounds)", t3b.items_s, t2s.items_s, "items/s", thresholds,
    ))
    # the Redis consumer takes 64 items per command (LPOP key 64): the same shape on this
    # side is get_batch(64), which T3b measured in the same rounds
    redis = runner.baseline_for(stream, "redis-mem")
    if redis is not None:
        out.append(_target(
            "T3b-redis", "64 B via get_batch(64) vs a Redis list in memory popped 64 at a "
            "time (LPOP key 64), items/s (same rounds)", t3b.items_s, redis.items_s,
            "items/s", thresholds, note=f"{redis.case}: {redis.items_s:.0f} items/s"))
    return out


def run_targets(
    runner: Runner, base: Case, tmpdir: str, thresholds: dict[str, Threshold] | None = None
) -> list[TargetResult]:
    """T1-T4 (with T2s, the 64 B stream) and T6-T10; T5, the Ray queue, is ``--baseline ray``.
    ``thresholds``: by target name (default: ``load_thresholds()``)."""
    thresholds = thresholds if thresholds is not None else load_thresholds()
    small = dataclasses.replace(
        base, ptype="bytes", size=64, transport="ipc", producers=1, consumers=1, window=64
    )
    out: list[TargetResult] = []
    saved = runner.baseline
    runner.baseline = "zmq"
    try:
        out.append(_t1_frames(runner, thresholds))
        t2, b2 = _t2_put_then_get(runner, small, thresholds)
        out.append(t2)
        out.extend(measure_stream_target(runner, small, thresholds))
        out.append(_t3_batch(runner, small, b2, thresholds))
        out.append(_t4_latency(runner, small, thresholds))
        out.append(_t6_processes(runner, small, thresholds))
        out.append(_t7_keys(runner, small, thresholds))
        out.append(measure_rss_target(runner, tmpdir, thresholds))
    finally:
        runner.baseline = saved
    out.extend(run_shm_targets(runner, thresholds))
    return out


def _t1_frames(runner: Runner, thresholds: dict[str, Threshold]) -> TargetResult:
    """T1: 16 MiB tensors over the socket (frames, no shared memory) against the relay."""
    # 4 GiB per run, as T9: over 1 GiB the start (connections, first allocations) weighs
    # in and single runs of both sides swing by +-20 %
    c1 = Case("channel", ptype="tensor", size=16 * MIB, messages=256, window=8, max_bytes=4 << 30)
    t1 = runner.measure(
        dataclasses.replace(
            c1,
            label="T1 channel tensor 16MiB 1P/1C ipc frames",
            shm=False,  # the socket path; T9 measures the shared-memory path
        )
    )
    b1 = runner.baseline_of(bounded(c1))
    return _target("T1", "16 MiB tensors 1P->1C ipc, MB/s vs zmq.proxy", t1.mb_s, b1.mb_s,
                   "MB/s", thresholds)


def _t2_put_then_get(
    runner: Runner, small: Case, thresholds: dict[str, Threshold]
) -> tuple[TargetResult, Result]:
    """T2: 64 B puts (64 in flight), then gets, against the relay at the same depth (returned:
    T3 compares with it too)."""
    # each target's case runs in rounds with what it is compared to (Runner.measure_together)
    (t2,) = runner.measure_together(
        [dataclasses.replace(small, scenario="get_only", label="T2 put(w64) then get(w64) 64B")],
        also=("zmq.proxy.depth",),
    )
    # T2 and T3 keep the reference they were defined with: the relay at the same depth in
    # flight (T2s compares the stream with the relay at libzmq's default HWM)
    b2 = runner.baseline_of(dataclasses.replace(small, scenario="channel"), "zmq.proxy.depth")
    composite = t2.extra["put_then_get_items_s"]
    result = _target(
        "T2", "64 B async puts (w64) then gets, items/s vs zmq.proxy at HWM 64", composite,
        b2.items_s, "items/s", thresholds,
        note=f"put phase {t2.extra['put_items_s']:.0f}/s, get phase {t2.items_s:.0f}/s",
    )
    return result, b2


def _t3_batch(runner: Runner, small: Case, b2: Result,
              thresholds: dict[str, Threshold]) -> TargetResult:
    """T3: 64 B items got 64 a batch, against T2's relay."""
    t3 = runner.measure(dataclasses.replace(small, scenario="batch", label="T3 get_batch(64) 64B"))
    return _target("T3", "64 B via get_batch (64/batch), items/s vs zmq.proxy at HWM 64",
                   t3.items_s, b2.items_s, "items/s", thresholds)


def _t4_latency(runner: Runner, small: Case, thresholds: dict[str, Threshold]) -> TargetResult:
    """T4: a get's median latency from a prefilled channel, against a raw echo."""
    prefilled = dataclasses.replace(
        small, scenario="get_only", window=1, messages=min(small.messages, 3000)
    )
    t4 = runner.measure(dataclasses.replace(prefilled, label="T4 get latency 64B prefilled"))
    b4 = runner.baseline_of(bounded(prefilled))
    return _target("T4", "get p50 latency, 64 B, prefilled vs raw echo p50 (us)", t4.p50_us,
                   b4.p50_us, "us", thresholds)


def _t6_processes(runner: Runner, small: Case, thresholds: dict[str, Threshold]) -> TargetResult:
    """T6: 4 producers and 4 consumers against 1 and 1, in the same rounds."""
    one, four = runner.measure_together(
        [
            dataclasses.replace(small, scenario="channel", label="T6 ref channel 64B 1P/1C"),
            dataclasses.replace(small, scenario="channel", producers=4, consumers=4,
                                label="T6 channel 64B 4P/4C"),
        ]
    )
    return _target("T6", "64 B 4P/4C aggregate items/s vs 1P/1C", four.items_s, one.items_s,
                   "items/s", thresholds)


def _t7_keys(runner: Runner, small: Case, thresholds: dict[str, Threshold]) -> TargetResult:
    """T7: 10,000 random keys against one, in the same rounds."""
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
    return _target("T7", "64 B over 10,000 keys vs 1 key, items/s", k10k.items_s, k1.items_s,
                   "items/s", thresholds)


def run_shm_targets(
    runner: Runner, thresholds: dict[str, Threshold] | None = None
) -> list[TargetResult]:
    """T9 and T10 of the shared-memory issue: large tensors 1P -> 1C on this host, through
    shared memory (default copy-out consumer), against zmq.proxy and pipelined Ray actor calls
    measured in the same run; T9d (default settings) and the report-only row T9w (the producer
    writes each tensor in its slot, ``Channel.empty_shm``) run in T9's rounds.  ``thresholds``:
    by target name (default: ``load_thresholds()``)."""
    thresholds = thresholds if thresholds is not None else load_thresholds()
    saved = runner.baseline
    runner.baseline = "zmq"
    try:
        out = _t9_large_tensors(runner, thresholds)
        out.append(_t10_tensors(runner, thresholds))
    finally:
        runner.baseline = saved
    return out


def _t9_cases(c9: Case) -> list[Case]:
    """T9's rows, measured in the same rounds: T9 (maxsize 8), T9w (written in slots), T9d
    (the defaults), T9z (zero-copy)."""
    # the same stream as a user writes it: default Channel.create (unbounded), nothing
    # reserved, 64 puts and 64 gets in flight; same rounds as T9
    c9d = dataclasses.replace(
        c9, window=64, max_inflight=64 * 16 * MIB, reserve=False, compare=False,
        label="T9d shm tensor 16MiB 1P/1C ipc defaults, windows 64",
    )
    # T9 with the producer writing each tensor in its slot (Channel.empty_shm): the put
    # sends the slot, so the row shows the stream without the producer's copy (a row of
    # the report, no target; it shares T9's relay)
    c9m = dataclasses.replace(c9, maxsize=8, label="T9 shm tensor 16MiB 1P/1C ipc maxsize=8")
    c9w = dataclasses.replace(
        c9m, in_slot=True, label="T9w shm tensor 16MiB 1P/1C ipc maxsize=8, written in slots"
    )
    # no copy at all: the producer writes in its slot, the consumer reads views of it
    # (copy=False); the limit is the broker's message rate (a row and target T9z, items/s)
    c9z = dataclasses.replace(
        c9w, views=True, compare=False,
        label="T9z shm tensor 16MiB 1P/1C ipc maxsize=8, zero-copy (slots and views)",
    )
    return [c9m, c9w, c9d, c9z]


def _t9_large_tensors(runner: Runner, thresholds: dict[str, Threshold]) -> list[TargetResult]:
    """T9 (against the relay, Ray's pipelined actor calls, np.copyto of a stream of distinct
    items and the bare copy-in, copy-out ring), T9z and T9d."""
    # maxsize = window: a bounded queue, like the baselines' (zmq HWM, Ray's window); the
    # producer's pool then covers every item in flight (see docs/shm.md, pool sizing)
    # 4 GiB per case: a steady state, not the first fill of the producer's pool (creating
    # and faulting in its segments costs the first ~400 MiB; docs/shm.md, pool sizing)
    c9 = bounded(
        Case("channel", ptype="tensor", size=16 * MIB, messages=256, window=8, max_bytes=4 << 30)
    )
    # fresh: T1 measured the same zmq.proxy set-up earlier; T9 gets its own, run in rounds,
    # and so do the copy limits: np.copyto over rotating buffers (a stream of distinct items,
    # T9-copy's reference) and between two fixed buffers (cache-warm, a report row)
    t9, _t9w, t9d, t9z = runner.measure_together(
        _t9_cases(c9), fresh=True, also=("np.copyto.stream", "np.copyto", "copy.pipeline")
    )
    b9 = runner.baseline_of(c9)
    copy9 = runner.baseline_for(c9, "np.copyto.stream")
    pipe9 = runner.baseline_for(c9, "copy.pipeline")
    r9 = measure_ray_actor(runner, dataclasses.replace(c9, label=""))
    out: list[TargetResult] = []
    what = "16 MiB tensors 1P->1C same host (shm, copy-out), MB/s vs"
    if r9 is not None:
        out.append(_target("T9", f"{what} Ray pipelined actor calls", t9.mb_s, r9.mb_s, "MB/s",
                           thresholds, key="T9-ray"))
    out.append(_target("T9", f"{what} zmq.proxy", t9.mb_s, b9.mb_s, "MB/s", thresholds))
    if copy9 is not None:
        out.append(_target(
            "T9-copy", f"{what} np.copyto of distinct 16 MiB items (rotating buffers, 4x L3) "
            "in one process (same rounds)", t9.mb_s,
            copy9.mb_s, "MB/s", thresholds,
        ))
    if pipe9 is not None:
        out.append(_target(
            "T9-pipe", f"{what} the same copy-in, copy-out ring with nothing else (two "
            "processes, same rounds)", t9.mb_s, pipe9.mb_s, "MB/s", thresholds,
        ))
    out.append(_target(
        "T9z", "16 MiB tensors, zero-copy (empty_shm producer, copy=False consumer), "
        "items/s (an absolute figure: reference 1)", t9z.items_s, 1.0, "items/s", thresholds,
        note=f"{t9z.mb_s:.0f} MB/s",
    ))
    out.append(_target(
        "T9d", "16 MiB tensors, default settings (windows 64, unbounded, no reserve_shm), "
        "MB/s vs T9 tuned (same rounds)", t9d.mb_s, t9.mb_s, "MB/s", thresholds,
    ))
    return out


def _t10_tensors(runner: Runner, thresholds: dict[str, Threshold]) -> TargetResult:
    """T10: 1 MiB tensors through shared memory against the relay."""
    c10 = bounded(
        Case("channel", ptype="tensor", size=MIB, messages=4096, window=16, max_bytes=4 << 30)
    )
    t10 = runner.measure(
        dataclasses.replace(c10, maxsize=16, label="T10 shm tensor 1MiB 1P/1C ipc maxsize=16")
    )
    b10 = runner.baseline_of(c10)
    return _target("T10", "1 MiB tensors 1P->1C same host (shm, copy-out), MB/s vs zmq.proxy",
                   t10.mb_s, b10.mb_s, "MB/s", thresholds)
