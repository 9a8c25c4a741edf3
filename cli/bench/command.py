"""The ``zchannel bench`` command: its options (also from a ``[bench]`` table of a TOML file),
and one run of a scenario, reported as a table (and ``--json``)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import click
import click.core
from zchannel.broker.handle.broker_channel import BrokerChannel
from zchannel.broker.host.toml import read_toml
from zchannel.broker.server.config import BrokerConfig
from zchannel.broker.server.starting import child_environ
from zchannel.cli.bench.baselines import ray_available
from zchannel.cli.bench.cases import (
    SCENARIOS,
    Case,
    bounded,
    keys_named,
    parse_size,
    scenario_cases,
)
from zchannel.cli.bench.durable import DURABLE_STEPS, run_durable_targets
from zchannel.cli.bench.payloads import PAYLOAD_TYPES, Mismatch
from zchannel.cli.bench.registry import BASELINES
from zchannel.cli.bench.report import (
    Progress,
    TargetResult,
    machine_description,
    print_report,
    write_json,
)
from zchannel.cli.bench.runner import Runner, run_scenario
from zchannel.cli.bench.scaling import (
    SCALING_STEPS,
    Point,
    plot_scaling,
    run_scaling,
    scaling_cases,
    scaling_table,
)
from zchannel.cli.bench.targets import (
    SHM_STEPS,
    TARGET_STEPS,
    Threshold,
    check_target_names,
    load_thresholds,
    parse_thresholds,
    run_shm_targets,
    run_targets,
)
from zchannel.cli.bench.workers import WorkerFailure
from zchannel.cli.failures import EXPECTED, CommandFailure, output_file
from zchannel.cli.shipped import ConfigFile


class BenchFailure(CommandFailure):
    """A run that failed: status 1 for a lost, duplicated or corrupted item or an unexpected
    error (a bug, its traceback printed), 2 for an expected one (a refusal, a timeout)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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

# The options that shape a scenario's cases, and those each scenario reads (the others, given
# on the command line, are refused: ``_check_scenario_options``).  ``quick`` and ``scaling``
# choose their own payloads, the target suites nearly everything.
_STREAM_OPTIONS = frozenset({"payload_type", "payload_size", "messages", "producers",
                             "consumers", "transport", "window", "baseline", "shm"})
_CASE_OPTIONS = _STREAM_OPTIONS | {"keys", "trajectory_batch"}
_SCENARIO_OPTIONS: dict[str, frozenset[str]] = {
    "quick": _STREAM_OPTIONS - {"payload_type", "payload_size"},
    "random_key": _STREAM_OPTIONS | {"keys"},
    "all": _STREAM_OPTIONS | {"keys"},
    "scaling": _STREAM_OPTIONS - {"payload_type", "payload_size"},
    "trajectory": frozenset({"messages", "trajectory_batch", "transport", "shm"}),
    "targets": frozenset({"messages", "shm"}),
    "shm": frozenset({"shm"}),
    "durable": frozenset({"shm"}),
}
# the parameters of the deprecated spellings (--producers) and the options they stand for
_DEPRECATED = {"old_producers": "producers", "old_consumers": "consumers"}
_TARGET_SCENARIOS = ("targets", "shm", "durable")  # the scenarios that read thresholds


