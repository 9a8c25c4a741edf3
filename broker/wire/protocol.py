"""The wire protocol between clients (DEALER) and a broker (ROUTER), written once.

A message is ``[header, *frames]``.  The header is msgpack: a list of *records*, one per
operation (clients and the broker coalesce several operations into one message).  Record ``i``
owns the next ``nf`` frames.  See ``docs/protocol.md`` for the full description.

Every record is a ``msgspec.Struct`` defined here, and only here: a request class per operation
(tagged by ``op``), ``Reply`` for what the broker sends back, ``HelloInfo`` for the hello reply's
result, ``SyncAnswer`` for the binding table a replica hands another, ``BindAnswer`` for a
``bind`` redirect and ``LoadAnswer`` for a replica's load (``steal``).  Their attributes have
readable names; on the wire they are the documented short keys (``msgspec.field(name=...)``), as
maps, with fields at their defaults left out.  No other module spells a wire key.
``unpack_requests`` decodes and checks a client's header in one pass (types included); a record
that is not a valid request becomes a ``BadRecord`` carrying its ``ProtocolError``, so that the
broker can answer it while handling the other records of its message.
"""

from __future__ import annotations

import collections.abc
import struct
import sys
from typing import Annotated, Any, NamedTuple, cast

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType, field
from zchannel.broker.wire.argchecks import (
    MAX_KEY_DEPTH,
    MAX_KEY_PARTS,
    MAX_PEEK,
    MAX_TIMEOUT,
    MAX_WEIGHT,
)

PROTOCOL_VERSION = 1

# Request operations (client -> broker).
HELLO, BYE, HEARTBEAT = "hello", "bye", "hb"
PUT, GET, GET_BATCH = "put", "get", "get_batch"
PUTS = "puts"  # several puts in one record, answered by one record (docs/protocol.md)
GETS = "gets"  # several gets alike but for their keys in one record, each answered as a get
QSIZE, FULL, STATS, ACK, CANCEL, SHUTDOWN = "qsize", "full", "stats", "ack", "cancel", "shutdown"
PEEK = "peek"  # copies of head items, left in place (docs/protocol.md)
SHM_HELLO, SHM_RELEASE = "shm_hi", "shm_rel"  # same-host shared memory (docs/shm.md)
BIND, LEARN, SYNC = "bind", "learn", "sync"  # between replicas of a distributed channel
LOAD, RELEASE = "load", "release"  # moving empty keys between replicas (steal = true)
# Broker -> client records without a request id.
EXPIRED = "expired"
ITEMS = "items"  # small items for several gets in one record (docs/protocol.md)

# An item body of at most this many bytes (and no other frame) travels inside its record, as
# field ``b``, instead of as a frame of its own: one frame less to send and receive per small
# item on each side (docs/protocol.md).
INLINE_BODY = 512

# Default limits (the broker's are configurable).
MAX_HEADER_BYTES = 1 << 20
MAX_FRAMES = 65536
MAX_RECORDS = 4096
# Shared-memory slot references one put names at most (its ``sm``; ``shm/claims.py`` checks
# the same number): a longer list is refused by its length before any of it is decoded.
MAX_SLOT_REFS = 4096
# Puts in one ``puts`` record, gets one ``gets`` record stands for, gets answered in one
# ``items`` record, at most (a client sends
# at most MAX_OPS_PER_MESSAGE, 512, records in one message).
MAX_BATCH_PUTS = 4096
# Requests one message stands for, at most: a record each, but a ``puts`` or ``gets`` record
# counts every put or get it stands for (a client sends at most 512), so one header cannot
# hold hundreds of thousands of requests for the broker to answer in one go.
MAX_REQUESTS = 4096
# A get_batch reply carries its items' bodies inside its record (field ``bs``) when every item
# is one frame of at most INLINE_BODY bytes and they add up to at most this many bytes.
MAX_INLINE_BATCH_BYTES = 64 << 10

