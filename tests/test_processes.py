"""Broker lifetime and multi-process behaviour: real brokers, real worker processes."""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import msgpack
import pytest
import zmq
from conftest import exited, pid_alive, until_available, wait_until
from zchannel.broker import BrokerUnavailable, Channel, ChannelNotFound
from zchannel.broker.host import paths
from zchannel.broker.shm import prefix_for as shm_prefix_for
from zchannel.broker.wire import codec
from zchannel.broker.wire.protocol import INLINE_BODY, PROTOCOL_VERSION, pack_header

pytestmark = pytest.mark.timeout(90)


def test_connect_to_nothing_is_quick():
    """Nothing to connect to is found out at once (no name, no socket file, refused), not by
    waiting for the connect timeout: the error names that cause, not the timeout."""
    for target, cause in (("nothing-here", "no channel named"),
                          ("ipc:///tmp/zchannel-no-such.sock", "no socket file"),
                          ("tcp://127.0.0.1:9", "connection refused")):
        with pytest.raises(ChannelNotFound, match=cause):
            Channel.connect(target, timeout=600)  # waiting for it would hit pytest's limit


def test_create_twice_gives_one_broker(channels):
    a = Channel.create("twice", maxsize=3)
    channels.append(a)
    b = Channel.create("twice", maxsize=5)  # connects; the running broker's settings win
    channels.append(b)
    assert a.stats()["pid"] == b.stats()["pid"]
    assert b.stats()["maxsize"] == 3
    with pytest.raises(PermissionError):
        b.shutdown()
    b.put("from b")
    assert a.get(timeout=5) == "from b"
    pid = a.stats()["pid"]
    a.shutdown()
    a.shutdown()  # the handle that stopped its broker: again, nothing (as close())
    # stopped by the first call (and reaped: by this process, or by the fork server that
    # forked it, which may reap it a moment after shutdown() saw it exit)
    assert not pid_alive(pid)
    with pytest.raises(PermissionError):
        b.shutdown()  # still not this handle's to stop


def test_create_from_two_processes_at_once(workers, channels):
    code = """
        import sys
        from zchannel.broker import Channel
        ch = Channel.create("race")
        print(ch.stats()["pid"], flush=True)
        sys.stdin.readline()
    """
    procs = [workers.start(code) for _ in range(2)]
    pids = [workers.wait_line(p) for p in procs]
    assert pids[0] == pids[1]
    for p in procs:
        workers.send(p)


def test_producer_and_consumer_processes_over_tcp(workers, channels):
    ch = Channel.create("tcpchan", address="tcp://127.0.0.1:0")
    channels.append(ch)
    assert ch.address.startswith("tcp://127.0.0.1:") and not ch.address.endswith(":0")
    producer = workers.start(
        """
        import sys, torch
        from zchannel.broker import Channel
        ch = Channel.connect(sys.argv[1])
        for i in range(200):
            ch.put({"i": i, "t": torch.full((1000,), float(i))}, key="work", async_op=(i % 2 == 0))
        ch.close()
        print("done", flush=True)
        """,
        ch.address,
    )
    consumer = workers.start(
        """
        import sys
        from zchannel.broker import Channel
        ch = Channel.connect(sys.argv[1])
        total = 0
        for i in range(200):
            item = ch.get(key="work", timeout=30)
            assert item["i"] == i and float(item["t"][0]) == i, (i, item["i"])
            total += int(item["t"].sum())
        print(total, flush=True)
        """,
        ch.address,
    )
    assert workers.finish(producer).strip() == "done"
    assert int(workers.finish(consumer).strip()) == sum(i * 1000 for i in range(200))
    # connect(name) also finds a tcp broker on this host through the .addr file
    again = Channel.connect("tcpchan")
    channels.append(again)
    assert again.address == ch.address


def test_sigkill_broker_while_get_waits(channels):
    ch = Channel.create("killme")
    channels.append(ch)
    pid = ch.stats()["pid"]
    work = ch.get(async_op=True)
    os.kill(pid, signal.SIGKILL)
    # found out after a few heartbeat intervals, never a hang: BrokerUnavailable, not the
    # TimeoutError of the wait
    with pytest.raises(BrokerUnavailable):
        work.wait(timeout=60)
    with pytest.raises(BrokerUnavailable):
        ch.put("while down")


