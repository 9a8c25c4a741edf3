"""The runners on the field: in-broker work the run schedules itself (a pipeline flush of a
whole step's camera images) and an env failing in the demo's final evaluation.

- A pipeline flush copies each camera row once, straight into micro-batches that own their
  memory (it used to stack, concatenate and shuffle every image of the step, each a copy, in
  one broker turn: 2-17 s on a loaded host).
- The run's trajectory broker gets ``TRAJECTORY_LIVENESS`` heartbeats, so a turn of its
  collector longer than the channel default's 3 s expiry does not make every worker take it
  for gone (the run used to fail with ``BrokerUnavailable``).
- An env that fails only in the demo's final evaluation ends the demo with one ``error:``
  line and status 2, its ``--json`` holding the training records (it used to end in a
  traceback, status 1, and no file).

The env below is registered when this module is imported: the demo's workers import it as
``gym:test_embodied_runner_field:EvaluationSeedsFail-v0`` (``PYTHONPATH`` has ``tests/``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import uuid
from dataclasses import replace

import numpy as np
import pytest
import torch

gymnasium = pytest.importorskip("gymnasium")

import zchannel.embodied.runners as runners  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from zchannel.broker import Channel  # noqa: E402
from zchannel.cli.main import main as cli  # noqa: E402
from zchannel.embodied.collector import TrajectoryCollector  # noqa: E402
from zchannel.embodied.plan import TrajectoryPlan  # noqa: E402
from zchannel.embodied.runners import EVALUATION_SEED_BASE, RunConfig, run  # noqa: E402
from zchannel.embodied.trajectory import ActorBatch  # noqa: E402
from zchannel.embodied.types import (  # noqa: E402
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectorySource,
)
from zchannel.hooks import ChannelContext  # noqa: E402

EVALUATION_FAILS = "gym:test_embodied_runner_field:EvaluationSeedsFail-v0"
# a stall of the trajectory broker past the channel default's expiry (1 s x 3), well within
# TRAJECTORY_LIVENESS heartbeats
STALL_S = 6.0


class EvaluationSeedsFail(gymnasium.Env):
    """Three-float observations, one-float actions, 4-step episodes; a reset with a seed of the
    demo's final evaluation (``>= EVALUATION_SEED_BASE``: some simulators take int32 seeds)
    raises ``RuntimeError``, so training completes and the evaluation fails."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        if seed is not None and seed >= EVALUATION_SEED_BASE:
            raise RuntimeError(f"seed {seed} too large for this simulator")
        super().reset(seed=seed)
        self.steps = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.steps += 1
        return np.zeros(3, np.float32), 1.0, False, self.steps >= 4, {}


gymnasium.register("EvaluationSeedsFail-v0", entry_point=EvaluationSeedsFail)


# ---------------------------------------------------------------------------------------------
# A pipeline flush of camera images


def _pipeline_collector(plan: TrajectoryPlan) -> TrajectoryCollector:
    collector = TrajectoryCollector()
    consumers = tuple(f"actor:{a}" for a in range(plan.actor_world_size))
    collector.setup(ChannelContext(name="trajectory", consumers=consumers,
                                   options=plan.to_options()))
    return collector


def _camera_parts(plan: TrajectoryPlan, rank: int, chunk: int, side: int):
    """Both halves of chunk ``chunk`` of source ``rank``: every pixel of env b's camera image
    and its action carry the row's tag ``rank * 100 + chunk * 10 + b``."""
    B = plan.source_batch_size
    key = TrajectoryKey(0, 0, rank, 0, chunk)
    sources = [TrajectorySource(key, B, 0)]
    tags = torch.arange(B) + rank * 100 + chunk * 10
    images = tags.to(torch.uint8).reshape(B, 1, 1, 1).expand(B, side, side, 3).contiguous()
    policy = PolicyPart(sources, {"states": torch.zeros(B, 2)}, output=PolicyOutput(
        forward_inputs={"action": tags.float().reshape(B, 1), "main_images": images},
        prev_logprobs=torch.zeros(B, 1), prev_values=torch.zeros(B, 1),
        versions=torch.zeros(B, 1)))
    flags = torch.zeros(B, 1, dtype=torch.bool)
    last = chunk == plan.num_chunks - 1
    env = EnvPart(
        sources, EnvTransition(rewards=torch.ones(B, 1), dones=flags, terminations=flags,
                               truncations=flags),
        final_prev_values=torch.zeros(B, 1) if last else None,
        initial_transition=EnvTransition(dones=flags, terminations=flags, truncations=flags)
        if chunk == 0 else None)
    return policy, env


