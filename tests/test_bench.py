"""``zchannel bench`` on tiny sizes: exit status, table rows, the JSON file, and a corrupted
item failing the run."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import click
import numpy as np
import pytest
from click.testing import CliRunner
from zchannel.cli.bench import bench, parse_size
from zchannel.cli.bench.payloads import CORRUPT_ENV, Mismatch, PayloadFactory, verify_seqs
from zchannel.cli.bench.registry import BASELINES
from zchannel.cli.main import main

pytestmark = pytest.mark.timeout(60)


def _run(*args: str, env: dict | None = None):
    return CliRunner().invoke(bench, list(args), env=env, catch_exceptions=False)


def test_parse_size():
    assert parse_size("64") == 64
    assert parse_size("64B") == 64
    assert parse_size("1KB") == 1024
    assert parse_size("16MB") == 16 << 20
    assert parse_size("1GiB") == 1 << 30
    with pytest.raises(click.BadParameter):
        parse_size("12XB")


@pytest.mark.parametrize(
    "ptype", ["bytes", "numpy", "tensor", "tensor_list", "tensor_dict", "dataclass"]
)
def test_payloads_check_themselves(ptype):
    fac = PayloadFactory(ptype, 256, ring=2)
    item, views = fac.make(5, 5)
    assert fac.check(item)[0] == 5
    views[-1][-3] ^= 1
    with pytest.raises(Mismatch):
        fac.check(item)
    verify_seqs([np.array([0, 1], dtype="uint64")], [2])
    with pytest.raises(Mismatch):
        verify_seqs([np.array([0, 0], dtype="uint64")], [2])


def test_registered_as_subcommand():
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0
    assert "--payload-type" in result.output


@pytest.mark.timeout(40)
def test_channel_with_zmq_baseline_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = _run("--scenario", "channel", "--messages", "300", "--window", "8", "--json", str(out),
                  "--repeat", "1")
    assert result.exit_code == 0, result.output
    assert "channel bytes 64B 1P/1C w8" in result.stdout
    assert "zmq.proxy bytes 64B 1P/1C w8" in result.stdout
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["error"] is None
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["pyzmq"]
    kinds = {row["kind"] for row in doc["rows"]}
    assert kinds == {"zchannel", "zmq.proxy"}
    row = next(r for r in doc["rows"] if r["kind"] == "zchannel")
    assert row["messages"] == 300 and row["items_s"] > 0 and row["ratio"] > 0
    assert row["rss_peak_mb"] > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ptype", ["tensor", "tensor_dict"])
def test_the_mp_baseline_carries_tensors_as_torch_shares_them(tmp_path, ptype):
    """With torch imported, multiprocessing.Queue sends a tensor's memory as a descriptor its
    producer hands out: the baseline's producer stays until its items were taken."""
    out = tmp_path / "bench.json"
    result = _run("--scenario", "channel", "--payload-type", ptype, "--messages", "300",
                  "--window", "8", "--baseline", "mp", "--repeat", "1", "--json", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["error"] is None
    rows = {row["kind"]: row for row in doc["rows"]}
    assert set(rows) == {"zchannel", "mp"}
    assert rows["mp"]["messages"] == 300 and rows["mp"]["items_s"] > 0


@pytest.mark.timeout(40)
def test_config_file_and_scenarios(tmp_path):
    cfg = tmp_path / "b.toml"
    cfg.write_text(
        '[bench]\nscenario = "batch"\npayload_type = "tensor_dict"\n'
        'payload_size = "1KB"\nmessages = 256\nbaseline = "none"\n'
    )
    out = tmp_path / "b.json"
    result = _run("--config", str(cfg), "--json", str(out), "--repeat", "1")
    assert result.exit_code == 0, result.output
    assert "batch tensor_dict 1KiB 1P/1C w64" in result.stdout
    result = _run(
        "--scenario",
        "get_only",
        "--window",
        "1",
        "--messages",
        "100",
        "--baseline",
        "none",
        "--payload-type",
        "dataclass",
        "--repeat",
        "1",
    )
    assert result.exit_code == 0, result.output
    assert "get_only dataclass 64B 1P/1C w1" in result.stdout


@pytest.mark.timeout(40)
def test_corrupted_item_fails_the_run(tmp_path):
    out = tmp_path / "bad.json"
    result = _run(
        "--scenario",
        "channel",
        "--messages",
        "200",
        "--baseline",
        "none",
        "--json",
        str(out),
        "--repeat",
        "1",
        env={CORRUPT_ENV: "17"},
    )
    assert result.exit_code == 1
    assert "content mismatch" in result.output
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and "mismatch" in doc["error"]


@pytest.mark.timeout(90)  # two brokers and six workers importing torch: ~27 s at load 11
def test_trajectory_collector_counts(tmp_path):
    from zchannel.cli.bench.trajectory import TrajectoryCase, check_counts, run_trajectory_case

    case = TrajectoryCase(mode="pipeline", batch=4, image=8, steps=1)
    res = run_trajectory_case(case, True, str(tmp_path), lambda n: f"ipc://{tmp_path}/{n}.sock")
    assert res["outputs"] == case.expected_outputs() == sum(res["per_consumer"]) > 0
    assert res["chunks"] == 2 * 8 and res["seconds"] > 0
    with pytest.raises(Mismatch, match="expected 5"):
        check_counts([{"count": 2}, {"count": 2}], 5, "pipeline")
    assert "trajectory" in CliRunner().invoke(bench, ["--help"]).output


@pytest.mark.timeout(120)
def test_cases_run_in_rounds_with_their_baselines(tmp_path, monkeypatch):
    """measure_together: one run of each case, then of each baseline not measured yet, per
    round; a baseline measured already is reused unless asked for fresh."""
    from zchannel.cli.bench import runner as runner_mod
    from zchannel.cli.bench.cases import Case

    order: list[str] = []

    def logged(name, fn):
        def run(case, *args, **kwargs):
            order.append(f"{name}:{case.producers}")
            return fn(case, *args, **kwargs)

        return run

    monkeypatch.setattr(
        runner_mod, "run_channel_stream", logged("case", runner_mod.run_channel_stream)
    )
    relay = BASELINES["zmq.proxy"]
    monkeypatch.setitem(BASELINES, "zmq.proxy",
                        dataclasses.replace(relay, run=logged("proxy", relay.run)))
    runner = runner_mod.Runner(address=None, baseline="zmq", repeats=2, tmpdir=str(tmp_path))
    one = Case("channel", messages=300, window=16)
    two = dataclasses.replace(one, producers=2, consumers=2)
    a, b = runner.measure_together([one, two])
    assert order == ["case:1", "case:2", "proxy:1", "proxy:2"] * 2
    assert a.messages == b.messages == 300 and a.ratio > 0 and b.ratio > 0
    order.clear()
    runner.repeats = 1  # the rounds are checked above: one round each from here
    runner.measure(one)  # its baseline is known: the case alone
    assert order == ["case:1"]
    order.clear()
    runner.measure_together([one], fresh=True)
    assert order == ["case:1", "proxy:1"]
    proxies = [r for r in runner.rows if r.kind == "zmq.proxy"]
    assert len(proxies) == 3  # 1P/1C twice (fresh adds a row), 2P/2C once
    # the row measured again is named apart: its B tag, and the ratio naming it, are its own
    assert len({r.case for r in proxies}) == 3 and proxies[-1].case.endswith("(#2)")
    assert runner.rows[-1].kind == "zchannel" and runner.rows[-1].baseline == proxies[-1].case
    from zchannel.cli.bench.report import baseline_tags

    assert sorted(baseline_tags(runner.rows).values()) == ["B1", "B2", "B3"]


def test_a_case_bounded_to_a_smaller_window_is_labelled_with_it():
    from zchannel.cli.bench.cases import Case, bounded

    big = Case("channel", ptype="numpy", size=64 << 20, window=8, label="scaling size=64MiB w8")
    run = bounded(big)
    assert run.window < 8 and run.label == f"scaling size=64MiB w{run.window}"
    assert bounded(Case("channel", window=64, label="x w64")).label == "x w64"


@pytest.mark.timeout(90)
def test_report_is_readable(tmp_path):
    """--repeat 2: progress lines on stderr, a legend, every ratio naming its baseline and which
    way is better, median with range and spread; --json - prints the JSON on stdout (with each
    repeat) and the report on stderr; the deprecated --producers still works, with a warning."""
    result = _run("--scenario", "get_only", "--window", "1", "--messages", "100",
                  "--repeat", "2")
    assert result.exit_code == 0, result.output
    out, err = result.stdout, result.stderr
    assert "zchannel bench get_only: 2 cases and baselines, 2 run(s) each" in err
    assert re.search(r"get_only bytes 64B 1P/1C w1: run 2/2, [\d,]+ items/s in", err)
    assert re.search(r"zmq.echo bytes 64B 1P/1C w1: run 1/2", err)
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 100, out  # fits a 100-column terminal
    fast, slow = lines.index("throughput (medians over the repeats):"), \
        lines.index("latency and memory:")
    assert all(word in lines[fast + 1] for word in ("items/s", "range (min-max)", "spread"))
    assert all(word in lines[slow + 1] for word in ("p50 us", "vs baseline (p50)"))
    # the get_only case is compared on p50: its ratio stands in the latency table, not beside
    # its items/s
    row = next(line for line in lines[fast:slow] if line.startswith("get_only"))
    assert re.search(r"\s\d+-\d+\s+\d+%\s", row) and row.endswith(" -")
    row = next(line for line in lines[slow:] if line.startswith("get_only"))
    assert re.search(r"\s[\d.]+x B1 \((about the same|[\d.]+x (faster|slower))\)$", row), row
    assert re.search(r"get_only bytes 64B 1P/1C w1: [\d.]+x the p50 latency of B1 = zmq.echo "
                     r"bytes 64B 1P/1C w1 \(raw DEALER -> ROUTER echo.*\); lower is better, so "
                     r"(about the same|[\d.]+x (faster|slower)); per round [\d.]+x-[\d.]+x",
                     " ".join(out.split()))
    legend = out[out.index("legend:"):]
    for abbreviation in ("1P/1C", "w64", "p50, p99 us", "B1, B2", "RSS MB", "zmq.echo = "):
        assert abbreviation in legend

    result = _run("--scenario", "channel", "--messages", "300", "--window", "8", "--repeat",
                  "2", "--producers", "2", "--json", "-")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["options"]["repeats"] == 2 and doc["options"]["producers"] == 2
    row = next(r for r in doc["rows"] if r["kind"] == "zchannel")
    assert row["repeats"] == 2 and len(row["runs"]["items_s"]) == 2
    assert len(row["runs"]["p50_us"]) == 2 and len(row["ratio_runs"]) == 2
    assert row["ratio_higher_is_better"] is True and row["baseline"].startswith("zmq.proxy")
    assert row["case"] == "channel bytes 64B 2P/1C w8"
    assert "bench --producers is deprecated; use --num-producers" in result.stderr
    assert re.search(r"\s[\d.]+x B1 \((about the same|[\d.]+x (faster|slower))\)\n",
                     result.stderr)
    assert "--num-producers" in CliRunner().invoke(bench, ["--help"]).output


def test_report_explains_queueing_and_warns_on_spread():
    """A 40 ms p50 of 64 B items in a w64 window is explained; a 50 % spread warns."""
    from zchannel.cli.bench.report import Result, print_report, set_ratio

    def row(case, kind, runs, p50, window=64, latency="e2e"):
        return Result(case=case, kind=kind, scenario="channel", ptype="bytes", size=64,
                      producers=1, consumers=1, transport="ipc", window=window, messages=100,
                      items_s=sorted(runs)[len(runs) // 2], mb_s=1.0, p50_us=p50, p99_us=p50,
                      latency=latency, seconds=1.0, repeats=len(runs),
                      runs={"items_s": runs, "p50_us": [p50] * len(runs)})

    base = row("zmq.proxy bytes 64B 1P/1C w64", "zmq.proxy", [50000.0, 52000.0, 51000.0], 20000.0)
    noisy = row("channel bytes 64B 1P/1C w64", "zchannel", [20000.0, 30000.0, 25000.0], 40000.0)
    noisier = row("batch bytes 64B 1P/1C w64", "zchannel", [10000.0, 30000.0, 20000.0], 9000.0,
                  latency="get_batch")
    steady = row("get_only bytes 64B 1P/1C w1", "zchannel", [6000.0, 6100.0, 6050.0], 80.0,
                 window=1, latency="get")
    set_ratio(noisy, base, "items/s")
    assert noisy.ratio == pytest.approx(25000 / 51000) and len(noisy.ratio_runs) == 3
    lines: list[str] = []
    warnings = print_report([base, noisy, noisier, steady], [], [], lines.append)
    assert max(len(line) for line in lines) <= 100, "\n".join(lines)
    text = " ".join(" ".join(lines).split())  # wrapped lines joined
    assert "40000.0*" in text and "p50 *" in text
    assert "channel bytes 64B 1P/1C w64: p50 40.0 ms = about 1,000 items waiting ahead" in text
    assert "one request alone takes 80 us (get_only bytes 64B 1P/1C w1)" in text
    assert "0.49x the items/s of B1 = zmq.proxy" in text and "2.04x slower" in text
    # one warning for the noisy machine, naming each noisy row once
    assert len(warnings) == 2 and all(w in text for w in warnings)
    assert sum(line.startswith("warning:") for line in lines) == 1
    assert "channel bytes 64B 1P/1C w64: items/s varied 40% between repeats" in warnings[0]
    assert warnings[1].startswith("batch bytes 64B 1P/1C w64: items/s varied 100%")

def test_shm_targets_measure_the_defaults_beside_tuned_t9(tmp_path, monkeypatch):
    """``--scenario shm``: T9d (the burst as users write it: windows 64, unbounded queue, no
    ``reserve_shm``) runs in the same rounds as T9 and is reported as a ratio to it."""
    from zchannel.cli.bench import runner as runner_mod
    from zchannel.cli.bench import targets as targets_mod
    from zchannel.cli.bench.cases import Measured
    from zchannel.cli.bench.channel import producer_specs

    runs: list = []

    def fake_stream(case, *args, **kwargs):
        runs.append(case)
        seconds = 2.0 if case.label.startswith("T9d") else 1.0
        return Measured(case.messages, seconds, np.array([1000], dtype=np.int64))

    def fake_proxy(case, *args, **kwargs):
        return Measured(case.messages, 4.0, np.array([1000], dtype=np.int64))

    monkeypatch.setattr(runner_mod, "run_channel_stream", fake_stream)
    def fake_ring(case, *args, **kwargs):
        return Measured(case.messages, 0.5, np.array([1000], dtype=np.int64))

    for kind in ("zmq.proxy", "zmq.proxy.depth"):
        monkeypatch.setitem(BASELINES, kind, dataclasses.replace(BASELINES[kind], run=fake_proxy))
    monkeypatch.setitem(BASELINES, "copy.pipeline",
                        dataclasses.replace(BASELINES["copy.pipeline"], run=fake_ring))
    monkeypatch.setattr(targets_mod, "measure_ray_actor", lambda runner, case: None)
    runner = runner_mod.Runner(address=None, baseline="none", repeats=3, tmpdir=str(tmp_path))
    targets = targets_mod.run_shm_targets(runner)
    labels = [c.label.split()[0] for c in runs]
    assert labels[:12] == ["T9", "T9w", "T9d", "T9z"] * 3  # interleaved, one of each per round
    tuned, in_slot, default = runs[0], runs[1], runs[2]
    assert (tuned.window, tuned.maxsize, tuned.reserve, tuned.in_slot) == (8, 8, True, False)
    # T9w: T9's stream with the producer writing each tensor in its slot (empty_shm)
    assert in_slot == dataclasses.replace(tuned, in_slot=True, label=in_slot.label)
    assert producer_specs(in_slot, "ipc://x", "k")[0]["in_slot"] is True
    compared = {r.case.split()[0]: r.baseline for r in runner.rows}
    assert compared["T9w"] == compared["T9"] is not None  # both against the same relay
    relays = [r.case for r in runner.rows if r.case.startswith("zmq.proxy")]
    assert len(relays) == len(set(relays)) == 2  # one 16 MiB relay (T9, T9w), one 1 MiB (T10)
    assert (default.window, default.maxsize, default.reserve) == (64, 0, False)
    assert default.size == tuned.size == 16 << 20 and default.messages == tuned.messages
    spec = producer_specs(default, "ipc://x", "k")[0]
    assert spec["shm_slots"] == 0 and spec["window"] == 64
    (t9d,) = [t for t in targets if t.target == "T9d"]
    assert t9d.ratio == 0.5 and t9d.threshold == 0.9 and not t9d.passed
    assert not [r for r in runner.rows if r.case.startswith("T9d") and r.baseline]
    # zero-copy: slots written by the producer, views for the consumer; items/s, absolute
    zero = runs[3]
    assert zero == dataclasses.replace(in_slot, views=True, compare=False, label=zero.label)
    by_name = {t.target: t for t in targets}
    assert by_name["T9z"].measured == by_name["T9z"].ratio == 256.0  # 256 items in 1 s
    # T9 against np.copyto of distinct 16 MiB items (rotating buffers), in the same rounds;
    # the fixed-buffer np.copyto is a row of the report beside it
    (stream,) = [r for r in runner.rows if r.kind == "np.copyto.stream"]
    (copy,) = [r for r in runner.rows if r.kind == "np.copyto"]
    assert stream.repeats == copy.repeats == 3 and stream.size == copy.size == 16 << 20
    assert by_name["T9-copy"].reference == pytest.approx(stream.mb_s)
    # and against the bare copy-in, copy-out ring (two copies and the check, nothing else)
    (ring,) = [r for r in runner.rows if r.kind == "copy.pipeline"]
    assert ring.repeats == 3 and ring.size == 16 << 20
    assert by_name["T9-pipe"].reference == pytest.approx(ring.mb_s)
    assert by_name["T9-pipe"].ratio == pytest.approx(0.5) and not by_name["T9-pipe"].passed


def test_payloads_built_in_slots_pass_the_check(make_remote):
    """T9w's producer (``PayloadFactory.make_in``) writes the payload into memory lent by
    ``empty_shm`` once, then only stamps it; every item the consumer gets checks out in full."""
    from zchannel.broker import shm

    ch = make_remote("bench-in-slot", shm_threshold=1 << 16)
    fac = PayloadFactory("tensor", 1 << 18)
    pool = ch._connection().shm.pool
    for i in range(6):
        item = fac.make_in(ch.empty_shm, i, i)
        assert pool.lent  # the item lives in a slot
        ch.put(item)
        del item
        assert fac.check(ch.get(timeout=10))[0] == i
    segs = list(pool.by_name.values())
    assert len(segs) == 1 and int((segs[0].states == shm.USED).sum()) <= 1


@pytest.mark.timeout(120)
def test_stream_target_runs_with_its_baselines(tmp_path):
    """T2s on a tiny stream: a producer process with 16 async puts in flight, a consumer
    process with 16 async gets outstanding (default ``Channel.create``, nothing reserved), in
    rounds with a fresh zmq.proxy relay at libzmq's default HWM, multiprocessing.Queue, a Redis
    list in memory (where redis-server is installed) popped by pipelines of single LPOPs (the
    T2s shape) and 64 items per LPOP (the T3b shape), the relay at the same depth (an extra
    row) and T3b's get_batch(64) of the same items; every rate is reported."""
    from zchannel.cli.bench.cases import Case
    from zchannel.cli.bench.redis import unavailable
    from zchannel.cli.bench.runner import Runner
    from zchannel.cli.bench.targets import load_thresholds, measure_stream_target

    runner = Runner(address=None, baseline="zmq", repeats=2, tmpdir=str(tmp_path))
    small = Case("channel", messages=300, window=16)
    thresholds = load_thresholds()
    results = {r.target: r for r in measure_stream_target(runner, small, thresholds)}
    redis_here = unavailable() is None
    assert set(results) == {"T2s", "T2s-mp", "T3b"} | (
        {"T2s-redis", "T3b-redis"} if redis_here else set())
    result = results["T2s"]
    assert result.unit == "items/s" and result.measured > 0 and result.reference > 0
    assert result.ratio == pytest.approx(result.measured / result.reference)
    assert result.threshold == thresholds["T2s"].value and result.higher_is_better
    (row,) = [r for r in runner.rows if r.case.startswith("T2s")]
    assert (row.producers, row.consumers, row.window, row.messages) == (1, 1, 16, 300)
    assert row.repeats == 2 and row.items_s == result.measured
    assert row.baseline == "zmq.proxy bytes 64B 1P/1C w16 hwm=1000" and len(row.ratio_runs) == 2
    by_kind = {r.kind: r for r in runner.rows}
    assert by_kind["zmq.proxy"].items_s == result.reference and by_kind["zmq.proxy"].repeats == 2
    assert by_kind["zmq.proxy.depth"].case == "zmq.proxy.depth bytes 64B 1P/1C w16 hwm=16"
    assert results["T2s-mp"].reference == by_kind["mp"].items_s
    # CPU per item of the relay process and of the broker (clock ticks: 0 on a tiny run), and
    # of the workers
    assert by_kind["zmq.proxy"].extra["server_cpu_us_item"] >= 0
    assert row.extra["server_cpu_us_item"] >= 0 and row.extra["consumer_cpu_us_item"] > 0
    if redis_here:
        assert results["T2s-redis"].reference == by_kind["redis-mem.single"].items_s
        assert results["T3b-redis"].reference == by_kind["redis-mem"].items_s
        assert by_kind["redis-mem.single"].repeats == by_kind["redis-mem"].repeats == 2
    else:
        assert any("redis" in note for note in runner.notes)
    (batch,) = [r for r in runner.rows if r.case.startswith("T3b")]
    assert results["T3b"].measured == batch.items_s and results["T3b"].reference == row.items_s
    if redis_here:
        assert results["T3b-redis"].measured == batch.items_s


def test_target_thresholds_are_data(tmp_path):
    """Every target's pass mark comes from [targets] of configs/bench_targets.toml (or of the
    --config file, when it has one); a broken entry is an error naming the file and the target;
    --targets is --scenario targets."""
    from zchannel.cli.bench import command as command_mod
    from zchannel.cli.bench import targets as targets_mod

    thresholds = targets_mod.load_thresholds()
    for name in ("T1", "T2", "T2s", "T2s-mp", "T2s-redis", "T3", "T3b", "T3b-redis", "T4", "T6",
                 "T7", "T8", "T9", "T9-ray", "T9-copy", "T9-pipe", "T9z", "T9d", "T10"):
        assert name in thresholds
    assert thresholds["T2s"] == targets_mod.Threshold(0.8, True)
    assert thresholds["T4"].higher is False
    bad = tmp_path / "t.toml"
    bad.write_text('[targets]\nT1 = { min = 0.9, max = 2 }\n')
    with pytest.raises(click.ClickException, match=r"t\.toml: targets\.T1 must be"):
        targets_mod.load_thresholds(bad)
    with pytest.raises(click.ClickException, match="no threshold for target 'T2s'"):
        targets_mod._target("T2s", "", 1.0, 2.0, "items/s", {"T1": thresholds["T1"]})
    own = tmp_path / "own.toml"
    own.write_text('[bench]\nscenario = "targets"\n\n[targets]\nT2s = { min = 0.9 }\n')
    # a [targets] table of --config replaces the thresholds it names; the rest stay
    assert command_mod._thresholds(str(own)) == {**thresholds, "T2s": targets_mod.Threshold(0.9, True)}
    assert command_mod._thresholds(None) == thresholds
    result = _run("--targets", "--scenario", "batch")
    assert result.exit_code == 2 and "--targets runs the target suite" in result.output
    assert "--targets" in _run("--help").output


@pytest.mark.timeout(120)
def test_redis_baseline_with_its_append_only_file_or_a_line_saying_why_not(tmp_path):
    """``--baseline redis``: a redis-server with AOF (everysec) on a Unix socket in the run's
    temporary directory, a list as the queue, every item checked; without redis-server on PATH
    the report says so and the case runs alone."""
    import shutil

    from zchannel.cli.bench.redis import RedisServer

    out = tmp_path / "bench.json"
    result = _run("--scenario", "channel", "--messages", "2000", "--window", "8", "--repeat",
                  "1", "--baseline", "redis", "--json", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    if shutil.which("redis-server") is None:
        assert "redis-server is not on PATH" in result.output
        assert {row["kind"] for row in doc["rows"]} == {"zchannel"}
        return
    redis_row = next(r for r in doc["rows"] if r["kind"] == "redis")
    assert redis_row["messages"] == 2000 and redis_row["items_s"] > 0
    assert "append-only file" in result.output  # the legend says what the baseline is
    with RedisServer(str(tmp_path), aof=True) as server:  # its settings, as the legend says
        import redis

        client = redis.Redis(unix_socket_path=server.socket)
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("appendfsync")["appendfsync"] == "everysec"
        client.close()
        pid = server.proc.pid
    assert server.proc.poll() is not None and not os.path.exists(f"/proc/{pid}/status")


def test_disk_baseline_writes_and_syncs_the_same_bytes(tmp_path, monkeypatch):
    from zchannel.cli.bench.cases import Case
    from zchannel.cli.bench.disk import run_disk

    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd)))
    measured = run_disk(Case("channel", ptype="tensor", size=1 << 20, messages=5), str(tmp_path))
    assert synced == [(i + 1) << 20 for i in range(5)]  # one sync per item, after its bytes
    assert measured.items == 5 and measured.lat_ns.size == 5 and not list(tmp_path.iterdir())


