"""Prometheus metrics of a broker (``zchannel broker --metrics-port PORT``).

The broker's loop is single-threaded and takes no lock on its hot path; the metrics never make
it.  A scrape runs in the HTTP server's thread (``prometheus_client``, an optional dependency:
``pip install 'zchannel[metrics]'``) and asks the loop for a fresh ``snapshot``: one byte on a
pipe the loop polls.  On its next turn the loop builds the snapshot (plain numbers and strings,
never a live object), stores it in one attribute and sets an ``Event``; the scrape thread then
turns it into metric families.  A snapshot less than ``SNAPSHOT_MAX_AGE_S`` old is served again
without asking, so scrapes in a burst cost the loop one snapshot per half second at most, and a
dear snapshot (a channel of many keys) is served again until ten times its cost has passed
(``SNAPSHOT_SHARE``: scrapes in a row take at most a tenth of the loop's time); a loop that does
not answer within ``SCRAPE_WAIT_S`` gets the previous snapshot served.

What the loop pays on its hot path, metrics or not: one integer increment per put or get
request and one per reply that delivers items (``Counters``).  With ``--metrics-port`` and hooks at work it also times each hook call
(``time_hooks``: two ``perf_counter`` calls).
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from zchannel.broker.core.hookpipeline import hook_name
from zchannel.broker.core.state import KeyState
from zchannel.broker.wire.argchecks import key_label

if TYPE_CHECKING:  # the loop imports this module; the type alone goes back
    from zchannel.broker.server.loop import Broker

log = logging.getLogger("zchannel.broker")

SNAPSHOT_MAX_AGE_S = 0.5  # a scrape reuses a snapshot this young
SNAPSHOT_SHARE = 0.1  # ... or younger than its cost over this: the loop's share for snapshots
SCRAPE_WAIT_S = 2.0  # a scrape waits this long for the loop, then serves the last snapshot
MAX_KEY_SERIES = 1000  # per-key series for at most this many keys (the deepest ones)
MAX_CLIENT_SERIES = 1000  # per-client series for at most this many clients (the most behind)


def check_port(port: Any) -> int:
    """A metrics port: an int in 0..65535 (0: any free port)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics_port must be an int in 0..65535 (0: any free port), got {port!r}")
    return port


class Counters:
    """Requests counted by the broker loop since it started (read by ``stats`` and scrapes)."""

    __slots__ = ("puts", "gets", "delivered", "duplicate_puts", "put_batches",
                 "get_runs", "item_records")

    def __init__(self) -> None:
        self.puts = 0  # put requests received (each carries one item)
        self.gets = 0  # get and get_batch requests received
        self.delivered = 0  # items sent to consumers (a get_batch reply counts each item)
        self.duplicate_puts = 0  # retried puts acknowledged without storing them again
        self.put_batches = 0  # ``puts`` records received (their puts count in ``puts``)
        self.get_runs = 0  # ``gets`` records received (their gets count in ``gets``)
        self.item_records = 0  # ``items`` records sent (their items count in ``delivered``)

    def as_dict(self) -> dict[str, int]:
        return {"puts": self.puts, "gets": self.gets, "delivered": self.delivered,
                "duplicate_puts": self.duplicate_puts, "put_batches": self.put_batches,
                "get_runs": self.get_runs, "item_records": self.item_records}


class HookTime:
    """Seconds and calls spent in the collector and the dispatcher (loop thread only)."""

    __slots__ = ("collector_s", "collector_calls", "dispatcher_s", "dispatcher_calls")

    def __init__(self) -> None:
        self.collector_s = self.dispatcher_s = 0.0
        self.collector_calls = self.dispatcher_calls = 0


