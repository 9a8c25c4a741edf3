"""The same program on a broker channel, a local channel and a distributed one: leases shared by
the handles of a process, the form arrays and tensors arrive in, the checks of ``consumer``
and ``timeout``, and a closed handle's ``stats``."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import warnings
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import wait_until
from zchannel.broker import BrokerUnavailable, Channel, ChannelError, ChannelNotFound
from zchannel.broker.errors import QueueEmpty
from zchannel.broker.wire.protocol import Full, Peek, QSize

pytestmark = pytest.mark.timeout(120)


def test_a_closed_handle_leaves_its_leases_to_the_other_handles_of_its_process(make):
    ch = make("leases", lease_timeout=60.0)
    other = Channel.connect(ch.name)
    try:
        ch.put("a", key="k")
        delivery = other.get(key="k", ack=True, timeout=10)
        ch.ack(delivery)  # acknowledged through another handle of the process

        ch.put("x", key="k")
        delivery = other.get(key="k", ack=True, timeout=10)
        other.close()  # the lease holder closes while ch stays open
        assert ch.qsize("k") == 0  # not handed back to the queue
        ch.ack(delivery)
        assert ch.qsize("k") == 0 and ch.stats()["leases"] == 0
    finally:
        other.close()


def test_the_last_handle_of_a_process_returns_its_leases(make):
    if not make.local:
        pytest.skip("a process's last handle of a broker is its connection's (test_handles.py)")
    ch = make("lastlease", lease_timeout=60.0)
    other = Channel.connect(ch.name)
    third = Channel.connect(ch.name, identity="reader:0")
    ch.put("x", key="k")
    third.get(key="k", ack=True, timeout=10)
    pending = third.get(key="k", async_op=True, timeout=30)
    other.close()
    assert ch.qsize("k") == 0
    third.close()  # the only handle of identity reader:0: its lease comes back, its get fails
    with pytest.raises(ChannelError, match="closed"):
        pending.wait(10)
    assert ch.qsize("k") == 1 and ch.get(key="k", timeout=10) == "x"


def test_arrays_and_tensors_arrive_contiguous_and_writable(make):
    ch = make("forms")
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    frozen = base.copy()
    frozen.flags.writeable = False
    sent = {"T": base.T, "reversed": base[::-1], "frozen": frozen,
            "t": torch.arange(12.0).reshape(3, 4).t(), "step": torch.arange(30)[::3]}
    for name, value in sent.items():
        ch.put(value, key=name)
    for name, value in sent.items():
        got = ch.get(key=name, timeout=10)
        assert type(got) is type(value), name
        if isinstance(got, np.ndarray):
            assert got.flags.c_contiguous and got.flags.writeable, name
            assert np.array_equal(got, value) and got.dtype == value.dtype, name
            got[0] = -1  # a consumer may write in place
        else:
            assert got.is_contiguous() and torch.equal(got, value), name


def test_the_consumer_of_qsize_full_and_peek_is_checked_the_same_everywhere(make):
    ch = make("consumerarg")
    for call in (ch.qsize, ch.full):
        with pytest.raises(TypeError, match="consumer must be a str"):
            call("k", consumer=3)
        with pytest.raises(ValueError, match="invalid consumer id"):
            call("k", consumer="bad id")
    with pytest.raises(TypeError, match="consumer must be a str"):
        ch.peek("k", consumer=3)
    with pytest.raises(ValueError, match="invalid consumer id"):
        ch.peek("k", consumer="bad id")
    assert ch.qsize("k", consumer="actor:0") == 0 and not ch.full("k", consumer="actor:0")


def test_the_broker_checks_the_consumer_of_what_arrives(make_remote):
    """The records a client would refuse, sent anyway: the broker refuses them the same way."""
    ch = make_remote("consumerwire")
    for rec in (QSize(id=0, key="k", consumer="bad id"), Full(id=0, key="k", consumer="x"),
                Peek(id=0, key="k", count=1, consumer="no:rank")):
        with pytest.raises(ValueError, match="invalid consumer id"):
            ch._submit(rec, wait=True).wait(10)
    with pytest.raises(TypeError, match="consumer must be a str"):
        ch._submit(QSize(id=0, key="k", consumer=7), wait=True).wait(10)
    ch.put(1, key="k")
    assert ch.get(key="k", timeout=10) == 1  # the broker serves on


def test_a_numpy_timeout_is_taken_without_a_warning(make):
    ch = make("nptimeout")
    ch.put(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ch.get(timeout=np.float32(5.0)) == 1
        with pytest.raises(TimeoutError):
            ch.get(timeout=np.float64(0.05))
    with pytest.raises(ValueError, match="timeout"):
        ch.get(timeout=np.float32("inf"))


def test_a_closed_handle_says_so_for_stats_too(make):
    ch = make("statsafter")
    other = Channel.connect(ch.name)
    assert other.stats()["name"] == ch.name
    other.close()
    with pytest.raises(ChannelError, match="this channel handle is closed") as raised:
        other.stats()
    assert not isinstance(raised.value, BrokerUnavailable)  # the brokers are up
    wait_until(lambda: ch.stats()["name"] == ch.name)


def test_a_lease_is_acknowledged_only_through_the_connection_that_got_it(make):
    """Handles of other identities use other connections: their ``ack`` of a lease they do not
    hold is refused, and the lease stays for its holder (it still comes back if not acked)."""
    ch = make("leaseowner", lease_timeout=60.0)
    mine = Channel.connect(ch.name, identity="learner:0")
    theirs = Channel.connect(ch.name, identity="learner:1")
    try:
        ch.put("x", key="k")
        delivery = mine.get(key="k", ack=True, timeout=10)
        with pytest.raises(ValueError, match="held by another connection"):
            theirs.ack(delivery)
        assert ch.stats()["leases"] == 1
        mine.close()  # the holder goes: its lease comes back
        assert ch.get(key="k", timeout=10) == "x"
    finally:
        mine.close()
        theirs.close()


def test_a_str_that_utf8_cannot_hold_is_the_same_type_error_on_every_path(make):
    """A lone surrogate (what ``os.fsdecode`` makes of undecodable bytes) cannot travel: as an
    item, inside one, or in a key it is a ``TypeError`` naming the cause, on a local channel
    too (which took and delivered it before; the broker path raised ``UnicodeEncodeError``
    for a whole item or a key)."""
    class Text(str):
        pass

    ch = make("surrogates")
    for item in ("\udc80", {"a": "\udc80"}, ["ok", "\ud800"], {"\udc80": 1}, Text("\udc80"),
                 [Text("\udc80")]):
        with pytest.raises(TypeError, match="cannot encode item: .*surrogates not allowed"):
            ch.put(item)
    for key in ("\udc80", ("a", "\ud800")):
        with pytest.raises(TypeError, match="a key str must be valid Unicode"):
            ch.put(1, key=key)
        with pytest.raises(TypeError, match="a key str must be valid Unicode"):
            ch.qsize(key=key)
    ch.put("é\u20ac", key="clé")  # valid non-ASCII text travels as it is
    assert ch.get(key="clé", timeout=30) == "é\u20ac"
    assert ch.qsize() == 0


def test_local_create_refuses_options_that_cannot_travel_as_the_broker_path_does(run_dir):
    """``options`` must be msgpack-able (hooks read them from ``ChannelContext``): a local
    channel refuses what a broker channel refuses, with the same message, and is not made."""
    refusals = []
    for local in (False, True):
        with pytest.raises(TypeError) as raised:
            Channel.create("badoptions", local=local, options={"x": object()})
        refusals.append(str(raised.value))
    assert refusals[0] == refusals[1] and "builtins.object" in refusals[1]
    with pytest.raises(ChannelNotFound):
        Channel.connect("badoptions", timeout=1.0)


def test_a_broker_channel_may_not_take_the_name_of_a_local_one(run_dir):
    """One name, one channel: ``connect(name)`` in a process finds its local channel, so a
    broker channel of that name would be one nobody here could reach; ``create`` refuses it
    and starts no broker."""
    local = Channel.create("onename", local=True)
    try:
        with pytest.raises(ValueError, match="local channel named 'onename'"):
            Channel.create("onename")
        local.put("x")
        other = Channel.connect("onename")
        assert other.is_local and other.get(timeout=5) == "x"
        other.close()
    finally:
        local.shutdown()
    with pytest.raises(ChannelNotFound):
        Channel.connect("onename", timeout=1.0)


def test_a_local_channel_may_not_take_the_name_of_a_live_broker(run_dir):
    """The other way round: ``create(name, local=True)`` while a broker serves ``name`` would
    hide that broker from ``connect(name)`` in this process; it is refused, and the broker
    channel stays reachable by name."""
    broker = Channel.create("onebroker")
    try:
        broker.put("y")
        with pytest.raises(ValueError, match="a broker on this host serves channel 'onebroker'"):
            Channel.create("onebroker", local=True)
        other = Channel.connect("onebroker")
        assert not other.is_local and other.get(timeout=30) == "y"
        other.close()
    finally:
        broker.shutdown()
    local = Channel.create("onebroker", local=True)  # the broker is gone: the name is free
    assert local.is_local
    local.shutdown()


def test_a_local_channel_needs_no_run_directory(monkeypatch, tmp_path):
    """Looking for a broker of the name must not make a local channel depend on the run
    directory: one that is unsafe (writable by others) finds no broker, and the channel is made."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("ZCHANNEL_RUN_DIR", str(shared))
    ch = Channel.create("inprocess", local=True)
    try:
        ch.put(1)
        assert ch.get(timeout=5) == 1
    finally:
        ch.shutdown()


