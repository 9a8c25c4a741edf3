"""``max_bytes`` bounds the broker's memory, not only its payload bytes (docs/guarantees.md,
"Hostile input and limits"): an item counts its payload plus ``ITEM_OVERHEAD``; the requests
waiting at one time count up to ``max_bytes`` more (``REQUEST_OVERHEAD`` each, a put's item, and
``KEY_OVERHEAD`` for a key the request made).  A flood of empty items and a flood of waiting
gets are refused at those bounds with errors naming ``max_bytes``, and the broker's resident
memory grows by less than twice ``max_bytes`` (read from ``/proc/<pid>/status``)."""

from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import pytest
import zmq
from conftest import BOUNDED_MAX_BYTES, rss_bytes, wait_until
from zchannel.broker import Channel, HookError
from zchannel.broker.core.state import ITEM_OVERHEAD, KEY_OVERHEAD, REQUEST_OVERHEAD, item_bytes
from zchannel.broker.wire.protocol import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(240)
MAX_BYTES = BOUNDED_MAX_BYTES  # the bounded_broker fixture's (conftest.py)


def _flood_empty_items(ch: Channel, n: int) -> tuple[int, set[str]]:
    """``n`` ``put(None, timeout=0)``, 1000 in flight: how many were refused, and why."""
    refused, why = 0, set()
    works: list = []

    def settle() -> None:
        nonlocal refused
        for work in works:
            try:
                work.wait()
            except TimeoutError as exc:
                refused += 1
                why.add(str(exc).split(";")[0])
        works.clear()

    for _ in range(n):
        works.append(ch.put(None, key="flood", timeout=0, async_op=True))
        if len(works) == 1000:
            settle()
    settle()
    return refused, why


def _flood_waiting_gets(address: str, n: int, keys: int) -> tuple[int, set[str]]:
    """``n`` gets without a timeout over ``keys`` keys from one raw DEALER, 128 per message,
    each message followed by a ``qsize`` whose reply says the broker has seen it: how many
    were refused (the rest wait), and why."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send_multipart([msgpack.packb([{"op": "hello", "id": 0, "v": PROTOCOL_VERSION}])])
    assert sock.poll(30_000)
    sock.recv_multipart()
    refused, why, rid = 0, set(), 1
    for start in range(0, n, 128):
        records = [{"op": "hb", "id": 0}]
        for i in range(start, min(n, start + 128)):
            records.append({"op": "get", "id": rid, "k": f"key-{i % keys}"})
            rid += 1
        marker = rid
        rid += 1
        records.append({"op": "qsize", "id": marker, "k": "key-0"})
        sock.send_multipart([msgpack.packb(records)])
        seen = False
        while not seen:
            assert sock.poll(60_000), "the broker did not answer"
            for rec in msgpack.unpackb(sock.recv_multipart()[0], raw=False):
                if rec.get("e"):
                    assert rec["e"][0] == "ValueError", rec
                    refused += 1
                    why.add(rec["e"][1].split(";")[0])
                seen = seen or rec.get("id") == marker
    sock.close()
    return refused, why


def test_floods_of_items_and_waiting_gets_stop_at_max_bytes(bounded_broker):
    pid, address = bounded_broker
    ch = Channel.connect(address)
    try:
        for _ in range(200):  # the paths the floods take, once, before measuring
            ch.put(None, key="warm")
            ch.get(key="warm")
        idle = rss_bytes(pid)
        refused, why = _flood_empty_items(ch, 60_000)
        held = MAX_BYTES // (1 + ITEM_OVERHEAD)  # None is one byte of msgpack
        assert ch.qsize("flood") == held and refused == 60_000 - held
        assert why and all("max_bytes limit (1048576" in w for w in why), why

        refused, why = _flood_waiting_gets(address, 60_000, keys=500)
        waiting = 60_000 - refused
        assert 0 < waiting <= MAX_BYTES // REQUEST_OVERHEAD
        assert waiting >= (MAX_BYTES - 500 * (REQUEST_OVERHEAD + KEY_OVERHEAD)) // REQUEST_OVERHEAD
        assert why and all("max_bytes limit (1048576" in w for w in why), why
        # each refusal names what the get would have cost: a new key costs its state too
        costs = {REQUEST_OVERHEAD, REQUEST_OVERHEAD + KEY_OVERHEAD}
        assert all(any(f"it would take {c} bytes" in w for c in costs) for w in why), why

        grown = rss_bytes(pid) - idle
        # twice max_bytes, plus the allocator's slack: the same broker grows 1.7-2.2 MiB here
        # depending on its heap layout (which imports it made); unbounded, these floods would
        # grow it by ~20 MiB
        assert grown < 3 * MAX_BYTES, f"the broker grew by {grown / 1024:.0f} KiB"
        stats = ch.stats()
        assert stats["bytes_held"] == held * (1 + ITEM_OVERHEAD)
        assert ch.get(key="flood", timeout=10) is None  # the broker serves on
        ch.put("room again", key="after", timeout=10)
        assert ch.get(key="after", timeout=10) == "room again"
    finally:
        ch.close()


def test_an_item_of_many_empty_frames_counts_each_frame(bounded_broker):
    """An item's frames count beside its bytes: puts of 2,000 empty frames each, which would
    count 320 bytes apiece by their payload, stop at ``max_bytes`` while the broker grows by
    less than about twice that."""
    pid, address = bounded_broker
    frames = 2_000
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    ch = Channel.connect(address)
    try:
        sock.send_multipart([msgpack.packb([{"op": "hello", "id": 0, "v": PROTOCOL_VERSION}])])
        assert sock.poll(30_000)
        sock.recv_multipart()
        ch.put(None, key="warm")
        ch.get(key="warm")
        idle = rss_bytes(pid)
        stored, refused = 0, []
        for rid in range(1, 41):
            sock.send_multipart([msgpack.packb([{"op": "put", "id": rid, "k": "frames",
                                                 "nf": frames, "nw": True}]), *[b""] * frames])
            assert sock.poll(30_000), "the broker did not answer"
            (rec,) = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
            if rec.get("e"):
                refused.append(rec["e"])
            else:
                stored += 1
        per_item = item_bytes(0, frames)
        assert per_item > frames * 200 and stored == MAX_BYTES // per_item
        assert refused and all(e[0] == "QueueFull" and "max_bytes" in e[1] for e in refused)
        assert ch.stats()["bytes_held"] == stored * per_item
        assert rss_bytes(pid) - idle < 3 * MAX_BYTES
        assert ch.qsize("frames") == stored
    finally:
        sock.close()
        ch.close()


def _flood_unread(address: str, messages: list[bytes], marker_key: str) -> zmq.Socket:
    """Send ``messages`` (packed records) from a raw DEALER that never reads a reply (its
    receive queue holds one: the replies stay with the broker), each followed by a put of
    one item under ``marker_key`` (a well-behaved handle counts them to know what the broker
    has read); the socket returned."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.connect(address)
    sock.send_multipart([msgpack.packb([{"op": "hello", "id": 0, "v": PROTOCOL_VERSION}])])
    assert sock.poll(30_000)
    sock.recv_multipart()
    body = msgpack.packb(None)
    for i, records in enumerate(messages):
        put = msgpack.packb([{"op": "put", "id": 1_000_000 + i, "k": marker_key, "nf": 1}])
        sock.send_multipart([records])
        sock.send_multipart([put, body])
    return sock