# Over ZeroMQ, which hands a message over only once all of it arrived, a message of at least
# NOTICE_BYTES of frames goes right behind a notice, a heartbeat naming its size (``nb``): its
# receiver does not take the sender for dead while it may still be arriving, ``arrival_s`` of
# its size past the notice, before the usual expiry starts (docs/protocol.md, "Heartbeats").
NOTICE_BYTES = 1 << 20
# The slowest crossing a receiver waits for, in bytes per second (~67 Mbit/s; a 1 GbE link
# moves ~120 MB/s): low, so that a slow link still gets its message across, and with the size
# it bounds how long a sender that died meanwhile is waited for.
FLOOR_BYTES_PER_S = 8 << 20
# The most bytes a notice may name (64 GiB: 8192 s at the floor rate, the longest such wait).
MAX_NOTICE_BYTES = 1 << 36
NoticeBytes = Annotated[int, Meta(ge=0, le=MAX_NOTICE_BYTES)]


def arrival_s(nbytes: int) -> float:
    """How long past its notice a message of ``nbytes`` may still be arriving: its crossing at
    ``FLOOR_BYTES_PER_S`` (the receiver's expiry comes on top)."""
    return min(nbytes, MAX_NOTICE_BYTES) / FLOOR_BYTES_PER_S


class ProtocolError(ValueError):
    """A message that does not follow the protocol: on the client, a reply from the broker that
    cannot be read or is not of the form its request asked for (the call raises it)."""


# -- records -------------------------------------------------------------------------------

# The numeric fields, checked while decoding (a value out of range is a ProtocolError: the
# record's error reply), with the bounds the clients check (argchecks.py).  NaN fails every
# bound; the upper bounds keep infinities out.
FrameCount = Annotated[int, Meta(ge=0)]
Count = Annotated[int, Meta(ge=0)]  # an index, id or count that is never negative
# a weight: an int or a finite float in [0, 2**53]; a get_batch target the same, > 0
Weight = Annotated[int, Meta(ge=0, le=MAX_WEIGHT)] | Annotated[float, Meta(ge=0, le=MAX_WEIGHT)]
Target = Annotated[int, Meta(ge=1, le=MAX_WEIGHT)] | Annotated[float, Meta(gt=0, le=MAX_WEIGHT)]
# a timeout in seconds: a finite number >= 0, or nil (no deadline)
Timeout = Annotated[float, Meta(ge=0, le=MAX_TIMEOUT)] | None


class Request(Struct, tag_field="op", omit_defaults=True, kw_only=True):
    """A client's request: ``op`` (the tag, one subclass per operation), ``id`` (int, chosen by
    the client) and ``nf``, the frames after the header that belong to it.  Fields the
    operation does not define are ignored."""

    id: int
    nf: FrameCount = 0


ProducerId = Annotated[bytes, Meta(min_length=8, max_length=64)]
Sequence = Annotated[int, Meta(ge=0)]


class Hello(Request, tag=HELLO):
    id: Any = 0  # a hello without an int id is answered under id 0
    identity: Any = field(default=None, name="ident")  # consumer id "group:rank"; non-str: nil
    version: Any = field(default=None, name="v")  # checked by the broker (error names both)
    # retry-safe puts: the connection's producer id, the same across its reconnects; its puts'
    # ids are then sequence numbers the broker stores each at most once (docs/protocol.md)
    producer: ProducerId | None = field(default=None, name="pr")
    # the client reads ``items`` records (the broker may answer several of its gets in one)
    # and get_batch replies whose small items are inline (``bs``)
    items: bool = field(default=False, name="it")


class Bye(Request, tag=BYE):
    pass


class Heartbeat(Request, tag=HEARTBEAT):
    # a notice: the frame bytes of the message that follows it at once (``NOTICE_BYTES``)
    next_bytes: NoticeBytes | None = field(default=None, name="nb")


