"""Worker groups with RLinf's call forms: ``Worker.create_group(...).launch(...)``.

A ``Worker`` subclass is instantiated once per rank, either as a local process (``multiprocessing``
spawn; no Ray needed) or as a Ray actor (``launch(ray=True)``, optionally pinned per rank to node
indexes with ``node_ranks=``).  Calling a method on the group calls it on every rank and returns
a ``GroupCall`` whose ``.wait()`` gives one result per rank.  Each worker is named
``<group>:<rank>`` and runs with ``ZCHANNEL_IDENTITY`` set to that name, so a channel handle
passed to a group method binds to the worker it lands in (it is a consumer under that id), and
``self.create_channel(name)`` / ``self.connect_channel(name)`` do the same from inside.

The group is a *worker group* for ``Channel.create(producers=[...], consumers=[...])``: it
implements ``zchannel_group() -> (name, worker_ids, placement_targets)``, the duck-typed protocol
the broker package recognises (``zchannel.broker.handle.workergroups``): as a consumer it expands to its
worker ids, as a producer to its name, and on Ray its actors are the placement targets (the
channel goes to the first producer's node, else the first consumer's, else the creator's).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from zchannel.broker import Channel
from zchannel.broker.handle import ray_placement

IDENTITY_ENV = "ZCHANNEL_IDENTITY"
log = logging.getLogger("zchannel.embodied")


class WorkerError(RuntimeError):
    """A group method failed (or its worker died) on some rank."""


class Worker:
    """Base class of group workers: ``rank``, ``world_size``, ``worker_name`` are set per rank,
    already when ``__init__`` runs."""

    _group_name: str = "worker"
    _rank: int = 0
    _world_size: int = 1

    @classmethod
    def create_group(cls, *args: Any, **kwargs: Any) -> WorkerGroup:
        """A group of this class built with ``cls(*args, **kwargs)`` on each rank; start it
        with ``.launch(...)``."""
        return WorkerGroup(cls, args, kwargs)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def worker_name(self) -> str:
        return f"{self._group_name}:{self._rank}"

    def create_channel(self, channel_name: str, maxsize: int = 0, distributed: bool = False,
                       node_rank: int | None = None, local: bool = False, **kwargs: Any) -> Any:
        """``Channel.create`` bound to this worker (placed on this worker's node under Ray);
        RLinf's ``Worker.create_channel(channel_name, maxsize, distributed, node_rank, local)``."""
        kwargs.setdefault("identity", self.worker_name)
        return Channel.create(channel_name, maxsize, distributed, node_rank, local, **kwargs)

    def connect_channel(self, channel_name: str, **kwargs: Any) -> Any:
        """``Channel.connect(channel_name)`` bound to this worker (RLinf's parameter name)."""
        kwargs.setdefault("identity", self.worker_name)
        return Channel.connect(channel_name, **kwargs)

    def _zchannel_setup(self, group: str, rank: int, world: int) -> None:
        self._group_name, self._rank, self._world_size = group, rank, world
        os.environ[IDENTITY_ENV] = f"{group}:{rank}"

    def _zchannel_call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self, method)(*args, **kwargs)

    def _zchannel_release(self) -> None:
        """Tear down the Ray-placed channels this worker's process created (with
        ``create_channel`` or ``Channel.create``), as their creating handles' ``shutdown()``
        would: their broker actors, work directories and shared memory.
        ``WorkerGroup.shutdown`` calls it before it kills the worker's actor, whose exit
        handlers (which would do it) Ray does not run."""
        ray_placement.teardown_all()

    def _zchannel_node(self) -> str | None:
        ray = __import__("sys").modules.get("ray")
        if ray is None or not ray.is_initialized():
            return None
        return ray.get_runtime_context().get_node_id()


LAUNCH_CALL = 0  # the call id of a local worker's construction; method calls count from 1


