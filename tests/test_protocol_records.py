"""The wire records of ``broker/wire/protocol.py``: every record round-trips through its encoding, the
decoder refuses every mutation of a valid message with ``ProtocolError``, and no other module of
``zchannel.broker`` spells a wire key (the guard at the end).

What the decoder checks is the shape of a message and the types of the fields it types (``id``,
``nf``, the flags, ``fs``, ``sm``, ``b``, and the bounds of every numeric field): a wrong one
makes the record a ``BadRecord`` carrying a ``ProtocolError`` (the broker answers it with a
``ValueError``, docs/protocol.md), or, for the message's structure (truncated, not a list of
maps, ``nf`` not adding up), fails the whole message.  The numeric fields' bounds are tested
against a live broker in ``test_numeric_fields.py``; fields whose values the handlers check
(``k``, ``c``, ...) in ``test_protocol_doc.py`` and ``test_fuzz.py``.
"""

from __future__ import annotations

import ast
import pathlib
import typing

import msgpack
import msgspec
import msgspec.inspect
import msgspec.inspect as mi
import pytest
import recordgen
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zchannel.broker.wire import protocol
from zchannel.broker.wire.protocol import (
    REQUEST_TYPES,
    UNSET,
    BadRecord,
    BindAnswer,
    HelloInfo,
    LoadAnswer,
    ProtocolError,
    Reply,
    SyncAnswer,
    bind_answer,
    hello_info,
    load_answer,
    op_of,
    pack_header,
    sync_answer,
    unpack_replies,
    unpack_requests,
)

BROKER = pathlib.Path(protocol.__file__).resolve().parents[1]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ---------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False), st.text(max_size=8), st.binary(max_size=8),
)
# what a field typed ``Any`` may hold (msgpack arrays decode as lists, maps with str keys)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def _field_strategy(tp: object) -> st.SearchStrategy:
    """Values of a record field's annotated type (``Any`` fields: any wire value)."""
    if tp is int:
        return st.integers(0, 2**63 - 1)
    if tp is bool:
        return st.booleans()
    if tp == (bytes | msgspec.UnsetType):
        return st.binary(max_size=protocol.INLINE_BODY)
    if tp == (list[int] | None):
        return st.none() | st.lists(st.integers(0, 2**40), max_size=4)
    if tp == (list | None):
        return st.none() | st.lists(values, max_size=3)
    if tp == (protocol.Sequence | msgspec.UnsetType):  # a retried put's sequence
        return st.just(UNSET) | st.integers(0, 2**63 - 1)
    if tp == (protocol.ProducerId | None):  # a hello's producer id
        return st.none() | st.binary(min_size=8, max_size=64)
    return recordgen.valid(msgspec.inspect.type_info(tp))  # within the field's type


def _fields(cls: type) -> list[msgspec.structs.FieldInfo]:
    return [f for f in msgspec.structs.fields(cls) if f.name != "nf"]


@st.composite
def requests(draw, cls: type | None = None) -> protocol.Request:
    """A valid request: every field within its type and bounds (``recordgen.valid``)."""
    cls = cls or draw(st.sampled_from(REQUEST_TYPES))
    kwargs = {f.name: draw(recordgen.valid(f.type, protocol.INLINE_BODY))
              for f in msgspec.inspect.type_info(cls).fields if f.name != "nf"}
    kwargs["nf"] = draw(st.integers(0, 5))
    return cls(**kwargs)


def _annotation(cls: type, f: msgspec.structs.FieldInfo) -> object:
    tp = f.type
    if getattr(tp, "__metadata__", None):  # Annotated[int, Meta(ge=0)]
        tp = tp.__origin__
    return tp


def decode_one(data: bytes, nframes: int) -> protocol.Request:
    """The one record of a header, or the ``ProtocolError`` the decoder found in it."""
    (record,) = unpack_requests(data, nframes)
    if isinstance(record, BadRecord):
        raise record.error
    return record


# -- round trips --------------------------------------------------------------------------------

@SETTINGS
@given(st.lists(requests(), min_size=1, max_size=6))
def test_every_request_round_trips(records):
    data = pack_header(records)
    assert unpack_requests(data, sum(r.nf for r in records)) == records
    # and it is the documented map form: op first-class, short keys, defaults left out
    for raw, rec in zip(msgpack.unpackb(data, raw=False, strict_map_key=False), records, strict=True):
        assert raw["op"] == op_of(rec)
        assert set(raw) <= {"op"} | {f.encode_name for f in msgspec.structs.fields(type(rec))}


