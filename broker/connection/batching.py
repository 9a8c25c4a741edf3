"""Request coalescing on the client: runs of consecutive puts in one outgoing message travel
as one ``puts`` record (``wire/protocol.py``: ``PutBatch``), and runs of consecutive gets with
the same options as one ``gets`` record (``GetRun``: get prefetch), of one key or of a key
each.

Only what is already queued is coalesced (``RequestQueue._next_message`` cuts messages as
before, nothing lingers to wait for more), and only consecutive records, so the broker sees
every request in the order it was issued.  Each put or get keeps its own id, ``Work``,
flow-control slot (``pending``), timeout and cancel; the record's own id maps to the ids it
stands for in ``RequestQueue.batches`` until its reply comes:

- a ``puts`` reply lists the ids stored; puts that fail or wait for room are answered under
  their own ids;
- a ``gets`` reply is an empty success once every get of the run was handled (each get is
  answered, now or when an item comes, under its own id, exactly as a single get, or by an
  entry of an ``items`` record: ``connection._deliver_items``);
- an error on the record itself (the broker refused it whole: nothing of it was done) fails
  each put or get of it still waiting for an answer.

``ZCHANNEL_BATCH=0`` turns both off (``connection/tuning.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from zchannel.broker.connection.work import _DONE
from zchannel.broker.errors import error_from_wire
from zchannel.broker.wire.protocol import (
    MAX_BATCH_PUTS,
    Get,
    GetRun,
    ProtocolError,
    Put,
    PutBatch,
    Reply,
    Request,
    batch_answer,
)

if TYPE_CHECKING:  # the request queue imports this module; the type alone goes back
    from zchannel.broker.connection.requestqueue import RequestQueue

log = logging.getLogger("zchannel.client")


def group_records(requests: RequestQueue, records: list[Request]) -> list[Request]:
    """``records`` of one message with each run of two or more consecutive puts replaced by
    one ``PutBatch`` and each run of two or more consecutive alike gets (``_alike``) by one
    ``GetRun`` (of their key, or of each get's key when they differ: ``_flush_run``),
    registered in ``requests.batches``; the frames keep their order."""
    out: list[Request] = []
    run: list[Any] = []
    rec: Any
    for rec in records:
        kind = type(rec)
        if run and (kind is not type(run[0]) or len(run) == MAX_BATCH_PUTS
                    or kind is Get and not _alike(run[0], rec)):
            _flush_run(requests, run, out)
            run = []
        if kind is Put or kind is Get:
            run.append(rec)
        else:
            out.append(rec)
    if run:
        _flush_run(requests, run, out)
    return out


def _alike(first: Get, rec: Get) -> bool:
    """Whether ``rec`` may stand in one ``gets`` record with ``first``: the same timeout,
    nowait and ack (each get keeps its own key)."""
    return first.timeout == rec.timeout and first.nowait is rec.nowait and first.ack is rec.ack


def _same_key(run: list[Get]) -> bool:
    """Whether the gets of ``run`` name one key (of one type: 1 and 1.0, or a tuple and a
    list, never count as one)."""
    key = run[0].key
    kind = type(key)
    for rec in run:
        if type(rec.key) is not kind or rec.key != key:
            return False
    return True


def _flush_run(requests: RequestQueue, run: list, out: list[Request]) -> None:
    if len(run) == 1:
        out.append(run[0])
        return
    first = run[0]
    ids = [rec.id for rec in run]
    rid = next(requests.ids)
    batch: Request
    if type(first) is Put:
        nf = 0
        for put in run:
            nf += put.nf
        batch = PutBatch(id=rid, nf=nf, puts=run)
        requests.batches[rid] = (True, frozenset(ids))
    else:
        batch = GetRun(id=rid, timeout=first.timeout, nowait=first.nowait, ack=first.ack, ids=ids)
        if _same_key(run):
            batch.key = first.key
        else:  # each get of the run its own key
            batch.keys = [rec.key for rec in run]
        requests.batches[rid] = (False, frozenset(ids))
    out.append(batch)


def on_batch_reply(requests: RequestQueue, rec: Reply) -> bool:
    """The reply to a ``puts`` or ``gets`` record (``rec.id`` in ``requests.batches``): complete
    the puts it stored, or fail every request of a record refused whole.  False when ``rec``
    answers no such record."""
    entry = requests.batches.get(rec.id)  # type: ignore[arg-type]
    if entry is None:
        return False
    is_puts, ids = entry
    if rec.error is not None:
        error = error_from_wire(rec.error)
        for rid in ids:
            requests.forget(rid, error)
    elif not is_puts:
        if rec.result is not None or rec.nf:
            log.warning("a reply to a gets record carries a result: ignored")
    else:
        _complete_puts(requests, rec, ids)
    # dropped last: a delivery an interruption cut short is made again with it
    requests.batches.pop(rec.id, None)  # type: ignore[arg-type]
    return True


def _complete_puts(requests: RequestQueue, rec: Reply, ids: frozenset[int]) -> None:
    """The reply to a ``puts`` record: complete the puts it stored (``inflight.py``: none is
    lost to an interruption)."""
    try:
        stored = batch_answer(rec.result, ids)
    except ProtocolError as exc:
        log.warning("malformed reply to a batch of puts from the broker: %s", exc)
        for rid in ids:
            requests.forget(rid, exc)
        return
    pending_of, inflight = requests.pending, requests.inflight
    for rid in stored:
        pending = pending_of.get(rid)  # (it stays there until delivered)
        if pending is not None:
            inflight.release(rid, pending[3])
            if pending[0]._state:  # completed by a delivery an interruption cut short
                pending[0]._wake()
            else:
                pending[0]._finish(_DONE, None)
            inflight.delivered(rid)
