"""A shared-memory segment that cannot be created does not turn shared memory off for the
connection (broker/shm/pool.py, ``SegmentCreator``; docs/shm.md, "When /dev/shm is full"): smaller
segments are tried at once, one as large again after a back-off, so a ``reserve_shm`` too large
for ``/dev/shm`` gets the segments that fit and disables no smaller one, and puts go through
shared memory again once ``/dev/shm`` has room.

Two ways to refuse a segment: a file-size limit on the producer (``RLIMIT_FSIZE``: any user,
any machine; ``posix_fallocate`` past it fails with ``EFBIG``) and a small ``/dev/shm`` in a
private mount namespace (``unshare -m``, as root; skipped, with the reason, where it cannot be
made).  Real brokers, real producers and consumers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
from zchannel.broker.shm.pool import RETRY_MAX_S, RETRY_MIN_S, SegmentCreator

pytestmark = pytest.mark.timeout(180)
MIB = 1 << 20

# What a producer does, shared by the scripts below: ``through_shm(nbytes, seed)`` puts an array
# and gets it back (checked), True when the put went through shared memory (no fallback);
# ``until_shm`` repeats one until a put does (False after ``deadline`` seconds).
_PRODUCER = r"""
import json, os, resource, sys, time
import numpy as np
from zchannel.broker import Channel

def connect(address):
    ch = Channel.connect(address, timeout=30)
    pool = ch._connection().shm.pool
    assert pool is not None, "no shared memory with the broker"
    return ch, pool

def through_shm(ch, pool, nbytes, seed):
    before = pool.fallbacks
    ch.put(np.full(nbytes, seed, np.uint8), timeout=30)
    got = ch.get(timeout=30)
    assert got.nbytes == nbytes and bool((got == seed).all()), "an item changed"
    return pool.fallbacks == before

def until_shm(ch, pool, nbytes, deadline=60.0):
    end = time.monotonic() + deadline
    seed = 0
    while time.monotonic() < end:
        seed = (seed + 1) % 250
        if through_shm(ch, pool, nbytes, seed):
            return True
        time.sleep(0.05)  # the back-off passes meanwhile (no event says when)
    return False
"""

# A producer whose file-size limit refuses segments: larger than 24 MiB, then any, then none.
_LIMITED = _PRODUCER + r"""
ch, pool = connect(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
out = {}
resource.setrlimit(resource.RLIMIT_FSIZE, (24 << 20, hard))
out["reserved"] = ch.reserve_shm(16 << 20, 8)   # 128 MiB asked: segments of 16 MiB fit
out["reserved_segments"] = len(pool.classes[16 << 20])
out["small_class_shm"] = through_shm(ch, pool, 2 << 20, 1)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))   # no segment can be made
out["blocked_shm"] = through_shm(ch, pool, 4 << 20, 2)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))      # room again
out["resumed"] = until_shm(ch, pool, 4 << 20)
out["large_reserve"] = ch.reserve_shm(8 << 20, 16)           # one 128 MiB segment again
out["large_reserve_segments"] = len(pool.classes.get(8 << 20, []))
out["fallbacks"] = pool.fallbacks
ch.close()
print(json.dumps(out), flush=True)
"""


def test_a_refused_segment_size_disables_neither_smaller_segments_nor_later_attempts(
        cli_broker, workers):
    """A producer's file-size limit refuses segments over 24 MiB: ``reserve_shm(16 MiB, 8)``
    (one 128 MiB segment) gets its 8 slots in segments of 16 MiB, and a 2 MiB array goes
    through shared memory.  Then no segment can be made (a 4 MiB array goes as a frame), then
    the limit is lifted: puts go through shared memory again, and a 128 MiB segment is made
    again in one piece."""
    address = cli_broker("refused")
    proc = workers.start(_LIMITED, address)
    out = json.loads(workers.finish(proc, timeout=150).strip().splitlines()[-1])
    assert out["reserved"] == 8 and out["reserved_segments"] == 8, out
    assert out["small_class_shm"], out
    assert not out["blocked_shm"], out
    assert out["resumed"], f"puts never went through shared memory again: {out}"
    assert out["large_reserve"] == 16 and out["large_reserve_segments"] == 1, out


# Inside a private mount namespace with a 96 MiB /dev/shm: a broker, and a producer that fills
# /dev/shm, puts while it is full, frees it, puts until shared memory is used again, then
# reserves more than /dev/shm holds.
_SMALL_SHM = _PRODUCER + r"""
import subprocess
broker = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "small"],
                          stdout=subprocess.PIPE, text=True)
