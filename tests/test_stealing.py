"""Cross-replica stealing (opt-in, ``steal = true`` in the cluster file): empty keys move from a
backed-up replica to an idle one (``broker/cluster/moving.py``).  Three replicas on loopback tcp started
with the CLI, a producer and a consumer process on node-b, an idle consumer on node-a."""

from __future__ import annotations

import json

import pytest
from cluster_util import Replicas, free_tcp_ports, write_cluster
from conftest import wait_until
from zchannel.broker import Channel, KeyMoved
from zchannel.broker.cluster.moving import MOVE_BACKLOG, choose_move
from zchannel.broker.handle.distributed import DistributedChannel
from zchannel.broker.wire.protocol import LoadAnswer

pytestmark = pytest.mark.timeout(120)

NODES = ("node-a", "node-b", "node-c")
KEYS = 4

# puts [j, seq] (weight 1) to ("w", j) for j < KEYS, round after round, after a backlog of 40
# items on "deep" that nobody takes meanwhile (its replica is backed up); "stop" on stdin ends it
PRODUCER = """
import json, sys, threading
from zchannel.broker import Channel
ch, keys = Channel.connect(sys.argv[1]), int(sys.argv[2])
for i in range(40):
    ch.put(["deep", i], 1, key="deep")
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
acked, seq = [], 0
print("ready", flush=True)
while not stop.is_set():
    for j in range(keys):
        seq += 1
        ch.put([j, seq], 1, key=("w", j), timeout=10)
        acked.append([j, seq])
    stop.wait(0.02)  # pacing: the consumer keeps up, so the keys are empty now and then
print(json.dumps({"acked": acked}), flush=True)
ch.close()
"""

# takes what there is from every ("w", j) without waiting (no parked get) until "stop"
CONSUMER = """
import json, sys, threading
from zchannel.broker import Channel, QueueEmpty
ch, keys = Channel.connect(sys.argv[1]), int(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
got = []
print("ready", flush=True)
while not stop.is_set():
    took = False
    for j in range(keys):
        try:
            got.append(ch.get_nowait(key=("w", j)))
            took = True
        except QueueEmpty:
            pass
    if not took:
        stop.wait(0.005)
print(json.dumps({"got": got}), flush=True)
ch.close()
"""


def _replica_stats(address: str) -> dict:
    with Channel(None, address) as plain:
        return plain.stats()


def test_empty_keys_move_to_an_idle_replica(run_dir, workers, monkeypatch):
    ports = free_tcp_ports(3)
    path = write_cluster(run_dir, NODES, [f"tcp://127.0.0.1:{p}" for p in ports])
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write("[cluster]\nsteal = true\n\n" + text)
    addresses = [f"tcp://127.0.0.1:{p}" for p in ports]
    reps = Replicas()
    try:
        reps.start("st", path, range(3))
        env = {"ZCHANNEL_NODE": "node-b"}
        producer = workers.start(PRODUCER, addresses[1], str(KEYS), env=env)
        workers.wait_line(producer, "ready", timeout=60)
        consumer = workers.start(CONSUMER, addresses[1], str(KEYS), env=env)
        workers.wait_line(consumer, "ready", timeout=60)
        # node-a's consumer waits on an empty key of replica 0: replica 0 is idle
        monkeypatch.setenv("ZCHANNEL_NODE", "node-a")
        idle = Channel.connect(addresses[0])
        parked = idle.get(key="idle", async_op=True, timeout=90)
        assert idle.replica_of("idle") == 0
        # replica 1 (node-b's keys, 40 items queued on "deep") gives empty keys to replica 0
        assert wait_until(lambda: _replica_stats(addresses[1]).get("keys_given", 0) >= 2, 60), \
            _replica_stats(addresses[1])
        parked.cancel()  # replica 0 is not idle any more: moves stop
        idle.close()
        for proc in (producer, consumer):
            workers.send(proc, "stop")
        produced = json.loads(workers.finish(producer, timeout=60).strip().splitlines()[-1])
        taken = json.loads(workers.finish(consumer, timeout=60).strip().splitlines()[-1])

        monkeypatch.setenv("ZCHANNEL_NODE", "node-c")
        reader = Channel.connect(addresses[2])
        assert isinstance(reader, DistributedChannel)
        try:
            bound = [reader.replica_of(("w", j)) for j in range(KEYS)]
            assert 0 in bound, bound  # the idle replica holds moved keys ...
            # ... and served their puts (only the producer puts, through its first handle: it
            # followed the moves; a key it did not touch since its move is still cached as on
            # replica 1 there, and would be corrected by the next operation)
            assert _replica_stats(addresses[0])["puts"] > 0
            summaries = reader.stats()["replicas"]
            assert summaries[1]["keys_given"] >= 2 and summaries[0]["moves_asked"] >= 2, summaries
            assert "keys_given" not in reader.stats()  # per replica only
            # no key is held by two replicas (read 0 first: keys only move from 1 to 0 here, so
            # a key read on 0 cannot show up on 1 afterwards, even if a last move was under way)
            held = [set(_replica_stats(address)["keys"]) for address in addresses]
            assert not (held[0] & held[1]) and not (held[0] & held[2]) and not (held[1] & held[2])
            assert "deep" in held[1]  # a key that never empties never moves
            # a replica answers an operation on a key it gave away with KeyMoved
            with Channel(None, addresses[1]) as plain, pytest.raises(KeyMoved) as moved:
                plain.qsize(("w", bound.index(0)))
            assert moved.value.replica == 0
            drained = {j: [] for j in range(KEYS)}
            for j in range(KEYS):
                while reader.qsize(("w", j)):
                    drained[j].append(reader.get(("w", j), timeout=10))
            assert [reader.get("deep", timeout=10) for _ in range(40)] == \
                [["deep", i] for i in range(40)]
        finally:
            reader.close()
        # per key: what the consumer took, then what was left, is exactly what was put, in order
        for j in range(KEYS):
            put = [seq for k, seq in produced["acked"] if k == j]
            got = [seq for k, seq in taken["got"] if k == j] + [seq for _, seq in drained[j]]
            assert got == put, (j, len(got), len(put))
        print("moved keys:", bound, "items:", len(produced["acked"]))
    finally:
        reps.stop_all()


def test_choose_move_needs_an_idle_and_a_backed_up_replica():
    idle, busy, quiet = LoadAnswer(backlog=0, starved=2), LoadAnswer(backlog=40, starved=0), \
        LoadAnswer(backlog=0, starved=0)
    assert choose_move({0: idle, 1: busy, 2: quiet}) == (1, 0)
    assert choose_move({0: quiet, 1: busy}) is None  # nobody waits: nothing to gain
    assert choose_move({0: idle, 1: LoadAnswer(backlog=MOVE_BACKLOG - 1, starved=0)}) is None
    # the deepest backlog gives, to the replica with the most waiting gets
    assert choose_move({0: LoadAnswer(backlog=0, starved=1), 1: busy, 2: LoadAnswer(backlog=0, starved=3),
                        3: LoadAnswer(backlog=90, starved=1)}) == (3, 2)
