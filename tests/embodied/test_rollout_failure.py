"""A failing rollout reaches the env loops as an error at once (a ``RolloutFailure`` on their
actions keys), instead of leaving them to wait out their reply timeout; EnvLoop and Rollout over
real broker channels."""

from __future__ import annotations

import threading

import pytest
import torch
from zchannel.broker import Channel, HookError
from zchannel.embodied import ChunkedEnv, MLPPolicy, PointReach
from zchannel.embodied.pipeline import (
    EnvLoop,
    Rollout,
    RolloutFailed,
    WeightPublisher,
    WeightReceiver,
)

from embodied.conftest import run_env_and_rollout
from embodied.test_collector import make_plan

pytestmark = pytest.mark.timeout(120)  # a hang (the reply timeout is 600 s) fails the test

LEROBOT = dict(mode="lerobot", num_sources=1, source_batch_size=2, num_chunks=2,
               rollout_epochs=1, actor_world_size=1, num_action_chunks=2, action_dim=2)


class _FailingPolicy(MLPPolicy):
    """Raises on its ``fail_at``-th forward call."""

    def __init__(self, fail_at: int) -> None:
        torch.manual_seed(0)
        super().__init__(PointReach.state_dim, PointReach.action_dim, 2)
        self.calls, self.fail_at = 0, fail_at

    def forward(self, obs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the model ran out of memory")
        return super().forward(obs)


def _run(name, channels, policy, *, record_episodes):
    """One env loop and a rollout thread (``run_env_and_rollout``, up to 20 steps); returns
    (env error, rollout error)."""
    env = ChunkedEnv(PointReach(2), 2, record_episodes=record_episodes)
    env_error, rollout_error, _ = run_env_and_rollout(name, channels, policy, make_plan(**LEROBOT),
                                                      env, {"recorder": 1}, steps=20)
    return env_error, rollout_error


def test_a_hook_error_reaches_the_env_loop_as_a_hook_error(channels):
    """Lerobot mode fed by an env that records no episode data: the collector's ValueError
    comes back to the rollout's put as a HookError, and the env loop raises that HookError."""
    env_error, rollout_error = _run("fail-hook", channels, _FailingPolicy(fail_at=0),
                                    record_episodes=False)
    assert isinstance(env_error, HookError), env_error
    assert env_error.exc_type == "ValueError"
    assert "LeRobot mode needs episode_data on every chunk's transition" in str(env_error)
    assert "ValueError" in env_error.remote_traceback
    assert isinstance(rollout_error, HookError)


def test_a_rollout_error_reaches_the_env_loop_as_rollout_failed(channels):
    env_error, rollout_error = _run("fail-model", channels, _FailingPolicy(fail_at=3),
                                    record_episodes=True)
    assert isinstance(env_error, RolloutFailed), env_error
    assert "RuntimeError: the model ran out of memory" in str(env_error)
    assert isinstance(rollout_error, RuntimeError)


def test_with_episode_data_the_same_loop_runs_on(channels):
    """The control: recording envs feed lerobot mode without an error."""
    plan = make_plan(**LEROBOT)
    plain = Channel.create("ok-plain")
    traj = Channel.create("ok-traj", collector="embodied_trajectory",
                          dispatcher="embodied_trajectory", producers=["rollout"],
                          consumers={"recorder": 1}, options=plan.to_options())
    channels.extend([plain, traj])
    policy = _FailingPolicy(fail_at=0)
    WeightPublisher(plain).publish(policy.state_dict(), 100)
    rollout = Rollout(policy, plan, requests=plain, actions=plain, trajectory=traj,
                      weights=WeightReceiver(plain, policy))
    thread = threading.Thread(target=rollout.run, kwargs={"stop_after": 3})
    thread.start()
    env_side = Channel.connect("ok-plain")
    loop = EnvLoop(ChunkedEnv(PointReach(2, max_steps=3), 2, record_episodes=True), plan, 0,
                   env_side, env_side, reply_timeout=60)
    loop.start(seed=0)
    for step in range(3):
        loop.run_step(step)
    env_side.close()
    thread.join(60)
    recorder = Channel.connect("ok-traj", identity="recorder:0")
    shards = [recorder.get(timeout=30) for _ in range(3)]
    recorder.close()
    assert [s.step_id for s in shards] == [0, 1, 2]
    frames = [f for s in shards for e in s.episodes for f in e]
    assert frames and all(f["observation.state"].shape == (4,) for f in frames)