def test_replies_nobody_reads_share_the_stats_bodies_and_the_peeked_items(bounded_broker):
    """A client that floods ``stats`` and ``peek`` and never reads the replies: each reply
    refers to the one stats body and to the queued items' own bytes (``zmq.Frame``s), where
    pyzmq copied a bytes object under its copy threshold into every reply (256 stats records
    a message made 256 copies of the body; a message of ``peek`` records a copy of each
    peeked item per record: gigabytes from a few MB of requests).  The broker's resident
    memory grows by far less than the copies would take, and it serves the others."""
    pid, address = bounded_broker
    ch = Channel.connect(address, timeout=30)
    for k in range(100):
        ch.put(b"k" * 8, key=f"key-{k}")  # a stats body of some KiB
    for _ in range(512):
        ch.put(b"y" * 480, key="small")
    body_bytes = len(msgpack.packb(ch.stats()))
    rounds = 300
    start = rss_bytes(pid)
    stats = msgpack.packb([{"op": "stats", "id": 10 + j} for j in range(256)])
    flooder = _flood_unread(address, [stats] * rounds, "marker")
    wait_until(lambda: ch.qsize("marker") == rounds, timeout=180)
    grown = rss_bytes(pid) - start
    copies = rounds * 256 * body_bytes
    assert copies > 400 << 20 and grown < 64 << 20, (body_bytes, grown)
    peeks = msgpack.packb([{"op": "peek", "id": 10 + j, "k": "small", "n": 512}
                           for j in range(8)])
    flooder2 = _flood_unread(address, [peeks] * rounds, "marker2")
    wait_until(lambda: ch.qsize("marker2") == rounds, timeout=180)
    grown = rss_bytes(pid) - start
    copies = rounds * 8 * 512 * 480
    assert copies > 500 << 20 and grown < 200 << 20, grown
    ch.put("served", key="other")
    assert ch.get(key="other", timeout=30) == "served"
    flooder.close()
    flooder2.close()
    ch.close()


def test_max_bytes_bounds_a_put_into_an_empty_broker_and_a_collectors_fan_out(run_dir):
    """An item larger than ``max_bytes`` is refused also while the broker holds nothing (it
    was stored then, and only the next one refused), and a collector's outputs of one put are
    refused as soon as they pass ``max_bytes`` (they were all made and stored: 400,000 outputs
    of one 8-byte put held 130 MB under a 1 MB limit)."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "fanout",
                             "--max-bytes", str(MAX_BYTES), "--collector", "hookmods:FanOut"],
                            stdout=subprocess.PIPE, text=True, cwd=tests_dir)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready "), line
        ch = Channel.connect(line.split()[1], timeout=30)
        with pytest.raises(HookError, match="outputs of one put take more than the broker's "
                                            "max_bytes limit") as info:
            ch.put(400_000)
        assert info.value.exc_type == "ValueError"
        stats = ch.stats()
        assert stats["bytes_held"] == 0 and stats["keys"] == {}
        ch.put(10)
        assert ch.qsize() == 10
        ch.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_an_item_over_max_bytes_is_refused_into_an_empty_broker(bounded_broker):
    _, address = bounded_broker
    ch = Channel.connect(address, timeout=30)
    for _ in range(2):
        with pytest.raises(ValueError, match="exceeds the broker's max_bytes limit"):
            ch.put(b"x" * (MAX_BYTES + 1))
    assert ch.stats()["bytes_held"] == 0
    ch.close()
