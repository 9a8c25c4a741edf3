"""Starting a broker process for ``Channel.create``: the hooks as the child receives them
(checked here first, so that a wrong name fails before anything starts), the child process
itself with the environment zchannel gives the processes it starts (``child_environ``) and
this process's ``sys.path`` (``broker_environ``), the errors of a start that failed
(``docs/errors.md``), and stopping it again."""

from __future__ import annotations

import os
import secrets
import select
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from zchannel.broker.core.hookpipeline import registered_name
from zchannel.broker.errors import BrokerStartError
from zchannel.broker.server import forkclient
from zchannel.broker.wire import codec
from zchannel.hooks import Collector, Dispatcher, hook_spec, import_path, registered

START_TIMEOUT_S = 60.0
# glibc's memcpy switches to non-temporal (streaming) stores only from this tunable up, and
# derives its default from the L3 size it detects (190 MiB on the VM of docs/benchmarks.md):
# a 16 MiB shared-memory slot copy then reads every destination line before writing it and
# pushes the rest of the cache out (docs/shm.md, "Large copies").  glibc reads it only when a
# process starts, and ignores it off x86-64.
NON_TEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
NON_TEMPORAL_BYTES = 4 << 20  # 1 MiB slots stay cached: their consumer reads them soon after
_OFF = ("0", "off", "false", "no")
# a broker process this process started: a child (``subprocess.Popen``) or one forked by the
# fork server (``forkclient.ForkedBroker``, the same methods)
BrokerProcess = subprocess.Popen | forkclient.ForkedBroker


def child_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process zchannel starts: ``environ`` (by default ``os.environ``)
    with glibc's non-temporal copy threshold at 4 MiB added to ``GLIBC_TUNABLES``, unless that
    variable sets the threshold already (the user's value wins) or ``ZCHANNEL_GLIBC_TUNABLES``
    is ``0``/``off``/``false``/``no``."""
    env = dict(os.environ if environ is None else environ)
    if env.get("ZCHANNEL_GLIBC_TUNABLES", "1").strip().lower() in _OFF:
        return env
    current = env.get("GLIBC_TUNABLES", "")
    if f"{NON_TEMPORAL_TUNABLE}=" in current:
        return env
    entry = f"{NON_TEMPORAL_TUNABLE}={NON_TEMPORAL_BYTES:#x}"
    env["GLIBC_TUNABLES"] = f"{current}:{entry}" if current else entry
    return env


def broker_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a broker this process starts: ``child_environ(environ)`` with this
    process's ``sys.path`` ahead of its ``PYTHONPATH``, so that the broker imports a hook's
    module wherever this process found it (next to the script it runs, say), as
    ``multiprocessing``'s spawn start method hands a child the parent's ``sys.path``.

    The entries that are directories go first, absolute (``''`` is the working directory),
    each once; the ``PYTHONPATH`` entries not among them follow, in their order.
    """
    env = child_environ(environ)
    entries: list[str] = []
    for entry in sys.path:
        path = os.path.abspath(entry)  # ("" is the working directory)
        if path not in entries and os.path.isdir(path):
            entries.append(path)
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.path.abspath(entry) not in entries:
            entries.append(entry)
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    return env


def hook_for_child(hook: Any, imports: list[str], base: type) -> Any:
    """A hook (a ``base`` subclass) as the broker child receives it: a name/path, or an
    instance's class and state.

    Modules of hook classes registered in this process are added to ``imports`` so that the
    child knows their registered names too.  Names and paths are resolved by the broker
    process (its environment decides which exist): an unknown one is its ``ValueError``.
    """
    if isinstance(hook, (Collector, Dispatcher)):
        return _instance_for_child(hook)
    if isinstance(hook, str) and ":" not in hook:
        named = registered(base).get(hook.lower())
        if named is not None and not named.__module__.startswith("zchannel."):
            imports.append(named.__module__)
            return _registered_for_child(named, hook.lower())
        return hook
    if isinstance(hook, type) and not hook.__module__.startswith("zchannel."):
        imports.append(hook.__module__)
        name = registered_name(hook)
        if name is not None and registered(base).get(name) is hook:
            return _registered_for_child(hook, name)
    return hook_spec(hook)


def _instance_for_child(hook: Collector | Dispatcher) -> dict[str, Any]:
    """A hook instance as the broker child receives it: its class's path, its ``vars()``
    (``"state"``) and, when its class has ``__slots__``, the slots that are set (``"slots"``,
    by attribute name); ``TypeError`` when a value cannot travel, or the class cannot be
    imported by the broker process."""
    state = dict(vars(hook))
    slots = {name: getattr(hook, name) for name in _slot_names(type(hook)) if hasattr(hook, name)}
    try:
        codec.encode([state, slots])
    except TypeError as exc:
        raise TypeError(
            f"hook instance {hook!r} cannot be handed to the broker ({exc}); pass its class "
            "or name and configure it through options="
        ) from None
    cls = type(hook)
    hook_spec(cls)  # raises for classes the broker process cannot import
    spec: dict[str, Any] = {"class": f"{cls.__module__}:{cls.__qualname__}", "state": state}
    if slots:
        spec["slots"] = slots
    return spec


def _slot_names(cls: type) -> list[str]:
    """The attribute names of the ``__slots__`` of ``cls`` and its bases (private ones
    mangled, as Python stores them; ``__dict__`` and ``__weakref__`` left out)."""
    names: list[str] = []
    for klass in cls.__mro__:
        declared = vars(klass).get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            if name not in names:
                names.append(name)
    return names


def _registered_for_child(cls: type, name: str) -> Any:
    """A class registered under ``name`` in this process, as the child receives it: its path
    and that name, which the child registers too (``hook_from_wire``): the registration may
    have been made at run time, not by importing the class's module.  A class the child
    cannot import (``__main__``, a local class) goes by name alone: the child may know it
    (an entry point, ``--import``)."""
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        return name
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "name": name}


