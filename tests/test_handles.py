"""Handles and connections: one connection per process per broker, shared by every handle and
released with the last; shutdown in order at close, at garbage collection and at interpreter
exit.  Real brokers, real worker processes."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import REPO, wait_until
from zchannel.broker import Channel, ChannelError
from zchannel.broker.connection import sharing
from zchannel.broker.handle import base

pytestmark = pytest.mark.timeout(180)

TESTS = os.path.join(REPO, "tests")


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _run(code: str, *args: str, stdin: str = "", timeout: float = 150, **env: str):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, env=_env(**env),
                          cwd=TESTS)


def _io_threads() -> int:
    return sum(t.name.startswith("zchannel-io") for t in threading.enumerate())


@pytest.fixture
def distributed_env(run_dir, monkeypatch):
    """Three replicas on this host (tests/cluster_util.py), as the ``make`` fixture does."""
    from cluster_util import write_cluster

    monkeypatch.setenv("ZCHANNEL_CLUSTER", write_cluster(run_dir))
    monkeypatch.setenv("ZCHANNEL_NODE", "n0")


# The RLinf pattern: a runner passes its channel into a worker method on every step; the worker
# unpickles the handle, uses it and drops it.
WORKER = """
    import gc, json, os, pickle, sys, threading
    from zchannel.broker import Channel

    blob = bytes.fromhex(sys.stdin.readline().strip())
    calls, keys = int(sys.argv[1]), sys.argv[2].split(",")

    def usage():
        gc.collect()
        return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd"))}

    def step(i):
        handle = pickle.loads(blob)
        for key in keys:
            handle.put(i, key=key)
            assert handle.get(key=key, timeout=30) == i
        return len({handle.replica_of(k) for k in keys}) if hasattr(handle, "replica_of") else 1

    before = usage()
    replicas = step(0)
    first = usage()
    for i in range(1, calls):
        step(i)
    last = usage()
    held = [pickle.loads(blob) for _ in range(50)]  # alive at once: one connection per replica
    for handle in held:
        for key in keys:
            handle.put(0, key=key)
            handle.get(key=key, timeout=30)
    io_threads = sum(t.name.startswith("zchannel-io") for t in threading.enumerate())
    print(json.dumps({"before": before, "first": first, "last": last, "replicas": replicas,
                      "io_threads_with_50_handles": io_threads}))
