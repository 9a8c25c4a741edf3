"""Inputs of the ``zchannel`` command that used to fail badly: JSON nested deeply in an option,
a ``keygen`` client name that is a replica's, config-file values checked only as the broker
started, a config or cluster file that is a FIFO or a device, and an abstract ipc address.
Each is one ``error:`` line naming the option, the file and key or the address, status 2, and
nothing is written or started.  The real command runs as a subprocess."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import uuid

import pytest
from zchannel.broker import Channel

pytestmark = pytest.mark.timeout(180)

TOO_DEEP = "[" * 100_000  # far past the recursion limit of Python's JSON parser


def _zchannel(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zchannel.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of a command that failed with status 2."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    assert "ready" not in out.stdout
    return lines[0]


def _start_broker(*args: str) -> subprocess.Popen:
    """``zchannel broker ARGS``, once it printed ``ready`` (a generous deadline)."""
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 90)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("ready "):
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the broker did not start: {line!r} {err[-2000:]}")
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize("value", [TOO_DEEP, "[" * 3000 + "]" * 3000, '{"a":' * 3000 + "1" + "}" * 3000],
                         ids=["unclosed-100000", "arrays-3000", "objects-3000"])
def test_deep_json_in_a_broker_option_is_one_line(run_dir, value):
    out = _zchannel("broker", "deepopt", "--option", f"k={value}")
    line = _one_error_line(out)
    assert "Invalid value for '--option': the value of k: JSON nested too deeply to parse" in line
    assert not os.path.exists(os.path.join(run_dir, "deepopt.addr"))


def test_json_nested_up_to_the_limit_reaches_the_hooks(run_dir):
    """100 levels are taken (JSON a hook may well be given), and brackets inside a JSON string
    are not nesting."""
    deep = "[" * 100 + "]" * 100
    text = json.dumps("[" * 300)
    proc = _start_broker("deepok", "--collector", "hookmods:EchoOptions",
                         "--option", f"deep={deep}", "--option", f"text={text}")
    try:
        with Channel.connect("deepok", timeout=30) as ch:
            ch.put(1, key="k")
            options = ch.get(key="k", timeout=30)["options"]
        assert options["text"] == "[" * 300
        value, depth = options["deep"], 0
        while value:
            value, depth = value[0], depth + 1
        assert depth == 99 and value == []  # 100 lists inside each other
    finally:
        _stop(proc)


@pytest.mark.parametrize("command,option", [("embodied", "--env-kwargs"), ("embodied", "--obs-map"),
                                            ("embodied-bench", "--env-kwargs")])
def test_deep_json_in_a_demo_option_is_the_same_error_in_both_demos(run_dir, command, option):
    line = _one_error_line(_zchannel("demo", command, option, TOO_DEEP))
    assert line.startswith(f"error: Invalid value for {option}: JSON nested too deeply to parse "
                           "(arrays and objects inside each other) (see '"), line
    assert line.endswith(f" demo {command} --help')"), line


def test_keygen_refuses_a_client_name_of_a_replica_pair(tmp_path):
    """The client pair ``replicaI`` would be written over replica I's pair (one secret key
    for both): refused before any file is written."""
    keys = tmp_path / "keys"
    line = _one_error_line(_zchannel("keygen", str(keys), "--replicas", "2", "--name",
                                     "replica1"))
    assert "Invalid value for '--name': 'replica1' is the file name stem of replica 1's pair" \
        in line
    assert not keys.exists() or not any(keys.rglob("*"))
    out = _zchannel("keygen", str(keys), "--replicas", "2", "--name", "client")
    assert out.returncode == 0, out.stderr
    secrets = {(keys / f"{stem}.key_secret").read_text()
               for stem in ("replica0", "replica1", "client")}
    assert len(secrets) == 3  # three distinct pairs
    assert sorted(p.name for p in (keys / "clients").iterdir()) == [
        "client.key", "replica0.key", "replica1.key"]


RANGE_ERRORS = [
    ("[hooks]\nconsumers = { actor = -1 }", "consumers must be"),
    ("[hooks]\nconsumers = { actor = 70000 }", "consumers must be"),
    ('[hooks]\nconsumers = { "a b" = 1 }', "consumers must be"),
    ('[hooks]\nproducers = ["a b"]', "producers must be"),
    ('metrics_port = "80"', "metrics_port must be an int in 0..65535"),
    ("metrics_port = true", "metrics_port must be an int in 0..65535"),
    ("metrics_port = 70000", "metrics_port must be an int in 0..65535"),
    ('allowed_dtypes = ["object"]', "allowed_dtypes names unknown or not allowed dtypes "
                                    "['object']"),
]


@pytest.mark.parametrize("lines,message", RANGE_ERRORS, ids=[r[0] for r in RANGE_ERRORS])
def test_config_file_values_out_of_range_name_the_file_and_key(run_dir, tmp_path, lines,
                                                               message):
    config = tmp_path / "broker.toml"
    config.write_text(f'[channel]\nname = "ranged"\n{lines}\n')
    line = _one_error_line(_zchannel("broker", "--config", str(config)))
    assert line.startswith(f"error: {config}: {message}"), line


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("option", ["--config", "--cluster"])
def test_a_config_or_cluster_file_that_is_no_regular_file_says_so(run_dir, tmp_path, kind,
                                                                   option):
    """A FIFO (no writer: reading it would block) or a device is refused as what it is,
    without being read, not as a missing file."""
    path = str(tmp_path / "fifo") if kind == "fifo" else os.devnull
    if kind == "fifo":
        os.mkfifo(path)
    args = ["broker", "plain", option, path] + (["--replica", "0"] if option == "--cluster" else [])
    line = _one_error_line(_zchannel(*args))
    assert f"{path} is not a regular file (a FIFO, a socket or a device)" in line, line
    assert "no such file" not in line


def test_an_abstract_ipc_address_is_refused_naming_it(run_dir, tmp_path):
    """``ipc://@NAME`` has no socket file whose mode keeps other users out: refused up front,
    from the command line and from a config file, and the run directory keeps nothing."""
    address = f"ipc://@zct-{uuid.uuid4().hex[:10]}"
    expected = (f"address {address} is a Linux abstract socket, which a broker does not serve "
                "(it has no file permissions: any local user could connect, and no socket "
                "file clients find); give ipc://PATH, a socket file only its owner may open")
    line = _one_error_line(_zchannel("broker", "abstract", "--address", address))
    assert line == f"error: {expected}"
    config = tmp_path / "abstract.toml"
    config.write_text(f'[channel]\nname = "abstract"\naddress = "{address}"\n')
    line = _one_error_line(_zchannel("broker", "--config", str(config)))
    assert line == f"error: {config}: {expected}"
    assert not [f for f in os.listdir(run_dir) if f.endswith((".addr", ".token"))]
