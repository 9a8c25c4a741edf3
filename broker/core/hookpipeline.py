"""The hook pipeline of one channel: the ``Collector`` that turns a put into (key, item)
outputs and the ``Dispatcher`` that deals items to consumers and names steal donors.

Items stay in the form their transport gave them; ``decode_item`` and ``encode_item`` (given by
the broker or the local channel) turn them into values only when a hook needs to see one.  A
hook that raises is its caller's ``HookError``: a collector's or ``route``'s the putter's,
``observe``'s the get of the consumer that joined (it has not joined then), ``rebalance``'s
the starved get's; ``forget`` and ``key_dropped``, which no request calls, and a durable
channel's ``holds_state`` and ``state_dict``, fail nothing but are, like every hook failure,
counted and logged (``HookPipeline._failed``).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from zchannel.broker.core.consumers import Consumers
from zchannel.broker.core.state import Client, Item
from zchannel.broker.core.statelog import Output, StateLog
from zchannel.broker.errors import HookError
from zchannel.broker.wire.argchecks import check_key, check_weight
from zchannel.hooks import ChannelContext, Collector, Dispatcher
from zchannel.hooks.registry import hook_failure

log = logging.getLogger("zchannel.broker")

# what a hook may raise: anything, also ``sys.exit()``, a ``KeyboardInterrupt`` it raises
# itself (a broker takes SIGINT with a handler, never as an exception), ``asyncio``'s
# ``CancelledError`` and its own ``BaseException`` subclasses, is the hook's failure
HOOK_FAILURES = (BaseException,)
FAILURE_LOG_S = 10.0  # a hook failing again and again logs a line this often, with the count


class HookPipeline:
    """A channel's collector and dispatcher, their ``ChannelContext``, and the item codec."""

    def __init__(self, *, name: str, maxsize: int, collector: Collector, dispatcher: Dispatcher,
                 producers: tuple[str, ...], options: dict | None, roster: Consumers,
                 decode_item: Callable[[Item], Any],
                 encode_item: Callable[[Any, int | float], Item], max_bytes: int = 0,
                 slots_viewed: Callable[[Item], bool] | None = None) -> None:
        self.collector = collector
        self.max_bytes = max_bytes  # the outputs of one put beyond it are refused as made
        # the hooks' failures, for the operator (``stats()``; logged at most every FAILURE_LOG_S)
        self.failures = 0
        self.last_failure: str | None = None
        self._next_log = 0.0
        self.dispatcher = dispatcher
        self.roster = roster
        self.decode_item = decode_item
        self.encode_item = encode_item
        self.slots_viewed = slots_viewed
        # the default collector passes each put through unchanged: no call, no decoding
        self.passthrough = type(collector).collect is Collector.collect
        # a collector that says when it keeps state between puts (Collector.holds_state): a
        # durable channel's journal (``log``) keeps the puts it may still need
        self.stateful = type(collector).holds_state is not Collector.holds_state
        # ... and can write that state down (Collector.state_dict): the journal then keeps the
        # puts since its last snapshot, not all those since the collector last held nothing
        self.snapshots = self.stateful and type(collector).state_dict is not Collector.state_dict
        self.log: StateLog | None = None
        self.deals = dispatcher.deals
        self.ctx = ChannelContext(
            name=name,
            maxsize=maxsize,
            producers=tuple(producers),
            consumers=roster.present(),
            options=dict(options or {}),
        )
        _setup(collector, "collector", self.ctx)
        _setup(dispatcher, "dispatcher", self.ctx)

    def value(self, item: Item) -> Any:
        """The decoded value of ``item`` (decoded once, kept on the item)."""
        if not item.decoded:
            item.value = self.decode_item(item)
            item.decoded = True
        return item.value

    def collect(self, item: Item, key: Any, weight: int | float) -> list[tuple[Any, Item]]:
        """The (key, item) pairs a put of ``item`` under ``key`` stores.  An output that is the
        put's value unchanged keeps the put's frames and slots, unless something the collector
        left behind (its state, another output) still views those slots: a consumer's
        ``copy=False`` view of a slot is writable and private, so that output is encoded again,
        as frames, like the others."""
        if self.passthrough:
            return [(key, item)]
        outputs, reused_at = self._run_collector(item, key, weight)
        if reused_at is not None and self.slots_viewed is not None:
            item.value, item.decoded = None, False  # the pipeline's own views go with it
            if self.slots_viewed(item):
                outputs[reused_at] = (outputs[reused_at][0],
                                      self.encode_item(self.value(item), weight))
        if self.log is not None and self.stateful:
            snapshot = self.state_item if self.snapshots and not outputs else None
            self.log.collected(item, key, self.holds_state(), len(outputs), snapshot)
        return outputs

    def _run_collector(self, item: Item, key: Any, weight: int | float
                       ) -> tuple[list[tuple[Any, Item]], int | None]:
        """``Collector.collect``'s outputs for ``item``, and the index of the one that reuses
        ``item`` itself (None if none does)."""
        value = self.value(item)  # a decode error is the putter's ValueError, not a HookError
        outputs: list[tuple[Any, Item]] = []
        reused_at = None
        made = 0  # their bytes, checked as they come: a fan-out past max_bytes stops there
        try:
            for out in collected(self.collector.collect(value, key)):
                if not isinstance(out, tuple) or len(out) not in (2, 3):
                    raise TypeError(
                        "Collector.collect must yield (key, item) or (key, item, weight) tuples, "
                        f"got {type(out).__name__}"
                    )
                out_key = check_key(out[0])
                out_weight = check_weight(out[2]) if len(out) == 3 else weight
                if out[1] is value and out_weight == weight and reused_at is None:
                    reused_at = len(outputs)  # once: each output is an item of its own (jid)
                    outputs.append((out_key, item))  # its frames, as received
                else:
                    outputs.append((out_key, self.encode_item(out[1], out_weight)))
                made += outputs[-1][1].nbytes
                if self.max_bytes and made > self.max_bytes:
                    raise ValueError(f"the collector's outputs of one put take more than the "
                                     f"broker's max_bytes limit ({self.max_bytes})")
        except HOOK_FAILURES as exc:
            raise self._failed(exc, "collector.collect") from None
        return outputs, reused_at

    def state_item(self) -> Item | None:
        """``Collector.state_dict`` encoded as an item; None if it failed, or returned what
        cannot travel (the puts it took are kept instead), counted and logged as every hook
        failure (``_failed``)."""
        try:
            item = self.encode_item(self.collector.state_dict(), 1)
        except HOOK_FAILURES as exc:
            self._failed(exc, "collector.state_dict")
            return None
        item.value, item.decoded = None, False  # the journal keeps the frames, not the value
        return item

    def restore_state(self, item: Item) -> None:
        """``Collector.load_state_dict`` of a state ``state_item`` encoded; ``HookError`` if
        it could not be decoded or the collector refused it."""
        try:
            self.collector.load_state_dict(self.decode_item(item))
        except HOOK_FAILURES as exc:
            raise self._failed(exc, "collector.load_state_dict") from None

    def holds_state(self) -> bool:
        """``Collector.holds_state``; a failure counts as holding state (the journal keeps
        the puts), and is counted and logged as every hook failure (``_failed``)."""
        try:
            return bool(self.collector.holds_state())
        except HOOK_FAILURES as exc:
            self._failed(exc, "collector.holds_state")
            return True

    def routed(self, outputs: list[tuple[Any, Item]], origin: Any) -> list[Output]:
        """``outputs`` of a put (``collect``'s), each with the consumer its dispatcher routes
        it to; the last carries the put's ``origin`` (its retry-safe sequence, recorded with
        it when stored)."""
        routed = [(k, self.route(it, k), it) for k, it in outputs]
        if origin is not None and routed:
            routed[-1][2].origin = origin
        return routed

    def route(self, item: Item, key: Any, departed: str | None = None) -> str | None:
        """The consumer whose private queue ``item`` goes to (None: the shared queue).  When
        ``item`` is dealt again because its consumer ``departed``, that id is accepted too: the
        item waits in its private queue for it to come back."""
        if not self.deals:
            return None
        value = self.value(item) if self.dispatcher.needs_item else None
        try:
            target = self.dispatcher.route(value, key)
        except HOOK_FAILURES as exc:
            raise self._failed(exc, "dispatcher.route") from None
        if target is None:
            return None
        if not isinstance(target, str):
            raise self._failed(HookError(
                f"Dispatcher.route returned {type(target).__name__}, expected a consumer id or None",
                "TypeError",
            ), "dispatcher.route")
        if target != departed and not self.roster.known(target):
            log.warning("route returned unknown consumer %r: the item goes to the shared queue", target)
            return None
        return target

    def route_again(self, item: Item, key: Any, departed: str) -> str | None:
        """``route`` for ``item`` of ``key`` dealt again because its consumer ``departed``;
        a failing dispatcher is logged and the item goes to the shared queue (None): nobody
        waits for an answer."""
        try:
            return self.route(item, key, departed)
        except HookError as exc:
            log.warning("re-dealing an item of %r failed (%s): it goes to the shared queue", key, exc)
            return None

    def notify(self, fn: Callable, *args: Any) -> None:
        """Call a dispatcher notification with no caller to answer (``forget``,
        ``key_dropped``); a failure is counted and logged as any hook's (``_failed``), never
        raised."""
        try:
            fn(*args)
        except HOOK_FAILURES as exc:
            self._failed(exc, f"dispatcher.{getattr(fn, '__name__', fn)}")

    def consumer_joined(self, client: Client, consumer: str) -> None:
        """``observe`` the consumer ``client`` made present; ``HookError`` if it raises (the
        client then leaves again: its next get tries again)."""
        self.ctx.consumers = self.roster.present()
        try:
            self.dispatcher.observe(consumer)
        except HOOK_FAILURES as exc:
            self.roster.leave(client)
            self.ctx.consumers = self.roster.present()
            raise self._failed(exc, "dispatcher.observe") from None

    def rebalance(self, key: Any, starved: str, depths: dict[str, int]) -> str | None:
        """The dispatcher's donor for ``starved`` (None: none); ``HookError`` if it raises or
        names anything but None or a consumer of the channel (one of ``depths``, or declared)
        other than ``starved``."""
        try:
            donor = self.dispatcher.rebalance(key, starved, depths)
        except HOOK_FAILURES as exc:
            raise self._failed(exc, "dispatcher.rebalance") from None
        if donor is None:
            return None
        if not isinstance(donor, str):
            raise self._failed(HookError(
                f"Dispatcher.rebalance returned {type(donor).__name__}, expected a consumer id "
                "or None", "TypeError"), "dispatcher.rebalance")
        if donor == starved or (donor not in depths and not self.roster.known(donor)):
            why = ("the starved consumer itself" if donor == starved
                   else "not a consumer of this channel")
            raise self._failed(HookError(
                f"Dispatcher.rebalance returned {_short(donor)}, {why}: expected one of the "
                f"consumers of depths other than {_short(starved)}, or None (no donor)",
                "ValueError"), "dispatcher.rebalance")
        return donor

    def _failed(self, exc: BaseException, where: str) -> HookError:
        """``exc``, raised by the hook method ``where`` (``"collector.collect"``), as the
        ``HookError`` its request gets; counted and kept for the operator (``stats()``'s
        ``hook_failures``, ``last_hook_failure``) and logged, at most once per
        ``FAILURE_LOG_S`` (with the count so far)."""
        error = hook_error(exc)
        self.failures += 1
        self.last_failure = f"{where}: {error}"
        now = time.monotonic()
        if now >= self._next_log:
            log.warning("hook %s failed (%d failure(s) so far): %s", where, self.failures, error)
            self._next_log = now + FAILURE_LOG_S
        return error

    def consumer_left(self, consumer: str) -> None:
        self.ctx.consumers = self.roster.present()
        self.notify(self.dispatcher.forget, consumer)

    def stats(self) -> dict[str, Any]:
        return {
            "collector": hook_name(self.collector),
            "dispatcher": hook_name(self.dispatcher),
            "collector_stats": _safe_stats(self.collector, self.encode_item),
            "dispatcher_stats": _safe_stats(self.dispatcher, self.encode_item),
            "hook_failures": self.failures,
            "last_hook_failure": self.last_failure,
        }


