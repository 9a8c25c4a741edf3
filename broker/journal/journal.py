"""``Journal``: the record of a durable channel's items, kept by its broker.

The queue core calls it where items enter and leave (``core/statelog.py``); the broker's loop
calls ``commit`` before it sends replies, ``sent`` after, and ``tick`` at ``due``.  What it
writes (``journal/format.py``):

- a ``PUT`` record for every stored item (each output of a collector), its frames raw, before
  the item enters its queue: the put is answered after the record was written (``interval``,
  ``never``) or synced (``always``);
- a ``REMOVE`` record for every item that left: for an ``ack``, before the ack is answered; for
  a plain ``get``, once its reply was handed to the socket (``sent``) — so an item whose reply
  had not left when the broker died is there again after a restart (at least once);
- a ``LEASE`` record for every delivery under a lease (counted as a redelivery when it comes
  back after a restart);
- for a collector that keeps state between puts, ``INPUT`` records of the puts it took since
  it last held nothing (``IDLE`` marks such a moment), or, for one that can write its state
  down, a ``STATE`` record now and then that replaces those taken up to then
  (``journal/collectors.py``);
- ``TABLE`` records for the tables kept beside the items (``_tables``), whole at the start of
  every segment, so that older segments are never needed for them: ``producers`` holds the put
  sequences of each producer whose puts were recorded (each ``PUT`` record carries its put's
  producer and sequence: ``journal/sequences.py``), which a broker started again on the
  journal knows as stored (retry-safe puts across a restart); ``collector`` names the
  collector the broker runs (``journal/collectors.py``), which a broker started again on
  inputs it holds must run too.

Segments are removed oldest first, once every item they hold has left; an old segment that
keeps a few items while the journal grows past twice what its items take has them copied to
the end (``_compact``, when ``journal/compaction.py`` says it frees space), so the disk used
stays within about twice the bytes the channel holds plus three segments
(``docs/durability.md``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from zchannel.broker.core.state import Item
from zchannel.broker.core.statelog import Output
from zchannel.broker.errors import JournalError
from zchannel.broker.journal import format as fmt
from zchannel.broker.journal.batch import PutBatch
from zchannel.broker.journal.collectors import TABLE_NAME as COLLECTOR_TABLE
from zchannel.broker.journal.collectors import CollectorState, check_collector
from zchannel.broker.journal.compaction import COMPACT_BYTES_PER_TICK, Compaction
from zchannel.broker.journal.items import LiveSet, item_parts, recovered_item
from zchannel.broker.journal.recovery import Recovered, read_journal
from zchannel.broker.journal.segments import JournalDir, SegmentFile
from zchannel.broker.journal.sequences import TABLE_NAME, StoredSequences, origin_of
from zchannel.broker.journal.store import SEGMENT_BYTES, SegmentStore
from zchannel.broker.journal.syncing import JournalFailed

log = logging.getLogger("zchannel.journal")

PUT_OVERHEAD = 64  # bytes a put record adds to its item, about (header, meta)


@dataclass
class JournalSettings:
    """Where and how a channel's journal is kept (``BrokerConfig.journal``, ``fsync``...)."""

    directory: str
    name: str
    fsync: str = "interval"
    fsync_interval: float = 0.01
    max_bytes: int = 0  # max_journal_bytes: puts wait while the journal would pass it (0: none)
    segment_bytes: int = SEGMENT_BYTES
    # the collector the broker runs (``collectors.collector_identity``; None: not known)
    collector: dict[str, str] | None = None


