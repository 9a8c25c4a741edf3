"""Operators' views of a live broker: ``zchannel broker --metrics-port`` scraped over HTTP, and
``zchannel stat --watch``; both against what ``zchannel stat`` reports."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from conftest import wait_until
from zchannel.broker import BrokerStartError, Channel
from zchannel.broker.server.forkclient import ENV as FORKSERVER_ENV
from zchannel.broker.server.metrics import (
    MAX_KEY_SERIES,
    SNAPSHOT_MAX_AGE_S,
    SNAPSHOT_SHARE,
    young,
)

pytestmark = pytest.mark.timeout(90)

CLI = [sys.executable, "-m", "zchannel.cli.main"]


def _start_broker(name: str, run_dir: str, *args: str, env: dict | None = None):
    proc = subprocess.Popen(
        [*CLI, "broker", name, "--address", f"ipc://{run_dir}/{name}.sock", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    line = proc.stdout.readline()
    return proc, line


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _stat_json(target: str) -> dict:
    out = subprocess.run([*CLI, "stat", "--json", target], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _scrape(url: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample of the exposition text."""
    assert url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_scraped_metrics_match_stat(run_dir):
    """Items and bytes per key, puts/gets/delivered, leases, consumers and per-client lag,
    scraped from a broker process, equal what ``zchannel stat`` says after the same puts."""
    proc, line = _start_broker("mx", run_dir, "--metrics-port", "0")
    try:
        assert line.startswith("ready "), proc.stderr.read()
        address = line.split()[1]
        producer = Channel.connect(address)
        consumer = Channel.connect(address, identity="learner:0")
        for _ in range(7):
            producer.put(bytes(100), key="obs")
        for i in range(3):
            producer.put({"step": i}, key=("traj", 2))
        assert consumer.get(key="obs", timeout=10) == bytes(100)
        delivery = consumer.get(key="obs", ack=True, timeout=10)  # a lease outstanding
        stats = _stat_json(address)
        url = stats["metrics"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)
        m = _scrape(url)

        assert stats["puts"] == 10 and m["zchannel_puts_total"] == 10
        assert stats["gets"] == 2 and m["zchannel_gets_total"] == 2
        assert stats["delivered"] == 2 and m["zchannel_delivered_items_total"] == 2
        keys = stats["keys"]
        assert keys["obs"]["depth"] == 5 == m['zchannel_key_items_held{key="obs"}']
        assert keys["('traj', 2)"]["depth"] == 3 == m["zchannel_key_items_held{key=\"('traj', 2)\"}"]
        assert m['zchannel_key_bytes_held{key="obs"}'] >= 5 * 100
        assert m["zchannel_bytes_held"] == stats["bytes_held"] > 0
        assert m["zchannel_leases_outstanding"] == stats["leases"] == 1
        assert m['zchannel_key_leases{key="obs"}'] == 1
        assert m["zchannel_consumers"] == len(stats["consumers"]) == 1
        assert m['zchannel_consumer_handles{consumer="learner:0"}'] == 1
        assert m["zchannel_clients"] == 2 == stats["clients"]  # producer and consumer
        lag = {k: v for k, v in m.items() if k.startswith("zchannel_client_leases{")}
        assert [v for k, v in lag.items() if 'identity="learner:0"' in k] == [1.0]
        seen = [v for k, v in m.items() if k.startswith("zchannel_client_seconds_since_seen{")]
        assert len(seen) == 2 and all(0 <= s < 30 for s in seen)
        assert m['zchannel_hook_seconds_total{hook="collector"}'] == 0
        assert "zchannel_shm_slots_used" in m and m["process_resident_memory_bytes"] > 0
        text = subprocess.run([*CLI, "stat", address], capture_output=True, text=True,
                              timeout=60).stdout
        assert "requests  puts 10   gets 2   delivered 2" in text and f"metrics   {url}" in text

        consumer.ack(delivery)
        producer.put(bytes(10), key="obs")
        # a snapshot is reused for up to 0.5 s; a later scrape reflects the changes
        later = wait_until(lambda: (m := _scrape(url))["zchannel_puts_total"] == 11 and m,
                           timeout=20, interval=0.1)
        assert later and later["zchannel_puts_total"] == 11
        assert later["zchannel_leases_outstanding"] == 0
        assert later['zchannel_key_items_held{key="obs"}'] == 6
        producer.close()
        consumer.close()
    finally:
        _stop(proc)
    assert proc.returncode == 0


