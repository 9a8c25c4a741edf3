"""A ``puts`` record of new small inline puts that all fit is stored in one pass
(``server/putrun.py``); every other batch goes put by put.  Both give the outcome of single
puts: these tests send batches at the edges of the one-pass case over a real broker and check
per-key FIFO, getters served as single puts serve them, ``maxsize``, duplicate ids and
retry-safe sequences."""

from __future__ import annotations

import os

import msgpack
import pytest
from conftest import drain
from test_put_batches import exchange, put, raw_dealer
from zchannel.broker import Channel
from zchannel.broker.wire.protocol import pack_header


def test_a_batch_over_two_keys_keeps_each_keys_order(channels):
    ch = Channel.create("run-keys")
    channels.append(ch)
    with raw_dealer(ch, os.urandom(16)) as raw:
        batch = {"op": "puts", "id": 40, "p": [put(2, "a", 1), put(3, "b", 10), put(4, "a", 2),
                                                put(5, "b", 20), put(6, "a", 3)]}
        assert exchange(raw, [batch]) == [{"id": 40, "r": [2, 3, 4, 5, 6]}]
    assert [ch.get("a", timeout=5) for _ in range(3)] == [1, 2, 3]
    assert [ch.get("b", timeout=5) for _ in range(2)] == [10, 20]
    stats = ch.stats()
    assert stats["puts"] == 5 and stats["put_batches"] == 1 and stats["bytes_held"] == 0


def test_a_waiting_get_batch_is_served_the_batch_in_order(channels):
    ch = Channel.create("run-getters")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        # one message: the get_batch parks first; the turn serves it the four items (the
        # put-by-put path gives the same)
        waiting = {"op": "get_batch", "id": 30, "k": "k", "tw": 4, "t": 30.0}
        batch = {"op": "puts", "id": 40, "p": [put(i, "k", i, w=1) for i in range(2, 6)]}
        replies = {rec["id"]: rec for rec in exchange(raw, [waiting, batch])}
        assert replies[40] == {"id": 40, "r": [2, 3, 4, 5]}
        assert replies[30] == {"id": 30, "nf": 4, "n": [1, 1, 1, 1]}  # four items, as frames
    assert ch.qsize("k") == 0 and ch.stats()["bytes_held"] == 0


def test_a_batch_that_just_fits_maxsize_is_stored_and_the_next_put_waits(channels):
    ch = Channel.create("run-full", maxsize=4)
    channels.append(ch)
    with raw_dealer(ch, os.urandom(16)) as raw:
        assert exchange(raw, [put(2, "k", 0)]) == [{"id": 2}]
        batch = {"op": "puts", "id": 40, "p": [put(i, "k", i) for i in range(3, 6)]}
        assert exchange(raw, [batch]) == [{"id": 40, "r": [3, 4, 5]}]
        with pytest.raises(TimeoutError):
            ch.put("late", key="k", timeout=0)
        over = {"op": "puts", "id": 41, "p": [put(i, "k", i) for i in range(6, 8)]}
        assert exchange(raw, [over]) == [{"id": 41, "r": []}]  # both wait for room
        assert ch.get("k", timeout=5) == 0
        assert raw.poll(10_000)
        assert msgpack.unpackb(raw.recv_multipart()[0]) == [{"id": 6}]
    assert [ch.get("k", timeout=5) for _ in range(4)] == [3, 4, 5, 6]


def test_a_put_under_the_id_of_a_waiting_get_fails_alone(channels):
    ch = Channel.create("run-dup-id")
    channels.append(ch)
    with raw_dealer(ch) as raw:
        raw.send_multipart([pack_header([{"op": "get", "id": 7, "k": "empty", "t": 30.0}])])
        batch = {"op": "puts", "id": 40, "p": [put(6, "k", 1), put(7, "k", 2), put(8, "k", 3)]}
        replies = {rec["id"]: rec for rec in exchange(raw, [batch])}
        assert replies[40] == {"id": 40, "r": [6, 8]}
        assert replies[7]["e"][0] == "ValueError" and "already used" in replies[7]["e"][1]
    assert [ch.get("k", timeout=5) for _ in range(2)] == [1, 3] and ch.qsize("k") == 0


def test_a_batch_repeating_some_sequences_stores_only_the_new_puts(channels):
    ch = Channel.create("run-retry")
    channels.append(ch)
    producer = os.urandom(16)
    with raw_dealer(ch, producer) as raw:
        first = {"op": "puts", "id": 40, "p": [put(i, "k", i) for i in range(2, 5)]}
        assert exchange(raw, [first]) == [{"id": 40, "r": [2, 3, 4]}]
        again = {"op": "puts", "id": 41, "p": [put(50, "k", 4, sq=4), put(51, "k", 5)]}
        assert exchange(raw, [again]) == [{"id": 41, "r": [50, 51]}]
        out_of_order = {"op": "puts", "id": 42, "p": [put(60, "k", 6), put(55, "k", 7)]}
        assert exchange(raw, [out_of_order]) == [{"id": 42, "r": [60, 55]}]
    assert [ch.get("k", timeout=5) for _ in range(5)] == [2, 3, 4, 5, 6]
    assert ch.get("k", timeout=5) == 7 and ch.qsize("k") == 0
    assert ch.stats()["duplicate_puts"] == 1


def test_a_journaled_batch_survives_a_kill_and_its_retry_is_not_stored_again(brokers, run_dir,
                                                                            tmp_path):
    """On a durable channel a batch stored in one pass is journaled, with its put sequences,
    before its answer leaves: a broker SIGKILLed right after the answer and started again on
    the journal holds every put in per-key order, and the same puts sent again by their
    producer are acknowledged as stored, not stored twice."""
    config = dict(name="run-durable", address=f"ipc://{run_dir}/run-durable.sock",
                  journal=str(tmp_path / "j"))
    pid = brokers.start(**config)
    producer = os.urandom(16)
    batch = {"op": "puts", "id": 40, "p": [put(i, "ab"[i % 2], i) for i in range(2, 9)]}
    ch = Channel.connect(config["address"])
    with raw_dealer(ch, producer) as raw:
        assert exchange(raw, [batch]) == [{"id": 40, "r": list(range(2, 9))}]
    ch.close()
    brokers.kill(pid)  # at once: nothing after the answer is waited for
    brokers.start(**config)
    ch = Channel.connect(config["address"])
    try:
        with raw_dealer(ch, producer) as raw:
            assert exchange(raw, [dict(batch, id=41)]) == [{"id": 41, "r": list(range(2, 9))}]
        assert ch.stats()["duplicate_puts"] == 7
        assert drain(ch, "a") == [2, 4, 6, 8] and drain(ch, "b") == [3, 5, 7]
    finally:
        ch.close()
