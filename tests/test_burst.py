"""A burst of large tensors must not make a healthy broker look dead, and the default path
must stay the shared-memory path.

The shape of the issue's reproducer: a producer process puts 256 tensors of 16 MiB (async,
``window`` in flight); the consumer (this process) takes one blocking get, then keeps
``window`` async gets outstanding.  Before the fix a default channel failed this with
``BrokerUnavailable: ... did not answer for 3.0s``: a producer's pool ran out of slots, its
tensors went as frames, and the broker coalesced up to 528 MiB of them into one reply, which
the client counted as life only once it had arrived whole (docs/decisions.md).

- Default suite (``test_burst_with_a_short_heartbeat_expiry``): the full burst shape for
  windows 1, 8 and 64 (and 64 with ``maxsize=8``), 2 rounds each on one broker, whose heartbeat
  interval is 0.5 s: clients and broker then declare each other dead after 1.5 s of silence
  (half the default expiry), so a misfire under load shows sooner than with the defaults.
- ``pytest -m soak`` (``test_burst_soak_20_rounds_default_channel``): the acceptance run as the
  issue states it, on a default ``Channel.create(name)``: 20 rounds in a row for each of the
  windows 1, 8 and 64 (20 x 256 x 16 MiB = 80 GiB through shared memory per window).

Both assert on what arrives (every tensor, in order, its first and last element carrying its
sequence number, the rest intact) and on the producer's puts never falling back to frames (the
pool waits for freed slots instead), never on time.  ``test_a_full_pool_waits_for_a_freed_slot``
pins the backpressure itself.
"""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import threading
from collections import deque

import msgpack
import pytest
import torch
from conftest import wait_until
from zchannel.broker import Channel, shm
from zchannel.broker.connection.connection import UP, Connection
from zchannel.broker.server.outbox import MAX_REPLY_BYTES
from zchannel.broker.transport import direct_framing
from zchannel.broker.wire.protocol import HEARTBEAT, QSize, pack_header

SIZE = 16 << 20
N = 256

PRODUCER = """
import sys
import torch
from zchannel.broker import Channel

address, n, window, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ch = Channel.connect(address)
# window + 1 tensors: one is reused only once the put that sent it was acknowledged (had it
# gone as a frame, the broker then holds its bytes)
ring = [torch.ones(SIZE // 4) for _ in range(window + 1)]
print("ready", flush=True)
for r in range(rounds):
    sys.stdin.readline()
    pending = []
    for i in range(n):
        t = ring[i % len(ring)]
        t[0] = t[-1] = r * n + i
        pending.append(ch.put(t, async_op=True))
        if len(pending) >= window:
            pending.pop(0).wait(120)
    for w in pending:
        w.wait(120)
    pool = ch._connection().shm.pool
    print("done", -1 if pool is None else pool.fallbacks, flush=True)
ch.close()
""".replace("SIZE", str(SIZE))


