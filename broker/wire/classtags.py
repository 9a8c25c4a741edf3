"""Classes registered for the wire: dataclasses and Enum classes, each under a tag.

``register_type(cls)`` / ``@serializable`` put a class in the registry of this process; the codec
(``broker/wire/codec.py``) sends an instance as its tag plus its fields (a dataclass) or its member
name (an Enum), and rebuilds it from the registry of the receiving process.  Nothing on the wire
names a class to import: a tag this process has not registered is a ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, TypeVar

from zchannel.hooks import load_entry_points

C = TypeVar("C", bound=type)
TAG_TO_CLS: dict[str, type] = {}
CLS_TO_TAG: dict[type, str] = {}


def register_type(cls: C, name: str | None = None) -> C:
    """Allow instances of ``cls`` on the wire, tagged ``name`` (default ``"module:qualname"``).

    ``cls`` is a dataclass (an instance travels field by field and is rebuilt with the class's
    constructor) or an ``Enum`` class (a member travels as tag + member name and arrives as the
    member itself; a combination of ``Flag`` members travels as tag + value).  Re-registering
    the same class is a no-op; another class under a taken tag is a ``ValueError``.
    """
    if not isinstance(cls, type) or not (
        dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)
    ):
        raise TypeError(f"register_type takes a dataclass or an Enum class, not {cls!r}")
    tag = name or f"{cls.__module__}:{cls.__qualname__}"
    owner = TAG_TO_CLS.get(tag)
    if owner is not None and owner is not cls:
        if f"{owner.__module__}:{owner.__qualname__}" != f"{cls.__module__}:{cls.__qualname__}":
            raise ValueError(f"serializable tag {tag!r} is already registered to {owner!r}")
    TAG_TO_CLS[tag] = cls
    CLS_TO_TAG[cls] = tag
    return cls


def serializable(cls: C | None = None, *, name: str | None = None) -> Any:
    """Class decorator form of :func:`register_type`: ``@serializable`` or
    ``@serializable(name="tag")``, on a dataclass or an Enum class."""
    if cls is None:
        return lambda c: register_type(c, name)
    return register_type(cls, name)


def lookup_tag(tag: str) -> type:
    """The class registered under ``tag`` (plug-ins' entry points are loaded once if it is
    unknown); ``ValueError`` if there is none."""
    cls = TAG_TO_CLS.get(tag)
    if cls is None:
        load_entry_points()  # plug-ins register their types on import
        cls = TAG_TO_CLS.get(tag)
    if cls is None:
        raise ValueError(
            f"unknown serializable type tag {tag!r}: import the module that registers it"
        )
    return cls


def member_ref(member: enum.Enum) -> str | int:
    """How a member of a registered Enum is named on the wire: its member name, or for a
    combination of ``Flag`` members (no single name) its int value."""
    name = member._name_
    if name is not None and type(member).__members__.get(name) is member:
        return name
    return member._value_


def member_from_ref(cls: type, ref: Any) -> enum.Enum:
    """The member of registered Enum ``cls`` that :func:`member_ref` named ``ref``;
    ``ValueError`` for anything else."""
    if isinstance(ref, str):
        member = cls.__members__.get(ref)
        if member is None:
            raise ValueError(f"{cls.__qualname__} has no member {ref!r}")
        return member
    if isinstance(ref, int) and not isinstance(ref, bool) and issubclass(cls, enum.Flag):
        try:
            return cls(ref)
        except ValueError:
            raise ValueError(f"{ref} is not a valid {cls.__qualname__} value") from None
    raise ValueError(f"malformed {cls.__qualname__} member reference {ref!r}")
