"""Checks of the arguments every transport validates the same way: keys, weights, timeouts,
``get_batch`` targets, ``peek`` counts and the ``consumer`` of ``qsize``/``full``/``peek``, and
the weight comparisons of ``get_batch``; the text that names a key where only text fits
(``key_label``, ``key_from_label``), and a refused number in an error message (``shown``).

Used by the client (before a request is sent), the broker (on what arrives) and the local
channel, so that all three refuse the same values with the same messages.
"""

from __future__ import annotations

import ast
import enum
import math
import numbers
import sys
from typing import Any

import numpy as np
from zchannel.hooks import check_consumer_id

MAX_KEY_BYTES = 1024
MAX_KEY_DEPTH = 4  # tuples in tuples
MAX_KEY_PARTS = 64  # parts of a tuple key in all, those of the tuples inside it counted
MAX_WEIGHT = 2**53
MAX_PEEK = 1024
MAX_TIMEOUT = sys.float_info.max  # any finite number of seconds
# an int of more bits than this is named by its size in an error message, not written out
# (Python refuses to write one of more than 4300 digits: that error would name no argument);
# another value by its repr, cut after SHOWN_CHARS characters
SHOWN_INT_BITS = 256
SHOWN_CHARS = 100
# Float weights are summed in binary floating point: 0.1 + 0.2 is 0.30000000000000004, which
# a target of 0.3 would otherwise refuse.  A total within this relative slack of the target
# counts as reaching it and not as exceeding it (int weights and targets compare exactly).
FLOAT_SLACK = 1e-9

# the first characters of the Python literals key_from_label reads (int, bytes, str, tuple;
# literal_eval skips leading blanks)
_LITERAL_STARTS = frozenset("0123456789+-.bBrR'\"( \t")
_KEY_TYPES = "keys are str, int, bytes or tuples of those"
# why a bool or a float (any number but an int) is no key
_NUMBER_WHY = (f"{_KEY_TYPES}, because True == 1 and 1.0 == 1 would share a queue in a Python "
               "dict (as in RLinf) but not on the wire")


def check_key(key: Any) -> Any:
    """Return ``key`` if it is a valid queue key (str, int, bytes or tuples of those); a
    subclass of one of those (a ``str``/``int`` Enum member, a named tuple) as its base value,
    as an item travels, so that a key is the same on every path and in ``stats()``.  A tuple
    key holds at most ``MAX_KEY_PARTS`` parts in all (nested tuples' parts counted) and at
    most ``MAX_KEY_BYTES`` characters and bytes of str and bytes parts in all."""
    if type(key) is str and len(key) <= MAX_KEY_BYTES and key.isascii():  # the common case
        return key
    return _checked_key(key, 0, [MAX_KEY_PARTS, MAX_KEY_BYTES])


