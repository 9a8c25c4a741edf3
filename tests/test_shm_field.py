"""Same-host shared memory in the field (docs/shm.md): a consumer stopped past its expiry, a
producer that forks, copy-out memory, the handle's ``shm`` switch.  Real brokers, real worker
processes, real /dev/shm."""

from __future__ import annotations

import gc
import os
import pickle
import signal

import numpy as np
import pytest
from cluster_util import write_cluster
from conftest import wait_until
from zchannel.broker import Channel
from zchannel.broker.shm import client as shm_client

pytestmark = pytest.mark.timeout(120)

T = 64 * 1024  # test threshold: small slots keep the suite light
MIB = 1 << 20


def _shm_stats(ch) -> dict:
    return ch.stats()["shm"]


def test_views_dropped_as_a_stalled_consumer_resumes_release_their_slots(make_remote, workers,
                                                                        tmp_path):
    """A consumer stopped (SIGSTOP) until the broker expired it, which drops its ``copy=False``
    views the moment it runs again -- before it learns that it expired, or before its new
    session proved the same host -- still releases their slots: the releases the broker could
    not take then go again once it registered again, and the holds go while the process lives.

    The consumer is stopped mid-computation (spinning on a flag in a shared mapping, which the
    test sets while it is stopped): resumed, it drops its views at once, holding the
    interpreter, before its I/O thread has read anything."""
    ch = make_remote("stallrel", shm_threshold=T)
    flag = tmp_path / "resumed"
    flag.write_bytes(b"\0")
    consumer = workers.start(
        """
        import mmap, os, sys
        from zchannel.broker import Channel
        ch = Channel.connect(sys.argv[1], identity="c:0")
        views = [ch.get(copy=False, timeout=30) for _ in range(4)]
        fd = os.open(sys.argv[2], os.O_RDONLY)
        resumed = mmap.mmap(fd, 1, prot=mmap.PROT_READ)
        print("held", [int(v[0]) for v in views], flush=True)
        while not resumed[0]:  # no system call: stopped and resumed in this loop
            pass
        del views
        print("dropped", flush=True)
        sys.stdin.readline()
        """,
        ch.address,
        str(flag),
    )
    for i in range(4):  # 4 MiB each: released at once (RELEASE_AT_ONCE_BYTES)
        ch.put(np.full(shm_client.RELEASE_AT_ONCE_BYTES, i, np.uint8))
    workers.wait_line(consumer, "held [0, 1, 2, 3]")
    clients = ch.stats()["clients"]
    os.kill(consumer.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: ch.stats()["clients"] == clients - 1, 30), "never expired"
        assert _shm_stats(ch)["consumer_holds"] == 4  # kept for the stopped process
        with open(flag, "r+b") as f:
            f.write(b"\1")
    finally:
        os.kill(consumer.pid, signal.SIGCONT)
    workers.wait_line(consumer, "dropped")
    assert wait_until(lambda: _shm_stats(ch)["consumer_holds"] == 0, 30), _shm_stats(ch)
    assert _shm_stats(ch)["consumer_bytes"] == 0
    assert consumer.poll() is None  # released by the live process, not by its exit
    assert wait_until(lambda: _shm_stats(ch)["slots_used"] == 0, 30)


