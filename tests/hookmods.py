"""Hooks used by the tests; importable in broker processes (tests/ is on PYTHONPATH there)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

from rldata.embodied_io_struct import ChunkStepResult
from zchannel.hooks import Collector, Dispatcher
from zchannel.hooks.builtin import FlattenBatch


class Raising(Collector):
    def collect(self, item, key):
        if item == "boom":
            raise RuntimeError("collector exploded")
        yield key, item


class Ending(BaseException):
    """A ``BaseException`` of a hook's own (neither an error nor an exit)."""


class Exits(Collector):
    """Raises what ends a process or a task: ``sys.exit`` for ``"exit"``, ``KeyboardInterrupt``
    for ``"interrupt"``, ``asyncio.CancelledError`` for ``"cancel"``, a ``BaseException`` of
    its own for ``"base"`` (each a hook's failure like any other)."""

    def collect(self, item, key):
        if item == "exit":
            raise SystemExit(3)
        if item == "interrupt":
            raise KeyboardInterrupt
        if item == "cancel":
            raise asyncio.CancelledError
        if item == "base":
            raise Ending("the hook's own")
        yield key, item


class UnsendableStats(Collector):
    """Its ``stats()`` returns what cannot travel."""

    def stats(self):
        return {"handle": object()}


class BadYield(Collector):
    def collect(self, item, key):
        if item == "bad":
            yield "just a key"
            return
        yield key, item


class PartialThenRaise(Collector):
    """Yields one output, then fails: nothing of the put may be enqueued."""

    def collect(self, item, key):
        yield key, "first half"
        if item == "fail":
            raise ValueError("second half failed")
        yield key, item


class Rekey(Collector):
    """Drops items that are None, re-keys ints by parity, weights strings by their length."""

    def collect(self, item, key):
        if item is None:
            return
        if isinstance(item, int):
            yield ("even" if item % 2 == 0 else "odd"), item
        else:
            yield key, item, len(item)


class RegisteredAtRunTime(Collector):
    """Registered by a test at run time (``register_collector(...)(cls)``), not by this module's
    import: the broker child learns the name from its creator."""

    def collect(self, item, key):
        yield key, ("seen", item)


class Scaled(Collector):
    """An instance with state handed to the broker at creation."""

    def __init__(self, factor: int = 1) -> None:
        self.factor = factor

    def collect(self, item, key):
        yield key, item * self.factor


class EchoOptions(Collector):
    def setup(self, ctx):
        self.ctx = ctx

    def collect(self, item, key):
        yield key, {"options": dict(self.ctx.options), "producers": list(self.ctx.producers),
                    "consumers": list(self.ctx.consumers), "pid": os.getpid()}


class HalfTensor(Collector):
    """Yields views of the received tensor: they must travel on without a copy."""

    def collect(self, item, key):
        n = item.shape[0] // 2
        yield key, item[:n]
        yield key, item[n:]


class NotAHook:
    pass


class RouteTo(Collector):
    """Distributed tests: a put of ``{"to": k, "v": v}`` yields ``(k, v)``; others pass through."""

    def collect(self, item, key):
        if isinstance(item, dict) and "to" in item:
            yield item["to"], item["v"]
        else:
            yield key, item


class YieldsUnsendable(Collector):
    """Yields an object no channel can carry when asked to."""

    def collect(self, item, key):
        yield key, (object() if item == "unsendable" else item)


class FloatWeights(Collector):
    """Yields each item with the weight it carries (``{"w": weight, ...}``): float weights from
    a hook."""

    def collect(self, item, key):
        yield key, item, item["w"]


class ChunkFromEnv(Collector):
    """Builds a ``ChunkStepResult`` (tests/rldata) in the broker from a dict or a received
    ``EnvOutput`` (a ``ChunkStepResult`` passes).  This module imports rldata but registers
    nothing: the broker knows those classes only if it registered their module (an entry point,
    ``register_module``)."""

    def collect(self, item, key):
        if isinstance(item, ChunkStepResult):
            yield key, item
        elif isinstance(item, dict):
            yield key, ChunkStepResult(rewards=item["rewards"], dones=item["dones"])
        else:
            yield key, ChunkStepResult(rewards=item.rewards, dones=item.dones,
                                       forward_inputs={"states": item.obs["states"]})


class Pairs(Collector):
    """Keeps the first put of each key until a second comes, then yields the pair: a collector
    with state between puts (``holds_state``), rebuilt from the journal of a durable channel."""

    def setup(self, ctx):
        self.waiting = {}

    def collect(self, item, key):
        if key in self.waiting:
            yield key, (self.waiting.pop(key), item)
        else:
            self.waiting[key] = item

    def holds_state(self):
        return bool(self.waiting)


