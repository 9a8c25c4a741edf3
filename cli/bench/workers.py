"""Worker processes of ``zchannel bench``.

``Workers`` starts worker processes (``spawn`` context) with a readiness handshake (one ``Event``
per worker, a shared ``go`` event per group), collects their results and ends every one of them
by PID.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from zchannel.cli.bench.payloads import Mismatch, PayloadFactory, Tally
from zchannel.cli.failures import EXPECTED

WORKER_DEADLINE_S = 300.0
POLL_S = 0.05  # receive-poll interval of the baselines' consumers
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # units of the CPU times in /proc/<pid>/stat
GET_TIMEOUT_S = 0.1  # consumers poll with this get timeout once the stream may be over


def _worker_entry(fn: Callable[..., dict], spec: dict, ready: Any, go: Any, out: Any) -> None:
    """Run ``fn(spec, ready_cb, go_wait)`` in a worker; its result (or error) goes to ``out``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    cpu_at_go: list[int] = []

    def go_wait() -> None:
        if not go.wait(WORKER_DEADLINE_S):
            raise TimeoutError("never told to start")
        cpu_at_go.append(time.process_time_ns())

    try:
        result = fn(spec, ready.set, go_wait)
        result["name"] = spec.get("name", fn.__name__)
        if cpu_at_go:  # CPU of all the worker's threads from its start signal to its end
            result["cpu_ns"] = time.process_time_ns() - cpu_at_go[0]
    except Mismatch as exc:
        result = {"name": spec.get("name"), "mismatch": str(exc)}
    except EXPECTED as exc:  # a refusal, a limit, a timeout: its message says it all
        result = {"name": spec.get("name"), "error": f"{type(exc).__name__}: {exc}"}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, with its traceback
        result = {"name": spec.get("name"), "error": repr(exc),
                  "traceback": traceback.format_exc()}
    out.put(result)


class WorkerFailure(RuntimeError):
    """A worker reported an exception.  ``traceback`` is its traceback when the exception is
    none of the expected kinds (``zchannel.cli.failures.EXPECTED``: a refusal, a limit, a
    timeout), i.e. a bug; None for an expected one."""

    def __init__(self, message: str, traceback_text: str | None = None) -> None:
        super().__init__(message)
        self.traceback = traceback_text


def _failure(message: str, res: dict) -> Exception:
    """The exception a worker's report ``res`` stands for, its text after ``message``."""
    if "mismatch" in res:
        return Mismatch(f"{res.get('name')}: {res['mismatch']}")
    return WorkerFailure(f"{message}: {res.get('error', res)}", res.get("traceback"))


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
        """Results of ``n`` workers; ``WorkerFailure`` on a worker's error, ``Mismatch`` on a
        content mismatch."""
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
            if "mismatch" in res or "error" in res:
                raise _failure(f"worker {res.get('name')} failed", res)
            results.append(res)
        return results

    def _raise_error(self, message: str) -> None:
        """Raise ``message`` with the report of a worker that failed, if one is queued."""
        try:
            res = self.out.get_nowait()
        except queue_mod.Empty:
            raise WorkerFailure(message) from None
        raise _failure(message, res)

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

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_consumer(spec: dict, ready: Callable[[], None], go_wait: Callable[[], None]
                   ) -> tuple[PayloadFactory, Tally, float]:
    """A baseline consumer's start: its payload checker (``spec``'s ``ptype`` and ``size``), its
    tally and its deadline (``WORKER_DEADLINE_S``), then the readiness handshake and the wait
    for the common start."""
    fac = PayloadFactory(spec["ptype"], spec["size"])
    tally = Tally()
    deadline = time.monotonic() + WORKER_DEADLINE_S
    ready()
    go_wait()
    return fac, tally, deadline


def read_proc_cpu_ns(pid: int) -> int | None:
    """User + system CPU time of process ``pid`` so far, in ns (``/proc/<pid>/stat``; None
    when not readable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks * 1_000_000_000 // CLOCK_TICKS


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