def test_channel_names_end_where_they_seem_to(run_dir):
    """A name is 1-64 characters of ``[A-Za-z0-9._-]`` and nothing after: a trailing newline
    (which ``$`` lets through) is refused, as is a 65th character after it."""
    for name in ("nl\n", "a" * 64 + "\n"):
        for local in (False, True):
            with pytest.raises(ValueError, match="invalid channel name"):
                Channel.create(name, local=local)
        with pytest.raises(ValueError, match="invalid channel name"):
            Channel.connect(name)


def test_a_handle_dropped_unclosed_leaves_as_a_closed_one(make):
    """A consumer's handle garbage collected without ``close()``: its lease comes back at once
    and its consumer id leaves (its private items are dealt again), as when it is closed."""
    if make.distributed:
        pytest.skip("dealing is per replica there (test_distributed.py)")
    ch = make("dropped", lease_timeout=60.0, dispatcher="round_robin", consumers=["actor:0"])
    handle = Channel.connect(ch.name, identity="actor:1")
    with pytest.raises(QueueEmpty):
        handle.get_nowait(key="k")  # actor:1 joins
    for i in range(4):  # dealt to actor:0, actor:1, actor:0, actor:1
        ch.put(f"i{i}", key="k")
    assert handle.get(key="k", ack=True, timeout=10).item == "i1"  # leased, not acknowledged
    del handle
    gc.collect()
    wait_until(lambda: ch.stats()["consumers"] == ["actor:0"], timeout=30)
    stats = ch.stats()
    assert stats["leases"] == 0 and stats["keys"]["k"]["private"] == {"actor:0": 4}


