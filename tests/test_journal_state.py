"""A collector's state in a durable channel's journal (``Collector.state_dict``): a snapshot of
it replaces the puts it took, so a collector that always holds something keeps a bounded
journal, and a broker started on the journal gives the state back before it replays the puts
that came after it (``docs/durability.md``, Hook state)."""

from __future__ import annotations

import os
import signal
import time

import msgpack
import pytest
from conftest import drain, until_available, wait_until
from hookmods import CountedPairs, Pairs
from zchannel.broker import BrokerUnavailable, Channel
from zchannel.broker.cluster.replica import wrap_collector
from zchannel.broker.core.queuecore import QueueCore
from zchannel.broker.core.state import Client, Item
from zchannel.broker.journal import collectors
from zchannel.broker.journal.collectors import SNAPSHOT_BYTES
from zchannel.broker.journal.journal import Journal, JournalSettings
from zchannel.hooks import Collector, Dispatcher

HALF = 64 << 10  # each put's bytes: a snapshot is due after SNAPSHOT_BYTES of them


def _pairs(ch: Channel, first: int, count: int) -> list:
    """Put ``count`` pairs of 64 KiB halves (keys ``k<first>``...) and take each pair."""
    got = []
    for i in range(first, first + count):
        ch.put(b"a" * HALF, key=f"k{i}")
        ch.put(b"b" * HALF, key=f"k{i}")
        got.extend(drain(ch, f"k{i}"))
    return got


def test_a_collector_that_always_holds_state_keeps_a_snapshot_not_every_put(
        brokers, run_dir, tmp_path):
    """A half that never finds its other half and a pair count: the collector always holds
    something, so without snapshots the journal would keep every put it ever took.  It keeps
    its state and the puts since it instead, and after a SIGKILL the restarted broker has the
    half and the count back (the half pairs with a put after the restart, numbered on)."""
    config = dict(name="durable-state", address=f"ipc://{run_dir}/state.sock",
                  journal=str(tmp_path / "j"), collector="hookmods:CountedPairs")
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    pairs = 3 * SNAPSHOT_BYTES // HALF  # three snapshots' worth of puts
    try:
        ch.put("stuck-a", key="stuck")
        got = _pairs(ch, 0, pairs)
        assert [n for n, _, _ in got] == list(range(1, pairs + 1))
        stats = ch.stats()["journal"]
        assert stats["collector_states"] >= 2, stats
        # the puts kept: those since the last state, well under all 2 * pairs + 1 taken
        assert stats["collector_inputs"] <= 2 * SNAPSHOT_BYTES // HALF + 2, stats
        assert stats["collector_input_bytes"] <= 2 * SNAPSHOT_BYTES + 2 * HALF, stats
    finally:
        ch.close()
    brokers.kill(pid)
    brokers.start(**config)
    ch = Channel.connect(config["address"])
    try:
        ch.put("stuck-b", key="stuck")
        assert ch.get(key="stuck", timeout=10) == (pairs + 1, "stuck-a", "stuck-b")
        assert [n for n, _, _ in _pairs(ch, pairs, 2)] == [pairs + 2, pairs + 3]
    finally:
        ch.close()


