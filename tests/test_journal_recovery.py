"""Durable channels: what a broker starting on its journal does with records it does not know,
damaged records inside the journal, files named like segments that are not regular files,
puts held by a collector other than the one configured, and a journal full of live items
that compaction cannot shrink (``docs/durability.md``).

Brokers are forks of a prepared process (``tests/forkbroker.py``): a test kills one and starts
it again on the same journal itself."""

from __future__ import annotations

import os

import pytest
from conftest import drain
from zchannel.broker import BrokerStartError, Channel, JournalError, QueueFull
from zchannel.broker.core.state import Item
from zchannel.broker.journal import format as fmt
from zchannel.broker.journal.collectors import collector_identity
from zchannel.broker.journal.journal import Journal, JournalSettings


def _segments(journal: str, name: str) -> list[str]:
    return sorted(os.path.join(journal, f) for f in os.listdir(journal)
                  if f.startswith(name + ".") and f.endswith(fmt.SUFFIX))


def _record_offsets(path: str) -> list[tuple[int, int, int]]:
    """``(offset, length, type)`` of every record of a segment file."""
    data = memoryview(open(path, "rb").read())
    crc = fmt.checksum_of(fmt.PREAMBLE.unpack_from(data, 0)[1])
    scan, out, offset = fmt.Scan(), [], fmt.PREAMBLE.size
    for rtype, body in fmt.records(data, crc, fmt.PREAMBLE.size, scan):
        out.append((offset, fmt.HEADER.size + len(body), rtype))
        offset += fmt.HEADER.size + len(body)
    return out


def _flip_byte(path: str, offset: int) -> None:
    """Damage the byte at ``offset`` of ``path`` (its bits inverted)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes((byte[0] ^ 0xFF,)))


def _write_bytes(pid: int) -> int:
    """Bytes process ``pid`` handed to write calls so far (``/proc/PID/io``)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


# -- records --------------------------------------------------------------------------------


def test_a_record_of_an_unknown_type_is_skipped(brokers, run_dir, tmp_path):
    """A record of a type this version does not know, with a good checksum (a later zchannel
    wrote it): skipped; the records after it are read and nothing is trimmed."""
    journal = str(tmp_path / "j")
    config = dict(name="durable-unknown", address=f"ipc://{run_dir}/unknown.sock",
                  journal=journal, fsync="always")
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    ch.put("first")
    ch.put("second")
    ch.close()
    brokers.kill(pid)
    (path,) = _segments(journal, "durable-unknown")
    records = _record_offsets(path)
    end = records[-1][0] + records[-1][1]
    data = open(path, "rb").read()
    crc = fmt.checksum_of(fmt.PREAMBLE.unpack_from(data, 0)[1])
    body = fmt.pack(["from a later version"])
    unknown = fmt.HEADER.pack(len(body), crc(body, crc(bytes((200,)), 0)), 200) + body
    at = records[2][0]  # after the SEGMENT and TABLE records: before the puts
    with open(path, "wb") as f:
        f.write(data[:at] + unknown + data[at:end])
    brokers.start(**config)
    assert os.path.exists(path) and os.path.getsize(path) == end + len(unknown)  # not trimmed
    ch = Channel.connect(config["address"])
    assert drain(ch, "default_queue") == ["first", "second"]
    assert ch.stats()["journal"]["recovered_items"] == 2
    ch.close()


@pytest.mark.parametrize("fsync", ["always", "interval"])
def test_a_damaged_record_inside_the_journal(brokers, run_dir, tmp_path, fsync):
    """A record whose checksum does not match in a segment that later segments follow.  With
    ``fsync="always"`` every record was on disk before its reply, so it is damage: the start is
    refused naming the file and the offset, and no file is trimmed.  With ``interval`` it is
    what a crash of the machine leaves of records not synced yet: that segment is trimmed
    there and the broker starts on the rest, later segments included."""
    journal = str(tmp_path / "j")
    config = dict(name="durable-damaged", address=f"ipc://{run_dir}/damaged.sock",
                  journal=journal, journal_segment_bytes=64 << 10, shm_threshold=0,
                  fsync=fsync)
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    for i in range(40):  # 4 KiB items: a few segments
        ch.put(i.to_bytes(4, "big") * 1024)
    ch.close()
    brokers.kill(pid)
    first, *later = _segments(journal, "durable-damaged")
    assert later
    offset, length, rtype = next(r for r in _record_offsets(first) if r[2] == fmt.PUT)
    sizes = {path: os.path.getsize(path) for path in [first, *later]}
    _flip_byte(first, offset + length - 1)  # one flipped byte in the body of a put
    if fsync == "always":
        with pytest.raises(RuntimeError, match=f"{os.path.basename(first)}: a torn or damaged "
                                               f"record at offset {offset} .*not the journal's "
                                               "last"):
            brokers.start(**config)
        assert {path: os.path.getsize(path) for path in sizes} == sizes
        return
    brokers.start(**config)
    ch = Channel.connect(config["address"])
    try:
        got = [int.from_bytes(ch.get(timeout=10)[:4], "big") for _ in range(ch.qsize())]
    finally:
        ch.close()
    # the damaged put is the first segment's first: its items are gone, the later segments'
    # items came back, in order
    assert 0 < got[0] and got == list(range(got[0], 40))


