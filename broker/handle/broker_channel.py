"""``BrokerChannel``: the handle of a channel served by one broker process.

Every operation is a request to the broker over this process's connection to it
(``connection/connection.py``), which all the handles of the process to that broker share (``connection/sharing.py``);
``async_op=True`` returns a ``Work`` handle instead of waiting.  Replies become items in the
waiting thread (the converters at the end of this module), not in the connection's I/O thread.

What a handle is apart from its operations (its share of the connection, ``close``,
``shutdown``, pickling) is ``ChannelHandle``'s (``handle/base.py``).  The public ``Channel``
(``handle/channel.py``) is this class plus ``Channel.create``/``Channel.connect``,
which start the broker (``server/starting.py``) or find it.  ``LocalChannel`` (``handle/local.py``: an
in-process channel) and ``DistributedChannel`` (``handle/distributed.py``: one ``BrokerChannel`` per
replica) subclass it to reuse its operations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal, cast, overload

import numpy as np
from zchannel.broker.connection.connection import Connection
from zchannel.broker.connection.requestqueue import Convert
from zchannel.broker.connection.waiting import withdraw
from zchannel.broker.connection.work import _DONE, CancelledError, Delivery, Work
from zchannel.broker.errors import BrokerUnavailable, ChannelNotFound, UndecodableItems
from zchannel.broker.handle.base import ChannelHandle
from zchannel.broker.handle.retries import InDoubtPuts
from zchannel.broker.shm.client import client_submit as shm_submit
from zchannel.broker.shm.client import client_undo as shm_undo
from zchannel.broker.wire import codec
from zchannel.broker.wire.argchecks import (
    check_consumer,
    check_copy,
    check_flag,
    check_key,
    check_peek_count,
    check_target_weight,
    check_timeout,
    check_weight,
)
from zchannel.broker.wire.protocol import (
    INLINE_BODY,
    UNSET,
    Ack,
    Full,
    Get,
    GetBatch,
    HelloInfo,
    Peek,
    ProtocolError,
    Put,
    QSize,
    Reply,
    Request,
    Stats,
    op_of,
)
from zchannel.broker.wire.refusals import refused_at

log = logging.getLogger("zchannel.client")

DEFAULT_KEY = "default_queue"
"""The key of operations that name none."""


class BrokerChannel(ChannelHandle):
    """A handle on a named channel: per-key FIFO queues served by one broker process (see the
    module docstring; users get one from ``Channel.create``/``Channel.connect``).  A handle may
    be pickled to other processes.  The behaviour of every operation is described in
    ``docs/channel.md``; ``Channel`` says what ``created``, ``repr()`` and ``str()`` are.
    """

    _in_doubt: InDoubtPuts | None = None  # puts that raised without an answer (retries.py)

    # -- requests ----------------------------------------------------------------------------

    def _submit(self, rec: Request, item: Any = None, *, has_item: bool = False,
                copy: bool | None = None, wait: bool = False) -> Work:
        share = self._acquired_for(rec, async_op=not wait)
        conn = share.conn
        frames: list[Any] = []
        retried = None
        if has_item:
            if not isinstance(rec, Put):
                raise TypeError(f"only a put carries an item, not {op_of(rec)!r}")
            frames, retried = self._put_frames(rec, item, conn)
        kind = type(rec)
        convert = _converter(rec, copy, conn) if kind is not Put else None
        cancellable = kind is Put or kind is Get or kind is GetBatch
        try:
            if wait:
                work = conn.call(rec, frames, convert, cancellable, owner=share)
            else:
                work = conn.request(rec, frames, convert, cancellable, owner=share,
                                    async_op=True)
        except BaseException:
            _not_submitted(self, rec, item, share)
            raise
        if kind is Put:
            if retried is not None and self._in_doubt is not None:
                self._in_doubt.discard(retried)  # sent: its retry's outcome decides
            if work._state != _DONE:  # in doubt if it fails without an answer
                work._on_error = (self._put_failed, rec, item, conn)
        return work

    def _put_frames(self, rec: Put, item: Any, conn: Connection) -> tuple[list[Any], Any]:
        """Encode ``item`` into ``rec`` (inline body, frames, shared-memory slots); the frames
        to send and the in-doubt put ``rec`` repeats (None: a new put)."""
        frames: list[Any] = []
        retried = None
        if self._in_doubt:  # an earlier put raised without an answer: is this its retry?
            retried = self._in_doubt.match(rec.key, rec.weight, item, conn)
            if retried is not None:
                rec.seq = retried.seq  # sent under the sequence of the put it repeats
        info = conn.broker_info
        limit, max_frames = info.max_message_bytes, info.max_frames
        pool = conn.shm.pool if conn.shm is not None else None
        try:
            if limit and pool is not None and type(item) not in codec.FLAT_TYPES:
                # its size (and frames) before any of its arrays is copied into a slot (the
                # pool's class of a large array would be made and faulted in first)
                _check_limits(info, *codec.encoded_extent(item, pool.threshold))
            body, buffers, refs = shm_submit(conn, item, rec)  # refs: shm slots or None
        except TypeError as exc:  # a value that cannot travel: say where it is in the item
            raise refused_at(exc, item) from None
        if not buffers and not refs and len(body) <= INLINE_BODY:
            rec.body = body  # a small item rides in its record (no frame)
            sizes = [len(body)]
        elif buffers:
            frames = [body, *buffers]
            rec.sizes = sizes = [len(body), *(memoryview(b).nbytes for b in buffers)]
        else:
            frames = [body]
            rec.sizes = sizes = [len(body)]
        if refs:
            rec.slots = refs
        if limit or max_frames and len(buffers) >= max_frames:
            try:  # slot bytes count: a consumer on another host receives them as frames
                _check_limits(info, sum(sizes) + sum(ref[2] for ref in refs or ()), len(buffers))
            except ValueError:
                shm_undo(conn, refs)  # its slots go back to the pool
                raise
        return frames, retried

    # put and get_batch: None / the items when waiting, a Work with async_op=True (the last
    # overload takes a bool known only at run time)
    @overload
    def put(self, item: Any, weight: int | float = ..., key: Any = ...,
            async_op: Literal[False] = ..., timeout: float | None = ...) -> None: ...
    @overload
    def put(self, item: Any, weight: int | float, key: Any, async_op: Literal[True],
            timeout: float | None = ...) -> Work: ...
    @overload
    def put(self, item: Any, weight: int | float = ..., key: Any = ..., *,
            async_op: Literal[True], timeout: float | None = ...) -> Work: ...
    @overload
    def put(self, item: Any, weight: int | float = ..., key: Any = ...,
            async_op: bool = ..., timeout: float | None = ...) -> Work | None: ...

    def put(self, item: Any, weight: int | float = 0, key: Any = DEFAULT_KEY,
            async_op: bool = False, timeout: float | None = None) -> Work | None:
        """Enqueue ``item`` under ``key``; blocks while a target queue is full.

        ``weight``: an int or finite float >= 0 (``ValueError`` otherwise); it never changes
        order.  ``key``: a str, int, bytes or tuple of those (``TypeError`` otherwise).

        Raises ``TimeoutError`` if not admitted by ``timeout``, ``TypeError`` for an item that
        cannot travel, ``HookError`` if a hook fails, ``BrokerUnavailable`` if the broker is gone.
        """
        rec = Put(id=0, key=check_key(key), weight=check_weight(weight),
                  timeout=None if timeout is None else check_timeout(timeout))
        if async_op is not False and async_op is not True:
            async_op = check_flag(async_op, "async_op")
        work = self._submit(rec, item, has_item=True, wait=not async_op)
        if async_op:
            return work
        on_error = work._on_error  # (fn, rec, item, conn) while it may still fail
        try:
            _wait_or_withdraw(work)
            return None
        except BaseException as exc:
            if on_error is not None and exc is not work._value \
                    and not isinstance(work._value, CancelledError):  # not withdrawn
                self._note_in_doubt(rec, item, on_error[3])  # interrupted: maybe stored
            raise

    def put_nowait(self, item: Any, weight: int | float = 0, key: Any = DEFAULT_KEY) -> None:
        """Enqueue without waiting; ``QueueFull`` (nothing enqueued) if a target is full: it
        subclasses both ``asyncio.QueueFull`` and ``queue.Full``."""
        rec = Put(id=0, key=check_key(key), weight=check_weight(weight), nowait=True)
        self._submit(rec, item, has_item=True, wait=True).wait()

    # -- retry-safe puts (handle/retries.py, docs/guarantees.md) ------------------------------

    def _put_failed(self, rec: Put, item: Any, conn: Any, error: BaseException) -> None:
        """A put's error was seen: without an answer from the broker (``BrokerUnavailable``)
        it is in doubt, and an equal put is taken as its retry."""
        if isinstance(error, BrokerUnavailable) and not isinstance(error, ChannelNotFound):
            self._note_in_doubt(rec, item, conn)

    def _note_in_doubt(self, rec: Put, item: Any, conn: Any) -> None:
        """The put ``rec`` of ``item``, sent over ``conn``, may be stored without its caller
        knowing (no answer came: the broker went away, or the caller was interrupted while it
        waited): an equal put on this handle is taken as its retry, under its sequence."""
        if self._in_doubt is None:
            with self._conn_lock:
                if self._in_doubt is None:
                    self._in_doubt = InDoubtPuts()
        try:
            self._in_doubt.add(rec.key, rec.weight, item, rec.sequence(), conn)
        except Exception:  # the put's own error (or the interruption) is what the caller sees
            log.exception("could not note a put in doubt; its retry is a new put")

    # get: the item (a Delivery with ack=True) when waiting, a Work with async_op=True
    @overload
    def get(self, key: Any = ..., async_op: Literal[False] = ..., timeout: float | None = ...,
            *, ack: Literal[True], copy: bool | None = ...) -> Delivery: ...
    @overload
    def get(self, key: Any = ..., async_op: Literal[False] = ..., timeout: float | None = ...,
            *, ack: bool = ..., copy: bool | None = ...) -> Any: ...
    @overload
    def get(self, key: Any, async_op: Literal[True], timeout: float | None = ..., *,
            ack: bool = ..., copy: bool | None = ...) -> Work: ...
    @overload
    def get(self, key: Any = ..., *, async_op: Literal[True], timeout: float | None = ...,
            ack: bool = ..., copy: bool | None = ...) -> Work: ...
    @overload
    def get(self, key: Any = ..., async_op: bool = ..., timeout: float | None = ..., *,
            ack: bool = ..., copy: bool | None = ...) -> Any: ...

    def get(self, key: Any = DEFAULT_KEY, async_op: bool = False, timeout: float | None = None,
            *, ack: bool = False, copy: bool | None = None) -> Any:
        """Remove and return the head of this consumer's queue for ``key`` (its private and the
        shared queue's items in put order, then a steal), waiting while there is none.
        ``ack=True`` returns a ``Delivery``."""
        rec = Get(id=0, key=check_key(key),
                  timeout=None if timeout is None else check_timeout(timeout),
                  ack=ack if ack is False else check_flag(ack, "ack"))
        if async_op is not False and async_op is not True:
            async_op = check_flag(async_op, "async_op")
        work = self._submit(rec, copy=copy if copy is None else check_copy(copy),
                            wait=not async_op)
        return work if async_op else _wait_or_withdraw(work)

    @overload
    def get_nowait(self, key: Any = ..., *, ack: Literal[True], copy: bool | None = ...) -> Delivery: ...
    @overload
    def get_nowait(self, key: Any = ..., *, ack: bool = ..., copy: bool | None = ...) -> Any: ...

    def get_nowait(self, key: Any = DEFAULT_KEY, *, ack: bool = False, copy: bool | None = None) -> Any:
        """Like ``get`` without waiting; ``QueueEmpty`` when nothing is available: it subclasses
        both ``asyncio.QueueEmpty`` and ``queue.Empty``."""
        rec = Get(id=0, key=check_key(key), nowait=True,
                  ack=ack if ack is False else check_flag(ack, "ack"))
        return self._submit(rec, copy=copy if copy is None else check_copy(copy),
                            wait=True).wait()

    @overload
    def get_batch(self, target_weight: int | float, key: Any = ...,
                  async_op: Literal[False] = ..., timeout: float | None = ..., *,
                  copy: bool | None = ...) -> list[Any]: ...
    @overload
    def get_batch(self, target_weight: int | float, key: Any, async_op: Literal[True],
                  timeout: float | None = ..., *, copy: bool | None = ...) -> Work: ...
    @overload
    def get_batch(self, target_weight: int | float, key: Any = ..., *,
                  async_op: Literal[True], timeout: float | None = ...,
                  copy: bool | None = ...) -> Work: ...
    @overload
    def get_batch(self, target_weight: int | float, key: Any = ...,
                  async_op: bool = ..., timeout: float | None = ..., *,
                  copy: bool | None = ...) -> list[Any] | Work: ...

    def get_batch(self, target_weight: int | float, key: Any = DEFAULT_KEY,
                  async_op: bool = False, timeout: float | None = None, *,
                  copy: bool | None = None) -> list[Any] | Work:
        """Take head items whose weights add up to at most ``target_weight`` (an int or finite
        float > 0, required), plus weight-0 items right behind; never returns ``[]``: a head
        heavier than the target comes alone (``docs/guarantees.md``).  Float sums within a
        relative 1e-9 of the target count as reaching it (0.1 + 0.2 meets 0.3)."""
        rec = GetBatch(id=0, key=check_key(key), target=check_target_weight(target_weight),
                       timeout=check_timeout(timeout))
        work = self._submit(rec, copy=copy if copy is None else check_copy(copy),
                            wait=not check_flag(async_op, "async_op"))
        return work if async_op else _wait_or_withdraw(work)

    def qsize(self, key: Any = DEFAULT_KEY, consumer: str | None = None) -> int:
        """Items queued under ``key``: the shared queue plus every private queue, or plus only
        ``consumer``'s private queue; 0 for an unknown key."""
        rec = QSize(id=0, key=check_key(key), consumer=check_consumer(consumer))
        return cast(int, self._submit(rec, wait=True).wait())

    def empty(self, key: Any = DEFAULT_KEY) -> bool:
        """``qsize(key) == 0``."""
        return self.qsize(key) == 0

    def full(self, key: Any = DEFAULT_KEY, consumer: str | None = None) -> bool:
        """Whether the shared queue of ``key`` (or ``consumer``'s private queue) holds ``maxsize``
        items; never with ``maxsize=0``."""
        rec = Full(id=0, key=check_key(key), consumer=check_consumer(consumer))
        return cast(bool, self._submit(rec, wait=True).wait())

    def peek(self, key: Any = DEFAULT_KEY, n: int = 1, *, consumer: str | None = None,
             weights: bool = False) -> list[Any]:
        """Copies of up to ``n`` (1..1024) items at the head of ``key``'s queue, head first,
        which stay queued: nothing is removed, reordered or leased, and changing a copy
        changes nothing in the channel.  ``[]`` for an empty or unknown key.

        Without ``consumer`` it shows the shared queue; with a consumer id, what that
        consumer's gets would take next (its private queue and the shared one, in put order).
        ``weights=True`` gives ``(item, weight)`` pairs.  For debugging: RLinf's
        ``str(channel)`` listed the default queue, zchannel's ``str()`` never touches the
        network.
        """
        rec = Peek(id=0, key=check_key(key), count=check_peek_count(n),
                   consumer=check_consumer(consumer))
        weights = check_flag(weights, "weights")
        pairs = self._submit(rec, copy=True, wait=True).wait()
        return [tuple(p) for p in pairs] if weights else [item for item, _ in pairs]

    def stats(self, *, exclude_self: bool = False) -> dict[str, Any]:
        """The broker's state (keys, consumers, counters; ``docs/guarantees.md``).
        ``exclude_self=True`` leaves this handle out of ``clients`` (what ``zchannel stat``
        does, so that an observer does not count itself)."""
        rec = Stats(id=0, exclude_self=bool(exclude_self))
        return cast(dict[str, Any], self._submit(rec, wait=True).wait())

    def reserve_shm(self, nbytes: int, slots: int) -> int:
        """Preallocate shared memory for puts of arrays/tensors of ``nbytes`` bytes: make the
        pool of this handle's connection (shared by the process's handles to the broker) hold
        ``slots`` slots of that size now, so that the first puts do not pay for creating and
        faulting in segments (docs/shm.md).  Returns the slots held (capped by the pool's
        limits); 0 when this handle has no shared memory with its broker (another host,
        ``shm=False``, ``shm_threshold=0``, or ``nbytes`` below the threshold).  Kept for the
        connection's life: a reconnect to a restarted broker reserves again.  ``ValueError``
        for ``nbytes`` or ``slots`` not an int > 0."""
        return self._connection().shm.reserve(nbytes, slots)

    def empty_shm(self, shape: Any, dtype: Any = np.float32) -> Any:
        """An uninitialised array of ``shape`` and ``dtype`` (a numpy dtype; a torch dtype
        gives a CPU tensor) for a producer to build an item in, placed in a free shared-memory
        slot of this handle's connection: put it (alone or inside an item) and the slot itself
        is sent, with no copy into shared memory (docs/shm.md, "Writing in place").

        Without a slot (another host, ``shm=False``, ``shm_threshold=0``, below the threshold,
        a local channel, or no slot free within the heartbeat expiry) it is a plain
        ``numpy.empty`` / ``torch.empty``, which a put sends the usual way: safe to call
        anywhere.  The slot stays with the array while it, or anything made from it, exists.
        Do not write to it after the put (its consumer reads that memory): make a new one for
        the next item.  Only the first put of it sends the slot; a later put copies, as for any
        array.  ``TypeError`` for a dtype that is neither numpy's nor torch's or a shape that
        is not ints, ``ValueError`` for a negative dimension."""
        return self._connection().shm.empty(shape, dtype)

    def ack(self, delivery: Delivery) -> None:
        """Confirm a delivery received with ``get(..., ack=True)``."""
        if not isinstance(delivery, Delivery):
            raise TypeError("ack() takes the Delivery returned by get(..., ack=True)")
        self._submit(Ack(id=0, lease=delivery.lease_id), wait=True).wait()