def _setup(hook: Any, kind: str, ctx: ChannelContext) -> None:
    """``hook.setup(ctx)``; whatever it raises (``sys.exit`` too) as a ``ValueError`` (a
    ``TypeError`` stays one) naming the hook and the exception's type and message, its
    ``__cause__`` the exception (``create`` and ``zchannel broker`` report it)."""
    try:
        hook.setup(ctx)
    except (Exception, SystemExit) as exc:
        raise hook_failure(kind, hook_name(hook), "failed in setup", exc) from exc


def collected(produced: Any) -> Iterator[Any]:
    """The outputs of what ``Collector.collect`` returned: a generator's, or any iterable's but
    a tuple's (None: none).  A ``TypeError`` for a non-empty tuple: ``return key, item`` written
    for ``yield key, item`` would otherwise store the key and the item as outputs of their own
    (a tuple key and a pair item make two well-formed outputs), or fail on the first of them."""
    if produced is None:
        return iter(())
    if isinstance(produced, tuple) and produced:
        raise TypeError(
            "Collector.collect must yield (key, item[, weight]) tuples or return an iterable of "
            f"them; it returned a tuple of {len(produced)} (`return key, item` where "
            "`yield key, item` was meant?)"
        )
    try:
        return iter(produced)
    except TypeError:
        raise TypeError("Collector.collect must yield (key, item[, weight]) tuples or return an "
                        f"iterable of them; it returned {type(produced).__name__}") from None


