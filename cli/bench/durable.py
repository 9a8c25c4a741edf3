"""The durable targets of ``zchannel bench --scenario durable`` (``docs/durability.md``): what a
journal costs, each ratio measured in the same rounds (medians of ``--repeat`` runs).

- **D1**: 16 MiB tensors 1P -> 1C through a journaled channel (``fsync="interval"``, through
  shared memory), MB/s against the disk's own rate for the same bytes (``write`` +
  ``fdatasync`` per item, ``cli/bench/disk.py``);
- **D2**: the 64 B stream (64 puts and 64 gets in flight) with a journal (``interval``) against
  the same channel without one;
- **D3**: that journaled 64 B stream against a Redis list with its append-only file
  (``appendfsync everysec``, ``cli/bench/redis.py``) whose consumer pipelines 64 single
  ``LPOP``s, as this one keeps 64 single gets outstanding (``redis.single``), items/s;
- **D3b**: the same journaled stream taken by ``get_batch(64)`` against the same Redis, whose
  consumer also takes 64 items per command (``LPOP key 64``): the same shape on both sides;
- **D4**: the journaled 16 MiB stream against the same Redis, MB/s.

D3, D3b and D4 need ``redis-server`` on ``PATH``; without it the report says so and they are left out.
Thresholds: ``[targets]`` of ``configs/bench_targets.toml``.
"""

from __future__ import annotations

import dataclasses

from zchannel.cli.bench.cases import MIB, Case, bounded
from zchannel.cli.bench.report import Result, TargetResult
from zchannel.cli.bench.runner import Runner
from zchannel.cli.bench.targets import Threshold, _target, load_thresholds

DURABLE_STEPS = 10  # progress-bar length (cases and baselines)


def run_durable_targets(runner: Runner, thresholds: dict[str, Threshold] | None = None
                        ) -> list[TargetResult]:
    """D1-D4 (see the module docstring)."""
    thresholds = thresholds if thresholds is not None else load_thresholds()
    saved = runner.baseline
    out: list[TargetResult] = []
    big = bounded(Case("channel", ptype="tensor", size=16 * MIB, messages=64, window=8,
                       maxsize=8, journal="interval",
                       label="D16 journal=interval shm tensor 16MiB 1P/1C maxsize=8"))
    small = Case("channel", ptype="bytes", size=64, messages=20000, window=64,
                 journal="interval", reserve=False,
                 label="D64 journal=interval 64B 1P/1C puts w64 gets w64")
    plain = dataclasses.replace(small, journal="", compare=False,
                                label="D64 no journal 64B 1P/1C puts w64 gets w64")
    # D3: 64 single gets outstanding against Redis's 64 single LPOPs per pipeline; D3b:
    # get_batch(64) against Redis popping 64 items per command (LPOP key 64)
    batch = dataclasses.replace(small, scenario="batch", compare=False,
                                label="D64 journal=interval 64B 1P/1C puts w64 get_batch(64)")
    try:
        runner.baseline = "disk"
        (d16,) = runner.measure_together([big], fresh=True)
        out += _against_baseline(
            runner, big, d16, "D1", "16 MiB tensors through a journal (fsync interval), MB/s vs "
            "the disk's write + fdatasync of the same bytes (same rounds)", thresholds, "disk")
        runner.baseline = "redis"
        d64, p64, b64 = runner.measure_together([small, plain, batch], fresh=True,
                                                also=("redis.single",))
        out.append(_target(
            "D2", "64 B stream with a journal (fsync interval), items/s vs no journal (same "
            "rounds)", d64.items_s, p64.items_s, "items/s", thresholds,
            note=f"no journal {p64.items_s:.0f} items/s"))
        d3 = _against_baseline(
            runner, small, d64, "D3", "64 B stream with a journal (fsync interval), items/s vs "
            "a Redis list with AOF everysec, 64 single LPOPs per pipeline (same rounds)",
            thresholds, "redis.single")
        out += d3
        out += _against_baseline(
            runner, small, b64, "D3b", "64 B stream with a journal (fsync interval) taken by "
            "get_batch(64), items/s vs a Redis list with AOF everysec popped 64 at a time "
            "(same rounds)", thresholds, "redis")
        if d3:  # redis-server runs here
            (d16r,) = runner.measure_together([big], fresh=True)
            out += _against_baseline(
                runner, big, d16r, "D4", "16 MiB tensors through a journal (fsync interval), "
                "MB/s vs a Redis list with AOF everysec (same rounds)", thresholds, "redis")
    finally:
        runner.baseline = saved
    return out


def _against_baseline(runner: Runner, case: Case, ours: Result, name: str, desc: str,
                      thresholds: dict[str, Threshold], baseline: str) -> list[TargetResult]:
    """Target ``name``: ``ours`` against the runner's baseline row for ``case`` (MB/s for
    items of 1 MiB or more, items/s below); none when that baseline cannot run here."""
    base = runner.baseline_for(case, baseline)
    if base is None:
        return []
    if case.size >= MIB:
        unit, mine, theirs = "MB/s", ours.mb_s, base.mb_s
    else:
        unit, mine, theirs = "items/s", ours.items_s, base.items_s
    return [_target(name, desc, mine, theirs, unit, thresholds,
                    note=f"{baseline} {theirs:.0f} {unit}")]