# a put's shared-memory slot references (at least one), each checked by the broker
# (``shm/claims.py``)
SlotRefs = Annotated[list, Meta(min_length=1, max_length=MAX_SLOT_REFS)]


class Put(Request, tag=PUT):
    key: Any = field(default=None, name="k")
    weight: Weight = field(default=0, name="w")
    timeout: Timeout = field(default=None, name="t")
    nowait: bool = field(default=False, name="nw")
    sizes: list[Count] | None = field(default=None, name="fs")  # of all frames, body included
    slots: SlotRefs | None = field(default=None, name="sm")  # shared-memory slot references
    body: bytes | UnsetType = field(default=UNSET, name="b")  # a small item's body inline
    seq: Sequence | UnsetType = field(default=UNSET, name="sq")  # a retry: the put it repeats

    def sequence(self) -> int:
        """The put's producer sequence: ``seq`` for a retry, else its request id."""
        seq = self.seq
        return self.id if seq is UNSET else seq


class PutBatch(Request, tag=PUTS):
    """Consecutive puts of one client in one record: each a whole ``Put`` record (its own id,
    key, weight, sequence...), owning the next ``nf`` of the batch's frames in turn; ``nf``
    of the batch is the sum of theirs.  The broker handles them in order, as the same records
    sent one by one, and answers the batch's ``id`` with ``r``: the ids of the puts stored at
    once (``BatchAnswer``); a put that waits for room or fails is answered under its own id."""

    puts: Annotated[list[Put], Meta(min_length=1, max_length=MAX_BATCH_PUTS)] = field(
        default_factory=list, name="p")


class Get(Request, tag=GET):
    key: Any = field(default=None, name="k")
    timeout: Timeout = field(default=None, name="t")
    nowait: bool = field(default=False, name="nw")
    ack: bool = False


class GetRun(Request, tag=GETS):
    """Several gets of one client with the same options, in one record: ``g`` the gets' own
    request ids (distinct, none of them the record's ``id``), all of key ``k``, or each of its
    own key: ``ks``, one key per id (then ``k`` is nil).  The broker handles them in order,
    each exactly as a ``get`` record with that id and key (parked, served, timed out,
    cancelled and answered under its own id), then answers the record's ``id`` with an empty
    success; an error on ``id`` means the record was refused whole and none of its gets was
    handled."""

    key: Any = field(default=None, name="k")
    timeout: Timeout = field(default=None, name="t")
    nowait: bool = field(default=False, name="nw")
    ack: bool = False
    ids: Annotated[list[Count], Meta(min_length=1, max_length=MAX_BATCH_PUTS)] = field(
        default_factory=list, name="g")
    keys: Annotated[list[Any], Meta(min_length=1, max_length=MAX_BATCH_PUTS)] | None = field(
        default=None, name="ks")


class GetBatch(Request, tag=GET_BATCH):
    key: Any = field(default=None, name="k")
    target: Target | None = field(default=None, name="tw")  # required: nil is refused
    timeout: Timeout = field(default=None, name="t")
    nowait: bool = field(default=False, name="nw")


class QSize(Request, tag=QSIZE):
    key: Any = field(default=None, name="k")
    consumer: Any = field(default=None, name="c")  # checked by the broker: a TypeError names it


class Full(Request, tag=FULL):
    key: Any = field(default=None, name="k")
    consumer: Any = field(default=None, name="c")  # checked by the broker: a TypeError names it


class Stats(Request, tag=STATS):
    exclude_self: bool = field(default=False, name="xs")  # an observer: not counted


class Peek(Request, tag=PEEK):
    key: Any = field(default=None, name="k")
    count: Annotated[int, Meta(ge=1, le=MAX_PEEK)] = field(default=1, name="n")
    consumer: Any = field(default=None, name="c")  # checked by the broker: a TypeError names it


class Ack(Request, tag=ACK):
    lease: Count | None = None


class Cancel(Request, tag=CANCEL):
    request_id: int | None = field(default=None, name="rid")


