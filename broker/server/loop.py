"""The broker process: one single-threaded event loop over a ``QueueCore``.

``Broker`` owns the loop and its parts: the ``Endpoint`` (channel lock, ROUTER socket, the
direct-link listener beside it, address files), the ``Sessions`` (clients, the replies coalesced
per client in a turn, heartbeats and expiry), the ``QueueCore`` and the shared-memory side
(``ShmBroker``).  Each turn polls the socket, the direct links and the stop sources
(``server/stopping.py``), hands each record to the handler of its operation (``handlers.HANDLERS``;
``handlers_for`` on a replica), lets the core expire deadlines, runs the sessions' heartbeats
every half interval, and flushes the replies.  With no collector and a built-in dispatcher it never decodes a payload: the
``zmq.Frame`` objects it received are stored and sent on with ``copy=False``.  With
``metrics_port`` a thread serves Prometheus metrics from snapshots the loop builds when a
scrape asks (``server/metrics.py``).
"""

from __future__ import annotations

import gc
import io
import logging
import math
import os
import secrets
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TextIO

import zmq
from zchannel.broker.cluster.replica import replica_state, wrap_collector
from zchannel.broker.core.queuecore import QueueCore
from zchannel.broker.core.state import Client, Item, item_bytes
from zchannel.broker.errors import BrokerUnavailable, KeyMoved
from zchannel.broker.host import paths
from zchannel.broker.host.regularfile import open_regular_file
from zchannel.broker.host.scheduling import batch_wanted, use_batch_policy
from zchannel.broker.journal.journal import Journal
from zchannel.broker.journal.syncing import JournalFailed
from zchannel.broker.server import metrics
from zchannel.broker.server.admission import PeerGuard, client_budget, raise_fd_limit
from zchannel.broker.server.config import BrokerConfig, lock_name_of
from zchannel.broker.server.durable import open_journal
from zchannel.broker.server.endpoint import Endpoint
from zchannel.broker.server.handlers import HANDLERS, TurnCosts, handlers_for, hello
from zchannel.broker.server.peers import Peers
from zchannel.broker.server.sessions import Sessions
from zchannel.broker.server.startwatch import close_pidfd
from zchannel.broker.server.stopping import StopSources
from zchannel.broker.shm.broker import ShmBroker
from zchannel.broker.transport import direct_broker
from zchannel.broker.transport.curve_broker import BrokerHandshakes, admin_keys
from zchannel.broker.transport.curve_keys import warn_if_others_can_read
from zchannel.broker.transport.sockets import recv_message
from zchannel.broker.wire import arrays, codec
from zchannel.broker.wire.classtags import register_paths
from zchannel.broker.wire.protocol import (
    BYE,
    HELLO,
    BadRecord,
    Bye,
    Get,
    GetBatch,
    GetRun,
    Hello,
    ProtocolError,
    PutBatch,
    Request,
    op_of,
    requests_in,
    unpack_requests,
)
from zchannel.hooks import (
    expand_consumers,
    import_named,
    import_path,
    resolve_collector,
    resolve_dispatcher,
)

log = logging.getLogger("zchannel.broker")

# records handled per turn of the loop at most (then the replies go out): a client's flood of
# requests in large messages cannot pile up replies without bound
RECORDS_PER_TURN = 16384
# Header bytes and frames the loop takes from its ZeroMQ socket per turn at most (then the
# replies, heartbeats and timers of the turn run): each message counts, handled or dropped, so
# a flood of messages that are refused (a header over a limit, more frames than max_frames)
# cannot hold the loop for longer than decoding this many bytes and receiving this many frames.
# The message that reaches a bound is handled whole; a direct link has a header budget of its
# own (``direct_broker.HEADER_BUDGET``).
HEADER_BYTES_PER_TURN = direct_broker.HEADER_BUDGET
FRAMES_PER_TURN = 1 << 16
# a token file's token, in characters: a guess must be hopeless, and ``zchannel broker stop``
# must be able to send it (a header is at most ``max_header_bytes``, at least 256 KiB)
MIN_TOKEN_CHARS, MAX_TOKEN_CHARS = 16, 1024
# plain ints: an operation on pyzmq's enum flags costs an Enum call, per link and turn
_POLLOUT, _POLLIN_ERR = int(zmq.POLLOUT), int(zmq.POLLIN | zmq.POLLERR)
# the frames of a record that has none (handlers never change the list they are given)
_NO_FRAMES: list = []


