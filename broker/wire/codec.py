"""Item serialization: a msgpack body plus zero-copy buffers for large arrays and tensors.

``encode(item)`` returns ``(body, buffers)``.  The body is msgpack; non-native values are ext
types whose payload is itself msgpack:

=====  ==============  ==========================================================
code   value           payload
=====  ==============  ==========================================================
1      tuple           ``[elements...]`` (so tuples stay tuples, also nested)
2      numpy array     ``[dtype.str, shape, loc]``
3      torch tensor    ``[dtype name, shape, loc, device]``
4      dataclass       ``[tag, {field: value}]`` (registered classes only; a field never set
                       is left out)
5      numpy scalar    ``[dtype.str, raw bytes]``
6      large bytes     ``frame index`` (bytes of 64 KiB or more travel as a buffer)
7      set             ``[elements...]``
8      frozenset       ``[elements...]``
9      complex         16 raw bytes: real and imaginary part, little-endian float64 (not msgpack)
10     big int         raw bytes: the int in big-endian two's complement (not msgpack); ints
                       outside ``[-2**63, 2**64)``, which msgpack cannot hold
11     torch.Size      ``[ints...]``
12     Enum member     ``[tag, member name]`` (registered Enums; a ``Flag`` combination:
                       ``[tag, int value]``)
=====  ==============  ==========================================================

The arrays' and tensors' part -- dtype allow-lists, descriptor heads kept per dtype and
shape, the checks of a received descriptor -- is ``broker/wire/arrays.py``.  What becomes of
every Python type (base values of subclasses, refusals) is ``docs/values.md``;
:func:`wire_form` (``broker/wire/wireform.py``) gives the same answer without encoding.

``loc`` is the raw bytes inline (below ``INLINE_LIMIT``) or the index of a buffer, or ``[i]``: the
``i``-th shared-memory slot of the item (same-host path, ``broker/shm/``).  Every buffer is
``prod(shape) * itemsize`` bytes of C-contiguous data.  ``decode`` validates every field
(dtype allow-list, rank, sizes, frame indices) and never unpickles anything; it restores a
tensor's ``device`` where the receiver can (a broker decoding for its hooks keeps tensors on the
CPU: ``decode(..., restore_devices=False)``).  ``encoded_extent`` gives the bytes and buffers an
item takes without taking its arrays' data (a put refused for ``max_message_bytes`` or
``max_frames`` copies nothing).

Nesting.  The payload of a tuple, set, frozenset or dataclass (the *nesting* ext types) is
decoded by a nested call of msgpack's unpacker, through ``ext_hook``; each such level costs
about 45 KiB of C stack, and a few hundred levels overflow it.  So they nest at most
``MAX_DEPTH`` deep along any path of an item: the encoder counts them as it goes and refuses a
deeper item with a ``TypeError``; the decoder counts them *before* each nested call and refuses
deeper input with a ``ValueError``; from ``HEAP_DEPTH`` levels on it decodes with an
``Unpacker``, whose state is on the heap (a few KiB of stack a level).  The payloads of the
other ext types (arrays, tensors, scalars...) are descriptors decoded without ext types
(``EXT_BIGINT`` aside), so they never nest.  Lists and dicts nest inside one payload without
recursion: msgpack's own limits bound them (its unpacker refuses more than 1,024 nested in a
row; every payload is packed inside a one-element array, so that the packer, which allows one
level more, refuses first).  Encoding recurses on the Python stack (per nesting level; with the
pure-Python msgpack per list and dict too): an item that reaches Python's recursion limit first
is refused naming that limit (``out_of_stack``).  ``wireform.py`` gives the same verdicts for
``local=True``.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, NoReturn

import msgpack
import numpy as np
from zchannel.broker.wire.arrays import (
    NP_DTYPES,
    array_layout,
    array_payload,
    check_dtype,
    check_rank,
    is_size,
    is_tensor,
    keep_sent_device,
    numpy_of,
    restore_device,
    tensor_bytes,
    tensor_head,
    tensor_over,
    tensor_payload,
    torch_module,
)
from zchannel.broker.wire.classtags import (
    CLS_TO_TAG,
    PUBLISHED_PENDING,
    lookup_tag,
    member_from_ref,
    member_ref,
    published_tag,
    rebuilt_by_constructor,
    registration_hint,
)
from zchannel.broker.wire.packers import shared_packer

INLINE_LIMIT = 64 * 1024

EXT_TUPLE, EXT_NDARRAY, EXT_TENSOR, EXT_DATACLASS, EXT_NPSCALAR, EXT_BYTES = 1, 2, 3, 4, 5, 6
EXT_SET, EXT_FROZENSET, EXT_COMPLEX, EXT_BIGINT, EXT_SIZE, EXT_ENUM = 7, 8, 9, 10, 11, 12
INT_MIN, INT_END = -(2**63), 2**64  # msgpack ints: [INT_MIN, INT_END); others are EXT_BIGINT
_COMPLEX = struct.Struct("<dd")
NESTED_TOO_DEEPLY = "cannot encode item: nested too deeply"
MAX_DEPTH = 100  # tuples, sets, frozensets and dataclasses inside each other, along any path
HEAP_DEPTH = 4  # from this many nesting levels on, payloads are decoded by a heap Unpacker
# msgpack's pure-Python fallback (MSGPACK_PUREPYTHON=1, or a msgpack built without its C
# extension) packs each list and dict level in Python frames of its own
PURE_PYTHON_MSGPACK = msgpack.Packer.__module__ == "msgpack.fallback"
# what msgpack's errors that carry no message of their own mean
_MSGPACK_CAUSES: dict[type, str] = {
    msgpack.exceptions.FormatError: "the body is not valid msgpack (a reserved or unknown byte)",
    msgpack.exceptions.StackError: "the body nests lists and maps deeper than msgpack's "
                                   "decoder allows",
}


def too_deep(what: str) -> str:
    """The error message for an item nested deeper than ``MAX_DEPTH``."""
    return (f"cannot {what} item: tuples, sets, frozensets and dataclasses nested deeper than "
            f"the depth limit of {MAX_DEPTH} (docs/values.md)")

def bigint_bytes(value: int) -> bytes:
    """The payload of an ``EXT_BIGINT``: ``value`` in big-endian two's complement."""
    return value.to_bytes(value.bit_length() // 8 + 1, "big", signed=True)


def refuse(obj: Any) -> NoReturn:
    """Raise the ``TypeError`` for a value that cannot travel, naming its type and the fix."""
    cls = type(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(obj, enum.Enum):
        raise TypeError(
            f"Enum {name} is not registered for the wire: {registration_hint(cls)} (its members "
            "then arrive as themselves; str and int Enums unregistered arrive as their value)"
        )
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        raise TypeError(f"dataclass {name} is not registered for the wire: {registration_hint(cls)}")
    if isinstance(obj, np.ma.MaskedArray):
        if cls is np.ma.MaskedArray:  # its public name (numpy < 2 says numpy.ma.core)
            name = "numpy.ma.MaskedArray"
        raise TypeError(
            f"cannot send a {name}: its mask would be lost; send arr.filled(value), or arr.data "
            "and arr.mask as two arrays"
        )
    raise TypeError(
        f"cannot send an object of type {name}: items are None, bool, int, float, complex, str, "
        "bytes, list, tuple, dict, set, frozenset, numpy arrays and scalars, torch tensors, "
        "torch.Size and registered dataclasses and Enums (docs/values.md)"
    )

# ---------------------------------------------------------------------------------------------
# Encoding


def check_array(obj: Any) -> None:
    """``TypeError`` for a numpy array or scalar that cannot travel (a masked array, its
    dtype, a rank above ``arrays.MAX_RANK``)."""
    if type(obj) is not np.ndarray and isinstance(obj, np.ma.MaskedArray):
        refuse(obj)
    check_dtype(obj)
    check_rank(obj.ndim)


def _small_buffer() -> dict[str, int]:
    """``Packer`` arguments for a small first buffer where msgpack takes them (1.1 and later):
    the default buffer (256 KiB, 1 MiB in 1.0) costs more to allocate than a small item costs
    to pack, and ``packb`` makes a packer per call (the encoder needs one per nested value: a
    packer is not re-entrant)."""
    try:
        msgpack.Packer(buf_size=256)
    except TypeError:
        return {}
    return {"buf_size": 256}


_PACKER_ARGS = {"strict_types": True, "use_bin_type": True, **_small_buffer()}


class _Encoder:
    __slots__ = ("buffers", "shm", "refs", "depth")

    def __init__(self, shm: Any = None) -> None:
        self.buffers: list[Any] = []
        self.shm = shm  # shared-memory slot allocator (broker/shm/pool.py) or None
        self.refs: list[Any] = []
        self.depth = 0  # nesting ext types around the value being packed

    def pack(self, obj: Any) -> bytes:
        """A descriptor's msgpack (the payload of an array, tensor, scalar... ext type)."""
        return msgpack.Packer(default=self.default, **_PACKER_ARGS).pack(obj)

    def pack_value(self, obj: Any) -> bytes:
        """The msgpack of a value that may hold lists and dicts: packed as ``[obj]``, minus the
        array's one-byte header, so that the packer's nesting limit (one level more than the
        unpacker's) refuses everything the unpacker would.  An item that is a memoryview
        travels as its bytes, in C order when it is not C-contiguous (msgpack packs only
        contiguous ones: inside an item, such a view is a ``TypeError``).  A top-level array or
        tensor, which holds nothing to nest, is packed as its ext type alone."""
        kind = type(obj)
        if kind is np.ndarray or kind.__module__ == "torch" and is_tensor(obj):
            return _plain_packer.pack(self.default(obj))  # nothing inside to nest
        if kind is memoryview and not obj.c_contiguous:
            obj = obj.tobytes()
        return msgpack.Packer(default=self.default, **_PACKER_ARGS).pack([obj])[1:]

    def nest(self, code: int, payload: Any) -> msgpack.ExtType:
        """A nesting ext type (tuple, set, frozenset, dataclass), one level deeper; its
        payload packed as ``pack_value`` packs."""
        depth = self.depth
        if depth >= MAX_DEPTH:
            raise TypeError(too_deep("encode"))
        self.depth = depth + 1
        data = msgpack.Packer(default=self.default, **_PACKER_ARGS).pack([payload])
        self.depth = depth  # (an exception ends the whole encoding: no need to restore it then)
        return msgpack.ExtType(code, data[1:])

    def loc(self, data: Any, nbytes: int) -> Any:
        if nbytes < INLINE_LIMIT:
            return bytes(memoryview(data).cast("B")) if nbytes else b""
        self.buffers.append(data)
        return len(self.buffers) - 1

    def array_loc(self, arr: np.ndarray) -> Any:
        """``loc`` of a C-contiguous array's bytes (an array's or a tensor's): a shared-memory
        slot ``[i]`` when the allocator takes it (same host, above its threshold, a free slot),
        else ``loc``."""
        nbytes = arr.nbytes
        if nbytes < INLINE_LIMIT:
            return arr.tobytes()  # (cheaper than ``loc``'s memoryview cast)
        if self.shm is not None:
            ref = self.shm(arr, nbytes)
            if ref is not None:
                self.refs.append(ref)
                return [len(self.refs) - 1]
        return self.loc(arr, nbytes)

    def default(self, obj: Any) -> Any:
        if type(obj) is tuple:  # the commonest ext: no subclass question to ask
            return self.nest(EXT_TUPLE, list(obj))
        if isinstance(obj, np.ndarray):
            if type(obj) is not np.ndarray:
                check_array(obj)  # (array_payload checks a plain array's dtype)
            # (np.ascontiguousarray would make a 0-d array 1-d)
            arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
            return msgpack.ExtType(EXT_NDARRAY, array_payload(arr, self.array_loc(arr)))
        if is_tensor(obj):
            head = tensor_head(obj)  # (checks the tensor before its bytes are taken)
            return msgpack.ExtType(EXT_TENSOR,
                                   tensor_payload(head, self.array_loc(tensor_bytes(obj))))
        tag = CLS_TO_TAG.get(type(obj))
        if tag is not None:
            if isinstance(obj, enum.Enum):
                return msgpack.ExtType(EXT_ENUM, self.pack([tag, member_ref(obj)]))
            return self.nest(EXT_DATACLASS, [tag, dataclass_values(obj)])
        return self._default_other(obj)

    def _default_other(self, obj: Any) -> Any:
        """``default`` for the rarer values: tuple subclasses, numpy scalars, large bytes."""
        if isinstance(obj, tuple):
            if is_size(obj):
                return msgpack.ExtType(EXT_SIZE, self.pack([int(d) for d in obj]))
            return self.nest(EXT_TUPLE, list(obj))
        if isinstance(obj, np.generic) and not isinstance(obj, (np.str_, np.bytes_)):
            check_array(obj)
            return msgpack.ExtType(EXT_NPSCALAR, self.pack([obj.dtype.str, obj.tobytes()]))
        if isinstance(obj, (bytes, bytearray, memoryview)):
            view = memoryview(obj)
            if view.nbytes >= INLINE_LIMIT:
                if not view.c_contiguous:
                    view = memoryview(view.tobytes())
                return msgpack.ExtType(EXT_BYTES, self.pack(self.loc(view, view.nbytes)))
            return view.tobytes()
        if PUBLISHED_PENDING and isinstance(obj, enum.Enum) and published_tag(type(obj)):
            return self.default(obj)  # its module is published: registered just now
        return self._default_base(obj)

    def _default_base(self, obj: Any) -> Any:
        """Subclasses of the base types (str and int Enums among them) travel as their base
        value: str.__str__, never the subclass's __str__ ("FinishReason.STOP")."""
        if isinstance(obj, dict):
            return dict(obj)
        if isinstance(obj, list):
            return list(obj)
        if isinstance(obj, str):
            return str.__str__(obj)
        if isinstance(obj, int):  # bool is packed natively (it cannot be subclassed)
            value = int.__int__(obj)
            if INT_MIN <= value < INT_END:
                return value
            return msgpack.ExtType(EXT_BIGINT, bigint_bytes(value))
        if isinstance(obj, float):
            return float.__float__(obj)
        if isinstance(obj, complex):
            return msgpack.ExtType(EXT_COMPLEX, _COMPLEX.pack(obj.real, obj.imag))
        if isinstance(obj, (set, frozenset)):
            return self.nest(EXT_FROZENSET if isinstance(obj, frozenset) else EXT_SET, list(obj))
        if PUBLISHED_PENDING and published_tag(type(obj)):
            return self.default(obj)  # its module is published: registered just now
        refuse(obj)


_PLAIN_TYPES = frozenset({bytes, str, int, float, bool, type(None)})
# items that hold no array: never a shared-memory slot
FLAT_TYPES = _PLAIN_TYPES | {bytearray}
# one packer for scalars, shared by threads (wire/packers.py)
_plain_packer = shared_packer(use_bin_type=True)


def encode(obj: Any) -> tuple[bytes, list[Any]]:
    """Encode ``obj`` into a msgpack body and a list of buffers (each 64 KiB or more).

    The buffers reference the caller's memory (no copy): do not modify the arrays or tensors
    until the message is sent.  Raises ``TypeError`` for values that cannot travel.
    """
    kind = type(obj)
    if kind in _PLAIN_TYPES:
        if kind is bytes and len(obj) >= INLINE_LIMIT:  # a large bytes item: its own frame
            return msgpack.packb(msgpack.ExtType(EXT_BYTES, msgpack.packb(0))), [obj]
        if kind is not int or INT_MIN <= obj < INT_END:
            try:
                return _plain_packer.pack(obj), []  # fast path: no ext types needed
            except ValueError as exc:  # a str that UTF-8 cannot hold (a lone surrogate)
                raise refusal(exc) from None
    elif kind is bytearray:  # msgpack bin, as the strict packer makes it (never an ext type)
        return _plain_packer.pack(obj), []
    enc = _Encoder()
    try:
        body = enc.pack_value(obj)
    except (ValueError, RecursionError, BufferError) as exc:
        raise refusal(exc) from None
    return body, enc.buffers


def refusal(exc: ValueError | RecursionError | BufferError) -> TypeError:
    """The ``TypeError`` for msgpack's ``ValueError`` (lists and dicts nested past its limit,
    too large), a ``RecursionError`` (Python's recursion limit reached: ``out_of_stack``) or a
    ``BufferError`` (a memoryview inside the item that is not C-contiguous)."""
    if isinstance(exc, RecursionError):
        return TypeError(out_of_stack())
    if "recursion limit" in str(exc):  # msgpack's own count of nested lists and dicts
        return TypeError(f"{NESTED_TOO_DEEPLY}: lists and dicts nest at most about 1,000 "
                         "levels in a row (msgpack's limit)")
    if isinstance(exc, BufferError):
        return TypeError("cannot encode item: a memoryview inside it is not C-contiguous; "
                         "put bytes(view) (or a contiguous view) there")
    return TypeError(f"cannot encode item: {exc}")


def out_of_stack() -> str:
    """The message of an encoding that reached Python's recursion limit (a ``RecursionError``)
    before any nesting limit of the codec: the encoder recurses in Python once per nesting
    level (tuples, sets, frozensets, dataclasses), the pure-Python msgpack once per list and
    dict level too, on top of the frames already on the stack (counted when it happened)."""
    depth = 0
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        depth += 1
        frame = frame.f_back
    takes = ("each nested tuple, set, frozenset, dataclass, list and dict takes Python frames "
             "(the pure-Python msgpack is in use here: msgpack.fallback)"
             if PURE_PYTHON_MSGPACK else
             "each nested tuple, set, frozenset and dataclass takes Python frames")
    fix = (", or install msgpack with its compiled extension (and leave MSGPACK_PUREPYTHON "
           "unset)" if PURE_PYTHON_MSGPACK else "")
    return (f"{NESTED_TOO_DEEPLY} for Python's recursion limit (sys.getrecursionlimit() = "
            f"{sys.getrecursionlimit()}), reached before any nesting limit of docs/values.md: "
            f"{takes}, and {depth} frames were on the stack below the encoding; put it from a "
            f"shallower stack, or raise the limit (sys.setrecursionlimit){fix}")


def check_text(text: str) -> None:
    """The ``TypeError`` ``encode`` raises for a str that UTF-8 cannot hold (a lone surrogate,
    as ``os.fsdecode`` makes of undecodable bytes), for the paths that do not encode."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise refusal(exc) from None


def encode_shm(obj: Any, alloc: Any) -> tuple[bytes, list[Any], list[Any]]:
    """:func:`encode` with a shared-memory slot allocator ``alloc(data, nbytes) -> ref | None``
    (``broker/shm/pool.py``): arrays and tensors it takes travel as ``[i]`` locs; returns
    ``(body, buffers, refs)``."""
    if type(obj) in FLAT_TYPES:
        body, buffers = encode(obj)
        return body, buffers, []
    enc = _Encoder(alloc)
    try:
        body = enc.pack_value(obj)
    except BaseException as exc:
        alloc.undo(enc.refs)  # slots taken for an item that will not travel
        if isinstance(exc, (ValueError, RecursionError, BufferError)):
            raise refusal(exc) from None
        raise
    return body, enc.buffers, enc.refs


class _Sizer(_Encoder):
    """Packs an item as ``encode_shm`` does when every array and tensor of at least
    ``slot_from`` bytes gets a slot (0: none does), counting the bytes of its arrays',
    tensors' and large bytes' data in ``outside`` instead of taking them (``encoded_bytes``)."""

    __slots__ = ("slot_from", "outside")

    def __init__(self, slot_from: int) -> None:
        super().__init__()
        self.slot_from = slot_from
        self.outside = 0  # bytes of the item's buffers and slots

    def default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if type(obj) is not np.ndarray:
                check_array(obj)
            # (the head and loc of its C-contiguous copy, which has its dtype, shape and size)
            return msgpack.ExtType(EXT_NDARRAY, array_payload(obj, self.sized_loc(obj.nbytes)))
        if is_tensor(obj):
            head = tensor_head(obj)
            nbytes = obj.numel() * obj.element_size()
            return msgpack.ExtType(EXT_TENSOR, tensor_payload(head, self.sized_loc(nbytes)))
        return super().default(obj)

    def sized_loc(self, nbytes: int) -> Any:
        """The ``loc`` of an array's ``nbytes`` bytes of data: inline bytes of that length (all
        zero), a slot or a buffer (counted)."""
        if nbytes < INLINE_LIMIT:
            return bytes(nbytes)
        if self.slot_from and nbytes >= self.slot_from:
            self.outside += nbytes
            self.refs.append(None)
            return [len(self.refs) - 1]
        return self.loc(None, nbytes)

    def loc(self, data: Any, nbytes: int) -> Any:
        """``_Encoder.loc``, a buffer counted instead of kept."""
        if nbytes < INLINE_LIMIT:
            return super().loc(data, nbytes)
        self.outside += nbytes
        self.buffers.append(None)
        return len(self.buffers) - 1


def encoded_bytes(obj: Any, slot_from: int = 0) -> int:
    """The bytes item ``obj`` takes (``encoded_extent``)."""
    return encoded_extent(obj, slot_from)[0]


def encoded_extent(obj: Any, slot_from: int = 0) -> tuple[int, int]:
    """The bytes item ``obj`` takes -- its body, buffers and shared-memory slots as
    :func:`encode_shm` makes them when every array and tensor of at least ``slot_from`` bytes
    gets a slot (0: as :func:`encode` makes them) -- and the number of its buffers (a frame
    each), worked out without taking the data of any array or tensor: nothing is copied, made
    contiguous, moved off its device or put in a slot, so that a put can be refused for its
    size before anything is.  Raises the ``TypeError`` :func:`encode` raises for a value that
    cannot travel."""
    if type(obj) in FLAT_TYPES:
        body, buffers = encode(obj)
        return len(body) + sum(memoryview(b).nbytes for b in buffers), len(buffers)
    sizer = _Sizer(slot_from)
    try:
        body = sizer.pack_value(obj)
    except (ValueError, RecursionError, BufferError) as exc:
        raise refusal(exc) from None
    return len(body) + sizer.outside, len(sizer.buffers)


# ---------------------------------------------------------------------------------------------
# Decoding


def _leaf_ext(code: int, data: bytes) -> Any:
    """The ext types a descriptor may hold: a big int (a ``Flag`` member's value) only."""
    if code == EXT_BIGINT:
        return _bigint(data)
    raise ValueError(f"malformed item: ext type {code} inside a descriptor")


def _unpack_leaf(data: bytes) -> Any:
    """The payload of an array, tensor, scalar, bytes, ``torch.Size`` or Enum ext type: a
    descriptor, which nests no further ext type (module docstring, "Nesting")."""
    return msgpack.unpackb(data, ext_hook=_leaf_ext, strict_map_key=False, raw=False,
                           use_list=True)


def _bigint(data: bytes) -> int:
    if not data:
        raise ValueError("malformed big int: no bytes")
    return int.from_bytes(data, "big", signed=True)


class _Decoder:
    """Decodes one item's body at nesting level ``depth`` (0: the body itself); the payloads of
    nesting ext types go to ``inner()``, the decoder one level deeper."""

    __slots__ = ("frames", "copy", "shm", "shm_copy", "restore_devices", "depth", "_inner")

    def __init__(self, frames: Sequence[Any], copy: bool, shm: Sequence[Any] = (),
                 shm_copy: bool = True, restore_devices: bool = True, depth: int = 0) -> None:
        self.frames = frames
        self.copy = copy
        self.shm = shm  # uint8 arrays of the item's shared-memory slots
        self.shm_copy = shm_copy
        self.restore_devices = restore_devices  # False: tensors stay on the CPU (a broker's)
        self.depth = depth
        self._inner: _Decoder | None = None

    def unpack(self, data: bytes) -> Any:
        if self.depth < HEAP_DEPTH:
            return msgpack.unpackb(
                data, ext_hook=self.ext_hook, strict_map_key=False, raw=False, use_list=True
            )
        # deep: unpackb keeps ~40 KiB of state on the C stack per call, an Unpacker on the heap
        unpacker = msgpack.Unpacker(None, ext_hook=self.ext_hook, strict_map_key=False,
                                    raw=False, use_list=True, max_buffer_size=max(1, len(data)))
        unpacker.feed(data)
        value = unpacker.unpack()
        if unpacker.tell() != len(data):
            raise ValueError("malformed item: extra bytes after a nested value")
        return value

    def inner(self) -> _Decoder:
        """The decoder of the payloads of this level's nesting ext types (made once, shared:
        it holds nothing a decoding changes); ``ValueError`` past ``MAX_DEPTH``, before any
        further call of msgpack."""
        inner = self._inner
        if inner is None:
            if self.depth >= MAX_DEPTH:
                raise ValueError(too_deep("decode"))
            inner = self._inner = _Decoder(self.frames, self.copy, self.shm, self.shm_copy,
                                           self.restore_devices, self.depth + 1)
        return inner

    def raw(self, loc: Any, nbytes: int) -> np.ndarray:
        """A writable flat uint8 array holding ``nbytes`` bytes at ``loc``."""
        if isinstance(loc, bytes):
            if len(loc) != nbytes:
                raise ValueError(f"inline array holds {len(loc)} bytes, expected {nbytes}")
            return np.frombuffer(loc, dtype=np.uint8).copy()
        if isinstance(loc, list):  # a shared-memory slot of the item
            index = loc[0] if len(loc) == 1 else None
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.shm):
                raise ValueError(f"shared-memory slot {loc!r} out of range ({len(self.shm)} slots)")
            slot = self.shm[index]
            if slot.nbytes != nbytes:
                raise ValueError(f"slot {index} holds {slot.nbytes} bytes, expected {nbytes}")
            return slot.copy() if self.shm_copy else slot
        if isinstance(loc, bool) or not isinstance(loc, int) or not 0 <= loc < len(self.frames):
            raise ValueError(f"buffer index {loc!r} out of range ({len(self.frames)} buffers)")
        view = memoryview(self.frames[loc])
        if view.nbytes != nbytes:
            raise ValueError(f"buffer {loc} holds {view.nbytes} bytes, expected {nbytes}")
        arr = np.frombuffer(view, dtype=np.uint8) if nbytes else np.empty(0, np.uint8)
        if self.copy or not arr.flags.writeable:
            arr = arr.copy()
        return arr

    def ext_hook(self, code: int, data: bytes) -> Any:
        reader = _EXT_READERS.get(code)
        if reader is None:
            raise ValueError(f"unknown ext type {code}")
        return reader(self, data)


# -- the ext types' readers (``_Decoder.ext_hook`` dispatches through ``_EXT_READERS``) ----------

def _read_tuple(dec: _Decoder, data: bytes) -> tuple:
    value = (dec._inner or dec.inner()).unpack(data)
    if not isinstance(value, list):
        raise ValueError("malformed tuple")
    return tuple(value)


def _read_ndarray(dec: _Decoder, data: bytes) -> np.ndarray:
    value = _unpack_leaf(data)
    if not (isinstance(value, list) and len(value) == 3):
        raise ValueError("malformed array descriptor")
    dtype, shape, nbytes = array_layout(value[0], value[1], tensor=False)
    loc = value[2]
    if type(loc) is bytes and len(loc) == nbytes:  # inline: an array of its own, in one call
        return np.ndarray(shape, dtype, bytearray(loc))
    return dec.raw(loc, nbytes).view(dtype).reshape(shape)


def _read_tensor(dec: _Decoder, data: bytes) -> Any:
    value = _unpack_leaf(data)
    if not (isinstance(value, list) and len(value) == 4):
        raise ValueError("malformed tensor descriptor")
    dtype, shape, nbytes = array_layout(value[0], value[1], tensor=True)
    loc, np_dtype = value[2], numpy_of(dtype)
    if type(loc) is bytes and len(loc) == nbytes and np_dtype is not None:  # as an array's
        tensor = torch_module().from_numpy(np.ndarray(shape, np_dtype, bytearray(loc)))
    else:
        tensor = tensor_over(dec.raw(loc, nbytes), dtype, shape)
    if dec.restore_devices:
        return restore_device(tensor, value[3])
    return keep_sent_device(tensor, value[3])


def _read_dataclass(dec: _Decoder, data: bytes) -> Any:
    value = (dec._inner or dec.inner()).unpack(data)
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], dict)):
        raise ValueError("malformed dataclass")
    if not isinstance(value[0], str):
        raise ValueError("malformed dataclass tag")
    cls = lookup_tag(value[0])
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"tag {value[0]!r} names {cls.__qualname__}, not a dataclass")
    return build_dataclass(cls, value[1])


