"""Arrays and tensors on the wire: the descriptor heads kept per dtype and shape
(``broker/wire/arrays.py``) never stand for another item's data, dtype, shape or device, follow
the dtype allow-list when it narrows, and stay bounded; small arrays and tensors arrive as
writable arrays of their own, through a broker as through the codec."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from zchannel.broker import Channel
from zchannel.broker.wire import arrays, codec


def _same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.float(), want.float())
    else:
        assert type(got) is np.ndarray
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def _items() -> list:
    """Items sharing dtypes and shapes in every combination the heads are kept by, with
    different data each time: a kept head standing for another item would show."""
    rng = np.random.default_rng(7)
    out: list = []
    for dtype in ("<f4", ">f4", "<i8", "|b1", "<c16"):
        for shape in ((4, 4), (16,), (4, 4), (), (0, 3)):
            raw = rng.integers(0, 2, size=shape) if dtype == "|b1" else rng.normal(size=shape) * 100
            out.append(np.asarray(raw).astype(dtype))
    for dtype in (torch.float32, torch.bfloat16, torch.int16, torch.float32):
        for shape in ((2, 3), (6,), ()):
            out.append((torch.randn(shape) * 50).to(dtype))
    out.append(torch.arange(12.0).reshape(3, 4).T)  # non-contiguous: its C-order copy travels
    out.append(torch.randn(5, requires_grad=True))  # its data, without the graph
    out.append(np.arange(20, dtype=np.float64)[::3])  # strided
    return out


def test_kept_heads_never_stand_for_another_items_data_dtype_or_shape():
    for item in _items():
        body, buffers = codec.encode(item)
        got = codec.decode(body, buffers)
        _same(got, item.detach() if isinstance(item, torch.Tensor) else item)


def test_small_arrays_arrive_writable_and_their_own(channels):
    ch = Channel.create("heads")
    channels.append(ch)
    items = _items()
    for item in items:
        ch.put(item)
    got = [ch.get(timeout=30) for _ in items]
    for g, want in zip(got, items, strict=True):
        _same(g, want.detach() if isinstance(want, torch.Tensor) else want)
        arr = g.numpy() if isinstance(g, torch.Tensor) and g.dtype != torch.bfloat16 else g
        if isinstance(arr, np.ndarray):
            assert arr.flags.writeable and arr.flags.c_contiguous
    # two deliveries of equal bodies share no memory
    twin = np.arange(8, dtype=np.float32)
    ch.put(twin)
    ch.put(twin)
    a, b = ch.get(timeout=30), ch.get(timeout=30)
    a[0] = 99.0
    assert b[0] == 0.0 and twin[0] == 0.0


def test_heads_are_bounded():
    for n in range(arrays.MAX_KEPT + 50):
        codec.encode(np.zeros((1, n % 7, n), dtype=np.float32))
        codec.encode(torch.zeros((n, 1)))
    assert 0 < len(arrays._array_heads) <= arrays.MAX_KEPT
    assert 0 < len(arrays._tensor_heads) <= arrays.MAX_KEPT


def test_a_narrowed_allow_list_refuses_a_dtype_whose_head_was_kept():
    script = textwrap.dedent(
        """
        import numpy as np, torch
        from zchannel.broker.wire import arrays, codec
        codec.encode(np.zeros(4, dtype="<f8"))
        codec.encode(torch.zeros(4, dtype=torch.float64))
        arrays.restrict(["<f4", "float32"])
        codec.encode(np.zeros(4, dtype="<f4"))
        codec.encode(torch.zeros(4))
        for value in (np.zeros(4, dtype="<f8"), torch.zeros(4, dtype=torch.float64)):
            try:
                codec.encode(value)
            except TypeError as exc:
                print("refused", exc)
            else:
                print("sent")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert out == ["refused numpy dtype float64 cannot be sent (numeric and bool dtypes only)",
                   "refused torch dtype torch.float64 cannot be sent"]


@pytest.mark.parametrize("value, pattern", [
    (np.zeros(3, dtype="<U2"), "numpy dtype <U2 cannot be sent"),
    (np.zeros(3, dtype=object), "numpy dtype object cannot be sent"),
    (np.ma.masked_array([1.0, 2.0], mask=[0, 1]), "its mask would be lost"),
    (torch.zeros(3).to_sparse(), "convert it to a dense tensor"),
    (torch.zeros(3, device="meta"), "meta device"),
])
def test_refusals_are_the_same_for_a_second_item_of_the_shape(value, pattern):
    for _ in range(2):
        with pytest.raises(TypeError, match=pattern):
            codec.encode(value)
