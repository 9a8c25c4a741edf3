"""zchannel.broker: the channel broker, its client library and the wire codec.

``Channel`` is the handle workers use; ``Work`` the handle of an asynchronous operation;
``Delivery`` an item received with ``ack=True``.  See ``docs/`` for the protocol and guarantees.
"""

from zchannel.broker.channel import Channel
from zchannel.broker.client import DEFAULT_KEY
from zchannel.broker.errors import (
    AuthenticationFailed,
    BrokerStartError,
    BrokerUnavailable,
    ChannelError,
    ChannelNotFound,
    HookError,
    KeyMoved,
    QueueEmpty,
    QueueFull,
)
from zchannel.broker.registry import register_type, serializable
from zchannel.broker.work import Delivery, Work

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
    "KeyMoved",
    "QueueEmpty",
    "QueueFull",
    "Work",
    "register_type",
    "serializable",
]