def _check(t: torch.Tensor, seq: int) -> None:
    assert t.shape == (SIZE // 4,) and t.dtype == torch.float32
    assert (t[0].item(), t[-1].item()) == (seq, seq), f"expected tensor {seq}"
    assert t[1].item() == t[SIZE // 8].item() == t[-2].item() == 1.0


def _consume(ch: Channel, n: int, window: int, first: int) -> int:
    """The reproducer's consumer: one blocking get, then ``window`` async gets outstanding."""
    _check(ch.get(timeout=120), first)
    received, pending = 1, deque()
    while received < n:
        while len(pending) < window and received + len(pending) < n:
            pending.append(ch.get(async_op=True))
        _check(pending.popleft().wait(120), first + received)
        received += 1
    return received


def _bursts(workers, ch: Channel, address: str, window: int, rounds: int) -> None:
    producer = workers.start(PRODUCER, address, str(N), str(window), str(rounds))
    workers.wait_line(producer, "ready", timeout=120)
    for r in range(rounds):
        workers.send(producer)
        assert _consume(ch, N, window, r * N) == N
        assert workers.wait_line(producer, timeout=120) == "done 0", \
            f"round {r}: the producer's puts fell back to frames (no free slot)"
        assert ch.qsize() == 0
    workers.send(producer)
    workers.finish(producer)
    # every slot came back: the consumer copied each tensor out and released it
    assert wait_until(lambda: ch.stats()["shm"]["slots_used"] == 0, timeout=30)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("window,maxsize", [(1, 0), (8, 0), (64, 0), (64, 8)])
def test_burst_with_a_short_heartbeat_expiry(run_dir, workers, tmp_path, window, maxsize):
    conf = tmp_path / "b.toml"
    conf.write_text(f"[channel]\nheartbeat_interval = 0.5\nliveness = 3\nmaxsize = {maxsize}\n")
    address = f"ipc://{run_dir}/burst.sock"
    broker = subprocess.Popen(
        [sys.executable, "-m", "zchannel.cli.main", "broker", "burst", "--address", address,
         "--config", str(conf)],
        stdout=subprocess.PIPE, text=True,
    )
    ch = None
    try:
        assert broker.stdout.readline().startswith("ready ")
        ch = Channel.connect(address)
        conn = ch._connection()
        assert (conn.hb, conn.liveness) == (0.5, 3), "clients keep the broker's heartbeat"
        _bursts(workers, ch, address, window, rounds=2)
    finally:
        if ch is not None:
            ch.close()
        broker.terminate()
        broker.wait(30)
        broker.stdout.close()


@pytest.mark.soak
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("window", [1, 8, 64])
def test_burst_soak_20_rounds_default_channel(channels, workers, window):
    ch = Channel.create("burst16")
    channels.append(ch)
    _bursts(workers, ch, "burst16", window, rounds=20)


T = 64 * 1024  # a small size class: MAX_SLOTS slots of 64 KiB


def test_a_full_pool_waits_for_a_freed_slot(make_remote):
    """A put that finds every slot of its class in use waits for the broker to free one (it
    does not go as a frame); ``put_nowait`` never waits; with nothing consumed for the
    heartbeat expiry the put goes as a frame, and the next ones at once until a slot is free."""
    ch = make_remote("bp", shm_threshold=T)
    pool = ch._connection().shm.pool
    ts = [torch.full((T // 4,), float(i)) for i in range(shm.MAX_SLOTS + 3)]
    for t in ts[: shm.MAX_SLOTS]:
        ch.put(t)
    assert ch.stats()["shm"]["slots_used"] == shm.MAX_SLOTS
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (ch.put(ts[shm.MAX_SLOTS]), done.set()))
    waiter.start()
    # the put waits in the pool (its handle stays usable meanwhile): a get frees a slot
    assert torch.equal(ch.get(timeout=30), ts[0])
    assert done.wait(30)
    waiter.join()
    assert pool.fallbacks == 0 and ch.stats()["shm"]["slots_in"] == shm.MAX_SLOTS + 1
    ch.put_nowait(ts[shm.MAX_SLOTS + 1])  # never waits: a frame
    assert pool.fallbacks == 1 and not pool.stalled
    ch.put(ts[shm.MAX_SLOTS + 2], timeout=0.2)  # waits at most its timeout, then a frame
    assert pool.fallbacks == 2 and pool.stalled  # the next puts do not wait again...
    for t in ts[1:]:
        assert torch.equal(ch.get(timeout=30), t)
    ch.put(ts[0])  # ...until a slot is free again
    assert pool.fallbacks == 2 and not pool.stalled
    assert torch.equal(ch.get(timeout=30), ts[0])
    assert wait_until(lambda: ch.stats()["shm"]["slots_used"] == 0, timeout=30)


def test_a_reply_arriving_slowly_is_life(run_dir):
    """A client counts bytes from the broker as life, not only whole messages: a 2 MiB reply
    that a (fake, hand-driven) broker trickles out in 8 pieces, one per heartbeat the client
    sends (every 1 s: ~8 s in all, far past the 3 s expiry it announced), completes its
    request and the connection never goes down.  (Each piece comes 2 s before the expiry: a
    loaded machine that stalls a thread for a second does not end the connection.)"""
    address = f"ipc://{run_dir}/slow.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(direct_framing.link_path(address[len("ipc://"):]))
    listener.listen(1)
    open(address[len("ipc://"):], "w").close()  # the ipc path a broker would bind
    done = threading.Event()
    states: list[str] = []

    def fake_broker() -> None:
        sock, _ = listener.accept()
        reader = direct_framing.Reader(1 << 10, 1 << 20)
        answered: set[int] = set()
        pieces: deque[bytes] = deque()  # of the reply, sent one per client heartbeat
        while not done.is_set():
            ready, _, _ = select.select([sock], [], [], 0.05)
            if ready and not reader.read(sock.fileno()):
                return
            while reader.messages:
                for rec in msgpack.unpackb(reader.messages.popleft()[0], raw=False):
                    rid = rec.get("id")
                    if rec.get("op") == "hello":
                        reply = [{"id": rid, "r": {"name": "slow", "hb": 1.0, "liveness": 3}}]
                        sock.sendall(b"".join(bytes(p) for p in direct_framing.iovec([pack_header(reply)])[0]))
                    elif rec.get("op") == "qsize" and rid not in answered:
                        answered.add(rid)
                        big = bytes(2 << 20)
                        data = b"".join(bytes(p) for p in direct_framing.iovec(
                            [pack_header([{"id": rid, "r": 7, "nf": 1}]), big])[0])
                        step = -(-len(data) // 8)
                        pieces.extend(data[i : i + step] for i in range(0, len(data), step))
                    if pieces and rec.get("op") in ("qsize", HEARTBEAT):
                        sock.sendall(pieces.popleft())
                        states.append(conn.state)
        sock.close()

    server = threading.Thread(target=fake_broker, daemon=True)
    server.start()
    conn = Connection(address)
    try:
        assert conn.wait_up(10) and conn.direct
        assert (conn.hb, conn.liveness) == (1.0, 3)
        work = conn.request(QSize(id=0, key=None), [])
        assert work.wait(30) == 7
        assert conn.state == UP and set(states) == {UP} and len(states) == 8
    finally:
        done.set()
        conn.close(bye=False)
        server.join(10)
        listener.close()


def test_replies_to_many_gets_are_cut_into_bounded_messages(make_remote, workers):
    """Items that travel as frames (a producer without shared memory) to a consumer with 24
    gets out: the broker answers in messages of at most ``MAX_REPLY_BYTES`` of frames (before,
    one message of all 24 x 16 MiB, which arrives whole only after seconds)."""
    ch = make_remote("cut")
    n = 24
    producer = workers.start("""
        import sys, torch
        from zchannel.broker import Channel
        ch = Channel.connect(sys.argv[1], shm=False)
        for i in range(int(sys.argv[2])):
            ch.put(torch.full((SIZE // 4,), float(i)))
        ch.close()
        print("done", flush=True)
    """.replace("SIZE", str(SIZE)), ch.address, str(n))
    workers.wait_line(producer, "done", timeout=120)
    workers.finish(producer)
    conn = ch._connection()
    sizes: list[int] = []
    on_message = conn._on_message

    def recording(header, frames):
        sizes.append(sum(memoryview(f).nbytes for f in frames))
        on_message(header, frames)

    conn._on_message = recording
    try:
        works = [ch.get(async_op=True) for _ in range(n)]
        for i, w in enumerate(works):
            t = w.wait(60)
            assert t[0].item() == t[-1].item() == float(i)
    finally:
        del conn._on_message
    big = [s for s in sizes if s]
    assert sum(big) >= n * SIZE and len(big) >= n * SIZE // MAX_REPLY_BYTES
    assert max(big) <= MAX_REPLY_BYTES
