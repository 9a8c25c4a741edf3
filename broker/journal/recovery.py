"""Reading a journal back when a broker starts on it: which items are still the channel's, in
which order, which of them were out on a lease, and the tables kept beside them.

Each segment is mapped and read once, checking every record's checksum (the one pass over the
data that recovery costs).  Items keep their frames as views of the mapping (large frames) or
as copies (small ones).  What the segments may hold, and what recovery does with it:

- a zero-length file, or one whose first record is not whole and that holds nothing but zeros
  after the head a broker writes (a broker died while making it, between preallocating and
  writing its head): removed, it held nothing;
- a first record that is torn or damaged with data after it: a torn record at the end of the
  preamble, handled as the next two cases say;
- a segment holding nothing but the tables every segment starts with, after segments read
  whole: removed (those give the same tables);
- a torn record (a broker or the machine died while it was written) in the last segment that
  holds records: the data end before it — nothing acknowledged can be there, since a reply
  waits for its record (``docs/durability.md``) — logged with the bytes dropped, and the file
  trimmed;
- a torn or damaged record in any other segment (records of later segments were written
  after it): with ``fsync="always"`` damage (every record was synced before its reply):
  ``JournalFormatError`` naming the file and the offset, nothing is trimmed and the broker
  does not start on it; with ``interval`` or ``never`` what a crash of the machine left of
  records not synced yet: trimmed there as the last segment is, and the error logged;
- a record of a type this version does not know, whose checksum matches (a later version
  wrote it): skipped, and logged;
- a file of this journal's name whose first record names another channel, that is not a
  segment at all, or that is not a regular file (a directory, a symbolic link, a FIFO...), or
  that cannot be read: ``JournalFormatError`` naming the file and the channel; the broker
  does not start on it.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from zchannel.broker.journal import format as fmt
from zchannel.broker.journal.segments import JournalDir, SegmentFile
from zchannel.broker.journal.sequences import TABLE_NAME, StoredSequences, origin_of

log = logging.getLogger("zchannel.journal")


@dataclass
class Recovered:
    """What a journal held for its channel when the broker started."""

    # jid -> (segment of its newest copy, record bytes, the record); in the order of the
    # newest copies in the files
    items: dict[int, tuple[SegmentFile, int, fmt.PutRecord]] = field(default_factory=dict)
    leased: set[int] = field(default_factory=set)
    # the inputs a collector that keeps state took since it last held nothing, by jid
    inputs: dict[int, tuple[SegmentFile, int, fmt.PutRecord]] = field(default_factory=dict)
    # those whose newest record is an ``INPUT_OUT``: stored only if their origin is marked
    awaiting: set[int] = field(default_factory=set)
    # that collector's state after the put of ``upto`` (a ``STATE`` record), replacing the
    # inputs up to it: (its segment, record bytes, the record, upto)
    state: tuple[SegmentFile, int, fmt.PutRecord, int] | None = None
    # the outputs of puts that waited for room when a state or an idle moment let go of their
    # inputs (``PENDING`` records not followed by a ``PUT`` of their jid), and the jids the
    # last ``STATE`` or ``IDLE`` adopted: those are stored (``_adopt_pending``)
    pending: dict[int, tuple[SegmentFile, int, fmt.PutRecord]] = field(default_factory=dict)
    adopted: set[int] = field(default_factory=set)
    tables: dict[str, dict[Any, Any]] = field(default_factory=dict)
    # the put sequences of each producer the journal recorded (journal/sequences.py)
    sequences: StoredSequences = field(default_factory=StoredSequences)
    segments: list[SegmentFile] = field(default_factory=list)
    max_jid: int = 0
    bytes_read: int = 0
    dropped_bytes: int = 0  # torn data after the last good record of a segment
    unknown_records: int = 0  # records of a type this version does not know (skipped)
    removed_files: int = 0  # empty or unfinished segments
    # the outputs read of puts with several outputs, by the jid of the put's last output, until
    # that one is read: those left at the end belong to a put a crash cut short
    parts: dict[int, list[int]] = field(default_factory=dict)


def read_journal(jdir: JournalDir, synced_always: bool = False) -> Recovered:
    """Read every segment of ``jdir`` in order (see the module docstring).  A torn or damaged
    record in a segment that later segments follow stops the start (``JournalFormatError``)
    when the journal is written with ``fsync="always"`` (``synced_always``: every record was on
    disk before its reply, so such a record is damage, not a crash); with ``interval`` or
    ``never`` it is what a crash of the machine leaves of records not synced yet: the segment
    is trimmed there, as the last one is, and the error logged."""
    rec = Recovered()
    torn: tuple[SegmentFile, int] | None = None  # a torn segment and its size
    whole = False  # whether the segments kept so far were read to their end
    for seq, path in jdir.listing():
        read = _read_segment(jdir, seq, path, rec)
        if read is None:
            continue
        if torn is not None:
            if synced_always:
                raise _torn_inside(jdir, *torn)
            _drop_torn(*torn, last=False, rec=rec)
            torn = None
        seg, size, is_torn = read
        if whole and not is_torn and seg.used == seg.head:
            # nothing but the whole tables a broker starts a segment with, which the segments
            # before it give as well (a broker started, or rolled, and wrote nothing more):
            # removed, or every restart of a broker that died at once would add a segment
            log.info("journal segment %s holds nothing but its tables: removed", path)
            _remove(path, rec)
            continue
        whole = not is_torn
        rec.segments.append(seg)
        if is_torn:
            torn = (seg, size)
        else:
            _trim(seg, size)  # the zeros after the data (a preallocated segment)
    if torn is not None:
        _drop_torn(*torn, last=True, rec=rec)
    _adopt_pending(rec)
    _drop_unfinished_puts(jdir, rec)
    return rec


def _adopt_pending(rec: Recovered) -> None:
    """The outputs the last ``STATE`` or ``IDLE`` adopted, of puts that waited for room and
    were not stored when the broker stopped: stored now (the collector's state consumed their
    puts), each put's sequence marked (its retry is known as stored)."""
    for jid in sorted(rec.adopted):
        got = rec.pending.get(jid)
        if got is not None:
            seg, nbytes, put = got
            _hold(rec.items, put, seg, nbytes, rec)
    rec.pending.clear()


