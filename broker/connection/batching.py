"""Put coalescing on the client: runs of consecutive puts in one outgoing message travel as
one ``puts`` record (``wire/protocol.py``: ``PutBatch``), answered by one reply.

Only what is already queued is coalesced (``RequestQueue._send_queued`` cuts messages as
before, nothing lingers to wait for more), and only consecutive puts, so the broker sees every
request in the order it was issued.  Each put keeps its own id, ``Work`` and flow-control slot
(``_pending``); the batch's id maps to its puts' ids in ``_batches`` until its reply comes:
the ids it lists were stored; an error on the batch itself (the broker refused the record
whole, nothing was stored) fails each put still waiting for an answer.  Puts that fail or wait
for room are answered under their own ids.  ``ZCHANNEL_BATCH=0`` turns this off
(``connection/tuning.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from zchannel.broker.connection.work import _DONE
from zchannel.broker.errors import error_from_wire
from zchannel.broker.wire.protocol import ProtocolError, Put, PutBatch, Reply, batch_answer

log = logging.getLogger("zchannel.client")


def group_puts(conn: Any, records: list) -> list:
    """``records`` of one message with each run of two or more consecutive puts replaced by
    one ``PutBatch`` (registered in ``conn._batches``); the frames keep their order."""
    out: list = []
    run: list[Put] = []
    for rec in records:
        if type(rec) is Put:
            run.append(rec)
            continue
        if run:
            _flush_run(conn, run, out)
            run = []
        out.append(rec)
    if run:
        _flush_run(conn, run, out)
    return out


def _flush_run(conn: Any, run: list[Put], out: list) -> None:
    if len(run) == 1:
        out.append(run[0])
        return
    nf = 0
    for put in run:
        nf += put.nf
    batch = PutBatch(id=next(conn._ids), nf=nf, puts=run)
    conn._batches[batch.id] = frozenset(put.id for put in run)
    out.append(batch)


def on_batch_reply(conn: Any, rec: Reply) -> None:
    """The reply to a batch (``rec.id`` in ``conn._batches``): complete the puts it stored,
    or fail every put of a batch refused whole; unknown ids are ignored (a late reply)."""
    ids = conn._batches.pop(rec.id, None)
    if ids is None:
        return
    if rec.error is not None:
        error = error_from_wire(rec.error)
        for rid in ids:
            conn.forget(rid, error)
        return
    try:
        stored = batch_answer(rec.result, ids)
    except ProtocolError as exc:
        log.warning("malformed reply to a batch of puts from the broker: %s", exc)
        for rid in ids:
            conn.forget(rid, exc)
        return
    pending_of = conn._pending
    for rid in stored:
        pending = pending_of.pop(rid, None)
        if pending is not None:
            conn._release(pending[3])
            pending[0]._finish(_DONE, None)
