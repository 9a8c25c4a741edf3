"""What a receiver gets for a value, worked out without encoding it (for local channels).

A local channel (``broker/handle/local.py``) passes items by reference, yet must deliver what a broker
delivers: ``wire_form(obj)`` is ``obj`` itself whenever ``decode(encode(obj))`` would hold the
same types and values (the common case: nothing is copied; C-contiguous, writable arrays and
contiguous tensors are not touched, others are copied into that form, as a broker delivers
them, and a tensor's conjugate or negative bit is resolved, as the encoder resolves it), else
a rebuilt value holding the base forms of ``docs/values.md`` (``"stop"`` for an unregistered
``str`` Enum member, ``tuple`` for a named tuple, ``bytes`` for a ``bytearray``, a detached plain
tensor for a ``Parameter``...).  What the codec refuses is the same ``TypeError`` here, the
nesting limit included (``codec.MAX_DEPTH`` tuples, sets, frozensets and dataclasses inside each
other).  An item whose containers nest deeper than ``WALK_DEPTH`` (lists and dicts included) is
not walked: it takes the broker's own path, encoded and decoded (a copy), which also gives
msgpack's verdict on long runs of nested lists and dicts.
"""

from __future__ import annotations

import enum
import itertools
import sys
from typing import Any

import numpy as np
from zchannel.broker.wire import arrays, codec
from zchannel.broker.wire.classtags import CLS_TO_TAG, PUBLISHED_PENDING, published_tag

WALK_DEPTH = 128  # containers of any kind; deeper items are encoded and decoded instead
# values that travel as they are (a str too once UTF-8 holds it: ``_form`` checks)
_AS_IS = frozenset({type(None), bool, int, float, complex, bytes})


class _Deep(Exception):
    """An item nested deeper than ``WALK_DEPTH``: not walked (see the module docstring)."""


def wire_form(obj: Any) -> Any:
    """``obj`` as a receiver gets it from a broker (``obj`` itself if that is the same); raises
    the ``TypeError`` that ``codec.encode`` raises for a value that cannot travel."""
    try:
        return _form(obj, 0, 0)
    except (_Deep, RecursionError):  # (the caller's own stack was deep already)
        body, buffers = codec.encode(obj)
        return codec.decode(body, buffers, copy=True)


def _form(obj: Any, level: int, nest: int) -> Any:
    """:func:`wire_form` of ``obj`` inside ``level`` containers, ``nest`` of them nesting ext
    types (tuples, sets, frozensets, dataclasses).  The checks come in the encoder's order, so
    that a value of several kinds (a ``str`` Enum, a named tuple) takes the same form and a
    value refused for several reasons is refused for the same one."""
    kind = type(obj)
    if kind in _AS_IS:
        return obj
    if kind is str:
        codec.check_text(obj)
        return obj
    if level >= WALK_DEPTH:
        raise _Deep
    if kind is dict:  # the exact containers first: no subclass question to ask
        return _dict(obj, level, nest)
    if kind is list:
        return _sequence(obj, kind, level, nest)
    if kind is tuple:
        return _sequence(obj, kind, level, _nest(nest))
    if kind is np.ndarray:
        return _array(obj)
    torch = sys.modules.get("torch")  # (not imported: no tensor can exist)
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor(obj, kind, torch)
    return _form_other(obj, kind, level, nest)


def _form_other(obj: Any, kind: type, level: int, nest: int) -> Any:
    """``_form`` for the rarer values: subclasses, registered classes, numpy scalars, bytes."""
    if isinstance(obj, np.ndarray):  # a subclass (the exact type was above)
        return _array(obj)
    if kind in CLS_TO_TAG:
        return obj if isinstance(obj, enum.Enum) else _dataclass(obj, level, _nest(nest))
    if isinstance(obj, tuple):
        if arrays.is_size(obj):
            size = sys.modules["torch"].Size
            return obj if kind is size else size(obj)
        return _sequence(obj, tuple, level, _nest(nest))
    if isinstance(obj, np.generic) and not isinstance(obj, (np.str_, np.bytes_)):
        codec.check_array(obj)
        scalar = arrays.NP_DTYPES[obj.dtype.str].type  # a C-named alias (np.longlong) comes
        return obj if kind is scalar else scalar(obj)  # as its sized type, as decoded
    if isinstance(obj, (bytes, bytearray, memoryview)):
        view = memoryview(obj)
        if level and not view.c_contiguous:  # as the codec: only an item itself is made so
            raise codec.refusal(BufferError(view))
        return view.tobytes()
    if PUBLISHED_PENDING and isinstance(obj, enum.Enum) and published_tag(kind):
        return obj  # its module is published: registered just now
    return _form_base(obj, kind, level, nest)


