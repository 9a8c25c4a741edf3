"""SIGHUP (the terminal of ``zchannel broker`` closed) stops the broker as SIGTERM does: its
run-directory files and shared memory removed, exit status 0; under ``nohup`` (SIGHUP
ignored when it started) the broker keeps serving; while it starts, SIGTERM and SIGHUP
interrupt it as SIGINT does, and the start gives back what it took."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import wait_until
from zchannel.broker import Channel

pytestmark = pytest.mark.timeout(120)


def _start(name: str, ignore_hup: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "zchannel.cli.main", "broker", name], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if ignore_hup else None)
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        pytest.fail(f"the broker did not start: {line!r} {proc.communicate(timeout=20)[1]}")
    return proc


def _reap(proc: subprocess.Popen) -> None:
    """End ``proc`` by its PID if a test left it running."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate(timeout=20)


def _segments(name: str) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f"+{name}+" in f]


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_sighup_stops_a_cli_broker_cleanly_as_sigterm_does(run_dir, sig):
    name = f"sig{sig.value}"
    proc = _start(name)
    try:
        with Channel.connect(name, timeout=30) as ch:
            ch.put(np.zeros(1 << 19), key="k")  # 4 MiB: in shared memory
            assert ch.qsize(key="k") == 1
        assert _segments(name)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        _reap(proc)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    assert os.listdir(run_dir) == [] and _segments(name) == []


def test_a_broker_started_under_nohup_keeps_serving_after_sighup(run_dir):
    proc = _start("nohup", ignore_hup=True)
    try:
        proc.send_signal(signal.SIGHUP)
        with Channel.connect("nohup", timeout=30) as ch:
            assert ch.stats()["pid"] == proc.pid  # the SIGHUP was ignored
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        _reap(proc)
    assert proc.returncode == 0, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_while_the_broker_starts_leaves_no_files(run_dir, tmp_path, sig):
    """A broker whose start waits (a collector's ``setup`` at a gate), its lock and shared
    memory taken: SIGTERM or SIGHUP there ends the start as Ctrl-C does ("Aborted!", status 1),
    with its lock file and probe segment given back, not left as stale entries."""
    name = f"gated{sig.value}"  # its own per signal: the cases may run at once (/dev/shm is shared)
    gate, starts = tmp_path / "gate", tmp_path / "starts"
    os.mkfifo(gate)
    starts.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (os.path.join(os.path.dirname(__file__)), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(
        [sys.executable, "-m", "zchannel.cli.main", "broker", name, "--collector",
         "hookmods:GatedStart", "--option", f'dir="{starts}"', "--option", f'gate="{gate}"'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        # the collector's setup waits at the gate
        assert wait_until(lambda: os.listdir(starts) or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, proc.communicate()
        assert os.path.exists(os.path.join(run_dir, f"{name}.lock")) and _segments(name)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        _reap(proc)
    assert proc.returncode == 1 and "Aborted!" in err and "ready" not in out, err
    assert "Traceback" not in err, err
    assert os.listdir(run_dir) == [] and _segments(name) == []