class FlakyPairs(Pairs):
    """``Pairs`` whose ``collect`` raises while ``FLAKY=1`` is in the broker's environment: a
    collector that fails at a restart (an upgrade with a stricter check, a resource missing
    after the restart)."""

    def collect(self, item, key):
        if os.environ.get("FLAKY") == "1":
            raise RuntimeError("flaky collect")
        yield from super().collect(item, key)


class CountedPairs(Pairs):
    """``Pairs`` that numbers its pairs (``(n, first, second)``): once a pair was made it always
    holds state (the count), and it writes that state down (``state_dict``), so a durable
    channel's journal keeps a snapshot and the puts after it.  A half ``"refuse"`` makes a
    state that ``load_state_dict`` refuses."""

    def setup(self, ctx):
        super().setup(ctx)
        self.pairs = 0

    def collect(self, item, key):
        if key in self.waiting:
            self.pairs += 1
            yield key, (self.pairs, self.waiting.pop(key), item)
        else:
            self.waiting[key] = item

    def holds_state(self):
        return bool(self.waiting) or self.pairs > 0

    def state_dict(self):
        return {"pairs": self.pairs, "waiting": [[k, v] for k, v in self.waiting.items()]}

    def load_state_dict(self, state):
        if any(v == "refuse" for _, v in state["waiting"]):
            raise ValueError("this state holds a half it refuses")
        self.pairs = state["pairs"]
        self.waiting = {k: v for k, v in state["waiting"]}


class ObserveRefusesOnce(Dispatcher):
    """``observe`` raises the first time consumer ``late:0`` joins (then lets it join)."""

    def setup(self, ctx):
        self.refused = False

    def observe(self, consumer_id):
        if consumer_id == "late:0" and not self.refused:
            self.refused = True
            raise RuntimeError("observe refused late:0")


class DealsToFirstRebalanceRaises(Dispatcher):
    """Deals every item to ``a:0``; ``rebalance`` raises (a starved ``a:1`` asks it)."""

    def route(self, item, key):
        return "a:0"

    def rebalance(self, key, starved, depths):
        raise RuntimeError(f"rebalance exploded for {starved}")


class DealsToNamed(Dispatcher):
    """Deals each item (a dict) to the consumer its ``"to"`` names, also when that consumer
    has left (a rank-bound item waits for its rank)."""

    def route(self, item, key):
        return item["to"]


class DoubledFlatten(FlattenBatch):
    """An unregistered subclass of the registered ``flatten_batch``: each element twice (another
    hook, so another name in ``stats()`` and in a journal)."""

    def collect(self, item, key):
        for out_key, value in super().collect(item, key):
            yield out_key, value
            yield out_key, value


def wait_at_gate(folder: str, gate: str) -> None:
    """Write ``started-<pid>`` into ``folder``, then read one byte from the FIFO ``gate`` (its
    open returns once a writer opens it)."""
    with open(os.path.join(folder, f"started-{os.getpid()}"), "w"):
        pass
    with open(gate, "rb") as fifo:
        fifo.read(1)


class GatedStart(Collector):
    """A broker whose start waits at a gate: ``setup`` writes ``started-<pid>`` into the
    directory ``options["dir"]``, then reads one byte from the FIFO ``options["gate"]`` (it
    opens when a writer opens it).  Options to misbehave while it waits: ``ignore_sigint``
    (SIGINT ignored first), ``swallow`` (whatever interrupts the wait is caught, and the setup
    returns), ``thread`` (a non-daemon thread started first, never ending)."""

    def setup(self, ctx):
        options = ctx.options
        if options.get("ignore_sigint"):
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if options.get("thread"):
            threading.Thread(target=threading.Event().wait, daemon=False).start()
        try:
            wait_at_gate(options["dir"], options["gate"])
        except BaseException:
            if not options.get("swallow"):
                raise

    def collect(self, item, key):
        yield key, item


class Split(Collector):
    """A put of ``[(key, value), ...]`` yields one output per pair, to that key."""

    def collect(self, item, key):
        yield from ((k, v) for k, v in item)


class FanOut(Collector):
    """Yields the put ``n`` (an int) times, 64 bytes each."""

    def collect(self, item, key):
        for _ in range(item):
            yield key, b"f" * 64


class Duplicate(Collector):
    """Yields the put, unchanged, to key ``"a"`` and then to key ``"b"``."""

    def collect(self, item, key):
        yield "a", item
        yield "b", item


class KeepsLast(Collector):
    """Yields each put unchanged and keeps it: the next put also yields it again, to ``"old"``."""

    def setup(self, ctx):
        self.last = None

    def collect(self, item, key):
        if self.last is not None:
            yield "old", self.last
        self.last = item
        yield key, item

    def holds_state(self):
        return self.last is not None


class Unchanged(Collector):
    """Yields each put unchanged, to its own key (a collector that is not the default one)."""

    def collect(self, item, key):
        yield key, item