class _RateLimitFilter(logging.Filter):
    """At most ``burst`` records of the same message template per ``period`` seconds; the first
    record of a later period says how many of the template the period before it dropped.

    At most ``max_templates`` templates are tracked, by hash (a long message costs no more
    than a short one), in the order their periods started.  When the table is full, the
    templates whose period ended are forgotten; if none has, a record of a template not in it
    counts against one budget those share (``burst`` per ``period`` too): messages that
    differ every time (an f-string with a counter) neither grow the table nor flood the log."""

    def __init__(self, burst: int = 5, period: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_templates: int = 1024) -> None:
        super().__init__()
        self.burst, self.period, self._clock = burst, period, clock
        self.max_templates = max_templates
        self._seen: OrderedDict[int, tuple[float, int]] = OrderedDict()  # hash -> (start, count)
        self._others: tuple[float, int] = (-math.inf, 0)  # the shared budget's (start, count)

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        template = str(record.msg)
        key = hash(template)
        if key not in self._seen and len(self._seen) >= self.max_templates:
            self._forget_ended(now)
        shared = key not in self._seen and len(self._seen) >= self.max_templates
        start, count = self._others if shared else self._seen.get(key, (now, 0))
        if now - start > self.period:
            dropped = count - self.burst
            if dropped > 0:
                like = (f"more of messages beyond the {self.max_templates} tracked"
                        if shared else "more like this")
                record.msg = (f"{template} ({dropped} {like} were not logged in the previous "
                              f"{self.period:g} s window)")
            start, count = now, 0
            self._seen.pop(key, None)  # a new period: the template moves to the table's end
        if shared:
            self._others = (start, count + 1)
        else:
            self._seen[key] = (start, count + 1)
        return count < self.burst

    def _forget_ended(self, now: float) -> None:
        """Drop the templates whose period ended (the oldest first, up to a live one)."""
        while self._seen:
            key, (start, _) = next(iter(self._seen.items()))
            if now - start <= self.period:
                return
            del self._seen[key]


def setup_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s zchannel[%(process)d] %(levelname)s %(message)s"))
    handler.addFilter(_RateLimitFilter())
    root = logging.getLogger("zchannel")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def curve_admins(config: BrokerConfig) -> frozenset:
    """The CURVE public keys (``curve_admin_keys``) whose clients may stop the broker without
    its shutdown token; ``ValueError`` for admin keys without CURVE."""
    if config.curve_admin_keys is None:
        return frozenset()
    if config.curve_secret_key is None:
        raise ValueError("curve_admin_keys needs CURVE (curve_secret_key): without it the "
                         "broker cannot tell who a client is")
    return admin_keys(config.curve_admin_keys)


def _load_classes(config: BrokerConfig) -> None:
    """Import the modules ``config`` names (``--import``), and register the classes its
    creator registered (``types``), before any hook is resolved."""
    for module in config.imports:
        import_named(module)
    register_paths(config.types, import_path)


