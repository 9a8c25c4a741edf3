"""Stopping a ``zchannel broker`` from the command line, and what its command line accepts.

- A stop that comes while a hook call runs is kept until the call returns; a second stop
  signal interrupts the call and stops the broker cleanly; ``zchannel broker stop NAME`` stops
  it with SIGTERM (also when it holds ``--max-clients`` connections) and says when it is busy.
- The broker logs a client whose reply could not go only when items of it were requeued.
- ``--consumers``: counts and ids cannot be mistaken for each other; ``stat --peek --consumer``
  checks the id; ``--fsync-interval`` with another fsync policy is refused.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading

import msgpack
import pytest
from conftest import exited, wait_until
from zchannel.broker import Channel
from zchannel.broker.host import paths
from zchannel.broker.transport.direct_framing import iovec, link_path

pytestmark = pytest.mark.timeout(180)

# A collector whose every collect first writes a byte into the FIFO ``started`` of the folder
# ``options["dir"]`` (its open waits for the test to open it for reading), then waits for a
# byte on the FIFO ``gate`` there (its open waits for the test to open it for writing).
GATE_HOOK = '''
import os
from zchannel.hooks import Collector


class Gate(Collector):
    def setup(self, ctx):
        self.folder = ctx.options["dir"]

    def collect(self, item, key):
        with open(os.path.join(self.folder, "started"), "wb") as started:
            started.write(b"x")
        with open(os.path.join(self.folder, "gate"), "rb") as gate:
            gate.read(1)
        yield key, item
'''


def _zchannel(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zchannel.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout)


class GatedBroker:
    """A ``zchannel broker NAME --collector stophooks:Gate`` process whose hook calls the test
    sees start (``wait_in_hook``) and lets return (``open_gate``)."""

    def __init__(self, broker_procs, folder, name: str, *flags: str) -> None:
        self.folder = str(folder)
        self.name = name
        for fifo in ("started", "gate"):
            os.mkfifo(os.path.join(self.folder, fifo))
        # opened before any put: the hook's open of "started" for writing then never blocks
        self.started = os.open(os.path.join(self.folder, "started"), os.O_RDONLY | os.O_NONBLOCK)
        self.proc, self.address = broker_procs(
            name, "--collector", "stophooks:Gate", "--option", f"dir={json.dumps(self.folder)}",
            *flags)
        self.outcome: list = []

    def put_in_background(self) -> threading.Thread:
        """A put (in a thread) whose collect call the broker then runs; its outcome (None or
        the exception) lands in ``outcome``."""
        def put() -> None:
            try:
                with Channel.connect(self.name, timeout=60) as ch:
                    ch.put("x", timeout=120)
                self.outcome.append(None)
            except Exception as exc:  # BrokerUnavailable once the hook ran past the expiry
                self.outcome.append(exc)

        thread = threading.Thread(target=put, daemon=True)
        thread.start()
        return thread

    def wait_in_hook(self) -> None:
        """Until a collect call of the broker started (it wrote into ``started``)."""
        ready, _, _ = select.select([self.started], [], [], 120)
        assert ready, "the broker never ran its collector"
        assert os.read(self.started, 1) == b"x"

    def open_gate(self) -> None:
        """Let the collect call waiting at the gate return."""
        fd = os.open(os.path.join(self.folder, "gate"), os.O_WRONLY)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)

    def finish(self) -> tuple[int, str]:
        """The broker's exit status and stderr, once it exited (it must within 120 s)."""
        assert exited(self.proc.pid, 120), f"broker {self.name} did not exit"
        _, err = self.proc.communicate(timeout=30)
        os.close(self.started)
        return self.proc.returncode, err


@pytest.fixture
def gated(broker_procs, tmp_path, monkeypatch):
    """``start(name, *flags)``: a ``GatedBroker`` (its hook module on the brokers' path)."""
    (tmp_path / "stophooks.py").write_text(GATE_HOOK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join((str(tmp_path), os.environ["PYTHONPATH"])))

    def start(name: str, *flags: str) -> GatedBroker:
        folder = tmp_path / name
        folder.mkdir()
        return GatedBroker(broker_procs, folder, name, *flags)

    return start


