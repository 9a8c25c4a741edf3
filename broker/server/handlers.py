"""What the broker does for each request: one handler per operation, found through ``HANDLERS``
(the record's class -> its handler; a replica that moves keys uses ``handlers_for``'s table) by
``Broker._handle_message``; ``hello``, which registers a
client (and so runs before there is one), is called by name.

A handler gets the broker, the client, the decoded record (``broker/wire/protocol.py``) and the
frames that came with it; it answers through ``broker.sessions.reply`` now or, for a request that waits
(a put into a full queue, a get from an empty one), leaves that to the queue core.  Whatever it
raises is the error reply of that one record.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
from zchannel.broker.cluster.replica import ReplicaState
from zchannel.broker.core.state import Client, Item, item_bytes
from zchannel.broker.server.batches import get_run, put_batch
from zchannel.broker.server.producers import DUPLICATE, NEW, WAITING, WINDOW, ProducerWindow
from zchannel.broker.wire import codec
from zchannel.broker.wire.argchecks import (
    check_consumer,
    check_peek_count,
    check_target_weight,
    check_timeout,
    check_weight,
)
from zchannel.broker.wire.protocol import (
    INLINE_BODY,
    KEYED_TYPES,
    PROTOCOL_VERSION,
    UNSET,
    Ack,
    Bind,
    Bye,
    Cancel,
    Full,
    Get,
    GetBatch,
    GetRun,
    Heartbeat,
    Hello,
    HelloInfo,
    Learn,
    Load,
    Peek,
    Put,
    PutBatch,
    QSize,
    Release,
    Request,
    ShmHello,
    ShmRelease,
    Shutdown,
    Stats,
    Sync,
    key_from_wire,
    op_of,
)
from zchannel.hooks import check_consumer_id

if TYPE_CHECKING:  # the loop imports this module; the type alone goes back
    from zchannel.broker.server.loop import Broker

Handler = Callable[[Any, Client, Any, list], None]

log = logging.getLogger("zchannel.broker")


def hello(broker: Broker, address: bytes, rec: Hello, head: Any = None) -> Client | None:
    """Register ``address`` (anew) and answer with the broker's parameters; a hello of
    another protocol version gets an error reply and changes nothing.  ``head``: the frame
    the hello came in, whose ``User-Id`` is the client's CURVE public key (with CURVE)."""
    rid = rec.id if type(rec.id) is int else 0
    version = rec.version
    if type(version) is not int or version != PROTOCOL_VERSION:
        broker.sessions.reply(Client(address=address), rid, error=ValueError(
            f"protocol version {version!r} is not supported: this broker speaks "
            f"version {PROTOCOL_VERSION} (field 'v' of hello)"))
        return broker.sessions.clients.get(address)
    identity = rec.identity if isinstance(rec.identity, str) else None
    if identity is not None:
        try:
            check_consumer_id(identity)
        except ValueError as exc:
            broker.sessions.reply(Client(address=address), rid, error=ValueError(
                f"{exc} (field 'ident' of hello)"))
            return broker.sessions.clients.get(address)
    broker.bound()[1].greeted(address)
    old = broker.sessions.clients.pop(address, None)
    if old is not None:  # the same connection registers again: its views live on
        broker.sessions.client_gone(old, expired=True)
    client = Client(address=address, identity=identity, items=rec.items)
    if broker.admin_keys and isinstance(head, zmq.Frame):
        user = head.get("User-Id")  # the CURVE key the ZAP handler let in (a str)
        client.user = user if isinstance(user, str) else None
    broker.sessions.clients[address] = client
    broker.sessions.forget_expired(address)
    broker.sessions.producers.attach(client, rec.producer)
    info = HelloInfo(
        name=broker.config.name, pid=os.getpid(), hb=broker.config.heartbeat_interval,
        liveness=broker.config.liveness, deals=broker.core.hooks.deals,
        maxsize=broker.core.queues.maxsize,
        max_message_bytes=broker.config.max_message_bytes, max_frames=broker.config.max_frames,
        shm=broker.shm.hello_info())
    if broker.replica is not None:
        broker.replica.describe(info)
    broker.sessions.reply(client, rid, result=info)
    return client


