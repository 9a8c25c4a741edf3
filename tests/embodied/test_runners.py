"""The runners end to end: env, rollout and actor processes over real brokers learn the toy task;
faults end or survive a run as documented."""

from __future__ import annotations

import os
import re
import signal
import threading

import pytest
import torch
from zchannel.embodied.policy import RandomPolicy
from zchannel.embodied.runners import (
    RunConfig,
    WorkerDied,
    _LocalLauncher,
    evaluate,
    run,
    trained_policy,
)

SEEDS = [10_000, 10_001, 10_002]


def _margin(cfg, result):
    """Trained minus random mean return on the same env seeds."""
    policy = trained_policy(cfg, result["final_weights"])
    trained = [evaluate(cfg, policy, episodes_seed=s)["mean_return"] for s in SEEDS]
    random = [evaluate(cfg, RandomPolicy(2, 2, seed=s), episodes_seed=s)["mean_return"]
              for s in SEEDS]
    return sum(trained) / 3 - sum(random) / 3


def _check_records(cfg, result):
    records = result["records"]
    assert [r["step"] for r in records] == list(range(cfg.steps))
    assert [r["version"] for r in records] == list(range(1, cfg.steps + 1))
    for r in records:
        assert r["episodes"] > 0 and r["env_steps_per_s"] > 0 and r["chunks_per_s"] > 0
        assert r["broker_bytes_held"] is not None


@pytest.mark.timeout(240)
def test_sync_runner_learns_over_brokers():
    """The default-run learning smoke test: 8 steps of the sync runner, one seed."""
    cfg = RunConfig(runner="sync", steps=8, seed=0)
    result = run(cfg)
    _check_records(cfg, result)
    assert all(r["policy_lag"] == 0 for r in result["records"])  # sync: never stale
    assert _margin(cfg, result) > 3.0


@pytest.mark.timeout(120)
def test_inproc_transport_learns_without_a_broker():
    cfg = RunConfig(runner="async", transport="inproc", steps=10, seed=1)
    result = run(cfg)
    _check_records(cfg, result)
    assert max(r["policy_lag"] for r in result["records"]) <= 1
    assert _margin(cfg, result) > 3.0


@pytest.mark.timeout(120)
def test_an_inproc_run_stopped_early_leaves_no_worker_thread_running():
    """``on_step`` returning True ends the workers: inproc, their threads are joined before
    ``run`` returns (they were left running torch, and a script that exited at once could
    abort with "terminate called without an active exception")."""
    cfg = RunConfig(runner="async", transport="inproc", steps=20, seed=1)
    result = run(cfg, on_step=lambda record: record["step"] >= 1)
    assert result["stopped_early"]
    left = [t.name for t in threading.enumerate()
            if re.fullmatch(r"(env|rollout|actor):\d+", t.name)]
    assert left == []


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~2 min on 2 idle cores; 300 s ran out at load average 20
@pytest.mark.parametrize("runner", ["sync", "async"])
def test_runner_learns_on_three_seeds(runner):
    """After 12 training steps the return beats a random policy's by a clear margin."""
    for seed in (0, 1, 2):
        cfg = RunConfig(runner=runner, steps=12, seed=seed)
        result = run(cfg)
        _check_records(cfg, result)
        lags = [r["policy_lag"] for r in result["records"]]
        assert max(lags) <= (0 if runner == "sync" else 1)
        assert _margin(cfg, result) > 4.0, (runner, seed)


@pytest.mark.timeout(240)
def test_actor_sigkilled_mid_run_is_survived():
    # killed at step 1: steps 1 and 2 must still train and publish on the one actor left
    cfg = RunConfig(runner="sync", actors=2, steps=3, seed=3)
    killed = []

    def kill(step, workers):
        if step == 1:
            pid = workers.procs["actor:1"].pid
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    result = run(cfg, kill=kill)
    assert killed and result["dead_actors"] == [1]
    _check_records(cfg, result)  # every step trained and published a version
    # the final weights are a real, finite model
    assert all(torch.isfinite(v).all() for v in result["final_weights"].values())


class _KillsActor1AtStart(_LocalLauncher):
    """Starts the workers and SIGKILLs ``actor:1`` at once: before it could say hello, let
    alone take its first item."""

    def start(self, cfg, data, channels):
        workers = super().start(cfg, data, channels)
        os.kill(workers.procs["actor:1"].pid, signal.SIGKILL)
        return workers


@pytest.mark.timeout(240)
def test_an_actor_killed_before_its_first_get_is_survived():
    """A declared actor that died before it joined never left the trajectory broker's
    consumers: the driver makes it leave, so what was dealt to it goes to the live actor."""
    cfg = RunConfig(runner="sync", actors=2, steps=3, seed=3)
    result = run(cfg, launcher=_KillsActor1AtStart(False))
    assert result["dead_actors"] == [1]
    _check_records(cfg, result)


@pytest.mark.timeout(240)
def test_env_worker_death_ends_the_run_with_its_name():
    cfg = RunConfig(runner="sync", steps=50, seed=4)

    def kill(step, workers):
        if step == 1:
            os.kill(workers.procs["env:1"].pid, signal.SIGKILL)

    with pytest.raises(WorkerDied, match=r"env:1 died \(exit code -9\)"):
        run(cfg, kill=kill)


@pytest.mark.timeout(240)
def test_a_worker_that_raises_ends_the_run_with_one_line_naming_it():
    """An env worker's exception ends the run: ``WorkerDied`` names the worker and the
    exception in one line; the worker's traceback travels in ``remote_traceback``."""
    cfg = RunConfig(env="gym:failenvs:FailsAfterSteps-v0", steps=3, seed=4)
    with pytest.raises(WorkerDied) as err:
        run(cfg)
    message = str(err.value)
    assert "\n" not in message, message
    assert re.fullmatch(r"worker env:\d failed: RuntimeError: the simulator lost its connection",
                        message), message
    assert "Traceback" in err.value.remote_traceback
    assert "lost its connection" in err.value.remote_traceback


def test_bad_runner_config_is_refused():
    with pytest.raises(ValueError, match="runner must be one of"):
        RunConfig(runner="lockstep")
    with pytest.raises(ValueError, match="envs must be >= 1"):
        RunConfig(envs=0)
