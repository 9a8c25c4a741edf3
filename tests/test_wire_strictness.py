"""Raw clients that get the protocol wrong, or ask for nothing, against a real broker: a get that
found nothing and did not wait leaves no key behind; the broker's records reach a client in the
order it produced them (``expired`` too); a malformed ``hello`` gets an error naming its field
(never ``expired``, which a conforming client would answer with the same hello); a record that
owns frames although its operation takes none is refused, and an ``ack`` or ``cancel`` without
the field it needs is told which (docs/protocol.md, "Order" and "Malformed input")."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from conftest import wait_until
from test_put_batches import raw_dealer
from zchannel.broker import Channel, QueueEmpty
from zchannel.broker.connection import liveness
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, ProtocolError, pack_header

pytestmark = pytest.mark.timeout(120)

WAIT_S = 20.0  # for a reply: generous, the machine may be loaded


def _records(raw: zmq.Socket, done, what: str) -> list[dict]:
    """The records the broker sends ``raw`` (its heartbeats left out), in the order they
    come, until ``done(records)`` holds."""
    got: list[dict] = []
    deadline = time.monotonic() + WAIT_S
    while not done(got):
        left = deadline - time.monotonic()
        assert left > 0 and raw.poll(int(left * 1000) + 1), f"no {what} within {WAIT_S}s: {got}"
        header, *_frames = raw.recv_multipart()
        got += [rec for rec in msgpack.unpackb(header) if rec.get("op") != "hb"]
    return got


def _answers(raw: zmq.Socket, records: list, frames: tuple = ()) -> dict[int, dict]:
    """Send one message; the reply records by id, once every record with an id has one."""
    raw.send_multipart([pack_header(records), *frames])
    ids = {rec["id"] for rec in records}
    got = _records(raw, lambda recs: ids <= {r.get("id") for r in recs}, f"replies to {ids}")
    return {rec["id"]: rec for rec in got if "id" in rec}


def _unregistered(address: str) -> zmq.Socket:
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    return raw


# -- a get that did not wait leaves no key -----------------------------------------------------------


def test_gets_that_may_not_wait_on_keys_the_broker_does_not_hold_leave_no_key(cli_broker):
    """``get_nowait``, ``get(timeout=0)``, ``get_batch(timeout=0)`` and a ``gets`` record with
    ``nw`` on fresh keys find nothing and make no key: the broker holds none afterwards, and
    another client's puts to as many new keys as ``max_keys`` allows are stored."""
    address = cli_broker("nokeys", "--max-keys", "20")
    poller, other = Channel.connect(address), Channel.connect(address)
    try:
        for j in range(20):
            with pytest.raises(QueueEmpty, match=f"no item for key 'nw-{j}'"):
                poller.get_nowait(key=f"nw-{j}")
            with pytest.raises(TimeoutError, match=f"get timed out on key 't0-{j}'"):
                poller.get(key=f"t0-{j}", timeout=0)
            with pytest.raises(TimeoutError, match=f"get timed out on key 'b0-{j}'"):
                poller.get_batch(1, key=f"b0-{j}", timeout=0)
        with raw_dealer(poller) as raw:
            gets = {"op": "gets", "id": 100, "nw": True, "g": list(range(101, 121)),
                    "ks": [f"gets-{j}" for j in range(20)]}
            answers = _answers(raw, [gets])
            assert all(answers[i]["e"][0] == "QueueEmpty" for i in range(101, 121)), answers
        assert poller.stats()["keys"] == {}
        for j in range(20):  # max_keys new keys: none of them taken by the gets above
            other.put(j, key=f"new-{j}", timeout=10)
        # the broker holds max_keys keys: a get that may not wait on another finds nothing
        # (it would add none), one that waits is refused for the limit
        with pytest.raises(QueueEmpty):
            poller.get_nowait(key="one-more")
        with pytest.raises(ValueError, match="max_keys"):
            poller.get(key="one-more", timeout=5)
        assert [other.get(key=f"new-{j}", timeout=10) for j in range(20)] == list(range(20))
    finally:
        poller.close()
        other.close()


def test_a_get_of_a_new_key_refused_a_wait_leaves_no_key(cli_broker):
    """A get of a fresh key that may not wait because the waiting requests take the broker's
    ``max_bytes`` ("this get cannot wait") leaves no key; the one that waits keeps its own."""
    address = cli_broker("nowait-room", "--max-bytes", "4000")  # room for one waiting get
    ch = Channel.connect(address)
    try:
        waiting = ch.get(key="first", timeout=60, async_op=True)
        assert wait_until(lambda: "first" in ch.stats()["keys"], WAIT_S), "it did not wait"
        with pytest.raises(ValueError, match="this get cannot wait"):
            ch.get(key="second", timeout=60)
        assert list(ch.stats()["keys"]) == ["first"]
        ch.put("x", key="first", timeout=10)
        assert waiting.wait(WAIT_S) == "x"
    finally:
        ch.close()


# -- order ------------------------------------------------------------------------------------------