def _apply_config(ctx: click.Context, path: str | None, values: dict[str, Any]) -> dict[str, Any]:
    """Values from ``[bench]`` of a TOML file, for options not given on the command line."""
    if not path:
        return values
    data = read_toml(path)
    unknown = set(data) - {"bench", "targets"}
    if unknown:
        raise click.BadParameter(f"{path}: unknown table(s) {sorted(unknown)} (a bench config "
                                 "holds [bench] and [targets])")
    table = data.get("bench", {})
    if not isinstance(table, dict):
        raise click.BadParameter(f"[bench] of {path} must be a table")
    params = {p.name: p for p in ctx.command.params}
    out = dict(values)
    spelled: dict[str, str] = {}  # option -> the key of the table that set it
    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        key = _CONFIG_ALIASES.get(key, key)
        if key not in _OPTION_NAMES:
            raise click.BadParameter(f"unknown option {raw_key!r} in [bench] of {path}")
        if key in spelled:  # two spellings of one option (repeat and repeats): which one?
            raise click.BadParameter(
                f"[bench] of {path} sets one option twice: {spelled[key]} = "
                f"{table[spelled[key]]!r} and {raw_key} = {value!r}; keep one")
        spelled[key] = raw_key
        if ctx.get_parameter_source(key) in (click.core.ParameterSource.DEFAULT, None):
            param = params[key]
            # a TOML value keeps its type: true or 1.9 is not an int (click would cast them to 1)
            ints = isinstance(param.type, click.types.IntParamType)
            if isinstance(value, bool) or (ints and type(value) is not int):
                raise click.BadParameter(f"{raw_key} = {value!r} in [bench] of {path}: expected "
                                         f"{'an integer' if ints else 'a string'}")
            try:  # the checks of the command-line option: type, choices, range and callback
                out[key] = param.process_value(ctx, value)
            except click.BadParameter as exc:
                raise click.BadParameter(f"{raw_key} = {value!r} in [bench] of {path}: "
                                         f"{exc.format_message()}") from None
    return out


def _checked_size(value: str) -> str:
    """``--payload-size`` as given, once ``parse_size`` accepts it (a bad one names the option)."""
    parse_size(value)
    return value


