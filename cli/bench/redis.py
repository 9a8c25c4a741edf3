"""The Redis baselines of ``zchannel bench``: a ``redis-server`` this run starts on a Unix
socket in its temporary directory, in memory (``redis-mem``: no append-only file, no
snapshots) or with its append-only file on (``redis``: ``appendonly yes``, ``appendfsync
everysec``: acknowledged writes reach the disk within a second, the setting Redis recommends
for a durable queue; the durable targets' baseline), a list as the queue, producers
``RPUSH``ing in pipelines of 64 (8 for items of 1 MiB or more: the same bytes in flight as a
channel's producer) and consumers taking with ``LPOP key 64`` (``BLPOP`` when the list is
empty).  The ``.single`` variants (``redis-mem.single``, ``redis.single``) have the shape of a
consumer keeping 64 single gets outstanding: 64 single ``LPOP`` commands per pipeline (those
that find the list empty answer nil).  The server is ended by its PID.  Needs
``redis-server`` on ``PATH`` (Debian: ``apt-get install redis-server``) and the ``redis``
Python package; without either the baseline is skipped with a line that says why.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from zchannel.cli.bench.cases import Case, Measured, cpu_figures, split
from zchannel.cli.bench.payloads import SEQ_SHIFT, PayloadFactory, checked_stream, lost_items
from zchannel.cli.bench.registry import Baseline, register_baseline
from zchannel.cli.bench.workers import (
    Workers,
    read_proc_cpu_ns,
    read_proc_status,
    start_consumer,
)

KEY = "zchannel-bench"
SMALL_PIPELINE = 64
LARGE_PIPELINE = 8  # items of LARGE_ITEM bytes or more
LARGE_ITEM = 1 << 20


def unavailable() -> str | None:
    """Why the Redis baseline cannot run here (None: it can)."""
    if shutil.which("redis-server") is None:
        return "redis-server is not on PATH (Debian/Ubuntu: apt-get install redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis package is not installed (pip install 'zchannel[redis]')"
    return None


class RedisServer:
    """A ``redis-server`` on a Unix socket in ``parent``: in memory, or with its append-only
    file (``aof``: ``appendfsync everysec``)."""

    def __init__(self, parent: str, aof: bool = False) -> None:
        self.dir = tempfile.mkdtemp(prefix="redis-", dir=parent)
        self.socket = os.path.join(self.dir, "redis.sock")
        durability = ["--appendonly", "yes", "--appendfsync", "everysec"] if aof else [
            "--appendonly", "no"]
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", self.socket, "--unixsocketperm",
             "700", "--dir", self.dir, *durability, "--save", "", "--daemonize", "no",
             "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                self.close()
                raise RuntimeError(f"redis-server did not start: {err.strip()}")
            time.sleep(0.01)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _client(socket: str) -> Any:
    import redis

    client = redis.Redis(unix_socket_path=socket)
    client.ping()
    return client


def redis_producer(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """``RPUSH``es ``n`` items in pipelines."""
    client = _client(spec["socket"])
    depth = LARGE_PIPELINE if spec["size"] >= LARGE_ITEM else SMALL_PIPELINE
    fac = PayloadFactory(spec["ptype"], spec["size"], ring=depth + 1)
    base = spec["pidx"] << SEQ_SHIFT
    ready()
    go_wait()
    t_start = time.monotonic_ns()
    pipe = client.pipeline(transaction=False)
    for i in range(spec["n"]):
        _, views = fac.make(base | i, i)
        pipe.rpush(KEY, b"".join(bytes(v) for v in views) if len(views) > 1 else views[0].tobytes())
        if len(pipe) >= depth:
            pipe.execute()
    if len(pipe):
        pipe.execute()
    t_end = time.monotonic_ns()
    client.close()
    return {"t_start": t_start, "t_end": t_end, "count": spec["n"]}


def redis_consumer(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]) -> dict:
    """Takes items (``LPOP`` 64 at a time, or with ``single`` a pipeline of 64 single
    ``LPOP``s; ``BLPOP`` on an empty list) until all consumers together got ``total``."""
    client = _client(spec["socket"])
    counts, slot, total = spec["counts"], spec["slot"], spec["total"]
    fac, tally, deadline = start_consumer(spec, ready, go_wait)
    n = 0
    pipe = client.pipeline(transaction=False) if spec.get("single") else None
    while sum(counts) < total:
        if pipe is None:
            got = client.lpop(KEY, SMALL_PIPELINE)
        else:
            for _ in range(SMALL_PIPELINE):
                pipe.lpop(KEY)
            got = [data for data in pipe.execute() if data is not None]
        if not got:
            popped = client.blpop([KEY], timeout=0.05)
            if popped is None:
                if time.monotonic() > deadline:
                    raise lost_items("redis consumer", n, sum(counts), total)
                continue
            got = [popped[1]]
        now = time.monotonic_ns()
        for data in got:
            seq, t_sent = fac.check_views(fac.split(memoryview(data)))
            tally.add(seq, t_sent, now)
            n += 1
        counts[slot] = n
    client.close()
    return tally.result()


def run_redis(case: Case, tmpdir: str, aof: bool = False, single: bool = False) -> Measured:
    """One run of ``case``'s stream through a Redis list (in memory, or ``aof``: with its
    append-only file, ``everysec``; consumers pipelining single pops with ``single``)."""
    with RedisServer(tmpdir, aof) as server, Workers() as w:
        counts = w.counters(case.consumers)
        per_prod = split(case.messages, case.producers)
        for p, n in enumerate(per_prod):
            w.start(redis_producer, {"name": f"producer-{p}", "socket": server.socket,
                                     "pidx": p, "n": n, "ptype": case.ptype, "size": case.size})
        for c in range(case.consumers):
            w.start(redis_consumer, {"name": f"consumer-{c}", "socket": server.socket,
                                     "ptype": case.ptype, "size": case.size, "counts": counts,
                                     "slot": c, "total": case.messages, "single": single})
        w.wait_ready()
        cpu0 = read_proc_cpu_ns(server.proc.pid)
        t_go = w.go()
        results = w.collect(case.producers + case.consumers)
        cpu1 = read_proc_cpu_ns(server.proc.pid)
        rss = read_proc_status(server.proc.pid, "VmHWM")
    seconds, lat = checked_stream(results, per_prod, t_go)
    cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    return Measured(case.messages, seconds, lat, rss, cpu_figures(results, case.messages, cpu))


register_baseline(Baseline(
    "redis-mem", run_redis,
    "a Redis list in memory (redis-server on a Unix socket, no AOF): RPUSH in pipelines of "
    "64, LPOP 64 at a time",
    unavailable=unavailable,
))
register_baseline(Baseline(
    "redis-mem.single", functools.partial(run_redis, single=True),
    "a Redis list in memory: RPUSH in pipelines of 64, single LPOPs in pipelines of 64 (the "
    "shape of 64 single gets outstanding)",
    unavailable=unavailable,
))
register_baseline(Baseline(
    "redis", functools.partial(run_redis, aof=True),
    "a Redis list with its append-only file, appendfsync everysec, over a Unix socket: RPUSH "
    "in pipelines of 64, LPOP 64 at a time",
    unavailable=unavailable,
))
register_baseline(Baseline(
    "redis.single", functools.partial(run_redis, aof=True, single=True),
    "a Redis list with its append-only file, appendfsync everysec: RPUSH in pipelines of 64, "
    "single LPOPs in pipelines of 64",
    unavailable=unavailable,
))
