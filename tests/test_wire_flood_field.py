"""One client's hostile headers and idle direct links cost a broker little
(docs/security.md, "Hostile input and limits"; docs/protocol.md, "Malformed input").

- A header over a limit is refused by what it declares before it is decoded: the record count
  is read from the first bytes of its msgpack array, and a put's ``sm`` list by its length.
  Each message, handled or dropped, counts its header bytes and frames against the loop
  turn's budget, so the replies and heartbeats of other clients go out between floods.  A
  client sending 1 MiB headers of a million empty maps (or puts naming 60,000 shared-memory
  slots) some 100 times a second stopped the broker answering anyone.
- A record that is not a valid request no longer holds its message in a reference cycle (its
  validation error's traceback) until the next garbage collection: 300 such 1 MiB messages
  grew the broker by ~300 MB.
- A direct link's read buffer is taken at its first read, small, grows while a message needs
  it and is given back when the link goes quiet or closes: each link took 256 KiB at accept,
  kept after it closed (1,000 idle links: +258 MB).

Each test runs a real ``zchannel broker`` process, floods it from raw sockets and measures
the well-behaved handle's round trips or the broker's resident memory (``/proc/PID/status``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import msgpack
import pytest
import zmq
from conftest import rss_bytes, wait_until
from rawlink import RawLink
from zchannel.broker import Channel
from zchannel.broker.shm.claims import MAX_REFS
from zchannel.broker.wire.protocol import (
    MAX_HEADER_BYTES,
    MAX_RECORDS,
    PROTOCOL_VERSION,
    pack_header,
)

pytestmark = pytest.mark.timeout(300)

# a header of MAX_HEADER_BYTES: an array of ~1M empty maps (over MAX_RECORDS records)
_MAPS = MAX_HEADER_BYTES - 5
MAPS_HEADER = b"\xdd" + _MAPS.to_bytes(4, "big") + b"\x80" * _MAPS
# one put naming 60,000 shared-memory slots (over MAX_REFS)
SLOTS_HEADER = msgpack.packb([{"op": "put", "id": 1, "k": "a", "b": b"x",
                               "sm": [["seg", 1, 2]] * 60_000}])
# one get whose key is a million empty lists: within every limit, refused once decoded (a
# key has at most 64 parts), and its decoding costs ~50 ns a byte (a million lists built)
KEY_HEADER = msgpack.packb([{"op": "get", "id": 5, "k": [[]] * (MAX_HEADER_BYTES - 64),
                             "nw": True}])
# one get with an invalid timeout, its record made 1 MiB by a field no request has
INVALID_HEADER = msgpack.packb([{"op": "get", "id": 1, "k": "a", "t": "soon",
                                 "zz": b"z" * (MAX_HEADER_BYTES - 64)}])
MiB = 1 << 20


@pytest.fixture
def broker(cli_broker) -> Callable[..., tuple[int, str]]:
    """``start(name, config=TOML)``: a ``zchannel broker`` process (``cli_broker``'s), (pid,
    address) once it printed ``ready``; its log goes to the test's stderr (a flood's warnings
    never fill a pipe)."""

    def start(name: str, config: str | None = None) -> tuple[int, str]:
        address = cli_broker(name, config=config)
        probe = Channel.connect(address, timeout=30)
        try:
            return probe.stats(exclude_self=True)["pid"], address
        finally:
            probe.close()

    return start


def _hello(ident: int) -> dict:
    return {"op": "hello", "id": ident, "v": PROTOCOL_VERSION}


class Flood(threading.Thread):
    """Sends ``count`` messages of ``headers`` in turn from a raw ZeroMQ DEALER, ``rate`` a
    second at most (as fast as the socket takes them with 0), then a hello, whose reply
    proves the broker handled every message before it (a DEALER's messages are handled in
    order); ``sent`` counts them, ``done`` is set once the reply came or the flood failed."""

    def __init__(self, address: str, headers: list[bytes], count: int, rate: float) -> None:
        super().__init__(daemon=True)
        self.address, self.headers, self.count, self.rate = address, headers, count, rate
        self.sent = 0
        self.answered = False
        self.done = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 8)
        sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        sock.connect(self.address)
        try:
            self._send_all(sock)
            sock.send_multipart([pack_header([_hello(7)])])
            self.answered = self._hello_answered(sock)
        finally:
            sock.close()
            ctx.term()
            self.done.set()

    def _send_all(self, sock: zmq.Socket) -> None:
        next_at = time.monotonic()
        while self.sent < self.count and not self.stop.is_set():
            if self.rate:  # pacing the flood, not waiting for anything
                time.sleep(max(0.0, next_at - time.monotonic()))
                next_at += 1 / self.rate
            if sock.poll(100, zmq.POLLOUT):
                sock.send_multipart([self.headers[self.sent % len(self.headers)]])
                self.sent += 1

    def _hello_answered(self, sock: zmq.Socket) -> bool:
        deadline = time.monotonic() + 120
        while not self.stop.is_set() and time.monotonic() < deadline:
            if sock.poll(200, zmq.POLLIN):
                records = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
                if any(r.get("id") == 7 for r in records):
                    return True
        return False


def _round_trips_while(good: Channel, flood: Flood) -> int:
    """Put and get a fresh value on ``good`` until ``flood`` is done, each with a generous
    timeout (a broker that stops answering fails them with ``BrokerUnavailable`` after its
    heartbeat expiry); the round trips made."""
    done = 0
    while not flood.done.is_set():
        value = f"{done}-{uuid.uuid4().hex}"
        good.put(value, key="good", timeout=60)
        assert good.get(key="good", timeout=60) == value
        done += 1
    return done


@pytest.mark.parametrize("headers", [[MAPS_HEADER], [MAPS_HEADER, SLOTS_HEADER]],
                         ids=["records", "records-and-slots"])
def test_a_flood_of_over_limit_headers_leaves_other_clients_served(broker, headers):
    """400 headers over a limit at 100 a second, while a handle puts and gets: every round
    trip succeeds, and the flood's closing hello is answered (the broker read it all)."""
    assert _MAPS > MAX_RECORDS and 60_000 > MAX_REFS
    _, address = broker("flood")
    good = Channel.connect(address)
    flood = Flood(address, headers, count=400, rate=100)
    flood.start()
    try:
        assert _round_trips_while(good, flood) > 0
        assert flood.sent == 400 and flood.answered
    finally:
        flood.stop.set()
        flood.join(60)
        good.close()


