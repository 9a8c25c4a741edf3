"""The common case of a ``puts`` record stored in one pass (``server/batches.py``).

A batch qualifies when the channel has no hooks at work, no ``max_bytes`` and no put waiting
for room, the broker is not a replica, and every put of it is a new small item
riding in its record: an inline body (no frames, no shared-memory slots), a valid key, weight
and timeout, an id no parked request of the client holds, and (for a retry-safe producer)
sequences above every sequence its window saw, increasing within the batch.  If every put
also fits under ``maxsize`` (each key's queue has room for all of that key's puts of the
batch), all are stored: each key's items appended in order, then each key with waiting getters
served once.  Getters of the shared queue are served strictly in arrival order, each taking
head items, so they take the items they would have taken had each item been served as it
came -- except that a get_batch completed by the batch would also take the zero-weight items
right behind its last counted one; so while a get_batch waits and the batch holds a
zero-weight item, the items are appended one by one, each key served after each of its items,
as single puts are.

On a durable channel each put is recorded in the journal (``StateLog.stored_each``: each put
recorded as a put of its own, the put sequence of a retry-safe producer with its item, as
``handlers._put_once`` does) before any item of the batch enters a queue, and only if the
journal has room for the whole batch (``max_journal_bytes``).  A put the journal refuses ends
the pass: the puts before it are stored (each recorded whole), it and the puts after it go to
the general path, which records each again or answers its error, exactly as for single puts
(so the journal's ``refused`` count may count that put twice).  The journal writes the
recorded puts before the turn's replies go (``Sessions.flush``): nothing is acknowledged
before it is written.

Anything else -- one malformed field, a duplicate, a full queue -- leaves the batch to the
general path, put by put, with nothing changed here: its errors, parking and retry handling
are those of single puts.  So the outcome of a batch is the same on both paths; this one only
skips the per-put layers (record checks, routing lists, acknowledgement collection).
"""

from __future__ import annotations

from typing import Any

from zchannel.broker.core.state import ITEM_OVERHEAD, Client, Item
from zchannel.broker.core.statelog import StateLog
from zchannel.broker.wire.argchecks import (
    MAX_KEY_BYTES,
    MAX_WEIGHT,
    check_key,
    check_timeout,
    check_weight,
)
from zchannel.broker.wire.protocol import INLINE_BODY, UNSET, Put, key_from_wire


def store_at_once(broker: Any, client: Client, puts: list[Put]) -> list[int] | None:
    """Store the puts of ``puts`` now and return their ids in order -- all of them, or on a
    durable channel the puts before one its journal refused -- or return None having changed
    nothing when the batch is not the common case (module docstring)."""
    core = broker.core
    queues, hooks = core.queues, core.hooks
    window = client.producer
    if (broker.replica is not None or queues.max_bytes or core.waiters.putters
            or not hooks.passthrough or hooks.deals or (window is not None and window.pending)):
        return None
    seqs: list[int] = []  # the puts' sequences, from a retry-safe producer
    checked = _checked(puts, client, window, broker.config.max_message_bytes, seqs)
    if checked is None or not _fits(queues, checked):
        return None
    log = core.log  # a durable channel's journal (``QueueCore.attach_log``)
    if log is not None:
        checked = _journaled(log, checked, window, seqs)
        if not checked:
            return None
        puts = puts[: len(checked)]
    if window is not None:
        window.mark_rising(seqs[: len(puts)])
    broker.counters.puts += len(puts)
    _store(core, queues, checked)
    return [put.id for put in puts]


def _journaled(log: StateLog, checked: list[tuple], window: Any, seqs: list[int]) -> list[tuple]:
    """Record each put of ``checked`` in the durable channel's journal ``log``, in order, with
    its put sequence (``seqs``) when its producer is retry-safe; the puts recorded: all of
    them, or those before the first the journal refused or found no room for (none: ``[]``)."""
    if log.limited and not log.room(sum(item.nbytes for _, item in checked)):
        return []
    if window is not None:
        producer = window.producer
        for seq, (_, item) in zip(seqs, checked, strict=True):
            item.origin = (producer, seq)
    n = log.stored_each([(key, None, item) for key, item in checked])
    return checked if n == len(checked) else checked[:n]


def _checked(puts: list[Put], client: Client, window: Any, limit: int,
             seqs: list[int]) -> list[tuple] | None:
    """``(key, Item)`` of each put in order (and each put's sequence appended to ``seqs`` when
    its producer is retry-safe), or None if one is not a new inline put with valid fields (the
    general path then answers it as a single put).  The common field values (a short str key,
    an int weight in range, no timeout) are told by their type and range here; any other value
    goes through the checks of ``wire/argchecks.py``."""
    out: list[tuple] = []
    parked = client.parked
    high = window.high if window is not None else 0
    largest = min(INLINE_BODY, limit) if limit else INLINE_BODY
    try:
        for put in puts:
            body = put.body
            if (type(body) is not bytes or put.nf or put.slots is not None
                    or put.sizes is not None or (parked and put.id in parked)):
                return None
            nbytes = len(body)
            if nbytes > largest:
                return None
            if window is not None:
                seq = put.seq
                if seq is UNSET:
                    seq = put.id
                if type(seq) is not int or seq <= high:
                    return None
                high = seq
                seqs.append(seq)
            key = put.key
            if type(key) is not str or len(key) > MAX_KEY_BYTES:
                key = check_key(key_from_wire(key))
            if put.timeout is not None:
                check_timeout(put.timeout)
            weight = put.weight
            if type(weight) is not int or not 0 <= weight <= MAX_WEIGHT:
                weight = check_weight(weight)
            out.append((key, Item([body], weight, nbytes + ITEM_OVERHEAD)))  # item_bytes(n, 1)
    except (TypeError, ValueError):
        return None
    return out


def _fits(queues: Any, checked: list[tuple]) -> bool:
    """Whether every item of ``checked`` fits now: the ``max_keys`` limit leaves room for its
    new keys and, under ``maxsize``, each key's queue for all of its items."""
    counts: dict[Any, int] = {}
    for key, _ in checked:
        counts[key] = counts.get(key, 0) + 1
    keys = queues.keys
    if queues.max_keys and len(keys) + len(counts) > queues.max_keys:  # may pass it
        try:
            queues.check_new_keys([k for k in counts if k not in keys])
        except ValueError:
            return False
    maxsize = queues.maxsize
    if maxsize > 0:
        for key, n in counts.items():
            ks = keys.get(key)
            if ks is not None and len(ks.shared) + n > maxsize:
                return False
            if ks is None and n > maxsize:
                return False
    return True


def _store(core: Any, queues: Any, checked: list[tuple]) -> None:
    """Append the items of ``checked`` to their keys' shared queues, in order, then serve the
    waiting getters of each key once (or item by item: module docstring)."""
    states = {key: queues.state(key) for key, _ in checked}
    serve = core.waiters.serve
    if (any(item.weight == 0 for _, item in checked)
            and any(req.kind == "batch" for ks in states.values() for req in ks.getters)):
        for key, item in checked:
            ks = states[key]
            ks.shared.append(item)
            queues.bytes_held += item.nbytes
            if ks.getters:
                serve(ks)
        return
    if len(states) == 1:
        next(iter(states.values())).shared.extend(item for _, item in checked)
    else:
        for key, item in checked:
            states[key].shared.append(item)
    queues.bytes_held += sum(item.nbytes for _, item in checked)
    for ks in states.values():
        if ks.getters:
            serve(ks)