def _not_submitted(handle: BrokerChannel, rec: Request, item: Any, share: Any) -> None:
    """``rec`` of ``handle`` raised instead of returning its ``Work`` (refused, or interrupted):
    what it leaves behind.  Never queued, its shared-memory slots go back; a put queued is in
    doubt (it may be stored); a get or get_batch queued is withdrawn (nobody has its Work)."""
    conn = share.conn
    if not rec.id:
        shm_undo(conn, getattr(rec, "slots", None))
    elif isinstance(rec, Put):  # (the queue sees to its slots)
        handle._note_in_doubt(rec, item, conn)
    elif isinstance(rec, (Get, GetBatch)):
        for rid, queued, _ in conn.requests_of(share):
            if rid == rec.id:
                withdraw(queued)


def _check_limits(info: HelloInfo, nbytes: int, nbuffers: int) -> None:
    """``ValueError`` for an item of ``nbytes`` bytes (its slots' included) and ``nbuffers``
    buffers over the broker's ``max_message_bytes`` or ``max_frames``, as its hello reply told
    them (a limit it did not tell, as an older broker's ``max_frames``, is not checked).  The
    item's frames are its body and one per buffer: an array, tensor or bytes of
    ``codec.INLINE_LIMIT`` bytes or more outside shared memory."""
    limit = info.max_message_bytes
    if limit and nbytes > limit:
        raise ValueError(f"item of {nbytes} bytes exceeds the broker's max_message_bytes "
                         f"limit ({limit})")
    if info.max_frames and 1 + nbuffers > info.max_frames:
        raise ValueError(
            f"item of {1 + nbuffers} frames exceeds the broker's max_frames limit "
            f"({info.max_frames}): each array, tensor or bytes of 64 KiB or more outside "
            "shared memory travels as a frame of its own; put fewer, larger ones (np.stack, "
            "torch.stack), or raise the broker's max_frames")