def put(broker: Broker, client: Client, rec: Put, frames: list) -> None:
    # shared-memory slots first: held by the payload (counted in item.nbytes), they go back to
    # their producer with it when a check below refuses the put (only the broker frees them)
    slots = None if rec.slots is None else broker.shm.attach_put(client, rec.slots, [])
    frames, nbytes = _put_frames(rec, frames, broker.config.max_message_bytes)
    weight = check_weight(rec.weight)
    key, timeout = key_from_wire(rec.key), check_timeout(rec.timeout)
    nframes = len(frames)
    if slots is not None:
        slots.extend(frames)
        nbytes += slots.slot_bytes
        frames = slots
    item = Item(frames, weight, item_bytes(nbytes, nframes))
    broker.counters.puts += 1
    window = client.producer
    if window is None:  # a client without retry-safe puts
        broker.core.put(client, rec.id, key, item, timeout, rec.nowait)
    else:
        _put_once(broker, client, rec, window, key, item, timeout)


def _put_frames(rec: Put, frames: list, limit: int) -> tuple[list, int]:
    """A put's frames (its inline body as the one frame) and their bytes, checked against the
    header's sizes and the message size limit (0: none)."""
    body = rec.body
    if body is not UNSET:  # a small item inside its record
        if len(body) > INLINE_BODY or frames:
            raise ValueError(f"an inline put body is at most {INLINE_BODY} bytes, with no frames")
        frames = [body]
        nbytes = len(body)
    else:
        if not frames:
            raise ValueError("a put carries at least one frame (the body)")
        lengths = [len(f) for f in frames]
        if rec.sizes is not None and rec.sizes != lengths:
            raise ValueError("put frame sizes do not match the header")
        nbytes = sum(lengths)
    if limit and nbytes > limit:
        raise ValueError(f"item of {nbytes} bytes exceeds the message size limit")
    return frames, nbytes


def _put_once(broker: Broker, client: Client, rec: Put, window: ProducerWindow, key: Any,
              item: Item, timeout: float | None) -> None:
    """A retry-safe put: stored once whatever the producer's retries (its sequence is marked
    in the producer's ``window`` while stored or waiting for room)."""
    seq = rec.sequence()
    verdict = window.begin(seq)  # NEW: marked stored already
    if verdict != NEW:
        repeated(broker, client, rec, seq, verdict)
        return
    if broker.journal is not None:  # a durable channel journals it with the item
        item.origin = (window.producer, seq)
    try:
        outcome = broker.core.put(client, rec.id, key, item, timeout, rec.nowait)
    except BaseException:  # answered with this error: not stored, as far as the client knows
        window.unmark(seq)
        raise
    if outcome is not True:
        if outcome is False:
            window.unmark(seq)
        else:
            window.wait(seq, outcome)


def repeated(broker: Broker, client: Client, rec: Put, seq: int, verdict: int) -> None:
    """A put whose sequence is not new to its producer (``server/producers.py``): a stored
    one is acknowledged as stored, nothing is stored again; one that waits for room, or that
    fell out of the window, is refused."""
    if verdict == DUPLICATE:
        broker.counters.duplicate_puts += 1
        broker.sessions.reply(client, rec.id)
    elif verdict == WAITING:
        raise ValueError(f"put sequence {seq} of this producer still waits for room at the "
                         "broker: a retry must wait for its outcome")
    else:
        raise ValueError(f"put sequence {seq} is older than this producer's last {WINDOW} "
                         "sequences, or than its session the broker forgot (its connection "
                         "was gone past the producer grace): the broker cannot tell whether "
                         "it was stored")


def _carries_frames(rec: Request, frames: list) -> ValueError:
    """The error of a record that owns frames although its operation takes none (only a
    ``put`` and a ``puts`` carry frames): refused, as its frames would be dropped unread."""
    return ValueError(f"records of op {op_of(rec)!r} carry no frames (this one owns "
                      f"{len(frames)}): only a put and a puts record do")


def _unanswered_with_frames(rec: Request, frames: list) -> bool:
    """Whether a record of an operation that gets no reply (``hb``, ``shm_hi``, ``shm_rel``)
    owns frames, which it may not: dropped and logged with id 0, as such records are sent
    (True), refused (``_carries_frames``) with an id of its own; False when it owns none."""
    if not frames:
        return False
    if rec.id != 0:
        raise _carries_frames(rec, frames)
    log.warning("dropped a %r record that owns %d frames (it carries none)", op_of(rec),
                len(frames))
    return True


