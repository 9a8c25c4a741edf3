"""Numpy arrays and torch tensors on the wire: the dtype allow-lists and the descriptors of
``codec.py``'s ext types 2 and 3, written and read.

An array travels as the ext type ``EXT_NDARRAY`` whose payload is the msgpack of
``[dtype.str, shape, loc]``; a tensor as ``EXT_TENSOR``, ``[dtype name, shape, loc, device]``
(``loc``: ``codec.py``'s module docstring).  Everything before ``loc`` depends only on the
dtype and shape, so its msgpack (the *head*) is made once per dtype and shape and kept
(``tensor_head``, ``array_payload``): the dtype (and a tensor's layout and device) is checked
when a head is made, once per key.  The kept heads are dropped whenever ``restrict`` narrows
what may travel (under ``_heads_lock``, which a head's check and keeping also hold), and are
bounded (``MAX_KEPT`` of each kind, then started afresh).  Reading checks every field of every
descriptor: its dtype and shape here (``array_layout``), its ``loc`` and device in
``codec.py``.

A tensor is restored to the device it was sent from where the receiver can put it there, else
left on the CPU (``restore_device``).  A broker's hooks get it on the CPU, marked with that
device (``keep_sent_device``), which an encoding of the same tensor sends again (``tensor_head``).

Torch is imported on first use: a broker that never decodes a tensor never imports it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import warnings
from typing import Any

import numpy as np
from zchannel.broker.wire.packers import shared_packer

log = logging.getLogger("zchannel.client")

MAX_RANK = 32  # the rank a decoded array or tensor may have (a broker's ``max_rank`` lowers it)
MAX_KEPT = 4096  # heads kept, of each kind
_MAX_EXTENT = 2**63 - 1  # numpy's largest array size in bytes (its intp), zero dimensions aside
MAX_DEVICE_CHARS = 32  # the longest device name a tensor descriptor may hold
# the attribute of a CPU tensor a broker decoded that names the device it was sent from
SENT_DEVICE = "_zchannel_sent_device"

# numpy dtypes allowed on the wire: numeric and bool, either byte order.
NP_DTYPES: dict[str, np.dtype] = {}
for _code in ("b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16"):
    for _order in ("<", ">", "|"):
        _dt = np.dtype(_order + _code) if _code[1:] != "1" or _order == "|" else None
        if _dt is not None:
            NP_DTYPES[_dt.str] = _dt

_TORCH_DTYPE_NAMES = (
    "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 float64 "
    "complex32 complex64 complex128 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz"
).split()
TORCH_DTYPES: dict[str, Any] = {}
_TORCH_DTYPE_NAME: dict[Any, str] = {}
_TORCH_ITEMSIZE: dict[Any, int] = {}  # torch dtype -> bytes per element
_TORCH_NUMPY: dict[Any, np.dtype] = {}  # torch dtype -> numpy dtype, where numpy has one
_torch_tables = False  # the tables above are built (restrict() may empty TORCH_DTYPES later)

# one packer for the descriptors' plain fields, shared by threads (wire/packers.py)
_packer = shared_packer(use_bin_type=True)
_heads_lock = threading.Lock()  # a head's check and keeping, against ``restrict``
_warned_pid = 0  # the process that warned of a tensor left on the CPU (``restore_device``)
_array_heads: dict[tuple[Any, ...], bytes] = {}  # (dtype, shape) -> head
_tensor_heads: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}  # (dtype, shape, device) ->
#                                                                  (head, packed device name)


def preload() -> None:
    """Import torch now (decoding imports it lazily on the first tensor)."""
    try:
        torch_module()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass


def torch_module() -> Any:
    """torch, imported on first use, with this module's dtype tables built."""
    import torch

    global _torch_tables
    if not _torch_tables:
        with warnings.catch_warnings():  # "ComplexHalf support is experimental"
            warnings.simplefilter("ignore")
            for name in _TORCH_DTYPE_NAMES:
                if hasattr(torch, name):
                    dtype = getattr(torch, name)
                    TORCH_DTYPES[name] = dtype
                    _TORCH_DTYPE_NAME[dtype] = name
                    probe = torch.empty(0, dtype=dtype)
                    _TORCH_ITEMSIZE[dtype] = probe.element_size()
                    try:
                        _TORCH_NUMPY[dtype] = probe.numpy().dtype
                    except (TypeError, RuntimeError):
                        pass  # bfloat16, float8, complex32: no numpy dtype
        _torch_tables = True
    return torch


