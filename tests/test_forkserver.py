"""The broker fork server (``ZCHANNEL_BROKER_FORKSERVER``): brokers forked from it serve like
spawned ones, report their exit status, stop with their creator; unset, brokers are children."""

from __future__ import annotations

import logging
import os
import signal
import subprocess

import pytest
from conftest import exited, pid_alive, start_forkserver, wait_until
from zchannel.broker import BrokerStartError, Channel
from zchannel.broker.host import paths
from zchannel.broker.server.forkclient import ENV, UNKNOWN_EXIT, ForkedBroker
from zchannel.embodied.plan import TrajectoryPlan


@pytest.fixture(scope="module")
def own_forkserver():
    """A fork server of this module's own (not the session's), shared by its tests: each one
    forks brokers from it after the others' brokers were stopped, killed or orphaned; stopped
    with SIGTERM at the end (its socket removed)."""
    folder = f"/tmp/zcft-{os.urandom(5).hex()}"
    os.makedirs(folder, mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    proc = start_forkserver(folder, env)  # it execs itself again with the brokers' tunables
    yield proc, os.path.join(folder, "forkserver.sock")
    proc.terminate()
    proc.wait(30)
    proc.stdout.close()
    assert not os.path.exists(os.path.join(folder, "forkserver.sock"))  # removed on SIGTERM
    os.rmdir(folder)


@pytest.fixture
def forkserver(own_forkserver, monkeypatch):
    """The module's fork server, named by the variable for this test."""
    proc, sock = own_forkserver
    assert proc.poll() is None, "the module's fork server exited"
    monkeypatch.setenv(ENV, sock)
    return proc


def ppid_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_forked_broker_serves_and_reports_its_exit(forkserver, channels):
    ch = Channel.create("forked", maxsize=4)
    channels.append(ch)
    proc = ch._proc
    assert isinstance(proc, ForkedBroker)
    assert ppid_of(proc.pid) == forkserver.pid  # forked by the server, not started here
    with open(f"/proc/{proc.pid}/environ", "rb") as f:
        assert b"glibc.cpu.x86_non_temporal_threshold=0x400000" in f.read()
    ch.put({"a": 1}, key="k")
    assert ch.get(key="k", timeout=10) == {"a": 1}
    assert proc.poll() is None
    ch.shutdown()
    assert proc.wait(10) == 0  # a clean stop, as reported by the server
    assert not pid_alive(proc.pid)


def test_forked_broker_killed_reports_the_signal(forkserver, channels):
    ch = Channel.create("forked-kill")
    channels.append(ch)
    proc = ch._proc
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    alive = Channel.create("forked-alive")
    channels.append(alive)
    with pytest.raises(subprocess.TimeoutExpired):
        alive._proc.wait(0.05)


def test_forked_broker_start_errors_keep_their_types(forkserver):
    with pytest.raises(ValueError, match="unknown collector"):
        Channel.create("forked-bad", collector="no_such_collector")


def test_published_hooks_are_imported_by_the_fork_server(forkserver, channels):
    """The fork server imported the ``zchannel.hooks`` entry points (``embodied_trajectory``,
    which imports torch) before serving: its brokers resolve the name without importing them."""
    with open(f"/proc/{forkserver.pid}/maps") as f:
        assert "libtorch" in f.read()
    plan = TrajectoryPlan.from_options(dict(
        mode="rollout", num_sources=1, source_batch_size=1, num_chunks=1, rollout_epochs=1,
        actor_world_size=1, num_action_chunks=1, action_dim=1))
    ch = Channel.create("forked-hooks", collector="embodied_trajectory",
                        dispatcher="embodied_trajectory", producers=["rollout"],
                        consumers={"actor": 1}, options=plan.to_options())
    channels.append(ch)
    assert ppid_of(ch._proc.pid) == forkserver.pid
    assert ch.qsize() == 0


def test_forked_broker_stops_with_its_creator(forkserver, workers):
    code = """
        from zchannel.broker import Channel
        ch = Channel.create("orphan")
        print(ch._proc.pid, type(ch._proc).__name__, flush=True)
        input()
    """
    worker = workers.start(code)
    pid, kind = workers.wait_line(worker).split()
    assert kind == "ForkedBroker"
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    assert exited(int(pid), 30)


def test_missing_forkserver_is_a_clear_error(monkeypatch, run_dir):
    monkeypatch.setenv(ENV, os.path.join(run_dir, "nothing.sock"))
    with pytest.raises(BrokerStartError, match="no broker fork server"):
        Channel.create("nowhere")


def test_without_the_variable_brokers_are_children(spawned_brokers, channels):
    ch = Channel.create("spawned")
    channels.append(ch)
    assert isinstance(ch._proc, subprocess.Popen)
    assert ppid_of(ch._proc.pid) == os.getpid()


@pytest.mark.parametrize("how", ["token", "killed"])
def test_a_forked_brokers_status_is_known_once_its_fork_server_is_gone(tmp_path, monkeypatch,
                                                                       caplog, how):
    """A fork server that stops leaves its brokers running; a durable one of them stopped on
    request later still says so (its 0, written by itself), and one killed is known to have
    died: the keeper starts nothing for the first, and its watch ends either way."""
    folder = f"/tmp/zcfg-{os.urandom(5).hex()}"
    os.makedirs(folder, mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    server = start_forkserver(folder, env)
    monkeypatch.setenv(ENV, os.path.join(folder, "forkserver.sock"))
    name = f"fs-gone-{how}"
    ch = Channel.create(name, journal=tmp_path / "j")
    try:
        ch.put("kept", key="a")
        pid, keeper = ch.stats()["pid"], ch._keeper
        server.terminate()
        server.wait(30)
        server.stdout.close()
        assert pid_alive(pid)  # the server's brokers outlive it
        with caplog.at_level(logging.INFO, logger="zchannel.client"):
            if how == "token":
                other = Channel.connect(name)
                other.shutdown(token=paths.read_token_file(name)["token"])
                keeper.join(timeout=60)
                assert not keeper._thread.is_alive() and keeper.restarts == 0
                assert ch._proc.returncode == 0
                assert "stopped on request: not started again" in caplog.text
            else:
                os.kill(pid, signal.SIGKILL)
                # its death is seen (no status: the server is gone), and a start is tried
                assert wait_until(lambda: "starting it again" in caplog.text, timeout=60)
                assert ch._proc.returncode == UNKNOWN_EXIT
        assert exited(pid, 30)
    finally:
        ch.shutdown()
        os.rmdir(folder)