def test_key_series_are_the_deepest_keys_with_their_sizes(run_dir):
    """Past MAX_KEY_SERIES keys, the series are the deepest keys' (chosen before their sizes
    are summed), each with its own items and bytes; ``zchannel_keys`` counts them all."""
    proc, line = _start_broker("mk", run_dir, "--metrics-port", "0")
    try:
        assert line.startswith("ready "), proc.stderr.read()
        address = line.split()[1]
        producer = Channel.connect(address)
        deep = MAX_KEY_SERIES // 2
        works = [producer.put(bytes(50), key=k, async_op=True)
                 for k in range(MAX_KEY_SERIES + deep) for _ in range(2 if k < deep else 1)]
        for work in works:
            work.wait(30)
        m = _scrape(_stat_json(address)["metrics"])
        assert m["zchannel_keys"] == MAX_KEY_SERIES + deep
        held = {k: v for k, v in m.items() if k.startswith("zchannel_key_items_held{")}
        assert len(held) == MAX_KEY_SERIES
        assert all(held[f'zchannel_key_items_held{{key="{k}"}}'] == 2 for k in range(deep))
        assert sum(v == 1 for v in held.values()) == MAX_KEY_SERIES - deep
        one = [v for k, v in m.items() if k.startswith("zchannel_key_bytes_held{")
               and held[k.replace("bytes", "items")] == 1]
        assert len(set(one)) == 1 and one[0] > 50
        assert all(m[f'zchannel_key_bytes_held{{key="{k}"}}'] == 2 * one[0] for k in range(deep))
        producer.close()
    finally:
        _stop(proc)
    assert proc.returncode == 0


def test_a_dear_snapshot_is_served_again_for_ten_times_its_cost():
    """A snapshot is served again while younger than half a second, or than its cost over
    SNAPSHOT_SHARE: scrapes in a row of a channel of many keys take at most that share of
    the loop's time."""
    cheap = {"time": 100.0, "cost_s": 0.001}
    assert young(cheap, 100.4) and not young(cheap, 100.5)
    dear = {"time": 100.0, "cost_s": 0.2}
    assert young(dear, 100.0 + 0.2 / SNAPSHOT_SHARE - 0.01)
    assert not young(dear, 100.0 + 0.2 / SNAPSHOT_SHARE)
    assert SNAPSHOT_SHARE <= 0.1 and SNAPSHOT_MAX_AGE_S == 0.5


