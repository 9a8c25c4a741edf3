"""A durable channel's journal as its user meets it when a start cannot go on: a collector that
fails on the puts it took when they go through it again, a segment a later zchannel wrote, and
journal settings in a config file without a journal directory.  Each start is refused with an
error naming the cause and its remedy, and nothing in the journal is dropped
(``docs/durability.md``)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import exited
from zchannel.broker import Channel
from zchannel.broker.journal import format as fmt

START_S = 120.0  # a broker process's start (an interpreter importing zmq) on a loaded machine

class CliBrokers:
    """``zchannel broker`` processes (hook modules from ``folder``); ended by pid at teardown."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen] = []

    def launch(self, *args: str, **env: str) -> subprocess.Popen:
        full_env = dict(os.environ, **env)
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(self.folder), os.environ.get("PYTHONPATH")) if p)
        proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=full_env, cwd=self.folder)
        self.procs.append(proc)
        return proc

    @staticmethod
    def first_line(proc: subprocess.Popen) -> str:
        """The first line the broker prints (``ready ADDRESS``), or '' if it exits first."""
        ready, _, _ = select.select([proc.stdout], [], [], START_S)
        assert ready, f"broker {proc.pid} printed nothing within {START_S}s"
        return proc.stdout.readline()

    def serving(self, *args: str, **env: str) -> subprocess.Popen:
        proc = self.launch(*args, **env)
        line = self.first_line(proc)
        assert line.startswith("ready "), (line, proc.stderr.read() if not line else "")
        return proc

    def refused(self, *args: str, **env: str) -> str:
        """The one-line error (stderr) of a broker that must not start (status 2)."""
        proc = self.launch(*args, **env)
        line = self.first_line(proc)
        if line:  # it started: stop it before reporting what it printed
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=START_S)
        assert not line and proc.returncode == 2, (line, proc.returncode, err)
        errors = [e for e in err.splitlines() if e.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in err, err
        return errors[0]

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGKILL)
        assert exited(proc.pid, START_S)
        proc.communicate()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.communicate()


@pytest.fixture
def cli_brokers(run_dir, tmp_path):
    started = CliBrokers(tmp_path)
    yield started
    started.close()


def test_a_collector_failing_on_its_replayed_puts_stops_the_start_and_keeps_them(
        cli_brokers, tmp_path):
    """A put the collector holds (the first half of a pair) is acknowledged, then the broker
    is SIGKILLed.  Started again with a collector whose ``collect`` raises, the broker does
    not start: one error names the channel, the collector, the put's key and the hook's error.
    Started with the collector working again, it still holds the half, which pairs with the
    next put of its key."""
    args = ("replayed", "--journal", str(tmp_path / "j"), "--collector", "hookmods:FlakyPairs")
    proc = cli_brokers.serving(*args)
    ch = Channel.connect("replayed", timeout=30)
    try:
        ch.put("half-a", key="a")
        assert ch.stats()["journal"]["collector_inputs"] == 1
    finally:
        ch.close()
    cli_brokers.kill(proc)

    error = cli_brokers.refused(*args, FLAKY="1")
    for part in ("channel 'replayed'", "collector 'hookmods:FlakyPairs'",
                 "its collect failed on the put of key 'a': RuntimeError: flaky collect",
                 "the journal keeps every put"):
        assert part in error, error

    proc = cli_brokers.serving(*args)
    ch = Channel.connect("replayed", timeout=30)
    try:
        assert ch.stats()["journal"]["collector_inputs"] == 1
        ch.put("half-b", key="a")
        assert ch.get(key="a", timeout=30) == ("half-a", "half-b")
    finally:
        ch.close()
    cli_brokers.kill(proc)


def _magic(segment: Path, magic: bytes) -> None:
    with open(segment, "r+b") as f:
        f.write(magic)


def test_a_segment_of_a_later_version_names_the_version_and_is_kept(brokers, run_dir,
                                                                    tmp_path):
    """A segment whose magic is the next format version's (``ZCJRNL04``): the start is
    refused with an error that says a later zchannel wrote it, names that version and the
    ones this zchannel reads, and advises running the zchannel that wrote it, not moving the
    file away (that would drop its acknowledged items).  The file is left as it is: with its
    magic put back, the item in it is recovered."""
    journal = tmp_path / "j"
    config = dict(name="durable-later", address=f"ipc://{run_dir}/later.sock",
                  journal=str(journal))
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    try:
        ch.put("kept")
    finally:
        ch.close()
    brokers.kill(pid)
    segment = sorted(journal.glob("durable-later.*.zcj"))[0]
    later = fmt.MAGIC[:-2] + b"%02d" % (fmt.VERSION + 1)
    _magic(segment, later)
    with pytest.raises(RuntimeError) as refused:
        brokers.start(**config)
    message = str(refused.value)
    assert f"{segment} is a journal segment of channel 'durable-later' written by a later " \
           "zchannel" in message, message
    assert f"{later.decode()} is journal format version {fmt.VERSION + 1}" in message
    assert all(m.decode() in message for m in fmt.MAGICS), message
    assert "zchannel version that wrote it" in message and "move it away" not in message
    assert segment.read_bytes()[:len(later)] == later

    _magic(segment, fmt.MAGIC)
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    try:
        assert ch.get(timeout=30) == "kept"
    finally:
        ch.close()
    brokers.kill(pid)


@pytest.mark.parametrize("setting", ['fsync = "always"', "journal_segment_bytes = 1048576"])
def test_journal_settings_in_a_config_file_without_a_journal_point_to_its_journal_key(
        cli_brokers, tmp_path, setting):
    """A config file with a journal setting but no ``journal`` key: refused (the channel
    would not be durable), with an error that names the setting and the file's ``journal``
    key as the fix, besides ``--journal``."""
    config = tmp_path / "hint.toml"
    config.write_text(f'[channel]\nname = "hint"\n{setting}\n')
    error = cli_brokers.refused("--config", str(config))
    key = setting.split()[0]
    assert error.startswith(f"error: {key} in {config} set(s) the journal: "), error
    assert f'a journal key in [channel] of {config} (journal = "DIR"' in error, error
    assert "--help" not in error, error

