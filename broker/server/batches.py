"""The broker's side of a ``puts`` record (``wire/protocol.py``: ``PutBatch``): several puts of
one client handled in one pass and answered by one record; and of a ``gets`` record
(``GetRun``): several gets of one client, on one key or each of its own key, handled in one
pass.

Each put of the batch goes through the handler of a single put (``handlers.put``, or a
replica's checked version of it), in order, exactly as if its record had come alone: per-key
FIFO, ``maxsize`` backpressure (a put that must wait is parked under its own id, and the puts
behind it for the same queue wait behind it, as ``Waiters.put`` orders them), retry-safe
sequences and errors are those of single puts.  A batch of new small inline puts that all fit now is stored in one
pass (``server/putrun.py``) with the same outcome.  Only the answers differ: while the batch is
handled, the bare acknowledgements of its puts are collected (``Sessions.collect_acks``)
instead of queued one record each, and one reply to the batch's id lists the ids stored; a put
that failed, or waits for room, is answered under its own id (in the same reply message for a
failure, later for a wait).

The gets of a ``gets`` record go through the handler of a single get, in order, each under its
own id, with the record's key and options: each is served, parked (with its own deadline and
its own place among the key's waiting getters), refused or cancelled exactly as a ``get``
record of that id, and answered under that id -- the replies of the items served in one turn
leave in one message, each its own delivery (its own lease under ``ack``; the small items of
a client that reads ``items`` records share such records: ``Sessions.reply``).  The record's own
id then gets an empty success.  The common case -- plain gets (no ``ack``) of a key that holds
items nobody else waits for, on a broker that is no replica -- is served in one pass
(``QueueCore.take_run``) with the same outcome: the first gets take the head items, in order,
and the gets the queue does not cover are parked in order in one pass when nothing keeps them
from waiting (no ``nowait``, a timeout above 0, no dealing, no ``max_bytes`` limit), also
behind getters waiting already on an empty queue; any other get goes get by get.  Of a record
naming a key per get (``ks``), each plain get of a str or int key whose shared queue holds
items nobody else waits for is served at once (``waiters.take_heads``: consecutive such gets
answered as one run), in order, the others get by get.  A record whose ids repeat, or name
the record itself, or whose ``ks`` does not hold a key per id (or comes with ``k``), is
refused whole (a ``ValueError`` reply to its id, none of its gets handled).
"""

from __future__ import annotations

import logging
from typing import Any

from zchannel.broker.core.state import Client
from zchannel.broker.core.waiters import take_heads
from zchannel.broker.errors import KeyMoved
from zchannel.broker.server.putrun import store_at_once
from zchannel.broker.wire.argchecks import check_key, check_timeout
from zchannel.broker.wire.protocol import Get, GetRun, Put, PutBatch, key_from_wire

log = logging.getLogger("zchannel.broker")
_NO_FRAMES: list = []


def put_batch(broker: Any, client: Client, rec: PutBatch, frames: list) -> None:
    """Handle the puts of ``rec`` in order, then answer the batch (module docstring)."""
    puts = rec.puts
    declared = 0
    for put in puts:
        declared += put.nf
    if declared != rec.nf or len(frames) != rec.nf:
        raise ValueError(f"a puts record declares {rec.nf} frames but its puts own {declared}")
    broker.counters.put_batches += 1
    sessions = broker.sessions
    stored_now = store_at_once(broker, client, puts)  # the common case, in one pass
    if stored_now is not None:
        if len(stored_now) == len(puts):
            sessions.reply(client, rec.id, result=stored_now)
            return
        puts = puts[len(stored_now):]  # a journal refused one: it and the rest, put by put
    handle = broker.handlers[Put]
    stored = sessions.collect_acks(client, {put.id for put in puts})
    if stored_now:
        stored.extend(stored_now)
    try:
        pos = 0  # (the puts stored at once carry no frames)
        for put in puts:
            nf = put.nf
            try:
                handle(broker, client, put, frames[pos : pos + nf] if nf else [])
            except Exception as exc:  # this put's error reply, as for a put sent alone
                if not isinstance(exc, (ValueError, TypeError, KeyMoved, PermissionError)):
                    log.exception("error handling a put of a batch")
                sessions.reply(client, put.id, error=exc)
            pos += nf
    finally:
        sessions.end_acks()
    sessions.reply(client, rec.id, result=stored)


def get_run(broker: Any, client: Client, rec: GetRun, frames: list) -> None:
    """Handle the gets ``rec`` stands for in order, then answer the record (module docstring)."""
    ids, keys = rec.ids, rec.keys
    if len(set(ids)) != len(ids) or rec.id in ids:
        raise ValueError("a gets record names a get twice, or names itself among its gets")
    if frames:
        raise ValueError("a gets record carries no frames")
    if keys is not None and rec.key is not None:
        raise ValueError("a gets record names one key (k) or a key per get (ks), not both")
    if keys is not None and len(keys) != len(ids):
        raise ValueError(f"a gets record's ks names {len(keys)} keys for {len(ids)} gets: "
                         "it needs a key per get")
    broker.counters.get_runs += 1
    one = Get(id=0, key=rec.key, timeout=rec.timeout, nowait=rec.nowait, ack=rec.ack)
    if keys is not None:
        # each get of its own key, in order: runs of the common case served at once
        # (take_heads), every other get by the single-get handler at its place
        quick = broker.replica is None and not rec.ack
        waiters = broker.core.waiters
        at = 0
        while at < len(ids):
            if quick:
                served = take_heads(waiters, client, ids, keys, at)
                broker.counters.gets += served
                at += served
                if at == len(ids):
                    break
            one.key = keys[at]
            _one_get(broker, client, one, ids[at])
            at += 1
    else:
        served = _take_at_once(broker, client, rec)  # the common case, in one pass
        for rid in ids[served:] if served else ids:
            _one_get(broker, client, one, rid)
    broker.sessions.reply(client, rec.id)


def _one_get(broker: Any, client: Client, one: Get, rid: int) -> None:
    """Get ``rid`` of a ``gets`` record (``one``: its key and options) through the handler
    of a single get, answered as a get record sent alone."""
    one.id = rid
    try:
        broker.handlers[Get](broker, client, one, _NO_FRAMES)
    except Exception as exc:  # this get's error reply, as for a get sent alone
        if not isinstance(exc, (ValueError, TypeError, KeyMoved, PermissionError)):
            log.exception("error handling a get of a gets record")
        broker.sessions.reply(client, rid, error=exc)


def _take_at_once(broker: Any, client: Client, rec: GetRun) -> int:
    """How many gets of ``rec``, from the first, were served or parked at once
    (``QueueCore.take_run``): plain gets (no ``ack``) with a valid key and timeout, on a
    broker that is no replica; anything else goes get by get."""
    if broker.replica is not None or rec.ack:
        return 0
    try:
        key = check_key(key_from_wire(rec.key))
        timeout = check_timeout(rec.timeout)
    except (TypeError, ValueError):
        return 0  # each get's error reply is the single path's
    served = broker.core.take_run(client, rec.ids, key, timeout, park=not rec.nowait)
    broker.counters.gets += served
    return served