def test_expired_comes_after_the_replies_to_the_records_before_it(channels):
    """``[put, bye, put]`` in one message: the replies to the put and the bye come first, then
    the ``expired`` the last put earned (the client is gone by then); the first put was
    stored."""
    ch = Channel.create("order-expired")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        raw.send_multipart([pack_header([
            {"op": "put", "id": 1, "k": "a", "b": b"\x01"}, {"op": "bye", "id": 2},
            {"op": "put", "id": 3, "k": "a", "b": b"\x02"}])])
        got = _records(raw, lambda recs: any(r.get("op") == "expired" for r in recs),
                       "expired")
        assert [r.get("id", r.get("op")) for r in got] == [1, 2, "expired"], got
        assert "e" not in got[0] and got[1]["r"] is True
    assert ch.qsize("a") == 1


# -- hello ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("pr", b"abcd"), ("pr", "0123456789abcdef"), ("pr", b"p" * 65), ("it", 1), ("it", "yes"),
])
def test_a_hello_with_a_malformed_field_gets_an_error_naming_it(channels, field, value):
    """An unknown client whose hello has a malformed ``pr`` or ``it`` gets a ``ValueError``
    under the hello's id naming the field, as for ``v`` (not ``expired``, which a conforming
    client answers with another hello); it is not registered: its next record earns
    ``expired``."""
    ch = Channel.create("bad-hello")
    channels.append(ch)
    raw = _unregistered(ch.address)
    try:
        hello = {"op": "hello", "id": 7, "v": PROTOCOL_VERSION, field: value}
        raw.send_multipart([pack_header([hello])])
        (answer,) = _records(raw, bool, "an answer to the hello")
        assert answer.get("id") == 7, answer
        kind, message, _ = answer["e"]
        assert kind == "ValueError" and f"$.{field}" in message, message
        raw.send_multipart([pack_header([{"op": "qsize", "id": 8, "k": "a"}])])
        assert _records(raw, bool, "expired") == [{"op": "expired"}]
    finally:
        raw.close()


def test_a_registered_client_whose_new_hello_is_malformed_keeps_its_session(channels):
    """A known client's malformed hello gets its error and ends nothing: the records after it
    are served in the session it had."""
    ch = Channel.create("bad-hello-known")
    channels.append(ch)
    ch.put("item", key="a")
    with raw_dealer(ch) as raw:
        answers = _answers(raw, [{"op": "hello", "id": 7, "v": PROTOCOL_VERSION, "it": 1},
                                 {"op": "qsize", "id": 8, "k": "a"}])
        assert answers[7]["e"][0] == "ValueError" and "$.it" in answers[7]["e"][1]
        assert answers[8] == {"id": 8, "r": 1}


def test_a_client_whose_hello_is_refused_fails_at_once(cli_broker, monkeypatch):
    """A client following the protocol that sends a malformed hello (here ``it`` as an int)
    is told why at once: ``connect`` raises the broker's error naming the field, instead of
    saying hello again and again until its timeout."""
    address = cli_broker("refused-hello")
    monkeypatch.setattr(liveness, "BATCH", 1)
    with pytest.raises(ProtocolError, match=r"refused this client's hello: ValueError: .*\$\.it"):
        Channel.connect(address, timeout=30).qsize("k")


# -- frames and missing fields ----------------------------------------------------------------------


@pytest.mark.parametrize("record", [
    {"op": "get", "k": "held", "nw": True},
    {"op": "get_batch", "k": "held", "tw": 1, "nw": True},
    {"op": "qsize", "k": "held"},
    {"op": "full", "k": "held"},
    {"op": "peek", "k": "held"},
    {"op": "stats"},
    {"op": "ack", "lease": 1},
    {"op": "cancel", "rid": 1},
    {"op": "shutdown", "token": "wrong"},
], ids=lambda rec: rec["op"])
def test_a_record_that_owns_frames_its_op_takes_none_of_is_refused(channels, record):
    """A record owning frames (``nf``) its operation takes none of is refused with a
    ``ValueError`` saying so, as a ``gets`` record is, and changes nothing (the item stays)."""
    ch = Channel.create("frames-refused")
    channels.append(ch)
    ch.put("item", key="held")
    with raw_dealer(ch) as raw:
        answers = _answers(raw, [{**record, "id": 5, "nf": 2}], (b"\x01" * 10, b"\x02"))
        kind, message, _ = answers[5]["e"]
        assert kind == "ValueError" and "carry no frames" in message and "owns 2" in message
    assert ch.qsize("held") == 1 and ch.get("held", timeout=10) == "item"


def test_a_heartbeat_that_owns_frames_is_dropped_unanswered(channels):
    """A heartbeat (id 0, as sent) owning frames gets no reply; the records after it are
    answered."""
    ch = Channel.create("frames-hb")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        raw.send_multipart([pack_header([{"op": "hb", "id": 0, "nf": 1},
                                         {"op": "qsize", "id": 6, "k": "a"}]), b"\x01"])
        got = _records(raw, lambda recs: any(r.get("id") == 6 for r in recs), "the qsize reply")
        assert got == [{"id": 6, "r": 0}], got


@pytest.mark.parametrize("record, field", [
    ({"op": "ack"}, "'lease'"), ({"op": "cancel"}, "'rid'"),
])
def test_an_ack_or_cancel_without_its_field_is_told_which(channels, record, field):
    ch = Channel.create("missing-field")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        answers = _answers(raw, [{**record, "id": 9}])
        kind, message, _ = answers[9]["e"]
        assert kind == "ValueError" and f"field {field}" in message, message
