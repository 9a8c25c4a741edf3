"""Collector -> Dispatcher pipeline: resolution, hooks in the broker, dealing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import hookmods
import pytest
import torch
from conftest import drain, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from zchannel.broker import Channel, HookError, QueueFull
from zchannel.broker.core.hookpipeline import hook_name
from zchannel.broker.server.forkclient import ENV as FORKSERVER_ENV
from zchannel.broker.server.starting import broker_environ
from zchannel.hooks import (
    ChannelContext,
    Collector,
    register_collector,
    register_dispatcher,
    resolve_collector,
    resolve_dispatcher,
)
from zchannel.hooks.base import consumer_sort_key
from zchannel.hooks.builtin import (
    FlattenBatch,
    LeastLoadedDispatcher,
    LeastLoadedStealingDispatcher,
    RoundRobinDispatcher,
)

pytestmark = pytest.mark.timeout(90)

SAMPLES = ["s0", "s1", "s2", "s3", "s4", "s5"]
EXPECTED = {"actor:0": ["s0", "s3"], "actor:1": ["s1", "s4"], "actor:2": ["s2", "s5"]}


# -- resolution ---------------------------------------------------------------------------------


def test_resolution_forms():
    import hookmods
    import seed_hooks

    assert isinstance(resolve_collector("flatten_batch"), FlattenBatch)
    assert isinstance(resolve_collector("FLATTEN_BATCH"), FlattenBatch)  # case-insensitive
    assert isinstance(resolve_collector(FlattenBatch), FlattenBatch)
    inst = FlattenBatch()
    assert resolve_collector(inst) is inst
    assert isinstance(resolve_collector("hookmods:Rekey"), hookmods.Rekey)
    assert isinstance(resolve_dispatcher("round_robin"), RoundRobinDispatcher)
    assert isinstance(resolve_dispatcher("even"), seed_hooks.EvenDispatcher)
    assert not resolve_dispatcher(None).deals and not resolve_dispatcher("shared").deals
    assert resolve_dispatcher("least_loaded").deals
    with pytest.raises(ValueError, match="flatten_batch"):  # unknown names list the known ones
        resolve_collector("no_such_collector")
    with pytest.raises(TypeError):
        resolve_collector(RoundRobinDispatcher)  # wrong base
    with pytest.raises(TypeError):
        resolve_dispatcher("hookmods:NotAHook")
    with pytest.raises(TypeError):
        resolve_collector(42)


def test_registration_rules():
    @register_collector("Test_Dup_Name")
    class One(Collector):
        pass

    register_collector("test_dup_name")(One)  # the same class again: a no-op
    assert isinstance(resolve_collector("test_dup_name"), One)

    class Other(Collector):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_collector("test_dup_name")(Other)
    with pytest.raises(TypeError):
        register_dispatcher("not_a_dispatcher")(One)


def test_entry_point_plugin_is_found():
    # setup.cfg publishes zchannel.embodied's hooks under the zchannel.hooks entry-point group
    pytest.importorskip("zchannel.embodied.collector")
    assert resolve_dispatcher("embodied_trajectory").deals


def test_hook_class_published_under_an_entry_point_name(tmp_path, monkeypatch, channels):
    """docs/hooks.md: a hook may be "a name published under the zchannel.hooks entry-point group" --
    also when the entry point names a hook class that is not registered by a decorator."""
    dist = tmp_path / "zchannel_audit_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: zchannel-audit-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[zchannel.hooks]\nAudit_Scaled = hookmods:Scaled\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    ch = Channel.create("published", collector="audit_scaled")  # the broker finds it
    channels.append(ch)
    ch.put(4)
    assert ch.get(timeout=5) == 4  # Scaled() with its default factor 1
    with pytest.raises(ValueError, match="known collectors: .*audit_scaled"):
        Channel.create("published2", collector="no_such_collector")
    with pytest.raises(ValueError, match="unknown dispatcher"):  # a collector, not a dispatcher
        Channel.create("published3", dispatcher="audit_scaled")
    from zchannel.hooks import registry

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.setattr(registry, "_entry_point_objects", {})
    import hookmods

    assert type(resolve_collector("AUDIT_SCALED")) is hookmods.Scaled  # in this process too


# -- dispatcher rules (pure) ----------------------------------------------------------------------


def _ctx(consumers):
    return ChannelContext(name="t", consumers=tuple(consumers))


def test_round_robin_order_and_per_key_state():
    d = RoundRobinDispatcher()
    d.setup(_ctx(["actor:0", "actor:1", "actor:2", "actor:10"]))  # (group, int(rank)) order
    assert [d.route(None, "a") for _ in range(5)] == [
        "actor:0", "actor:1", "actor:2", "actor:10", "actor:0"]
    # per-key: another key starts its own rotation
    assert d.route(None, "b") == "actor:0"
    assert d.route(None, "a") == "actor:1"


@settings(max_examples=60, deadline=None)
@given(
    n_consumers=st.integers(1, 6),
    events=st.lists(st.one_of(st.just("item"), st.just("join"), st.just("leave")), max_size=80),
)
def test_round_robin_counts_differ_by_at_most_one(n_consumers, events):
    present = [f"w:{i}" for i in range(n_consumers)]
    ctx = _ctx(present)
    d = RoundRobinDispatcher()
    d.setup(ctx)
    throughout = set(present)
    counts: dict[str, int] = {}
    next_id = n_consumers
    for event in events:
        if event == "join":
            present.append(f"w:{next_id}")
            next_id += 1
        elif event == "leave" and len(present) > 1:
            gone = present.pop(0)
            throughout.discard(gone)
        else:
            target = d.route(None, "k")
            counts[target] = counts.get(target, 0) + 1
            continue
        ctx.consumers = tuple(sorted(present, key=lambda c: int(c.split(":")[1])))
    dealt = [counts.get(c, 0) for c in throughout]
    if dealt:
        assert max(dealt) - min(dealt) <= 1


def test_least_loaded_and_stealing_rules():
    d = LeastLoadedDispatcher()
    ctx = _ctx(["a:0", "a:1"])
    d.setup(ctx)
    assert [d.route(None, "k") for _ in range(3)] == ["a:0", "a:1", "a:0"]
    ctx.consumers = ("a:0", "a:1", "a:2")  # a newcomer gets items until it catches up
    assert [d.route(None, "k") for _ in range(3)] == ["a:2", "a:1", "a:2"]
    assert d.route(None, "other") == "a:0"
    s = LeastLoadedStealingDispatcher()
    s.setup(ctx)
    assert s.rebalance("k", "a:0", {"a:0": 0, "a:1": 2, "a:2": 2}) == "a:1"  # ties -> first id
    assert s.rebalance("k", "a:0", {"a:0": 0, "a:1": 0}) is None


# -- through a broker ---------------------------------------------------------------------------


def _consumer_code() -> str:
    return """
        import sys
        from zchannel.broker import Channel
        ch = Channel.connect(sys.argv[1], identity=sys.argv[2])
        print("ready", flush=True)
        n = int(sys.argv[3])
        print(" ".join(str(ch.get(timeout=30)) for _ in range(n)), flush=True)
        ch.close()
    """


@pytest.mark.parametrize(
    "collector,dispatcher",
    [("flatten_batch", "round_robin"), ("seed_flatten_batch", "even"),
     ("seed_hooks:FlattenBatchCollector", "seed_hooks:EvenDispatcher")],
)
def test_seed_example_three_consumer_processes(workers, channels, collector, dispatcher):
    import seed_hooks  # noqa: F401 - registers the seed's names in the creator too
    ch = Channel.create("samples", collector=collector, dispatcher=dispatcher,
                        producers=["rollout"], consumers={"actor": 3})
    channels.append(ch)
    ch.put(SAMPLES)  # dealt before any consumer connects: declared consumers exist from creation
    assert ch.stats()["keys"]["default_queue"]["private"] == {c: 2 for c in EXPECTED}
    procs = {c: workers.start(_consumer_code(), ch.address, c, "2") for c in EXPECTED}
    for proc in procs.values():
        workers.wait_line(proc, "ready")
    for consumer, proc in procs.items():
        assert workers.finish(proc).split() == EXPECTED[consumer]


def test_hook_registered_at_run_time_reaches_the_broker(channels):
    """A class registered by a call in the creating process, not by its module's import, works
    by its name and as the class: the broker child imports it and registers the name too."""
    register_collector("registered_at_run_time")(hookmods.RegisteredAtRunTime)
    for spec in ("registered_at_run_time", hookmods.RegisteredAtRunTime):
        ch = Channel.create("runtime", collector=spec)
        channels.append(ch)
        assert ch.stats()["collector"] == "registered_at_run_time"
        ch.put(1)
        assert ch.get(timeout=5) == ("seen", 1)
        ch.shutdown()


BESIDE_SCRIPT = """
import besidehooks
from zchannel.broker import Channel

