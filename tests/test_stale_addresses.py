"""A killed broker's run-directory files name an address that another broker may have taken
over since: ``zchannel clean`` never removes that broker's socket files, and a channel name
whose broker is gone reaches nothing (``Channel.connect``, ``zchannel stat NAME``, ``zchannel
broker stop NAME``) instead of the broker now at its old address.  A channel named like a
replica's lock (``foo.replica0``) is a channel of its own, not a replica of ``foo``.  Real
brokers, real ``zchannel`` processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from cluster_util import free_tcp_ports
from zchannel.broker import Channel, ChannelNotFound
from zchannel.broker.host import paths
from zchannel.broker.server import rundir

pytestmark = pytest.mark.timeout(180)


def _zchannel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zchannel.cli.main", *args],
                          capture_output=True, text=True, timeout=120)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` (by PID) and reap it: its run-directory files stay behind."""
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)


def _taken_over(broker_procs, address: str) -> subprocess.Popen:
    """Broker ``ca`` served ``address`` and was killed; broker ``cb`` serves it now, holding
    one item under key ``"k"``.  The ``cb`` process."""
    killed, _ = broker_procs("ca", "--address", address)
    _kill(killed)
    taker, real = broker_procs("cb", "--address", address)
    assert real == address
    with Channel.connect("cb", timeout=30) as ch:
        ch.put(b"cb's own", key="k")
    return taker


