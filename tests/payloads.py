"""Registered dataclasses and Enums used by the tests (importable by worker and broker
processes); importing it also registers the RL data modules of ``tests/rldata``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from zchannel.broker import register_module, serializable
from zchannel.hooks import Collector

RLDATA = register_module("rldata", recursive=True)  # an RL framework's data modules, undecorated


@serializable
@dataclass
class Sample:
    obs: Any
    tags: list = field(default_factory=list)
    info: dict = field(default_factory=dict)


@dataclass
class Point:
    """Registered by the test that uses it (``register_type``), not by this module."""

    x: int
    label: tuple = ()


@dataclass
class Unregistered:
    x: int = 1


# -- Enums and subclasses of the value table (tests/test_values.py) ---------------------------


class FinishReason(str, enum.Enum):  # not registered: travels as its value
    STOP = "stop"
    LENGTH = "length"


@serializable
class Stage(str, enum.Enum):  # registered: arrives as the member
    ROLLOUT = "rollout"
    TRAIN = "train"


class Priority(enum.IntEnum):  # not registered: an int
    LOW = 1
    HIGH = 2


@serializable
class Level(enum.IntEnum):
    DEBUG = 10
    INFO = 20


class Perm(enum.IntFlag):  # not registered: an int
    R = 4
    W = 2


@serializable(name="tests.Access")
class Access(enum.IntFlag):  # registered: single members by name, combinations by value
    READ = 1
    WRITE = 2


@serializable
class Color(enum.Enum):  # a plain Enum, registered
    RED = 1
    GREEN = (0, 255, 0)


class Shape(enum.Enum):  # a plain Enum, not registered: refused
    CIRCLE = 1


class Tag(str):
    def __str__(self) -> str:  # what str() shows is not the value
        return f"Tag({str.__str__(self)})"


class Count(int):
    pass


class Ratio(float):
    pass


@serializable
@dataclass(frozen=True)
class Step:
    reason: Any
    sizes: Any = None
    extra: dict = field(default_factory=dict)


class Unwrap(Collector):
    """Yields ``item["v"]``: the broker decodes every put and encodes what it yields."""

    def collect(self, item: Any, key: Any) -> Any:
        yield key, item["v"]