def _restore_env(name: str, value: str | None) -> None:
    """Set ``os.environ[name]`` back to ``value`` (None: the variable was not set)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _thresholds(config_path: str | None) -> dict[str, Threshold]:
    """The thresholds of the default file, those that ``[targets]`` of ``--config`` names
    replaced by its own (so a partial table is checked before anything runs, and the rest keep
    their defaults)."""
    thresholds = load_thresholds()
    if config_path:
        table = read_toml(config_path).get("targets")
        if table is not None:
            given = parse_thresholds(table, config_path)
            check_target_names(given, thresholds, config_path)
            thresholds.update(given)
    return thresholds


def _scenario_thresholds(scenario: str, config_path: str | None) -> dict[str, Threshold]:
    """The thresholds of a scenario with targets (``_thresholds``); {} for another, whose
    ``--config`` file's ``[targets]`` table, if it has one, is checked all the same: a bad
    table is an error whatever the scenario, not only once a run with targets reads it."""
    if scenario in _TARGET_SCENARIOS:
        return _thresholds(config_path)
    if config_path and read_toml(config_path).get("targets") is not None:
        _thresholds(config_path)
    return {}


@click.command(short_help="Benchmark a broker against ZeroMQ, mp, Redis and Ray baselines.")
@click.option(
    "--scenario",
    type=click.Choice(SCENARIOS),
    default="quick",
    show_default=True,
    help="what to measure (quick: a short suite; targets: T1-T4, T2s, T6-T10, as --targets; "
    "shm: T9, T9w (T9 written in slots), T9z (zero-copy), T9d (defaults vs tuned T9), "
    "T9-copy (vs np.copyto of distinct items, np.copyto.stream), T9-pipe (vs the bare "
    "two-copy ring), T10; durable: D1-D4 and D3b, the "
    "cost of a journal against the disk, no journal and Redis with AOF; scaling: curves over "
    "processes, keys and item size, with --plot DIR)",
)
@click.option(
    "--payload-type", type=click.Choice(PAYLOAD_TYPES), default="bytes", show_default=True
)
@click.option(
    "--payload-size",
    default="64B",
    show_default=True,
    callback=lambda _ctx, _param, value: _checked_size(value),
    help="bytes per item: 64, 64B, 4KB, 16MB, 1GB",
)
@click.option(
    "--messages",
    type=click.IntRange(1),
    default=20000,
    show_default=True,
    help="items per case (large payloads are capped at 1 GiB per case, at least one item)",
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
    "--baseline",
    type=click.Choice(("zmq", "zmq.proxy.depth", "ray", "mp", "redis", "redis.single",
                       "redis-mem", "redis-mem.single", "none")),
    default="zmq",
    show_default=True,
    help="what each case is compared with in the same run: zmq = a zmq.proxy relay at "
    "libzmq's default HWM (an echo for get_only), zmq.proxy.depth = the relay at the case's "
    "window, Ray, multiprocessing.Queue, a Redis list with its append-only file (redis: "
    "appendfsync everysec) or in memory (redis-mem), its consumer popping 64 items per "
    "command, or (.single) pipelining 64 single pops; Redis needs redis-server on PATH",
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
    help="keys of each producer of the random_key scenario (default: up to 128; in all at "
    f"most the {BrokerConfig.max_keys:,} keys the broker bench starts holds)",
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
@click.option(
    "--targets",
    "targets_flag",
    is_flag=True,
    help="the target suite T1-T4, T2s, T6-T10 with PASS/FAIL (the same as --scenario targets; "
    "thresholds: [targets] of configs/bench_targets.toml or of --config)",
)
@click.option("--address", default=None, help="measure the running broker at this address")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, writable=True, allow_dash=True),
    callback=output_file,
    help="also write every row (with each repeat) and the machine description to this file; "
    "'-' prints the JSON on stdout and the report on stderr",
)
@click.option(
    "--plot",
    "plot_dir",
    type=click.Path(file_okay=False, writable=True),
    default=None,
    help="--scenario scaling: draw the curves as PNGs in this directory (needs matplotlib, "
    "the plot extra)",
)
@click.option(
    "--config",
    "config_path",
    type=ConfigFile(),
    help="a TOML file with a [bench] table of these options (configs/NAME.toml also finds the "
    "copy installed with zchannel)",
)
@click.pass_context
def bench(
    ctx: click.Context,
    config_path: str | None,
    targets_flag: bool,
    plot_dir: str | None,
    **values: Any,
) -> None:
    """Benchmark a channel broker against raw-ZeroMQ (or mp, Redis, Ray) baselines.

    Starts what it needs (or measures --address), runs bounded load, checks every item and
    prints one table with a legend and the ratios in words (docs/benchmarks.md: how to read
    it); exits 1 on a lost, duplicated or corrupted item (or a worker's unexpected error, its
    traceback printed), 2 on another failure.  Progress goes to stderr.
    """
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C, so every worker and broker is ended in its finally block
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, previous))
    _deprecated_counts(ctx, values)
    opts = _apply_config(ctx, config_path, values)
    if targets_flag:
        opts["scenario"] = _targets_scenario(ctx, opts["scenario"])
    base = _base_case(opts, config_path)
    _worker_environment(ctx, base)
    scenario = opts["scenario"]
    _check_plot(plot_dir, scenario)
    _check_scenario_options(ctx, scenario)
    _check_baseline(opts["baseline"])
    if not opts.get("address"):
        _check_keys(base, scenario, opts.get("keys"))
    thresholds = _scenario_thresholds(scenario, config_path)
    if opts.get("address"):
        _check_address(opts["address"])
    machine = machine_description()
    with tempfile.TemporaryDirectory(prefix="zcb-", dir="/tmp") as tmpdir:
        runner = Runner(
            address=opts.get("address"),
            baseline=opts["baseline"],
            repeats=int(opts["repeats"]),
            tmpdir=tmpdir,
        )
        started = time.monotonic()
        run = _run_scenario(ctx, runner, base, opts, thresholds, config_path)
        elapsed = time.monotonic() - started
    out = _report(opts, machine, runner, run, elapsed, base.size)
    if plot_dir and run.points:
        _plot(run, plot_dir, opts.get("json_path"), out)
    if run.traceback is not None:  # a worker's unexpected error: what a bug report needs
        click.echo(run.traceback.rstrip(), err=True)
    if run.error is not None:
        raise BenchFailure(run.error, run.status)


def _check_plot(plot_dir: str | None, scenario: str) -> None:
    """``--plot`` draws the scaling curves with matplotlib (the ``plot`` extra) in DIR: a
    missing ``--scenario scaling`` or matplotlib, or a DIR that cannot be made or written, is
    a usage error before the run, not after it (DIR is made now)."""
    if plot_dir is None:
        return
    if scenario != "scaling":
        raise click.UsageError(f"--plot draws the scaling curves: give --scenario scaling "
                               f"(not {scenario})")
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise click.UsageError(
            "--plot needs matplotlib; install the extra: pip install 'zchannel[plot]'") from None
    try:
        os.makedirs(plot_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=plot_dir):
            pass
    except OSError as exc:
        raise click.UsageError(f"--plot {plot_dir}: cannot write the plots there: "
                               f"{exc.strerror or exc}") from None


def _check_keys(base: Case, scenario: str, keys: int | None) -> None:
    """The keys of each case of ``scenario`` against the ``max_keys`` limit of the broker the
    bench starts (it refuses a key past the limit): too many is a usage error before the run,
    naming ``--keys`` (or, for the scaling curve, which takes its own key counts, the
    options that make its keys too many)."""
    cases = ([c for _, _, c in scaling_cases(base)] if scenario == "scaling"
             else scenario_cases(scenario, base, keys))
    limit = BrokerConfig.max_keys
    for case in cases:
        named = keys_named(bounded(case))
        if named <= limit:
            continue
        why = (f"the case {case.name} puts its items on {named:,} keys ({case.producers} "
               f"producer(s), each on up to {case.keys:,} keys of its own), and the broker "
               f"zchannel bench starts holds at most {limit:,} keys (its max_keys)")
        if scenario == "scaling":
            raise click.UsageError(f"{why}; give fewer --messages or --num-producers")
        raise click.BadParameter(
            f"{keys}: {why}; give --keys {limit // case.producers:,} or fewer, or measure a "
            "broker started with a larger --max-keys (--address)", param_hint="--keys")


def _check_baseline(kind: str) -> None:
    """A ``--baseline`` that cannot run here (its extra or server missing) is a usage error
    before the run, not a skipped row after it."""
    if kind == "ray":
        why = None if ray_available() else "Ray is not installed (pip install 'zchannel[ray]')"
    else:
        entry = BASELINES.get(kind)
        why = entry.unavailable() if entry is not None else None
    if why is not None:
        raise click.UsageError(f"--baseline {kind} cannot run here: {why}")


def _check_scenario_options(ctx: click.Context, scenario: str) -> None:
    """Options given on the command line that shape cases ``scenario`` does not read (its
    cases set their own: ``--transport`` for the shared-memory targets, which run over ipc)
    are a usage error naming them, before the run, not dropped without a word.  A ``[bench]``
    table's are left unused: one file serves several scenarios."""
    used = _SCENARIO_OPTIONS.get(scenario, _STREAM_OPTIONS)
    flags = {param.name or "": param.opts[0] for param in ctx.command.params}
    unused = {_DEPRECATED.get(name, name): flag for name, flag in flags.items()
              if _DEPRECATED.get(name, name) in _CASE_OPTIONS - used
              and ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE}
    if not unused:
        return
    takes = ", ".join(flag for name, flag in flags.items() if name in used) or "none of them"
    others = ", ".join(s for s in SCENARIOS if set(unused) <= _SCENARIO_OPTIONS.get(
        s, _STREAM_OPTIONS))
    raise click.UsageError(
        f"--scenario {scenario} does not use {', '.join(unused.values())}: its cases set "
        f"their own (docs/benchmarks.md, \"What is measured\"); of the options that shape "
        f"cases it takes {takes}.  Leave the others out"
        + (f", or give a scenario that uses them ({others})" if others else ""))


