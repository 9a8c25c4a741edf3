"""Self-checking payloads of ``zchannel bench``.

``PayloadFactory`` builds the items of one payload type and size.  Every item carries a 16-byte
header (sequence number, ``CLOCK_MONOTONIC`` send time in ns) at the start of its first buffer;
the rest of every buffer is a fixed pseudo-random pattern, so a receiver checks the full content
of every item it gets (``check``), and the set of sequence numbers tells lost or duplicated items
(``verify_seqs``).  ``Tally`` is what a receiving worker records.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from zchannel.broker import serializable
from zchannel.cli.bench.cases import stream_figures

HEADER = struct.Struct("<QQ")  # sequence number, send time (time.monotonic_ns)
PAYLOAD_TYPES = ("bytes", "numpy", "tensor", "tensor_list", "tensor_dict", "dataclass")
DICT_FIELDS = ("obs", "action", "reward", "done")
SEQ_SHIFT = 40  # seq = producer index << SEQ_SHIFT | item index
SEQ_TOP_BYTE = 7  # the header's byte holding the sequence number's top 8 bits (always 0 sent)
CORRUPT_ENV = "ZCHANNEL_BENCH_CORRUPT"  # test hook: producers corrupt the item with this index


class Mismatch(Exception):
    """An item arrived with the wrong content, or items were lost or duplicated."""


@serializable
@dataclasses.dataclass
class BenchSample:
    """The ``dataclass`` payload type: a registered dataclass holding a tensor."""

    seq: int
    data: Any


def _torch() -> Any:
    """``torch``, imported by the workers of tensor payloads only: a worker of ``bytes`` or
    ``numpy`` items starts without it (about 2 s less per spawned process)."""
    import torch

    return torch


def part_sizes(ptype: str, size: int) -> list[int]:
    """Byte sizes of the buffers of one item (float32 types round to multiples of 4)."""
    if ptype not in PAYLOAD_TYPES:
        raise ValueError(f"unknown payload type {ptype!r}")
    if ptype == "bytes":
        return [max(size, HEADER.size)]
    if ptype in ("tensor_list", "tensor_dict"):
        part = max(HEADER.size, (size // 4) // 4 * 4)
        return [part] * 4
    return [max(HEADER.size, size // 4 * 4)]


TAIL_CHECK = 4096  # bytes at the end of each buffer a check of views compares (``check``)


class PayloadFactory:
    """Items of one payload type and size, stamped with a header and checked on arrival.

    ``ring`` preallocated items are reused in rotation (the caller keeps at most ``ring - 1``
    sends in flight, so an item is never modified while the transport may still read it).
    """

    def __init__(self, ptype: str, size: int, ring: int = 1) -> None:
        self.ptype = ptype
        self.parts = part_sizes(ptype, size)
        self.nbytes = sum(self.parts)
        self.expected = [
            np.frombuffer(np.random.default_rng(1000 + i).bytes(n), dtype=np.uint8)
            for i, n in enumerate(self.parts)
        ]
        corrupt = os.environ.get(CORRUPT_ENV, "")
        self.corrupt = int(corrupt) if corrupt.strip().isdigit() else -1
        self.ring = [self._build() for _ in range(max(1, ring))]

    def _build(self) -> tuple[Any, list[np.ndarray]]:
        """A fresh item and uint8 views of its buffers."""
        bufs = [e.copy() for e in self.expected]
        if self.ptype == "bytes":
            data = bytearray(bufs[0].tobytes())
            return data, [np.frombuffer(data, dtype=np.uint8)]
        if self.ptype == "numpy":
            return bufs[0].view(np.float32), bufs
        tensors = [_torch().from_numpy(b.view(np.float32)) for b in bufs]
        if self.ptype == "tensor":
            return tensors[0], bufs
        if self.ptype == "tensor_list":
            return tensors, bufs
        if self.ptype == "tensor_dict":
            return dict(zip(DICT_FIELDS, tensors, strict=True)), bufs
        return BenchSample(seq=0, data=tensors[0]), bufs

    def make(self, seq: int, index: int, fresh: bool = False) -> tuple[Any, list[np.ndarray]]:
        """The item for ``seq`` (the ``index``-th of its producer): header stamped now."""
        item, views = self._build() if fresh else self.ring[index % len(self.ring)]
        return self._stamp(item, views, seq, index), views

    def make_in(self, empty: Callable[..., Any], seq: int, index: int) -> Any:
        """The item for ``seq`` (``tensor`` or ``numpy``) built in the memory of
        ``empty(shape, dtype)`` (``Channel.empty_shm``), as a producer writing its tensor in a
        shared-memory slot does.  The bench's payload is the same for every item, so memory
        that held one already (the slot freed last comes back first) only gets its header
        stamped, as ``make`` stamps a ring item; other memory gets the payload written (its
        last 4 KiB tell which: random bytes, never there by chance; the consumer checks every
        byte anyway)."""
        if self.ptype not in ("tensor", "numpy"):
            raise ValueError(f"make_in builds tensor and numpy items, not {self.ptype!r}")
        n = self.parts[0] // 4
        item = empty((n,), _torch().float32 if self.ptype == "tensor" else np.float32)
        view = (item.numpy() if self.ptype == "tensor" else item).view(np.uint8)
        want = self.expected[0]
        if not np.array_equal(view[-4096:-1], want[-4096:-1]):  # (the last byte is stamped)
            view[:] = want
        return self._stamp(item, [view], seq, index)

    def _stamp(self, item: Any, views: list[np.ndarray], seq: int, index: int) -> Any:
        """``item`` with its header (``seq``, send time now) and its last byte stamped: the
        pattern's byte, flipped on the item the corruption hook names.  An item of the header
        alone (one 16-byte buffer) has no pattern byte: that item gets the top byte of its
        sequence number flipped instead (0 in every sequence number sent, so ``check`` finds
        the content wrong)."""
        HEADER.pack_into(views[0].data, 0, seq, time.monotonic_ns())
        corrupt = index == self.corrupt
        last = views[-1]
        if len(views) > 1 or last.nbytes > HEADER.size:
            last[-1] = self.expected[-1][-1] ^ (0xFF if corrupt else 0)
        elif corrupt:
            views[0][SEQ_TOP_BYTE] ^= 0xFF
        if isinstance(item, BenchSample):
            item.seq = seq
        return item

    def views_of(self, item: Any) -> list[np.ndarray]:
        """uint8 views of the buffers of a received item (``Mismatch`` on a wrong shape)."""
        try:
            if self.ptype == "bytes":
                return [np.frombuffer(item, dtype=np.uint8)]
            if self.ptype == "numpy":
                return [np.asarray(item).reshape(-1).view(np.uint8)]
            if self.ptype == "tensor":
                parts = [item]
            elif self.ptype == "tensor_list":
                parts = list(item)
            elif self.ptype == "tensor_dict":
                parts = [item[f] for f in DICT_FIELDS]
            else:
                if not isinstance(item, BenchSample):
                    raise Mismatch(f"expected a BenchSample, got {type(item).__name__}")
                parts = [item.data]
            return [p.numpy().reshape(-1).view(np.uint8) for p in parts]
        except Mismatch:
            raise
        except Exception as exc:
            raise Mismatch(f"received a malformed {self.ptype} item: {exc!r}") from None

    def check(self, item: Any, full: bool = True) -> tuple[int, int]:
        """Check a received item; return its (seq, send time ns).  Not ``full``: its header,
        sizes and last 4 KiB only (for views of shared memory, which a full compare would
        read once more)."""
        views = self.views_of(item)
        if not full:
            if [v.nbytes for v in views] != [w.nbytes for w in self.expected]:
                raise Mismatch(f"item of buffers {[v.nbytes for v in views]}, expected "
                               f"{[w.nbytes for w in self.expected]}")
            seq, t_ns = self._check_arrays([_ends(v) for v in views],
                                           [_ends(w) for w in self.expected])
        else:
            seq, t_ns = self.check_views(views)
        if isinstance(item, BenchSample) and item.seq != seq:
            raise Mismatch(f"dataclass seq field {item.seq} != header seq {seq}")
        return seq, t_ns

    def split(self, flat: Any) -> list[Any]:
        """``flat`` (one buffer holding an item's parts back to back) cut into one view per
        part, as ``check_views`` takes them."""
        views, pos = [], 0
        for size in self.parts:
            views.append(flat[pos : pos + size])
            pos += size
        return views

    def check_views(self, views: list[Any]) -> tuple[int, int]:
        """Check raw buffers (as received by the baselines); return (seq, send time ns)."""
        return self._check_arrays([np.frombuffer(v, dtype=np.uint8) for v in views],
                                  self.expected)

    def _check_arrays(self, arrays: list[np.ndarray], expected: list[np.ndarray]
                      ) -> tuple[int, int]:
        if len(arrays) != len(expected):
            raise Mismatch(f"item has {len(arrays)} buffers, expected {len(expected)}")
        for i, (got, want) in enumerate(zip(arrays, expected, strict=True)):
            if got.nbytes != want.nbytes:
                raise Mismatch(f"buffer {i} holds {got.nbytes} bytes, expected {want.nbytes}")
        seq, t_ns = HEADER.unpack_from(arrays[0].data, 0)
        h = HEADER.size
        ok = seq >> (8 * SEQ_TOP_BYTE) == 0 and _equal(arrays[0][h:], expected[0][h:]) and all(
            _equal(g, w) for g, w in zip(arrays[1:], expected[1:], strict=True)
        )
        if not ok:
            raise Mismatch(f"content mismatch in item seq={seq:#x}")
        return seq, t_ns


def _ends(buf: np.ndarray) -> np.ndarray:
    """The header and the last ``TAIL_CHECK`` bytes of ``buf`` (all of a short one)."""
    if buf.nbytes <= HEADER.size + TAIL_CHECK:
        return buf
    return np.concatenate([buf[:HEADER.size], buf[-TAIL_CHECK:]])


def _memcmp() -> Callable[[int, int, int], int] | None:
    """libc's ``memcmp`` (one pass, no temporary), or None where ctypes cannot find it."""
    try:
        fn = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_MEMCMP = _memcmp()


def _equal(got: np.ndarray, want: np.ndarray) -> bool:
    """Byte equality of two equally long uint8 arrays. Large ones go through libc's ``memcmp``
    (one pass over both at memory speed: 0.7 ms for 16 MiB here, against 1.2 ms for numpy's
    8-byte compare and its temporary); the check must not dominate what the bench measures."""
    if got.nbytes <= 4096:  # small items: numpy's per-call overhead would dominate
        return got.tobytes() == want.tobytes()
    if _MEMCMP is not None and got.flags.c_contiguous and want.flags.c_contiguous:
        return _MEMCMP(got.ctypes.data, want.ctypes.data, got.nbytes) == 0
    n = got.nbytes - got.nbytes % 8
    return bool(
        np.array_equal(got[:n].view(np.uint64), want[:n].view(np.uint64))
        and np.array_equal(got[n:], want[n:])
    )


def lost_items(who: str, got: int, together: int, total: int) -> Mismatch:
    """A consumer's deadline passed before all consumers ``together`` got the ``total`` items
    sent: the rest count as lost."""
    return Mismatch(f"{who} got {got}; all consumers together got {together} of the {total} "
                    f"items sent by the deadline: {total - together} lost")


def expected_seqs(counts: list[int]) -> np.ndarray:
    """All sequence numbers sent by producers that sent ``counts[p]`` items each, sorted."""
    return np.sort(
        np.concatenate(
            [
                (np.uint64(p) << np.uint64(SEQ_SHIFT)) + np.arange(n, dtype=np.uint64)
                for p, n in enumerate(counts)
            ]
            or [np.zeros(0, np.uint64)]
        )
    )


def verify_seqs(received: list[np.ndarray], counts: list[int]) -> None:
    """``Mismatch`` unless every item was received exactly once."""
    got = np.sort(np.concatenate(received or [np.zeros(0, np.uint64)]).astype(np.uint64))
    want = expected_seqs(counts)
    if got.shape != want.shape or not np.array_equal(got, want):
        missing = np.setdiff1d(want, got).size
        dup = got.size - np.unique(got).size
        raise Mismatch(
            f"received {got.size} items, expected {want.size} ({missing} missing, {dup} duplicated)"
        )


def verify_consumers(results: list[dict], counts: list[int]) -> None:
    """``verify_seqs`` over the ``seqs`` the consumer workers reported."""
    verify_seqs([r["seqs"] for r in results], counts)


def checked_stream(results: list[dict], counts: list[int], t_go: int) -> tuple[float, np.ndarray]:
    """The figures of a stream from its workers' ``results``: the consumers' seqs checked
    against ``counts`` (``verify_consumers``), then ``stream_figures`` of producers and
    consumers."""
    prod = [r for r in results if r["name"].startswith("producer")]
    cons = [r for r in results if r["name"].startswith("consumer")]
    verify_consumers(cons, counts)
    return stream_figures(prod, cons, t_go)


class Tally:
    """What a receiving worker records: seqs, latencies, first/last times."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.lat_ns: list[int] = []
        self.t_start = time.monotonic_ns()
        self.t_end = self.t_start

    def add(self, seq: int, t_sent: int, now: int | None = None) -> None:
        now = time.monotonic_ns() if now is None else now
        self.seqs.append(seq)
        self.lat_ns.append(now - t_sent)
        self.t_end = now

    def result(self, **extra: Any) -> dict:
        return {
            "seqs": np.asarray(self.seqs, dtype=np.uint64),
            "lat_ns": np.asarray(self.lat_ns, dtype=np.int64),
            "t_start": self.t_start,
            "t_end": self.t_end,
            "count": len(self.seqs),
            **extra,
        }
