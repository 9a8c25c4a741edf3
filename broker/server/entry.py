"""The broker process's entry points: ``python -m zchannel.broker`` (``main_from_stdin``: the
config from its creator on stdin, the start watched by ``StartWatch``, then the loop) and
``zchannel broker`` (``run_broker``)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, NoReturn, TextIO

import zmq
from zchannel.broker.host import paths
from zchannel.broker.server.config import BrokerConfig, lock_name_of
from zchannel.broker.server.loop import Broker, setup_logging
from zchannel.broker.server.startwatch import StartInterrupted, StartWatch, close_pidfd
from zchannel.broker.wire import codec
from zchannel.hooks import (
    Collector,
    import_path,
    register_collector,
    register_dispatcher,
)


def hook_from_wire(spec: Any) -> Any:
    """Rebuild a hook given to ``create`` as an instance: ``{"class": path, "state": {...}}``
    (its ``vars()``) and, for a class with ``__slots__``, ``"slots": {...}``, set as they
    were; a class its creator registered under a name, ``{"class": path, "name": name}``, is
    registered here under that name too and given as the class."""
    if isinstance(spec, dict) and "class" in spec:
        cls = import_path(spec["class"])
        if "name" in spec:
            register = register_collector if issubclass(cls, Collector) else register_dispatcher
            return register(spec["name"])(cls)
        obj = cls.__new__(cls)
        obj.__dict__.update(spec.get("state") or {})
        for name, value in (spec.get("slots") or {}).items():
            object.__setattr__(obj, name, value)  # past any __setattr__ of its, as __dict__ is
        return obj
    return spec


def _report_pipe() -> TextIO:
    """The pipe to the creator, which reads one ``ready``/``error`` line on it, moved off
    stdout: what hooks print (at import, in ``setup``, on every put) goes to stderr, so it
    neither garbles that line nor fills a pipe nobody reads after it."""
    sys.stdout.flush()
    report = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return report


def _report_error(exc: BaseException | None, report: TextIO) -> None:
    """Tell the creator why the start failed (``error NAME: message`` on ``report``); a
    creator gone (a broken pipe) is told nothing, and ``report`` goes to /dev/null (no error
    at exit)."""
    try:
        report.write(f"error {type(exc).__name__}: {exc}\n")
        report.flush()
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, report.fileno())
        os.close(devnull)


def _abandon_start(fields: dict[str, Any], started: list[Broker], parent_fd: int | None) -> NoReturn:
    """The creator exited while this broker started: give back what the start took (the
    broker's files, else the channel lock it was handed) and exit, not waiting for threads a
    hook may have started."""
    try:
        if started:
            started[0].close()
        elif fields.get("lock_fd") is not None:
            paths.release_lock_if_held(lock_name_of(fields["name"], fields.get("cluster"),
                                                    fields.get("replicas"), fields.get("replica")),
                                       fields["lock_fd"])
        close_pidfd(parent_fd)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # (a creator gone: a broken pipe) exit all the same
                pass
        os._exit(1)


def run_broker(config: BrokerConfig) -> int:
    """Run a broker in this process until it stops (``zchannel broker``: it logs where its
    shutdown token is kept); the exit status.  While it starts, SIGTERM and SIGHUP (unless
    ignored: ``nohup``) interrupt it as SIGINT does, so a start they end gives back what it
    took (its lock, its shared memory); the loop then handles them as stops."""
    setup_logging()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, signal.default_int_handler)
    broker = Broker(config)
    broker.announce_token = True
    broker.serve_forever()
    return broker.exit_code


def main_from_stdin() -> int:
    """Entry of ``python -m zchannel.broker``: the config arrives as msgpack on stdin (the trusted
    start-up pipe of ``Channel.create``)."""
    data = sys.stdin.buffer.read()
    try:
        fields = codec.decode(data)
        if not isinstance(fields, dict):
            raise ValueError(f"a {type(fields).__name__}, not a table of settings")
    except ValueError as exc:
        print(f"error: no broker settings on stdin ({exc}); this is the process Channel.create "
              "starts: run `zchannel broker NAME` instead", file=sys.stderr)
        return 2
    report = _report_pipe()
    setup_logging()
    watch = StartWatch(fields.get("parent_pid"))  # the creator may exit while hooks start
    started: list[Broker] = []
    error: Exception | None = None
    try:
        try:
            watch.arm()  # (raises at once if the creator is gone already)
            for name in ("collector", "dispatcher"):
                fields[name] = hook_from_wire(fields.get(name))
            started.append(Broker(BrokerConfig(**fields)))
        except Exception as exc:
            error = exc
        watch.disarm()
    except StartInterrupted:  # raised once at most: nothing after this may raise it
        pass
    except KeyboardInterrupt:  # another SIGINT (it disarmed the watch): as before, once the
        close_pidfd(watch.stop())  # watch is stopped and what the start took given back
        if started:
            started[0].close()
        raise
    parent_fd = watch.stop()
    if watch.fired:  # however the start ended (a hook may have swallowed the interruption)
        _abandon_start(fields, started, parent_fd)
    if error is not None or not started:
        close_pidfd(parent_fd)
        _report_error(error, report)
        return 1
    broker = started[0]
    broker.parent_fd = parent_fd  # the loop watches the creator on it from now on
    try:
        broker.serve_forever(report)
    except (zmq.ZMQError, ValueError, OSError, RuntimeError) as exc:
        # a busy address, a bad key file, a metrics endpoint that cannot start (RuntimeError),
        # a creator gone before "ready" (BrokenPipeError)
        _report_error(exc, report)
        return 1
    return broker.exit_code


__all__ = ["hook_from_wire", "main_from_stdin", "run_broker"]
