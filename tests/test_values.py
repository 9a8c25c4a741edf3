"""The value table (docs/values.md): every kind of Python value, what arrives, on every path.

One table of ``(value, expected arrival)`` -- the same type and value, a documented base form, or
``Refused`` (a ``TypeError`` at ``put`` naming the type and the fix) -- is run through a broker
over ZeroMQ, a broker over the same-host direct link, shared memory (each value beside large
tensors and arrays), a broker that decodes and re-encodes every item (a collector), and
``local=True``; every path must deliver exactly the expected arrival, so all agree.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import math
import re

import msgpack
import numpy as np
import pytest
import torch
import zmq
from conftest import pid_alive
from hypothesis import given, settings
from hypothesis import strategies as st
from payloads import (
    RLDATA,
    Access,
    Color,
    Count,
    FinishReason,
    Level,
    Perm,
    Priority,
    Ratio,
    Sample,
    Shape,
    Stage,
    Step,
    Tag,
    Unregistered,
)
from rldata.embodied_io_struct import (
    Budget,
    ChunkKey,
    ChunkStepResult,
    EmbodiedTrajectory,
    EnvOutput,
    EnvStatus,
    EvalTrajectory,
    LazyStats,
    Phase,
    Sensors,
    Stamp,
    Trajectory,
)
from rldata.io_struct import FinishReason as RLFinish
from rldata.io_struct import RolloutRequest, RolloutResult, SeqGroupInfo, Timing
from zchannel.broker import Channel, register_type
from zchannel.broker.wire import codec
from zchannel.broker.wire.protocol import PROTOCOL_VERSION, pack_header
from zchannel.broker.wire.wireform import wire_form

pytestmark = pytest.mark.timeout(120)


class Refused:
    """The expected arrival of a value refused at put: a TypeError matching ``pattern`` (the
    type and the fix)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern


NOT_REGISTERED_ENUM = Refused(r"Enum payloads\.Shape is not registered for the wire: call "
                              r"zchannel\.broker\.register_module\(\"payloads\"\).*register_type")
NOT_AN_ITEM = Refused(r"cannot send an object of type builtins\.object: items are")
MIB = 1 << 20
Pair = collections.namedtuple("Pair", "left right")


class Items(list):
    pass


class Blob(bytes):
    pass


class Frame(np.ndarray):
    pass


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def _nested(depth: int, kind: type = list) -> object:
    value: object = 0
    for _ in range(depth):
        value = kind([value])
    return value


