"""Cluster files as found in the field: a file that gives two channels one replica address,
files nested too deeply, too large or not regular files, and replica rows whose node or
address is malformed.  Replicas are real processes (``zchannel broker NAME --cluster FILE
--replica I``); clients claim nodes with ``ZCHANNEL_NODE``."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading

import msgpack
import pytest
import zmq
from cluster_util import Replicas, free_tcp_ports
from zchannel.broker import Channel
from zchannel.broker.cluster import clusterfile
from zchannel.broker.errors import ChannelError
from zchannel.broker.host import toml as toml_reader
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, pack_header

pytestmark = pytest.mark.timeout(120)


def _write(path, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def test_a_replica_of_another_channel_is_never_used(tmp_path, monkeypatch):
    """One file for two channels whose replica 1 has a fixed tcp address: channel ``fx`` runs
    both replicas; ``fy``'s replica 0 neither learns ``fx``'s bindings nor binds to ``fx``'s
    replica, and every ``fy`` handle (the creator's, one unpickled) refuses that replica."""
    port = free_tcp_ports(1)[0]
    path = _write(tmp_path / "shared.toml",
                  f'[[replica]]\nnode = "na"\naddress = "ipc://{tmp_path}/{{name}}-0.sock"\n'
                  f'[[replica]]\nnode = "nb"\naddress = "tcp://127.0.0.1:{port}"\n')
    replicas = Replicas()
    y = None
    try:
        replicas.start("fx", path, (0, 1))
        monkeypatch.setenv("ZCHANNEL_NODE", "nb")
        x = Channel.connect(f"tcp://127.0.0.1:{port}", timeout=30)
        x.put("x-item", key="kx", timeout=30)
        assert x.replica_of("kx") == 1
        monkeypatch.setenv("ZCHANNEL_NODE", "na")
        y = Channel.create("fy", distributed=True, options={"cluster": path})
        assert y.replica_of("kx") == 0  # not fx's binding of kx
        y.put("y-item", key="kx", timeout=30)
        assert y.get(key="kx", timeout=30) == "y-item"
        with pytest.raises(ChannelError, match=r"shared\.toml does not match .*'fy'.*serves channel 'fx'"):
            y._sub(1)._connection(timeout=30)
        summary = y.stats()["replicas"][1]
        assert "'fx'" in summary["error"] and "'fy'" in summary["error"], summary
        monkeypatch.setenv("ZCHANNEL_NODE", "nb")
        copy = pickle.loads(pickle.dumps(y))  # a handle on node nb: replica 1 is its home
        try:
            with pytest.raises(ChannelError, match=r"shared\.toml does not match .*'fy'.*serves channel 'fx'"):
                copy.reserve_shm(1024, 1)
            assert copy.replica_of("ky") == 0  # bound to fy's own replica
        finally:
            copy.close()
        assert x.qsize("kx") == 1 and x.get(key="kx", timeout=30) == "x-item"
        x.close()
    finally:
        if y is not None:
            y.shutdown()
        replicas.stop_all()


def test_a_replica_refuses_a_table_request_of_another_channel(tmp_path):
    """A replica's first table request (``sync``) may go out before its peer's hello is
    checked: a replica of another channel answers it with an error naming both channels and
    sends no table; one of its own channel gets the table."""
    port = free_tcp_ports(1)[0]
    path = _write(tmp_path / "shared.toml",
                  f'[[replica]]\nnode = "na"\naddress = "ipc://{tmp_path}/{{name}}-0.sock"\n'
                  f'[[replica]]\nnode = "nb"\naddress = "tcp://127.0.0.1:{port}"\n')
    replicas = Replicas()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        replicas.start("fx", path, (0, 1))
        sock.connect(f"tcp://127.0.0.1:{port}")

        def answer(record: dict) -> dict:
            sock.send_multipart([pack_header([record])])
            assert sock.poll(30_000)
            return msgpack.unpackb(sock.recv_multipart()[0], raw=False)[0]

        answer({"op": "hello", "id": 1, "v": PROTOCOL_VERSION})
        refused = answer({"op": "sync", "id": 2, "from": 0, "ch": "fy"})
        assert "'fx'" in str(refused.get("e")) and "'fy'" in str(refused.get("e")), refused
        assert "r" not in refused
        own = answer({"op": "sync", "id": 3, "from": 0, "ch": "fx"})
        assert "e" not in own and "r" in own, own
    finally:
        sock.close()
        replicas.stop_all()


def test_a_deeply_nested_cluster_file_is_a_value_error(tmp_path, monkeypatch):
    """5000 nested arrays: ``connect`` through ``$ZCHANNEL_CLUSTER`` names the variable and the
    file, ``zchannel broker --cluster`` prints one error line and exits with status 2."""
    deep = _write(tmp_path / "deep.toml",
                  '[[replica]]\nnode = "a"\naddress = "ipc://a.sock"\nhostnames = '
                  + "[" * 5000 + "]" * 5000 + "\n")
    monkeypatch.setenv(clusterfile.ENV_CLUSTER, deep)
    with pytest.raises(ValueError, match=r"ZCHANNEL_CLUSTER.*deep\.toml.*nested too deeply"):
        Channel.connect("fdeep", timeout=5)
    monkeypatch.delenv(clusterfile.ENV_CLUSTER)
    done = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", "fdeep",
                           "--cluster", deep, "--replica", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "deep.toml" in lines[0], lines


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = str(tmp_path / "fifo.toml")
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            clusterfile.load(fifo, "f")
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(30)
    try:
        assert not reader.is_alive(), "reading the FIFO blocked"
        assert isinstance(outcome[0], ValueError) and "not a regular file" in str(outcome[0])
    finally:
        if reader.is_alive():  # let a blocked open return (a writer that closes at once)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(30)


def test_a_device_an_oversized_file_and_too_many_replicas_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"/dev/null is not a regular file"):
        clusterfile.load("/dev/null", "f")
    row = '[[replica]]\nnode = "a"\naddress = "ipc://a.sock"\n'
    big = _write(tmp_path / "big.toml", row + "#" * toml_reader.MAX_TOML_BYTES + "\n")
    with pytest.raises(ValueError, match=rf"big\.toml is larger than {toml_reader.MAX_TOML_BYTES} bytes"):
        clusterfile.load(big, "f")
    many = _write(tmp_path / "many.toml", "".join(
        f'[[replica]]\nnode = "n{i}"\naddress = "ipc://r{i}.sock"\n'
        for i in range(clusterfile.MAX_REPLICAS + 1)))
    with pytest.raises(ValueError, match=rf"many\.toml: {clusterfile.MAX_REPLICAS + 1} replicas "
                                         rf"listed, at most {clusterfile.MAX_REPLICAS}"):
        clusterfile.load(many, "f")
    at_most = _write(tmp_path / "most.toml", "".join(
        f'[[replica]]\nnode = "n{i}"\naddress = "ipc://r{i}.sock"\n'
        for i in range(clusterfile.MAX_REPLICAS)))
    assert len(clusterfile.load(at_most, "f").replicas) == clusterfile.MAX_REPLICAS