class Shutdown(Request, tag=SHUTDOWN):
    token: Any = None  # any other value is refused as a wrong token (PermissionError)


class ShmHello(Request, tag=SHM_HELLO):
    token: Any = field(default=None, name="tok")  # not bytes: no proof (unanswered)  # the probe segment's token
    pid: Any = field(default=None, name="cpid")  # the client's process id, as it sees it
    pid_ns: Any = field(default=None, name="cpidns")  # its pid namespace (None: cannot tell)


class ShmRelease(Request, tag=SHM_RELEASE):
    holds: list[Count] | None = field(default=None, name="h")  # hold ids the client let go


class Bind(Request, tag=BIND):
    key: Any = field(default=None, name="k")
    node: Any = None  # checked by the binding table: an error names it
    replica: Count | None = None
    sender: Count | None = field(default=None, name="from")  # the asking replica's index


class Learn(Request, tag=LEARN):
    entries: list | None = field(default=None, name="b")  # [[key, replica], ...]
    force: bool = False
    sender: Count | None = field(default=None, name="from")


class Sync(Request, tag=SYNC):
    sender: Count | None = field(default=None, name="from")
    # the asking replica's channel (a peer of another channel refuses it: a cluster file that
    # gave two channels one address); nil from peers that do not send it
    channel: Annotated[str, Meta(max_length=64)] | None = field(default=None, name="ch")


class Load(Request, tag=LOAD):
    """The binder asks a replica for its ``LoadAnswer`` (``steal = true`` only)."""


class Release(Request, tag=RELEASE):
    """The binder asks a replica to give one empty key to replica ``to`` (``steal = true``)."""

    to: Count | None = None


REQUEST_TYPES: tuple[type[Request], ...] = (
    Hello, Bye, Heartbeat, Put, PutBatch, Get, GetRun, GetBatch, QSize, Full, Stats, Peek, Ack,
    Cancel, Shutdown, ShmHello, ShmRelease, Bind, Learn, Sync, Load, Release,
)
_AnyRequest = Hello | Bye | Heartbeat | Put | PutBatch | Get | GetRun | GetBatch | QSize | Full | \
    Stats | Peek | Ack | Cancel | Shutdown | ShmHello | ShmRelease | Bind | Learn | Sync | Load | Release
# the requests on one key, which a replica that gave the key away answers with ``KeyMoved``
KEYED_TYPES = (Put, Get, GetBatch, QSize, Full, Peek)


def op_of(rec: Request) -> str:
    """The operation name of a request (its ``op`` on the wire)."""
    return cast(str, rec.__struct_config__.tag)  # every request's tag is its op name


# One get answered inside an ``items`` record: the get's request id, its item's inline body
# and its lease (nil without ``ack``).
ItemEntry = tuple[Count, Annotated[bytes, Meta(max_length=INLINE_BODY)], Count | None]
# The small item bodies of a get_batch reply, in order, inside its record.
InlineBodies = Annotated[list[Annotated[bytes, Meta(max_length=INLINE_BODY)]],
                         Meta(min_length=1, max_length=MAX_BATCH_PUTS)]


