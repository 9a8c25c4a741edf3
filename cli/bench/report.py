"""The report of ``zchannel bench``: its rows, progress while it runs, the table, the JSON file
and the machine description.

A row (``Result``) holds the medians over the repeats of one case and every run's figures
(``runs``); its ratio names the baseline row it is measured against (``baseline``), the figure
compared (``ratio_metric``), which way is better (``ratio_higher_is_better``) and the ratio of
each round (``ratio_runs``: case and baseline run in rounds, see ``Runner.measure_together``).
``print_report`` writes two tables (throughput, then latency and memory: each ratio stands
beside the figure it compares), the ratios in words, a legend of every abbreviation used, why
some figures look surprising (queueing in the window), and one warning naming the rows whose
repeats spread widely, all within ``WIDTH`` (100) columns.  ``Progress`` shows a bar on a terminal and one line per finished run
otherwise, so a long run is never silent.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import click
import numpy as np
import zmq
from zchannel.cli.bench.registry import BASELINES, describe

WIDE_SPREAD = 0.25  # warn when (max - min) / median of a row's repeats is above this
WIDTH = 100  # the report fits a terminal of this many columns (a wide table's last column wraps)


# what each kind of row is that is not a registered baseline (registry.BASELINES), for the
# ratios in words and the legend
KIND_DESCRIPTIONS = {
    "zchannel": "through a zchannel broker",
    "ray.queue": "ray.util.queue.Queue between two Ray tasks",
    "ray.actor": "pipelined calls to a Ray actor",
    "collector": "trajectory chunks through the embodied_trajectory collector",
    "plain": "the same trajectory chunks through a channel without hooks",
}


METRIC_WORDS = {"items/s": "items/s", "p50": "p50 latency", "chunks/s": "chunks/s"}
HIGHER_IS_BETTER = {"items/s": True, "chunks/s": True, "p50": False, "MB/s": True}


@dataclasses.dataclass
class Result:
    """One row of the table: medians over the repeats of one case."""

    case: str
    kind: str  # "zchannel" or the baseline's name
    scenario: str
    ptype: str
    size: int
    producers: int
    consumers: int
    transport: str
    window: int
    messages: int
    items_s: float
    mb_s: float
    p50_us: float
    p99_us: float
    latency: str
    seconds: float
    rss_peak_mb: float | None = None
    baseline: str | None = None
    ratio: float | None = None
    ratio_metric: str | None = None
    note: str = ""
    extra: dict = dataclasses.field(default_factory=dict)
    repeats: int = 1
    runs: dict = dataclasses.field(default_factory=dict)  # figure -> its value in each run
    ratio_runs: list | None = None  # the ratio of each round (case run i / baseline run i)
    ratio_higher_is_better: bool | None = None

    def spread(self, figure: str = "items_s") -> tuple[float, float, float] | None:
        """(min, max, (max - min) / median) of ``figure`` over the repeats; None for one run."""
        values = [v for v in self.runs.get(figure, ()) if v == v]
        if len(values) < 2:
            return None
        median = statistics.median(values)
        return min(values), max(values), (max(values) - min(values)) / median if median else 0.0


@dataclasses.dataclass
class TargetResult:
    """One of T1-T10: a measured figure against its reference."""

    target: str
    description: str
    measured: float
    reference: float
    unit: str
    ratio: float
    threshold: float
    higher_is_better: bool
    passed: bool
    note: str = ""


def set_ratio(row: Result, base: Result, metric: str) -> None:
    """``row``'s ratio to ``base`` on ``metric`` (items/s, chunks/s or p50), overall (medians)
    and per round (runs paired by index, as they ran)."""
    figure = "p50_us" if metric == "p50" else "items_s"
    ours, theirs = getattr(row, figure), getattr(base, figure)
    if not theirs or theirs != theirs:
        return
    row.baseline, row.ratio_metric = base.case, metric
    row.ratio = ours / theirs
    row.ratio_higher_is_better = HIGHER_IS_BETTER[metric]
    a, b = row.runs.get(figure, []), base.runs.get(figure, [])
    if len(a) == len(b) > 1 and all(b):
        row.ratio_runs = [round(x / y, 4) for x, y in zip(a, b, strict=True)]


class Progress:
    """Progress on stderr: a bar naming the current run on a terminal; one line per finished
    run otherwise (a log file, CI), with its figure and the time so far."""

    def __init__(self, label: str, steps: int, repeats: int, file: TextIO | None = None) -> None:
        self.file = file or sys.stderr
        self.label = label
        self.repeats = repeats
        self.steps = steps
        self.started = time.monotonic()
        isatty = getattr(self.file, "isatty", None)
        self.bar: Any = None
        if isatty is not None and isatty():
            self.bar = click.progressbar(length=steps, label=label, file=self.file,
                                         item_show_func=lambda text: text)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.__enter__()
        else:
            click.echo(f"{self.label}: {self.steps} cases and baselines, {self.repeats} "
                       f"run(s) each", file=self.file)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, steps: int = 1) -> None:
        """A case or a baseline is summarised (all its runs done)."""
        if self.bar is not None:
            self.bar.update(steps)

    def run(self, what: str, index: int, total: int, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (run ``index`` of ``total`` of ``what``) and show it."""
        if self.bar is not None:
            self.bar.update(0, f"{what} (run {index + 1}/{total})")
        t0 = time.monotonic()
        result = fn()
        if self.bar is None:
            figure = _run_figure(result)
            click.echo(f"  [{time.monotonic() - self.started:6.1f}s] {what}: run {index + 1}/"
                       f"{total}{figure} in {time.monotonic() - t0:.1f}s", file=self.file)
        return result


