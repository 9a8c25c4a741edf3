"""What a hook hands the broker and what the broker is given by path, bounded and checked: a
hook's log lines (rate-limited in a table of bounded size), a hook instance's ``__slots__``
(sent with it), a collector's ``holds_state``/``state_dict`` failures (counted), a
``rebalance`` naming no usable donor (the starved get's ``HookError``), and the key and token
files of the command line (a regular file only, bounded, named in every error)."""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import sys
import tracemalloc

import pytest
import zmq.auth
from zchannel.broker import Channel, HookError
from zchannel.broker.server.loop import _RateLimitFilter
from zchannel.hooks import Collector, Dispatcher

pytestmark = pytest.mark.timeout(300)

TESTS = os.path.dirname(os.path.abspath(__file__))
LOGGER = "zchannel.hooks.limits"


class LogsDistinctLines(Collector):
    """``put(n)`` logs ``n`` warnings, each with its own text (an f-string), and stores ``n``."""

    def collect(self, item, key):
        log = logging.getLogger(LOGGER)
        for i in range(int(item)):
            log.warning(f"distinct message number {i}")  # a new template each time
        yield key, item


class OffsetSlot(Collector):
    """A private slot (stored under its mangled name, ``_OffsetSlot__offset``)."""

    __slots__ = ("__offset",)

    def set_offset(self, offset):
        self.__offset = offset

    def offset(self):
        return self.__offset


class ScaledInSlots(OffsetSlot):
    """State in slots of its own and of its base, one slot left unset, one attribute in
    ``__dict__``: ``put(x)`` stores ``(x * scale + offset, label, whether 'unset' is set)``."""

    __slots__ = ("scale", "unset")

    def __init__(self, scale, offset):
        self.scale = scale
        self.set_offset(offset)
        self.label = "in vars"

    def collect(self, item, key):
        yield key, (item * self.scale + self.offset(), self.label, hasattr(self, "unset"))


class HoldsStateFails(Collector):
    def collect(self, item, key):
        yield key, item

    def holds_state(self):
        raise RuntimeError("holds_state broke")


class StateDictFails(Collector):
    """Keeps every put and yields nothing; its ``state_dict`` raises."""

    def setup(self, ctx):
        self.held = []

    def collect(self, item, key):
        self.held.append(item)
        return ()

    def holds_state(self):
        return bool(self.held)

    def state_dict(self):
        raise RuntimeError("state_dict broke")

    def load_state_dict(self, state):
        self.held = list(state)


class DonorByKey(Dispatcher):
    """Deals every item to ``a:2``; ``rebalance`` names the donor the key asks for."""

    def route(self, item, key):
        return "a:2"

    def rebalance(self, key, starved, depths):
        return {"unknown": "nobody:9", "no-id": "not an id", "itself": starved,
                "good": "a:2"}[key]


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord(LOGGER, logging.WARNING, __file__, 1, message, None, None)


def test_distinct_log_messages_keep_the_broker_log_filter_bounded():
    """Messages that differ every time each made an entry of the filter's table, kept for
    ever: the broker's memory grew with every put of a hook logging an f-string.  At most 1024
    templates are tracked; the others share one budget of 5 per 10 s."""
    now = [0.0]
    limit = _RateLimitFilter(burst=5, period=10.0, clock=lambda: now[0])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        passed = sum(limit.filter(_record(f"put number {n} " + "x" * 200)) for n in range(20000))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert passed == 1024 + 5
    assert grown < 1 << 20, f"the filter kept {grown} bytes for 20000 distinct messages"
    now[0] = 10.5  # every period ended: a template is tracked again (the table forgets them)
    steady = [limit.filter(_record("steady %d")) for _ in range(7)]
    assert steady == [True] * 5 + [False] * 2

    small = _RateLimitFilter(burst=5, period=10.0, clock=lambda: now[0], max_templates=2)
    now[0] = 0.0
    assert small.filter(_record("a")) and small.filter(_record("b"))  # the table is full
    others = [small.filter(_record(f"other {n}")) for n in range(7)]
    assert others == [True] * 5 + [False] * 2  # one budget for them all
    now[0] = 10.5
    assert small.filter(_record("a")) and small.filter(_record("b"))  # tracked: new periods
    late = _record("other late")
    assert small.filter(late)
    assert late.getMessage() == ("other late (2 more of messages beyond the 2 tracked were not "
                                 "logged in the previous 10 s window)")


