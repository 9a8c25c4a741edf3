"""The broker's clients: who is there, what each is owed this turn, and when each expires.

``Sessions`` holds the table of clients by address, the replies coalesced for each in the
current turn of the loop (an ``Outbox`` each, sent by ``flush``), and the heartbeat and expiry
rules in one place: a client silent for ``heartbeat_interval * liveness`` seconds is ended
(its requests withdrawn, its leases returned, its slots dropped) and told ``expired``; one the
broker has not written to for ``heartbeat_interval`` gets a heartbeat; a message from an
unknown address is answered ``expired`` (at most every 0.2 s per address).  The loop
(``server/loop.py``) calls ``heartbeats`` every half interval and ``was_stalled`` when it did not run
for a while; the handlers (``server/handlers.py``) answer through ``reply``.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from zchannel.broker.core.queuecore import QueueCore
from zchannel.broker.core.state import Client, Item
from zchannel.broker.core.waiters import reply_each
from zchannel.broker.errors import error_to_wire
from zchannel.broker.host.heap import trim_heap
from zchannel.broker.journal.journal import Journal
from zchannel.broker.server import metrics
from zchannel.broker.server.config import BrokerConfig
from zchannel.broker.server.outbox import Outbox
from zchannel.broker.server.peers import Peers
from zchannel.broker.server.producers import Producers
from zchannel.broker.shm.broker import ShmBroker, SlotFrames
from zchannel.broker.transport import direct_broker
from zchannel.broker.wire.protocol import (
    BROKER_EXPIRED,
    BROKER_HEARTBEAT,
    INLINE_BODY,
    ITEMS,
    MAX_BATCH_PUTS,
    MAX_INLINE_BATCH_BYTES,
    NOTICE_BYTES,
    Reply,
    arrival_s,
    broker_notice,
    pack_header,
)

log = logging.getLogger("zchannel.broker")


def _add_items(out: Outbox, entries: list[tuple[int, bytes, int | None]]) -> int:
    """Answer gets with their small items, ``(rid, body, lease)`` each, inside ``items``
    records: the outbox's last record while it is one with room (the replies keep their
    order), then new ones of at most ``MAX_BATCH_PUTS`` entries; how many records were made."""
    records = out.records
    last = records[-1] if records else None
    if last is not None and last.op == ITEMS and last.items is not None:
        room = MAX_BATCH_PUTS - len(last.items)
        if len(entries) <= room:
            last.items.extend(entries)
            return 0
        last.items.extend(entries[:room])
        entries = entries[room:]
    made = 0
    for start in range(0, len(entries), MAX_BATCH_PUTS):
        records.append(Reply(op=ITEMS, items=entries[start : start + MAX_BATCH_PUTS]))
        made += 1
    return made


def _run_deliveries(client: Client, items: list[Item],
                    origins: list[tuple[Any, str | None]]) -> list[tuple]:
    """The deliveries of a run of gets answered with ``items`` from the queues ``origins``
    names (handed back in order if the client cannot be reached): one for a run of one queue,
    else one per item."""
    first = origins[0]
    if origins.count(first) == len(origins):
        return [(client, first, items, None)]
    return [(client, origin, [item], None) for origin, item in zip(origins, items, strict=True)]


def _inline_bodies(items: list[Item]) -> list[bytes] | None:
    """The bodies of a get_batch's ``items`` when each is one frame of at most ``INLINE_BODY``
    bytes (not in shared memory), together at most ``MAX_INLINE_BATCH_BYTES``; else None."""
    if len(items) > MAX_BATCH_PUTS:
        return None
    bodies = []
    total = 0
    for item in items:
        body = _inline_body(item)
        if body is None:
            return None
        total += len(body)
        bodies.append(body)
    return bodies if total <= MAX_INLINE_BATCH_BYTES else None


def _inline_body(item: Item) -> bytes | None:
    """The body of ``item`` when it is one frame of at most ``INLINE_BODY`` bytes, not in shared
    memory (it may then ride inside its reply record), as bytes; else None."""
    payload = item.payload
    if isinstance(payload, SlotFrames) or len(payload) != 1 or len(payload[0]) > INLINE_BODY:
        return None
    body = payload[0]
    return body if type(body) is bytes else bytes(body)


def _attach_frames(shm: ShmBroker, out: Outbox, client: Client, rec: Reply, items: list[Item],
                   batch: bool) -> None:
    """Queue the frames of ``items`` in ``out`` for ``rec`` (``nf``; ``n`` of a batch)."""
    nf = 0
    counts = []
    r0, f0 = len(out.records), len(out.frames)
    for i, item in enumerate(items):
        payload = item.payload
        out.frames.extend(payload)
        n = len(payload)
        if isinstance(payload, SlotFrames):  # slot references, or the slots' bytes as frames
            n += shm.attach_reply(client, payload, rec, i, len(items), out.frames)
        nf += n
        counts.append(n)
    rec.nf = nf
    out.record_added(r0, f0)
    if batch:
        rec.counts = counts


class Sessions:
    """The clients of one broker, their replies of this turn, their heartbeats and expiry.

    ``core`` is set once the queue core exists (it answers through ``reply``); ``peers`` once
    the broker bound its socket, and back to None when it closed (nothing is sent then)."""

    def __init__(self, config: BrokerConfig, shm: ShmBroker, counters: metrics.Counters,
                 replica: Any = None) -> None:
        self.config = config
        self.shm = shm
        self.counters = counters
        self.replica = replica
        self.core: QueueCore | None = None
        self.peers: Peers | None = None
        # a durable channel's journal: written before replies go (``commit``), told after (``sent``)
        self.journal: Journal | None = None
        self.clients: dict[bytes, Client] = {}
        self.last_sent: dict[bytes, float] = {}
        # clients sent something after a silence past ``judge_after``: they may have failed
        # their requests meanwhile (``judged_gone`` sees to them before the next turn reads)
        self.suspects: set[bytes] = set()
        self.judge_after = config.heartbeat_interval * (config.liveness - 1)
        self._out: dict[bytes, Outbox] = {}
        self._expired_told: dict[bytes, float] = {}
        # the clients' notices of a large message (``announced``): address -> (when it came,
        # how long its message may take to arrive); void once a message came since
        self._arriving: dict[bytes, tuple[float, float]] = {}
        self._peak_held = 0
        self.producers = Producers(config.producer_grace)  # retry-safe puts
        # the batch of puts being handled (``collect_acks``)
        self._ack_client: Client | None = None
        self._ack_ids: set[int] = set()
        self._acked: list[int] = []

    def tell_expired(self, address: bytes, now: float) -> None:
        """A message came from ``address``, which is no client (any more): say ``expired``,
        after the replies queued for it this turn (to the records before, such as those
        before its ``bye``: records go out in the order they were produced)."""
        if now - self._expired_told.get(address, 0.0) < 0.2:
            return
        self._expired_told[address] = now
        self._outbox(address).records.append(BROKER_EXPIRED)

    def forget_expired(self, address: bytes) -> None:
        """``address`` said hello: an ``expired`` is due again at once when it is unknown next."""
        self._expired_told.pop(address, None)

    # -- sending -----------------------------------------------------------------------------

    def reply(self, client: Client, rid: int, result: Any = None, error: BaseException | None = None,
              items: list[Item] | None = None, batch: bool = False, lease: int | None = None,
              origin: Any = None, raw: bool = False, weights: list | None = None) -> None:
        """Queue the reply to request ``rid`` of ``client`` (sent at the end of the turn)."""
        if self._ack_client is client and error is None and items is None and result is None \
                and rid in self._ack_ids:  # a put of a batch stored: the batch's reply says so
            self._acked.append(rid)
            return
        out = self._outbox(client.address)
        if items is None and error is None and weights is None:  # an acknowledgement or a result
            out.records.append(Reply(id=rid, result=result))
            return
        if error is None and items is not None and not batch and not raw and len(items) == 1 \
                and (body := _inline_body(items[0])) is not None:
            # a small item rides in the reply record (no frame)
            out.deliveries.append((client, origin, items, lease))
            self.counters.delivered += 1
            if client.items:  # with the small items before it, one ``items`` record
                self.counters.item_records += _add_items(out, [(rid, body, lease)])
                return
            out.records.append(Reply(id=rid, weights=weights, body=body, lease=lease))
            return
        rec = Reply(id=rid, weights=weights)
        if error is not None:
            rec.error = error_to_wire(error)
        elif items is not None and batch and not raw and client.items \
                and (bodies := _inline_bodies(items)):
            rec.bodies = bodies  # a batch of small items rides in its record (no frame)
            out.deliveries.append((client, origin, items, lease))
            self.counters.delivered += len(items)
        elif items is not None:
            _attach_frames(self.shm, out, client, rec, items, batch)
            rec.lease = lease
            if not raw:
                out.deliveries.append((client, origin, items, lease))
                self.counters.delivered += len(items)
        else:
            rec.result = result
        out.records.append(rec)

    def reply_run(self, client: Client, rids: list[int], items: list[Item],
                  origins: list[tuple[Any, str | None]]) -> None:
        """Queue the replies of plain gets ``rids`` served at once with ``items``, one each in
        order, from the queues ``origins`` names (one per item; ``QueueCore.take_run``,
        ``waiters.take_heads``): for a client that reads ``items`` records, small items as
        entries of the last one (or new ones; ``_run_deliveries``); else reply by reply, as
        ``reply`` answers each."""
        bodies = _inline_bodies(items) if client.items else None
        if bodies is None:
            reply_each(self.reply, client, rids, items, origins)
            return
        out = self._outbox(client.address)
        out.deliveries.extend(_run_deliveries(client, items, origins))
        self.counters.delivered += len(items)
        self.counters.item_records += _add_items(
            out, [(rid, body, None) for rid, body in zip(rids, bodies, strict=True)])

    def _outbox(self, address: bytes) -> Outbox:
        """The replies of this turn for the client at ``address`` (made on first use)."""
        out = self._out.get(address)
        if out is None:
            out = self._out[address] = Outbox()
        return out

    def collect_acks(self, client: Client, ids: set[int]) -> list[int]:
        """From now until ``end_acks``, a bare acknowledgement to one of the requests ``ids``
        of ``client`` is not queued as a record of its own: its id is added to the list
        returned (in order), which the batch's one reply carries (``server/batches.py``)."""
        self._ack_client, self._ack_ids, self._acked = client, ids, []
        return self._acked

    def end_acks(self) -> None:
        """Acknowledgements are queued as records again (see ``collect_acks``)."""
        self._ack_client, self._ack_ids = None, set()

    def _send(self, address: bytes, records: list, frames: list) -> bool:
        """Send to the client at ``address`` over its transport (``server/peers.py``); False when it
        cannot be reached (``flush`` then requeues and ends the client)."""
        peers = self.peers
        if peers is None or not peers.send(address, [pack_header(records), *frames]):
            return False
        now = time.monotonic()
        if now - self.last_sent.get(address, now) > self.judge_after:
            self.suspects.add(address)  # the silence before this send was the broker's stall
        self.last_sent[address] = now
        return True

    def flush(self) -> None:
        """Send the replies coalesced this turn (none once the broker closed its socket).  On a
        durable channel what they confirm is written to the journal first, and the removals of
        the items they deliver are recorded once they left (``Journal.commit``/``sent``)."""
        journal = self.journal
        while self._out and self.peers is not None:
            if journal is not None:  # also for replies made while sending (a requeue)
                if journal.failed:
                    self._out.clear()  # never confirm what the journal may not hold
                    return
                journal.commit()
            out_all, self._out = self._out, {}
            for address, out in out_all.items():
                unsent = self._send_outbox(address, out)
                if unsent is not None:  # the client ends, its unsent deliveries requeued
                    dropped = out.deliveries[unsent:]
                    _log_unreachable(address, self._end_client(address, dropped), dropped)
        if journal is not None:
            journal.sent()

    def _send_outbox(self, address: bytes, out: Outbox) -> int | None:
        """Send the messages of ``out`` in order; None when all went, else the index of the
        first delivery of the first message that could not go.  Over ZeroMQ, which hands a
        message over only whole, one of at least ``NOTICE_BYTES`` of frames goes right behind
        a notice naming them (the client's judgement of this broker's silence waits for it)."""
        messages = out.messages()
        whole = len(messages) == 1  # (then ``out.nbytes`` counts its frames' bytes)
        for records, frames, first in messages:
            nbytes = (out.nbytes if whole else sum(len(f) for f in frames)) if frames else 0
            if nbytes >= NOTICE_BYTES and not direct_broker.is_link_address(address) \
                    and not self._send(address, [broker_notice(nbytes)], []):
                return first
            if not self._send(address, records, frames):
                return first
        return None

    def announced(self, client: Client, nbytes: int) -> None:
        """``client``'s notice (just read) of a message of ``nbytes`` it sends next: ZeroMQ
        hands it over only whole, so until it (or anything) arrives, the client's silence
        counts from the end of its crossing at the floor rate (``protocol.arrival_s``)."""
        self._arriving[client.address] = (client.last_seen, arrival_s(nbytes))

    def _silent_since(self, address: bytes, client: Client) -> float:
        """When ``client`` last gave a sign of life: its last message, or past a notice with no
        message since, the end of the time its message may take to arrive (``announced``)."""
        notice = self._arriving.get(address)
        if notice is None or notice[0] < client.last_seen:
            return client.last_seen
        return max(client.last_seen, notice[0] + notice[1])

    # -- ending clients ----------------------------------------------------------------------

    def _end_client(self, address: bytes, unsent: list[tuple]) -> Client | None:
        """``address`` cannot be reached: the ``unsent`` deliveries (of replies that did not
        go) go back to their queues first, then the client ends (its leases, parked
        requests, holds)."""
        client = self.clients.pop(address, None)
        self.last_sent.pop(address, None)
        self._core().hand_back(unsent)  # each queue keeps its order
        if client is not None:
            self.client_gone(client)
        return client

    def _core(self) -> QueueCore:
        if self.core is None:
            raise RuntimeError("the broker's queue core is not made yet")
        return self.core

    def client_gone(self, client: Client, expired: bool = False) -> None:
        """``client`` left or was ended: the core withdraws its requests and returns its leases,
        then the slots it held as a consumer are dropped (``ShmBroker.client_gone``: kept for
        an ``expired`` one whose process runs), and its producer window starts its grace
        period (``Producers.detach``).  Each step runs even if one before it failed (logged):
        one client's end never stops the loop."""
        shm_gone = functools.partial(self.shm.client_gone, expired=expired)
        for step in (self._core().client_gone, shm_gone, self.producers.detach):
            try:
                step(client)
            except Exception:
                log.exception("ending client %s: %s failed", client.address.hex(),
                              getattr(step, "__qualname__", step))

    def direct_gone(self, peer: direct_broker.Peer) -> None:
        """A link closed (its process exited or was killed): the client is gone at once."""
        if self.peers is not None:
            self.peers.drop(peer)
        out = self._out.pop(peer.address, None)
        self._end_client(peer.address, out.deliveries if out is not None else [])

    # -- heartbeats and expiry -----------------------------------------------------------------

    def was_stalled(self, seconds: float) -> None:
        """The loop did not look at its sockets for ``seconds`` more than it planned (a loaded
        machine did not run it, or a turn was long): the clients' silence meanwhile is not
        theirs (their heartbeats may still be on the way in), so it does not count towards
        their expiry."""
        log.info("the broker did not read for %.1fs: clients' expiry moved on as much", seconds)
        for client in self.clients.values():
            client.last_seen += seconds
        self._arriving = {a: (since + seconds, s) for a, (since, s) in self._arriving.items()}

    def judged_gone(self, now: float) -> None:
        """Before a turn reads any message: a client this broker sent nothing for about the
        expiry (less one heartbeat: it may have read the last send late) — now, or before a
        send since (``suspects``: the stall fell inside a turn that went on sending) — may
        have failed its pending requests with ``BrokerUnavailable``, so its parked gets are
        withdrawn, it is told it expired (it fails what it still waits for and says hello),
        and its gets sent before that hello are dropped.  (Its puts go on: a retry of one is
        recognised, docs/guarantees.md.)"""
        waiters, suspects = self._core().waiters, self.suspects
        for address, client in list(self.clients.items()):
            silent = now - self.last_sent.get(address, now) > self.judge_after
            if client.stale or not (silent or address in suspects):
                continue
            log.info("client %s heard nothing from this broker for a while (a stall): its "
                     "gets are withdrawn", address.hex())
            client.stale = True
            for req in [r for r in client.parked.values() if r.kind != "put"]:
                waiters.withdraw(req)
            # one that did not judge yet fails what it still waits for and says hello
            self._send(address, [BROKER_EXPIRED], [])
        self.suspects = set()  # (the expired notices just sent joined it)

    def heartbeats(self, now: float) -> None:
        """Every half heartbeat interval: expire the silent, heartbeat the idle, close direct
        links that never said hello (or not again after their client expired), and let the
        other periodic chores run."""
        self._peak_held = _release_memory(self._core().bytes_held, self._peak_held)
        self.producers.sweep(now)
        if self.replica is not None:
            self.replica.tick()
        self.shm.sweep(now)
        hb = self.config.heartbeat_interval
        expiry = hb * self.config.liveness
        for address, client in list(self.clients.items()):
            if now - client.last_seen > expiry and now - self._silent_since(address, client) > expiry:
                log.info("client %s expired (no heartbeat for %.1fs)", address.hex(), now - client.last_seen)
                del self.clients[address]
                self.last_sent.pop(address, None)
                self.client_gone(client, expired=True)
                # after the replies of this turn (a parked get's timeout, say): in order
                self._outbox(address).records.append(BROKER_EXPIRED)
                if self.peers is not None:
                    self.peers.expired(address, now)
            elif now - self.last_sent.get(address, 0.0) >= hb / 2 and address not in self._out:
                # checked every half interval: at most one interval between two messages
                self._outbox(address).records.append(BROKER_HEARTBEAT)
        for address in [a for a in self.last_sent if a not in self.clients]:
            del self.last_sent[address]
        for address, (since, _) in list(self._arriving.items()):
            known = self.clients.get(address)
            if known is None or since < known.last_seen:  # gone, or its message came
                del self._arriving[address]
        listener = self.peers.listener if self.peers is not None else None
        if listener is not None:  # links that never said hello hold a descriptor each
            for peer in [p for p in listener.by_fd.values()
                         if not p.greeted and now - p.since > expiry]:
                log.info("closed a direct link that said nothing for %.1fs", now - peer.since)
                self.direct_gone(peer)
        for address in [a for a, t in self._expired_told.items() if now - t > expiry]:
            del self._expired_told[address]


def _log_unreachable(address: bytes, client: Client | None, unsent: list[tuple]) -> None:
    """A reply to ``address`` could not be sent, and ``client`` (None: none was registered
    there) ended: when items were in its ``unsent`` deliveries (requeued), a line says how
    many.  A connection gone with none (as one a process drops right after its hello, which
    concurrent first connects of its threads do) is no news to the operator: debug."""
    items = sum(len(delivery[2]) for delivery in unsent)
    if items:
        log.info("client %s went away or stopped reading before its reply was sent: %d "
                 "item(s) of its unsent replies were requeued", address.hex(), items)
    elif client is not None:
        log.debug("client %s went away before its reply was sent (it held no items)",
                  address.hex())


def _release_memory(held: int, peak: int) -> int:
    """After a large backlog drained (``held`` bytes now, ``peak`` at most since the last
    time), hand freed heap pages back to the OS (glibc keeps them otherwise, and the broker's
    RSS would stay at its peak); the peak from now on."""
    peak = max(peak, held)
    if held == 0 and peak >= 16 << 20:
        trim_heap()
        return 0
    return peak