def is_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_size(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.Size`` (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Size)


def restrict(dtypes: list[str] | None = None, max_rank: int | None = None) -> None:
    """Narrow what this process decodes (a broker's ``allowed_dtypes`` / ``max_rank`` limits).

    ``dtypes`` names numpy ``dtype.str`` values (``"<f4"``) and/or torch dtype names
    (``"bfloat16"``); anything outside the built-in allow-lists is a ``ValueError``.
    """
    global MAX_RANK
    if max_rank is not None:
        if not 0 <= max_rank <= 32:
            raise ValueError("max_rank must be in [0, 32]")
        MAX_RANK = max_rank
    if dtypes is not None:
        torch_module()
        unknown = [d for d in dtypes if d not in NP_DTYPES and d not in TORCH_DTYPES]
        if unknown:
            raise ValueError(f"allowed_dtypes: unknown or not allowed dtypes {unknown}")
        with _heads_lock:
            for table in (NP_DTYPES, TORCH_DTYPES):
                for name in [d for d in table if d not in dtypes]:
                    del table[name]
            for dtype in [d for d, n in _TORCH_DTYPE_NAME.items() if n not in dtypes]:
                del _TORCH_DTYPE_NAME[dtype]
            for kept in (_array_heads, _tensor_heads):
                kept.clear()


def _keep(kept: dict, key: Any, value: Any) -> None:
    if len(kept) >= MAX_KEPT:
        kept.clear()
    kept[key] = value


# ---------------------------------------------------------------------------------------------
# Writing


def check_dtype(obj: Any) -> None:
    """``TypeError`` for a numpy array or scalar of a dtype that cannot travel."""
    check_numpy_dtype(obj.dtype, "numpy dtype" if isinstance(obj, np.ndarray)
                      else "numpy scalar of dtype")


def check_numpy_dtype(dtype: np.dtype, what: str = "numpy dtype") -> None:
    """``TypeError`` for a numpy ``dtype`` that cannot travel (``what`` names the value)."""
    if dtype.str not in NP_DTYPES:
        raise TypeError(f"{what} {dtype} cannot be sent (numeric and bool dtypes only)")


def check_rank(ndim: int) -> None:
    """``TypeError`` for an array or tensor of more dimensions than a decoder accepts
    (``MAX_RANK``): refused at the put rather than by every receiver."""
    if ndim > MAX_RANK:
        raise TypeError(f"cannot send an array or tensor of rank {ndim}: at most {MAX_RANK} "
                        "dimensions travel")


def check_extent(shape: tuple[int, ...], itemsize: int) -> None:
    """``TypeError`` for a shape whose non-zero dimensions times ``itemsize`` pass numpy's
    largest array size (a receiver cannot make the array, even one of no elements)."""
    extent = itemsize
    for dim in shape:
        if dim:
            extent *= dim
    if extent > _MAX_EXTENT:
        raise TypeError(f"cannot send an array or tensor of shape {tuple(shape)}: numpy cannot "
                        "hold that shape (its non-zero dimensions times the item size pass "
                        f"{_MAX_EXTENT} bytes)")


def array_payload(arr: np.ndarray, loc: Any) -> bytes:
    """The payload of ``arr``'s ``EXT_NDARRAY`` (a C-contiguous array) whose bytes are at
    ``loc``; ``TypeError`` for a dtype that cannot travel (checked when the head of its dtype
    and shape is made)."""
    key = (arr.dtype, arr.shape)
    head = _array_heads.get(key)
    if head is None:
        with _heads_lock:
            check_dtype(arr)
            check_rank(arr.ndim)
            head = (_packer.pack_array_header(3) + _packer.pack(arr.dtype.str)
                    + _packer.pack(list(arr.shape)))
            _keep(_array_heads, key, head)
    return head + _packer.pack(loc)


def torch_dtype_name(dtype: Any) -> str:
    """The wire name of torch ``dtype``; ``TypeError`` for a dtype that cannot travel."""
    torch_module()
    name = _TORCH_DTYPE_NAME.get(dtype)
    if name is None:
        raise TypeError(f"torch dtype {dtype} cannot be sent")
    return name


def check_not_nested(t: Any) -> None:
    """``TypeError`` for a nested tensor (of any layout: a strided one has no single shape)."""
    if t.is_nested:
        raise TypeError("cannot send a nested tensor; convert it to a dense tensor "
                        "(torch.nested.to_padded_tensor) or send its components as a list")


def tensor_dtype_name(t: Any) -> str:
    """The wire name of tensor ``t``'s dtype; ``TypeError`` for a tensor that cannot travel
    (its dtype, a nested or non-strided layout, the meta device, a rank above ``MAX_RANK``, a
    shape numpy cannot hold)."""
    check_not_nested(t)
    name = torch_dtype_name(t.dtype)
    if t.layout != torch_module().strided:
        raise TypeError(f"cannot send a {t.layout} tensor; convert it to a dense tensor")
    if t.is_meta:
        raise TypeError("cannot send a tensor on the meta device: it has no data")
    check_rank(t.dim())
    check_extent(tuple(t.shape), _TORCH_ITEMSIZE[t.dtype])
    return name


def tensor_head(t: Any) -> tuple[bytes, bytes]:
    """The msgpack of tensor ``t``'s descriptor before its ``loc`` and after it (its device:
    the one it was sent from for a tensor a broker decoded, ``sent_device``); ``TypeError``
    for a tensor that cannot travel."""
    check_not_nested(t)  # (before its shape, which a nested tensor does not have)
    key = (t.dtype, t.shape, t.device, t.layout)
    parts = _tensor_heads.get(key)
    if parts is None:
        with _heads_lock:
            name = tensor_dtype_name(t)
            parts = (_packer.pack_array_header(4) + _packer.pack(name)
                     + _packer.pack(list(t.shape)), _packer.pack(str(t.device)))
            _keep(_tensor_heads, key, parts)
    sent = sent_device(t)
    return parts if sent is None else (parts[0], _packer.pack(sent))


def sent_device(t: Any) -> str | None:
    """The device tensor ``t`` was sent from when it is a tensor a broker decoded
    (``keep_sent_device``) and still on the CPU; None for any other tensor."""
    device = getattr(t, SENT_DEVICE, None)
    return device if device is not None and t.is_cpu else None


def tensor_payload(head: tuple[bytes, bytes], loc: Any) -> bytes:
    """The payload of a tensor's ``EXT_TENSOR``: its ``tensor_head`` around ``loc``."""
    return head[0] + _packer.pack(loc) + head[1]


def tensor_bytes(t: Any) -> np.ndarray:
    """A C-contiguous numpy view of a tensor's data (of its dtype and shape where numpy has
    the dtype, else flat uint8): copied to the CPU and made contiguous once if needed."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    if t.dtype in _TORCH_NUMPY:
        return t.numpy()
    return t.reshape(-1).view(torch_module().uint8).numpy()


# ---------------------------------------------------------------------------------------------
# Reading


def check_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` (a descriptor's field) as a tuple; ``ValueError`` unless it is a list of at
    most ``MAX_RANK`` non-negative ints."""
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise ValueError(f"array shape must be a list of at most {MAX_RANK} ints")
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise ValueError(f"invalid array dimension {dim!r}")
    return tuple(shape)


def array_layout(dtype_name: Any, shape: Any, tensor: bool) -> tuple[Any, tuple[int, ...], int]:
    """``(dtype, shape, nbytes)`` of a received descriptor's dtype and shape fields: a numpy
    dtype (a torch dtype when ``tensor``), the shape as a tuple and the bytes its data takes;
    ``ValueError`` for a dtype not allowed or a shape that is not one."""
    if tensor:
        if not _torch_tables:
            torch_module()
        dtype = TORCH_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise ValueError(f"tensor dtype {dtype_name!r} is not allowed")
        itemsize = _TORCH_ITEMSIZE[dtype]
    else:
        dtype = NP_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise ValueError(f"array dtype {dtype_name!r} is not allowed")
        itemsize = dtype.itemsize
    dims = check_shape(shape)
    return dtype, dims, math.prod(dims) * itemsize


def tensor_itemsize(dtype: Any) -> int:
    """Bytes per element of torch ``dtype`` (from the table built once; a dtype outside it is
    probed)."""
    torch = torch_module()
    size = _TORCH_ITEMSIZE.get(dtype)
    return size if size is not None else int(torch.empty(0, dtype=dtype).element_size())


def numpy_of(dtype: Any) -> np.dtype | None:
    """The numpy dtype of torch ``dtype``, or None where numpy has none (bfloat16...)."""
    return _TORCH_NUMPY.get(dtype)


def tensor_over(raw: np.ndarray, dtype: Any, shape: tuple[int, ...]) -> Any:
    """A CPU tensor of torch ``dtype`` and ``shape`` sharing the memory of ``raw`` (a flat uint8
    array of exactly its bytes): one torch call where numpy has the dtype (view and reshape in
    numpy cost a third of torch's)."""
    torch = torch_module()
    np_dtype = _TORCH_NUMPY.get(dtype)
    if np_dtype is not None:
        return torch.from_numpy(raw.view(np_dtype).reshape(shape))
    tensor = torch.from_numpy(raw)
    tensor = tensor.view(dtype) if raw.size else torch.empty(0, dtype=dtype)
    return tensor.reshape(shape)


def check_device(device: Any) -> str:
    """A received tensor descriptor's device name; ``ValueError`` unless it is a str of at
    most ``MAX_DEVICE_CHARS`` characters."""
    if not isinstance(device, str) or len(device) > MAX_DEVICE_CHARS:
        raise ValueError("malformed tensor device")
    return device


def restore_device(tensor: Any, device: Any) -> Any:
    """``tensor`` (on the CPU) moved to ``device``, the exact device it was sent from
    (``"cuda:3"``, not the receiver's current device), where this process has that kind of
    device; else left on the CPU.  A move that fails (no device of that index here, CUDA not
    usable in this process -- a child forked after its parent used it --, the device's memory
    full) also leaves it on the CPU, never losing the item: the first such tensor of a
    process logs a warning naming the device and the error (``_left_on_cpu``)."""
    if device == "cpu":
        return tensor
    kind = check_device(device).partition(":")[0]
    if kind == "cpu":
        return tensor
    backend = getattr(torch_module(), kind, None)
    is_available = getattr(backend, "is_available", None)
    try:
        if is_available is None or not is_available():
            return tensor  # no such kind of device here: the tensor stays on the CPU
        return tensor.to(device)
    except Exception as exc:
        _left_on_cpu(device, exc)
        return tensor


def _left_on_cpu(device: str, exc: Exception) -> None:
    """Log that a tensor sent from ``device`` stays on the CPU because moving it there raised
    ``exc``: a warning for the first in this process, later ones at debug level."""
    global _warned_pid
    pid = os.getpid()
    if _warned_pid == pid:
        log.debug("a tensor sent from %s stays on the CPU: %s: %s", device,
                  type(exc).__name__, exc)
        return
    _warned_pid = pid
    log.warning("a tensor sent from %s stays on the CPU: moving it there failed (%s: %s); "
                "later tensors this process cannot move are logged at debug level only",
                device, type(exc).__name__, exc)


def keep_sent_device(tensor: Any, device: Any) -> Any:
    """``tensor`` (on the CPU) left there, marked with ``device``, the one it was sent from, for
    a broker's hooks: the broker never moves a tensor onto its own devices, and an encoding
    of this tensor sends that device again (``tensor_head``), so its receivers restore it as
    they would have without the hooks."""
    if check_device(device).partition(":")[0] != "cpu":
        setattr(tensor, SENT_DEVICE, device)
    return tensor