@pytest.mark.parametrize("child", ["exits", "drops its copy"])
def test_a_forked_child_frees_none_of_its_parents_lent_slots(make_remote, workers, child):
    """An ``empty_shm`` array stays its parent's through a fork: a child that exits (its
    finalizers run at exit) or drops its copy leaves the slot lent, and the parent's first put
    of the array sends that slot as it is."""
    ch = make_remote("forklent", shm_threshold=T)
    producer = workers.start(
        """
        import gc, os, sys
        import numpy as np
        from zchannel.broker import Channel
        from zchannel.broker.shm import USED
        ch = Channel.connect(sys.argv[1])
        a = ch.empty_shm((65536,), np.uint8)
        a[:] = 7
        seg, slot = ch._connection().shm.pool.lent[a.ctypes.data][:2]  # the slot lent to `a`
        pid = os.fork()
        if pid == 0:  # the child does nothing with the channel
            if sys.argv[2] == "drops its copy":
                del a
                gc.collect()
                os._exit(0)
            sys.exit(0)  # a normal exit: finalizers run
        os.waitpid(pid, 0)
        print("still used", seg.states[slot] == USED, flush=True)
        ch.put(a)
        print("put", flush=True)
        sys.stdin.readline()
        """,
        ch.address,
        child,
    )
    workers.wait_line(producer, "still used True")
    workers.wait_line(producer, "put")
    assert _shm_stats(ch)["slots_in"] == 1  # the put sent the lent slot
    got = ch.get(timeout=10)
    assert got.shape == (65536,) and (got == 7).all()
    workers.send(producer)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_copy_out_buffers_are_bounded_and_freed_with_the_connection(make_remote, monkeypatch):
    """The buffers a consumer keeps to recycle for its copy-outs stay within
    ``OUT_CACHE_BYTES`` in all, whatever sizes come, and go when its connection closes.  Items
    over 32 MiB: glibc maps each buffer on its own, so a freed one leaves the process."""
    cap = 80 * MIB
    monkeypatch.setattr(shm_client, "OUT_CACHE_BYTES", cap, raising=False)
    ch = make_remote("copyouts", shm_threshold=T)
    consumer = Channel.connect("copyouts", identity="c:0")  # a connection of its own
    try:
        assert consumer.qsize() == 0
        gc.collect()
        start = _rss_anon()
        for i in range(6):  # six sizes of 33-38 MiB, each taken, read and dropped
            item = np.full((33 + i) * MIB, i, np.uint8)
            ch.put(item)
            del item
            got = consumer.get(timeout=30)
            assert got.nbytes == (33 + i) * MIB and got[0] == i and got[-1] == i
            del got
            gc.collect()
        kept = _rss_anon() - start
        assert kept <= cap + 40 * MIB, f"{kept / MIB:.0f} MiB kept after every item was dropped"
    finally:
        consumer.close()
    gc.collect()
    assert _rss_anon() - start <= 40 * MIB, "copy-out buffers kept after close"


def test_connect_refuses_a_shm_switch_that_is_not_a_bool(make):
    """``shm=`` is None, True or False: ``"false"`` (truthy), ``0`` or a numpy bool is a
    ``TypeError`` naming it, before anything connects, on every kind of channel."""
    make("shmarg")
    for value in ("false", "no", "0", 0, 1, 2, 0.0, [], np.False_):
        with pytest.raises(TypeError, match=r"^shm must be None, True or False, got "):
            Channel.connect("shmarg", shm=value)
    for value in (None, True, False):
        handle = Channel.connect("shmarg", shm=value)
        handle.close()


def test_a_pickled_handle_keeps_shm_off(make_remote, workers):
    """``shm=False`` travels with a pickled handle: its copies, here and in another process,
    put large arrays as frames too."""
    ch = make_remote("pickshm", shm_threshold=T)
    off = Channel.connect("pickshm", shm=False)
    try:
        here = pickle.loads(pickle.dumps(off))
        here.put(np.full(T, 1, np.uint8))
        worker = workers.start(
            """
            import pickle, sys
            import numpy as np
            handle = pickle.loads(bytes.fromhex(sys.argv[1]))
            handle.put(np.full(65536, 2, np.uint8))
            print("put", flush=True)
            """,
            pickle.dumps(off).hex(),
        )
        workers.wait_line(worker, "put")
        for value in (1, 2):
            assert (ch.get(timeout=10) == value).all()
        assert _shm_stats(ch)["slots_in"] == 0  # every put went as frames
        here.close()
    finally:
        off.close()


def test_a_distributed_handle_keeps_shm_off_on_every_replica(run_dir, monkeypatch, channels):
    """``Channel.connect(name, shm=False)`` of a distributed channel: the handle of each
    replica it reaches keeps shared memory off too (and so does a pickled copy), so large
    arrays go as frames to every replica."""
    monkeypatch.setenv("ZCHANNEL_CLUSTER", write_cluster(run_dir))
    monkeypatch.setenv("ZCHANNEL_NODE", "n0")
    ch = Channel.create("distshm", distributed=True, shm_threshold=T)
    channels.append(ch)
    off = Channel.connect("distshm", shm=False)
    copy = pickle.loads(pickle.dumps(off))
    try:
        keys = [f"k{i}" for i in range(12)]
        assert len({off.replica_of(k) for k in keys}) == 3  # every replica gets some
        for handle in (off, copy):
            for key in keys:
                handle.put(np.full(T, 3, np.uint8), key=key)
        for index in range(3):
            assert off._sub(index)._connection().shm.pool is None
            assert ch._sub(index).stats()["shm"]["slots_in"] == 0  # every put went as frames
        assert all((ch.get(key=k, timeout=10) == 3).all() for k in keys for _ in range(2))
    finally:
        copy.close()
        off.close()