def _socket_files(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def test_clean_keeps_the_sockets_of_a_broker_that_took_over_a_killed_brokers_address(
        broker_procs, short_dir, run_dir):
    """``zchannel stat`` lists the killed broker's lock, address and token files as stale, not
    the socket files at the address a live broker took over; ``zchannel clean`` removes the
    former and leaves the live broker reachable by name."""
    address = f"ipc://{short_dir}/c.sock"
    taker = _taken_over(broker_procs, address)
    sockets = _socket_files(short_dir)
    assert "c.sock" in sockets
    listed = json.loads(_zchannel("stat", "--json").stdout)
    stale = {entry["name"]: entry["files"] for entry in listed["stale"]}
    assert sorted(stale) == ["ca"], listed
    assert not [f for f in stale["ca"] if f.startswith(short_dir)], stale
    assert {os.path.join(run_dir, f"ca.{ext}") for ext in ("lock", "addr", "token")} <= set(
        stale["ca"])
    out = _zchannel("clean")
    assert out.returncode == 0, out.stderr
    assert short_dir not in out.stdout, out.stdout
    assert _socket_files(short_dir) == sockets
    assert not [f for f in os.listdir(run_dir) if f.startswith("ca.")]
    with Channel.connect("cb", timeout=30) as ch:
        assert ch.get(key="k", timeout=30) == b"cb's own"
    assert taker.poll() is None
    assert _zchannel("broker", "stop", "cb").returncode == 0
    taker.communicate(timeout=30)
    assert taker.returncode == 0


def test_a_stale_entry_listed_before_its_address_was_taken_over_keeps_the_new_sockets(
        broker_procs, short_dir):
    """Between ``zchannel clean``'s scan and its removals another broker may take the killed
    broker's address over (the killed channel's lock does not keep a broker of another name
    out): the socket files it made there are not the ones listed, and stay."""
    address = f"ipc://{short_dir}/c.sock"
    killed, _ = broker_procs("ca", "--address", address)
    _kill(killed)
    entry = next(e for e in rundir.scan()[1] if e.name == "ca")
    assert os.path.join(short_dir, "c.sock") in entry.files  # nothing listens there yet
    taker, _ = broker_procs("cb", "--address", address)
    sockets = _socket_files(short_dir)
    removed = rundir._clean(entry)
    assert not [f for f in removed if f.startswith(short_dir)], removed
    assert _socket_files(short_dir) == sockets
    with Channel.connect("cb", timeout=30) as ch:
        ch.put(1)
        assert ch.get(timeout=30) == 1
    assert taker.poll() is None


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_killed_brokers_name_does_not_reach_the_broker_at_its_old_address(
        broker_procs, short_dir, transport):
    """Broker ``ca`` was killed and ``cb`` serves at its address now (an ipc path taken over,
    a tcp port reused): ``connect("ca")``, ``zchannel stat ca`` and ``zchannel broker stop
    ca`` find no broker of ``ca`` and say why; ``cb`` keeps serving, its items untouched."""
    address = (f"ipc://{short_dir}/c.sock" if transport == "ipc"
               else f"tcp://127.0.0.1:{free_tcp_ports(1)[0]}")
    taker = _taken_over(broker_procs, address)
    with pytest.raises(ChannelNotFound, match=r"no channel named 'ca' on this host \(its "
                       r"address file .*ca\.addr is left from a broker that is gone"):
        Channel.connect("ca", timeout=30)
    stat = _zchannel("stat", "ca", "--timeout", "30")
    assert stat.returncode == 2, stat.stdout
    assert stat.stderr.startswith("error: no channel named 'ca' on this host"), stat.stderr
    stop = _zchannel("broker", "stop", "ca", "--timeout", "30")
    assert stop.returncode == 2, stop.stdout
    assert "shutdown token file" in stop.stderr and "left from a broker that is gone" in \
        stop.stderr and "refused" not in stop.stderr, stop.stderr
    assert taker.poll() is None
    with Channel.connect("cb", timeout=30) as ch:
        keys = ch.stats()["keys"]
        assert {key: k["depth"] for key, k in keys.items()} == {"k": 1}


def test_connect_by_name_checks_that_the_broker_serves_that_channel(broker_procs, short_dir):
    """Even while the channel's lock is held (a broker of it starting, its ``.addr`` not yet
    written anew), an address file that names another channel's broker is not followed: the
    broker's hello names the channel it serves."""
    address = f"ipc://{short_dir}/c.sock"
    _, real = broker_procs("cb", "--address", address)
    lock_fd = paths.try_lock("ca")
    assert lock_fd is not None
    try:
        paths.write_address("ca", real)
        with pytest.raises(ChannelNotFound, match=r"no broker serves channel 'ca' at "
                           r".*: the broker there serves channel 'cb'"):
            Channel.connect("ca", timeout=30)
    finally:
        paths.addr_path("ca").unlink()
        paths.release_lock("ca", lock_fd)
    with Channel.connect("cb", timeout=30) as ch:
        assert ch.stats()["keys"] == {}


def test_a_channel_named_like_a_replica_is_a_channel_of_its_own(broker_procs, run_dir):
    """``foo.replica0`` is a valid channel name: its broker is not a replica of ``foo``
    (``connect("foo")`` finds no channel), ``zchannel stat`` lists it as a live broker with no
    stale entries, ``zchannel clean`` would remove nothing, ``zchannel broker stop`` stops it,
    and once it is killed its files are its own stale entry."""
    proc, address = broker_procs("foo.replica0")
    with pytest.raises(ChannelNotFound, match=r"^no channel named 'foo' on this host$"):
        Channel.connect("foo", timeout=30)
    with Channel.connect("foo.replica0", timeout=30) as ch:
        ch.put(b"x")
        assert ch.stats()["name"] == "foo.replica0"
    listed = json.loads(_zchannel("stat", "--json").stdout)
    assert listed["stale"] == [], listed
    assert [(b["name"], b["address"], b["pid"]) for b in listed["brokers"]] == [
        ("foo.replica0", address, proc.pid)]
    dry = _zchannel("clean", "--dry-run")
    assert dry.stdout.strip() == f"nothing to remove in {run_dir}", dry.stdout
    _kill(proc)
    listed = json.loads(_zchannel("stat", "--json").stdout)
    assert [e["name"] for e in listed["stale"]] == ["foo.replica0"], listed
    assert f"{run_dir}/foo.replica0.sock" in listed["stale"][0]["files"]
    assert _zchannel("clean").returncode == 0
    assert not os.listdir(run_dir)
    again, _ = broker_procs("foo.replica0")
    stop = _zchannel("broker", "stop", "foo.replica0")
    assert stop.returncode == 0, stop.stderr
    again.communicate(timeout=30)
    assert again.returncode == 0