def test_a_hook_logging_distinct_messages_is_rate_limited_in_the_broker_log(run_dir, tmp_path):
    """A collector logging 3000 distinct lines in one put: the broker's log (its stderr) takes
    the first 1024 templates and 5 of the rest, where it took all 3000."""
    stderr_path = tmp_path / "broker.err"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "zchannel.cli.main", "broker", "chatty", "--collector",
             "test_hook_and_file_limits:LogsDistinctLines"],
            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=TESTS)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready "), (line, stderr_path.read_text())
        ch = Channel.connect("chatty", timeout=30)
        ch.put(3000, timeout=60)
        assert ch.get(timeout=60) == 3000
        ch.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    logged = [ln for ln in stderr_path.read_text().splitlines() if "distinct message number" in ln]
    assert 0 < len(logged) < 1500, len(logged)


def test_a_hook_instance_keeps_the_state_of_its_slots(channels):
    """``create`` sent an instance's ``vars()`` alone: a class keeping its state in
    ``__slots__`` arrived without it, and every put failed with an ``AttributeError``."""
    ch = Channel.create("slots", collector=ScaledInSlots(3, 1))
    channels.append(ch)
    ch.put(2, timeout=30)
    assert ch.get(timeout=30) == (7, "in vars", False)
    assert ch.stats()["hook_failures"] == 0


def test_holds_state_failures_count_as_hook_failures(channels, tmp_path):
    """A durable channel's collector whose ``holds_state`` raises fails no put (it counts as
    holding state: the journal keeps the puts), but the failure was only logged:
    ``hook_failures`` stayed 0 and ``zchannel stat`` showed nothing while the journal kept
    every put."""
    ch = Channel.create("holds", collector=HoldsStateFails, journal=str(tmp_path / "journal"))
    channels.append(ch)
    for n in range(3):
        ch.put(n, timeout=30)
    figures = ch.stats()
    assert figures["hook_failures"] == 3, figures
    assert figures["last_hook_failure"] == "collector.holds_state: RuntimeError: holds_state broke"
    assert figures["journal"]["collector_inputs"] == 3
    assert [ch.get(timeout=30) for _ in range(3)] == [0, 1, 2]


def test_state_dict_failures_count_as_hook_failures(channels, tmp_path):
    """A ``state_dict`` that raises writes no state (the journal keeps the puts instead),
    counted as the hook's failure; it was only logged."""
    ch = Channel.create("states", collector=StateDictFails, journal=str(tmp_path / "journal"))
    channels.append(ch)
    for n in range(30):  # 9 MB kept: past the 4 MiB after which a state is written
        ch.put(bytes([n]) * 300_000, timeout=30)
    figures = ch.stats()
    assert figures["hook_failures"] >= 1, figures
    assert figures["last_hook_failure"] == "collector.state_dict: RuntimeError: state_dict broke"
    assert figures["journal"]["collector_states"] == 0
    assert figures["journal"]["collector_inputs"] == 30  # the puts are kept instead


def test_a_rebalance_naming_no_usable_donor_fails_the_starved_get(channels):
    """A ``rebalance`` naming an id of no consumer, a string that is no id, or the starved
    consumer itself stole nothing and said nothing: the get waited out its timeout.  It is the
    hook's failure now, the starved get's ``HookError``, counted; a real donor still works."""
    ch = Channel.create("donors", dispatcher=DonorByKey, consumers={"a": 3})
    channels.append(ch)
    for key in ("unknown", "no-id", "itself", "good"):
        ch.put(f"item of {key}", key=key, timeout=30)
    starved = Channel.connect("donors", identity="a:0", timeout=30)
    channels.append(starved)
    for key, named in (("unknown", "'nobody:9'"), ("no-id", "'not an id'"), ("itself", "'a:0'")):
        with pytest.raises(HookError, match=f"Dispatcher.rebalance returned {named}") as err:
            starved.get(key=key, timeout=60)
        assert err.value.exc_type == "ValueError"
        assert ch.qsize(key=key, consumer="a:2") == 1  # nothing taken
    assert starved.get(key="good", timeout=60) == "item of good"
    figures = ch.stats()
    assert figures["hook_failures"] == 3
    assert figures["last_hook_failure"].startswith("dispatcher.rebalance: ")