class Reply(Struct, omit_defaults=True, kw_only=True):
    """A record from the broker: the reply to request ``id`` (an error ``e``, or a result
    ``r`` and/or ``nf`` frames), or, without ``id``, the broker's ``hb`` / ``expired``, or an
    ``items`` record: ``i``, several gets each answered with its small item (``ItemEntry``),
    owning no frame.  A get_batch reply of small items carries their bodies in ``bs``
    (``InlineBodies``), with no frame and no ``n``.  An ``hb`` with ``nb`` is a notice
    (``NOTICE_BYTES``).  Decoded leniently (unknown fields ignored; the client checks what it
    uses), but an ``i`` entry that is not an ``ItemEntry``, a ``bs`` that is not
    ``InlineBodies`` or an ``nb`` that is not ``NoticeBytes`` makes the header malformed."""

    op: str | None = None  # only on records without id
    id: int | None = None
    error: list | None = field(default=None, name="e")  # [type, message, extra]
    result: Any = field(default=None, name="r")
    nf: FrameCount = 0
    counts: list[int] | None = field(default=None, name="n")  # frames per item (get_batch, peek)
    body: bytes | UnsetType = field(default=UNSET, name="b")  # a get's small item inline
    bodies: InlineBodies | None = field(default=None, name="bs")  # a get_batch's small items
    lease: int | None = None
    slots: list | None = field(default=None, name="sm")  # per item: nil or shared-memory entries
    weights: list | None = field(default=None, name="ws")  # peek: the items' weights
    items: Annotated[list[ItemEntry], Meta(max_length=MAX_BATCH_PUTS)] | None = field(
        default=None, name="i")  # op ``items`` only
    # op ``hb`` only, a notice: the frame bytes of the message that follows it at once
    next_bytes: NoticeBytes | None = field(default=None, name="nb")


BROKER_HEARTBEAT = Reply(op=HEARTBEAT)
CLIENT_HEARTBEAT = Heartbeat(id=0)
BROKER_EXPIRED = Reply(op=EXPIRED)


def client_notice(nbytes: int) -> Heartbeat:
    """A client's notice of a message of ``nbytes`` of frames it sends next (``NOTICE_BYTES``)."""
    return Heartbeat(id=0, next_bytes=min(nbytes, MAX_NOTICE_BYTES))


def broker_notice(nbytes: int) -> Reply:
    """The broker's notice of a message of ``nbytes`` of frames it sends next."""
    return Reply(op=HEARTBEAT, next_bytes=min(nbytes, MAX_NOTICE_BYTES))


MIN_HEARTBEAT_S = 0.001  # the shortest heartbeat interval a client takes from a broker


class HelloInfo(Struct, kw_only=True):
    """The result of a ``hello`` reply: the broker's parameters (``hb`` in seconds, ``liveness``
    in intervals); ``replica``, ``node`` and ``replicas`` only from a replica of a distributed
    channel (left out otherwise)."""

    name: str | None = None
    pid: int | None = None
    # at least a millisecond: a client's I/O thread wakes every ``hb`` (a broker's own
    # ``heartbeat_interval`` is far above it; 1e-9 spun a client's CPU)
    hb: Annotated[float, Meta(ge=MIN_HEARTBEAT_S, le=sys.float_info.max)] = 1.0
    liveness: Annotated[int, Meta(ge=1)] = 3
    deals: bool = False
    maxsize: Count = 0
    max_message_bytes: Count | None = None
    max_frames: Count | None = None  # frames after a message's header (nil: an older broker)
    shm: Any = None  # read by shm_offer: a malformed offer turns shared memory off, no more  # {probe, prefix, threshold, pool} or nil (docs/shm.md)
    replica: int | UnsetType = UNSET
    node: str | UnsetType = UNSET
    replicas: list | UnsetType = UNSET  # [{node, address, hostnames}, ...] in replica order


class ShmOffer(Struct, kw_only=True):
    """The ``shm`` field of the hello reply: the probe segment a client proves its host with,
    the segment name prefix, the size threshold and the pool budget (docs/shm.md)."""

    probe: str | None = None
    prefix: str | None = None
    threshold: int | None = None
    pool: int | None = None


def shm_offer(value: Any) -> ShmOffer | None:
    """The ``ShmOffer`` of a hello reply's ``shm`` field (None: off, or not a map)."""
    try:
        return msgspec.convert(value, ShmOffer)
    except msgspec.ValidationError:
        return None


def hello_info(result: Any) -> HelloInfo:
    """The ``HelloInfo`` of a hello reply's result (the defaults for one that is not a map)."""
    try:
        return msgspec.convert(result, HelloInfo)
    except msgspec.ValidationError:
        return HelloInfo()