class Broker:
    """Serves one channel until stopped: the loop, and the dispatch of each record to its
    handler."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        paths.check_name(config.name)
        self.sched_policy = "other"  # the loop's scheduling policy once serving (stats)
        _load_classes(config)
        if config.allowed_dtypes is not None or config.max_rank is not None:
            arrays.restrict(config.allowed_dtypes, config.max_rank)
        self.replica = None  # distributed: this broker is one replica (cluster/replica.py)
        self.handlers = HANDLERS
        if config.cluster is not None or config.replicas is not None:
            self.replica = replica_state(config)
            self.handlers = handlers_for(self.replica)
        self.lock_name = lock_name = lock_name_of(config.name, config.cluster, config.replicas,
                                                  config.replica)
        self.token = shutdown_token(config)
        self.admin_keys = curve_admins(config)  # CURVE clients that may stop it without the token
        self.announce_token = False  # log where the token is kept (``zchannel broker``)
        fd_limit = raise_fd_limit()  # the descriptor budget (server/admission.py)
        self.endpoint = Endpoint(config, lock_name, fd_limit,  # takes the channel lock
                                 client_budget(fd_limit, config.max_clients))
        self.address = self.endpoint.address
        self.exit_code = 0
        self.parent_fd: int | None = None  # the creator's pidfd, handed on to StopSources
        self.journal: Journal | None = None
        self.sock: zmq.Socket | None = None
        self.peers: Peers | None = None  # the clients' transports (set by bind)
        shm = None
        try:
            shm = ShmBroker(self.lock_name, str(paths.run_dir()), config.shm_threshold,
                            config.shm_pool_bytes, 2 * config.heartbeat_interval * config.liveness)
            self._setup(config, shm)
        except BaseException:  # a failed start leaves no files behind
            if shm is not None:
                shm.close()
            self.endpoint.release_lock()
            raise

    def _setup(self, config: BrokerConfig, shm: ShmBroker) -> None:
        self.shm = shm
        self.counters = metrics.Counters()
        self.turn_costs = TurnCosts()  # of this turn's stats and peeks (server/handlers.py)
        self.sessions = Sessions(config, self.shm, self.counters, self.replica)
        self.core = QueueCore(
            name=config.name,
            maxsize=config.maxsize,
            collector=_replica_collector(self, resolve_collector(config.collector)),
            dispatcher=resolve_dispatcher(config.dispatcher),
            producers=tuple(config.producers or ()),
            consumers=expand_consumers(config.consumers),
            options=config.options,
            reply=self.sessions.reply, reply_run=self.sessions.reply_run,
            decode_item=self.shm.decode_item(_decode_item), encode_item=_encode_item,
            slots_viewed=self.shm.slots_viewed,
            lease_timeout=config.lease_timeout,
            max_bytes=config.max_bytes,
            max_keys=config.max_keys,
            key_grace=config.key_grace,
        )
        hooks = self.core.hooks
        if not hooks.passthrough or (hooks.deals and hooks.dispatcher.needs_item):
            # A hook decodes items: import torch before serving, not on the first tensor (that
            # takes seconds on a loaded machine, long enough for clients to miss heartbeats).
            arrays.preload()
        self.sessions.core = self.core
        if config.journal is not None:  # a durable channel (broker/journal/)
            self.journal = open_journal(config, self.lock_name, self.core, self.sessions)
        self._running = False
        self.hook_time = metrics.HookTime()
        self.metrics: metrics.MetricsServer | None = None
        if config.metrics_port is not None:
            metrics.check_port(config.metrics_port)
            metrics.time_hooks(self.core, self.hook_time)

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self) -> str:
        """Bind the socket (``ZMQError`` for a busy address, ``ValueError`` for bad key files:
        ``close()`` then removes what was made)."""
        self.address = self.endpoint.bind(self.token)
        self.sock, self.peers = self.endpoint.sock, self.endpoint.peers
        self.sessions.peers = self.peers
        return self.address

    def bound(self) -> tuple[zmq.Socket, Peers]:
        """The socket and the clients' transports (``bind`` made them)."""
        sock, peers = self.sock, self.peers
        if sock is None or peers is None:
            raise RuntimeError(f"the broker of {self.config.name!r} is not bound")
        return sock, peers

    def serve_forever(self, report: TextIO | None = None) -> None:
        """Bind, print ``ready <address>`` on ``report`` (else stdout), and run the loop until a
        signal, a shutdown request or the death of the parent process."""
        stops: StopSources | None = None
        try:
            stops = self._start_serving()
            # EPIPE: the creator is gone
            print(f"ready {self.address}", file=report or sys.stdout, flush=True)
            self._serve(stops)
        except JournalFailed as exc:  # stop unanswered: a restarted broker recovers the disk's
            log.critical("channel %r stops: %s", self.config.name, exc)
            self.exit_code = 3
        finally:
            self.close()
            if stops is not None:
                stops.close()

    def _start_serving(self) -> StopSources:
        """Bind, start the metrics server and the replica link and make the poll set; the
        sources of a stop (signals, the parent's death) returned."""
        self.bind()
        self.metrics = _metrics_server(self)
        self.sched_policy = _tune_for_serving(batch_wanted(self.config.sched_batch))
        if self.replica is not None:
            self.replica.start(self.core)
        token_file = self.endpoint.token_file
        if self.announce_token and token_file is not None:  # (once nothing more can fail)
            log.info("shutdown token of %r kept in %s (readable by its owner only): "
                     "`zchannel broker stop %s` stops this broker", self.config.name,
                     token_file, token_file.stem)
        self._running = True  # before the handlers: a signal right after "ready" stops us
        stops = _stop_sources(self)
        sock, _ = self.bound()
        guard, _ = self._admission()
        poll_set: list[tuple[Any, int]] = [(sock, zmq.POLLIN), *stops.poll_items(),
                                           (guard.wake_fd, zmq.POLLIN)]
        if self.metrics is not None:
            poll_set.append((self.metrics.fd, zmq.POLLIN))
        self._poll_base = poll_set
        self._poll_set = list(poll_set)
        log.debug("broker %r serving %s (pid %d)", self.config.name, self.address, os.getpid())
        return stops

    def _admission(self) -> tuple[PeerGuard, BrokerHandshakes]:
        """The connection budget and the pending handshakes (``bind`` made them)."""
        guard, handshakes = self.endpoint.guard, self.endpoint.handshakes
        if guard is None or handshakes is None:
            raise RuntimeError(f"the broker of {self.config.name!r} is not bound")
        return guard, handshakes

    def _serve(self, stops: StopSources) -> None:
        """The loop: poll, handle what came, answer, then the timers of the turn."""
        sock, peers = self.bound()
        guard, handshakes = self._admission()
        woke = time.monotonic()
        next_hb = woke + self.config.heartbeat_interval / 2
        while self._running:
            polled, timeout_ms, events = self._poll(peers, next_hb)
            last, woke = woke, time.monotonic()
            if (woke - last - timeout_ms / 1000 > self.config.heartbeat_interval
                    or self.sessions.suspects):  # stalled (in the poll or a turn before it)
                self.sessions.judged_gone(woke)
            ready = [obj for obj, _ in events]
            if sock in ready:
                _drain(self)
                self.sessions.flush()  # replies first: the rest of the turn is not on their path
            if peers.listener is not None and len(events) > (sock in ready):
                self._direct_events(events)
            _side_events(self, ready, stops, guard, handshakes)
            next_hb = _turn_timers(self, polled, woke, timeout_ms, next_hb, peers, stops)
            self.sessions.flush()

    def _poll(self, peers: Peers, next_hb: float) -> tuple[float, int, list[tuple[Any, int]]]:
        """Wait for the sockets until the next deadline (a parked request's, the journal's, the
        heartbeat's): when the poll started, its timeout in ms and the events."""
        now = time.monotonic()
        wake = min(next_hb, self.core.next_deadline() or next_hb)
        if self.journal is not None:
            wake = min(wake, self.journal.due() or wake)
        timeout_ms = max(0, int((wake - now) * 1000) + 1)
        if peers.poll_dirty:  # links came or went, or a full socket held bytes back
            self._poll_set = peers.poll_set(self._poll_base)
        polled = time.monotonic()
        return polled, timeout_ms, zmq.zmq_poll(self._poll_set, timeout_ms)

    def close(self) -> None:
        """Stop serving and remove this broker's files: address file, socket file, shared
        memory, and last the lock file (a successor may start once it is released)."""
        if self.metrics is not None:  # its thread stops before the pipe closes
            self.metrics.close()
            self.metrics = None
        if self.endpoint.sock is not None:
            self.sessions.flush()
            self.sessions.peers = None  # nothing is sent from here on
            self.sock = None
            self.endpoint.close()
            if self.replica is not None:
                self.replica.close()
            log.debug("broker %r stopped", self.config.name)
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        fd, self.parent_fd = self.parent_fd, None  # not handed on: the loop never started
        close_pidfd(fd)
        self._release_files()

    def _release_files(self) -> None:
        """Remove the shared-memory segments and the lock file (while holding the lock)."""
        self.shm.close()
        self.endpoint.release_lock()

    # -- receiving ---------------------------------------------------------------------------

    def _handle(self, frames: list[zmq.Frame]) -> int:
        address = frames[0].bytes if len(frames) >= 2 else b""
        if not address or direct_broker.is_link_address(address):  # (a peer as a link)
            log.warning("dropped a message without a header or from a link-form routing id")
            return 0
        return self._handle_message(address, frames[1].buffer, frames, 2)

    def _handle_message(self, address: bytes, header: Any, frames: list, pos: int) -> int:
        """One message of ``address``: its header and, from ``frames[pos]`` on, its frames;
        the number of requests it stood for (``requests_in``)."""
        if len(frames) - pos > self.config.max_frames:
            return _refuse_frames(self, address, header, len(frames) - pos)
        try:
            records = unpack_requests(header, len(frames) - pos, self.config.max_header_bytes)
        except ProtocolError as exc:
            log.warning("dropped a malformed message: %s", exc)
            return 0
        client = self.sessions.clients.get(address)
        now = time.monotonic()
        if client is not None:
            client.last_seen = now
        head = frames[pos - 1]  # the header: a zmq.Frame (its CURVE User-Id), or link bytes
        handlers = self.handlers
        for rec in records:
            nf = rec.nf
            op_frames = frames[pos : pos + nf] if nf else _NO_FRAMES  # most have none
            pos += nf
            if isinstance(rec, BadRecord):
                _answer_bad_record(self.sessions, address, client, rec, now)
                continue
            kind = type(rec)
            if client is None or kind is Hello:
                client = _greet(self, address, rec, head, now)
                continue
            if client.stale and kind in _GETS:
                continue  # its caller was told it failed (``Sessions.judged_gone``)
            try:
                handlers[kind](self, client, rec, op_frames)
            except Exception as exc:
                if not isinstance(exc, (ValueError, TypeError, KeyMoved, PermissionError)):
                    log.exception("error handling op %r", op_of(rec))
                self.sessions.reply(client, rec.id, error=exc)
            if kind is Bye:
                client = None
        return requests_in(records)

    def stop(self) -> None:
        """End the loop after this turn (a shutdown request)."""
        self._running = False

    # -- direct links (broker/transport/direct_broker.py) -----------------------------------------

    def _direct_events(self, events: list) -> None:
        """Accept new links, read the ready ones (and handle their messages), write out what
        full sockets held back."""
        _, peers = self.bound()
        listener = peers.listener
        assert listener is not None
        changed = False
        for obj, ev in events:
            if obj == listener.fd:
                changed = bool(peers.accept()) or changed
                continue
            peer = listener.by_fd.get(obj) if type(obj) is int else None
            if peer is None:
                continue
            if ev & _POLLOUT and not peer.write_out():
                self.sessions.direct_gone(peer)
                changed = True
                continue
            if ev & _POLLIN_ERR and not _direct_read(self, peer):
                changed = True
        self.sessions.flush()
        peers.poll_dirty = peers.poll_dirty or changed


