"""The watch on a broker's creator while the broker starts, before its loop watches it.

A start imports hook modules, runs the collector's and dispatcher's ``setup`` and recovers a
journal through the collector: any of them may take long, or never end.  ``StartWatch`` runs a
thread that waits on the creator's pidfd meanwhile.  When the creator exits first, the thread
sends SIGINT to the main thread, whose handler (installed for the start) raises
``StartInterrupted`` there once, between ``arm`` and ``disarm`` (the block that catches it): the
start unwinds and gives back what it took (``main_from_stdin`` then exits).  Any other SIGINT
is handled as by the handler it replaced.  A start still running ``START_GRACE_S`` later (the
interruption ignored or swallowed by a hook, or a hook blocked outside Python) ends with the
process.  When the start ends, ``stop`` hands the pidfd on to the loop (``StopSources``), so an
exit of the creator between the two is not missed.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from typing import Any

START_GRACE_S = 5.0  # an interrupted start ends within this, or the process exits


class StartInterrupted(BaseException):
    """Raised in the main thread of a starting broker whose creator exited (a
    ``BaseException``, as ``KeyboardInterrupt``: a hook's ``except Exception`` lets it pass)."""


class StartWatch:
    """The creator ``parent_pid``'s watch during a start (None: no creator, nothing watched).
    Made, ``arm``-ed, ``disarm``-ed and ``stop``-ped by the main thread."""

    def __init__(self, parent_pid: int | None) -> None:
        self.parent_pid = parent_pid
        self.fired = False  # the creator exited before ``stop`` (set before the SIGINT)
        self._armed = False  # StartInterrupted may be raised (``arm``; once at most)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._pidfd: int | None = None
        self._gone = False  # the creator had exited before the watch began
        if not parent_pid:
            return
        try:
            self._pidfd = os.pidfd_open(parent_pid)
        except ProcessLookupError:
            self._gone = True
        except (AttributeError, OSError):
            # no pidfds: a child of its creator compares getppid(); a broker forked by the
            # fork server cannot tell (its loop refuses to start: ``StopSources``)
            if os.getppid() != parent_pid:
                return
        self._rfd, self._wfd = os.pipe()
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        self._previous = signal.default_int_handler if previous is None else previous
        self._thread = threading.Thread(target=self._run, name="zchannel-start-watch",
                                        daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._thread = None
            signal.signal(signal.SIGINT, self._previous)
            for fd in (self._rfd, self._wfd, self._pidfd):
                if fd is not None:
                    os.close(fd)
            raise

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if not self.fired:  # not the watch's: as the handler this one replaced
            if self._previous is signal.SIG_IGN:
                return
            self._armed = False  # the start ends with this interruption, not with ours
            if callable(self._previous):
                self._previous(signum, frame)
            else:
                signal.default_int_handler(signum, frame)
        elif self._armed:
            self._interrupt()

    def arm(self) -> None:
        """From here on (the main thread is where ``StartInterrupted`` is caught) the creator's
        exit raises it: at once if the creator exited already."""
        self._armed = True
        if self.fired:
            self._interrupt()

    def _interrupt(self) -> None:
        self._armed = False  # once at most
        raise StartInterrupted(f"creator process {self.parent_pid} exited")

    def _creator_gone(self) -> bool:
        """Wait for the creator's exit (True) or for ``stop`` (False)."""
        poller = select.poll()
        poller.register(self._rfd, select.POLLIN)
        if self._pidfd is not None:
            poller.register(self._pidfd, select.POLLIN)
        while not self._gone:
            ready = {fd for fd, _ in poller.poll(None if self._pidfd is not None else 200)}
            if self._rfd in ready:
                return False
            self._gone = (self._pidfd in ready if self._pidfd is not None
                          else os.getppid() != self.parent_pid)
        return True

    def _run(self) -> None:
        if not self._creator_gone():
            return
        with self._lock:
            if self._stopped.is_set():
                return
            self.fired = True
            main = threading.main_thread().ident
            if main is not None:
                signal.pthread_kill(main, signal.SIGINT)
        _say(f"creator process {self.parent_pid} exited while the broker was starting: "
             "stopping\n")
        if not self._stopped.wait(START_GRACE_S):
            _say(f"the start did not end {START_GRACE_S:.0f} s after its creator exited: "
                 "exiting\n")
            os._exit(1)

    def disarm(self) -> None:
        """No ``StartInterrupted`` from here on (the start ended, or was interrupted)."""
        self._armed = False

    def stop(self) -> int | None:
        """The start ended: the thread stops, its pipe closes, the SIGINT handler the watch
        replaced is back (unless a hook installed another); the creator's pidfd, now the
        caller's (None without one).  Call it once, after ``disarm``."""
        with self._lock:
            self._stopped.set()
        if self._thread is None:
            return None
        os.write(self._wfd, b"x")
        self._thread.join()
        os.close(self._rfd)
        os.close(self._wfd)
        if signal.getsignal(signal.SIGINT) == self._on_sigint:
            signal.signal(signal.SIGINT, self._previous)
        return self._pidfd


def close_pidfd(fd: int | None) -> None:
    """Close a creator's pidfd that ``stop`` handed on (None: there was none)."""
    if fd is not None:
        os.close(fd)


def _say(text: str) -> None:
    """A line on stderr that takes no lock (the main thread may hold logging's, stuck)."""
    try:
        os.write(2, f"zchannel[{os.getpid()}] WARNING {text}".encode())
    except OSError:
        pass