def _check_address(address: str) -> None:
    """``--address``: no broker there, or a channel that deals items to its consumers, is an
    expected failure (status 2) before anything is put.  The bench's consumers have no
    consumer id, which a dealing channel's consumers need: its items would be dealt to the
    channel's own consumers and stay in their private queues."""
    handle = BrokerChannel(None, address)
    try:
        if not handle._connection(timeout=5.0).broker_info.deals:
            return
        stats = handle.stats(exclude_self=True)
    finally:
        handle.close()
    consumers = ", ".join(str(c) for c in stats.get("consumers") or ()) or "none declared"
    raise BenchFailure(
        f"--address {address}: channel {stats.get('name')!r} deals items to consumers "
        f"(dispatcher {stats.get('dispatcher')!r}; consumers: {consumers}): a consumer needs "
        "an identity, which the bench's consumers do not have, and the bench's items would "
        "stay in the private queues of the channel's own consumers; nothing was put.  Measure "
        "a broker whose channel does not deal (no dispatcher, or the shared one)", 2)


@dataclasses.dataclass
class _Run:
    """What one run of a scenario gave besides the runner's rows."""

    targets: list[TargetResult] = dataclasses.field(default_factory=list)
    points: list[Point] = dataclasses.field(default_factory=list)
    error: str | None = None
    status: int = 0  # the exit status of the error (``BenchFailure``)
    traceback: str | None = None  # of a worker's unexpected error


