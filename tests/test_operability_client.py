"""What an operator sees from the client side of ``zchannel``: malformed client settings in the
environment, a peer at the address that is no zchannel broker, a tcp host that does not
resolve, keys that would drive the terminal, and ``stat --peek ''`` (the empty key)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from test_cli_errors import _console_script, _one_line, _zchannel
from zchannel.broker import Channel, ProtocolError

pytestmark = pytest.mark.timeout(120)

# (variable, malformed value, the start of its error line)
MALFORMED = [
    ("ZCHANNEL_SPIN_US", "abc", "error: ZCHANNEL_SPIN_US must be an int >= 0"),
    ("ZCHANNEL_LAZY_MS", "-1", "error: ZCHANNEL_LAZY_MS must be an int >= 0"),
    ("ZCHANNEL_BATCH", "xyz", "error: ZCHANNEL_BATCH must be 0 or 1 (or false/true"),
    ("ZCHANNEL_DIRECT", "maybe", "error: ZCHANNEL_DIRECT must be 0 or 1 (or false/true"),
    ("ZCHANNEL_SHM", "nah", "error: ZCHANNEL_SHM must be 0 or 1 (or false/true"),
]


def _run(args: list[str], timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


@pytest.mark.parametrize("name, value, line", MALFORMED)
def test_a_malformed_client_setting_is_one_line_for_every_command(name, value, line, tmp_path):
    """``--help`` included: the installed console script and ``python -m`` alike."""
    script = _console_script()
    for args in ([script, "--help"], [script, "stat"],
                 [sys.executable, "-m", "zchannel.cli.main", "keygen", str(tmp_path)]):
        out = _run(args, **{name: value})
        assert out.returncode == 2, (args, out.stderr)
        assert _one_line(out.stderr).startswith(line), out.stderr
    assert not os.listdir(tmp_path)  # the command did not run
    out = _run([script, "--help"], ZCHANNEL_DEBUG="1", **{name: value})
    assert out.returncode == 1 and "Traceback" in out.stderr and f"{name} must be" in out.stderr


@pytest.mark.parametrize("name, value, line", MALFORMED)
def test_a_malformed_client_setting_is_a_value_error_at_import(name, value, line):
    out = _run([sys.executable, "-c", "import zchannel.broker"], **{name: value})
    assert out.returncode == 1
    assert f"ValueError: {line.removeprefix('error: ')}" in out.stderr


@pytest.mark.parametrize("flag, on", [("OFF", False), ("No", False), ("false", False),
                                      ("0", False), ("Yes", True), ("on", True), ("TRUE", True)])
def test_client_flags_take_their_words_in_any_case(flag, on):
    code = ("from zchannel.broker.connection import tuning; from zchannel.broker.shm import "
            "env_enabled; print(tuning.direct_enabled(), env_enabled(), tuning.BATCH)")
    out = _run([sys.executable, "-c", code], ZCHANNEL_DIRECT=flag, ZCHANNEL_SHM=flag,
               ZCHANNEL_BATCH=flag)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(on)] * 3


def test_direct_and_shm_read_at_connect_are_checked_there(channels, monkeypatch):
    """ZCHANNEL_DIRECT and ZCHANNEL_SHM are read again by each new connection: a malformed
    value set after import is a ValueError naming it at connect, not a silent "on"."""
    ch = Channel.create("envchk")
    channels.append(ch)
    for name in ("ZCHANNEL_DIRECT", "ZCHANNEL_SHM"):
        with monkeypatch.context() as mp:
            mp.setenv(name, "maybe")
            with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
                Channel.connect("envchk", timeout=10)
    other = Channel.connect("envchk", timeout=10)
    other.put(1, key="k")
    assert ch.get(key="k", timeout=10) == 1
    other.close()


GARBAGE_SERVER = textwrap.dedent("""
    import sys, zmq
    sock = zmq.Context().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    while True:
        parts = sock.recv_multipart()
        sock.send_multipart([parts[0], b"garbage\\xff\\x00"])