def _table() -> list[tuple[str, object, object]]:
    """``(name, value, expected arrival)`` rows."""
    g = _gen()
    t_f32 = torch.randn(3, 4, generator=g)
    t_big = torch.randn(512, 1024, generator=g)  # 2 MiB: a shared-memory slot on the same host
    t_bf16_big = torch.randn(1024, 1024, generator=g).to(torch.bfloat16)
    a_big = np.arange(MIB // 2, dtype=np.float64).reshape(512, -1)  # 4 MiB
    strided = torch.arange(40, dtype=torch.float16).reshape(5, 8).t()
    param = torch.nn.Parameter(torch.ones(3))
    grad = torch.ones(2, requires_grad=True) * 2
    rows = [
        # -- Enums and subclasses of the base types
        ("str-enum unregistered", FinishReason.STOP, "stop"),
        ("str-enum registered", Stage.ROLLOUT, Stage.ROLLOUT),
        ("IntEnum unregistered", Priority.HIGH, 2),
        ("IntEnum registered", Level.INFO, Level.INFO),
        ("IntFlag unregistered", Perm.R | Perm.W, 6),
        ("IntFlag registered member", Access.WRITE, Access.WRITE),
        ("IntFlag registered combination", Access.READ | Access.WRITE, Access.READ | Access.WRITE),
        ("plain Enum registered", Color.GREEN, Color.GREEN),
        ("plain Enum unregistered", Shape.CIRCLE, NOT_REGISTERED_ENUM),
        ("str subclass", Tag("abc"), "abc"),
        ("int subclass", Count(5), 5),
        ("float subclass", Ratio(0.25), 0.25),
        ("bool", True, True),
        ("bool False", False, False),
        ("bools in a list", [True, 1, False, 0], [True, 1, False, 0]),
        # -- sets, complex, big ints, torch.Size
        ("set", {1, "two", (3, b"4")}, {1, "two", (3, b"4")}),
        ("frozenset", frozenset({1.5, None}), frozenset({1.5, None})),
        ("empty set", set(), set()),
        ("set of frozensets", {frozenset({1}), frozenset()}, {frozenset({1}), frozenset()}),
        ("nested set in dict", {"s": {1, 2}, "f": {"x": frozenset({"y"})}},
         {"s": {1, 2}, "f": {"x": frozenset({"y"})}}),
        ("set of str-enum members", {FinishReason.STOP, Stage.TRAIN}, {"stop", Stage.TRAIN}),
        ("complex", 1 + 2j, 1 + 2j),
        ("complex inf/-0", complex(math.inf, -0.0), complex(math.inf, -0.0)),
        ("2**64", 2**64, 2**64),
        ("-(2**70)", -(2**70), -(2**70)),
        ("2**63-1", 2**63 - 1, 2**63 - 1),
        ("2**64-1", 2**64 - 1, 2**64 - 1),
        ("-(2**63)", -(2**63), -(2**63)),
        ("-(2**63)-1", -(2**63) - 1, -(2**63) - 1),
        ("2**1000 in a list", [2**1000, -(2**1000)], [2**1000, -(2**1000)]),
        ("big int subclass", Count(2**80), 2**80),
        ("torch.Size", torch.Size([3, 4]), torch.Size([3, 4])),
        ("empty torch.Size", torch.Size([]), torch.Size([])),
        ("tensor.shape in a dict", {"shape": t_f32.shape}, {"shape": torch.Size([3, 4])}),
        # -- numpy
        ("np.float32", np.float32(2.5), np.float32(2.5)),
        ("np.float64", np.float64(-1.25), np.float64(-1.25)),
        ("np.int64", np.int64(-3), np.int64(-3)),
        ("np.uint8", np.uint8(200), np.uint8(200)),
        ("np.longlong", np.longlong(-5), np.int64(-5)),  # a C-named alias: its sized type
        ("np.ulonglong", np.ulonglong(7), np.uint64(7)),
        ("np.bool_", np.bool_(True), np.bool_(True)),
        ("np.complex128", np.complex128(1 - 1j), np.complex128(1 - 1j)),
        ("np.str_", np.str_("s"), "s"),
        ("np.bytes_", np.bytes_(b"b"), b"b"),
        ("ndarray int16", np.arange(10, dtype=np.int16), np.arange(10, dtype=np.int16)),
        ("ndarray big-endian", np.arange(6, dtype=">i4"), np.arange(6, dtype=">i4")),
        ("ndarray bool", np.array([True, False]), np.array([True, False])),
        ("ndarray 0-d", np.array(3.5), np.array(3.5)),
        ("ndarray non-contiguous", np.arange(12.0).reshape(3, 4).T, np.arange(12.0).reshape(3, 4).T),
        ("ndarray 4 MiB", a_big, a_big),
        ("ndarray subclass", np.arange(4).view(Frame), np.arange(4)),
        ("masked array", np.ma.masked_array([1, 2], mask=[0, 1]),
         Refused(r"numpy\.ma\.MaskedArray: its mask would be lost; send arr\.filled")),
        ("object ndarray", np.array(["a"], dtype=object),
         Refused(r"numpy dtype object cannot be sent \(numeric and bool dtypes only\)")),
        # -- torch
        ("tensor float32", t_f32, t_f32),
        ("tensor float16 strided", strided, strided.contiguous()),
        ("tensor bfloat16", torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)),
        ("tensor bool", torch.tensor([True, False]), torch.tensor([True, False])),
        ("tensor int64", torch.arange(5), torch.arange(5)),
        ("tensor uint8", torch.arange(5, dtype=torch.uint8), torch.arange(5, dtype=torch.uint8)),
        ("tensor complex64", torch.tensor([1 + 2j]), torch.tensor([1 + 2j])),
        ("tensor 0-d", torch.tensor(7.0), torch.tensor(7.0)),
        ("tensor empty", torch.zeros(0, 3), torch.zeros(0, 3)),
        ("tensor 2 MiB", t_big, t_big),
        ("tensor bfloat16 2 MiB", t_bf16_big, t_bf16_big),
        ("Parameter", param, param.detach()),
        ("tensor requiring grad", grad, grad.detach()),
        ("sparse tensor", torch.eye(2).to_sparse(),
         Refused(r"cannot send a torch\.sparse_coo tensor; convert it to a dense tensor")),
        ("meta tensor", torch.empty(4, device="meta"),
         Refused(r"cannot send a tensor on the meta device")),
        # -- containers and the rest
        ("None", None, None),
        ("str", "text", "text"),
        ("bytes", b"\x00bytes", b"\x00bytes"),
        ("bytes 100 KiB", bytes(range(256)) * 400, bytes(range(256)) * 400),
        ("bytearray", bytearray(b"ba"), b"ba"),
        ("bytes subclass", Blob(b"sub"), b"sub"),
        ("memoryview", memoryview(b"mv"), b"mv"),
        ("memoryview with a step inside", [memoryview(b"abcdef")[::2]],
         Refused("cannot encode item: a memoryview inside it is not C-contiguous")),
        ("float nan", [math.nan], [math.nan]),
        ("tuple nested", (1, (2, (3, "x")), []), (1, (2, (3, "x")), [])),
        ("namedtuple", Pair(1, FinishReason.LENGTH), (1, "length")),
        ("list subclass", Items([1, Tag("t")]), [1, "t"]),
        ("OrderedDict", collections.OrderedDict(b=1, a=2), {"b": 1, "a": 2}),
        ("defaultdict", collections.defaultdict(list, {"k": [1]}), {"k": [1]}),
        ("dict str-enum keys", {FinishReason.STOP: 1, Stage.TRAIN: 2, Priority.LOW: 3},
         {"stop": 1, Stage.TRAIN: 2, 1: 3}),
        ("dict tuple/int/bytes keys", {(1, "a"): 1, 5: "int", b"k": None},
         {(1, "a"): 1, 5: "int", b"k": None}),
        ("registered dataclass", Sample(torch.arange(3), ["x", {1}], {"t": torch.zeros(1)}),
         Sample(torch.arange(3), ["x", {1}], {"t": torch.zeros(1)})),
        ("registered dataclass, nested base forms",
         Step(FinishReason.STOP, torch.Size([2]), {"c": 1j, "e": Color.RED, "n": Sample(Count(1))}),
         Step("stop", torch.Size([2]), {"c": 1j, "e": Color.RED, "n": Sample(1)})),
        ("unregistered dataclass", Unregistered(),
         Refused(r"dataclass payloads\.Unregistered is not registered for the wire: call "
                 r"zchannel\.broker\.register_module\(\"payloads\"\).*@zchannel\.broker\.serializable")),
        ("object", object(), NOT_AN_ITEM),
        ("object deep inside", [1, {"k": (2, {object()})}], NOT_AN_ITEM),
        ("unregistered Enum inside", {"shape": Shape.CIRCLE}, NOT_REGISTERED_ENUM),
        ("nested 3000 deep", _nested(3000), Refused("cannot encode item: nested too deeply")),
        ("tuples nested 3000 deep", _nested(3000, tuple),
         Refused("cannot encode item: tuples, sets, frozensets and dataclasses nested deeper "
                 "than the depth limit of 100")),
    ]
    return rows + _rldata_rows(g)


