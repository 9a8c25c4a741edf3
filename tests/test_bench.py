"""``zchannel bench`` on tiny sizes: exit status, table rows, the JSON file, and a corrupted
item failing the run."""

from __future__ import annotations

import json

import click
import numpy as np
import pytest
from click.testing import CliRunner
from zchannel.cli.bench import bench, parse_size
from zchannel.cli.bench_baselines import CORRUPT_ENV, Mismatch, PayloadFactory, verify_seqs
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
    result = _run("--scenario", "channel", "--messages", "300", "--window", "8", "--json", str(out))
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


@pytest.mark.timeout(40)
def test_config_file_and_scenarios(tmp_path):
    cfg = tmp_path / "b.toml"
    cfg.write_text(
        '[bench]\nscenario = "batch"\npayload_type = "tensor_dict"\n'
        'payload_size = "1KB"\nmessages = 256\nbaseline = "none"\n'
    )
    out = tmp_path / "b.json"
    result = _run("--config", str(cfg), "--json", str(out))
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
        env={CORRUPT_ENV: "17"},
    )
    assert result.exit_code == 1
    assert "content mismatch" in result.output
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and "mismatch" in doc["error"]


@pytest.mark.timeout(30)
def test_trajectory_collector_counts(tmp_path):
    from zchannel.cli.bench_trajectory import TrajectoryCase, check_counts, run_trajectory_case

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
    from zchannel.cli import bench as bench_mod

    order: list[str] = []

    def logged(name, fn):
        def run(case, *args, **kwargs):
            order.append(f"{name}:{case.producers}")
            return fn(case, *args, **kwargs)

        return run

    monkeypatch.setattr(
        bench_mod, "run_channel_stream", logged("case", bench_mod.run_channel_stream)
    )
    monkeypatch.setattr(bench_mod, "run_zmq_proxy", logged("proxy", bench_mod.run_zmq_proxy))
    runner = bench_mod.Runner(address=None, baseline="zmq", repeats=2, tmpdir=str(tmp_path))
    one = bench_mod.Case("channel", messages=300, window=16)
    two = bench_mod.dataclasses.replace(one, producers=2, consumers=2)
    a, b = runner.measure_together([one, two])
    assert order == ["case:1", "case:2", "proxy:1", "proxy:2"] * 2
    assert a.messages == b.messages == 300 and a.ratio > 0 and b.ratio > 0
    order.clear()
    runner.measure(one)  # its baseline is known: the case alone
    assert order == ["case:1", "case:1"]
    order.clear()
    runner.measure_together([one], fresh=True)
    assert order == ["case:1", "proxy:1"] * 2
    proxies = [r for r in runner.rows if r.kind == "zmq.proxy"]
    assert len(proxies) == 3  # 1P/1C twice (fresh adds a row), 2P/2C once
