"""The copy limit of a copy-in, copy-out stream on this host: baseline ``copy.pipeline``.

A default shared-memory stream moves each large tensor twice: the producer copies it into a
slot, the consumer copies it out (``copy=True``: it owns its tensor), and the bench's consumer
then reads every byte once more to check it.  ``np.copyto`` in one process (the baseline of
T9-copy) does one copy and no check, so it is not what such a stream can reach.  This baseline
is that stream with nothing else: one producer process copies each item into one of
``window`` slots of a shared segment, one consumer process copies each slot into memory it
owns (two buffers, reused, so no page is faulted in while timed), frees the slot and checks
every byte as the bench's consumers do; two semaphores hand the slots over (a ring).  Its
items/s are the ceiling of T9 on this machine: the two copies run in parallel on two cores,
and the broker, the codec and the sockets cost nothing here.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Callable

import numpy as np
from zchannel.cli.bench.cases import Case, Measured, cpu_figures
from zchannel.cli.bench.payloads import SEQ_SHIFT, PayloadFactory, checked_stream
from zchannel.cli.bench.registry import Baseline, register_baseline
from zchannel.cli.bench.workers import WORKER_DEADLINE_S, Workers, start_consumer

SEGMENT_DIR = "/dev/shm"


def _slots(path: str, slot: int, n: int) -> list[np.ndarray]:
    """The ``n`` slots of ``slot`` bytes of the segment at ``path``, mapped here (the mapping
    goes with the last of them)."""
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, slot * n)
    finally:
        os.close(fd)
    whole = np.frombuffer(mm, dtype=np.uint8)
    return [whole[i * slot : (i + 1) * slot] for i in range(n)]


def pipeline_producer(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """Copies ``n`` items into the ring's slots, each once the consumer freed it."""
    window = spec["window"]
    fac = PayloadFactory(spec["ptype"], spec["size"], ring=window + 1)
    slots = _slots(spec["path"], spec["slot"], window)
    free, full = spec["free"], spec["full"]
    base = spec["pidx"] << SEQ_SHIFT
    ready()
    go_wait()
    t_start = time.monotonic_ns()
    for i in range(spec["n"]):
        _, views = fac.make(base | i, i)
        if not free.acquire(timeout=WORKER_DEADLINE_S):
            raise TimeoutError(f"no slot freed for item {i}")
        dst, pos = slots[i % window], 0
        for v in views:
            np.copyto(dst[pos : pos + v.nbytes], v.reshape(-1).view(np.uint8))
            pos += v.nbytes
        full.release()
    t_end = time.monotonic_ns()
    return {"t_start": t_start, "t_end": t_end, "count": spec["n"]}


def pipeline_consumer(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """Copies each slot out into memory of its own, frees the slot, checks every byte."""
    window, total = spec["window"], spec["total"]
    slots = _slots(spec["path"], spec["slot"], window)
    free, full = spec["free"], spec["full"]
    owned = [np.ones(spec["slot"], dtype=np.uint8) for _ in range(2)]  # faulted in now
    fac, tally, _ = start_consumer(spec, ready, go_wait)
    for i in range(total):
        if not full.acquire(timeout=WORKER_DEADLINE_S):
            raise TimeoutError(f"consumer got {i}/{total}")
        out = owned[i % 2]
        np.copyto(out, slots[i % window])
        free.release()
        seq, t_sent = fac.check_views(fac.split(out))
        tally.add(seq, t_sent)
    return tally.result()


def run_copy_pipeline(case: Case, tmpdir: str) -> Measured:
    """One run of ``case`` (1 producer, 1 consumer) through the copy-in, copy-out ring."""
    if case.producers != 1 or case.consumers != 1:
        raise ValueError("the copy.pipeline baseline runs 1 producer and 1 consumer")
    fac = PayloadFactory(case.ptype, case.size)
    slot = (fac.nbytes + 4095) // 4096 * 4096
    window = max(1, case.window)
    path = os.path.join(SEGMENT_DIR, f"zcb-copy-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, slot * window)
        os.close(fd)
        with Workers() as w:
            free, full = w.ctx.Semaphore(window), w.ctx.Semaphore(0)
            common = {"path": path, "slot": slot, "window": window, "free": free, "full": full,
                      "ptype": case.ptype, "size": case.size}
            w.start(pipeline_producer, {**common, "name": "producer-0", "pidx": 0,
                                        "n": case.messages})
            w.start(pipeline_consumer, {**common, "name": "consumer-0", "total": case.messages})
            w.wait_ready()
            t_go = w.go()
            results = w.collect(2)
    finally:
        os.unlink(path)
    seconds, lat = checked_stream(results, [case.messages], t_go)
    return Measured(case.messages, seconds, lat, extra=cpu_figures(results, case.messages))


register_baseline(Baseline(
    "copy.pipeline", run_copy_pipeline,
    "the copy limit of a copy-in, copy-out stream: a producer process copies each item into "
    "shared slots, a consumer process copies it out and checks every byte (two copies on two "
    "cores, nothing else)",
))