def _allocated_bytes(fn) -> tuple[object, int]:
    """``fn()``'s result and the bytes it allocated: torch's CPU tensors (the profiler's
    memory events) and numpy's arrays (tracemalloc, at its peak; started inside the profiler,
    which it would count)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        tracemalloc.start()
        try:
            result = fn()
            numpy_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    torch_bytes = sum(e.self_cpu_memory_usage for e in prof.events()
                      if e.self_cpu_memory_usage > 0)
    return result, torch_bytes + numpy_peak


def test_a_pipeline_flush_copies_each_camera_row_once_into_micro_batches_of_their_own():
    """Two sources of 4 envs, 3 chunks, 2 actors: each micro-batch's images own exactly their
    rows (no view of a step-wide buffer, kept alive until every micro-batch is taken), are
    the rows of the actions beside them, and the flush allocates the images once (stacking,
    concatenating and shuffling them took three copies, splitting a source among actors a
    fourth)."""
    side = 64
    plan = TrajectoryPlan.from_options(dict(
        mode="pipeline", num_sources=2, source_batch_size=4, num_chunks=3, rollout_epochs=1,
        actor_world_size=2, num_action_chunks=1, action_dim=1, micro_batch_size=3, seed=3))
    collector = _pipeline_collector(plan)
    halves = [half for rank in range(2) for chunk in range(3)
              for half in _camera_parts(plan, rank, chunk, side)]
    for half in halves[:-1]:
        assert list(collector.collect(half, "ignored")) == []
    pairs, allocated = _allocated_bytes(lambda: list(collector.collect(halves[-1], "ignored")))
    batches = [item for _, item in pairs]
    assert len(batches) == 8 and all(isinstance(b, ActorBatch) for b in batches)
    image_bytes = 2 * 3 * 4 * side * side * 3
    assert allocated < 1.5 * image_bytes, (allocated, image_bytes)
    rows: dict[int, list[int]] = {0: [], 1: []}
    for batch in batches:
        images = batch.data["forward_inputs::main_images"]
        assert images.shape == (3, side, side, 3) and images.dtype == torch.uint8
        assert images.untyped_storage().nbytes() == images.numel()  # its own rows only
        tags = batch.data["forward_inputs::action"].reshape(-1).to(torch.int64)
        assert torch.equal(images.amin(dim=(1, 2, 3)).to(torch.int64), tags)
        assert torch.equal(images.amax(dim=(1, 2, 3)).to(torch.int64), tags)
        rows[batch.actor_rank] += tags.tolist()
    # actor 0 has the envs of source 0, actor 1 those of source 1, every chunk's once
    assert sorted(rows[0]) == sorted(c * 10 + b for c in range(3) for b in range(4))
    assert sorted(rows[1]) == sorted(100 + c * 10 + b for c in range(3) for b in range(4))


# ---------------------------------------------------------------------------------------------
# The brokers' heartbeats


def _hello(handle) -> tuple[float, int]:
    """The heartbeat interval and liveness of ``handle``'s broker (its hello reply)."""
    info = handle._connection().broker_info
    return info.hb, info.liveness


