"""The copy limits of a stream of large items on this host: baselines ``np.copyto.stream``
and ``copy.pipeline``.

``np.copyto.stream`` (the reference of T9-copy) is one process copying each item with
``np.copyto`` from one of several distinct sources into one of several distinct destinations,
both faulted in before the clock starts, with a working set of at least four times the last
level cache (``L3_BYTES``).  A stream of distinct items works that way: the producer's pool of
slots and the consumer's buffers are far larger than the cache, while ``np.copyto`` between two
fixed 16 MiB buffers (baseline ``np.copyto``, a report row) keeps its 32 MiB largely in a
32 MiB L3 and measures a cache-warm copy no stream of distinct items reaches.


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
from zchannel.cli.bench.payloads import (
    SEQ_SHIFT,
    Mismatch,
    PayloadFactory,
    checked_stream,
    lost_items,
)
from zchannel.cli.bench.registry import Baseline, register_baseline
from zchannel.cli.bench.workers import WORKER_DEADLINE_S, Workers, start_consumer

SEGMENT_DIR = "/dev/shm"
L3_SYSFS = "/sys/devices/system/cpu/cpu0/cache/index3/size"
L3_DEFAULT = 32 << 20  # when sysfs does not say


def l3_bytes(path: str = L3_SYSFS) -> int:
    """The last level cache of this host in bytes (sysfs, e.g. ``32768K``; ``L3_DEFAULT`` when
    it cannot be read)."""
    try:
        with open(path) as f:
            text = f.read().strip().upper()
    except OSError:
        return L3_DEFAULT
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    mult = units.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in units else text
    return int(digits) * mult if digits.isdigit() and int(digits) > 0 else L3_DEFAULT


def stream_buffers(size: int, l3: int) -> int:
    """How many sources (and as many destinations) of ``size`` bytes make a working set of at
    least four times ``l3``: two at the least."""
    return max(2, -(-4 * l3 // (2 * max(1, size))))


def run_copyto_stream(case: Case, tmpdir: str) -> Measured:
    """``case.messages`` copies of ``case.size`` bytes, item ``i`` from source ``i % n`` into
    destination ``(i + n // 2) % n`` (``n = stream_buffers``): each buffer comes round again
    only after the other copies moved four caches' worth, so every copy reads and writes memory
    out of the cache, as a stream of distinct items does."""
    n = stream_buffers(case.size, l3_bytes())
    rng = np.random.default_rng(7)
    srcs = [np.frombuffer(rng.bytes(case.size), dtype=np.uint8) for _ in range(n)]
    dsts = [np.ones(case.size, dtype=np.uint8) for _ in range(n)]  # faulted in now
    lat = np.empty(case.messages, dtype=np.int64)
    start = time.monotonic_ns()
    for i in range(case.messages):
        t0 = time.monotonic_ns()
        np.copyto(dsts[(i + n // 2) % n], srcs[i % n])
        lat[i] = time.monotonic_ns() - t0
    seconds = (time.monotonic_ns() - start) / 1e9
    last = case.messages - 1
    if case.messages and not np.array_equal(dsts[(last + n // 2) % n], srcs[last % n]):
        raise Mismatch("np.copyto.stream baseline: a copy differs from its source")
    return Measured(case.messages, max(seconds, 1e-9), lat)


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
            raise lost_items("copy.pipeline consumer", i, i, total)
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
register_baseline(Baseline(
    "np.copyto.stream", run_copyto_stream,
    "the copy limit of a stream of distinct items: np.copyto in one process from rotating "
    "sources into rotating destinations, a working set of at least 4x the L3 cache",
    latency="copy",
))
