"""Which collector a journal's held inputs belong to: the ``collector`` table.

A collector that keeps state between puts (``Collector.holds_state``) has its inputs kept in
the journal (``INPUT`` records) until it holds nothing; a broker started on the journal replays
them through its collector.  Through another collector, or the same one with other options,
the replay would rebuild another state (or none) and drop what it yields: acknowledged puts
would be lost without a word.  So every segment starts with a ``TABLE`` record ``collector``
naming the collector its broker runs (``name``: its registered name, else
``module:qualname``, as ``stats()["collector"]`` shows it) and its ``options`` (the channel's
``options``, as canonical JSON), and a broker whose collector is not the one the table names
does not start while the journal holds inputs (``check_collector``).  With no held inputs any
collector may start.  A journal without the table (written before it existed) is replayed as
before.

A collector that can write its state down (``Collector.state_dict``) has it written now and then
(a ``STATE`` record) in place of the inputs taken up to then; ``CollectorState`` keeps the
last one and says when the next is due.  ``docs/durability.md`` (Hook state).
"""

from __future__ import annotations

import json
from typing import Any

from zchannel.broker.core.state import Item
from zchannel.broker.errors import JournalError
from zchannel.broker.journal.items import LiveSet
from zchannel.broker.journal.segments import SegmentFile
from zchannel.hooks import Collector

TABLE_NAME = "collector"
PASS_THROUGH = f"{Collector.__module__}:{Collector.__qualname__}"  # no collector configured
# a state is written once the inputs kept since the last one take this much, and at least twice
# that state's bytes: the inputs kept stay within about twice the state
SNAPSHOT_BYTES = 4 << 20


class CollectorState:
    """The last state of a collector written in a journal: ``record`` holds its ``STATE``
    record (one entry, whose key is the jid of the put the state follows), ``recovered`` the
    state read back at the start (for the broker to give to the collector), ``written`` how
    many were written, and ``due_at`` the bytes of kept inputs that make the next one due.
    ``pending`` holds the ``PENDING`` records of the outputs of puts that waited for room
    when a ``STATE`` or ``IDLE`` let go of their inputs, ``adopted`` their jids as the last
    of those records named them."""

    def __init__(self) -> None:
        self.record = LiveSet()
        self.recovered: Item | None = None
        self.written = 0
        self.due_at = SNAPSHOT_BYTES
        self.pending = LiveSet()
        self.adopted: list[int] = []

    def __bool__(self) -> bool:
        return bool(self.record)

    def upto(self) -> int | None:
        """The jid of the put the state follows (None: no state)."""
        return next((entry[2] for entry in self.record.entries.values()), None)

    def replace(self, jid: int, seg: SegmentFile, nbytes: int, upto: int, item: Item) -> None:
        """The state ``item`` after the put ``upto``, in the record ``jid`` of ``nbytes`` in
        ``seg``, replaces the one before."""
        self.drop()
        self.record.add(jid, seg, nbytes, upto, item)
        self.due_at = max(SNAPSHOT_BYTES, 2 * nbytes)

    def drop(self) -> None:
        """The collector holds nothing (or a newer state came): the state is not needed."""
        self.record.forget_all(list(self.record.entries))
        self.due_at = SNAPSHOT_BYTES


def collector_identity(name: str, options: dict[str, Any]) -> dict[str, str]:
    """What the ``collector`` table holds for a collector named ``name`` run with ``options``."""
    return {"name": name,
            "options": json.dumps(options, sort_keys=True, separators=(",", ":"), default=repr)}


def check_collector(recorded: dict[Any, Any] | None, current: dict[str, str] | None,
                    held: int, channel: str, directory: str) -> None:
    """``JournalError`` if the journal of ``channel`` holds ``held`` inputs of the collector
    ``recorded`` (its table as read back; None: the journal has none) and the broker runs
    another one, ``current`` (None: not known, nothing is checked)."""
    if not held or recorded is None or current is None:
        return
    if recorded.get("name") == current["name"] and recorded.get("options") == current["options"]:
        return
    was, now = _label(recorded), _label(current)
    if recorded.get("name") == current["name"]:
        was = f"{was} with options {recorded.get('options')}"
        now = f"{now} with options {current['options']}"
    raise JournalError(
        f"the journal of channel {channel!r} in {directory!r} holds {held} acknowledged "
        f"put(s) that collector {was} was holding (it keeps state between puts); this broker "
        f"runs collector {now}, which would not rebuild that state: they would be lost.  "
        f"Start the broker with collector {_label(recorded)} and the same options to let it "
        f"finish them, or remove this channel's journal (the files {directory}/{channel}.*.zcj; "
        "every item it holds is lost with them)")


def _label(identity: dict[Any, Any]) -> str:
    name = identity.get("name")
    return "none (the pass-through collector)" if name == PASS_THROUGH else repr(name)