def test_copy_pipeline_baseline_moves_and_checks_every_item(tmp_path, monkeypatch):
    """The copy limit of T9-pipe: every item goes through the shared ring once (the sequence
    numbers are verified), its segment is removed afterwards, and a corrupted item fails it."""
    from zchannel.cli.bench.cases import Case
    from zchannel.cli.bench.copylimit import run_copy_pipeline

    def segments() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"zcb-copy-{os.getpid()}-")}

    case = Case("channel", ptype="tensor", size=1 << 20, messages=40, window=3)
    measured = run_copy_pipeline(case, str(tmp_path))
    assert measured.items == 40 and measured.lat_ns.size == 40 and not segments()
    assert measured.extra["consumer_cpu_us_item"] > 0
    monkeypatch.setenv(CORRUPT_ENV, "17")
    with pytest.raises(Mismatch, match="content mismatch"):
        run_copy_pipeline(case, str(tmp_path))
    assert not segments()
    with pytest.raises(ValueError, match="1 producer and 1 consumer"):
        run_copy_pipeline(dataclasses.replace(case, producers=2), str(tmp_path))


def test_copyto_stream_baseline_rotates_past_the_cache(tmp_path):
    """T9-copy's reference copies distinct items: sources and destinations rotate over a
    working set of at least four times the L3 cache (read from sysfs, 32 MiB when unreadable),
    and every copy it times is a real one."""
    from zchannel.cli.bench.cases import Case
    from zchannel.cli.bench.copylimit import (
        L3_DEFAULT,
        l3_bytes,
        run_copyto_stream,
        stream_buffers,
    )

    sysfs = tmp_path / "size"
    for text, want in (("32768K\n", 32 << 20), ("8M", 8 << 20), ("1048576", 1 << 20),
                       ("lots", L3_DEFAULT), ("0K", L3_DEFAULT)):
        sysfs.write_text(text)
        assert l3_bytes(str(sysfs)) == want
    assert l3_bytes(str(tmp_path / "absent")) == L3_DEFAULT
    assert stream_buffers(16 << 20, 32 << 20) == 4  # 4 sources + 4 destinations: 128 MiB
    assert stream_buffers(1 << 20, 32 << 20) == 64
    assert stream_buffers(1 << 30, 32 << 20) == 2
    for size in (16 << 20, 1 << 20, 1 << 30):
        assert 2 * stream_buffers(size, 32 << 20) * size >= 4 * (32 << 20)
    measured = run_copyto_stream(Case("channel", ptype="tensor", size=1 << 20, messages=9),
                                 str(tmp_path))
    assert measured.items == 9 and measured.lat_ns.size == 9 and (measured.lat_ns > 0).all()