with Channel.create("beside", collector=besidehooks.Doubling) as ch:
    ch.put(21)
    print(ch.get(timeout=30), ch.stats()["collector"], flush=True)
"""


@pytest.mark.parametrize("start", ["spawned", "forkserver"])
def test_hook_module_beside_the_creating_script_reaches_the_broker(tmp_path, monkeypatch,
                                                                      start):
    """A collector class whose module sits next to the script that creates the channel, run from
    another directory: the broker (a child, or forked by the fork server) gets the creator's
    ``sys.path``, as a spawned multiprocessing child does, not only its ``PYTHONPATH``."""
    if start == "spawned":
        monkeypatch.delenv(FORKSERVER_ENV, raising=False)
    elif not os.environ.get(FORKSERVER_ENV):
        pytest.skip("no fork server in this run (ZCHANNEL_TEST_FORKSERVER=0)")
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "besidehooks.py").write_text(
        "from zchannel.hooks import Collector\n"
        "class Doubling(Collector):\n"
        "    def collect(self, item, key):\n"
        "        yield key, item * 2\n")
    (project / "app.py").write_text(BESIDE_SCRIPT)
    assert str(project) not in os.environ.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(project / "app.py")], cwd=elsewhere,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["42", "besidehooks:Doubling"]


def test_broker_environ_puts_the_creators_sys_path_first(tmp_path, monkeypatch):
    """Directories of ``sys.path`` first (``''`` as the working directory), each once, then the
    ``PYTHONPATH`` entries not among them; entries that are no directory are left out."""
    a, b, cwd = tmp_path / "a", tmp_path / "b", tmp_path / "cwd"
    for folder in (a, b, cwd):
        folder.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", ["", str(a), str(tmp_path / "gone.zip"), str(a)])
    env = broker_environ({"PYTHONPATH": os.pathsep.join([str(b), str(a), "", str(b)])})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(cwd), str(a), str(b)]
    assert broker_environ({})["PYTHONPATH"].split(os.pathsep) == [str(cwd), str(a)]


def test_seed_example_local(channels):
    ch = Channel.create("samples", local=True, collector=FlattenBatch, dispatcher="round_robin",
                        consumers={"actor": 3})
    channels.append(ch)
    ch.put(SAMPLES)
    for consumer, expected in EXPECTED.items():
        handle = Channel.connect("samples", identity=consumer)
        assert [handle.get(timeout=5), handle.get(timeout=5)] == expected
        handle.close()


def test_hook_instance_and_context(make):
    import hookmods

    ch = make("inst", collector=hookmods.Scaled(3))
    ch.put(5)
    assert ch.get(timeout=5) == 15
    ch2 = make("ctxt", collector="hookmods:EchoOptions", producers=["rollout"],
               consumers=["actor:1", "actor:0"], options={"alpha": 0.5, "mode": "x"})
    ch2.put("anything")
    seen = ch2.get(timeout=5)
    assert seen["options"] == {"alpha": 0.5, "mode": "x"}
    assert seen["producers"] == ["rollout"]
    assert seen["consumers"] == ["actor:0", "actor:1"]
    if not make.local:
        assert seen["pid"] != os.getpid()  # the hook ran in the broker


def test_unknown_hook_names_at_create_are_value_errors(make):
    # docs/hooks.md: "an unknown name is a ValueError listing the known ones" -- also when the broker
    # process resolves the name; a class of the wrong kind stays a TypeError
    with pytest.raises(ValueError, match="flatten_batch"):
        make("unknownc", collector="no_such_collector")
    with pytest.raises(ValueError, match="round_robin"):
        make("unknownd", dispatcher="no_such_dispatcher")
    with pytest.raises(TypeError):
        make("notahook", collector="hookmods:NotAHook")
    with pytest.raises(ValueError):  # a hook whose setup rejects the options
        make("badopts", collector="embodied_trajectory", options={})


def test_create_of_a_running_channel_warns_about_differing_hooks(make, caplog):
    # docs/channel.md: "the running broker's settings win; differing arguments are logged"
    make("running", maxsize=3, collector="flatten_batch", dispatcher="round_robin")
    with caplog.at_level("WARNING", logger="zchannel.client"):
        make("running", maxsize=3, collector="FLATTEN_BATCH",
             dispatcher="zchannel.hooks.builtin:RoundRobinDispatcher")  # the same hooks
    # attaching is always logged; the same settings are not called differences
    assert [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()] == []
    assert any("attached to the broker" in r.getMessage() for r in caplog.records)
    with caplog.at_level("WARNING", logger="zchannel.client"):
        second = make("running", maxsize=5, collector="hookmods:Rekey",
                      dispatcher="least_loaded")
    text = caplog.text
    assert "maxsize=5 ignored" in text
    assert "collector=hookmods:Rekey ignored" in text
    assert "dispatcher=least_loaded ignored" in text
    second.put([1, 2])
    assert second.qsize() == 2  # the running broker's flatten_batch collector still applies


def test_create_of_a_running_channel_warns_about_every_ignored_setting(make_remote, caplog,
                                                                       tmp_path):
    """Declared consumers, producers, a journal and the lease timeout the running broker does
    not have are named too: a ``journal=`` that is ignored leaves a channel that is not
    durable."""
    make_remote("running2", consumers={"a": 1}, producers=["p"])
    with caplog.at_level("WARNING", logger="zchannel.client"):
        second = make_remote("running2", consumers={"a": 2}, producers=["q"],
                             journal=tmp_path / "j", lease_timeout=5.0)
    text = caplog.text
    assert "consumers=['a:0', 'a:1'] ignored" in text
    assert "producers=['q'] ignored" in text
    assert "journal=" in text and second.stats()["journal"] is None
    assert "lease_timeout=5.0 ignored" in text and second.stats()["lease_timeout"] == 30.0
    caplog.clear()
    with caplog.at_level("WARNING", logger="zchannel.client"):
        make_remote("running2", consumers={"a": 1}, producers=["p"])  # the same settings
    assert "ignored" not in caplog.text


def test_create_of_a_running_durable_channel_names_another_journal_or_fsync(make_remote, caplog,
                                                                            tmp_path):
    """A running durable channel keeps its journal directory and fsync policy: a ``create``
    that asks for others is told so."""
    make_remote("running-durable", journal=tmp_path / "j")
    with caplog.at_level("WARNING", logger="zchannel.client"):
        second = make_remote("running-durable", journal=tmp_path / "other", fsync="always")
    assert "fsync=interval; fsync=always ignored" in caplog.text
    assert f"journal={tmp_path / 'other'} ignored" in caplog.text
    assert second.stats()["journal"]["fsync"] == "interval"
    caplog.clear()
    with caplog.at_level("WARNING", logger="zchannel.client"):
        make_remote("running-durable", journal=tmp_path / "j")  # the same settings
    assert "ignored" not in caplog.text


def test_failing_hooks_reach_the_putter(make):
    ch = make("raising", collector="hookmods:Raising")
    with pytest.raises(HookError) as info:
        ch.put("boom")
    assert info.value.exc_type == "RuntimeError"
    assert "collector exploded" in str(info.value)
    assert "Traceback" in info.value.remote_traceback
    ch.put("fine")
    assert ch.get(timeout=5) == "fine"

    bad = make("badyield", collector="hookmods:BadYield")
    with pytest.raises(HookError) as info:
        bad.put("bad")
    assert info.value.exc_type == "TypeError"
    bad.put("ok")
    assert bad.get(timeout=5) == "ok"

    partial = make("partial", collector="hookmods:PartialThenRaise")
    with pytest.raises(HookError, match="second half failed"):
        partial.put("fail")
    assert partial.qsize() == 0  # nothing of the failed put was enqueued
    partial.put("x")
    assert [partial.get(timeout=5), partial.get(timeout=5)] == ["first half", "x"]


def test_failing_observe_and_rebalance_reach_the_get(make):
    # docs/hooks.md: a dispatcher hook that raises reaches the request it ran for
    ch = make("obsfail", dispatcher="hookmods:ObserveRefusesOnce")
    ch.put("x")
    late = Channel.connect("obsfail", identity="late:0")
    try:
        with pytest.raises(HookError, match="observe refused late:0") as info:
            late.get(timeout=5)
        assert info.value.exc_type == "RuntimeError"
        assert ch.qsize() == 1  # nothing was taken; the consumer had not joined
        assert late.get(timeout=5) == "x"  # its next get calls observe again, which lets it in
    finally:
        late.close()
    ch = make("rebalfail", dispatcher="hookmods:DealsToFirstRebalanceRaises",
              consumers=["a:0", "a:1"])
    ch.put("y")  # dealt to a:0
    starved = Channel.connect("rebalfail", identity="a:1")
    try:
        with pytest.raises(HookError, match="rebalance exploded for a:1") as info:
            starved.get(timeout=5)  # its private and the shared queue are empty: a steal
        assert info.value.exc_type == "RuntimeError"
        assert ch.qsize(consumer="a:0") == 1  # nothing was stolen
    finally:
        starved.close()


def test_a_hook_that_exits_or_interrupts_is_a_hook_error(make):
    ch = make("exits", collector="hookmods:Exits")
    ch.put("kept")
    for item, kind in (("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt"),
                       ("cancel", "CancelledError"), ("base", "Ending")):
        with pytest.raises(HookError) as info:
            ch.put(item)
        assert info.value.exc_type == kind
    ch.put("after")  # the broker serves on, and lost nothing
    assert [ch.get(timeout=5), ch.get(timeout=5)] == ["kept", "after"]
    if not make.distributed:  # the operator sees them (a replica's own figures: its keys')
        figures = ch.stats()
        assert figures["hook_failures"] == 4
        assert figures["last_hook_failure"] == "collector.collect: Ending: the hook's own"


def test_hook_stats_that_cannot_travel_are_an_error_entry_not_a_broken_stats(make):
    """A hook whose ``stats()`` returns what cannot travel: ``stats()`` (and ``zchannel
    stat``) still answer, its entry naming the hook and the cause."""
    ch = make("badstats", collector="hookmods:UnsendableStats")
    ch.put("x")
    figures = ch.stats()
    error = figures["collector_stats"]["error"]
    assert error.startswith("UnsendableStats.stats(): TypeError") and "builtins.object" in error
    assert figures["keys"]["default_queue"]["depth"] == 1


def test_a_broker_that_decodes_knows_the_classes_its_creator_registered(make_remote):
    """A collector's broker decodes each put: ``create`` hands it the classes this process
    registered (here one registered by a call, not by importing its module), which it
    registers too, so registered dataclasses travel through it."""
    import payloads
    from zchannel.broker import register_type

    register_type(payloads.Point)
    ch = make_remote("decodes-types", collector="flatten_batch")
    ch.put([payloads.Point(1, ("a",)), payloads.Sample(torch.arange(2), ["x"], {})])
    assert ch.get(timeout=5) == payloads.Point(1, ("a",))
    got = ch.get(timeout=5)
    assert isinstance(got, payloads.Sample) and torch.equal(got.obs, torch.arange(2))


def test_unsendable_collector_output_is_hook_error(make):
    # the broker must encode a new output; a local channel checks it the same way
    ch = make("unsendable_out", collector="hookmods:YieldsUnsendable")
    with pytest.raises(HookError) as info:
        ch.put("unsendable")
    assert info.value.exc_type == "TypeError"
    assert ch.qsize() == 0
    ch.put("fine")
    assert ch.get(timeout=5) == "fine"


def test_collector_drops_and_rekeys(make):
    ch = make("rekey", collector="hookmods:Rekey")
    for item in [1, 2, None, 3, "abc"]:
        ch.put(item)
    assert [ch.get("odd", timeout=5), ch.get("odd", timeout=5)] == [1, 3]
    assert ch.get("even", timeout=5) == 2
    assert ch.stats()["keys"]["default_queue"]["weight"] == 3  # weight from the 3-tuple
    assert ch.get(timeout=5) == "abc"
    assert ch.qsize() == 0  # None was dropped


def test_collector_outputs_views_of_received_tensors(make_remote):
    ch = make_remote("views", collector="hookmods:HalfTensor")
    t = torch.arange(100_000, dtype=torch.float32)
    ch.put(t)
    a, b = ch.get(timeout=5), ch.get(timeout=5)
    assert torch.equal(a, t[:50_000]) and torch.equal(b, t[50_000:])


def test_items_routed_before_any_consumer_go_to_first_asker(make):
    ch = make("early", dispatcher="round_robin")
    ch.put("early bird")  # no consumers exist: the item stays shared
    late = Channel.connect("early", identity="late:0")
    try:
        assert late.get(timeout=5) == "early bird"
    finally:
        late.close()


def test_an_item_dealt_back_to_its_departed_consumer_waits_for_it(make):
    """A consumer that joined by its first get (not declared) leaves: its private item is dealt
    again, the dispatcher names the departed id, and the item waits for that consumer to come
    back instead of going to the shared queue (where another consumer would take it)."""
    ch = make("dealback", dispatcher="hookmods:DealsToNamed")
    first = Channel.connect("dealback", identity="x:1")
    other = Channel.connect("dealback", identity="y:1")
    try:
        with pytest.raises(TimeoutError):
            first.get(timeout=0.05)  # x:1 joins by its first get
        ch.put({"to": "x:1", "v": 1})
        assert ch.stats()["keys"]["default_queue"]["private"] == {"x:1": 1}
        first.close()
        assert wait_until(lambda: "x:1" not in ch.stats()["consumers"], timeout=30)
        assert ch.stats()["keys"]["default_queue"]["private"] == {"x:1": 1}
        with pytest.raises(TimeoutError):
            other.get(timeout=0.2)
        again = Channel.connect("dealback", identity="x:1")
        try:
            assert again.get(timeout=10) == {"to": "x:1", "v": 1}
        finally:
            again.close()
    finally:
        other.close()


def test_get_without_identity_on_dealing_channel(make):
    ch = make("needsid", dispatcher="round_robin", consumers={"actor": 1})
    with pytest.raises(ValueError, match="identity"):
        ch.get(timeout=1)


def test_private_maxsize_and_multi_output_put(make):
    ch = make("privmax", maxsize=2, collector="flatten_batch", dispatcher="round_robin",
              consumers={"actor": 2})
    ch.put([1, 2, 3, 4])  # two items to each consumer: both private queues are at maxsize
    assert ch.full(consumer="actor:0") and ch.full(consumer="actor:1")
    assert ch.qsize() == 4 and ch.qsize(consumer="actor:0") == 2
    blocked = ch.put([5, 6], async_op=True)  # one output to each: waits for both queues
    a0 = Channel.connect("privmax", identity="actor:0")
    a1 = Channel.connect("privmax", identity="actor:1")
    try:
        assert a0.get(timeout=5) == 1
        with pytest.raises(TimeoutError):
            blocked.wait(timeout=0.3)  # actor:1's queue is still full
        assert a1.get(timeout=5) == 2
        blocked.wait(timeout=5)  # completes after its last output was admitted
        assert [a0.get(timeout=5), a0.get(timeout=5)] == [3, 5]
        assert [a1.get(timeout=5), a1.get(timeout=5)] == [4, 6]
    finally:
        a0.close()
        a1.close()


def test_per_key_dealing_state(make):
    ch = make("perkey", dispatcher="round_robin", consumers={"w": 2})
    ch.put("a0", key="a")
    ch.put("b0", key="b")
    ch.put("a1", key="a")
    assert ch.stats()["keys"]["a"]["private"] == {"w:0": 1, "w:1": 1}
    assert ch.stats()["keys"]["b"]["private"] == {"w:0": 1}


def test_stealing_idle_consumer_drains_blocked_peer(workers, channels):
    ch = Channel.create("steal", dispatcher="least_loaded_stealing", consumers={"w": 2})
    channels.append(ch)
    # w:0 takes one item and then "works" for a long time without asking again
    slow = workers.start(
        """
        import sys
        from zchannel.broker import Channel
        ch = Channel.connect(sys.argv[1], identity="w:0")
        print("got", ch.get(timeout=30), flush=True)
        sys.stdin.readline()
        """,
        ch.address,
    )
    ch.put(0)
    assert workers.wait_line(slow) == "got 0"
    fast = Channel.connect("steal", identity="w:1")
    try:
        waiting = fast.get(async_op=True)
        fast.qsize()  # the get is parked once this answers
        for i in range(1, 9):  # dealt alternately, half of them to the busy w:0
            ch.put(i)
        got = [waiting.wait(timeout=5)] + [fast.get(timeout=5) for _ in range(7)]
        assert sorted(got) == list(range(1, 9))
        assert ch.qsize() == 0
    finally:
        fast.close()
        workers.send(slow)


def test_killed_consumer_items_are_redealt_exactly_once(workers, channels):
    ch = Channel.create("redeal", dispatcher="round_robin", consumers={"w": 3})
    channels.append(ch)
    victim = workers.start(
        """
        import sys
        from zchannel.broker import Channel
        ch = Channel.connect(sys.argv[1], identity="w:0")
        print("got", ch.get(timeout=30), flush=True)
        sys.stdin.readline()
        """,
        ch.address,
    )
    for i in range(12):
        ch.put(i)
    assert workers.wait_line(victim) == "got 0"  # w:0 took item 0; 3, 6, 9 wait for it
    assert ch.stats()["keys"]["default_queue"]["private"]["w:0"] == 3
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert wait_until(lambda: "w:0" not in ch.stats()["consumers"], 10), \
        "the dead consumer never left"
    survivors = [Channel.connect("redeal", identity=f"w:{i}") for i in (1, 2)]
    try:
        got = []
        for handle in survivors:
            while True:
                try:
                    got.append(handle.get_nowait())
                except Exception:
                    break
        assert sorted(got) == list(range(1, 12))  # all but the delivered item 0, exactly once
    finally:
        for handle in survivors:
            handle.close()


@pytest.mark.parametrize("dispatcher", ["round_robin", "least_loaded"])
def test_a_put_waiting_for_a_killed_consumers_queue_is_dealt_again(workers, channels, dispatcher):
    """A put waiting for room (``maxsize``) in the private queue of a consumer that dies is
    routed again among those present: the survivor gets every item, none stays behind in the
    dead consumer's queue."""
    name = f"reroute-{dispatcher}"
    ch = Channel.create(name, maxsize=1, dispatcher=dispatcher, consumers={"w": 2})
    channels.append(ch)
    victim = workers.start(
        """
        import sys
        from zchannel.broker import Channel
        ch = Channel.connect(sys.argv[1], identity="w:0")
        try:
            ch.get_nowait(key="nothing")  # a get joins the consumer
        except Exception as exc:
            print("joined", type(exc).__name__, flush=True)
        sys.stdin.readline()
        """,
        ch.address,
    )
    assert workers.wait_line(victim) == "joined QueueEmpty"
    ch.put("item0")  # to w:0
    ch.put("item1")  # to w:1
    waiting = ch.put("item2", async_op=True, timeout=60)  # to w:0, whose queue is full
    assert wait_until(lambda: ch.stats()["keys"]["default_queue"]["putters"] == 1, 10)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert wait_until(lambda: "w:0" not in ch.stats()["consumers"], 10), \
        "the dead consumer never left"
    survivor = Channel.connect(name, identity="w:1")
    try:
        got = sorted(survivor.get(timeout=10) for _ in range(3))
        assert got == ["item0", "item1", "item2"]
        assert waiting.wait(10) is None
        assert not any(ch.stats()["keys"]["default_queue"]["private"].values())
    finally:
        survivor.close()


