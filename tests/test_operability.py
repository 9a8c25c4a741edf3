"""What an operator runs into when starting brokers: a broker never removes a file of theirs at
its ipc address (only socket files, and on stop only those it made); a refused run directory is
offered for removal only when it is zchannel's own, and ``ZCHANNEL_RUN_DIR`` is made one level
deep at most; a token file's token has a most length ``zchannel broker stop`` can send; and
``max_message_bytes`` has a floor under which no client could reach the broker.  Real brokers,
real ``zchannel`` processes."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
from zchannel.broker import BrokerStartError, Channel

pytestmark = pytest.mark.timeout(180)


def _zchannel(*args: str, env: dict | None = None, timeout: float = 60):
    return subprocess.run([sys.executable, "-m", "zchannel.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _broker_start(*args: str) -> tuple[int | None, str, str]:
    """Run ``zchannel broker ARGS`` until it says ``ready`` or exits: (its exit status, or None
    when it got ready (it is then stopped with SIGTERM), its stdout line, its stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.startswith("ready "):
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        return None, line, err
    out, err = proc.communicate(timeout=60)
    return proc.returncode, line + out, err


def _serving_broker(*args: str) -> tuple[subprocess.Popen, str]:
    """Start ``zchannel broker ARGS`` and wait for its ``ready`` line: the process (the caller
    ends it by PID) and the address it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"the broker did not get ready: {line!r} {err}")
    return proc, line.split()[1]


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def _occupy(path: str, kind: str) -> None:
    if kind == "file":
        with open(path, "w") as f:
            f.write("precious data\n")
    elif kind == "directory":
        os.mkdir(path)
        with open(os.path.join(path, "inside"), "w") as f:
            f.write("precious data\n")
    else:  # a symbolic link to a file of the user's
        with open(path + ".target", "w") as f:
            f.write("precious data\n")
        os.symlink(path + ".target", path)


def _intact(path: str, kind: str) -> bool:
    if kind == "file":
        return stat.S_ISREG(os.lstat(path).st_mode) and open(path).read() == "precious data\n"
    if kind == "directory":
        return open(os.path.join(path, "inside")).read() == "precious data\n"
    return os.path.islink(path) and open(path).read() == "precious data\n"


WHAT = {"file": "a regular file", "directory": "a directory", "symlink": "a symbolic link"}


# -- an ipc address's path is the user's unless it is a socket ---------------------------------


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
def test_a_broker_refuses_an_ipc_path_that_is_not_a_socket_and_keeps_it(short_dir, kind):
    """``zchannel broker --address ipc://PATH`` where PATH is a file of the user's used to
    remove it and serve there (its data lost); a directory gave a bare ``[Errno 21]``.  Now:
    one line naming the address, the path and what it is, status 2, the path untouched."""
    path = os.path.join(short_dir, "precious.txt")
    _occupy(path, kind)
    status, _, err = _broker_start("pf", "--address", f"ipc://{path}")
    assert status == 2, err
    assert _one_line(err) == (
        f"error: cannot bind ipc://{path}: {path} exists and is not a socket (it is "
        f"{WHAT[kind]}): not removing it; choose another address")
    assert _intact(path, kind)


def test_create_refuses_an_ipc_path_that_is_not_a_socket(short_dir, channels):
    path = os.path.join(short_dir, "precious.txt")
    _occupy(path, "file")
    with pytest.raises(BrokerStartError, match="exists and is not a socket") as err:
        channels.append(Channel.create("pf2", address=f"ipc://{path}"))
    assert err.value.reason == "FileExistsError" and f"cannot bind ipc://{path}" in str(err.value)
    assert _intact(path, "file")


def test_files_beside_an_ipc_address_are_left_alone(short_dir):
    """``PATH.d`` (the direct link's socket), ``PATH.z`` and ``PATH.g`` (the gate's) used to be
    removed at start whatever they were.  A file there now is kept, with a warning naming it
    (the broker serves without that socket), and the broker's own socket goes at stop."""
    path = os.path.join(short_dir, "side")
    for suffix in (".d", ".z", ".g"):
        _occupy(path + suffix, "file")
    status, line, err = _broker_start("side", "--address", f"ipc://{path}")
    assert status is None, err
    assert f"no direct link at {path}.d: {path}.d exists and is not a socket" in err
    assert f"{path}.z exists and is not a socket" in err
    for suffix in (".d", ".z", ".g"):
        assert _intact(path + suffix, "file"), suffix
    assert not os.path.lexists(path)  # its own socket, removed at stop


def test_a_stopping_broker_removes_only_the_socket_it_made(short_dir):
    """A file put at the broker's ipc path while it ran (the socket renamed over) is not the
    broker's: it stays when the broker stops.  A socket file nothing listens on (a killed
    broker's) is still taken over at start."""
    path = os.path.join(short_dir, "own")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # a socket file left behind, nothing listening
    proc, _ = _serving_broker("own", "--address", f"ipc://{path}")
    try:
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        _occupy(path + ".new", "file")
        os.replace(path + ".new", path)  # the operator's file now has that name
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert _intact(path, "file")


def test_clean_removes_a_killed_brokers_sockets_but_not_a_file_at_its_address(short_dir,
                                                                             run_dir):
    """``zchannel clean`` after a broker was killed: the socket files at its address go, a
    regular file the user has put at one of those paths since stays (and is not listed)."""
    path = os.path.join(short_dir, "cl")
    proc, _ = _serving_broker("cl", "--address", f"ipc://{path}")
    proc.kill()  # by PID: its files stay behind
    proc.communicate(timeout=30)
    sockets = [p for p in os.listdir(short_dir) if stat.S_ISSOCK(os.lstat(
        os.path.join(short_dir, p)).st_mode)]
    assert "cl" in sockets and len(sockets) >= 2  # the socket and its direct-link socket
    _occupy(path + ".new", "file")
    os.replace(path + ".new", path)  # the user's file now has the address's name
    listed = _zchannel("clean", "--dry-run")
    assert listed.returncode == 0, listed.stderr
    assert f"{path}\n" not in listed.stdout + "\n" and f"{path}.d" in listed.stdout
    out = _zchannel("clean")
    assert out.returncode == 0, out.stderr
    assert _intact(path, "file")
    assert not os.path.lexists(path + ".d")  # the killed broker's direct-link socket went


# -- the run directory --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["/etc", "/tmp", "/usr/bin", "/etc/passwd"])
def test_a_refused_run_directory_the_user_named_is_never_offered_for_removal(where):
    """``ZCHANNEL_RUN_DIR=/etc zchannel stat`` used to say ``remove it (rm -r /etc)``."""
    out = _zchannel("stat", env=dict(os.environ, ZCHANNEL_RUN_DIR=where))
    assert out.returncode == 2, out.stderr
    line = _one_line(out.stderr)
    assert f"run directory {where} " in line and "rm " not in line and "remove" not in line
    assert "choose another ZCHANNEL_RUN_DIR" in line


def test_zchannels_own_run_directory_may_be_removed(tmp_path):
    """The advice to remove a refused run directory stays for zchannel's own one
    (``$XDG_RUNTIME_DIR/zchannel`` here, as ``/tmp/zchannel-<uid>``)."""
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    (xdg / "zchannel").mkdir(mode=0o700)
    os.chmod(xdg / "zchannel", 0o755)
    env = {k: v for k, v in os.environ.items() if k != "ZCHANNEL_RUN_DIR"}
    out = _zchannel("stat", env=dict(env, XDG_RUNTIME_DIR=str(xdg)))
    assert out.returncode == 2, out.stderr
    assert f"remove it (rm -r {xdg}/zchannel) if no broker of yours runs there" in out.stderr
    wide = tmp_path / "wide"  # the same mode on a directory the user named: no removal
    wide.mkdir()
    os.chmod(wide, 0o755)
    out = _zchannel("stat", env=dict(os.environ, ZCHANNEL_RUN_DIR=str(wide)))
    assert out.returncode == 2 and "rm -r" not in out.stderr and "mode 0755" in out.stderr


def test_zchannel_run_dir_is_made_one_level_deep_at_most(tmp_path):
    """``ZCHANNEL_RUN_DIR=/nonexistent/deep/dir`` used to make the whole tree; now a missing
    parent is an error naming the variable, and only a last component is made (mode 0700)."""
    deep = tmp_path / "missing" / "deep" / "dir"
    out = _zchannel("stat", env=dict(os.environ, ZCHANNEL_RUN_DIR=str(deep)))
    assert out.returncode == 2
    line = _one_line(out.stderr)
    assert f"run directory {deep} (ZCHANNEL_RUN_DIR) cannot be made: its parent " \
           f"{deep.parent} does not exist" in line
    assert not (tmp_path / "missing").exists()
    fresh = tmp_path / "fresh"
    out = _zchannel("stat", env=dict(os.environ, ZCHANNEL_RUN_DIR=str(fresh)))
    assert out.returncode == 0, out.stderr
    assert not fresh.exists()  # looking does not make it (tests/test_operator_field.py)
    made = subprocess.run([sys.executable, "-c", "from zchannel.broker.host import paths; "
                           "paths.run_dir()"], env=dict(os.environ, ZCHANNEL_RUN_DIR=str(fresh)),
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700


# -- the shutdown token -------------------------------------------------------------------------


def test_a_token_too_long_to_send_is_refused_at_start(tmp_path, run_dir):
    """A token file whose first line is over a megabyte was taken, and ``zchannel broker stop``
    could then never send it.  A token is at most 1024 characters: longer is refused at start,
    naming the file; 1024 works end to end."""
    huge = tmp_path / "huge"
    huge.write_text("a" * 2_000_000 + "\n")
    status, _, err = _broker_start("bt", "--token-file", str(huge))
    assert status == 2, err
    assert _one_line(err) == (f"error: {huge}: a shutdown token is at least 16 characters and at "
                              "most 1024 (its first line has more)")
    longest = tmp_path / "longest"
    longest.write_text("b" * 1024 + "\n")
    proc, address = _serving_broker("bt", "--token-file", str(longest))
    try:
        # broker stop --token-file reads the token as the broker does: a huge one is refused
        # in one line naming the file, before anything is sent
        refused = _zchannel("broker", "stop", "--token-file", str(huge), address)
        assert refused.returncode == 2 and _one_line(refused.stderr) == (
            f"error: {huge}: a shutdown token is at least 16 characters and at most 1024 (its "
            "first line has more)")
        assert proc.poll() is None
        stop = _zchannel("broker", "stop", "--token-file", str(longest), address)
        assert stop.returncode == 0, stop.stderr
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_secret_files_others_can_read_are_warned_about(tmp_path, run_dir):
    """A CURVE secret key file or a token file with a mode that lets other users read it is
    used, with a warning naming it and the fix (``chmod 600``), as ssh does for a private key;
    0600 files get none."""
    keys = tmp_path / "keys"
    made = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "keygen", str(keys),
                           "--name", "broker"], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    secret, token = keys / "broker.key_secret", tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    args = ("sec", "--address", "tcp://127.0.0.1:0", "--curve-secret-key", str(secret),
            "--curve-public-keys", str(keys), "--token-file", str(token))
    for mode in (0o644, 0o600):
        os.chmod(secret, mode)
        os.chmod(token, mode)
        status, line, err = _broker_start(*args)
        assert status is None and line.startswith("ready "), err
        warned = [w for w in err.splitlines() if "other users may read it" in w]
        if mode == 0o644:
            assert len(warned) == 2, err
            assert f"secret key file {secret} has mode 0644" in warned[0] + warned[1]
            assert f"chmod 600 {token}" in warned[0] + warned[1]
        else:
            assert warned == [], err


# -- max_message_bytes --------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["10", "65536", "262143"])
def test_a_max_message_bytes_no_client_could_use_is_refused(tmp_path, value):
    """``--max-message-bytes 10`` made a broker no client could reach (its hello dropped);
    under 256 KiB even a client's coalesced small puts were dropped.  0 or at least 256 KiB,
    from a flag or a config file."""
    status, _, err = _broker_start("mm", "--max-message-bytes", value)
    assert status == 2, err
    assert _one_line(err) == (
        "error: max_message_bytes must be an int >= 262144 and <= 9223372036854775807, or 0 "
        "for no limit (bytes; less would refuse a client's ordinary messages), got " + value)
    config = tmp_path / "mm.toml"
    config.write_text(f'[channel]\nname = "mm"\nmax_message_bytes = {value}\n')
    status, _, err = _broker_start("--config", str(config))
    assert status == 2 and f"{config}: max_message_bytes must be" in err


@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_broker_at_the_least_max_message_bytes_serves_small_items(cli_broker, channels,
                                                                    monkeypatch, direct):
    """At the floor every request for small items gets through, over a direct link and over
    ZeroMQ: the hello, stat, thousands of async puts that the client coalesces (long keys of
    4-byte characters make their headers as large as they get), coalesced gets and a batch."""
    monkeypatch.setenv("ZCHANNEL_DIRECT", direct)
    address = cli_broker("floor", "--max-message-bytes", str(256 << 10))
    ch = Channel.connect(address, timeout=30)
    channels.append(ch)
    key = "\U0001F600" * 64
    puts = [ch.put(b"x" * 120, 1, key, async_op=True, timeout=30) for _ in range(4000)]
    for work in puts:
        work.wait(timeout=60)
    assert ch.qsize(key) == 4000
    gets = [ch.get(key, async_op=True, timeout=30) for _ in range(2000)]
    assert all(work.wait(timeout=60) == b"x" * 120 for work in gets)
    assert len(ch.get_batch(1000, key, timeout=30)) == 1000
    out = _zchannel("stat", "floor")
    assert out.returncode == 0 and "floor" in out.stdout, out.stderr


def test_a_broker_stopped_while_its_gate_is_shut_leaves_no_socket_file(short_dir, channels):
    """With its connection budget used up, the broker's path names the gate's stand-in
    socket (server/admission.py): stopping then still removes the path and the gate's files
    (the path is pointed back at the broker's own socket first)."""
    path = os.path.join(short_dir, "gated")
    proc, _ = _serving_broker("gated", "--address", f"ipc://{path}", "--max-clients", "1")
    try:
        real = os.lstat(path)
        ch = Channel.connect(f"ipc://{path}", timeout=30)
        channels.append(ch)
        ch.put(1)
        deadline = time.monotonic() + 30
        while os.lstat(path).st_ino == real.st_ino and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.lstat(path).st_ino != real.st_ino  # the stand-in
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert sorted(os.listdir(short_dir)) == []