def _files_of(run_dir: str, name: str) -> list[str]:
    return sorted(f for f in os.listdir(run_dir) if f.startswith(f"{name}."))


# -- a stop while a hook call runs -----------------------------------------------------------------


def test_a_stop_during_a_hook_call_is_kept_until_the_call_returns(gated, run_dir):
    """``zchannel broker stop NAME`` while the collector runs: the command says the broker is
    busy (status 2, naming its pid and what to do), the broker keeps running until the call
    returns, and then stops cleanly (it used to say "no broker answered", and the broker kept
    serving after the call: the stop was lost)."""
    broker = gated("busy")
    broker.put_in_background()
    broker.wait_in_hook()
    stop = _zchannel("broker", "stop", "busy", "--timeout", "1")
    assert stop.returncode == 2, stop.stdout
    line = stop.stderr.strip()
    assert line.startswith(f"error: broker 'busy' (pid {broker.proc.pid}) got the stop signal "
                           "but has not exited within 1.0s: it is busy (in a hook call"), line
    assert "zchannel broker stop busy` again" in line, line
    assert broker.proc.poll() is None  # the call has not returned: the broker waits for it
    broker.open_gate()
    status, err = broker.finish()
    assert status == 0, err
    assert "Traceback" not in err, err
    assert _files_of(run_dir, "busy") == []


def test_a_second_stop_signal_interrupts_the_hook_call_and_stops_cleanly(gated, run_dir):
    """SIGTERM while the collector waits for good, then SIGINT (a second Ctrl-C): the call is
    interrupted (the hook fails with ``ForcedStop``) and the broker stops as cleanly as on one
    signal: exit status 0, its files removed (both signals used to wait for the call)."""
    broker = gated("forced")
    broker.put_in_background()
    broker.wait_in_hook()
    broker.proc.send_signal(signal.SIGTERM)
    broker.proc.send_signal(signal.SIGINT)
    status, err = broker.finish()
    assert status == 0, err
    assert "hook collector.collect failed" in err and "ForcedStop: the broker is stopping: a " \
        "second stop signal interrupted this hook call" in err, err
    assert "Traceback" not in err, err
    assert _files_of(run_dir, "forced") == []


def test_broker_stop_twice_forces_a_broker_stuck_in_a_hook(gated, run_dir):
    """The first ``zchannel broker stop`` says the broker is busy; running it again (the
    second stop signal it names) stops the broker, which the command reports."""
    broker = gated("stuck")
    broker.put_in_background()
    broker.wait_in_hook()
    first = _zchannel("broker", "stop", "stuck", "--timeout", "1")
    assert first.returncode == 2 and "got the stop signal" in first.stderr, first.stderr
    second = _zchannel("broker", "stop", "stuck", "--timeout", "120")
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith(f"stopped stuck (pid {broker.proc.pid}, "), second.stdout
    status, err = broker.finish()
    assert status == 0 and "ForcedStop" in err, err
    assert _files_of(run_dir, "stuck") == []


def test_broker_stop_by_address_names_the_busy_broker_of_this_host(gated, tmp_path):
    """A stop by address (a shutdown request) gets no answer from a broker busy in a hook:
    the error says which broker of this host serves the address, that it runs, and how to
    stop it (status 2)."""
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123\n")
    token.chmod(0o600)
    broker = gated("byaddr", "--token-file", str(token))
    broker.put_in_background()
    broker.wait_in_hook()
    stop = _zchannel("broker", "stop", broker.address, "--token-file", str(token), "--timeout",
                     "1")
    assert stop.returncode == 2, stop.stdout
    line = stop.stderr.strip()
    assert line.startswith(f"error: no broker answered at {broker.address}"), line
    assert f"yet broker 'byaddr' of this host (pid {broker.proc.pid}) serves it and runs" in \
        line and "`zchannel broker stop byaddr` stops it with a signal" in line, line
    broker.open_gate()
    broker.proc.send_signal(signal.SIGTERM)
    status, err = broker.finish()
    assert status == 0, err


