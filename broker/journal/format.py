"""The on-disk format of a journal: segment files holding checksummed records.

A segment file starts with a 16-byte preamble (``ZCJRNL03``, the checksum kind, 7 zero bytes)
and then holds records back to back.  The rest of the file, preallocated and never written, is
zeros: a zero record header ends the data.  A record is a 9-byte header — the length of its
body (u32), the checksum of its type byte and body (u32), its type (u8), little-endian — then
the body:

============  ==================================================================================
type          body
============  ==================================================================================
``SEGMENT``   msgpack map: ``channel`` (the journal's name), ``seq`` (the segment's number),
              ``created`` (Unix time), ``version`` (3); always the first record of a segment
``PUT``       u32 length of the meta, the meta (msgpack ``[jid, key, weight, consumer, sizes,
              slots, extra]``), then the item's frames back to back, ``sizes`` bytes each: the
              frames the broker received, raw; the last ``slots`` of them hold the bytes of the
              item's shared-memory slots (in the order of the body's ``[i]`` locs).  ``extra``:
              ``[producer, sequence]`` of a retry-safe put (``journal/sequences.py``),
              ``["part", J]`` for an output of a put with several outputs other than its last
              (``J``: the last one's jid; the outputs are written in order, each a ``PUT``
              record, and count only once the record of ``J`` was written), or nil
``REMOVE``    msgpack list of the jids of items that left the channel (taken, acknowledged)
``LEASE``     msgpack list of the jids of items delivered under a lease (``get(ack=True)``)
``TABLE``     msgpack ``[name, whole, data]``: a table kept beside the items (``whole``: all of it,
              replacing what came before; else ``data`` is ``[[key, value], ...]`` to set)
``INPUT``     as ``PUT``: a put a collector that keeps state took (``Collector.holds_state``),
              replayed through it when a broker starts on the journal
``IDLE``      msgpack ``[jid, [P...]]``: the collector held nothing after the put of ``jid``: the
              ``INPUT`` records up to it are not needed any more; ``P...``, the ``PENDING``
              records it adopts (``[jid]`` alone in earlier versions: it adopts none)
``PUTS``      msgpack list of small puts stored in one loop turn, each ``[jid, key, weight,
              consumer, extra, body]`` (``body``: the item's one frame, bytes): what ``PUT``
              records of those items would hold, in one record (version 2)
``INPUT_OUT`` as ``INPUT``, for a put whose outputs are stored after it (``PUT`` records; the
              last carries the put's ``extra``): its ``extra`` counts as stored only with them,
              and a replay stores the outputs of one whose outputs were not stored
``STATE``     as ``PUT``, with ``extra`` ``["state", J, [P...]]``: the state of that collector
              (``Collector.state_dict``, encoded as an item) after the put of ``J``; it
              replaces the ``INPUT`` records up to ``J`` and any ``STATE`` before it, and is
              not needed after an ``IDLE`` of ``J`` or later.  ``P...``: the jids of the
              ``PENDING`` records it adopts
``PENDING``   as ``PUT``: an output of a put that waits for room, written when a ``STATE`` or
              ``IDLE`` lets go of that put's input (the collector consumed it); it counts as
              stored if the last ``STATE``, ``IDLE`` or ``ADOPT`` adopts it and no ``PUT``
              record (the output stored, when the put got room) or ``REMOVE`` (the put ended
              without room, or its item left) of its jid follows
``ADOPT``     msgpack list of jids: the ``PENDING`` records adopted, written after compaction
              copied some (the ``IDLE`` that adopted them may go with the old segment)
============  ==================================================================================

Versions: a version-1 segment (``ZCJRNL01``) holds no ``PUTS`` record, a version-2 one
(``ZCJRNL02``) no ``STATE`` record; this code reads all three and writes version 3.  A reader
of an earlier version refuses a later segment by its magic (version 1 does not skip records it
does not know: it would take them for torn data; version 2 would skip a ``STATE`` record and
lose the collector state it replaces).  This reader
yields a record of a type it does not know, whose checksum matches, like any other (recovery
skips it).

The checksum is CRC-32C (the ``crc32c`` package: hardware instructions, GB/s) when that is
installed, else zlib's CRC-32; the preamble says which, and a reader without ``crc32c`` refuses
a CRC-32C journal with an error that says so.  A record whose header runs past the end of the
file, or whose checksum does not match, is *torn*: the data of its segment end before it.  So
is a zero header (where the data end) with bytes other than zeros after it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec

try:  # the hardware CRC-32C; zlib's CRC-32 otherwise (slower: ~1 GB/s here)
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - depends on the install
    _crc32c = None  # type: ignore[assignment]  # without the durable extra: zlib's CRC-32

MAGIC = b"ZCJRNL03"  # the version written
MAGICS = {b"ZCJRNL01": 1, b"ZCJRNL02": 2, MAGIC: 3}  # the versions read
PREAMBLE = struct.Struct("<8sB7x")  # magic, checksum kind
HEADER = struct.Struct("<IIB")  # body length, checksum of type + body, type
U32 = struct.Struct("<I")
HEADER_META = struct.Struct("<IIBI")  # a put record's header and the length of its meta
TYPE_META = struct.Struct("<BI")  # the first bytes a put record's checksum covers
VERSION = 3
SUFFIX = ".zcj"
MAX_BODY = (1 << 32) - 1

CRC32C, CRC32 = 1, 2  # the checksum kinds of the preamble
(END, SEGMENT, PUT, REMOVE, LEASE, TABLE, INPUT, IDLE, PUTS, INPUT_OUT, STATE, PENDING,
 ADOPT) = range(13)
RECORD_TYPES = {SEGMENT, PUT, REMOVE, LEASE, TABLE, INPUT, IDLE, PUTS, INPUT_OUT, STATE, PENDING,
                ADOPT}
_TYPE_BYTE = tuple(bytes((t,)) for t in range(256))  # what each type's checksum starts with
ZEROS_CHECKED = 1 << 20  # the bytes after the data are checked for zeros this much at a time
ARRAY16, ARRAY32 = struct.Struct(">BH"), struct.Struct(">BI")  # msgpack array headers
PART = "part"  # the tag of an output of a put with several outputs (``part_extra``)
STATE_TAG = "state"  # the tag of a collector's state (``state_extra``)
PUT_ENTRY_BYTES = 40  # what a put in a ``PUTS`` record takes besides its body, about

Checksum = Callable[[Any, int], int]


class JournalFormatError(ValueError):
    """A segment file that is not a segment of this journal (wrong magic, another channel's,
    an unknown checksum kind): the broker refuses to start on it, naming the file."""


def _zlib_crc(data: Any, value: int = 0) -> int:
    return zlib.crc32(data, value)


def default_kind() -> int:
    """The checksum kind new segments use: CRC-32C where the ``crc32c`` package is installed."""
    return CRC32C if _crc32c is not None else CRC32


def checksum_of(kind: int, where: str = "") -> Checksum:
    """The checksum function of ``kind`` (``JournalFormatError`` if it cannot be computed)."""
    if kind == CRC32:
        return _zlib_crc
    if kind == CRC32C:
        if _crc32c is None:
            raise JournalFormatError(
                f"{where}: the journal uses CRC-32C checksums; install the crc32c package "
                "(pip install 'zchannel[durable]') to read it")
        return _crc32c.crc32c
    raise JournalFormatError(f"{where}: unknown checksum kind {kind}")


def preamble(kind: int) -> bytes:
    return PREAMBLE.pack(MAGIC, kind)


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


# The records written per item (a put's meta, a removal's jids): msgspec's encoder writes the
# same msgpack bytes as ``pack`` for the plain values they hold (ints, floats, str, bytes, None,
# lists and tuples of them) at a third of the cost of ``msgpack.packb``, which makes a packer
# per call (tests/test_journal_records.py checks that the bytes are the same).
pack_plain = msgspec.msgpack.Encoder().encode


def part_extra(last_jid: int) -> list[Any]:
    """The ``extra`` of an output of a put with several outputs, other than its last one."""
    return [PART, last_jid]


def part_of(extra: Any) -> int | None:
    """The jid of the last output of the put whose output carries ``extra`` (None: the record
    is a whole put, or that last output)."""
    if (isinstance(extra, list) and len(extra) == 2 and extra[0] == PART
            and type(extra[1]) is int and extra[1] > 0):
        return extra[1]
    return None


def state_extra(upto: int, adopted: list[int]) -> list[Any]:
    """The ``extra`` of a ``STATE`` record: the state after the put of ``upto``, adopting the
    ``PENDING`` records ``adopted``."""
    return [STATE_TAG, upto, adopted]


def state_of(extra: Any) -> tuple[int, list[int]] | None:
    """The jid of the put a ``STATE`` record's state follows and the ``PENDING`` records it
    adopts (None: a malformed ``extra``)."""
    if (isinstance(extra, list) and len(extra) == 3 and extra[0] == STATE_TAG
            and type(extra[1]) is int and extra[1] > 0 and jid_list(extra[2])):
        return extra[1], extra[2]
    return None


def jid_list(value: Any) -> bool:
    """Whether ``value`` is a list of jids."""
    return isinstance(value, list) and all(type(j) is int and j > 0 for j in value)


def unpack(data: Any) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


def record(kind_crc: Checksum, rtype: int, body: bytes) -> bytes:
    """A whole record of ``rtype`` with ``body`` (small records: one bytes object)."""
    crc = kind_crc(body, kind_crc(_TYPE_BYTE[rtype], 0))
    return HEADER.pack(len(body), crc, rtype) + body


def small_put(crc_of: Checksum, meta: tuple, body: bytes, rtype: int = PUT) -> tuple[list[Any], int]:
    """``put_parts`` of an item that is one small frame ``body``: the same bytes, as
    ``[header and meta length, meta, body]`` (appended to the record buffer as they are: no
    joined copy, the checksum computed part by part) and the record's length."""
    packed = pack_plain(meta)
    n = len(packed)
    size = 4 + n + len(body)
    crc = crc_of(body, crc_of(packed, crc_of(TYPE_META.pack(rtype, n), 0)))
    return [HEADER_META.pack(size, crc, rtype, n), packed, body], HEADER.size + size


