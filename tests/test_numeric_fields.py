"""Every numeric field is checked at both ends (docs/guarantees.md, "Hostile input"): NaN,
infinities, bools, negative or out-of-range timeouts, weights, targets, counts, sizes and
indices are a ``ValueError`` at the client, and an error reply from the broker when a raw
DEALER sends them; the broker keeps serving.  A NaN deadline cannot stall the broker's timers.

The fields are read from the records' msgspec types (``recordgen.py``): a numeric field added
to a record is covered without touching this file.
"""

from __future__ import annotations

import math

import msgpack
import msgspec.inspect
import pytest
import recordgen
import zmq
from conftest import pid_alive
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zchannel.broker import Channel
from zchannel.broker.server.config import BrokerConfig
from zchannel.broker.wire import protocol
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, REQUEST_TYPES, op_of

pytestmark = pytest.mark.timeout(180)

# (record class, field) for every numeric field of every request
NUMERIC = [(cls, f) for cls in REQUEST_TYPES for f in msgspec.inspect.type_info(cls).fields
           if recordgen.numeric(f.type)]
# the fields without which a record cannot be answered: a bad one drops it (or its message)
UNANSWERABLE = {"id", "nf"}
# the numeric fields of docs/protocol.md ("Numeric fields"), by operation and wire key
DOCUMENTED = {
    ("put", "w"), ("put", "t"), ("put", "fs"), ("put", "sq"), ("get", "t"), ("gets", "t"),
    ("gets", "g"), ("get_batch", "tw"),
    ("get_batch", "t"), ("peek", "n"), ("ack", "lease"), ("cancel", "rid"),
    ("shm_rel", "h"), ("bind", "replica"), ("bind", "from"), ("learn", "from"),
    ("sync", "from"), ("release", "to"), ("hb", "nb"),
}
BY_OP = {op_of(cls(id=0)): cls for cls in REQUEST_TYPES}
# bad for any numeric field, typed or not
ALWAYS_BAD = [math.nan, math.inf, -math.inf, -1, True, "1"]


def test_the_numeric_fields_are_the_documented_ones():
    found = {(op_of(cls(id=0)), f.encode_name) for cls, f in NUMERIC if f.name not in UNANSWERABLE}
    assert found == DOCUMENTED


def _field(op: str, key: str) -> msgspec.inspect.Field:
    (f,) = [f for f in msgspec.inspect.type_info(BY_OP[op]).fields if f.encode_name == key]
    return f


