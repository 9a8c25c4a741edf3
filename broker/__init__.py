"""zchannel.broker: the channel broker, its client library and the wire codec.

``Channel`` is the handle workers use; ``Work`` the handle of an asynchronous operation;
``Delivery`` an item received with ``ack=True``.  See ``docs/`` for the protocol and guarantees.
"""

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
)
from zchannel.broker.handle.broker_channel import DEFAULT_KEY
from zchannel.broker.handle.channel import Channel
from zchannel.broker.wire.classtags import register_type, serializable

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
    "QueueEmpty",
    "QueueFull",
    "Work",
    "register_type",
    "serializable",
]