""")


@pytest.fixture
def garbage_peer():
    """A process whose ROUTER answers every message with bytes that are no zchannel reply."""
    proc = subprocess.Popen([sys.executable, "-c", GARBAGE_SERVER], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        yield f"tcp://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.kill()
        proc.wait(30)


def test_a_peer_answering_garbage_is_one_protocol_error_at_once(garbage_peer):
    start = time.monotonic()
    with pytest.raises(ProtocolError) as err:
        Channel.connect(garbage_peer, timeout=30)
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert garbage_peer in message and "answered the hello with a reply this client cannot "\
        "read (malformed header" in message
    start = time.monotonic()
    out = _zchannel("stat", garbage_peer, "--timeout", "30")
    assert time.monotonic() - start < 15
    assert out.returncode == 2
    line = _one_line(out.stderr)  # no ERROR log lines before it
    assert line.startswith(f"error: {garbage_peer} answered the hello"), line


@pytest.mark.parametrize("host", ["256.1.1.1", "example.invalid"])
def test_a_tcp_host_that_does_not_resolve_is_named_at_once(host):
    try:
        socket.getaddrinfo(host, 5555, type=socket.SOCK_STREAM)
        pytest.skip(f"{host} resolves here")
    except socket.gaierror as exc:
        if exc.errno != socket.EAI_NONAME:
            pytest.skip(f"the name server does not say {host} does not exist: {exc}")
    start = time.monotonic()
    out = _zchannel("stat", f"tcp://{host}:5555", "--timeout", "30")
    assert time.monotonic() - start < 15
    assert out.returncode == 2
    assert _one_line(out.stderr).startswith(
        f"error: no broker at tcp://{host}:5555: its host '{host}' is no IP address and no "
        "name that resolves")


EVIL = "evil\nhot  99999  0  0  0  -"
RED = "\x1b[2J\x1b[31mRED\x1b[0m"
LONG = "k" * 1000


def test_stat_shows_keys_escaped_and_cut(channels):
    """Control characters of keys reach the terminal escaped (``\\x1b``, ``\\n``), a long key
    is cut, in the table and in --watch; --json keeps every key exact."""
    ch = Channel.create("esc")
    channels.append(ch)
    for key in (EVIL, RED, LONG, "\u202eabc"):
        ch.put("x", key=key)
    out = _zchannel("stat", "esc")
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\u202e" not in out.stdout
    lines = out.stdout.splitlines()
    assert not any(line.startswith("hot") for line in lines)  # no row forged by a newline
    assert any(line.startswith("\\x1b[2J\\x1b[31mRED\\x1b[0m ") for line in lines)
    assert any(line.startswith("evil\\nhot  99999") for line in lines)
    assert any(line.startswith("\\u202eabc ") for line in lines)
    assert any(line.startswith("k" * 57 + "... ") for line in lines)
    assert max(len(line) for line in lines) < 200
    watch = _zchannel("stat", "esc", "--watch", "--count", "1")
    assert watch.returncode == 0, watch.stderr
    assert "\x1b[31m" not in watch.stdout and "\\x1b[2J" in watch.stdout
    assert "evil\\nhot" in watch.stdout and "\u202e" not in watch.stdout
    assert max(len(line) for line in watch.stdout.splitlines()) <= 80
    raw = _zchannel("stat", "esc", "--json")
    assert set(json.loads(raw.stdout)["keys"]) == {EVIL, RED, LONG, "\u202eabc"}


def test_stat_peek_of_the_empty_key_takes_n(channels):
    ch = Channel.create("pe")
    channels.append(ch)
    ch.put("item", key="")
    out = _zchannel("stat", "pe", "--peek", "", "-n", "1")
    assert out.returncode == 0, out.stderr
    assert "[0] weight 0  'item'" in out.stdout
    # options whose companion is a flag or an option not given are still refused
    for args, message in ((["-n", "1"], "-n does nothing without --peek"),
                          (["--count", "2"], "--count does nothing without --watch"),
                          (["--consumer", "a:0"], "--consumer does nothing without --peek")):
        out = _zchannel("stat", "pe", *args)
        assert out.returncode == 2
        assert message in _one_line(out.stderr)
