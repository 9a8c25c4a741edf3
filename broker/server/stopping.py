"""What ends a broker's loop from outside: SIGINT, SIGTERM or SIGHUP (its terminal closed; not
when the broker was started ignoring it, as ``nohup`` does), and the exit of the process that
created it (``config.parent_pid``).

A signal handler only sets a flag; the signal also writes a byte into a wake-up pipe, which a
thread (``SignalWatch``) passes on to a pipe the loop polls, so the loop sees it at once.  The
creator is watched through a pidfd the loop polls where the system has them, and by comparing
``os.getppid()`` on each heartbeat tick anyway.

The loop sees the flag between two turns, so a stop that comes while a hook call runs waits
for that call to return (the stop is kept).  A second stop signal while one is pending forces
the stop, as a second Ctrl-C does elsewhere: ``ForcedStop`` is raised inside the hook call
the loop is in (the hook pipeline, ``core/hookpipeline.py``, takes it as that hook's failure:
its request gets a ``HookError``), and from then on, every ``FORCE_TICK_S``, inside any hook
call the loop makes, until it ended its turn and stopped as on the first signal (its files
removed, exit status 0).  A signal that finds the loop outside a hook call raises nothing: the
turn ends by itself.

Python runs a signal's handler in the main thread (the loop's) only, once that thread runs
Python code again: a signal that comes while the main thread is about to block in a hook's
system call, or that the kernel hands to another thread, leaves the main thread blocked with
the handler not run.  So the watch thread, which sees every signal's byte, counts the stop
signals itself, and once the stop is forced sends the main thread the stop signal again every
``FORCE_TICK_S`` (``pthread_kill``): each interrupts its system call and runs the handlers due.

Before the loop runs, ``server/startwatch.py`` watches the creator (a start may never end) and
hands its pidfd on to ``StopSources``.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

import zmq
from zchannel.broker.core import hookpipeline

log = logging.getLogger("zchannel.broker")
# each stops the loop as a shutdown does (the broker's files and shared memory removed, exit 0);
# SIGHUP comes when the terminal of a ``zchannel broker`` closes (kept ignored under ``nohup``)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# once the stop is forced, how often the loop's thread gets the stop signal again, which
# interrupts the hook call it is in
FORCE_TICK_S = 0.005
_BROKER_PACKAGE = "zchannel.broker"


class ForcedStop(SystemExit):
    """Raised inside a hook call of a broker whose stop was forced (a second stop signal): the
    hook pipeline takes it as the hook's failure, as any exception.  A ``SystemExit`` with
    status 0, which a hook's ``except Exception`` lets pass."""

    def __init__(self) -> None:
        super().__init__(0)

    def __str__(self) -> str:
        return "the broker is stopping: a second stop signal interrupted this hook call"


def in_hook_call(frame: FrameType | None) -> bool:
    """Whether ``frame`` (where a signal found the loop's thread) runs inside a hook call: the
    hook pipeline (``core/hookpipeline.py``, which makes every call of a hook inside a ``try``
    that takes any exception as the hook's failure) is below it on the stack, and between the
    two there is code of neither the broker (``zchannel.broker``) nor the standard library:
    the hook's."""
    hook_code = False
    while frame is not None:
        module = frame.f_globals.get("__name__")
        module = module if isinstance(module, str) else ""
        if module == hookpipeline.__name__:
            return hook_code
        hook_code = hook_code or not _broker_or_stdlib(module)
        frame = frame.f_back
    return False


def _broker_or_stdlib(module: str) -> bool:
    """Whether ``module`` (a frame's ``__name__``) is the broker's own or the standard
    library's."""
    return (module == _BROKER_PACKAGE or module.startswith(_BROKER_PACKAGE + ".")
            or module.partition(".")[0] in sys.stdlib_module_names)


class SignalWatch:
    """The thread that reads the signals' wake-up pipe: it wakes the loop (a byte into the
    pipe ``wake_fd``), counts the stop signals, and once a second one came (``forced``)
    interrupts the main thread with the stop signal every ``FORCE_TICK_S`` until ``close``.
    Made in the main thread (the loop's)."""

    def __init__(self, wake_fd: int) -> None:
        self.wake_fd = wake_fd
        self.stops = 0  # stop signals received
        self.forced = False  # a second stop signal came
        self._main = threading.get_ident()
        self._sig_r, self._sig_w = os.pipe()
        os.set_blocking(self._sig_w, False)
        self._stop_r, self._stop_w = os.pipe()
        # (a full pipe only means the watch has a byte to read already)
        self._old_wakeup = signal.set_wakeup_fd(self._sig_w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="zchannel-signal-watch",
                                        daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._release()
            raise

    def _run(self) -> None:
        # the main thread takes the stop signals (they interrupt its system calls)
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        stop_numbers = {int(sig) for sig in STOP_SIGNALS}
        forced_by = 0
        while True:
            ready, _, _ = select.select([self._sig_r, self._stop_r], [], [],
                                       FORCE_TICK_S if self.forced else None)
            if self._stop_r in ready:
                return
            if self._sig_r in ready:
                for number in os.read(self._sig_r, 512):
                    if number in stop_numbers and not self.forced:
                        self.stops += 1
                        self.forced, forced_by = self.stops > 1, number
                _write_byte(self.wake_fd)
            if self.forced:
                try:
                    signal.pthread_kill(self._main, forced_by)
                except OSError:  # the main thread is gone: nothing is left to interrupt
                    return

    def close(self) -> None:
        """Stop the thread, and give the wake-up descriptor back to what it was."""
        os.write(self._stop_w, b"x")
        self._thread.join(10.0)
        self._release()

    def _release(self) -> None:
        signal.set_wakeup_fd(self._old_wakeup)
        for fd in (self._sig_r, self._sig_w, self._stop_r, self._stop_w):
            os.close(fd)


def _write_byte(fd: int) -> None:
    """A byte into the non-blocking pipe ``fd`` (a full one has bytes to read already)."""
    try:
        os.write(fd, b"x")
    except BlockingIOError:
        pass


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
        self._closed = False
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._watch = SignalWatch(self._wfd)
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

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """A stop signal: the loop stops after this turn; once the stop is forced (a second
        one, ``SignalWatch``), the hook call the loop is in, if any, is interrupted."""
        if self._closed:
            return
        self._on_stop()
        if self._watch.forced and in_hook_call(frame):
            raise ForcedStop()

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
        """Stop the signal watch (its wake-up descriptor given back to what it was) and close
        the descriptors; a stop signal from now on changes nothing."""
        self._closed = True
        self._watch.close()
        os.close(self._rfd)
        os.close(self._wfd)
        if self._parent_fd is not None:
            os.close(self._parent_fd)
            self._parent_fd = None
