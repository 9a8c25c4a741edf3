"""Local worker groups when a call goes wrong: a timed-out call's answer stays its own (the next
call gets its own answer), a rank that dies is a ``WorkerError`` naming it and its exit code,
and a constructor that raises fails ``launch()`` with a ``WorkerError`` carrying the cause after
stopping the ranks already started."""

from __future__ import annotations

import multiprocessing
import os

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


def test_a_constructor_that_raises_fails_launch_and_stops_the_started_ranks():
    group = FailsOnRankOne.create_group()
    with pytest.raises(WorkerError) as err:
        group.launch(2, name="half")
    message = str(err.value)
    assert message.startswith("worker half:1 failed:\nconstructing FailsOnRankOne raised:")
    assert "FileNotFoundError: no checkpoint at /nope.pt" in message
    assert group.pids() == []
    assert [p for p in multiprocessing.active_children() if p.name.startswith("half:")] == []