class SyncAnswer(Struct, kw_only=True):
    """A replica's answer to ``sync``: whether it is ready, and its binding table."""

    ready: bool = False
    entries: list = field(default_factory=list, name="b")  # [[key, replica], ...]


def sync_answer(result: Any) -> SyncAnswer:
    try:
        return msgspec.convert(result, SyncAnswer)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"malformed sync answer: {exc}") from None


class BindAnswer(Struct, omit_defaults=True, kw_only=True):
    """A ``bind`` answer from a replica that does not decide bindings now (a replica that does
    answers with the replica index alone): ``binder``, the replica to ask instead, or
    ``retry``, why to ask again shortly (it is joining)."""

    binder: int | UnsetType = UNSET
    retry: str | UnsetType = UNSET

    def redirect(self) -> int | None:
        """The replica index to ask instead, or None (a ``retry`` answer, or no index)."""
        binder = self.binder
        return binder if isinstance(binder, int) and not isinstance(binder, bool) else None


def bind_answer(result: Any) -> BindAnswer | None:
    """The ``BindAnswer`` of a ``bind`` result that is one, or a map (None for anything else)."""
    if isinstance(result, BindAnswer):
        return result
    if not isinstance(result, dict):
        return None
    try:
        return msgspec.convert(result, BindAnswer)
    except msgspec.ValidationError:
        return None


class LoadAnswer(Struct, kw_only=True):
    """A replica's answer to ``load``: ``backlog``, the items it holds queued, and ``starved``,
    the gets parked on its empty keys."""

    backlog: Annotated[int, Meta(ge=0)] = 0
    starved: Annotated[int, Meta(ge=0)] = 0


def load_answer(result: Any) -> LoadAnswer | None:
    """The ``LoadAnswer`` of a ``load`` result (None for one that is not a valid answer)."""
    if type(result) is not dict:
        return None
    try:
        return msgspec.convert(result, LoadAnswer)  # strict: a bool is not a count
    except msgspec.ValidationError:
        return None


def batch_answer(result: Any, ids: frozenset[int]) -> list[int]:
    """The put ids a ``puts`` reply's result says were stored, each one of ``ids`` (the
    batch's puts) at most once; ``ProtocolError`` for a result that is not such a list."""
    if type(result) is not list or len(result) > len(ids):
        raise ProtocolError("a puts reply's result is a list of at most as many ids as puts")
    seen: set[int] = set()
    for rid in result:
        if type(rid) is not int or rid not in ids or rid in seen:
            raise ProtocolError(f"a puts reply names {rid!r}, which is not a put of its batch "
                                "(or names it twice)")
        seen.add(rid)
    return result


class BadRecord(NamedTuple):
    """A record of a well-formed message that is not a valid request (or reply): ``id`` is its
    int id (None without one: a request is then dropped), ``error`` says why (a request's is
    answered as a ``ValueError``, a reply's fails the request it answers)."""

    op: Any
    id: int | None
    nf: int
    error: ProtocolError
    slots: Any = None  # a put's ``sm`` as it came (unchecked): its slots go back to the producer


# -- encoding and decoding ----------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(list[_AnyRequest])
_replies = msgspec.msgpack.Decoder(list[Reply])
_one_request = msgspec.msgpack.Decoder(_AnyRequest)
_one_reply = msgspec.msgpack.Decoder(Reply)


class _RecordHead(Struct):
    """What ``_record_by_record`` reads of a record that is not a valid request or reply: the
    raw msgpack of four fields (empty when absent), each decoded only as the type it must
    have (``_head_field``); the other fields are skipped, whatever they hold.  Passing over a
    value builds nothing, so a field of any shape costs no more than its bytes."""

    op: msgspec.Raw = msgspec.Raw()
    id: msgspec.Raw = msgspec.Raw()
    nf: msgspec.Raw = msgspec.Raw()
    sm: msgspec.Raw = msgspec.Raw()