def _drain(broker: Broker) -> None:
    """Handle the messages waiting on ``broker``'s ZeroMQ socket, at most 4096 of them,
    ``RECORDS_PER_TURN`` requests (a batch record's puts or gets counted each; the replies of a
    turn wait in memory until it ends), ``HEADER_BYTES_PER_TURN`` header bytes and
    ``FRAMES_PER_TURN`` frames (the last two counting dropped messages too); called when a
    poll said one is there."""
    sock, _ = broker.bound()
    records = header_bytes = nframes = 0
    for i in range(4096):
        frames = recv_message(sock, ready=i == 0)
        if frames is None:
            return
        nframes += len(frames)
        if len(frames) > 1:  # [routing id, header, frames...]
            header_bytes += len(frames[1])
        try:
            records += broker._handle(frames)
        except Exception:  # a broker never crashes because of one client
            log.exception("unexpected error handling a message")
        if (records + broker.turn_costs.peeked >= RECORDS_PER_TURN
                or header_bytes >= HEADER_BYTES_PER_TURN or nframes >= FRAMES_PER_TURN):
            return


def _greet(broker: Broker, address: bytes, rec: Request, head: Any, now: float) -> Client | None:
    """A record of ``address`` that is a hello (the client registered anew), or that came from
    no client (told it expired, unless it was its bye): the client from now on."""
    if isinstance(rec, Hello):
        return hello(broker, address, rec, head)
    if type(rec) is not Bye:
        broker.sessions.tell_expired(address, now)
    return None