def test_a_killed_broker_is_reaped_and_its_death_logged_by_its_creator(channels, caplog):
    """The process that created a channel without a journal reaps its broker when it dies
    (no zombie until ``shutdown``) and logs the exit status and what it means."""
    ch = Channel.create("reaped")
    channels.append(ch)
    pid = ch.stats()["pid"]
    with caplog.at_level(logging.WARNING, logger="zchannel.client"):
        os.kill(pid, signal.SIGKILL)
        # a zombie keeps its /proc entry until its parent reaps it
        assert wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout=60), \
            "the creator left its killed broker a zombie"
        assert wait_until(lambda: "reaped" in caplog.text, timeout=60)
    assert f"(pid {pid}) exited with status -9: the items it held are lost" in caplog.text
    ch.shutdown()  # nothing left to stop: returns at once, no error
    assert "zchannel-keeper-reaped" not in [t.name for t in threading.enumerate()]


def test_shutdown_leaves_no_thread_watching_the_broker(channels):
    """The creator watches its broker from a thread (reaping it if it dies); ``shutdown``
    returns only once that watch ended."""
    ch = Channel.create("watched")
    channels.append(ch)
    assert "zchannel-keeper-watched" in [t.name for t in threading.enumerate()]
    ch.put(b"x")
    ch.shutdown()
    assert "zchannel-keeper-watched" not in [t.name for t in threading.enumerate()]


def _create_and_shutdown(name: str, kill: bool) -> None:
    ch = Channel.create(name)
    ch.put(b"x")
    if kill:
        pid = ch.stats()["pid"]
        os.kill(pid, signal.SIGKILL)
        assert exited(pid)
    ch.shutdown()


@pytest.mark.parametrize("kill", [False, True], ids=["shut-down", "killed"])
def test_a_shut_down_channel_leaves_no_descriptor_without_the_garbage_collector(kill):
    """The thread that watches a broker refers to its handle weakly, and ``shutdown`` lets go
    of it: with the cyclic garbage collector off (as some training loops run), channels
    created and shut down -- their brokers SIGKILLed first, or not -- hold no descriptor."""
    _create_and_shutdown(f"fds-warm-{kill}", kill)  # process-wide parts made once
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = len(os.listdir("/proc/self/fd"))
        for i in range(4):
            _create_and_shutdown(f"fds-{kill}-{i}", kill)
        # a link the broker's death left reconnecting is closed by its I/O thread, just after
        settled = wait_until(lambda: len(os.listdir("/proc/self/fd")) <= before, timeout=30)
    finally:
        if enabled:
            gc.enable()
    assert settled, f"{len(os.listdir('/proc/self/fd'))} descriptors open, {before} before"


def test_broker_dies_with_its_creator(workers):
    creator = workers.start(
        """
        from zchannel.broker import Channel
        ch = Channel.create("orphan")
        print(ch.stats()["pid"], flush=True)
        import sys
        sys.stdin.readline()  # blocks until this test SIGKILLs it (its stdin stays open)
        """
    )
    broker_pid = int(workers.wait_line(creator))
    assert pid_alive(broker_pid)
    os.kill(creator.pid, signal.SIGKILL)
    creator.wait()
    assert exited(broker_pid, 10), "the broker outlived its SIGKILLed creator"


_BLOCKED_STARTS = {  # case -> (forked by the session's fork server, GatedStart's options)
    "spawned": (False, {}),
    "forked": (True, {}),
    "swallows-the-interruption": (True, {"swallow": True}),
    "keeps-a-thread": (False, {"thread": True}),
    "ignores-sigint": (False, {"ignore_sigint": True}),
    "blocked-in-import": (False, None),  # tests/gatedimport.py, given as an instance
}