def _run_figure(result: Any) -> str:
    if isinstance(result, tuple):  # put then get: the last phase measured
        result = next((r for r in reversed(result) if r is not None), None)
    items, seconds = getattr(result, "items", None), getattr(result, "seconds", None)
    if isinstance(result, dict):
        items, seconds = result.get("chunks"), result.get("seconds")
    return f", {rate_text(items / seconds, ',')} items/s" if items and seconds else ""


def _fmt(value: float | None, spec: str = ".0f") -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "-"
    return format(value, spec)


def rate_text(value: float | None, grouping: str = "") -> str:
    """An items/s figure: whole from 10 up (``grouping`` "," groups the thousands), with two
    decimals below (half an item per second of a large item is 0.50, not 1); "-" for none."""
    if value is not None and not np.isnan(value) and abs(value) < 10:
        return format(value, ".2f")
    return _fmt(value, f"{grouping}.0f")


def _print_grid(table: list[tuple], out: Callable[[str], None], width: int = WIDTH) -> None:
    """``table`` (its header first) in aligned columns, numbers right-aligned; the last column
    wraps so that a line stays within ``width`` columns (when the others leave it room)."""
    cells = [[str(c) for c in row] for row in table]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]) - 1)]
    numeric = [all(_is_number(row[i]) for row in cells[1:]) for i in range(len(widths))]
    start = sum(widths) + 2 * len(widths)
    room = max(width - start, 24)
    last = min(room, max(len(row[-1]) for row in cells))
    for i, row in enumerate(cells):
        head = "  ".join(c.rjust(w) if num and i else c.ljust(w)
                         for c, w, num in zip(row, widths, numeric, strict=False))
        parts = textwrap.wrap(row[-1], room) or [""]
        out(f"{head}  {parts[0]}".rstrip())
        for part in parts[1:]:
            out(" " * start + part)
        if i == 0:
            out("  ".join("-" * w for w in [*widths, last]))


def _is_number(cell: str) -> bool:
    return bool(re.fullmatch(r"-|[\d.,]+[%*x]?|[\d.,]+-[\d.,]+", cell))


def _wrapped(text: str, out: Callable[[str], None], indent: str = "",
             hanging: str = "    ") -> None:
    """``text`` in lines of at most ``WIDTH`` columns, continuation lines indented."""
    for line in textwrap.wrap(text, WIDTH, initial_indent=indent,
                              subsequent_indent=indent + hanging, break_on_hyphens=False):
        out(line)


