"""Durable channels: what a journal keeps across a broker's death, what it does with damaged or
foreign files, a directory it cannot write, a full disk, and how compaction and
``max_journal_bytes`` bound its disk use (``docs/durability.md``).

Brokers are real processes: ``Channel.create(..., journal=DIR)`` (whose keeper starts a dead
broker again), ``zchannel broker --journal``, or forks of a prepared process
(``tests/forkbroker.py``) where a test kills and restarts brokers itself."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from cluster_util import write_cluster
from conftest import drain, pid_alive, until_available, wait_until
from zchannel.broker import (
    BrokerStartError,
    BrokerUnavailable,
    Channel,
    QueueFull,
)
from zchannel.broker.core.state import Item
from zchannel.broker.host import paths
from zchannel.broker.journal import format as fmt
from zchannel.broker.journal.journal import Journal, JournalSettings
from zchannel.broker.server.config import BrokerConfig


def test_create_journal_survives_sigkill_and_the_creator_restarts_it(channels, tmp_path):
    """Acknowledged puts come back in per-key order after a SIGKILL (the creating process starts
    the broker again by itself), leased items come again, acknowledged ones do not; tensors and
    arrays that travelled through shared memory come back byte for byte."""
    ch = Channel.create("durable-a", journal=tmp_path / "j")
    channels.append(ch)
    assert ch.stats()["journal"]["fsync"] == "interval"
    for i in range(20):
        ch.put(i, key="a")
    arr = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: a shared-memory slot
    ch.put(arr, key="big")
    ch.put(torch.arange(300_000, dtype=torch.int64), key="big")
    ch.put(b"x" * 100_000, key="b")
    assert [ch.get(key="a") for _ in range(3)] == [0, 1, 2]
    acked = ch.get(key="a", ack=True)
    ch.ack(acked)
    leased = ch.get(key="a", ack=True)  # never acknowledged: comes again
    assert (acked.item, leased.item) == (3, 4)
    pid = ch.stats()["pid"]
    os.kill(pid, signal.SIGKILL)
    got = until_available(ch, lambda: ch.get(key="a", timeout=5))
    assert got == 4
    with pytest.raises(ValueError):
        ch.ack(leased)  # a delivery of the dead broker: the restarted one has no such lease
    assert drain(ch, "a") == list(range(5, 20))
    assert np.array_equal(until_available(ch, lambda: ch.get(key="big", timeout=5)), arr)
    assert torch.equal(ch.get(key="big", timeout=5), torch.arange(300_000, dtype=torch.int64))
    assert ch.get(key="b", timeout=5) == b"x" * 100_000
    stats = ch.stats()
    assert stats["pid"] != pid and ch._keeper.restarts == 1
    assert stats["journal"]["recovered_items"] == 19 and stats["journal"]["redelivered"] == 1
    assert stats["journal"]["items"] == 0 and stats["bytes_held"] == 0
    # shutdown is not a death: nothing starts it again, and the journal stays for the next one
    ch.put("kept", key="a")
    proc = ch._proc
    ch.shutdown()
    assert proc.poll() is not None
    channels.remove(ch)
    again = Channel.create("durable-a", journal=tmp_path / "j")
    channels.append(again)
    assert again.get(key="a", timeout=5) == "kept"


@pytest.mark.parametrize("how", ["token", "sigterm"])
def test_a_durable_broker_stopped_on_request_is_not_started_again(channels, tmp_path, caplog, how):
    """A stop on request (the broker's shutdown token, as ``zchannel broker stop`` sends it, or
    SIGTERM) is no death: the creator notes it and starts nothing; the journal stays."""
    name = f"durable-stop-{how}"
    ch = Channel.create(name, journal=tmp_path / "j")
    channels.append(ch)
    ch.put("kept", key="a")
    pid = ch.stats()["pid"]
    keeper = ch._keeper
    with caplog.at_level(logging.INFO, logger="zchannel.client"):
        if how == "token":
            Channel.connect(name).shutdown(token=paths.read_token_file(name)["token"])
        else:
            os.kill(pid, signal.SIGTERM)
        keeper.join(timeout=60)  # the watch ends without a restart
    assert not keeper._thread.is_alive() and keeper.restarts == 0
    assert f"(pid {pid}) stopped on request: not started again; its journal stays" in caplog.text
    assert "starting it again" not in caplog.text
    assert not pid_alive(pid)  # exited (a forked broker's fork server reaps it)
    ch.shutdown()
    channels.remove(ch)
    again = Channel.create(name, journal=tmp_path / "j")
    channels.append(again)
    assert again.get(key="a", timeout=5) == "kept"


def _open_gate(fifo) -> threading.Thread:
    """A thread that lets one waiting broker start through the gate of ``hookmods.GatedStart``
    (its open of the FIFO returns once the broker opens it to read)."""

    def open_it():
        with open(fifo, "wb") as gate:
            gate.write(b"1")

    thread = threading.Thread(target=open_it, daemon=True)
    thread.start()
    return thread


def test_shutdown_during_a_restart_returns_once_the_restarted_broker_stopped(channels, tmp_path):
    """``shutdown()`` while the keeper starts a dead broker again waits for that start and the
    stop of its broker: no broker outlives the call."""
    gate, starts = tmp_path / "gate", tmp_path / "starts"
    os.mkfifo(gate)
    starts.mkdir()
    opened = _open_gate(gate)
    ch = Channel.create("durable-restarting", journal=tmp_path / "j",
                        collector="hookmods:GatedStart",
                        options={"gate": str(gate), "dir": str(starts)})
    channels.append(ch)
    opened.join(timeout=60)
    pid = ch.stats()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: len(os.listdir(starts)) == 2, timeout=60), "no restart began"
    new_pid = int(next(f for f in os.listdir(starts) if f != f"started-{pid}").split("-")[1])
    stopping = threading.Thread(target=ch.shutdown, daemon=True)
    stopping.start()
    try:
        stopping.join(timeout=12)  # (a shutdown that gave up waiting would be back by now)
        returned_early = not stopping.is_alive() and pid_alive(new_pid)
    finally:
        _open_gate(gate)  # the restarted broker starts; the keeper stops it
        stopping.join(timeout=120)
    assert not returned_early, "shutdown returned while the restarted broker ran"
    assert not stopping.is_alive() and not pid_alive(new_pid)
    channels.remove(ch)


def test_cli_broker_journal_flags_config_file_and_stat(tmp_path, run_dir):
    journal = tmp_path / "j"
    config = tmp_path / "broker.toml"
    config.write_text(f'[channel]\nname = "durable-cli"\njournal = "{journal}"\nfsync = "always"\n')

    def start() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "--config",
                                 str(config)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().startswith("ready ")
        return proc

    proc = start()
    try:
        ch = Channel.connect("durable-cli")
        for i in range(5):
            ch.put(i)
        ch.close()
        out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "stat", "durable-cli"],
                             capture_output=True, text=True, check=True).stdout
        line = next(x for x in out.splitlines() if x.startswith("journal"))
        assert str(journal) in line and "fsync always" in line and "items 5" in line
        assert "fsync lag" in line and "segments 1" in line
        assert "(0 redelivered)" in line and "compacted 0 bytes, 0 segments" in line
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = start()
        ch = Channel.connect("durable-cli")
        assert drain(ch, "default_queue") == [0, 1, 2, 3, 4]
        assert ch.stats()["journal"]["fsync"] == "always"
        ch.close()
    finally:
        proc.terminate()
        proc.wait()
    flags = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", "x",
                            "--fsync", "sometimes"], capture_output=True, text=True)
    assert flags.returncode == 2 and "sometimes" in flags.stderr


def test_bad_journal_arguments(tmp_path):
    with pytest.raises(ValueError, match="fsync"):
        Channel.create("durable-bad", journal=tmp_path, fsync="sometimes")
    with pytest.raises(ValueError, match="journal needs a broker process"):
        Channel.create("durable-bad", journal=tmp_path, local=True)
    with pytest.raises(ValueError, match="max_journal_bytes"):
        Channel.create("durable-bad", journal=tmp_path, max_journal_bytes=-1)
    with pytest.raises(ValueError, match="fsync_interval"):
        Channel.create("durable-bad", journal=tmp_path, fsync_interval=0)
    with pytest.raises(ValueError, match=r"journal must be a directory path \(not empty, no NUL "
                                         r"character\), got ''"):
        Channel.create("durable-bad", journal="")  # not the working directory
    for journal in (5, b"/tmp/j", ["/tmp/j"]):  # named, before a broker starts
        with pytest.raises(TypeError, match=r"^journal must be a directory path \(a str or an "
                                            r"os.PathLike of one\), got "):
            Channel.create("durable-bad", journal=journal)
    with pytest.raises(ValueError, match=r"^journal must be a directory path \(not empty, no "
                                         r"NUL character\), got '/tmp/a\\x00b'"):
        Channel.create("durable-bad", journal="/tmp/a\0b")
    with pytest.raises(ValueError, match="no NUL character"):
        BrokerConfig(name="durable-bad", journal="/tmp/a\0b")
    with pytest.raises(ValueError, match=r"max_journal_bytes must be 0 \(no limit\) or at least"):
        Channel.create("durable-bad", journal=tmp_path, max_journal_bytes=1000)
    with pytest.raises(ValueError, match="journal_segment_bytes must be an int >= 65536 and <= "):
        BrokerConfig(name="durable-bad", journal=str(tmp_path), journal_segment_bytes=10**14)


def test_a_journal_under_home_is_found_from_any_directory(tmp_path, monkeypatch, channels):
    """``journal="~/..."`` (the docs' advice for an ordinary user) is the home directory's,
    in ``Channel.create`` and in a config file alike, not a folder named ``~`` under the
    working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    ch = Channel.create("durable-home", journal="~/zc-journal")
    channels.append(ch)
    assert ch.stats()["journal"]["directory"] == str(tmp_path / "home" / "zc-journal")
    assert not (tmp_path / "~").exists()
    assert BrokerConfig(name="x", journal="~/j").journal == str(tmp_path / "home" / "j")


def test_a_journal_serves_one_broker_at_a_time(brokers, run_dir, tmp_path):
    journal = str(tmp_path / "j")
    brokers.start(name="durable-one", address=f"ipc://{run_dir}/one.sock", journal=journal)
    other_run = f"{run_dir}/other"  # another run directory: the channel lock does not stop it
    os.makedirs(other_run, mode=0o700)
    proc = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", "durable-one",
                           "--journal", journal], capture_output=True, text=True,
                          env=dict(os.environ, ZCHANNEL_RUN_DIR=other_run))
    assert proc.returncode == 2
    assert "in use by another broker" in proc.stderr and journal in proc.stderr


