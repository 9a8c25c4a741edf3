"""The broker's loop runs under Linux's SCHED_BATCH policy by default (broker/host/scheduling.py,
docs/decisions.md "The broker runs as a batch task"); the config key, the CLI flag and the
environment variable turn it off, and bad values are refused by name."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from zchannel.broker import Channel
from zchannel.broker.server.config import BrokerConfig, build_config

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's"),
]


def test_a_created_broker_serves_as_a_batch_task(channels):
    ch = Channel.create("batched")
    channels.append(ch)
    stats = ch.stats()
    assert stats["sched"] == "batch"
    assert os.sched_getscheduler(stats["pid"]) == os.SCHED_BATCH  # its loop's thread
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the creating process keeps its own
    ch.put(b"x", key="k")
    assert ch.get(key="k", timeout=10) == b"x"


def test_the_environment_keeps_the_default_policy(monkeypatch, channels):
    monkeypatch.setenv("ZCHANNEL_SCHED_BATCH", "0")
    ch = Channel.create("unbatched")
    channels.append(ch)
    stats = ch.stats()
    assert stats["sched"] == "other"
    assert os.sched_getscheduler(stats["pid"]) == os.SCHED_OTHER


def test_a_bad_environment_value_fails_the_start_by_name(monkeypatch):
    monkeypatch.setenv("ZCHANNEL_SCHED_BATCH", "maybe")
    with pytest.raises(ValueError, match="ZCHANNEL_SCHED_BATCH must be 0 or 1"):
        Channel.create("badsched")


def test_the_config_key_is_a_bool(tmp_path):
    with pytest.raises(ValueError, match="sched_batch must be true or false"):
        BrokerConfig(name="x", sched_batch="yes")
    path = tmp_path / "broker.toml"
    path.write_text('[channel]\nname = "x"\nsched_batch = false\n')
    assert build_config(path).sched_batch is False
    assert build_config(name="x").sched_batch is True


def _cli_broker_policy(name: str, *flags: str) -> int:
    """The scheduling policy of a ``zchannel broker`` process once it printed ready (stopped
    by its pid afterwards)."""
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", name, *flags],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready "), line
        return os.sched_getscheduler(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()


def test_the_command_line_flag_turns_it_off(run_dir):
    assert _cli_broker_policy("clibatch") == os.SCHED_BATCH
    assert _cli_broker_policy("clinobatch", "--no-sched-batch") == os.SCHED_OTHER


def test_a_chosen_policy_is_left_alone(channels):
    """A broker started from a process someone put under SCHED_IDLE keeps that policy (it only
    ever moves the default policy to SCHED_BATCH)."""
    code = ("import os, sys\n"
            "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
            "from zchannel.broker import Channel\n"
            "ch = Channel.create('idlesched')\n"
            "st = ch.stats()\n"
            "print(st['sched'], os.sched_getscheduler(st['pid']) == os.SCHED_IDLE, flush=True)\n"
            "ch.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k != "ZCHANNEL_BROKER_FORKSERVER"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=80, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["kept", "True"]
