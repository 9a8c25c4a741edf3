"""The same-host direct link (broker/transport/direct.py): real brokers, real Unix sockets, real clients."""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch
import zmq
from conftest import wait_until
from zchannel.broker import BrokerUnavailable, Channel
from zchannel.broker.transport import direct_framing
from zchannel.broker.transport.direct_broker import ADDRESS_PREFIX
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, pack_header

pytestmark = pytest.mark.timeout(60)


def _link_file(ch: Channel) -> str:
    address = ch.stats()["address"]
    assert address.startswith("ipc://")
    path = direct_framing.link_path(address[len("ipc://") :])
    assert path is not None
    return path


class RawLink:
    """A hand-driven direct link: frames messages as clients do, reads with a timeout."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.reader = direct_framing.Reader(1 << 20, 1 << 30)

    def send(self, records: list[dict], frames: list = ()) -> None:
        self.send_raw(b"".join(bytes(p) for p in direct_framing.iovec([pack_header(records), *frames])[0]))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, timeout: float = 10.0) -> list | None:
        """The next message, or None once the broker closed the link."""
        while not self.reader.messages:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            assert ready, "no message from the broker in time"
            if not self.reader.read(self.sock.fileno()):
                return None
        return self.reader.messages.popleft()

    def replies(self, n: int) -> list[tuple[dict, list]]:
        """The next ``n`` reply records with their frames (heartbeats skipped)."""
        out: list[tuple[dict, list]] = []
        while len(out) < n:
            parts = self.recv()
            assert parts is not None, "the broker closed the link"
            pos = 1
            for rec in msgpack.unpackb(parts[0], raw=False):
                nf = rec.get("nf", 0)
                if "id" in rec:
                    out.append((rec, parts[pos : pos + nf]))
                pos += nf
        return out

    def close(self) -> None:
        self.sock.close()


def test_same_host_handles_use_the_direct_link(make_remote):
    ch = make_remote("dl")
    path = _link_file(ch)
    assert os.path.exists(path)
    assert ch._connection().direct
    rng = np.random.default_rng(0)
    # small, inline, one scratch buffer, larger than the scratch buffer, several frames
    values = [
        b"x",
        os.urandom(100 << 10),
        os.urandom(3 << 20),
        [torch.arange(10), rng.random((3, 4)), b"tail"],
        {"a": np.zeros(0, np.float32), "b": torch.ones(2, 2, dtype=torch.bfloat16)},
    ]
    for value in values:
        ch.put(value)
    for value in values:
        got = ch.get(timeout=10)
        if isinstance(value, bytes):
            assert got == value
        elif isinstance(value, list):
            assert torch.equal(got[0], value[0]) and np.array_equal(got[1], value[1])
            assert got[2] == value[2]
        else:
            assert got["a"].shape == (0,) and torch.equal(got["b"], value["b"])
    works = [ch.put(i, async_op=True) for i in range(2000)]
    for w in works:
        w.wait(10)
    assert [ch.get(timeout=10) for _ in range(2000)] == list(range(2000))
    ch.shutdown()
    assert not os.path.exists(path), "the broker removes its link socket when it stops"


def test_zchannel_direct_0_keeps_a_handle_on_zeromq(make_remote, monkeypatch):
    ch = make_remote("dz")
    monkeypatch.setenv("ZCHANNEL_DIRECT", "0")
    other = Channel.connect("dz")
    try:
        assert not other._connection().direct
        assert ch._connection().direct
        other.put(b"over zmq")
        assert ch.get(timeout=10) == b"over zmq"
        ch.put(np.arange(5))
        assert np.array_equal(other.get(timeout=10), np.arange(5))
    finally:
        other.close()


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\x00\x00\x00",  # a message of no parts
        (10**9).to_bytes(4, "little"),  # more parts than the broker's frame limit
        (1).to_bytes(4, "little") + (1 << 40).to_bytes(8, "little"),  # a header beyond its limit
        # a part of 2**50 bytes: once np.empty's MemoryError, which stopped the broker
        struct.pack("<I2Q", 2, 16, 1 << 50) + b"\x91\x80" + b"x" * 14,
        # parts that each could fit but add up to more than the host's memory
        struct.pack("<I4Q", 4, 16, 1 << 45, 1 << 45, 1 << 45) + b"\x91\x80" + b"x" * 14,
    ],
)
def test_a_broken_direct_stream_closes_that_link_only(make_remote, garbage):
    ch = make_remote("db")
    ch.put(1)
    raw = RawLink(_link_file(ch))
    try:
        raw.send_raw(garbage)
        assert raw.recv() is None, "the broker closes a link that breaks the framing"
    finally:
        raw.close()
    assert ch.get(timeout=10) == 1  # and keeps serving everyone else
    ch.put(2)
    assert ch.get(timeout=10) == 2


def test_message_lengths_are_checked_against_max_message_bytes_before_allocating(run_dir):
    """With ``max_message_bytes`` set, a part over it, or parts adding up to more than a
    client ever coalesces into one message (the limit plus 64 MiB), close the link at once:
    nothing is allocated for them and nothing waits for their bytes."""
    limit = 1_000_000
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "dlimit",
                             "--max-message-bytes", str(limit)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready "), line
        ch = Channel.connect(line.split()[1])
        try:
            ch.put(b"x" * 1000)
            path = _link_file(ch)
            header = pack_header([{"op": "hb", "id": 0}])
            for lens in ([len(header), limit + 1], [len(header)] + [limit] * 80):
                raw = RawLink(path)
                try:  # a greeted link: the broker would keep it open, waiting for the bytes
                    raw.send([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION}])
                    raw.send_raw(struct.pack(f"<I{len(lens)}Q", len(lens), *lens) + header)
                    while raw.recv(timeout=5) is not None:  # the hello reply, if it went out
                        pass
                finally:
                    raw.close()
            assert ch.get(timeout=10) == b"x" * 1000  # the broker serves on
            assert proc.poll() is None
        finally:
            ch.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_client_that_does_not_read_does_not_stall_the_broker(make_remote):
    ch = make_remote("ds")
    blobs = [os.urandom(1 << 20) for _ in range(12)]
    for blob in blobs:
        ch.put(blob, key="big")
    raw = RawLink(_link_file(ch))
    try:
        raw.send([{"op": "hello", "id": 1, "ident": None, "v": 1}])
        raw.replies(1)
        # 12 MiB of replies, far more than a socket buffer holds, and nobody reads them yet
        raw.send([{"op": "get", "id": 10 + i, "k": "big"} for i in range(12)])
        for i in range(200):  # the broker goes on serving others meanwhile
            ch.put(i, key="small")
            assert ch.get(key="small", timeout=10) == i
        got = raw.replies(12)
        assert [rec["id"] for rec, _ in got] == [10 + i for i in range(12)]
        from zchannel.broker.wire import codec

        assert [codec.decode(frames[0], frames[1:]) for _, frames in got] == blobs
    finally:
        raw.close()


def test_a_killed_direct_client_gives_its_lease_back_at_once(run_dir, workers, tmp_path):
    """A consumer SIGKILLed while holding a lease: the broker sees its link close and requeues
    the item then, not after the heartbeat expiry (90 s here) or the lease timeout (300 s)."""
    conf = tmp_path / "b.toml"
    conf.write_text("[channel]\nheartbeat_interval = 30.0\nlease_timeout = 300.0\n")
    address = f"ipc://{run_dir}/kill.sock"
    broker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zchannel.cli.main",
            "broker",
            "dk",
            "--address",
            address,
            "--config",
            str(conf),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert broker.stdout.readline().startswith("ready ")
        ch = Channel.connect(address)
        ch.put(b"precious")
        consumer = workers.start(
            """
            import sys
            from zchannel.broker import Channel
            ch = Channel.connect(sys.argv[1])
            assert ch._connection().direct
            d = ch.get(ack=True, timeout=10)
            print("got", d.item, flush=True)
            sys.stdin.readline()
        """,
            address,
        )
        line = workers.wait_line(consumer)
        assert line.startswith("got") and "precious" in line
        assert ch.qsize() == 0
        os.kill(consumer.pid, signal.SIGKILL)
        consumer.wait()
        assert ch.get(timeout=20) == b"precious"
        ch.close()
    finally:
        broker.send_signal(signal.SIGTERM)
        try:
            broker.wait(10)
        except subprocess.TimeoutExpired:
            broker.kill()
            broker.wait()


def test_without_shared_memory_handles_stay_on_zeromq(make_remote):
    """Large frames move faster through libzmq's I/O threads: the link is used only beside the
    shared-memory path (a broker with shm_threshold=0 does not listen, shm=False keeps zmq)."""
    off = make_remote("doff", shm_threshold=0)
    path = direct_framing.link_path(off.stats()["address"][len("ipc://") :])
    assert path is not None and not os.path.exists(path)
    assert not off._connection().direct
    on = make_remote("don")
    plain = Channel.connect("don", shm=False)
    try:
        assert not plain._connection().direct
        blob = os.urandom(2 << 20)
        plain.put(blob)
        assert on.get(timeout=10) == blob
        off.put(blob)
        assert off.get(timeout=10) == blob
    finally:
        plain.close()


def test_a_stream_over_a_link_reads_its_replies_in_the_waiting_thread(make_remote):
    """Threads that wait read the link themselves: a windowed stream of 4,000 puts and gets
    wakes each handle's I/O thread far less than once per reply (it would be ~once per reply if
    the I/O thread read them)."""
    producer = make_remote("dw")
    consumer = Channel.connect("dw")
    try:
        pconn, cconn = producer._connection(), consumer._connection()
        assert pconn.direct and cconn.direct
        before = pconn.io_turns + cconn.io_turns
        n, window = 4000, 16
        puts: list = []
        gets: list = []
        got = []
        for i in range(n):
            puts.append(producer.put(i, async_op=True))
            gets.append(consumer.get(async_op=True, timeout=10))
            if len(puts) >= window:
                puts.pop(0).wait(10)
                got.append(gets.pop(0).wait(10))
        for w in puts:
            w.wait(10)
        got.extend(w.wait(10) for w in gets)
        assert got == list(range(n))
        turns = pconn.io_turns + cconn.io_turns - before
        assert turns < n // 4, f"the I/O threads woke {turns} times for {n} items"
    finally:
        consumer.close()


def test_a_waiting_thread_takes_replies_read_already_before_it_polls(make_remote, monkeypatch):
    """One read of the link can cut several messages; the replies in those after the first wait
    in the process, where no poll sees them: a waiting thread completes them before it polls
    again (else its reply waits for the broker's next bytes)."""
    from zchannel.broker.connection import waiting

    producer = make_remote("dbuf")
    consumer = Channel.connect("dbuf")
    try:
        cconn = consumer._connection()
        assert cconn.direct
        polled_past: list[int] = []  # messages waiting in the process at a waiting thread's poll

        class Zmq:  # zmq for waiting.py only: its polls are watched (the I/O thread's are not)
            def __getattr__(self, name):
                return getattr(zmq, name)

            @staticmethod
            def zmq_poll(sockets, timeout=-1):
                waiting_now = len(cconn.transport.reader.messages)
                if waiting_now:
                    polled_past.append(waiting_now)
                return zmq.zmq_poll(sockets, timeout)

        monkeypatch.setattr(waiting, "zmq", Zmq())
        n, window = 3000, 64
        for work in [producer.put(i, async_op=True) for i in range(n)]:
            work.wait(10)
        gets: list = []
        got = []
        for _ in range(n):
            gets.append(consumer.get(async_op=True, timeout=10))
            if len(gets) >= window:
                got.append(gets.pop(0).wait(10))
        got.extend(w.wait(10) for w in gets)
        assert got == list(range(n))
        assert polled_past == [], f"polled with {polled_past[:5]} messages read already"
    finally:
        consumer.close()


def test_replies_nobody_waits_for_still_complete(make_remote):
    """After a waiting thread stopped reading, a reply that no thread waits for is read by the
    I/O thread (LAZY_S later at most); a done-callback (asyncio's await) makes it watch at once."""
    import asyncio
    import threading

    ch = make_remote("dn")
    deadline = 30.0  # generous: a loaded 2-core machine
    ch.put(b"a")
    assert ch.get(timeout=10) == b"a"  # this thread read the link just now
    work = ch.get(async_op=True, timeout=deadline)
    ch.put(b"b", async_op=True)
    done = threading.Event()
    assert wait_until(work.done, deadline, interval=0.001), \
        "a reply nobody waited for never completed"
    assert work.wait(0) == b"b"
    work = ch.get(async_op=True, timeout=deadline)
    work.add_done_callback(lambda _: done.set())
    ch.put(b"c", async_op=True)
    assert done.wait(deadline)

    async def consume():
        w = ch.get(async_op=True, timeout=deadline)
        ch.put(b"d", async_op=True)
        return await w

    assert asyncio.run(asyncio.wait_for(consume(), deadline)) == b"d"


def test_many_threads_waiting_on_one_handle_all_get_their_replies(make_remote):
    """Waits from several threads: one reads the link, the others sleep until it (or the I/O
    thread) completes their Work; nobody is left waiting, a timeout still works."""
    import threading

    ch = make_remote("dm")
    errors: list = []

    def worker(t: int) -> None:
        try:
            for i in range(300):
                ch.put((t, i), key=t, async_op=True).wait(10)
                assert ch.get(key=t, async_op=True, timeout=10).wait(10) == (t, i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors and not any(th.is_alive() for th in threads)
    pending = ch.get(key="empty", async_op=True)
    with pytest.raises(TimeoutError):
        pending.wait(0.2)
    ch.put(b"late", key="empty")
    assert pending.wait(10) == b"late"  # a timed-out wait leaves the get pending


def test_a_request_held_back_goes_out_soon_without_a_wait(make_remote):
    """With replies due and a thread reading the link, an async request waits to go out with
    the next ones; if no wait comes, the I/O thread sends it within LAZY_S (20 ms), not at its
    next heartbeat tick (500 ms)."""
    import statistics
    import time

    ch = make_remote("dh")
    other = Channel.connect("dh")
    try:
        conn = ch._connection()
        parked = ch.get(key="never", async_op=True)  # a reply due all along
        delays = []  # of the puts that were held back
        for i in range(400):
            ch.qsize()  # a blocking call: this thread just read the link
            held = conn.held_back
            start = time.monotonic()
            ch.put(i, key="k", async_op=True)  # no wait follows
            assert other.get(key="k", timeout=5) == i
            if conn.held_back > held:
                delays.append(time.monotonic() - start)
                if len(delays) == 16:
                    break
        assert delays, "no request was held back"
        # A held-back request waits LAZY_S (20 ms) at most; one left for the heartbeat tick
        # would wait up to 0.5 s, 0.25 s in the median.  The two differ only in time, so this
        # stays a time comparison: the median of 16 samples, so that a few stalls of a loaded
        # machine do not decide it.
        assert statistics.median(delays) < 0.25, delays
        assert not parked.done()
    finally:
        other.close()


def test_lazy_setting_is_checked_and_zero_holds_nothing_back(make_remote):
    make_remote("dlz")
    for bad in ("-1", "soon"):
        proc = subprocess.run([sys.executable, "-c", "import zchannel.broker.connection.connection"],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "ZCHANNEL_LAZY_MS": bad})
        assert proc.returncode != 0
        assert "ZCHANNEL_LAZY_MS must be an int >= 0" in proc.stderr
    code = """
from zchannel.broker import BrokerUnavailable, Channel
ch = Channel.connect("dlz")
parked = ch.get(key="never", async_op=True)
for i in range(50):
    ch.qsize()
    ch.put(i, key="k", async_op=True)
assert [ch.get(key="k", timeout=5) for _ in range(50)] == list(range(50))
print(ch._connection().held_back)
ch.close()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "ZCHANNEL_LAZY_MS": "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0"


def test_a_link_that_never_says_hello_is_closed_after_the_expiry(make_remote):
    """A local process that connects to the link and stays silent holds a descriptor of the
    broker: it is closed once the heartbeat expiry (3 s here) passed; handles stay served."""
    ch = make_remote("dq")
    raw = RawLink(_link_file(ch))
    try:
        ch.put(1)
        assert raw.recv(timeout=20) is None, "the broker closes a silent link"
        assert ch.get(timeout=10) == 1
        conn = ch._connection()
        assert conn.transport.up and conn._liveness.relink_at == 0.0, "the handle's own link stayed open"
        assert ch.stats()["clients"] == 1
    finally:
        raw.close()


def test_a_request_queued_when_a_reader_finds_the_broker_gone_fails(make_remote):
    """A thread reading the link (``Waiting._read_for``) finds the broker gone (the link closed,
    nothing listens at its path) while another thread's request waits in the queue: the
    connection is down, and that request fails with ``BrokerUnavailable`` instead of going out
    on the dead link and waiting for an answer that never comes."""
    ch = make_remote("gone-while-queued")
    conn = ch._connection()
    assert conn.direct
    line = conn._line
    # this thread takes the link (between the I/O thread's turns) and reads it, as a waiting
    # caller does
    assert wait_until(line.take, timeout=30, interval=0.001)
    try:
        work = ch.get(async_op=True)  # the socket is taken: queued for the reader to send
        os.kill(ch._proc.pid, signal.SIGKILL)
        ch._proc.wait()
        while conn._recv_one():  # the reader sees the link close and nothing listening
            pass
        assert conn.state == "down"
        conn._requests.send_queued()  # what the reader does next with what is queued
    finally:
        line.give()
    with pytest.raises(BrokerUnavailable, match="before this request was sent"):
        work.wait(timeout=10)


def test_a_zeromq_peer_cannot_speak_as_a_direct_link(make_remote):
    """A direct link's address is the listener's prefix and a serial; a ZeroMQ peer choosing a
    routing id of that form is ignored, so it can neither cancel a link client's waiting get
    nor make requests in its session."""
    ch = make_remote("linkid")
    link = RawLink(_link_file(ch))
    dealers = []
    try:
        link.send([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION}])
        assert link.replies(1)[0][0].get("e") is None
        link.send([{"op": "get", "id": 50, "k": "vk", "t": 60}])  # waits
        wait_until(lambda: ch.stats()["keys"].get("vk", {}).get("getters") == 1)
        for serial in range(1, 5):  # the first links' addresses
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, ADDRESS_PREFIX + serial.to_bytes(8, "little"))
            sock.connect(ch.stats()["address"])
            sock.send_multipart([msgpack.packb([{"op": "cancel", "id": 7, "rid": 50}])])
            dealers.append(sock)
        ch.put("for the link", key="vk")  # sent after the cancels: the broker read them first
        (reply, frames), = link.replies(1)
        assert reply["id"] == 50 and reply.get("e") is None
        for sock in dealers:
            assert not sock.poll(200), "a peer in a link's guise was answered"
    finally:
        for sock in dealers:
            sock.close()
        link.close()


def test_a_link_whose_client_expired_is_closed_unless_it_says_hello_again(make_remote):
    """A link client that goes silent mid-message is expired like any client, and its link,
    which holds the message read in part, is closed one expiry later (a live client says
    hello again on its link after ``expired``)."""
    ch = make_remote("expiredlink")
    link = RawLink(_link_file(ch))
    try:
        link.send([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION}])
        assert link.replies(1)[0][0].get("e") is None
        header = pack_header([{"op": "put", "id": 5, "k": "big", "nf": 1}])
        whole = b"".join(bytes(p) for p in direct_framing.iovec([header, b"x" * (1 << 20)])[0])
        link.send_raw(whole[: len(whole) // 2])  # half of a message, then silence
        wait_until(lambda: ch.stats()["clients"] == 1, timeout=60)  # this handle's connection
        ops = []
        for _ in range(100):  # heartbeats, then ``expired``, then the link closes
            parts = link.recv(timeout=60)
            if parts is None:
                break
            ops += [rec.get("op") for rec in msgpack.unpackb(parts[0], raw=False)]
        else:
            raise AssertionError(f"the link stayed open: {ops}")
        assert "expired" in ops
        ch.put("still", key="k")
        assert ch.get(key="k", timeout=10) == "still"
    finally:
        link.close()
