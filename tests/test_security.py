"""CURVE authentication and bind policy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from zchannel.broker import Channel, ChannelNotFound

pytestmark = pytest.mark.timeout(90)


def _keygen(directory, name):
    out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "keygen", str(directory),
                          "--name", name], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return str(directory / f"{name}.key"), str(directory / f"{name}.key_secret")


def test_curve_admits_known_clients_only(tmp_path):
    keys = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server_pub, server_sec = _keygen(keys, "broker")
    client_pub, client_sec = _keygen(keys, "client")
    _, intruder_sec = _keygen(keys, "intruder")
    os.link(client_pub, allowed / "client.key")
    assert oct(os.stat(client_sec).st_mode & 0o777) == "0o600"
    proc = subprocess.Popen(
        [sys.executable, "-m", "zchannel.cli.main", "broker", "secure", "--address",
         "tcp://127.0.0.1:0", "--curve-secret-key", server_sec, "--curve-public-keys",
         str(allowed)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        address = proc.stdout.readline().split()[1]
        good = Channel.connect(address, curve_keys=(client_sec, server_pub))
        good.put("secret payload")
        with pytest.raises(ChannelNotFound):
            Channel.connect(address, curve_keys=(intruder_sec, server_pub), timeout=2)
        with pytest.raises(ChannelNotFound):
            Channel.connect(address, timeout=2)  # no keys at all
        assert good.get(timeout=5) == "secret payload"  # authorised traffic is unaffected
        good.close()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "DENIED" in err  # the broker logged the rejected client


def test_env_vars_and_create_with_keys(tmp_path, monkeypatch, channels):
    server_pub, server_sec = _keygen(tmp_path, "broker")
    client_pub, client_sec = _keygen(tmp_path, "client")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    os.link(client_pub, allowed / "client.key")
    ch = Channel.create("curvy", address="tcp://127.0.0.1:0", curve_keys={
        "server_secret_key": server_sec, "public_keys": str(allowed),
        "secret_key": client_sec, "server_public_key": server_pub})
    channels.append(ch)
    ch.put(1)
    monkeypatch.setenv("ZCHANNEL_CURVE_SECRET_KEY", client_sec)
    monkeypatch.setenv("ZCHANNEL_CURVE_SERVER_KEY", server_pub)
    other = Channel.connect(ch.address)
    assert other.get(timeout=5) == 1
    other.close()