def _damaged_journal(brokers, run_dir, tmp_path, fsync: str, name: str):
    """A journal of 40 items of 4 KiB in segments of 64 KiB, its broker killed: its config
    and segment files, oldest first."""
    journal = str(tmp_path / "j")
    config = dict(name=name, address=f"ipc://{run_dir}/{name}.sock", journal=journal,
                  journal_segment_bytes=64 << 10, shm_threshold=0, fsync=fsync)
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    for i in range(40):
        ch.put(i.to_bytes(4, "big") * 1024)
    ch.close()
    brokers.kill(pid)
    segments = _segments(journal, name)
    assert len(segments) >= 3
    return config, segments


@pytest.mark.parametrize("fsync", ["always", "interval"])
def test_a_damaged_first_record_with_records_after_it_is_not_an_unfinished_segment(
        brokers, run_dir, tmp_path, fsync):
    """One flipped byte in the ``SEGMENT`` record of a segment that later segments follow: not
    a segment a broker was making when it died (records follow it), so it is a torn record
    at the end of the preamble.  With ``always`` the start is refused naming it and nothing
    is removed; with ``interval`` its items are dropped (logged) and the later ones served."""
    config, (first, second, *later) = _damaged_journal(brokers, run_dir, tmp_path, fsync,
                                                       "durable-head")
    sizes = {path: os.path.getsize(path) for path in [first, second, *later]}
    _flip_byte(second, fmt.PREAMBLE.size + fmt.HEADER.size + 3)  # in its SEGMENT record
    if fsync == "always":
        with pytest.raises(RuntimeError, match=f"{os.path.basename(second)}: a torn or damaged "
                                               f"record at offset {fmt.PREAMBLE.size} .*not the "
                                               "journal's last"):
            brokers.start(**config)
        assert {path: os.path.getsize(path) for path in sizes} == sizes
        return
    brokers.start(**config)
    ch = Channel.connect(config["address"])
    try:
        got = [int.from_bytes(x[:4], "big") for x in drain(ch)]
    finally:
        ch.close()
    assert got[0] == 0 and got[-1] == 39 and 0 < 40 - len(got) < 40  # the second's are gone
    assert got == sorted(got)


@pytest.mark.parametrize("content", ["random bytes", "zeros, then data"])
def test_a_short_or_zeroed_file_with_data_is_refused_not_removed(brokers, run_dir, tmp_path,
                                                                  content):
    """A file named like a segment that was not cut short while a broker made it: 20 bytes
    that are no start of a segment, or a segment whose first page was zeroed (data after
    it).  The start is refused naming it; the file stays."""
    config, segments = _damaged_journal(brokers, run_dir, tmp_path, "interval", "durable-odd")
    if content == "random bytes":
        odd = segments[-1][:-len(".zcj") - 10] + "0000000099.zcj"
        with open(odd, "wb") as f:
            f.write(bytes(range(100, 120)))
        match = "is not a zchannel journal segment"
    else:
        odd = segments[1]
        with open(odd, "r+b") as f:
            f.write(bytes(4096))
        match = "whose start is zeros but that holds data further on"
    with pytest.raises(RuntimeError, match=f"{os.path.basename(odd)}.*{match}"):
        brokers.start(**config)
    assert os.path.exists(odd)


def test_segments_read_at_the_start_give_their_disk_back_once_drained(brokers, run_dir,
                                                                       tmp_path):
    """A broker started on a journal of several segments, its items taken: the segments go,
    and the broker keeps none of them open or mapped (their disk space comes back)."""
    config, _ = _damaged_journal(brokers, run_dir, tmp_path, "interval", "durable-drain")
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    assert len(drain(ch)) == 40
    ch.put(b"after")  # a removal of the last items, then a put: the old segments went
    assert ch.get(timeout=10) == b"after"
    assert ch.stats()["journal"]["segments"] == 1
    ch.close()
    with open(f"/proc/{pid}/maps") as f:
        held = [line for line in f if ".zcj" in line and "(deleted)" in line]
    fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    assert held == [] and not [fd for fd in fds if ".zcj" in fd and "(deleted)" in fd]


