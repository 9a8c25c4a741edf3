"""What one client's requests may leave in the broker for others (docs/security.md, "Hostile
input and limits"): a shared-memory slot reference the broker refuses changes no segment's
owner, a segment belongs only to the client whose pid its name carries, and the windows of
departed producers (retry-safe puts) stay within their budget however many producer ids a
client says hello with.  Real brokers, raw DEALER clients."""

from __future__ import annotations

import mmap
import os
import struct
import tracemalloc
import uuid
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import zmq
from conftest import rss_bytes
from zchannel.broker import Channel, shm
from zchannel.broker.server import producers
from zchannel.broker.server.producers import DUPLICATE, NEW, Producers
from zchannel.broker.wire.codec import encode
from zchannel.broker.wire.protocol import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(240)

T = 64 * 1024  # the channels' shm_threshold: small slots keep the tests light
STATES = 64  # a segment's state bytes: one per slot (docs/shm.md)


class Raw:
    """A raw DEALER client of a channel: records in, replies by id."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, records: list, frames: tuple = ()) -> None:
        self.sock.send_multipart([msgpack.packb(records, use_bin_type=True), *frames])

    def reply(self, rid: int) -> dict:
        """The reply to request ``rid`` (replies to others are skipped)."""
        while True:
            assert self.sock.poll(60_000), f"no reply to request {rid}"
            header, *_ = self.sock.recv_multipart()
            for rec in msgpack.unpackb(header, raw=False):
                if rec.get("id") == rid:
                    return rec

    def prove(self, cpid: int) -> dict:
        """hello, then ``shm_hi`` with the probe's token and ``cpid``: the shm offer."""
        self.send([{"op": "hello", "id": 0, "v": PROTOCOL_VERSION}])
        offer = self.reply(0)["r"]["shm"]
        with open(os.path.join(shm.SHM_DIR, offer["probe"]), "rb") as probe:
            token = probe.read(24)[8:24]
        self.send([{"op": "shm_hi", "id": 0, "tok": token, "cpid": cpid}])
        return offer

    def put_slots(self, rid: int, refs: list) -> dict:
        """A put of the body of None that names the slots ``refs``: its reply."""
        body, _ = encode(None)
        self.send([{"op": "put", "id": rid, "k": "claimed", "nf": 1, "sm": refs}], (body,))
        return self.reply(rid)


@pytest.fixture
def raw(channels) -> Iterator[tuple[Channel, Raw]]:
    """A channel with shared memory (threshold ``T``) and a raw client of it."""
    ch = Channel.create("claims", shm_threshold=T)
    channels.append(ch)
    client = Raw(ch.address)
    try:
        yield ch, client
    finally:
        client.sock.close()


def _reserved_segment(ch: Channel) -> str:
    """Reserve two slots of size ``T`` in ``ch``'s pool: the segment made (named in no put)."""
    assert ch.reserve_shm(T, 2) == 2
    prefix = ch.stats()["shm"]["prefix"]
    (name,) = [n for n in shm.list_segments(prefix) if not n.startswith(f"{prefix}probe-")]
    return name


def _producer_works(ch: Channel) -> None:
    """``ch`` puts an item in a slot of its pool and gets it back."""
    array = np.full(T, 7, np.uint8)
    ch.put(array, key="own", timeout=30)
    assert np.array_equal(ch.get(key="own", timeout=30), array)


def test_a_refused_slot_reference_leaves_the_segment_to_its_producer(raw):
    """A put naming a slot of a segment its producer made but never named in a put (here
    from the producer's own process: the pid in the name matches) is refused, and records
    nothing: the producer's own puts of that segment's slots go on."""
    ch, client = raw
    name = _reserved_segment(ch)
    client.prove(os.getpid())
    rec = client.put_slots(1, [[name, 0, 16]])
    assert rec["e"][0] == "ValueError" and "is not a fresh slot" in rec["e"][1], rec
    assert ch.stats()["shm"]["segments"] == 0  # the refused reference recorded no segment
    _producer_works(ch)
    assert ch.stats()["shm"]["slots_in"] == 1


def test_a_client_cannot_take_a_segment_another_process_made(raw):
    """A client that gave its pid in ``shm_hi`` may name only slots of segments whose name
    carries that pid: naming a fresh slot of another process's segment (its state byte set
    USED, as a same-user process could) is refused with an error naming both processes, and
    the segment stays its maker's."""
    ch, client = raw
    name = _reserved_segment(ch)
    other = os.getppid()  # a running process that is not the segment's maker
    client.prove(other)
    fd = os.open(os.path.join(shm.SHM_DIR, name), os.O_RDWR)
    try:
        segment = mmap.mmap(fd, 4096)
    finally:
        os.close(fd)
    try:
        segment[STATES] = shm.USED
        rec = client.put_slots(1, [[name, 0, 16]])
        segment[STATES] = shm.FREE  # the producer's pool takes it again
    finally:
        segment.close()
    assert rec.get("e") is not None, f"the other process's slot was taken: {rec}"
    kind, message, _ = rec["e"]
    assert kind == "ValueError"
    assert f"made by process {os.getpid()}" in message and f"process {other}" in message
    assert ch.stats()["shm"]["segments"] == 0
    _producer_works(ch)