def _direct_read(broker: Broker, peer: direct_broker.Peer) -> bool:
    """Read a ready link of ``broker`` and handle the messages it completed; False if it is
    gone."""
    alive, got_bytes = broker.bound()[1].read(peer)
    reader = peer.reader
    client = broker.sessions.clients.get(peer.address)
    if client is not None and got_bytes:
        client.last_seen = time.monotonic()  # bytes are life, even within a long message
    while reader.messages:
        parts = reader.messages.popleft()
        try:
            broker._handle_message(peer.address, parts[0], parts, 1)
        except Exception:  # a broker never crashes because of one client
            log.exception("unexpected error handling a message")
    if not alive:
        broker.sessions.direct_gone(peer)
    return alive


def _decode_item(item: Item) -> Any:
    """An item's value for the hooks: its tensors stay on the CPU, each remembering the device
    it was sent from, which ``_encode_item`` sends again (``codec.decode``)."""
    frames = item.payload
    body = frames[0].buffer if isinstance(frames[0], zmq.Frame) else frames[0]
    return codec.decode(body, frames[1:], restore_devices=False)


def _replica_collector(broker: Broker, collector: Any) -> Any:
    """The collector this broker runs (a replica's wrapped: ``cluster/replica.wrap_collector``)."""
    if broker.replica is None:
        return collector
    return wrap_collector(collector, broker.replica)