class Journal:
    """The journal of one channel (see the module docstring); a ``StateLog`` for its core."""

    def __init__(self, settings: JournalSettings) -> None:
        self.settings = settings
        segment_bytes = settings.segment_bytes
        if settings.max_bytes:  # a few segments fit in the limit
            segment_bytes = max(64 << 10, min(segment_bytes, settings.max_bytes // 8))
        self.dir = JournalDir(settings.directory, settings.name)
        try:
            self.store = SegmentStore(self.dir, policy=settings.fsync,
                                      interval=settings.fsync_interval,
                                      segment_bytes=segment_bytes, kind=fmt.default_kind())
        except BaseException:
            self.dir.close()
            raise
        self.live = LiveSet()  # the items still the channel's
        self.inputs = LiveSet()  # a stateful collector's puts since it last held nothing
        self.collector_state = CollectorState()  # its last state written (``STATE``)
        # an IDLE or STATE (or the last broker's records, at a start) let go of records and
        # may not be on disk: synced before the segments they freed are removed
        self._unsynced_release = False
        # the outputs of the puts waiting for room (set by the broker; what a state consumed)
        self.waiting_outputs: Callable[[], list[Sequence[Output]]] = list
        # the inputs read back, to replay: (key, input, whether its outputs were not stored)
        self.replay: list[tuple[Any, Item, bool]] = []
        self._idle_after: int | None = None  # the put that emptied the collector (its outputs due)
        self._next_jid = 1
        self._sending: set[int] = set()  # taken by plain gets whose replies were not sent yet
        self._unwritten: list[int] = []  # removals that found no room (written later)
        self._leases: list[int] = []
        self.on_room: Callable[[], None] | None = None  # puts may fit again (segments went)
        self.sequences = StoredSequences()  # the put sequences recorded, per producer
        self._tables: dict[str, Callable[[], dict]] = {TABLE_NAME: lambda: self.sequences.snapshot()}
        if settings.collector is not None:  # the collector its held inputs belong to
            self._tables[COLLECTOR_TABLE] = lambda: dict(settings.collector or {})
        self.recovered_items = 0
        self.redelivered = 0
        self.recovery_s = 0.0
        self.refused = 0  # puts and acks it could not record
        self.limited = bool(settings.max_bytes)  # StateLog: room() may say no
        self.store.tables = lambda: _table_records(self)
        self.store.reserve.live = self.live.entries
        self.batch = PutBatch(self.store, self.live, self.sequences)  # a turn's small puts
        self.compaction = Compaction()

    # -- start -------------------------------------------------------------------------------

    def recover(self) -> list[tuple[Any, list[Item]]]:
        """Read the journal (``journal/recovery.py``) and open a new segment to write in; the
        items still the channel's, grouped by key (whatever private queue held them), each
        group in put order."""
        return _recover(self)

    # -- StateLog ----------------------------------------------------------------------------

    def stored(self, outputs: Sequence[Output]) -> None:
        written: list[int] = []
        store, live, batch = self.store, self.live, self.batch
        # outputs written as PENDING records while their put waited keep those jids
        pending = bool(self.collector_state.pending) and _is_pending(self, outputs)
        last = self._next_jid + len(outputs) - 1 if len(outputs) > 1 else 0  # format.part_of
        if pending and last:
            last = outputs[-1][2].jid
        try:
            for key, consumer, item in outputs:
                jid = item.jid if pending else self._next_jid
                if not last and not pending and batch.take(jid, key, consumer, item):
                    self._next_jid = jid + 1  # in the turn's record
                    written.append(jid)
                    continue
                parts, nbytes = item_parts(store.crc, jid, key, consumer, item,
                                           part_of=last if jid < last else 0)
                seg = self._append(parts, nbytes, True)
                if pending:
                    self.collector_state.pending.forget(jid)
                else:
                    self._next_jid, item.jid = jid + 1, jid
                live.add(jid, seg, nbytes, key, item)
                written.append(jid)
                if item.origin is not None:
                    self.sequences.mark(item.origin)
                    item.origin = None  # recorded: the tables carry it from here on
            if self._idle_after is not None:
                self._idle(self._idle_after, outputs)
        except JournalError:
            self.refused += 1
            if pending:  # none of its outputs is stored: their PENDING records go too
                written = [item.jid for _, _, item in outputs]
                self.collector_state.pending.forget_all(written)
            if written:  # a put is all or nothing
                self._remove(written)
            raise

    def unstored(self, outputs: Sequence[Output]) -> None:
        """A put that waited for room ended without being stored (timed out, withdrawn):
        ``PENDING`` records of its outputs are removed (they would be stored at a restart)."""
        if self.collector_state.pending and _is_pending(self, outputs):
            jids = [item.jid for _, _, item in outputs]
            self.collector_state.pending.forget_all(jids)
            self._remove(jids)

    def stored_each(self, outputs: Sequence[Output]) -> int:
        n = 0
        if self._idle_after is None:
            jid = self._next_jid
            try:
                n = self.batch.take_run(jid, outputs)
            except JournalError:  # ``stored`` of the first answers it
                n = 0
            self._next_jid = jid + n
        for i in range(n, len(outputs)):
            try:
                self.stored(outputs[i : i + 1])
            except Exception:  # this put's error is the caller's to answer
                return i
        return len(outputs)

    def taken(self, items: Sequence[Item]) -> None:
        sending = self._sending
        for item in items:
            sending.add(item.jid)

    def leased(self, item: Item) -> None:
        self._leases.append(item.jid)

    def acked(self, item: Item) -> None:
        try:
            self._write_removal([item.jid])
        except JournalError:
            self.refused += 1
            raise
        self._forget([item.jid])

    def returned(self, items: Sequence[Item]) -> None:
        for item in items:
            self._sending.discard(item.jid)

    def collected(self, item: Item, key: Any, holds_state: bool, outputs: int,
                  snapshot: Callable[[], Item | None] | None = None) -> None:
        if not (holds_state or self.inputs or self.collector_state):
            return  # the collector holds nothing, before and after this put
        # kept, to replay, also when it empties the collector: until its outputs are stored
        jid = self._next_jid
        parts, nbytes = item_parts(self.store.crc, jid, key, None, item,
                                   _input_type(self.sequences, item, outputs))
        seg = self._append(parts, nbytes, True)
        self._next_jid = jid + 1
        self.inputs.add(jid, seg, nbytes, key, item)
        if item.origin is not None and not outputs:  # else its last output marks it, stored
            self.sequences.mark(item.origin)
        if holds_state:
            self._idle_after = None  # it holds something again: every input stays
            if snapshot is not None and self.inputs.nbytes >= self.collector_state.due_at:
                _write_state(self, jid, snapshot)
        elif outputs:
            self._idle_after = jid  # written by ``stored``, after the outputs
        else:
            self._idle(jid)

    def replayed(self, holds_state: bool) -> None:
        """The state and inputs read back went through the collector again: one that holds
        nothing after them (its replay stored what waited) needs none of them any more."""
        upto = max([*self.inputs.entries, self.collector_state.upto() or 0], default=0)
        if upto and not holds_state:
            self._idle(upto)

    def _idle(self, upto: int, storing: Sequence[Output] = ()) -> None:
        """The collector held nothing after the put ``upto``: the inputs are not needed (the
        outputs of the puts that wait for room, but ``storing``, are kept as ``PENDING``)."""
        self._idle_after = None
        try:
            body = fmt.pack([upto, _adopt_waiting(self, storing)])
        except JournalError as exc:  # the inputs stay, until the next moment it holds nothing
            log.warning("journal of %r: the outputs of puts waiting for room could not be "
                        "written (%s): the collector's inputs stay", self.settings.name, exc)
            return
        self._append([fmt.record(self.store.crc, fmt.IDLE, body)], fmt.HEADER.size + len(body))
        self.inputs.forget_all([j for j in self.inputs.entries if j <= upto])
        self.collector_state.drop()
        self._unsynced_release = True
        self._drop_dead()

    def room(self, nbytes: int) -> bool:
        limit = self.settings.max_bytes
        return not limit or self.store.room_for(nbytes + PUT_OVERHEAD + self.batch.nbytes, limit,
                                                current_stays=bool(self.batch))

    def too_large(self, nbytes: int) -> str | None:
        return _too_large(self, nbytes)

    # -- records -----------------------------------------------------------------------------

    def _append(self, parts: list[Any], nbytes: int, for_put: bool = False) -> SegmentFile:
        """Append a record after the turn's gathered puts (their record first: records keep
        the order of the changes); the segment it went to."""
        if self.batch:
            self.batch.flush()
        return self.store.append(parts, nbytes, for_put)

    def _write_removal(self, jids: list[int]) -> None:
        body = fmt.pack_plain(jids)
        self._append([fmt.record(self.store.crc, fmt.REMOVE, body)], fmt.HEADER.size + len(body))

    def _forget(self, jids: list[int]) -> None:
        """``jids`` left the channel and their removal is recorded: their segments may go."""
        self.live.forget_all(jids)
        self._drop_dead()

    def _drop_dead(self) -> None:
        """Remove the oldest segments that hold nothing needed (puts may fit again); first,
        sync what let go of records that are not removals (``_unsynced_release``)."""
        segments = self.store.segments
        if segments[0].live == 0 and len(segments) > 1:
            if self._unsynced_release:
                self.store.sync_now()
                self._unsynced_release = False
            if self.store.drop_dead_prefix() and self.on_room is not None:
                self.on_room()

    def _remove(self, jids: list[int]) -> None:
        """Record the removal of ``jids`` now, or as soon as there is room for it."""
        try:
            self._write_removal(jids)
        except JournalError as exc:
            if not self._unwritten:
                log.warning("journal of %r: no room to record removals (%s); they wait",
                            self.settings.name, exc)
            self._unwritten.extend(jids)
            return
        self._forget(jids)

    # -- the loop ----------------------------------------------------------------------------

    def commit(self) -> None:
        """Before the broker sends replies: what they confirm is written (``always``: synced).
        First, segments that hold nothing any more since a put began a new one go (puts
        waiting for room may fit: admitted here, not in the middle of another put)."""
        self._drop_dead()
        if self.batch:
            self.batch.flush()
        if self._leases:
            leases, self._leases = self._leases, []
            body = fmt.pack_plain(leases)
            # (it only counts redeliveries: left out where it would take room kept for others)
            if not self.store.append_spare([fmt.record(self.store.crc, fmt.LEASE, body)],
                                           fmt.HEADER.size + len(body)):
                log.debug("lease record left out: no spare room in the journal")
        self.store.commit()

    def sent(self) -> None:
        """The broker handed its replies to the sockets: record the removals of the items that
        plain gets took."""
        if self._sending:
            jids = list(self._sending)
            self._sending.clear()
            if self._unwritten:
                jids, self._unwritten = self._unwritten + jids, []
            self._remove(jids)

    def due(self) -> float | None:
        return self.store.due()  # when ``tick`` has work (the interval's deadline), or None

    def tick(self, now: float) -> None:
        """Write and sync what the interval says, retry removals that found no room, and
        compact; ``JournalFailed`` once a write or sync failed."""
        if self.store.failed is not None:
            raise JournalFailed(f"the journal failed: {self.store.failed}")
        if self.batch:
            self.batch.flush()
        self.store.tick(now)
        if self._unwritten:
            unwritten, self._unwritten = self._unwritten, []
            self._remove(unwritten)
        _compact(self)

    def stats(self) -> dict[str, Any]:
        """What ``stats()["journal"]`` and ``zchannel stat`` show."""
        return _stats(self)

    @property
    def failed(self) -> bool:
        return self.store.failed is not None

    def close(self) -> None:
        """Write (and sync, unless ``never``) what is pending, close the files, let the lock go."""
        try:
            if not self.failed and (self._sending or self._leases or self.batch):
                self.sent()
                self.commit()
        except JournalError as exc:
            log.error("journal of %r: %s", self.settings.name, exc)
        finally:
            try:
                self.store.close()
            finally:
                self.dir.close()


def _table_records(journal: Journal) -> list[bytes]:
    """The ``TABLE`` records of the whole tables, that every new segment starts with."""
    crc = journal.store.crc
    return [fmt.record(crc, fmt.TABLE,
                       fmt.pack([name, True, [[k, v] for k, v in snapshot().items()]]))
            for name, snapshot in journal._tables.items()]


def _recover(journal: Journal) -> list[tuple[Any, list[Item]]]:
    """``Journal.recover``."""
    started = time.monotonic()
    # not kept: its records hold views of the segments' mappings, whose disk space a removed
    # segment would keep while the broker runs (items keep views of their own frames only)
    rec = read_journal(journal.dir, journal.settings.fsync == "always")
    check_collector(rec.tables.get(COLLECTOR_TABLE), journal.settings.collector,
                    len(rec.inputs) + (rec.state is not None), journal.settings.name,
                    journal.dir.path)
    for seg in rec.segments:
        journal.store.adopt(seg)
    journal._next_jid = rec.max_jid + 1
    journal.sequences = journal.batch.sequences = rec.sequences
    groups: dict[Any, list[Item]] = defaultdict(list)
    for jid, (seg, nbytes, put) in rec.items.items():
        got = recovered_item(jid, put)
        if got is not None:
            journal.live.add(jid, seg, nbytes, *got)
            groups[got[0]].append(got[1])
    _recover_collector(journal, rec)
    journal.recovered_items = len(journal.live)
    journal.redelivered = len(rec.leased)
    journal.store.start(journal.settings.max_bytes)
    journal._unsynced_release = True  # what the last broker wrote may not be on disk yet
    journal._drop_dead()  # segments whose items all left before the restart
    journal.recovery_s = time.monotonic() - started
    if journal.live or rec.segments:
        log.info("journal of %r: %d items recovered (%d were out on a lease) from %d "
                 "segments, %.1f MiB read in %.2fs", journal.settings.name, len(journal.live),
                 journal.redelivered, len(rec.segments), rec.bytes_read / (1 << 20),
                 journal.recovery_s)
    for items in groups.values():
        items.sort(key=lambda it: it.jid)
    return list(groups.items())


def _recover_collector(journal: Journal, rec: Recovered) -> None:
    """What a stateful collector needs, read back: its last state (``STATE``), for the
    broker to give back first, and the inputs after it, to replay."""
    for jid, (seg, nbytes, put) in sorted(rec.inputs.items()):
        got = recovered_item(jid, put)
        if got is not None:
            journal.inputs.add(jid, seg, nbytes, *got)
            origin = origin_of(put.extra)
            got[1].origin = origin
            unstored = (jid in rec.awaiting and origin is not None
                        and not rec.sequences.marked(origin))
            journal.replay.append((*got, unstored))
    if rec.state is not None:
        seg, nbytes, put, upto = rec.state
        got = recovered_item(put.jid, put)
        if got is None:  # the inputs it replaced are gone: nothing could rebuild the state
            raise JournalError(f"the collector state in {seg.path} (after put {upto}) cannot "
                               "be read back; the broker does not start on it")
        journal.collector_state.replace(put.jid, seg, nbytes, upto, got[1])
        journal.collector_state.recovered = got[1]


def _write_state(journal: Journal, upto: int, snapshot: Callable[[], Item | None]) -> None:
    """Write the collector's state after the put ``upto`` (a ``STATE`` record) in place of
    the inputs up to it and of its previous state; a state that could not be made or
    written leaves them kept (the next try once twice as many inputs are kept)."""
    journal.collector_state.due_at = 2 * journal.inputs.nbytes
    item = snapshot()
    if item is None:
        return
    try:  # as a put: the room kept for removals is not for it
        extra = fmt.state_extra(upto, _adopt_waiting(journal))
        jid = journal._next_jid
        parts, nbytes = item_parts(journal.store.crc, jid, upto, None, item, fmt.STATE,
                                   extra=extra)
        seg = journal._append(parts, nbytes, True)
    except JournalError as exc:
        log.warning("journal of %r: the collector's state was not written (%s): the puts "
                    "it took stay", journal.settings.name, exc)
        return
    journal._next_jid = jid + 1
    journal.collector_state.written += 1
    journal.collector_state.replace(jid, seg, nbytes, upto, item)
    journal.inputs.forget_all([j for j in journal.inputs.entries if j <= upto])
    journal._unsynced_release = True
    journal._drop_dead()


def _adopt_waiting(journal: Journal, storing: Sequence[Output] = ()) -> list[int]:
    """The jids of ``PENDING`` records of the outputs of every put waiting for room, written
    now for those that have none (a ``STATE`` or ``IDLE`` about to be written lets go of their
    inputs: the collector consumed them); the records of puts that stopped waiting without
    being stored (timed out, withdrawn) are not needed any more.  ``JournalError`` if a record
    could not be written (that put keeps no record: nothing may let go of its input).
    ``storing``: the outputs of a waiting put being stored now (``stored``), not adopted."""
    held = journal.collector_state
    adopted: list[int] = []
    for outputs in journal.waiting_outputs():
        if not outputs or outputs is storing:
            continue
        if not _is_pending(journal, outputs):
            _write_pending(journal, outputs)
        adopted.extend(item.jid for _, _, item in outputs)
    kept = set(adopted)
    held.pending.forget_all([j for j in held.pending.entries if j not in kept])
    held.adopted = adopted
    return adopted


def _is_pending(journal: Journal, outputs: Sequence[Output]) -> bool:
    """Whether the outputs of a put have ``PENDING`` records (written while it waited): the
    record of the last one's jid holds that very item (``Item.jid`` alone says nothing: a
    recovered item replayed as an output has the jid of its own record)."""
    item = outputs[-1][2]
    entry = journal.collector_state.pending.entries.get(item.jid)
    return entry is not None and entry[3] is item


def _write_pending(journal: Journal, outputs: Sequence[Output]) -> None:
    """``PENDING`` records of the outputs of a put that waits for room, under the jids its
    ``PUT`` records take when it is stored (``Item.jid``, set here)."""
    first = journal._next_jid
    last = first + len(outputs) - 1 if len(outputs) > 1 else 0
    try:
        for i, (key, consumer, item) in enumerate(outputs):
            jid = first + i
            parts, nbytes = item_parts(journal.store.crc, jid, key, consumer, item, fmt.PENDING,
                                       part_of=last if jid < last else 0)
            seg = journal._append(parts, nbytes, True)
            journal.collector_state.pending.add(jid, seg, nbytes, key, item)
    except JournalError:
        journal.collector_state.pending.forget_all(list(range(first, first + len(outputs))))
        raise
    finally:
        journal._next_jid = first + len(outputs)
    for i, (_, _, item) in enumerate(outputs):
        item.jid = first + i


def _write_adopt(journal: Journal) -> bool:
    """An ``ADOPT`` record of the ``PENDING`` records adopted (compaction copies some: the
    ``IDLE`` that adopted them may go with the old segment); False if there was no room."""
    body = fmt.pack_plain(journal.collector_state.adopted)
    try:
        journal._append([fmt.record(journal.store.crc, fmt.ADOPT, body)],
                        fmt.HEADER.size + len(body))
    except JournalError:
        return False
    return True


def _copy_parts(journal: Journal, held: LiveSet, jid: int, key: Any,
                item: Item) -> tuple[list[Any], int]:
    """The parts of a copy of the record of ``jid`` in ``held`` (compaction)."""
    held_state = journal.collector_state
    if held is journal.live:
        return item_parts(journal.store.crc, jid, key, None, item, fmt.PUT)
    if held is held_state.record:
        extra = fmt.state_extra(key, held_state.adopted)
        return item_parts(journal.store.crc, jid, key, None, item, fmt.STATE, extra=extra)
    if held is held_state.pending:
        return item_parts(journal.store.crc, jid, key, None, item, fmt.PENDING)
    return item_parts(journal.store.crc, jid, key, None, item,
                      _input_type(journal.sequences, item))


def _input_type(sequences: StoredSequences, item: Item, outputs: int = 1) -> int:
    """The record type of a collector's input: ``INPUT_OUT`` for a retry-safe put whose
    outputs are not stored yet (its origin counts once they are), else ``INPUT``."""
    origin = item.origin
    if origin is None or not outputs or sequences.marked(origin):
        return fmt.INPUT
    return fmt.INPUT_OUT


def _compact(journal: Journal) -> int:
    """Copy the records of the oldest segment still needed (items, a collector's inputs) to
    the end, at most ``COMPACT_BYTES_PER_TICK``, when ``Compaction.due`` says it frees space,
    so that segment can go; the bytes copied."""
    store, live, inputs = journal.store, journal.live, journal.inputs
    state, pending = journal.collector_state.record, journal.collector_state.pending
    removals = live.removed + inputs.removed + state.removed + pending.removed
    if not journal.compaction.due(store, live.nbytes + inputs.nbytes + state.nbytes
                                  + pending.nbytes, journal.settings.max_bytes, removals):
        return 0
    oldest = store.segments[0]
    copied = 0
    pending = journal.collector_state.pending
    adopting = any(True for _ in pending.in_segment(oldest))
    if adopting and not _write_adopt(journal):  # no room: nothing is copied
        journal.compaction.stalled(removals)
        return 0
    for held in (live, inputs, state, pending):
        for jid, (_, _, key, item) in held.in_segment(oldest):
            if copied >= COMPACT_BYTES_PER_TICK:
                break
            parts, nbytes = _copy_parts(journal, held, jid, key, item)
            try:  # as a put: the copies leave the room kept for removals and a restart
                new = journal._append(parts, nbytes, for_put=True)
            except JournalError:
                journal.compaction.stalled(removals)
                break
            held.move(jid, new, nbytes)
            copied += nbytes
    # again after the copies, which may have rolled to a newer segment than the first one:
    # the newest ADOPT must not go before them (a small record: the removals' room takes it)
    if adopting and copied and not _write_adopt(journal):
        log.error("journal of %r: no room for the record of the pending outputs copied",
                  journal.settings.name)
    if copied:
        store.sync_now()  # the copies are on disk before the originals go
    before = len(store.segments)
    journal._drop_dead()
    journal.compaction.copied(copied, before - len(store.segments))
    return copied


def _too_large(journal: Journal, nbytes: int) -> str | None:
    """Why a put of ``nbytes`` could never be stored under ``max_journal_bytes`` (beside its
    record, a segment's removals' margin and a page), or None."""
    limit = journal.settings.max_bytes
    most = limit - PUT_OVERHEAD - journal.store.full_margin - 4096
    if not limit or nbytes <= most:
        return None
    return (f"put of {nbytes} bytes exceeds the {most} bytes one put may take under the "
            f"broker's max_journal_bytes limit ({limit}: less a segment's margin for removal "
            "records)")


def _stats(journal: Journal) -> dict[str, Any]:
    """What ``stats()["journal"]`` and ``zchannel stat`` show of ``journal``."""
    store = journal.store
    now = time.monotonic()
    return {
        "directory": journal.dir.path,
        "fsync": store.policy,
        "fsync_interval_ms": round(store.interval * 1000, 3),
        "bytes": store.disk_bytes,
        "segments": len(store.segments),
        "items": len(journal.live),
        "item_bytes": journal.live.nbytes,
        "collector_inputs": len(journal.inputs),
        "collector_input_bytes": journal.inputs.nbytes,
        "collector_state_bytes": journal.collector_state.record.nbytes,
        "collector_states": journal.collector_state.written,
        "collector_pending": len(journal.collector_state.pending),
        "max_journal_bytes": journal.settings.max_bytes,
        "fsync_lag_ms": round(store.lag(now) * 1000, 3),
        "last_fsync_ms": round(store.sync.last_sync_s * 1000, 3),
        "fsyncs": store.sync.syncs,
        "recovered_items": journal.recovered_items,
        "redelivered": journal.redelivered,
        "recovery_s": round(journal.recovery_s, 3),
        "refused": journal.refused,
        "compacted_bytes": journal.compaction.copied_bytes,
        "compacted_segments": journal.compaction.segments_freed,
        "failed": None if store.failed is None else str(store.failed),
    }