def time_hooks(core: Any, hook_time: HookTime) -> None:
    """Wrap the hook methods the core calls per item (``collect``, ``route``, ``rebalance``)
    so their time adds up in ``hook_time``; a built-in pass-through hook is left alone.  A
    wrapped method returns what the hook returned and raises what it raised, so the hook
    pipeline checks and reports it as without the wrapper; only an iterator that ``collect``
    returns (a generator does its work as it is iterated) comes back wrapped in
    ``_timed_outputs``, which yields the same outputs, lazily, and times each step."""
    perf = time.perf_counter

    def timed(fn: Callable, which: str) -> Callable:
        def call(*args: Any) -> Any:
            t0 = perf()
            try:
                out = fn(*args)
                if which == "collector" and isinstance(out, Iterator):
                    return _timed_outputs(out, hook_time)
                return out
            finally:
                if which == "collector":
                    hook_time.collector_s += perf() - t0
                    hook_time.collector_calls += 1
                else:
                    hook_time.dispatcher_s += perf() - t0
                    hook_time.dispatcher_calls += 1

        return call

    wraps = []
    hooks = core.hooks
    if not hooks.passthrough:
        wraps.append((hooks.collector, "collect", "collector"))
    if hooks.deals:
        wraps += [(hooks.dispatcher, "route", "dispatcher"),
                  (hooks.dispatcher, "rebalance", "dispatcher")]
    for hook, method, which in wraps:
        try:
            setattr(hook, method, timed(getattr(hook, method), which))
        except AttributeError:  # a hook with __slots__: its time is not measured
            log.warning("cannot time %s.%s (no instance attributes)", type(hook).__name__, method)


def _timed_outputs(outputs: Iterator, hook_time: HookTime) -> Iterator:
    """The items of ``outputs`` (an iterator a collector returned), each step's time added to
    ``hook_time.collector_s``; what a step raises passes through, and closing this closes
    ``outputs`` (a consumer that stops early, past ``max_bytes``, ends the generator)."""
    perf = time.perf_counter
    try:
        while True:
            t0 = perf()
            try:
                out = next(outputs)
            except StopIteration:
                return
            finally:
                hook_time.collector_s += perf() - t0
            yield out
    finally:
        close = getattr(outputs, "close", None)
        if close is not None:
            close()


def snapshot(broker: Broker) -> dict[str, Any]:
    """The broker's state as plain values (called on the loop thread only)."""
    core = broker.core
    now = time.monotonic()
    # the deepest keys first, then their rows: summing the sizes of every key's items took
    # ~0.25 s a snapshot with 99,000 keys, choosing the keys ~0.03 s
    held: Iterable[tuple[Any, KeyState]] = core.keys.items()
    if len(core.keys) > MAX_KEY_SERIES:
        held = heapq.nlargest(MAX_KEY_SERIES, held, key=lambda kv: kv[1].depth())
    keys = []
    for key, ks in held:
        queues = (ks.shared, *ks.private.values())
        keys.append((key, ks.depth(), sum(i.nbytes for q in queues for i in q), ks.leases,
                     len(ks.getters), ks.putters))
    clients = [(address.hex(), c.identity or "", len(c.parked), len(c.leases), now - c.last_seen)
               for address, c in broker.sessions.clients.items()]
    if len(clients) > MAX_CLIENT_SERIES:
        clients = sorted(clients, key=lambda c: -c[4])[:MAX_CLIENT_SERIES]
    hook_time = broker.hook_time
    return {
        "time": now,
        "name": core.name,
        "address": broker.address,
        # named as stats() and `zchannel stat` name them (a registered name, else module:qualname)
        "collector": hook_name(core.hooks.collector),
        "dispatcher": hook_name(core.hooks.dispatcher),
        "uptime_s": time.time() - core.started,
        "keys": keys,
        "key_count": len(core.keys),
        "bytes_held": core.bytes_held,
        "leases": len(core.leases),
        "consumers": [(cid, state.handles) for cid, state in core.consumers.items()],
        "present_consumers": len(core.hooks.ctx.consumers),
        "clients": clients,
        "client_count": len(broker.sessions.clients),
        "counters": broker.counters.as_dict(),
        "hook_time": {"collector": (hook_time.collector_s, hook_time.collector_calls),
                      "dispatcher": (hook_time.dispatcher_s, hook_time.dispatcher_calls)},
        "shm": broker.shm.stats(),
    }