@pytest.mark.parametrize("case", list(_BLOCKED_STARTS))
def test_a_broker_whose_start_blocks_stops_when_its_creator_dies(workers, tmp_path, case):
    """A start that never ends (a collector's ``setup`` or its module's import waiting at a
    FIFO no one writes) does not keep a broker alive once its creator is gone: the start is
    interrupted, and its lock file, run-directory files and shared memory are given back — also
    when the setup swallows the interruption (the start then completes) or leaves a thread
    running; a start that ignores SIGINT ends with its process."""
    gate, starts = tmp_path / "gate", tmp_path / "starts"
    os.mkfifo(gate)
    starts.mkdir()
    forked, options = _BLOCKED_STARTS[case]
    env = {"GATED_IMPORT_GATE": str(gate), "GATED_IMPORT_DIR": str(starts)}
    if not forked:
        env["ZCHANNEL_BROKER_FORKSERVER"] = ""
    if options is None:  # an instance: its module is imported before the broker is made
        hook = "collector=__import__('gatedimport').PassThrough()"
    else:
        hook = f"collector='hookmods:GatedStart', options={dict(options, gate=str(gate), dir=str(starts))!r}"
    creator = workers.start(
        f"""
        import os
        os.environ["GATED_IMPORT_CREATOR"] = str(os.getpid())
        from zchannel.broker import Channel
        Channel.create("blocked-start", {hook})
        """, env=env)
    assert wait_until(lambda: os.listdir(starts), timeout=60), "the broker's start never began"
    broker_pid = int(os.listdir(starts)[0].split("-")[1])
    assert pid_alive(broker_pid)
    run_dir = os.environ["ZCHANNEL_RUN_DIR"]
    assert os.path.exists(os.path.join(run_dir, "blocked-start.lock"))
    os.kill(creator.pid, signal.SIGKILL)
    creator.wait()
    assert exited(broker_pid, 30), "a broker blocked in its start outlived its creator"
    if case == "ignores-sigint":
        return  # it exited without giving back its files (the run dir's teardown does)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(
        shm_prefix_for("blocked-start", run_dir))], "the interrupted start left its segments"
    assert not [n for n in os.listdir(run_dir) if n.startswith("blocked-start")], os.listdir(run_dir)


@pytest.mark.parametrize("watched", ["handed-on", "not-handed-on", "stdout-gone"])
def test_a_creator_that_exits_between_start_and_loop_stops_the_broker_cleanly(tmp_path, watched):
    """The creator exits after the broker was made and before its loop watches it: with the
    start's pidfd handed on, the loop sees the exit and stops; without it, the start of the loop
    fails; with the creator's end of stdout gone too, "ready" cannot be written; each way the
    broker's files are given back (each case its own channel name: the cases may run at once,
    and /dev/shm is shared)."""
    script = textwrap.dedent(
        f"""
        import os, subprocess, sys
        from zchannel.broker.server.loop import Broker, BrokerConfig
        creator = subprocess.Popen(["sleep", "60"])
        broker = Broker(BrokerConfig(name="gap-{watched}", parent_pid=creator.pid))
        if {watched != "not-handed-on"}:
            broker.parent_fd = os.pidfd_open(creator.pid)
        out = os.fdopen(os.dup(1), "w")
        if {watched == "stdout-gone"}:  # the creator's end of the pipe closed with it
            read_end, write_end = os.pipe()
            os.dup2(write_end, 1)
            os.close(read_end)
        creator.kill()
        creator.wait()  # gone, and reaped, before the loop watches it
        try:
            broker.serve_forever()
            outcome = f"stopped {{broker.exit_code}}"
        except BaseException as exc:
            outcome = f"raised {{type(exc).__name__}}"
        run_dir = os.environ["ZCHANNEL_RUN_DIR"]
        print(outcome, file=out)
        print("left", sorted(os.listdir(run_dir)),
              [n for n in os.listdir("/dev/shm") if "+gap-{watched}+" in n], file=out, flush=True)
        os._exit(0)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    *_, outcome, left = done.stdout.splitlines()  # (after "ready ADDRESS" when it served)
    assert outcome == {"handed-on": "stopped 0", "not-handed-on": "raised SystemExit",
                       "stdout-gone": "raised BrokenPipeError"}[watched]
    assert left == "left [] []"


def test_a_broker_whose_creator_is_gone_before_its_start_exits_and_leaves_nothing(run_dir):
    """The creator exits (and is reaped) before the broker's start watches it: the start is
    interrupted at its beginning, the channel lock it was handed is given back."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock_fd = paths.try_lock("gone-creator")
    try:
        body, _ = codec.encode({"name": "gone-creator", "parent_pid": dead.pid,
                                "lock_fd": lock_fd})
        done = subprocess.run([sys.executable, "-m", "zchannel.broker"], input=body,
                              pass_fds=(lock_fd,), capture_output=True, timeout=120)
    finally:
        os.close(lock_fd)
    assert done.returncode == 1, done.stderr.decode()[-2000:]
    assert b"Traceback" not in done.stderr, done.stderr.decode()[-2000:]
    assert b"exited while the broker was starting" in done.stderr
    assert os.listdir(run_dir) == []


def _consume_pickled(channel, queue):
    queue.put(channel.get(timeout=30))
    channel.close()


def test_pickled_handle_in_spawned_process(channels):
    ch = Channel.create("pickled")
    channels.append(ch)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_consume_pickled, args=(ch, results))
    proc.start()
    try:
        ch.put("across processes")
        assert results.get(timeout=60) == "across processes"
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
    assert proc.exitcode == 0