# requests a stale client's caller was told failed (``Sessions.judged_gone``)
_GETS = (Get, GetBatch, GetRun)


# the ops that get no reply (docs/protocol.md): an invalid one sent as they are (id 0) is
# dropped, logged; one with an id of its own is answered
_UNANSWERED = frozenset({"hb", "shm_hi", "shm_rel"})


def _answer_bad_record(sessions: Sessions, address: bytes, client: Client | None, rec: BadRecord,
                now: float) -> None:
    """A record that failed its checks: its error replied (a client unknown here is told
    it expired, unless the record was its bye or a hello, whose error it gets)."""
    if rec.op == HELLO:  # an invalid hello: its error (under id 0 without an int id), as a
        # hello of another version gets; nothing is registered (anew)
        sessions.reply(client or Client(address=address), rec.id or 0,
                       error=ValueError(str(rec.error)))
        return
    if client is None:
        if rec.op != BYE:
            sessions.tell_expired(address, now)
        return
    client.last_seen = now
    _give_back_slots(sessions, client, rec.slots)  # a refused put's
    if rec.id is None or rec.id == 0 and rec.op in _UNANSWERED:
        log.warning("dropped an invalid record (op %r): %s", rec.op, rec.error)
    else:
        sessions.reply(client, rec.id, error=ValueError(str(rec.error)))