"""


@pytest.mark.parametrize("kind", ["broker", "distributed"])
def test_a_worker_unpickling_a_handle_on_every_call_holds_flat_threads_and_fds(
        kind, channels, request):
    """1,000 calls, each unpickling the channel handle, using it and dropping it: the worker
    holds exactly as many threads and descriptors after the last call as after the first (and
    as before any: a dropped handle's connection is gone), and 50 live handles share one
    connection (one I/O thread) per replica."""
    distributed = kind == "distributed"
    if distributed:
        request.getfixturevalue("distributed_env")
    ch = Channel.create("steps", distributed=distributed)
    channels.append(ch)
    keys = "a,b,f" if distributed else "a"  # key_hash spreads a, b, f over replicas 0, 1, 2
    proc = _run(WORKER, "1000", keys, stdin=pickle.dumps(ch).hex() + "\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    got = json.loads(proc.stdout)
    assert got["last"] == got["first"], got
    assert got["first"] == got["before"], got
    assert got["io_threads_with_50_handles"] == got["replicas"], got
    assert got["replicas"] == (3 if distributed else 1), got


def test_handles_of_one_process_share_one_connection(make_remote):
    ch = make_remote("share")
    others = [Channel.connect("share") for _ in range(5)]
    unpickled = [pickle.loads(pickle.dumps(ch)) for _ in range(5)]
    for h in others + unpickled:
        h.put(1)
    conns = {id(h._connection()) for h in [ch, *others, *unpickled]}
    assert len(conns) == 1
    conn = ch._connection()
    assert sharing.shares(conn) == 11
    assert ch.stats()["clients"] == 1
    # another identity is another consumer, so another connection
    actor = Channel.connect("share", identity="actor:0")
    assert actor._connection() is not conn
    for h in others + unpickled:
        h.close()
    actor.close()
    assert sharing.shares(conn) == 1 and conn.state == "up"
    assert ch.qsize() == 10


def test_closing_one_handle_withdraws_only_its_own_requests(make_remote):
    """close() on a handle whose connection others keep: its parked get is withdrawn (it
    fails; the broker does not hand it an item later), the connection and the other handles'
    requests stay."""
    ch = make_remote("own")
    a = Channel.connect("own")
    b = Channel.connect("own")
    assert a._connection() is b._connection()
    threads = threading.active_count()
    ga = a.get(key="k", async_op=True)
    gb = b.get(key="k2", async_op=True)
    a.close()
    with pytest.raises(ChannelError, match="closed"):
        ga.wait(timeout=10)
    with pytest.raises(ChannelError, match="closed"):
        a.put("after close")
    ch.put("for nobody", key="k")
    ch.put("for b", key="k2")
    assert gb.wait(timeout=10) == "for b"
    assert ch.qsize("k") == 1, "the closed handle's get did not take the item"
    assert threading.active_count() == threads
    b.close()


def test_close_waits_for_its_own_puts(make_remote):
    ch = make_remote("puts", maxsize=1)
    a = Channel.connect("puts")
    ch.put("full")
    parked = a.put("waits for room", async_op=True)  # parked: the queue is full
    closer = threading.Thread(target=a.close)
    closer.start()
    assert ch.get(timeout=10) == "full"  # room: the parked put goes in, then a's close ends
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert parked.wait(timeout=0) is None
    assert ch.get(timeout=10) == "waits for room"


def test_a_dropped_handle_is_released_after_its_outstanding_work(make_remote):
    """A Work outlives its handle: the connection stays until it completes; then the last
    share goes and the I/O thread is joined."""
    make_remote("drop")
    blob = pickle.dumps(Channel.connect("drop", identity="w:0"))  # a connection of its own
    gc.collect()
    baseline = _io_threads()  # the creator's connection
    work = pickle.loads(blob).get(key="later", async_op=True)  # its handle is dropped at once
    gc.collect()
    assert _io_threads() == baseline + 1
    feeder = pickle.loads(blob)
    feeder.put("late", key="later")
    assert work.wait(timeout=10) == "late"
    del feeder
    gc.collect()
    assert _io_threads() == baseline


def test_a_forked_child_does_not_use_its_parents_connection(make_remote):
    make_remote("fork")
    h = Channel.connect("fork")
    h.put("parent")
    parent_conn = h._connection()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            conn = h._connection()
            ok = conn is not parent_conn and conn.pid == os.getpid()
            h.put("child")
            status = 0 if ok and h.qsize() == 2 else 2
            os.write(write, b"1")
        finally:
            os._exit(status)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert h._connection() is parent_conn and parent_conn.state == "up"
    assert [h.get(timeout=10), h.get(timeout=10)] == ["parent", "child"]


# One exit per forked child of a fresh interpreter (each a real interpreter exit: atexit
# handlers, thread shutdown, finalization), with handles in every state an exit can find them.
EXITS = """
    import gc, os, sys, threading, traceback
    from zchannel.broker import Channel, ChannelError

    address, runs, tmp = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    def child(i):
        variant = i % 5
        if variant == 4:
            os.environ["ZCHANNEL_DIRECT"] = "0"  # ZeroMQ instead of the direct link
        ch = Channel.connect(address)
        assert (not ch._connection().direct) == (variant == 4)
        ch.get(key="never", async_op=True)  # parked at exit
        work = ch.put(i, key="k", async_op=True)  # acknowledged before the exit ends
        if variant == 1:  # a thread blocked in a get while the interpreter exits
            def blocked():
                try:
                    ch.get(key="never")
                except ChannelError:
                    pass
            threading.Thread(target=blocked, daemon=True).start()
        elif variant == 2:  # the handle is gone; its Work is kept
            globals()["kept"] = work
            del ch
        elif variant == 3:
            ch.close()
        else:
            globals()["kept"] = ch

    gc.freeze()  # the children's exits then skip collecting (and copying) the parent's heap
    running = {}
    for i in range(runs):
        while len(running) >= 4:  # a few exits at a time
            pid, status = os.wait()
            print(running.pop(pid), os.waitstatus_to_exitcode(status), flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            fd = os.open(os.path.join(tmp, f"{i}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            os.close(fd)
            try:
                child(i)
            except BaseException:
                traceback.print_exc()
                os._exit(3)
            raise SystemExit(0)  # through the whole interpreter exit
        running[pid] = i
    while running:
        pid, status = os.wait()
        print(running.pop(pid), os.waitstatus_to_exitcode(status), flush=True)
"""


def test_the_exit_path_200_times_without_an_io_thread_error(make_remote, tmp_path):
    """Interpreter exits with live handles (a parked get and an unacknowledged put each, over
    the direct link or ZeroMQ, a thread blocked in get, a dropped handle, a closed one): no
    "I/O thread failed", no traceback, nothing at all on stderr, every put acknowledged."""
    ch = make_remote("exits")
    runs = 200
    proc = _run(EXITS, ch.address, str(runs), str(tmp_path), timeout=170)
    assert proc.returncode == 0, proc.stderr
    codes = dict(line.split() for line in proc.stdout.splitlines())
    assert codes == {str(i): "0" for i in range(runs)}
    for i in range(runs):
        err = (tmp_path / f"{i}.err").read_text()
        assert err == "", f"exit {i} (variant {i % 5}) wrote to stderr:\n{err}"
    # fresh interpreters too, with weakref's exit hook registered before zchannel's (a
    # finalizer made before the import) and after it (the order of the forked children)
    early = "import weakref\nclass Early: pass\nearly = Early()\nweakref.finalize(early, int)\n"
    fresh = [subprocess.Popen(
        [sys.executable, "-c", (early if i % 2 else "") + textwrap.dedent(EXITS).replace(
            "for i in range(runs):", "for i in []:") + f"\nchild({i % 5})\n",
         ch.address, "0", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=TESTS)
        for i in range(6)]
    for i, p in enumerate(fresh):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and err == "", f"fresh exit {i}: {err}"
    assert ch.qsize("k") == runs + len(fresh)
    assert ch.qsize("never") == 0


KILLED = """
    import atexit, sys, time, weakref
    started = []
    # registered before zchannel is imported: runs after zchannel's own exit handler
    atexit.register(lambda: print("exit-s", time.monotonic() - started[0], flush=True))
    # a finalizer made before zchannel is imported (libraries do) puts weakref's exit hook
    # after zchannel's: the order in which a close waiting for the heartbeat expiry showed
    class Early:
        pass
    early = Early()
    weakref.finalize(early, lambda: None)
    from zchannel.broker import Channel

    ch = Channel.connect(sys.argv[1])
    ch.put("x")  # the queue (maxsize 1) is full
    if sys.argv[2] == "pending":
        ch.get(key="never", async_op=True)  # parked
        ch.put("y", async_op=True)  # parked: never acknowledged
    print("linked" if ch._connection().direct else "zmq", flush=True)
    sys.stdin.readline()  # the broker is SIGKILLed meanwhile
    started.append(time.monotonic())
"""


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("pending", ["idle", "pending"])
def test_exit_with_a_killed_broker_is_prompt_and_quiet(direct, pending, channels):
    """A handle outlives its broker (SIGKILL), and the process exits: no wait for the
    heartbeat expiry (3 s), no "silent ... unavailable" message, nothing on stderr."""
    ch = Channel.create("killed", maxsize=1)
    channels.append(ch)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED), ch.address, pending],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(ZCHANNEL_DIRECT=direct), cwd=TESTS)
    try:
        assert proc.stdout.readline().strip() == ("linked" if direct == "1" else "zmq")
        os.kill(ch._proc.pid, signal.SIGKILL)
        ch._proc.wait()
        out, err = proc.communicate("\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert err == ""
    label, seconds = out.split()
    assert label == "exit-s"
    assert float(seconds) < 2.5, f"the exit took {seconds} s"


def test_every_handle_is_a_channel(make):
    """Whatever serves the channel (a broker process, this process, replicas), ``create``,
    ``connect`` and unpickling give a ``Channel``; a one-broker handle is a ``Channel`` itself
    (``broker/handle/channel.py``), and every handle of a channel reaches the same items."""
    ch = make("kinds")
    handles = [ch, Channel.connect("kinds")]
    if not make.local:  # a local channel is not picklable
        handles.append(pickle.loads(pickle.dumps(ch)))
    try:
        for i, h in enumerate(handles):
            assert isinstance(h, Channel), type(h)
            assert h.is_local == make.local
            h.put(i, key="k")
        assert sorted(ch.get(key="k", timeout=10) for _ in handles) == list(range(len(handles)))
        if not make.local and not make.distributed:
            assert {type(h) for h in handles} == {Channel}
    finally:
        for h in handles[1:]:
            h.close()


@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct-link", "zeromq"])
def test_a_broker_started_again_at_its_address_gets_a_new_connection(direct, monkeypatch,
                                                                      channels):
    """``Channel.create`` at once after the channel's broker was SIGKILLed: the process's
    connection to the dead broker has not noticed yet (over ZeroMQ it cannot before the
    heartbeat expiry), and the new broker does not know it.  The new handle does not share it:
    it puts and gets through a connection of its own, which ``connect`` by name shares; the old
    handle's connection registers with the new broker by itself and serves again."""
    monkeypatch.setenv("ZCHANNEL_DIRECT", direct)
    old = Channel.create("again")
    channels.append(old)
    old.put("before")  # this process's connection to the first broker is up
    conn = old._conn
    assert conn is not None and conn.direct == (direct == "1")
    os.kill(old._proc.pid, signal.SIGKILL)
    old._proc.wait()
    new = Channel.create("again")
    channels.append(new)
    new.put("after")
    assert new.get(timeout=10) == "after"
    assert new._conn is not conn and new._conn.broker_info.pid == new._proc.pid
    by_name = Channel.connect("again")
    assert by_name._connection() is new._conn
    by_name.close()
    assert wait_until(lambda: conn.state == "up" and conn.broker_info.pid == new._proc.pid,
                      timeout=30)
    old.put("through the old handle", timeout=10)
    assert new.get(timeout=10) == "through the old handle"
    new.shutdown()


@pytest.mark.parametrize("how", ["close then shutdown", "close in a with block"])
def test_shutdown_after_close_stops_the_broker_without_waiting_it_out(run_dir, monkeypatch, how):
    """The creating handle closed, then ``shutdown()`` (or the ``with`` block's end): no
    connection is left to ask on, so the broker is sent SIGTERM at once and exits cleanly;
    it is not waited for ten seconds, then stopped as one that did not answer."""
    forced = []
    monkeypatch.setattr(base, "stop_broker", lambda proc, *a: forced.append(proc.pid))
    if how == "close in a with block":
        with Channel.create("closedfirst") as ch:
            ch.put("x")
            proc = ch._proc
            ch.close()
    else:
        ch = Channel.create("closedfirst")
        proc = ch._proc
        ch.close()
        ch.shutdown()
    assert forced == [] and proc.poll() == 0
    assert not os.path.exists(os.path.join(run_dir, "closedfirst.sock"))


def test_a_local_channel_shut_down_from_a_done_callback_returns(channels):
    """``shutdown()`` of a local channel from a done-callback (it runs in the thread that
    completed the get, holding the channel's lock) returns: it does not wait for the timer
    thread, which needs that lock to end."""
    ch = Channel.create("local-callback-shutdown", local=True)
    work = ch.get(async_op=True)
    returned = threading.Event()

    def shut(_work) -> None:
        ch.shutdown()
        returned.set()

    def put() -> None:
        with contextlib.suppress(ChannelError):  # the callback shut the channel down under it
            ch.put(1)

    work.add_done_callback(shut)
    putter = threading.Thread(target=put, daemon=True)
    putter.start()
    assert returned.wait(30)
    putter.join(30)
    assert not putter.is_alive() and work.wait(10) == 1
