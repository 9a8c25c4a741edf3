"""The process's heap: its free pages handed back to the OS (glibc's ``malloc_trim``), which
a broker calls after it let go of much memory at once (its items drained, direct links' read
buffers released), so its resident size falls with what it holds."""

from __future__ import annotations

import ctypes


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