# -- damaged and foreign files ---------------------------------------------------------------


def _segments(journal: str, name: str) -> list[str]:
    return sorted(os.path.join(journal, f) for f in os.listdir(journal)
                  if f.startswith(name + ".") and f.endswith(fmt.SUFFIX))


def _last_record(path: str) -> tuple[int, int]:
    """(offset, length) of the last record of a segment file."""
    data = memoryview(open(path, "rb").read())
    scan = fmt.Scan()
    crc = fmt.checksum_of(fmt.PREAMBLE.unpack_from(data, 0)[1])
    offset = fmt.PREAMBLE.size
    last = (offset, 0)
    for _, body in fmt.records(data, crc, fmt.PREAMBLE.size, scan):
        last = (offset, fmt.HEADER.size + len(body))
        offset += last[1]
    return last


def test_a_dealt_key_comes_back_in_put_order(brokers, run_dir, tmp_path):
    """Items dealt to three consumers' private queues return, after a crash, to the key's
    shared queue in the order they were put (not private queue by private queue)."""
    config = dict(name="durable-dealt", address=f"ipc://{run_dir}/dealt.sock",
                  journal=str(tmp_path / "j"), dispatcher="round_robin",
                  consumers=["actor:0", "actor:1", "actor:2"])
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    for i in range(9):
        ch.put(i, key="k")
    assert sorted(ch.stats()["keys"]["k"]["private"].values()) == [3, 3, 3]
    ch.close()
    brokers.kill(pid)
    brokers.start(**config)
    actor = Channel.connect(config["address"], identity="actor:0")
    try:
        assert [actor.get(key="k", timeout=30) for _ in range(9)] == list(range(9))
    finally:
        actor.close()


