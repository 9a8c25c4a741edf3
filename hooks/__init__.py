"""zchannel.hooks: the Collector -> Dispatcher pipeline that runs inside a channel's broker.

This package imports nothing else of zchannel.  ``__all__`` is the documented API
(``docs/reference/hooks.md``); ``hook_spec``, ``import_path``, ``import_named``,
``load_entry_points`` and ``forget_entry_point_scan`` are the broker's plumbing, importable from
here but not part of it.
"""

from zchannel.hooks.base import (
    ChannelContext,
    Collector,
    Dispatcher,
    check_consumer_id,
    consumer_sort_key,
    expand_consumers,
)
from zchannel.hooks.builtin import (
    FlattenBatch,
    LeastLoadedDispatcher,
    LeastLoadedStealingDispatcher,
    RoundRobinDispatcher,
    SharedDispatcher,
)
from zchannel.hooks.registry import (
    entry_point_objects,
    register_collector,
    register_dispatcher,
    registered,
    resolve_collector,
    resolve_dispatcher,
)
from zchannel.hooks.registry import forget_entry_point_scan as forget_entry_point_scan
from zchannel.hooks.registry import hook_spec as hook_spec
from zchannel.hooks.registry import import_named as import_named
from zchannel.hooks.registry import import_path as import_path
from zchannel.hooks.registry import load_entry_points as load_entry_points

__all__ = [
    "ChannelContext",
    "Collector",
    "Dispatcher",
    "FlattenBatch",
    "LeastLoadedDispatcher",
    "LeastLoadedStealingDispatcher",
    "RoundRobinDispatcher",
    "SharedDispatcher",
    "check_consumer_id",
    "consumer_sort_key",
    "entry_point_objects",
    "expand_consumers",
    "register_collector",
    "register_dispatcher",
    "registered",
    "resolve_collector",
    "resolve_dispatcher",
]