def test_consumer_ids_with_equal_ranks_keep_their_own_places(make):
    """``a:1`` and ``a:01`` have the same integer rank but are two consumers: round robin
    deals to both."""
    assert consumer_sort_key("a:1") != consumer_sort_key("a:01")
    ch = make("equalranks", dispatcher="round_robin", consumers=["a:1", "a:01", "a:2"])
    for i in range(9):
        ch.put(i)
    assert ch.stats()["keys"]["default_queue"]["private"] == {"a:01": 3, "a:1": 3, "a:2": 3}


def test_an_unregistered_subclass_of_a_registered_hook_is_named_as_itself(make_remote, caplog):
    """A subclass inherits ``hook_name`` but is another hook: ``stats()``, the warning of a
    ``create`` with other hooks and a journal's record of its collector name the subclass."""
    import hookmods

    assert hook_name(hookmods.DoubledFlatten()) == "hookmods:DoubledFlatten"
    ch = make_remote("subclassed", collector="hookmods:DoubledFlatten")
    ch.put([1, 2])
    assert ch.stats()["collector"] == "hookmods:DoubledFlatten"
    assert drain(ch) == [1, 1, 2, 2]
    with caplog.at_level("WARNING", logger="zchannel.client"):
        make_remote("subclassed", collector="flatten_batch")
    assert "collector=flatten_batch ignored" in caplog.text


