"""The disk baseline of ``zchannel bench``'s durable targets: the same bytes as the measured case
written to a file in the run's temporary directory (so on the disk the journal uses) by a plain
loop of ``write`` + ``fdatasync`` per item — what a disk sustains for synced sequential writes
of that size, measured in the same rounds as the journal."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
from zchannel.cli.bench.cases import Case, Measured
from zchannel.cli.bench.payloads import PayloadFactory
from zchannel.cli.bench.registry import Baseline, register_baseline


def run_disk(case: Case, tmpdir: str) -> Measured:
    """Write ``case.messages`` blocks of ``case``'s payload bytes, each followed by
    ``fdatasync``; the figures of that loop (latency: one write + sync)."""
    block = b"".join(v.tobytes() for v in PayloadFactory(case.ptype, case.size).ring[0][1])
    fd, path = tempfile.mkstemp(prefix="disk-", dir=tmpdir)
    lat = np.empty(case.messages, dtype=np.int64)
    try:
        t0 = time.monotonic_ns()
        for i in range(case.messages):
            start = time.monotonic_ns()
            view = memoryview(block)
            while view:
                view = view[os.write(fd, view):]
            os.fdatasync(fd)
            lat[i] = time.monotonic_ns() - start
        seconds = (time.monotonic_ns() - t0) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)
    return Measured(case.messages, max(seconds, 1e-9), lat)


register_baseline(Baseline(
    "disk", run_disk,
    "write + fdatasync of each item's bytes to a file on the journal's disk",
))
