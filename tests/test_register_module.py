"""``register_module``: a whole module of dataclasses and Enums registered in one call, the fix the
errors name, receivers that have not registered it, and modules published under the
``zchannel.hooks`` entry point (the RL data modules of ``tests/rldata``; their round trips on
every path are rows of the value table, tests/test_values.py)."""

from __future__ import annotations

import json
import os
import re
import textwrap
import uuid
from dataclasses import dataclass

import pytest
import torch
from conftest import pid_alive, wait_until
from payloads import RLDATA
from rldata.embodied_io_struct import ChunkStepResult, EnvOutput, EnvStatus
from rldata.io_struct import RolloutRequest, Timing
from zchannel.broker import Channel, HookError, register_module, register_type
from zchannel.broker.wire import classtags, codec

pytestmark = pytest.mark.timeout(180)

MODULE = '''
import enum
from dataclasses import dataclass, field

from rldata.io_struct import RolloutRequest  # imported, not defined here


class Mode(str, enum.Enum):
    EVAL = "eval"


@dataclass
class Point:
    x: int
    ys: list = field(default_factory=list)


Alias = Point


class Box:
    @dataclass(frozen=True)
    class Inner:
        v: int


class NotData:
    pass


def make():
    @dataclass
    class Local:
        a: int

    return Local


Local = make()
'''


def _module(tmp_path, monkeypatch, source: str, files: dict[str, str] | None = None) -> str:
    """A fresh module (or package, with ``files``) under a unique name on ``sys.path``."""
    name = f"regmod_{uuid.uuid4().hex[:8]}"
    if files is None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    else:
        for path, text in {"__init__.py": source, **files}.items():
            target = tmp_path / name / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _round_trip(value):
    return codec.decode(*codec.encode(value))


def test_register_module_registers_the_classes_the_module_defines(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, MODULE)
    mod = __import__(name)
    with pytest.raises(TypeError, match=re.escape(
            f'dataclass {name}.Point is not registered for the wire: call '
            f'zchannel.broker.register_module("{name}")') + r".*@zchannel\.broker\.serializable"):
        codec.encode({"p": mod.Point(1)})
    assert _round_trip(mod.Mode.EVAL) == "eval"  # an unregistered str Enum: its value

    registered = register_module(name)
    assert registered == [mod.Mode, mod.Point, mod.Box.Inner]
    assert [classtags.CLS_TO_TAG[cls] for cls in registered] == [
        f"{name}:Mode", f"{name}:Point", f"{name}:Box.Inner"]
    assert classtags.CLS_TO_TAG[RolloutRequest] == "rldata.io_struct:RolloutRequest"  # untouched
    point = _round_trip([mod.Point(1, [mod.Mode.EVAL]), mod.Box.Inner(2)])
    assert point == [mod.Point(1, [mod.Mode.EVAL]), mod.Box.Inner(2)]
    assert type(point[1]) is mod.Box.Inner and point[0].ys[0] is mod.Mode.EVAL
    # a class made inside a function is no module's to register: the fix is a tag of its own
    with pytest.raises(TypeError, match=r"is not registered for the wire: decorate it .*name= tag"):
        codec.encode(mod.Local(1))

    before = dict(classtags.TAG_TO_CLS)
    assert register_module(mod) == registered  # idempotent, module or name alike
    assert register_module(name) == registered
    assert classtags.TAG_TO_CLS == before


PAIR = """
    from dataclasses import dataclass

    @dataclass
    class First:
        v: int

    @dataclass
    class Second:
        v: int
    """


def test_a_class_registered_under_its_own_tag_keeps_it(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, PAIR)
    mod = __import__(name)
    register_type(mod.First, name=f"custom.{name}.First")
    assert register_module(name) == [mod.First, mod.Second]
    assert classtags.CLS_TO_TAG[mod.First] == f"custom.{name}.First"
    assert classtags.CLS_TO_TAG[mod.Second] == f"{name}:Second"
    assert f"custom.{name}.First".encode() in codec.encode(mod.First(1))[0]


def test_a_taken_tag_registers_nothing_of_the_module(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, PAIR)
    mod = __import__(name)

    @dataclass
    class Other:
        pass

    register_type(Other, name=f"{name}:Second")  # the default tag of the module's Second
    with pytest.raises(ValueError, match=rf"{name}:Second.*already registered.*nothing of "):
        register_module(name)
    assert mod.First not in classtags.CLS_TO_TAG and mod.Second not in classtags.CLS_TO_TAG


def test_register_module_arguments():
    with pytest.raises(TypeError, match="a module or its dotted name, not int"):
        register_module(42)
    with pytest.raises(ModuleNotFoundError, match="no_such_module_"):
        register_module(f"no_such_module_{uuid.uuid4().hex[:6]}")
    assert register_module("rldata") == []  # the package's __init__ defines no class
    assert register_module("rldata", recursive=True) == RLDATA
    assert Timing.Span in RLDATA and RolloutRequest in RLDATA and EnvOutput in RLDATA
    assert len(RLDATA) == len(set(RLDATA)) == 17  # FinishReason once: where it is defined