def _serve(cls: type, args: tuple, kwargs: dict, group: str, rank: int, world: int,
           conn: Any) -> None:
    """A local worker process: build the worker, its rank and name set before its ``__init__``
    runs (answering ``(LAUNCH_CALL, status, error)``;
    a constructor that raises is answered with its traceback and ends the process), then run
    the calls ``(call_id, method, args, kwargs)`` that arrive on ``conn``, answering each with
    ``(call_id, "ok", result)`` or ``(call_id, "err", traceback)``."""
    os.environ[IDENTITY_ENV] = f"{group}:{rank}"
    try:
        worker_class: Any = cls  # built as ``cls(*args, **kwargs)`` is, set up in between:
        worker = worker_class.__new__(worker_class, *args, **kwargs)
        worker._zchannel_setup(group, rank, world)  # rank and name are there in ``__init__``
        worker_class.__init__(worker, *args, **kwargs)
    except BaseException:
        conn.send((LAUNCH_CALL, "err", f"constructing {cls.__name__} raised:\n"
                                       f"{traceback.format_exc()}"))
        return
    conn.send((LAUNCH_CALL, "ok", None))
    while True:
        try:
            call = conn.recv()
        except EOFError:
            return
        if call is None:
            return
        call_id, method, a, kw = call
        try:
            conn.send((call_id, "ok", worker._zchannel_call(method, a, kw)))
        except BaseException:
            conn.send((call_id, "err", traceback.format_exc()))


def _ranked_class(cls: Any) -> type:
    """A subclass of ``cls`` (same name) whose constructor takes ``(group, rank, world)`` first
    and sets them up before ``cls.__init__`` runs: Ray builds its actors itself, and this is how
    a Ray rank knows its rank and name in ``__init__``."""
    def __init__(self: Any, _zchannel_rank: tuple, *args: Any, **kwargs: Any) -> None:
        self._zchannel_setup(*_zchannel_rank)
        cls.__init__(self, *args, **kwargs)
    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


def _ray_done(ray: Any, ref: Any) -> bool:
    """Whether the Ray call ``ref`` finished."""
    return bool(ray.wait([ref], timeout=0)[0])


class GroupCall:
    """One method call on every rank; ``wait()`` returns the per-rank results in rank order."""

    def __init__(self, group: WorkerGroup, method: str, waiters: list[Callable[[float | None], Any]],
                 ready: list[Callable[[], bool]]) -> None:
        self.group, self.method = group, method
        self._waiters, self._ready = waiters, ready
        self._results: dict[int, tuple[bool, Any]] = {}  # rank -> (ok, value or error)

    def _wait_rank(self, rank: int, timeout: float | None) -> Any:
        if rank not in self._results:
            try:
                self._results[rank] = (True, self._waiters[rank](timeout))
            except WorkerError as exc:
                self._results[rank] = (False, exc)
        ok, value = self._results[rank]
        if not ok:
            raise value
        return value

    def done(self) -> bool:
        return all(rank in self._results or ready() for rank, ready in enumerate(self._ready))

    def failures(self) -> dict[int, str]:
        """The ranks whose call already ended in an error (or whose worker died): rank -> why."""
        out = {}
        for rank, ready in enumerate(self._ready):
            if rank in self._results or ready():
                try:
                    self._wait_rank(rank, 0)
                except (WorkerError, TimeoutError) as exc:
                    out[rank] = str(exc).splitlines()[0]
        return out

    def wait(self, timeout: float | None = None) -> list:
        """Every rank's result in rank order; the first rank's error is raised after all ranks
        answered (so no answer is left behind for the next call)."""
        first: BaseException | None = None
        out = []
        for rank in range(len(self._waiters)):
            try:
                out.append(self._wait_rank(rank, timeout))
            except WorkerError as exc:
                first = first or exc
                out.append(None)
        if first is not None:
            raise first
        return out