def _check_key_text(key: str) -> None:
    """``TypeError`` for a str key that UTF-8 cannot hold (a lone surrogate): it could not
    travel, so no path takes it."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TypeError(f"a key str must be valid Unicode that UTF-8 can hold: {exc}") from None


def _checked_key(key: Any, depth: int, left: list[int]) -> Any:
    """``check_key`` of ``key`` at nesting ``depth``; ``left``: the parts and the str/bytes
    length the whole key may still hold (both counted down here)."""
    if isinstance(key, bool):
        raise TypeError(f"a key may not be a bool: {_NUMBER_WHY}")
    if isinstance(key, (str, bytes)):
        left[1] -= len(key)
        if left[1] < 0:
            raise ValueError(f"key longer than the key size limit ({MAX_KEY_BYTES} characters "
                             "and bytes of str and bytes parts in all)")
        if isinstance(key, str) and not key.isascii():
            _check_key_text(key)
        if type(key) is str or type(key) is bytes:
            return key
        return str.__str__(key) if isinstance(key, str) else bytes(key)
    if isinstance(key, int):
        if not -(2**63) <= key < 2**64:
            raise ValueError("an int key must fit in 64 bits")
        return key if type(key) is int else int.__int__(key)
    if isinstance(key, tuple) and depth < MAX_KEY_DEPTH:
        left[0] -= len(key)
        if left[0] < 0:
            raise ValueError(f"a tuple key may have at most {MAX_KEY_PARTS} parts in all "
                             "(the parts of tuples inside it counted)")
        parts = [_checked_key(part, depth + 1, left) for part in key]
        if type(key) is tuple and all(p is q for p, q in zip(parts, key, strict=True)):
            return key
        return tuple(parts)
    if isinstance(key, tuple):
        raise TypeError(f"a key's tuples may be nested {MAX_KEY_DEPTH} deep at most "
                        "(the key itself counted)")
    raise _not_a_key(key)


def _not_a_key(key: Any) -> TypeError:
    """The error of a key of no key type, with what fits its type: for an ``Enum`` member the
    fix (its value, or its name), for a numpy integer (``np.arange``) ``int(key)``, for a list
    ``tuple(key)``, for another number (a float) why numbers are no keys; else the key types."""
    kind = type(key).__name__
    if isinstance(key, enum.Enum):
        return TypeError(f"a key may not be a {type(key).__qualname__} (an Enum member): "
                         f"{_member_fix(key)}; {_KEY_TYPES}")
    if isinstance(key, numbers.Integral):
        return TypeError(f"a key may not be a {kind}: pass int(key) (an int key is a Python "
                         f"int, not another integer type; {_KEY_TYPES})")
    if isinstance(key, numbers.Number):
        return TypeError(f"a key may not be a {kind}: {_NUMBER_WHY}")
    if isinstance(key, list):
        return TypeError(f"a key may not be a list: pass tuple(key) ({_KEY_TYPES})")
    return TypeError(f"a key may not be {'None' if key is None else 'a ' + kind}: {_KEY_TYPES}")


def _member_fix(member: enum.Enum) -> str:
    """How to pass ``member`` of an Enum whose members are no keys (no ``str`` or ``int``
    base): as its value if that is a key, else as its name."""
    name = member._name_
    spelled = (f"{type(member).__qualname__}.{name}" if name is not None and name.isidentifier()
               else "member")  # (a combination of Flag members has no one name)
    try:
        check_key(member.value)
    except (TypeError, ValueError):
        if name is None:
            return f"pass a str or int that stands for it (its value, {member.value!r}, is no key)"
        return f"pass its name, key={spelled}.name ({name!r}; its value, {member.value!r}, is no key)"
    return f"pass its value, key={spelled}.value ({member.value!r})"


def key_label(key: Any) -> str:
    """The text naming ``key`` where only text fits (``zchannel stat`` and its JSON, metric
    labels), which ``key_from_label`` reads back: a str key is itself, another key (int, bytes,
    tuple) its ``repr``, and a str key that reads as one of those (``"7"``, ``"('a', 1)"``) its
    ``repr`` too (``"'7'"``), so that no two keys share a label."""
    if isinstance(key, str) and key_from_label(key) == key:
        # the common case: text that is no Python literal, which key_from_label keeps
        return key
    return repr(key)


def key_from_label(text: str) -> Any:
    """The key ``key_label`` names ``text``: ``7`` is the int key 7, ``b'x'`` a bytes key,
    ``('train', 3)`` a tuple key, ``'7'`` the str ``"7"``; other text (``train``) is a str."""
    if not text or text[0] not in _LITERAL_STARTS:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    if isinstance(value, bool) or not isinstance(value, (str, int, bytes, tuple)):
        return text
    return value


def check_weight(weight: Any, what: str = "weight") -> int | float:
    """Return ``weight`` if it is an int or a finite float in ``[0, 2**53]`` (numpy numbers
    become the int or float they equal), else ``ValueError`` naming the value: other numbers
    (``Fraction``, ``Decimal``) are refused, not rounded to a float."""
    kind = type(weight)
    if kind is int or kind is float:
        if 0 <= weight <= MAX_WEIGHT:  # NaN fails every comparison, inf the upper bound
            return weight
    elif not isinstance(weight, bool) and isinstance(weight, numbers.Integral):
        whole = int(weight)
        if 0 <= whole <= MAX_WEIGHT:
            return whole
    elif isinstance(weight, (float, np.floating)):  # a numpy float, or a float subclass
        value = float(weight)
        if 0 <= value <= MAX_WEIGHT:
            return value
    raise ValueError(f"{what} must be an int or a finite float in [0, 2**53] (not a bool, NaN, "
                     f"infinite or negative), got {shown(weight)}")


def check_target_weight(target: Any) -> int | float:
    """``get_batch``'s target: an int or finite float in ``(0, 2**53]``."""
    try:
        value = check_weight(target, "target_weight")  # the range of a weight
    except ValueError:
        raise ValueError(f"target_weight must be an int or a finite float in (0, 2**53] (not a "
                         f"bool, NaN, infinite, zero or negative), got {shown(target)}") from None
    if value <= 0:
        raise ValueError(
            f"target_weight must be an int or a finite float > 0, got {target!r}: zchannel "
            "has no default target, because RLinf's default of 0 returns an empty batch and a "
            "zchannel batch is never empty")
    return value


