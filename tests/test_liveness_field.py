"""A client's judgement of its broker's liveness, with real broker processes.

- A handle idle while its broker was killed and started again at the same address: its next
  call works, whether its connection is still up (a direct link broken while nobody used it)
  or already down (its I/O thread found nothing listening and has not tried again yet); with
  nothing listening, it fails at once.
- A message that takes longer to cross a ZeroMQ link than the heartbeat expiry: neither side
  judges the other dead while it is arriving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import zmq
from conftest import exited
from zchannel.broker import BrokerUnavailable, Channel
from zchannel.broker.connection.line import DOWN, UP
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, pack_header

# A long heartbeat interval: an idle connection's I/O thread turns every half interval (15 s),
# so what a call finds is what the test left (the call, not that thread, does the work).
SLOW_HEARTBEATS = "[channel]\nheartbeat_interval = 30.0\n"


class Restartable:
    """``zchannel broker idle`` processes with ``SLOW_HEARTBEATS`` at one ipc address:
    ``start()`` one (its pid), ``kill()`` the running one (SIGKILL, waited for until it is
    gone); ``close()`` kills by PID any still running."""

    def __init__(self, run_dir: str, conf: str) -> None:
        self.address = f"ipc://{run_dir}/idle.sock"
        self.conf = conf
        self.procs: list[subprocess.Popen] = []

    def start(self) -> int:
        proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "idle",
                                 "--address", self.address, "--config", self.conf],
                                stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("ready ")
        return proc.pid

    def kill(self) -> None:
        proc = self.procs[-1]
        proc.send_signal(signal.SIGKILL)
        assert exited(proc.pid)
        proc.wait(timeout=30)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def restartable(run_dir, tmp_path) -> Iterator[Restartable]:
    conf = tmp_path / "slow.toml"
    conf.write_text(SLOW_HEARTBEATS)
    brokers = Restartable(run_dir, str(conf))
    yield brokers
    brokers.close()


def _answered_by(address: str, pid: int) -> None:
    """Wait until the broker ``pid`` answers a new handle at ``address``."""
    probe = Channel.connect(address)
    try:
        assert probe.stats()["pid"] == pid
    finally:
        probe.close()


def _down_after_kill(handle: Channel, restartable: Restartable) -> None:
    """Kill the broker; the handle's next call fails (nothing listens) and leaves its
    connection down."""
    restartable.kill()
    with pytest.raises(BrokerUnavailable):
        handle.qsize()
    assert handle._conn.state == DOWN


def test_a_call_on_a_connection_down_waits_for_the_broker_started_again(restartable):
    """The connection went down (its broker was killed, nothing listened) and a broker serves
    the address again: the next call relinks and says hello at once instead of failing with
    ``BrokerUnavailable`` until the I/O thread's next turn (15 s away here)."""
    restartable.start()
    idle = Channel.connect(restartable.address, identity="w:0")
    try:
        assert idle.qsize() == 0 and idle._conn.direct
        _down_after_kill(idle, restartable)
        pid = restartable.start()
        _answered_by(restartable.address, pid)
        feeder = Channel.connect(restartable.address)
        try:
            feeder.put("after the restart")
        finally:
            feeder.close()
        assert idle._conn.state == DOWN  # (its I/O thread has not tried again)
        assert idle.get(timeout=30) == "after the restart"
        assert idle._conn.state == UP
        assert idle.stats()["pid"] == pid
    finally:
        idle.close()


def test_a_call_over_a_link_broken_while_idle_goes_to_the_broker_started_again(restartable):
    """The broker was killed and started again while the handle was idle: its connection is
    still up (nobody read the broken link), and its next call, which finds the link broken
    before any of it went out, goes to the new broker behind a new link's hello instead of
    failing as a request in flight."""
    restartable.start()
    idle = Channel.connect(restartable.address, identity="w:0")
    try:
        assert idle.qsize() == 0 and idle._conn.direct
        restartable.kill()
        pid = restartable.start()
        _answered_by(restartable.address, pid)
        assert idle._conn.state == UP  # (nothing noticed the broken link yet)
        assert idle.stats()["pid"] == pid
        idle.put("through the new link")
        assert idle.get(timeout=30) == "through the new link"
    finally:
        idle.close()


def test_a_call_on_a_connection_down_fails_at_once_when_nothing_listens(restartable):
    """With no broker at the address (a killed broker's socket file left behind), a call on a
    connection that is down fails with ``BrokerUnavailable`` naming that, not after waiting
    for a hello."""
    restartable.start()
    idle = Channel.connect(restartable.address, identity="w:0")
    try:
        _down_after_kill(idle, restartable)
        assert os.path.exists(restartable.address[len("ipc://"):])
        with pytest.raises(BrokerUnavailable, match="nothing listens"):
            idle.get(timeout=None)
        with pytest.raises(BrokerUnavailable, match="nothing listens"):
            idle.put_nowait(1)
    finally:
        idle.close()


# -- large messages over ZeroMQ ------------------------------------------------------------------

# A heartbeat expiry of 0.15 s: an item of LARGE_MIB takes longer to cross tcp loopback.
SHORT_HEARTBEATS = "[channel]\nheartbeat_interval = 0.05\nliveness = 3\n"
LARGE_MIB = 384
DEADLINE_S = 60.0