def _rldata_rows(g: torch.Generator) -> list[tuple[str, object, object]]:
    """Items of an RL framework's data modules (tests/rldata: RLinf's shapes, no decorator),
    registered by ``register_module("rldata", recursive=True)``: each arrives as itself."""
    assert RolloutRequest in RLDATA and Stamp in RLDATA
    request = RolloutRequest(
        n=2, input_ids=[[1, 2, 3], [4]], image_data=[[b"\x89PNG"], []],
        answers=[["42"], {"vqa": "cat"}],
        multi_modal_inputs=[None, {"pixel_values": torch.rand(2, 3, generator=g)}])
    group = SeqGroupInfo(id=7, input_ids=[1, 2, 3], answer=["42"], group_size=3)
    group.record(0, RLFinish.STOP, [5, 6])  # init=False state, changed after construction
    group.record(2, RLFinish.ABORT, [])
    result = RolloutResult(
        num_sequence=4, group_size=2, prompt_lengths=[3, 1, 3, 1], prompt_ids=[[1, 2, 3], [4]] * 2,
        response_lengths=[2, 0, 2, 1], response_ids=[[5, 6], [], [5, 6], [9]],
        is_end=[True, False, True, True], rewards=torch.tensor([1.0, 0.0, 1.0, 0.5]),
        finish_reasons=[RLFinish.STOP, RLFinish.ABORT, RLFinish.STOP, RLFinish.LENGTH],
        prev_logprobs=torch.randn(4, 2, generator=g),
        ref_logprobs=[torch.randn(2, generator=g), torch.zeros(0)])
    key = ChunkKey(step_id=3, env_rank=1, chunk_id=2)
    stamp = Stamp(key, 5)
    object.__setattr__(stamp, "digest", "as sent")  # arrives as sent, not recomputed
    env = EnvOutput(
        obs={"states": torch.randn(4, 8, generator=g), "task_descriptions": ["pick", "place"] * 2,
             "main_images": torch.randint(0, 255, (4, 64, 64, 3), dtype=torch.uint8, generator=g)},
        dones=torch.tensor([False, True, False, False]), rewards=torch.ones(4),
        status=EnvStatus.DONE)
    chunk = ChunkStepResult(
        actions=torch.randn(4, 7, generator=g), versions=torch.full((4, 1), 3),
        forward_inputs={"tokens": torch.arange(8), "mask": torch.ones(8, dtype=torch.bool)},
        finish_reasons=[RLFinish.LENGTH])
    trajectory = Trajectory(
        max_episode_length=2, model_weights_id="w1", key=key, phase=Phase.TRAIN,
        actions=torch.randn(256, 256, generator=g),  # 256 KiB: a frame of its own
        steps=[chunk, ChunkStepResult()], curr_obs={"states": torch.randn(2, 8, generator=g)})
    budget = Budget(100)
    budget.used = 7
    rows = [
        ("rldata RolloutRequest: lists, bytes, None, a tensor in a dict", request, request),
        ("rldata SeqGroupInfo: init=False fields set by __post_init__", group, group),
        ("rldata RolloutResult: kw_only, tensors, a list of tensors, str Enum members", result, result),
        ("rldata frozen slots dataclass", key, key),
        ("rldata frozen slots, init=False field", stamp, stamp),
        ("rldata slots, init=False field with a default", budget, budget),
        ("rldata init=False field never set", LazyStats(3), LazyStats(3)),
        ("rldata EnvOutput: dict of tensors, IntEnum", env, env),
        ("rldata ChunkStepResult: default_factory dict of tensors", chunk, chunk),
        ("rldata defaults only", Trajectory(), Trajectory()),
        ("rldata dataclasses nested in a dataclass", trajectory, trajectory),
        ("rldata inheritance, a Flag combination",
         EmbodiedTrajectory(key=key, sensors=Sensors.RGB | Sensors.DEPTH,
                            intervene_flags=torch.tensor([True, False])), None),
        ("rldata subclass without the decorator", EvalTrajectory(phase=Phase.EVAL, steps=[chunk]),
         None),
        ("rldata nested Enum and class", [Phase.EVAL, Timing.Span("gen", 0.5)], None),
        ("rldata dataclasses in lists and dicts, a dataclass as a dict key",
         {key: [chunk, stamp], "results": {"r": result}, EnvStatus.TRUNCATED: (key, group)}, None),
    ]
    return [(name, value, value if expected is None else expected) for name, value, expected in rows]


