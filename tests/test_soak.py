"""Soak: 4 producer and 4 consumer processes on 8 keys, random sizes up to 4 MiB (bytes and
tensors carrying a sequence number and a checksum), random put/put_nowait/timeouts and
get/get_nowait/get_batch, while consumers using ``ack=True`` are SIGKILLed and restarted.

Every acknowledged put must be received (never lost); duplicates are allowed only for deliveries
that were never acknowledged (redelivered leases); the broker's RSS returns near idle once the
queues drain.  ``pytest -m slow`` runs the short soak (400 puts, 3 kills at least);
``pytest -m soak`` runs ``ZCHANNEL_SOAK_OPS`` (default 100000) puts.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter

import pytest
from conftest import pid_alive, rss_bytes, wait_until
from zchannel.broker import Channel

KEYS = 8
LEASE_TIMEOUT = 3.0

PRODUCER = """
import asyncio, random, sys, zlib
import torch
from zchannel.broker import Channel

address, p, nops, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
torch.manual_seed(seed)
ch = Channel.connect(address)
print("ready", flush=True)
for seq in range(nops):
    key = f"k{rng.randrange(NKEYS)}"
    r = rng.random()
    size = rng.randrange(4 << 20) if r < 0.02 else rng.randrange(64 << 10) if r < 0.3 else rng.randrange(512)
    if rng.random() < 0.3:
        data = torch.randint(0, 256, (size,), dtype=torch.uint8)
        crc = zlib.crc32(data.numpy().tobytes())
    else:
        data = rng.randbytes(size)
        crc = zlib.crc32(data)
    item = {"p": p, "seq": seq, "data": data, "crc": crc}
    weight = rng.randint(1, 4)
    mode = rng.random()
    try:
        if mode < 0.4:
            ch.put(item, weight=weight, key=key)
        elif mode < 0.7:
            ch.put(item, weight=weight, key=key, timeout=rng.choice([0, 0.01, 0.5]))
        else:
            ch.put_nowait(item, weight=weight, key=key)
    except (TimeoutError, asyncio.QueueFull):
        print(f"X {p} {seq}", flush=True)  # not admitted: must never be delivered
        continue
    print(f"P {p} {seq}", flush=True)  # acknowledged put
ch.close()
print("done", flush=True)
""".replace("NKEYS", str(KEYS))

CONSUMER = """
import asyncio, random, select, sys, zlib
from zchannel.broker import Channel

address, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
ch = Channel.connect(address)
print("ready", flush=True)

def received(item):
    data = item["data"]
    raw = data.numpy().tobytes() if hasattr(data, "numpy") else bytes(data)
    tag = "R" if zlib.crc32(raw) == item["crc"] else "BAD"
    print(f"{tag} {item['p']} {item['seq']}", flush=True)

while not select.select([sys.stdin], [], [], 0)[0]:
    key = f"k{rng.randrange(NKEYS)}"
    r = rng.random()
    try:
        if mode == "ack":
            if r < 0.8:
                delivery = ch.get(key=key, timeout=rng.choice([0.01, 0.1, 0.3]), ack=True)
            else:
                delivery = ch.get_nowait(key=key, ack=True)
            item = delivery.item
            received(item)
            if rng.random() < 0.02:
                continue  # never acknowledged: the lease lapses and the item is redelivered
            try:
                ch.ack(delivery)
            except ValueError:
                continue  # the lease had already lapsed
            print(f"A {item['p']} {item['seq']}", flush=True)
        else:  # no lease: a receipt is final
            if r < 0.5:
                items = ch.get_batch(rng.randint(1, 10), key=key, timeout=rng.choice([0.01, 0.1, 0.3]))
            elif r < 0.6:
                items = [ch.get_nowait(key=key)]
            else:
                items = [ch.get(key=key, timeout=rng.choice([0.01, 0.1, 0.3]))]
            for item in items:
                received(item)
                print(f"A {item['p']} {item['seq']}", flush=True)
    except (TimeoutError, asyncio.QueueEmpty):
        pass