def _drop_unfinished_puts(jdir: JournalDir, rec: Recovered) -> None:
    """Drop the outputs of a put whose last output was never written (the broker died while it
    wrote them): the put was not acknowledged, and its retry stores them all again.  Jids go
    on after that last output's: a later put never takes it."""
    for last, jids in rec.parts.items():
        for jid in jids:
            rec.items.pop(jid, None)
        rec.max_jid = max(rec.max_jid, last)
        log.warning("journal of %r: %d outputs of a put the broker did not finish writing "
                    "dropped (it was not acknowledged)", jdir.name, len(jids))
    rec.parts.clear()


def _drop_torn(seg: SegmentFile, size: int, last: bool, rec: Recovered) -> None:
    """Drop what follows the torn record of ``seg`` (logged) and trim its file there."""
    dropped = size - seg.used
    rec.dropped_bytes += dropped
    (log.warning if last else log.error)(
        "journal segment %s: a torn record at offset %d, %d bytes after it dropped (%s)",
        seg.path, seg.used, dropped, "the end of what was written when the broker stopped"
        if last else "written before a crash of the machine, not synced")
    _trim(seg, size)


def _torn_inside(jdir: JournalDir, seg: SegmentFile, size: int) -> fmt.JournalFormatError:
    """The error of a torn or damaged record in a segment that later segments follow."""
    return fmt.JournalFormatError(
        f"{seg.path}: a torn or damaged record at offset {seg.used} ({size - seg.used} bytes "
        f"from there to the end of the file), in a segment of channel {jdir.name!r} that is not "
        "the journal's last: the records after it cannot be read, and later segments hold "
        "records written after them, and with fsync 'always' every record was on disk before "
        "its reply, so this is damage: the broker does not start on it.  "
        f"`truncate -s {seg.used} {seg.path}` starts on the records before it (what follows "
        "it in that file is lost); else move the journal's files away")


def _trim(seg: SegmentFile, size: int) -> None:
    """Cut the file of a segment read back after its data (zeros, or a torn last record)."""
    if size > seg.used:
        try:
            os.truncate(seg.path, seg.used)
            seg.allocated = seg.used
        except OSError as exc:
            log.warning("could not trim journal segment %s: %s", seg.path, exc)


def _open_segment(jdir: JournalDir, path: str) -> tuple[int, int]:
    """Open a file named like a segment of ``jdir`` to read it: its descriptor and size
    (``JournalFormatError`` naming it for anything but a regular file, or an ``OSError``)."""
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISREG(mode):
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode):
                return fd, info.st_size
            os.close(fd)  # replaced meanwhile
            mode = info.st_mode
    except OSError as exc:
        raise fmt.JournalFormatError(
            f"{path}: this file, named like a segment of the journal of channel "
            f"{jdir.name!r}, cannot be read: {exc.strerror or exc}") from None
    raise fmt.JournalFormatError(
        f"{path} is named like a segment of the journal of channel {jdir.name!r} but is "
        f"{_file_kind(mode)}, not a regular file; move it away")


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "of another kind"