def _refuse_frames(broker: Broker, address: bytes, header: Any, nframes: int) -> int:
    """A message of ``address`` with ``nframes`` frames, over ``max_frames``: none of its records
    is handled; each one's id, read from the header (decoded within the usual limits: a header
    that breaks them drops the message), is answered with a ``ValueError`` naming the limit,
    and its puts' shared-memory slots go back to their producer.  Returns the requests the
    message stood for (``requests_in``)."""
    limit = broker.config.max_frames
    try:
        records = unpack_requests(header, nframes, broker.config.max_header_bytes)
    except ProtocolError as exc:
        log.warning("dropped a message of %d frames (frame limit %d): %s", nframes, limit, exc)
        return 0
    log.warning("refused a message of %d frames (frame limit %d)", nframes, limit)
    sessions = broker.sessions
    client = sessions.clients.get(address)
    now = time.monotonic()
    ops = [rec.op if isinstance(rec, BadRecord) else op_of(rec) for rec in records]
    if client is None:  # answered as any message of an unknown client (a bye is not)
        if any(op != BYE for op in ops):
            sessions.tell_expired(address, now)
        return requests_in(records)
    client.last_seen = now
    error = ValueError(f"a message of {nframes} frames exceeds the broker's max_frames limit "
                       f"({limit}); none of its requests was handled")
    for rec, op in zip(records, ops, strict=True):
        for put in rec.puts if isinstance(rec, PutBatch) else (rec,):
            _give_back_slots(sessions, client, getattr(put, "slots", None))
        if rec.id is not None and not (rec.id == 0 and op in _UNANSWERED):
            sessions.reply(client, rec.id, error=error)
    return requests_in(records)


def _give_back_slots(sessions: Sessions, client: Client, slots: Any) -> None:
    """The shared-memory slots ``slots`` (a put's ``sm`` as it came) of a put refused before it
    was handled back to ``client``, its producer, if they check out (their holds dropped at
    once)."""
    if slots is not None:
        try:
            sessions.shm.attach_put(client, slots, [])
        except ValueError:
            pass


def _side_events(broker: Broker, ready: list, stops: StopSources, guard: PeerGuard,
                 handshakes: BrokerHandshakes) -> None:
    """The turn's events besides the clients' messages: a metrics scrape, refused
    handshakes, the parent's exit."""
    if broker.metrics is not None and broker.metrics.fd in ready:
        broker.metrics.publish()  # a scrape asked for a snapshot
    if guard.wake_fd in ready:
        handshakes.check(guard.take_failures())
    if stops.parent_exited(ready):
        broker._running = False


def _turn_timers(broker: Broker, polled: float, woke: float, timeout_ms: int, next_hb: float,
                 peers: Peers, stops: StopSources) -> float:
    """The deadlines of a turn: stalls noted, parked requests and the journal ticked,
    heartbeats sent, the read buffers of quiet direct links given back and the parent checked
    when due; the next heartbeat's time returned."""
    hb = broker.config.heartbeat_interval
    now = time.monotonic()
    # how long this loop did not look at its sockets beyond what it planned (its
    # process did not run, or this turn was long): not the clients' silence
    away = max(0.0, woke - polled - timeout_ms / 1000) + now - woke
    if away > hb:
        broker.sessions.was_stalled(away)
    broker.core.tick(now)
    broker.turn_costs.new_turn()
    if broker.journal is not None:
        broker.journal.tick(now)
    if now >= next_hb:
        broker.sessions.heartbeats(now)
        peers.resume(now)
        if peers.listener is not None:
            peers.listener.rest_quiet()
        next_hb = now + hb / 2
        if stops.parent_gone():
            broker.stop()
    return next_hb


