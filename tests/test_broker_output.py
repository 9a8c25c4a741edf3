"""What a broker's hooks print: a broker started by ``Channel.create`` tells its creator
``ready <address>`` (or ``error …``) on a pipe of its own, and its stdout is its stderr — so a
hook module printing at import or in ``setup`` does not garble the start, and one printing on
every put does not fill a pipe nobody reads (which froze the broker once it held 64 KiB).

Both start paths: forked by the test session's fork server, and spawned as
``python -m zchannel.broker`` (``spawned_brokers``)."""

from __future__ import annotations

import pytest
from zchannel.broker import Channel

HOOKS = '''
from zchannel.hooks import Collector

print("ready ipc:///nowhere (printed while the hook module imports)", flush=True)


class Chatty(Collector):
    def setup(self, ctx):
        print("ready ipc:///nowhere (printed in setup)", flush=True)

    def collect(self, item, key):
        print("collect got", item, "." * 1000)
        yield key, item
'''


@pytest.mark.parametrize("start", ["forked", "spawned"])
def test_hooks_that_print_neither_garble_the_start_nor_fill_a_pipe(
        start, tmp_path, monkeypatch, channels, request, capfd):
    if start == "spawned":
        request.getfixturevalue("spawned_brokers")
    (tmp_path / "chattyhooks.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    ch = Channel.create(f"chatty-{start}", collector="chattyhooks:Chatty")
    channels.append(ch)
    assert ch.address.startswith(("ipc://", "tcp://")) and "nowhere" not in ch.address
    n = 400  # ~400 KiB printed: six times a pipe's buffer
    for i in range(n):
        ch.put(i, timeout=30)
    assert [ch.get(timeout=30) for _ in range(n)] == list(range(n))
    ch.shutdown()
    channels.remove(ch)
    err = capfd.readouterr().err
    assert "(printed in setup)" in err and err.count("collect got") == n