def get(broker: Broker, client: Client, rec: Get, frames: list) -> None:
    if frames:
        raise _carries_frames(rec, frames)
    broker.counters.gets += 1
    broker.core.get(client, rec.id, key_from_wire(rec.key), check_timeout(rec.timeout),
                    rec.nowait, ack=rec.ack, batch_target=0)


def get_batch(broker: Broker, client: Client, rec: GetBatch, frames: list) -> None:
    if frames:
        raise _carries_frames(rec, frames)
    target = check_target_weight(rec.target)
    broker.counters.gets += 1
    broker.core.get(client, rec.id, key_from_wire(rec.key), check_timeout(rec.timeout),
                    rec.nowait, batch_target=target)


def heartbeat(broker: Broker, client: Client, rec: Heartbeat, frames: list) -> None:
    """A sign of life (the caller noted it); with ``next_bytes``, a notice: the large message
    that follows may take a while to arrive whole (``Sessions.announced``)."""
    if not _unanswered_with_frames(rec, frames) and rec.next_bytes is not None:
        broker.sessions.announced(client, rec.next_bytes)


def qsize(broker: Broker, client: Client, rec: QSize, frames: list) -> None:
    if frames:
        raise _carries_frames(rec, frames)
    result = broker.core.qsize(key_from_wire(rec.key), check_consumer(rec.consumer))
    broker.sessions.reply(client, rec.id, result=result)


def full(broker: Broker, client: Client, rec: Full, frames: list) -> None:
    if frames:
        raise _carries_frames(rec, frames)
    result = broker.core.full(key_from_wire(rec.key), check_consumer(rec.consumer))
    broker.sessions.reply(client, rec.id, result=result)


# ``stats`` bodies computed afresh per turn of the loop at most; later ``stats`` records of the
# turn share the last body made (a snapshot of this turn): each costs O(keys) to make and holds
# its own reply, so one message of 4096 ``stats`` records stalled the broker for minutes and
# held gigabytes of replies
FRESH_STATS_PER_TURN = 4
# Over time, making dear ``stats`` bodies takes at most this share of the loop's time (a credit
# of seconds that refills at this rate, up to STATS_BURST_S): a body of 100,000 keys takes
# ~0.3 s, so a client asking for one per turn would otherwise leave the others a fraction of
# the loop.  Past it a ``stats`` record gets the last body made until the credit is back.  A
# body is dear when the last one took STATS_DEAR_S or more (some thousands of keys): a body of
# a few keys takes ~0.1 ms and is always made afresh (at most FRESH_STATS_PER_TURN a turn).
STATS_SHARE = 0.1
STATS_BURST_S = 0.5
STATS_DEAR_S = 0.01
# frames ``peek`` records may copy in one turn (an item of many frames counts each): a ``peek``
# that would go past it is refused (``ValueError``: peek again, or fewer items), so neither one
# message of thousands of ``peek n=1024`` records nor a few peeks of items of 65,535 frames
# each can stall the loop; the first peek of a turn always gets one item (its frames are
# bounded by ``max_frames``)
PEEKED_PER_TURN = 65536


class TurnCosts:
    """What the records of the current turn cost beyond one record each (``Broker`` starts
    anew each turn): the ``stats`` bodies made, and the frames ``peek`` records copied (each
    counts against the turn's record budget, ``RECORDS_PER_TURN``: a message of 4096
    ``peek n=1024`` records made 4 million reply frames in one turn)."""

    def __init__(self) -> None:
        self.made = 0
        # by the figures they report: ``clients`` and the asker left out of the same-host ones
        # (zmq.Frames: every reply refers to one body, where pyzmq would copy a bytes object
        # under its copy threshold into each: a flood of stats nobody reads costs references)
        self.bodies: dict[tuple[int, int], zmq.Frame] = {}
        self.peeked = 0
        self.last: zmq.Frame | None = None
        self.last_cost = 0.0  # seconds the last body took to make
        self.stats_credit = STATS_BURST_S  # seconds of making stats bodies (STATS_SHARE)
        self._credit_at = time.monotonic()

    def new_turn(self) -> None:
        self.peeked = 0
        self.made = 0

    def may_make_stats(self) -> bool:
        """Whether a ``stats`` record may have a body made afresh (FRESH_STATS_PER_TURN, and
        the credit of STATS_SHARE)."""
        if self.made >= FRESH_STATS_PER_TURN:
            return False
        now = time.monotonic()
        self.stats_credit = min(STATS_BURST_S,
                                self.stats_credit + (now - self._credit_at) * STATS_SHARE)
        self._credit_at = now
        return self.last_cost < STATS_DEAR_S or self.stats_credit > 0

    def last_stats(self, figures: tuple[int, int]) -> zmq.Frame | None:
        """The body to answer again while none may be made: the last one of the asker's
        ``figures`` (``stats``), else the last one made (its client counts may be off by the
        asker or a connection), None before the first."""
        return self.bodies.get(figures, self.last)

    def made_stats(self, figures: tuple[int, int], body: bytes, seconds: float) -> zmq.Frame:
        """A body made afresh in ``seconds``: the one later records get while none may be (as
        the frame every reply refers to, returned)."""
        if figures not in self.bodies and len(self.bodies) >= 2:
            self.bodies.clear()  # the figures of an observer and of a client, lately
        frame = self.bodies[figures] = self.last = zmq.Frame(body)
        self.made += 1
        self.last_cost = seconds
        if seconds >= STATS_DEAR_S:
            self.stats_credit -= seconds
        return frame


