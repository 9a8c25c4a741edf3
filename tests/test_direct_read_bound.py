"""Each read of the same-host direct link is bounded (broker/transport/direct_framing.py,
``READ_BYTES``): a read of a stream socket goes on copying for as long as the writer keeps
writing, so a read offered the whole of a large message could take all of it in one system call
(a broker reading 300 MiB that way served no other client for ~1 s, and at ~1 GB its clients
expired).  The broker's per-turn budget (``direct_broker.READ_BUDGET``, checked between reads)
then holds.  Measured on what each ``os.readv`` is offered, in a real broker process and in a
real client, while a 64 MiB value crosses the link both ways."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading

import pytest
from zchannel.broker import Channel
from zchannel.broker.transport import direct_framing

pytestmark = pytest.mark.timeout(240)
BIG = 64 << 20

# A broker process whose ``os.readv`` notes the largest buffers it was offered and the largest
# count it returned (in the file argv[1], rewritten each time one grows), then the broker CLI.
_SPIED_BROKER = r"""
import os, runpy, sys

record, largest = sys.argv[1], [0, 0]
real_readv = os.readv

def readv(fd, buffers):
    offered = sum(memoryview(b).nbytes for b in buffers)
    n = real_readv(fd, buffers)
    if offered > largest[0] or n > largest[1]:
        largest[0], largest[1] = max(largest[0], offered), max(largest[1], n)
        with open(record + ".new", "w") as f:
            f.write(f"{largest[0]} {largest[1]}")
        os.replace(record + ".new", record)
    return n

os.readv = readv
sys.argv = ["zchannel", "broker", *sys.argv[2:]]
runpy.run_module("zchannel.cli.main", run_name="__main__")
"""


@pytest.fixture
def spied_broker(run_dir, tmp_path):
    """A ``zchannel broker spied`` process whose reads are noted: (address, record file)."""
    record = str(tmp_path / "reads")
    proc = subprocess.Popen([sys.executable, "-c", _SPIED_BROKER, record, "spied"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ready "), line
        yield line.split()[1], record
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _value(seed: int) -> bytes:
    """A value of ``BIG`` bytes whose every MiB differs (a misplaced piece shows)."""
    return b"".join(bytes([(seed + i) & 0xFF]) * (1 << 20) for i in range(BIG >> 20))


def test_the_broker_reads_a_large_message_in_bounded_reads(spied_broker):
    """A 64 MiB bytes value (one frame: bytes never use shared memory) put over the direct
    link: the broker reads it in reads offered ``READ_BYTES`` at most, and it arrives whole."""
    address, record = spied_broker
    producer = Channel.connect(address, timeout=30)
    consumer = Channel.connect(address, timeout=30)
    try:
        assert producer._connection().direct, "the producer is not on the direct link"
        for seed in range(2):
            value = _value(seed)
            producer.put(value, timeout=60)
            assert consumer.get(timeout=60) == value
        with open(record) as f:
            offered, returned = map(int, f.read().split())
        assert offered <= direct_framing.READ_BYTES, (
            f"one broker read was offered {offered} bytes (bound {direct_framing.READ_BYTES})")
        assert returned <= direct_framing.READ_BYTES
    finally:
        producer.close()
        consumer.close()


def test_a_client_reads_a_large_reply_in_bounded_reads(cli_broker, monkeypatch):
    """A 64 MiB value got over the direct link: the client's reader (the same ``Reader``)
    reads it in reads offered ``READ_BYTES`` at most, and it arrives whole."""
    address = cli_broker("replies")
    offered: list[int] = []
    real_readv = os.readv

    def readv(fd: int, buffers: list) -> int:
        offered.append(sum(memoryview(b).nbytes for b in buffers))
        return real_readv(fd, buffers)

    ch = Channel.connect(address, timeout=30)
    try:
        assert ch._connection().direct, "the handle is not on the direct link"
        value = _value(7)
        ch.put(value, timeout=60)
        monkeypatch.setattr(os, "readv", readv)
        assert ch.get(timeout=60) == value
        monkeypatch.undo()
        assert offered, "the reply was not read through the direct link's reader"
        assert max(offered) <= direct_framing.READ_BYTES, (
            f"one client read was offered {max(offered)} bytes")
    finally:
        monkeypatch.undo()
        ch.close()


def _frame(parts: list) -> bytes:
    return b"".join(bytes(p) for p in direct_framing.iovec(parts)[0])


@pytest.mark.parametrize("seed", range(4))
def test_bounded_reads_cut_large_messages_of_many_parts_intact(seed, monkeypatch):
    """Messages with parts on both sides of every bound (``SMALL_PART``, ``RUN_BYTES``,
    ``READ_BYTES``), written by a thread into a socket pair while the reader reads: every read
    is offered ``READ_BYTES`` at most and every part arrives intact and in order."""
    rng = random.Random(seed)
    sizes = [0, 100, direct_framing.SMALL_PART - 1, direct_framing.SMALL_PART, 1 << 20,
             direct_framing.READ_BYTES - 1, direct_framing.READ_BYTES,
             direct_framing.READ_BYTES + 3, 9 << 20]
    messages = [[b"head", *(rng.randbytes(rng.choice(sizes)) for _ in range(rng.randint(1, 12)))]
                for _ in range(4)]
    data = b"".join(_frame(parts) for parts in messages)
    reader = direct_framing.Reader(1 << 20, 1 << 30)
    writer_end, reader_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    writer = threading.Thread(target=writer_end.sendall, args=(data,), daemon=True)
    offered: list[int] = []
    real_readv = os.readv

    def readv(fd: int, buffers: list) -> int:
        offered.append(sum(memoryview(b).nbytes for b in buffers))
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", readv)
    try:
        writer.start()
        while len(reader.messages) < len(messages):
            assert reader.read(reader_end.fileno()), "end of stream"
    finally:
        monkeypatch.undo()
        writer.join(60)
        writer_end.close()
        reader_end.close()
    assert max(offered) <= direct_framing.READ_BYTES
    assert [[bytes(p) for p in parts] for parts in reader.messages] == messages
