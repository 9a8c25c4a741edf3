"""One-line summaries of channel items (``zchannel stat NAME --peek KEY``; the key is read by
``argchecks.key_from_label``), and keys as ``zchannel stat`` shows them on a terminal:
``key_text`` escapes what a terminal would act on and cuts a long key (``--json`` keeps keys
exact)."""

from __future__ import annotations

import dataclasses
from typing import Any

from zchannel.broker.wire.argchecks import key_label

WIDTH = 100
KEY_WIDTH = 60  # ``zchannel stat``'s key column: a longer key is cut, ending with "..."


def printable(text: str) -> str:
    """``text`` with every character a terminal could act on (control characters such as ESC
    and newline, line separators, bidirectional overrides: whatever is not printable) escaped
    as ``repr`` writes it (``\\x1b``, ``\\n``, ``\\u202e``); printable text is returned as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def key_text(key: Any, width: int = KEY_WIDTH, more: str = "...") -> str:
    """``key_label(key)`` made ``printable``, cut to ``width`` characters (ending with
    ``more``) when longer."""
    text = printable(key_label(key))
    return text if len(text) <= width else text[: width - len(more)] + more


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
