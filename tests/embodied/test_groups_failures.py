"""Local worker groups when a call goes wrong: a timed-out call's answer stays its own (the next
call gets its own answer), a rank that dies is a ``WorkerError`` naming it and its exit code,
and a constructor that raises fails ``launch()`` with a ``WorkerError`` carrying the cause after
stopping the ranks already started."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
from zchannel.embodied.groups import IDENTITY_ENV, Worker, WorkerError

pytestmark = pytest.mark.timeout(120)


class Gate(Worker):
    """``slow()`` answers once ``release`` is set; ``fast()`` at once; ``die()`` exits with 3 on
    rank 1."""

    def __init__(self, release) -> None:
        self.release = release

    def slow(self) -> str:
        assert self.release.wait(60)
        return "answer of slow()"

    def fast(self) -> str:
        return "answer of fast()"

    def die(self) -> int:
        if self.rank == 1:
            os._exit(3)
        return self.rank


class FailsOnRankOne(Worker):
    def __init__(self) -> None:
        if os.environ[IDENTITY_ENV].endswith(":1"):
            raise FileNotFoundError("no checkpoint at /nope.pt")


def _release():
    return multiprocessing.get_context("spawn").Event()


def test_a_timed_out_call_leaves_no_answer_for_the_next_call():
    release = _release()
    group = Gate.create_group(release).launch(1, name="gate")
    try:
        slow = group.slow()
        with pytest.raises(TimeoutError, match="gate:0 did not answer in time"):
            slow.wait(timeout=0.2)
        release.set()
        assert group.fast().wait(60) == ["answer of fast()"]
        assert group.fast().wait(60) == ["answer of fast()"]
        assert slow.wait(60) == ["answer of slow()"]  # the timed-out call still gets its own
    finally:
        group.shutdown()


def test_a_rank_that_dies_is_a_worker_error_naming_it_and_its_exit_code():
    group = Gate.create_group(_release()).launch(2, name="w")
    try:
        call = group.die()
        with pytest.raises(WorkerError, match=r"^worker w:1 died \(exit code 3\)$"):
            call.wait(60)
        assert call.failures() == {1: "worker w:1 died (exit code 3)"}
    finally:
        group.shutdown()


def test_a_call_after_a_rank_died_is_a_worker_error_naming_it():
    """Calling the group again after a rank died: the documented ``WorkerError`` (it was a bare
    ``BrokenPipeError`` from sending the call to the dead rank's pipe)."""
    group = Gate.create_group(_release()).launch(2, name="w")
    try:
        with pytest.raises(WorkerError):
            group.die().wait(60)
        for _ in range(2):
            with pytest.raises(WorkerError, match=r"^worker w:1 died \(exit code 3\)$"):
                group.fast()
    finally:
        group.shutdown()


def test_a_call_that_reached_some_ranks_before_a_dead_one_leaves_no_answer():
    """A rank dies after the liveness check, so the call reaches rank 0 and breaks on rank 1's
    pipe: ``WorkerError``, and rank 0's answer to that call is dropped when it comes."""
    group = Gate.create_group(_release()).launch(2, name="w")
    try:
        with pytest.raises(WorkerError):
            group.die().wait(60)
        group._procs[1].is_alive = lambda: True  # (as if it died just after the check)
        with pytest.raises(WorkerError, match=r"^worker w:1 died \(exit code 3\)$"):
            group.fast()
        assert group._conns[0].poll(60)  # rank 0 got the call and answers it
        group._receive(0)
        assert group._answers == [{}, {}]
    finally:
        group.shutdown()


def test_a_constructor_that_raises_fails_launch_and_stops_the_started_ranks():
    group = FailsOnRankOne.create_group()
    with pytest.raises(WorkerError) as err:
        group.launch(2, name="half")
    message = str(err.value)
    assert message.startswith("worker half:1 failed:\nconstructing FailsOnRankOne raised:")
    assert "FileNotFoundError: no checkpoint at /nope.pt" in message
    assert group.pids() == []
    assert [p for p in multiprocessing.active_children() if p.name.startswith("half:")] == []


class Answers(Worker):
    def blob(self, n: int) -> bytes:
        return b"x" * n


def test_a_launch_that_cannot_start_a_rank_raises_why():
    """A constructor argument that cannot be pickled for the spawned rank: ``launch`` raises
    pickle's error (it raised ``AssertionError: can only join a started process`` from its
    clean-up, hiding the cause) and holds no rank."""
    group = Gate.create_group(threading.Lock())
    with pytest.raises(TypeError, match="pickle"):
        group.launch(1, name="unpicklable")
    assert group.pids() == [] and group.size == 0


def test_answers_of_calls_nobody_holds_are_not_kept():
    """Calls made and dropped without a wait: their answers, read on the way to a later call's,
    are dropped (50 dropped calls of 1 MiB answers were all kept until ``shutdown``)."""
    group = Answers.create_group().launch(1, name="blobs")
    try:
        for _ in range(50):
            group.blob(1 << 20)  # dropped at once
        assert group.blob(3).wait(60) == [b"xxx"]
        assert group._answers == [{}]
    finally:
        group.shutdown()