LEAF = """
    from dataclasses import dataclass

    @dataclass
    class Leaf:
        v: int
    """
TOP = """
    import enum

    class Top(enum.Enum):
        A = 1
    """


def test_recursive_registers_submodules_and_skips_main(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, TOP, {
        "sub/__init__.py": "", "sub/leaf.py": LEAF,
        "__main__.py": "raise SystemExit('a __main__ module was imported')",
    })
    top = __import__(name)
    assert register_module(name) == [top.Top]
    leaf = __import__(f"{name}.sub.leaf", fromlist=["Leaf"])
    assert register_module(name, recursive=True) == [top.Top, leaf.Leaf]
    assert classtags.CLS_TO_TAG[leaf.Leaf] == f"{name}.sub.leaf:Leaf"
    assert _round_trip(leaf.Leaf(3)) == leaf.Leaf(3)


def test_a_submodule_that_fails_to_import_registers_nothing(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, TOP, {
        "leaf.py": LEAF, "zbroken.py": "import a_dependency_that_is_not_installed_here"})
    with pytest.raises(ImportError, match=rf"cannot import {name}\.zbroken .*nothing was registered"):
        register_module(name, recursive=True)
    top = __import__(name)
    assert top.Top not in classtags.CLS_TO_TAG


# -- a receiver that has not registered the module (real processes) ----------------------------------

RECEIVER = """
    import json, sys
    from zchannel.broker import Channel, register_module

    ch = Channel.connect(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()  # the items are in
    out = {}
    for key, ack in (("plain", False), ("acked", True)):
        try:
            ch.get(key=key, ack=ack, timeout=60)
            out[key] = "decoded"
        except ValueError as exc:
            out[key] = str(exc)
    out["registered"] = [cls.__qualname__ for cls in register_module("rldata.io_struct")]
    again = ch.get(key="acked", ack=True, timeout=120)  # the same item, once its lease ran out
    ch.ack(again)
    ch.put(again.item, key="back")
    ch.put(ch.get(key="plain", timeout=60), key="back")  # the next one
    print(json.dumps(out), flush=True)
    ch.close()
"""


def test_a_receiver_that_has_not_registered_the_module_gets_a_value_error_and_goes_on(
        channels, workers):
    ch = Channel.create("receiver", lease_timeout=1.0)  # a broker that never decodes items
    channels.append(ch)
    proc = workers.start(RECEIVER, "receiver")
    workers.wait_line(proc, "ready")
    first, second = RolloutRequest(1, [[1]], [[b"a"]], [["x"]], [None]), RolloutRequest(
        2, [[2, 3]], [[]], [{"vqa": "y"}], [{"k": 1}])
    acked = RolloutRequest(3, [], [], [], [])
    ch.put(first, key="plain")
    ch.put(second, key="plain")
    ch.put(acked, key="acked")
    workers.send(proc)
    out = json.loads(workers.wait_line(proc, timeout=180))
    for key in ("plain", "acked"):
        assert re.fullmatch(
            r"unknown serializable type tag 'rldata\.io_struct:RolloutRequest': the process "
            r"decoding the item .* has not registered it; call "
            r'zchannel\.broker\.register_module\("rldata\.io_struct"\) in that process.*',
            out[key]), out[key]
    assert "RolloutRequest" in out["registered"]
    # the handle went on: the acknowledged item came back, the next one decoded
    assert ch.get(key="back", timeout=60) == acked
    assert ch.get(key="back", timeout=60) == second
    workers.finish(proc)
    assert ch.qsize("plain") == 0 and ch.qsize("acked") == 0 and ch.stats()["leases"] == 0


BATCH_RECEIVER = """
    import json, sys
    import numpy as np
    from zchannel.broker import Channel, UndecodableItems

    ch = Channel.connect(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()  # the items are in
    out = {}
    for key in ("small", "large"):
        try:
            ch.get_batch(5, key=key, timeout=60)
            out[key] = "decoded"
        except UndecodableItems as exc:
            out[key] = {"items": [x if isinstance(x, str) else float(np.asarray(x).sum())
                                  for x in exc.items],
                        "failed": [i for i, _ in exc.errors],
                        "value_error": isinstance(exc, ValueError), "message": str(exc)}
    ch.put(ch.get_batch(1, key="small", timeout=60), key="back")  # the handle goes on
    print(json.dumps(out), flush=True)
    ch.close()
"""


