"""One-line summaries of channel items (``zchannel stat NAME --peek KEY``), and keys as
``zchannel stat`` shows them on a terminal: ``key_text`` escapes what a terminal would act on and
cuts a long key to a number of terminal columns (``--json`` keeps keys exact); ``key_from_text``
reads the printed form back (``--peek``)."""

from __future__ import annotations

import dataclasses
import re
import sys
import unicodedata
from typing import Any

from zchannel.broker.wire.argchecks import key_from_label, key_label

WIDTH = 100
KEY_WIDTH = 60  # ``zchannel stat``'s key column: a longer key is cut, ending with "..."
# the escapes ``escaped`` writes (as ``repr`` writes them), which ``unescaped`` reads
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[\\ntr]|.?)", re.S)
_NAMED = {"\\": "\\", "n": "\n", "t": "\t", "r": "\r"}


def printable(text: str) -> str:
    """``text`` with every character a terminal could act on (control characters such as ESC
    and newline, line separators, bidirectional overrides: whatever is not printable) escaped
    as ``repr`` writes it (``\\x1b``, ``\\n``, ``\\u202e``); printable text is returned as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def escaped(text: str) -> str:
    """``text`` made ``printable`` with its backslashes doubled as well, so that ``unescaped``
    gives ``text`` back (the newline ``a\\nb`` and the backslash-n ``a\\\\nb`` print apart);
    text that is printable and holds no backslash is returned as it is."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join("\\\\" if c == "\\" else c if c.isprintable() else repr(c)[1:-1]
                   for c in text)


def unescaped(text: str) -> str:
    """The text ``escaped`` made ``text`` from: ``\\\\`` is a backslash, ``\\n``, ``\\t``,
    ``\\r``, ``\\xHH``, ``\\uHHHH`` and ``\\UHHHHHHHH`` the characters they name; ``ValueError``
    for a backslash that starts none of these (a backslash of the key is written ``\\\\``)."""
    if "\\" not in text:
        return text

    def one(found: re.Match) -> str:
        body = found.group(1)
        if body in _NAMED:
            return _NAMED[body]
        if len(body) > 1 and int(body[1:], 16) <= sys.maxunicode:
            return chr(int(body[1:], 16))
        raise ValueError(
            f"{printable(text)}: \"{printable(found.group())}\" (character {found.start() + 1}) "
            "is none of the escapes zchannel stat prints: a backslash of a key is printed \\\\, "
            "and \\n, \\t, \\r, \\xHH, \\uHHHH, \\UHHHHHHHH stand for the characters they name")

    return _ESCAPE.sub(one, text)


def key_printed(key: Any) -> str:
    """``key`` as ``zchannel stat`` prints it, whole: its ``key_label``, which is a Python
    literal for any but a plain str key, and a plain str key ``escaped``, or its ``repr`` when
    the escaped text would read as a literal (``'a\\nb'`` of the str ``"'a<newline>b'"``):
    ``key_from_text`` gives ``key`` back."""
    label = key_label(key)
    if label != key:  # a literal: printable (repr escapes what is not), read back as it is
        return label
    text = escaped(label)
    return text if text == label or key_from_label(text) == text else repr(key)


def key_from_text(text: str) -> Any:
    """The key ``key_printed`` printed as ``text``: a Python literal (``7``, ``b'x'``,
    ``('train', 3)``, ``'7'``) is the key it reads as, other text a str key with the escapes
    of ``escaped`` undone (``ValueError`` for a backslash that starts none)."""
    key = key_from_label(text)
    return key if key != text else unescaped(text)


def char_width(c: str) -> int:
    """The terminal columns a character takes: 2 for a wide or fullwidth one (CJK, most emoji),
    0 for a combining mark (it joins the character before it), else 1."""
    if unicodedata.combining(c) or unicodedata.category(c) in ("Mn", "Me"):
        return 0
    return 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1


def text_width(text: str) -> int:
    """The terminal columns ``text`` (printable) takes (``char_width`` of each character)."""
    if text.isascii():
        return len(text)
    return sum(char_width(c) for c in text)


def cut(text: str, width: int, more: str = "...") -> str:
    """``text`` if it fits ``width`` columns, else its start that fits with ``more`` after it
    (a combining mark stays with its character, a wide character is never halved)."""
    if text_width(text) <= width:
        return text
    room = width - text_width(more)
    kept: list[str] = []
    used = 0
    for c in text:
        w = char_width(c)
        if used + w > room:
            break
        kept.append(c)
        used += w
    return "".join(kept) + more


def pad(text: str, width: int) -> str:
    """``text`` with spaces after it up to ``width`` columns (``str.ljust`` in columns)."""
    return text + " " * (width - text_width(text))


def key_text(key: Any, width: int = KEY_WIDTH, more: str = "...") -> str:
    """``key_printed(key)`` cut to ``width`` terminal columns (ending with ``more``) when
    wider."""
    return cut(key_printed(key), width, more)


def summarize(value: Any, width: int = WIDTH) -> str:
    """``value`` in at most ``width`` characters: type, shape and dtype of arrays and tensors,
    sizes of containers, the start of strings."""
    text = _summary(value, 2)
    return text if len(text) <= width else text[: width - 3] + "..."


def _summary(value: Any, depth: int) -> str:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None and not isinstance(value, type):
        kind = type(value).__name__
        dims = "x".join(str(d) for d in tuple(shape)) or "scalar"
        device = getattr(value, "device", None)
        where = f" on {device}" if device is not None and str(device) != "cpu" else ""
        return f"{kind}[{dims}] {dtype}{where}"
    if isinstance(value, (str, bytes)):
        text = repr(value)
        return text if len(text) <= 40 else f"{text[:37]}... ({len(value)} {_unit(value)})"
    if value is None or isinstance(value, (bool, int, float, complex)):
        return repr(value)
    if dataclasses.is_dataclass(value):
        fields = [f.name for f in dataclasses.fields(value)]
        if depth <= 0:
            return f"{type(value).__name__}(...)"
        inner = ", ".join(f"{n}={_summary(getattr(value, n), depth - 1)}" for n in fields[:6])
        return f"{type(value).__name__}({inner}{', ...' if len(fields) > 6 else ''})"
    if isinstance(value, dict):
        if depth <= 0:
            return f"dict({len(value)})"
        parts = [f"{k!r}: {_summary(v, depth - 1)}" for k, v in list(value.items())[:6]]
        more = ", ..." if len(value) > 6 else ""
        return "{" + ", ".join(parts) + more + "}"
    if isinstance(value, (list, tuple, set, frozenset)):
        kind = type(value).__name__
        if depth <= 0:
            return f"{kind}({len(value)})"
        head = [_summary(v, depth - 1) for v in list(value)[:4]]
        more = ", ..." if len(value) > 4 else ""
        return f"{kind}({len(value)}) [{', '.join(head)}{more}]"
    return f"{type(value).__name__}: {repr(value)[:40]}"


def _unit(value: str | bytes) -> str:
    return "chars" if isinstance(value, str) else "bytes"