def _read_npscalar(dec: _Decoder, data: bytes) -> Any:
    value = _unpack_leaf(data)
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], bytes)):
        raise ValueError("malformed numpy scalar")
    dtype = NP_DTYPES.get(value[0]) if isinstance(value[0], str) else None
    if dtype is None:
        raise ValueError(f"numpy scalar dtype {value[0]!r} is not allowed")
    if len(value[1]) != dtype.itemsize:
        raise ValueError(f"numpy scalar of dtype {value[0]!r} has {len(value[1])} bytes, "
                         f"not {dtype.itemsize}")
    return np.frombuffer(value[1], dtype=dtype)[0]


def _read_bytes(dec: _Decoder, data: bytes) -> bytes:
    index = _unpack_leaf(data)
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError("malformed bytes reference")
    if not 0 <= index < len(dec.frames):
        raise ValueError(f"buffer index {index} out of range")
    return bytes(memoryview(dec.frames[index]))


def _set_elements(dec: _Decoder, data: bytes) -> list:
    value = (dec._inner or dec.inner()).unpack(data)
    if not isinstance(value, list):
        raise ValueError("malformed set: its payload is not an array")
    return value


def _read_set(dec: _Decoder, data: bytes) -> set:
    try:
        return set(_set_elements(dec, data))
    except TypeError:  # a list or dict element
        raise ValueError("malformed set: an element is not hashable") from None