def test_keys_that_print_alike_stay_apart(run_dir):
    """The int key 7 and the str key "7" (and the str "'7'") are separate series, separate
    entries of ``stat --json`` and separate ``--peek`` targets: a str key that reads as a
    literal is quoted, and ``--peek`` reads a key the way ``stat`` prints it."""
    proc, line = _start_broker("mxk", run_dir, "--metrics-port", "0")
    try:
        assert line.startswith("ready "), proc.stderr.read()
        address = line.split()[1]
        producer = Channel.connect(address)
        for key, n in ((7, 1), ("7", 2), ("'7'", 3), ("plain", 4)):
            for i in range(n):
                producer.put(f"{key!r}-{i}", key=key)
        stats = _stat_json(address)
        assert {k: v["depth"] for k, v in stats["keys"].items()} == {
            "7": 1, "'7'": 2, "\"'7'\"": 3, "plain": 4}
        m = _scrape(stats["metrics"])
        held = {k: v for k, v in m.items() if k.startswith("zchannel_key_items_held{")}
        assert held == {'zchannel_key_items_held{key="7"}': 1,
                        "zchannel_key_items_held{key=\"'7'\"}": 2,
                        'zchannel_key_items_held{key="\\"\'7\'\\""}': 3,
                        'zchannel_key_items_held{key="plain"}': 4}
        for label, key, n in (("7", 7, 1), ("'7'", "7", 2), ("\"'7'\"", "'7'", 3)):
            out = subprocess.run([*CLI, "stat", address, "--peek", label], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert f"peek      {label}: {n} of {n} item(s)" in out.stdout, out.stdout
            first = f"{key!r}-0"
            peeked = json.loads(subprocess.run(
                [*CLI, "stat", address, "--json", "--peek", label], capture_output=True,
                text=True, timeout=60).stdout)["peek"]
            assert peeked["key"] == label and len(peeked["items"]) == n
            assert repr(first) in out.stdout, out.stdout
        producer.close()
    finally:
        _stop(proc)
    assert proc.returncode == 0


def test_hook_time_is_measured(run_dir, tmp_path):
    """With a collector and a dispatcher at work, hook seconds and calls add up."""
    proc, line = _start_broker("mh", run_dir, "--metrics-port", "0", "--collector",
                               "flatten_batch", "--dispatcher", "round_robin",
                               "--consumers", "actor:2")
    try:
        assert line.startswith("ready "), proc.stderr.read()
        ch = Channel.connect(line.split()[1])
        ch.put([1, 2, 3, 4], key="k")
        url = ch.stats()["metrics"]
        m = _scrape(url)
        assert m['zchannel_hook_calls_total{hook="collector"}'] == 1
        assert m['zchannel_hook_calls_total{hook="dispatcher"}'] == 4
        assert m['zchannel_hook_seconds_total{hook="collector"}'] > 0
        assert m['zchannel_key_items_held{key="k"}'] == 4
        (info,) = [name for name in m if name.startswith("zchannel_broker_info{")]
        # the hooks named as stats() and `zchannel stat` name them
        assert 'collector="flatten_batch"' in info and 'dispatcher="round_robin"' in info
        ch.close()
    finally:
        _stop(proc)


def test_create_with_metrics_port_needs_the_extra_before_a_broker_starts(run_dir, tmp_path):
    """``Channel.create(..., metrics_port=0)`` without prometheus_client: an ``ImportError``
    naming ``metrics_port`` and the extra, before a broker is started (no lock is left)."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "prometheus_client.py").write_text("raise ImportError('not installed')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), os.environ["PYTHONPATH"]]),
               ZCHANNEL_RUN_DIR=run_dir)
    script = ("from zchannel.broker import Channel\n"
              "try:\n"
              "    Channel.create('nometrics', metrics_port=0)\n"
              "except ImportError as exc:\n"
              "    print('ImportError', exc)\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == ("ImportError metrics_port needs prometheus_client: "
                                  "pip install 'zchannel[metrics]'"), out.stderr
    assert not [f for f in os.listdir(run_dir) if f.startswith("nometrics")]


def test_metrics_port_errors(run_dir, tmp_path):
    """Without prometheus_client: one line naming the extra; a busy port: one line naming it;
    a bad port value: a usage error."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "prometheus_client.py").write_text("raise ImportError('not installed')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), os.environ["PYTHONPATH"]]))
    proc, line = _start_broker("mm", run_dir, "--metrics-port", "0", env=env)
    err = proc.stderr.read()
    proc.wait(30)
    assert proc.returncode == 2 and line == ""  # an expected failure: exit 2 (cli/failures.py)
    assert "error: --metrics-port needs prometheus_client: pip install 'zchannel[metrics]'" in err
    assert "Traceback" not in err

    first, line = _start_broker("m1", run_dir, "--metrics-port", "0")
    try:
        port = _stat_json(line.split()[1])["metrics"].rsplit(":", 1)[1].split("/")[0]
        second, line2 = _start_broker("m2", run_dir, "--metrics-port", port)
        err = second.stderr.read()
        second.wait(30)
        assert second.returncode == 2 and line2 == ""
        assert f"metrics endpoint 127.0.0.1:{port}" in err and "Traceback" not in err
    finally:
        _stop(first)
    out = subprocess.run([*CLI, "broker", "m3", "--metrics-port", "70000"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--metrics-port" in out.stderr


def test_stat_watch_refreshes_with_rates(run_dir):
    """``stat --watch --count 2`` prints two frames; the second has rates from the first."""
    proc, line = _start_broker("mw", run_dir)
    try:
        assert line.startswith("ready ")
        address = line.split()[1]
        ch = Channel.connect(address)
        for _ in range(4):
            ch.put(b"x", key="a")
        watch = subprocess.Popen([*CLI, "stat", address, "--watch", "--interval", "0.5",
                                  "--count", "2"], stdout=subprocess.PIPE, text=True)
        first = []
        for text in watch.stdout:  # the first frame ends with a blank line
            if not text.strip():
                break
            first.append(text)
        for _ in range(6):  # between the frames: 6 puts, 2 gets
            ch.put(b"y", key="a")
        ch.get(key="a", timeout=10)
        ch.get(key="a", timeout=10)
        rest, _ = watch.communicate(timeout=60)
        assert watch.returncode == 0
        frame1, frame2 = "".join(first), rest
        assert "--watch" in frame1 and "puts 4" in frame1 and "/s)" not in frame1
        assert re.search(r"puts 10 \(\d[\d,]*\.\d/s\)", frame2), frame2
        assert re.search(r"gets 2 \(\d[\d,]*\.\d/s\)", frame2), frame2
        assert re.search(r"^a\s+8\s+\+\d", frame2, re.M), frame2  # depth 8, growing
        out = subprocess.run([*CLI, "stat", address, "--watch", "--json", "--count", "2",
                              "--interval", "0.2"], capture_output=True, text=True, timeout=60)
        docs = [json.loads(line) for line in out.stdout.splitlines()]
        assert len(docs) == 2 and docs[0]["rates"] == {}
        assert docs[1]["rates"]["puts"] == 0.0 and docs[1]["keys"]["a"]["depth"] == 8
        ch.close()
    finally:
        _stop(proc)


def test_metrics_port_from_create_and_config(run_dir, channels, tmp_path, monkeypatch):
    """``Channel.create(metrics_port=0)`` and ``metrics_port`` in a config file's [channel];
    an in-process channel has no broker to serve them."""
    ch = Channel.create("mcreate", metrics_port=0)
    channels.append(ch)
    for _ in range(3):
        ch.put(b"abc", key="k")
    m = _scrape(ch.stats()["metrics"])
    assert m['zchannel_key_items_held{key="k"}'] == 3 and m["zchannel_puts_total"] == 3
    with pytest.raises(ValueError, match="metrics_port"):
        Channel.create("mlocal", local=True, metrics_port=0)
    with pytest.raises(ValueError, match="metrics_port must be an int in 0..65535"):
        Channel.create("mbad", metrics_port=-1)
    port = ch.stats()["metrics"].rsplit(":", 1)[1].split("/")[0]
    with monkeypatch.context() as env:  # a fresh interpreter, as users start brokers
        env.delenv(FORKSERVER_ENV, raising=False)
        with pytest.raises(BrokerStartError) as info:  # the broker's error, not "no output"
            Channel.create("mbusy", metrics_port=int(port))
    assert info.value.reason == "RuntimeError"
    assert f"metrics endpoint 127.0.0.1:{port}" in str(info.value)
    conf = tmp_path / "m.toml"
    conf.write_text("[channel]\nmetrics_port = 0\nmetrics_address = \"127.0.0.1\"\n")
    proc, line = _start_broker("mconf", run_dir, "--config", str(conf))
    try:
        assert line.startswith("ready "), proc.stderr.read()
        url = _stat_json(line.split()[1])["metrics"]
        assert _scrape(url)["zchannel_keys"] == 0
    finally:
        _stop(proc)


def test_stat_watch_frame_fits_80_columns():
    """A frame of a busy broker (large counters and rates, many consumers, shared memory, a
    long tuple key) stays within 80 columns; a long list wraps at the label column."""
    from zchannel.cli.stat_watch import render

    stats = {
        "name": "trajectory-pipeline", "pid": 123456, "uptime_s": 123456.7, "clients": 12,
        "address": "ipc:///run/user/1000/zchannel/trajectory-pipeline.sock",
        "puts": 123456789, "gets": 123456780, "delivered": 123456700, "bytes_held": 3 << 30,
        "leases": 12, "consumers": [f"actor:{i}" for i in range(16)],
        "shm": {"enabled": True, "slots_used": 1234, "bytes_held": 2 << 30,
                "consumer_bytes": 1 << 30},
        "metrics": "http://127.0.0.1:9100/metrics",
        "keys": {("train", 3, "a-very-long-key-name-indeed"): {"depth": 123456, "getters": 12},
                 "a": {"depth": 8}},
    }
    per_s = {"puts": 123456.7, "gets": 123456.7, "delivered": 123456.7, "depth": {"a": 2.0}}
    lines = render(stats, per_s, 1.0)
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    text = "\n".join(lines)
    assert "puts 123,456,789 (123,456.7/s)" in text and "delivered 123,456,700" in text
    consumers = [line for line in lines if "actor:" in line]
    assert len(consumers) > 1 and consumers[0].startswith("consumers actor:0, ")
    assert consumers[0].endswith(",") and consumers[1].startswith(" " * 10 + "actor:")
    assert "actor:15" in consumers[-1] and re.search(r"^a\s+8\s+\+2\.0", text, re.M)
    assert "('train', 3, 'a-very-long..." in text