def same(a, b) -> bool:
    """``b`` has exactly the types and values of ``a`` (containers compared element-wise)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and not b.requires_grad
                and torch.equal(a.detach().contiguous(), b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, (set, frozenset)):
        return len(a) == len(b) and all(any(same(x, y) for y in b) for x in a)
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if hasattr(a, "__dataclass_fields__"):  # (a field never set must be unset in both)
        return all(same(getattr(a, f, Refused), getattr(b, f, Refused))
                   for f in a.__dataclass_fields__)
    if isinstance(a, (float, complex)):  # exact: nan, -0.0
        return repr(a) == repr(b)
    return a == b


ROWS = _table()
GOOD = [(name, v, e) for name, v, e in ROWS if not isinstance(e, Refused)]
BAD = [(name, v, e.pattern) for name, v, e in ROWS if isinstance(e, Refused)]
PATHS = ["zmq", "direct", "shm", "decoding broker", "local"]


def _pad() -> tuple:
    """Large tensors and arrays put beside a value on the shared-memory path."""
    return (torch.full((MIB // 4,), 3.0), {"a": np.ones(MIB, np.uint8)})


def _open(path: str, channels: list, monkeypatch) -> Channel:
    if path == "zmq":  # frames over ZeroMQ: no direct link, no shared memory
        monkeypatch.setenv("ZCHANNEL_DIRECT", "0")
        monkeypatch.setenv("ZCHANNEL_SHM", "0")
    kwargs = {"collector": "payloads:Unwrap"} if path == "decoding broker" else {}
    ch = Channel.create("values", local=path == "local", **kwargs)
    channels.append(ch)
    if path == "zmq":
        assert not ch._connection().direct
    elif path in ("direct", "shm"):
        assert ch._connection().direct, "same host: the direct link is the default"
    return ch


def _wrap(path: str, value):
    if path == "shm":
        return (value, *_pad())
    if path == "decoding broker":
        return {"v": value}
    return value


def _unwrap(path: str, got):
    if path == "shm":
        value, big, small = got
        assert same(_pad()[0], big) and same(_pad()[1], small)
        return value
    return got


@pytest.mark.parametrize("path", PATHS)
def test_value_table_arrives_the_same_on_every_path(path, channels, monkeypatch):
    ch = _open(path, channels, monkeypatch)
    wrong = []
    for start in range(0, len(GOOD), 8):  # 8 at a time: the shared-memory pool has room
        rows = list(enumerate(GOOD))[start : start + 8]
        for i, (_name, value, _expected) in rows:
            ch.put(_wrap(path, value), key=i)
            ch.put(_wrap(path, value), key="batch", weight=1)
        got = [ch.get(key=i, timeout=30) for i, _row in rows]
        got_batch = ch.get_batch(len(rows), key="batch", timeout=30)  # another reply format
        for (_i, (name, _value, expected)), one, in_batch in zip(rows, got, got_batch, strict=True):
            for arrived in (one, in_batch):
                if not same(expected, _unwrap(path, arrived)):
                    wrong.append((name, expected, arrived))
    assert not wrong, wrong
    if path == "shm":  # every item took slots for its large tensors and arrays
        assert ch.stats()["shm"]["slots_in"] >= 4 * len(GOOD)
    if path == "zmq":
        stats = ch.stats().get("shm") or {}
        assert stats.get("slots_in", 0) == 0


@pytest.mark.parametrize("path", PATHS)
def test_refused_values_are_type_errors_at_put_naming_type_and_fix(path, channels, monkeypatch):
    ch = _open(path, channels, monkeypatch)
    for _name, value, pattern in BAD:
        for put in (ch.put, ch.put_nowait, lambda v: ch.put(v, async_op=True)):
            with pytest.raises(TypeError, match=pattern):
                put(_wrap(path, value))
    assert ch.qsize() == 0
    ch.put(_wrap(path, FinishReason.STOP))  # the handle still works
    assert _unwrap(path, ch.get(timeout=10)) == "stop"


@pytest.mark.parametrize("path", ["zmq", "direct", "local"])
def test_a_memoryview_with_a_step_travels_as_its_bytes(path, channels, monkeypatch):
    """An item that is a memoryview arrives as bytes, also one that is not C-contiguous (in C
    order, as ``bytes(view)``); inside an item, such a view is refused (msgpack packs only
    contiguous ones), the same way on every path."""
    ch = _open(path, channels, monkeypatch)
    big = bytes(range(256)) * 1200
    for view in (memoryview(b"abcdef")[::2], memoryview(big)[::2],
                 memoryview(np.arange(12, dtype=np.uint8).reshape(3, 4).T)):
        ch.put(view)
        assert ch.get(timeout=10) == view.tobytes()
    with pytest.raises(TypeError, match="a memoryview inside it is not C-contiguous"):
        ch.put({"v": memoryview(b"abcdef")[::2]})
    assert ch.qsize() == 0


RLDATA_ROWS = [(name, value) for name, value, _expected in GOOD if name.startswith("rldata ")]


def test_rl_data_items_arrive_alike_sync_async_asyncio_and_in_batches(make):
    """The items of an RL framework's data modules, registered with ``register_module``, through
    a broker, a local and a distributed channel: blocking, ``async_op`` and asyncio calls, one by
    one and in a ``get_batch``; each arrives as itself."""
    ch = make("rl")
    assert len(RLDATA_ROWS) >= 15
    wrong = []
    for i, (_name, value) in enumerate(RLDATA_ROWS):
        ch.put(value, key=("sync", i))
        ch.put(value, key=("async", i), async_op=True).wait(timeout=30)
        ch.put(value, key="batch", weight=1)
    for i, (name, value) in enumerate(RLDATA_ROWS):
        got = [ch.get(key=("sync", i), timeout=30),
               ch.get(key=("async", i), async_op=True).wait(timeout=30)]
        wrong += [(name, "sync/async") for item in got if not same(value, item)]

    async def consume() -> list:
        works = [ch.get_batch(len(RLDATA_ROWS), key="batch", async_op=True)]
        for i, (_name, value) in enumerate(RLDATA_ROWS):
            works.append(ch.put(value, key=("asyncio", i), async_op=True))
        batch = await works[0]
        for work in works[1:]:
            await work
        singles = [await ch.get(key=("asyncio", i), async_op=True) for i in range(len(RLDATA_ROWS))]
        return [batch, singles]

    batch, singles = asyncio.run(consume())
    for (name, value), in_batch, single in zip(RLDATA_ROWS, batch, singles, strict=True):
        wrong += [(name, "asyncio") for item in (in_batch, single) if not same(value, item)]
    assert not wrong, wrong


@pytest.mark.parametrize("name,value,expected", GOOD, ids=[r[0] for r in GOOD])
def test_local_form_is_the_decoded_form(name, value, expected):
    """What a local channel delivers (``wire_form``) is what the codec delivers, in types and
    values; values already in their wire form are passed by reference."""
    body, buffers = codec.encode(value)
    decoded = codec.decode(body, buffers)
    assert same(expected, decoded)
    local = wire_form(value)
    assert same(decoded, local)
    if same(value, expected) and not isinstance(value, torch.Tensor | np.ndarray | np.generic):
        assert local is value  # nothing to change: passed by reference
    if isinstance(value, torch.Tensor) and not value.requires_grad:
        # a contiguous tensor is passed by reference, another arrives contiguous (a copy)
        assert (local is value) == value.is_contiguous() and local.is_contiguous()
    if isinstance(value, np.ndarray):
        contiguous = value.flags.c_contiguous and value.flags.writeable
        assert (local is value) == (contiguous and type(value) is np.ndarray)
        assert local.flags.c_contiguous and local.flags.writeable


@pytest.mark.parametrize("name,value,pattern", BAD, ids=[r[0] for r in BAD])
def test_local_and_codec_refuse_alike(name, value, pattern):
    with pytest.raises(TypeError, match=pattern) as by_codec:
        codec.encode(value)
    with pytest.raises(TypeError) as by_local:
        wire_form(value)
    assert str(by_codec.value) == str(by_local.value)


def test_register_type_takes_dataclasses_and_enums_only():
    class Mode(str, enum.Enum):
        EVAL = "eval"

    assert codec.decode(*codec.encode(Mode.EVAL)) == "eval"  # unregistered: its value
    assert register_type(Mode, name="tests.Mode") is Mode
    assert codec.decode(*codec.encode([Mode.EVAL])) == [Mode.EVAL]  # registered: the member
    assert register_type(Mode, name="tests.Mode") is Mode  # again: a no-op
    with pytest.raises(TypeError, match="dataclass or an Enum class"):
        register_type(int)

    class Other(enum.Enum):
        A = 1

    with pytest.raises(ValueError, match="already registered"):
        register_type(Other, name="tests.Mode")


# -- the new wire forms, property-tested at the codec level --------------------------------------

_registered = st.sampled_from([Stage.ROLLOUT, Level.DEBUG, Access.READ, Access.READ | Access.WRITE,
                               Color.GREEN])
_ints = (st.integers() | st.integers(min_value=2**63 - 2, max_value=2**200)
         | st.integers(min_value=-(2**200), max_value=-(2**63) + 2))
_hashable = st.recursive(
    st.none() | st.booleans() | _ints | st.floats() | st.complex_numbers() | st.text(max_size=4)
    | st.binary(max_size=4) | _registered,
    lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3),
    max_leaves=6,
)
_sizes = st.lists(st.integers(0, 2**63 - 1), max_size=4).map(torch.Size)
canonical = st.recursive(
    _hashable | st.sets(_hashable, max_size=4) | _sizes,
    lambda inner: (st.lists(inner, max_size=3) | st.tuples(inner)
                   | st.dictionaries(_hashable, inner, max_size=3)
                   | st.builds(Step, inner, inner)),
    max_leaves=12,
)
# values holding subclasses of the base types, which travel in their base form
_based = (st.sampled_from([FinishReason.STOP, Priority.HIGH, Perm.R | Perm.W, np.str_("n")])
          | st.text(max_size=3).map(Tag) | _ints.map(Count) | st.floats().map(Ratio))
with_base_forms = st.recursive(
    _hashable | _based,
    lambda inner: (st.lists(inner, max_size=3).map(Items) | st.builds(Pair, inner, inner)
                   | st.dictionaries(_hashable | _based, inner, max_size=3)
                   | st.frozensets(_hashable | _based, max_size=3)
                   | st.binary(max_size=4).map(bytearray)),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(canonical)
def test_new_wire_forms_round_trip_exactly(value):
    body, buffers = codec.encode(value)
    assert same(value, codec.decode(body, buffers))
    assert wire_form(value) is value  # already in wire form: a local channel passes it as is


@settings(max_examples=200, deadline=None)
@given(with_base_forms)
def test_base_forms_are_the_same_locally_and_through_the_codec(value):
    body, buffers = codec.encode(value)
    decoded = codec.decode(body, buffers)
    local = wire_form(value)
    assert same(decoded, local)
    assert wire_form(local) is local  # a wire form is final
    again = codec.decode(*codec.encode(decoded))
    assert same(decoded, again)


@settings(max_examples=300, deadline=None)
@given(canonical, st.data())
def test_a_mutated_encoding_is_a_value_error_or_a_value(value, data):
    """The decoder never fails otherwise on bytes of the new forms gone wrong."""
    body = bytearray(codec.encode(value)[0])
    for _ in range(data.draw(st.integers(1, 3))):
        if body and data.draw(st.booleans()):
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
        else:
            del body[data.draw(st.integers(0, len(body))):]
    try:
        codec.decode(bytes(body))
    except ValueError as exc:
        assert type(exc) is ValueError and str(exc)


@pytest.mark.parametrize("body", [b"\xc4", b"\xc4\x05ab", b"\xc4\x00\x00"])
def test_a_cut_or_padded_bin8_body_is_a_value_error(body):
    """The small-bytes shortcut reads the length byte only when there is one."""
    with pytest.raises(ValueError):
        codec.decode(body)
    assert codec.decode(b"\xc4\x02ab") == b"ab"


@pytest.mark.parametrize("body, cause", [
    (b"\xc1", "not valid msgpack"),
    (msgpack.packb(msgpack.ExtType(4, b"\xc1")), "not valid msgpack"),
    (b"\x91" * 3000 + b"\xc0", "deeper than msgpack's decoder allows"),
], ids=["reserved-byte", "reserved-byte-in-ext", "nested-3000-deep"])
def test_msgpack_errors_without_a_message_still_name_the_cause(body, cause):
    """msgpack's FormatError and StackError carry no text: the ValueError says what they mean."""
    with pytest.raises(ValueError, match=cause):
        codec.decode(body)