def young(snap: dict[str, Any], now: float) -> bool:
    """Whether a scrape at ``now`` serves ``snap`` again: it is younger than
    ``SNAPSHOT_MAX_AGE_S``, or than its cost over ``SNAPSHOT_SHARE`` (a dear snapshot is made
    less often, so scrapes in a row take at most that share of the loop's time)."""
    return now - snap["time"] < max(SNAPSHOT_MAX_AGE_S, snap.get("cost_s", 0.0) / SNAPSHOT_SHARE)


def require_prometheus(setting: str) -> None:
    """``ImportError`` naming ``setting`` and the extra to install when prometheus_client (the
    ``metrics`` extra) cannot be imported: ``Channel.create(metrics_port=...)`` checks it
    before it starts a broker."""
    try:
        import prometheus_client  # noqa: F401  (an optional dependency)
    except ImportError:
        raise ImportError(f"{setting} needs prometheus_client: "
                          "pip install 'zchannel[metrics]'") from None


class MetricsServer:
    """The HTTP endpoint (a thread) and the pipe through which scrapes ask the loop for a
    snapshot.  The loop polls ``fd`` and calls ``publish`` when it is readable."""

    def __init__(self, build: Callable[[], dict], address: str, port: int) -> None:
        try:
            import prometheus_client
            from prometheus_client.registry import CollectorRegistry
        except ImportError:
            raise RuntimeError("--metrics-port needs prometheus_client: "
                               "pip install 'zchannel[metrics]'") from None
        self._build = build
        self._snapshot: dict | None = None
        self._ready = threading.Event()
        self._scrape_lock = threading.Lock()  # scrapes among themselves; never the loop
        self._closed = False
        self.fd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(self.fresh))
        registry.register(prometheus_client.ProcessCollector(registry=None))
        try:
            self._httpd, self._thread = prometheus_client.start_http_server(
                port, addr=address, registry=registry)
        except OSError as exc:
            self._close_pipe()
            raise RuntimeError(f"metrics endpoint {address}:{port}: {exc.strerror or exc}") from None
        host = f"[{address}]" if ":" in address else address
        self.url = f"http://{host}:{self._httpd.server_port}/metrics"

    def publish(self) -> None:
        """Loop thread: a scrape asked; build the snapshot (noting what it cost) and hand it
        over."""
        try:
            os.read(self.fd, 512)
        except BlockingIOError:
            pass
        start = time.perf_counter()
        snap = self._build()
        snap["cost_s"] = time.perf_counter() - start
        self._snapshot = snap
        self._ready.set()

    def fresh(self) -> dict | None:
        """Scrape thread: the last snapshot while it is ``young``, else a fresh one (the last one
        if the loop does not answer within ``SCRAPE_WAIT_S``)."""
        with self._scrape_lock:
            snap = self._snapshot
            if self._closed or (snap is not None and young(snap, time.monotonic())):
                return snap
            self._ready.clear()
            try:
                os.write(self._wfd, b"\0")
            except (BlockingIOError, OSError):
                pass  # the pipe holds a request already (or the broker is closing)
            self._ready.wait(SCRAPE_WAIT_S)
            return self._snapshot

    def close(self) -> None:
        """Stop the HTTP thread, then close the pipe it writes to."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)
        with self._scrape_lock:  # a scrape still running (its own thread) no longer writes
            self._closed = True
            self._close_pipe()

    def _close_pipe(self) -> None:
        os.close(self.fd)
        os.close(self._wfd)


class _Families:
    """A ``prometheus_client`` collector that renders the latest snapshot."""

    def __init__(self, fresh: Callable[[], dict | None]) -> None:
        self._fresh = fresh

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            InfoMetricFamily,
        )

        snap = self._fresh()
        if snap is None:
            return
        info = InfoMetricFamily("zchannel_broker", "the channel this broker serves")
        info.add_metric([], {"name": snap["name"], "address": snap["address"],
                             "collector": snap["collector"], "dispatcher": snap["dispatcher"]})
        yield info

        yield from _totals(snap)
        yield from _tables(snap)


def _totals(snap: dict[str, Any]) -> Iterator[Any]:
    """The broker's totals: requests, items, keys, bytes, leases, clients, hook time, shm."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"zchannel_{name}", doc, value=value)

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(f"zchannel_{name}", doc, value=value)

    counters = snap["counters"]
    yield counter("puts", "put requests received", counters["puts"])
    yield counter("gets", "get and get_batch requests received", counters["gets"])
    yield counter("delivered_items", "items sent to consumers", counters["delivered"])
    yield gauge("uptime_seconds", "seconds since the broker started", snap["uptime_s"])
    yield gauge("keys", "keys the broker holds state for", snap["key_count"])
    yield gauge("bytes_held", "bytes of queued and leased items: payloads plus 320 per item",
                snap["bytes_held"])
    yield gauge("leases_outstanding", "deliveries not acknowledged yet", snap["leases"])
    yield gauge("clients", "connected handles", snap["client_count"])
    yield gauge("consumers", "consumer ids present (declared or connected)",
                snap["present_consumers"])

    seconds = CounterMetricFamily("zchannel_hook_seconds", "seconds spent in hook calls",
                                  labels=["hook"])
    calls = CounterMetricFamily("zchannel_hook_calls", "hook calls", labels=["hook"])
    for hook, (secs, n) in snap["hook_time"].items():
        seconds.add_metric([hook], secs)
        calls.add_metric([hook], n)
    yield seconds
    yield calls

    shm = snap["shm"]
    yield gauge("shm_segments", "shared-memory segments of this channel", shm.get("segments", 0))
    yield gauge("shm_slots_used", "shared-memory slots holding items", shm.get("slots_used", 0))
    yield gauge("shm_bytes_held", "bytes in shared-memory slots held by the broker",
                shm.get("bytes_held", 0))
    yield gauge("shm_consumer_bytes", "bytes in shared-memory slots consumers still hold",
                shm.get("consumer_bytes", 0))


