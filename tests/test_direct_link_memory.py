"""A direct-link message's parts do not keep each other alive (broker/transport/direct_framing.py):
a large part is read into a buffer of its own and the small parts of a large message are copied
out, so an item the broker keeps holds only its own bytes, not the rest of the message it came
in (the other items, consumed long ago).  ``--max-bytes`` then bounds the broker's memory over
the direct link as over ZeroMQ (docs/security.md, "Hostile input and limits", **Memory**): the
broker's resident memory, read from ``/proc/<pid>/status``, stays flat while small items that
came with 16 MiB ones stay queued, where it grew by each of those messages whole."""

from __future__ import annotations

import random
import socket

import msgpack
import numpy as np
import pytest
from conftest import rss_bytes
from rawlink import RawLink, frame
from zchannel.broker import Channel
from zchannel.broker.transport import direct_framing
from zchannel.broker.wire.protocol import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(240)
MAX_BYTES = 64 << 20
BIG = 16 << 20
# Resident growth allowed while the small items stay queued: the allocator keeps a freed large
# buffer or two for reuse (the new reader measured +0-16 MiB).  Each 16 MiB message a small item
# kept alive whole made the old reader grow by ~370 MiB for 23 messages, ~140-260 MiB for the
# 23 bursts of the ordinary client.
ALLOWED_GROWTH = 64 << 20


def _bin(payload: bytes) -> bytes:
    """``payload`` as a msgpack bin: a put body of a raw client."""
    return msgpack.packb(payload, use_bin_type=True)


def _put_small_and_big_and_take_the_big(link: RawLink, round_: int) -> None:
    """One message [header, a 1000-byte put to ``small``, a 16 MiB put to ``big``] with a get
    of ``big`` in it: the small item stays queued, the big one leaves at once."""
    rid = 10 + 3 * round_
    link.send([{"op": "put", "id": rid, "k": "small", "nf": 1},
               {"op": "put", "id": rid + 1, "k": "big", "nf": 1},
               {"op": "get", "id": rid + 2, "k": "big", "t": 30}],
              [_bin(bytes([round_]) * 1000), _bin(bytes([round_]) * BIG)])
    replies = link.replies({rid, rid + 1, rid + 2})
    assert not replies[rid][0].get("e") and not replies[rid + 1][0].get("e"), replies
    got, frames = replies[rid + 2]
    assert not got.get("e") and len(frames) == 1, got
    assert bytes(frames[0][-16:]) == bytes([round_]) * 16


def test_a_queued_small_item_does_not_keep_its_messages_large_item(cli_broker):
    address = cli_broker("kept", "--max-bytes", str(MAX_BYTES))
    ch = Channel.connect(address, timeout=30)
    link = RawLink(address)
    try:
        pid = ch.stats()["pid"]
        link.send([{"op": "hello", "id": 0, "v": PROTOCOL_VERSION}])
        assert not link.replies({0})[0][0].get("e")
        _put_small_and_big_and_take_the_big(link, 0)  # the path once, before measuring
        idle = rss_bytes(pid)
        rounds = 24
        for round_ in range(1, rounds):
            _put_small_and_big_and_take_the_big(link, round_)
        grown = rss_bytes(pid) - idle
        assert ch.qsize("small") == rounds and ch.qsize("big") == 0
        assert grown < ALLOWED_GROWTH, (
            f"the broker grew by {grown >> 20} MiB holding {ch.stats()['bytes_held']} bytes")
        for round_ in range(rounds):  # the kept items are whole and in order
            assert ch.get(key="small", timeout=30) == bytes([round_]) * 1000
    finally:
        link.close()
        ch.close()


def test_bursts_of_an_ordinary_client_leave_only_their_small_items(cli_broker):
    """A handle's async puts go out together in one direct-link message: 8 of 2 MiB and one
    of 1000 bytes per burst; the 2 MiB items are taken, the small ones stay."""
    address = cli_broker("bursts", "--max-bytes", str(MAX_BYTES))
    ch = Channel.connect(address, timeout=30)
    try:
        assert ch._connection().direct
        pid = ch.stats()["pid"]
        big = b"x" * (2 << 20)

        def burst(round_: int) -> None:
            works = [ch.put(big, key="big", async_op=True) for _ in range(8)]
            works.append(ch.put(bytes([round_]) * 1000, key="status", async_op=True))
            for work in works:
                work.wait(60)
            for _ in range(8):
                assert ch.get(key="big", timeout=30) == big

        burst(0)  # the path once, before measuring
        idle = rss_bytes(pid)
        rounds = 24
        for round_ in range(1, rounds):
            burst(round_)
        grown = rss_bytes(pid) - idle
        assert ch.qsize("status") == rounds and ch.qsize("big") == 0
        assert grown < ALLOWED_GROWTH, (
            f"the broker grew by {grown >> 20} MiB holding {ch.stats()['bytes_held']} bytes")
        for round_ in range(rounds):
            assert ch.get(key="status", timeout=30) == bytes([round_]) * 1000
    finally:
        ch.close()


def _read_all(data: bytes, rng: random.Random) -> list[list]:
    """The messages a ``Reader`` cuts from ``data`` written to a socket in pieces of odd sizes,
    read as they arrive."""
    reader = direct_framing.Reader(1 << 20, 1 << 30)
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        left.setblocking(False)
        right.setblocking(False)
        pos = 0
        while True:
            if pos < len(data):
                size = rng.choice([1, 7, 4096, 100_000, 1 << 20])
                try:
                    pos += left.send(data[pos : pos + size])
                except BlockingIOError:
                    pass
            try:
                assert reader.read(right.fileno()), "end of stream"
            except BlockingIOError:
                if pos == len(data):
                    break
        assert reader.big is None
        return list(reader.messages)
    finally:
        left.close()
        right.close()


@pytest.mark.parametrize("seed", range(6))
def test_the_reader_gives_every_large_part_a_buffer_of_its_own(seed):
    """Messages of mixed part sizes (empty, small, long runs of small ones, large, a large
    header), written in odd pieces: every part arrives intact, as ``bytes`` (the header always)
    or as a writable view of a buffer of exactly its size, never of a buffer it shares; a part
    of 1 MiB of a large message is not copied (a view)."""
    rng = random.Random(seed)
    messages = []
    for _ in range(4):
        lens = [rng.choice([10, 70_000, 200_000])]  # the header
        lens += [rng.choice([0, 1, 5000, 60_000, 70_000, 200_000, 1 << 20]) for _ in range(40)]
        messages.append([rng.randbytes(n) for n in lens])
    messages.append([b"h", *[rng.randbytes(60_000) for _ in range(40)], rng.randbytes(1 << 20)])
    messages.append([b"tiny", b"message"])
    data = b"".join(frame(parts) for parts in messages)
    got = _read_all(data, rng)
    for sent, parts in zip(messages, got, strict=True):
        assert [bytes(p) for p in parts] == sent
        assert type(parts[0]) is bytes
        for part in parts[1:]:
            if type(part) is bytes:
                assert len(part) < 1 << 20 or len(frame(sent)) <= direct_framing.SCRATCH // 2
                continue
            assert isinstance(part, memoryview) and not part.readonly
            owner = part.obj
            assert isinstance(owner, np.ndarray) and owner.nbytes == part.nbytes, (
                f"a part of {part.nbytes} bytes keeps a buffer of {owner.nbytes} alive")
