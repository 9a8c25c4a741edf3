"""``zchannel bench --scenario scaling``: how a channel's items/s, p99 latency, broker CPU per
item and broker peak RSS change with producers x consumers (1, 2, 4, 8 of each), keys
(1 ... 100,000), item size (64 B ... 64 MiB) and broker processes of one channel on this host
(1, 2, 4 replicas with the keys spread over them, as a distributed channel's; CPU and RSS are
summed over them), each case beside the same-run baseline
(``--baseline``, a zmq.proxy relay by default) on the same set-up.  ``--plot DIR`` draws one
PNG per axis (needs matplotlib, the ``plot`` extra) and ``scaling_table`` gives the markdown
table of docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import click
from zchannel.cli.bench.cases import MIB, Case, bounded, fmt_size
from zchannel.cli.bench.report import Result, rate_text
from zchannel.cli.bench.runner import Runner

PROCESS_COUNTS = (1, 2, 4, 8)
KEY_COUNTS = (1, 100, 10_000, 100_000)
ITEM_SIZES = (64, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
BROKER_COUNTS = (1, 2, 4)  # broker processes of one channel on this host
SPREAD_KEYS = 64  # keys per producer of the brokers axis (spread over the brokers by hash)
SPREAD_PROCESSES = 2  # producers = consumers of the brokers axis
LARGE = 64 << 10  # items of this size or more are numpy arrays (shared memory on one host)
SCALING_STEPS = 2 * (len(PROCESS_COUNTS) + len(KEY_COUNTS) + len(ITEM_SIZES)) + len(BROKER_COUNTS)
AXES = {
    "processes": "producers = consumers (processes of each)",
    "keys": "keys (items spread over them, random order)",
    "size": "item size (bytes)",
    "brokers": f"broker processes of the channel ({SPREAD_PROCESSES}P/{SPREAD_PROCESSES}C, "
               f"{SPREAD_KEYS} keys each)",
}


@dataclasses.dataclass
class Point:
    """One case of a curve and the baseline measured beside it."""

    axis: str
    x: int
    case: Result
    baseline: Result | None


def scaling_cases(base: Case) -> list[tuple[str, int, Case]]:
    """(axis, x, case) of every point, from ``base``'s messages and window."""
    small = dataclasses.replace(base, scenario="channel", ptype="bytes", size=64)
    out: list[tuple[str, int, Case]] = []
    for n in PROCESS_COUNTS:
        out.append(("processes", n, dataclasses.replace(
            small, producers=n, consumers=n, label=f"scaling {n}P/{n}C 64B w{small.window}")))
    for k in KEY_COUNTS:
        out.append(("keys", k, dataclasses.replace(
            small, scenario="random_key", keys=k, messages=max(small.messages, k),
            label=f"scaling keys={k} 64B w{small.window}")))
    for size in ITEM_SIZES:
        large = size >= LARGE
        window = max(1, min(small.window, 8)) if size >= MIB else small.window
        out.append(("size", size, dataclasses.replace(
            small, ptype="numpy" if large else "bytes", size=size, window=window,
            label=f"scaling size={fmt_size(size)} w{window}")))
    for b in BROKER_COUNTS:
        out.append(("brokers", b, dataclasses.replace(
            small, scenario="random_key", keys=SPREAD_KEYS, producers=SPREAD_PROCESSES,
            consumers=SPREAD_PROCESSES, brokers=b,
            label=f"scaling brokers={b} {SPREAD_PROCESSES}P/{SPREAD_PROCESSES}C "
                  f"keys={SPREAD_KEYS} 64B w{small.window}")))
    return out


def run_scaling(runner: Runner, base: Case) -> list[Point]:
    """Measure every point (``runner.measure``: in rounds with its baseline)."""
    points = []
    for axis, x, case in scaling_cases(base):
        result = runner.measure(case)
        points.append(Point(axis, x, result, runner.baseline_for(bounded(case))))
    return points


def _cpu(row: Result | None) -> float:
    return float(row.extra.get("server_cpu_us_item", math.nan)) if row is not None else math.nan


def _figures(row: Result | None) -> tuple[float, float, float, float]:
    """(items/s, p99 us, server CPU us per item, peak RSS MB) of a row (NaN when absent)."""
    if row is None:
        return (math.nan,) * 4
    rss = row.rss_peak_mb if row.rss_peak_mb is not None else math.nan
    return row.items_s, row.p99_us, _cpu(row), rss


def scaling_table(points: list[Point]) -> list[str]:
    """The markdown table of the curves: each point's figures beside its baseline's."""
    lines = [
        "| axis | x | items/s | baseline items/s | ratio | p99 ms | baseline p99 ms | "
        "broker CPU us/item | relay CPU us/item | broker RSS MB | relay RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        c, b = _figures(p.case), _figures(p.baseline)
        x = fmt_size(p.x) if p.axis == "size" else f"{p.x:,}"
        lines.append(
            f"| {p.axis} | {x} | {rate_text(c[0], ',')} | {rate_text(b[0], ',')} | "
            f"{c[0] / b[0]:.2f} | "
            f"{c[1] / 1e3:.1f} | {b[1] / 1e3:.1f} | {c[2]:.1f} | {b[2]:.1f} | {c[3]:.0f} | "
            f"{b[3]:.0f} |"
        )
    return lines


def plot_scaling(points: list[Point], directory: str, title: str = "") -> list[str]:
    """One PNG per axis in ``directory`` (four panels: items/s, p99, broker CPU per item,
    broker RSS; the channel beside its baseline).  Returns the paths written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException(
            "--plot needs matplotlib; install the extra: pip install 'zchannel[plot]'") from None
    os.makedirs(directory, exist_ok=True)
    written = []
    panels = ("items/s", "p99 latency (ms)", "broker CPU per item (us)", "broker peak RSS (MB)")
    for axis, xlabel in AXES.items():
        mine = [p for p in points if p.axis == axis]
        if not mine:
            continue
        xs = [p.x for p in mine]
        fig, axs = plt.subplots(1, 4, figsize=(16, 3.6))
        for i, (ax, name) in enumerate(zip(axs, panels, strict=True)):
            scale = 1e3 if i == 1 else 1.0
            chan = [_figures(p.case)[i] / scale for p in mine]
            base = [_figures(p.baseline)[i] / scale for p in mine]
            ax.plot(xs, chan, marker="o", label="zchannel")
            base_kind = next((p.baseline.kind for p in mine if p.baseline is not None), None)
            if base_kind is not None:
                ax.plot(xs, base, marker="s", linestyle="--", label=f"{base_kind} (same run)")
            ax.set_xscale("log", base=2 if axis in ("processes", "brokers") else 10)
            if i in (0, 1, 2) and axis != "processes":
                ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_title(name)
            ax.grid(True, alpha=0.3)
        axs[0].legend(fontsize=8)
        fig.suptitle(title or f"zchannel bench --scenario scaling: {axis}")
        fig.tight_layout()
        path = os.path.join(directory, f"scaling-{axis}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def scaling_json(points: list[Point]) -> list[dict[str, Any]]:
    """The points for ``--json``: axis, x and both rows' case names."""
    return [{"axis": p.axis, "x": p.x, "case": p.case.case,
             "baseline": p.baseline.case if p.baseline is not None else None} for p in points]
