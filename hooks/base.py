"""Base classes of the two broker hooks and the context they are set up with.

A put runs, inside the broker and serially, ``Collector.collect(item, key)`` and then
``Dispatcher.route(out_item, out_key)`` for every output.  Hook state therefore needs no locks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

GROUP_RE = re.compile(r"[A-Za-z0-9._-]+")  # a group name: the part of an id before the colon
CONSUMER_ID_RE = re.compile(GROUP_RE.pattern + r":[0-9]+")  # whole id (fullmatch), ASCII digits
MAX_CONSUMER_ID = 256  # characters of a consumer id at most


def consumer_sort_key(consumer_id: str) -> tuple[str, int, str]:
    """Sort key of a consumer id ``"group:rank"``: by group, then by integer rank (then by the
    id itself, so that ``"a:1"`` and ``"a:01"`` are two places in a rotation, not one)."""
    group, _, rank = consumer_id.rpartition(":")
    return (group, int(rank), consumer_id)


def check_consumer_id(consumer_id: object) -> str:
    """Return ``consumer_id`` if it matches ``group:rank``, else raise ``ValueError``."""
    if (not isinstance(consumer_id, str) or len(consumer_id) > MAX_CONSUMER_ID
            or not CONSUMER_ID_RE.fullmatch(consumer_id)):
        shown = repr(consumer_id)
        raise ValueError(
            f"invalid consumer id {shown[:80] + '...' if len(shown) > 80 else shown}: expected "
            f"'group:rank' (group of [A-Za-z0-9._-], integer rank; at most {MAX_CONSUMER_ID} "
            "characters), e.g. 'actor:0'"
        )
    return consumer_id


def check_groups(groups: object) -> list[str]:
    """Return ``groups`` (``producers=``: an iterable of group names, not a str) as a list if
    every name matches ``GROUP_RE`` (what a consumer id's group holds), else raise
    ``TypeError`` / ``ValueError`` naming the first bad name."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
        raise TypeError(f"producers= takes a list of group names, not {type(groups).__name__}")
    names = list(groups)
    for name in names:
        if (not isinstance(name, str) or len(name) >= MAX_CONSUMER_ID
                or not GROUP_RE.fullmatch(name)):
            shown = repr(name)
            raise ValueError(f"invalid group name {shown[:80]} in producers=: expected "
                             f"[A-Za-z0-9._-] characters (at most {MAX_CONSUMER_ID - 1}), "
                             "e.g. 'rollout'")
    return names


# the most consumer ids ``consumers=`` declares, over all its groups: each id declared takes
# memory in the broker (a few hundred bytes, with its private queue) before any consumer comes
MAX_CONSUMERS = 65536


def expand_consumers(consumers: Iterable[str] | Mapping[str, int] | None) -> tuple[str, ...]:
    """Expand ``consumers=`` (a list of ids or a mapping ``{"actor": 3}``) to sorted ids;
    ``ValueError`` for a count that is not an int >= 0, and for more than ``MAX_CONSUMERS``
    ids in all (naming the group that goes past it)."""
    if consumers is None:
        return ()
    if isinstance(consumers, Mapping):
        ids: list[str] = []
        for group, count in consumers.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"consumer count for group {group!r} must be an int >= 0")
            if len(ids) + count > MAX_CONSUMERS:
                raise ValueError(f"consumer count for group {group!r} must be an int >= 0 and "
                                 f"<= {MAX_CONSUMERS - len(ids)} (a channel declares "
                                 f"{MAX_CONSUMERS} consumers at most), got {count}")
            ids.extend(check_consumer_id(f"{group}:{rank}") for rank in range(count))
    elif isinstance(consumers, str):
        raise TypeError("consumers= takes a list of ids or a mapping {group: count}, not a str")
    else:
        ids = [check_consumer_id(c) for c in consumers]
        if len(set(ids)) > MAX_CONSUMERS:
            raise ValueError(f"{len(set(ids))} consumer ids declared: a channel declares "
                             f"{MAX_CONSUMERS} consumers at most")
    return tuple(sorted(set(ids), key=consumer_sort_key))


@dataclass
class ChannelContext:
    """What hooks know about their channel.

    ``consumers`` is kept current by the broker as consumers join and leave (sorted by
    ``(group, int(rank))``); ``options`` is the msgpack-able dict given at creation.
    """

    name: str
    """The channel's name."""
    maxsize: int = 0
    """Items per queue before a put waits (0: unbounded)."""
    producers: tuple[str, ...] = ()
    """Producer group names given at creation."""
    consumers: tuple[str, ...] = ()
    """Current and declared consumer ids, sorted by ``(group, int(rank))``."""
    options: dict[str, Any] = field(default_factory=dict)
    """The ``options=`` dict given at creation (msgpack-able)."""


