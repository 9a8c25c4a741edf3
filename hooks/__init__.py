"""zchannel.hooks: the Collector -> Dispatcher pipeline that runs inside a channel's broker.

This package imports nothing else of zchannel.
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
    hook_spec,
    import_path,
    load_entry_points,
    register_collector,
    register_dispatcher,
    registered,
    resolve_collector,
    resolve_dispatcher,
)

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
    "hook_spec",
    "import_path",
    "load_entry_points",
    "register_collector",
    "register_dispatcher",
    "registered",
    "resolve_collector",
    "resolve_dispatcher",
]
