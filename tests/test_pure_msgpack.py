"""msgpack's pure-Python build (``MSGPACK_PUREPYTHON=1``, or where no wheel with its C extension
exists): threads of one process encode at once, a broker and its clients run on it, and every
value arrives as it was sent (``broker/wire/packers.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(300)


def _run_pure(script: str, tmp_path) -> list[str]:
    env = dict(os.environ, MSGPACK_PUREPYTHON="1", ZCHANNEL_RUN_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_threads_encoding_at_once_with_pure_python_msgpack(tmp_path):
    out = _run_pure(
        """
        import sys, threading
        import msgpack, numpy as np, torch
        from zchannel.broker.wire import codec
        from zchannel.broker.handle.retries import put_digest
        sys.setswitchinterval(1e-6)  # threads switch inside a packer's work
        print(msgpack.Packer.__module__)
        errors = []
        def run(t):
            try:
                for i in range(3000):
                    for value in (f"t{t}-{i}" * (1 + i % 7), i * 1000 + t,
                                  np.full((1 + i % 3, t + 1), i, np.int32),
                                  torch.full((t + 1,), float(i))):
                        got = codec.decode(*codec.encode(value))
                        if type(got) is not type(value) or not (
                                got == value if isinstance(value, (str, int))
                                else bool((got == value).all()) and got.shape == value.shape):
                            errors.append((t, i, value, got))
                    if put_digest("k", t, i) != put_digest("k", t, i):
                        errors.append((t, i, "digest"))
            except Exception as exc:
                errors.append((t, repr(exc)))
        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        print("errors", len(errors), errors[:3])
        """, tmp_path)
    assert out == ["msgpack.fallback", "errors 0 []"]


def test_a_broker_and_threaded_producers_on_pure_python_msgpack(tmp_path):
    out = _run_pure(
        """
        import sys, threading
        import msgpack, numpy as np
        from zchannel.broker import Channel
        sys.setswitchinterval(1e-6)  # threads switch inside a packer's work
        ch = Channel.create("purepy", maxsize=0)
        print(msgpack.Packer.__module__)
        def produce(t):
            works = [ch.put((t, i, np.arange(i % 5 + t, dtype=np.int64), f"v{t}.{i}"),
                            key=t, async_op=True) for i in range(300)]
            for w in works:
                w.wait(60)
        threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        bad = 0
        for t in range(4):
            for i in range(300):
                got = ch.get(key=t, timeout=60)
                want = (t, i, np.arange(i % 5 + t, dtype=np.int64), f"v{t}.{i}")
                if got[:2] != want[:2] or got[3] != want[3] or not np.array_equal(got[2], want[2]):
                    bad += 1
        print("bad", bad, "left", ch.qsize())
        ch.shutdown()
        """, tmp_path)
    assert out == ["msgpack.fallback", "bad 0 left 0"]
