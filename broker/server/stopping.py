"""What ends a broker's loop from outside: SIGINT, SIGTERM or SIGHUP (its terminal closed; not
when the broker was started ignoring it, as ``nohup`` does), and the exit of the process that
created it (``config.parent_pid``).

A signal handler only sets a flag; the signal also writes a byte into a wake-up pipe the loop
polls, so the loop sees it at once.  The creator is watched through a pidfd the loop polls
where the system has them, and by comparing ``os.getppid()`` on each heartbeat tick anyway.

Before the loop runs, ``server/startwatch.py`` watches the creator (a start may never end) and
hands its pidfd on to ``StopSources``.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("zchannel.broker")
# each stops the loop as a shutdown does (the broker's files and shared memory removed, exit 0);
# SIGHUP comes when the terminal of a ``zchannel broker`` closes (kept ignored under ``nohup``)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSources:
    """The wake-up pipe, the signal handlers and the watch on the creator process of a loop."""

    def __init__(self, parent_pid: int | None, on_signal: Callable[[], None],
                 parent_fd: int | None = None) -> None:
        """``parent_fd``: a pidfd of ``parent_pid`` opened before (the start's watch), taken
        over: an exit of the creator before this was made is still seen on it."""
        self.parent_pid = parent_pid
        self._on_stop = on_signal
        self._parent_fd = parent_fd
        if parent_fd is None:
            self._parent_fd = self._watch_parent()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._old_wakeup = signal.set_wakeup_fd(self._wfd)
        for sig in STOP_SIGNALS:
            if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, self._on_signal)

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