ch.close()
print("done", flush=True)
""".replace("NKEYS", str(KEYS))


def _rss_kib(pid: int) -> int:
    return rss_bytes(pid) // 1024


class _Proc:
    """A worker whose stdout lines are collected by a thread (the pipe never fills), which
    notifies ``changed`` at each line and at the end of the output."""

    def __init__(self, workers, code: str, *args: str) -> None:
        self.proc = workers.start(code, *args)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.ended = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            with self.changed:
                self.lines.append(raw.decode().strip())
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def count(self, tag: str) -> int:
        return sum(1 for line in list(self.lines) if line.startswith(tag + " "))

    def wait_ready(self, timeout: float = 120) -> None:
        with self.changed:
            self.changed.wait_for(lambda: "ready" in self.lines or self.ended, timeout)
            assert "ready" in self.lines, (
                f"worker {self.proc.pid} never got ready (ended: {self.ended}): {self.lines}")

    def wait_count(self, tag: str, target: int, timeout: float) -> None:
        """Until ``target`` lines of ``tag`` arrived, the output ended, or ``timeout`` passed."""
        with self.changed:
            self.changed.wait_for(lambda: self.count(tag) >= target or self.ended, timeout)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.thread.join(30)

    def finish(self, timeout: float = 60) -> None:
        self.proc.wait(timeout)
        self.thread.join(30)
        assert self.proc.returncode == 0, f"worker {self.proc.pid} exited {self.proc.returncode}"


def _soak(workers, channels, ops_total: int, min_kills: int, budget_s: float) -> dict:
    rng = random.Random(int(os.environ.get("ZCHANNEL_SOAK_SEED", "0")) or None)
    ch = Channel.create("soak", maxsize=16, lease_timeout=LEASE_TIMEOUT)
    channels.append(ch)
    pid = ch.stats()["pid"]
    ch.put(b"warm" * 1000, key="k0")  # one round trip: the broker's steady state
    assert ch.get(key="k0", timeout=10) == b"warm" * 1000
    rss_idle = _rss_kib(pid)
    start = time.monotonic()

    done: list[_Proc] = []  # killed or finished consumers, whose lines still count
    consumers = [
        _Proc(workers, CONSUMER, ch.address, "ack" if i < 3 else "batch", str(rng.randrange(2**31)))
        for i in range(4)
    ]
    per_producer = max(1, ops_total // 4)
    producers = [
        _Proc(workers, PRODUCER, ch.address, str(p), str(per_producer), str(rng.randrange(2**31)))
        for p in range(4)
    ]
    for w in consumers + producers:
        w.wait_ready()

    kills = 0
    rss_peak = rss_idle
    while any(p.proc.poll() is None for p in producers) or kills < min_kills:
        assert time.monotonic() - start < budget_s, "the soak did not finish in its budget"
        victim_i = rng.randrange(3)  # only the ack consumers are killed
        victim = consumers[victim_i]
        target = victim.count("R") + rng.randint(3, 40)
        deadline = time.monotonic() + 3
        while (  # a random number of receipts, or 3 s, or until the producers are done
            victim.count("R") < target
            and time.monotonic() < deadline
            and any(p.proc.poll() is None for p in producers)
        ):
            victim.wait_count("R", target, timeout=0.05)
        rss_peak = max(rss_peak, _rss_kib(pid))
        victim.kill()
        kills += 1
        done.append(victim)
        consumers[victim_i] = _Proc(workers, CONSUMER, ch.address, "ack", str(rng.randrange(2**31)))
        consumers[victim_i].wait_ready()
    for p in producers:
        p.finish(timeout=budget_s)
        assert p.lines[-1] == "done"

    acked = {
        tuple(map(int, line.split()[1:]))
        for p in producers
        for line in p.lines
        if line.startswith("P ")
    }
    refused = {
        tuple(map(int, line.split()[1:]))
        for p in producers
        for line in p.lines
        if line.startswith("X ")
    }

    def tally(tag: str) -> Counter:
        return Counter(
            tuple(map(int, line.split()[1:]))
            for w in done + consumers
            for line in list(w.lines)
            if line.startswith(tag + " ")
        )

    def drained() -> bool:
        stats = ch.stats()
        return acked <= set(tally("R")) and stats["bytes_held"] == 0 and not stats["leases"]

    # wait for the drain: every acknowledged put received, nothing held (leases returned/acked);
    # what is left otherwise is reported by the asserts below
    wait_until(drained, timeout=60 + 4 * LEASE_TIMEOUT, interval=0.1)
    for c in consumers:
        c.proc.stdin.write(b"stop\n")
        c.proc.stdin.flush()
    for c in consumers:
        c.finish()
    received, completed, bad = tally("R"), tally("A"), tally("BAD")
    stats = ch.stats()
    rss_after = _rss_kib(pid)
    result = {
        "puts_acked": len(acked),
        "puts_refused": len(refused),
        "kills": kills,
        "received": sum(received.values()),
        "lost": len(acked - set(received)),
        "duplicates": sum(n - 1 for n in received.values() if n > 1),
        "completed_twice": sum(1 for n in completed.values() if n > 1),
        "phantoms": len(set(received) - acked - refused),
        "refused_delivered": len(refused & set(received)),
        "bad": sum(bad.values()),
        "bytes_held": stats["bytes_held"],
        "leases": stats["leases"],
        "rss_idle_mib": rss_idle / 1024,
        "rss_peak_mib": rss_peak / 1024,
        "rss_after_mib": rss_after / 1024,
        "seconds": round(time.monotonic() - start, 1),
    }
    print("soak:", result)
    assert pid_alive(pid)
    assert result["bad"] == 0, result
    assert result["lost"] == 0, (result, sorted(acked - set(received))[:20])
    assert result["phantoms"] == 0 and result["refused_delivered"] == 0, result
    assert result["completed_twice"] == 0, result  # a duplicate only follows an un-acked delivery
    assert result["bytes_held"] == 0 and result["leases"] == 0, result
    assert kills >= min_kills
    assert rss_after < rss_idle + 64 * 1024, result
    ch.put("fresh", key="after")
    assert ch.get(key="after", timeout=10) == "fresh"
    return result


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_soak_short(workers, channels):
    _soak(workers, channels, ops_total=400, min_kills=3, budget_s=60)


@pytest.mark.soak
@pytest.mark.timeout(660)
def test_soak_long(workers, channels):
    _soak(
        workers,
        channels,
        ops_total=int(os.environ.get("ZCHANNEL_SOAK_OPS", "100000")),
        min_kills=10,
        budget_s=560,
    )
