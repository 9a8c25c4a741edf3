"""The nesting limit (docs/values.md, "Nesting"): tuples, sets, frozensets and dataclasses nest
at most ``codec.MAX_DEPTH`` deep; the encoder, the decoder, a decoding broker and ``local=True``
give the same verdict, and no input crashes a decoder (msgpack's unpacker re-enters Python
through ``ext_hook`` for each such level, ~45 KiB of C stack each).

The fuzz test runs nested and adversarial values at every depth around the limit through a
consumer process and a decoding broker process (``--collector flatten_batch``): values the
encoder accepts arrive; hand-made deeper or malformed bodies, sent by a raw DEALER, are an
error for the consumer (which stays alive and usable) and an error reply from the broker
(which answers the next request).  ``pytest -m fuzz`` runs ``ZCHANNEL_FUZZ_EXAMPLES``
(default 400) examples.
"""

from __future__ import annotations

import functools
import os
import struct
import subprocess
import sys
import textwrap

import msgpack
import pytest
import zmq
from conftest import REPO, pid_alive
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from payloads import Sample
from zchannel.broker import Channel
from zchannel.broker.wire import codec
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, pack_header
from zchannel.broker.wire.wireform import wire_form

pytestmark = pytest.mark.timeout(300)
LIMIT = codec.MAX_DEPTH
TOO_DEEP = f"nested deeper than the depth limit of {LIMIT}"


def _ext(code: int, payload: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, payload))


def _ext_header(code: int, size: int) -> bytes:
    """The msgpack header of an ext type ``code`` with a payload of ``size`` bytes."""
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if size in fixed:
        return bytes([fixed[size], code])
    for marker, fmt in ((0xC7, ">B"), (0xC8, ">H"), (0xC9, ">I")):
        if size < 1 << (8 * struct.calcsize(fmt)):
            return bytes([marker]) + struct.pack(fmt, size) + bytes([code])
    raise ValueError(size)


def tuple_chain(levels: int, inner: bytes = b"\x90") -> bytes:
    """The msgpack of ``levels`` tuples nested around ``inner`` (an empty list by default),
    made without the encoder (which refuses more than the limit), in linear time."""
    heads = []
    size = len(inner)
    for _ in range(levels):
        header = _ext_header(codec.EXT_TUPLE, 1 + size)
        heads.append(header + b"\x91")
        size += len(header) + 1
    return b"".join(reversed(heads)) + inner


# -- the building blocks of nested values: (name, counts toward the limit, wrap) --------------

def _dataclass(v):
    return Sample(obs=v)


WRAPPERS = {
    "list": (False, lambda v: [v]),
    "dict": (False, lambda v: {"k": v}),
    "tuple": (True, lambda v: (v,)),
    "dataclass": (True, _dataclass),
    "frozenset": (True, lambda v: frozenset([v])),  # needs a hashable element
    "set": (True, lambda v: {v}),
    "dict key": (False, lambda v: {v: 1}),  # needs a hashable element
}
_HASHABLE_KEEPING = {"tuple", "frozenset"}  # wrappers whose result is hashable if v is
_NEEDS_HASHABLE = {"frozenset", "set", "dict key"}


def build(kinds: list[str], leaf) -> object:
    """The value made by wrapping ``leaf`` in ``kinds``, innermost first."""
    value = leaf
    for kind in kinds:
        value = WRAPPERS[kind][1](value)
    return value


def nesting(kinds: list[str]) -> int:
    return sum(WRAPPERS[k][0] for k in kinds)


@st.composite
def nested_values(draw, target=None) -> tuple[object, int]:
    """A value whose tuples/sets/frozensets/dataclasses nest ``target`` deep (default: a depth
    around the limit), with lists and dicts in between: ``(value, nesting)``."""
    target = draw(st.integers(LIMIT - 2, LIMIT + 2)) if target is None else target
    leaf = draw(st.sampled_from([0, "s", b"b", 1.5, None, (), frozenset(), 2**70, 1j]))
    hashable = True
    kinds: list[str] = []
    while nesting(kinds) < target or (kinds and draw(st.integers(0, 3)) == 0):
        choices = [k for k in WRAPPERS if hashable or k not in _NEEDS_HASHABLE]
        if nesting(kinds) >= target:
            choices = [k for k in choices if not WRAPPERS[k][0]]
        kind = draw(st.sampled_from(choices))
        kinds.append(kind)
        hashable = hashable and kind in _HASHABLE_KEEPING
    if draw(st.booleans()):  # the worst case for the stack: nothing but tuples
        kinds = ["tuple"] * target
    if isinstance(leaf, (tuple, frozenset)):  # an empty one is a level too
        kinds = kinds[1:]
    return build(kinds, leaf), nesting(kinds) + isinstance(leaf, (tuple, frozenset))


