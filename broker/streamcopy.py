"""Large copies with non-temporal (streaming) stores, for the shared-memory path.

A copy into a shared-memory slot, or out of one, is several MiB that the copying process will
not read again soon. glibc's ``memcpy`` switches to non-temporal stores only above
``x86_non_temporal_threshold``, which it derives from the L3 size it detects; on the VMs we
measured it detects 320 MiB of L3 and so never streams a 16 MiB copy. Its cached stores then
read every destination line before writing it and push the rest of the cache out: a 16 MiB
copy moves 48 MiB instead of 32. Same-run A/B of the T9 stream (16 MiB tensors through shared
memory, glibc forced to stream from 1 MiB up): 3.8-4.2 -> 4.5-4.9 GB/s (docs/decisions.md).

Python has no streaming store, so on x86-64 Linux this module assembles a 52-byte SSE2 loop
(``movdqu`` loads, ``movntdq`` stores, 64 bytes a turn, then ``sfence``) into a page mapped
writable, then read-only and executable, and calls it through ``ctypes`` (which releases the
GIL). Elsewhere, or with ``ZCHANNEL_STREAM_COPY=0``, ``copy`` is ``numpy.copyto``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
from collections.abc import Callable

import numpy as np

STREAM_MIN = 4 << 20  # smaller copies stay cached: their reader is often about to read them

# for (n = rdx; n; n -= 64, src += 64, dst += 64) { load 4 x 16 bytes; stream 4 x 16 bytes }
_CODE = bytes.fromhex(
    "f30f6f06"  # movdqu  xmm0, [rsi]
    "f30f6f4e10"  # movdqu  xmm1, [rsi+16]
    "f30f6f5620"  # movdqu  xmm2, [rsi+32]
    "f30f6f5e30"  # movdqu  xmm3, [rsi+48]
    "660fe707"  # movntdq [rdi], xmm0
    "660fe74f10"  # movntdq [rdi+16], xmm1
    "660fe75720"  # movntdq [rdi+32], xmm2
    "660fe75f30"  # movntdq [rdi+48], xmm3
    "4883c640"  # add rsi, 64
    "4883c740"  # add rdi, 64
    "4883ea40"  # sub rdx, 64
    "75cc"  # jnz -52 (the first movdqu)
    "0faef8"  # sfence
    "c3"  # ret
)

_Stream = Callable[[int, int, int], None]
_page: mmap.mmap | None = None  # the code page, kept for the life of the process


def _assemble() -> _Stream | None:
    global _page
    if os.environ.get("ZCHANNEL_STREAM_COPY", "1").strip() in ("0", "false", "no", "off"):
        return None
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        page.write(_CODE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            return None  # e.g. a policy that forbids executable mappings: plain copies
        _page = page
        kind = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        return kind(address)
    except (OSError, ValueError, AttributeError, TypeError):
        return None


_stream: _Stream | None = _assemble()


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy the flat C-contiguous uint8 array ``src`` into ``dst`` (same size): streamed from
    ``STREAM_MIN`` bytes up where available, else ``numpy.copyto``."""
    n = src.nbytes
    if _stream is None or n < STREAM_MIN:
        np.copyto(dst, src, casting="no")
        return
    d = dst.ctypes.data
    head = -d % 64  # movntdq needs 16-byte aligned stores; a whole cache line is better
    body = (n - head) & ~63
    if head:
        np.copyto(dst[:head], src[:head])
    _stream(d + head, src.ctypes.data + head, body)
    if head + body < n:
        np.copyto(dst[head + body :], src[head + body :])