class Collector:
    """Turns one put into zero or more ``(out_key, out_item)`` or ``(out_key, out_item, weight)``.

    The default collector passes the item through unchanged.  ``collect`` may be a generator,
    or return an iterable of the outputs other than a tuple (None: none).  Raising, returning a
    non-empty tuple (``return key, item`` for ``yield key, item``), or yielding anything but a
    2- or 3-tuple, fails the put with ``HookError`` and enqueues nothing of it.
    """

    def setup(self, ctx: ChannelContext) -> None:  # noqa: B027 - optional override
        """Called once in the broker before any traffic."""

    def collect(self, item: Any, key: Any) -> Iterable[tuple]:
        """Yield ``(out_key, out_item)`` or ``(out_key, out_item, weight)`` for one put; yield
        nothing to drop it.  An output without a weight weighs what the whole put weighed
        (every one of them: give each its own, ``yield key, part, 1``, to count parts)."""
        yield key, item

    def stats(self) -> dict[str, Any]:
        """Optional figures shown by ``zchannel stat`` (must be msgpack-able)."""
        return {}

    def holds_state(self) -> bool:
        """Whether the collector now keeps something of earlier puts that a later put may
        still need (a half waiting for its other half, an open trajectory).  A durable
        channel's journal keeps the puts since the last moment this was False and, when a
        broker starts on the journal, replays them through ``collect`` (dropping what they
        yield: those outputs were stored already) to rebuild the state.  A collector that
        keeps state must be deterministic for that (the same puts give the same state).
        Default: False, nothing is kept between puts."""
        return False

    def state_dict(self) -> Any:
        """Optional, with ``holds_state``: the state the collector keeps between puts, as a
        value the channel can carry (what a put may hold: msgpack types, tensors and arrays,
        registered types).  A durable channel's journal writes it now and then in place of
        the puts it took so far (a snapshot), so the puts it keeps stay few however long the
        collector holds something; a broker starting on the journal calls
        ``load_state_dict`` with it, then replays the puts that came after it.  The value
        must not change after it was returned (return copies of what ``collect`` changes in
        place).  Not overridden: no snapshot, every put since ``holds_state`` was last False
        is kept."""
        raise NotImplementedError(f"{type(self).__qualname__} keeps no state_dict")

    def load_state_dict(self, state: Any) -> None:
        """Take back a state ``state_dict`` returned (decoded as a get returns items), in a
        collector just set up; raising stops the broker's start (the state is not lost)."""
        raise NotImplementedError(f"{type(self).__qualname__} keeps no state_dict")


class Dispatcher:
    """Decides, per output item, whether it stays shared or is dealt to one consumer.

    ``route`` returns ``None`` (shared queue) or a consumer id (that consumer's private queue).
    A dispatcher that overrides ``route`` is *dealing* (``deals`` is True).
    """

    #: Whether ``route``/``rebalance`` look at the item.  When False the broker does not
    #: decode payloads for this dispatcher (the built-ins set it False).
    needs_item: bool = True

    def setup(self, ctx: ChannelContext) -> None:
        """Called once in the broker before any traffic; keeps ``ctx`` as ``self.ctx``."""
        self.ctx = ctx

    def route(self, item: Any, key: Any) -> str | None:
        """The consumer id whose private queue gets ``item``, or None for the key's shared queue.

        An id that is neither present nor declared sends the item to the shared queue (logged).
        """
        return None

    @property
    def deals(self) -> bool:
        """True iff ``route`` is overridden: consumers then need an identity."""
        return type(self).route is not Dispatcher.route

    def observe(self, consumer_id: str) -> None:  # noqa: B027 - optional override
        """A consumer joined (``ctx.consumers`` already includes it)."""

    def forget(self, consumer_id: str) -> None:  # noqa: B027 - optional override
        """A consumer left (``ctx.consumers`` no longer includes it)."""

    def rebalance(self, key: Any, starved: str, depths: dict[str, int]) -> str | None:
        """Name a donor whose oldest item the starved consumer takes, or ``None``: a consumer
        of the channel other than ``starved`` (one of ``depths``, or a declared one); any other
        id fails the starved get with a ``HookError``."""
        return None

    def key_dropped(self, key: Any) -> None:  # noqa: B027 - optional override
        """The broker dropped an idle key: per-key dealing state may be discarded."""

    def stats(self) -> dict[str, Any]:
        """Optional figures shown by ``zchannel stat`` (must be msgpack-able)."""
        return {}