def test_every_checked_slot_of_a_refused_put_goes_back_and_no_segment_is_recorded(raw):
    """A put whose slot references are refused (one out of range, one slot named twice)
    gives back the slots of its references that checked out, whichever reference was
    refused, and records none of the segments it named."""
    ch, client = raw
    client.prove(os.getpid())
    prefix = ch.stats()["shm"]["prefix"]
    name = f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    nslots, slot_size = 4, 1 << 16
    fd = os.open(os.path.join(shm.SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096 + nslots * slot_size)
        segment = mmap.mmap(fd, 4096 + nslots * slot_size)
        struct.pack_into("<8sQQQ", segment, 0, b"ZCSHM001", slot_size, nslots, os.getpid())
        segment[STATES:STATES + nslots] = bytes([shm.USED]) * nslots
        rec = client.put_slots(1, [[name, 99, 16], [name, 1, 16], [name, 2, 16]])
        assert rec["e"][1] == "shared-memory slot reference out of range", rec
        assert list(segment[STATES:STATES + nslots]) == [shm.USED, shm.FREE, shm.FREE, shm.USED]
        rec = client.put_slots(2, [[name, 3, 16], [name, 3, 16]])
        assert rec["e"][0] == "ValueError" and "named twice in one put" in rec["e"][1], rec
        assert segment[STATES + 3] == shm.FREE
        assert ch.stats()["shm"]["segments"] == 0
        segment[STATES] = shm.USED  # an ordinary put of its own slot is stored
        segment[STATES + 1] = shm.USED
        assert "e" not in client.put_slots(3, [[name, 1, 16]])
        assert ch.stats()["shm"]["segments"] == 1 and ch.qsize("claimed") == 1
        segment.close()
    finally:
        os.close(fd)
        os.unlink(os.path.join(shm.SHM_DIR, name))


class _Session:
    producer = None


def test_departed_windows_are_packed_within_their_budget_and_still_recognise_retries():
    """However many producers depart, their windows and forgotten sequences take at most
    ``DEPARTED_BYTES`` (measured with ``tracemalloc``: 65,536 unpacked windows took 158 MB),
    the first to depart going first; a departed window kept, packed, still recognises its
    producer's retries."""
    table = Producers(grace=60.0)
    real = _Session()
    table.attach(real, b"r" * 16)
    assert [real.producer.begin(seq) for seq in (1, 2, 5)] == [NEW] * 3
    table.detach(real, now=0.0)
    back = _Session()
    table.attach(back, b"r" * 16)
    assert [back.producer.begin(seq) for seq in (1, 2, 3, 5)] == [DUPLICATE, DUPLICATE, NEW,
                                                                  DUPLICATE]
    table.detach(back, now=0.0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(65_536):
            flood = _Session()
            table.attach(flood, i.to_bytes(16, "big"))
            flood.producer.begin(1 + i % 7)
            table.detach(flood, now=1.0)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 8 << 20, f"departed windows took {grown / 2**20:.1f} MiB"
    assert table.kept_bytes <= producers.DEPARTED_BYTES == 8 << 20
    assert len(table.windows) < 65_536 // 2 and b"r" * 16 not in table.windows  # pushed out


def test_the_window_budget_counts_what_the_table_keeps():
    """Through departures, returns, a second session ending, sweeps and evictions for room,
    the bytes counted are those of the departed windows kept and the sequences forgotten, and
    stay within the budget."""
    table = Producers(grace=5.0, limit=64, departed_bytes=20 * producers.FORGOTTEN_COST)

    def counted() -> int:
        return (sum(w.cost() for w in table.departed.values())
                + producers.FORGOTTEN_COST * len(table.forgotten))

    sessions = {}
    for i in range(200):
        producer = bytes([i % 90]) * 16
        session = sessions[i] = _Session()
        table.attach(session, producer)
        session.producer.begin(1 + i)
        if i % 3:
            table.detach(session, now=float(i))
        if i % 7 == 0 and i >= 2 and sessions[i - 2].producer is not None:
            table.detach(sessions[i - 2], now=float(i))
        if i % 50 == 49:
            table.sweep(now=float(i))
        assert table.kept_bytes == counted() <= table.departed_bytes
    assert table.forgotten and table.departed


def _hellos(client: Raw, count: int, per_message: int = 256) -> None:
    """``count`` hellos from ``client``, each with a fresh producer id and followed by a put
    and a get of its item (each hello ends the session before it: its window departs), then a
    ``qsize`` whose reply says the broker read them all; replies are read as they come."""
    body, _ = encode(None)
    for start in range(0, count, per_message):
        records, frames = [], []
        for _ in range(min(per_message, count - start)):
            records.append({"op": "hello", "id": 0, "v": PROTOCOL_VERSION, "pr": os.urandom(16)})
            records.append({"op": "put", "id": 1, "k": "w", "nf": 1, "nw": True})
            records.append({"op": "get", "id": 2, "k": "w", "nw": True})  # the put's room back
            frames.append(body)
        client.send(records, tuple(frames))
        while client.sock.poll(0):
            client.sock.recv_multipart()
    client.send([{"op": "qsize", "id": 3, "k": "w"}])
    assert client.reply(3) == {"id": 3, "r": 0}


def test_a_flood_of_producer_ids_stays_within_the_window_budget(bounded_broker):
    """One client saying hello with 65,536 fresh producer ids, a put after each, grows a
    broker with ``--max-bytes 1 MiB`` by about the departed windows' budget and its replies'
    slack, not by a window per id (it grew by 114-167 MB); the broker serves on."""
    pid, address = bounded_broker
    client = Raw(address)
    ch = Channel.connect(address)
    try:
        _hellos(client, 4096)  # the paths the flood takes, once, before measuring
        idle = rss_bytes(pid)
        _hellos(client, 65_536)
        grown = rss_bytes(pid) - idle
        # the departed windows' budget (8 MiB) and the allocator's slack for the replies
        assert grown < 32 << 20, f"the broker grew by {grown / 2**20:.0f} MiB"
        ch.put("after", key="good", timeout=30)
        assert ch.get(key="good", timeout=30) == "after"
    finally:
        client.sock.close()
        ch.close()