def _read_frozenset(dec: _Decoder, data: bytes) -> frozenset:
    try:
        return frozenset(_set_elements(dec, data))
    except TypeError:  # a list or dict element
        raise ValueError("malformed set: an element is not hashable") from None


def _read_complex(dec: _Decoder, data: bytes) -> complex:
    if len(data) != _COMPLEX.size:
        raise ValueError(f"malformed complex: {len(data)} bytes, expected 16")
    return complex(*_COMPLEX.unpack(data))


def _read_bigint(dec: _Decoder, data: bytes) -> int:
    return _bigint(data)


def _read_size(dec: _Decoder, data: bytes) -> Any:
    value = _unpack_leaf(data)
    if not isinstance(value, list) or not all(
        type(d) is int and INT_MIN <= d < 2**63 for d in value
    ):
        raise ValueError("malformed torch.Size: not an array of 64-bit ints")
    return torch_module().Size(value)


def _read_enum(dec: _Decoder, data: bytes) -> enum.Enum:
    value = _unpack_leaf(data)
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
        raise ValueError("malformed Enum member: not [tag, name]")
    cls = lookup_tag(value[0])
    if not issubclass(cls, enum.Enum):
        raise ValueError(f"tag {value[0]!r} names {cls.__qualname__}, not an Enum")
    return member_from_ref(cls, value[1])


