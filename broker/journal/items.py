"""Items in a journal: the records of queue items (``PUT``) and of a stateful collector's inputs
(``INPUT``), the sets of records still needed (``LiveSet``: what keeps a segment from being
removed), and the queue items made from records read back."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import zmq
from zchannel.broker.core.state import Item, item_bytes
from zchannel.broker.journal import format as fmt
from zchannel.broker.journal.segments import SegmentFile
from zchannel.broker.shm.broker import FramedSlots, SlotFrames
from zchannel.broker.wire.argchecks import check_key, check_weight
from zchannel.broker.wire.protocol import key_from_wire

log = logging.getLogger("zchannel.journal")

# frames at least this large stay views of the mapped segment when read back (smaller ones
# are copied: a view would keep the whole mapping alive for a few bytes)
COPY_BELOW = 64 << 10

# jid -> (its segment, its record's bytes, its key, the item)
Entry = tuple[SegmentFile, int, Any, Item]


def item_parts(crc: fmt.Checksum, jid: int, key: Any, consumer: str | None, item: Item,
               rtype: int = fmt.PUT, part_of: int = 0,
               extra: Any = None) -> tuple[list[Any], int]:
    """The record of ``item`` (its frames raw; the bytes of its shared-memory slots straight
    from the slots, after them) and its length; ``part_of``: the jid of the last output of
    the put whose earlier output ``item`` is (``format.part_extra``), 0 for a whole put;
    ``extra``: the record's ``extra`` when it is neither (a ``STATE``'s)."""
    payload = item.payload
    if extra is None:
        extra = fmt.part_extra(part_of) if part_of else item.origin
    if len(payload) == 1 and type(payload) is list and type(payload[0]) is bytes:
        body = payload[0]  # the common small item, as small puts carry it inline
        return fmt.small_put(crc, (jid, key, item.weight, consumer, (len(body),), 0, extra),
                             body, rtype)
    frames = [f.buffer if isinstance(f, zmq.Frame) else f for f in payload]
    slots = 0
    if isinstance(payload, FramedSlots):
        slots = len(payload.framed)
    elif isinstance(payload, SlotFrames):
        frames.extend(h.view() for h in payload.holds)
        slots = len(payload.holds)
    sizes = [memoryview(f).nbytes for f in frames]
    meta = [jid, key, item.weight, consumer, sizes, slots, extra]
    return fmt.put_parts(crc, meta, frames, rtype)


def recovered_item(jid: int, put: fmt.PutRecord) -> tuple[Any, Item] | None:
    """The key and queue item of a record read back (small frames copied, large ones views
    of the mapped file); None, logged, for a bad key or weight."""
    try:
        key = check_key(key_from_wire(put.key))
        weight = check_weight(put.weight)
    except (TypeError, ValueError) as exc:
        log.error("journal item %d has a bad key or weight (%s): skipped", jid, exc)
        return None
    frames: list[Any] = [f if f.nbytes >= COPY_BELOW else bytes(f) for f in put.frames]
    payload: list[Any] = frames
    if put.slots:
        first = len(frames) - put.slots
        payload = FramedSlots(frames, list(range(first, len(frames))))
    nbytes = item_bytes(sum(memoryview(f).nbytes for f in frames), len(frames))
    return key, Item(payload, weight, nbytes, jid=jid)


class LiveSet:
    """Records still needed, by jid, in the order they were (last) written: each counts in
    its segment (``SegmentFile.live``), which is removed only when none is left."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self.nbytes = 0
        self.removed = 0  # records forgotten so far (a copy moved by ``move`` is none)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, jid: int, seg: SegmentFile, nbytes: int, key: Any, item: Item) -> None:
        self.entries[jid] = (seg, nbytes, key, item)
        seg.live += 1
        seg.live_bytes += nbytes
        self.nbytes += nbytes

    def add_run(self, seg: SegmentFile, rows: list[tuple[int, int, Any, Item]]) -> None:
        """``add`` of each ``(jid, nbytes, key, item)`` of ``rows``, all in ``seg``."""
        entries, total = self.entries, 0
        for jid, nbytes, key, item in rows:
            entries[jid] = (seg, nbytes, key, item)
            total += nbytes
        seg.live += len(rows)
        seg.live_bytes += total
        self.nbytes += total

    def _drop(self, jid: int) -> Entry | None:
        """Take ``jid``'s entry out of the set and of its segment's counts (None: not held)."""
        entry = self.entries.pop(jid, None)
        if entry is not None:
            seg, nbytes = entry[0], entry[1]
            seg.live -= 1
            seg.live_bytes -= nbytes
            self.nbytes -= nbytes
        return entry

    def forget(self, jid: int) -> None:
        if self._drop(jid) is not None:
            self.removed += 1

    def move(self, jid: int, seg: SegmentFile, nbytes: int) -> None:
        """The record of ``jid`` was copied to ``seg`` (``nbytes``): the copy counts from here
        on, the old record no more (compaction; not a removal)."""
        entry = self._drop(jid)
        if entry is None:
            raise KeyError(jid)
        self.add(jid, seg, nbytes, entry[2], entry[3])

    def forget_all(self, jids: list[int]) -> None:
        """``forget`` each of ``jids`` (a loop turn's removals)."""
        pop, gone, count = self.entries.pop, 0, 0
        for jid in jids:
            entry = pop(jid, None)
            if entry is not None:
                seg, nbytes = entry[0], entry[1]
                seg.live -= 1
                seg.live_bytes -= nbytes
                gone += nbytes
                count += 1
        self.nbytes -= gone
        self.removed += count

    def in_segment(self, seg: SegmentFile) -> Iterator[tuple[int, Entry]]:
        """The entries in ``seg`` when it is the oldest segment (they come first)."""
        for jid, entry in list(self.entries.items()):
            if entry[0] is not seg:
                return
            yield jid, entry