def _form_base(obj: Any, kind: type, level: int, nest: int) -> Any:
    """Subclasses of the base types take their base value (as ``codec`` encodes them)."""
    if isinstance(obj, dict):
        return _dict(obj, level, nest)
    if isinstance(obj, list):
        return _sequence(obj, list, level, nest)
    if isinstance(obj, str):
        text = str.__str__(obj)
        codec.check_text(text)
        return text
    if isinstance(obj, int):
        return int.__int__(obj)
    if isinstance(obj, float):
        return float.__float__(obj)
    if isinstance(obj, complex):
        return complex(obj.real, obj.imag)
    if isinstance(obj, (set, frozenset)):
        return _sequence(obj, frozenset if isinstance(obj, frozenset) else set, level,
                         _nest(nest))
    if PUBLISHED_PENDING and published_tag(kind):
        return _form(obj, level, nest)  # its module is published: registered just now
    codec.refuse(obj)


def _array(obj: np.ndarray) -> np.ndarray:
    """An array as a broker delivers it: a plain ``ndarray`` (a view of a subclass), ``obj``
    itself if C-contiguous and writable, else a copy that is; the codec's ``TypeError`` for
    one that cannot travel (its dtype, a masked array)."""
    codec.check_array(obj)
    if type(obj) is not np.ndarray:
        obj = obj.view(np.ndarray)
    flags = obj.flags
    if flags.c_contiguous and flags.writeable:
        return obj
    return np.array(obj, order="C")


def _tensor(obj: Any, kind: type, torch: Any) -> Any:
    """A tensor as a broker delivers it: ``obj`` itself if it is a plain, contiguous tensor
    without grad, conjugate or negative bit, else a plain tensor that is (its storage
    shared where nothing needs resolving); the codec's ``TypeError`` for one that cannot
    travel."""
    arrays.tensor_dtype_name(obj)
    if kind is not torch.Tensor or obj.requires_grad:
        obj = obj.detach().as_subclass(torch.Tensor)
    if obj.is_conj():  # (the encoder sends the values, never the lazy bits)
        obj = obj.resolve_conj()
    if obj.is_neg():
        obj = obj.resolve_neg()
    return obj if obj.is_contiguous() else obj.contiguous()


def _nest(nest: int) -> int:
    """``nest`` plus the nesting ext type entered: ``TypeError`` past ``codec.MAX_DEPTH``."""
    if nest >= codec.MAX_DEPTH:
        raise TypeError(codec.too_deep("encode"))
    return nest + 1


def _sequence(obj: Any, base: type, level: int, nest: int) -> Any:
    """A list, tuple, set or frozenset (or subclass) with its elements in wire form: ``obj``
    itself if nothing changes, else a new ``base``."""
    out: list | None = None
    for i, value in enumerate(obj):
        if out is None and (type(value) in _AS_IS  # the common elements: nothing to call
                            or type(value) is str and value.isascii()):
            continue
        form = _form(value, level + 1, nest)
        if out is None:
            if form is value:
                continue
            out = list(itertools.islice(obj, i))
        out.append(form)
    if out is None:
        return obj if type(obj) is base else base(obj)
    return base(out)


def _dict(obj: dict, level: int, nest: int) -> dict:
    out: dict | None = None
    for i, (key, value) in enumerate(obj.items()):
        if out is None and (type(key) in _AS_IS or type(key) is str and key.isascii()) \
                and (type(value) in _AS_IS or type(value) is str and value.isascii()):
            continue
        key_form, value_form = _form(key, level + 1, nest), _form(value, level + 1, nest)
        if out is None:
            if key_form is key and value_form is value:
                continue
            out = dict(itertools.islice(obj.items(), i))
        out[key_form] = value_form
    if out is None:
        return obj if type(obj) is dict else dict(obj)
    return out


def _dataclass(obj: Any, level: int, nest: int) -> Any:
    """A registered dataclass instance: ``obj`` if no field changes, else rebuilt as the
    receiver rebuilds it (``codec.build_dataclass``: its constructor, or field by field for a class with a
    constructor of its own)."""
    fields = codec.dataclass_values(obj)
    forms = {name: _form(value, level + 1, nest) for name, value in fields.items()}
    if all(forms[name] is value for name, value in fields.items()):
        return obj
    return codec.build_dataclass(type(obj), forms)
