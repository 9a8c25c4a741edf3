"""Brokers clean up after themselves; ``zchannel stat`` lists this host's brokers and stale
entries and ``zchannel clean`` removes the stale ones."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import stat
import subprocess
import sys

import pytest
from click.testing import CliRunner
from zchannel.broker import Channel, ChannelNotFound, UnsafeRunDir, shm
from zchannel.broker.host import paths
from zchannel.cli.main import main as cli

pytestmark = pytest.mark.timeout(120)


def _leftovers(run_dir):
    """Files in the run directory and this run directory's segments in /dev/shm."""
    return sorted(os.listdir(run_dir)) + shm.list_segments(shm.run_prefix(run_dir))


def test_a_broker_of_another_name_does_not_take_a_served_ipc_address(broker_procs, run_dir):
    """The channel lock keeps brokers of one name apart, not brokers of two names given one
    ``ipc://`` address: the second is refused as on a busy tcp port (it used to remove the
    first's socket file and serve there, stranding the first's items), and the first keeps
    its socket file."""
    address = f"ipc://{run_dir}/shared.sock"
    first, _ = broker_procs("first", "--address", address)
    ch = Channel.connect(address, timeout=30)
    ch.put("precious")
    out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", "second",
                          "--address", address], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Address already in use" in out.stderr, out.stderr
    again = Channel.connect(address, timeout=30)
    assert again.stats()["name"] == "first" and again.get(timeout=30) == "precious"
    again.close()
    ch.close()