class Raw:
    """A DEALER that said hello to the broker at ``address``."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.rid = 100
        assert self.ask({"op": "hello", "v": PROTOCOL_VERSION})["r"]["pid"] > 0

    def send(self, *records: dict) -> None:
        self.sock.send_multipart([msgpack.packb(list(records), use_bin_type=True)])

    def ask(self, record: dict, timeout_ms: int = 30_000) -> dict:
        """Send ``record`` under a new id; its reply record."""
        self.rid += 1
        self.send({**record, "id": self.rid})
        while True:
            assert self.sock.poll(timeout_ms), f"no reply to {record}"
            for rec in msgpack.unpackb(self.sock.recv_multipart()[0], raw=False):
                if rec.get("id") == self.rid:
                    return rec

    def close(self) -> None:
        self.sock.close()


def _check_refused(raw: Raw, cls: type, f: msgspec.inspect.Field, value) -> None:
    op = op_of(cls(id=0))
    record = {"op": op, "k": "key", f.encode_name: value}  # (a valid key: only the field is bad)
    if op == "put":
        record["b"] = b"\xc0"
    if f.name == "id":  # no id to answer under: dropped
        raw.send(record)
        return
    if f.name == "nf":  # the message's frames cannot be told apart: dropped whole
        raw.send({**record, "id": 1})
        return
    reply = raw.ask(record, timeout_ms=10_000)
    assert reply.get("e") and reply["e"][0] == "ValueError", (record, reply)
    assert f"$.{f.encode_name}" in reply["e"][1], (record, reply)


def test_every_numeric_field_refuses_nan_inf_and_out_of_range(channels):
    ch = Channel.create("numeric")
    channels.append(ch)
    pid = ch.stats()["pid"]
    raw = Raw(ch.address)
    try:
        for op, key in sorted(DOCUMENTED):
            f = _field(op, key)
            typed = recordgen.refused(f.type) if recordgen.numeric(f.type) else []
            for value in typed or ALWAYS_BAD:
                _check_refused(raw, BY_OP[op], f, value)
        for cls, f in NUMERIC:  # and a bad id or nf: dropped
            if f.name in UNANSWERABLE:
                for value in recordgen.refused(f.type):
                    _check_refused(raw, cls, f, value)
        assert raw.ask({"op": "qsize", "k": "x"})["r"] == 0  # still serving this client
    finally:
        raw.close()
    ch.put("after", key="after")
    assert ch.get(key="after", timeout=10) == "after"
    assert pid_alive(pid) and ch.stats()["pid"] == pid


def _out_of_range(info: msgspec.inspect.Type) -> st.SearchStrategy:
    """Numbers outside every numeric type of ``info`` (or not finite)."""
    kinds = recordgen.numeric(info)
    lows = [k.ge if k.ge is not None else k.gt for k in kinds]
    highs = [k.le for k in kinds]
    options = [st.sampled_from([math.nan, math.inf, -math.inf])]
    if all(low is not None for low in lows):
        low = min(lows)
        options.append(st.integers(-(2**63), low - 1))
        options.append(st.floats(max_value=low, exclude_max=True, allow_nan=False))
    if all(high is not None and high < 1e300 for high in highs):
        high = max(highs)
        options.append(st.integers(high + 1, 2**63 - 1))
        options.append(st.floats(min_value=high, exclude_min=True, allow_nan=False))
    if not any(isinstance(k, msgspec.inspect.FloatType) for k in kinds):
        options.append(st.floats(allow_nan=False).filter(lambda x: x != int(x) if math.isfinite(x) else True))
    strategy = st.one_of(options)
    if isinstance(recordgen._strip_none(info), msgspec.inspect.ListType):
        return st.lists(strategy, min_size=1, max_size=3)
    return strategy


ANSWERED = [(cls, f) for cls, f in NUMERIC if f.name not in UNANSWERABLE]


def test_out_of_range_numbers_get_error_replies_property(channels):
    ch = Channel.create("numeric-prop")
    channels.append(ch)
    pid = ch.stats()["pid"]
    raw = Raw(ch.address)

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        cls, f = data.draw(st.sampled_from(ANSWERED))
        _check_refused(raw, cls, f, data.draw(_out_of_range(f.type)))

    try:
        run()
    finally:
        raw.close()
    ch.put(1)
    assert ch.get(timeout=10) == 1 and pid_alive(pid)


# -- the client end ------------------------------------------------------------------------------

BAD_TIMEOUTS = [math.nan, math.inf, -math.inf, -1, -1e-9, True, "1"]
BAD_WEIGHTS = [math.nan, math.inf, -1, -0.5, True, 2**53 + 1, 1e300, "1"]
BAD_TARGETS = [math.nan, math.inf, 0, 0.0, -1, True, 2**53 + 1]


@pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])
def test_client_refuses_bad_numbers_with_value_errors(channels, local):
    ch = Channel.create("numeric-client", local=local)
    channels.append(ch)
    calls = []
    for t in BAD_TIMEOUTS:
        calls += [lambda t=t: ch.put(1, timeout=t), lambda t=t: ch.put(1, timeout=t, async_op=True),
                  lambda t=t: ch.get(timeout=t), lambda t=t: ch.get(key="a", timeout=t, async_op=True),
                  lambda t=t: ch.get_batch(1, timeout=t)]
    for w in BAD_WEIGHTS:
        calls += [lambda w=w: ch.put(1, weight=w), lambda w=w: ch.put_nowait(1, weight=w)]
    for target in BAD_TARGETS:
        calls.append(lambda target=target: ch.get_batch(target, timeout=1))
    for n in (0, 1025, math.nan, True, 1.5):
        calls.append(lambda n=n: ch.peek(n=n))
    for call in calls:
        with pytest.raises(ValueError):
            call()
    assert ch.qsize() == 0 and ch.qsize("a") == 0  # nothing was sent, nothing changed
    work = ch.get(key="w", async_op=True)
    with pytest.raises(ValueError):
        work.wait(math.nan)
    with pytest.raises(TimeoutError):
        work.wait(0)  # negative and zero: do not wait
    ch.put("x", key="w")
    assert work.wait(math.inf) == "x"  # beyond what a lock can wait: no limit
    if not local:
        for t in (math.nan, math.inf, -1, None):
            with pytest.raises(ValueError):
                Channel.connect(ch.address, timeout=t)


def test_hello_answers_with_bad_numbers_fall_back_to_defaults():
    info = protocol.hello_info({"name": "x", "hb": math.nan, "liveness": 3})
    assert info.hb == 1.0 and info.liveness == 3
    assert protocol.hello_info({"hb": -1.0}).hb == 1.0
    assert protocol.hello_info({"liveness": 0}).liveness == 3


# -- the deadline heap ---------------------------------------------------------------------------

def test_a_nan_timeout_cannot_stall_other_clients_deadlines(channels, workers):
    """``get(timeout=nan)`` once froze every deadline of the broker (it sat at the root of the
    heap, comparing false with everything): another process's ``get(timeout=0.5)`` hung."""
    ch = Channel.create("nan-deadline")
    channels.append(ch)
    with pytest.raises(ValueError):
        ch.get(key="a", timeout=math.nan, async_op=True)  # the client end
    raw = Raw(ch.address)
    try:
        for t in (math.nan, math.inf, -1.0):  # the broker end
            for op in ({"op": "get", "k": "a"}, {"op": "get_batch", "k": "a", "tw": 1},
                       {"op": "put", "k": "a", "b": b"\xc0"}):
                reply = raw.ask({**op, "t": t})
                assert reply["e"][0] == "ValueError", reply
        proc = workers.start(
            """
            import sys, time
            from zchannel.broker import Channel
            ch = Channel.connect(sys.argv[1])
            start = time.monotonic()
            try:
                ch.get(key="b", timeout=0.5)
            except TimeoutError:
                print("timed out", flush=True)
            """,
            ch.address,
        )
        assert workers.wait_line(proc, timeout=60) == "timed out"
        workers.finish(proc)
    finally:
        raw.close()
    assert ch.qsize("a") == 0