@SETTINGS
@given(st.builds(
    Reply, id=st.none() | st.integers(0, 2**40), nf=st.integers(0, 5), result=values,
    error=st.none() | st.tuples(st.text(max_size=8), st.text(max_size=8), st.none()).map(list),
    counts=st.none() | st.lists(st.integers(0, 4), max_size=3),
    body=st.just(UNSET) | st.binary(max_size=64), lease=st.none() | st.integers(0, 2**40),
    slots=st.none() | st.lists(st.none() | st.lists(values, max_size=3), max_size=3),
    weights=st.none() | st.lists(st.integers(0, 9) | st.floats(0, 9), max_size=3),
))
def test_every_reply_round_trips(reply):
    assert unpack_replies(pack_header([reply, protocol.BROKER_HEARTBEAT]), reply.nf) == [
        reply, protocol.BROKER_HEARTBEAT]


def test_hello_info_and_sync_answer_round_trip():
    info = HelloInfo(name="c", pid=7, hb=0.5, liveness=4, deals=True, maxsize=9,
                     max_message_bytes=None, shm=None)
    raw = msgpack.unpackb(pack_header(info), raw=False)
    assert "replicas" not in raw and raw["hb"] == 0.5  # a plain broker leaves replica fields out
    assert hello_info(raw) == info
    info.replica, info.node, info.replicas = 1, "n1", [{"node": "n1", "address": "tcp://x:1"}]
    assert hello_info(msgpack.unpackb(pack_header(info), raw=False)) == info
    assert hello_info("not a map") == HelloInfo()
    answer = SyncAnswer(ready=True, entries=[["k", 1]])
    assert sync_answer(msgpack.unpackb(pack_header(answer), raw=False)) == answer
    with pytest.raises(ProtocolError):
        sync_answer({"ready": "yes"})


# -- every mutation is refused ------------------------------------------------------------------

def _wrong_run(tp: object) -> st.SearchStrategy:
    """A wrong value for the ids of a ``gets`` record or the puts of a ``puts`` record (1 to
    MAX_BATCH_PUTS ints, or put records)."""
    ints = st.integers(-(2**63), 2**64 - 1)
    wrong = st.text(max_size=3) | ints | st.none() | st.just([])
    if tp == list[protocol.Count]:
        return (wrong | st.lists(st.integers(-(2**63), -1), min_size=1, max_size=2) | st.lists(st.booleans() | st.text(max_size=2) | st.floats(), min_size=1,
                                 max_size=2)
                | st.just(list(range(protocol.MAX_BATCH_PUTS + 1))))
    return (wrong | st.lists(ints, min_size=1, max_size=3)
            | st.just([{"op": "get", "id": 1, "k": "k"}])
            | st.just([{"op": "put", "id": 1, "k": "k", "w": -1}])
            | st.just([{"op": "put", "id": 1, "k": "k"}] * (protocol.MAX_BATCH_PUTS + 1)))


def _wrong_value(tp: object) -> st.SearchStrategy:
    """A value of a wrong type for a field the decoder types."""
    ints = st.integers(-(2**63), 2**64 - 1)
    if tp is int:
        return st.booleans() | st.text(max_size=3) | st.floats() | st.none()
    if tp is bool:
        return ints | st.text(max_size=3) | st.none()
    if tp == (bytes | msgspec.UnsetType):  # text too: base64 text is not bytes
        return st.text(max_size=3) | st.just("YWI=") | ints | st.none() | st.lists(ints, max_size=2)
    if tp == (list[int] | None):
        return st.text(max_size=3) | ints | st.lists(st.text(max_size=2), min_size=1, max_size=2)
    if tp == (list | None):
        return st.text(max_size=3) | ints | st.binary(max_size=3)
    if tp in (list[protocol.Count], list[protocol.Put]):
        return _wrong_run(tp)
    if tp == (protocol.Sequence | msgspec.UnsetType):
        return st.integers(-(2**63), -1) | st.booleans() | st.text(max_size=3) | st.floats()
    if tp == (protocol.ProducerId | None):
        return (st.binary(max_size=7) | st.binary(min_size=65, max_size=80) | st.text(max_size=3)
                | ints)
    info = msgspec.inspect.type_info(tp)
    if recordgen.numeric(info):  # numbers out of their bounds, and non-numbers
        return st.sampled_from(recordgen.refused(info))
    return _wrong_for_kinds(info, ints)


def _wrong_for_kinds(info: mi.Type, ints: st.SearchStrategy) -> st.SearchStrategy:
    """A wrong value for a str, bytes or bounded-list field (each maybe nil)."""
    types = info.types if isinstance(info, mi.UnionType) else (info,)
    kinds = {type(k) for k in types}
    if kinds <= {mi.StrType, mi.NoneType}:
        return ints | st.binary(max_size=3) | st.lists(ints, max_size=2)
    if kinds <= {mi.BytesType, mi.NoneType}:
        return ints | st.text(max_size=3).filter(lambda t: t != "") | st.lists(ints, max_size=2)
    if kinds <= {mi.ListType, mi.NoneType}:  # a list of values of any type, of bounded length
        (bounded,) = [t for t in types if isinstance(t, mi.ListType)]
        assert bounded.min_length == 1 and bounded.max_length is not None
        return (ints | st.text(max_size=3) | st.binary(max_size=3) | st.just([])
                | st.just([0] * (bounded.max_length + 1)))
    raise AssertionError(info)