_record_head = msgspec.msgpack.Decoder(_RecordHead)
_raw_records = msgspec.msgpack.Decoder(list[msgspec.Raw])
_head_text = msgspec.msgpack.Decoder(str)
_head_int = msgspec.msgpack.Decoder(int)  # strict: a bool or a float is not an int
_head_slots = msgspec.msgpack.Decoder(SlotRefs)

# The first byte of a msgpack array of up to 15 elements (its low 4 bits the count), of one
# whose count follows in 2 bytes, and in 4 bytes.
_FIXARRAY, _ARRAY16, _ARRAY32 = 0x90, 0xDC, 0xDD
_COUNT16, _COUNT32 = struct.Struct(">xH"), struct.Struct(">xI")


def pack_header(records: list) -> bytes:
    """A header of request or reply records (plain maps are packed as they are)."""
    return _encoder.encode(records)


def unpack_requests(data: bytes | memoryview, nframes: int,
                    max_bytes: int = MAX_HEADER_BYTES) -> collections.abc.Sequence[Request | BadRecord]:
    """Decode and check a client's header against the ``nframes`` frames that follow it:
    ``ProtocolError`` for a message to drop whole, else its records, each a ``Request`` or a
    ``BadRecord``.  A header over ``max_bytes``, or declaring more than ``MAX_RECORDS``
    records, is refused before any of it is decoded."""
    size = len(data)
    if size > max_bytes:
        raise ProtocolError(f"header of {size} bytes exceeds the header limit ({max_bytes})")
    if size > MAX_RECORDS:  # room for more records than allowed (each takes a byte at least)
        count = record_count(data)
        if not 0 < count <= MAX_RECORDS:
            raise ProtocolError(f"a header is a non-empty list of at most {MAX_RECORDS} "
                                f"records (this one declares {count})")
    records: collections.abc.Sequence[Request | BadRecord]
    try:
        records = _requests.decode(data)
    except msgspec.ValidationError:  # some record is not a valid request: find which
        records = _record_by_record(data, _one_request)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed header: {exc}") from None
    except RecursionError:  # a field nested about 1,000 deep (msgspec counts its recursion)
        raise ProtocolError("malformed header: nested too deeply") from None
    if not records:
        raise ProtocolError("a header is a non-empty list of records")
    _check_frames(records, nframes)
    requests = requests_in(records)
    if requests > MAX_REQUESTS:
        raise ProtocolError(f"a header stands for {requests} requests, more than "
                            f"{MAX_REQUESTS} (puts and gets of batch records counted each)")
    return records


def record_count(data: bytes | memoryview) -> int:
    """The records a header declares, read from the length of the msgpack array it must be
    (its first 1, 3 or 5 bytes), before anything of it is decoded; ``ProtocolError`` for a
    header that does not start as an array."""
    if not len(data):
        raise ProtocolError("a header is a non-empty list of records (this one is empty)")
    first = data[0]
    try:
        if first & 0xF0 == _FIXARRAY:
            return first & 0x0F
        if first == _ARRAY16:
            return _COUNT16.unpack_from(data)[0]
        if first == _ARRAY32:
            return _COUNT32.unpack_from(data)[0]
    except struct.error:
        raise ProtocolError("malformed header: cut short in its record count") from None
    raise ProtocolError("a header is a non-empty list of records (this one is not a msgpack "
                        "array)")


def requests_in(records: collections.abc.Sequence[Any]) -> int:
    """The requests ``records`` stand for: one each, a ``puts`` or ``gets`` record one per put
    or get of it."""
    total = len(records)
    for record in records:
        kind = type(record)
        if kind is PutBatch:
            total += len(record.puts) - 1
        elif kind is GetRun:
            total += len(record.ids) - 1
    return total


def _check_frames(records: collections.abc.Sequence[Any], nframes: int) -> None:
    """``ProtocolError`` unless the records' frame counts add up to the message's frames."""
    total = 0
    for record in records:
        total += record.nf
    if total != nframes:
        raise ProtocolError(f"header declares {total} frames but the message has {nframes}")