def test_max_journal_bytes_stores_any_item_up_to_it_and_restarts_add_no_segments(
        brokers, run_dir, tmp_path):
    """Under ``max_journal_bytes``, an item of up to the limit is stored once the queues are
    empty (the segments that hold nothing do not count); a journal at its limit, its broker
    killed again and again, keeps its segments (a restart adds none that stays, and its new
    segment fits the room under the limit)."""
    limit = 1 << 20
    journal = str(tmp_path / "j")
    config = dict(name="durable-cap", address=f"ipc://{run_dir}/cap.sock", journal=journal,
                  max_journal_bytes=limit, shm_threshold=0)
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    for size in (600_000, 600_000, 950_000, 500_000):
        ch.put(b"x" * size, timeout=10)
        assert len(ch.get(timeout=10)) == size
    with pytest.raises(QueueFull, match="max_journal_bytes"):
        for i in range(4000):
            ch.put_nowait(i.to_bytes(4, "big") * 256)  # 1 KiB each
    ch.close()
    counts = []
    for _ in range(3):
        brokers.kill(pid)
        pid = brokers.start(**config)
        ch = Channel.connect(config["address"])
        stats = ch.stats()["journal"]
        ch.close()
        counts.append(stats["segments"])
        assert stats["bytes"] <= limit + 8192, stats
    assert counts[0] == counts[1] == counts[2]
    ch = Channel.connect(config["address"])
    assert [int.from_bytes(x[:4], "big") for x in drain(ch)] == list(range(i))
    ch.close()


# -- files named like segments --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["directory", "dangling symlink", "symlink", "fifo"])
def test_a_file_named_like_a_segment_that_is_no_regular_file_stops_the_start(
        brokers, run_dir, tmp_path, kind):
    """A directory, a symbolic link (dangling or to a segment) or a FIFO named like a segment:
    the start is refused with an error naming it, its kind and the channel; nothing is
    removed."""
    journal = str(tmp_path / "j")
    config = dict(name="durable-files", address=f"ipc://{run_dir}/files.sock", journal=journal)
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    ch.put("kept")
    ch.close()
    brokers.kill(pid)
    (segment,) = _segments(journal, "durable-files")
    odd = os.path.join(journal, "durable-files.0000000099.zcj")
    if kind == "directory":
        os.mkdir(odd)
    elif kind == "dangling symlink":
        os.symlink(str(tmp_path / "nowhere"), odd)
    elif kind == "symlink":
        os.symlink(segment, odd)
    else:
        os.mkfifo(odd)
    named = {"directory": "a directory", "fifo": "a FIFO"}.get(kind, "a symbolic link")
    with pytest.raises(RuntimeError, match=f"durable-files.0000000099.zcj is named like a "
                                           f"segment of the journal of channel 'durable-files' "
                                           f"but is {named}, not a regular file"):
        brokers.start(**config)
    assert os.path.lexists(odd) and os.path.exists(segment)
    (os.rmdir if kind == "directory" else os.unlink)(odd)
    brokers.start(**config)
    ch = Channel.connect(config["address"])
    assert ch.get(timeout=10) == "kept"
    ch.close()


# -- the collector held inputs belong to ----------------------------------------------------


def test_inputs_held_by_another_collector_stop_the_start(brokers, run_dir, tmp_path):
    """Puts a stateful collector was holding are not replayed through another collector (or
    the same one with other options), which would drop them: that start is refused naming
    both collectors and the number of held puts; the previous collector finishes them; with
    nothing held any collector starts."""
    base = dict(name="durable-held", address=f"ipc://{run_dir}/held.sock",
                journal=str(tmp_path / "j"))
    pid = brokers.start(**base, collector="hookmods:Pairs")
    ch = Channel.connect(base["address"])
    ch.put("a1", key="k")
    ch.put("a2", key="k")
    ch.put("b1", key="k")  # acknowledged, held by the collector
    ch.close()
    brokers.kill(pid)
    with pytest.raises(RuntimeError, match="holds 1 acknowledged put.* collector "
                                           "'hookmods:Pairs' was holding.*runs collector none "
                                           r"\(the pass-through collector\)"):
        brokers.start(**base)
    with pytest.raises(RuntimeError, match=r'Pairs.{1,3} with options \{\} was holding.*runs '
                                           r'collector .{1,3}hookmods:Pairs.{1,3} with options '
                                           r'\{"size":3\}'):
        brokers.start(**base, collector="hookmods:Pairs", options={"size": 3})
    pid = brokers.start(**base, collector="hookmods:Pairs")
    ch = Channel.connect(base["address"])
    ch.put("b2", key="k")
    assert drain(ch, "k") == [("a1", "a2"), ("b1", "b2")]
    assert ch.stats()["journal"]["collector_inputs"] == 0
    ch.close()
    brokers.kill(pid)
    brokers.start(**base)  # nothing held: another collector may start
    ch = Channel.connect(base["address"])
    ch.put("plain", key="k")
    assert ch.get(key="k", timeout=10) == "plain"
    ch.close()


