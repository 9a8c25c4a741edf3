"""``Work``: the handle of an operation in flight, usable from threads and from asyncio."""

from __future__ import annotations

import asyncio
import logging
import numbers
import threading
from collections.abc import Callable, Generator
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, cast

_PENDING, _DONE, _FAILED = 0, 1, 2

log = logging.getLogger("zchannel.client")


def _wait_timeout(timeout: Any) -> float | None:
    """``Work.wait``'s timeout: None, or a number (negative: do not wait; beyond what a lock
    can wait, infinity included: no limit); ``ValueError`` for NaN or a non-number."""
    if timeout is None:
        return None
    kind = type(timeout)
    if (kind is float or kind is int) and 0 <= timeout <= threading.TIMEOUT_MAX:  # the common case
        return float(timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout != timeout:
        raise ValueError(f"timeout must be None or a number of seconds, got {timeout!r}")
    # a Real compares with a float (typeshed's numbers.Real does not say so)
    seconds = cast(float, timeout)
    return None if seconds > threading.TIMEOUT_MAX else max(0.0, float(seconds))


@dataclass(frozen=True)
class Delivery:
    """An item received with ``get(..., ack=True)``: acknowledge it with ``channel.ack``."""

    item: Any
    """The item taken from the queue."""
    lease_id: int
    """The broker's lease; the item is delivered again if not acknowledged in time."""


class Work:
    """Result of an ``async_op=True`` call.

    ``wait(timeout)`` returns the result or raises the operation's error; a ``TimeoutError``
    from ``wait`` leaves the operation pending.  ``await work`` (or ``await work.async_wait()``)
    yields to the event loop without a thread per handle; cancelling the awaiting task does not
    cancel the operation.  ``cancel()`` returns True iff the broker withdrew the operation.
    A ``Work`` belongs to the process that made the request: pickling it is a ``TypeError``.
    """

    __slots__ = ("_state", "_value", "_convert", "_gate", "_callbacks", "_waking", "_cancel_fn",
                 "_lock", "_tag", "_reader", "_on_error", "_line", "__weakref__")

    def __init__(self, cancel_fn: Callable[[Work], bool] | None = None) -> None:
        self._state = _PENDING
        self._value: Any = None
        self._convert: Callable[..., Any] | None = None
        # held while pending, made only when a thread sleeps on it (``_sleep``): most Works
        # complete before anyone waits, or are read by their waiting thread itself
        self._gate: threading.Lock | None = None
        self._callbacks: list[Callable[[Work], None]] | None = None
        self._waking: list[Callable[[Work], None]] | None = None  # those ``_wake`` calls
        self._cancel_fn = cancel_fn
        self._tag: Any = None  # the transport's note (the request id), read by ``cancel_fn``
        # a transport whose waiting threads read their replies themselves (a direct link)
        self._reader: Any = None
        # a put's: ``(fn, *args)``, ``fn(*args, error)`` called once by the first thread that
        # sees it fail (the handle notes a put in doubt, handle/retries.py)
        self._on_error: tuple[Any, ...] | None = None
        # the connection's ``Line`` (set by the transport): a wait on the thread that reads
        # its replies would wait for itself (``_sleep`` refuses it)
        self._line: Any = None
        self._lock = threading.Lock()

    # -- completion (called by the transport) ------------------------------------------------

    def _finish(self, state: int, value: Any, convert: Callable[..., Any] | None = None) -> None:
        with self._lock:
            if self._state != _PENDING:
                return
            self._value, self._convert, self._state = value, convert, state
            self._waking, self._callbacks = self._callbacks, None
            if state == _DONE:
                self._on_error = None
        if self._gate is not None or self._waking:
            self._wake()

    def _wake(self) -> None:
        """Wake what waits for this completed operation: the threads asleep on it, then its
        done-callbacks, each once.  An interruption (a signal handler's exception) may cut
        it short: the reply path calls it again (``Connection._on_reply``) and it goes on."""
        gate = self._gate
        if gate is not None:
            self._gate = None  # (no call before the release: done once)
            gate.release()
        waking = self._waking
        while waking:
            _call(waking[0], self)  # (it returns with no interruption: del follows at once)
            del waking[0]

    def set_result(self, value: Any = None, convert: Callable[[], Any] | None = None) -> None:
        """Complete with ``value``, or with ``convert()`` computed lazily by the first reader."""
        if convert is None:
            self._finish(_DONE, value)
        else:
            self._finish(_DONE, (), convert)

    def set_exception(self, exc: BaseException) -> None:
        self._finish(_FAILED, exc)

    def add_done_callback(self, callback: Callable[[Work], None]) -> None:
        """Call ``callback(work)`` once the operation is done (at once if it already is), in the
        thread that completes it.  An exception it raises is logged and goes no further (as
        ``concurrent.futures`` does): that thread may be completing other requests too.
        ``TypeError`` at once for a ``callback`` that is not callable."""
        if not callable(callback):
            raise TypeError(f"add_done_callback() takes a callable, not "
                            f"{type(callback).__name__}")
        with self._lock:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                if self._reader is not None:
                    self._reader.watch()  # nobody may wait: its reply must not wait for one
                return
        _call(callback, self)

    # -- user API ----------------------------------------------------------------------------

    def done(self) -> bool:
        """True once the operation completed or failed (never blocks)."""
        return self._state != _PENDING

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation completes and return its result or raise its error.

        A ``TimeoutError`` after ``timeout`` seconds leaves the operation pending (only the
        operation's own ``timeout=`` withdraws it).
        """
        timeout = _wait_timeout(timeout)
        if self._state == _PENDING:
            if self._reader is not None:
                self._reader.wait_for(self, timeout)  # reads its reply itself (waiting.py)
                if self._state == _PENDING:
                    raise TimeoutError("Work.wait timed out; the operation is still pending")
            elif not self._sleep(-1 if timeout is None else timeout):
                raise TimeoutError("Work.wait timed out; the operation is still pending")
        return self.result()

    def _sleep(self, timeout: float) -> bool:
        """Sleep until the operation is done, for up to ``timeout`` seconds (-1: no limit);
        whether it is.  Its gate is made here, under the lock ``_finish`` takes: a completion
        either comes before (nothing to sleep on) or releases it."""
        with self._lock:
            if self._state != _PENDING:
                return True
            if self._line is not None and self._line.reads_here():
                raise RuntimeError(SELF_WAIT)
            gate = self._gate
            if gate is None:
                gate = self._gate = threading.Lock()
                gate.acquire()
        if gate.acquire(timeout=timeout):
            gate.release()  # the next sleeper passes too
            return True
        return self._state != _PENDING

    def result(self) -> Any:
        """The result of a completed operation, or its error raised; ``asyncio.InvalidStateError``
        while it is pending."""
        # ``_finish`` sets the state last and a conversion clears ``_convert`` only after
        # storing its value (a failed one never clears it): done with no converter left means
        # ``_value`` is the result
        if self._state == _DONE and self._convert is None:
            return self._value
        return self._result()

    def _result(self) -> Any:
        """``result`` when the value may still need converting (by the first reader, under the
        lock), or the operation failed or is pending."""
        if self._state == _PENDING:
            raise asyncio.InvalidStateError("the operation is still pending")
        if self._state == _FAILED:
            if self._on_error is not None:
                self._failed()
            raise self._value
        with self._lock:
            convert = self._convert
            if convert is not None and self._state == _DONE:
                try:
                    value = convert(*self._value)
                except Exception as exc:
                    self._state, self._value = _FAILED, exc
                    raise
                # (an interruption, a signal handler's KeyboardInterrupt, leaves the value to
                # the next read: converters read their reply again, or say it is lost)
                self._value = value
                self._convert = None
        if self._state == _FAILED:
            raise self._value
        return self._value

    def _failed(self) -> None:
        with self._lock:
            on_error, self._on_error = self._on_error, None
        if on_error is not None:
            on_error[0](*on_error[1:], self._value)

    def exception(self) -> BaseException | None:
        """The error of a failed operation; None while pending or after success."""
        if self._state == _FAILED:
            if self._on_error is not None:
                self._failed()
            return cast(BaseException, self._value)
        return None

    def cancel(self) -> bool:
        """Ask the broker to withdraw the operation; True iff it did before completing it."""
        if self._state != _PENDING or self._cancel_fn is None:
            return False
        return self._cancel_fn(self)

    def then(self, fn: Callable[[Any], Any]) -> Work:
        """A new ``Work`` that resolves to ``fn(result)`` once this one succeeds.

        If this operation fails, or ``fn`` raises, the new ``Work`` fails with that error
        (``fn`` is not called after a failure).  ``fn`` runs once, in the thread that completes
        this operation — usually the handle's I/O thread (a thread reading its own reply may
        complete it too; in a local channel, the thread whose call completed it): keep ``fn``
        short and never block on a channel in it.  If this operation is already done, ``fn``
        runs at once in the calling thread.  Chains nest: ``work.then(f).then(g)``.
        ``cancel()`` on the new ``Work`` cancels this operation.
        """
        if not callable(fn):
            raise TypeError(f"then() takes a callable, not {type(fn).__name__}")
        out = Work(lambda _: self.cancel())
        out._line = self._line  # waited for where this one's reply is read: refused too

        def done(work: Work) -> None:
            try:
                value = fn(work.result())
            except BaseException as exc:  # the operation's error, or fn's
                out.set_exception(exc)
                return
            out.set_result(value)

        self.add_done_callback(done)
        return out

    async def async_wait(self) -> Any:
        """Await the result in asyncio (``await work`` is the same); cancelling the awaiting task
        does not cancel the operation."""
        if self._state == _PENDING:
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def wake(_: Work) -> None:
                try:
                    loop.call_soon_threadsafe(_resolve, future)
                except RuntimeError:  # its loop closed meanwhile: nobody awaits any more
                    pass

            self.add_done_callback(wake)
            try:
                # shield: cancelling the awaiting task does not cancel the operation
                await asyncio.shield(future)
            except asyncio.CancelledError:  # (a timed-out wait_for): its wake-up goes too
                self._discard_callback(wake)
                raise
        return self.result()

    def _discard_callback(self, callback: Callable[[Work], None]) -> None:
        """Forget ``callback`` if the operation is still pending (an await given up)."""
        with self._lock:
            if self._callbacks is not None and callback in self._callbacks:
                self._callbacks.remove(callback)

    def __await__(self) -> Generator[Any, None, Any]:
        return self.async_wait().__await__()

    def __reduce__(self) -> Any:
        raise TypeError(
            "a Work cannot be pickled: it is a request this process's handle made, and only "
            "this process receives its answer; pickle its result (work.wait()) or the channel "
            "handle instead")

    def __repr__(self) -> str:
        state = {_PENDING: "pending", _DONE: "done", _FAILED: "failed"}[self._state]
        return f"<Work {state}>"


SELF_WAIT = ("waiting for a pending Work (or cancelling one) in a done-callback, then() or a "
              "signal handler that runs while this thread reads the connection's replies "
              "would wait for itself: use add_done_callback/then, or another thread")


def _call(callback: Callable[[Work], None], work: Work) -> None:
    """``callback(work)``; what it raises is logged (never raised in the completing thread)."""
    try:
        callback(work)
    except BaseException:  # SystemExit, KeyboardInterrupt too: the completing thread goes on
        log.exception("a Work done-callback raised (ignored): %r", callback)


def _resolve(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(None)


__all__ = ["CancelledError", "Delivery", "Work"]