def _refused_too_deep(exc: BaseException) -> bool:
    return TOO_DEEP in str(exc)


# -- the codec and local=True -----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["tuple", "frozenset", "set", "dataclass"])
def test_each_nesting_kind_is_refused_one_level_past_the_limit(kind):
    inner_kind = "frozenset" if kind == "set" else kind  # a set holds hashable values
    at_limit = build([inner_kind] * (LIMIT - 1) + [kind], 0)
    body, buffers = codec.encode(at_limit)
    assert codec.decode(body, buffers) == at_limit
    assert wire_form(at_limit) is at_limit
    over = WRAPPERS["tuple"][1](at_limit)
    for encode in (codec.encode, wire_form):
        with pytest.raises(TypeError, match=TOO_DEEP):
            encode(over)


def test_lists_and_dicts_between_do_not_count():
    kinds = ["tuple", "list", "dict", "list"] * LIMIT
    value = build(kinds, "leaf")
    assert codec.decode(*codec.encode(value)) == value
    assert wire_form(value) == value
    with pytest.raises(TypeError, match=TOO_DEEP):
        codec.encode((value,))


def test_decoder_refuses_deeper_input_before_recursing():
    assert codec.decode(tuple_chain(LIMIT)) == build(["tuple"] * LIMIT, [])
    for levels in (LIMIT + 1, LIMIT + 2, 1000, 200_000):
        with pytest.raises(ValueError, match=TOO_DEEP):
            codec.decode(tuple_chain(levels))


def _chain(value) -> tuple[int, object]:
    """(how many one-element lists wrap the leaf, the leaf), without recursion."""
    depth = 0
    while isinstance(value, list) and len(value) == 1:
        value, depth = value[0], depth + 1
    return depth, value


@pytest.mark.parametrize("inner", [b"\x90", b"\x01"])
def test_lists_at_msgpack_limit_the_encoder_refuses_what_the_decoder_refuses(inner):
    """Lists and dicts alone nest inside one payload, bounded by msgpack (its unpacker takes
    1,024 in a row); whatever the encoder accepts decodes, and local=True agrees."""
    leaf = [] if inner == b"\x90" else 1
    for depth in range(1015, 1030):
        value = leaf
        for _ in range(depth):
            value = [value]
        try:
            body, buffers = codec.encode(value)
        except TypeError as exc:
            assert "nested too deeply" in str(exc)
            with pytest.raises(TypeError):
                wire_form(value)
        else:
            assert _chain(codec.decode(body, buffers)) == (depth, leaf)
            assert _chain(wire_form(value)) == (depth, leaf)
        crafted = b"\x91" * depth + inner  # the same shape, made by hand
        try:
            codec.decode(crafted)
        except ValueError:
            pass


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(nested_values())
def test_codec_and_local_agree_around_the_limit(case):
    value, depth = case
    if depth > LIMIT:
        with pytest.raises(TypeError, match=TOO_DEEP) as by_codec:
            codec.encode(value)
        with pytest.raises(TypeError) as by_local:
            wire_form(value)
        assert str(by_codec.value) == str(by_local.value)
    else:
        body, buffers = codec.encode(value)
        assert codec.decode(body, buffers) == value
        assert wire_form(value) == value