def hook_label(spec: Any) -> str | None:
    """A hook as given to ``create`` (after ``hook_for_child``), named the way the broker's
    ``stats()`` names it: its registered name, else ``module:qualname``."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        spec = spec.get("class")
    if not isinstance(spec, str):
        return None
    if ":" in spec:
        try:
            cls = import_path(spec)
        except Exception:
            return spec
        return (registered_name(cls) if isinstance(cls, type) else None) or spec
    return spec.lower()


def spawn_broker(config: dict, lock_fd: int) -> tuple[BrokerProcess, str, str]:
    """Start ``python -m zchannel.broker`` as a child in its own session (environment:
    ``broker_environ``, so it imports what this process's ``sys.path`` finds); it inherits the
    lock fd and stderr, reads its config from stdin and prints ``ready <address>``.  With
    ``ZCHANNEL_BROKER_FORKSERVER`` set, the fork server that variable names forks the broker
    instead (``forkclient``), with the same config, lock, environment and stderr."""
    token = secrets.token_hex(16)
    config = dict(config, parent_pid=os.getpid(), lock_fd=lock_fd, token=token)
    body, buffers = codec.encode(config)
    assert not buffers
    server = forkclient.forkserver_path()
    if server is not None:
        # (the forked broker puts the PYTHONPATH entries its sys.path lacks first on it)
        forked = forkclient.spawn_forked(server, body, lock_fd, broker_environ())
        return forked, _ready_address(forked, config["name"]), token
    proc = subprocess.Popen(
        [sys.executable, "-m", "zchannel.broker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        pass_fds=(lock_fd,),
        start_new_session=True,
        close_fds=True,
        env=broker_environ(),
    )
    stdin = proc.stdin
    assert stdin is not None  # stdin=PIPE
    try:
        stdin.write(body)
        stdin.close()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, _ready_address(proc, config["name"]), token


def _ready_address(proc: BrokerProcess, name: str) -> str:
    """The address a starting broker reports on its ``ready`` line; a broker that reports an
    error (or nothing in time) is killed and its error raised (``start_error``).  The pipe is
    closed once read: the broker writes nothing more on it."""
    try:
        line = read_line(proc, START_TIMEOUT_S)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
    if not line.startswith("ready "):
        proc.kill()
        proc.wait()
        raise start_error(name, line.strip())
    return line.split(None, 1)[1].strip()


def stop_broker(proc: BrokerProcess, grace_s: float = 5.0) -> None:
    """Stop a broker process this process started: SIGTERM (the broker removes its files), then
    SIGKILL if it has not exited within ``grace_s`` (by PID)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10.0)


def start_error(name: str, line: str) -> BaseException:
    """The error of a broker that reported ``error <Type>: <message>`` instead of ``ready``.

    Wrong arguments keep the standard types, wherever they are found: the broker's
    ``ValueError``/``TypeError`` (an unknown hook name, options a hook's ``setup`` refused)
    stay so, and a hook module that does not import (``ImportError``) is a ``ValueError``.
    Anything else (an address in use, a hook failing otherwise, no output) is
    ``BrokerStartError`` with the broker's exception type as ``reason``.
    """
    message = f"broker for {name!r} failed to start: {line or 'no output'}"
    exc_name, sep, _ = line.removeprefix("error ").partition(":")
    reason = exc_name if line.startswith("error ") and sep else ""
    if reason == "TypeError":
        return TypeError(message)
    if reason in ("ValueError", "ImportError", "ModuleNotFoundError"):
        return ValueError(message)
    return BrokerStartError(message, reason)


def read_line(proc: BrokerProcess, timeout: float) -> str:
    assert proc.stdout is not None, "the broker child's stdout is a pipe"
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BrokerStartError("the broker did not report ready in time", "timeout")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace")
