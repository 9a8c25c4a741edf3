"""Replica failover of a distributed channel: three replicas on loopback tcp (``zchannel broker
NAME --cluster FILE --replica I``), one producer process per node putting to old keys, new keys
and keys all nodes touch at once, while replicas are SIGKILLed (by PID) and restarted.

Checked: every handle (and a fresh one) sees one replica per key and no replica ever served a
key bound to another; nothing is delivered twice; every acknowledged item is delivered unless
its replica was killed after the put was issued; new keys bind again after a kill.  The default
run kills replica 0 once; ``pytest -m soak tests/test_failover.py`` kills a replica in turn for
``ZCHANNEL_CHAOS_S`` s (default 60), each once every producer completed
``ZCHANNEL_CHAOS_ROUNDS`` (default 50) rounds without a failed put since the last restart, and
prints the figures (docs/distributed.md).
"""

from __future__ import annotations

import json
import os
import time

import pytest
from cluster_util import Replicas, audit, free_tcp_ports, write_cluster
from zchannel.broker import Channel
from zchannel.broker.cluster import clusterfile
from zchannel.broker.handle.distributed import DistributedChannel

NODES = ("node-a", "node-b", "node-c")

# A producer: puts "node/seq" (weight 1) to its node's three old keys, to a new key of its node every
# ten rounds, and to a key every producer touches in the same round ("shared"); each round it
# also takes what is there from one old key and its previous new key.  Commands on stdin, read
# by a thread of their own (a round may wait on a dead replica's key meanwhile):
# "next" -> binds a key it never used, from that thread through a second handle, puts one item
# to it and prints "bound <time.monotonic()> <replica>" (the clock is the same in every process
# of the host); "all" -> prints "all <time>" after the next round in which every put succeeded;
# "stop" -> prints the JSON record and exits.
PRODUCER = """
import itertools, json, sys, threading, time
from zchannel.broker import BrokerUnavailable, Channel, QueueEmpty
node, address = sys.argv[1], sys.argv[2]
ch = Channel.connect(address)
probe = Channel.connect(address)
old = [(node, "old", i) for i in range(3)]
acked, got, failed, views, used = [], [], [0], {}, set()
whole, stop, out = threading.Event(), threading.Event(), threading.Lock()
counter = itertools.count(1)  # next() is atomic: items stay unique over both threads

def say(line):
    with out:
        print(line, flush=True)

def put(handle, key):
    item = f"{node}/{next(counter)}"  # unique over all producers
    issued = time.monotonic()  # a broker that acknowledges it was alive by then
    handle.put(item, 1, key=key, timeout=10)
    acked.append([list(key), item, issued])
    views[json.dumps(key)] = handle.replica_of(key)

def commands():
    probes = 0
    for line in sys.stdin:
        line = line.strip()
        if line == "next":
            while True:  # a put to the new key that failed: another new key
                probes += 1
                key = (node, "probe", probes)
                try:
                    put(probe, key)
                    break
                except (BrokerUnavailable, TimeoutError):
                    failed[0] += 1
            say(f"bound {time.monotonic()} {probe.replica_of(key)}")
        elif line == "all":
            whole.set()
        else:
            break
    stop.set()

for key in old:
    ch.replica_of(key)
threading.Thread(target=commands, daemon=True).start()
say("ready")
rnd = 0
while not stop.is_set():
    ok = True
    for key in old + [(node, "new", rnd // 10), ("shared", rnd // 10)]:
        try:
            put(ch, key)
        except (BrokerUnavailable, TimeoutError):
            failed[0] += 1
            ok = False
    for key in (old[rnd % 3], (node, "new", max(0, rnd // 10 - 1))):  # consume meanwhile
        try:
            got.extend([[list(key), item] for item in ch.get_batch(8, key, timeout=0)])
        except (BrokerUnavailable, QueueEmpty, TimeoutError):
            pass
    if whole.is_set() and ok:
        whole.clear()
        say(f"all {time.monotonic()}")
    rnd += 1
say(json.dumps({"acked": acked, "got": got, "failed": failed[0], "views": views}))
probe.close()
ch.close()
"""


def _key(value):
    return tuple(_key(v) for v in value) if isinstance(value, list) else value