# -- malformed new forms against live brokers ----------------------------------------------------

_p = msgpack.packb
MALFORMED = [
    (msgpack.ExtType(7, _p(5)), "malformed set: its payload is not an array"),
    (msgpack.ExtType(7, _p([[1]])), "malformed set: an element is not hashable"),
    (msgpack.ExtType(8, b"\xc1"), "cannot decode item"),
    (msgpack.ExtType(9, b"abc"), "malformed complex: 3 bytes, expected 16"),
    (msgpack.ExtType(10, b""), "malformed big int: no bytes"),
    (msgpack.ExtType(11, _p([2**64 - 1])), "malformed torch.Size"),
    (msgpack.ExtType(11, _p(["a"])), "malformed torch.Size"),
    (msgpack.ExtType(12, _p("payloads:Stage")), r"malformed Enum member: not \[tag, name\]"),
    (msgpack.ExtType(12, _p(["nowhere:Nothing", "X"])), "unknown serializable type tag"),
    (msgpack.ExtType(12, _p(["payloads:Sample", "X"])), "names Sample, not an Enum"),
    (msgpack.ExtType(12, _p(["payloads:Stage", "NOPE"])), "Stage has no member 'NOPE'"),
    (msgpack.ExtType(12, _p(["payloads:Stage", 1])), "malformed Stage member reference 1"),
    (msgpack.ExtType(4, _p(["payloads:Stage", {}])), "names Stage, not a dataclass"),
    (msgpack.ExtType(99, b""), "unknown ext type 99"),
]


