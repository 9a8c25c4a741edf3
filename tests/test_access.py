"""Who may stop a broker (its shutdown token, a CURVE admin key) and what a broker warns about
when its address lets others in (docs/security.md)."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys

import msgpack
import pytest
import zmq
from conftest import exited, pid_alive
from zchannel.broker import Channel
from zchannel.broker.host import paths
from zchannel.broker.server.config import BrokerConfig
from zchannel.broker.server.loop import Broker

pytestmark = pytest.mark.timeout(120)


def _cli(*args: str, timeout: float = 60,
         env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zchannel.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env_extra or {})})


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    """A ``zchannel broker`` process and its address (from its ready line)."""
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise AssertionError(proc.communicate(timeout=10))
    return proc, line.split()[1]


def _stop(proc: subprocess.Popen) -> str:
    """SIGTERM (by PID) and the broker's stderr."""
    if proc.poll() is None:
        proc.terminate()
    _, err = proc.communicate(timeout=30)
    return err


def _raw_shutdown(address: str, token: str | None = "x") -> list:
    """The repro: a raw DEALER saying hello and asking for a shutdown with a made-up token;
    the broker's reply records."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(address)
        sock.send(msgpack.packb([{"op": "hello", "id": 1, "v": 1},
                                 {"op": "shutdown", "id": 2, "token": token}]))
        assert sock.poll(20_000), "the broker did not answer"
        return msgpack.unpackb(sock.recv())
    finally:
        sock.close()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_raw_dealer_cannot_stop_a_cli_broker(transport, run_dir):
    args = ["guarded"] + (["--address", "tcp://127.0.0.1:0"] if transport == "tcp" else [])
    proc, address = _start(*args)
    try:
        for token in ("x", None, 7):
            replies = _raw_shutdown(address, token)
            assert replies[1]["e"][0] == "PermissionError", replies
            assert "shutdown token" in replies[1]["e"][1]
        ch = Channel.connect(address, timeout=20)  # still serving
        ch.put("after")
        assert ch.get(timeout=10) == "after"
        ch.close()
        assert proc.poll() is None
    finally:
        err = _stop(proc)
    assert proc.returncode == 0, err
    assert "refused a shutdown request" in err


def test_zchannel_broker_stop_uses_the_token_kept_for_its_owner(run_dir):
    proc, address = _start("stoppable")
    try:
        token_file = os.path.join(run_dir, "stoppable.token")
        st = os.stat(token_file)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        info = paths.read_token_file("stoppable")
        assert info["address"] == address and info["pid"] == proc.pid
        assert len(info["token"]) >= 32
        out = _cli("broker", "stop", "stoppable")
        assert out.returncode == 0, out.stderr
        assert f"stopped stoppable (pid {proc.pid}" in out.stdout
        assert proc.wait(timeout=30) == 0
    finally:
        err = _stop(proc)
    # the CLI said where the token is kept, and the broker took its files away
    assert f"kept in {token_file}" in err and "zchannel broker stop stoppable" in err
    assert not os.path.exists(token_file)
    missing = _cli("broker", "stop", "stoppable")
    assert missing.returncode == 2 and "no shutdown token for 'stoppable'" in missing.stderr


def test_a_token_file_sets_the_token(run_dir, tmp_path):
    secret = tmp_path / "token"
    secret.write_text("0123456789abcdef0123\n")
    proc, address = _start("chosen", "--token-file", str(secret))
    try:
        assert paths.read_token_file("chosen")["token"] == "0123456789abcdef0123"
        wrong = _cli("broker", "stop", address)  # an address: no token file, no admin key
        assert wrong.returncode == 2 and "give --token-file FILE" in wrong.stderr
        guessed = tmp_path / "guessed"
        guessed.write_text("not-the-token-at-all\n")
        refused = _cli("broker", "stop", address, "--token-file", str(guessed))
        assert refused.returncode == 2 and "shutdown refused" in refused.stderr
        out = _cli("broker", "stop", address, "--token-file", str(secret))
        assert out.returncode == 0, out.stderr
        assert proc.wait(timeout=30) == 0
    finally:
        _stop(proc)
    short = tmp_path / "short"
    short.write_text("abc\n")
    bad = _cli("broker", "short", "--token-file", str(short))
    assert bad.returncode == 2 and "at least 16 characters" in bad.stderr


def test_the_creating_handle_stops_its_broker_and_others_need_the_token(channels, run_dir):
    ch = Channel.create("owned")
    channels.append(ch)
    pid = ch.stats()["pid"]
    other = Channel.connect("owned")
    with pytest.raises(PermissionError, match="only the handle that created"):
        other.shutdown()
    other = Channel.connect("owned")
    with pytest.raises(PermissionError, match="shutdown refused"):
        other.shutdown(token="not-the-token")
    assert ch.qsize() == 0 and pid_alive(pid)
    # the creator's token is the one in the run directory: its owner may stop it from anywhere
    token = paths.read_token_file("owned")["token"]
    Channel.connect("owned").shutdown(token=token)
    assert exited(pid, 30)
    ch.shutdown()  # the creator's shutdown of a broker already gone: no error


def _keygen(directory, name):
    out = _cli("keygen", str(directory), "--name", name)
    assert out.returncode == 0, out.stderr
    return str(directory / f"{name}.key"), str(directory / f"{name}.key_secret")


def test_stop_and_stat_of_a_curve_broker_by_name_need_only_the_client_key_pair(tmp_path,
                                                                              run_dir):
    """A CURVE broker of this host leaves its public key beside its token: ``zchannel broker
    stop NAME`` and ``zchannel stat NAME`` connect with the client's key pair alone (its
    option or ``$ZCHANNEL_CURVE_SECRET_KEY``), as a distributed channel's clients do."""
    keys = tmp_path / "keys"
    server_pub, server_sec = _keygen(keys, "broker")
    _, user_sec = _keygen(keys, "user")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    os.link(keys / "user.key", allowed / "user.key")
    proc, address = _start("curvename", "--address", "tcp://127.0.0.1:0", "--curve-secret-key",
                           server_sec, "--curve-public-keys", str(allowed))
    try:
        assert paths.read_token_file("curvename")["curve_public_key"] == \
            open(server_pub).read().split('public-key = "')[1].split('"')[0]
        shown = _cli("stat", "curvename", "--json", "--curve-secret-key", user_sec)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["name"] == "curvename"
        out = _cli("broker", "stop", "curvename", env_extra={"ZCHANNEL_CURVE_SECRET_KEY": user_sec})
        assert out.returncode == 0, out.stderr
        assert proc.wait(timeout=30) == 0
    finally:
        _stop(proc)