def test_a_blocking_call_in_a_callback_of_a_local_channel_is_refused_not_a_hang(make):
    """A local channel completes requests in the calling thread, holding the channel: a
    blocking call in a done-callback there would wait for itself (its deadline never comes),
    so it is a ``RuntimeError``, as on the thread that reads a broker connection's replies."""
    if not make.local:
        pytest.skip("a broker channel's case: test_reentry.py")
    ch = make("cbcall")
    seen: dict = {}
    pending = ch.get(key="k", async_op=True, timeout=60)
    pending.add_done_callback(lambda _: seen.setdefault("error", _blocking_get(ch)))
    ch.put(42, key="k")  # completes the get here, running the callback
    assert pending.wait(30) == 42
    assert isinstance(seen["error"], RuntimeError) and "would wait for itself" in str(
        seen["error"])
    ch.put(7, key="k2")
    assert ch.get(key="k2", timeout=30) == 7 and ch.qsize("k") == 0  # the channel goes on


def _blocking_get(ch: Channel) -> BaseException | None:
    try:
        ch.get(key="other", timeout=0.5)
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        return exc
    return None


def test_stats_name_the_lease_timeout(make):
    ch = make("leasestat", lease_timeout=7.0)
    assert ch.stats()["lease_timeout"] == 7.0


def test_close_lets_a_put_waiting_for_room_get_in(make):
    """``close()`` waits (up to the heartbeat expiry) for this handle's puts: one waiting for
    room gets in when a consumer makes room meanwhile."""
    if make.distributed:
        pytest.skip("the same handle code as a broker channel's")
    ch = make("closeput", maxsize=1)
    producer = Channel.connect(ch.name)
    producer.put("first", key="k")
    waiting = producer.put("second", key="k", async_op=True, timeout=60)
    wait_until(lambda: ch.stats()["keys"]["k"].get("putters", 0) == 1, timeout=30)
    closing = threading.Thread(target=producer.close)
    closing.start()
    assert ch.get(key="k", timeout=10) == "first"  # room: the waiting put gets in
    closing.join(30)
    assert not closing.is_alive() and waiting.wait(10) is None
    assert ch.get(key="k", timeout=10) == "second"


def test_copy_and_target_weight_are_checked_the_same_everywhere(make):
    ch = make("argchecks")
    ch.put(1, key="k")
    for call in (lambda: ch.get(key="k", timeout=5, copy="yes"),
                 lambda: ch.get_nowait(key="k", copy=1),
                 lambda: ch.get_batch(1, key="k", timeout=5, copy="no")):
        with pytest.raises(TypeError, match="copy must be None, True or False"):
            call()
    for target in (-1, 0, float("nan")):
        with pytest.raises(ValueError, match=r"target_weight must be an int or a finite float "
                                             r"(in \(0, 2\*\*53\]|> 0)"):
            ch.get_batch(target, key="k", timeout=5)
    assert ch.get(key="k", timeout=5, copy=True) == 1  # nothing was taken meanwhile