_EXT_READERS: dict[int, Callable[[_Decoder, bytes], Any]] = {
    EXT_TUPLE: _read_tuple,
    EXT_NDARRAY: _read_ndarray,
    EXT_TENSOR: _read_tensor,
    EXT_DATACLASS: _read_dataclass,
    EXT_NPSCALAR: _read_npscalar,
    EXT_BYTES: _read_bytes,
    EXT_SET: _read_set,
    EXT_FROZENSET: _read_frozenset,
    EXT_COMPLEX: _read_complex,
    EXT_BIGINT: _read_bigint,
    EXT_SIZE: _read_size,
    EXT_ENUM: _read_enum,
}


_UNSET = object()  # a dataclass field never set
_FIELDS: dict[type, dict[str, bool]] = {}  # dataclass -> {field name: passed to its constructor}
_BY_CONSTRUCTOR: dict[type, bool] = {}  # dataclass -> rebuilt_by_constructor(cls)


def _fields(cls: type) -> dict[str, bool]:
    """The fields of dataclass ``cls`` by name, each with whether its rebuild passes it to the
    constructor (none for a class restored field by field; read once per class)."""
    fields = _FIELDS.get(cls)
    if fields is None:
        by_constructor = _BY_CONSTRUCTOR[cls] = rebuilt_by_constructor(cls)
        fields = _FIELDS[cls] = {f.name: f.init and by_constructor
                                 for f in dataclasses.fields(cls)}
    return fields


