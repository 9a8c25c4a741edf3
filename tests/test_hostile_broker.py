"""A client facing a broker that answers wrongly: a real client against a ROUTER socket that
says hello and heartbeats as a broker does, then answers one request with a malformed or
wrong-typed reply.  The call fails with a ``ProtocolError`` naming what was wrong; it never
hangs and never returns a value of the wrong type."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import pytest
import zmq
from zchannel.broker import Channel
from zchannel.broker.wire import codec
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, ProtocolError, QSize

pytestmark = pytest.mark.timeout(120)

HELLO = {"name": "hostile", "pid": 1, "hb": 1.0, "liveness": 3, "deals": False, "maxsize": 0,
         "max_message_bytes": 0, "shm": None, "v": PROTOCOL_VERSION}
Answer = Callable[[dict], list]


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class HostileBroker:
    """A ROUTER at ``address`` answering hello, bye and heartbeats as a broker does, and every
    other request with ``answer(record)`` (the message parts to send; [] for none)."""

    def __init__(self, address: str, answer: Answer, hello: dict = HELLO,
                 hello_error: list | None = None) -> None:
        self.address, self.answer, self.hello = address, answer, hello
        self.hello_error = hello_error  # the hello's answer is this error reply when set
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        peers: set[bytes] = set()
        while not self.stop.is_set():
            if self.sock.poll(100):
                ident, header, *_frames = self.sock.recv_multipart()
                peers.add(ident)
                for rec in msgpack.unpackb(header, raw=False):
                    op = rec.get("op")
                    if op == "hello":
                        answer = ({"e": self.hello_error} if self.hello_error is not None
                                  else {"r": self.hello})
                        self.sock.send_multipart([ident, _pack([{"id": rec["id"], **answer}])])
                    elif op == "bye":
                        self.sock.send_multipart([ident, _pack([{"id": rec["id"], "r": True}])])
                    elif op not in ("hb", "shm_hi", "shm_rel"):
                        parts = self.answer(rec)
                        if parts:
                            self.sock.send_multipart([ident, *parts])
            for ident in peers:  # a live broker's heartbeat
                self.sock.send_multipart([ident, _pack([{"op": "hb"}])])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        self.sock.close()


@pytest.fixture
def hostile(run_dir, monkeypatch) -> Iterator[Callable[[Answer], Channel]]:
    monkeypatch.setenv("ZCHANNEL_DIRECT", "0")
    made: list[tuple[HostileBroker, Channel]] = []

    def connect(answer: Answer) -> Channel:
        broker = HostileBroker(f"ipc://{run_dir}/hostile{len(made)}.sock", answer)
        ch = Channel.connect(broker.address, timeout=30)
        made.append((broker, ch))
        return ch

    yield connect
    for broker, ch in made:
        ch.close()
        broker.close()


def _reply(**fields) -> Answer:
    return lambda rec: [_pack([{"id": rec["id"], **fields}])]


UNREADABLE = [
    ("an error that is not a list", "qsize", _reply(e="boom"), "at `\\$.e`"),
    ("an id that is not an int", "qsize", lambda rec: [_pack([{"id": str(rec["id"]), "r": 1}])],
     "at `\\$.id`"),
    ("a negative frame count", "qsize", _reply(r=1, nf=-1), "nf must be an int"),
    ("a header that is not msgpack", "qsize", lambda rec: [b"\xc1"], "malformed reply header"),
    ("frames the header does not declare", "qsize", lambda rec: [_pack([{"id": rec["id"]}]),
                                                                  b"x"], "declares 0 frames"),
    ("an inline body that is a str", "get", _reply(b="text"), "at `\\$.b`"),
    ("a lease that is a str", "get", _reply(b=_pack(1), lease="x"), "at `\\$.lease`"),
    ("an items entry too long to be inline", "get",
     lambda rec: [_pack([{"op": "items", "i": [[rec["id"], b"x" * 600, None]]}])],
     "'items' record"),
    ("a batch of no inline bodies", "get_batch", _reply(bs=[]), "at `\\$.bs`"),
]


def _call(ch: Channel, op: str):
    if op == "qsize":
        return ch._submit(QSize(id=0, key="k"))  # qsize() without waiting
    if op == "get":
        return ch.get(key="k", timeout=5, async_op=True)
    return ch.get_batch(2, key="k", timeout=5, async_op=True)


@pytest.mark.parametrize("what,op,answer,match", UNREADABLE, ids=[c[0] for c in UNREADABLE])
def test_an_unreadable_reply_fails_the_call_at_once(hostile, what, op, answer, match):
    ch = hostile(answer)
    work = _call(ch, op)
    with pytest.raises(ProtocolError, match=match):
        work.wait(30)  # (the broker's timeout of 5 s never comes: nothing answers in time)


WRONG = [
    ("a qsize that is a str", "qsize", _reply(r="3"), "expected an int >= 0"),
    ("a qsize below 0", "qsize", _reply(r=-1), "expected an int >= 0"),
    ("a full that is an int", "full", _reply(r=5), "expected a bool"),
    ("stats that are an int", "stats", lambda rec: [_pack([{"id": rec["id"], "nf": 1}]),
                                                    _pack(7)], "stats are a map"),
    ("stats without a frame", "stats", _reply(r=None), "stats are a map"),
    ("a get with ack answered without a lease", "get_ack", _reply(b=_pack(1)),
     "without a lease"),
    ("a get answered with a lease it did not ask for", "get", _reply(b=_pack(1), lease=3),
     "with a lease"),
    ("a get answered with no item", "get", _reply(r=None), "no item"),
    ("a batch whose frames are not counted", "get_batch",
     lambda rec: [_pack([{"id": rec["id"], "nf": 2}]), _pack(1), _pack(2)], "counted as"),
    ("a batch counting more frames than came", "get_batch",
     lambda rec: [_pack([{"id": rec["id"], "nf": 1, "n": [1, 1]}]), _pack(1)], "counted as"),
    ("a batch of no item", "get_batch", _reply(n=[]), "a batch is never empty"),
    ("a batch answered with nothing", "get_batch", _reply(r=None), "a batch is never empty"),
    ("shared-memory entries not one per item", "get_batch",
     lambda rec: [_pack([{"id": rec["id"], "nf": 1, "n": [1], "sm": [None, None, None]}]),
                  _pack(1)], "3 shared-memory entries for a batch of 1 items"),
]


def _call_sync(ch: Channel, op: str):
    return {"qsize": lambda: ch.qsize("k"), "full": lambda: ch.full("k"), "stats": ch.stats,
            "get": lambda: ch.get(key="k", timeout=5),
            "get_ack": lambda: ch.get(key="k", timeout=5, ack=True),
            "get_batch": lambda: ch.get_batch(2, key="k", timeout=5)}[op]()


@pytest.mark.parametrize("what,op,answer,match", WRONG, ids=[c[0] for c in WRONG])
def test_a_reply_of_the_wrong_form_is_a_protocol_error(hostile, what, op, answer, match):
    ch = hostile(answer)
    with pytest.raises(ProtocolError, match=match):
        _call_sync(ch, op)


def test_a_put_answered_with_a_result_returns_none(hostile):
    ch = hostile(_reply(r={"unexpected": 1}))
    assert ch.put(b"x", key="k", timeout=5) is None
    assert ch.put(b"x", key="k", timeout=5, async_op=True).wait(30) is None


@pytest.mark.parametrize("table", [[1, 2], [{"node": 5, "address": "ipc:///x"}],
                                   [{"node": "a", "address": "ipc:///x", "hostnames": "h"}]])
def test_a_malformed_replicas_table_in_the_hello_is_named(run_dir, monkeypatch, table):
    monkeypatch.setenv("ZCHANNEL_DIRECT", "0")
    broker = HostileBroker(f"ipc://{run_dir}/replicas.sock", _reply(r=0),
                           {**HELLO, "replicas": table, "replica": 0, "node": "a"})
    try:
        with pytest.raises(ValueError, match="replicas table"):
            Channel.connect(broker.address, timeout=30)
    finally:
        broker.close()


def test_unreadable_replies_fail_each_request_and_are_logged_once_in_a_while(hostile, caplog):
    """A broker answering every request with a header that does not decode: each request
    fails with ``ProtocolError``, and the log gets one line (with the count), not one per
    reply."""
    caplog.set_level(logging.ERROR, logger="zchannel")
    ch = hostile(lambda rec: [b"\xc1 not msgpack"])
    for _ in range(20):
        with pytest.raises(ProtocolError, match="cannot read"):
            ch.qsize("k")
    lines = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(lines) == 1 and "(1 so far)" in lines[0], lines


def test_a_hello_answered_with_an_error_refuses_the_connection(run_dir, monkeypatch):
    """A broker that refuses the hello (another protocol version) makes ``connect`` raise a
    ``ProtocolError`` carrying its message at once, not a connection taken as up with the
    defaults."""
    monkeypatch.setenv("ZCHANNEL_DIRECT", "0")
    broker = HostileBroker(f"ipc://{run_dir}/refusing.sock", _reply(r=0), hello_error=[
        "ValueError", "protocol version 2 is not this broker's version 1", None])
    try:
        with pytest.raises(ProtocolError, match="refused this client's hello: ValueError: "
                                                "protocol version 2 is not this broker's"):
            Channel.connect(broker.address, timeout=30).qsize("k")
    finally:
        broker.close()


def test_a_hello_with_a_heartbeat_too_short_to_follow_is_not_taken(run_dir, monkeypatch):
    """A broker whose hello says ``hb`` 1e-9 s would make the client's I/O thread wake all the
    time (it spun a CPU): that hello is not taken (as any malformed hello: the defaults, a
    heartbeat a second), and the client works on."""
    monkeypatch.setenv("ZCHANNEL_DIRECT", "0")
    broker = HostileBroker(f"ipc://{run_dir}/hb.sock", _reply(r=3), {**HELLO, "hb": 1e-9})
    try:
        ch = Channel.connect(broker.address, timeout=30)
        assert ch.qsize("k") == 3
        assert ch._acquired().conn.broker_info.hb == 1.0
        ch.close()
    finally:
        broker.close()


def test_a_numpy_scalar_of_the_wrong_length_is_named_as_such():
    """An item's numpy scalar whose bytes do not fit its (allowed) dtype: the error says so."""
    def scalar(data: bytes) -> bytes:
        return _pack(msgpack.ExtType(codec.EXT_NPSCALAR, _pack(["<i8", data])))

    assert codec.decode(scalar(np.int64(5).tobytes())) == 5
    with pytest.raises(ValueError, match="has 3 bytes, not 8"):
        codec.decode(scalar(b"\x05\x00\x00"))
