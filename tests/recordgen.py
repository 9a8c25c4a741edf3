"""Values for the fields of the wire records (``broker/wire/protocol.py``), read from their
msgspec types: valid ones (within every bound), and for each numeric field the values its
bounds refuse.  Used by ``test_protocol_records.py`` and ``test_numeric_fields.py``."""

from __future__ import annotations

import math
from typing import Any

import msgspec.inspect as mi
from hypothesis import strategies as st

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False), st.text(max_size=8), st.binary(max_size=8),
)
# what a field typed ``Any`` may hold (msgpack arrays decode as lists, maps with str keys)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                               max_size=3),
    max_leaves=8,
)
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # what every msgpack int field can hold


def valid(info: mi.Type, body_max: int = 512) -> st.SearchStrategy:
    """Values of type ``info`` (a ``msgspec.inspect`` type) within its bounds."""
    if isinstance(info, mi.UnionType):
        return st.one_of([valid(t, body_max) for t in info.types])
    if isinstance(info, mi.IntType):
        low = info.ge if info.ge is not None else info.gt + 1 if info.gt is not None else INT_MIN
        high = info.le if info.le is not None else info.lt - 1 if info.lt is not None else INT_MAX
        return st.integers(low, min(high, INT_MAX))
    if isinstance(info, mi.FloatType):
        low = info.ge if info.ge is not None else info.gt
        return st.floats(min_value=low, max_value=info.le, exclude_min=info.gt is not None,
                         allow_nan=False, allow_infinity=False)
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.BytesType):  # within its length bounds (a producer id: 8 to 64)
        high = body_max if info.max_length is None else min(body_max, info.max_length)
        return st.binary(min_size=info.min_length or 0, max_size=high)
    if isinstance(info, mi.ListType):
        return st.lists(valid(info.item_type, body_max), min_size=info.min_length or 0,
                        max_size=max(4, info.min_length or 0))
    if isinstance(info, mi.StructType):  # a record inside a record (the puts of a batch)
        return st.fixed_dictionaries(
            {f.name: valid(f.type, body_max) for f in info.fields}
        ).map(lambda kwargs: info.cls(**kwargs))
    if isinstance(info, mi.StrType):
        return st.text(max_size=16)
    if isinstance(info, mi.DictType):
        return st.dictionaries(st.text(max_size=4), values, max_size=3)
    return values


def numeric(info: mi.Type) -> list[mi.IntType | mi.FloatType]:
    """The int and float types in ``info`` (in unions and list items too)."""
    if isinstance(info, mi.UnionType):
        return [n for t in info.types for n in numeric(t)]
    if isinstance(info, mi.ListType):
        return numeric(info.item_type)
    if isinstance(info, (mi.IntType, mi.FloatType)):
        return [info]
    return []


def refused(info: mi.Type) -> list[Any]:
    """Values a numeric field of type ``info`` refuses: NaN, infinities, bools, strings and the
    numbers just past its bounds (in a one-element list for a list field)."""
    kinds = numeric(info)
    ints = [k for k in kinds if isinstance(k, mi.IntType)]
    floats = [k for k in kinds if isinstance(k, mi.FloatType)]
    out: list[Any] = [math.nan, -math.nan, math.inf, -math.inf, True, "1"]
    if not floats:
        out.append(0.5)
    lows = [k.ge if k.ge is not None else k.gt for k in kinds
            if k.ge is not None or k.gt is not None]
    if lows and (k_low := min(lows)) is not None:
        out.append(k_low - 1 if ints else -1e-9 if k_low == 0 else k_low - abs(k_low) * 1e-3)
        if any(k.gt is not None for k in floats) and min(lows) == 0:
            out.append(0.0)
    highs = [k.le for k in kinds if k.le is not None and k.le < 1e300]
    if highs:
        out.append(max(highs) + 1)
        if floats:
            out.append(float(max(highs)) * 2)
    if isinstance(_strip_none(info), mi.ListType):
        return [[v] for v in out] + ["not a list"]
    return out


def _strip_none(info: mi.Type) -> mi.Type:
    if isinstance(info, mi.UnionType):
        rest = [t for t in info.types if not isinstance(t, mi.NoneType)]
        return rest[0] if len(rest) == 1 else info
    return info
