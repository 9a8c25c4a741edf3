"""What docs/protocol.md tells a client writer, pinned against a live broker.

Each test speaks the wire protocol from a raw ZeroMQ ``DEALER`` (no zchannel client code on that
side), as an independent client written from the documentation would.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
import uuid
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import zmq
from conftest import wait_until
from zchannel.broker import Channel
from zchannel.broker.wire.codec import decode, encode
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, pack_header

DEADLINE_S = 20.0  # generous: a loaded 2-core machine


class Raw:
    """A bare DEALER speaking the protocol: ``send(records, frames)``, ``recv()`` one message as
    ``(records, frames)``."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.backlog: list[tuple[dict, list[bytes]]] = []

    def send(self, records: list[dict], frames: list[bytes] = ()) -> None:
        self.sock.send_multipart([pack_header(records), *frames])

    def recv(self, timeout: float = DEADLINE_S) -> tuple[list[dict], list[bytes]]:
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no message from the broker within {timeout}s")
        header, *frames = self.sock.recv_multipart()
        return msgpack.unpackb(header, raw=False), frames

    def reply(self, rid: int, timeout: float = DEADLINE_S) -> tuple[dict, list[bytes]]:
        """The reply record with id ``rid`` and its frames (heartbeats skipped; other records
        kept for later calls)."""
        end = time.monotonic() + timeout
        while True:
            for i, (rec, frames) in enumerate(self.backlog):
                if rec.get("id") == rid:
                    del self.backlog[i]
                    return rec, frames
            records, frames = self.recv(max(0.0, end - time.monotonic()))
            pos = 0
            for rec in records:
                nf = rec.get("nf", 0)
                if rec.get("op") != "hb":
                    self.backlog.append((rec, frames[pos:pos + nf]))
                pos += nf

    def quiet(self, wait: float = 1.0) -> list[dict]:
        """The records that arrive within ``wait`` seconds, heartbeats left out."""
        got = []
        end = time.monotonic() + wait
        while self.sock.poll(max(0, int((end - time.monotonic()) * 1000))):
            records, _ = self.recv()
            got.extend(r for r in records if r.get("op") != "hb")
        return got

    def hello(self, ident: str | None = None) -> dict:
        self.send([{"op": "hello", "id": 1, "ident": ident, "v": PROTOCOL_VERSION}])
        rec, _ = self.reply(1)
        assert "e" not in rec, rec
        return rec["r"]


@contextlib.contextmanager
def raw_client(ch: Channel, hello: bool = True) -> Iterator[Raw]:
    raw = Raw(ch.address)
    try:
        if hello:
            raw.hello()
        yield raw
    finally:
        raw.sock.close()


def test_hello_of_another_protocol_version_is_refused(channels):
    ch = Channel.create("version")
    channels.append(ch)
    with raw_client(ch, hello=False) as raw:
        for rid, fields in ((1, {"v": PROTOCOL_VERSION + 1}), (2, {}), (3, {"v": "1"})):
            raw.send([{"op": "hello", "id": rid, "ident": None, **fields}])
            rec, _ = raw.reply(rid)
            kind, message, _ = rec["e"]
            assert kind == "ValueError"
            assert f"version {PROTOCOL_VERSION}" in message
            assert repr(fields.get("v")) in message
        # refused: the client is not registered, so a request is answered with `expired`
        raw.send([{"op": "qsize", "id": 4, "k": "q"}])
        records, _ = raw.recv()
        assert records == [{"op": "expired"}]
        # the right version registers it
        info = raw.hello()
        assert info["name"] == "version"
        raw.send([{"op": "qsize", "id": 5, "k": "q"}])
        assert raw.reply(5)[0] == {"id": 5, "r": 0}


