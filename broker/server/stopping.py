"""What ends a broker's loop from outside: SIGINT or SIGTERM, and the exit of the process that
created it (``config.parent_pid``); and what ends its start when that process exits first.

A signal handler only sets a flag; the signal also writes a byte into a wake-up pipe the loop
polls, so the loop sees it at once.  The creator is watched through a pidfd the loop polls
where the system has them, and by comparing ``os.getppid()`` on each heartbeat tick anyway.

Before the loop runs, the start itself (hooks imported and set up, a journal recovered through
its collector) may take long or never end; ``StartWatch`` watches the creator meanwhile.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("zchannel.broker")

START_GRACE_S = 5.0  # a start interrupted for its creator's exit ends within this, or exits


class StopSources:
    """The wake-up pipe, the signal handlers and the watch on the creator process of a loop."""

    def __init__(self, parent_pid: int | None, on_signal: Callable[[], None]) -> None:
        self.parent_pid = parent_pid
        self._on_stop = on_signal
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._old_wakeup = signal.set_wakeup_fd(self._wfd)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self._parent_fd = self._watch_parent()

    def _watch_parent(self) -> int | None:
        # the creator is this process's parent, or (a broker forked by the fork server,
        # server/forkserver.py) a process of the same user watched through its pidfd alone
        pid = self.parent_pid
        if not pid:
            return None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise SystemExit(f"creator process {pid} is already gone") from None
        except (AttributeError, OSError):
            fd = None  # fall back to the getppid() check on every heartbeat tick
        if fd is None and os.getppid() != pid:
            raise SystemExit(f"creator process {pid} is already gone")
        return fd

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._on_stop()

    def poll_items(self) -> list[tuple[int, int]]:
        """The descriptors the loop polls for them."""
        items: list[tuple[int, int]] = [(self._rfd, zmq.POLLIN)]
        if self._parent_fd is not None:
            items.append((self._parent_fd, zmq.POLLIN))
        return items

    def parent_exited(self, ready: list) -> bool:
        """Empty the wake-up pipe if ``ready`` holds it; True when the creator process exited."""
        if self._rfd in ready:
            os.read(self._rfd, 512)
        if self._parent_fd is not None and self._parent_fd in ready:
            log.warning("creator process %s exited: stopping", self.parent_pid)
            return True
        return False

    def parent_gone(self) -> bool:
        """The heartbeat tick's check: True when this process has another parent by now."""
        if self.parent_pid and self._parent_fd is None and os.getppid() != self.parent_pid:
            log.warning("creator process %s is gone: stopping", self.parent_pid)
            return True
        return False

    def close(self) -> None:
        """Give the wake-up descriptor back to what it was and close the descriptors."""
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self._rfd)
        os.close(self._wfd)
        if self._parent_fd is not None:
            os.close(self._parent_fd)
            self._parent_fd = None


class StartWatch:
    """A thread watching the creator ``parent_pid`` while a broker starts (None: no creator, no
    thread).  When the creator exits before ``stop``, the start is interrupted: SIGINT to the
    main thread (``fired`` is set first), whose ``KeyboardInterrupt`` unwinds the start and
    gives back what it took; a start that has not ended ``START_GRACE_S`` later (SIGINT
    ignored, or a hook that does not return to Python) ends with the process (exit status 1).
    """

    def __init__(self, parent_pid: int | None) -> None:
        self.parent_pid = parent_pid
        self.fired = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        if not parent_pid:
            return
        try:
            self._pidfd: int | None = os.pidfd_open(parent_pid)
        except ProcessLookupError:
            self._pidfd = None  # gone already: the first getppid() check sees it
        except (AttributeError, OSError):
            self._pidfd = None
        self._rfd, self._wfd = os.pipe()
        self._thread = threading.Thread(target=self._run, name="zchannel-start-watch",
                                        daemon=True)
        self._thread.start()

    def _creator_gone(self, poller: select.poll) -> bool:
        """Wait for the creator's exit or ``stop``; True for the exit."""
        while True:
            ready = {fd for fd, _ in poller.poll(None if self._pidfd is not None else 200)}
            if self._rfd in ready:
                return False
            if self._pidfd is not None and self._pidfd in ready:
                return True
            if self._pidfd is None and os.getppid() != self.parent_pid:
                return True

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._rfd, select.POLLIN)
        if self._pidfd is not None:
            poller.register(self._pidfd, select.POLLIN)
        if not self._creator_gone(poller):
            return
        with self._lock:
            if self._stopped.is_set():
                return
            self.fired = True
        log.warning("creator process %s exited while the broker was starting: stopping",
                    self.parent_pid)
        main = threading.main_thread().ident
        if main is not None:
            signal.pthread_kill(main, signal.SIGINT)
        if not self._stopped.wait(START_GRACE_S):
            log.warning("the start did not end %.0f s after its creator exited: exiting",
                        START_GRACE_S)
            logging.shutdown()
            os._exit(1)

    def stop(self) -> None:
        """The start ended (the loop watches the creator from now on): the thread stops, then
        its descriptors close.  Idempotent."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
        if self._thread is None:
            return
        os.write(self._wfd, b"x")
        self._thread.join()
        for fd in (self._rfd, self._wfd, self._pidfd):
            if fd is not None:
                os.close(fd)
