"""``PutBatch``: the small puts of one loop turn gathered into one ``PUTS`` record.

A put whose item is one small bytes frame (every put of up to ``INLINE_BODY`` bytes is) is
packed as it is stored — ``[jid, key, weight, consumer, extra, body]``, one encoder call — and
its place is reserved in the current segment then (a full disk refuses that put, and nothing
else).  The record is made when anything else is appended (so records stay in the order of
the changes: a removal never precedes the put it removes) and before the broker sends the
turn's replies (``Journal.commit``): one header and one checksum for the turn's puts instead
of one each.  The items count in their segment, and their put sequences in the tables, once
the record is in the buffer — as for a ``PUT`` record, a table written at the start of a new
segment never names a sequence whose record comes after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zchannel.broker.core.state import Item
from zchannel.broker.core.statelog import Output
from zchannel.broker.journal import format as fmt
from zchannel.broker.journal.items import LiveSet
from zchannel.broker.journal.sequences import StoredSequences
from zchannel.broker.journal.store import DIRECT_BYTES, SegmentStore
from zchannel.broker.journal.syncing import JournalFailed

BATCH_BYTES = DIRECT_BYTES // 2  # a record of a turn's puts stays in the buffer
ENTRY_BYTES = 4096  # larger puts get a ``PUT`` record of their own
RECORD_EXTRA = fmt.HEADER.size + 5  # a ``PUTS`` record's header and its array's


class PutBatch:
    """The small puts of a loop turn not yet in a record (see the module docstring)."""

    def __init__(self, store: SegmentStore, live: LiveSet, sequences: StoredSequences) -> None:
        self.store = store
        self.live = live
        self.sequences = sequences
        self.entries: list[bytes] = []
        self.items: list[tuple[Any, Item, Any]] = []  # key, item, origin
        self.nbytes = 0  # what the entries take

    def __bool__(self) -> bool:
        return bool(self.entries)

    def take(self, jid: int, key: Any, consumer: str | None, item: Item) -> bool:
        """Gather the put of ``item`` as ``jid`` (its jid set); False if it is not a small
        one-frame item (it gets a record of its own).  ``JournalError`` if the disk has no
        room for it (nothing of it was kept)."""
        entry = _entry(jid, key, consumer, item)
        if entry is None:
            return False
        store = self.store
        if store.sync.failed is not None:
            raise JournalFailed(f"the journal failed: {store.sync.failed}")
        origin = item.origin
        n = len(entry)
        if self.nbytes + n > BATCH_BYTES or not self._room_for(n, 1):
            self.flush()
            store.ensure_room(n + RECORD_EXTRA, puts=1)
            seg = store.segments[-1]
            if seg.allocated - seg.used < n + RECORD_EXTRA:  # a nearly full disk's last segment
                raise store.dir.no_room(f"a put of {n} bytes")
        self.entries.append(entry)
        self.items.append((key, item, origin))
        self.nbytes += n
        item.jid = jid
        item.origin = None  # kept here, recorded with the item: the tables carry it from then on
        return True

    def take_run(self, jid: int, outputs: Sequence[Output]) -> int:
        """Gather the leading small one-frame items of ``outputs`` (each a put of its own) as
        ``jid``, ``jid + 1``, ... in one pass, as ``take`` would each; how many (0 when the
        first is not small, or their room is not there without a new segment: ``take``
        then sees to each)."""
        store = self.store
        if store.sync.failed is not None:
            return 0
        entries: list[bytes] = []
        for key, consumer, item in outputs:
            entry = _entry(jid + len(entries), key, consumer, item)
            if entry is None:
                break
            entries.append(entry)
        n = len(entries)
        if n == 0:
            return 0
        total = sum(map(len, entries))
        if self.nbytes + total > BATCH_BYTES:
            self.flush()
        if total > BATCH_BYTES or not self._room_for(total, n):
            return 0
        self.entries += entries
        items = self.items
        for key, _, item in outputs[:n]:
            items.append((key, item, item.origin))
            item.jid = jid
            item.origin = None
            jid += 1
        self.nbytes += total
        return n

    def _room_for(self, nbytes: int, puts: int) -> bool:
        """Whether the current segment holds ``nbytes`` more of entries (``puts`` puts) beside
        those gathered, the record's header and the removals' margin, and the disk then keeps
        what ``DiskReserve.for_puts`` says."""
        store = self.store
        seg = store.segments[-1]
        left = seg.allocated - seg.used - self.nbytes - nbytes - RECORD_EXTRA
        if left < store.margin:
            return False
        reserve = store.reserve
        new = len(self.entries) + puts
        return len(reserve.live) + new <= reserve.roomy or not reserve.short(left, new)

    def flush(self) -> None:
        """Append the ``PUTS`` record of the gathered puts (to the room reserved for them)."""
        if not self.entries:
            return
        entries, items = self.entries, self.items
        self.entries, self.items, self.nbytes = [], [], 0
        parts, nbytes = fmt.puts_record(self.store.crc, entries)
        # into the room ``take`` made sure of (the removals' margin counted when the segment
        # has one): this never continues in a new segment, which could fail on a full disk
        seg = self.store.append(parts, nbytes, False)
        self.live.add_run(seg, [(item.jid, len(entry), key, item)
                                for entry, (key, item, _) in zip(entries, items, strict=True)])
        self.sequences.mark_all([origin for _, _, origin in items])


def _entry(jid: int, key: Any, consumer: str | None, item: Item) -> bytes | None:
    """The packed entry of ``item`` as put ``jid`` when it is one small bytes frame (of at most
    ``ENTRY_BYTES``); else None (it gets a record of its own)."""
    payload = item.payload
    if not (type(payload) is list and len(payload) == 1 and type(payload[0]) is bytes
            and len(payload[0]) <= ENTRY_BYTES):
        return None
    return fmt.pack_plain((jid, key, item.weight, consumer, item.origin, payload[0]))