def put_parts(crc_of: Checksum, meta: list, frames: list[Any],
              rtype: int = PUT) -> tuple[list[Any], int]:
    """The parts of a ``PUT`` (or ``INPUT``) record (header and meta first, then the frames
    unchanged, for ``os.writev``) and its total length."""
    packed = pack_plain(meta)
    head = U32.pack(len(packed)) + packed
    crc = crc_of(head, crc_of(_TYPE_BYTE[rtype], 0))
    body_len = len(head)
    for frame in frames:
        crc = crc_of(frame, crc)
        body_len += memoryview(frame).nbytes
    if body_len > MAX_BODY:
        raise ValueError(f"an item of {body_len} bytes is too large for the journal (4 GiB)")
    return [HEADER.pack(body_len, crc, rtype) + head, *frames], HEADER.size + body_len


def array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` elements."""
    if n < 16:
        return bytes((0x90 | n,))
    return ARRAY16.pack(0xDC, n) if n < 1 << 16 else ARRAY32.pack(0xDD, n)


def puts_record(crc_of: Checksum, entries: list[bytes]) -> tuple[list[Any], int]:
    """The parts of a ``PUTS`` record of ``entries`` (each a put already packed, as
    ``pack_plain([jid, key, weight, consumer, extra, body])``) and its length: one header,
    one checksum over all."""
    body = array_header(len(entries)) + b"".join(entries)  # one copy: one checksum call
    crc = crc_of(body, crc_of(_TYPE_BYTE[PUTS], 0))
    return [HEADER.pack(len(body), crc, PUTS), body], HEADER.size + len(body)


@dataclass
class PutRecord:
    """A ``PUT`` read back: its meta and its frames (views of the segment's mapping)."""

    jid: int
    key: Any
    weight: int | float
    consumer: str | None
    frames: list[memoryview]
    slots: int
    extra: Any


def read_put(body: memoryview) -> PutRecord:
    """Parse a ``PUT`` body (``ValueError`` if it does not hold together)."""
    (meta_len,) = U32.unpack_from(body, 0)
    meta = unpack(body[4 : 4 + meta_len])
    if not (isinstance(meta, list) and len(meta) == 7):
        raise ValueError("malformed put meta")
    jid, key, weight, consumer, sizes, slots, extra = meta
    if not (isinstance(jid, int) and jid > 0 and isinstance(sizes, list) and sizes
            and isinstance(slots, int) and 0 <= slots < len(sizes)):
        raise ValueError("malformed put meta")
    frames, pos = [], 4 + meta_len
    for size in sizes:
        if not isinstance(size, int) or size < 0 or pos + size > len(body):
            raise ValueError("put frame sizes do not match the record")
        frames.append(body[pos : pos + size])
        pos += size
    if pos != len(body):
        raise ValueError("put frame sizes do not match the record")
    return PutRecord(jid, key, weight, consumer, frames, slots, extra)


def read_puts(body: memoryview) -> list[PutRecord]:
    """Parse a ``PUTS`` body (``ValueError`` if it does not hold together)."""
    entries = unpack(body)
    if not isinstance(entries, list):
        raise ValueError("malformed puts record")
    out = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 6):
            raise ValueError("malformed put in a puts record")
        jid, key, weight, consumer, extra, data = entry
        if not (isinstance(jid, int) and jid > 0 and isinstance(data, bytes)):
            raise ValueError("malformed put in a puts record")
        out.append(PutRecord(jid, key, weight, consumer, [memoryview(data)], 0, extra))
    return out


@dataclass
class Scan:
    """Where the data of a segment end: ``end`` (the offset after its last good record) and
    whether a torn record (not zeros) lies there."""

    end: int = 0
    torn: bool = False


def records(data: memoryview, crc_of: Checksum, start: int, scan: Scan) -> Iterator[tuple[int, memoryview]]:
    """The ``(type, body)`` records of a segment's ``data`` from ``start`` on, of any type
    (``RECORD_TYPES`` are the ones this version writes); ``scan`` says where they end and
    whether a torn record was found there."""
    pos, size = start, len(data)
    scan.end = pos
    while pos + HEADER.size <= size:
        body_len, crc, rtype = HEADER.unpack_from(data, pos)
        if rtype == END and body_len == 0 and crc == 0:
            scan.torn = not all_zeros(data[pos:size])  # the zeros after the last record?
            return
        end = pos + HEADER.size + body_len
        if end > size:
            scan.torn = True
            return
        body = data[pos + HEADER.size : end]
        if crc_of(body, crc_of(_TYPE_BYTE[rtype], 0)) != crc:
            scan.torn = True
            return
        yield rtype, body
        pos = end
        scan.end = pos
    if pos < size and not all_zeros(data[pos:size]):
        scan.torn = True  # a header cut short


def all_zeros(data: memoryview) -> bool:
    """Whether ``data`` holds only zero bytes (read ``ZEROS_CHECKED`` bytes at a time)."""
    for at in range(0, len(data), ZEROS_CHECKED):
        chunk = data[at : at + ZEROS_CHECKED].tobytes()
        if chunk.count(0) != len(chunk):
            return False
    return True