TYPED = [(cls, f) for cls in REQUEST_TYPES for f in _fields(cls)
         if _annotation(cls, f) is not object and not (f.name == "id" and cls is protocol.Hello)
         and _annotation(cls, f) is not typing.Any]


@SETTINGS
@given(st.data())
def test_a_field_of_the_wrong_type_is_refused(data):
    cls, f = data.draw(st.sampled_from(TYPED))
    raw = msgpack.unpackb(pack_header(data.draw(requests(cls))), raw=False, strict_map_key=False)
    raw[f.encode_name] = data.draw(_wrong_value(_annotation(cls, f)))
    with pytest.raises(ProtocolError):
        decode_one(pack_header([raw]), raw.get("nf", 0))


@SETTINGS
@given(st.data())
def test_a_missing_id_or_op_and_an_unknown_op_are_refused(data):
    rec = data.draw(requests())
    raw = msgpack.unpackb(pack_header(rec), raw=False, strict_map_key=False)
    mutation = data.draw(st.sampled_from(["no id", "no op", "unknown op", "op of a wrong type"]))
    if mutation == "no id":
        if type(rec) is protocol.Hello:  # answered under id 0 (docs/protocol.md)
            return
        del raw["id"]
    elif mutation == "no op":
        del raw["op"]
    elif mutation == "unknown op":
        raw["op"] = data.draw(st.text(max_size=10).filter(
            lambda op: op not in {op_of(c(id=0)) for c in REQUEST_TYPES}))
    else:
        raw["op"] = data.draw(st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=3) | st.none()
                              | st.booleans())
    with pytest.raises(ProtocolError):
        decode_one(pack_header([raw]), raw.get("nf", 0))


@SETTINGS
@given(st.lists(requests(), min_size=1, max_size=4), st.data())
def test_a_malformed_message_is_refused_whole(records, data):
    good = pack_header(records)
    nframes = sum(r.nf for r in records)
    mutation = data.draw(st.sampled_from(
        ["truncated", "trailing bytes", "frame count", "not a list", "a record not a map",
         "nf negative", "nf not an int", "empty", "not msgpack"]))
    if mutation == "truncated":
        bad = good[: data.draw(st.integers(0, len(good) - 1))]
    elif mutation == "trailing bytes":
        bad = good + data.draw(st.binary(min_size=1, max_size=8))
    elif mutation == "frame count":
        bad = good
        nframes += data.draw(st.integers(1, 3)) * data.draw(st.sampled_from([-1, 1]))
    elif mutation == "not a list":
        bad = pack_header(msgpack.unpackb(good, raw=False, strict_map_key=False)[0])
    elif mutation == "a record not a map":
        raws = msgpack.unpackb(good, raw=False, strict_map_key=False)
        raws.insert(data.draw(st.integers(0, len(raws))), data.draw(scalars | st.lists(scalars, max_size=2)))
        bad = pack_header(raws)
    elif mutation in ("nf negative", "nf not an int"):
        raws = msgpack.unpackb(good, raw=False, strict_map_key=False)
        raws[data.draw(st.integers(0, len(raws) - 1))]["nf"] = (
            data.draw(st.integers(-5, -1)) if mutation == "nf negative"
            else data.draw(st.text(max_size=2) | st.booleans() | st.floats() | st.none()))
        bad = pack_header(raws)
    elif mutation == "empty":
        bad = pack_header([])
    else:
        bad = b"\xc1" + good
    with pytest.raises(ProtocolError):
        unpack_requests(bad, nframes)


def test_one_bad_record_leaves_the_others_of_its_message():
    records = unpack_requests(pack_header([
        {"op": "nonsense", "id": 3}, protocol.QSize(id=4, key="q"), {"op": "get", "id": "x"},
        {"op": "put", "id": 5, "b": "a str"}]), 0)
    assert [type(r) for r in records] == [BadRecord, protocol.QSize, BadRecord, BadRecord]
    assert [r.id for r in records] == [3, 4, None, 5]  # no int id: dropped by the broker
    assert all(isinstance(r.error, ProtocolError) for r in records if type(r) is BadRecord)