def test_a_batch_keeps_the_items_that_decode_when_some_do_not(channels, workers):
    """A ``get_batch`` reply holding items the consumer cannot decode: those are consumed (as a
    single get's would be) and the others reach the caller in ``UndecodableItems.items``, small
    items in the record and large ones through shared memory alike; nothing stays held."""
    ch = Channel.create("batchdecode")
    channels.append(ch)
    proc = workers.start(BATCH_RECEIVER, "batchdecode")
    workers.wait_line(proc, "ready")
    odd = RolloutRequest(1, [[1]], [[b"a"]], [["x"]], [None])
    big = torch.ones(1 << 19)  # 2 MiB: through shared memory
    for key, items in (("small", ["good1", odd, "good2", odd, "good3"]),
                       ("large", ["good1", big, odd, "good2", big])):
        for item in items:
            ch.put(item, key=key, weight=1)
    ch.put("after", key="small", weight=1)
    workers.send(proc)
    out = json.loads(workers.wait_line(proc, timeout=180))
    assert out["small"]["items"] == ["good1", "good2", "good3"] and out["small"]["failed"] == [1, 3]
    assert out["large"]["items"] == ["good1", float(1 << 19), "good2", float(1 << 19)]
    assert out["large"]["failed"] == [2] and out["large"]["value_error"]
    assert re.search(r"1 of the 5 items of this batch could not be decoded .*unknown "
                     r"serializable type tag 'rldata\.io_struct:RolloutRequest'",
                     out["large"]["message"]), out["large"]["message"]
    assert ch.get(key="back", timeout=60) == ["after"]
    workers.finish(proc)
    stats = ch.stats()
    assert stats["leases"] == 0 and ch.qsize("small") == 0 and ch.qsize("large") == 0
    assert wait_until(lambda: ch.stats()["shm"]["slots_used"] == 0, timeout=60)


# -- a module published under the zchannel.hooks entry point (broker and receivers) -------------------

CONSUMER = """
    import sys
    from zchannel.broker import Channel

    ch = Channel.connect(sys.argv[1])
    for _ in range(2):  # no register_module here: the entry point registers rldata.embodied_io_struct
        item = ch.get(timeout=60)
        ch.put(item, key="back")
    print(type(item).__module__, type(item).__qualname__, flush=True)
    ch.close()
"""


LOCAL = """
    from rldata.embodied_io_struct import ChunkKey, EnvStatus
    from zchannel.broker import Channel
    from zchannel.broker.wire import codec

    # no register_module: the first put of a published class registers its module, on both paths
    ch = Channel.create("local", local=True)
    ch.put([EnvStatus.DONE, {ChunkKey(1, 2): "k"}])
    got = ch.get(timeout=10)
    assert got == [EnvStatus.DONE, {ChunkKey(1, 2): "k"}] and type(got[0]) is EnvStatus, got
    assert codec.decode(*codec.encode(EnvStatus.RUNNING)) is EnvStatus.RUNNING  # not 0
    print("ok", flush=True)
    ch.shutdown()
"""


def _publish(tmp_path, monkeypatch) -> None:
    """A distribution publishing ``rldata.embodied_io_struct`` under the ``zchannel.hooks`` entry
    point, on the ``PYTHONPATH`` of the processes started from now on (not this one)."""
    dist = tmp_path / "rldata_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rldata-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[zchannel.hooks]\nrl_embodied = rldata.embodied_io_struct\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))


def test_a_broker_hook_uses_the_classes_of_a_published_module(tmp_path, monkeypatch, channels,
                                                              workers, brokers, run_dir):
    rewards, dones = torch.arange(4.0), torch.tensor([False, True, False, True])
    env = EnvOutput(obs={"states": torch.randn(4, 3)}, rewards=rewards, dones=dones,
                    status=EnvStatus.DONE)
    # the hook module imports rldata but registers nothing, and this broker was not started
    # by a process that registered them (no ``types``): it cannot build or read them
    brokers.start(name="unpublished", address=f"ipc://{run_dir}/unpublished.sock",
                  collector="hookmods:ChunkFromEnv")
    bare = Channel.connect(f"ipc://{run_dir}/unpublished.sock")
    channels.append(bare)
    with pytest.raises(HookError, match=r"dataclass rldata\.embodied_io_struct\.ChunkStepResult is "
                       r'not registered .*register_module\("rldata\.embodied_io_struct"\)'):
        bare.put({"rewards": rewards, "dones": dones})
    with pytest.raises(ValueError, match=r"unknown serializable type tag "
                       r"'rldata\.embodied_io_struct:\w+'.*broker whose hooks decode items"
                       r'.*register_module\("rldata\.embodied_io_struct"\)'):
        bare.put(env)
    assert bare.qsize() == 0 and pid_alive(bare.stats()["pid"])

    _publish(tmp_path, monkeypatch)
    ch = Channel.create("published", collector="hookmods:ChunkFromEnv")
    channels.append(ch)
    proc = workers.start(CONSUMER, "published")  # its PYTHONPATH holds the distribution
    ch.put({"rewards": rewards, "dones": dones})  # built in the broker: encoded there
    ch.put(env)  # read in the broker: decoded there
    assert workers.wait_line(proc, timeout=120) == "rldata.embodied_io_struct ChunkStepResult"
    workers.finish(proc)
    from_dict, from_env = ch.get(key="back", timeout=30), ch.get(key="back", timeout=30)
    assert type(from_dict) is ChunkStepResult and type(from_env) is ChunkStepResult
    assert torch.equal(from_dict.rewards, rewards) and torch.equal(from_dict.dones, dones)
    assert from_dict.forward_inputs == {}
    assert torch.equal(from_env.forward_inputs["states"], env.obs["states"])
    local = workers.start(LOCAL)
    assert workers.wait_line(local, timeout=120) == "ok"
    workers.finish(local)