def test_durable_targets_compare_in_the_same_rounds(tmp_path, monkeypatch):
    """D1 against the disk, D2 against the same stream without a journal, D3/D4 against Redis,
    each in rounds with what it is compared to; the journaled cases use a journal."""
    from zchannel.cli.bench import durable as durable_mod
    from zchannel.cli.bench import runner as runner_mod
    from zchannel.cli.bench.cases import Measured

    order: list[str] = []

    def fake(kind: str, seconds: float):
        def run(case, *args, **kwargs):
            order.append(f"{kind}:{case.journal or '-'}:{case.size}")
            return Measured(case.messages, seconds, np.array([1000], dtype=np.int64))
        return run

    monkeypatch.setattr(runner_mod, "run_channel_stream", fake("zchannel", 1.0))
    monkeypatch.setitem(BASELINES, "disk", dataclasses.replace(BASELINES["disk"],
                                                               run=fake("disk", 2.0)))
    monkeypatch.setitem(BASELINES, "redis", dataclasses.replace(
        BASELINES["redis"], run=fake("redis", 4.0), unavailable=lambda: None))
    monkeypatch.setitem(BASELINES, "redis.single", dataclasses.replace(
        BASELINES["redis.single"], run=fake("redis.single", 3.0), unavailable=lambda: None))
    runner = runner_mod.Runner(address=None, baseline="zmq", repeats=2, tmpdir=str(tmp_path))
    targets = {t.target: t for t in durable_mod.run_durable_targets(runner)}
    assert sorted(targets) == ["D1", "D2", "D3", "D3b", "D4"]
    assert targets["D1"].ratio == 2.0 and targets["D1"].passed
    assert targets["D2"].ratio == 1.0 and targets["D3"].ratio == 3.0 and targets["D4"].ratio == 4.0
    # D3: 64 single gets against Redis's pipelined single LPOPs; D3b: get_batch(64) against
    # LPOP key 64
    assert targets["D3b"].ratio == 4.0
    big, small = f"zchannel:interval:{16 << 20}", "zchannel:interval:64"
    assert order[:4] == [big, f"disk:-:{16 << 20}"] * 2  # rounds: case, then its baselines
    assert order[4:14] == [small, "zchannel:-:64", small, "redis:-:64", "redis.single:-:64"] * 2
    assert order[14:] == [big, f"redis:-:{16 << 20}"] * 2
    assert runner.baseline == "zmq"


