"""Crash tests of durable channels: a journaled broker SIGKILLed at random moments under load.

Two producer processes put as fast as the keys' ``maxsize`` lets them (blocking puts, retried
after ``BrokerUnavailable`` or a timeout) and two consumer processes take, one with plain
``get``, one with ``get(ack=True)`` + ``ack``, while the broker is killed at a random moment of
the stream (after a random number of puts, gets or acks) and started again on its journal
(``tests/forkbroker.py``: a fork, back in tens of milliseconds).  Afterwards:

- every acknowledged put was delivered (at least once, to one of the consumers);
- no item whose ``ack`` succeeded was delivered again to a get asked after the ack returned,
  also for puts the producer retried after ``BrokerUnavailable`` (an answer that never came):
  the journal keeps each put's producer and sequence, so a retry reaching the restarted broker
  is acknowledged, not stored twice (retry-safe puts across a restart).  Only a put retried
  after a ``TimeoutError`` is exempt: that is a new put by the documented rule.

``test_power_loss_with_fsync_always`` does the same with ``fsync="always"`` on an ext4 file
system on a loop device, and at each kill copies the loop device's backing file: the copy holds
what had reached the "disk" (synced or written back), not what only sat in the page cache of
the file system on top — a power loss.  A broker started on the copy must hold every
acknowledged put that had not been taken, and none that was acknowledged.

The default run kills the broker 20 times, ``pytest -m slow`` 50 times, ``pytest -m soak``
``ZCHANNEL_CRASH_KILLS`` times (default 300), with more power losses.
"""

from __future__ import annotations

import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter

import pytest
from forkbroker import ForkBroker, wait_gone
from zchannel.broker import Channel

MAXSIZE = 32  # items per key: the producers' puts block until the consumers make room

PRODUCER = r"""
import os, random, sys, time
import numpy as np
from zchannel.broker import BrokerUnavailable, Channel

def await_broker(ch):  # the broker answered the connection's hello again (a new connection
    conn = ch._conn    # replacing an ended one waits for it at the next call)
    if conn is not None and conn.state != "closed":
        conn.wait_up(60)

address, p, stop, seed = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
rng = random.Random(seed)
ch = Channel.connect(address, timeout=60)
print("ready", flush=True)
seq = 0
while not os.path.exists(stop):
    ident = p * 10**9 + seq
    if rng.random() < 0.01:  # through shared memory: the journal writes the slot's bytes
        data = np.full(2 << 20, ident % 251, dtype=np.uint8)
    else:
        data = rng.randbytes(rng.randrange(16, 600))
    while True:
        try:
            ch.put({"id": ident, "data": data}, key=f"k{p}", timeout=5)
            break
        except BrokerUnavailable:  # in doubt: it may be stored already; the retry is safe
            print(f"R {ident}", flush=True)
            await_broker(ch)
        except TimeoutError:  # not in doubt (no room came within 5 s): putting it again is a new put
            print(f"T {ident}", flush=True)
    print(f"P {ident} {time.monotonic_ns()}", flush=True)
    seq += 1  # the next put blocks while the key holds MAXSIZE items: paced by the consumers
print("done", flush=True)
"""

CONSUMER = r"""
import os, sys, time
import numpy as np
from zchannel.broker import BrokerUnavailable, Channel

def await_broker(ch):  # as in the producer
    conn = ch._conn
    if conn is not None and conn.state != "closed":
        conn.wait_up(60)

address, mode, stop = sys.argv[1], sys.argv[2], sys.argv[3]
ch = Channel.connect(address, timeout=60)
print("ready", flush=True)
idle_since = None
n = 0
while True:
    key = f"k{n % 2}"
    n += 1
    asked = time.monotonic_ns()  # a delivery is known to follow an ack only if asked after it
    try:
        got = ch.get(key=key, timeout=0.05, ack=mode == "ack")
    except TimeoutError:
        if os.path.exists(stop):
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 3:
                break
        continue
    except BrokerUnavailable:
        await_broker(ch)
        continue
    idle_since = None
    item = got.item if mode == "ack" else got
    data = item["data"]
    if isinstance(data, np.ndarray):
        assert data.size == 2 << 20 and (data == item["id"] % 251).all(), "corrupt array"
    print(f"{'L' if mode == 'ack' else 'G'} {item['id']} {asked} {time.monotonic_ns()}", flush=True)
    if mode == "ack":
        try:
            ch.ack(got)
        except (BrokerUnavailable, ValueError):
            print(f"F {item['id']}", flush=True)
            continue
        print(f"A {item['id']} {time.monotonic_ns()}", flush=True)
print("done", flush=True)
"""