def test_deepest_items_decode_on_a_small_thread_stack():
    """A 512 KiB thread stack holds the deepest item the limit lets through (the decoder's
    state goes to the heap past a few levels), and refuses deeper ones without a crash."""
    code = textwrap.dedent(f"""
        import threading
        from zchannel.broker.wire import codec
        from test_nesting import build, tuple_chain
        deepest = build(["tuple"] * {LIMIT}, 0)
        body, _ = codec.encode(deepest)
        out = []
        def run():
            out.append(codec.decode(body) == deepest)
            try:
                codec.decode(tuple_chain(100_000))
            except ValueError as exc:
                out.append("depth limit" in str(exc))
        threading.stack_size(512 * 1024)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        print(out)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests"),
                                                        os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=os.path.join(REPO, "tests"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[True, True]"


def test_local_channel_applies_the_limit(channels):
    ch = Channel.create("nest-local", local=True)
    channels.append(ch)
    ch.put(build(["tuple"] * LIMIT, 0))
    assert ch.get(timeout=5) == build(["tuple"] * LIMIT, 0)
    with pytest.raises(TypeError, match=TOO_DEEP):
        ch.put(build(["tuple"] * (LIMIT + 1), 0))
    assert ch.qsize() == 0


# -- through processes: a consumer and a decoding broker ------------------------------------

CONSUMER = """
import sys
import payloads  # the Sample dataclass
from zchannel.broker import Channel
ch = Channel.connect(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    key = line.strip()
    try:
        ch.get(key=key, timeout=60)
        print("ok", flush=True)
    except ValueError as exc:
        print("ValueError", str(exc).replace("\\n", " "), flush=True)
"""


def _adversarial_bodies() -> st.SearchStrategy[bytes]:
    """Hand-made bodies a decoder must refuse or decode, never crash on."""
    deep = st.integers(LIMIT - 2, 5000).map(tuple_chain)
    lists = st.integers(1020, 1030).map(lambda n: b"\x91" * n + b"\x90")
    # a leaf descriptor (an array, a scalar) holding nesting ext types: not a descriptor
    leaf = st.tuples(st.sampled_from([codec.EXT_NDARRAY, codec.EXT_NPSCALAR, codec.EXT_ENUM,
                                      codec.EXT_SIZE, codec.EXT_BYTES]),
                     st.integers(0, 300)).map(lambda a: _ext(a[0], tuple_chain(a[1])))
    # an ext payload with bytes after its value, or cut short
    trailing = st.integers(1, 300).map(lambda n: _ext(codec.EXT_TUPLE, b"\x91\x90" + tuple_chain(n)))
    cut = st.tuples(st.integers(LIMIT - 2, LIMIT + 2), st.integers(1, 40)).map(
        lambda a: tuple_chain(a[0])[: -a[1]])
    dataclasses = st.integers(LIMIT - 1, LIMIT + 3).map(
        lambda n: functools.reduce(lambda body, _: _ext(
            codec.EXT_DATACLASS, msgpack.packb(["payloads:Sample", {}])[:-1]
            + b"\x81\xa3obs" + body), range(n), b"\xc0"))
    return st.one_of(deep, lists, leaf, trailing, cut, dataclasses)


class _Rig:
    """A passthrough broker with a consumer process, a decoding broker (``zchannel broker
    --collector flatten_batch``), and a raw DEALER on each broker."""

    def __init__(self, channels, workers, run_dir) -> None:
        self.plain = Channel.create("nest-plain")
        channels.append(self.plain)
        self.workers = workers
        self.consumer = workers.start(CONSUMER, self.plain.address)
        workers.wait_line(self.consumer, "ready")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zchannel.cli.main", "broker", "nest-hooks", "--collector",
             "flatten_batch", "--import", "payloads"],
            stdout=subprocess.PIPE, text=True, cwd=os.path.join(REPO, "tests"))
        line = self.proc.stdout.readline()
        assert line.startswith("ready "), line
        self.hooks = Channel.connect(line.split()[1])
        channels.append(self.hooks)
        self.dealers = {}
        for name, ch in (("plain", self.plain), ("hooks", self.hooks)):
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(ch.address)
            sock.send_multipart([pack_header([{"op": "hello", "id": 0, "v": PROTOCOL_VERSION}])])
            assert sock.poll(30_000)
            sock.recv_multipart()
            self.dealers[name] = sock
        self.rid = 0
        self.n = 0

    def close(self) -> None:
        for sock in self.dealers.values():
            sock.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def raw_put(self, which: str, key: str, body: bytes) -> dict:
        """Put ``body`` as it is, by the raw DEALER; the broker's reply record."""
        self.rid += 1
        sock = self.dealers[which]
        hello = {"op": "hello", "id": 0, "v": PROTOCOL_VERSION}  # (its heartbeats: none)
        sock.send_multipart([pack_header([hello, {"op": "put", "id": self.rid, "k": key,
                                                  "nf": 1}]), body])
        while True:
            assert sock.poll(60_000), "the broker did not answer"
            for rec in msgpack.unpackb(sock.recv_multipart()[0], raw=False):
                if rec.get("id") == self.rid:
                    return rec

    def consume(self, key: str) -> str:
        self.workers.send(self.consumer, key)
        return self.workers.wait_line(self.consumer, timeout=120)

    def check_alive(self) -> None:
        assert self.consumer.poll() is None and self.proc.poll() is None
        self.n += 1
        key = f"alive-{self.n}"
        self.plain.put("after", key=key)
        assert self.consume(key) == "ok"
        self.hooks.put(["after"], key=key)  # the decoding broker answers the next request
        assert self.hooks.get(key=key, timeout=30) == "after"


def _fuzz_processes(channels, workers, run_dir, examples: int) -> None:
    rig = _Rig(channels, workers, run_dir)
    pid = rig.plain.stats()["pid"]

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(nested_values().map(lambda c: ("value", c)),
                     _adversarial_bodies().map(lambda b: ("body", b))))
    def run(case):
        rig.n += 1
        key = f"k{rig.n}"
        kind, data = case
        if kind == "value":
            value, depth = data
            if depth <= LIMIT:
                rig.plain.put(value, key=key)
                assert rig.consume(key) == "ok"
                rig.hooks.put([value], key=key)  # flatten_batch: decoded, re-encoded, stored
                assert rig.hooks.get(key=key, timeout=30) == value
                return
            with pytest.raises(TypeError, match=TOO_DEEP):
                rig.plain.put(value, key=key)
            saved = codec.MAX_DEPTH  # encode it anyway, as a client without the limit would
            codec.MAX_DEPTH = 10_000
            try:
                body, buffers = codec.encode(value)
            finally:
                codec.MAX_DEPTH = saved
            assert not buffers
        else:
            body = data
        rec = rig.raw_put("plain", key, body)  # a passthrough broker stores it undecoded
        assert "e" not in rec, rec
        answer = rig.consume(key)
        assert answer == "ok" or answer.startswith("ValueError"), answer
        if kind == "value":
            assert TOO_DEEP in answer
        rec = rig.raw_put("hooks", key, b"\x91" + body)  # a list of one: flatten_batch
        if "e" in rec:
            assert rec["e"][0] == "ValueError", rec
            if kind == "value":
                assert TOO_DEEP in rec["e"][1]
        else:
            assert kind == "body"
            rig.hooks.get(key=key, timeout=30)
        if rig.n % 10 == 0:
            rig.check_alive()

    try:
        run()
        rig.check_alive()
        assert pid_alive(pid)
    finally:
        rig.close()


def test_fuzz_consumer_and_decoding_broker_survive_nesting(channels, workers, run_dir):
    _fuzz_processes(channels, workers, run_dir, 30)


@pytest.mark.fuzz
@pytest.mark.timeout(0)
def test_fuzz_nesting_long(channels, workers, run_dir):
    _fuzz_processes(channels, workers, run_dir,
                    int(os.environ.get("ZCHANNEL_FUZZ_EXAMPLES", "400")))


def test_headers_nested_deeply_are_dropped_or_refused(channels):
    """A header field nested about 1,000 deep or more (msgspec counts its recursion) drops its
    message; a key nested deeper than a key may be is a ``TypeError`` reply."""
    ch = Channel.create("nest-header")
    channels.append(ch)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ch.address)
    try:
        prefix = msgpack.packb([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION}])[1:]
        for depth, rid in ((900, 2), (200_000, 3)):
            get = b"\x83\xa2op\xa3get\xa2id" + bytes([rid]) + b"\xa1k" + b"\x91" * depth + b"\x01"
            sock.send_multipart([b"\x92" + prefix + get])
        replies = {}
        while 2 not in replies or 1 not in replies:
            assert sock.poll(30_000), replies
            for rec in msgpack.unpackb(sock.recv_multipart()[0], raw=False):
                replies[rec.get("id")] = rec
        assert replies[2]["e"][0] == "TypeError", replies[2]
        sock.send_multipart([pack_header([{"op": "qsize", "id": 4, "k": "x"}])])
        assert sock.poll(30_000)
        recs = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
        assert [r for r in recs if r.get("id") == 3] == []  # the deep one was dropped whole
        assert any(r.get("id") == 4 and r.get("r") == 0 for r in recs), recs
    finally:
        sock.close()
    ch.put("after")
    assert ch.get(timeout=10) == "after"
