"""Brokers placed by Ray: a simulated three-node cluster (``ray.cluster_utils.Cluster``) on this
machine; producers pinned to nodes by custom resources.  Skipped when ray is not installed."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
import tempfile
import time

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'zchannel[ray]')")

import torch  # noqa: E402
from cluster_util import audit  # noqa: E402
from conftest import exited, pid_alive, until_available, wait_until  # noqa: E402
from zchannel.broker import (  # noqa: E402
    BrokerUnavailable,
    Channel,
    ChannelError,
    ChannelNotFound,
)
from zchannel.broker.handle import ray_placement  # noqa: E402
from zchannel.broker.handle.distributed import DistributedChannel  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster  # the session's shared cluster (tests/conftest.py), node resources on


@ray.remote(num_cpus=0)
class Producer:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def produce(self, channel, tag: str, n: int) -> str:
        for i in range(n):
            channel.put(torch.full((50_000,), i, dtype=torch.int32), key=(tag, i))
        node = channel.node_of((tag, 0))
        channel.close()
        return node

    def consume(self, channel, tag: str, n: int) -> list:
        got = [int(channel.get((tag, i), timeout=30)[0]) for i in range(n)]
        channel.close()
        return got


@ray.remote(num_cpus=0)
def read_by_name(name: str, key) -> int:
    ch = Channel.connect(name)
    try:
        return int(ch.get(key, timeout=30)[0])
    finally:
        ch.close()


def _pinned(i: int):
    return Producer.options(resources={f"node{i}": 0.01}).remote()


def _sorted_nodes() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


def _assert_gone(pids: list[int], actor_name: str, actor_ids: list[str] = ()) -> None:
    import ray._private.state as state

    assert actor_name not in ray.util.list_named_actors()
    for actor_id in actor_ids:
        assert state.actors(actor_id=actor_id)["State"] in ("DEAD", 4)
    for pid in pids:  # shutdown() waited for the actors to stop their brokers
        assert not pid_alive(pid), f"broker {pid} outlived its channel"


def test_replica_per_node_keys_stay_with_producers(cluster):
    ch = Channel.create("rayd", distributed=True)
    try:
        assert isinstance(ch, DistributedChannel)
        nodes = [r["node"] for r in ch.replicas]
        assert sorted(nodes) == _sorted_nodes()
        producers = [_pinned(i) for i in range(3)]
        producer_nodes = ray.get([p.node.remote() for p in producers])
        placed = ray.get([p.produce.remote(ch, f"p{i}", 4) for i, p in enumerate(producers)])
        assert placed == producer_nodes  # each key lives on its producer's node
        stats = ch.stats()
        for i, node in enumerate(producer_nodes):
            for k in range(4):
                assert stats["keys"][(f"p{i}", k)]["node"] == node
        per_replica = {r["node"]: r["bytes_held"] for r in stats["replicas"]}
        for node in producer_nodes:
            assert 4 * 200_000 <= per_replica[node] < 4 * 200_000 + 16_384
        # round trips: a consumer on another node, and the driver
        assert ray.get(producers[1].consume.remote(ch, "p0", 2)) == [0, 1]
        assert [int(ch.get(("p2", k), timeout=10)[0]) for k in range(4)] == [0, 1, 2, 3]
        # any process of the job finds the channel by name
        assert ray.get(read_by_name.remote("rayd", ("p1", 3))) == 3
        # CURVE: the simulated nodes bind a non-loopback IP, so the channel got its own keys
        if not ray.util.get_node_ip_address().startswith("127."):
            assert ch._curve_keys is not None
        pids = [r["pid"] for r in stats["replicas"]]
        # the actors (and the brokers they spawn) run this checkout's code
        exe, module = ray.get(ch._ray_owner.actors[0].where.remote())
        import zchannel.broker

        assert module == zchannel.broker.__file__, (exe, module)
        actor_ids = [a._actor_id.hex() for a in ch._ray_owner.actors]
    finally:
        ch.shutdown()
    _assert_gone(pids, "zchannel:rayd", actor_ids)
    with pytest.raises(ChannelNotFound):
        Channel.connect("rayd", timeout=2)


def test_single_broker_placement(cluster):
    nodes = _sorted_nodes()
    ch = Channel.create("rank2", node_rank=2)
    try:
        stats = ch.stats()
        assert [r["node"] for r in stats["replicas"]] == [nodes[2]]
        ch.put("x")
        assert ch.stats()["keys"]["default_queue"]["node"] == nodes[2]
        assert ch.get() == "x"
        pids = [stats["replicas"][0]["pid"]]
    finally:
        ch.shutdown()
    _assert_gone(pids, "zchannel:rank2")

    producer = _pinned(1)
    consumer_node = nodes[0]
    ch = Channel.create("byproducer", producers=[producer, "rollout"], consumers=[consumer_node])
    try:
        stats = ch.stats()
        assert [r["node"] for r in stats["replicas"]] == [ray.get(producer.node.remote())]
        assert stats["producers"] == ["rollout"]  # the actor handle only placed the broker
    finally:
        ch.shutdown()
    ch = Channel.create("byconsumer", consumers=[consumer_node])
    try:
        assert [r["node"] for r in ch.stats()["replicas"]] == [consumer_node]
    finally:
        ch.shutdown()
    ray.kill(producer)


def test_creator_death_leaves_no_brokers(cluster, workers):
    import signal

    from zchannel.broker import shm

    before = set(os.listdir(shm.SHM_DIR))

    proc = workers.start("""
        import sys, ray
        ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
        from zchannel.broker import Channel
        ch = Channel.create("orphan", distributed=True)
        ch.put("x", key="k")
        print(" ".join(str(r["pid"]) for r in ch.stats()["replicas"]), flush=True)
        print(" ".join(r.workdir for r in ch._ray_owner.remains), flush=True)
        sys.stdin.readline()
    """, cluster.address)
    pids = [int(p) for p in workers.wait_line(proc, timeout=120).split()]
    workdirs = workers.wait_line(proc, timeout=30).split()
    assert len(pids) == 3 and all(pid_alive(p) for p in pids)
    os.kill(proc.pid, signal.SIGKILL)  # the creator dies: Ray removes its actors, brokers follow
    proc.wait()
    assert exited(pids, 60), \
        "brokers outlived their creator"
    # Ray SIGKILLs an exiting worker's child processes, so these brokers could not remove their
    # shared-memory probe segments (a later broker of the channel would, in the same run dir).
    for name in set(os.listdir(shm.SHM_DIR)) - before:
        if "+orphan+" in name:
            os.unlink(os.path.join(shm.SHM_DIR, name))
    for workdir in workdirs:  # and their work directories stay (docs/distributed.md)
        shutil.rmtree(workdir, ignore_errors=True)


def test_broker_actor_restarts_and_channel_keeps_serving(cluster):
    """A broker actor killed by Ray (``ray.kill(no_restart=False)``) is restarted on its node,
    starts its broker again on the same address (it learns the bindings from the other
    replicas), and the creator's handle keeps serving without a restart: the dead replica's
    items are lost, the others' are not, and its keys take puts again."""

    ch = Channel.create("rayha", distributed=True)
    try:
        producers = [_pinned(i) for i in range(3)]
        nodes = ray.get([p.node.remote() for p in producers])
        index = {r["node"]: i for i, r in enumerate(ch.replicas)}
        ray.get([p.produce.remote(ch, f"h{i}", 3) for i, p in enumerate(producers)])
        victim = index[nodes[1]]
        actor = ch._ray_owner.actors[victim]
        old_pid = ray.get(actor.pid.remote())
        old_address = ch.replicas[victim]["address"]
        ray.kill(actor, no_restart=False)
        new_pid = _restarted_pid(actor, old_pid)
        assert new_pid != -1
        # the survivors' items are all there
        for i in (0, 2):
            assert [int(ch.get((f"h{i}", k), timeout=30)[0]) for k in range(3)] == [0, 1, 2]

        # retried while the handle has not seen the restarted replica yet: each retry waits
        # for that replica to answer the connection's hello
        until_available(ch._sub(victim), lambda: ch.put(torch.zeros(4), key=("h1", 0), timeout=5))
        # it serves its keys at once; it binds only once it learned the table (joining)
        assert wait_until(lambda: ch.stats()["replicas"][victim].get("binding") != "joining", 60)
        stats = ch.stats()
        rep = stats["replicas"][victim]
        assert rep["pid"] == new_pid and rep["node"] == nodes[1]
        assert rep["address"] == old_address
        assert stats["keys"][("h1", 0)]["node"] == nodes[1]
        assert ch.qsize(("h1", 1)) == 0  # what the dead replica held is lost
        assert rep["bound_keys"] == stats["replicas"][(victim + 1) % 3]["bound_keys"], \
            stats["replicas"]
        # a new key from the restarted node binds to its replica once the binder sees that
        # replica live again; connect by name still works
        binder = next(i for i, r in enumerate(ch.stats()["replicas"]) if r.get("binding") == "binder")
        assert wait_until(lambda: victim in ch.stats()["replicas"][binder]["live_replicas"], 60)
        assert ray.get(producers[1].produce.remote(ch, "after", 1)) == nodes[1]
        assert ray.get(read_by_name.remote("rayha", ("after", 0))) == 0
        pids = [r["pid"] for r in ch.stats()["replicas"]]
        for p in producers:
            ray.kill(p)
    finally:
        ch.shutdown()
    _assert_gone(pids, "zchannel:rayha")