def test_the_trajectory_broker_of_a_run_is_created_with_the_generous_liveness():
    """Pipeline mode: the trajectory broker, whose collector flushes a whole step in one
    turn, has ``TRAJECTORY_LIVENESS`` heartbeats of 1 s; the other brokers the channel
    default (1 s, 3).  ``RunConfig.heartbeat_interval`` and ``liveness`` set every broker's,
    out-of-range values are refused up front, and in-process channels get none."""
    assert runners.TRAJECTORY_LIVENESS >= 30
    cfg = RunConfig(mode="pipeline", env_batch=8, run_id=f"hb{uuid.uuid4().hex[:8]}")
    custom = replace(cfg, heartbeat_interval=0.5, liveness=7, run_id=f"hb{uuid.uuid4().hex[:8]}")
    for config, trajectory, others in ((cfg, (1.0, runners.TRAJECTORY_LIVENESS), (1.0, 3)),
                                       (custom, (0.5, 7), (0.5, 7))):
        plan = config.plan(runners.env_spec(config).action_dim)
        channels = runners._create_channels(config, plan)
        try:
            for name, handle in channels.items():
                assert _hello(handle) == (trajectory if name == "trajectory" else others), name
        finally:
            for handle in channels.values():
                handle.shutdown()
    assert replace(cfg, transport="inproc").heartbeats("trajectory") == {}
    with pytest.raises(ValueError, match=r"liveness must be an int >= 1"):
        RunConfig(liveness=0)
    with pytest.raises(ValueError, match=r"heartbeat_interval must be a number >= 0.001"):
        RunConfig(heartbeat_interval=0)


def test_the_demo_takes_the_liveness_of_its_brokers():
    """``--liveness`` takes 1 to 1000 heartbeats (``RunConfig.liveness``): 0 is a usage
    error before anything starts, 40 is taken (and the demo's own checks go on: here the
    envs that cannot be split among the actors)."""
    result = CliRunner().invoke(cli, ["demo", "embodied", "--liveness", "0", "--steps", "1"])
    assert result.exit_code == 2 and "Invalid value for '--liveness'" in result.output, \
        result.output
    result = CliRunner().invoke(cli, ["demo", "embodied", "--liveness", "40", "--mode", "pipeline",
                                      "--envs", "3", "--env-batch", "1", "--actors", "2"])
    assert result.exit_code == 2 and "cannot be split evenly among --actors 2" in result.output, \
        result.output


@pytest.mark.timeout(300)
def test_a_pipeline_run_survives_its_trajectory_broker_stalled_past_the_default_expiry():
    """The trajectory broker stopped for ``STALL_S`` (as a long collector turn stops its
    loop) while the actor waits for the next step's micro-batches: the run goes on and
    finishes (with the default liveness of 3 every worker took it for gone after 3 s)."""
    cfg = RunConfig(mode="pipeline", env_batch=8, num_chunks=4, steps=3,
                    run_id=f"hb{uuid.uuid4().hex[:8]}")
    stalled: list[int] = []

    def stall(step: int, workers) -> None:
        if step != 0:
            return
        probe = Channel.connect(cfg.names()["trajectory"])
        pid = probe._connection().broker_info.pid
        probe.close()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(STALL_S)  # the stall itself, not a wait for anything
        finally:
            os.kill(pid, signal.SIGCONT)
        stalled.append(pid)

    result = run(cfg, kill=stall)
    assert stalled
    assert [r["step"] for r in result["records"]] == [0, 1, 2]
    assert result["final_weights"] is not None


# ---------------------------------------------------------------------------------------------
# The demo's final evaluation


@pytest.mark.timeout(300)
def test_an_env_failing_in_the_demo_evaluation_is_one_error_line_and_keeps_the_records(
        tmp_path):
    """Training completes, the evaluation's first reset raises: one ``error:`` line naming
    the exception and the file, status 2, no traceback, and ``--json`` has the training
    records (``evaluation`` null)."""
    proc = subprocess.run(
        [sys.executable, "-m", "zchannel.cli.main", "demo", "embodied", "--env",
         EVALUATION_FAILS, "--env-batch", "2", "--steps", "1", "--quiet", "--json", "run.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: the evaluation after training failed: RuntimeError: seed "
        f"{EVALUATION_SEED_BASE} too large for this simulator (--json {tmp_path / 'run.json'} "
        "has the training records)"], proc.stderr
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["evaluation"] is None
    assert [r["step"] for r in data["steps"]] == [0]
    assert data["config"]["env"] == EVALUATION_FAILS
    assert data["episodes"] and all(e["length"] == 4 for e in data["episodes"])
    assert not [p for p in os.listdir(tmp_path) if p.startswith("run.json.")]  # no leftovers