def _wait_or_withdraw(work: Work) -> Any:
    """A blocking get's (or put's) result; interrupted while it waits, the request is withdrawn
    at the broker before the interruption goes on (``waiting.withdraw``)."""
    try:
        return work.wait()
    except BaseException:
        withdraw(work)
        raise


# -- reply conversion (runs in the waiting thread, not the I/O thread) ------------------------


def _converter(rec: Request, copy: bool | None, conn: Connection) -> Convert | None:
    """How the reply of ``rec`` becomes its result, checked against what the request asked
    for (``ProtocolError`` for a reply of another form; None: the reply's ``r`` as it is)."""
    kind = type(rec)
    if kind is Get or kind is GetBatch:
        ack = kind is Get and cast(Get, rec).ack
        convert = conn.converters.get((kind, copy, ack))
        if convert is None:  # one per connection, op, copy and ack (not a closure per call)
            convert = conn.converters[(kind, copy, ack)] = (
                _get_converter(copy, conn.shm, ack) if kind is Get
                else _batch_converter(copy, conn.shm))
        return convert
    return _RESULT_CONVERTERS.get(kind) or (_peek_converter(conn.shm) if kind is Peek else None)


def _malformed(what: str) -> ProtocolError:
    return ProtocolError(f"malformed reply from the broker: {what}")