def _short(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut after ``limit`` characters (a hook may return any string)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}..."


def hook_error(exc: BaseException) -> HookError:
    """``exc`` raised by a hook, as the ``HookError`` its putter gets (with the traceback)."""
    if isinstance(exc, HookError):
        return exc
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return HookError(f"{type(exc).__name__}: {exc}", type(exc).__name__, tb)


def registered_name(cls: type) -> str | None:
    """The name hook class ``cls`` itself was registered under (its own ``hook_name``), or
    None: a subclass inherits the attribute but is another hook."""
    name = vars(cls).get("hook_name")
    return name if isinstance(name, str) else None


def hook_name(hook: Any) -> str:
    """The name of ``hook`` as ``stats()`` shows it: its class's registered name
    (``registered_name``), else ``module:qualname``."""
    return registered_name(type(hook)) or f"{type(hook).__module__}:{type(hook).__qualname__}"


def _safe_stats(hook: Any, encode_item: Callable[[Any, int | float], Item]) -> dict:
    """``hook.stats()`` as a dict that travels (``encode_item`` takes it as a stats reply
    must); what it raised or returned otherwise as ``{"error": ...}``, naming the hook, and
    logged: one hook's figures never break ``stats()`` and ``zchannel stat``."""
    try:
        figures = dict(hook.stats())
        encode_item(figures, 0)
        return figures
    except HOOK_FAILURES as exc:
        name = type(hook).__name__
        log.exception("%s.stats() failed or returned what cannot travel", name)
        return {"error": f"{name}.stats(): {type(exc).__name__}: {exc}"}
