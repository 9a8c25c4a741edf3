"""Retry-safe puts (docs/guarantees.md): a put retried by the same handle is stored at most once,
whether the broker stopped (SIGSTOP) before it read the put or stored it and its
acknowledgement was lost; the broker's window of stored sequences per producer
(``broker/server/producers.py``), over the wire and in itself."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import msgpack
import numpy as np
import pytest
import zmq
from cluster_util import Replicas, free_tcp_ports, write_cluster
from conftest import drain, until_available, wait_until
from zchannel.broker import BrokerUnavailable, Channel
from zchannel.broker.connection import waiting
from zchannel.broker.core.state import Parked
from zchannel.broker.handle import retries
from zchannel.broker.server.producers import (
    DUPLICATE,
    NEW,
    TOO_OLD,
    WAITING,
    WINDOW,
    Producers,
    ProducerWindow,
)
from zchannel.broker.wire import codec
from zchannel.broker.wire.protocol import unpack_requests

pytestmark = pytest.mark.timeout(180)


def _retry_until_stored(ch, item, **kw) -> None:
    """Put ``item`` until it is acknowledged (what a user's retry loop does)."""
    until_available(ch, lambda: ch.put(item, **kw))


# -- the user's retry after the broker stopped answering ------------------------------------------


class Interrupted(Exception):
    """What the test's signal handler raises (as Ctrl-C raises ``KeyboardInterrupt``)."""


def _interrupt_when_waiting(producer, broker_pid: int) -> threading.Thread:
    """A thread that, once ``producer`` has a request in flight (the broker is stopped, so
    it stays there), interrupts the main thread with SIGUSR1 and lets the broker run again."""
    def interrupt() -> None:
        assert wait_until(lambda: producer._share.conn._requests.pending, 30, interval=0.005)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(broker_pid, signal.SIGCONT)

    return threading.Thread(target=interrupt)


@pytest.mark.parametrize("phase", ["reading replies", "waiting"])
def test_an_interrupted_put_is_in_doubt_and_its_retry_is_stored_once(channels, monkeypatch,
                                                                     phase):
    """A blocking put interrupted while it waits for its answer (a signal handler raising,
    as Ctrl-C does) may be stored: its retry on the same handle is recognised, as a put
    that failed without an answer is.  Interrupted while the caller itself reads the replies
    (``Waiting.call``), its shared-memory slots stay the queued request's: a later put does
    not take them while the broker holds the item."""
    monkeypatch.setattr(waiting, "DRIVE_S", 30.0 if phase == "reading replies" else 0.0)

    def raise_interrupted(signum, frame):
        raise Interrupted()

    previous = signal.signal(signal.SIGUSR1, raise_interrupted)
    ch = Channel.create("interrupted", shm_threshold=4096)
    channels.append(ch)
    producer = Channel.connect(ch.address, identity="p:0")
    try:
        pid = ch.stats()["pid"]
        first = np.full(1 << 16, 1, np.uint8)
        producer.put(first, key="w")
        assert np.array_equal(ch.get(key="w", timeout=10), first)
        os.kill(pid, signal.SIGSTOP)
        thread = _interrupt_when_waiting(producer, pid)
        thread.start()
        try:
            with pytest.raises(Interrupted):
                producer.put(first, key="k", timeout=30)
        finally:
            thread.join()
            os.kill(pid, signal.SIGCONT)
        producer.put(first, key="k", timeout=30)  # the retry
        for _ in range(4):  # later puts take slots: never the one the broker holds
            producer.put(np.full(1 << 16, 2, np.uint8), key="later", timeout=30)
        assert ch.qsize("k") == 1 and ch.stats()["duplicate_puts"] == 1
        assert np.array_equal(ch.get(key="k", timeout=10), first)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        producer.close()


@pytest.mark.parametrize("address", [None, "tcp://127.0.0.1:0"], ids=["ipc", "tcp"])
def test_a_put_retried_after_a_sigstop_is_stored_once(address, channels):
    ch = Channel.create("retry", address=address)
    channels.append(ch)
    pid = ch.stats()["pid"]
    ch.put("warm")
    assert ch.get(timeout=10) == "warm"
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(BrokerUnavailable):
            ch.put("A")  # sent; the broker reads it only when it runs again
    finally:
        os.kill(pid, signal.SIGCONT)
    _retry_until_stored(ch, "A")
    stats = ch.stats()
    assert stats["keys"]["default_queue"]["depth"] == 1 and stats["duplicate_puts"] == 1
    ch.put("A")  # the retry was matched once: an equal put now is a new put
    ch.put("B")
    assert drain(ch) == ["A", "A", "B"]


@pytest.mark.parametrize("address", [None, "tcp://127.0.0.1:0"], ids=["ipc", "tcp"])
def test_gets_failed_by_a_broker_stall_get_no_items_after_it(address, channels, run_dir):
    """A broker stopped past the expiry (SIGSTOP, a long GC or swap pause) while gets are
    parked: the client fails them with ``BrokerUnavailable``; the broker, running again,
    withdraws them before it reads anything, so the items another process puts at once go to
    the next gets, not to gets nobody waits for any more."""
    ch = Channel.create("stalled-gets", address=address)
    channels.append(ch)
    pid = ch.stats()["pid"]
    parked = [ch.get(key="g", async_op=True, timeout=120) for _ in range(5)]
    parked.append(ch.get_batch(2, key="g", async_op=True, timeout=120))
    wait_until(lambda: ch.stats()["keys"].get("g", {}).get("getters") == 6, timeout=60)
    os.kill(pid, signal.SIGSTOP)
    try:
        for work in parked:
            with pytest.raises(BrokerUnavailable):
                work.wait(60)
    finally:
        os.kill(pid, signal.SIGCONT)
    subprocess.run([sys.executable, "-c", "import sys; from zchannel.broker import Channel; "
                    "c = Channel.connect(sys.argv[1]); [c.put(i, 1, key='g') for i in range(8)]",
                    ch.address], check=True, timeout=120, env=dict(os.environ, ZCHANNEL_RUN_DIR=run_dir))
    got = [until_available(ch, lambda: ch.get(key="g", timeout=30)) for _ in range(8)]
    assert got == list(range(8))


@pytest.mark.parametrize("address", [None, "tcp://127.0.0.1:0"], ids=["ipc", "tcp"])
def test_puts_sent_during_a_broker_stall_go_to_no_failed_get(address, channels):
    """Puts another handle sent while the broker was stopped wait in its socket beside the
    consumer's new hello; the broker, running again, may read them first: they must not go
    to the gets that consumer was told failed (the broker withdraws those before it reads)."""
    ch = Channel.create("stall-puts", address=address)
    channels.append(ch)
    pid = ch.stats()["pid"]
    producer = Channel.connect(ch.address)
    try:
        producer.put("warm", key="w")
        parked = [ch.get(key="g", async_op=True, timeout=120) for _ in range(4)]
        wait_until(lambda: ch.stats()["keys"].get("g", {}).get("getters") == 4, timeout=60)
        os.kill(pid, signal.SIGSTOP)
        try:
            sent = [producer.put(i, key="g", async_op=True, timeout=120) for i in range(6)]
            for work in parked + sent:
                with pytest.raises(BrokerUnavailable):
                    work.wait(60)
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        producer.close()
    got = [until_available(ch, lambda: ch.get(key="g", timeout=30)) for _ in range(6)]
    assert got == list(range(6))


def test_async_puts_in_doubt_are_each_recognised(channels):
    ch = Channel.create("retry_async")
    channels.append(ch)
    pid = ch.stats()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        works = [ch.put(i, key="k", async_op=True) for i in range(20)]
        failed = []
        for i, work in enumerate(works):
            with pytest.raises(BrokerUnavailable):
                work.wait(timeout=30)
            failed.append(i)
    finally:
        os.kill(pid, signal.SIGCONT)
    for i in reversed(failed):  # retried out of order: the window holds more than the last
        _retry_until_stored(ch, i, key="k")
    assert sorted(drain(ch, "k")) == list(range(20))
    assert ch.stats()["duplicate_puts"] == 20


def test_only_the_same_handle_retries(channels):
    """Puts in doubt belong to their handle: another handle's equal put (over the same shared
    connection) is a new put."""
    ch = Channel.create("retry_handles")
    channels.append(ch)
    other = Channel.connect("retry_handles")
    other.put("warm")
    assert ch._conn is other._conn  # one connection per process and broker
    pid = ch.stats()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(BrokerUnavailable):
            ch.put("A")
    finally:
        os.kill(pid, signal.SIGCONT)
    _retry_until_stored(other, "A")
    assert drain(ch) == ["warm", "A", "A"]
    other.close()


def test_a_put_in_doubt_is_forgotten_after_a_while(channels, monkeypatch):
    ch = Channel.create("retry_expiry")
    channels.append(ch)
    pid = ch.stats()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(BrokerUnavailable):
            ch.put("A")
    finally:
        os.kill(pid, signal.SIGCONT)
    monkeypatch.setattr(retries, "IN_DOUBT_S", 0.0)
    _retry_until_stored(ch, "A")  # too late to be taken as the retry: a new put
    assert drain(ch) == ["A", "A"]


class _Proxy:
    """A loopback TCP relay in front of a broker that can hold back everything the broker sends
    (``hold``) and then cut both connections, dropping what it held (``cut``): the broker
    stored a put, and its acknowledgement never reaches the client."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.holding = threading.Event()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock = threading.Lock()
        self.stopped = False
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            broker = socket.create_connection(self.target)
            with self.lock:
                self.pairs.append((client, broker))
            for src, dst, held in ((client, broker, False), (broker, client, True)):
                t = threading.Thread(target=self._pump, args=(src, dst, held), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, held: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if held and self.holding.is_set():
                    continue  # read and kept from the client: dropped at the cut
                dst.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for sock in pair:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
        self.holding.clear()

    def close(self) -> None:
        self.stopped = True
        self.listener.close()
        self.cut()


def test_a_put_whose_acknowledgement_was_lost_is_not_stored_again(channels):
    ch = Channel.create("retry_ack", address="tcp://127.0.0.1:0")
    channels.append(ch)
    host, port = ch.address[len("tcp://"):].rsplit(":", 1)
    proxy = _Proxy((host, int(port)))
    try:
        via = Channel.connect(f"tcp://127.0.0.1:{proxy.port}", timeout=20)
        via.put("warm")
        proxy.holding.set()  # from here on nothing the broker sends reaches ``via``
        with pytest.raises(BrokerUnavailable):
            via.put("B")  # stored by the broker; its acknowledgement is held, then dropped
        assert ch.qsize() == 2  # the broker did store it
        proxy.cut()  # the client reconnects through the relay and says hello again
        _retry_until_stored(via, "B")
        assert drain(ch) == ["warm", "B"]
        assert ch.stats()["duplicate_puts"] == 1
        via.close()
    finally:
        proxy.close()


def test_a_lost_acknowledgement_and_a_restart_on_the_journal_store_once(channels, tmp_path):
    """A durable channel journals each put's producer and sequence with its item: the broker
    stored a put, its acknowledgement was lost, the broker was SIGKILLed and started again on
    its journal (by the creating process) — the retry is acknowledged, not stored again."""
    ch = Channel.create("retry_durable", address="tcp://127.0.0.1:0", journal=tmp_path / "j")
    channels.append(ch)
    host, port = ch.address[len("tcp://"):].rsplit(":", 1)
    proxy = _Proxy((host, int(port)))
    try:
        via = Channel.connect(f"tcp://127.0.0.1:{proxy.port}", timeout=20)
        via.put("warm")
        proxy.holding.set()
        with pytest.raises(BrokerUnavailable):
            via.put("B")  # stored and journaled; its acknowledgement is held, then dropped
        pid = ch.stats()["pid"]
        assert ch.qsize() == 2
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: _restarted(ch, pid), timeout=60)
        proxy.cut()  # the client reconnects through the relay to the new broker
        _retry_until_stored(via, "B")
        assert drain(ch) == ["warm", "B"]
        stats = ch.stats()
        assert stats["duplicate_puts"] == 1 and stats["journal"]["recovered_items"] == 2
        via.close()
    finally:
        proxy.close()


def _restarted(ch, pid: int) -> bool:
    try:
        return ch.stats()["pid"] != pid
    except BrokerUnavailable:
        return False


_PRODUCER = """
import select, sys
from zchannel.broker import BrokerUnavailable, Channel
ch = Channel.connect(sys.argv[1], timeout=30)
window, most = 64, 20000
print("ready", flush=True)
inflight, retried, doubted = {}, 0, None  # doubted: the first put found in doubt
def await_broker():  # the broker answered the connection's hello again
    conn = ch._conn
    if conn is not None and conn.state != "closed":
        conn.wait_up(60)
def settle(seq, work):
    global retried, doubted
    try:
        work.wait(timeout=60)
    except BrokerUnavailable:  # in doubt: retried until acknowledged, as a user would
        if doubted is None:
            doubted = seq
            print("in doubt", flush=True)
        while True:
            try:
                ch.put(seq, key="s")
                retried += 1
                return
            except BrokerUnavailable:
                await_broker()
def told_to_stop():
    return bool(select.select([sys.stdin], [], [], 0)[0])
seq = 0
while seq < most and not told_to_stop():  # a window of puts in flight, paced by their acks
    inflight[seq] = ch.put(seq, key="s", async_op=True)
    seq += 1
    if len(inflight) >= window:
        first = min(inflight)
        settle(first, inflight.pop(first))
        if first == 300:
            print("at 300", flush=True)
        if doubted is not None and first == doubted + window:
            print("serving again", flush=True)
for s in sorted(inflight):
    settle(s, inflight[s])
print("done", seq, retried, flush=True)
"""


def test_a_stream_retried_across_a_broker_stop_stores_every_item_once(channels, workers):
    """The stream that once stored one item twice: a producer keeps a window of puts in flight
    (paced by their acknowledgements) and retries what failed while the broker was stopped
    (until the producer found puts in doubt: the broker's heartbeat expiry, 3 s by default);
    afterwards every sequence is in the queue exactly once."""
    ch = Channel.create("stream", maxsize=0)
    channels.append(ch)
    pid = ch.stats()["pid"]
    producer = workers.start(_PRODUCER, ch.address)
    workers.wait_line(producer, "ready")
    workers.wait_line(producer, "at 300", timeout=60)
    os.kill(pid, signal.SIGSTOP)
    try:  # stopped until the producer's puts in flight failed: it retries them
        workers.wait_line(producer, "in doubt", timeout=120)
    finally:
        os.kill(pid, signal.SIGCONT)
    workers.wait_line(producer, "serving again", timeout=120)  # a window acknowledged since
    workers.send(producer, "stop")
    line = workers.wait_line(producer, timeout=120)
    assert line.startswith("done"), line
    n, retried = (int(x) for x in line.split()[1:])
    assert retried > 0  # some puts were in doubt and retried
    # this process's handle went silent too while the broker was stopped: its first call after
    # may meet the broker's ``expired`` notice (BrokerUnavailable), which a user retries
    until_available(ch, lambda: ch.qsize("s"))
    got = drain(ch, "s")
    assert sorted(got) == list(range(n)), (n, len(got), len(set(got)))
    assert ch.stats()["duplicate_puts"] >= 1


def test_distributed_puts_are_retry_safe_per_replica(run_dir, monkeypatch):
    """A distributed handle's puts go to one replica per key, each over its own connection (its
    own producer id): a put retried after its replica stopped is stored once."""
    ports = free_tcp_ports(3)
    nodes = ("node-a", "node-b", "node-c")
    path = write_cluster(run_dir, nodes, [f"tcp://127.0.0.1:{p}" for p in ports])
    reps = Replicas()
    try:
        reps.start("dist", path, range(3))
        monkeypatch.setenv("ZCHANNEL_NODE", "node-b")
        ch = Channel.connect(f"tcp://127.0.0.1:{ports[0]}")
        ch.put("warm", key="kb")
        index = ch.replica_of("kb")
        assert index == 1
        producers = {ch._sub(i)._conn.producer for i in range(3) if ch._sub(i)._conn}
        assert len(producers) == len([i for i in range(3) if ch._sub(i)._conn])
        os.kill(reps.procs[index].pid, signal.SIGSTOP)
        try:
            with pytest.raises(BrokerUnavailable):
                ch.put("A", key="kb")
        finally:
            os.kill(reps.procs[index].pid, signal.SIGCONT)
        _retry_until_stored(ch, "A", key="kb")
        assert ch.qsize("kb") == 2
        assert ch._sub(index).stats()["duplicate_puts"] == 1
        assert [ch.get("kb", timeout=10) for _ in range(2)] == ["warm", "A"]
        ch.close()
    finally:
        reps.stop_all()


# -- the wire: producer ids and sequences ------------------------------------------------------------


@pytest.fixture
def raw(channels):
    """``raw(name, maxsize)`` -> ``(send, channel)``: ``send(records)`` sends one message from
    a raw DEALER and returns the broker's reply records by id (``expect`` of them)."""
    socks = []

    def make(name: str, maxsize: int = 0):
        ch = Channel.create(name, maxsize=maxsize)
        channels.append(ch)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(ch.address)
        socks.append(sock)

        def send(records: list, expect: int | None = None) -> dict:
            sock.send(msgpack.packb(records))
            replies: dict = {}
            want = len(records) if expect is None else expect
            while len(replies) < want:
                assert sock.poll(20_000), "the broker did not answer"
                for rec in msgpack.unpackb(sock.recv()):
                    if rec.get("id") is not None:
                        replies[rec["id"]] = rec
            return replies

        return send, ch

    yield make
    for sock in socks:
        sock.close()


def _put(rid: int, item: str, seq: int | None = None, **fields) -> dict:
    body, _ = codec.encode(item)
    rec = {"op": "put", "id": rid, "b": body, **fields}
    if seq is not None:
        rec["sq"] = seq
    return rec


HELLO = {"op": "hello", "id": 1, "v": 1, "pr": b"p" * 16}


def test_the_broker_stores_each_sequence_of_a_producer_once(raw):
    send, ch = raw("raw_retry")
    replies = send([HELLO, _put(5, "x5", k="a"), _put(6, "x6", k="a"), _put(7, "x7", k="b")])
    assert all("e" not in r for r in replies.values())
    # 5 again, under a new request id: acknowledged, not stored; 9 repeats 3 (never stored)
    replies = send([_put(8, "x5", seq=5, k="a"), _put(9, "x3", seq=3, k="a")])
    assert "e" not in replies[8] and "e" not in replies[9]
    assert ch.qsize("a") == 3 and ch.stats()["duplicate_puts"] == 1  # x5, x6, x3
    replies = send([_put(7, "again", k="b")])  # a reused request id is a sequence too
    assert "e" not in replies[7] and ch.qsize("b") == 1
    far = WINDOW + 100
    send([_put(far, "far", k="c")])
    replies = send([_put(far + 1, "old", seq=50, k="c")])
    assert replies[far + 1]["e"][0] == "ValueError" and "older than" in replies[far + 1]["e"][1]
    assert ch.qsize("c") == 1


def test_a_retry_of_a_put_waiting_for_room_is_refused_until_it_ends(raw):
    send, ch = raw("raw_wait", maxsize=1)
    send([HELLO, _put(2, "first", k="c")])
    send([_put(3, "waits", k="c")], expect=0)  # the queue is full: it waits
    replies = send([_put(4, "waits", seq=3, k="c")])
    assert replies[4]["e"][0] == "ValueError" and "still waits" in replies[4]["e"][1]
    assert ch.get("c", timeout=10) == "first"  # room: the waiting put is admitted
    assert wait_until(lambda: ch.qsize("c") == 1)
    replies = send([_put(5, "waits", seq=3, k="c")], expect=2)  # 3's late reply, and 5's
    assert "e" not in replies[3] and "e" not in replies[5]
    assert ch.qsize("c") == 1 and ch.get("c", timeout=10) == "waits"


def test_a_client_without_a_producer_id_has_no_deduplication(raw):
    send, ch = raw("raw_plain")
    send([{"op": "hello", "id": 1, "v": 1}, _put(5, "x", k="a")])
    ch.get("a", timeout=10)
    send([_put(5, "x", k="a")])
    assert ch.qsize("a") == 1 and ch.stats()["duplicate_puts"] == 0


def test_a_malformed_producer_id_is_refused():
    for bad in (b"short", "text" * 4, 7, b"x" * 65):
        records = unpack_requests(msgpack.packb([{"op": "hello", "id": 1, "pr": bad}]), 0)
        assert type(records[0]).__name__ == "BadRecord", bad
    for bad in (-1, "1", 1.5):
        records = unpack_requests(msgpack.packb([{"op": "put", "id": 2, "sq": bad}]), 0)
        assert type(records[0]).__name__ == "BadRecord", bad
    ok = unpack_requests(msgpack.packb([{"op": "put", "id": 2, "sq": 1}]), 0)[0]
    assert ok.sequence() == 1 and unpack_requests(
        msgpack.packb([{"op": "put", "id": 2}]), 0)[0].sequence() == 2


# -- the window itself ---------------------------------------------------------------------------------


def test_producer_window_marks_and_forgets():
    w = ProducerWindow(b"p" * 16)
    assert [w.begin(s) for s in (1, 2, 3)] == [NEW] * 3
    assert w.begin(2) == DUPLICATE
    assert w.begin(10) == NEW  # 4..9 never seen
    assert [w.begin(s) for s in (4, 9)] == [NEW, NEW] and w.begin(4) == DUPLICATE
    w.unmark(9)  # not stored after all
    assert w.begin(9) == NEW
    # a jump of less than the window keeps what is still inside it, wrapping around
    assert w.begin(WINDOW + 5) == NEW
    assert w.begin(5) == TOO_OLD and w.begin(6) == NEW and w.begin(10) == DUPLICATE
    assert w.begin(7) == NEW  # its slot held 7, was cleared by the jump: never stored
    assert w.begin(3 * WINDOW) == NEW and w.begin(2 * WINDOW + 1) == NEW
    assert w.begin(2 * WINDOW) == TOO_OLD


def test_producer_window_waiting_puts():
    w = ProducerWindow(b"p" * 16)
    req = Parked(client=None, rid=1, kind="put", key="k", deadline=None)
    assert w.begin(1) == NEW
    w.wait(1, req)
    assert w.begin(1) == WAITING
    req.on_end(False)  # timed out: not stored
    assert w.begin(1) == NEW
    req2 = Parked(client=None, rid=2, kind="put", key="k", deadline=None)
    w.begin(2)
    w.wait(2, req2)
    req2.on_end(True)
    assert w.begin(2) == DUPLICATE


def test_producers_expire_after_their_grace_and_stay_bounded():
    class C:
        producer = None

    table = Producers(grace=5.0, limit=3)
    a, b = C(), C()
    table.attach(a, b"a" * 16)
    table.attach(b, b"a" * 16)  # the same producer reconnected
    assert a.producer is b.producer and a.producer.sessions == 2
    table.detach(a, now=0.0)
    table.detach(b, now=1.0)
    table.sweep(now=5.0)
    assert b"a" * 16 in table.windows  # within its grace
    table.sweep(now=6.5)
    assert b"a" * 16 not in table.windows
    clients = [C() for _ in range(5)]
    for i, c in enumerate(clients):
        table.attach(c, bytes([i]) * 16)
        table.detach(c, now=float(i))
    assert len(table.windows) == 3 and bytes([0]) * 16 not in table.windows
    table.attach(C(), 7)  # not bytes: no window
    assert len(table.windows) == 3


def test_a_producer_back_after_its_window_was_forgotten_cannot_store_a_sequence_again():
    """A window forgotten (its producer gone past the grace, or evicted for room) leaves its
    highest sequence: the producer's late retry of a put it had made is refused (``TOO_OLD``:
    a ``ValueError``), not stored a second time; its new puts go on."""
    class C:
        producer = None

    table = Producers(grace=1.0, limit=2)
    first = C()
    table.attach(first, b"p" * 16)
    assert [first.producer.begin(s) for s in (1, 2, 3)] == [NEW] * 3
    table.detach(first, now=0.0)
    table.sweep(now=2.0)
    assert b"p" * 16 not in table.windows
    back = C()
    table.attach(back, b"p" * 16)
    assert [back.producer.begin(s) for s in (1, 3)] == [TOO_OLD, TOO_OLD]
    assert back.producer.begin(4) == NEW and back.producer.begin(4) == DUPLICATE
    table.detach(back, now=3.0)
    others = [C() for _ in range(3)]  # evicting for room forgets the same way
    for i, c in enumerate(others):
        table.attach(c, bytes([i]) * 16)
    assert b"p" * 16 not in table.windows
    again = C()
    table.attach(again, b"p" * 16)
    assert again.producer.begin(4) == TOO_OLD and again.producer.begin(5) == NEW
    assert len(table.forgotten) <= 2


def test_evicting_for_room_takes_the_first_departed_window_without_a_scan():
    """At the limit, a new producer's window pushes out the departed window that expires first
    (a reconnected one is live again and stays), kept in expiry order as they depart, so a
    flood of new producer ids costs the broker the same per hello at any table size."""
    class C:
        producer = None

    table = Producers(grace=5.0, limit=4)
    clients = {i: C() for i in range(4)}
    for i, c in clients.items():
        table.attach(c, bytes([i]) * 16)
    for t, i in enumerate((2, 0, 3, 1)):  # departure order: 2 expires first, then 0, 3, 1
        table.detach(clients[i], now=float(t))
    assert list(table.departed) == [bytes([i]) * 16 for i in (2, 0, 3, 1)]
    table.attach(C(), bytes([0]) * 16)  # producer 0 back: live, no longer departed
    assert list(table.departed) == [bytes([i]) * 16 for i in (2, 3, 1)]
    for n in range(10, 13):
        table.attach(C(), bytes([n]) * 16)
    assert set(table.windows) == {bytes([i]) * 16 for i in (0, 10, 11, 12)}
    assert table.departed == {}
    assert table.windows[bytes([0]) * 16].sessions == 1
    table.sweep(now=1e9)  # nothing departed: nothing forgotten
    assert len(table.windows) == 4
