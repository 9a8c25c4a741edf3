"""An operator's settings at the edges: empty paths in a broker config file, a relative
``ZCHANNEL_RUN_DIR``, a missing run directory looked at, ``zchannel bench`` options its
scenario does not use (or that a ``[bench]`` table gives twice), a bad ``[targets]`` table,
``--address`` at a channel that deals, and the CURVE error of a command-line client."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner
from zchannel.broker import AuthenticationFailed, Channel
from zchannel.broker.host import paths
from zchannel.broker.transport import curve
from zchannel.cli.main import main as cli

pytestmark = pytest.mark.timeout(120)


def _zchannel(*args: str, cwd: str | None = None, env: dict | None = None,
              timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zchannel.cli.main", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _error_line(stderr: str) -> str:
    """The one ``error:`` line of a failed command."""
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def _keygen(directory: str, name: str) -> tuple[str, str]:
    out = _zchannel("keygen", directory, "--name", name)
    assert out.returncode == 0, out.stderr
    return os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret")


@pytest.mark.parametrize("key, tcp", [("address", False), ("token_file", False),
                                      ("curve_secret_key", True), ("curve_public_keys", True),
                                      ("curve_admin_keys", True)])
def test_an_empty_path_in_a_broker_config_file_is_refused_naming_key_and_file(
        run_dir, tmp_path, key, tcp):
    """``KEY = ""`` (a template whose variable expanded to nothing) is an error naming the key
    and the file, status 2, before the broker starts: it is not taken as "not set" -- which for
    ``curve_public_keys`` would let in any client with a key pair."""
    lines = ['[channel]', 'name = "empty"']
    if tcp:
        _, secret = _keygen(str(tmp_path / "keys"), "broker")
        lines.append('address = "tcp://127.0.0.1:0"')
        if key != "curve_secret_key":
            lines.append(f'curve_secret_key = "{secret}"')
    lines.append(f'{key} = ""')
    config = tmp_path / "broker.toml"
    config.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "--config",
                             str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        started = proc.stdout.readline()  # "ready ADDRESS", or nothing once it exited
    finally:
        if proc.poll() is None:
            proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert not started, f"the broker started with {key} = '': {started}"
    assert proc.returncode == 2, err
    line = _error_line(err)
    assert line.startswith(f"error: {config}: {key} must be a str"), line
    assert "not empty" in line and "got ''" in line, line


def test_a_relative_run_dir_names_the_same_absolute_directory_from_anywhere(run_dir,
                                                                            monkeypatch):
    """``ZCHANNEL_RUN_DIR=rundir`` is resolved against the working directory once: the broker
    announces and writes an absolute ipc address, which clients of another working directory
    (and ``zchannel stat`` from there) reach; a process keeps the directory across a chdir,
    and the processes it starts inherit the absolute path."""
    work = os.path.join(run_dir, "work")
    os.mkdir(work, 0o700)
    absolute = os.path.join(work, "rundir")
    env = dict(os.environ, ZCHANNEL_RUN_DIR="rundir")
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "rel"],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready "), proc.communicate(timeout=30)
        address = line.split()[1]
        assert address == f"ipc://{absolute}/rel.sock", address
        with open(os.path.join(absolute, "rel.addr")) as f:
            assert f.read().strip() == address
        # another working directory, naming the directory relative to it
        out = _zchannel("stat", "rel", cwd=run_dir, env=dict(os.environ,
                                                              ZCHANNEL_RUN_DIR="work/rundir"))
        assert out.returncode == 0 and address in out.stdout, out.stdout + out.stderr
        monkeypatch.setenv("ZCHANNEL_RUN_DIR", absolute)
        ch = Channel.connect("rel", timeout=30)
        try:
            ch.put("x")
            assert ch.get(timeout=30) == "x"
        finally:
            ch.close()
        # in this process: resolved once, kept after a chdir, the variable made absolute
        monkeypatch.chdir(work)
        monkeypatch.setenv("ZCHANNEL_RUN_DIR", "rundir")
        assert str(paths.run_dir()) == absolute
        assert os.environ["ZCHANNEL_RUN_DIR"] == absolute
        monkeypatch.chdir(run_dir)
        assert paths.default_address("rel") == address
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode == 0


def test_stat_and_clean_leave_a_missing_run_dir_missing(run_dir):
    """``zchannel stat``, ``stat --json``, ``clean --dry-run`` and ``clean`` on a run
    directory that does not exist say so and do not make it."""
    missing = os.path.join(run_dir, "missing")
    env = dict(os.environ, ZCHANNEL_RUN_DIR=missing)
    out = _zchannel("stat", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"no brokers: the run directory {missing} does not exist",
                                       "no stale entries"]
    out = _zchannel("stat", "--json", env=env)
    listed = json.loads(out.stdout)
    assert listed["run_dir_exists"] is False and listed["brokers"] == listed["stale"] == []
    for args in (["clean", "--dry-run"], ["clean"]):
        out = _zchannel(*args, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == (f"nothing to remove: the run directory {missing} does "
                                      "not exist")
    assert not os.path.lexists(missing)
    # a missing parent (a mistyped path) is still an error naming it
    deeper = os.path.join(missing, "deeper")
    out = _zchannel("stat", env=dict(os.environ, ZCHANNEL_RUN_DIR=deeper))
    assert out.returncode == 2 and f"its parent {missing} does not exist" in out.stderr
    assert not os.path.lexists(missing)


def _bench(*args: str):
    """``zchannel bench ARGS`` in this process (its output: stdout and stderr)."""
    return CliRunner().invoke(cli, ["bench", *args])


def test_bench_refuses_the_options_its_scenario_does_not_use():
    """An option given on the command line that the scenario's cases do not read is a usage
    error naming it, before anything runs: not dropped without a word."""
    result = _bench("--scenario", "channel", "--keys", "5", "--messages", "20", "--repeat", "1",
                    "--baseline", "none")
    assert result.exit_code == 2, result.output
    assert "--scenario channel does not use --keys" in result.output
    assert "random_key" in result.output  # the scenarios that use it
    for scenario, given in (("shm", ("--transport", "tcp", "--baseline", "redis",
                                     "--messages", "1")),
                            ("durable", ("--payload-size", "1KB", "--window", "8")),
                            ("targets", ("--num-producers", "2", "--transport", "tcp")),
                            ("scaling", ("--payload-type", "numpy",)),
                            ("trajectory", ("--baseline", "mp"))):
        result = _bench("--scenario", scenario, *given, "--repeat", "1")
        assert result.exit_code == 2, result.output
        named = {arg for arg in given if arg.startswith("--")}
        refused = result.output.split(f"--scenario {scenario} does not use ", 1)[1]
        assert set(refused.split(":", 1)[0].split(", ")) == named, result.output
        assert f"zchannel bench {scenario}:" not in result.output  # nothing ran
    result = _bench("--targets", "--transport", "ipc")
    assert result.exit_code == 2 and "does not use --transport" in result.output


def test_bench_checks_a_targets_table_whatever_the_scenario(tmp_path):
    """A bad ``[targets]`` table in ``--config`` is an error naming the file and the target,
    status 2, for a scenario without targets too."""
    config = tmp_path / "bench.toml"
    for table, message in (("T2S = { min = nan }", "targets.T2S must be a finite number"),
                           ("T2S = { min = 0.5 }", "unknown target 'T2S' in [targets] (did "
                                                   "you mean 'T2s'?)")):
        config.write_text('[bench]\nscenario = "channel"\nmessages = 20\nrepeat = 1\n'
                          f'baseline = "none"\n\n[targets]\n{table}\n')
        result = _bench("--config", str(config))
        assert result.exit_code == 2, result.output
        assert f"{config}: {message}" in result.output
        assert "zchannel bench channel:" not in result.output


def test_bench_refuses_a_bench_table_that_sets_an_option_twice(tmp_path):
    """``repeat`` and ``repeats`` (or ``num_producers`` and ``num-producers``) in one
    ``[bench]`` table: an error naming both, not one of them taken."""
    config = tmp_path / "bench.toml"
    for first, second in (("repeat = 1", "repeats = 2"),
                          ("num_producers = 1", "num-producers = 2")):
        config.write_text(f'[bench]\nscenario = "channel"\nmessages = 20\nbaseline = "none"\n'
                          f"{first}\n{second}\n")
        result = _bench("--config", str(config))
        assert result.exit_code == 2, result.output
        assert f"sets one option twice: {first} and {second}" in result.output
        assert "zchannel bench channel:" not in result.output


def test_bench_address_at_a_dealing_channel_is_refused_before_any_put(broker_procs):
    """``zchannel bench --address`` at a channel that deals items to its consumers stops with
    status 2 before anything is put: the bench's consumers have no consumer id, and its items
    would be dealt to the channel's own consumers' private queues and stay there."""
    _, address = broker_procs("deal", "--dispatcher", "round_robin", "--consumers", "actor:2",
                              "--maxsize", "5")
    out = _zchannel("bench", "--address", address, "--scenario", "channel", "--messages", "50",
                    "--repeat", "1", "--baseline", "none")
    ch = Channel.connect(address, timeout=30)
    try:
        assert ch.stats()["keys"] == {}, out.stderr  # not one item dealt to actor:0 or actor:1
    finally:
        ch.close()
    assert out.returncode == 2, out.stdout + out.stderr
    line = _error_line(out.stderr)
    assert "channel 'deal' deals items to consumers" in line and "nothing was put" in line
    assert "a consumer needs an identity" in line


@pytest.fixture
def curve_broker(tmp_path, broker_procs):
    """A broker on loopback tcp with CURVE keys; (address, the client's key pair file)."""
    keys = str(tmp_path / "keys")
    _, broker_secret = _keygen(keys, "broker")
    client_public, client_secret = _keygen(keys, "client")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(client_public, allowed)
    _, address = broker_procs("curved", "--address", "tcp://127.0.0.1:0", "--curve-secret-key",
                              broker_secret, "--curve-public-keys", str(allowed))
    return address, client_secret


def test_a_curve_error_names_the_settings_the_keys_came_from(curve_broker, monkeypatch):
    """A client with its own key pair but not the broker's public key: the error names the
    setting its key pair came from and the remedy in its terms -- a command's options once it
    named them (``name_key_settings``: ``--curve-server-key FILE``), else a Python program's
    ``curve_keys=`` and environment variables."""
    address, client_secret = curve_broker
    monkeypatch.delenv("ZCHANNEL_CURVE_SERVER_KEY", raising=False)
    monkeypatch.setenv("ZCHANNEL_CURVE_SECRET_KEY", client_secret)
    monkeypatch.setattr(curve, "_settings", curve.KeySettings())  # given back after the test
    with pytest.raises(AuthenticationFailed) as python:
        Channel.connect(address, timeout=30)
    assert "only its own (ZCHANNEL_CURVE_SECRET_KEY)" in str(python.value)
    assert "pass curve_keys=" in str(python.value)
    curve.name_key_settings("--curve-secret-key", "--curve-server-key")
    with pytest.raises(AuthenticationFailed) as command:
        Channel.connect(address, timeout=30)
    message = str(command.value)
    assert (f"only its own key pair (--curve-secret-key {client_secret}), not the broker's "
            "public key: give --curve-server-key FILE") in message, message
    assert "curve_keys=" not in message and "ZCHANNEL_CURVE" not in message
    monkeypatch.delenv("ZCHANNEL_CURVE_SECRET_KEY")
    with pytest.raises(AuthenticationFailed, match="has none: give --curve-secret-key FILE"):
        Channel.connect(address, timeout=30)


def test_zchannel_stat_names_its_curve_options(curve_broker):
    """``zchannel stat ADDRESS --curve-secret-key FILE`` without the broker's public key: the
    error names the setting the key pair came from and ``--curve-server-key FILE``, not a
    Python program's ``curve_keys=``."""
    address, client_secret = curve_broker
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZCHANNEL_CURVE_")}
    out = _zchannel("stat", address, "--curve-secret-key", client_secret, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    line = _error_line(out.stderr)
    assert (f"only its own key pair (--curve-secret-key {client_secret}), not the broker's "
            "public key: give --curve-server-key FILE") in line, line
    assert "curve_keys=" not in line
    out = _zchannel("stat", address, env=dict(env, ZCHANNEL_CURVE_SECRET_KEY=client_secret))
    assert out.returncode == 2, out.stdout + out.stderr
    assert (f"only its own key pair (ZCHANNEL_CURVE_SECRET_KEY {client_secret})"
            in _error_line(out.stderr))


def test_a_command_run_in_process_leaves_python_curve_errors_as_they_were(curve_broker,
                                                                          monkeypatch):
    """A ``zchannel`` command run inside a Python process (``CliRunner``, as tests and
    notebooks do) names its options in its CURVE errors, and sets ``ZCHANNEL_CURVE_SECRET_KEY``
    to its key pair, only while it runs: a handle connected afterwards in the same process gets
    a Python program's message again, and a process started later no key pair."""
    address, client_secret = curve_broker
    monkeypatch.delenv("ZCHANNEL_CURVE_SERVER_KEY", raising=False)
    monkeypatch.delenv("ZCHANNEL_CURVE_SECRET_KEY", raising=False)
    result = CliRunner().invoke(cli, ["stat", address, "--curve-secret-key", client_secret])
    assert result.exit_code == 2, result.output
    # nor the environment: processes started later do not inherit the command's key pair
    assert "ZCHANNEL_CURVE_SECRET_KEY" not in os.environ
    monkeypatch.setenv("ZCHANNEL_CURVE_SECRET_KEY", client_secret)
    with pytest.raises(AuthenticationFailed) as after:
        Channel.connect(address, timeout=30)
    assert "only its own (ZCHANNEL_CURVE_SECRET_KEY)" in str(after.value), str(after.value)
    assert "--curve-server-key" not in str(after.value)