def _metrics_server(broker: Broker) -> metrics.MetricsServer | None:
    """The Prometheus metrics server of ``broker`` when its configuration asks for one."""
    config = broker.config
    if config.metrics_port is None:
        return None
    server = metrics.MetricsServer(lambda: metrics.snapshot(broker), config.metrics_address,
                                   config.metrics_port)
    log.info("metrics of %r at %s", config.name, server.url)
    return server


def _tune_for_serving(sched_batch: bool) -> str:
    """The interpreter settings of a serving broker: rare garbage collections, short switches;
    with ``sched_batch``, the loop's thread under ``SCHED_BATCH`` (host/scheduling.py).  The
    policy the loop runs under: ``"batch"``, ``"other"`` or ``"kept"``.  Called before the
    broker says ``ready`` (the policy holds from then on), where a start error still removes
    the broker's files (a bad ``ZCHANNEL_SCHED_BATCH``)."""
    # The broker allocates a few container objects per item and rarely makes cycles: a
    # collection every 700 allocations (the default) costs ~5-10 % of its CPU at 50k items/s.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    # the peer guard's thread (server/admission.py) must get the interpreter soon after
    # libzmq accepts a connection, not after the default 5 ms: libzmq goes on accepting
    sys.setswitchinterval(0.001)
    return use_batch_policy() if sched_batch else "other"


def _encode_item(value: Any, weight: int | float) -> Item:
    body, buffers = codec.encode(value)
    frames = [zmq.Frame(body)] + [zmq.Frame(b, copy=False) for b in buffers]
    return Item(frames, weight, item_bytes(sum(len(f) for f in frames), len(frames)), value, True)


def shutdown_token(config: BrokerConfig) -> str:
    """The broker's shutdown token: ``config.token`` (``Channel.create`` makes one), else the
    first line of ``config.token_file`` (``MIN_TOKEN_CHARS`` to ``MAX_TOKEN_CHARS``
    characters, else a ``ValueError`` naming the file), else a random one
    (``docs/security.md``)."""
    if config.token:
        return config.token
    if config.token_file is not None:
        return read_token_file(config.token_file)
    return secrets.token_hex(16)


def read_token_file(path: str) -> str:
    """The shutdown token on the first line of the file at ``path`` (``--token-file`` of
    ``zchannel broker`` and of ``zchannel broker stop``): ``MIN_TOKEN_CHARS`` to
    ``MAX_TOKEN_CHARS`` characters of UTF-8 text, else a ``ValueError`` naming the file; only
    a regular file is opened (``host/regularfile.py``: a FIFO would block), and no more than a
    token's worth is read."""
    try:
        opened = open_regular_file(path, "a shutdown token file")
        with io.TextIOWrapper(opened, encoding="utf-8") as f:
            token = f.readline(MAX_TOKEN_CHARS + 2).strip()
    except OSError as exc:
        raise ValueError(f"cannot read the shutdown token from {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"cannot read the shutdown token from {path}: it is not UTF-8 text "
                         f"({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise ValueError(f"cannot read the shutdown token: {exc}") from None
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        raise ValueError(f"{path}: a shutdown token is at least {MIN_TOKEN_CHARS} characters and "
                         f"at most {MAX_TOKEN_CHARS} (its first line has "
                         f"{'more' if len(token) > MAX_TOKEN_CHARS else len(token)})")
    warn_if_others_can_read(path, "token file")
    return token


def _stop_sources(broker: Broker) -> StopSources:
    """The loop's ``StopSources``, watching the creator on the pidfd the start's watch handed
    on (``broker.parent_fd``, taken here: closed if they cannot be made)."""
    parent_fd, broker.parent_fd = broker.parent_fd, None
    try:
        return StopSources(broker.config.parent_pid, broker.stop, parent_fd)
    except BaseException:
        close_pidfd(parent_fd)
        raise


__all__ = ["Broker", "BrokerConfig", "BrokerUnavailable", "read_token_file", "setup_logging"]
