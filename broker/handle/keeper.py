"""``BrokerKeeper``: the process that created a channel's broker watches it; a durable channel's
broker that dies is started again, on the same address and journal, so that nobody has to
(``docs/durability.md``).

A thread waits on the broker process.  When it exits without ``shutdown()``, the keeper logs
its exit status, which also reaps the process (no zombie is left until ``shutdown()``).  An
exit with status 0 is a stop on request (the broker's shutdown token, ``zchannel broker
stop``, or SIGTERM / SIGINT), noted at INFO: the watch ends there, for a durable channel too
(its journal stays for the next broker).  Any other exit (SIGKILL, OOM, a crash) of a channel
without a journal ends the watch as well: the items its broker held are gone (a warning says
so), and its handles fail with ``BrokerUnavailable``.  The keeper refers to the handle it
tells of a restart weakly: its thread keeps no handle alive.

For a durable channel whose broker died so, the keeper takes the channel lock the dead broker
held and starts a broker with the same settings: it reads the journal back before it takes
requests, and the handles, which say ``hello`` again every heartbeat interval while their
broker is silent, resume by themselves (their calls in flight failed with
``BrokerUnavailable``).  A start that fails is tried again after 0.1 s, doubling up to 5 s; a
broker that another process started meanwhile ends the keeper's watch.  The keeper stops with
``shutdown()`` or with its process.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import threading
import time
import weakref
from collections.abc import Callable

from zchannel.broker.errors import BrokerStartError
from zchannel.broker.host import paths
from zchannel.broker.server.starting import (
    START_TIMEOUT_S,
    BrokerProcess,
    spawn_broker,
    stop_broker,
)

log = logging.getLogger("zchannel.client")

RETRY_FIRST_S = 0.1
RETRY_MAX_S = 5.0
# after ``stop``, the longest the watch takes to end: a start under way (its ready line) and
# the stop of the broker it started (``stop_broker``: SIGTERM, then SIGKILL)
WATCH_END_S = START_TIMEOUT_S + 20.0

# called with the new broker process and its shutdown token after each restart
Restarted = Callable[[BrokerProcess, str], None]


class BrokerKeeper:
    """Watches the broker started by ``Channel.create`` and, for a channel with a journal
    (``restart``), starts it again when it dies (see the module docstring)."""

    def __init__(self, name: str, config: dict, proc: BrokerProcess,
                 on_restart: Restarted, restart: bool = True) -> None:
        self.name = name
        self.restart = restart
        self.config = dict(config)
        self.proc = proc
        self._pidfd = _pidfd_of(proc)  # opened before anyone may reap it; the watch closes it
        self.restarts = 0
        # weak: the keeper's thread must not keep the handle it reports to alive
        self._on_restart = weakref.WeakMethod(on_restart)
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name=f"zchannel-keeper-{name}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Start no broker again (``shutdown``, or the process is exiting); a start under way
        is undone."""
        with self._lock:
            self._stopped.set()

    def _watch(self) -> None:
        while True:
            code = _wait_exit(self.proc, self._pidfd)
            self._pidfd = None
            if self._stopped.is_set():
                return
            if code == 0:  # stopped on request (its shutdown token, SIGTERM, SIGINT)
                log.info("the broker of channel %r (pid %d) stopped on request%s", self.name,
                         self.proc.pid, ": not started again; its journal stays"
                         if self.restart else "")
                return
            if not self.restart:
                log.warning("the broker of channel %r (pid %d) exited with status %s: the "
                            "items it held are lost (a channel without a journal; "
                            "docs/durability.md)", self.name, self.proc.pid, code)
                return
            log.warning("the broker of durable channel %r (pid %d) exited with status %s: "
                        "starting it again on %s and its journal", self.name, self.proc.pid,
                        code, self.config.get("address"))
            if not self._start_again():
                return

    def _start_again(self) -> bool:
        """Start the broker again (trying until it starts or the keeper stops); False when the
        keeper's watch ends."""
        delay = RETRY_FIRST_S
        while not self._stopped.is_set():
            lock_fd = paths.try_lock(self.name)
            if lock_fd is None:  # another process started a broker of the channel meanwhile
                if paths.read_address(self.name):
                    log.warning("channel %r is served by a broker another process started: "
                                "this process stops restarting it", self.name)
                    return False
            else:
                try:
                    proc, _, token = spawn_broker(self.config, lock_fd)
                except (BrokerStartError, ValueError, TypeError, OSError) as exc:
                    paths.release_lock(self.name, lock_fd)
                    log.error("could not start the broker of %r again (%s); next try in %.1fs",
                              self.name, exc, delay)
                else:
                    os.close(lock_fd)  # the broker holds it now
                    with self._lock:
                        if self._stopped.is_set():  # shutdown() came meanwhile
                            stop_broker(proc)
                            return False
                        self.proc = proc
                        self._pidfd = _pidfd_of(proc)
                        self.restarts += 1
                        on_restart = self._on_restart()
                        if on_restart is not None:  # (its handle is gone: nobody to tell)
                            on_restart(proc, token)
                    return True
            if self._stopped.wait(delay):
                return False
            delay = min(delay * 2, RETRY_MAX_S)
        return False

    def join(self, timeout: float | None = WATCH_END_S) -> None:
        """Wait for the watch to end (after ``stop`` and the broker's exit); by default as long
        as a start under way and the stop of its broker take, so that no broker it started
        outlives the wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _pidfd_of(proc: BrokerProcess) -> int | None:
    """A pidfd of ``proc`` when it is this process's child (``subprocess.Popen``) and pidfds
    exist; None otherwise (a forked broker's ``wait`` sleeps on its own exit pipe)."""
    if not isinstance(proc, subprocess.Popen):
        return None
    try:
        return os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfds here, or it exited and was reaped already
        return None


def _wait_exit(proc: BrokerProcess, pidfd: int | None) -> int:
    """Wait for ``proc`` to exit and reap it; its status.  A child's exit is awaited on
    ``pidfd`` (closed here) first: a ``Popen.wait()`` blocked in ``waitpid`` holds the lock
    ``shutdown``'s ``wait(timeout)`` and ``poll()`` need, which would then see the exit only by
    polling."""
    if pidfd is not None:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll()
        finally:
            os.close(pidfd)
    return proc.wait()
