"""Broker limits and producers killed mid-put."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq
from conftest import wait_until
from zchannel.broker import Channel
from zchannel.broker.server.handlers import (
    PEEKED_PER_TURN,
    STATS_BURST_S,
    STATS_SHARE,
    TurnCosts,
)
from zchannel.broker.server.outbox import MAX_REPLY_BYTES, MAX_REPLY_FRAMES, Outbox
from zchannel.broker.transport.direct_broker import MAX_QUEUED_MESSAGES
from zchannel.broker.wire import codec, protocol
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, Reply, pack_header

pytestmark = pytest.mark.timeout(90)


def test_limits_name_themselves_and_store_nothing(cli_broker):
    address = cli_broker("limited", "--max-keys", "2", "--max-bytes", "200000",
                         "--max-message-bytes", "262144")  # its least (but 0)
    ch = Channel.connect(address)
    try:
        ch.put(1, key="a")
        ch.put(2, key="b")
        with pytest.raises(ValueError, match="max_keys"):
            ch.put(3, key="c")
        with pytest.raises(ValueError, match="max_keys"):
            ch.get(key="c", timeout=0.1)
        assert ch.get(key="a") == 1  # existing keys still work
        ch.put(torch.zeros(30_000), key="a")  # 120 kB
        with pytest.raises(asyncio.QueueFull, match="max_bytes"):  # waits like a full queue
            ch.put_nowait(torch.zeros(30_000), key="a")
        with pytest.raises(TimeoutError, match="max_bytes"):
            ch.put(torch.zeros(30_000), key="a", timeout=0.2)
        assert ch.qsize("a") == 1
        ch.get(key="a")
        ch.put(torch.zeros(30_000), key="a")  # admitted once bytes were freed
        with pytest.raises(ValueError, match="max_message_bytes"):
            ch.put(torch.zeros(70_000), key="b", timeout=2)  # 280 kB
    finally:
        ch.close()
    fresh = Channel.connect(address)
    try:
        assert fresh.qsize("a") == 1 and fresh.qsize("b") == 1  # nothing half-stored
    finally:
        fresh.close()


def test_producer_killed_mid_put_enqueues_whole_items_or_nothing(workers, channels):
    ch = Channel.create("midput")
    channels.append(ch)
    producer = workers.start(
        """
        import sys, torch
        from zchannel.broker import Channel
        ch = Channel.connect(sys.argv[1])
        i = 0
        while True:
            t = torch.full((8 << 20,), float(i))  # 32 MiB per item
            work = ch.put(t, async_op=True)
            if i == 0:
                work.wait()  # one acknowledged item; the rest stream while we are killed
                print("streaming", flush=True)
            i += 1
        """,
        ch.address,
    )
    workers.wait_line(producer, "streaming")
    os.kill(producer.pid, signal.SIGKILL)
    producer.wait()
    n = ch.qsize()
    assert n >= 1
    for _ in range(n):
        item = ch.get(timeout=10)
        assert item.shape == (8 << 20,)
        assert bool((item == item[0]).all())  # intact, never a torn item
    ch.put("after")
    assert ch.get(timeout=5) == "after"


@contextlib.contextmanager
def _decoding_broker(tmp_path, name: str, channel_options: str):
    """A broker started from a config file with ``channel_options`` and a collector (so it
    decodes every item), and a handle to it; the broker is terminated by PID afterwards."""
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'[channel]\nname = "{name}"\n{channel_options}\n[hooks]\ncollector = "flatten_batch"\n'
    )
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "--config",
                             str(config)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("ready ")
        ch = Channel.connect(name)
        yield ch
        ch.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_dtype_allow_list_and_rank_limit_for_decoding_brokers(tmp_path, run_dir):
    options = 'allowed_dtypes = ["float32", "<f4"]\nmax_rank = 2'
    with _decoding_broker(tmp_path, "strict", options) as ch:
        ch.put([torch.ones(2, 2)])  # decoded by the collector: allowed
        assert torch.equal(ch.get(timeout=5), torch.ones(2, 2))
        for bad in ([torch.ones(2, dtype=torch.int64)], [torch.ones(1, 1, 1)]):
            with pytest.raises(ValueError):
                ch.put(bad)
        assert ch.qsize() == 0


def test_an_allow_list_of_numpy_dtypes_only_refuses_every_tensor(tmp_path, run_dir):
    """With only numpy dtypes allowed, no torch dtype may come back allowed once the broker
    first decodes a tensor (its dtype tables are built once, then narrowed)."""
    with _decoding_broker(tmp_path, "numpy_only", 'allowed_dtypes = ["<f4"]') as ch:
        ch.put([np.ones(3, np.float32)])
        assert np.array_equal(ch.get(timeout=5), np.ones(3, np.float32))
        for bad in ([torch.ones(2)], [np.ones(2, np.float64)]):
            with pytest.raises(ValueError):
                ch.put(bad)
        assert ch.qsize() == 0


def test_a_client_that_stops_reading_is_ended_and_the_broker_serves_on(channels):
    """A client that sends requests but never reads the replies fills its pipe: past
    ``MAX_QUEUED_MESSAGES`` reply messages the broker ends it (its sends fail at the high-water
    mark) instead of queueing replies without bound, and serves everyone else."""
    ch = Channel.create("nonreader")
    channels.append(ch)
    ch.put(b"x" * 1000, key="peeked")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ch.address)
    try:
        sock.send_multipart([pack_header([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION}])])
        assert wait_until(lambda: ch.stats()["clients"] == 2, timeout=30)
        sent = 0
        while ch.stats()["clients"] == 2:
            for _ in range(100):  # a peek, then a round trip: the peek's reply is a message
                sent += 1
                sock.send_multipart([pack_header([{"op": "peek", "id": sent, "k": "peeked"}])])
                ch.qsize("peeked")
            assert sent < 20 * MAX_QUEUED_MESSAGES, "the broker kept queueing replies"
        assert sent > MAX_QUEUED_MESSAGES
        ch.put("after", key="q")
        assert ch.get(key="q", timeout=10) == "after"
        assert ch.qsize("peeked") == 1
    finally:
        sock.close()


def test_a_reply_cut_into_messages_names_the_deliveries_of_each():
    """Replies of one turn over ``MAX_REPLY_BYTES`` go as several messages; each knows its first
    delivery, so a client that can take the first but not the second gets back only the items
    of what it did not get (a requeue of every delivery would deliver the first ones twice)."""
    class Frame(bytes):
        """A frame as long as it says (its bytes are not what is measured here)."""

        def __len__(self) -> int:
            return MAX_REPLY_BYTES // 2 + 1

    out = Outbox()
    for i in range(3):
        r0, f0 = len(out.records), len(out.frames)
        out.records.append(Reply(id=i))
        out.frames.append(Frame())
        out.record_added(r0, f0)
        out.deliveries.append(("client", "origin", [i], None))
    messages = out.messages()
    assert [(len(r), len(f), first) for r, f, first in messages] == [(1, 1, 0), (1, 1, 1),
                                                                      (1, 1, 2)]
    assert [d[2] for d in out.deliveries[messages[1][2]:]] == [[1], [2]]


@pytest.mark.parametrize("address", [None, "tcp://127.0.0.1:0"], ids=["direct", "zmq-tcp"])
def test_coalesced_puts_stay_within_the_brokers_header_limit(channels, address):
    """A client coalesces up to 512 queued requests into one message; their keys count toward
    the header the broker limits (1 MiB by default): 1,000 async puts to a key of 1,024
    three-byte characters all get in (they made a 1.5 MiB header, which the broker dropped:
    ``BrokerUnavailable``, or puts that never returned over ZeroMQ)."""
    ch = Channel.create("longkeys", address=address)
    channels.append(ch)
    key = "\u20ac" * 1024
    works = [ch.put(b"y", key=key, async_op=True) for _ in range(1000)]
    for work in works:
        work.wait(timeout=60)
    assert ch.qsize(key) == 1000


@pytest.mark.parametrize("line", ["max_frames = 16", "max_header_bytes = 16384"])
def test_message_limits_below_what_a_client_coalesces_are_refused(run_dir, tmp_path, line):
    config = tmp_path / "broker.toml"
    config.write_text(f"[channel]\n{line}\n")
    out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", "lowlimit",
                          "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "ready" not in out.stdout
    assert f"{line.split()[0]} must be" in out.stderr, out.stderr


def _cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_a_message_of_many_stats_records_costs_a_few_stats(channels):
    """``stats`` costs O(keys) to make and holds its own reply: one message of 1000 ``stats``
    records on a broker of 5000 keys made 1000 bodies in one turn (tens of seconds during which
    nobody else was served, and a gigabyte held at 20000 keys).  The broker makes a few per turn
    (``FRESH_STATS_PER_TURN``) and the later ones of the turn share the last: every record is
    answered with a whole stats dict, for about the broker CPU of ten records and at most the
    stats credit (``STATS_SHARE``) more (measured in the broker's own CPU time)."""
    ch = Channel.create("statsflood")
    channels.append(ch)
    pid = ch.stats()["pid"]
    sock = _dealer(ch.address)

    def replies(n: int, timeout: float) -> list:
        got: list = []
        while len(got) < n and sock.poll(int(timeout * 1000)):
            header, *frames = sock.recv_multipart()
            recs = [r for r in msgpack.unpackb(header, raw=False) if "id" in r]
            got += [(r, frames) for r in recs]
        return got

    def stats_burst(n: int, first_id: int) -> tuple[list, int, float]:
        before, start = _cpu_ticks(pid), time.monotonic()
        sock.send_multipart([pack_header([{"op": "stats", "id": first_id + i}
                                          for i in range(n)])])
        got = replies(n, 300)
        return got, _cpu_ticks(pid) - before, time.monotonic() - start

    try:
        sock.send_multipart([pack_header([{"op": "hello", "id": 0, "v": PROTOCOL_VERSION}])])
        assert len(replies(1, 30)) == 1
        keys = 5000
        for part in range(0, keys, 2500):  # at most 4096 records per header
            sock.send_multipart([pack_header([{"op": "put", "id": 1 + i, "k": f"k{i}", "b": b"x",
                                               "nw": True} for i in range(part, part + 2500)])])
        assert len(replies(keys, 60)) == keys
        few = min(stats_burst(10, 10_000)[1] for _ in range(3))
        got, many, seconds = stats_burst(1000, 20_000)
        assert len(got) == 1000 and all("e" not in r for r, _ in got)
        for _, frames in got[:: 100]:
            assert len(codec.decode(frames[0], [])["keys"]) == keys
        # when a body takes STATS_DEAR_S or more (a loaded machine), the later turns of the
        # burst may make fresh ones within the credit: STATS_BURST_S, and STATS_SHARE of the
        # burst's time (the answers to 1000 records go out over several turns)
        credit = (STATS_BURST_S + seconds * STATS_SHARE) * os.sysconf("SC_CLK_TCK")
        assert many <= 10 * max(few, 5) + credit, \
            f"1000 stats records: {many} ticks in {seconds:.1f}s, 10: {few}"
        assert ch.qsize("k0") == 1
    finally:
        sock.close()


def test_a_message_of_many_peeks_is_bounded_per_turn(channels):
    """Each ``peek n=1024`` record copies 1024 items into its reply: one message of thousands
    made millions of reply frames in one turn (seconds of a stalled loop, gigabytes held for a
    client that does not read).  A turn copies at most ``PEEKED_PER_TURN`` frames (later peeks
    are refused, naming why), and reply messages are cut at ``MAX_REPLY_FRAMES`` frames."""
    ch = Channel.create("peekflood")
    channels.append(ch)
    sock = _dealer(ch.address)
    got: list = []
    largest = 0
    try:
        sock.send_multipart([pack_header([{"op": "hello", "id": 0, "v": PROTOCOL_VERSION}])])
        assert sock.poll(30_000)
        sock.recv_multipart()
        sock.send_multipart([pack_header([{"op": "put", "id": 1 + i, "k": "p", "b": b"x",
                                           "nw": True} for i in range(1024)])])
        peeks = 100
        sock.send_multipart([pack_header([{"op": "peek", "id": 10_000 + i, "k": "p", "n": 1024}
                                          for i in range(peeks)])])
        while len([r for r in got if r["id"] >= 10_000]) < peeks and sock.poll(120_000):
            header, *frames = sock.recv_multipart()
            largest = max(largest, len(frames))
            got += [r for r in msgpack.unpackb(header, raw=False) if "id" in r]
        answered = [r for r in got if r["id"] >= 10_000]
        assert len(answered) == peeks
        refused = [r for r in answered if "e" in r]
        assert len(answered) - len(refused) == PEEKED_PER_TURN // 1024
        assert all("frames in this turn" in str(r["e"]) for r in refused)
        assert largest <= MAX_REPLY_FRAMES + 1024
        assert ch.qsize("p") == 1024  # peeks take nothing
    finally:
        sock.close()


def _dealer(address: str):
    """A raw DEALER socket connected to ``address`` (closed without lingering)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _hello(sock) -> None:
    sock.send_multipart([pack_header([{"op": "hello", "id": 0, "v": PROTOCOL_VERSION}])])
    assert sock.poll(30_000)
    sock.recv_multipart()


def _replies_until(sock, last_id: int) -> list:
    """The records the broker sends until the reply to request ``last_id``."""
    got: list = []
    while not any(r.get("id") == last_id for r in got):
        assert sock.poll(60_000), f"no reply to request {last_id}"
        header, *_ = sock.recv_multipart()
        got += msgpack.unpackb(header, raw=False)
    return got


def test_requests_in_counts_each_put_and_get_of_a_batch_record():
    put = protocol.Put(id=1, key="k", body=b"x")
    records = [protocol.PutBatch(id=2, puts=[put] * 3), protocol.GetRun(id=3, key="k", ids=[4, 5]),
               protocol.Stats(id=6)]
    assert protocol.requests_in(records) == 3 + 2 + 1


def test_a_message_standing_for_more_requests_than_the_limit_is_dropped(channels):
    """A ``gets`` record stands for up to 4096 gets: a header of 87 of them made the broker
    answer 356,352 gets in one go (seconds of a stalled loop, other clients expired).  A message
    standing for more than ``MAX_REQUESTS`` requests is dropped whole; at the limit it is
    served."""
    ch = Channel.create("manygets")
    channels.append(ch)
    sock = _dealer(ch.address)
    try:
        _hello(sock)
        run = {"op": "gets", "k": "empty", "nw": True}
        over = [dict(run, id=100_000 + r, g=list(range(r * 4096 + 1, r * 4096 + 4097)))
                for r in range(2)]
        sock.send_multipart([pack_header(over)])
        sock.send_multipart([pack_header([{"op": "stats", "id": 200_000}])])
        got = _replies_until(sock, 200_000)
        assert [r["id"] for r in got if "id" in r] == [200_000], "the over-limit message was served"
        at_limit = dict(run, id=300_000, g=list(range(1, protocol.MAX_REQUESTS + 1)))
        sock.send_multipart([pack_header([at_limit])])
        got = _replies_until(sock, 300_000)
        emptied = {r["id"] for r in got if r.get("e") and r["e"][0] == "QueueEmpty"}
        assert emptied == set(range(1, protocol.MAX_REQUESTS + 1))
        assert ch.qsize("empty") == 0
    finally:
        sock.close()


def test_a_peek_of_items_of_many_frames_is_bounded_by_frames(channels):
    """``peek`` counted items: a few peeks of items of 65,535 frames each copied millions of
    reply frames in one turn.  It counts frames: a peek past ``PEEKED_PER_TURN`` is refused,
    naming why; a smaller one is served, and so is everyone else."""
    ch = Channel.create("peekframes")
    channels.append(ch)
    sock = _dealer(ch.address)
    nf = PEEKED_PER_TURN // 2 + 1
    try:
        _hello(sock)
        body = codec.encode(b"x")[0]
        for i in range(2):
            sock.send_multipart([pack_header([{"op": "put", "id": 10 + i, "k": "many", "nf": nf}]),
                                 body] + [b""] * (nf - 1))
            (reply,) = [r for r in _replies_until(sock, 10 + i) if r.get("id") == 10 + i]
            assert "e" not in reply, reply
        sock.send_multipart([pack_header([{"op": "peek", "id": 20, "k": "many", "n": 2}])])
        (reply,) = [r for r in _replies_until(sock, 20) if r.get("id") == 20]
        assert reply["e"][0] == "ValueError" and "frames in this turn" in reply["e"][1], reply
        sock.send_multipart([pack_header([{"op": "peek", "id": 21, "k": "many", "n": 1}])])
        (reply,) = [r for r in _replies_until(sock, 21) if r.get("id") == 21]
        assert "e" not in reply and reply["n"] == [nf], reply
        assert ch.qsize("many") == 2
        ch.put("still served", key="g")
        assert ch.get(key="g", timeout=30) == "still served"
    finally:
        sock.close()


def test_stats_bodies_are_made_afresh_within_a_share_of_the_loops_time():
    """A stats body of 100,000 keys takes ~0.3 s: asked for every turn it would leave the other
    clients a fraction of the loop.  Past ``STATS_SHARE`` of the time the last body made is
    answered again; a cheap body never runs the credit out."""
    costs = TurnCosts()
    for _ in range(2000):  # 2 s of cheap bodies, one per turn: each made afresh
        assert costs.may_make_stats()
        costs.made_stats((1, 0), b"cheap", 0.001)
        costs.new_turn()
    costs.made_stats((1, 0), b"dear", STATS_BURST_S + 1.0)  # a body that took 1.5 s
    costs.new_turn()
    assert not costs.may_make_stats()  # about 10 s of loop time before the next one
    assert costs.last_stats((1, 0)).bytes == b"dear"
    assert costs.last_stats((2, 0)).bytes == b"dear"  # another clients figure: the last body made