def stats(broker: Broker, client: Client, rec: Stats, frames: list) -> None:
    if frames:
        raise _carries_frames(rec, frames)
    # an observer (zchannel stat) does not count itself
    table = broker.sessions.clients
    clients = len(table) - (1 if rec.exclude_self and client.address in table else 0)
    if broker.replica is not None:  # the other replicas' links are not clients
        clients -= broker.replica.bindings.peer_clients(c.identity for c in table.values())
    # the asker's own same-host (shared-memory) connection likewise
    same_host = 1 if rec.exclude_self and client in broker.shm.verified else 0
    figures = (clients, same_host)
    costs = broker.turn_costs
    body = None if costs.may_make_stats() else costs.last_stats(figures)
    if body is None:
        start = time.perf_counter()
        made = _stats_body(broker, clients, same_host)
        body = costs.made_stats(figures, made, time.perf_counter() - start)
    broker.sessions.reply(client, rec.id, items=[Item([body], 0, len(body))], raw=True)


def _stats_body(broker: Broker, clients: int, same_host_asker: int) -> bytes:
    """The stats dict, encoded; ``clients`` counted already, and ``same_host_asker`` (1 or 0)
    taken from the shared-memory clients."""
    stats = broker.core.stats()
    guard = broker.endpoint.guard  # the connection budget (server/admission.py)
    if guard is not None:  # bound
        stats.update(connections=guard.connections, max_clients=guard.max_clients,
                     refused_connections=guard.refused)
    stats.update(address=broker.address, pid=os.getpid(), sched=broker.sched_policy, clients=clients,
                 lease_timeout=broker.config.lease_timeout,
                 shm=broker.shm.stats(), **broker.counters.as_dict(),
                 metrics=broker.metrics.url if broker.metrics is not None else None,
                 journal=broker.journal.stats() if broker.journal is not None else None)
    stats["shm"]["clients"] -= same_host_asker
    if broker.replica is not None:
        broker.replica.annotate(stats)
    body, _ = codec.encode(stats)
    return body


def ack(broker: Broker, client: Client, rec: Ack, frames: list) -> None:
    if frames:
        raise _carries_frames(rec, frames)
    if rec.lease is None:
        raise ValueError("an ack record names the lease it acknowledges (field 'lease', an "
                         "int >= 0, as the get's reply gave it)")
    broker.core.ack(client, rec.id, rec.lease)


def peek(broker: Broker, client: Client, rec: Peek, frames: list) -> None:
    """Copies of head items: sent like a batch, never tracked as delivered."""
    if frames:
        raise _carries_frames(rec, frames)
    costs = broker.turn_costs
    items = broker.core.peek(key_from_wire(rec.key), check_peek_count(rec.count),
                             check_consumer(rec.consumer))
    copied = 0
    for item in items:
        copied += len(item.payload)
    if costs.peeked + copied > PEEKED_PER_TURN and (costs.peeked or len(items) > 1):
        raise ValueError(f"peeking {len(items)} items of {copied} frames would copy more than "
                         f"{PEEKED_PER_TURN} frames in this turn of the broker's loop (with "
                         f"{costs.peeked} copied already): peek again, or fewer items")
    costs.peeked += copied
    for item in items:
        _share_frames(item.payload)
    broker.sessions.reply(client, rec.id, items=items, batch=True, raw=True,
                 weights=[item.weight for item in items])