def _raw_put(ch: Channel, bodies: list[bytes]) -> list[dict]:
    """Put each body from a bare DEALER (what a hostile or buggy client can send); the reply
    records."""
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(ch.address)
    try:
        raw.send_multipart([pack_header([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION}])])
        assert raw.poll(10_000), "no hello reply"
        raw.recv_multipart()
        replies = []
        for rid, body in enumerate(bodies, start=2):
            raw.send_multipart([pack_header([{"op": "put", "id": rid, "k": "bad", "nf": 1}]), body])
            while True:
                assert raw.poll(10_000), "no put reply"
                (rec,) = msgpack.unpackb(raw.recv_multipart()[0])
                if rec.get("id") == rid:
                    replies.append(rec)
                    break
        return replies
    finally:
        raw.close()


def test_malformed_forms_are_clear_errors_and_the_broker_stays_up(channels):
    # a broker that decodes items (a collector): each put fails with a ValueError naming the fault
    decoding = Channel.create("decoding", collector="payloads:Unwrap")
    channels.append(decoding)
    pid = decoding.stats()["pid"]
    replies = _raw_put(decoding, [msgpack.packb({"v": ext}) for ext, _ in MALFORMED])
    for rec, (_ext, message) in zip(replies, MALFORMED, strict=True):
        assert rec["e"][0] == "ValueError" and re.search(message, rec["e"][1]), rec
    assert decoding.qsize("bad") == 0 and pid_alive(pid)
    decoding.put({"v": {Stage.TRAIN, 2**70}}, key="good")
    assert decoding.get(key="good", timeout=10) == {Stage.TRAIN, 2**70}
    # a broker that forwards frames as they are: the getter's decode fails, with the same words
    plain = Channel.create("plain")
    channels.append(plain)
    pid = plain.stats()["pid"]
    replies = _raw_put(plain, [msgpack.packb(ext) for ext, _ in MALFORMED])
    assert all("e" not in rec for rec in replies)
    for _ext, message in MALFORMED:
        with pytest.raises(ValueError, match=message):
            plain.get(key="bad", timeout=10)
    assert pid_alive(pid) and plain.stats()["pid"] == pid
    plain.put(1 + 2j, key="good")
    assert plain.get(key="good", timeout=10) == 1 + 2j


class _KeyWord(str, enum.Enum):
    TRAIN = "train"


class _Rank(enum.IntEnum):
    ONE = 1


class _Name(str):
    pass


_Pair = collections.namedtuple("_Pair", "group rank")


def test_keys_of_base_type_subclasses_are_their_base_value_everywhere(make):
    """A key that subclasses str, int, bytes or tuple (an Enum member, a named tuple) is its
    base value on every path, as an item is: the same queue as the plain key, and a plain key
    in ``stats()``."""
    ch = make("subkeys")
    for key, plain in ((_KeyWord.TRAIN, "train"), (_Name("n"), "n"), (_Rank.ONE, 1),
                       (_Pair("actor", 2), ("actor", 2)), ((_KeyWord.TRAIN, _Rank.ONE), ("train", 1))):
        ch.put(repr(key), key=key)
        assert ch.qsize(plain) == 1 and ch.qsize(key) == 1
        assert plain in ch.stats()["keys"]
        assert all(type(k) in (str, int, bytes, tuple) for k in ch.stats()["keys"])
        assert ch.get(key=plain, timeout=10) == repr(key)
