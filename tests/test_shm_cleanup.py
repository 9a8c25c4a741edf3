"""Cleanup of shared-memory segments whose producer is gone (docs/shm.md, "Cleanup rules"):
a long-lived consumer stops mapping segments the broker unlinked, and the broker removes the
segments a killed producer made but never named in a put.  Real brokers, real processes."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import exited, wait_until
from zchannel.broker import Channel, shm
from zchannel.broker.host import procs
from zchannel.broker.shm.broker import ShmBroker
from zchannel.broker.wire.protocol import ShmHello

pytestmark = pytest.mark.timeout(120)

T = 64 * 1024  # test threshold: small slots keep the tests light

PRODUCER = """
    import sys, numpy as np
    from zchannel.broker import Channel
    ch = Channel.connect(sys.argv[1])
    ch.put(np.full(int(sys.argv[2]), int(sys.argv[3]), np.uint8), timeout=10)
    ch.close()
"""


def _deleted_maps(prefix: str) -> list[str]:
    """Names of the unlinked segments of ``prefix`` this process still maps."""
    with open("/proc/self/maps") as f:
        return sorted({line.split("/dev/shm/", 1)[1].split()[0] for line in f
                       if f"/dev/shm/{prefix}" in line and line.rstrip().endswith("(deleted)")})


def test_a_consumer_stops_mapping_segments_of_departed_producers(make_remote, workers):
    ch = make_remote("churn", shm_threshold=T)
    prefix = ch.stats()["shm"]["prefix"]
    cache = ch._connection().shm.mapped  # this process consumes: its connection maps segments

    def produce(value: int) -> str:
        """A producer process puts one item of ``value`` and leaves; the name of its segment."""
        workers.finish(workers.start(PRODUCER, "churn", str(T), str(value)))
        got = ch.get(timeout=10, copy=False if value == 2 else None)
        assert np.array_equal(np.asarray(got), np.full(T, value, np.uint8))
        produced[value] = got
        return next(reversed(cache))  # the segment mapped last

    produced: dict[int, object] = {}
    names = [produce(i) for i in range(3)]
    del produced[0], produced[1]  # owned copies: only the view of producer 2's slot is kept
    view = produced.pop(2)
    assert list(cache) == names
    # the broker unlinks the departed producers' segments nothing holds (the view holds one)
    assert wait_until(lambda: [n for n in shm.list_segments(prefix)
                               if not n.startswith(f"{prefix}probe-")] == [names[2]],
                      timeout=60)
    os.unlink(os.path.join(shm.SHM_DIR, names[2]))  # as a broker stop does, while the view lives
    last = produce(3)  # the next segment mapped: the cache looks for unlinked segments
    assert list(cache) == [last]
    # the view's mapping stays as long as the view: its bytes are still readable
    assert _deleted_maps(prefix) == [names[2]]
    assert np.array_equal(np.asarray(view), np.full(T, 2, np.uint8))
    del view
    gc.collect()
    assert _deleted_maps(prefix) == []


VICTIM = """
    import os, sys
    from zchannel.broker import Channel
    ch = Channel.connect(sys.argv[1])
    assert ch.reserve_shm(int(sys.argv[2]), 2) == 2   # a segment made, named in no put yet
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    import numpy as np
    ch.put(np.full(int(sys.argv[2]), 5, np.uint8), timeout=10)  # the reserved slot
    print("put", flush=True)
    sys.stdin.readline()