def _tables(snap: dict[str, Any]) -> Iterator[Any]:
    """The per-key, per-consumer and per-client metric families."""
    from prometheus_client.core import GaugeMetricFamily

    per_key = [
        ("key_items_held", "items queued on a key (shared and private queues)", 1),
        ("key_bytes_held", "bytes queued on a key: payloads plus 320 per item", 2),
        ("key_leases", "deliveries of a key not acknowledged yet", 3),
        ("key_waiting_getters", "get requests parked on a key", 4),
        ("key_waiting_putters", "put requests parked on a key (its queue is full)", 5),
    ]
    labels = [key_label(row[0]) for row in snap["keys"]]
    for name, doc, col in per_key:
        fam = GaugeMetricFamily(f"zchannel_{name}", doc, labels=["key"])
        for label, row in zip(labels, snap["keys"], strict=True):
            fam.add_metric([label], row[col])
        yield fam
    handles = GaugeMetricFamily("zchannel_consumer_handles", "handles connected per consumer id",
                                labels=["consumer"])
    for cid, n in snap["consumers"]:
        handles.add_metric([cid], n)
    yield handles

    per_client = [
        ("client_outstanding_requests", "requests of a client parked in the broker", 2),
        ("client_leases", "deliveries a client has not acknowledged yet", 3),
        ("client_seconds_since_seen", "seconds since the broker last heard from a client", 4),
    ]
    for name, doc, col in per_client:
        fam = GaugeMetricFamily(f"zchannel_{name}", doc, labels=["client", "identity"])
        for row in snap["clients"]:
            fam.add_metric([row[0], row[1]], row[col])
        yield fam