def test_stat_shows_consumers_and_hooks(make_remote):
    ch = make_remote("statme", collector="flatten_batch", dispatcher="round_robin",
                     consumers={"actor": 2})
    ch.put([1, 2, 3])
    stats = ch.stats()
    assert stats["collector"] == "flatten_batch" and stats["dispatcher"] == "round_robin"
    assert stats["consumers"] == ["actor:0", "actor:1"]
    assert stats["keys"]["default_queue"]["private"] == {"actor:0": 2, "actor:1": 1}


@pytest.mark.parametrize("local", [True, False], ids=["local", "broker"])
def test_producer_group_names_are_checked(local, channels):
    """``producers=`` names groups as a consumer id's group is spelled: a bad one is refused
    by name before anything starts, a good one reaches the hooks' context."""
    for bad, error, cause in ((["x y"], ValueError, "group name 'x y' in producers="),
                              (["a:b"], ValueError, "group name 'a:b' in producers="),
                              ([1], ValueError, "group name 1 in producers="),
                              ("rollout", TypeError, "producers= takes a list of group names")):
        with pytest.raises(error, match=cause):
            Channel.create("groups", producers=bad, local=local)
    ch = Channel.create("groups", producers=["rollout", "env.1"], local=local)
    channels.append(ch)
    assert ch.stats()["producers"] == ["rollout", "env.1"]


@pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])
def test_a_put_behind_an_earlier_waiting_put_says_so_and_names_the_queue(channels, local):
    """Puts waiting for room are stored in arrival order, queue by queue: a put for queue B
    waits behind an earlier put of outputs for A (full) and B, although B has room; its
    ``QueueFull`` says why, naming B, and one for a full queue names that queue, not the
    put's own key."""
    ch = Channel.create("hol", maxsize=1, collector="hookmods:Split", local=local)
    channels.append(ch)
    ch.put([("A", 1)])
    waiting = ch.put([("A", 2), ("B", 2)], async_op=True, timeout=60)
    assert wait_until(lambda: ch.stats()["keys"]["A"]["putters"] == 1, 10)
    assert not ch.full("B")
    with pytest.raises(QueueFull, match="an earlier put waits for room and targets the queue "
                                        "of key 'B' too"):
        ch.put_nowait([("B", 3)])
    ch.put([("C", 1)], key="elsewhere")
    with pytest.raises(QueueFull, match=r"the queue of key 'C' is full \(maxsize 1\)"):
        ch.put_nowait([("C", 3)], key="elsewhere")
    assert ch.get(key="A", timeout=10) == 1
    waiting.wait(10)
    assert ch.get(key="A", timeout=10) == 2 and ch.get(key="B", timeout=10) == 2