class Worker:
    """A worker script in a subprocess; its stdout lines are collected (and counted by tag) by
    a thread, which notifies ``lines_changed`` at each."""

    def __init__(self, script: str, *args: str, lines_changed: threading.Condition) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self.counts: Counter[str] = Counter()  # lines by their first word
        self.ready = threading.Event()
        self.lines_changed = lines_changed
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.strip()
            if line == "ready":
                self.ready.set()
            with self.lines_changed:
                self.lines.append(line)
                self.counts[line.split(" ", 1)[0]] += 1
                self.lines_changed.notify_all()

    def count(self, tag: str) -> int:
        """Lines printed so far whose first word is ``tag`` (``"P "`` or ``"P"``)."""
        return self.counts[tag.strip()]

    def stop(self, timeout: float = 120) -> None:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._thread.join(10)


def _records(workers: list[Worker]) -> dict[str, list[tuple[int, ...]]]:
    """The workers' lines by tag: (id, time) — deliveries (G, L): (id, asked, received)."""
    out: dict[str, list[tuple[int, ...]]] = {t: [] for t in "PGLAFRT"}
    for w in workers:
        for line in w.lines:
            parts = line.split()
            if parts and parts[0] in out:
                out[parts[0]].append(tuple(int(p) for p in parts[1:]) + (0,) * (2 - len(parts[1:])))
    return out