try:
    line = broker.stdout.readline()
    assert line.startswith("ready "), line
    ch, pool = connect(line.split()[1])
    out = {}
    st = os.statvfs("/dev/shm")
    filler = "/dev/shm/filler"
    with open(filler, "wb") as f:   # all but 8 MiB: no 4 MiB class segment fits
        f.write(b"\1" * (st.f_bavail * st.f_frsize - (8 << 20)))
    out["full_shm"] = through_shm(ch, pool, 4 << 20, 1)
    os.unlink(filler)
    out["resumed"] = until_shm(ch, pool, 4 << 20)
    out["reserved"] = ch.reserve_shm(16 << 20, 8)   # 128 MiB asked of what is left
    out["reserved_class_shm"] = through_shm(ch, pool, 16 << 20, 2)
    out["smaller_class_shm"] = through_shm(ch, pool, 2 << 20, 3)
    ch.close()
    print(json.dumps(out), flush=True)
finally:
    broker.terminate()
    broker.wait(60)
"""


def _private_shm_command(size_mib: int) -> list[str]:
    """The command that runs what follows it (``sh -c`` arguments) with a private ``/dev/shm``
    of ``size_mib`` MiB; skips the test where such a namespace cannot be made."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) (util-linux) for a private /dev/shm")
    mount = f"mount -t tmpfs -o size={size_mib}m tmpfs /dev/shm"
    probe = subprocess.run([unshare, "-m", "sh", "-c", mount], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("cannot mount a private /dev/shm (unshare -m and mount need root or "
                    f"CAP_SYS_ADMIN): {probe.stderr.strip()}")
    return [unshare, "-m", "sh", "-c", f'{mount} && exec "$@"', "sh"]


def test_shared_memory_resumes_after_dev_shm_was_full(tmp_path):
    """The reviewer's case on a 96 MiB ``/dev/shm`` of its own: full for a moment (a 4 MiB
    array goes as a frame), then freed: puts go through shared memory again; a
    ``reserve_shm`` larger than what is left gets the slots that fit (not 0), and puts of
    that class and of a smaller one go through shared memory."""
    command = _private_shm_command(96)
    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM)
    done = subprocess.run([*command, sys.executable, str(script)], capture_output=True,
                          text=True, timeout=150, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert not out["full_shm"], out
    assert out["resumed"], f"puts never went through shared memory again: {out}"
    assert 1 <= out["reserved"] < 8, out
    assert out["reserved_class_shm"] and out["smaller_class_shm"], out


def test_refusals_back_off_and_let_smaller_segments_through():
    """The rule itself: after a refusal of B bytes, segments up to B/2 may be made at once and
    larger ones only after the back-off (1 s, doubling up to 16 s); making one at least as large
    as the smallest refused ends it."""
    creator = SegmentCreator()
    assert creator.allowed(16 * MIB) == 64
    first, retry_s = creator.refuse(128 * MIB)
    assert first and 0 < retry_s <= RETRY_MIN_S  # the first: worth a warning
    assert creator.allowed(16 * MIB) == 4 and creator.allowed(1 * MIB) == 64
    assert not creator.refuse(64 * MIB)[0]  # a smaller one during the back-off
    assert creator.allowed(16 * MIB) == 2 and creator.allowed(64 * MIB) == 0
    assert not creator.made(16 * MIB)  # smaller than the refused: the back-off stays
    assert creator.allowed(64 * MIB) == 0
    creator.retry_at = time.monotonic() - 1  # the back-off passed
    assert creator.allowed(64 * MIB) == 64
    assert RETRY_MIN_S < creator.refuse(128 * MIB)[1] <= 2 * RETRY_MIN_S  # a longer back-off
    for _ in range(10):
        creator.retry_at = time.monotonic() - 1
        assert creator.refuse(128 * MIB)[1] <= RETRY_MAX_S
    assert creator.made(128 * MIB) and creator.allowed(128 * MIB) == 64
    assert creator.retry_s == RETRY_MIN_S
    assert not creator.made(1 * MIB)
