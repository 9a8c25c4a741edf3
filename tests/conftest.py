"""Shared fixtures: a private run dir per test, channel factories that always clean up, and
worker processes ended by PID.

The session starts one broker fork server (``python -m zchannel.broker.server.forkserver``) and
sets ``ZCHANNEL_BROKER_FORKSERVER`` for itself and the processes it starts, so that each
``Channel.create`` forks a prepared broker instead of starting an interpreter (tens of
milliseconds instead of ~1 s on a loaded machine).  ``ZCHANNEL_TEST_FORKSERVER=0`` runs the
suite on the default start path (``python -m zchannel.broker`` children); tests of that path
itself unset the variable (``spawned_brokers``)."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

import pytest
from cluster_util import SharedRayCluster, until_available, wait_connected  # noqa: F401
from forkbroker import ForkBroker, wait_gone
from zchannel.broker import Channel
from zchannel.broker.server.forkclient import ENV as FORKSERVER_ENV
from zchannel.broker.server.starting import child_environ, read_line, stop_broker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "docs", "examples")  # seed_hooks.py: the seed's example hooks
sys.path.insert(0, EXAMPLES)
_FORKSERVER: dict = {}  # the session's broker fork server: its process and folder
RAY_CLUSTER = SharedRayCluster()  # the simulated Ray cluster of the ``ray_cluster`` tests


PR_SET_PDEATHSIG = 1  # prctl(2)

def _terminated_with_parent() -> None:
    """In a child about to exec: SIGTERM when the process that started it dies (Linux's
    ``PR_SET_PDEATHSIG``, kept across exec), so that a fork server outlives no pytest process
    killed before its ``pytest_unconfigure`` (it would hold the run's output pipe open)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_forkserver(folder: str, env: dict | None = None) -> subprocess.Popen:
    """Start a broker fork server listening in ``folder`` (environment: ``env``, by default
    ``child_environ()``); returned once it printed ready."""
    env = child_environ() if env is None else dict(env)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(REPO, "tests"), EXAMPLES, env.get("PYTHONPATH")) if p)
    sock = os.path.join(folder, "forkserver.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "zchannel.broker.server.forkserver", sock],
        stdout=subprocess.PIPE, env=env, cwd=os.path.join(REPO, "tests"),
        start_new_session=True, preexec_fn=_terminated_with_parent)
    assert proc.stdout is not None
    line = read_line(proc, 120.0)
    assert line.startswith("ready "), f"the broker fork server did not start: {line!r}"
    return proc


def _xdist_controller(config) -> bool:
    """Whether this process hands the tests out to pytest-xdist workers (it runs none)."""
    return (not hasattr(config, "workerinput") and config.pluginmanager.hasplugin("xdist")
            and config.getoption("dist", "no") != "no" and bool(config.getoption("tx", None)))


def pytest_configure(config) -> None:
    if os.environ.get("ZCHANNEL_TEST_FORKSERVER", "1").strip().lower() in ("0", "off", "no"):
        return
    if _xdist_controller(config):  # each worker starts its own fork server
        return
    folder = f"/tmp/zcfs-{uuid.uuid4().hex[:10]}"
    os.makedirs(folder, mode=0o700)
    proc = start_forkserver(folder)
    _FORKSERVER.update(proc=proc, folder=folder)
    os.environ[FORKSERVER_ENV] = os.path.join(folder, "forkserver.sock")


def _on_ray_cluster(item) -> bool:
    """Whether test ``item`` runs on the shared Ray cluster (uses ``ray_cluster``)."""
    return "ray_cluster" in getattr(item, "fixturenames", ())