@contextlib.contextmanager
def _raw_dealer(ch: Channel, hello: bool = True) -> Iterator[zmq.Socket]:
    """A bare DEALER on ``ch``'s broker (registered with a hello unless ``hello=False``)."""
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(ch.address)
    try:
        if hello:
            raw.send_multipart([pack_header([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION}])])
            raw.recv_multipart()
        yield raw
    finally:
        raw.close()


def test_malformed_messages_do_not_hurt_the_broker(channels):
    ch = Channel.create("hostile")
    channels.append(ch)
    with _raw_dealer(ch, hello=False) as raw:
        bad = [
            [b"not msgpack \xff\xff"],
            [pack_header([{"op": "hello", "id": 1, "v": PROTOCOL_VERSION}])],
            [pack_header([{"op": "put", "id": 2, "k": "x", "nf": 3}]), b"only one frame"],
            [pack_header([{"op": "put", "id": 3, "k": [[[]]], "nf": 1}]), b"\xc1"],
            [pack_header([{"op": "put", "id": 4, "k": "x", "w": -3, "nf": 1}]), b"\x01"],
            [pack_header([{"op": "get", "id": "five"}])],
            [pack_header([{"op": "nonsense", "id": 6}])],
            [pack_header([{"op": "get_batch", "id": 7, "tw": "lots"}])],
            [pack_header("not a list")],
        ]
        for message in bad:
            raw.send_multipart(message)
        # the records with an id got error replies; the broker is still serving everybody
        replies = []
        while raw.poll(2000):
            replies.append(raw.recv_multipart())
        assert len(replies) >= 2
        ch.put("still fine")
        assert ch.get(timeout=5) == "still fine"


def test_undecodable_item_is_value_error_and_handle_survives(channels):
    ch = Channel.create("undecodable")
    channels.append(ch)
    with _raw_dealer(ch) as raw:
        # an ndarray ext with an object dtype: must never be unpickled
        evil = msgpack.packb(msgpack.ExtType(2, msgpack.packb(["|O", [1], b"\x80\x04"])))
        raw.send_multipart([pack_header([{"op": "put", "id": 2, "k": "default_queue", "nf": 1}]), evil])
        raw.recv_multipart()
    with pytest.raises(ValueError):
        ch.get(timeout=5)
    ch.put("next")
    assert ch.get(timeout=5) == "next"


def test_inline_bodies_are_checked_and_small_items_travel_inline(channels):
    ch = Channel.create("inline")
    channels.append(ch)
    with _raw_dealer(ch) as raw:
        body = codec.encode(b"y" * 64)[0]
        bad = [
            [pack_header([{"op": "put", "id": 2, "k": "x", "b": "a str", "nf": 0}])],
            [pack_header([{"op": "put", "id": 3, "k": "x", "b": b"\xc4" * (INLINE_BODY + 1),
                           "nf": 0}])],
            [pack_header([{"op": "put", "id": 4, "k": "x", "b": body, "nf": 1}]), body],
        ]
        for message in bad:
            raw.send_multipart(message)
            (header,) = raw.recv_multipart()
            (rec,) = msgpack.unpackb(header)
            assert rec["e"][0] == "ValueError", rec  # refused, nothing enqueued
        assert ch.qsize("x") == 0
        # a good inline put, and its get: the reply carries the body in its record, no frame
        raw.send_multipart([pack_header([{"op": "put", "id": 5, "k": "x", "b": body, "nf": 0}])])
        assert msgpack.unpackb(raw.recv_multipart()[0]) == [{"id": 5}]
        raw.send_multipart([pack_header([{"op": "get", "id": 6, "k": "x"}])])
        reply = raw.recv_multipart()
        (rec,) = msgpack.unpackb(reply[0])
        assert len(reply) == 1 and rec["b"] == body and codec.decode(rec["b"]) == b"y" * 64
    big = b"z" * (2 * INLINE_BODY)  # above the inline size: frames, as before
    ch.put(big, key="y")
    ch.put(b"small", key="y")
    assert ch.get(key="y", timeout=5) == big and ch.get(key="y", timeout=5) == b"small"
    # a burst of inline items larger than one message's inline budget: split, none lost
    items = [bytes([i % 256]) * (INLINE_BODY - 16) for i in range(400)]
    works = [ch.put(v, key="burst", async_op=True) for v in items]
    for w in works:
        w.wait(10)
    assert [ch.get(key="burst", timeout=5) for _ in items] == items