def baseline_tags(rows: list[Result]) -> dict[str, str]:
    """``B1``, ``B2``, ... for the rows other rows are measured against, in table order."""
    used = {r.baseline for r in rows if r.baseline and r.ratio is not None}
    return {r.case: f"B{i}" for i, r in enumerate((r for r in rows if r.case in used), 1)}


def _better(ratio: float, higher: bool) -> str:
    gain = ratio if higher else 1 / ratio if ratio else float("inf")
    if 0.95 <= gain <= 1.05:
        return "about the same"
    return f"{gain:.2f}x faster" if gain > 1 else f"{1 / gain:.2f}x slower"


def ratio_lines(rows: list[Result], tags: dict[str, str]) -> list[str]:
    """Each ratio in words: which baseline, which figure, which way is better, per round."""
    by_case = {r.case: r for r in rows}
    lines = []
    for r in rows:
        if r.ratio is None or r.baseline not in by_case:
            continue
        base = by_case[r.baseline]
        higher = bool(r.ratio_higher_is_better)
        what = METRIC_WORDS.get(r.ratio_metric or "", r.ratio_metric)
        line = (f"{r.case}: {r.ratio:.2f}x the {what} of {tags.get(base.case, 'the baseline')} = "
                f"{base.case} ({describe(base.kind, KIND_DESCRIPTIONS)}); "
                f"{'higher' if higher else 'lower'} is better, so {_better(r.ratio, higher)}")
        if r.ratio_runs:
            line += f"; per round {min(r.ratio_runs):.2f}x-{max(r.ratio_runs):.2f}x"
        lines.append(line)
    return lines


def legend_lines(rows: list[Result]) -> list[str]:
    """Every abbreviation the table uses, explained."""
    order = ["zchannel", *BASELINES, *KIND_DESCRIPTIONS]
    kinds = sorted({r.kind for r in rows}, key=lambda k: order.index(k) if k in order else len(order))
    lines = [
        "64B, 1KiB, 1MiB  payload bytes per item (binary multiples); MB/s uses MB = 2**20 bytes",
        "1P/1C            producer processes / consumer processes (1P/1C: one of each)",
        "w64              window: each worker keeps 64 asynchronous requests in flight "
        "(w1: one blocking call at a time)",
        "items/s, MB/s    median over the repeats; range = min-max of the repeats; "
        "spread = (max - min) / median",
        "p50, p99 us      50th / 99th percentile latency of one item, in microseconds "
        "(median over the repeats)",
        "lat              what the latency spans: e2e = put issued -> item received; put, get, "
        "get_batch = request -> reply; rtt = raw echo round trip",
        "RSS MB           peak resident memory (VmHWM) of the broker, or of the proxy/echo "
        "process of a baseline row",
        "B1, B2, ...      baseline rows, measured in the same run on the same payloads; "
        "'vs baseline' = this row's figure / the baseline's: items/s for streams (throughput "
        "table), p50 for one request at a time (latency table)",
    ]
    named = [k for k in kinds if k != "zchannel"]  # the case names that start (or end) with it
    if named:
        lines.append("zmq.proxy, ...   what carried a row's items when it is not a zchannel "
                     "broker: " + "; ".join(f"{k} = {describe(k, KIND_DESCRIPTIONS)}"
                                            for k in named))
    if any(_queued(r) for r in rows):
        lines.insert(3, "p50 *            a p50 that is mostly time waiting in the queue "
                        "(explained below)")
    if any(r.scenario == "random_key" for r in rows):
        lines.append("keys=N           items spread over N keys (random_key scenario)")
    if any(r.scenario == "hooks" for r in rows):
        lines.append("+hooks/nohooks   with/without the flatten_batch collector and "
                     "round_robin dispatcher (8 items per put with hooks)")
    return lines


