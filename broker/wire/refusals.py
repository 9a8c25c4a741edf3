"""Where a value a put refuses is in its item: "...; it is at item['obs'][2]".

The encoder (``wire/codec.py``) keeps no trail of the containers it descends through, so once a
put is refused its item is walked again, in the encoder's order, for the first value whose own
refusal is the one raised.  Used by broker channels and local channels alike.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

from zchannel.broker.wire import codec
from zchannel.broker.wire.arrays import is_size
from zchannel.broker.wire.classtags import CLS_TO_TAG

_MAX_RUN = 1100  # lists and dicts in a row a path goes through (msgpack refuses ~1,000)
_MAX_PATH = 400  # characters of a path shown (a longer one loses its middle)
_SHOWN_KEYS = (str, bytes, int, float, bool, type(None))  # dict keys a path shows (repr)
_BIG = 2**64  # (a larger int key is shown by its type: its repr may be thousands of digits)


def refused_at(exc: TypeError, item: Any) -> TypeError:
    """``exc``, the refusal of a value inside ``item`` (a put's), naming where that value is:
    "...; it is at item['obs'][2]".  The item is walked again for it, in the encoder's order,
    only once a put is refused (encoding keeps no trail): the first value whose own refusal
    (``_refusal_alone``) is ``exc``'s is the one refused.  ``exc`` itself when that is the
    item, when no one value is to blame (a refusal of the nesting), or when the walk fails."""
    try:
        path = _refused_path(item, str(exc))
    except Exception:  # (a deep stack, a field that raises): the refusal alone is still true
        return exc
    return exc if path is None else TypeError(f"{exc}; it is at {path}")


def _refused_path(item: Any, refusal: str) -> str | None:
    """The path in ``item`` of the first value refused on its own with the message
    ``refusal``; None if there is none, or it is the item itself.  Each container is walked
    once (an item may hold one several times, or hold itself), without recursion, through at
    most ``codec.MAX_DEPTH`` tuples, sets, frozensets and dataclasses and ``_MAX_RUN`` lists
    and dicts in a row between them: the encoder refuses deeper items before any value in
    them."""
    parts = _parts(item)
    if parts is None:
        return None
    stack = [(parts[0], 1 if parts[1] else 0, 0 if parts[1] else 1)]  # (parts, nesting, run)
    trail = ["item"]  # the path to each container on the stack
    seen = {id(item)}
    while stack:
        steps, nesting, run = stack[-1]
        step = next(steps, None)
        if step is None:
            stack.pop()
            trail.pop()
            continue
        label, value = step
        inner = _parts(value)
        if inner is None:
            if _refusal_alone(value) == refusal:
                path = "".join(trail) + label
                return path if len(path) <= _MAX_PATH else \
                    f"{path[:_MAX_PATH // 2]}...{path[-_MAX_PATH // 2:]}"
            continue
        nests = inner[1]
        if id(value) in seen or (nesting >= codec.MAX_DEPTH if nests else run >= _MAX_RUN):
            continue
        seen.add(id(value))
        stack.append((inner[0], nesting + 1 if nests else nesting, 0 if nests else run + 1))
        trail.append(label)
    return None


def _parts(value: Any) -> tuple[Iterator[tuple[str, Any]], bool] | None:
    """The values ``value`` holds, in the order the encoder packs them, each with the step
    of a path that leads to it (``[2]``, ``['obs']``, ``.keys()[0]``, ``.field``, ``{3}`` for
    the 4th element a set iterates), and whether ``value`` is a nesting type (tuple, set,
    frozenset, registered dataclass); None for a value packed whole."""
    kind = type(value)
    if kind in CLS_TO_TAG:  # registered: a dataclass (its fields) or an Enum (whole)
        if isinstance(value, enum.Enum):
            return None
        fields = codec.dataclass_values(value).items()
        return ((f".{name}", field) for name, field in fields), True
    if isinstance(value, dict):
        return _dict_parts(value), False
    if isinstance(value, list):
        return ((f"[{i}]", v) for i, v in enumerate(value)), False
    if isinstance(value, tuple) and not is_size(value):
        return ((f"[{i}]", v) for i, v in enumerate(value)), True
    if isinstance(value, (set, frozenset)):
        return ((f"{{{i}}}", v) for i, v in enumerate(value)), True
    return None


def _dict_parts(value: dict[Any, Any]) -> Iterator[tuple[str, Any]]:
    """A dict's keys and values, each key before its value (as msgpack packs them)."""
    for i, (key, field) in enumerate(value.items()):
        yield f".keys()[{i}]", key
        kind = type(key)
        text = repr(key) if kind in _SHOWN_KEYS and (kind is not int or -_BIG < key < _BIG) \
            else f"<{kind.__name__} key>"
        yield f"[{text if len(text) <= 40 else text[:37] + '...'}]", field


def _refusal_alone(value: Any) -> str | None:
    """The message of the encoder's refusal of ``value`` (not a container of others:
    ``_parts``) where it stands inside an item; None if it travels.  Worked out without taking
    any data (``codec.encoded_extent``)."""
    kind = type(value)
    if kind is int or kind is float or kind is bool or value is None or kind is bytes \
            or kind is str and value.isascii():
        return None
    try:
        codec.encoded_extent([value])
    except TypeError as exc:
        return str(exc)
    return None