def _get_converter(copy: bool | None, shm: Any = None, ack: bool = False) -> Convert:
    # a leased delivery's slots are copied out even with copy=False: the broker keeps the
    # slot for a redelivery (and a journal's compaction) until the ack, so a writable view of
    # it would change what comes again
    slot_copy = None if ack and copy is False else copy

    def convert(rec: Reply, frames: list[Any]) -> Any:
        sm = rec.slots  # shared-memory slots of the item (broker/shm/client.py)
        if (rec.lease is not None) is not ack:
            raise _lease_mismatch(ack)
        if sm and sm[0]:
            item = shm.decode(sm[0], frames, slot_copy)
        elif rec.body is not UNSET:  # a small item inside its record
            body = rec.body
            if type(body) is not bytes or frames:
                raise _malformed("an inline item is bytes, with no frames")
            return _inline_item(body, rec.lease)
        elif not frames:
            raise _malformed("a get answered with no item")
        else:
            item = codec.decode_frames(frames, copy)
        lease = rec.lease
        return Delivery(item, lease) if lease is not None else item

    # an entry of an ``items`` record is converted from its body and lease alone, with no
    # ``Reply`` made for it (``connection._deliver_items``)
    convert.inline = _checked_inline if ack else _inline_item  # type: ignore[attr-defined]
    return convert


