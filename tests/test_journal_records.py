"""The journal's records of small items, made on the broker's hot path: the same bytes as the
general encoding (so recovery reads them as before), the stored put sequences noted per put and
settled when read, and what a reply acknowledges on file before the reply leaves — a broker
killed right after a put's or an ack's answer came back loses neither (``docs/durability.md``).
"""

from __future__ import annotations

import os
import shutil

import msgpack
import pytest
from conftest import drain
from zchannel.broker import Channel
from zchannel.broker.core.sequences import WINDOW, SequenceBits
from zchannel.broker.core.state import Item
from zchannel.broker.journal import format as fmt
from zchannel.broker.journal.journal import Journal, JournalSettings
from zchannel.broker.journal.sequences import StoredSequences

KEYS = ["k", "", "ключ", 0, -(2**63), 2**64 - 1, 300, b"\x00bytes", ("a", 1, (b"b", -2))]
WEIGHTS = [0, 1, 2.5, 2**53, 1e-300]
ORIGINS = [None, (b"p" * 16, 7), (b"q", 2**40)]


def _reference_put(crc: fmt.Checksum, meta: list, body: bytes, rtype: int) -> bytes:
    """A put record as the general encoding writes it: msgpack's packer, one joined body."""
    packed = msgpack.packb(meta, use_bin_type=True)
    return fmt.record(crc, rtype, fmt.U32.pack(len(packed)) + packed + body)


@pytest.mark.parametrize("kind", [fmt.CRC32, fmt.default_kind()])
def test_small_put_records_are_the_bytes_of_the_general_encoding(kind):
    crc = fmt.checksum_of(kind)
    for i, key in enumerate(KEYS):
        for weight in WEIGHTS:
            for origin in ORIGINS:
                for rtype, consumer in ((fmt.PUT, None), (fmt.PUT, "c1"), (fmt.INPUT, None)):
                    body = os.urandom(i * 7)
                    jid = 1 + i * 1_000_003
                    parts, nbytes = fmt.small_put(
                        crc, (jid, key, weight, consumer, (len(body),), 0, origin), body, rtype)
                    record = b"".join(parts)
                    meta = [jid, key, weight, consumer, [len(body)], 0,
                            None if origin is None else list(origin)]
                    assert record == _reference_put(crc, meta, body, rtype)
                    assert nbytes == len(record)
                    general, general_bytes = fmt.put_parts(crc, meta, [body], rtype)
                    assert b"".join(general) == record and general_bytes == nbytes
                    scan = fmt.Scan()
                    ((read_type, read_body),) = fmt.records(memoryview(record), crc, 0, scan)
                    put = fmt.read_put(read_body)
                    assert (read_type, put.jid, put.weight, put.consumer) == \
                        (rtype, jid, weight, consumer)
                    assert [bytes(f) for f in put.frames] == [body]
                    assert scan.end == nbytes and not scan.torn


def test_removal_and_lease_lists_pack_as_msgpack_does():
    for jids in ([], [1], list(range(1, 300)), [2**31, 2**32 + 5, 2**63 - 1, 2**64 - 1]):
        assert fmt.pack_plain(jids) == fmt.pack(jids)


def test_a_torn_small_put_ends_the_data_of_its_segment():
    crc = fmt.checksum_of(fmt.default_kind())
    parts, nbytes = fmt.small_put(crc, (1, "k", 0, None, (64,), 0, None), b"x" * 64)
    record = bytearray(b"".join(parts))
    record[-1] ^= 0xFF  # a byte of the body that did not reach the file
    scan = fmt.Scan()
    assert list(fmt.records(memoryview(bytes(record)), crc, 0, scan)) == []
    assert scan.torn and scan.end == 0