def test_a_journal_that_names_no_collector_is_replayed_as_before(tmp_path):
    """Held inputs in a journal written without the ``collector`` table (by an earlier
    zchannel) go to whatever collector the broker runs, as they did; a journal that names
    its collector refuses another."""
    old = JournalSettings(directory=str(tmp_path), name="held", fsync="never")
    journal = Journal(old)
    journal.recover()
    journal.collected(Item([b"half"], 1, 4), "k", True, 0)
    journal.close()
    other = collector_identity("other:Collector", {})
    again = Journal(JournalSettings(directory=str(tmp_path), name="held", collector=other))
    try:
        again.recover()
        assert [bytes(item.payload[0]) for _, item, _ in again.replay] == [b"half"]
    finally:
        again.close()  # its new segment names ``other``
    with pytest.raises(JournalError, match="holds 1 acknowledged put.*'other:Collector'.*"
                                           "'mine:Pairs'"):
        Journal(JournalSettings(directory=str(tmp_path), name="held",
                                collector=collector_identity("mine:Pairs", {}))).recover()


# -- compaction ------------------------------------------------------------------------------


def test_a_journal_of_live_items_near_its_limit_is_not_rewritten(brokers, run_dir, tmp_path):
    """Items that take more than 3/4 of ``max_journal_bytes``, none of them taken: copying
    them would free nothing, so the broker serves hundreds of loop turns without writing to
    its journal (its segments stay the same files, nothing is compacted)."""
    limit = 2 << 20
    journal = str(tmp_path / "j")
    config = dict(name="durable-full", address=f"ipc://{run_dir}/full.sock", journal=journal,
                  max_journal_bytes=limit, shm_threshold=0)
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    with pytest.raises(QueueFull, match="max_journal_bytes"):
        for i in range(200):
            ch.put_nowait(i.to_bytes(4, "big") * (8 << 10), key="k")  # 32 KiB each
    stats = ch.stats()["journal"]
    assert stats["bytes"] > limit * 3 // 4 and stats["segments"] >= 3, stats
    files = _segments(journal, "durable-full")
    written = _write_bytes(pid)
    for _ in range(300):  # loop turns: each one ticks the journal
        ch.qsize(key="other")
    assert _segments(journal, "durable-full") == files
    assert _write_bytes(pid) - written < 1 << 20  # the replies, not copies of the items
    assert ch.stats()["journal"]["compacted_bytes"] == 0
    assert [int.from_bytes(x[:4], "big") for x in drain(ch, "k")] == list(range(i))
    ch.close()


def test_an_unfinished_segment_of_an_older_version_is_removed(brokers, run_dir, tmp_path):
    """A segment a broker of an earlier journal version was making when it died (its magic,
    then zeros) is removed as the current version's would be; the items are served."""
    config, segments = _damaged_journal(brokers, run_dir, tmp_path, "interval", "durable-v2")
    older = next(magic for magic in fmt.MAGICS if magic != fmt.MAGIC)
    unfinished = segments[-1][:-len(".zcj") - 10] + "0000000099.zcj"
    with open(unfinished, "wb") as f:
        f.write(fmt.PREAMBLE.pack(older, fmt.CRC32) + bytes(64 << 10))
    brokers.start(**config)
    assert not os.path.exists(unfinished)
    ch = Channel.connect(config["address"])
    assert len(drain(ch)) == 40
    ch.close()


@pytest.mark.parametrize("kind", ["directory", "dangling symlink"])
def test_a_lock_file_that_is_no_regular_file_is_named(tmp_path, channels, kind):
    """The journal's lock file is a directory, or a symbolic link to nowhere: the start is
    refused naming the lock file (not the journal directory), and nothing is made through
    the link."""
    journal = tmp_path / "j"
    journal.mkdir()
    lock = journal / "durable-lock.zcj-lock"
    elsewhere = tmp_path / "elsewhere"
    if kind == "directory":
        lock.mkdir()
    else:
        lock.symlink_to(elsewhere)
    with pytest.raises(BrokerStartError, match=f"the lock file '{lock}' of the journal"):
        Channel.create("durable-lock", journal=journal)
    assert not elsewhere.exists()