def test_failed_starts_leave_nothing(run_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", "busy",
                              "--address", f"tcp://127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "Address already in use" in out.stderr
        with pytest.raises(Exception, match="Address already in use"):
            Channel.create("busy", address=f"tcp://127.0.0.1:{port}")
    assert _leftovers(run_dir) == []
    with pytest.raises(ValueError, match="unknown collector"):
        Channel.create("nohook", collector="no_such_collector")
    out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", "nohook",
                          "--collector", "no_such_collector"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert _leftovers(run_dir) == []


def test_clean_shutdown_leaves_nothing(run_dir, broker_procs):
    ch = Channel.create("tidy")
    ch.put(b"x" * (2 << 20))  # a shared-memory item: the producer's pool segment exists
    assert any(name.endswith(".lock") for name in os.listdir(run_dir))
    assert shm.list_segments(shm.run_prefix(run_dir))
    ch.shutdown()
    assert _leftovers(run_dir) == []
    proc, _ = broker_procs("tidy-cli")
    assert "tidy-cli.lock" in os.listdir(run_dir)
    proc.send_signal(signal.SIGTERM)  # at once after "ready": it stops all the same
    proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert _leftovers(run_dir) == []


def test_shutdown_after_the_broker_was_killed_leaves_nothing(run_dir):
    """The creator of a broker that was SIGKILLed (it removed none of its files) removes them
    at ``shutdown()`` (and so at exit): the socket, address, lock and token files and its
    shared-memory segments."""
    ch = Channel.create("killed")
    reader = Channel.connect("killed")
    ch.put(b"x" * (2 << 20))
    view = reader.get(copy=False, timeout=10)  # a held slot: its segment stays mapped here
    assert len(view) == 2 << 20 and shm.list_segments(shm.prefix_for("killed", run_dir))
    pid = ch.stats()["pid"]
    os.kill(pid, signal.SIGKILL)
    ch._proc.wait(timeout=30)  # the handle's own child process, by its pid
    assert any(name.startswith("killed.") for name in os.listdir(run_dir))
    del view
    reader.close()
    ch.shutdown()
    assert _leftovers(run_dir) == []


def test_lock_file_removal_does_not_let_two_holders_in(run_dir):
    first = paths.try_lock("racy")
    assert first is not None and paths.try_lock("racy") is None
    late = os.open(paths.lock_path("racy"), os.O_RDWR)  # a starter that opened the old file
    paths.release_lock("racy", first)
    assert not paths.lock_path("racy").exists()
    fcntl.flock(late, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it gets the old file's lock...
    second = paths.try_lock("racy")  # ...which is worthless: the path's file is the lock
    assert second is not None and paths.try_lock("racy") is None
    assert os.fstat(second).st_ino == os.stat(paths.lock_path("racy")).st_ino
    os.close(late)
    paths.release_lock("racy", second)
    assert _leftovers(run_dir) == []


def test_stat_lists_brokers_and_stale_entries_and_clean_removes_them(run_dir, broker_procs):
    runner = CliRunner()
    result = runner.invoke(cli, ["stat"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [f"no brokers in {run_dir}", "no stale entries"]
    live, live_address = broker_procs("alive")
    dead, _ = broker_procs("dead")
    # an identity of its own: the in-process `stat` below must not share its connection (a
    # process's handles of one identity share one, and stat leaves its own out)
    handle = Channel.connect("alive", identity="user:0")
    handle.put(1)
    handle.put(2)
    dead_handle = Channel.connect("dead", shm=True)
    dead_handle.put(b"y" * (2 << 20))  # leaves a pool segment
    dead_handle.close()
    os.kill(dead.pid, signal.SIGKILL)  # no clean exit: its files stay
    dead.communicate(timeout=20)
    # its name and socket file are left, but nothing listens: a connect says so at once
    # instead of waiting out its timeout (here longer than the test's)
    with pytest.raises(ChannelNotFound, match="nothing listens"):
        Channel.connect("dead", timeout=600)
    result = runner.invoke(cli, ["stat"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"brokers in {run_dir}"
    row = next(line.split() for line in lines if line.split()[:1] == ["alive"])
    assert row == ["alive", live_address, str(live.pid), "1", "1", "2"]  # 1 client: handle
    assert not any(line.split()[:1] == ["dead"] for line in lines[:3])
    stale_line = next(line for line in lines if line.strip().startswith("dead:"))
    for name in ("dead.lock", "dead.addr", "dead.sock", "+dead+probe"):
        assert name in stale_line, result.output
    data = json.loads(runner.invoke(cli, ["stat", "--json"]).output)
    assert [b["name"] for b in data["brokers"]] == ["alive"]
    assert [s["name"] for s in data["stale"]] == ["dead"]
    stale_files = data["stale"][0]["files"]
    result = runner.invoke(cli, ["clean", "--dry-run"])
    assert all(os.path.lexists(path) for path in stale_files)
    assert sorted(result.output.split("would remove ")[1:]) == sorted(
        f"{path}\n" for path in stale_files)
    result = runner.invoke(cli, ["clean"])
    assert result.exit_code == 0, result.output
    assert sorted(result.output.splitlines()) == sorted(f"removed {p}" for p in stale_files)
    assert not any(os.path.lexists(path) for path in stale_files)
    assert not [n for n in os.listdir(run_dir) if n.startswith("dead")]
    assert not shm.list_segments(shm.prefix_for("dead", run_dir))
    assert runner.invoke(cli, ["stat"]).output.splitlines()[-1] == "no stale entries"
    assert handle.get(timeout=10) == 1  # the live broker kept its files and works
    handle.close()
    assert runner.invoke(cli, ["clean"]).output.strip() == f"nothing to remove in {run_dir}"
    live.terminate()
    live.communicate(timeout=20)
    assert _leftovers(run_dir) == []


def test_create_whose_client_is_refused_leaves_nothing(run_dir, tmp_path):
    from zchannel.broker import AuthenticationFailed
    from zchannel.broker.transport.curve_keys import keygen

    server_pub, server_sec = keygen(str(tmp_path), "broker")
    _, other_sec = keygen(str(tmp_path), "other")
    allowed = tmp_path / "allowed"
    allowed.mkdir()  # nobody is let in
    with pytest.raises(AuthenticationFailed, match="refused this client key"):
        Channel.create("refused", address="tcp://127.0.0.1:0", curve_keys={
            "server_secret_key": server_sec, "public_keys": str(allowed),
            "secret_key": other_sec, "server_public_key": server_pub})
    assert _leftovers(run_dir) == []


def test_create_with_a_bad_server_key_file_names_it_and_leaves_nothing(run_dir, tmp_path):
    bad = tmp_path / "broker.key_secret"
    bad.write_text("garbage\n")
    with pytest.raises(ValueError, match=f"cannot read the broker's CURVE key pair from {bad}"):
        Channel.create("badkey", address="tcp://127.0.0.1:0",
                       curve_keys={"server_secret_key": str(bad), "secret_key": str(bad),
                                   "server_public_key": str(bad)})
    assert _leftovers(run_dir) == []


# -- whose run directory (docs/security.md) ----------------------------------------------------

OTHER_UID = 4242  # a user that is not us: tests run as root here, so chown can make one


@pytest.fixture
def foreign_dir(tmp_path, monkeypatch):
    """``make(mode, uid)``: a run directory another user made (or one of ours with a wide mode),
    set as ``ZCHANNEL_RUN_DIR``."""
    def make(mode: int, uid: int):
        path = tmp_path / "taken"
        path.mkdir()
        os.chmod(path, mode)
        if uid != os.getuid():
            if os.getuid() != 0:
                pytest.skip("making a directory of another user needs root")
            os.chown(path, uid, uid)
        monkeypatch.setenv("ZCHANNEL_RUN_DIR", str(path))
        return str(path)
    return make


@pytest.mark.parametrize("mode, uid", [(0o700, OTHER_UID), (0o777, OTHER_UID), (0o777, None),
                                       (0o750, None)])
def test_a_run_directory_that_is_not_ours_alone_is_refused(foreign_dir, mode, uid):
    uid = os.getuid() if uid is None else uid
    path = foreign_dir(mode, uid)
    with pytest.raises(UnsafeRunDir) as err:
        Channel.create("victim")
    message = str(err.value)
    assert f"run directory {path} " in message and f"{mode:04o}" in message
    assert f"uid {uid}" in message and "ZCHANNEL_RUN_DIR" in message  # owner and the fix
    assert isinstance(err.value, PermissionError)
    assert os.listdir(path) == [] and stat.S_IMODE(os.stat(path).st_mode) == mode  # untouched
    out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", "victim"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"error: run directory {path} " in out.stderr
    with pytest.raises(UnsafeRunDir):
        Channel.connect("victim", timeout=1)


def test_a_symbolic_link_of_another_user_is_refused(tmp_path, monkeypatch):
    if os.getuid() != 0:
        pytest.skip("making a link of another user needs root")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("ZCHANNEL_RUN_DIR", str(link))
    with pytest.raises(UnsafeRunDir, match=f"symbolic link owned by uid {OTHER_UID}"):
        paths.run_dir()
    os.lchown(link, os.getuid(), os.getgid())
    assert paths.run_dir() == link  # a link of ours to a directory of ours is fine


def test_xdg_runtime_dir_is_preferred_when_it_is_ours(tmp_path, monkeypatch):
    monkeypatch.delenv("ZCHANNEL_RUN_DIR")
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert paths.run_dir() == xdg / "zchannel"
    assert stat.S_IMODE(os.stat(xdg / "zchannel").st_mode) == 0o700
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert paths.run_dir() == paths.Path(f"/tmp/zchannel-{os.getuid()}")
    if os.getuid() == 0:  # sudo leaves the invoking user's XDG_RUNTIME_DIR set
        os.chown(xdg, OTHER_UID, OTHER_UID)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
        assert paths.run_dir() == paths.Path(f"/tmp/zchannel-{os.getuid()}")


def test_a_socket_too_long_for_the_run_directory_stays_in_a_private_one(tmp_path, monkeypatch,
                                                                        channels):
    """An ipc path may take 107 bytes: a long name becomes a hash in the run directory, and a
    run directory too long for that sends the socket to ``/tmp/zchannel-<uid>`` (mode 0700),
    never straight into ``/tmp``; the channel works there."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir(mode=0o700)
    monkeypatch.setenv("ZCHANNEL_RUN_DIR", str(deep))
    name = "n" * 60
    address = paths.default_address(name)
    folder = os.path.dirname(address[len("ipc://"):])
    assert folder == f"/tmp/zchannel-{os.getuid()}"
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert len(address) - len("ipc://") <= 107
    ch = Channel.create(name)
    channels.append(ch)
    assert ch.address == address
    ch.put("through the short path")
    assert ch.get(timeout=10) == "through the short path"
    short = tmp_path / "r"
    short.mkdir(mode=0o700)
    monkeypatch.setenv("ZCHANNEL_RUN_DIR", str(short))
    assert os.path.dirname(paths.default_address("n" * 64)[len("ipc://"):]) == str(short)