def test_scaling_curves_table_and_plots(tmp_path, monkeypatch):
    """``--scenario scaling``: every point (processes 1-8, keys 1-100k, sizes 64 B-64 MiB) runs
    beside its baseline on the same set-up; the table has a line per point with both figures
    and the ratio, and ``--plot`` writes one PNG per axis."""
    pytest.importorskip("matplotlib")
    from zchannel.cli.bench import runner as runner_mod
    from zchannel.cli.bench import scaling
    from zchannel.cli.bench.cases import Measured

    seen: list = []

    def fake_stream(case, *args, **kwargs):
        seen.append(case)
        seconds = 2.0 * case.producers  # half the relay's rate at 1P/1C, less with more
        return Measured(case.messages, seconds, np.array([1000, 3000], dtype=np.int64),
                        50 << 20, {"server_cpu_us_item": 20.0})

    def fake_relay(case, *args, **kwargs):
        return Measured(case.messages, 1.0, np.array([500], dtype=np.int64), 40 << 20,
                        {"server_cpu_us_item": 5.0})

    monkeypatch.setattr(runner_mod, "run_channel_stream", fake_stream)
    monkeypatch.setitem(BASELINES, "zmq.proxy",
                        dataclasses.replace(BASELINES["zmq.proxy"], run=fake_relay))
    runner = runner_mod.Runner(address=None, baseline="zmq", repeats=1, tmpdir=str(tmp_path))
    from zchannel.cli.bench.cases import Case

    points = scaling.run_scaling(runner, Case("channel", messages=1000))
    axes = [(p.axis, p.x) for p in points]
    assert axes == [("processes", n) for n in (1, 2, 4, 8)] + [
        ("keys", k) for k in (1, 100, 10_000, 100_000)] + [
        ("size", s) for s in (64, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)] + [
        ("brokers", b) for b in (1, 2, 4)]
    assert all(p.baseline is not None and p.baseline.kind == "zmq.proxy" for p in points)
    keys_100k = [c for c in seen if c.scenario == "random_key" and c.keys == 100_000]
    assert keys_100k and keys_100k[0].messages == 100_000  # every key gets an item
    sizes = {c.size: c for c in seen if c.label.startswith("scaling size")}
    assert sizes[64 << 20].ptype == "numpy" and sizes[64].ptype == "bytes"
    assert sizes[64 << 20].messages == 16  # bounded: 1 GiB per case
    table = scaling.scaling_table(points)
    assert len(table) == 2 + len(points)
    assert "| processes | 8 | 62 | 1,000 | 0.06 |" in table[5]  # 1000 items in 16 s
    assert "| 20.0 | 5.0 | 50 | 40 |" in table[2]
    written = scaling.plot_scaling(points, str(tmp_path / "plots"))
    assert sorted(os.path.basename(p) for p in written) == [
        "scaling-brokers.png", "scaling-keys.png", "scaling-processes.png", "scaling-size.png"]
    spread = [c for c in seen if c.label.startswith("scaling brokers")]
    assert [c.brokers for c in spread] == [1, 2, 4] and all(c.keys == 64 for c in spread)
    relays = {p.baseline.case for p in points if p.axis == "brokers"}
    assert len(relays) == 1  # one relay for the three: brokers and keys do not change it
    # every relay row measured is some point's baseline (each on the bounded case: 16 items
    # of 64 MiB, not the unbounded 1000)
    relay_rows = [r for r in runner.rows if r.kind == "zmq.proxy"]
    assert {r.case for r in relay_rows} == {p.baseline.case for p in points}
    assert len(relay_rows) == len({(r.case, r.messages) for r in relay_rows})
    assert [p.baseline.messages for p in points if p.x == 64 << 20] == [16]
    assert all(os.path.getsize(p) > 1000 for p in written)