def _map(jdir: JournalDir, path: str, fd: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise fmt.JournalFormatError(
            f"{path}: this segment of the journal of channel {jdir.name!r} cannot be mapped: "
            f"{exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _read_segment(jdir: JournalDir, seq: int, path: str,
                  rec: Recovered) -> tuple[SegmentFile, int, bool] | None:
    """Read one segment into ``rec``: it, its file's size, and whether its data end at a torn
    record; None for a file removed (a broker stopped while making it: it held nothing)."""
    fd, size = _open_segment(jdir, path)
    if size == 0:
        os.close(fd)
        log.warning("journal segment %s is empty (a broker stopped while making it): removed",
                    path)
        _remove(path, rec)
        return None
    data = _map(jdir, path, fd)
    view = memoryview(data)
    magic, kind = (fmt.PREAMBLE.unpack_from(view, 0) if size >= fmt.PREAMBLE.size
                   else (b"", 0))
    scan = fmt.Scan()
    records: Iterator[tuple[int, memoryview]] = iter(())
    first = None
    if magic in fmt.MAGICS:
        records = fmt.records(view, fmt.checksum_of(kind, path), fmt.PREAMBLE.size, scan)
        first = next(records, None)
    if first is None or first[0] != fmt.SEGMENT:
        if _unfinished(jdir, seq, view):
            log.warning("journal segment %s holds no whole first record and nothing after it "
                        "(a broker stopped while making it): removed", path)
            _remove(path, rec)
            return None
        if not any(view[: fmt.PREAMBLE.size]):
            raise fmt.JournalFormatError(
                f"{path}: a segment of channel {jdir.name!r} whose start is zeros but that "
                "holds data further on: damaged (not cut short while a broker made it), so "
                "the broker does not start on it; move it away")
        start = bytes(view[:len(fmt.MAGIC)])  # also of a file shorter than a preamble
        if _later_version(start):
            raise _written_later(jdir, path, start)
        if magic not in fmt.MAGICS:
            raise fmt.JournalFormatError(
                f"{path} is not a zchannel journal segment (it is named like one of channel "
                f"{jdir.name!r}); move it away")
        if scan.end != fmt.PREAMBLE.size or not scan.torn:
            raise fmt.JournalFormatError(f"{path}: its first record is not a segment record")
        # a damaged first record with data after it: the segment's data end at its preamble
        # (``read_journal`` refuses it, or drops them, as any torn record)
        used = fmt.PREAMBLE.size
        return (SegmentFile(seq, path, None, size, used, head=used, written=used, synced=used,
                            recovered=True), size, True)
    _check_segment_record(jdir, seq, path, first[1])
    seg = SegmentFile(seq, path, None, size, 0, recovered=True)
    _apply_records(records, seg, rec, scan)
    seg.used = seg.written = seg.synced = scan.end
    rec.bytes_read += scan.end
    return seg, size, scan.torn


def _later_version(magic: bytes) -> int:
    """The format version of a segment magic a later zchannel writes (``ZCJRNL`` and two
    digits above ``fmt.VERSION``); 0 for any other magic."""
    stem, digits = fmt.MAGIC[:-2], magic[len(fmt.MAGIC) - 2:]
    if magic[:len(stem)] != stem or len(digits) != 2 or not digits.isdigit():
        return 0
    version = int(digits)
    return version if version > fmt.VERSION else 0


def _written_later(jdir: JournalDir, path: str, magic: bytes) -> fmt.JournalFormatError:
    """The error of a segment of ``jdir`` a later zchannel wrote (its ``magic``): its records
    may be of kinds this version cannot read, so the broker does not start on it; the items
    in it are acknowledged puts, which the zchannel that wrote it recovers."""
    read = ", ".join(f"{m.decode()} (version {v})" for m, v in sorted(fmt.MAGICS.items()))
    return fmt.JournalFormatError(
        f"{path} is a journal segment of channel {jdir.name!r} written by a later zchannel: "
        f"its magic {magic.decode()} is journal format version {_later_version(magic)}, and "
        f"this zchannel reads {read}.  Start the broker with the zchannel version that wrote "
        "it (or a later one): the segment holds acknowledged items, which moving or removing "
        "it would lose.  To use this version on the channel again, drain it with that one "
        "first")


def _unfinished(jdir: JournalDir, seq: int, view: memoryview) -> bool:
    """Whether a segment whose first record is not whole was cut short while a broker made it
    (between preallocating it and writing its head): it starts with zeros or with the magic a
    broker of some version writes, and nothing but zeros follows the length of that head.  A file of other
    bytes, or with data further on, is no such segment (damage, or a file of something else)."""
    start = bytes(view[: len(fmt.MAGIC)])
    if any(start) and not any(magic[: len(start)] == start for magic in fmt.MAGICS):
        return False
    bound = len(jdir.head(seq, fmt.CRC32))
    return len(view) <= bound or not np.frombuffer(view, np.uint8, offset=bound).any()


def _check_segment_record(jdir: JournalDir, seq: int, path: str, body: memoryview) -> None:
    """``JournalFormatError`` unless a segment's first record names this channel and ``seq``."""
    info = fmt.unpack(body)
    channel = info.get("channel") if isinstance(info, dict) else None
    if channel != jdir.name:
        raise fmt.JournalFormatError(
            f"{path} is a segment of channel {channel!r}, not of {jdir.name!r}: a journal "
            "directory holds each channel's segments under its own name; move it away")
    if info.get("seq") != seq:
        raise fmt.JournalFormatError(f"{path}: it says it is segment {info.get('seq')!r}, its "
                                     f"name says {seq}; move it away")


def _apply_records(records: Iterator[tuple[int, memoryview]], seg: SegmentFile,
                   rec: Recovered, scan: fmt.Scan) -> None:
    """The records of a segment after its first applied to what recovery holds; records of a
    type this version does not know skipped (logged); where its start (tables) ends noted."""
    unknown: dict[int, int] = {}
    head = None
    for rtype, body in records:
        if head is None and rtype != fmt.TABLE:
            head = scan.end  # the offset of this record: the tables end here
        apply = _APPLY.get(rtype)
        if apply is not None:
            apply(rtype, body, seg, rec)
        else:
            unknown[rtype] = unknown.get(rtype, 0) + 1
    seg.head = scan.end if head is None else head
    if unknown:
        rec.unknown_records += sum(unknown.values())
        log.warning("journal segment %s: %s skipped (written by a later zchannel?)", seg.path,
                    ", ".join(f"{n} records of unknown type {t}" for t, n in sorted(unknown.items())))


def _apply_put(rtype: int, body: memoryview, seg: SegmentFile, rec: Recovered) -> None:
    """A put (or a hook's input): held under its jid, the newest copy counting."""
    try:
        put = fmt.read_put(body)
    except (ValueError, TypeError) as exc:
        log.error("journal segment %s: a put record that does not hold together (%s): "
                  "skipped", seg.path, exc)
        return
    if rtype == fmt.PENDING:
        rec.pending[put.jid] = (seg, fmt.HEADER.size + len(body), put)
        rec.max_jid = max(rec.max_jid, put.jid)
        return
    if rtype != fmt.PUT and rec.state is not None and put.jid <= rec.state[3]:
        origin = origin_of(put.extra) if rtype == fmt.INPUT else None
        if origin is not None:  # an input the collector's state holds already: no replay
            rec.sequences.mark(origin)
        return
    if rtype == fmt.INPUT_OUT:  # its outputs, once stored, mark its origin
        rec.awaiting.add(put.jid)
    elif rtype == fmt.INPUT:
        rec.awaiting.discard(put.jid)
    _hold(rec.items if rtype == fmt.PUT else rec.inputs, put, seg, fmt.HEADER.size + len(body),
          rec, mark=rtype != fmt.INPUT_OUT)


def _apply_puts(rtype: int, body: memoryview, seg: SegmentFile, rec: Recovered) -> None:
    """The small puts of a loop turn, each as a ``PUT`` record of its own."""
    try:
        puts = fmt.read_puts(body)
    except (ValueError, TypeError) as exc:
        log.error("journal segment %s: a puts record that does not hold together (%s): "
                  "skipped", seg.path, exc)
        return
    for put in puts:
        _hold(rec.items, put, seg, fmt.PUT_ENTRY_BYTES + put.frames[0].nbytes, rec)


def _hold(held: dict, put: fmt.PutRecord, seg: SegmentFile, nbytes: int, rec: Recovered,
          mark: bool = True) -> None:
    """A put read back: held under its jid, the newest copy counting (compaction copies);
    its origin marked as stored (``mark``)."""
    held.pop(put.jid, None)
    held[put.jid] = (seg, nbytes, put)
    if rec.pending and held is rec.items:
        rec.pending.pop(put.jid, None)  # a waiting put's output, stored since
    rec.max_jid = max(rec.max_jid, put.jid)
    if held is rec.items:
        last = fmt.part_of(put.extra)
        if last is not None and last > put.jid:
            rec.parts.setdefault(last, []).append(put.jid)
        elif rec.parts:
            rec.parts.pop(put.jid, None)  # the last output of a put: its outputs are whole
    origin = origin_of(put.extra) if mark else None
    if origin is not None:
        rec.sequences.mark(origin)


def _apply_idle(rtype: int, body: memoryview, seg: SegmentFile, rec: Recovered) -> None:
    """A hook went idle up to a jid: the inputs up to it, and its state, are done."""
    upto = fmt.unpack(body)
    if isinstance(upto, list) and upto and isinstance(upto[0], int):
        _inputs_done(rec, upto[0])
        if rec.state is not None and rec.state[3] <= upto[0]:
            rec.state = None
        rec.adopted = set(upto[1]) if len(upto) > 1 and fmt.jid_list(upto[1]) else set()


def _apply_state(rtype: int, body: memoryview, seg: SegmentFile, rec: Recovered) -> None:
    """A collector's state after a put: the inputs up to that put, and an earlier state, are
    not needed any more."""
    try:
        put = fmt.read_put(body)
    except (ValueError, TypeError):
        put = None
    of = fmt.state_of(put.extra) if put is not None else None
    if put is None or of is None:  # the inputs it replaced are gone: no state to rebuild
        raise fmt.JournalFormatError(f"{seg.path}: a collector state record that does not "
                                     "hold together; the broker does not start on it")
    upto, adopted = of
    rec.max_jid = max(rec.max_jid, put.jid)
    if rec.state is None or rec.state[3] <= upto:
        rec.state = (seg, fmt.HEADER.size + len(body), put, upto)
        rec.adopted = set(adopted)
        _inputs_done(rec, upto)


def _apply_adopt(rtype: int, body: memoryview, seg: SegmentFile, rec: Recovered) -> None:
    """The ``PENDING`` records adopted, as compaction wrote them after copying some."""
    jids = fmt.unpack(body)
    if fmt.jid_list(jids):
        rec.adopted = set(jids)


def _inputs_done(rec: Recovered, upto: int) -> None:
    for jid in [j for j in rec.inputs if j <= upto]:
        del rec.inputs[jid]


def _apply_jids(rtype: int, body: memoryview, seg: SegmentFile, rec: Recovered) -> None:
    """Items removed (taken) or leased, by jid."""
    jids = fmt.unpack(body)
    if not isinstance(jids, list):
        return
    for jid in jids:
        if not isinstance(jid, int):
            continue
        if rtype == fmt.REMOVE:
            rec.items.pop(jid, None)
            rec.leased.discard(jid)
            rec.pending.pop(jid, None)
        elif jid in rec.items:
            rec.leased.add(jid)
        rec.max_jid = max(rec.max_jid, jid)


def _apply_table(rtype: int, body: memoryview, seg: SegmentFile, rec: Recovered) -> None:
    """A table's pairs (the whole table, or changes to it)."""
    value = fmt.unpack(body)
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)):
        return
    name, whole, pairs = value
    table = rec.tables.setdefault(name, {})
    if whole:
        table.clear()
    for pair in pairs if isinstance(pairs, list) else ():
        if isinstance(pair, list) and len(pair) == 2:
            table[_hashable(pair[0])] = pair[1]
    if name == TABLE_NAME:  # the whole table of stored sequences, as it was here
        rec.sequences.load(table)


_APPLY: dict[int, Callable[[int, memoryview, SegmentFile, Recovered], None]] = {
    fmt.PUT: _apply_put, fmt.INPUT: _apply_put, fmt.INPUT_OUT: _apply_put,
    fmt.PENDING: _apply_put, fmt.ADOPT: _apply_adopt,
    fmt.PUTS: _apply_puts, fmt.IDLE: _apply_idle, fmt.STATE: _apply_state,
    fmt.REMOVE: _apply_jids, fmt.LEASE: _apply_jids, fmt.TABLE: _apply_table,
}


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _remove(path: str, rec: Recovered) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    rec.removed_files += 1
