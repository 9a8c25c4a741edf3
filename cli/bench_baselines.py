"""Helpers of ``zchannel bench``: self-checking payloads, worker processes, and the baselines.

* ``PayloadFactory`` builds the items of one payload type and size.  Every item carries a
  16-byte header (sequence number, ``CLOCK_MONOTONIC`` send time in ns) at the start of its first
  buffer; the rest of every buffer is a fixed pseudo-random pattern, so a receiver checks the full
  content of every item it gets (``check``) and the set of sequence numbers tells lost or
  duplicated items.
* ``Workers`` starts worker processes (``spawn`` context) with a readiness handshake (one
  ``Event`` per worker, a shared ``go`` event) and ends every one of them by PID.
* The baselines measured on the same payloads in the same run: a raw ``zmq.proxy``
  ROUTER/DEALER relay, a raw DEALER/ROUTER echo (latency), ``multiprocessing.Queue`` and, when
  ``ray`` is importable, ``ray.util.queue.Queue`` and pipelined Ray actor calls.
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import struct
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq
from zchannel.broker import serializable

HEADER = struct.Struct("<QQ")  # sequence number, send time (time.monotonic_ns)
PAYLOAD_TYPES = ("bytes", "numpy", "tensor", "tensor_list", "tensor_dict", "dataclass")
DICT_FIELDS = ("obs", "action", "reward", "done")
SEQ_SHIFT = 40  # seq = producer index << SEQ_SHIFT | item index
CORRUPT_ENV = "ZCHANNEL_BENCH_CORRUPT"  # test hook: producers corrupt the item with this index
ZERO_COPY_MIN = 64 * 1024  # frames at least this big are sent with copy=False (as the codec does)
WORKER_DEADLINE_S = 300.0
POLL_S = 0.05


class Mismatch(Exception):
    """An item arrived with the wrong content, or items were lost or duplicated."""


@serializable
@dataclasses.dataclass
class BenchSample:
    """The ``dataclass`` payload type: a registered dataclass holding a tensor."""

    seq: int
    data: Any


# -- payloads ---------------------------------------------------------------------------------


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


def _torch() -> Any:
    import torch

    return torch


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
        torch = _torch()
        tensors = [torch.from_numpy(b.view(np.float32)) for b in bufs]
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
        HEADER.pack_into(views[0], 0, seq, time.monotonic_ns())
        last = views[-1]
        last[-1] = self.expected[-1][-1] ^ (0xFF if index == self.corrupt else 0)
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

    def check(self, item: Any) -> tuple[int, int]:
        """Check a received item; return its (seq, send time ns)."""
        seq, t_ns = self.check_views(self.views_of(item))
        if isinstance(item, BenchSample) and item.seq != seq:
            raise Mismatch(f"dataclass seq field {item.seq} != header seq {seq}")
        return seq, t_ns

    def check_views(self, views: list[Any]) -> tuple[int, int]:
        """Check raw buffers (as received by the baselines); return (seq, send time ns)."""
        if len(views) != len(self.expected):
            raise Mismatch(f"item has {len(views)} buffers, expected {len(self.expected)}")
        arrays = [np.frombuffer(v, dtype=np.uint8) for v in views]
        for i, (got, want) in enumerate(zip(arrays, self.expected, strict=True)):
            if got.nbytes != want.nbytes:
                raise Mismatch(f"buffer {i} holds {got.nbytes} bytes, expected {want.nbytes}")
        seq, t_ns = HEADER.unpack_from(arrays[0], 0)
        h = HEADER.size
        ok = _equal(arrays[0][h:], self.expected[0][h:]) and all(
            _equal(g, w) for g, w in zip(arrays[1:], self.expected[1:], strict=True)
        )
        if not ok:
            raise Mismatch(f"content mismatch in item seq={seq:#x}")
        return seq, t_ns


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


# -- worker processes -------------------------------------------------------------------------


def _worker_entry(fn: Callable[..., dict], spec: dict, ready: Any, go: Any, out: Any) -> None:
    """Run ``fn(spec, ready_cb, go_wait)`` in a worker; its result (or error) goes to ``out``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def go_wait() -> None:
        if not go.wait(WORKER_DEADLINE_S):
            raise TimeoutError("never told to start")

    try:
        result = fn(spec, ready.set, go_wait)
        result["name"] = spec.get("name", fn.__name__)
    except Mismatch as exc:
        result = {"name": spec.get("name"), "mismatch": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = {"name": spec.get("name"), "error": f"{exc!r}\n{traceback.format_exc()}"}
    out.put(result)


class Workers:
    """Worker processes of one measurement; ``close()`` ends each by PID."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.procs: list[Any] = []
        self.groups: list[str] = []  # the group of each process in ``procs``
        self.ready: list[Any] = []
        self.gos: dict[str, Any] = {}

    def counters(self, n: int) -> Any:
        """``n`` shared int64 slots (each written by one worker only)."""
        return self.ctx.RawArray("q", max(1, n))

    def start(self, fn: Callable[..., dict], spec: dict, group: str = "main") -> None:
        go = self.gos.setdefault(group, self.ctx.Event())
        ready = self.ctx.Event()
        proc = self.ctx.Process(
            target=_worker_entry,
            args=(fn, spec, ready, go, self.out),
            daemon=True,
            name=spec.get("name", fn.__name__),
        )
        proc.start()
        self.procs.append(proc)
        self.groups.append(group)
        self.ready.append(ready)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until every worker signalled readiness; fail early if one died."""
        deadline = time.monotonic() + timeout
        for proc, ready in zip(self.procs, self.ready, strict=True):
            while not ready.wait(0.2):
                if not proc.is_alive() or time.monotonic() > deadline:
                    self._raise_error(f"worker {proc.name} (pid {proc.pid}) did not get ready")

    def go(self, group: str = "main") -> int:
        """Release the workers of ``group``; returns the start time (monotonic ns)."""
        now = time.monotonic_ns()
        self.gos[group].set()
        return now

    def join(self, group: str, timeout: float = 30.0) -> None:
        """Wait until the workers of ``group`` have exited (after reporting, a worker still
        tears its interpreter down: tens of ms of CPU that must not overlap the next phase's
        measurement); ``close()`` ends any that does not."""
        deadline = time.monotonic() + timeout
        for proc, g in zip(self.procs, self.groups, strict=True):
            if g == group:
                proc.join(max(0.0, deadline - time.monotonic()))

    def collect(self, n: int, timeout: float = WORKER_DEADLINE_S) -> list[dict]:
        """Results of ``n`` workers; raises on an error, ``Mismatch`` on a content mismatch."""
        results: list[dict] = []
        deadline = time.monotonic() + timeout
        while len(results) < n:
            try:
                res = self.out.get(timeout=0.5)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError("workers did not finish in time") from None
                if not any(p.is_alive() for p in self.procs):
                    self._raise_error("all workers exited before reporting")
                continue
            if "mismatch" in res:
                raise Mismatch(f"{res.get('name')}: {res['mismatch']}")
            if "error" in res:
                raise RuntimeError(f"worker {res.get('name')} failed: {res['error']}")
            results.append(res)
        return results

    def _raise_error(self, message: str) -> None:
        try:
            res = self.out.get_nowait()
        except queue_mod.Empty:
            raise RuntimeError(message) from None
        if "mismatch" in res:
            raise Mismatch(f"{res.get('name')}: {res['mismatch']}")
        raise RuntimeError(f"{message}: {res.get('error', res)}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.join(timeout=10)
        self.out.close()
        self.out.join_thread()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_proc_status(pid: int, field: str = "VmHWM") -> int | None:
    """A ``/proc/<pid>/status`` memory field in bytes (None when not readable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# -- raw zmq baselines --------------------------------------------------------------------------


def _bind(sock: zmq.Socket, transport: str, tmpdir: str, name: str) -> str:
    if transport == "ipc":
        sock.bind(f"ipc://{tmpdir}/{name}")
    else:
        sock.bind("tcp://127.0.0.1:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def zmq_proxy_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """The relay: ROUTER (producers) -> ``zmq.proxy`` -> DEALER (consumers).  Runs until killed;
    reports its addresses through ``spec['addr_queue']``."""
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (front, back):
        sock.setsockopt(zmq.SNDHWM, spec["hwm"])
        sock.setsockopt(zmq.RCVHWM, spec["hwm"])
        sock.setsockopt(zmq.LINGER, 0)
    addrs = (
        _bind(front, spec["transport"], spec["tmpdir"], "front"),
        _bind(back, spec["transport"], spec["tmpdir"], "back"),
    )
    spec["addr_queue"].put(addrs)
    ready()
    zmq.proxy(front, back)
    return {}


def zmq_echo_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """A ROUTER that sends every message back to its sender.  Runs until killed."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    spec["addr_queue"].put(_bind(sock, spec["transport"], spec["tmpdir"], "echo"))
    ready()
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def _send_item(sock: zmq.Socket, views: list[np.ndarray], trackers: deque, track_slot: int) -> None:
    large = any(v.nbytes >= ZERO_COPY_MIN for v in views)
    if large:
        tracker = sock.send_multipart(views, copy=False, track=True)
        trackers.append((track_slot, tracker))
    else:
        sock.send_multipart([v.tobytes() for v in views])


def zmq_producer_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """A DEALER sending ``n`` items to the relay (ring buffers reused once zmq released them)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, spec["hwm"])
    sock.setsockopt(zmq.LINGER, -1)
    sock.connect(spec["address"])
    window = spec["window"]
    fac = PayloadFactory(spec["ptype"], spec["size"], ring=window + 1)
    base = spec["pidx"] << SEQ_SHIFT
    trackers: deque = deque()
    ready()
    go_wait()
    t_start = time.monotonic_ns()
    for i in range(spec["n"]):
        while trackers and (len(trackers) >= window or trackers[0][0] == i % (window + 1)):
            trackers.popleft()[1].wait()
        _, views = fac.make(base | i, i)
        _send_item(sock, views, trackers, i % (window + 1))
    for _, tracker in trackers:
        tracker.wait()
    t_end = time.monotonic_ns()
    # Stay connected until the consumers got everything: libzmq may drop messages still queued
    # in the proxy when their sender disconnects.
    spec["done"].wait(WORKER_DEADLINE_S)
    sock.close(linger=-1)
    ctx.term()
    return {"t_start": t_start, "t_end": t_end, "count": spec["n"]}


def _counts_done(counts: Any, total: int) -> bool:
    return sum(counts) >= total


def zmq_consumer_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """A DEALER receiving from the relay until all consumers together got ``total`` items."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, spec["hwm"])
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec["address"])
    fac = PayloadFactory(spec["ptype"], spec["size"])
    counts, slot, total = spec["counts"], spec["slot"], spec["total"]
    tally = Tally()
    deadline = time.monotonic() + WORKER_DEADLINE_S
    ready()
    go_wait()
    n = 0
    while True:
        if sock.poll(int(POLL_S * 1000)):
            frames = sock.recv_multipart(copy=False)
            now = time.monotonic_ns()
            seq, t_sent = fac.check_views([f.buffer for f in frames[1:]])
            tally.add(seq, t_sent, now)
            n += 1
            counts[slot] = n
        elif _counts_done(counts, total):
            break
        elif time.monotonic() > deadline:
            raise TimeoutError(f"relay consumer got {n} items; all together {sum(counts)}/{total}")
    sock.close()
    ctx.term()
    return tally.result()


def zmq_echo_client_worker(
    spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]
) -> dict:
    """Round trips through the echo: ``window`` requests in flight, each reply checked."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec["address"])
    window, n = spec["window"], spec["n"]
    fac = PayloadFactory(spec["ptype"], spec["size"], ring=window + 1)
    tally = Tally()
    trackers: deque = deque()
    ready()
    go_wait()
    tally.t_start = time.monotonic_ns()
    sent = received = 0
    while received < n:
        while sent < n and sent - received < window:
            _, views = fac.make(sent, sent)
            _send_item(sock, views, trackers, sent % (window + 1))
            sent += 1
        frames = sock.recv_multipart(copy=False)
        seq, t_sent = fac.check_views([f.buffer for f in frames])
        tally.add(seq, t_sent)
        received += 1
        while trackers and trackers[0][1].done:
            trackers.popleft()
    sock.close()
    ctx.term()
    return tally.result()


# -- multiprocessing.Queue baseline -----------------------------------------------------------


def mp_producer_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """Puts ``n`` fresh items (the queue pickles them later, in its feeder thread)."""
    fac = PayloadFactory(spec["ptype"], spec["size"])
    q = spec["queue"]
    base = spec["pidx"] << SEQ_SHIFT
    ready()
    go_wait()
    t_start = time.monotonic_ns()
    for i in range(spec["n"]):
        q.put(fac.make(base | i, i, fresh=True)[0])
    q.close()
    q.join_thread()
    return {"t_start": t_start, "t_end": time.monotonic_ns(), "count": spec["n"]}


def mp_consumer_worker(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """Gets from the queue until all consumers together got ``total`` items."""
    fac = PayloadFactory(spec["ptype"], spec["size"])
    q, counts, slot, total = spec["queue"], spec["counts"], spec["slot"], spec["total"]
    tally = Tally()
    deadline = time.monotonic() + WORKER_DEADLINE_S
    ready()
    go_wait()
    n = 0
    while True:
        try:
            item = q.get(timeout=POLL_S)
        except queue_mod.Empty:
            if _counts_done(counts, total):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("mp consumer timed out") from None
            continue
        seq, t_sent = fac.check(item)
        tally.add(seq, t_sent)
        n += 1
        counts[slot] = n
    return tally.result()


# -- Ray baseline ---------------------------------------------------------------------------------


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def run_ray_baselines(
    ptype: str, size: int, n: int, window: int, queue: bool = True
) -> dict[str, dict]:
    """1 producer -> ``ray.util.queue.Queue`` -> 1 consumer (Ray tasks; unless ``queue`` is
    false), and ``n`` pipelined actor calls from the driver (``window`` in flight).  Returns raw
    tallies per variant."""
    import ray
    from ray.util.queue import Queue

    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",  # our own instance, never a cluster another process started here
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    try:

        @ray.remote(num_cpus=0)
        def produce(q: Any, ptype: str, size: int, n: int) -> dict:
            fac = PayloadFactory(ptype, size)
            t0 = time.monotonic_ns()
            for i in range(n):
                q.put(fac.make(i, i, fresh=True)[0])
            return {"t_start": t0, "t_end": time.monotonic_ns(), "count": n}

        @ray.remote(num_cpus=0)
        def consume(q: Any, ptype: str, size: int, n: int) -> dict:
            fac = PayloadFactory(ptype, size)
            tally = Tally()
            for _ in range(n):
                tally.add(*fac.check(q.get(timeout=WORKER_DEADLINE_S)))
            return tally.result()

        @ray.remote(num_cpus=0)
        class Sink:
            def __init__(self, ptype: str, size: int) -> None:
                self.fac = PayloadFactory(ptype, size)

            def push(self, item: Any) -> tuple[int, int]:
                return self.fac.check(item)

        out: dict[str, dict] = {}
        if queue:
            q = Queue()
            cons = consume.remote(q, ptype, size, n)
            prod = produce.remote(q, ptype, size, n)
            prod_res, cons_res = ray.get([prod, cons])
            cons_res["t_start"] = prod_res["t_start"]
            out["ray.queue"] = cons_res
        sink = Sink.remote(ptype, size)
        ray.get(sink.push.remote(PayloadFactory(ptype, size).make(0, 0, fresh=True)[0]))
        fac = PayloadFactory(ptype, size)
        tally = Tally()
        inflight: deque = deque()
        for i in range(n):
            if len(inflight) >= window:
                ref = inflight.popleft()
                tally.add(*ray.get(ref))
            inflight.append(sink.push.remote(fac.make(i, i, fresh=True)[0]))
        for ref in inflight:
            tally.add(*ray.get(ref))
        out["ray.actor"] = tally.result()
        return out
    finally:
        if started:
            ray.shutdown()