class WorkerGroup:
    """Ranks of one ``Worker`` class; method calls go to every rank (see the module doc)."""

    def __init__(self, cls: type, args: tuple, kwargs: dict) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"{cls!r} is not a Worker subclass")
        self._cls, self._args, self._kwargs = cls, args, kwargs
        self._name = cls.__name__.lower()
        self._ray = False
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._actors: list[Any] = []
        # per local rank: call id -> (status, value), the answers read but not yet taken (an
        # answer is read when it or a later call's answer is awaited)
        self._answers: list[dict[int, tuple[str, Any]]] = []
        self._dropped_calls: set[int] = set()  # calls whose GroupCall nobody holds any more
        self._calls = LAUNCH_CALL  # the id of the last call sent to the local ranks

    def launch(self, num_workers: int = 1, *, name: str | None = None, ray: bool = False,
               node_ranks: list[int] | None = None) -> WorkerGroup:
        """Start ``num_workers`` ranks named ``<name>:<rank>`` as local processes, or as Ray
        actors (``ray=True``; ``node_ranks[i]`` pins rank i to the i-th alive node in node-id
        order).  Returns the group once every rank is constructed; when a rank fails to start
        (a local rank: ``WorkerError`` naming it, with its constructor's traceback or its exit
        code), every rank already started is stopped before the error is raised."""
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if name is not None:
            self._name = name
        self._ray = bool(ray)
        try:
            if self._ray:
                self._launch_ray(num_workers, node_ranks)
            else:
                self._launch_local(num_workers)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _launch_local(self, num_workers: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        for rank in range(num_workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, name=f"{self._name}:{rank}", daemon=True,
                               args=(self._cls, self._args, self._kwargs, self._name, rank,
                                     num_workers, child))
            try:
                proc.start()
            except BaseException:  # (an argument that cannot be pickled): no rank of it
                parent.close()
                child.close()
                raise
            self._procs.append(proc)
            self._conns.append(parent)
            self._answers.append({})
            child.close()
        for rank in range(num_workers):
            self._local_result(rank, LAUNCH_CALL, None)

    def _launch_ray(self, num_workers: int, node_ranks: list[int] | None) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        if node_ranks is not None:
            _check_node_ranks(node_ranks, len(nodes))
        remote: Any = ray.remote(num_cpus=0)(_ranked_class(self._cls))
        for rank in range(num_workers):
            options: dict[str, Any] = {"runtime_env": {"env_vars": {
                IDENTITY_ENV: f"{self._name}:{rank}",
                **{k: v for k, v in os.environ.items() if k.startswith("ZCHANNEL_")
                   and k != IDENTITY_ENV}}}}
            if node_ranks is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    nodes[node_ranks[rank % len(node_ranks)]], soft=False)
            actor = remote.options(**options).remote((self._name, rank, num_workers),
                                                     *self._args, **self._kwargs)
            self._actors.append(actor)
        ray.get([a._zchannel_node.remote() for a in self._actors])  # every rank constructed

    # -- the zchannel group protocol ---------------------------------------------------------

    def zchannel_group(self) -> tuple[str, list[str], list]:
        """``(name, worker ids, placement targets)`` for ``Channel.create``."""
        return self._name, self.worker_ids, list(self._actors)

    @property
    def name(self) -> str:
        return self._name

    @property
    def worker_ids(self) -> list[str]:
        return [f"{self._name}:{r}" for r in range(self.size)]

    @property
    def size(self) -> int:
        return len(self._actors) if self._ray else len(self._procs)

    # -- calls -------------------------------------------------------------------------------

    def _died(self, rank: int) -> WorkerError:
        proc = self._procs[rank]
        proc.join(5)  # its pipe ended: the exit code follows
        return WorkerError(f"worker {self._name}:{rank} died (exit code {proc.exitcode})")

    def _receive(self, rank: int) -> None:
        """Read one answer of rank ``rank`` into ``self._answers``; ``WorkerError`` naming the
        rank and its exit code when the pipe ended (the process died)."""
        try:
            call_id, status, value = self._conns[rank].recv()
        except (EOFError, OSError):
            raise self._died(rank) from None
        if call_id not in self._dropped_calls:  # (nobody can wait for a dropped call's)
            self._answers[rank][call_id] = (status, value)

    def _local_done(self, rank: int, call_id: int) -> bool:
        """Whether rank ``rank``'s answer to call ``call_id`` is there (or its process ended)."""
        try:
            while call_id not in self._answers[rank] and self._conns[rank].poll(0):
                self._receive(rank)
        except WorkerError:
            return True
        return call_id in self._answers[rank] or not self._procs[rank].is_alive()

    def _local_result(self, rank: int, call_id: int, timeout: float | None) -> Any:
        """Rank ``rank``'s answer to call ``call_id`` (answers of other calls read on the way
        are kept for them): ``TimeoutError`` after ``timeout`` seconds, ``WorkerError`` for an
        error or a dead process."""
        conn, proc, answers = self._conns[rank], self._procs[rank], self._answers[rank]
        deadline = None if timeout is None else time.monotonic() + timeout
        while call_id not in answers:
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            if conn.poll(wait):
                self._receive(rank)
            elif not proc.is_alive() and not conn.poll(0):
                raise self._died(rank)
            elif deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self._name}:{rank} did not answer in time")
        status, value = answers.pop(call_id)
        if status == "err":
            raise WorkerError(f"worker {self._name}:{rank} failed:\n{value}")
        return value

    def call(self, method: str, *args: Any, **kwargs: Any) -> GroupCall:
        """Call ``method(*args, **kwargs)`` on every rank; ``.wait()`` for the results."""
        if self._ray:
            import ray

            refs = [a._zchannel_call.remote(method, args, kwargs) for a in self._actors]

            def waiter(ref: Any, rank: int) -> Callable[[float | None], Any]:
                def wait(timeout: float | None) -> Any:
                    try:
                        return ray.get(ref, timeout=timeout)
                    except ray.exceptions.GetTimeoutError:
                        raise TimeoutError(f"{self._name}:{rank} did not answer in time") from None
                    except ray.exceptions.RayError as exc:
                        raise WorkerError(f"worker {self._name}:{rank} failed: {exc}") from None
                return wait

            return GroupCall(self, method, [waiter(r, i) for i, r in enumerate(refs)],
                             [functools.partial(_ray_done, ray, r) for r in refs])
        self._send_call(method, args, kwargs)
        handle = GroupCall(self, method,
                           [functools.partial(self._local_result, r, self._calls)
                            for r in range(self.size)],
                           [functools.partial(self._local_done, r, self._calls)
                            for r in range(self.size)])
        weakref.finalize(handle, self._drop_call, self._calls)
        return handle

    def _send_call(self, method: str, args: tuple, kwargs: dict) -> None:
        """Send the next call to every local rank; ``WorkerError`` naming a rank that died (and
        its exit code) before the call could reach it, the call then dropped (the answers of
        the ranks it reached are not kept for a later call)."""
        self._calls += 1
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                self._drop_call(self._calls)
                raise self._died(rank)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((self._calls, method, args, kwargs))
            except OSError:  # (it died since: its pipe is broken)
                self._drop_call(self._calls)
                raise self._died(rank) from None

    def _drop_call(self, call_id: int) -> None:
        """The ``GroupCall`` of ``call_id`` was dropped: its answers, come or to come, go."""
        self._dropped_calls.add(call_id)
        for answers in self._answers:
            answers.pop(call_id, None)

    def __getattr__(self, method: str) -> Callable[..., GroupCall]:
        if method.startswith("_") or not callable(getattr(self._cls, method, None)):
            raise AttributeError(f"{self._cls.__name__} has no public method {method!r}")
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)

    def _shutdown_ray(self, timeout: float) -> None:
        """Kill the Ray ranks once each tore down the channels it created; a rank still busy
        after ``timeout`` seconds is killed too, and named in a warning (Ray removes its
        channels' actors with it, which leave their work directories: docs/distributed.md).
        A rank that died already had its channels go with it."""
        import ray

        actors, self._actors = self._actors, []
        if not actors:
            return
        releases = [a._zchannel_release.remote() for a in actors]
        done, _ = ray.wait(releases, num_returns=len(releases), timeout=timeout)
        busy = [rank for rank, ref in enumerate(releases) if ref not in done]
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if busy:
            log.warning("worker group %r: ranks %s did not answer within %g s (busy in a "
                        "call, or not running yet): killed without tearing down the channels "
                        "they created, whose broker actors' work directories stay",
                        self._name, busy, timeout)

    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every rank: local processes are asked to end, then terminated after
        ``timeout`` seconds; Ray actors are asked to tear down the Ray-placed channels they
        created (``timeout`` seconds for all: ``_shutdown_ray``), then killed."""
        if self._ray:
            self._shutdown_ray(timeout)
            return
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._answers = [], [], []


__all__ = ["GroupCall", "Worker", "WorkerError", "WorkerGroup"]


def _check_node_ranks(node_ranks: Any, n_nodes: int) -> None:
    """``ValueError`` unless ``node_ranks`` is a non-empty list of node ranks in
    ``0 .. n_nodes - 1`` (as ``Channel.create(node_rank=)`` checks one)."""
    if not isinstance(node_ranks, (list, tuple)) or not node_ranks:
        raise ValueError(f"node_ranks={node_ranks!r}: give a non-empty list of node ranks "
                         "(or None: Ray places the ranks)")
    for rank in node_ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n_nodes:
            raise ValueError(f"node_ranks={node_ranks!r}: node rank {rank!r} is not in "
                             f"0..{n_nodes - 1}: the Ray cluster has {n_nodes} nodes")