def _checked_inline(body: bytes, lease: int | None) -> Any:
    """``_inline_item`` of a get with ``ack``: its entry must carry a lease."""
    if lease is None:
        raise _lease_mismatch(True)
    return _inline_item(body, lease)


def _lease_mismatch(ack: bool) -> ProtocolError:
    """A get answered with a lease it did not ask for, or (``ack``) without the one it did."""
    return _malformed(f"a get{' with ack' if ack else ''} answered "
                      f"{'without' if ack else 'with'} a lease")


def _inline_item(body: bytes, lease: int | None) -> Any:
    """A get's small item answered by an entry of an ``items`` record (bytes by the record's
    schema, ``wire/protocol.py``: ``ItemEntry``), as ``Delivery`` when it carries a lease."""
    item = codec.decode(body)
    return Delivery(item, lease) if lease is not None else item


def _batch_converter(copy: bool | None, shm: Any = None, *, empty: bool = False) -> Convert:
    """How a batch reply becomes its items (``empty``: it may have none, as a peek's; a
    ``get_batch``'s never does)."""
    def convert(rec: Reply, frames: list[Any]) -> list[Any]:
        bodies = rec.bodies
        if not empty and not (bodies or rec.counts or frames):
            raise _malformed("a get_batch answered with no item (a batch is never empty)")
        if bodies is not None:  # small items inside the record
            if frames or rec.counts is not None or rec.slots:
                raise ValueError("malformed reply: a batch of inline items has no frames, "
                                 "frame counts or slots")
            decode = codec.decode
            try:
                return [decode(body) for body in bodies]
            except ValueError:  # again one at a time (no side effects), to keep those that decode
                return _decoded_apart(decode, bodies)
        return _counted_items(rec, frames, copy, shm)

    return convert


