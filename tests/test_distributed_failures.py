"""Distributed channels whose replicas are dead, and cluster files that do not fit: replicas on
ipc sockets in the test's run directory, started with ``zchannel broker NAME --cluster FILE
--replica I`` and SIGKILLed (their socket files stay behind, as a killed broker's do)."""

from __future__ import annotations

import os
import threading

import pytest
from cluster_util import Replicas, write_cluster
from conftest import wait_until
from zchannel.broker import BrokerUnavailable, Channel
from zchannel.broker.cluster import clusterfile
from zchannel.broker.connection import tuning
from zchannel.broker.connection.work import Work
from zchannel.broker.errors import ChannelError, ChannelNotFound
from zchannel.broker.handle import routing
from zchannel.broker.handle.distributed import DistributedChannel

pytestmark = pytest.mark.timeout(90)

NODES = ("node-a", "node-b", "node-c", "node-d")


@pytest.fixture
def replicas(run_dir):
    """Four replicas of channel ``dead`` on ipc sockets, one per node of ``NODES``."""
    path = write_cluster(run_dir, NODES)
    reps = Replicas()
    try:
        reps.start("dead", path, range(len(NODES)))
        yield path, reps
    finally:
        reps.stop_all()


def _handle(monkeypatch, path: str, node: str, via: int = 0) -> DistributedChannel:
    monkeypatch.setenv("ZCHANNEL_NODE", node)
    ch = Channel.connect(clusterfile.load(path, "dead").replicas[via].address)
    assert isinstance(ch, DistributedChannel)
    return ch


def _outcome(call, limit: float) -> tuple[str, object]:
    """``("returned", value)`` or ``("raised", exception)`` of ``call()`` run in a thread, or
    ``("blocked", None)`` when it has not finished within ``limit`` seconds."""
    out: list = []

    def run() -> None:
        try:
            out.append(("returned", call()))
        except BaseException as exc:
            out.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    return out[0] if out else ("blocked", None)


def test_new_handle_fails_at_once_on_a_dead_replicas_keys(replicas, monkeypatch):
    """A handle that never connected to a SIGKILLed replica (its socket file left behind)
    fails operations on that replica's keys with ``BrokerUnavailable`` at once, whatever the
    operation's timeout; an asynchronous operation returns a ``Work`` failed with it."""
    path, reps = replicas
    producer = _handle(monkeypatch, path, "node-b")
    producer.put(1, key="kb")
    assert producer.replica_of("kb") == 1
    producer.close()  # the process keeps no connection to replica 1
    reps.kill(1)
    ch = _handle(monkeypatch, path, "node-c")
    try:
        for call in (lambda: ch.get("kb", timeout=1), lambda: ch.get("kb", timeout=1),
                     lambda: ch.qsize("kb")):
            # a wait for the connection took 10 s before, on every call
            kind, value = _outcome(call, 6.0)
            assert kind == "raised" and isinstance(value, BrokerUnavailable), (kind, value)
        kind, work = _outcome(lambda: ch.put(2, key="kb", async_op=True), 6.0)
        assert kind == "returned" and isinstance(work, Work), (kind, work)
        with pytest.raises(BrokerUnavailable):
            work.wait(timeout=30)
        ch.put(3, key="ka")  # the live replicas serve as before
        assert ch.get("ka", timeout=30) == 3
    finally:
        ch.close()


def test_stats_does_not_wait_for_dead_replicas_one_by_one(replicas, monkeypatch):
    """``stats()`` with three dead replicas answers with an ``error`` for each: it neither
    waits for each in turn nor for a connection that nothing can accept."""
    path, reps = replicas
    for i in (1, 2, 3):
        reps.kill(i)
    ch = _handle(monkeypatch, path, "node-a")
    try:
        kind, stats = _outcome(ch.stats, 6.0)  # 3 s per dead replica before: 9 s
        assert kind == "returned", (kind, stats)
        rows = stats["replicas"]
        assert "error" not in rows[0] and all("error" in rows[i] for i in (1, 2, 3)), rows
    finally:
        ch.close()


def test_new_keys_bind_at_once_while_the_binder_cannot_be_connected(replicas, monkeypatch):
    """Replica 0 (the binder) SIGKILLed: once replica 1 took over, a new handle binds new keys
    without waiting for a connection to replica 0 that nothing can accept (a wait of
    ``BIND_CONNECT_S`` before; made long here so that it shows)."""
    path, reps = replicas
    reps.kill(0)
    watcher = _handle(monkeypatch, path, "node-b", via=1)
    try:
        assert wait_until(lambda: watcher.stats()["replicas"][1].get("binding") == "binder",
                          timeout=30)
    finally:
        watcher.close()
    monkeypatch.setattr(routing, "BIND_CONNECT_S", 60.0)
    ch = _handle(monkeypatch, path, "node-c", via=1)
    try:
        kind, value = _outcome(lambda: ch.put(1, key="new-c", timeout=10), 20.0)
        assert kind == "returned", (kind, value)
        assert ch.replica_of("new-c") == 2
    finally:
        ch.close()