def _deprecated_counts(ctx: click.Context, values: dict[str, Any]) -> None:
    """--producers/--consumers (deprecated) as --num-producers/--num-consumers, with a warning."""
    for old, new in (("old_producers", "producers"), ("old_consumers", "consumers")):
        count = values.pop(old)
        if count is not None:
            click.echo(f"warning: bench --{new} is deprecated; use --num-{new}", err=True)
            if ctx.get_parameter_source(new) is click.core.ParameterSource.DEFAULT:
                values[new] = count


def _targets_scenario(ctx: click.Context, scenario: str) -> str:
    """--targets: the target suite, refused beside another --scenario."""
    if scenario not in ("targets", "quick") or (
        scenario == "quick"
        and ctx.get_parameter_source("scenario") is not click.core.ParameterSource.DEFAULT
    ):
        raise click.BadParameter(
            f"--targets runs the target suite; it cannot be combined with --scenario {scenario}"
        )
    return "targets"


def _base_case(opts: dict[str, Any], config_path: str | None) -> Case:
    """The case the options describe (each scenario's cases are made from it)."""
    try:
        size = parse_size(opts["payload_size"])
    except click.BadParameter as exc:  # the command line's value was checked: the file's is bad
        exc.param_hint = f"payload_size in [bench] of {config_path}"
        raise
    return Case(
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


def _worker_environment(ctx: click.Context, base: Case) -> None:
    """The environment the workers and baselines inherit (spawned): shared memory off with
    --shm off, the brokers' allocator tunables; both given back when the command ends."""
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


def _run_scenario(ctx: click.Context, runner: Runner, base: Case, opts: dict[str, Any],
                  thresholds: dict[str, Threshold], config_path: str | None) -> _Run:
    """Run the scenario with a progress bar; a mismatch or a failure becomes the run's error."""
    scenario, keys = opts["scenario"], opts.get("keys")
    n_steps = {"targets": TARGET_STEPS, "shm": SHM_STEPS, "trajectory": 4,
               "durable": DURABLE_STEPS, "scaling": SCALING_STEPS}.get(scenario)
    if n_steps is None:  # the cases and their distinct baselines
        cases = [bounded(c) for c in scenario_cases(scenario, base, keys)]
        n_steps = len(cases) + len({runner.baseline_key(c) for c in cases} - {None})
    run = _Run()
    try:
        with Progress(f"zchannel bench {scenario}", n_steps, runner.repeats) as bar:
            runner.progress = bar
            if scenario == "targets":
                run.targets = run_targets(runner, base, runner.tmpdir, thresholds)
            elif scenario == "shm":
                run.targets = run_shm_targets(runner, thresholds)
            elif scenario == "durable":
                run.targets = run_durable_targets(runner, thresholds)
            elif scenario == "scaling":
                run.points = run_scaling(runner, base)
            elif scenario == "trajectory":
                _trajectory(ctx, runner, base, opts, config_path)
            else:
                run_scenario(runner, scenario, base, keys)
    except Mismatch as exc:
        run.error, run.status = f"content check failed: {exc}", 1
    except WorkerFailure as exc:  # a bug (its traceback) is status 1, an expected error 2
        run.traceback = exc.traceback
        unexpected = " (an unexpected error: its traceback is on stderr)" if exc.traceback else ""
        run.error, run.status = f"benchmark failed: {exc}{unexpected}", 1 if unexpected else 2
    except (*EXPECTED, RuntimeError) as exc:
        run.error, run.status = f"benchmark failed: {exc}", 2
    return run


def _trajectory(ctx: click.Context, runner: Runner, base: Case, opts: dict[str, Any],
                config_path: str | None) -> None:
    """The trajectory scenario: its global steps from --messages when given, else its own."""
    # loaded for this scenario only: it imports zchannel.embodied (and its hooks)
    from zchannel.cli.bench.trajectory import TRAJECTORY_STEPS, run_trajectory

    given = ctx.get_parameter_source("messages") not in (
        click.core.ParameterSource.DEFAULT,
        None,
    ) or (config_path and "messages" in opts and opts["messages"] != 20000)
    steps = int(opts["messages"]) if given else TRAJECTORY_STEPS
    run_trajectory(runner, base, steps, int(opts["trajectory_batch"]))


def _report(opts: dict[str, Any], machine: dict[str, Any], runner: Runner, run: _Run,
            elapsed: float, size: int) -> Callable[[str], None]:
    """The table, the scaling curves and the --json file; returns where the report's lines
    went (stdout, or stderr with ``--json -``)."""
    scenario = opts["scenario"]
    # with --json - the JSON owns stdout and the report goes to stderr
    out = (lambda line: click.echo(line, err=True)) if opts.get("json_path") == "-" else click.echo
    out(f"zchannel bench {scenario}: {runner.repeats} run(s) per case, medians shown; "
        f"{elapsed:.1f}s")
    out(f"machine: {machine['cpu_count']} CPUs ({machine['cpu_model']}), load average "
        f"{machine['loadavg'][0]:.1f}")
    out(f"versions: zchannel {machine['zchannel']}, python {machine['python']}, torch "
        f"{machine['torch']}, pyzmq {machine['pyzmq']} (libzmq {machine['libzmq']})")
    out("")
    warnings = print_report(runner.rows, run.targets, runner.notes, out)
    if run.points:
        out("")
        out("scaling (markdown; ratio = items/s over the baseline's, same run):")
        for line in scaling_table(run.points):
            out(line)
    if opts.get("json_path"):
        options = {k: opts.get(k) for k in _OPTION_NAMES}
        options["payload_bytes"] = size
        write_json(opts["json_path"], machine, options, runner.rows, run.targets, runner.notes,
                   run.error is None, run.error, warnings)
    return out


def _plot(run: _Run, plot_dir: str, json_path: str | None, out: Callable[[str], None]) -> None:
    """The PNGs of the scaling curves in ``plot_dir``, drawn after the table and the --json
    file, so a failure here loses no result: it is an error naming --plot (a warning when
    the run failed already, whose error then stands)."""
    try:
        for path in plot_scaling(run.points, plot_dir):
            out(f"plot: {path}")
    except OSError as exc:
        kept = "" if not json_path else (" and in the JSON on stdout" if json_path == "-"
                                         else f" and in {json_path}")
        message = (f"--plot {plot_dir}: the plots could not be written: {exc}; the results "
                   f"are in the table above{kept}")
        if run.error is None:
            raise click.ClickException(message) from None
        out(f"warning: {message}")