def pytest_itemcollected(item) -> None:
    """Tests that must share one pytest-xdist worker (the README's test command runs the suite
    on 2 with ``--dist loadgroup``; a plain run ignores the groups), in collection order: the
    ``ray_cluster`` tests (one cluster start), the tests of a module with a module-scoped
    fixture (built once), and the long runs marked slow, fuzz or soak (one at a time, as each
    is sized for the whole machine)."""
    if _on_ray_cluster(item):
        group = "ray_cluster"
    elif any(item.get_closest_marker(m) for m in ("slow", "fuzz", "soak")):
        group = "long_runs"
    else:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if not any(d.scope == "module" for fds in defs for d in fds):
            return
        group = item.module.__name__
    item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items) -> None:
    """The tests on the shared Ray cluster (``ray_cluster``) run one after another, where the
    first of them stood (after any reordering by other plugins): one cluster start for all."""
    users = [item for item in items if _on_ray_cluster(item)]
    if users:
        first = items.index(users[0])
        moved = {id(item) for item in users}
        rest = [item for item in items if id(item) not in moved]
        items[:] = rest[:first] + users + rest[first:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a run of ``ray_cluster`` tests (and its fixtures), the cluster
    is shut down."""
    yield
    if nextitem is None or not _on_ray_cluster(nextitem):
        RAY_CLUSTER.close()


@pytest.fixture
def ray_cluster():
    """The simulated three-node Ray cluster (tests/cluster_util.py ``ray_three_nodes``, node
    ``i`` offering the custom resource ``node<i>``), shared by the tests that use it (they run
    one after another); skipped with Ray's reason where it cannot start."""
    return RAY_CLUSTER.get()


def pytest_unconfigure(config) -> None:
    RAY_CLUSTER.close()
    proc = _FORKSERVER.pop("proc", None)
    if proc is None:
        return
    os.environ.pop(FORKSERVER_ENV, None)
    stop_broker(proc)
    if proc.stdout:
        proc.stdout.close()
    shutil.rmtree(_FORKSERVER.pop("folder"), ignore_errors=True)


@pytest.fixture
def spawned_brokers(monkeypatch) -> None:
    """Brokers of this test start on the default path: ``python -m zchannel.broker`` children
    of the process creating them (no fork server)."""
    monkeypatch.delenv(FORKSERVER_ENV, raising=False)


@pytest.fixture(autouse=True)
def run_dir(tmp_path_factory, monkeypatch) -> Iterator[str]:
    """Each test gets its own ``ZCHANNEL_RUN_DIR`` (short path: ipc paths are limited)."""
    path = f"/tmp/zct-{uuid.uuid4().hex[:10]}"
    os.makedirs(path, mode=0o700)
    monkeypatch.setenv("ZCHANNEL_RUN_DIR", path)
    # broker children import the tests' hook modules (hookmods, payloads)
    tests_dir = os.path.join(REPO, "tests")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (tests_dir, EXAMPLES, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.delenv("ZCHANNEL_IDENTITY", raising=False)
    yield path
    from zchannel.broker import shm  # segments of brokers a test SIGKILLed (no next start here)

    for name in shm.list_segments(shm.run_prefix(path)):
        os.unlink(os.path.join(shm.SHM_DIR, name))
    for name in os.listdir(path):
        try:
            os.unlink(os.path.join(path, name))
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


@pytest.fixture(autouse=True)
def zchannel_logging() -> Iterator[None]:
    """A ``zchannel broker`` run in this process (click's CliRunner) sets up the broker's
    logging (``setup_logging``: no propagation to the root logger); put it back afterwards,
    so that later tests' ``caplog`` sees zchannel's records."""
    logger = logging.getLogger("zchannel")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate, logger.level = saved[0], saved[1], saved[2]


@pytest.fixture
def channels() -> Iterator[list]:
    """A list to which tests append channels; each is shut down (or closed) at teardown."""
    opened: list = []
    yield opened
    for ch in reversed(opened):
        try:
            if getattr(ch, "_proc", None) is not None or getattr(ch, "_owner", False):
                ch.shutdown()
            else:
                ch.close()
        except Exception:
            pass


@pytest.fixture(params=["broker", "local", "distributed"])
def make(request, channels, run_dir):
    """``make(name, **kw)`` creates a channel served by a broker process, a local one, or a
    distributed one (three replicas on this host, keys spread over them: tests/cluster_util.py)."""
    local = request.param == "local"
    distributed = request.param == "distributed"
    if distributed:
        from cluster_util import write_cluster

        mp = request.getfixturevalue("monkeypatch")
        mp.setenv("ZCHANNEL_CLUSTER", write_cluster(run_dir))
        mp.setenv("ZCHANNEL_NODE", "n0")

    def factory(name: str = "ch", **kwargs):
        ch = Channel.create(name, local=local, distributed=distributed, **kwargs)
        channels.append(ch)
        return ch

    factory.local = local
    factory.distributed = distributed
    return factory


@pytest.fixture
def make_remote(channels):
    def factory(name: str = "ch", **kwargs):
        ch = Channel.create(name, **kwargs)
        channels.append(ch)
        return ch

    return factory


@pytest.fixture
def brokers() -> Iterator[ForkBroker]:
    """Brokers forked from one prepared process (tests/forkbroker.py): ``start(**fields)`` a
    broker, ``kill(pid)`` it (SIGKILL, until it is gone) and start it again on its journal;
    the ones still running are killed at teardown."""
    fb = ForkBroker()
    yield fb
    fb.close()


def drain(ch, key: str = "default_queue") -> list:
    """Every item ``key`` holds, taken in order (its depth says how many: no timeout to wait
    out at the end)."""
    out = []
    while ch.qsize(key):
        out.append(ch.get(key=key, timeout=10))
    return out


class Workers:
    """Python worker processes started from source text; all killed by PID at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.join(REPO, "tests"), full_env.get("PYTHONPATH")) if p
        )
        full_env.update(env or {})
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            env=full_env,
            cwd=os.path.join(REPO, "tests"),  # not the repo root, whose folders shadow modules
            bufsize=0,  # unbuffered: readline() never reads past the line it returns
        )
        self.procs.append(proc)
        return proc

    def wait_line(self, proc: subprocess.Popen, expected: str | None = None, timeout: float = 60) -> str:
        """Read one line of the worker's stdout (a readiness handshake), with a timeout."""
        import select

        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"worker {proc.pid} printed nothing within {timeout}s")
        line = proc.stdout.readline().decode().strip()
        if expected is not None:
            assert line == expected, f"worker said {line!r}, expected {expected!r}"
        return line

    def finish(self, proc: subprocess.Popen, timeout: float = 60) -> str:
        out, _ = proc.communicate(timeout=timeout)
        text = out.decode()
        assert proc.returncode == 0, f"worker {proc.pid} exited with {proc.returncode}: {text}"
        return text

    @staticmethod
    def send(proc: subprocess.Popen, line: str = "") -> None:
        proc.stdin.write((line + "\n").encode())
        proc.stdin.flush()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            for stream in (proc.stdout, proc.stdin):
                if stream:
                    stream.close()


@pytest.fixture
def workers() -> Iterator[Workers]:
    w = Workers()
    yield w
    w.kill_all()


def wait_until(cond, timeout: float = 10.0, interval: float = 0.05):
    """Poll ``cond()`` until it is truthy or ``timeout`` passes; its last value.  Only for
    state no event reports to the test: a broker's counters read through ``stats()`` (it
    publishes no change notifications), a lock's state, a reply deliberately left unwaited.
    Process exits use ``exited`` (pidfds), brokers starting again ``wait_connected``, workers
    their printed handshakes."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)  # the one poll left: what it waits for sends no event


def exited(pids, timeout: float = 30.0) -> bool:
    """Whether every process of ``pids`` (a pid or several) exits within ``timeout`` seconds:
    a wait on each one's pidfd, which turns readable when it exits (``forkbroker.wait_gone``)."""
    deadline = time.monotonic() + timeout
    for pid in [pids] if isinstance(pids, int) else pids:
        try:
            wait_gone(pid, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
    return True


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` (``VmRSS`` of ``/proc/PID/status``), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped meanwhile (ESRCH on the read)
        return False


@pytest.fixture
def broker_procs() -> Iterator:
    """``start(*args)`` runs ``zchannel broker ARGS`` until its ``ready`` line: (process,
    address), its stdout and stderr piped (read them once it ended); any still running at
    teardown is killed by PID."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline()
        assert line.startswith("ready "), proc.communicate(timeout=30)
        return proc, line.split()[1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


# the ``bounded_broker`` fixture's ``--max-bytes``
BOUNDED_MAX_BYTES = 1 << 20


@pytest.fixture
def bounded_broker(run_dir) -> Iterator[tuple[int, str]]:
    """A ``zchannel broker bounded --max-bytes BOUNDED_MAX_BYTES`` process (its log goes to the
    test's stderr: a flood's warnings never fill a pipe): (pid, address).  Ended at teardown."""
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "bounded",
                             "--max-bytes", str(BOUNDED_MAX_BYTES)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ready "), line
        yield proc.pid, line.split()[1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A directory with a short path (an ipc path takes 107 bytes), removed afterwards."""
    path = f"/tmp/zcsd-{uuid.uuid4().hex[:8]}"
    os.makedirs(path, mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def cli_broker(run_dir, tmp_path):
    """``start(name, *flags, config=TOML)``: a ``zchannel broker`` process (``config``: the text
    of a ``--config`` file); its address once it printed ``ready``.  Ended at teardown."""
    procs: list[subprocess.Popen] = []

    def start(name: str, *flags: str, config: str | None = None) -> str:
        args = [sys.executable, "-m", "zchannel.cli.main", "broker", name, *flags]
        if config is not None:
            path = tmp_path / f"{name}.toml"
            path.write_text(config)
            args += ["--config", str(path)]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline()
        assert line.startswith("ready "), line
        return line.split()[1]

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