def test_stored_sequences_noted_per_put_are_settled_in_their_order():
    """``mark`` only notes; the windows read back are those of marking at once, jumps past the
    window included; a whole table loaded replaces what was noted before it."""
    seqs = StoredSequences()
    eager: dict[bytes, SequenceBits] = {}
    p, q = b"p" * 16, b"q" * 16
    plan = [(p, s) for s in range(1, 2000)] + [(q, 5), (p, 2000 + WINDOW + 3), (q, 4), (p, 1999)]
    plan += [(q, s) for s in range(10, StoredSequences.SETTLE_AFTER + 50)]
    plan += [(p if s % 2 else q, s) for s in range(3 * WINDOW, 3 * WINDOW + 3000)]  # short runs
    plan += [(q, s) for s in range(5 * WINDOW - 37, 5 * WINDOW + 101)]  # across the ring's end
    plan += [(p, s) for s in range(3 * WINDOW - 50, 3 * WINDOW + WINDOW + 20)]  # a whole window
    for producer, seq in plan:
        seqs.mark((producer, seq))
        eager.setdefault(producer, SequenceBits()).mark(seq)
        assert len(seqs._runs) < StoredSequences.SETTLE_AFTER  # settled once that many wait
    windows = seqs.windows
    assert set(windows) == {p, q}
    for producer, window in eager.items():
        assert (windows[producer].high, windows[producer].bits) == (window.high, window.bits)
    # marked a turn at a time (``mark_all``, puts of no retry-safe producer among them): the same
    by_turn = StoredSequences()
    for start in range(0, len(plan), 37):
        by_turn.mark_all([None, *plan[start : start + 37], None])
    assert {k: (w.high, w.bits) for k, w in by_turn.windows.items()} == \
        {k: (w.high, w.bits) for k, w in eager.items()}
    table = seqs.snapshot()
    again = StoredSequences()
    again.mark((b"r" * 16, 3))  # noted before the whole table: the table replaces it
    again.load(table)
    again.mark((q, 5 * WINDOW + 200))
    assert set(again.windows) == {p, q}
    assert again.windows[p].bits == eager[p].bits
    assert again.windows[q].marked(5 * WINDOW + 200) and not again.windows[q].marked(5 * WINDOW + 199)


def test_what_a_turn_appended_is_on_file_once_committed(tmp_path):
    """The files as a SIGKILL right after a turn's replies leaves them (copied before closing:
    nothing more is written) hold every put of the turn not taken, with its sequence."""
    settings = JournalSettings(directory=str(tmp_path / "j"), name="turns", fsync="interval")
    journal = Journal(settings)
    journal.recover()
    p = b"p" * 16
    seq = 0
    taken: list[int] = []
    try:
        for turn in range(40):
            items = []
            for _ in range(1 + turn % 29):  # turns of 1 to 29 puts
                seq += 1
                item = Item([seq.to_bytes(8, "little") * 8], 1, 64, origin=(p, seq))
                journal.stored([("k", None, item)])
                items.append(item)
            journal.taken(items[::3])  # plain gets of the same turn
            journal.commit()  # the replies would leave now
            journal.sent()
            taken += [int.from_bytes(it.payload[0][:8], "little") for it in items[::3]]
        journal.commit()
        shutil.copytree(tmp_path / "j", tmp_path / "killed")
    finally:
        journal.close()
    again = Journal(JournalSettings(directory=str(tmp_path / "killed"), name="turns"))
    try:
        (group,) = again.recover()
        got = [int.from_bytes(bytes(it.payload[0][:8]), "little") for it in group[1]]
        assert got == [s for s in range(1, seq + 1) if s not in set(taken)]
        window = again.sequences.windows[p]
        assert window.high == seq and all(window.marked(s) for s in range(1, seq + 1))
    finally:
        again.close()


def test_a_broker_killed_right_after_its_answers_keeps_what_they_acknowledged(brokers, run_dir,
                                                                             tmp_path):
    """Bursts of async puts (many records a loop turn) and single acks: the broker is SIGKILLed
    as soon as the last answer came back, and the one started on the journal holds every put
    answered and no item whose ack was answered."""
    config = dict(name="durable-answers", address=f"ipc://{run_dir}/answers.sock",
                  journal=str(tmp_path / "j"))
    pid = brokers.start(**config)
    expected: list[int] = []
    n = 0
    for round_ in range(4):
        ch = Channel.connect(config["address"])
        works = []
        for _ in range(150 + 50 * round_):
            works.append(ch.put(n, key="k", async_op=True))
            expected.append(n)
            n += 1
        for work in works:
            work.wait(timeout=30)
        delivery = ch.get(key="k", ack=True, timeout=10)
        ch.ack(delivery)  # answered: this item must not come again
        expected.remove(delivery.item)
        brokers.kill(pid)  # at once: nothing after the answers is waited for
        ch.close()
        pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    try:
        assert drain(ch, "k") == expected
    finally:
        ch.close()