"""


def test_broker_removes_unannounced_segments_of_a_killed_producer(make_remote, workers):
    ch = make_remote("dead", shm_threshold=T)
    prefix = ch.stats()["shm"]["prefix"]
    victim = workers.start(VICTIM, "dead", str(T))
    live = workers.start(VICTIM, "dead", str(T))
    victim_pid, live_pid = int(workers.wait_line(victim)), int(workers.wait_line(live))

    def of(pid: int) -> list[str]:
        return [n for n in shm.list_segments(prefix) if n.startswith(f"{prefix}{pid}-")]

    assert len(of(victim_pid)) == 1 and len(of(live_pid)) == 1
    kept = of(live_pid)
    os.kill(victim_pid, signal.SIGKILL)
    assert exited(victim_pid)
    victim.wait()
    # the broker never heard of the victim's segment; its creator is dead: it goes
    assert wait_until(lambda: of(victim_pid) == [], timeout=60)
    assert of(live_pid) == kept  # a live producer's segment not yet named in a put stays
    workers.send(live)
    assert workers.wait_line(live) == "put"
    assert np.array_equal(ch.get(timeout=10), np.full(T, 5, np.uint8))
    assert ch.stats()["shm"]["slots_in"] == 1
    workers.send(live)
    workers.finish(live)
    other = Channel.connect("dead")  # the channel still works for new producers
    try:
        other.put(np.zeros(T, np.uint8), timeout=10)
        assert np.array_equal(ch.get(timeout=10), np.zeros(T, np.uint8))
    finally:
        other.close()


class _Client:
    """What the broker's shared-memory side reads of a client: its routing id."""

    address = b"client"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("pid, pid_ns, foreign", [
    ("own", "own", False),
    ("dead", "own", False),  # the client exited before the broker read its hello
    ("own", None, False),  # a client that cannot name its namespace, seen running
    ("dead", None, True),  # ... not seen running: perhaps another namespace
    ("own", "pid:[1]", True),  # another pid namespace
])
def test_the_dead_producer_scan_trusts_only_pids_it_can_see(run_dir, pid, pid_ns, foreign):
    """A proven client of another pid namespace shares ``/dev/shm``: pids in segment names
    then say nothing, and the broker removes no segment it never heard of.  With every
    client's pid one of this namespace, a dead creator's segment goes, even when a client
    had exited by the time the broker read its hello."""
    broker = ShmBroker(f"scan{pid}{pid_ns}", run_dir, threshold=T, orphan_grace=0.0)
    client = _Client()
    path = os.path.join(shm.SHM_DIR, f"{broker.prefix}{_dead_pid()}-0123abcd")
    ns = procs.pid_namespace() if pid_ns == "own" else pid_ns
    assert procs.pid_namespace() is not None  # Linux: /proc names it
    try:
        broker.handle(client, ShmHello(id=0, token=broker._token, pid_ns=ns,
                                       pid=_dead_pid() if pid == "dead" else os.getpid()))
        assert broker.foreign_pids is foreign
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        broker.client_gone(client)
        broker.sweep(time.monotonic() + 1.0)
        assert os.path.exists(path) is foreign
    finally:
        broker.close()
        if os.path.exists(path):
            os.unlink(path)


def test_a_restarted_broker_keeps_live_producers_old_segments_for_the_grace(run_dir):
    """A broker started after one of its channel died removes that broker's probe and the
    segments of dead producers at once; a live producer's segment stays for the grace period
    (a reply the dead broker sent may name it to a consumer that has not mapped it yet) and
    goes after it."""
    prefix = shm.prefix_for("restarted", run_dir)
    live = os.path.join(shm.SHM_DIR, f"{prefix}{os.getpid()}-0123abcd")
    dead = os.path.join(shm.SHM_DIR, f"{prefix}{_dead_pid()}-4567abcd")
    probe = os.path.join(shm.SHM_DIR, f"{prefix}probe-0123456789abcdef")  # the dead broker's
    for path in (live, dead, probe):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    broker = ShmBroker("restarted", run_dir, threshold=T, orphan_grace=30.0)
    try:
        assert os.path.exists(live) and not os.path.exists(dead) and not os.path.exists(probe)
        assert broker.probe is not None and broker.probe.startswith(f"{prefix}probe-")
        assert os.path.exists(os.path.join(shm.SHM_DIR, broker.probe))  # its own, made anew
        broker.sweep(time.monotonic())
        assert os.path.exists(live)  # within the grace
        broker.sweep(time.monotonic() + 31.0)
        assert not os.path.exists(live)
    finally:
        broker.close()
        for path in (live, dead):
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.parametrize("copy", [None, True])
def test_a_get_completed_before_close_and_read_after_it_is_its_own_item(make_remote, copy):
    """A get's ``Work`` that completed before its handle closed, read after: the item it got,
    not what a later put wrote in its slot (the handle reads it before saying bye, when the
    broker gives the slot back to its producer)."""
    owner = make_remote("readafter", shm_threshold=T)
    producer = Channel.connect(owner.address, identity="p:0")
    consumer = Channel.connect(owner.address, identity="c:0")
    try:
        producer.put(np.full(4 * T, 1, np.uint8), key="k")
        work = consumer.get(key="k", async_op=True, copy=copy, timeout=10)
        assert wait_until(work.done, 10)
        assert owner.stats()["shm"]["consumer_holds"] == 1
        consumer.close()
        assert wait_until(lambda: owner.stats()["shm"]["consumer_holds"] == 0, 10)
        for _ in range(4):  # the producer's pool reuses the freed slot
            producer.put(np.full(4 * T, 2, np.uint8), key="k2")
        assert np.unique(work.wait(10)).tolist() == [1]
        assert len(owner.get_batch(4, key="k2", timeout=10)) == 4
    finally:
        producer.close()