def _share_frames(payload: Any) -> None:
    """Make the bytes frames of a queued item's ``payload`` (a list; slots are left alone)
    ``zmq.Frame``s in place, holding the same bytes once: every reply then refers to them,
    where pyzmq would copy a bytes object under its copy threshold into each (a flood of
    peeks nobody reads costs the broker references, not copies of the queue)."""
    if type(payload) is list:
        for i, frame in enumerate(payload):
            if type(frame) is bytes:
                payload[i] = zmq.Frame(frame)


def cancel(broker: Broker, client: Client, rec: Cancel, frames: list) -> None:
    if frames:
        raise _carries_frames(rec, frames)
    if rec.request_id is None:
        raise ValueError("a cancel record names the request it withdraws (field 'rid', the "
                         "int id of a waiting put or get of this client)")
    broker.core.cancel(client, rec.id, rec.request_id)


def bye(broker: Broker, client: Client, rec: Bye, frames: list) -> None:
    """The client leaves (frames it should not own change nothing: a bye always ends the
    session, as the loop takes it)."""
    broker.sessions.clients.pop(client.address, None)
    broker.sessions.client_gone(client)
    broker.sessions.reply(client, rec.id, result=True)


def shm_record(broker: Broker, client: Client, rec: ShmHello | ShmRelease, frames: list) -> None:
    if not _unanswered_with_frames(rec, frames):
        broker.shm.handle(client, rec)


def shutdown(broker: Broker, client: Client, rec: Shutdown, frames: list) -> None:
    """Stop the broker for a request with its shutdown token, or from a CURVE client whose
    public key is one of ``curve_admin_keys`` (``docs/security.md``); ``PermissionError``
    (nothing changes) for anyone else."""
    if frames:
        raise _carries_frames(rec, frames)
    token = rec.token
    valid = isinstance(token, str) and hmac.compare_digest(token.encode(), broker.token.encode())
    if not valid and not (client.user is not None and client.user in broker.admin_keys):
        log.warning("refused a shutdown request without this broker's token (client %s)",
                    client.address.hex())
        raise PermissionError(
            "shutdown refused: the request does not carry this broker's shutdown token (the "
            "handle that created the channel holds it; `zchannel broker stop NAME` reads it "
            "from the run directory)")
    if not valid:
        log.info("stopping: shutdown requested by admin key %s", client.user)
    broker.sessions.reply(client, rec.id, result=True)
    broker.stop()


def replica_record(broker: Broker, client: Client, rec: Bind | Learn | Sync | Load | Release,
                   frames: list) -> None:
    """The binding table of a distributed channel (``broker/cluster/binding.py``) and its key moves
    (``broker/cluster/moving.py``)."""
    if broker.replica is None:
        raise ValueError(f"unknown op {op_of(rec)!r}")
    if frames:
        raise _carries_frames(rec, frames)
    broker.sessions.reply(client, rec.id, result=broker.replica.handle(rec))


HANDLERS: dict[type[Request], Handler] = {
    Put: put, PutBatch: put_batch, Get: get, GetRun: get_run, GetBatch: get_batch,
    Heartbeat: heartbeat, QSize: qsize, Full: full,
    Stats: stats, Ack: ack, Peek: peek, Cancel: cancel, Bye: bye, ShmHello: shm_record,
    ShmRelease: shm_record, Shutdown: shutdown, Bind: replica_record, Learn: replica_record,
    Sync: replica_record, Load: replica_record, Release: replica_record,
}


def on_moved_keys(handler: Handler) -> Handler:
    """``handler`` of an operation on one key, on a replica that moves keys (``steal``): a key
    this replica gave away is answered with ``KeyMoved`` (nothing happens)."""
    def handle(broker: Broker, client: Client, rec: Any, frames: list) -> None:
        if broker.replica is not None:
            broker.replica.check_key(rec)
        handler(broker, client, rec, frames)
    return handle


def handlers_for(replica: ReplicaState) -> dict[type[Request], Handler]:
    """The handler table of a replica (``ReplicaState``): ``HANDLERS``, with the operations on
    one key checked first for keys that moved when the replica moves keys."""
    if replica.mover is None:
        return HANDLERS
    return {**HANDLERS, **{kind: on_moved_keys(HANDLERS[kind]) for kind in KEYED_TYPES}}
