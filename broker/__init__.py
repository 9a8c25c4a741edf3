"""zchannel.broker: the channel broker, its client library and the wire codec.

``Channel`` is the handle workers use; ``Work`` the handle of an asynchronous operation;
``Delivery`` an item received with ``ack=True``.  See ``docs/`` for the protocol and guarantees.
``__version__`` is the installed distribution's version (one place: ``setup.cfg``).
"""

import importlib.metadata

from zchannel.broker.connection.work import Delivery, Work
from zchannel.broker.errors import (
    AuthenticationFailed,
    BrokerStartError,
    BrokerUnavailable,
    ChannelError,
    ChannelNotFound,
    HookError,
    JournalError,
    KeyMoved,
    QueueEmpty,
    QueueFull,
    UndecodableItems,
    UnsafeRunDir,
)
from zchannel.broker.handle.broker_channel import DEFAULT_KEY
from zchannel.broker.handle.channel import Channel
from zchannel.broker.host import logs
from zchannel.broker.wire.classtags import register_module, register_type, serializable
from zchannel.broker.wire.protocol import ProtocolError

__version__ = importlib.metadata.version("zchannel")
logs.install()  # zchannel's warnings name their process where the application logs nothing

__all__ = [
    "DEFAULT_KEY",
    "AuthenticationFailed",
    "BrokerStartError",
    "BrokerUnavailable",
    "Channel",
    "ChannelError",
    "ChannelNotFound",
    "Delivery",
    "HookError",
    "JournalError",
    "KeyMoved",
    "ProtocolError",
    "QueueEmpty",
    "QueueFull",
    "UndecodableItems",
    "UnsafeRunDir",
    "Work",
    "register_module",
    "register_type",
    "serializable",
]