@pytest.mark.parametrize("dispatcher", [None, "round_robin"])
def test_hello_with_an_invalid_consumer_id_is_refused(channels, dispatcher):
    """A hello whose ``ident`` is a str but not ``group:rank`` (or too long) is refused with
    an error naming the field and registers nothing; a consumer that joined before and then
    falls silent still leaves the broker serving (its sorted roster never holds a bad id)."""
    ch = Channel.create("idents", identity="actor:1",
                        **({"dispatcher": dispatcher} if dispatcher else {}))
    channels.append(ch)
    with raw_client(ch, hello=False) as good, raw_client(ch, hello=False) as evil:
        good.hello("actor:0")
        good.send([{"op": "get", "id": 2, "k": "q", "nw": True}])
        assert good.reply(2)[0]["e"][0] == "QueueEmpty"
        for rid, ident in ((1, "evil"), (2, "actor:x"), (3, "a" * 300 + ":1")):
            evil.send([{"op": "hello", "id": rid, "ident": ident, "v": PROTOCOL_VERSION}])
            kind, message, _ = evil.reply(rid)[0]["e"]
            assert kind == "ValueError"
            assert "invalid consumer id" in message and "'ident' of hello" in message
        evil.send([{"op": "get", "id": 4, "k": "q", "nw": True}])
        assert evil.recv()[0] == [{"op": "expired"}]  # nothing was registered
    # the consumer that joined is gone without a bye: it expires, the broker serves on
    assert wait_until(lambda: ch.stats()["clients"] == 1, timeout=60)
    ch.put("after", key="q")
    assert ch.get(key="q", timeout=10) == "after"


def test_hello_reply_units(channels):
    ch = Channel.create("units")
    channels.append(ch)
    with raw_client(ch, hello=False) as raw:
        info = raw.hello()
    assert info["hb"] == 1.0 and isinstance(info["hb"], float)  # seconds
    assert info["liveness"] == 3 and isinstance(info["liveness"], int)  # heartbeat intervals
    assert info["deals"] is False and info["maxsize"] == 0


def test_expired_in_reply_to_a_request_of_an_unknown_client(channels):
    ch = Channel.create("unknown")
    channels.append(ch)
    with raw_client(ch, hello=False) as raw:
        raw.send([{"op": "put", "id": 1, "k": "q", "b": encode("lost")[0]}])
        raw.send([{"op": "get", "id": 2, "k": "q", "nw": True}])  # within 0.2 s: not told again
        assert raw.recv()[0] == [{"op": "expired"}]
        assert raw.quiet(1.0) == []
        raw.send([{"op": "bye", "id": 3}])  # bye of an unknown client: nothing at all
        assert raw.quiet(1.0) == []
    assert ch.qsize("q") == 0  # nothing the unknown client sent was done


def test_expired_sent_unprompted_when_a_client_falls_silent(channels):
    ch = Channel.create("silent")
    channels.append(ch)
    with raw_client(ch) as raw:  # says hello, then never sends again
        raw.send([{"op": "get", "id": 7, "k": "q"}])  # parked, withdrawn at expiry
        end = time.monotonic() + DEADLINE_S
        records: list[dict] = []
        while not any(r.get("op") == "expired" for r in records):
            assert time.monotonic() < end, "the broker never expired the silent client"
            records, _ = raw.recv(end - time.monotonic())
        assert records == [{"op": "expired"}]
        ch.put("kept")  # the expired client's parked get is gone: the item stays queued
        assert ch.qsize() == 1


def test_get_batch_completion_rule(channels):
    ch = Channel.create("batch")
    channels.append(ch)
    for i, weight in enumerate([1, 2, 3]):
        ch.put(i, key="q", weight=weight)
    with raw_client(ch) as raw:
        raw.send([{"op": "get_batch", "id": 1, "k": "q", "tw": 3}])
        rec, frames = raw.reply(1)
        assert rec["n"] == [1, 1] and rec["nf"] == 2 and "sm" not in rec
        assert [decode(f) for f in frames] == [0, 1]  # the total reached the target
        raw.send([{"op": "get_batch", "id": 2, "k": "q", "tw": 2}])
        rec, frames = raw.reply(2)
        assert rec["n"] == [1] and [decode(f) for f in frames] == [2]  # one head above target
        # an incomplete batch waits; at its timeout it returns what there is
        ch.put("a", key="q", weight=1)
        raw.send([{"op": "get_batch", "id": 3, "k": "q", "tw": 5, "t": 0.5}])
        rec, frames = raw.reply(3)
        assert [decode(f) for f in frames] == ["a"]


def test_fs_is_optional_and_counts_every_frame_of_the_item(channels):
    ch = Channel.create("fs")
    channels.append(ch)
    array = np.arange(1 << 15, dtype=np.int64)  # 256 KiB: a buffer frame after the body
    body, buffers = encode(array)
    assert len(buffers) == 1
    frames = [body, *(bytes(b) for b in buffers)]
    with raw_client(ch) as raw:
        raw.send([{"op": "put", "id": 1, "k": "q", "nf": 2}], frames)  # no fs
        assert raw.reply(1)[0] == {"id": 1}
        raw.send([{"op": "put", "id": 2, "k": "q", "nf": 2, "fs": [len(f) for f in frames]}],
                 frames)
        assert raw.reply(2)[0] == {"id": 2}
        raw.send([{"op": "put", "id": 3, "k": "q", "nf": 2, "fs": [len(frames[1])]}], frames)
        assert raw.reply(3)[0]["e"][0] == "ValueError"  # the body's size left out
    assert ch.qsize("q") == 2
    assert np.array_equal(ch.get(key="q", timeout=10), array)