def test_a_broker_process_killed_under_its_actor_is_started_again(cluster):
    """The broker process of a replica dies (SIGKILL, as the OOM killer does) while its actor
    lives: the actor ends itself, Ray restarts it, and it starts the broker again on the same
    address; the replica's keys take puts again (they used to fail for good)."""
    ch = Channel.create("raybroker", distributed=True)
    try:
        victim = 1
        actor = ch._ray_owner.actors[victim]
        old_pid = ray.get(actor.pid.remote())
        address = ch.replicas[victim]["address"]
        os.kill(old_pid, signal.SIGKILL)
        assert exited([old_pid], 30)
        new_pid = _restarted_pid(actor, old_pid)
        assert new_pid not in (-1, old_pid) and pid_alive(new_pid)
        sub = ch._sub(victim)
        until_available(sub, lambda: sub.put("again", key="k", timeout=5))
        assert sub.get(key="k", timeout=30) == "again"
        rep = ch.stats()["replicas"][victim]
        assert rep["pid"] == new_pid and rep["address"] == address
        pids = [r["pid"] for r in ch.stats()["replicas"]]
    finally:
        ch.shutdown()
    _assert_gone(pids, "zchannel:raybroker")


@ray.remote(num_cpus=0)
class Loader:
    """Puts (weight 1) to its node's three old keys, a new key every five rounds and a key every
    loader touches in the same round, from a thread of its own until ``finish``; records every
    acknowledged put (with when it was issued) and the replica its handle routed each key to."""

    def start(self, channel, tag: str) -> str:
        import threading

        self.ch, self.tag = channel, tag
        self.acked, self.views, self.failed = [], {}, 0
        self.clean_round = -1.0  # when the last round in which every put succeeded began
        self.clean = threading.Condition()  # notified at each such round
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return ray.get_runtime_context().get_node_id()

    def _run(self) -> None:
        from zchannel.broker import BrokerUnavailable

        old = [(self.tag, "old", j) for j in range(3)]
        seq = rnd = 0
        while not self.done.is_set():
            began, ok = time.monotonic(), True
            for key in old + [(self.tag, "new", rnd // 5), ("shared", rnd // 5)]:
                seq += 1
                item = f"{self.tag}/{seq}"
                issued = time.monotonic()  # a broker that acknowledges it was alive by then
                try:
                    self.ch.put(item, 1, key=key, timeout=10)
                except (BrokerUnavailable, TimeoutError):
                    self.failed += 1
                    ok = False
                    continue
                self.acked.append((key, item, issued))
                self.views[key] = self.ch.replica_of(key)
            if ok:
                with self.clean:
                    self.clean_round = began
                    self.clean.notify_all()
            rnd += 1
            self.done.wait(0.01)  # pacing: three loaders share two cores with Ray and brokers

    def served_since(self, t: float, timeout: float) -> bool:
        """Whether a round that began after ``t`` has every put acknowledged within ``timeout``
        seconds (waits for it)."""
        with self.clean:
            return self.clean.wait_for(lambda: self.clean_round > t, timeout)

    def finish(self) -> tuple[list, dict, int]:
        self.done.set()
        self.thread.join(60)
        self.ch.close()
        return self.acked, self.views, self.failed


def test_broker_actor_killed_under_load(cluster):
    """Loaders on all three nodes keep putting to old, new and shared keys while Ray kills a
    broker actor: the actor restarts on its node, the loaders' handles (never restarted) take
    puts on its keys again and bind new keys meanwhile; no key is served by two replicas,
    every acknowledged item on the surviving replicas is delivered exactly once (the killed
    replica's are lost until it died, none after)."""

    ch = Channel.create("rayload", distributed=True)
    loaders = []
    try:
        loaders = [Loader.options(resources={f"node{i}": 0.01}).remote() for i in range(3)]
        nodes = ray.get([lo.start.remote(ch, f"l{i}") for i, lo in enumerate(loaders)])
        victim = {r["node"]: i for i, r in enumerate(ch.replicas)}[nodes[1]]
        actor = ch._ray_owner.actors[victim]
        node_before = ray.get(actor.node.remote())[0]
        t0 = time.monotonic()

        def served_since(t: float) -> bool:
            return all(ray.get([lo.served_since.remote(t, 60) for lo in loaders], timeout=120))

        assert served_since(t0), "the loaders never ran a clean round"
        old_pid = ray.get(actor.pid.remote())
        ray.kill(actor, no_restart=False)
        assert exited(old_pid, 30), "the killed actor's broker lives on"
        dead_at = time.monotonic()  # nothing the old broker acknowledged was issued later
        new_pid = _restarted_pid(actor, old_pid)
        assert new_pid not in (-1, old_pid)
        assert ray.get(actor.node.remote())[0] == node_before  # restarted on its node
        restarted = time.monotonic()
        # the loaders' handles (not restarted) are served again, the restarted replica's keys too
        assert served_since(restarted), "the channel stopped serving"
        records = ray.get([lo.finish.remote() for lo in loaders], timeout=120)
        acked = [a for r in records for a in r[0]]
        on_victim_after = [a for a in acked if records[1][1].get(a[0]) == victim
                           and a[2] > restarted]
        assert on_victim_after, "the restarted replica took no put of its old keys"
        figures = audit(ch, acked, [r[1] for r in records], {victim: [dead_at]})
        figures["failed"] = sum(r[2] for r in records)
        print("ray kill under load:", figures)
        assert figures["ops"] > 0
        stats = ch.stats()
        assert stats["replicas"][victim]["pid"] == new_pid
        assert [r["address"] for r in stats["replicas"]] == [r["address"] for r in ch.replicas]
        pids = [r["pid"] for r in stats["replicas"]]
    finally:
        for lo in loaders:
            ray.kill(lo)
        ch.shutdown()
    _assert_gone(pids, "zchannel:rayload")


def _restarted_pid(actor, old_pid: int, timeout: float = 120) -> int:
    """The broker pid of ``actor`` once Ray restarted it: the call is retried by Ray itself
    (``max_task_retries``) until the restarted instance answers, and Ray holds it while the
    actor restarts.  A call that still reaches the old instance, between its broker's death and
    the moment its watching thread ends the actor (longer on a loaded machine), answers
    ``old_pid``: it is asked again until the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        pid = ray.get(actor.pid.options(max_task_retries=-1).remote(), timeout=timeout)
        if pid != old_pid:
            return pid
        assert exited(old_pid, timeout), "the killed actor's broker lives on"
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the restarted broker actor still answers with the old broker {old_pid}")


def test_connect_by_name_while_the_broker_actor_restarts(cluster):
    """``Channel.connect(name)`` while Ray restarts replica 0's actor (the named one) raises
    a zchannel error or connects, never a raw Ray exception (``ActorUnavailableError: The actor
    was restarted`` used to escape from the table look-up)."""
    ch = Channel.create("rayrc", distributed=True)
    try:
        ray.kill(ray.get_actor("zchannel:rayrc"), no_restart=False)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                Channel.connect("rayrc").close()
            except ChannelError:
                pass  # BrokerUnavailable / ChannelNotFound: the documented errors
        other = Channel.connect("rayrc")
        until_available(other._sub(0), lambda: other.put(1, key="after", timeout=5))
        other.close()
    finally:
        ch.shutdown()


# a creator that ends Ray (``ray.shutdown()``) before it shuts its channel down, or exits
# without shutdown(); it prints its brokers' pids and the work directories they made
_CREATOR_SCRIPT = """
    import os, sys
    if sys.argv[2] == "ray_first":
        import ray
        from zchannel.broker import Channel
    else:  # zchannel's exit handler is registered first: Ray's runs (and ends Ray) before it
        from zchannel.broker import Channel
        import ray
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    ch = Channel.create(sys.argv[3], distributed=True)
    ch.put("x", key="k")
    print(" ".join(str(r["pid"]) for r in ch.stats()["replicas"]), flush=True)
    # its brokers' work directories (by their actors' ids: other Ray jobs may make theirs)
    print(" ".join(r.workdir for r in ch._ray_owner.remains if os.path.isdir(r.workdir)),
          flush=True)
    if sys.argv[4] == "shutdown_after_ray":
        ray.shutdown()
        ch.shutdown()
        print(ray.is_initialized(), flush=True)
"""


def test_shutdown_after_ray_shutdown_does_not_start_ray(cluster, workers):
    """``shutdown()`` of the creating handle after ``ray.shutdown()`` calls no actor (that
    started a new local Ray cluster, about 8 s) and removes the brokers' work directories
    (CURVE keys) on this host, which Ray's end of the actors leaves."""
    proc = workers.start(_CREATOR_SCRIPT, cluster.address, "ray_first", "rayend",
                         "shutdown_after_ray")
    pids = [int(p) for p in workers.wait_line(proc, timeout=120).split()]
    workdirs = workers.wait_line(proc, timeout=30).split()
    initialized = workers.wait_line(proc, timeout=120)
    assert initialized == "False", "ch.shutdown() after ray.shutdown() started Ray again"
    assert proc.wait(60) == 0
    assert exited(pids, 60), "brokers outlived their creator"
    assert len(workdirs) == 3 and not any(os.path.exists(w) for w in workdirs), workdirs


@pytest.mark.parametrize("order", ["ray_first", "zchannel_first"])
def test_creator_exit_without_shutdown_leaves_no_work_dirs(cluster, workers, order):
    """A creator that exits normally without ``shutdown()`` leaves neither brokers nor their
    work directories (they hold the channel's CURVE secret keys), whichever of Ray's and
    zchannel's exit handlers runs first."""
    proc = workers.start(_CREATOR_SCRIPT, cluster.address, order, f"rayexit{order[0]}", "exit")
    pids = [int(p) for p in workers.wait_line(proc, timeout=120).split()]
    workdirs = workers.wait_line(proc, timeout=30).split()
    assert proc.wait(120) == 0
    assert exited(pids, 60), "brokers outlived their creator"
    assert len(workdirs) == 3 and not any(os.path.exists(w) for w in workdirs), workdirs


def test_connect_by_name_after_replica_0_node_is_lost(cluster):
    """Replica 0's node dies (its actor cannot be placed again: hard node affinity):
    ``Channel.connect(name)`` raises ``BrokerUnavailable`` naming replica 0's actor while Ray
    still knows it, then ``ChannelNotFound``; never Ray's ``ActorUnschedulableError``."""
    node = cluster.add_node(num_cpus=0)
    cluster.wait_for_nodes()
    ch = Channel.create("raylost", node_rank=_sorted_nodes().index(node.node_id))
    try:
        assert ch.replicas[0]["node"] == node.node_id
        lost_workdir = ch._ray_owner.remains[0].workdir
        cluster.remove_node(node, allow_graceful=False)
        seen: list[BrokerUnavailable] = []
        deadline = time.monotonic() + 120
        while True:  # until Ray dropped the actor's name (a Ray exception fails the test)
            try:
                Channel.connect("raylost", timeout=2).close()  # the node's end not seen yet
            except ChannelNotFound as exc:
                if "no channel named" in str(exc):
                    break
                seen.append(exc)
            except BrokerUnavailable as exc:
                seen.append(exc)
            assert time.monotonic() < deadline, f"the name stayed: {seen[-3:]}"
        assert any("replica 0's broker actor" in str(e) for e in seen), seen
    finally:
        ch.shutdown()
    # the lost node was this host: shutdown() removed what its killed actor left here
    assert not os.path.exists(lost_workdir)


def test_dropping_the_creating_handle_keeps_the_channel(cluster):
    """The creating handle is dropped without ``shutdown()``: the channel lives on (as a broker
    started off Ray does, until the creating process ends); its actors were killed by Ray as
    soon as the handle was collected."""
    import ray._private.state as state

    def actor_state(actor_id: str) -> str:
        return state.actors(actor_id=actor_id)["State"]

    ch = Channel.create("raygc", distributed=True)
    ch.put("kept", key="k")
    actor_ids = [a._actor_id.hex() for a in ch._ray_owner.actors]
    pids = [r["pid"] for r in ch.stats()["replicas"]]
    del ch
    gc.collect()
    # a witness actor dropped after the channel's handle: once Ray ended it, Ray has handled
    # the drop of the channel's actors too
    witness = Producer.remote()
    witness_id = witness._actor_id.hex()
    ray.get(witness.node.remote())
    del witness
    gc.collect()
    assert wait_until(lambda: actor_state(witness_id) == "DEAD", 60)
    assert [actor_state(i) for i in actor_ids] == ["ALIVE"] * 3
    other = Channel.connect("raygc")
    assert other.get("k", timeout=30) == "kept"
    other.close()
    placement = next(p for p in list(ray_placement._placements)
                     if [a._actor_id.hex() for a in p.actors] == actor_ids)
    placement.teardown()
    _assert_gone(pids, "zchannel:raygc", actor_ids)


def test_same_name_in_another_cluster_keeps_its_work_dir(cluster):
    """The work directory of a broker actor is its own: a directory another Ray cluster on the
    host made for the same channel name and replica (every cluster's first job is 01000000)
    is left alone; it used to be removed, CURVE keys and all, by the new actor."""
    job = ray.get_runtime_context().get_job_id()
    others = [os.path.join(tempfile.gettempdir(), f"zchannel-ray-{job}-raytwo-r0-{os.getuid()}"),
              os.path.join(tempfile.gettempdir(), f"zchannel-ray-{job}-raytwo-r0")]
    for other in others:
        os.makedirs(os.path.join(other, "keys"), mode=0o700, exist_ok=True)
        with open(os.path.join(other, "keys", "server.key_secret"), "w") as f:
            f.write("the other cluster's key\n")
    ch = Channel.create("raytwo", node_rank=0)
    try:
        ch.put("x")
        for other in others:
            assert os.path.exists(os.path.join(other, "keys", "server.key_secret")), other
        _host, workdir = ray.get(ch._ray_owner.actors[0].host_and_work_dir.remote())
        assert workdir not in others and os.path.isdir(workdir)
        # a long channel name's socket falls back to a 16-hex-digit name in the run directory
        assert len(os.path.join(workdir, "run", "0123456789abcdef.sock")) <= 107
    finally:
        ch.shutdown()
        for other in others:
            shutil.rmtree(other, ignore_errors=True)
    assert not os.path.exists(workdir)


def test_second_create_logs_the_settings_it_ignores(cluster, caplog):
    """A second ``create`` of a Ray-placed channel attaches and logs each setting it ignores
    (maxsize, lease_timeout), as a second create of a broker channel does."""
    ch = Channel.create("raysettings", maxsize=2, lease_timeout=5.0, distributed=True)
    try:
        with caplog.at_level(logging.WARNING, logger="zchannel.client"):
            again = Channel.create("raysettings", maxsize=7, lease_timeout=9.0, distributed=True)
        assert not again.created
        again.close()
        text = caplog.text
        assert "maxsize=7 ignored" in text, text
        assert "lease_timeout=9.0 ignored" in text, text
    finally:
        ch.shutdown()