def test_cluster_file_of_another_channel_is_refused(run_dir, monkeypatch):
    """A cluster file without ``{name}`` or ``[cluster] name`` lists the replicas of the
    channel running at its addresses: ``connect`` of another name through it is a
    ``ChannelError`` naming the file and both channels, not a handle of that channel."""
    path = write_cluster(run_dir, ("node-a", "node-b"),
                         [f"ipc://{run_dir}/fixed-{i}.sock" for i in range(2)])
    reps = Replicas()
    try:
        reps.start("xchan", path, range(2))
        monkeypatch.setenv("ZCHANNEL_NODE", "node-a")
        monkeypatch.setenv("ZCHANNEL_CLUSTER", path)
        with pytest.raises(ChannelError) as caught:
            Channel.connect("zchan", timeout=10)
        assert not isinstance(caught.value, ChannelNotFound)
        text = str(caught.value)
        assert path in text and "'zchan'" in text and "'xchan'" in text, text
        x = Channel.connect("xchan", timeout=10)  # the channel the file does describe
        assert isinstance(x, DistributedChannel) and x.name == "xchan"
        x.close()
    finally:
        reps.stop_all()


def test_broken_cluster_file_in_the_environment_is_reported(run_dir, monkeypatch, tmp_path):
    """``$ZCHANNEL_CLUSTER`` naming a missing or malformed file: ``connect`` of any channel
    by name is a ``ValueError`` naming the variable, the file and the cause; a file that serves
    another channel (``[cluster] name``) is no error for this one."""
    plain = Channel.create("plainch")
    try:
        plain.put("hi", key="k")
        missing = str(tmp_path / "missing.toml")
        malformed = tmp_path / "malformed.toml"
        malformed.write_text("[cluster\nname = 1\n")
        for path, cause in ((missing, "No such file"), (str(malformed), "not valid TOML")):
            monkeypatch.setenv("ZCHANNEL_CLUSTER", path)
            for name in ("plainch", "nosuchch"):
                with pytest.raises(ValueError) as caught:
                    Channel.connect(name, timeout=5)
                text = str(caught.value)
                assert "$ZCHANNEL_CLUSTER" in text and path in text and cause in text, text
        other = tmp_path / "other.toml"
        other.write_text('[cluster]\nname = "another"\n[[replica]]\nnode = "n"\n'
                         f'address = "ipc://{run_dir}/another-0.sock"\n')
        monkeypatch.setenv("ZCHANNEL_CLUSTER", str(other))
        again = Channel.connect("plainch", timeout=10)
        assert again.get("k", timeout=10) == "hi"
        again.close()
    finally:
        plain.shutdown()


def test_relative_ipc_addresses_resolve_against_the_cluster_file(run_dir, monkeypatch):
    """A relative ipc path in a cluster file is relative to the file (as its key paths are):
    the creator and a client in other working directories reach the same socket."""
    here = os.path.join(run_dir, "conf")
    os.makedirs(os.path.join(here, "socks"))
    path = write_cluster(here, ("node-a",), ["ipc://socks/{name}-0.sock"])
    elsewhere = os.path.join(run_dir, "elsewhere")
    os.makedirs(elsewhere)
    assert clusterfile.load(path, "rel").replicas[0].address == \
        f"ipc://{here}/socks/rel-0.sock"
    monkeypatch.setenv("ZCHANNEL_NODE", "node-a")
    monkeypatch.chdir(elsewhere)  # where the relative path names no directory
    ch = Channel.create("rel", distributed=True, options={"cluster": path})
    try:
        assert os.path.exists(os.path.join(here, "socks", "rel-0.sock"))
        ch.put("x", key="k")
        monkeypatch.chdir(run_dir)
        monkeypatch.setenv("ZCHANNEL_CLUSTER", path)
        client = Channel.connect("rel", timeout=10)
        assert client.get("k", timeout=10) == "x"
        client.close()
    finally:
        ch.shutdown()


def test_connect_budget_bounds():
    """An operation waits for a first connection as long as its timeout, at least
    ``CONNECT_MIN_S`` (a hello under load) and at most ``CONNECT_S``; an asynchronous one
    ``CONNECT_MIN_S``."""
    assert tuning.connect_budget(None) == tuning.CONNECT_S
    assert tuning.connect_budget(0.0) == tuning.CONNECT_MIN_S
    assert tuning.connect_budget(5.0) == 5.0
    assert tuning.connect_budget(1e6) == tuning.CONNECT_S
    assert tuning.connect_budget(60.0, async_op=True) == tuning.CONNECT_MIN_S