def test_a_durable_distributed_channel_restarts_its_dead_replica(run_dir, monkeypatch, channels,
                                                                  tmp_path):
    """``Channel.create(distributed=True, journal=DIR)`` keeps each replica it started as
    ``create`` keeps its one broker: a SIGKILLed replica is started again on its address and
    its journal, and its keys' acknowledged items come back."""
    path = write_cluster(run_dir, ("host", "host"))
    monkeypatch.setenv("ZCHANNEL_NODE", "host")
    ch = Channel.create("durable-dist", distributed=True, options={"cluster": path},
                        journal=tmp_path / "j")
    channels.append(ch)
    keys = [f"k{i}" for i in range(8)]
    for key in keys:
        ch.put(f"{key}-item", key=key)
    assert {ch.replica_of(key) for key in keys} == {0, 1}
    (pid,) = [r["pid"] for r in ch.stats()["replicas"] if r["replica"] == 1]
    os.kill(pid, signal.SIGKILL)
    for key in keys:
        assert until_available(ch, lambda key=key: ch.get(key=key, timeout=5)) == f"{key}-item"
    (again,) = [r["pid"] for r in ch.stats()["replicas"] if r["replica"] == 1]
    assert again != pid


def test_items_dealt_after_a_restart_come_after_the_recovered_ones(brokers, run_dir, tmp_path):
    """A consumer's gets (and its peek) take its private queue and the key's shared queue in
    put order on a durable channel: an item put after the restart and dealt to it does not
    overtake the items read back from the journal."""
    config = dict(name="durable-dealt-after", address=f"ipc://{run_dir}/dealt-after.sock",
                  journal=str(tmp_path / "j"), dispatcher="round_robin",
                  consumers=["actor:0", "actor:1"])
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    for i in range(6):
        ch.put(i, key="k")
    brokers.kill(pid)
    ch.close()
    brokers.start(**config)
    ch = Channel.connect(config["address"])
    actor = Channel.connect(config["address"], identity="actor:0")
    try:
        ch.put(6, key="k")
        ch.put(7, key="k")
        assert sum(ch.stats()["keys"]["k"]["private"].values()) == 2  # dealt, one each
        ahead = ch.peek(key="k", n=8, consumer="actor:0")
        assert ahead[:6] == list(range(6)) and len(ahead) == 7
        got = [actor.get(key="k", timeout=30) for _ in range(7)]
        assert got == ahead
    finally:
        actor.close()
        ch.close()


