"""The broker's descriptor budget (docs/security.md): it raises its soft descriptor limit, serves
at most ``max_clients`` connections and refuses the others with a log line, and never aborts
(libzmq's ipc listener asserts on EMFILE) — 2,000 peers against a broker held at 1,024
descriptors."""

from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys
import threading

import pytest
from conftest import pid_alive, wait_until
from zchannel.broker import Channel, ChannelNotFound
from zchannel.broker.server.admission import client_budget

pytestmark = pytest.mark.timeout(240)

_FLOOD = """
import sys, zmq
n, address = int(sys.argv[1]), sys.argv[2]
ctx = zmq.Context()
socks = []
for _ in range(n):
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(address)
    socks.append(s)
print("connecting", flush=True)
sys.stdin.readline()
for s in socks:
    s.close(0)
ctx.term()
print("closed", flush=True)
"""


class _Broker:
    """``zchannel broker`` with its descriptor limit set by ``limits`` (soft, hard) before it
    starts; its stderr collected by a thread (``lines``), which notifies ``changed`` at each line."""

    def __init__(self, args: list[str], limits: tuple[int, int]) -> None:
        def set_limits() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zchannel.cli.main", "broker", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=set_limits)
        line = self.proc.stdout.readline()
        assert line.startswith("ready "), self.proc.communicate(timeout=10)
        self.address = line.split()[1]
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    def said(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def wait_said(self, text: str, timeout: float = 60) -> bool:
        """Whether the broker writes a line holding ``text`` within ``timeout`` seconds."""
        with self.changed:
            return self.changed.wait_for(lambda: self.said(text), timeout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        rc = self.proc.wait(timeout=60)
        self.reader.join(10)
        return rc


@pytest.fixture
def brokers():
    started: list[_Broker] = []

    def start(*args: str, limits: tuple[int, int] = (1024, 1024)) -> _Broker:
        broker = _Broker(list(args), limits)
        started.append(broker)
        return broker

    yield start
    for broker in started:
        if broker.proc.poll() is None:
            broker.proc.kill()
            broker.proc.wait()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_broker_at_1024_descriptors_survives_2000_peers(transport, brokers, workers):
    args = ["crowded"] + (["--address", "tcp://127.0.0.1:0"] if transport == "tcp" else [])
    broker = brokers(*args, limits=(1024, 1024))  # hard 1024 too: it cannot raise it
    floods = [workers.start(_FLOOD, "500", broker.address) for _ in range(4)]  # 2,000 peers
    for proc in floods:
        workers.wait_line(proc, "connecting")
    # over tcp the broker accepts and refuses the peers past its budget; over ipc it first
    # points the path at a stand-in (the gate), so only peers already in its accept backlog
    # when the gate shut are refused: none when the broker kept up with the connects
    said = "refused a connection" if transport == "tcp" else "refuses new connections"
    assert broker.wait_said(said, 60), "".join(broker.lines)
    assert broker.proc.poll() is None, "".join(broker.lines)
    for proc in floods:
        workers.send(proc)
        workers.wait_line(proc, "closed", timeout=60)
    assert broker.proc.poll() is None, "".join(broker.lines)
    # the peers are gone: a well-behaved client is served
    ch = Channel.connect(broker.address, timeout=30)
    ch.put("served")
    assert ch.get(timeout=10) == "served"
    stats = ch.stats()
    assert stats["max_clients"] == 768
    if transport == "tcp":  # over ipc only peers backlogged when the gate shut are refused
        assert stats["refused_connections"] > 0
    assert wait_until(lambda: ch.stats()["connections"] <= 2, 30)
    ch.close()
    assert broker.stop() == 0, "".join(broker.lines)
    # each refusal is logged naming the budget and the limit it came from; over ipc a run
    # whose gate shut before any peer was backlogged refuses none, and then logs none
    refused = stats["refused_connections"]
    assert broker.said("max_clients 768 (descriptor limit 1024)") == (refused > 0), refused
    if transport == "ipc":  # the path named a stand-in while the budget was used up
        assert broker.said("refuses new connections: max_clients (768)")
        assert broker.said("accepts connections again")


_STREAM = """
import sys, time
from zchannel.broker import Channel
ch = Channel.connect(sys.argv[1], timeout=30)
print("ready", flush=True)
n = 0
while not sys.stdin.readline().strip():
    works = [ch.put(list(range(8)), async_op=True) for _ in range(32)]
    for w in works:
        w.wait(timeout=60)
    while ch.qsize() > 1000:
        ch.get_batch(512, timeout=10)
    n += 32
    print(n, flush=True)
"""


@pytest.mark.slow
def test_a_busy_broker_survives_4000_peers(brokers, workers):
    """The same while the broker decodes a stream (a collector): its guard thread competes for
    the interpreter with a busy loop."""
    broker = brokers("busy", "--collector", "flatten_batch", limits=(1024, 1024))
    stream = workers.start(_STREAM, broker.address)
    workers.wait_line(stream, "ready")
    floods = [workers.start(_FLOOD, "500", broker.address) for _ in range(8)]
    for proc in floods:
        workers.wait_line(proc, "connecting")
    # an ipc broker shuts its gate at the budget (see the test above): refusals only for the
    # peers already in its accept backlog
    assert broker.wait_said("refuses new connections", 60), "".join(broker.lines)
    for proc in floods:
        workers.send(proc)
        workers.wait_line(proc, "closed", timeout=60)
    assert broker.proc.poll() is None, "".join(broker.lines)
    workers.send(stream)  # one more round: the stream still flows
    workers.wait_line(stream, timeout=60)
    workers.send(stream, "stop")
    assert broker.proc.poll() is None, "".join(broker.lines)
    assert broker.stop() == 0, "".join(broker.lines)


def test_max_clients_is_enforced_and_the_soft_limit_raised(brokers, workers):
    broker = brokers("few", "--address", "tcp://127.0.0.1:0", "--max-clients", "40",
                     limits=(512, 4096))
    with open(f"/proc/{broker.proc.pid}/limits") as f:
        line = next(row for row in f if row.startswith("Max open files"))
    assert line.split()[3:5] == ["4096", "4096"], line  # soft raised to hard
    # a client connected before the flood holds one of the 40 connections and reads the
    # broker's counter while the other 39 are taken
    ch = Channel.connect(broker.address, timeout=30)
    flood = workers.start(_FLOOD, "200", broker.address)
    workers.wait_line(flood, "connecting")
    assert broker.wait_said("refused a connection", 60), "".join(broker.lines)
    assert broker.said("max_clients 40 (descriptor limit 4096)")
    # 161 peers are beyond the budget; a refused peer reconnects and is refused again, so the
    # count grows while the flood lasts (the log shows 5 refusals per 10 s, rate-limited):
    # the flood ends only once the counter says 50
    assert wait_until(lambda: ch.stats()["refused_connections"] >= 50, 60), ch.stats()
    workers.send(flood)
    workers.wait_line(flood, "closed", timeout=60)
    stats = ch.stats()
    assert stats["max_clients"] == 40 and stats["refused_connections"] >= 50, stats
    ch.close()
    assert broker.stop() == 0


def test_direct_links_wait_for_room(brokers):
    broker = brokers("links", "--max-clients", "2", limits=(4096, 4096))
    first = Channel.connect(broker.address, identity="w:0")
    second = Channel.connect(broker.address, identity="w:1")
    first.put(1)
    second.put(2)
    assert first._conn.direct and second._conn.direct
    with pytest.raises(ChannelNotFound):  # its link waits in the listener's backlog
        Channel.connect(broker.address, identity="w:2", timeout=3).put(3)
    first.close()  # room: the waiting link is accepted
    third = Channel.connect(broker.address, identity="w:3", timeout=30)
    third.put(3)
    assert third.qsize() == 3
    assert broker.said("direct links wait: max_clients (2) connections held")
    second.close()
    third.close()
    assert pid_alive(broker.proc.pid) and broker.stop() == 0


def test_client_budget_arithmetic(caplog):
    assert client_budget(1024, 0) == 768  # a quarter kept back
    assert client_budget(256, 0) == 128  # at least 128 kept back
    assert client_budget(1 << 20, 0) == (1 << 20) - 4096  # at most 4096
    assert client_budget(1024, 100) == 100
    # read the warning off the broker's logger itself: earlier tests in this process may have
    # set up zchannel's logging (no propagation) or disabled loggers (logging.config)
    logger = logging.getLogger("zchannel.broker")
    saved = logger.disabled, logger.level
    logger.disabled = False
    logger.setLevel(logging.WARNING)
    logger.addHandler(caplog.handler)
    try:
        assert client_budget(1024, 5000) == 768
    finally:
        logger.removeHandler(caplog.handler)
        logger.disabled, logger.level = saved
    assert "max_clients 5000 lowered to 768" in caplog.text
    assert client_budget(100, 0) == 1
    assert os.sysconf("SC_OPEN_MAX") > 0