def test_a_state_the_collector_refuses_stops_the_start_and_loses_nothing(
        brokers, run_dir, tmp_path):
    """``load_state_dict`` raising: the broker does not start (the puts the state replaced
    would be lost), naming the collector and its error; the segments are left as they were."""
    journal = tmp_path / "j"
    config = dict(name="durable-refused", address=f"ipc://{run_dir}/refused.sock",
                  journal=str(journal), collector="hookmods:CountedPairs")
    pid = brokers.start(**config)
    ch = Channel.connect(config["address"])
    try:
        ch.put("refuse", key="held")
        _pairs(ch, 0, 2 * SNAPSHOT_BYTES // HALF)
        assert ch.stats()["journal"]["collector_states"] >= 1
    finally:
        ch.close()
    brokers.kill(pid)
    with pytest.raises(RuntimeError, match=r"holds the state of collector 'hookmods:Counted"
                                           r"Pairs'.*load_state_dict refused.*a half it "
                                           r"refuses"):
        brokers.start(**config)
    kept = Journal(JournalSettings(directory=str(journal), name="durable-refused"))
    try:  # the state is still there, with the half
        kept.recover()
        assert kept.collector_state.recovered is not None
        assert b"refuse" in b"".join(bytes(f) for f in kept.collector_state.recovered.payload)
    finally:
        kept.close()


@pytest.mark.parametrize("collector", ["hookmods:CountedPairs", "hookmods:Pairs"])
def test_a_put_waiting_for_room_when_the_collector_lets_go_of_its_input_is_stored_after_a_crash(
        channels, tmp_path, collector):
    """A pair's second half completes a pair that waits for room (``maxsize=1``) while other
    keys' traffic goes on: the collector writes its state (``CountedPairs``) or holds nothing
    for a moment (``Pairs``, an ``IDLE``), which lets go of the waiting put's input, so its
    output is kept as a ``PENDING`` record.  After a SIGKILL the restarted broker stores that
    pair, and the producer's retry of the put in doubt is known as stored."""
    counted = collector.endswith("CountedPairs")
    ch = Channel.create(f"durable-waiting{int(counted)}", journal=tmp_path / "j",
                        collector=collector, maxsize=1)
    channels.append(ch)
    ch.put("a1", key="k")
    ch.put("a2", key="k")  # a pair: stored, and the queue of k is full
    ch.put("b1", key="k")
    waiting = ch.put("b2", key="k", async_op=True)  # the pair (b1, b2) waits for room
    wait_until(lambda: ch.stats()["keys"]["k"]["putters"] == 1)
    _pairs(ch, 0, 2 * SNAPSHOT_BYTES // HALF if counted else 1)
    journal = ch.stats()["journal"]
    if counted:
        assert journal["collector_states"] >= 1, journal
    assert journal["collector_pending"] == 1, journal  # the pair's output, not b1 and b2
    os.kill(ch.stats()["pid"], signal.SIGKILL)
    with pytest.raises(BrokerUnavailable):
        waiting.wait(60)
    until_available(ch, lambda: ch.put("b2", key="k", timeout=5))  # the retry in doubt
    firsts = [until_available(ch, lambda: ch.get(key="k", timeout=5)) for _ in range(2)]
    if counted:
        assert firsts == [(1, "a1", "a2"), (2, "b1", "b2")]
    else:
        assert firsts == [("a1", "a2"), ("b1", "b2")]
    with pytest.raises(TimeoutError):
        ch.get(key="k", timeout=0.5)
    assert ch.stats()["duplicate_puts"] == 1


def test_a_waiting_pair_stored_when_the_collector_empties_is_taken_once(channels, tmp_path):
    """The put that empties the collector waits for room; when it gets room its outputs are
    stored and the collector's moment of holding nothing is recorded then: that put is not
    also kept as waiting (it used to be, and came back at every restart after it was taken)."""
    ch = Channel.create("durable-emptied", journal=tmp_path / "j", collector="hookmods:Pairs",
                        maxsize=1)
    channels.append(ch)
    for half in ("a1", "a2", "b1"):
        ch.put(half, key="k")
    waiting = ch.put("b2", key="k", async_op=True)  # (b1, b2) waits; the collector is empty
    wait_until(lambda: ch.stats()["keys"]["k"]["putters"] == 1)
    assert ch.get(key="k", timeout=10) == ("a1", "a2")
    waiting.wait(30)  # stored now
    assert ch.get(key="k", timeout=10) == ("b1", "b2")
    journal = ch.stats()["journal"]
    assert journal["items"] == 0 and journal["collector_pending"] == 0, journal
    os.kill(ch.stats()["pid"], signal.SIGKILL)
    with pytest.raises(TimeoutError):  # nothing comes back
        until_available(ch, lambda: ch.get(key="k", timeout=1))


class _Snapshots:
    """A collector state for ``Journal.collected``: an item naming the snapshot's number."""

    def __init__(self) -> None:
        self.made = 0

    def __call__(self) -> Item:
        self.made += 1
        body = f"state-{self.made}".encode()
        return Item([body], 1, len(body))


def _come_and_go(journal: Journal, n: int) -> None:
    """``n`` items of another key of 4,000 bytes, each stored, taken and its removal written,
    with a ``tick`` (compaction) after each: the older segments age."""
    for _ in range(n):
        item = Item([os.urandom(4000)], 1, 4000)
        journal.stored([("other", None, item)])
        journal.taken([item])
        journal.sent()
        journal.tick(time.monotonic())


def _input(i: int) -> Item:
    return Item([i.to_bytes(4, "big") * 1024], 1, 4096)


def test_a_state_replaces_the_inputs_before_it_also_across_compaction(tmp_path, monkeypatch):
    """``STATE`` records: the newest state and the inputs after it are read back, also when
    compaction copied the state to a new segment (the segments of the inputs it replaced are
    removed); an ``IDLE`` after it leaves neither."""
    monkeypatch.setattr(collectors, "SNAPSHOT_BYTES", 16 << 10)  # every 4 inputs
    settings = JournalSettings(directory=str(tmp_path), name="states", fsync="never",
                               segment_bytes=64 << 10)
    journal = Journal(settings)
    journal.recover()
    snapshots = _Snapshots()
    try:
        for i in range(1, 42):
            journal.collected(_input(i), "k", True, 0, snapshots)
        assert journal.collector_state.written == snapshots.made >= 3
        kept = sorted(int.from_bytes(bytes(e[3].payload[0][:4]), "big")
                      for e in journal.inputs.entries.values())
        assert kept and kept[-1] == 41 and len(kept) < 41
        # the inputs' segments went: only what the state and the kept inputs need is left
        assert len(journal.store.segments) <= 3
        state_segment = next(iter(journal.collector_state.record.entries.values()))[0]
        _come_and_go(journal, 200)  # the state's segment ages
        assert journal.compaction.copied_bytes > 0
        assert next(iter(journal.collector_state.record.entries.values()))[0] is not state_segment
        assert state_segment not in journal.store.segments
    finally:
        journal.close()
    again = Journal(settings)
    try:
        again.recover()
        assert again.collector_state.recovered is not None
        assert bytes(again.collector_state.recovered.payload[0]) == f"state-{snapshots.made}".encode()
        assert [int.from_bytes(bytes(item.payload[0][:4]), "big")
                for _, item, _ in again.replay] == kept
        again.collected(_input(99), "k", False, 1)  # it holds nothing any more
        again.stored([("k", None, Item([b"out"], 1, 3))])
    finally:
        again.close()
    third = Journal(settings)
    try:
        third.recover()
        assert third.collector_state.recovered is None and third.replay == []
    finally:
        third.close()


@pytest.mark.parametrize("admitted", [False, True])
def test_the_output_of_a_waiting_put_a_state_consumed_is_stored_once(tmp_path, monkeypatch,
                                                                     admitted):
    """A state written while a put waits for room: that put's output is written as a
    ``PENDING`` record the state adopts.  Read back, it is stored (its sequence known as
    stored) -- once, also when the put got room and was stored before the broker stopped."""
    monkeypatch.setattr(collectors, "SNAPSHOT_BYTES", 16 << 10)
    settings = JournalSettings(directory=str(tmp_path), name="waiting", fsync="never")
    producer = b"p" * 16
    waiting = [("k", None, Item([b"the pair"], 1, 8, origin=(producer, 7)))]
    journal = Journal(settings)
    journal.recover()
    journal.waiting_outputs = lambda: [waiting]
    try:
        for i in range(1, 6):
            journal.collected(_input(i), "k", True, 0, _Snapshots())
        assert journal.collector_state.written >= 1 and journal.collector_state.adopted
        if admitted:  # the put got room: its output is stored under the same jid
            journal.stored(waiting)
            journal.waiting_outputs = list
            assert journal.stats()["collector_pending"] == 0
    finally:
        journal.close()
    again = Journal(settings)
    try:
        groups = again.recover()
        assert [[bytes(f) for f in item.payload] for _, items in groups for item in items] == \
            [[b"the pair"]]
        assert again.sequences.windows[producer].marked(7)
        (_, (stored,)), = groups
        again.taken([stored])  # a consumer takes it
        again.sent()
    finally:
        again.close()
    third = Journal(settings)
    try:  # taken: not stored again by a later start (the state that adopted it is still there)
        assert third.recover() == []
    finally:
        third.close()


def _waiting(body: bytes, seq: int) -> list:
    """The outputs of a put that waits for room, as ``Journal.waiting_outputs`` lists them."""
    return [("k", None, Item([body], 1, len(body), origin=(b"p" * 16, seq)))]


def test_outputs_an_idle_adopted_survive_compaction_and_a_put_that_ended_unstored_does_not(
        tmp_path):
    """A waiting put's output adopted by an ``IDLE``: compaction that copies its ``PENDING``
    record out of the old segment (the ``IDLE`` goes with it) writes which records are
    adopted, so a start stores it; the output of a put that timed out is removed, not stored
    at a start; an item whose jid came from another record (a replayed input) gets its own."""
    settings = JournalSettings(directory=str(tmp_path), name="adopted", fsync="never",
                               segment_bytes=64 << 10)
    journal = Journal(settings)
    journal.recover()
    try:
        kept, timed_out = _waiting(b"kept", 1), _waiting(b"timed out", 2)
        journal.waiting_outputs = lambda: [kept, timed_out]
        journal.collected(_input(1), "k", True, 0)  # the collector holds something
        journal.collected(_input(2), "k", False, 0)  # and nothing: an IDLE adopts both
        assert journal.stats()["collector_pending"] == 2
        journal.unstored(timed_out)  # it ended without room
        journal.waiting_outputs = lambda: [kept]
        assert journal.stats()["collector_pending"] == 1
        replayed = Item([b"replayed"], 1, 8, jid=1)  # the jid of its own (input) record
        journal.stored([("r", None, replayed)])
        assert replayed.jid > 2
        first = journal.store.segments[0]
        _come_and_go(journal, 100)  # the first segment is compacted
        assert first not in journal.store.segments and journal.compaction.copied_bytes > 0
    finally:
        journal.close()
    again = Journal(settings)
    try:
        groups = dict(again.recover())
        assert {key: [bytes(item.payload[0]) for item in items]
                for key, items in groups.items()} == {"k": [b"kept"], "r": [b"replayed"]}
    finally:
        again.close()


class _HoldUntilReleased(Collector):
    """Holds the bodies of ``("hold", body)`` puts (nothing out), lets go of them at a
    ``("release", body)`` put; every other put's body goes out as it is."""

    def setup(self, ctx):
        self.held = []

    def collect(self, item, key):
        command, body = item
        if command == "hold":
            self.held.append(body)
            return
        if command == "release":
            self.held.clear()
        yield key, body

    def holds_state(self):
        return bool(self.held)


def test_room_freed_while_a_waiting_put_is_recorded_admits_it_once(tmp_path):
    """The put that empties the collector waits for room; when a get makes room, recording
    it writes an ``IDLE`` that frees a journal segment, which admits waiting puts: not that
    put again (it was stored twice and answered twice)."""
    replies: list[int] = []

    def encode(value, weight):
        return Item([msgpack.packb(value)], weight, 16)

    core = QueueCore(name="reenter", maxsize=1, collector=_HoldUntilReleased(),
                     dispatcher=Dispatcher(), reply=lambda client, rid, **kw: replies.append(rid),
                     decode_item=lambda item: msgpack.unpackb(item.payload[0]),
                     encode_item=encode)
    journal = Journal(JournalSettings(directory=str(tmp_path), name="reenter", fsync="never",
                                      segment_bytes=64 << 10))
    journal.recover()
    core.attach_log(journal)
    journal.on_room = core.waiters.admit_putters
    journal.waiting_outputs = lambda: [req.outputs for req in core.waiters.putters]
    producer, consumer = Client(address=b"p"), Client(address=b"c")
    try:
        for rid, value in enumerate([["hold", "x" * 40000], ["hold", "y" * 40000],
                                     ["pass", "filler"]], 1):  # the held puts fill a segment
            assert core.put(producer, rid, "k", encode(value, 1), None, False) is True
        waiting = core.put(producer, 4, "k", encode(["release", "P"], 1), None, False)
        assert waiting is not True and waiting is not False  # it waits: k is full
        core.get(consumer, 10, "k", None, False, ack=True)  # a lease takes the filler: room
        queue = core.queues.keys["k"].shared
        assert [msgpack.unpackb(item.payload[0]) for item in queue] == ["P"]
        assert replies.count(4) == 1
    finally:
        journal.close()


def test_a_replicas_collector_passes_on_what_the_broker_asks_of_stateful_collectors():
    """A distributed channel's replica wraps its collector: ``holds_state`` and the state
    methods reach the wrapped collector only where it has them, so the broker treats the
    wrapper as it would the collector (a durable replica keeps the puts a stateful one needs,
    and its snapshots)."""
    counted = wrap_collector(CountedPairs(), None)  # type: ignore[arg-type]
    counted.setup(None)
    counted.inner.waiting["k"] = "half"
    assert type(counted).holds_state is not Collector.holds_state
    assert counted.holds_state() is True
    assert counted.state_dict() == {"pairs": 0, "waiting": [["k", "half"]]}
    counted.load_state_dict({"pairs": 5, "waiting": []})
    assert counted.inner.pairs == 5 and counted.holds_state() is True
    pairs = wrap_collector(Pairs(), None)  # type: ignore[arg-type]
    assert type(pairs).holds_state is not Collector.holds_state
    assert type(pairs).state_dict is Collector.state_dict  # no snapshots: every put is kept