@pytest.mark.timeout(120)
def test_a_channel_spread_over_several_brokers_moves_every_item(tmp_path):
    """The scaling curve's ``brokers`` points: one channel with two broker processes on this
    host (replicas from a cluster file, keys spread over them by hash); every item of two
    producers over 8 keys each arrives once, and the broker figures cover both processes."""
    from zchannel.cli.bench.cases import Case
    from zchannel.cli.bench.channel import Target, run_channel_stream

    case = Case("random_key", keys=8, producers=2, consumers=2, messages=400, brokers=2)
    target = Target(case, None, str(tmp_path))
    try:
        assert len(set(target.pids)) == 2 and target.cpu_ns() is not None
        assert target.peak_rss() > max(target.rss() or 0, 1) // 2
    finally:
        target.close()
    measured = run_channel_stream(case, None, str(tmp_path))  # checks every item (seqs)
    assert measured.items == 400 and measured.rss_peak is not None
    assert "server_cpu_us_item" in measured.extra


@pytest.mark.timeout(60)
def test_a_failed_content_check_exits_1_from_the_zchannel_command():
    """Through the ``zchannel`` group, as a user runs it: a corrupted item is status 1 (a
    failed run), one line on stderr; status 2 stays for usage errors."""

    cmd = [sys.executable, "-m", "zchannel.cli.main", "bench", "--scenario", "channel",
           "--messages", "200", "--baseline", "none", "--repeat", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=50,
                         env={**os.environ, CORRUPT_ENV: "17"})
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: content check failed"), out.stderr
    bad = subprocess.run(cmd[:4] + ["nope"], capture_output=True, text=True, timeout=50)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