@pytest.mark.parametrize("count", [1, 15, 16, 300, 70_000])
def test_a_puts_record_reads_back_as_its_puts(count):
    crc = fmt.checksum_of(fmt.default_kind())
    entries = [fmt.pack_plain((jid, f"k{jid % 3}", jid % 5, None, (b"p", jid), b"%d" % jid))
               for jid in range(1, count + 1)]
    parts, nbytes = fmt.puts_record(crc, entries)
    record = b"".join(parts)
    assert len(record) == nbytes
    scan = fmt.Scan()
    ((rtype, body),) = fmt.records(memoryview(record), crc, 0, scan)
    puts = fmt.read_puts(body)
    assert rtype == fmt.PUTS and [p.jid for p in puts] == list(range(1, count + 1))
    assert [bytes(p.frames[0]) for p in puts[:3]] == [b"1", b"2", b"3"][:count]
    assert (puts[-1].key, puts[-1].weight, puts[-1].extra) == \
        (f"k{count % 3}", count % 5, [b"p", count])
    torn = fmt.Scan()
    assert list(fmt.records(memoryview(record[:-1]), crc, 0, torn)) == [] and torn.torn


def test_a_version_1_journal_is_read_and_continued_in_the_version_written_now(tmp_path):
    """Segments written before ``PUTS`` records (``ZCJRNL01``: a ``PUT`` record per item) are
    recovered as before; the new segment the broker writes in is version 3."""
    kind = fmt.default_kind()
    crc = fmt.checksum_of(kind)
    directory = tmp_path / "j"
    directory.mkdir()
    head = fmt.PREAMBLE.pack(b"ZCJRNL01", kind) + fmt.record(crc, fmt.SEGMENT, fmt.pack(
        {"channel": "old", "seq": 1, "created": 0.0, "version": 1}))
    records = [b"".join(fmt.small_put(crc, (jid, "k", 0, None, (4,), 0, [b"p" * 16, jid]),
                                      b"v%03d" % jid)[0]) for jid in range(1, 11)]
    records.append(fmt.record(crc, fmt.REMOVE, fmt.pack([1, 2])))
    (directory / f"old.{1:010d}.zcj").write_bytes(head + b"".join(records))
    journal = Journal(JournalSettings(directory=str(directory), name="old"))
    try:
        (group,) = journal.recover()
        assert [bytes(it.payload[0]) for it in group[1]] == [b"v%03d" % j for j in range(3, 11)]
        assert journal.sequences.windows[b"p" * 16].high == 10
        journal.stored([("k", None, Item([b"new"], 1, 3))])
        journal.commit()
    finally:
        journal.close()
    assert (directory / f"old.{2:010d}.zcj").read_bytes()[:8] == fmt.MAGIC == b"ZCJRNL03"
    again = Journal(JournalSettings(directory=str(directory), name="old"))
    try:
        (group,) = again.recover()
        assert [bytes(it.payload[0]) for it in group[1]][-2:] == [b"v010", b"new"]
    finally:
        again.close()


def test_puts_recorded_as_a_run_read_back_as_single_puts_would(tmp_path):
    """``stored_each`` (the one-pass store of a ``puts`` record) records each put as ``stored``
    would: runs of small puts, puts large enough for a record of their own among them, across
    segment ends; what was not taken reads back in order, with every put sequence."""
    settings = JournalSettings(directory=str(tmp_path / "j"), name="runs", fsync="never",
                               segment_bytes=64 << 10)
    journal = Journal(settings)
    journal.recover()
    p = b"p" * 16
    seq, kept = 0, []
    try:
        for turn in range(200):
            outputs = []
            for i in range(1 + turn % 40):
                seq += 1
                size = 5000 if (turn + i) % 17 == 0 else 64  # 5000 B: a PUT record of its own
                body = seq.to_bytes(8, "little") * (size // 8)
                outputs.append((f"k{seq % 3}", None, Item([body], 1, size, origin=(p, seq))))
            assert journal.stored_each(outputs) == len(outputs)
            assert [o[2].jid for o in outputs] == sorted({o[2].jid for o in outputs})
            taken = [o[2] for o in outputs[::4]]
            journal.taken(taken)
            journal.commit()
            journal.sent()
            kept += [o for o in outputs if o[2] not in taken]
        assert len(journal.store.segments) > 2  # the runs crossed segment ends
    finally:
        journal.close()
    again = Journal(settings)
    try:
        groups = dict(again.recover())
        for key in ("k0", "k1", "k2"):
            want = [bytes(o[2].payload[0]) for o in kept if o[0] == key]
            assert [bytes(it.payload[0]) for it in groups[key]] == want
        window = again.sequences.windows[p]
        assert window.high == seq and all(window.marked(s) for s in range(seq - 1000, seq + 1))
    finally:
        again.close()