def _queued(r: Result) -> bool:
    """A long p50 that queueing in the window explains (streaming rows, window > 1)."""
    return r.window > 1 and r.latency in ("e2e", "get_batch") and r.p50_us > 1000


def queueing_notes(rows: list[Result]) -> list[str]:
    """Why a long p50 is not the cost of one request: the window fills the queue."""
    long = [r for r in rows if _queued(r)]
    if not long:
        return []
    single = next((r for r in rows if r.window == 1 and r.kind == "zchannel"
                   and r.p50_us == r.p50_us), None)
    lines = [
        "p50 values marked * are mostly queueing, not transfer: with a window of N (wN) "
        "producers run up to N requests ahead and the queue holds what consumers have not "
        "taken yet, so an item waits behind others (about p50 x items/s of them)"
        + (f"; one request alone takes {single.p50_us:.0f} us ({single.case})"
           if single is not None else "; --window 1 measures one request alone"),
    ]
    for r in long:
        lines.append(f"  {r.case}: p50 {r.p50_us / 1000:.1f} ms = about "
                     f"{r.p50_us / 1e6 * r.items_s:,.0f} items waiting ahead")
    return lines


def spread_warnings(rows: list[Result]) -> list[str]:
    """What varied, for each row whose repeats (or per-round ratios) differ by more than 25 %
    (``print_report`` prints them under one warning)."""
    warnings = []
    for r in rows:
        spread = r.spread()
        ratios = r.ratio_runs or []
        ratio_spread = (max(ratios) - min(ratios)) / statistics.median(ratios) if ratios else 0.0
        if (spread is None or spread[2] <= WIDE_SPREAD) and ratio_spread <= WIDE_SPREAD:
            continue
        parts = []
        if spread is not None and spread[2] > WIDE_SPREAD:
            parts.append(f"items/s varied {spread[2]:.0%} between repeats "
                         f"({rate_text(spread[0], ',')}-{rate_text(spread[1], ',')})")
        if ratio_spread > WIDE_SPREAD:
            parts.append(f"its ratio varied {min(ratios):.2f}x-{max(ratios):.2f}x between rounds")
        warnings.append(f"{r.case}: {'; '.join(parts)}")
    return warnings


THROUGHPUT_METRICS = ("items/s", "chunks/s")


def _versus(r: Result, tags: dict[str, str], metrics: tuple[str, ...]) -> str:
    """The ``vs baseline`` cell of ``r`` in a table of ``metrics``: its ratio and verdict when
    it is compared on one of them, its tag when it is a baseline, else ``-``."""
    if r.ratio is not None and r.ratio_metric in metrics:
        verdict = _better(r.ratio, bool(r.ratio_higher_is_better))
        return f"{r.ratio:.2f}x {tags.get(r.baseline or '', 'baseline')} ({verdict})"
    return tags.get(r.case, "-")


def _tables(rows: list[Result], tags: dict[str, str], out: Callable[[str], None]) -> None:
    """Two tables of the same rows: throughput (a stream's ratio is on items/s), then latency
    and memory (a window-1 case's ratio is on p50), so a ratio stands beside its figure."""
    fast: list[tuple] = [("case", "items/s", "range (min-max)", "spread", "MB/s",
                          "vs baseline (items/s)")]
    slow: list[tuple] = [("case", "lat", "p50 us", "p99 us", "RSS MB", "vs baseline (p50)")]
    for r in rows:
        spread = r.spread()
        fast.append((r.case, rate_text(r.items_s),
                     "-" if spread is None else f"{rate_text(spread[0])}-{rate_text(spread[1])}",
                     "-" if spread is None else f"{spread[2]:.0%}", _fmt(r.mb_s, ".1f"),
                     _versus(r, tags, THROUGHPUT_METRICS)))
        slow.append((r.case, r.latency, _fmt(r.p50_us, ".1f") + ("*" if _queued(r) else ""),
                     _fmt(r.p99_us, ".1f"), _fmt(r.rss_peak_mb), _versus(r, tags, ("p50",))))
    out("throughput (medians over the repeats):")
    _print_grid(fast, out)
    out("")
    out("latency and memory:")
    _print_grid(slow, out)


