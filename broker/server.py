"""The broker process: one ROUTER socket, one single-threaded event loop over a ``QueueCore``.

The loop reads messages, hands each record to the handler of its operation
(``handlers.HANDLERS``; ``handlers_for`` on a replica), lets the core expire deadlines,
keeps heartbeats in both directions, and flushes the replies it coalesced per client.  With no
collector and a built-in dispatcher it never decodes a payload: the ``zmq.Frame`` objects it
received are stored and sent on with ``copy=False``.  With ``metrics_port`` a thread serves
Prometheus metrics from snapshots the loop builds when a scrape asks (``metrics.py``).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from typing import Any

import zmq
from zchannel.broker import codec, direct, metrics, paths
from zchannel.broker.config import BrokerConfig
from zchannel.broker.core import Client, Item, QueueCore
from zchannel.broker.errors import BrokerUnavailable, KeyMoved, error_to_wire
from zchannel.broker.handlers import HANDLERS, handlers_for, hello
from zchannel.broker.outbox import Outbox
from zchannel.broker.peers import Peers
from zchannel.broker.protocol import (
    BROKER_EXPIRED,
    BROKER_HEARTBEAT,
    BYE,
    INLINE_BODY,
    BadRecord,
    Bye,
    Hello,
    ProtocolError,
    Reply,
    op_of,
    pack_header,
    recv_message,
    unpack_requests,
)
from zchannel.broker.replica import replica_state, wrap_collector
from zchannel.broker.security import BrokerHandshakes, RefusalLog, secure_server
from zchannel.broker.shm.broker import ShmBroker, SlotFrames
from zchannel.hooks import expand_consumers, import_path, resolve_collector, resolve_dispatcher

log = logging.getLogger("zchannel.broker")


class _RateLimitFilter(logging.Filter):
    """At most ``burst`` records of the same message template per ``period`` seconds."""

    def __init__(self, burst: int = 5, period: float = 10.0) -> None:
        super().__init__()
        self.burst, self.period = burst, period
        self._seen: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        start, count = self._seen.get(record.msg, (now, 0))
        if now - start > self.period:
            start, count = now, 0
        self._seen[record.msg] = (start, count + 1)
        return count < self.burst


def setup_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s zchannel[%(process)d] %(levelname)s %(message)s"))
    handler.addFilter(_RateLimitFilter())
    root = logging.getLogger("zchannel")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


class Broker:
    """Serves one channel on one ROUTER socket until stopped."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        paths.check_name(config.name)
        for module in config.imports:
            __import__(module)
        if config.allowed_dtypes is not None or config.max_rank is not None:
            codec.restrict(config.allowed_dtypes, config.max_rank)
        # -- distributed: this broker is one replica (see broker/replica.py) --
        self.replica = None
        self.handlers = HANDLERS
        lock_name = config.name
        if config.cluster is not None or config.replicas is not None:
            self.replica = replica_state(config)
            self.handlers = handlers_for(self.replica)
            lock_name = f"{config.name}.replica{config.replica}"
        # -- end distributed --
        self._lock_name = lock_name
        self._lock_fd = config.lock_fd
        if self._lock_fd is None:
            self._lock_fd = paths.try_lock(lock_name)
            if self._lock_fd is None:
                raise RuntimeError(f"a broker already serves channel {config.name!r} on this host")
        self.shm: ShmBroker | None = None
        self.sock: zmq.Socket | None = None
        try:
            self._setup(config)
        except BaseException:  # a failed start leaves no files behind
            self._release_files()
            raise

    def _setup(self, config: BrokerConfig) -> None:
        self.address = config.address or paths.default_address(config.name)
        paths.check_bind_address(self.address, secure=bool(config.curve_secret_key),
                                 insecure=config.insecure)
        self._auth = None
        self.refusals = RefusalLog()  # refused handshakes, each logged once (broker/security.py)
        self._handshakes: BrokerHandshakes | None = None
        self.shm = ShmBroker(config.name, str(paths.run_dir()), config.shm_threshold,
                                 config.shm_pool_bytes,
                                 2 * config.heartbeat_interval * config.liveness)
        self.core = QueueCore(
            name=config.name,
            maxsize=config.maxsize,
            collector=self._collector(resolve_collector(config.collector)),
            dispatcher=resolve_dispatcher(config.dispatcher),
            producers=tuple(config.producers or ()),
            consumers=expand_consumers(config.consumers),
            options=config.options,
            reply=self.reply,
            decode_item=self.shm.decode_item(_decode_item),
            encode_item=_encode_item,
            lease_timeout=config.lease_timeout,
            max_bytes=config.max_bytes,
            max_keys=config.max_keys,
            key_grace=config.key_grace,
        )
        if not self.core.passthrough or (self.core.deals and self.core.dispatcher.needs_item):
            # A hook decodes items: import torch before serving, not on the first tensor (that
            # takes seconds on a loaded machine, long enough for clients to miss heartbeats).
            codec.preload()
        self.clients: dict[bytes, Client] = {}
        self.last_sent: dict[bytes, float] = {}
        self._out: dict[bytes, Outbox] = {}
        self._running = False
        self._expired_told: dict[bytes, float] = {}
        self._peak_held = 0
        self.peers: Peers | None = None  # the clients' transports (set by bind)
        self.counters = metrics.Counters()
        self.hook_time = metrics.HookTime()
        self.metrics: metrics.MetricsServer | None = None
        if config.metrics_port is not None:
            metrics.check_port(config.metrics_port)
            metrics.time_hooks(self.core, self.hook_time)

    def _collector(self, collector: Any) -> Any:
        if self.replica is None:
            return collector
        return wrap_collector(collector, self.replica)

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self) -> str:
        """Bind the socket (``ZMQError`` for a busy address, ``ValueError`` for bad key files:
        ``close()`` then removes what was made)."""
        ctx = zmq.Context.instance()
        sock = self.sock = ctx.socket(zmq.ROUTER)
        self.peers = Peers(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        if self.config.max_message_bytes:
            sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        if self.config.curve_secret_key:
            self._auth = secure_server(sock, self.config.curve_secret_key,
                                       self.config.curve_public_keys, self.refusals)
        self._handshakes = BrokerHandshakes(sock, bool(self._auth), self.refusals)
        ipc = paths.ipc_path(self.address)
        if ipc and os.path.exists(ipc):
            os.unlink(ipc)  # stale: we hold the channel lock, so no live broker owns it
        try:
            sock.bind(self.address)
        except zmq.ZMQError as exc:  # a busy address: say which
            reason = zmq.strerror(exc.errno)
            raise zmq.ZMQError(exc.errno, f"cannot bind {self.address}: {reason}") from None
        if self.address.startswith("tcp://"):
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if ipc:
            os.chmod(ipc, 0o600)
        # beside shared memory only (see transport.open_transport); never around CURVE
        link = direct.link_path(ipc) if ipc and self.config.direct and not self._auth \
            and self.config.shm_threshold > 0 else None
        if link is not None:
            try:
                self.peers.listener = direct.Listener(link, self.config.max_frames + 1,
                                              self.config.max_header_bytes,
                                              self.config.max_message_bytes)
            except OSError as exc:  # clients then use ZeroMQ only
                log.warning("no direct link at %s: %s", link, exc)
        paths.write_address(self.config.name, self.address)
        return self.address

    def serve_forever(self) -> None:
        """Bind, print ``ready <address>``, and run the loop until a signal, a shutdown request
        or the death of the parent process."""
        try:
            self.bind()
        except BaseException:
            self.close()
            raise
        if self.config.metrics_port is not None:
            try:
                self.metrics = metrics.MetricsServer(lambda: metrics.snapshot(self),
                                                     self.config.metrics_address,
                                                     self.config.metrics_port)
            except BaseException:
                self.close()
                raise
            log.info("metrics of %r at %s", self.config.name, self.metrics.url)
        if self.replica is not None:
            self.replica.start(self.core)
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        self._running = True  # before the handlers: a signal right after "ready" stops us
        old_wakeup = signal.set_wakeup_fd(wfd)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        parent_fd = self._watch_parent()
        poll_set = [(self.sock, zmq.POLLIN), (rfd, zmq.POLLIN),
                    (self._handshakes.socket, zmq.POLLIN)]
        if parent_fd is not None:
            poll_set.append((parent_fd, zmq.POLLIN))
        if self.peers.listener is not None:
            poll_set.append((self.peers.listener.fd, zmq.POLLIN))
        if self.metrics is not None:
            poll_set.append((self.metrics.fd, zmq.POLLIN))
        self._poll_base = poll_set
        self._poll_set = list(poll_set)
        sys.stdout.write(f"ready {self.address}\n")
        sys.stdout.flush()
        log.debug("broker %r serving %s (pid %d)", self.config.name, self.address, os.getpid())
        # The broker allocates a few container objects per item and rarely makes cycles: a
        # collection every 700 allocations (the default) costs ~5-10 % of its CPU at 50k items/s.
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        hb = self.config.heartbeat_interval
        next_hb = time.monotonic() + hb / 2
        try:
            while self._running:
                now = time.monotonic()
                wake = min(next_hb, self.core.next_deadline() or next_hb)
                timeout_ms = max(0, int((wake - now) * 1000) + 1)
                if self.peers.poll_dirty:  # links came or went, or a full socket held bytes back
                    self._poll_set = self.peers.poll_set(self._poll_base)
                polled = time.monotonic()
                events = zmq.zmq_poll(self._poll_set, timeout_ms)
                woke = time.monotonic()
                ready = [obj for obj, _ in events]
                if self.sock in ready:
                    self._drain()
                    self._flush()  # replies first: the rest of the turn is not on their path
                if self.peers.listener is not None and len(events) > (self.sock in ready):
                    self._direct_events(events)
                if rfd in ready:
                    os.read(rfd, 512)
                if self.metrics is not None and self.metrics.fd in ready:
                    self.metrics.publish()  # a scrape asked for a snapshot
                if self._handshakes.socket in ready:
                    self._handshakes.check()
                if parent_fd is not None and parent_fd in ready:
                    log.warning("creator process %s exited: stopping", self.config.parent_pid)
                    self._running = False
                now = time.monotonic()
                # how long this loop did not look at its sockets beyond what it planned (its
                # process did not run, or this turn was long): not the clients' silence
                away = max(0.0, woke - polled - timeout_ms / 1000) + now - woke
                if away > hb:
                    self._was_stalled(away)
                self.core.tick(now)
                if now >= next_hb:
                    self._heartbeats(now)
                    next_hb = now + hb / 2
                    if self.config.parent_pid and os.getppid() != self.config.parent_pid:
                        log.warning("creator process %s is gone: stopping", self.config.parent_pid)
                        self._running = False
                self._flush()
        finally:
            signal.set_wakeup_fd(old_wakeup)
            self.close()
            os.close(rfd)
            os.close(wfd)

    def _watch_parent(self) -> int | None:
        pid = self.config.parent_pid
        if not pid:
            return None
        if os.getppid() != pid:
            raise SystemExit(f"creator process {pid} is already gone")
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return None  # fall back to the getppid() check on every heartbeat tick
        return fd

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._running = False

    def close(self) -> None:
        """Stop serving and remove this broker's files: address file, socket file, shared
        memory, and last the lock file (a successor may start once it is released)."""
        if self.metrics is not None:  # its thread stops before the pipe closes
            self.metrics.close()
            self.metrics = None
        if self.sock is not None:
            self._flush()
            if self._handshakes is not None:
                self._handshakes.close()
            self.sock.close(linger=0)
            self.sock = None
            self.peers.close()
            if self._auth is not None:
                self._auth.stop()
            paths.remove_address(self.config.name, self.address)
            if self.replica is not None:
                self.replica.close()
            ipc = paths.ipc_path(self.address)
            if ipc:
                try:
                    os.unlink(ipc)
                except FileNotFoundError:
                    pass
            log.debug("broker %r stopped", self.config.name)
        self._release_files()

    def _release_files(self) -> None:
        """Remove the shared-memory segments and the lock file (while holding the lock)."""
        if self.shm is not None:
            self.shm.close()
        if self._lock_fd is not None:
            paths.release_lock(self._lock_name, self._lock_fd)
            self._lock_fd = None

    # -- receiving ---------------------------------------------------------------------------

    def _drain(self) -> None:
        """Handle the messages waiting (at most 4096); called when a poll said one is there."""
        sock = self.sock
        for i in range(4096):
            frames = recv_message(sock, ready=i == 0)
            if frames is None:
                return
            try:
                self._handle(frames)
            except Exception:  # a broker never crashes because of one client
                log.exception("unexpected error handling a message")

    def _handle(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            log.warning("dropped a message without a header")
            return
        self._handle_message(frames[0].bytes, frames[1].buffer, frames, 2)

    def _handle_message(self, address: bytes, header: Any, frames: list, pos: int) -> None:
        """One message of ``address``: its header and, from ``frames[pos]`` on, its frames."""
        if len(frames) - pos > self.config.max_frames:
            log.warning("dropped a message of %d frames (frame limit %d)", len(frames) - pos,
                        self.config.max_frames)
            return
        try:
            records = unpack_requests(header, len(frames) - pos, self.config.max_header_bytes)
        except ProtocolError as exc:
            log.warning("dropped a malformed message: %s", exc)
            return
        client = self.clients.get(address)
        now = time.monotonic()
        for rec in records:
            nf = rec.nf
            op_frames = frames[pos : pos + nf]
            pos += nf
            kind = type(rec)
            if client is None or kind is Hello:
                if kind is Hello:
                    client = hello(self, address, rec)
                elif kind is not Bye and not (kind is BadRecord and rec.op == BYE):
                    self._tell_expired(address, now)
                continue
            client.last_seen = now
            if kind is BadRecord:
                if rec.id is None:
                    log.warning("dropped a record without a request id (op %r)", rec.op)
                else:
                    self.reply(client, rec.id, error=ValueError(str(rec.error)))
                continue
            try:
                self.handlers[kind](self, client, rec, op_frames)
            except Exception as exc:
                if not isinstance(exc, (ValueError, TypeError, KeyMoved)):
                    log.exception("error handling op %r", op_of(rec))
                self.reply(client, rec.id, error=exc)
            if kind is Bye:
                client = None

    def _tell_expired(self, address: bytes, now: float) -> None:
        if now - self._expired_told.get(address, 0.0) < 0.2:
            return
        self._expired_told[address] = now
        self._send(address, [BROKER_EXPIRED], [])

    def forget_expired(self, address: bytes) -> None:
        """``address`` said hello: an ``expired`` is due again at once when it is unknown next."""
        self._expired_told.pop(address, None)

    def stop(self) -> None:
        """End the loop after this turn (a shutdown request)."""
        self._running = False

    # -- sending -----------------------------------------------------------------------------

    def reply(self, client: Client, rid: int, result: Any = None, error: BaseException | None = None,
              items: list[Item] | None = None, batch: bool = False, lease: int | None = None,
              origin: Any = None, raw: bool = False, weights: list | None = None) -> None:
        """Queue the reply to request ``rid`` of ``client`` (sent at the end of the turn)."""
        rec = Reply(id=rid, weights=weights)
        out = self._out.get(client.address)
        if out is None:
            out = self._out[client.address] = Outbox()
        if error is not None:
            rec.error = error_to_wire(error)
        elif items is not None and not batch and not raw and len(items) == 1 \
                and not isinstance(items[0].payload, SlotFrames) and len(items[0].payload) == 1 \
                and len(items[0].payload[0]) <= INLINE_BODY:
            body = items[0].payload[0]  # a small item rides in the reply record (no frame)
            rec.body = body if type(body) is bytes else bytes(body)
            rec.lease = lease
            out.deliveries.append((client, origin, items, lease))
            self.counters.delivered += 1
        elif items is not None:
            nf = 0
            counts = []
            r0, f0 = len(out.records), len(out.frames)
            for i, item in enumerate(items):
                payload = item.payload
                out.frames.extend(payload)
                n = len(payload)
                if isinstance(payload, SlotFrames):  # slot references, or the slots' bytes as frames
                    n += self.shm.attach_reply(client, payload, rec, i, len(items), out.frames)
                nf += n
                counts.append(n)
            rec.nf = nf
            out.record_added(r0, f0)
            if batch:
                rec.counts = counts
            rec.lease = lease
            if not raw:
                out.deliveries.append((client, origin, items, lease))
                self.counters.delivered += len(items)
        else:
            rec.result = result
        out.records.append(rec)

    def _send(self, address: bytes, records: list, frames: list) -> bool:
        """Send to the client at ``address`` over its transport (``peers.py``); False when it
        cannot be reached (``_flush`` then requeues and ends the client)."""
        if not self.peers.send(address, [pack_header(records), *frames]):
            return False
        self.last_sent[address] = time.monotonic()
        return True

    def _flush(self) -> None:
        while self._out and self.sock is not None:
            out_all, self._out = self._out, {}
            for address, out in out_all.items():
                if all(self._send(address, records, frames) for records, frames in out.messages()):
                    continue
                if self._end_client(address, out) is not None:
                    log.info("client went away before its reply was sent; its items were requeued")

    def _end_client(self, address: bytes, out: Outbox | None) -> Client | None:
        """``address`` cannot be reached: the deliveries of ``out`` that were not sent go back
        to their queues first, then the client ends (its leases, parked requests, holds)."""
        client = self.clients.pop(address, None)
        self.last_sent.pop(address, None)
        if out is not None:
            for c, origin, items, lease in out.deliveries:
                self.core.requeue(c, origin, items, lease)
        if client is not None:
            self.client_gone(client)
        return client

    def client_gone(self, client: Client) -> None:
        """``client`` left or was ended: the core withdraws its requests and returns its leases,
        then the slots it held as a consumer are dropped (``ShmBroker.client_gone``)."""
        self.core.client_gone(client)
        self.shm.client_gone(client)

    # -- direct links (broker/direct.py) -------------------------------------------------------

    def _direct_events(self, events: list) -> None:
        """Accept new links, read the ready ones (and handle their messages), write out what
        full sockets held back."""
        listener = self.peers.listener
        assert listener is not None
        changed = False
        for obj, ev in events:
            if obj == listener.fd:
                changed = bool(listener.accept()) or changed
                continue
            peer = listener.by_fd.get(obj) if type(obj) is int else None
            if peer is None:
                continue
            if ev & zmq.POLLOUT and not peer.write_out():
                self._direct_gone(peer)
                changed = True
                continue
            if ev & (zmq.POLLIN | zmq.POLLERR) and not self._direct_read(peer):
                changed = True
        self._flush()
        self.peers.poll_dirty = self.peers.poll_dirty or changed

    def _direct_read(self, peer: direct.Peer) -> bool:
        """Read a ready link and handle the messages it completed; False if it is gone."""
        alive, got_bytes = self.peers.read(peer)
        reader = peer.reader
        client = self.clients.get(peer.address)
        if client is not None and got_bytes:
            client.last_seen = time.monotonic()  # bytes are life, even within a long message
        while reader.messages:
            parts = reader.messages.popleft()
            try:
                self._handle_message(peer.address, parts[0], parts, 1)
            except Exception:  # a broker never crashes because of one client
                log.exception("unexpected error handling a message")
        if not alive:
            self._direct_gone(peer)
        return alive

    def _direct_gone(self, peer: direct.Peer) -> None:
        """A link closed (its process exited or was killed): the client is gone at once."""
        self.peers.drop(peer)
        self._end_client(peer.address, self._out.pop(peer.address, None))

    def _release_memory(self) -> None:
        """After a large backlog drained, hand freed heap pages back to the OS (glibc keeps them
        otherwise, and the broker's RSS would stay at its peak)."""
        held = self.core.bytes_held
        self._peak_held = max(self._peak_held, held)
        if held == 0 and self._peak_held >= 16 << 20:
            self._peak_held = 0
            try:
                import ctypes

                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):
                pass

    def _was_stalled(self, seconds: float) -> None:
        """The loop did not look at its sockets for ``seconds`` more than it planned (a loaded
        machine did not run it, or a turn was long): the clients' silence meanwhile is not
        theirs (their heartbeats may still be on the way in), so it does not count towards
        their expiry."""
        log.info("the broker did not read for %.1fs: clients' expiry moved on as much", seconds)
        for client in self.clients.values():
            client.last_seen += seconds

    def _heartbeats(self, now: float) -> None:
        self._release_memory()
        if self.replica is not None:
            self.replica.tick()
        self.shm.sweep(now)
        hb = self.config.heartbeat_interval
        expiry = hb * self.config.liveness
        for address, client in list(self.clients.items()):
            if now - client.last_seen > expiry:
                log.info("client %s expired (no heartbeat for %.1fs)", address.hex(), now - client.last_seen)
                del self.clients[address]
                self.last_sent.pop(address, None)
                self.client_gone(client)
                self._send(address, [BROKER_EXPIRED], [])
            elif now - self.last_sent.get(address, 0.0) >= hb and address not in self._out:
                out = self._out[address] = Outbox()
                out.records.append(BROKER_HEARTBEAT)
        for address in [a for a in self.last_sent if a not in self.clients]:
            del self.last_sent[address]
        if self.peers.listener is not None:  # links that never said hello hold a descriptor each
            for peer in [p for p in self.peers.listener.by_fd.values()
                         if not p.greeted and now - p.since > expiry]:
                log.info("closed a direct link that said nothing for %.1fs", now - peer.since)
                self._direct_gone(peer)
        for address in [a for a, t in self._expired_told.items() if now - t > expiry]:
            del self._expired_told[address]


def _decode_item(item: Item) -> Any:
    frames = item.payload
    return codec.decode(frames[0].buffer if isinstance(frames[0], zmq.Frame) else frames[0], frames[1:])


def _encode_item(value: Any, weight: int) -> Item:
    body, buffers = codec.encode(value)
    frames = [zmq.Frame(body)] + [zmq.Frame(b, copy=False) for b in buffers]
    return Item(frames, weight, sum(len(f) for f in frames), value, True)


def hook_from_wire(spec: Any) -> Any:
    """Rebuild a hook given to ``create`` as an instance: ``{"class": path, "state": {...}}``."""
    if isinstance(spec, dict) and "class" in spec:
        cls = import_path(spec["class"])
        obj = cls.__new__(cls)
        obj.__dict__.update(spec.get("state") or {})
        return obj
    return spec


def run_broker(config: BrokerConfig) -> int:
    """Run a broker in this process until it stops; the exit status."""
    setup_logging()
    broker = Broker(config)
    broker.serve_forever()
    return 0


def main_from_stdin() -> int:
    """Entry of ``python -m zchannel.broker``: the config arrives as msgpack on stdin (the trusted
    start-up pipe of ``Channel.create``)."""
    data = sys.stdin.buffer.read()
    fields = codec.decode(data)
    for name in ("collector", "dispatcher"):
        fields[name] = hook_from_wire(fields.get(name))
    config = BrokerConfig(**fields)
    setup_logging()
    try:
        broker = Broker(config)
    except Exception as exc:
        sys.stdout.write(f"error {type(exc).__name__}: {exc}\n")
        sys.stdout.flush()
        return 1
    try:
        broker.serve_forever()
    except (zmq.ZMQError, ValueError, OSError) as exc:  # a busy address, a bad key file
        sys.stdout.write(f"error {type(exc).__name__}: {exc}\n")
        sys.stdout.flush()
        return 1
    return 0


__all__ = ["Broker", "BrokerConfig", "BrokerUnavailable", "run_broker"]