def dataclass_values(obj: Any) -> dict[str, Any]:
    """The fields of a dataclass instance by name; a field never set (``init=False`` without a
    default) is left out, and stays unset in the rebuilt instance."""
    values = {}
    for name in _fields(type(obj)):
        value = getattr(obj, name, _UNSET)
        if value is not _UNSET:
            values[name] = value
    return values


def build_dataclass(cls: type[object], fields: dict) -> Any:
    """An instance of dataclass ``cls`` from its received ``fields``: called with the ``init``
    fields if its ``__init__`` is the one ``@dataclass`` wrote for them (so ``__post_init__``
    runs), else made with ``cls.__new__(cls)`` as ``pickle`` makes it (``rebuilt_by_constructor``);
    then the other fields set as sent, with ``object.__setattr__`` (frozen and slots classes too).
    ``ValueError`` naming the class for a field it lacks or values it refuses (whatever its
    ``__init__`` or ``__post_init__`` raises)."""
    init: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    known = _fields(cls)
    for name, value in fields.items():
        taken = known.get(name)
        if taken is None:
            raise ValueError(f"{cls.__qualname__} has no field {name!r}")
        (init if taken else rest)[name] = value
    try:
        obj = cls(**init) if _BY_CONSTRUCTOR[cls] else cls.__new__(cls)
        for name, value in rest.items():
            object.__setattr__(obj, name, value)
    except Exception as exc:  # the class's own code (__init__, __post_init__, a descriptor)
        raise ValueError(f"cannot rebuild {cls.__qualname__}: {type(exc).__name__}: {exc}") \
            from None
    return obj