def _print_targets(targets: list[TargetResult], out: Callable[[str], None]) -> None:
    """The PASS/FAIL table of the targets."""
    grid: list[tuple] = [
        ("target", "result", "ratio", "threshold", "measured", "reference", "description")
    ]
    for t in targets:
        op = ">=" if t.higher_is_better else "<="
        grid.append((t.target, "PASS" if t.passed else "FAIL", f"{t.ratio:.2f}",
                     f"{op} {t.threshold}", f"{_fmt(t.measured, '.4g')} {t.unit}",
                     f"{_fmt(t.reference, '.4g')} {t.unit}",
                     t.description + (f" [{t.note}]" if t.note else "")))
    _print_grid(grid, out)


def print_report(rows: list[Result], targets: list[TargetResult], notes: list[str],
                 out: Callable[[str], None] = click.echo) -> list[str]:
    """The results (a throughput and a latency table), the ratios in words, the PASS/FAIL
    table of the targets (when measured), the legend, the notes and one warning naming every
    row whose repeats spread widely (returned, one entry per row), in lines of at most
    ``WIDTH`` columns."""
    tags = baseline_tags(rows)
    if rows:
        _tables(rows, tags, out)
        lines = ratio_lines(rows, tags)
        if lines:
            out("")
            out("ratios (medians; the baseline ran in rounds with the case, in this run):")
            for line in lines:
                _wrapped(line, out, indent="  ")
    if targets:
        out("")
        if rows:
            _wrapped("targets (each against its own reference, named in its row and in "
                     "configs/bench_targets.toml: it may be another row than the B tag the "
                     "table above gives that case):", out)
        _print_targets(targets, out)
    if rows:
        out("")
        out("legend:")
        for line in legend_lines(rows):
            _wrapped(line, out, indent="  ", hanging=" " * 17)
    why = queueing_notes(rows)
    if why:
        out("")
        for line in why:
            _wrapped(line, out, hanging="    " if line.startswith("  ") else "  ")
    for note in notes:
        _wrapped(f"note: {note}", out)
    return _print_spread(rows, out)


def _print_spread(rows: list[Result], out: Callable[[str], None]) -> list[str]:
    """The note on one run per case, or the warning naming the rows whose repeats spread
    widely (returned, one entry per row)."""
    warnings = spread_warnings(rows)
    if rows and all(r.repeats < 2 for r in rows):
        out("note: one run per case, so no spread is shown; --repeat 3 or more shows "
            "run-to-run noise")
    if warnings:
        _wrapped(f"warning: the machine was noisy: {len(warnings)} row(s) varied by more than "
                 f"{WIDE_SPREAD:.0%} between repeats or rounds, so trust their medians less "
                 "(or rerun with --repeat 5 on a quieter machine):", out)
        for line in warnings:
            _wrapped(line, out, indent="  ")
    return warnings


def write_json(path: str, machine: dict, options: dict, rows: list[Result],
               targets: list[TargetResult], notes: list[str], ok: bool, error: str | None,
               warnings: Sequence[str] = ()) -> None:
    """Every row (with its runs), the targets and the machine, to ``path`` (``-``: stdout)."""
    doc = {
        "machine": machine,
        "options": options,
        "rows": [dataclasses.asdict(r) for r in rows],
        "targets": [dataclasses.asdict(t) for t in targets],
        "notes": notes,
        "warnings": list(warnings),
        "ok": ok,
        "error": error,
    }
    text = json.dumps(doc, indent=2,
                      default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))
    if path == "-":
        click.echo(text)
        return
    with open(path, "w") as f:
        f.write(text)


def machine_description() -> dict[str, Any]:
    """CPU count and model, kernel, and the versions that matter."""
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
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
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
        "zchannel": importlib.metadata.version("zchannel"),
        "torch": torch_version,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "numpy": np.__version__,
    }