def test_consumer_killed_while_parked_loses_nothing(workers, channels):
    ch = Channel.create("parked")
    channels.append(ch)
    consumer = workers.start(
        """
        import sys
        from zchannel.broker import Channel
        ch = Channel.connect(sys.argv[1])
        work = ch.get(key="k", async_op=True)
        ch.qsize("k")  # the get is registered once this answers
        print("parked", flush=True)
        work.wait()
        """,
        ch.address,
    )
    workers.wait_line(consumer, "parked")
    os.kill(consumer.pid, signal.SIGKILL)
    consumer.wait()
    # the broker expires the dead client after its heartbeats stop
    wait_until(lambda: not ch.stats()["keys"].get("k", {}).get("getters", 0), 10)
    ch.put("for a live consumer", key="k")
    assert ch.get(key="k", timeout=5) == "for a live consumer"


def test_cli_broker_and_stat(run_dir, tmp_path):
    env = dict(os.environ)
    proc = subprocess.Popen(
        [sys.executable, "-m", "zchannel.cli.main", "broker", "clichan", "--maxsize", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("ready ipc://"), line
        ch = Channel.connect("clichan")
        ch.put(b"x", key="a", weight=2)
        ch.put(b"y", key=("t", 1))
        ch.put(b"z", key=b"\x01")
        out = subprocess.run(
            [sys.executable, "-m", "zchannel.cli.main", "stat", "clichan"],
            capture_output=True, text=True, timeout=60, env=env,
        )
        assert out.returncode == 0, out.stderr
        assert "clichan" in out.stdout and "a" in out.stdout
        js = subprocess.run(
            [sys.executable, "-m", "zchannel.cli.main", "stat", "clichan", "--json"],
            capture_output=True, text=True, timeout=60, env=env,
        )
        import json

        data = json.loads(js.stdout)
        assert data["keys"]["a"]["depth"] == 1 and data["keys"]["a"]["weight"] == 2
        assert data["keys"]["('t', 1)"]["depth"] == 1 and data["keys"]["b'\\x01'"]["depth"] == 1
        assert data["maxsize"] == 4
        ch.close()
        # a second broker for the same name refuses to start
        second = subprocess.run(
            [sys.executable, "-m", "zchannel.cli.main", "broker", "clichan"],
            capture_output=True, text=True, timeout=60, env=env,
        )
        assert second.returncode != 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0
    assert not os.path.exists(os.path.join(run_dir, "clichan.addr"))  # removed on a clean stop


def test_cli_refuses_public_bind_without_curve():
    out = subprocess.run(
        [sys.executable, "-m", "zchannel.cli.main", "broker", "pub", "--address", "tcp://0.0.0.0:0"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert "insecure" in out.stderr
    with pytest.raises(ValueError):
        Channel.create("pub", address="tcp://0.0.0.0:0")


def test_broker_restart_reconnects_handles(run_dir):
    env = dict(os.environ)
    address = f"ipc://{run_dir}/restart.sock"

    def start():
        proc = subprocess.Popen(
            [sys.executable, "-m", "zchannel.cli.main", "broker", "restart", "--address", address],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        assert proc.stdout.readline().startswith("ready ")
        return proc

    first = start()
    second = None
    try:
        ch = Channel.connect(address)
        ch.put(1)
        assert ch.get(timeout=5) == 1
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        # the I/O thread may have seen the link break already (the get raises at once) or
        # not yet (its Work fails): BrokerUnavailable either way
        with pytest.raises(BrokerUnavailable):
            ch.get(async_op=True).wait(timeout=15)
        second = start()
        # calls while the handle reconnects raise BrokerUnavailable, later ones work
        until_available(ch, lambda: ch.put(2, timeout=5))
        assert ch.get(timeout=5) == 2
        ch.close()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
