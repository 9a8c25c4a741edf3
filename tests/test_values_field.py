"""Registered dataclasses whose ``__init__`` does not take their fields, and queue keys of the
wrong type, through real broker processes and a local channel (docs/values.md, "Which
dataclasses round trip"; the queue keys note under the value table).

A dataclass with its own constructor (``@dataclass(init=False)`` plus an ``__init__`` of its
own, an ``__init__`` in the class body, a constructor that needs an ``InitVar``, an ``__init__``
inherited from a base) is restored on receipt as ``pickle`` restores it: ``cls.__new__(cls)``,
then its fields as sent; its constructor is not run again.  A class that cannot be restored so
is refused when it is registered.  This module is imported by the brokers whose collector
decodes items and by the consumer processes, which register its classes.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import sys
import types
from typing import Any, ClassVar

import pytest
from zchannel.broker import Channel, register_module, register_type, serializable

pytestmark = pytest.mark.timeout(120)


@serializable
@dataclasses.dataclass(init=False)
class Doubled:
    """Its own constructor takes no field: ``Doubled(5).x == 10``; ``made`` counts the calls of
    the constructor in this process."""

    x: int
    made: ClassVar[int] = 0

    def __init__(self, data: int) -> None:
        Doubled.made += 1
        self.x = data * 2


@serializable
@dataclasses.dataclass
class Scaled:
    """``@dataclass`` keeps an ``__init__`` written in the class body: this one takes the field by
    its name but doubles it, so calling it with the sent field would double it again."""

    x: int

    def __init__(self, x: int) -> None:
        self.x = x * 2


@serializable
@dataclasses.dataclass(frozen=True, slots=True, init=False)
class FrozenRange:
    """Frozen, slotted, with a constructor of its own that takes a start and a length."""

    lo: int
    hi: int

    def __init__(self, lo: int, length: int) -> None:
        object.__setattr__(self, "lo", lo)
        object.__setattr__(self, "hi", lo + length)


@serializable
@dataclasses.dataclass
class FromScale:
    """Its generated constructor needs an ``InitVar`` without a default (not a field, never
    sent); ``y`` is computed from it in ``__post_init__``."""

    x: int
    scale: dataclasses.InitVar[int]
    y: int = dataclasses.field(init=False)

    def __post_init__(self, scale: int) -> None:
        self.y = self.x * scale


@dataclasses.dataclass
class _Point:
    x: int
    y: int


@serializable
@dataclasses.dataclass(init=False)
class Labelled(_Point):
    """Inherits ``_Point``'s ``__init__``, which does not take ``label``."""

    label: str = ""


def _own_constructor_item() -> dict[str, Any]:
    labelled = Labelled(1, 2)
    labelled.label = "corner"
    return {"doubled": Doubled(5), "scaled": Scaled(5), "range": FrozenRange(3, 4),
            "initvar": FromScale(2, scale=10), "labelled": labelled,
            "nested": [(Doubled(1), frozenset({FrozenRange(0, 1)}))]}


PATHS = ["broker", "decoding broker", "local"]


@pytest.mark.parametrize("path", PATHS)
def test_a_dataclass_with_its_own_constructor_arrives_as_it_was_put(path, channels):
    """Each class arrives equal to what was put, of its own class, on every path (a broker
    forwarding frames to this process, a broker that rebuilds it for its collector, and
    ``local=True``); its constructor is not run on receipt, and nothing stays queued."""
    kwargs = {"collector": "payloads:Unwrap"} if path == "decoding broker" else {}
    ch = Channel.create("ownctor", local=path == "local", **kwargs)
    channels.append(ch)
    sent = _own_constructor_item()
    assert sent["doubled"].x == 10 and sent["scaled"].x == 10 and sent["initvar"].y == 20
    made = Doubled.made
    ch.put({"v": sent} if path == "decoding broker" else sent, timeout=30)
    got = ch.get(timeout=30)
    assert got == sent, path
    for name, value in sent.items():
        assert type(got[name]) is type(value), (path, name)
    assert got["scaled"].x == 10 and got["range"].hi == 7 and got["labelled"].label == "corner"
    assert Doubled.made == made, "the class's own constructor ran on receipt"
    assert ch.qsize() == 0


