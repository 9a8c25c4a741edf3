"""The worker processes (spawn) or threads (``transport="inproc"``) of a run, by name
``group:rank``: started, watched for abnormal ends, stopped or ended at once.  A spawned worker
starts with SIGINT held, so that a Ctrl-C while it still imports (torch takes seconds) is not a
traceback of its own: it takes SIGINT once it runs, and a held Ctrl-C ends it quietly."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from typing import Any

log = logging.getLogger("zchannel.embodied")


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread while a worker process is spawned, then the thread's mask
    as it was: the worker inherits the mask, so a Ctrl-C while it still imports is held for it
    instead of printing its traceback (``_spawned_worker`` takes it once the worker runs).
    multiprocessing's resource tracker is started first: starting it unblocks SIGINT in the
    calling thread."""
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _spawned_worker(target: Callable, *args: Any) -> None:
    """A spawned worker process's entry: it takes SIGINT from here on (held while it was
    spawned, ``_sigint_blocked``), and a Ctrl-C held meanwhile ends it quietly."""
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        target(*args)
    except KeyboardInterrupt:  # Ctrl-C reached the whole group: the driver ends the run
        raise SystemExit(130) from None


class Workers:
    """Worker processes (spawn) or threads (inproc), by name ``group:rank``."""

    def __init__(self, inproc: bool) -> None:
        self.inproc = inproc
        self.procs: dict[str, Any] = {}
        self.failed: dict[str, str] = {}

    def start(self, name: str, target: Callable, *args: Any) -> None:
        if self.inproc:
            def body() -> None:
                try:
                    target(*args)
                except BaseException as exc:  # reported through the errors key as well
                    self.failed[name] = repr(exc)

            proc: threading.Thread | multiprocessing.process.BaseProcess = threading.Thread(
                target=body, name=name, daemon=True)
            proc.start()
        else:
            proc = multiprocessing.get_context("spawn").Process(
                target=_spawned_worker, args=(target, *args), name=name, daemon=True)
            with _sigint_blocked():
                proc.start()
        self.procs[name] = proc

    def dead(self) -> dict[str, str]:
        """Workers that ended abnormally: name -> how."""
        out = dict(self.failed)
        if not self.inproc:
            for name, proc in self.procs.items():
                if proc.exitcode not in (None, 0):
                    out[name] = f"exit code {proc.exitcode}"
        return out

    def join_threads(self, timeout: float = 30.0) -> None:
        """Wait for inproc worker threads to end (after their channels were shut down), so
        that none is still running torch when the caller's interpreter exits."""
        if not self.inproc:
            return
        deadline = time.monotonic() + timeout
        for thread in self.procs.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [name for name, thread in self.procs.items() if thread.is_alive()]
        if left:
            log.warning("inproc workers still running %.0f s after the run ended: %s",
                        timeout, ", ".join(left))

    def abort(self) -> None:
        """End the worker processes now (threads end when their channels are shut down)."""
        if not self.inproc:
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.terminate()
            for proc in self.procs.values():
                proc.join(10)

    def stop(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(max(0.1, deadline - time.monotonic()))
        if not self.inproc:
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.terminate()
                    proc.join(5)


__all__ = ["Workers"]