def _stored_twice(records: dict, kills: list[tuple[int, int]]) -> list[int]:
    """Items two deliveries of one broker (no kill between the first get asked and the last
    reply received) handed out: a broker hands an item out twice only if it stored it twice
    (or its lease was given back: an ack that failed, ``F``, is left out)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for tag in "GL":
        for ident, asked, received in records[tag]:
            spans.setdefault(ident, []).append((asked, received))
    failed = {i for i, _ in records["F"]}
    twice = []
    for ident, got in spans.items():
        if len(got) < 2 or ident in failed:
            continue
        got.sort()
        for (a1, r1), (_, r2) in zip(got, got[1:], strict=False):
            lo, hi = a1, max(r1, r2)
            if not any(before <= hi and after >= lo for before, after in kills):
                twice.append(ident)
                break
    return twice


def _check(records: dict, extra_delivered: set[int] = frozenset()) -> None:
    """Every acknowledged put delivered; nothing delivered again after its ack succeeded: no
    get asked after an ``ack`` returned got that item (a delivery's time is when its get was
    asked: a reply a dying broker sent may be read by a descheduled consumer long after)."""
    delivered: dict[int, list[int]] = {}
    for tag in "GL":
        for ident, t, _ in records[tag]:
            delivered.setdefault(ident, []).append(t)
    lost = {i for i, _ in records["P"]} - set(delivered) - set(extra_delivered)
    assert not lost, f"{len(lost)} acknowledged puts were never delivered: {sorted(lost)[:10]}"
    # a put retried after BrokerUnavailable is stored once (its copies would be two items);
    # one put again after a TimeoutError is a new put
    new_puts = {i for i, _ in records["T"]}
    again = [(i, t) for i, t in records["A"]
             if i not in new_puts and any(d > t for d in delivered.get(i, ()))]
    assert not again, f"acknowledged items delivered again after their ack: {again[:10]}"


def _start_workers(address: str, stop: str) -> list[Worker]:
    changed = threading.Condition()
    workers = [Worker(PRODUCER, address, str(p), stop, str(p + 7), lines_changed=changed)
               for p in range(2)]
    workers += [Worker(CONSUMER, address, mode, stop, lines_changed=changed)
                for mode in ("plain", "ack")]
    for w in workers:
        assert w.ready.wait(120), "a worker did not start"
    return workers


def _wait_progress(producers: list[Worker], before: int, timeout: float = 60) -> None:
    with producers[0].lines_changed:
        assert producers[0].lines_changed.wait_for(
            lambda: sum(w.count("P ") for w in producers) >= before + 5, timeout
        ), "no put was acknowledged after the restart"


def _random_moment(workers: list[Worker], rng: random.Random, most: int,
                   timeout: float = 60) -> None:
    """Wait for a random moment of the stream: 1 to ``most`` further events of one kind drawn
    at random (puts acknowledged, plain gets, leased gets, acks), counted as the workers print
    them."""
    tag, group = rng.choice([("P", workers[:2]), ("G", workers[2:3]), ("L", workers[3:]),
                             ("A", workers[3:])])
    target = sum(w.count(tag) for w in group) + rng.randint(1, most)
    with group[0].lines_changed:
        assert group[0].lines_changed.wait_for(
            lambda: sum(w.count(tag) for w in group) >= target, timeout
        ), f"the workers stopped at {sum(w.count(tag) for w in group)} {tag} lines"


def _crash_run(run_dir: str, tmp_path, brokers: ForkBroker, kills: int) -> None:
    name = f"crash-{uuid.uuid4().hex[:6]}"
    address = f"ipc://{run_dir}/{name}.sock"
    config = dict(name=name, address=address, journal=str(tmp_path / "journal"),
                  fsync="interval", journal_segment_bytes=1 << 20, maxsize=MAXSIZE)
    stop = str(tmp_path / "stop")
    workers: list[Worker] = []
    try:
        pid = brokers.start(**config)
        workers = _start_workers(address, stop)
        rng = random.Random(kills)
        killed: list[tuple[int, int]] = []  # (before the kill, after it) in monotonic ns
        for _ in range(kills):
            before = sum(w.count("P ") for w in workers[:2])
            _wait_progress(workers[:2], before)
            _random_moment(workers, rng, 60)  # the moment of the stream to kill at
            start = time.monotonic_ns()
            brokers.kill(pid)
            killed.append((start, time.monotonic_ns()))
            pid = brokers.start(**config)
        open(stop, "w").close()
        for w in workers:
            w.stop()
        records = _records(workers)
        assert len(records["P"]) > kills * 5
        assert records["A"] and records["G"], "both consumers took items"
        _check(records)
        assert records["R"], "no put was retried after BrokerUnavailable"
        twice = _stored_twice(records, killed)
        assert not twice, f"items stored twice (retried: {sorted(set(twice) & {i for i, _ in records['R']})[:10]}): {twice[:10]}"
        stats = Channel.connect(address).stats()
        assert stats["journal"]["items"] == 0 and stats["bytes_held"] == 0, stats
        # the journal's disk use is back to about one segment once everything was taken
        assert stats["journal"]["segments"] <= 3, stats["journal"]
    finally:
        open(stop, "w").close()
        _kill_workers(workers)


def _kill_workers(workers: list[Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


@pytest.mark.timeout(600)
def test_sigkill_under_load_20_times(run_dir, tmp_path, brokers):
    _crash_run(run_dir, tmp_path, brokers, kills=20)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_under_load_50_times(run_dir, tmp_path, brokers):
    _crash_run(run_dir, tmp_path, brokers, kills=50)


@pytest.mark.soak
@pytest.mark.timeout(7200)
def test_sigkill_under_load_long(run_dir, tmp_path, brokers):
    _crash_run(run_dir, tmp_path, brokers,
               kills=int(os.environ.get("ZCHANNEL_CRASH_KILLS", "300")))


# -- power loss ------------------------------------------------------------------------------


def _mount_loop(image: str, where: str) -> None:
    os.makedirs(where, exist_ok=True)
    subprocess.run(["mount", "-o", "loop", image, where], check=True, capture_output=True)


def _umount(where: str) -> None:
    if subprocess.run(["umount", where], check=False, capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", where], check=False, capture_output=True)


@pytest.fixture
def ext4(tmp_path):
    """An ext4 file system on a loop device backed by a file: (image, mount point)."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 to mount a loop device")
    image, mnt = str(tmp_path / "disk.img"), str(tmp_path / "disk")
    with open(image, "wb") as f:
        f.truncate(96 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", image], check=True, capture_output=True)
    try:
        _mount_loop(image, mnt)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot mount a loop device here: {exc.stderr!r}")
    yield image, mnt
    _umount(mnt)


def _drain(address: str) -> set[int]:
    """Every item a recovered broker holds on k0 and k1: as many as its ``qsize`` says, each
    with a generous deadline (a loaded machine), then any straggler ``qsize`` did not count
    until ``get_nowait`` finds the key empty.  Nothing is put to this broker and the items
    leased before the crash are queued again at recovery, so nothing can arrive later: there
    is no deadline to wait out."""
    ch = Channel.connect(address, timeout=30)
    got: set[int] = set()
    try:
        for key in ("k0", "k1"):
            for _ in range(ch.qsize(key)):
                got.add(ch.get(key=key, timeout=30.0)["id"])
            while True:
                try:
                    got.add(ch.get_nowait(key=key)["id"])
                except queue.Empty:
                    break
    finally:
        ch.close()
    return got


def _settled_records(workers: list[Worker], recovered: set[int],
                     timeout: float = 30.0) -> dict[str, list[tuple[int, ...]]]:
    """The workers' records once every acknowledged put is accounted for (delivered or
    recovered), or as they stand after ``timeout``: a reply read just before the broker died
    may reach its worker's log a little later on a loaded machine."""

    def accounted() -> bool:
        records = _records(workers)
        delivered = {i for tag in "GL" for i, *_ in records[tag]}
        return not ({i for i, _ in records["P"]} - delivered - recovered)

    with workers[0].lines_changed:
        workers[0].lines_changed.wait_for(accounted, timeout)
    return _records(workers)


def _power_loss_run(run_dir: str, tmp_path, brokers: ForkBroker, ext4: tuple[str, str],
                    losses: int) -> None:
    image, mnt = ext4
    name = f"power-{uuid.uuid4().hex[:6]}"
    address = f"ipc://{run_dir}/{name}.sock"
    check_address = f"ipc://{run_dir}/{name}-check.sock"
    config = dict(name=name, address=address, journal=os.path.join(mnt, "journal"),
                  fsync="always", journal_segment_bytes=4 << 20, maxsize=MAXSIZE)
    stop = str(tmp_path / "stop")
    snapshot, snap_mnt = str(tmp_path / "snapshot.img"), str(tmp_path / "snapshot")
    workers: list[Worker] = []
    try:
        pid = brokers.start(**config)
        workers = _start_workers(address, stop)
        rng = random.Random(losses)
        for _ in range(losses):
            _wait_progress(workers[:2], sum(w.count("P ") for w in workers[:2]))
            _random_moment(workers, rng, 120)  # the moment of the stream to cut power at
            brokers.kill(pid, wait=False)
            shutil.copyfile(image, snapshot)  # what reached the disk when the power went
            wait_gone(pid)
            _mount_loop(snapshot, snap_mnt)  # ext4 replays its own journal: a crashed disk
            try:
                check = brokers.start(**dict(config, address=check_address,
                                             journal=os.path.join(snap_mnt, "journal")))
                try:
                    recovered = _drain(check_address)
                finally:
                    brokers.kill(check, signal.SIGTERM)
            finally:
                _umount(snap_mnt)
            # its successor is not started yet: once every reply the dead broker sent has been
            # read and written down (a descheduled consumer may take a while), these are the
            # records of its life
            records = _settled_records(workers, recovered)
            _check(records, extra_delivered=recovered)
            acked = {i for i, _ in records["A"]} - {i for i, _ in records["T"]}
            assert not acked & recovered, f"acknowledged items came back: {sorted(acked & recovered)[:10]}"
            pid = brokers.start(**config)
        open(stop, "w").close()
        for w in workers:
            w.stop()
        _check(_records(workers))
    finally:
        open(stop, "w").close()
        _kill_workers(workers)


@pytest.mark.timeout(600)
def test_power_loss_with_fsync_always(run_dir, tmp_path, ext4, brokers):
    _power_loss_run(run_dir, tmp_path, brokers, ext4, losses=5)


@pytest.mark.soak
@pytest.mark.timeout(7200)
def test_power_loss_long(run_dir, tmp_path, ext4, brokers):
    _power_loss_run(run_dir, tmp_path, brokers, ext4,
                    losses=int(os.environ.get("ZCHANNEL_POWER_LOSSES", "50")))