def test_a_record_nested_too_deeply_after_a_bad_one_drops_the_message_as_malformed():
    """The slow path (a message whose records are decoded one by one after one failed) met a
    record nested thousands deep with a ``RecursionError`` that left the broker's loop as an
    unexpected error; it is the ``ProtocolError`` the fast path raises."""
    deep = b"\x91" * 5000 + b"\x01"
    bad = msgpack.packb({"op": "put", "id": "not an int"})
    record = (b"\x83" + msgpack.packb("op") + msgpack.packb("qsize") + msgpack.packb("id")
              + msgpack.packb(8) + msgpack.packb("k") + deep)
    for header in (b"\x92" + bad + record, b"\x92" + record + bad):
        with pytest.raises(ProtocolError, match="nested too deeply"):
            unpack_requests(header, 0)


def test_bind_and_load_answers():
    """A ``bind`` redirect and a ``load`` answer travel as the documented maps; what a replica
    cannot use is None, never a half-valid answer."""
    wire = msgpack.unpackb(msgspec.msgpack.encode(BindAnswer(binder=2)))
    assert wire == {"binder": 2} and bind_answer(wire) == BindAnswer(binder=2)
    assert bind_answer(wire).redirect() == 2 and BindAnswer(retry="joining").redirect() is None
    assert msgpack.unpackb(msgspec.msgpack.encode(BindAnswer(retry="joining"))) == {"retry": "joining"}
    assert bind_answer(3) is None and bind_answer([1]) is None
    load = LoadAnswer(backlog=40, starved=2)
    assert load_answer(msgpack.unpackb(msgspec.msgpack.encode(load))) == load
    for bad in ({"backlog": True, "starved": 0}, {"backlog": -1, "starved": 0},
                {"backlog": 1.5, "starved": 0}, [40, 2], None):
        assert load_answer(bad) is None, bad


def test_a_header_over_the_limit_is_refused():
    with pytest.raises(ProtocolError, match="header limit"):
        unpack_requests(pack_header([protocol.Put(id=1, key="q", body=bytes(64))]), 0, max_bytes=32)
    with pytest.raises(ProtocolError):
        unpack_requests(pack_header([protocol.Heartbeat(id=0)] * (protocol.MAX_RECORDS + 1)), 0)


# -- the guard: protocol.py is the only module that spells a wire key -----------------------------

# Every key of a request or reply record.  Left out: words that also name fields of the stats,
# config and cluster-table maps (``node``, ``replica``, ``token``, ``ready``), and the fields of
# the results ``HelloInfo`` and ``ShmOffer`` (``name``, ``maxsize``, ``pid``, ``prefix``...):
# those maps are not records, and their keys are not the protocol's.
WIRE_KEYS = ({"op"} | {f.encode_name for cls in (*REQUEST_TYPES, Reply, SyncAnswer, BindAnswer,
                                                   LoadAnswer)
                       for f in msgspec.structs.fields(cls)}) - {"node", "replica", "token", "ready"}


def wire_key_literals(source: str) -> list[tuple[int, str]]:
    """``(line, key)`` of every place in ``source`` that reads or writes a wire key by literal:
    ``x["k"]``, ``x.get("k")`` (and ``pop``/``setdefault``), ``{"k": ...}``, ``"k" in x``,
    ``dict(k=...)``.  Comments and docstrings do not count."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        keys = []
        if isinstance(node, ast.Subscript):
            keys = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("get", "pop", "setdefault") and node.args:
            keys = [node.args[0]]
        elif isinstance(node, ast.Dict):
            keys = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops):
            keys = [node.left]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            hits += [(node.lineno, kw.arg) for kw in node.keywords if kw.arg in WIRE_KEYS]
        hits += [(node.lineno, k.value) for k in keys
                 if isinstance(k, ast.Constant) and k.value in WIRE_KEYS]
    return sorted(hits)


def test_no_module_but_protocol_spells_a_wire_key():
    found = {}
    for path in sorted(BROKER.rglob("*.py")):
        if path == BROKER / "wire" / "protocol.py":
            continue
        hits = wire_key_literals(path.read_text())
        if hits:
            found[str(path.relative_to(BROKER))] = hits
    assert found == {}, f"wire keys spelled outside broker/wire/protocol.py: {found}"


def test_the_guard_finds_a_wire_key_literal():
    server = (BROKER / "server" / "loop.py").read_text()
    assert wire_key_literals(server + '\nkey = rec["k"]\n') == [(server.count("\n") + 2, "k")]
    for snippet in ('rec.get("nf", 0)', '{"op": "put", "id": 1}', '"b" in rec', 'dict(op="hb")',
                    'rec.pop("sm")'):
        assert wire_key_literals(snippet), snippet
    assert wire_key_literals('"""rec["k"]"""\n# rec["k"]\nconfig["name"]\n') == []
