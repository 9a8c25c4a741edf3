"""Registered dataclasses used by the tests (importable by worker processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zchannel.broker import serializable


@serializable
@dataclass
class Sample:
    obs: Any
    tags: list = field(default_factory=list)
    info: dict = field(default_factory=dict)


@dataclass
class Unregistered:
    x: int = 1
