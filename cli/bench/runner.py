"""The runner of ``zchannel bench``: cases with repeats, in rounds with the baselines they are
compared to, summarised into report rows (medians over the repeats)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from zchannel.cli.bench import copylimit as _copy_baseline  # noqa: F401 - registers copy.pipeline
from zchannel.cli.bench import disk as _disk_baseline  # noqa: F401 - registers disk
from zchannel.cli.bench import redis as _redis_baselines  # noqa: F401 - registers redis, redis-mem
from zchannel.cli.bench.baselines import ray_available, run_ray_baselines
from zchannel.cli.bench.cases import (
    MIB,
    Case,
    Measured,
    bounded,
    fmt_size,
    percentiles,
    scenario_cases,
)
from zchannel.cli.bench.channel import run_channel_stream, run_put_get
from zchannel.cli.bench.payloads import part_sizes, verify_seqs
from zchannel.cli.bench.registry import baseline
from zchannel.cli.bench.report import Result, set_ratio

LATENCY_KIND = {
    "channel": "e2e",
    "random_key": "e2e",
    "hooks": "e2e",
    "batch": "get_batch",
    "put_only": "put",
    "get_only": "get",
}


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
    per_run = [round(r.items / r.seconds, 1 if r.items >= 10 * r.seconds else 3) for r in runs]
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

    def tick(self) -> None:
        """One step of the progress display done (a case or a baseline measured)."""
        if self.progress is not None:
            self.progress.update(1)

    def logged(self, what: str, index: int, fn: Callable[[], Any]) -> Any:
        """``fn()``, run ``index`` of ``what``, shown by the progress display."""
        run = getattr(self.progress, "run", None)
        return fn() if run is None else run(what, index, self.repeats, fn)

    def measure(self, case: Case) -> Result:
        """Run ``case`` (repeats), add its row (and its baseline's row) and return it."""
        return self.measure_together([case])[0]

    def measure_together(
        self,
        cases: list[Case],
        baselines_of: Sequence[Case] = (),
        fresh: bool = False,
        also: tuple[str, ...] = (),
    ) -> list[Result]:
        """Run ``cases`` in rounds, one run of each per round, ``repeats`` rounds, together with
        the baselines they (and ``baselines_of``) are compared to, where not measured yet
        (``fresh``: measure them again, alongside these cases), and with the baselines of kinds
        ``also`` on the first case's set-up (extra rows; ``baseline_for(case, kind)``).

        Interleaving pairs each run with the runs it is compared to in time: on a shared
        machine the rate of every transport drifts by 10-30 % over minutes, and a block of
        repeats of one side then a block of the other puts that drift into the ratio."""
        cases = [bounded(c) for c in cases]
        keys: list[tuple[str, Case]] = []
        wanted = [self.baseline_key(c) for c in [*cases, *(bounded(b) for b in baselines_of)]]
        wanted += [self.baseline_key(cases[0], kind) for kind in also]
        for key in wanted:
            if (
                key is not None
                and key[0] != "ray"
                and (fresh or key not in self._baselines)
                and key not in keys
            ):
                keys.append(key)
        case_runs: list[list] = [[] for _ in cases]
        base_runs: dict[tuple[str, Case], list[Measured]] = {key: [] for key in keys}
        for i in range(self.repeats):
            for runs, case in zip(case_runs, cases, strict=True):
                runs.append(self.logged(case.name, i, functools.partial(self._run_case, case)))
            for key in keys:
                base_runs[key].append(self.logged(
                    _baseline_label(*key), i, functools.partial(self._run_baseline_once, *key)))
        for key in keys:
            self.store_baseline(key, self._summarise_baseline(*key, base_runs[key]))
        return [self._case_result(c, runs) for c, runs in zip(cases, case_runs, strict=True)]

    def _run_case(self, case: Case) -> Any:
        if case.scenario in ("put_only", "get_only"):
            return run_put_get(
                case, self.address, self.tmpdir, get_phase=case.scenario == "get_only"
            )
        return run_channel_stream(case, self.address, self.tmpdir)

    def _case_result(self, case: Case, runs: list) -> Result:
        self.tick()
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

    def baseline_key(self, case: Case, kind: str | None = None) -> tuple[str, Case] | None:
        """(kind, the baseline's own case) for ``case`` on the baseline of ``kind`` (default:
        ``--baseline``'s); None without a baseline, or when it cannot run here (noted)."""
        if kind is None:
            if self.baseline == "none" or not case.compare:
                return None
            kind = self.baseline
        if kind == "zmq":
            kind = "zmq.echo" if case.scenario == "get_only" else "zmq.proxy"
        base_case = dataclasses.replace(
            case, scenario="channel", keys=1, hooks=False, label="", shm=True, maxsize=0,
            reserve=True, in_slot=False, views=False, compare=True, brokers=1, journal="",
        )
        if kind == "zmq.echo":
            base_case = dataclasses.replace(
                base_case, producers=1, consumers=1, scenario="get_only"
            )
        if kind == "ray":
            base_case = dataclasses.replace(base_case, producers=1, consumers=1)
        else:
            why = baseline(kind).unavailable()
            if why is not None:
                self.note(f"{kind} baseline skipped: {why}")
                return None
        return kind, base_case

    def baseline_of(self, case: Case, kind: str | None = None) -> Result:
        """``baseline_for`` where a target compares with it (``--targets`` measures them)."""
        result = self.baseline_for(case, kind)
        if result is None:
            raise RuntimeError(f"no baseline for {case.label or case.name}")
        return result

    def baseline_for(self, case: Case, kind: str | None = None) -> Result | None:
        """The baseline row for ``case`` (measured once per distinct set-up) on the baseline
        of ``kind`` (default: ``--baseline``'s); None when there is none."""
        key = self.baseline_key(case, kind)
        if key is None:
            return None
        if key not in self._baselines:
            kind, base_case = key
            if kind == "ray":
                self.store_baseline(key, self._run_ray_baseline(base_case))
            else:
                runs = [self.logged(_baseline_label(kind, base_case), i,
                                     lambda: self._run_baseline_once(kind, base_case))
                        for i in range(self.repeats)]
                self.store_baseline(key, self._summarise_baseline(kind, base_case, runs))
        return self._baselines[key]

    def store_baseline(self, key: tuple, result: Result | None) -> None:
        """Remember the baseline row of ``key`` (None: not measurable) and add it to the rows,
        named apart from a row of the same name measured before (the same set-up measured
        again in other rounds: ``B`` tags and ratios name one row each)."""
        self._baselines[key] = result
        if result is not None:
            taken = {r.case for r in self.rows}
            name, n = result.case, 1
            while result.case in taken:
                n += 1
                result.case = f"{name} (#{n})"
            self.rows.append(result)

    def _run_baseline_once(self, kind: str, case: Case) -> Measured:
        return baseline(kind).run(case, self.tmpdir)

    def _summarise_baseline(self, kind: str, case: Case, runs: list[Measured]) -> Result:
        self.tick()
        latency = baseline(kind).latency
        label = _baseline_label(kind, case)
        return _summarise(dataclasses.replace(case, label=label), kind, runs, latency)

    def _run_ray_baseline(self, case: Case) -> Result | None:
        if not ray_available():
            self.note("ray baseline skipped: `ray` is not importable "
                      "(pip install 'zchannel[ray]')")
            return None
        raw = [
            self.logged("ray", i, lambda: run_ray_baselines(
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
        self.tick()
        return _summarise(
            dataclasses.replace(case, label=f"ray.queue {case.ptype} {label}"),
            "ray.queue",
            runs,
            "e2e",
        )

    def note(self, text: str) -> None:
        """A line printed under the report (each text once)."""
        if text not in self.notes:
            self.notes.append(text)


def _baseline_label(kind: str, case: Case) -> str:
    suffix = baseline(kind).suffix(case)
    return (f"{kind} {case.ptype} {fmt_size(case.size)} {case.producers}P/{case.consumers}C "
            f"w{case.window}{suffix}")


def _ray_measured(res: dict, n: int) -> Measured:
    verify_seqs([res["seqs"]], [n])
    return Measured(n, max(1e-9, (res["t_end"] - res["t_start"]) / 1e9), res["lat_ns"])


def measure_ray_actor(runner: Runner, case: Case) -> Result | None:
    """Pipelined Ray actor calls (``window`` in flight) on ``case``'s payloads, as a row."""
    key = ("ray.actor", case)
    if key in runner._baselines:
        return runner._baselines[key]
    result = None
    if not ray_available():
        runner.note("ray comparison skipped: `ray` is not importable "
                    "(pip install 'zchannel[ray]')")
    else:
        raw = [
            runner.logged("ray.actor", i, lambda: run_ray_baselines(
                case.ptype, case.size, case.messages, case.window, queue=False))
            for i in range(runner.repeats)
        ]
        runs = [_ray_measured(r["ray.actor"], case.messages) for r in raw]
        label = f"ray.actor {case.ptype} {fmt_size(case.size)} 1P/1C w{case.window}"
        result = _summarise(dataclasses.replace(case, label=label), "ray.actor", runs, "e2e")
    runner.store_baseline(key, result)
    runner.tick()
    return result


def run_scenario(runner: Runner, scenario: str, base: Case, keys: int | None) -> None:
    for case in scenario_cases(scenario, base, keys):
        if case.hooks and runner.address:
            runner.note("hooks case skipped with --address (hooks are the broker's settings)")
            continue
        runner.measure(case)
