"""A durable channel's broker: its journal opened from the configuration and read back into the
queue core before the broker takes any request (``broker/journal/``, ``docs/durability.md``)."""

from __future__ import annotations

import logging
from typing import Any

from zchannel.broker.core.hookpipeline import hook_name
from zchannel.broker.core.queuecore import QueueCore
from zchannel.broker.core.state import Item
from zchannel.broker.core.statelog import Output
from zchannel.broker.errors import HookError, JournalError
from zchannel.broker.journal.collectors import collector_identity
from zchannel.broker.journal.journal import Journal, JournalSettings
from zchannel.broker.server.config import BrokerConfig
from zchannel.broker.server.sessions import Sessions

log = logging.getLogger("zchannel.broker")


def open_journal(config: BrokerConfig, name: str, core: QueueCore, sessions: Sessions) -> Journal:
    """Open the journal ``name`` (the channel's, or ``NAME.replicaI`` for a replica) in
    ``config.journal``, put the items it holds back into ``core``'s queues (in each key's put
    order, in the shared queue: any consumer takes them; an item that was out on a lease comes
    again), and let it record every change from here on.  A journal that holds puts another
    collector (or the same with other options) was holding is refused (``JournalError``:
    ``journal/collectors.py``), and so is one whose state the collector refuses
    (``_restore``) or whose puts it fails on when they go through it again (``_replay``)."""
    if config.journal is None:
        raise ValueError(f"channel {config.name!r} has no journal directory")
    journal = Journal(JournalSettings(
        directory=config.journal, name=name, fsync=config.fsync,
        fsync_interval=config.fsync_interval, max_bytes=config.max_journal_bytes,
        segment_bytes=config.journal_segment_bytes,
        collector=collector_identity(hook_name(core.hooks.collector), config.options)))
    try:
        for key, items in journal.recover():
            core.requeue(None, (key, None), items, None)
        _restore(journal, core)
        _replay(journal, core)
    except BaseException:
        journal.close()
        raise
    sessions.producers.restore(journal.sequences.windows)  # retry-safe puts go on
    core.attach_log(journal)
    journal.on_room = core.waiters.admit_putters
    journal.waiting_outputs = lambda: [req.outputs for req in core.waiters.putters]
    sessions.journal = journal
    return journal


def _restore(journal: Journal, core: QueueCore) -> None:
    """Give the collector back the state the journal holds (``Collector.load_state_dict``);
    ``JournalError`` if it cannot take it (the broker does not start: the puts that state
    replaced would be lost)."""
    state = journal.collector_state.recovered
    if state is None:
        return
    journal.collector_state.recovered = None
    try:
        core.hooks.restore_state(state)
    except HookError as exc:
        raise JournalError(
            f"the journal of channel {journal.settings.name!r} in {journal.dir.path!r} holds "
            f"the state of collector {hook_name(core.hooks.collector)!r} "
            f"(Collector.state_dict), which its load_state_dict refused: {exc}.  Start the "
            "broker with a collector that takes it, or remove this channel's journal (the "
            f"files {journal.dir.path}/{journal.settings.name}.*.zcj; every item it holds is "
            "lost with them)") from None


def _replay(journal: Journal, core: QueueCore) -> None:
    """Rebuild the state of a collector that keeps state between puts: the puts it took since
    it last held nothing go through it again, in their order.  What they yield is dropped (it
    was stored already, and recovered with the items), but for a put whose outputs were not
    stored when the broker died (they waited for room): those are stored now, and its retry is
    then known as stored.  A put the collector (or the dispatcher, routing those outputs)
    fails on stops the start (``JournalError``, ``_replay_failed``): the collector took each of
    these puts when it came, and without it the state they rebuild would be lost."""
    stored = 0
    for key, item, unstored in journal.replay:
        routed = _collect_again(journal, core, key, item, unstored)
        if routed:
            journal.stored(routed)
            core.queues.store(routed)
            stored += len(routed)
    if journal.replay or journal.collector_state:
        log.info("journal of %r: %d puts replayed through the collector (%d items stored that "
                 "had waited for room)", journal.settings.name, len(journal.replay), stored)
        journal.replayed(core.hooks.holds_state())
    journal.replay = []


def _collect_again(journal: Journal, core: QueueCore, key: Any, item: Item,
                   unstored: bool) -> list[Output]:
    """The outputs of a replayed put to store now, each routed (``HookPipeline.routed``, with
    the put's origin): those of a put whose outputs were ``unstored``; none for another (they
    were stored when it came).  ``JournalError`` if ``collect`` or ``route`` raises."""
    hooks = core.hooks
    try:
        outputs = hooks.collect(item, key, item.weight)
    except Exception as exc:
        raise _replay_failed(journal, core, f"its collect failed on the put of key {key!r}",
                             exc) from None
    if not (unstored and outputs):
        return []
    try:
        return hooks.routed(outputs, item.origin)
    except Exception as exc:
        raise _replay_failed(journal, core, f"the route of dispatcher "
                             f"{hook_name(hooks.dispatcher)!r} failed on an output of the put "
                             f"of key {key!r}", exc) from None


def _replay_failed(journal: Journal, core: QueueCore, failure: str,
                   exc: Exception) -> JournalError:
    """The error of a start whose replay of the collector's puts met a ``failure`` (what
    failed, on which put), the hook raising ``exc``.  Nothing was dropped from the journal: a
    broker with hooks that take the puts again recovers them."""
    cause = str(exc) if isinstance(exc, HookError) else f"{type(exc).__name__}: {exc}"
    return JournalError(
        f"the journal of channel {journal.settings.name!r} in {journal.dir.path!r} holds "
        f"acknowledged puts ({len(journal.replay)}) that collector "
        f"{hook_name(core.hooks.collector)!r} took while it kept state "
        f"(Collector.holds_state), to replay through it at a start; {failure}: {cause}.  The "
        "broker does not start, and the journal keeps every put: start it with hooks that "
        "take these puts again (the version that took them), or remove this channel's "
        f"journal (the files {journal.dir.path}/{journal.settings.name}.*.zcj; every item it "
        "holds is lost with them)")