def _counted_items(rec: Reply, frames: list[Any], copy: bool | None, shm: Any) -> list[Any]:
    """The items of a batch reply whose frames ``rec.counts`` counts (and ``rec.slots``, one
    entry per item, names shared-memory slots of), each decoded on its own."""
    counts = rec.counts or ()
    if sum(counts) != len(frames) or any(n < 1 for n in counts):
        raise _malformed(f"a batch of {len(frames)} frames counted as {list(counts)}")
    sm = rec.slots or ()  # shared-memory slots per item (broker/shm/client.py)
    if sm and len(sm) != len(counts):
        raise _malformed(f"{len(sm)} shared-memory entries for a batch of {len(counts)} items")
    out: list[Any] = []
    errors: list[tuple[int, ValueError]] = []
    pos = 0
    append, decode_frames = out.append, codec.decode_frames
    for i, n in enumerate(counts):
        try:  # each item is tried (its slots released or kept as for a single get)
            if i < len(sm) and sm[i]:
                append(shm.decode(sm[i], frames[pos : pos + n], copy))
            elif n == 1:  # the common small item: its body alone
                append(decode_frames((frames[pos],), copy))
            else:
                append(decode_frames(frames[pos : pos + n], copy))
        except ValueError as exc:
            errors.append((i, exc))
        pos += n
    if errors:
        raise _undecodable(out, errors, len(counts))
    return out


