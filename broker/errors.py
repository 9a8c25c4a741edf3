"""The project's error types and their transport across the wire.

Standard errors keep their standard types across the wire (``ValueError``, ``TypeError``,
``TimeoutError``, ``asyncio.QueueFull``, ``asyncio.QueueEmpty``, ``PermissionError``...).
"""

from __future__ import annotations

import asyncio
import builtins


class ChannelError(Exception):
    """Base of zchannel's own errors."""


class BrokerUnavailable(ChannelError, ConnectionError):
    """The broker is gone, did not answer, or expired this client."""


class ChannelNotFound(BrokerUnavailable):
    """Nothing serves that channel name or address."""


class HookError(ChannelError):
    """A collector or dispatcher failed on a put.

    ``exc_type`` is the hook exception's class name, ``remote_traceback`` its traceback text.
    """

    def __init__(self, message: str, exc_type: str = "Exception", remote_traceback: str = ""):
        super().__init__(message)
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return (type(self), (str(self), self.exc_type, self.remote_traceback))


_BY_NAME: dict[str, type[BaseException]] = {
    "ChannelError": ChannelError,
    "BrokerUnavailable": BrokerUnavailable,
    "ChannelNotFound": ChannelNotFound,
    "HookError": HookError,
    "QueueFull": asyncio.QueueFull,
    "QueueEmpty": asyncio.QueueEmpty,
}
for _name in (
    "ValueError TypeError TimeoutError PermissionError KeyError RuntimeError "
    "MemoryError OverflowError NotImplementedError"
).split():
    _BY_NAME[_name] = getattr(builtins, _name)


def error_to_wire(exc: BaseException) -> list:
    """``[type name, message, extra]`` for an error reply."""
    name = type(exc).__name__
    if isinstance(exc, HookError):
        return ["HookError", str(exc), [exc.exc_type, exc.remote_traceback]]
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
    cls = _BY_NAME.get(name, ChannelError)
    return cls(message)