# items without frames or slots (stateless: shared by threads), tensors restored to their
# devices or (a broker's) left on the CPU
_INLINE = _Decoder((), False)
_INLINE_ON_CPU = _Decoder((), False, restore_devices=False)


def decode(body: Any, frames: Sequence[Any] = (), *, copy: bool = False, shm: Sequence[Any] = (),
           shm_copy: bool = True, restore_devices: bool = True) -> Any:
    """Decode an item encoded by :func:`encode`.

    ``frames`` are the buffers (``zmq.Frame``, bytes, memoryview...).  Arrays and tensors read
    from frames are writable views of them unless ``copy`` is true; inline ones are owned
    copies.  ``shm`` are the uint8 arrays of the item's shared-memory slots (``broker/shm/``),
    copied out unless ``shm_copy`` is false.  A tensor goes to the device it was sent from
    where this process can put it there (``arrays.restore_device``); with ``restore_devices``
    false (a broker decoding for its hooks) every tensor stays on the CPU, marked with that
    device, which encoding the same tensor sends again (``arrays.keep_sent_device``).  Raises
    ``ValueError`` for anything malformed or not allowed.
    """
    if not (frames or shm) and (type(body) is bytes or type(body) is memoryview) \
            and len(body) >= 2 and body[0] == 0xC4 and len(body) == 2 + body[1]:
        # a small bytes item (msgpack bin 8): nothing else to look at (a frame of a batch
        # reply comes as a memoryview of the message: its bytes copied out)
        return body[2:] if type(body) is bytes else bytes(body[2:])
    if frames or shm:
        dec = _Decoder(frames, copy, shm, shm_copy, restore_devices)
    else:
        dec = _INLINE if restore_devices else _INLINE_ON_CPU
    try:
        return dec.unpack(body)
    except Exception as exc:  # msgpack's own errors (ValueError subclasses), RecursionError, ...
        if type(exc) is ValueError:  # the decoder's own words
            raise
        raise ValueError(f"cannot decode item: {type(exc).__name__}: "
                         f"{str(exc) or _MSGPACK_CAUSES.get(type(exc), 'malformed body')}") from None


def decode_frames(frames: Sequence[Any], copy: bool | None, shm: Sequence[Any] = (),
                  shm_copy: bool = True) -> Any:
    """Decode an item received as ``frames`` (its body, then its buffers; ``zmq.Frame`` or
    bytes-like): :func:`decode`, with ``copy=None`` meaning views (as ``False``) and ``shm`` /
    ``shm_copy`` the item's shared-memory slots."""
    body = frames[0]
    if type(body) is not bytes and type(body) is not memoryview:  # a zmq.Frame: its buffer
        body = memoryview(body)
    if len(frames) == 1 and not shm:  # the common small item: nothing but its body
        return decode(body)
    return decode(body, frames[1:], copy=bool(copy), shm=shm, shm_copy=shm_copy)