@pytest.fixture
def short_heartbeat_broker(broker_procs, tmp_path) -> str:
    """A ``zchannel broker`` on tcp loopback with ``SHORT_HEARTBEATS``: its address."""
    conf = tmp_path / "short.toml"
    conf.write_text(SHORT_HEARTBEATS)
    _, address = broker_procs("large", "--address", "tcp://127.0.0.1:0", "--config", str(conf))
    return address


def test_an_item_longer_to_cross_than_the_expiry_is_put_and_got_over_zeromq(
        short_heartbeat_broker):
    """Over ZeroMQ (no shared memory) a put and a get whose message takes longer to cross than
    the heartbeat expiry: each side announces its large message, and neither the broker (the
    client's heartbeats queue behind the put) nor the client (the broker's behind the reply)
    takes the other for dead meanwhile.  Each goes through at the first try, and the client
    stays registered throughout."""
    ch = Channel.connect(short_heartbeat_broker, shm=False)
    try:
        assert not ch._conn.direct and ch._conn.hb * ch._conn.liveness == pytest.approx(0.15)
        item = np.arange(LARGE_MIB << 18, dtype=np.int32)  # LARGE_MIB MiB
        for _ in range(2):
            ch.put(item, key="large", timeout=DEADLINE_S)
            got = ch.get(key="large", timeout=DEADLINE_S)
            assert got.nbytes == item.nbytes and np.array_equal(got, item)
            del got
        assert ch.qsize("large") == 0
        assert ch._conn.state == UP
        assert ch.stats()["clients"] == 1
    finally:
        ch.close()


def _silent_client(address: str, records: list[dict]) -> zmq.Socket:
    """A raw DEALER that says hello, sends ``records`` and then nothing."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send_multipart([pack_header([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION}])])
    assert sock.poll(int(DEADLINE_S * 1000)), "no answer to the hello"
    sock.recv_multipart()
    if records:
        sock.send_multipart([pack_header(records)])
    return sock


def _expired(sock: zmq.Socket, wait_s: float) -> bool:
    """Whether ``sock`` is told ``expired`` within ``wait_s`` seconds (heartbeats skipped)."""
    end = time.monotonic() + wait_s
    while sock.poll(max(0, int((end - time.monotonic()) * 1000))):
        header, *_ = sock.recv_multipart()
        if any(rec.get("op") == "expired" for rec in msgpack.unpackb(header, raw=False)):
            return True
    return False


def test_a_notice_keeps_a_silent_client_for_its_message_s_crossing_and_no_longer(
        short_heartbeat_broker):
    """A client that announced a message (``hb`` with ``nb``: 16 MiB, 2 s at the floor rate)
    and then fell silent outlives one that said nothing past the expiry, and is expired in its
    turn: a notice never keeps a dead client for longer than its message's crossing."""
    announced = _silent_client(short_heartbeat_broker,
                               [{"op": "hb", "id": 0, "nb": 16 << 20}])
    plain = _silent_client(short_heartbeat_broker, [])
    try:
        assert _expired(plain, DEADLINE_S)
        assert not _expired(announced, 0.0)  # (its allowance runs 2 s past the other's)
        assert _expired(announced, DEADLINE_S)
    finally:
        announced.close()
        plain.close()


class SilentBroker:
    """A ROUTER at ``address`` that answers each client's first hello (heartbeats 0.1 s,
    liveness 3: an expiry of 0.3 s) and then never sends again, but to the client of identity
    ``announcing``: right after its hello's answer, a notice of a 16 MiB message (2 s at the
    floor rate), which never comes."""

    def __init__(self, address: str, announcing: str) -> None:
        self.address, self.announcing = address, announcing
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        greeted: set[bytes] = set()
        info = {"name": "silent", "pid": 1, "hb": 0.1, "liveness": 3, "shm": None}
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, header, *_ = self.sock.recv_multipart()
            for rec in msgpack.unpackb(header, raw=False):
                if rec.get("op") != "hello" or ident in greeted:
                    continue
                greeted.add(ident)
                self.sock.send_multipart([ident, pack_header([{"id": rec["id"], "r": info}])])
                if rec.get("ident") == self.announcing:
                    self.sock.send_multipart([ident, pack_header([{"op": "hb", "nb": 16 << 20}])])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        self.sock.close()


def _down(ch: Channel) -> bool:
    """Wait (at most ``DEADLINE_S``) until ``ch``'s connection is down; whether it is."""
    line = ch._conn._line
    with line.state_cv:
        return line.state_cv.wait_for(lambda: line.state == DOWN, DEADLINE_S)


def test_a_notice_from_the_broker_keeps_it_alive_for_its_message_s_crossing_and_no_longer(
        run_dir):
    """The broker announced a message (16 MiB: 2 s at the floor rate) and then fell silent: the
    client does not take it for dead at the expiry, as it does a broker that announced nothing,
    but once the announced message could have crossed, and says so."""
    broker = SilentBroker(f"ipc://{run_dir}/silent.sock", announcing="slow:0")
    announced = Channel.connect(broker.address, identity="slow:0", shm=False, timeout=30)
    plain = Channel.connect(broker.address, identity="plain:0", shm=False, timeout=30)
    try:
        waiting = announced.get(key="k", timeout=DEADLINE_S, async_op=True)
        assert _down(plain)
        assert announced._conn.state == UP  # (its allowance runs 2 s past the other's expiry)
        assert _down(announced)
        with pytest.raises(BrokerUnavailable, match="a message it announced did not arrive"):
            waiting.wait(DEADLINE_S)
    finally:
        announced.close()
        plain.close()
        broker.close()