CONSUMER = """
import sys
from zchannel.broker import Channel, register_module
register_module("test_values_field")
ch = Channel.connect(sys.argv[1])
print("ready", flush=True)
delivery = ch.get(ack=True, timeout=60)
ch.ack(delivery)
print(repr(delivery.item), flush=True)
ch.close()
"""


def test_a_consumer_process_gets_and_acks_a_class_with_its_own_constructor(channels, workers):
    """A consumer process that registered the module takes the item with ``get(ack=True)``
    and acknowledges it: no refusal at the consumer, no redelivery, nothing left queued or
    leased."""
    ch = Channel.create("ownctor-ack", lease_timeout=60)
    channels.append(ch)
    proc = workers.start(CONSUMER, "ownctor-ack")
    workers.wait_line(proc, "ready")
    ch.put(Doubled(21), timeout=30)
    out = workers.finish(proc, timeout=90)
    assert out.strip().splitlines()[-1] == "Doubled(x=42)", out
    assert ch.qsize() == 0
    assert ch.stats()["leases"] == 0


def _module_of(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


# Tokened is restored without its constructor, but its __new__ needs an argument: no receiver
# could make one (Tokened.__new__(Tokened) fails)
NEEDS_TOKEN_MODULE = """
import dataclasses

@dataclasses.dataclass
class Fine:
    x: int

@dataclasses.dataclass(init=False)
class Tokened:
    x: int

    def __new__(cls, token):
        return super().__new__(cls)

    def __init__(self, token):
        self.x = len(token)
"""


@pytest.mark.parametrize("local", [False, True])
def test_a_dataclass_no_receiver_could_rebuild_is_refused_at_registration(local, channels):
    """A class restored without its constructor whose ``__new__`` needs arguments is a
    ``TypeError`` naming it and why at ``register_type``, and ``register_module`` of a module
    holding one registers nothing of it; its instances stay unregistered, so ``put`` refuses
    them and nothing is enqueued."""
    module = _module_of("zc_field_needs_token", NEEDS_TOKEN_MODULE)
    try:
        with pytest.raises(TypeError, match=r"Tokened.*__new__ needs more arguments"):
            register_type(module.Tokened)
        with pytest.raises(TypeError, match=r"Tokened.*nothing of .* was registered"):
            register_module(module)
        ch = Channel.create("unrebuildable", local=local)
        channels.append(ch)
        for item in (module.Tokened("abc"), module.Fine(1)):
            with pytest.raises(TypeError, match="is not registered for the wire"):
                ch.put(item, timeout=30)
        assert ch.qsize() == 0
    finally:
        del sys.modules[module.__name__]


class Reason(enum.Enum):
    STOP = "stop"


class Speed(enum.Enum):
    FAST = 1.5


NUMBER_WHY = r"True == 1 and 1\.0 == 1 would share a queue"


@pytest.mark.parametrize("local", [False, True])
def test_a_key_of_the_wrong_type_gets_the_reason_that_fits_it(local, channels):
    """The bool/float rationale only for numbers; an Enum member is told to pass its value (or
    its name when its value is no key either); a list ``tuple(key)``; other types the key
    types.  Every refused put enqueues nothing."""
    ch = Channel.create("keywords", local=local)
    channels.append(ch)
    cases = [
        (Reason.STOP, r"may not be a Reason \(an Enum member\): pass its value, "
                      r"key=Reason\.STOP\.value \('stop'\)"),
        (Speed.FAST, r"may not be a Speed \(an Enum member\): pass its name, "
                     r"key=Speed\.FAST\.name \('FAST'; its value, 1\.5, is no key\)"),
        (None, r"^a key may not be None: keys are str, int, bytes or tuples of those$"),
        (datetime.date(2026, 1, 1), r"^a key may not be a date: keys are str, int, bytes"),
        (frozenset({1}), r"^a key may not be a frozenset: keys are str, int, bytes"),
        ([1, 2], r"^a key may not be a list: pass tuple\(key\)"),
        (("a", None), r"^a key may not be None"),
        (1.5, NUMBER_WHY),
        (True, NUMBER_WHY),
    ]
    for key, message in cases:
        with pytest.raises(TypeError, match=message) as info:
            ch.put("x", key=key, timeout=30)
        if not isinstance(key, (bool, float)):
            assert "would share a queue" not in str(info.value), key
    assert ch.qsize() == 0
    ch.put("x", key=Reason.STOP.value, timeout=30)
    assert ch.get(key="stop", timeout=30) == "x"
