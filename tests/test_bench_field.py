"""``zchannel bench`` at the edges of its options: the smallest payload, keys past a broker's
``max_keys``, a ``--plot`` directory that cannot be written, ``[targets]`` names and numbers
of ``--config``, the 1 GiB cap of large items, and which failures are status 1 or 2."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time

import click
import pytest
from click.testing import CliRunner
from zchannel.broker import Channel
from zchannel.cli.bench import bench
from zchannel.cli.bench.cases import Case, bounded
from zchannel.cli.bench.channel import _Consumer
from zchannel.cli.bench.payloads import CORRUPT_ENV, PAYLOAD_TYPES, Mismatch, PayloadFactory
from zchannel.cli.main import main

pytestmark = pytest.mark.timeout(90)

TINY = ("--messages", "50", "--repeat", "1", "--baseline", "none")


def _zchannel(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``zchannel ARGS`` as a user runs it (its exit status and both streams)."""
    return subprocess.run([sys.executable, "-m", "zchannel.cli.main", *args],
                          capture_output=True, text=True, timeout=80,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("ptype", PAYLOAD_TYPES)
@pytest.mark.parametrize("size", [16, 19])
def test_the_smallest_payloads_carry_their_send_time_and_show_corruption(ptype, size,
                                                                         monkeypatch):
    """Items of 16-19 bytes (one buffer of the 16-byte header alone, for the types that round
    to float32) keep the send time they were stamped with, and the item the corruption hook
    names fails the check."""
    monkeypatch.setenv(CORRUPT_ENV, "3")
    factory = PayloadFactory(ptype, size, ring=2)
    for index in range(6):
        before = time.monotonic_ns()
        item, _ = factory.make(index, index)
        if index == 3:
            with pytest.raises(Mismatch):
                factory.check(item)
            continue
        seq, sent = factory.check(item)
        assert seq == index and before <= sent <= time.monotonic_ns()


def test_a_run_of_16_byte_items_moves_and_checks_every_item(run_dir, tmp_path):
    """``--payload-size 16``, the least the option takes, runs to the end with status 0."""
    out = tmp_path / "b.json"
    done = _zchannel("bench", "--scenario", "channel", "--payload-size", "16", *TINY,
                     "--json", str(out))
    assert done.returncode == 0, done.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["size"] == 16 and row["messages"] == 50 and row["items_s"] > 0
    assert 0 < row["p50_us"] < 60e6  # a latency from the real send time


def test_keys_past_the_max_keys_of_the_benchs_broker_are_refused_before_the_run(run_dir):
    """More keys than the broker the bench starts holds is a usage error naming ``--keys``
    and the limit, before anything runs; the producers' keys add up."""
    runner = CliRunner()
    result = runner.invoke(bench, ["--scenario", "random_key", "--keys", "100001",
                                   "--messages", "100001", *TINY[2:]])
    assert result.exit_code == 2, result.output
    assert "--keys" in result.output and "100,000" in result.output
    assert "max_keys" in result.output and "zchannel bench random_key" not in result.output
    result = runner.invoke(bench, ["--scenario", "random_key", "--keys", "60000",
                                   "--num-producers", "2", "--messages", "120000", *TINY[2:]])
    assert result.exit_code == 2 and "120,000 keys" in result.output, result.output


def test_a_refusal_by_the_broker_is_status_2_and_the_json_is_written(cli_broker, tmp_path):
    """A worker's expected error (the ``max_keys`` of a broker given by ``--address``) ends
    the run with one ``error:`` line and status 2, not 1 (a lost or corrupted item), and no
    traceback; the --json file records it."""
    address = cli_broker("bench-keys", "--max-keys", "10")
    out = tmp_path / "k.json"
    done = _zchannel("bench", "--address", address, "--scenario", "random_key", "--keys", "20",
                     *TINY, "--json", str(out))
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    # a producer's put or a consumer's get makes the eleventh key: either is refused
    assert re.match(r"error: benchmark failed: worker (producer|consumer)-0 failed: "
                    r"ValueError: ", last), last
    assert "max_keys limit (10)" in last and "Traceback" not in done.stderr
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and "max_keys" in doc["error"]


def test_a_workers_unexpected_error_keeps_its_traceback_and_an_expected_one_does_not():
    """A worker's exception reaches the parent as ``WorkerFailure``: with the traceback when it
    is a bug (a ``KeyError``), without one when it is expected (a ``ValueError``)."""
    from zchannel.cli.bench.baselines import mp_consumer_worker
    from zchannel.cli.bench.workers import WorkerFailure, Workers

    expected = {"name": "consumer-0", "queue": None, "counts": None, "slot": 0, "total": 1,
                "ptype": "nope", "size": 64}
    for spec, traceback_holds in ((expected, None), ({"name": "consumer-0"}, "KeyError")):
        with Workers() as workers:
            workers.start(mp_consumer_worker, spec)
            with pytest.raises(WorkerFailure) as failed:
                workers.collect(1, timeout=60)
        if traceback_holds is None:
            assert failed.value.traceback is None
            assert "ValueError: unknown payload type 'nope'" in str(failed.value)
        else:
            assert traceback_holds in failed.value.traceback and "Traceback" not in str(
                failed.value)


def _one_point_scaling(monkeypatch) -> None:
    """``--scenario scaling`` cut to its first point (1P/1C), the rest of the command real."""
    from zchannel.cli.bench import command, scaling

    real = scaling.scaling_cases

    def first_point(base):
        return real(base)[:1]

    monkeypatch.setattr(scaling, "scaling_cases", first_point)
    monkeypatch.setattr(command, "scaling_cases", first_point, raising=False)


def test_a_plot_directory_that_cannot_be_made_is_refused_before_the_run(run_dir, tmp_path,
                                                                        monkeypatch):
    pytest.importorskip("matplotlib")
    from zchannel.cli.bench import command

    ran: list = []
    monkeypatch.setattr(command, "run_scaling", lambda *args: ran.append(args) or [])
    a_file = tmp_path / "afile"
    a_file.write_text("")
    out = tmp_path / "s.json"
    result = CliRunner().invoke(bench, ["--scenario", "scaling", *TINY, "--plot",
                                        str(a_file / "plots"), "--json", str(out)])
    assert result.exit_code == 2, result.output
    assert "--plot" in result.output and "Not a directory" in result.output
    assert ran == [] and not out.exists()
    made = tmp_path / "new" / "plots"
    result = CliRunner().invoke(bench, ["--scenario", "scaling", *TINY, "--plot", str(made)])
    assert made.is_dir() and ran, result.output  # made before the run


def test_the_json_is_written_before_the_plots_so_a_plot_failure_loses_nothing(
        run_dir, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from zchannel.cli.bench import command

    _one_point_scaling(monkeypatch)

    def disk_full(points, directory, title=""):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(command, "plot_scaling", disk_full)
    out = tmp_path / "s.json"
    result = CliRunner().invoke(main, ["bench", "--scenario", "scaling", *TINY, "--plot",
                                       str(tmp_path / "plots"), "--json", str(out)])
    assert result.exit_code == 2, result.output
    assert "error: --plot" in result.output and "No space left" in result.output
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["rows"][0]["messages"] == 50


@pytest.mark.parametrize(("table", "words"), [
    ('T2S = { min = 0.1 }', ["unknown target 'T2S'", "did you mean 'T2s'", "T9-copy"]),
    ('T1 = { min = nan }', ["targets.T1 must be a finite number"]),
    ('T4 = { max = inf }', ["targets.T4 must be a finite number"]),
])
def test_targets_of_a_config_are_known_names_with_finite_thresholds(tmp_path, table, words):
    from zchannel.cli.bench.command import _thresholds

    path = tmp_path / "t.toml"
    path.write_text(f"[targets]\n{table}\n")
    with pytest.raises(click.ClickException) as refused:
        _thresholds(str(path))
    message = refused.value.format_message()
    assert str(path) in message and all(word in message for word in words), message


def test_the_1_gib_cap_per_case_holds_for_items_of_any_size(run_dir, tmp_path):
    """At most 1 GiB per case, at least one item: 4 items of 256 MiB, one of 1 or 2 GiB; a
    case capped to one item runs."""
    from zchannel.cli.bench.channel import run_channel_stream

    mib = 1 << 20
    for size, items in ((16 * mib, 64), (256 * mib, 4), (1024 * mib, 1), (2048 * mib, 1)):
        case = bounded(Case("channel", ptype="tensor", size=size, messages=64, window=8))
        assert case.messages == items and case.messages * size <= max(size, 1 << 30)
    one = bounded(Case("channel", size=4096, messages=50, max_bytes=1000))
    assert one.messages == 1
    measured = run_channel_stream(one, None, str(tmp_path))
    assert measured.items == 1 and measured.lat_ns.size == 1


def test_items_per_second_below_10_show_decimals():
    from zchannel.cli.bench.report import Result, print_report

    row = Result(case="channel bytes 256MiB 1P/1C w1", kind="zchannel", scenario="channel",
                 ptype="bytes", size=256 << 20, producers=1, consumers=1, transport="ipc",
                 window=1, messages=4, items_s=0.5, mb_s=128.0, p50_us=1.0, p99_us=1.0,
                 latency="e2e", seconds=8.0, repeats=2,
                 runs={"items_s": [0.45, 0.55], "p50_us": [1.0, 1.0]})
    lines: list[str] = []
    print_report([row], [], [], lines.append)
    line = next(text for text in lines if text.startswith("channel bytes 256MiB"))
    assert " 0.50 " in line and "0.45-0.55" in line, line


def test_a_get_batch_that_timed_out_is_asked_again(channels):
    """A stream's lone ``get_batch`` consumer asks for the stream's end; a ``get_batch`` that
    times out (``GET_TIMEOUT_S``: the producer paused, a loaded machine) took nothing, so its
    items are asked for again: the consumer gets them all (it stopped early and the run
    reported them lost)."""
    ch = Channel.create("bench-batch", maxsize=0)
    channels.append(ch)
    fac = PayloadFactory("bytes", 64)
    counts = multiprocessing.get_context("spawn").RawArray("q", 1)
    consumer = _Consumer({"address": ch.address, "ptype": "bytes", "size": 64, "counts": counts,
                          "slot": 0, "total": 100, "key": "s", "window": 2, "batch": 64})
    timed_out = threading.Event()
    note_timeout = consumer._timed_out

    def timed_out_once(deadline: float) -> None:
        timed_out.set()
        note_timeout(deadline)

    consumer._timed_out = timed_out_once
    for i in range(64):
        ch.put(fac.make(i, i)[0], weight=1, key="s")
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(consumer.run()))
    thread.start()
    try:
        assert timed_out.wait(60)  # a get_batch of the last 36 timed out: they were not put
        for i in range(64, 100):
            ch.put(fac.make(i, i)[0], weight=1, key="s")
    finally:
        thread.join(120)
    assert not thread.is_alive()
    assert consumer.n == 100 and ch.qsize("s") == 0