def check_switch(value: Any, name: str, hint: str = "") -> bool | None:
    """``value`` if it is None, True or False (a numpy bool or a truthy str is not), else
    ``TypeError`` naming ``name`` (and ``hint``)."""
    if value is None or value is True or value is False:
        return value
    raise TypeError(f"{name} must be None, True or False, got {value!r}{hint}")


def check_copy(copy: Any) -> bool | None:
    """A get's ``copy``: None (the default form), True or False, else ``TypeError``."""
    return check_switch(copy, "copy")


def check_flag(value: Any, name: str) -> bool:
    """``ack``, ``async_op``, ``weights``: True or False (a numpy bool too), else ``TypeError`` —
    a truthy ``"no"`` must not switch a mode on."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` as a float: None (no deadline) or a finite number of seconds >= 0 (an int,
    float or numpy number) that a float holds (at most ``MAX_TIMEOUT``), else ``ValueError``
    naming the value.  NaN and infinities are refused: a deadline that compares false with
    every other would stall the broker's timers; so is an int (or a ``Fraction``) beyond every
    float, which no float holds."""
    if timeout is None:
        return None
    kind = type(timeout)
    if (kind is float or kind is int) and 0 <= timeout <= MAX_TIMEOUT:  # the common case
        return float(timeout)
    # compared as a float: a numpy float32 compared with MAX_TIMEOUT would overflow (a warning)
    if not isinstance(timeout, bool) and isinstance(timeout, numbers.Real):
        try:
            seconds = float(timeout)
        except OverflowError:  # beyond every float: out of range, as an infinity is
            seconds = math.inf
        if 0 <= seconds <= MAX_TIMEOUT:  # NaN fails every comparison, inf the upper bound
            return seconds
    raise ValueError(f"timeout must be None or a finite number of seconds >= 0 and <= "
                     f"{MAX_TIMEOUT:g} (not a bool, NaN or infinite), got {shown(timeout)}")


def check_consumer(consumer: Any) -> str | None:
    """The ``consumer`` of ``qsize``, ``full`` and ``peek``: None, or a consumer id
    ``group:rank`` (``TypeError`` for a value that is not a str, ``ValueError`` for a str that
    is not an id)."""
    if consumer is None:
        return None
    if not isinstance(consumer, str):
        raise TypeError(f"consumer must be a str (a consumer id 'group:rank'), got "
                        f"{type(consumer).__name__}")
    return check_consumer_id(consumer)


def check_peek_count(n: Any) -> int:
    """``peek``'s item count: an int in ``[1, MAX_PEEK]``."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PEEK:
        raise ValueError(f"n must be an int in [1, {MAX_PEEK}], got {shown(n)}")
    return n


def shown(value: Any) -> str:
    """``value`` in an error message about it: its ``repr``, cut after ``SHOWN_CHARS``
    characters; an int of more than ``SHOWN_INT_BITS`` bits by its size (``an int of about 401
    digits``), and a value too large to write out (a ``Fraction`` of such ints) by its type."""
    if isinstance(value, int) and value.bit_length() > SHOWN_INT_BITS:
        sign = "a negative" if value < 0 else "an"
        return f"{sign} int of about {math.floor(math.log10(abs(value))) + 1} digits"
    try:
        text = repr(value)
    except ValueError:  # an int inside it past the digits Python writes out
        return f"a {type(value).__name__} too large to write out"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}..."


def exceeds(total: int | float, target: int | float) -> bool:
    """``total > target``, where float sums within ``FLOAT_SLACK`` of the target do not count
    as exceeding it."""
    if total <= target:
        return False
    if type(total) is int and type(target) is int:
        return True
    return total - target > target * FLOAT_SLACK


def reaches(total: int | float, target: int | float) -> bool:
    """``total >= target``, where float sums within ``FLOAT_SLACK`` below it count as reaching."""
    if total >= target:
        return True
    if type(total) is int and type(target) is int:
        return False
    return target - total <= target * FLOAT_SLACK
