"""Hook failures the user must be able to read: a collector that returns a tuple, an entry point
that does not load, a dispatcher's ``forget`` that raises, and the ``max_keys`` limit reached
by a collector's fan-out.  The hook classes live here: the brokers import them from this module
(``tests/`` is on their ``PYTHONPATH``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from cluster_util import write_cluster
from conftest import wait_until
from zchannel.broker import Channel, HookError
from zchannel.broker.core import hookpipeline
from zchannel.hooks import Collector, Dispatcher

pytestmark = pytest.mark.timeout(120)


class Returns(Collector):
    """``collect`` returns, not yields: a tuple (``return key, item`` for ``yield key, item``)
    for most items; a list of outputs, None or an empty tuple for the items naming them."""

    def collect(self, item, key):
        if item == "list":
            return [(key, "from a list")]
        if item == "none":
            return None
        if item == "empty":
            return ()
        return key, item


class ForgetFails(Dispatcher):
    """A dealing dispatcher whose ``forget`` raises (``route``: always the shared queue)."""

    def route(self, item, key):
        return None

    def forget(self, consumer_id):
        raise RuntimeError(f"forget {consumer_id}")


class FanKeys(Collector):
    """``put(n)`` makes one output under each of the keys ``k0`` .. ``k{n-1}``."""

    def collect(self, item, key):
        for i in range(int(item)):
            yield f"k{i}", i


@pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])
def test_a_collector_returning_a_tuple_fails_the_put_and_stores_nothing(local, channels):
    """``return key, item`` is refused with a message saying so, a tuple key and a pair item
    included (two well-formed outputs, once stored under the key's elements); an iterable
    other than a tuple, None and an empty tuple are outputs (or none) as ever."""
    ch = Channel.create(f"returns-{'local' if local else 'broker'}", collector=Returns,
                        local=local)
    channels.append(ch)
    for item, key in (("payload", "plain"), (("obs", "act"), ("env", 3))):
        with pytest.raises(HookError, match=r"must yield \(key, item\[, weight\]\) tuples or "
                                            r"return an iterable of them; it returned a tuple") as err:
            ch.put(item, key=key)
        assert err.value.exc_type == "TypeError"
    figures = ch.stats()
    assert all(state["depth"] == 0 for state in figures["keys"].values()), figures["keys"]
    assert figures["hook_failures"] == 2
    assert "it returned a tuple of 2" in figures["last_hook_failure"]
    for item in ("list", "none", "empty"):
        ch.put(item, key="kept")
    assert ch.qsize("kept") == 1 and ch.get(key="kept", timeout=10) == "from a list"


def test_a_distributed_channels_replicas_refuse_a_returned_tuple_too(run_dir, monkeypatch,
                                                                      channels):
    """A replica runs the collector inside the wrapper that checks where outputs go: the same
    refusal, nothing stored."""
    monkeypatch.setenv("ZCHANNEL_NODE", "n0")
    ch = Channel.create("returns-dist", distributed=True, collector=Returns,
                        options={"cluster": write_cluster(run_dir, ("n0", "n0"))})
    channels.append(ch)
    for item, key in (("payload", "plain"), (("obs", "act"), ("env", 3))):
        with pytest.raises(HookError, match="it returned a tuple of 2"):
            ch.put(item, key=key)
    assert ch.qsize("plain") == 0 and ch.qsize("env") == 0 and ch.qsize("obs") == 0
    ch.put("list", key="kept")
    assert ch.get(key="kept", timeout=10) == "from a list"


@pytest.mark.parametrize("local", [False, True], ids=["broker", "local"])
def test_forget_failures_count_and_log_as_every_hook_failure(local, channels, monkeypatch,
                                                             caplog):
    """A ``forget`` that raises counts in ``hook_failures``, is the ``last_hook_failure`` and
    is logged in one line, at most one per ``FAILURE_LOG_S`` (seen here on a local channel,
    whose pipeline runs in this process)."""
    monkeypatch.setattr(hookpipeline, "FAILURE_LOG_S", 1e9)  # one line for this whole test
    caplog.set_level(logging.WARNING, logger="zchannel")
    # (a broker run in this process earlier, setup_logging, stopped "zchannel" propagating)
    monkeypatch.setattr(logging.getLogger("zchannel"), "propagate", True)
    name = f"forget-{'local' if local else 'broker'}"
    ch = Channel.create(name, dispatcher=ForgetFails, local=local)
    channels.append(ch)
    for n in range(2):
        consumer = Channel.connect(name, identity=f"w:{n}")
        ch.put(n)
        assert consumer.get(timeout=10) == n
        consumer.close()  # the broker calls forget("w:<n>")
        wait_until(lambda n=n: ch.stats()["hook_failures"] == n + 1)
    figures = ch.stats()
    assert figures["hook_failures"] == 2
    assert figures["last_hook_failure"] == "dispatcher.forget: RuntimeError: forget w:1"
    if local:
        logged = [r for r in caplog.records if r.name.startswith("zchannel")
                  and "forget" in r.getMessage()]
        assert len(logged) == 1, [r.getMessage() for r in logged]
        assert logged[0].exc_info is None and "dispatcher.forget" in logged[0].getMessage()


def test_the_max_keys_error_counts_the_keys_a_fan_out_would_add(brokers, run_dir):
    """A put whose outputs would pass ``max_keys`` names the keys held, the new keys it would
    add and the limit; nothing of it is stored."""
    address = f"ipc://{run_dir}/fan.sock"
    brokers.start(name="fan", address=address, collector=f"{__name__}:FanKeys", max_keys=5)
    ch = Channel.connect(address)
    try:
        ch.put(3)
        with pytest.raises(ValueError, match=r"^the broker holds 3 keys and this request would "
                                             r"add 7 more: the max_keys limit \(5\) is reached"):
            ch.put(10)
        assert sorted(ch.stats()["keys"]) == ["k0", "k1", "k2"]
    finally:
        ch.close()


PLUGIN = '''
from zchannel.hooks import Collector


class Double(Collector):
    def collect(self, item, key):
        yield key, item
        yield key, item
'''

CREATOR = '''
import sys
from zchannel.broker import Channel

for local in (False, True):
    name = f"ep-{sys.argv[1]}-{int(local)}"
    if sys.argv[1] == "good":
        with Channel.create(name, collector="zchep_double", local=local) as ch:
            ch.put("x")
            print("good", local, ch.get(timeout=10), ch.get(timeout=10), flush=True)
    else:
        hook = "zchep_broken" if sys.argv[1] == "bad" else "zchep_dobule"
        try:
            Channel.create(name, collector=hook, local=local).shutdown()
        except ValueError as exc:
            print(sys.argv[1], local, type(exc.__cause__).__name__, str(exc).splitlines()[0],
                  flush=True)
'''


def _plugin(tmp_path):
    """A distribution on ``tmp_path`` publishing two hooks: ``zchep_double``, a collector, and
    ``zchep_broken``, whose module does not exist."""
    (tmp_path / "zchep_pkg").mkdir()
    (tmp_path / "zchep_pkg" / "__init__.py").write_text("")
    (tmp_path / "zchep_pkg" / "hooks.py").write_text(PLUGIN)
    dist = tmp_path / "zchep-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: zchep\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[zchannel.hooks]\nzchep_double = zchep_pkg.hooks:Double\n"
        "zchep_broken = zchep_pkg.missing:Nope\n")
    (tmp_path / "creator.py").write_text(CREATOR)


def _run_creator(tmp_path, phase: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    return subprocess.run([sys.executable, str(tmp_path / "creator.py"), phase], env=env,
                          capture_output=True, text=True, timeout=100)


def test_a_published_hook_that_does_not_load_is_named_with_its_error(tmp_path):
    """Naming an entry point that cannot be loaded is an error naming it, its target and the
    import error (its ``__cause__`` in the creating process), by the broker as by a local
    channel; naming another published hook neither imports nor logs the broken one, and a
    name no entry point publishes (all are loaded then) logs it in one line, no traceback."""
    _plugin(tmp_path)
    good = _run_creator(tmp_path, "good")
    assert good.returncode == 0, good.stderr
    assert good.stdout.splitlines() == ["good False x x", "good True x x"]
    assert "zchep_broken" not in good.stderr and "missing" not in good.stderr, good.stderr
    bad = _run_creator(tmp_path, "bad")
    assert bad.returncode == 0, bad.stderr
    lines = bad.stdout.splitlines()
    assert len(lines) == 2, bad.stdout + bad.stderr
    expected = ("cannot load collector 'zchep_broken': entry point zchep_broken = "
                "zchep_pkg.missing:Nope of group zchannel.hooks raised ModuleNotFoundError: "
                "No module named 'zchep_pkg.missing'")
    assert lines[0].startswith("bad False ") and expected in lines[0]
    assert lines[1] == f"bad True ModuleNotFoundError {expected}"
    typo = _run_creator(tmp_path, "typo")  # every entry point loaded: the broken one in a line
    assert typo.returncode == 0, typo.stderr
    lines = typo.stdout.splitlines()
    assert len(lines) == 2 and all(
        "unknown collector 'zchep_dobule'; known collectors: " in line and "zchep_double" in line
        and line.endswith("(entry points that could not be loaded: zchep_broken)")
        for line in lines), typo.stdout + typo.stderr
    assert "Traceback" not in typo.stderr, typo.stderr
    assert ("hook entry point zchep_broken = zchep_pkg.missing:Nope (group zchannel.hooks) "
            "could not be loaded: ModuleNotFoundError") in typo.stderr, typo.stderr