def _limited_memory() -> None:
    """In the child: at most 2 GiB of address space (a file read whole fails, not the host)."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _zchannel_error(*args: str) -> str:
    """``zchannel ARGS``, which must fail at once with one ``error:`` line and status 2: that
    line."""
    proc = subprocess.run([sys.executable, "-m", "zchannel.cli.main", *args],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          preexec_fn=_limited_memory)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (
        proc.returncode, proc.stderr)
    return lines[0]


NOT_REGULAR = "is not a regular file (a FIFO, a socket or a device)"


@pytest.mark.parametrize("args, named", [
    (("broker", "tf", "--token-file", "{fifo}"), f"{{fifo}} {NOT_REGULAR}"),
    (("broker", "stop", "{address}", "--token-file", "{fifo}"), f"{{fifo}} {NOT_REGULAR}"),
    (("broker", "kf", "--curve-secret-key", "{fifo}"), f"{{fifo}} {NOT_REGULAR}"),
    (("broker", "kz", "--curve-secret-key", "/dev/zero"), f"/dev/zero {NOT_REGULAR}"),
    (("stat", "tcp://127.0.0.1:1", "--curve-secret-key", "{client}", "--curve-server-key",
      "/dev/zero"), f"/dev/zero {NOT_REGULAR}"),
    (("broker", "kh", "--curve-secret-key", "{huge}"),
     "{huge} is larger than 65536 bytes: not a CURVE key file zchannel reads"),
    (("broker", "kp", "--curve-secret-key", "{server}", "--curve-public-keys", "{keydir}"),
     f"{{keydir}}/x.key {NOT_REGULAR}"),
], ids=["broker-token-fifo", "stop-token-fifo", "broker-key-fifo", "broker-key-dev-zero",
        "stat-key-dev-zero", "broker-key-huge", "broker-client-key-fifo"])
def test_key_and_token_files_that_are_not_regular_files_are_refused_at_once(tmp_path, args,
                                                                             named):
    """A FIFO given as ``--token-file`` or a key file blocked the command for ever (waiting
    for a writer); ``/dev/zero`` or a huge file as a key file was read whole (a
    ``MemoryError`` traceback).  They are refused without being read, naming the file."""
    paths = {"fifo": str(tmp_path / "fifo"), "huge": str(tmp_path / "huge.key_secret"),
             "address": f"ipc://{tmp_path}/none.sock"}
    os.mkfifo(paths["fifo"])
    with open(paths["huge"], "wb") as f:
        f.truncate(300 << 20)  # sparse: 300 MB of zeros, no line break
    _, paths["client"] = zmq.auth.create_certificates(str(tmp_path), "client")
    os.chmod(paths["client"], 0o600)
    _, paths["server"] = zmq.auth.create_certificates(str(tmp_path), "server")
    os.chmod(paths["server"], 0o600)
    paths["keydir"] = str(tmp_path / "clients")
    os.mkdir(paths["keydir"])
    os.mkfifo(os.path.join(paths["keydir"], "x.key"))  # a client key file that never ends
    line = _zchannel_error(*(arg.format(**paths) for arg in args))
    assert named.format(**paths) in line


def test_a_token_file_that_is_not_utf8_is_named(tmp_path):
    """A token file that is not UTF-8 was an error naming neither the file nor the option."""
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe\xfdabcdefghijklmnopqrstuv\n")
    token.chmod(0o600)
    expected = (f"error: cannot read the shutdown token from {token}: it is not UTF-8 text "
                "(invalid start byte at byte 0)")
    assert _zchannel_error("broker", "tu", "--token-file", str(token)) == expected
    assert _zchannel_error("broker", "stop", f"ipc://{tmp_path}/none.sock", "--token-file",
                           str(token)) == expected


def test_a_key_file_zchannel_keygen_wrote_still_reaches_a_curve_broker(tmp_path, channels):
    """The key files are parsed by zchannel now, from the bytes read: a pair ``zchannel
    keygen`` writes serves and connects as before."""
    server_pub, server_sec = zmq.auth.create_certificates(str(tmp_path), "server")
    client_pub, client_sec = zmq.auth.create_certificates(str(tmp_path), "client")
    keys = {"server_secret_key": server_sec, "secret_key": client_sec,
            "server_public_key": server_pub}
    ch = Channel.create("keyed", address="tcp://127.0.0.1:0", curve_keys=keys)
    channels.append(ch)
    ch.put("secret", timeout=30)
    assert ch.get(timeout=30) == "secret"