def test_torn_last_records_and_empty_segments_lose_nothing_acknowledged(brokers, run_dir,
                                                                        tmp_path, caplog):
    journal = str(tmp_path / "j")
    config = dict(name="durable-torn", address=f"ipc://{run_dir}/torn.sock", journal=journal)
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    for i in range(10):
        ch.put({"i": i, "pad": b"p" * 200})
    brokers.kill(pid)
    ch.close()
    (last,) = _segments(journal, "durable-torn")
    offset, length = _last_record(last)
    with open(last, "rb") as f:
        f.seek(offset)
        record = f.read(length)
    with open(last, "r+b") as f:  # a copy of the last record, cut short: a write the kill tore
        f.seek(offset + length)
        f.write(record[: length // 2])
    seq = int(os.path.basename(last).split(".")[1])
    open(os.path.join(journal, f"durable-torn.{seq + 1:010d}.zcj"), "wb").close()  # zero-length
    with open(os.path.join(journal, f"durable-torn.{seq + 2:010d}.zcj"), "wb") as f:
        f.write(fmt.preamble(fmt.default_kind()))  # a segment whose making was cut short
    with open(os.path.join(journal, f"durable-torn.{seq + 3:010d}.zcj"), "wb") as f:
        f.truncate(1 << 20)  # preallocated, killed before its first record was written
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    assert [x["i"] for x in drain(ch, "default_queue")] == list(range(10))
    stats = ch.stats()["journal"]
    assert stats["recovered_items"] == 10
    ch.close()
    for path in _segments(journal, "durable-torn"):  # the empty and unfinished ones went
        with open(path, "rb") as f:
            assert f.read(len(fmt.MAGIC)) == fmt.MAGIC and os.path.getsize(path) > 64, path


def test_a_segment_of_another_channel_is_refused_by_name(brokers, run_dir, tmp_path):
    journal = str(tmp_path / "shared")  # two channels share one directory
    a = dict(name="durable-x", address=f"ipc://{run_dir}/x.sock", journal=journal)
    b = dict(name="durable-y", address=f"ipc://{run_dir}/y.sock", journal=journal)
    pa, pb = brokers.start(**a), brokers.start(**b)
    cha, chb = Channel.connect(a["address"]), Channel.connect(b["address"])
    cha.put("for x")
    chb.put("for y")
    brokers.kill(pa)
    brokers.kill(pb)
    cha.close()
    chb.close()
    pb = brokers.start(**b)  # the other channel's files are left alone
    chb = Channel.connect(b["address"])
    assert chb.get(timeout=5) == "for y"
    chb.close()
    brokers.kill(pb)
    (x_segment,) = _segments(journal, "durable-x")
    shutil.copy(x_segment, os.path.join(journal, "durable-y.0000009999.zcj"))
    with pytest.raises(RuntimeError, match="durable-y.0000009999.zcj is a segment of channel "
                                           "'durable-x', not of 'durable-y'"):
        brokers.start(**b)


def test_unwritable_journal_directory_is_a_clear_error(tmp_path, channels):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(BrokerStartError, match=f"journal directory '{not_a_dir}'") as err:
        Channel.create("durable-nodir", journal=not_a_dir)
    assert err.value.reason == "JournalError"
    if os.geteuid() != 0:
        pytest.skip("a read-only mount needs root")
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                      capture_output=True).returncode != 0:
        pytest.skip("mount is not permitted here")
    try:
        with pytest.raises(BrokerStartError, match="Read-only file system|not writable"):
            Channel.create("durable-ro", journal=ro / "j")
        with pytest.raises(BrokerStartError, match="Read-only file system|not writable"):
            Channel.create("durable-ro", journal=ro)
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_compaction_bounds_the_disk_used(brokers, run_dir, tmp_path):
    """A stream through a journal of small segments, with one old item left behind: segments
    are removed as their items leave, the old item is copied forward so that its segment can
    go, and disk use stays within twice the items held plus three segments."""
    segment = 256 << 10
    config = dict(name="durable-compact", address=f"ipc://{run_dir}/compact.sock",
                  journal=str(tmp_path / "j"), journal_segment_bytes=segment)
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    ch.put("old", key="old")  # stays while everything else streams past
    peak = 0
    for i in range(600):  # 600 x 8 KiB = 18 segments' worth
        ch.put(b"x" * (8 << 10) + i.to_bytes(4, "big"), key="s")
        if i >= 8:
            assert ch.get(key="s")[-4:] == (i - 8).to_bytes(4, "big")
        if i % 50 == 0:
            j = ch.stats()["journal"]
            peak = max(peak, j["bytes"])
            assert j["bytes"] <= 2 * j["item_bytes"] + 3 * segment, j
    j = ch.stats()["journal"]
    assert peak > 0 and j["segments"] <= 4, j
    brokers.kill(pid)
    ch.close()
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    assert ch.get(key="old", timeout=5) == "old"
    assert len(drain(ch, "s")) == 8
    ch.close()


def test_max_journal_bytes_makes_puts_wait(brokers, run_dir, tmp_path):
    limit = 1 << 20
    config = dict(name="durable-limit", address=f"ipc://{run_dir}/limit.sock",
                  journal=str(tmp_path / "j"), max_journal_bytes=limit, shm_threshold=0)
    brokers.start(**config)
    ch = Channel.connect(config["address"])
    with pytest.raises(ValueError, match=r"exceeds the \d+ bytes one put may take under the "
                                         rf"broker's max_journal_bytes limit \({limit}"):
        ch.put(b"x" * limit)
    n = 0
    with pytest.raises(QueueFull, match="max_journal_bytes"):
        while True:
            ch.put_nowait(b"x" * (32 << 10))
            n += 1
            assert n < 100
    assert ch.stats()["journal"]["bytes"] <= limit
    with pytest.raises(TimeoutError, match="put timed out: the journal holds max_journal_bytes"):
        ch.put(b"y" * (32 << 10), timeout=0.2)  # it waited, then timed out naming the cause
    waiting = ch.put(b"z" * (32 << 10), async_op=True)
    for _ in range(n):  # taking frees the segments, and the waiting put goes in
        ch.get()
    waiting.wait(timeout=10)
    assert ch.get(timeout=5) == b"z" * (32 << 10)
    ch.close()


def test_collector_outputs_are_journaled(channels, tmp_path):
    ch = Channel.create("durable-hooks", journal=tmp_path / "j", collector="flatten_batch")
    channels.append(ch)
    ch.put([1, 2, 3, 4])
    assert ch.get() == 1
    os.kill(ch.stats()["pid"], signal.SIGKILL)
    assert until_available(ch, lambda: ch.get(timeout=5)) == 2
    assert drain(ch, "default_queue") == [3, 4]


def test_a_put_whose_last_output_was_not_written_leaves_none_of_its_outputs(brokers, run_dir,
                                                                           tmp_path):
    """A collector's put with several outputs is in the journal whole or not at all: outputs
    written before a crash cut the put short are dropped at the restart (the put was not
    acknowledged; its retry stores all of them), not served as a part of it, and later puts
    never take the missing output's jid (which would make them whole at the next restart)."""
    journal = str(tmp_path / "j")
    config = dict(name="durable-parts", address=f"ipc://{run_dir}/parts.sock", journal=journal,
                  collector="flatten_batch")

    def names(items: list) -> list:
        return [(x[0], x[1]) for x in items]

    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    ch.put([("pin", 0, b"")], key="pin")  # keeps the first segment (and the cut records) on disk
    ch.put([("whole", i, b"w" * 100_000) for i in range(2)], key="k")
    ch.put([("cut", i, b"c" * 100_000) for i in range(3)], key="k")
    brokers.kill(pid)
    ch.close()
    (segment,) = _segments(journal, "durable-parts")
    offset, _ = _last_record(segment)
    os.truncate(segment, offset)  # the third output's record was never written
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    assert names(drain(ch, "k")) == [("whole", 0), ("whole", 1)]
    ch.put([("after", 0, b"a" * 100_000)], key="k")  # one output: a whole put
    ch.put([("after", i, b"a" * 100_000) for i in (1, 2)], key="k")
    brokers.kill(pid)
    ch.close()
    brokers.start(**config)
    ch = Channel.connect(config["address"])
    try:
        assert names(drain(ch, "k")) == [("after", 0), ("after", 1), ("after", 2)]
    finally:
        ch.close()


def test_a_stateful_collectors_state_is_rebuilt_from_the_journaled_puts(channels, tmp_path):
    """A collector that keeps state between puts (``holds_state``): the puts it took since it
    last held nothing are journaled and replayed through it when the broker starts again, so
    a half put before the crash pairs with one put after; a collector that holds nothing
    leaves nothing to replay."""
    ch = Channel.create("durable-pairs", journal=tmp_path / "j", collector="hookmods:Pairs")
    channels.append(ch)
    ch.put("a1", key="k1")
    ch.put("a2", key="k1")  # a pair: stored
    ch.put("b1", key="k2")  # waits for its other half
    assert ch.stats()["journal"]["collector_inputs"] == 1  # the pair left nothing held
    os.kill(ch.stats()["pid"], signal.SIGKILL)
    until_available(ch, lambda: ch.put("b2", key="k2", timeout=5))
    assert ch.get(key="k1", timeout=5) == ("a1", "a2")
    assert ch.get(key="k2", timeout=5) == ("b1", "b2")
    stats = ch.stats()["journal"]
    assert stats["collector_inputs"] == 0 and stats["items"] == 0  # it holds nothing now


@pytest.mark.parametrize("retry", [True, False])
def test_a_collected_put_that_waited_for_room_is_stored_after_a_crash(channels, tmp_path,
                                                                     retry):
    """A stateful collector's put whose outputs wait for room when the broker dies: its input
    was journaled but its outputs were not.  The restarted broker stores those outputs (the
    acknowledged half they hold is not lost), and the producer's retry of the put in doubt is
    known as stored (it used to be acknowledged and dropped, with the pair)."""
    ch = Channel.create(f"durable-parked{int(retry)}", journal=tmp_path / "j",
                        collector="hookmods:Pairs", maxsize=1)
    channels.append(ch)
    ch.put("a1", key="k")
    ch.put("a2", key="k")  # a pair: stored, and the queue is full
    ch.put("b1", key="k")  # acknowledged, held by the collector
    waiting = ch.put("b2", key="k", async_op=True)  # completes a pair that waits for room
    wait_until(lambda: ch.stats()["keys"]["k"]["putters"] == 1)
    os.kill(ch.stats()["pid"], signal.SIGKILL)
    with pytest.raises(BrokerUnavailable):
        waiting.wait(60)
    if retry:
        until_available(ch, lambda: ch.put("b2", key="k", timeout=5))
    assert until_available(ch, lambda: ch.get(key="k", timeout=5)) == ("a1", "a2")
    assert ch.get(key="k", timeout=5) == ("b1", "b2")
    with pytest.raises(TimeoutError):
        ch.get(key="k", timeout=0.5)
    stats = ch.stats()
    assert stats["duplicate_puts"] == int(retry)
    assert stats["journal"]["collector_inputs"] == 0  # the replay left the collector empty


@pytest.mark.timeout(300)
def test_each_replica_of_a_distributed_channel_keeps_its_journal(run_dir, tmp_path):
    """``zchannel broker NAME --cluster FILE --replica I --journal DIR``: each replica journals
    under ``NAME.replicaI``; a replica SIGKILLed and started again serves what it held, the
    others lose nothing."""
    from cluster_util import Replicas, write_cluster
    from zchannel.broker.cluster import clusterfile

    path = write_cluster(run_dir)
    journal = str(tmp_path / "j")
    reps = Replicas()
    try:
        reps.start("dj", path, range(3), "--journal", journal)
        address = clusterfile.load(path, "dj").replicas[0].address
        ch = Channel.connect(address)
        keys = [f"k{i}" for i in range(12)]
        for key in keys:
            ch.put(f"{key}-a", key=key)
            ch.put(f"{key}-b", key=key)
        where = {key: ch.replica_of(key) for key in keys}
        assert set(where.values()) == {0, 1, 2}  # the keys spread over the replicas
        names = {f for f in os.listdir(journal) if f.endswith(".zcj")}
        assert {n.rsplit(".", 2)[0] for n in names} == {"dj.replica0", "dj.replica1", "dj.replica2"}
        reps.kill(1)
        reps.start("dj", path, [1], "--journal", journal)
        for key in keys:  # replica 1's keys came back from its journal, in order
            replica = ch._sub(where[key])  # retries wait for this key's replica to answer
            assert until_available(replica, lambda k=key: ch.get(key=k, timeout=10)) == f"{key}-a"
            assert ch.get(key=key, timeout=10) == f"{key}-b"
        ch.close()
    finally:
        reps.stop_all()


def test_the_stored_put_sequences_outlive_their_segments(tmp_path):
    """Each put record carries its producer and sequence, and every segment starts with the
    whole table of them: a journal read back knows every sequence it stored (within the last
    WINDOW of its producer), also after the segments of those puts went, and none it did not
    store (journal/sequences.py)."""
    settings = JournalSettings(directory=str(tmp_path), name="seqs", fsync="never",
                               segment_bytes=64 << 10)
    p, q = b"p" * 16, b"q" * 16
    journal = Journal(settings)
    journal.recover()
    try:
        for seq in range(1, 301):  # 2 KiB items: ~30 per segment, ten segments
            item = Item([os.urandom(2000)], 1, 2000, origin=(p, seq))
            journal.stored([("k", None, item)])
            journal.taken([item])
            journal.sent()  # taken: the segments of these puts are removed
        kept = Item([b"kept"], 1, 4, origin=(q, 7))
        journal.stored([("k", None, kept)])
        journal.stored([("k", None, Item([b"anonymous"], 1, 9))])  # no retry-safe producer
        assert len(journal.store.segments) <= 2  # the segments of p's puts are gone
    finally:
        journal.close()
    again = Journal(settings)
    try:
        groups = again.recover()
        assert [[bytes(f) for f in it.payload] for _, items in groups for it in items] == \
            [[b"kept"], [b"anonymous"]]
        windows = again.sequences.windows
        assert set(windows) == {p, q}
        assert all(windows[p].marked(seq) for seq in range(1, 301))
        assert not windows[p].marked(301) and windows[p].high == 300
        assert windows[q].marked(7) and not windows[q].marked(6)
    finally:
        again.close()


def test_records_written_straight_to_a_new_segment_follow_its_tables(tmp_path):
    """A large record (written at once, not buffered) that starts a new segment comes after the
    tables the segment begins with (a buffered table written after it would overwrite it): every
    put is read back, in order."""
    settings = JournalSettings(directory=str(tmp_path), name="big", segment_bytes=64 << 10)
    journal = Journal(settings)
    journal.recover()
    p = b"p" * 16
    for seq in range(1, 101):
        size = 200_000 if seq % 7 == 0 else 600  # every 7th fills a segment of its own
        journal.stored([("k", None, Item([seq.to_bytes(4, "little") * (size // 4)], 1, size,
                                         origin=(p, seq)))])
        if seq % 3 == 0:
            journal.commit()  # what a loop turn does before its replies go
    journal.commit()  # all written: closing changes nothing read back
    journal.close()
    again = Journal(settings)
    try:
        (group,) = again.recover()
        assert [int.from_bytes(bytes(it.payload[0][:4]), "little") for it in group[1]] == \
            list(range(1, 101))
        assert again.sequences.windows[p].high == 100
    finally:
        again.close()