def _decoded_apart(decode: Callable[[bytes], Any], bodies: list[bytes]) -> list[Any]:
    """The small items of a batch decoded one by one: all of them, or ``UndecodableItems``
    holding those that decoded."""
    out: list[Any] = []
    errors: list[tuple[int, ValueError]] = []
    for i, body in enumerate(bodies):
        try:
            out.append(decode(body))
        except ValueError as exc:
            errors.append((i, exc))
    if errors:
        raise _undecodable(out, errors, len(bodies))
    return out


def _undecodable(items: list[Any], errors: list[tuple[int, ValueError]], n: int) -> UndecodableItems:
    first, exc = errors[0]
    return UndecodableItems(
        f"{len(errors)} of the {n} items of this batch could not be decoded and are consumed "
        f"(the first, at position {first}: {exc}); the {len(items)} others are in this "
        "error's .items", items, errors)


def _peek_converter(shm: Any = None) -> Convert:
    batch = _batch_converter(True, shm, empty=True)  # copies: nothing points into a slot

    def convert(rec: Reply, frames: list[Any]) -> list[Any]:
        items = batch(rec, frames)
        weights = rec.weights or ()
        if len(weights) != len(items):
            raise ValueError("malformed peek reply: one weight per item")
        return list(zip(items, weights, strict=True))

    return convert


def _stats_converter(rec: Reply, frames: list[Any]) -> dict[str, Any]:
    stats = codec.decode_frames(frames, True) if frames else None
    if not isinstance(stats, dict):
        raise _malformed(f"stats are a map, not {type(stats).__name__}")
    return stats


def _result_of(kind: type, check: Callable[[Any], bool], what: str) -> Convert:
    """The converter of a reply whose result ``r`` must pass ``check`` (``what`` it is)."""
    def convert(rec: Reply, frames: list[Any]) -> Any:
        if frames or not check(rec.result):
            raise _malformed(f"{op_of(kind(id=0))} answered {rec.result!r} with {len(frames)} "
                             f"frame(s), expected {what}")
        return rec.result
    return convert


_RESULT_CONVERTERS: dict[type, Convert] = {
    Stats: _stats_converter,
    QSize: _result_of(QSize, lambda r: type(r) is int and r >= 0, "an int >= 0"),
    Full: _result_of(Full, lambda r: type(r) is bool, "a bool"),
    Ack: _result_of(Ack, lambda r: r is None, "no result"),
}
