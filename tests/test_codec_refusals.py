"""What a refused put says (docs/values.md): where in the item the refused value is, and, for
an item refused for its nesting, which limit was reached -- zchannel's, msgpack's, or Python's
recursion limit at the caller's stack depth (with the pure-Python msgpack too)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from zchannel.broker import Channel, serializable
from zchannel.broker.wire import codec

pytestmark = pytest.mark.timeout(180)

DEADLINE_S = 60.0  # generous: a loaded 2-core machine
PATHS = ["zmq", "same host", "local"]


@serializable
@dataclasses.dataclass
class _EnvOutput:
    """An RLinf-shaped item: observations by name."""

    obs: dict
    dones: object = None


def _open(path: str, monkeypatch, channels: list) -> Channel:
    if path == "zmq":  # frames over ZeroMQ: no direct link, no shared memory
        monkeypatch.setenv("ZCHANNEL_DIRECT", "0")
        monkeypatch.setenv("ZCHANNEL_SHM", "0")
    ch = Channel.create("refusals", local=path == "local")
    channels.append(ch)
    return ch


def _sparse() -> torch.Tensor:
    return torch.zeros(2, 3).to_sparse()


_shared = [1, 2]
_cyclic: list = [1]
_cyclic.append(_cyclic)

LOCATED = [  # (name, item, the path of the refused value)
    ("dataclass field", lambda: _EnvOutput(obs={"states": torch.zeros(4), "wrist": _sparse()}),
     "item.obs['wrist']"),
    ("list, dict, tuple", lambda: [1, {"a": 2, "b": (object(),)}], "item[1]['b'][0]"),
    ("dict key", lambda: {"k": {object(): 1}}, "item['k'].keys()[0]"),
    ("set element", lambda: {"s": [1, {object()}]}, "item['s'][1]{0}"),
    ("surrogate str", lambda: {"text": ["ok", "bad \udc80"]}, "item['text'][1]"),
    ("strided memoryview", lambda: (b"a", memoryview(b"abcd")[::2]), "item[1]"),
    ("masked array", lambda: {"x": [np.ma.masked_array([1, 2], [0, 1])]}, "item['x'][0]"),
    ("object array", lambda: [np.zeros(3), np.array([None, 1])], "item[1]"),
    ("the first of two", lambda: {"a": 1, "first": object(), "second": _sparse()},
     "item['first']"),
    ("a list held twice", lambda: [_shared, _shared, object()], "item[2]"),
    ("int key", lambda: {7: [object()]}, "item[7][0]"),
]


@pytest.mark.parametrize("path", PATHS)
def test_a_refused_value_is_named_by_where_it_is_in_the_item(path, monkeypatch, channels):
    """The ``TypeError`` of a put names the refused value's type and the fix as before, and
    where it is: "; it is at item.obs['wrist']" (a field, an index, a dict key's value, a
    dict key, a set's element by its place in the set's order); nothing is stored.  (It named
    the type only.)"""
    ch = _open(path, monkeypatch, channels)
    for name, make, where in LOCATED:
        item = make()
        with pytest.raises(TypeError) as refused:
            codec.encode(item)
        alone = str(refused.value)  # the codec's own refusal: the type and the fix
        with pytest.raises(TypeError) as put:
            ch.put(item, timeout=DEADLINE_S)
        assert str(put.value) == f"{alone}; it is at {where}", name
    assert ch.qsize() == 0
    ch.put([1, {"a": 2}], timeout=DEADLINE_S)  # the handle goes on
    assert ch.get(timeout=DEADLINE_S) == [1, {"a": 2}]


def _tuples(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = (value,)
    return value


def _lists(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("path", PATHS)
def test_refusals_of_the_item_itself_or_of_its_nesting_name_no_place(path, monkeypatch,
                                                                     channels):
    """A refused item that is itself the refused value, or that is refused for its nesting
    (no one value is to blame), keeps the codec's message as it is."""
    ch = _open(path, monkeypatch, channels)
    for item in (object(), _sparse(), _tuples(codec.MAX_DEPTH + 1), _cyclic,
                 _lists(1100)):
        with pytest.raises(TypeError) as refused:
            codec.encode(item)
        with pytest.raises(TypeError) as put:
            ch.put(item, timeout=DEADLINE_S)
        assert str(put.value) == str(refused.value)
        assert "; it is at" not in str(put.value)
    assert "msgpack's limit" in str(refused.value)  # lists and dicts in a row: msgpack's count
    assert ch.qsize() == 0


def _stack_depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def _at_depth(depth: int, call):
    """``call()`` with the stack ``depth`` frames deep."""
    return call() if _stack_depth() >= depth else _at_depth(depth, call)


@pytest.mark.parametrize("path", PATHS)
def test_a_put_from_a_deep_stack_names_the_recursion_limit(path, monkeypatch, channels):
    """A tuple nested ``codec.MAX_DEPTH`` deep (allowed) put from a stack near Python's
    recursion limit: the ``TypeError`` says the encoding reached Python's recursion limit,
    with the limit and the frames already on the stack; the same put from a shallow stack
    travels.  (It blamed msgpack's limit of about 1,000 lists and dicts in a row.)"""
    ch = _open(path, monkeypatch, channels)
    item = _tuples(codec.MAX_DEPTH)
    limit = sys.getrecursionlimit()
    with pytest.raises(TypeError) as refused:
        _at_depth(limit - 100, lambda: ch.put(item, timeout=DEADLINE_S))
    message = str(refused.value)
    assert message.startswith("cannot encode item: nested too deeply for Python's recursion "
                              f"limit (sys.getrecursionlimit() = {limit})"), message
    assert "frames were on the stack below the encoding" in message
    assert "msgpack's limit" not in message
    assert ch.qsize() == 0
    ch.put(item, timeout=DEADLINE_S)
    assert ch.get(timeout=DEADLINE_S) == item


_PURE_PYTHON = textwrap.dedent("""
    import msgpack, sys
    from zchannel.broker import Channel
    from zchannel.broker.wire import codec
    assert msgpack.Packer.__module__ == "msgpack.fallback", msgpack.Packer.__module__
    value = "leaf"
    for _ in range(100):  # a tuple, then a list, a dict and a list: 100 tuples deep, allowed
        value = [{"k": [(value,)]}]
    with Channel.create("purepython") as ch:
        try:
            ch.put(value, timeout=60)
        except TypeError as exc:
            print(exc)
        else:
            print("stored")
""")


def test_the_pure_python_msgpack_is_named_when_it_runs_out_of_stack(run_dir):
    """With msgpack's pure-Python fallback (``MSGPACK_PUREPYTHON=1``, or a msgpack without its
    compiled extension), which takes Python frames for every list and dict level, an item within
    the nesting limits may reach Python's recursion limit: the error says so, and names the
    fallback and the fix."""
    env = dict(os.environ, MSGPACK_PUREPYTHON="1")
    out = subprocess.run([sys.executable, "-c", _PURE_PYTHON], env=env, capture_output=True,
                         text=True, timeout=DEADLINE_S * 2)
    assert out.returncode == 0, out.stderr
    message = out.stdout.strip()
    assert message.startswith("cannot encode item: nested too deeply for Python's recursion "
                              "limit"), message
    assert "the pure-Python msgpack is in use here: msgpack.fallback" in message
    assert "compiled extension" in message and "msgpack's limit" not in message