def test_a_weight_of_another_number_type_is_refused_not_rounded(make):
    """A weight is an int or a float (numpy's count as the one they equal): a ``Fraction`` is
    refused as a ``Decimal`` is, not stored as a rounded float; nothing is stored."""
    ch = make("weights")
    for weight in (Fraction(1, 3), Decimal("0.5")):
        with pytest.raises(ValueError, match=r"weight must be an int or a finite float"):
            ch.put("x", weight, key="k", timeout=5)
    ch.put("a", np.float32(0.5), key="k", timeout=5)
    ch.put("b", np.int16(2), key="k", timeout=5)
    assert ch.qsize("k") == 2
    assert ch.get_batch(2.5, key="k", timeout=5) == ["a", "b"]


def test_closing_a_handle_with_requests_waiting_one_behind_the_other(make):
    """A handle closed with a ``get_batch`` waiting and a get waiting behind it on one key:
    ``close()`` returns, both fail with ``ChannelError``, the item stays queued and the
    consumer id leaves (a local channel raised ``KeyError`` from ``close()``: withdrawing
    the batch served the get, and the handle stayed a consumer)."""
    if make.distributed:
        pytest.skip("the same handle code as a broker channel's")
    ch = make("close-waiting")
    handle = Channel.connect(ch.name, identity="a:0")
    ch.put("item", 1, key="k")
    batch = handle.get_batch(5, key="k", async_op=True)  # waits: weight 1 of 5
    behind = handle.get(key="k", async_op=True)  # waits behind it
    assert wait_until(lambda: ch.stats()["keys"]["k"]["getters"] == 2, timeout=10)
    handle.close()
    for work in (batch, behind):
        with pytest.raises(ChannelError, match="closed"):
            work.wait(10)
    assert wait_until(lambda: ch.stats()["consumers"] == [], timeout=30)
    assert ch.qsize("k") == 1 and ch.get(key="k", timeout=10) == "item"


def _get_in_forked_child(ch, result) -> None:
    """A forked child's ``get`` on ``ch``: what it raised (or got), and whether ``create``
    of the name makes the child's own local channel."""
    try:
        outcome = ("got", ch.get(timeout=0.5))
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    own = Channel.create(ch.name, local=True)
    own.put("child's")
    result.put((outcome, own.get(timeout=5)))
    own.shutdown()


def test_a_local_channel_in_a_forked_child_is_a_clear_error_not_a_copy(run_dir):
    """A local channel lives in its creating process: a forked child (multiprocessing's fork,
    a DataLoader worker) has only a copy, whose timer thread does not exist there; its handles
    raise ``ChannelError`` at once (no get that never times out, no item taken from a copy
    while the parent delivers it too), and the name is free for the child's own channel."""
    ch = Channel.create("forked", local=True)
    try:
        ch.put("parent's")
        context = multiprocessing.get_context("fork")
        result = context.Queue()
        child = context.Process(target=_get_in_forked_child, args=(ch, result))
        child.start()
        (kind, message), own = result.get(timeout=60)
        child.join(60)
        assert kind == "ChannelError" and "is a fork of it and has only a copy" in message
        assert own == "child's" and child.exitcode == 0
        assert ch.get(timeout=5) == "parent's"  # the parent's item stayed the parent's
    finally:
        ch.shutdown()


def test_a_local_handle_reaches_the_channel_made_again_under_its_name(run_dir):
    """As a broker channel's handle reconnects to a broker serving its address again, a local
    channel's handle reaches the channel ``create(name, local=True)`` makes after the first
    one's ``shutdown()``; until then it is ``BrokerUnavailable``."""
    first = Channel.create("again", local=True)
    other = Channel.connect("again")
    first.shutdown()
    with pytest.raises(BrokerUnavailable, match="was shut down"):
        other.put("lost")
    second = Channel.create("again", local=True)
    try:
        second.put("new")
        assert other.get(timeout=5) == "new"
        other.put("back")
        assert second.get(timeout=5) == "back"
    finally:
        other.close()
        second.shutdown()


def test_create_checks_its_numeric_settings_the_same_local_or_not(run_dir):
    """``shm_threshold``, ``fsync_interval`` and ``max_journal_bytes`` out of range are the same
    ``ValueError`` from a local ``create`` as from a broker's (the local one used to take them)."""
    for setting, value in (("shm_threshold", -1), ("fsync_interval", 0),
                           ("max_journal_bytes", -5)):
        messages = []
        for local in (False, True):
            with pytest.raises(ValueError) as raised:
                Channel.create("numbers", local=local, **{setting: value})
            messages.append(str(raised.value))
        assert messages[0] == messages[1] and setting in messages[0]
