"""The project's error types and their transport across the wire.

Standard errors keep their standard types across the wire (``ValueError``, ``TypeError``,
``TimeoutError``, ``PermissionError``...); a full or empty queue arrives as ``QueueFull`` /
``QueueEmpty``, which subclass both the ``asyncio`` and the ``queue`` module's classes.
"""

from __future__ import annotations

import asyncio
import builtins
import queue
from typing import Any


class ChannelError(Exception):
    """Base of zchannel's own errors."""


class BrokerUnavailable(ChannelError, ConnectionError):
    """The broker is gone, did not answer, or expired this client."""


class ChannelNotFound(BrokerUnavailable):
    """Nothing serves that channel name or address."""


class BrokerStartError(ChannelError):
    """``Channel.create`` accepted its arguments but the broker could not start: the address is
    in use, the socket path is not writable, a hook failed in the broker process, or the
    broker exited or stayed silent.  ``reason`` names the broker's exception type (e.g.
    ``"ZMQError"``).  Arguments that are wrong in themselves are ``ValueError``/``TypeError``
    instead (``docs/errors.md``)."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.reason))


class QueueEmpty(asyncio.QueueEmpty, queue.Empty):
    """``get_nowait`` found nothing: both ``except asyncio.QueueEmpty`` (as in RLinf) and
    ``except queue.Empty`` (the standard library's form) catch it."""


class QueueFull(asyncio.QueueFull, queue.Full):
    """``put_nowait`` found a target queue full (nothing was enqueued): both ``except
    asyncio.QueueFull`` and ``except queue.Full`` catch it."""


class AuthenticationFailed(ChannelError, PermissionError):
    """The broker and this client do not agree on CURVE: the broker requires keys and the client
    has none, refused the client's key, does not use CURVE, or cannot read the client's hello
    (wrong server key).  Retrying does not help."""


class UnsafeRunDir(ChannelError, PermissionError):
    """The run directory (where brokers keep their sockets, locks and address files) is not
    this user's alone: another user owns it, or its mode lets others in, so they could
    replace a broker's socket and receive the next connection.  The message names the
    directory, its owner and mode, and the fix (``docs/security.md``)."""


class HookError(ChannelError):
    """A collector or dispatcher failed on a put.

    ``exc_type`` is the hook exception's class name, ``remote_traceback`` its traceback text.
    """

    def __init__(self, message: str, exc_type: str = "Exception", remote_traceback: str = ""):
        super().__init__(message)
        self.exc_type = exc_type
        """The class name of the hook's exception (``"TypeError"`` for a bad yield)."""
        self.remote_traceback = remote_traceback
        """The hook's traceback, as text from the broker process."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.exc_type, self.remote_traceback))


class JournalError(ChannelError):
    """A durable channel's journal could not record a put or an ack (its disk is full, its
    directory cannot be written, the journal is in use by another broker): that put or ack
    changed nothing.  Also the error of a broker that cannot start on its journal
    (``docs/durability.md``)."""


class KeyMoved(ChannelError):
    """The replica asked no longer holds the key: it moved (while empty) to replica ``replica``
    of a distributed channel that moves keys (``steal = true``, ``docs/distributed.md``).
    Nothing happened; a distributed handle follows it by itself."""

    def __init__(self, message: str, replica: int = -1):
        super().__init__(message)
        self.replica = replica

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.replica))


class UndecodableItems(ValueError):
    """Some items of one ``get_batch`` reply could not be decoded (an unregistered tag, an item
    nested past the depth limit): they are consumed, as a plain ``get``'s undecodable item is,
    and the others are not lost: ``items`` holds them, decoded, in their order in the batch;
    ``errors`` pairs each failed position in the batch with its ``ValueError``."""

    def __init__(self, message: str, items: list[Any] | None = None,
                 errors: list[tuple[int, ValueError]] | None = None):
        super().__init__(message)
        self.items = [] if items is None else items
        """The items of the batch that decoded, in batch order."""
        self.errors = [] if errors is None else errors
        """``(position in the batch, ValueError)`` of each item that did not decode."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.items, self.errors))


_BY_NAME: dict[str, type[BaseException]] = {
    "ChannelError": ChannelError,
    "BrokerUnavailable": BrokerUnavailable,
    "ChannelNotFound": ChannelNotFound,
    "AuthenticationFailed": AuthenticationFailed,
    "UnsafeRunDir": UnsafeRunDir,
    "HookError": HookError,
    "JournalError": JournalError,
    "BrokerStartError": BrokerStartError,
    "QueueFull": QueueFull,
    "QueueEmpty": QueueEmpty,
}
for _name in (
    "ValueError TypeError TimeoutError PermissionError KeyError RuntimeError "
    "MemoryError OverflowError NotImplementedError"
).split():
    _BY_NAME[_name] = getattr(builtins, _name)


def error_to_wire(exc: BaseException) -> list[Any]:
    """``[type name, message, extra]`` for an error reply."""
    name = type(exc).__name__
    if isinstance(exc, HookError):
        return ["HookError", str(exc), [exc.exc_type, exc.remote_traceback]]
    if isinstance(exc, KeyMoved):
        return ["KeyMoved", str(exc), exc.replica]
    if name not in _BY_NAME:
        return ["ChannelError", f"{name}: {exc}", None]
    return [name, str(exc) if not isinstance(exc, KeyError) else exc.args[0] if exc.args else "", None]


def error_from_wire(value: object) -> BaseException:
    """Rebuild an exception from an error reply (unknown or malformed → ``ChannelError``)."""
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)):
        return ChannelError(f"malformed error reply: {value!r}")
    name, message, extra = value
    message = str(message)
    if name == "HookError":
        exc_type, tb = extra if isinstance(extra, list) and len(extra) == 2 else ("Exception", "")
        return HookError(message, str(exc_type), str(tb))
    if name == "KeyMoved":
        replica = extra if isinstance(extra, int) and not isinstance(extra, bool) else -1
        return KeyMoved(message, replica)
    cls = _BY_NAME.get(name, ChannelError)
    return cls(message)