def test_key_is_required(channels):
    ch = Channel.create("nokey")
    channels.append(ch)
    with raw_client(ch) as raw:
        for rid, op in enumerate(("get", "qsize", "full"), start=1):
            raw.send([{"op": op, "id": rid, "nw": True}])
            assert raw.reply(rid)[0]["e"][0] == "TypeError", op
        raw.send([{"op": "put", "id": 9, "b": encode(1)[0]}])
        assert raw.reply(9)[0]["e"][0] == "TypeError"
    assert ch.stats()["keys"] == {}


def test_a_key_of_too_many_parts_in_all_is_refused_before_it_is_built(channels):
    """A key nested within the depth limit, each tuple within 64 parts, but of 64**3 parts in
    all (a 0.3 MB header) is refused at once with a ``ValueError``, for every keyed request;
    the broker stores nothing and serves on."""
    ch = Channel.create("widekey")
    channels.append(ch)
    wide = [[list(range(64))] * 64] * 64
    with raw_client(ch) as raw:
        for rid, op in enumerate(("get", "qsize", "full", "peek"), start=1):
            raw.send([{"op": op, "id": rid, "k": wide, "nw": True}])
            kind, message, _ = raw.reply(rid)[0]["e"]
            assert kind == "ValueError" and "64 parts in all" in message, op
        raw.send([{"op": "put", "id": 9, "k": wide, "b": encode(1)[0]}])
        assert "64 parts in all" in raw.reply(9)[0]["e"][1]
        raw.send([{"op": "puts", "id": 10, "p": [{"id": 11, "k": wide, "b": encode(1)[0]}]}])
        assert "64 parts in all" in raw.reply(11)[0]["e"][1]
    assert ch.stats()["keys"] == {}
    ch.put("after", key=("a", ("b",)))
    assert ch.get(key=("a", ("b",)), timeout=10) == "after"


def test_malformed_inputs_dropped_or_answered(channels):
    """The table of docs/protocol.md: what is dropped, what gets an error reply."""
    ch = Channel.create("malformed")
    channels.append(ch)
    with raw_client(ch) as raw:
        dropped = [
            [b"\xc1"],  # not msgpack
            [pack_header([])],  # an empty list
            [pack_header({"op": "get"})],  # not a list
            [pack_header([{"op": "put", "id": 1, "k": "q", "nf": 2}]), b"x"],  # nf sum != frames
            [pack_header([{"op": "get", "id": 2, "k": "q", "nf": -1}])],
            [pack_header([{"op": "qsize", "k": "q"}])],  # no id
            [pack_header([{"op": "qsize", "id": "3", "k": "q"}])],  # id not an int
            [pack_header([{"op": "qsize", "id": True, "k": "q"}])],
        ]
        for message in dropped:
            raw.sock.send_multipart(message)
        assert raw.quiet(1.0) == []
        answered = {
            10: ({"op": "nonsense", "id": 10}, "ValueError"),
            11: ({"op": "put", "id": 11, "k": "q"}, "ValueError"),  # no body
            12: ({"op": "put", "id": 12, "k": "q", "b": "str"}, "ValueError"),
            13: ({"op": "put", "id": 13, "k": "q", "b": b"\x01", "w": -1}, "ValueError"),
            14: ({"op": "get", "id": 14, "k": "q", "t": -1}, "ValueError"),
            15: ({"op": "get_batch", "id": 15, "k": "q"}, "ValueError"),  # no target
            16: ({"op": "get", "id": 16, "k": 1.5}, "TypeError"),
            17: ({"op": "qsize", "id": 17, "k": "q", "c": 3}, "TypeError"),
            18: ({"op": "ack", "id": 18, "lease": 99}, "ValueError"),
        }
        raw.send([rec for rec, _ in answered.values()])
        for rid, (_, kind) in answered.items():
            assert raw.reply(rid)[0]["e"][0] == kind, rid
        # one record's error does not drop the others of its message
        raw.send([{"op": "nonsense", "id": 20}, {"op": "qsize", "id": 21, "k": "q"}])
        assert raw.reply(20)[0]["e"][0] == "ValueError"
        assert raw.reply(21)[0] == {"id": 21, "r": 0}