def test_broker_stop_goes_through_at_max_clients(broker_procs, run_dir):
    """A broker holding ``--max-clients`` connections refuses more, but ``zchannel broker stop
    NAME`` stops it all the same (it used to be refused like any client: "no broker
    answered")."""
    proc, _ = broker_procs("full", "--max-clients", "1")
    with Channel.connect("full", timeout=60) as ch:
        ch.put(1)
        assert ch.stats()["connections"] == 1
        stop = _zchannel("broker", "stop", "full", "--timeout", "60")
        assert stop.returncode == 0, stop.stderr
        assert stop.stdout.startswith(f"stopped full (pid {proc.pid}, "), stop.stdout
    assert exited(proc.pid, 60)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert _files_of(run_dir, "full") == []


# -- the log of a client gone before its reply went --------------------------------------------


def _link_client(address: str, records: list) -> socket.socket:
    """A direct-link client that sends one message of ``records`` and reads nothing: its
    reading side is shut before it sends, so the broker's reply finds it gone (EPIPE)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(link_path(paths.ipc_path(address)))
    sock.shutdown(socket.SHUT_RD)
    bufs, _ = iovec([msgpack.packb(records)])
    sock.sendall(b"".join(bytes(b) for b in bufs))
    return sock


def test_only_a_client_gone_with_items_is_logged_and_the_log_names_them(broker_procs):
    """Two clients whose replies cannot go: one said hello and put (no item in its replies),
    one said hello and got an item (requeued).  The broker logs the second alone, with the
    count of items requeued; the first (as a process's concurrent first connects drop
    connections right after their hello) used to log "went away ... requeued" as well."""
    proc, address = broker_procs("gone")
    with Channel.connect("gone", timeout=60) as ch:
        ch.put("first")
    hello = {"op": "hello", "id": 1, "v": 1}
    putter = _link_client(address, [hello, {"op": "put", "id": 2, "k": "default_queue",
                                            "b": b"second"}])
    try:
        with Channel.connect("gone", timeout=60) as ch:  # the put stored: its reply went
            assert wait_until(lambda: ch.stats()["keys"]["default_queue"]["depth"] == 2, 60)
        getter = _link_client(address, [hello, {"op": "get", "id": 2, "k": "default_queue",
                                                "nw": True}])
        try:
            with Channel.connect("gone", timeout=60) as ch:  # delivered, then requeued
                assert wait_until(lambda: ch.stats()["delivered"] == 1, 60)
                assert ch.stats()["keys"]["default_queue"]["depth"] == 2
        finally:
            getter.close()
    finally:
        putter.close()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    gone = [line for line in err.splitlines() if "went away" in line]
    assert len(gone) == 1, err
    assert "stopped reading before its reply was sent: 1 item(s) of its unsent replies were " \
        "requeued" in gone[0], gone


# -- what the command line accepts -------------------------------------------------------------


def _refused(*args: str) -> subprocess.CompletedProcess | None:
    """``zchannel ARGS`` (a broker command) once it exited; None, and the broker killed, if it
    started instead (it printed ready)."""
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.startswith("ready "):
        proc.kill()
        proc.communicate(timeout=30)
        return None
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, line + out, err)


@pytest.mark.parametrize("value, message", [
    ("actor:0", "'actor:0' alone would declare no consumer (a count of 0): for the consumer "
                "actor:0 write actor:0, (a list of one id); a count is written actor=N"),
    ("actor:1", "'actor:1' alone reads both as a count (one consumer, actor:0) and as the "
                "consumer id actor:1: write actor=1 for the count, or actor:1, (a list of one "
                "id) for that consumer"),
    ("actor=0", "'actor=0': a count is group=N with N >= 1"),
])
def test_a_consumer_value_that_reads_as_count_and_id_is_refused(value, message):
    """``--consumers actor:0`` used to declare no consumer and ``actor:1`` the consumer
    actor:0, silently: each is now an error naming both spellings."""
    out = _refused("broker", "ambiguous", "--dispatcher", "round_robin", "--consumers", value)
    assert out is not None, f"--consumers {value} started a broker"
    assert out.returncode == 2, out.stdout
    assert out.stderr.startswith("error: Invalid value for '--consumers': " + message), out.stderr


@pytest.mark.parametrize("values, declared", [
    (["actor=1"], ["actor:0"]),
    (["actor:1,"], ["actor:1"]),
    (["actor:3"], ["actor:0", "actor:1", "actor:2"]),
    (["actor=2,critic=1"], ["actor:0", "actor:1", "critic:0"]),
])
def test_consumer_counts_and_ids_declare_what_they_say(broker_procs, values, declared):
    args = [arg for value in values for arg in ("--consumers", value)]
    broker_procs("declared", "--dispatcher", "round_robin", *args)
    with Channel.connect("declared", timeout=60) as ch:
        assert ch.stats()["consumers"] == declared


def test_stat_peek_consumer_is_checked_and_drops_the_hint(broker_procs):
    """``stat --peek KEY --consumer ID`` shows what ID takes next without the hint to use
    --consumer (it printed it anyway), and an ID that is no consumer is an error naming the
    consumers (it showed "0 of 1" silently)."""
    broker_procs("peeked", "--dispatcher", "round_robin", "--consumers", "actor=2")
    with Channel.connect("peeked", timeout=60) as ch:
        ch.put("x", key="k")
    plain = _zchannel("stat", "peeked", "--peek", "k")
    assert plain.returncode == 0, plain.stderr
    assert "--consumer ID shows what ID would take next" in plain.stdout
    mine = _zchannel("stat", "peeked", "--peek", "k", "--consumer", "actor:0")
    assert mine.returncode == 0, mine.stderr
    assert "peek      k: 1 of 1 item(s), head first, as consumer actor:0 would take them, " \
        "left in place\n  [0] weight 0  'x'\n" in mine.stdout, mine.stdout
    assert "--consumer ID shows" not in mine.stdout
    other = _zchannel("stat", "peeked", "--peek", "k", "--consumer", "actor:9")
    assert other.returncode == 2, other.stdout
    assert other.stderr.startswith("error: --consumer actor:9: no consumer of channel "
                                   "'peeked' has that id (its consumers: actor:0, actor:1)"), \
        other.stderr


def test_an_fsync_interval_with_another_fsync_policy_is_refused(tmp_path):
    """``--fsync-interval`` (or ``fsync_interval`` in a config file) does nothing unless the
    policy is ``interval``: with ``never`` or ``always`` it is refused, as journal settings
    without a journal are (it used to be accepted silently)."""
    journal = str(tmp_path / "journal")
    out = _refused("broker", "fsyncs", "--journal", journal, "--fsync", "never",
                   "--fsync-interval", "5")
    assert out is not None, "--fsync never --fsync-interval 5 started a broker"
    assert out.returncode == 2, out.stdout
    assert out.stderr.startswith("error: --fsync-interval sets how often the journal syncs "
                                 "under --fsync interval: with fsync never (--fsync) it would "
                                 "do nothing"), out.stderr
    config = tmp_path / "c.toml"
    config.write_text(f'[channel]\njournal = "{journal}"\nfsync = "always"\nfsync_interval = 2\n')
    out = _refused("broker", "fsyncs", "--config", str(config))
    assert out is not None, "fsync = always with fsync_interval started a broker"
    assert out.returncode == 2, out.stdout
    assert out.stderr.startswith(f"error: fsync_interval in {config} sets how often the "
                                 "journal syncs under --fsync interval: with fsync always "
                                 f"(fsync in {config}) it would do nothing"), out.stderr
    assert not os.path.exists(journal)


@pytest.mark.parametrize("fsync", ["never", "always"])
def test_channel_create_refuses_an_fsync_interval_with_another_fsync_policy(tmp_path, fsync):
    """``Channel.create(journal=..., fsync=..., fsync_interval=...)`` holds the command line's
    rule: an interval under another policy would do nothing, so it is a ``ValueError`` and no
    broker (nor journal directory) is made."""
    journal = tmp_path / "journal"
    with pytest.raises(ValueError, match=f"with fsync='{fsync}' it would do nothing"):
        Channel.create("fsyncs", journal=str(journal), fsync=fsync, fsync_interval=1.0)
    assert not journal.exists()