def test_refused_records_do_not_hold_their_messages(broker):
    """300 messages of 1 MiB whose one record is invalid (a timeout that is text) are each
    answered and let go at once: the broker's resident memory grows by far less than they
    add up to (each one's validation error used to keep it in a reference cycle)."""
    pid, address = broker("invalid")
    before = rss_bytes(pid)
    flood = Flood(address, [INVALID_HEADER], count=300, rate=100)
    flood.start()
    flood.join(240)
    assert flood.answered, "the broker did not answer the hello after the flood"
    grown = rss_bytes(pid) - before
    assert grown < 100 * MiB, f"the broker grew by {grown / MiB:.0f} MiB for 300 MiB refused"


def test_a_direct_link_flooding_costly_headers_leaves_other_clients_served(broker):
    """A direct link that said hello sends 200 headers of 1 MiB, each a key of a million empty
    lists, back to back; a handle's round trips meanwhile all succeed.  The broker reads 32 MiB
    of a link per turn, and used to decode all their headers before it answered anyone (seconds
    a turn); it now handles 1 MiB of a link's headers per turn."""
    assert len(KEY_HEADER) <= MAX_HEADER_BYTES
    _, address = broker("dflood")
    good = Channel.connect(address)
    link = RawLink(address)
    link.send([_hello(1)])
    link.replies({1})
    done = threading.Event()

    def flood() -> None:
        try:
            for _ in range(200):
                link.send_parts([KEY_HEADER])
        except OSError:
            pass  # the link closed: the round trips say whether others were served
        finally:
            done.set()

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    try:
        trips = 0
        while not done.is_set():
            value = f"{trips}-{uuid.uuid4().hex}"
            good.put(value, key="good", timeout=60)
            assert good.get(key="good", timeout=60) == value
            trips += 1
        assert trips > 0
    finally:
        link.close()
        sender.join(60)
        good.close()


def _connections(ch: Channel) -> int:
    return ch.stats(exclude_self=True)["connections"]


def test_idle_and_closed_direct_links_cost_the_broker_little(broker):
    """250 links that send nothing and 250 that say hello and send a 100 KB request (their
    read buffer grows for it) cost the broker under 20 MB of resident memory once the links are
    quiet, and again once they are closed (each took 256 KiB at accept, kept after it closed:
    +128 MB).  The broker's heartbeat interval is long enough that none is closed for its
    silence meanwhile."""
    pid, address = broker("idlelinks", config="[channel]\nheartbeat_interval = 10\n")
    observer = Channel.connect(address)
    links: list[RawLink] = []
    try:
        base = _connections(observer)
        before = rss_bytes(pid)
        big = pack_header([{"op": "get", "id": 2, "k": "none", "nw": True,
                            "zz": b"z" * 100_000}])  # a field no request has: skipped
        for i in range(500):
            link = RawLink(address)
            links.append(link)
            if i % 2:
                link.send([_hello(1)])
                link.send_parts([big])
        for link in links[1::2]:
            replies = link.replies({1, 2})
            assert replies[2][0]["e"][0] == "QueueEmpty"
        accepted = wait_until(lambda: _connections(observer) >= base + 500, timeout=60)
        assert accepted, f"{_connections(observer) - base} of 500 links accepted"
        quiet = wait_until(lambda: rss_bytes(pid) - before < 20 * MiB, timeout=60)
        assert quiet, f"500 quiet links: the broker grew by {(rss_bytes(pid) - before) / MiB:.0f} MiB"
        for link in links:
            link.close()
        assert wait_until(lambda: _connections(observer) <= base, timeout=60)
        closed = wait_until(lambda: rss_bytes(pid) - before < 20 * MiB, timeout=60)
        assert closed, f"500 closed links: the broker kept {(rss_bytes(pid) - before) / MiB:.0f} MiB"
    finally:
        for link in links:
            link.close()
        observer.close()