def test_a_record_with_int_map_keys_or_a_bad_timestamp_is_refused_alone(channels):
    """A field holding a map with non-str keys, or an extension value that does not decode (a
    timestamp of one byte), fails its own record with a ``ValueError``; the other records of
    the message are handled (the whole message used to be dropped, none of them answered)."""
    ch = Channel.create("mapkeys")
    channels.append(ch)
    raw = Raw(ch.stats()["address"])
    try:
        bad_timestamp = msgpack.ExtType(0, b"")  # replaced below by a type -1 of one byte
        for bad in ({"op": "put", "id": 1, "k": "key", "w": {1: 2}, "b": b"\xc0"},
                    {"op": "get", "id": 1, "k": {1.5: "x"}, "nw": True},
                    {"op": "qsize", "id": 1, "k": "key", "extra": {True: 1}},
                    {"op": "qsize", "id": 1, "k": bad_timestamp}):
            header = msgpack.packb([bad, {"op": "put", "id": 2, "k": "key", "b": b"\x01"},
                                    {"op": "qsize", "id": 3, "k": "key"}], use_bin_type=True)
            header = header.replace(b"\xd4\x00\x00", b"\xd4\xff\x00")  # (ExtType refuses -1)
            raw.sock.send_multipart([header])
            replies: dict[int, dict] = {}
            while len(replies) < 3:
                assert raw.sock.poll(30_000), f"no reply for {bad}: {replies}"
                for rec in msgpack.unpackb(raw.sock.recv_multipart()[0], raw=False):
                    replies[rec.get("id")] = rec
            if "extra" in bad:  # unknown fields are skipped, whatever they hold
                assert replies[1].get("e") is None, replies
            else:
                assert replies[1]["e"][0] in ("ValueError", "TypeError"), replies
            assert replies[2].get("e") is None and replies[3]["r"] >= 1, replies
        assert ch.qsize("key") == 4
    finally:
        raw.close()


@pytest.mark.parametrize("local", [False, True])
def test_settings_past_what_a_broker_can_send_are_refused(channels, local):
    """An int setting above 2**63 - 1 (what msgpack and ZeroMQ's socket options hold) is a
    ``ValueError`` naming it, wherever the broker is configured: 2**64 made a broker crash
    on its first hello reply, and the creator waited a minute for it."""
    for big in (2**63, 2**64):
        with pytest.raises(ValueError, match=r"maxsize must be an int >= 0 and <= 9223372036"):
            Channel.create("too-big", maxsize=big, local=local)
    ch = Channel.create("big-enough", maxsize=2**63 - 1, local=local)
    channels.append(ch)
    ch.put("x")
    assert ch.get(timeout=10) == "x"
    with pytest.raises(ValueError, match="max_message_bytes must be an int"):
        BrokerConfig(name="too-big", max_message_bytes=2**64)


def test_a_deadline_years_ahead_leaves_a_local_channels_timers_running(channels):
    """A local channel's timer thread sleeps at most TIMER_WAIT_S at a time: a get waiting
    1e10 s (past what a lock can wait) does not end it, so other deadlines still fire, and
    ``shutdown()`` returns once it has ended."""
    ch = Channel.create("far-deadline", local=True, lease_timeout=1e10)
    far = ch.get(key="far", timeout=1e10, async_op=True)
    ch.put("leased", key="l")
    assert ch.get(key="l", ack=True, timeout=10).item == "leased"
    with pytest.raises(TimeoutError, match="get timed out"):
        ch.get(key="near", timeout=0.2)
    timer = ch._broker.timer
    assert timer.is_alive()
    ch.put("x", key="far")
    assert far.wait(10) == "x"
    ch.shutdown()
    assert not timer.is_alive()