def test_a_curve_admin_key_stops_the_broker_without_the_token(tmp_path, run_dir):
    keys = tmp_path / "keys"
    server_pub, server_sec = _keygen(keys, "broker")
    admin_pub, admin_sec = _keygen(keys, "admin")
    _, user_sec = _keygen(keys, "user")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in ("admin", "user"):
        os.link(keys / f"{name}.key", allowed / f"{name}.key")
    admins = tmp_path / "admins"
    admins.mkdir()
    os.link(admin_pub, admins / "admin.key")
    proc, address = _start("secured", "--address", "tcp://127.0.0.1:0", "--curve-secret-key",
                           server_sec, "--curve-public-keys", str(allowed),
                           "--curve-admin-keys", str(admins))
    try:
        user = Channel.connect(address, curve_keys=(user_sec, server_pub), timeout=20)
        user.put(1)
        with pytest.raises(PermissionError, match="shutdown refused"):
            user.shutdown(token="")
        assert proc.poll() is None
        out = _cli("broker", "stop", address, "--curve-secret-key", admin_sec,
                   "--curve-server-key", server_pub)
        assert out.returncode == 0, out.stderr
        assert proc.wait(timeout=30) == 0
    finally:
        err = _stop(proc)
    assert "shutdown requested by admin key" in err
    # admin keys without CURVE: the broker could not tell who a client is
    bad = _cli("broker", "plain", "--curve-admin-keys", str(admins))
    assert bad.returncode == 2 and "curve_admin_keys needs CURVE" in bad.stderr


@pytest.mark.parametrize("args, warning", [
    (["--address", "tcp://127.0.0.1:0"], "no authentication (tcp without CURVE): any local user"),
    (["--address", "tcp://0.0.0.0:0", "--insecure"], "bound without CURVE (insecure): anyone"),
    ([], None),
])
def test_the_cli_warns_about_addresses_that_let_others_in(args, warning, run_dir):
    proc, address = _start("exposed", *args)
    err = _stop(proc)
    if warning is None:
        assert "CURVE" not in err, err
    else:
        assert f"WARNING {address} " in err and warning in err, err


def test_the_warnings_are_logged_on_the_zchannel_logger(caplog, run_dir):
    broker = Broker(BrokerConfig(name="logged", address="tcp://127.0.0.1:0"))
    with caplog.at_level(logging.WARNING, logger="zchannel"):
        try:
            broker.bind()
        finally:
            broker.close()
    found = [r for r in caplog.records if "no authentication" in r.getMessage()]
    assert found and found[0].name == "zchannel.broker" and found[0].levelno == logging.WARNING