def test_duplicate_outstanding_ids_are_refused(channels):
    """A request under the id of a waiting request of the same client is a ValueError; the
    waiting one is unaffected, and answered ids may be used again."""
    ch = Channel.create("dupids")
    channels.append(ch)
    with raw_client(ch) as raw:
        raw.send([{"op": "get", "id": 5, "k": "q"}])
        raw.send([{"op": "put", "id": 5, "k": "q", "b": encode("dup")[0]}])
        rec, _ = raw.reply(5)
        assert rec["e"][0] == "ValueError" and "request id 5" in rec["e"][1]
        assert ch.qsize("q") == 0  # the refused put did nothing
        ch.put("x", key="q")
        assert decode(raw.reply(5)[0]["b"]) == "x"  # the waiting get, served
        raw.send([{"op": "put", "id": 5, "k": "q", "b": encode("again")[0]}])
        assert raw.reply(5)[0] == {"id": 5}
    assert ch.get(key="q", timeout=10) == "again"


def test_slot_converted_to_frames_is_indexed_among_the_items_frames(channels):
    """``sm`` (per item) counts the item's frames including the body; ``loc`` counts buffers."""
    ch = Channel.create("slots", shm_threshold=1 << 16)
    channels.append(ch)
    array = np.arange(1 << 14, dtype=np.int64)  # 128 KiB: a slot, not a frame
    ch.put(array, key="q")
    assert ch.stats()["shm"]["slots_in"] == 1
    with raw_client(ch) as raw:  # never proves same-host (no shm_hi): slots become frames
        raw.send([{"op": "get", "id": 1, "k": "q"}])
        rec, frames = raw.reply(1)
    assert rec["nf"] == 2 and rec["sm"] == [[1]]  # frame 1 of the item: the body is frame 0
    assert np.array_equal(np.frombuffer(frames[1], dtype=np.int64), array)


def test_a_refused_put_gives_its_shared_memory_slots_back(channels):
    """Only the broker frees a slot (docs/shm.md): a put it refuses (frame sizes that do not
    match, a NaN weight, a negative timeout: checked before or while the record is decoded)
    gives its slots back to the producer at once, as a stored item's would be once taken."""
    ch = Channel.create("slotback")
    channels.append(ch)
    with raw_client(ch, hello=False) as raw:
        offer = raw.hello()["shm"]
        with open(f"/dev/shm/{offer['probe']}", "rb") as probe:
            token = probe.read(24)[8:24]
        raw.send([{"op": "shm_hi", "id": 0, "tok": token, "cpid": os.getpid()}])
        name = f"{offer['prefix']}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        nslots, slot_size = 4, 1 << 16
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, 4096 + nslots * slot_size)
            segment = mmap.mmap(fd, 4096 + nslots * slot_size)
            struct.pack_into("<8sQQQ", segment, 0, b"ZCSHM001", slot_size, nslots, os.getpid())
            body, _ = encode(None)
            refused = [{"k": "q", "fs": [len(body) + 1]}, {"k": "q", "w": float("nan")},
                       {"k": "q", "t": -1}]
            for slot, fields in enumerate(refused):
                segment[64 + slot] = 1  # USED: the producer's, until the broker frees it
                raw.send([{"op": "put", "id": 10 + slot, "nf": 1, "sm": [[name, slot, 16]],
                           **fields}], [body])
                rec, _ = raw.reply(10 + slot)
                assert rec["e"][0] == "ValueError", rec
            assert list(segment[64:64 + len(refused)]) == [0] * len(refused)  # FREE again
            segment.close()
        finally:
            os.close(fd)
            os.unlink(f"/dev/shm/{name}")


def test_invalid_records_of_ops_without_replies_get_none(channels):
    """``hb``, ``shm_hi`` and ``shm_rel`` are answered with nothing: invalid ones are dropped
    (logged), not answered with an error under id 0; the message's other records are served."""
    ch = Channel.create("noreply")
    channels.append(ch)
    with raw_client(ch) as raw:
        raw.send([{"op": "shm_rel", "id": 0, "h": [2**64 - 1, -1, "x"]},
                  {"op": "shm_hi", "id": 0, "tok": 12345},
                  {"op": "qsize", "id": 7, "k": "q"}])
        assert raw.reply(7)[0] == {"id": 7, "r": 0}
        assert [rec for rec, _ in raw.backlog] + raw.quiet(0.5) == []