def _record_by_record(data: bytes | memoryview, one: msgspec.msgpack.Decoder) -> list[Any]:
    """The slow path of ``unpack_requests`` and ``unpack_replies``: the message cut into its
    records' raw msgpack, then each record decoded by ``one`` on its own; one that is not valid
    (a wrong type in any field, a map with int keys, a malformed extension value) is a
    ``BadRecord`` with its ``op``, ``id`` and ``nf`` (read by ``_RecordHead``), the others are
    handled as usual."""
    try:
        return _each_record(data, one)
    except RecursionError:  # a field nested about 1,000 deep (msgspec counts its recursion)
        raise ProtocolError("malformed header: nested too deeply") from None


def _each_record(data: bytes | memoryview, one: msgspec.msgpack.Decoder) -> list[Any]:
    """``_record_by_record`` but for a record nested too deeply (``RecursionError``)."""
    try:
        raws = _raw_records.decode(data)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"malformed header: {exc}") from None
    if not raws or len(raws) > MAX_RECORDS:
        raise ProtocolError("a header is a non-empty list of records")
    out: list[Any] = []
    for raw in raws:
        try:
            out.append(one.decode(raw))
            continue
        except msgspec.ValidationError as exc:
            # its text, not the exception: that would hold this frame (and the message's
            # buffer) in a reference cycle until the next garbage collection
            why = str(exc)
        try:
            head = _record_head.decode(raw)
        except msgspec.MsgspecError:
            raise ProtocolError("a header record is a map") from None
        nf = _head_field(head.nf, _head_int, 0)
        if nf is None or nf < 0:
            raise ProtocolError("record field nf must be an int >= 0")
        op = _head_field(head.op, _head_text, None)
        out.append(BadRecord(op, _head_field(head.id, _head_int, None), nf,
                             ProtocolError(f"invalid {op!r} record: {why}"),
                             _head_field(head.sm, _head_slots, None) if op == PUT else None))
    return out


def _head_field(raw: msgspec.Raw, decoder: msgspec.msgpack.Decoder, absent: Any) -> Any:
    """A ``_RecordHead`` field decoded by ``decoder``: ``absent`` if the record has none, None
    if it is not of the decoder's type (refused by its first byte or length: nothing of a
    value of another type is built)."""
    if not raw:
        return absent
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError:
        return None


def unpack_replies(data: bytes, nframes: int) -> collections.abc.Sequence[Reply | BadRecord]:
    """Decode a header from the broker against the ``nframes`` frames that follow it:
    ``ProtocolError`` if it is not a list of maps whose frame counts add up to ``nframes``,
    else its records, a ``BadRecord`` for each that is not a valid ``Reply``."""
    records: collections.abc.Sequence[Reply | BadRecord]
    try:
        records = _replies.decode(data)
    except msgspec.ValidationError:
        records = _record_by_record(data, _one_reply)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"malformed reply header: {exc}") from None
    _check_frames(records, nframes)
    return records


def key_from_wire(value: Any) -> Any:
    """Keys travel as msgpack, tuples as arrays (a key is never a list): arrays become tuples,
    down to the nesting a key may have (deeper arrays stay lists, which ``check_key`` refuses).
    ``ValueError`` as soon as the arrays hold more than ``MAX_KEY_PARTS`` elements in all,
    before the rest is converted."""
    if not isinstance(value, list):
        return value
    return _tuple_from_wire(value, 0, [MAX_KEY_PARTS])


def _tuple_from_wire(value: Any, depth: int, left: list[int]) -> Any:
    if isinstance(value, list) and depth <= MAX_KEY_DEPTH:
        left[0] -= len(value)
        if left[0] < 0:
            raise ValueError(f"a tuple key may have at most {MAX_KEY_PARTS} parts in all (the "
                             "parts of tuples inside it counted)")
        return tuple(_tuple_from_wire(v, depth + 1, left) for v in value)
    return value
