"""What ``zchannel stat`` shows of a running broker, and what a broker with ``--metrics-port``
reports of its hooks: ``--watch`` rates on the broker's clock (a broker of many keys answers a
refresh with its previous stats), frames of 80 terminal columns with wide and combining
characters, keys printed apart and read back by ``--peek``, ``ZCHANNEL_DEBUG`` read as a flag,
and hook errors that read the same with the metrics' timing.  The hook classes live here: the
brokers import them from this module (``tests/`` is on their ``PYTHONPATH``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import unicodedata

import pytest
from zchannel.broker import Channel, HookError
from zchannel.hooks import Collector

pytestmark = pytest.mark.timeout(180)

CLI = [sys.executable, "-m", "zchannel.cli.main"]


def _zchannel(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)


def _columns(text: str) -> int:
    """Terminal columns of ``text``, counted here on their own: wide and fullwidth characters
    take two, combining marks none."""
    return sum(0 if unicodedata.combining(c) else
               2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


# -- --watch rates ---------------------------------------------------------------------------


def test_repeated_answers_keep_their_rates_and_a_new_broker_starts_them_over():
    """Rates divide by the broker's clock (``uptime_s``); an answer given again is marked and
    keeps the rates of the last new one; another pid starts them over."""
    from zchannel.cli.stat_watch import RateTracker

    tracker = RateTracker()
    first = {"pid": 7, "uptime_s": 10.0, "puts": 100, "gets": 50, "delivered": 50,
             "keys": {"k": {"depth": 4}}}
    assert tracker.update(first) is False and tracker.per_s == {}
    second = dict(first, uptime_s=14.0, puts=500, gets=250, keys={"k": {"depth": 12}})
    assert tracker.update(second) is False
    assert tracker.per_s == {"puts": 100.0, "gets": 50.0, "delivered": 0.0, "depth": {"k": 2.0}}
    assert tracker.update(dict(second)) is True  # the same answer again: no 0/s
    assert tracker.per_s["puts"] == 100.0
    third = dict(second, uptime_s=16.0, puts=700)  # over the broker's 2 s, whatever the client's
    assert tracker.update(third) is False and tracker.per_s["puts"] == 100.0
    assert tracker.update(dict(third, pid=8, uptime_s=1.0, puts=3)) is False
    assert tracker.per_s == {}


class DearStats(Collector):
    """Passes items through; its ``stats()`` takes 0.2 s, so that each stats body of its
    broker costs what one of some 60,000 keys does (the broker then rations them)."""

    def collect(self, item, key):
        yield key, item

    def stats(self):
        time.sleep(0.2)
        return {"dear": True}


def test_watch_rates_follow_the_brokers_clock_through_repeated_answers(run_dir, channels):
    """Stats bodies are dear, so past its share of time for them the broker answers the
    watch's refreshes with the body it made before.  While a client puts and gets steadily,
    each new frame's rates are its counters' change over the change of ``uptime_s``, and a
    repeated frame is marked and keeps the rates (never 0/s, then a spike)."""
    ch = Channel.create("wstale", collector=DearStats)
    channels.append(ch)
    putting, stop = threading.Event(), threading.Event()

    def steady() -> None:
        worker = Channel.connect("wstale")
        try:
            while not stop.is_set():
                worker.put(b"p", key="hot", timeout=30)
                worker.get(key="hot", timeout=30)
                putting.set()
        finally:
            worker.close()

    thread = threading.Thread(target=steady, daemon=True)
    thread.start()
    try:
        assert putting.wait(60)
        out = _zchannel("stat", "wstale", "--watch", "--json", "--interval", "0.1",
                        "--count", "30")
    finally:
        stop.set()
        thread.join(60)
    assert out.returncode == 0, out.stderr
    frames = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(frames) == 30 and frames[0]["rates"] == {} and frames[0]["repeated"] is False
    repeated = 0
    for before, frame in zip(frames[:-1], frames[1:], strict=True):
        if frame["uptime_s"] == before["uptime_s"]:
            repeated += 1
            assert frame["repeated"] is True and frame["rates"] == before["rates"]
            continue
        assert frame["repeated"] is False
        seconds = frame["uptime_s"] - before["uptime_s"]
        for name in ("puts", "gets", "delivered"):
            assert frame["rates"][name] == pytest.approx(
                (frame[name] - before[name]) / seconds, rel=1e-9), (name, before, frame)
    assert repeated, [(f["uptime_s"], f["puts"]) for f in frames]
    assert any(f["rates"].get("puts", 0) > 0 for f in frames)  # the steady client was seen


# -- --watch and the key table in terminal columns ------------------------------------------

WIDE = "训练数据" * 7  # 28 characters, 56 columns
EMOJI = "🚀" * 28
ACCENTED = "e\u0301" * 40  # 80 characters, 40 columns


def test_frames_fit_80_columns_and_columns_line_up_with_wide_and_combining_keys(run_dir,
                                                                              channels):
    ch = Channel.create("wwide")
    channels.append(ch)
    for key in (WIDE, EMOJI, ACCENTED, ("traj", "训练数据" * 5), "plain"):
        ch.put(b"v", key=key)
    watch = _zchannel("stat", "wwide", "--watch", "--count", "1")
    assert watch.returncode == 0, watch.stderr
    lines = watch.stdout.splitlines()
    assert max(_columns(line) for line in lines) <= 80, watch.stdout
    head = next(i for i, line in enumerate(lines) if line.startswith("key "))
    rows = lines[head + 1:head + 6]
    assert _columns(rows[0]) and all("..." in row for row in rows if "plain" not in row)
    depth_at = lines[head].index("depth")  # the header is ASCII: characters are columns
    for row in rows:  # each row's depth (1) starts in the header's depth column
        before = row.split("  1  ")[0] + "  "
        assert _columns(before) == depth_at, (row, lines[head])
    assert any(row.startswith("e\u0301" * 25 + "...") for row in rows)
    table = _zchannel("stat", "wwide")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("key "))
    depth_at = lines[head].index("depth")
    for row in lines[head + 1:head + 6]:
        assert _columns(row.split("  1  ")[0] + "  ") == depth_at, (row, lines[head])
    assert any(row.startswith(WIDE + " ") for row in lines)  # 56 columns: not cut at 60


# -- keys printed apart, and read back by --peek --------------------------------------------


def test_keys_print_apart_and_peek_reads_the_printed_form(run_dir, channels):
    """The newline key ``a<LF>b`` prints ``a\\nb``, the backslash key ``a\\nb`` prints
    ``a\\\\nb``; --peek of either printed text reads that key; a backslash starting no
    escape is a usage error naming --peek; plain keys and literals read as before."""
    ch = Channel.create("wesc")
    channels.append(ch)
    ch.put("newline", key="a\nb")
    for item in ("backslash", "again"):
        ch.put(item, key="a\\nb")
    ch.put("path", key="C:\\data")
    ch.put("int", key=7)
    ch.put("plain", key="train")
    out = _zchannel("stat", "wesc")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("key "))
    rows = {line.split()[0]: line.split()[1] for line in lines[head + 1:]}
    assert rows["a\\nb"] == "1" and rows["a\\\\nb"] == "2" and rows["C:\\\\data"] == "1"
    for text, depth, items in (("a\\nb", 1, ["'newline'"]),
                               ("a\\\\nb", 2, ["'backslash'", "'again'"]),
                               ("C:\\\\data", 1, ["'path'"]), ("7", 1, ["'int'"]),
                               ("train", 1, ["'plain'"])):
        peek = _zchannel("stat", "wesc", "--peek", text)
        assert peek.returncode == 0, peek.stderr
        assert f"peek      {text}: {len(items)} of {depth} item(s)" in peek.stdout, peek.stdout
        shown = [line.split("  ", 2)[-1] for line in peek.stdout.splitlines()
                 if line.startswith("  [")]
        assert shown == items, peek.stdout
    bad = _zchannel("stat", "wesc", "--peek", "C:\\data")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "'--peek'" in bad.stderr and '"\\d" (character 3)' in bad.stderr, bad.stderr


# -- ZCHANNEL_DEBUG ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, traceback", [
    ("false", False), ("off", False), ("No", False), ("0", False), ("", False),
    ("true", True), ("ON", True), ("yes", True), ("1", True)])
def test_debug_reads_like_the_other_flags(value, traceback, run_dir):
    env = dict(os.environ, ZCHANNEL_DEBUG=value)
    out = _zchannel("stat", "nosuch", env=env)
    if traceback:
        assert out.returncode == 1 and "Traceback" in out.stderr, out.stderr
    else:
        assert out.returncode == 2 and out.stderr.strip().splitlines() == [
            "error: no channel named 'nosuch' on this host"], out.stderr
    bad_setting = _zchannel("stat", env=dict(env, ZCHANNEL_BATCH="maybe"))  # as zchannel loads
    assert ("Traceback" in bad_setting.stderr) is traceback, bad_setting.stderr
    assert "ZCHANNEL_BATCH must be 0 or 1" in bad_setting.stderr


def test_a_malformed_debug_flag_is_one_error_line(run_dir):
    out = _zchannel("stat", "nosuch", env=dict(os.environ, ZCHANNEL_DEBUG="verbose"))
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: ZCHANNEL_DEBUG must be 0 or 1 (or false/true, no/yes, off/on), got 'verbose'"]


# -- hook errors with --metrics-port ----------------------------------------------------------


class ReturnsAnInt(Collector):
    """``collect`` returns what is no iterable."""

    def collect(self, item, key):
        return 5


class Endless(Collector):
    """A generator of many 1 KiB outputs, counting those it made (``collector_stats``)."""

    def setup(self, ctx):
        self.made = 0

    def collect(self, item, key):
        for i in range(20_000):
            self.made += 1
            yield f"{key}{i}", b"x" * 1024

    def stats(self):
        return {"made": self.made}


@pytest.mark.parametrize("metrics", [False, True], ids=["plain", "metrics"])
def test_hook_errors_read_the_same_with_the_metrics_timing(metrics, run_dir, channels,
                                                          cli_broker):
    """A collector returning an int gets the pipeline's own message, in the putter's
    ``HookError`` and in ``last_hook_failure``; a generator stops being drawn once its outputs
    pass ``max_bytes`` (the timing does not draw it to its end first)."""
    extra = {"metrics_port": 0} if metrics else {}
    ch = Channel.create(f"hint{int(metrics)}", collector=ReturnsAnInt, **extra)
    channels.append(ch)
    message = ("Collector.collect must yield (key, item[, weight]) tuples or return an "
               "iterable of them; it returned int")
    with pytest.raises(HookError) as err:
        ch.put("x", key="k")
    assert message in str(err.value) and err.value.exc_type == "TypeError"
    figures = ch.stats()
    assert message in figures["last_hook_failure"] and figures["keys"] == {}
    assert (figures["metrics"] is not None) is metrics
    fan = Channel.connect(cli_broker(f"hfan{int(metrics)}", "--collector",
                                     "test_stat_field:Endless", "--max-bytes", str(1 << 20),
                                     *(["--metrics-port", "0"] if metrics else [])))
    channels.append(fan)
    with pytest.raises(HookError, match="take more than the broker's max_bytes limit"):
        fan.put("x", key="k")
    made = fan.stats()["collector_stats"]["made"]
    assert 0 < made < 2_000, made  # ~1,000 outputs of 1 KiB pass 1 MiB, not 20,000