@pytest.mark.parametrize("rows, cause", [
    ('node = "a"\naddress = "tcp://127.0.0.1:0"', r"replica 0: address .*port 0"),
    ('node = "a"\naddress = ""', r"replica 0: address must be a non-empty string"),
    ('node = ""\naddress = "ipc://a.sock"', r"replica 0: node must be a non-empty string"),
    ('node = 123\naddress = "ipc://a.sock"', r"replica 0: node must be a non-empty string, got 123"),
    ('node = "a"\naddress = 5555', r"replica 0: address must be a non-empty string, got 5555"),
    ('node = "a"\naddress = "foo://bar"', r"replica 0: address 'foo://bar' must be ipc://PATH"),
    ('node = "a"\naddress = "tcp://127.0.0.1:47{name}"', r"replica 0: address 'tcp://127\.0\.0\.1:47fz'"),
    ('node = "a"\naddress = "tcp://127.0.0.1:5555"\n[[replica]]\nnode = "b"\n'
     'address = "tcp://LOCALHOST:5555"', r"each replica has an address of its own; listed more than once: replica 0 \(tcp://127\.0\.0\.1:5555\) "
     r"and replica 1 \(tcp://LOCALHOST:5555\)"),
])
def test_a_malformed_replica_row_is_refused_naming_file_and_replica(tmp_path, monkeypatch,
                                                                     rows, cause):
    path = _write(tmp_path / "rows.toml", f"[[replica]]\n{rows}\n")
    with pytest.raises(ValueError, match=rf"rows\.toml: {cause}"):
        clusterfile.load(path, "fz")
    monkeypatch.setenv(clusterfile.ENV_CLUSTER, path)
    with pytest.raises(ValueError, match=rf"ZCHANNEL_CLUSTER.*rows\.toml: {cause}"):
        Channel.connect("fz", timeout=5)