class Chaos:
    """The cluster, its producers and the record of kills."""

    def __init__(self, run_dir: str, workers) -> None:
        ports = free_tcp_ports(3)
        self.path = write_cluster(run_dir, NODES, [f"tcp://127.0.0.1:{p}" for p in ports])
        self.addresses = [r.address for r in clusterfile.load(self.path, "fo").replicas]
        self.reps = Replicas()
        self.workers = workers
        self.kills: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.bind_times: list[float] = []
        self.reps.start("fo", self.path, range(3))
        # each producer connects through another node's replica (any replica yields the table)
        self.producers = [
            workers.start(PRODUCER, node, self.addresses[(i + 1) % 3], env={"ZCHANNEL_NODE": node})
            for i, node in enumerate(NODES)
        ]
        for proc in self.producers:
            workers.wait_line(proc, "ready", timeout=60)

    def new_keys_bind(self, since: float, dead: int | None = None) -> float:
        """Handshake with every producer: each binds a key it never used after this call and
        puts to it; the longest time from ``since`` (a kill) until that put was acknowledged.
        No key binds to the ``dead`` replica."""
        for proc in self.producers:
            self.workers.send(proc, "next")
        longest = 0.0
        for proc in self.producers:
            line = self.workers.wait_line(proc, timeout=60)
            assert line.startswith("bound "), line
            _, at, replica = line.split()
            assert int(replica) != dead, f"a new key bound to the dead replica {dead}"
            longest = max(longest, float(at) - since)
        self.bind_times.append(longest)
        return longest

    def configured_expiry(self) -> float:
        """The heartbeat expiry the replicas run with (interval x liveness, from the hello)."""
        with Channel(None, self.addresses[2]) as plain:
            info = plain._connection().broker_info
        return info.hb * info.liveness

    def binding_roles(self) -> dict[int, str]:
        """The ``binding`` role of every live replica (its stats)."""
        roles = {}
        for i, proc in self.reps.procs.items():
            if proc.poll() is None:
                with Channel(None, self.addresses[i]) as plain:
                    roles[i] = plain.stats()["binding"]
        return roles

    def all_served(self, rounds: int = 1) -> None:
        """Handshake, ``rounds`` times: every producer completed a round in which every put
        succeeded."""
        for _ in range(rounds):
            for proc in self.producers:
                self.workers.send(proc, "all")
            for proc in self.producers:
                assert self.workers.wait_line(proc, timeout=60).startswith("all ")

    def kill(self, index: int) -> float:
        self.reps.kill(index)  # returns once the process is gone: nothing issued later is
        # acknowledged by it
        self.kills[index].append(time.monotonic())
        return self.kills[index][-1]

    def restart(self, index: int) -> None:
        self.reps.start("fo", self.path, [index])

    def finish(self, monkeypatch) -> dict:
        """Stop the producers, check every handle's bindings and where keys were served, drain
        every key, and count: ops (acknowledged puts), failed puts, lost, duplicates."""
        records = []
        for proc in self.producers:
            self.workers.send(proc, "stop")
            records.append(json.loads(self.workers.finish(proc, timeout=120).strip().splitlines()[-1]))
        monkeypatch.setenv("ZCHANNEL_NODE", "node-c")
        reader = Channel.connect(self.addresses[2])
        assert isinstance(reader, DistributedChannel)
        try:
            figures = audit(
                reader, [(_key(k), item, t) for r in records for k, item, t in r["acked"]],
                [{_key(json.loads(k)): i for k, i in r["views"].items()} for r in records],
                self.kills, [(_key(k), item) for r in records for k, item in r["got"]])
        finally:
            reader.close()
        return {**figures, "failed": sum(r["failed"] for r in records),
                "kills": sum(len(v) for v in self.kills.values()),
                "bind_after_kill_s": [round(t, 2) for t in self.bind_times]}

    def close(self) -> None:
        self.reps.stop_all()


@pytest.fixture
def chaos(run_dir, workers):
    c = Chaos(run_dir, workers)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.timeout(240)
def test_bindings_survive_replica0_loss_and_restart(chaos, monkeypatch):
    chaos.new_keys_bind(time.monotonic())  # every producer bound a new key before the kill
    killed = chaos.kill(0)
    # new keys (also node-a's, whose replica is down) bind through replica 1
    took = chaos.new_keys_bind(killed, dead=0)
    # replica 1 took over when replica 0's heartbeat expiry ended (it judges the silence at the
    # request, and the handles ask it while replica 0 does not answer): 2-3.2 s after the kill
    # on the test machine (docs/distributed.md); the bound here only catches a second wait (a
    # loaded machine must not break the test)
    expiry = chaos.configured_expiry()
    assert took < 2 * expiry, f"new keys bound again only {took:.1f}s after the kill"
    assert chaos.binding_roles() == {1: "binder", 2: "ready"}
    chaos.restart(0)  # learns the table from replicas 1 and 2 before it binds anything
    chaos.new_keys_bind(time.monotonic())
    # the producers' handles reconnected to the restarted replica by themselves: node-a's old
    # keys (bound to replica 0) take puts again
    chaos.all_served()
    figures = chaos.finish(monkeypatch)
    print("failover figures:", figures)
    assert figures["ops"] > 0 and figures["delivered"] > 0


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_chaos_replica_kills(chaos, monkeypatch):
    duration = float(os.environ.get("ZCHANNEL_CHAOS_S", "60"))
    rounds = int(os.environ.get("ZCHANNEL_CHAOS_ROUNDS", "50"))
    end = time.monotonic() + duration
    victim = 0
    while time.monotonic() < end:
        killed = chaos.kill(victim)
        chaos.new_keys_bind(killed, dead=victim)
        chaos.restart(victim)
        chaos.new_keys_bind(time.monotonic())
        victim = (victim + 1) % 3
        chaos.all_served(rounds)  # the producers' traffic runs on all three replicas meanwhile
    figures = chaos.finish(monkeypatch)
    print("chaos figures:", json.dumps(figures))
