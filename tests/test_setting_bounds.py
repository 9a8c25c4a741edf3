"""Time settings have an upper bound, refused alike by ``Channel.create``, ``zchannel broker``
flags and a TOML file; a broker at the bounds serves.  So has the number of declared
consumers."""

from __future__ import annotations

import subprocess
import sys

import pytest
from zchannel.broker import Channel
from zchannel.hooks import expand_consumers

pytestmark = pytest.mark.timeout(120)

TOO_LONG = [
    ("heartbeat_interval", 1e300, "heartbeat_interval must be a number >= 0.001 and <= 3600"),
    ("heartbeat_interval", 3601, "heartbeat_interval must be a number >= 0.001 and <= 3600"),
    ("heartbeat_interval", 0.0005, "heartbeat_interval must be a number >= 0.001 and <= 3600"),
    ("liveness", 1001, "liveness must be an int >= 1 and <= 1000"),
    ("lease_timeout", 1e300, "lease_timeout must be a number > 0 and <= 10000000000"),
    ("key_grace", 1e11, "key_grace must be a number >= 0 and <= 10000000000"),
    ("producer_grace", 1e300, "producer_grace must be a number >= 0 and <= 10000000000"),
]


def _broker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name, value, message", TOO_LONG, ids=[f"{n}={v}" for n, v, _ in TOO_LONG])
def test_a_time_setting_too_long_is_refused_from_a_config_file(run_dir, tmp_path, name, value,
                                                               message):
    config = tmp_path / "broker.toml"
    config.write_text(f'[channel]\nname = "long"\n{name} = {value!r}\n')
    out = _broker("--config", str(config))
    assert out.returncode == 2 and "ready" not in out.stdout, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{config}: {message}" in lines[0], out.stderr


@pytest.mark.parametrize("flag", ["--lease-timeout", "--producer-grace", "--fsync-interval"])
def test_a_time_flag_too_long_is_refused(run_dir, tmp_path, flag):
    extra = ["--journal", str(tmp_path / "j")] if flag == "--fsync-interval" else []
    out = _broker("long", flag, "1e300", *extra)
    assert out.returncode == 2 and "ready" not in out.stdout, out.stderr
    setting = flag[2:].replace("-", "_")
    assert f"error: {setting} must be a number" in out.stderr
    assert "and <= 10000000000 (seconds), got 1e+300" in out.stderr


@pytest.mark.parametrize("local", [False, True])
def test_create_refuses_a_lease_timeout_too_long(run_dir, local):
    with pytest.raises(ValueError,
                       match=r"lease_timeout must be a number > 0 and <= 10000000000"):
        Channel.create("longlease", lease_timeout=1e300, local=local)
    with pytest.raises(ValueError,
                       match=r"fsync_interval must be a number > 0 and <= 10000000000"):
        Channel.create("longlease", fsync_interval=1e11, local=local)


def test_a_broker_at_the_bounds_serves(run_dir, tmp_path):
    config = tmp_path / "broker.toml"
    config.write_text('[channel]\nname = "atbounds"\nheartbeat_interval = 3600\nliveness = 1000\n'
                      "lease_timeout = 10000000000\nkey_grace = 10000000000\n"
                      "producer_grace = 10000000000\n")
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "--config",
                             str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().startswith("ready ")
        with Channel.connect("atbounds", timeout=30) as ch:
            ch.put(7, key="k")
            got = ch.get(key="k", ack=True, timeout=30)
            assert got.item == 7
            ch.ack(got)
            assert ch.stats()["pid"] == proc.pid
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_declared_consumers_are_bounded_naming_the_group(run_dir):
    assert len(expand_consumers({"a": 65000, "b": 536})) == 65536  # the most
    with pytest.raises(ValueError, match=r"group 'b' must be an int >= 0 and <= 536 \(a channel "
                                         r"declares 65536 consumers at most\), got 537"):
        expand_consumers({"a": 65000, "b": 537})
    with pytest.raises(ValueError, match="65537 consumer ids declared: a channel declares 65536"):
        expand_consumers([f"a:{i}" for i in range(65537)])
    for local in (False, True):
        with pytest.raises(ValueError, match="group 'actor' must be an int >= 0 and <= 65536"):
            Channel.create("many", consumers={"actor": 10**8}, local=local)
    out = _broker("many", "--consumers", "actor:3000000")
    assert out.returncode == 2 and "ready" not in out.stdout, out.stderr
    assert out.stderr.strip() == (
        "error: consumer count for group 'actor' must be an int >= 0 and <= 65536 (a channel "
        "declares 65536 consumers at most), got 3000000")
