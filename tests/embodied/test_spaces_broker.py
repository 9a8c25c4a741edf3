"""Every space kind end to end through real brokers: an EnvLoop and a Rollout (threads of this
process, each with its own connections) over request, action and trajectory brokers, the actor
side reading the collector's trajectories and training on them; two camera images arrive
byte-identical through shared memory; a bad observation mid-run names the key and the env rank
and loses nothing already sent."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

gymnasium = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402
from zchannel.broker import Channel  # noqa: E402
from zchannel.embodied import Trajectory, runners  # noqa: E402
from zchannel.embodied.envs import ChunkedEnv, make_env  # noqa: E402
from zchannel.embodied.gymenv import GymVectorEnv, ObservationCheck  # noqa: E402
from zchannel.embodied.models import ActorCritic  # noqa: E402
from zchannel.embodied.pipeline import (  # noqa: E402
    REQUESTS_KEY,
    STOP,
    EnvLoop,
    Rollout,
    WeightPublisher,
    WeightReceiver,
)
from zchannel.embodied.ppo import PPOConfig, ppo_update, training_rows  # noqa: E402
from zchannel.embodied.presets import GYM_DEFAULT  # noqa: E402
from zchannel.embodied.spaces import ObservationError  # noqa: E402

from embodied.conftest import make_plan  # noqa: E402

pytestmark = pytest.mark.timeout(180)

TOY = "gym:zchannel.embodied.toyenvs:SpacesToy-v0"
CAMERAS = "gym:zchannel.embodied.toyenvs:TwoCameraReach-v0"


class RecordingEnv(ChunkedEnv):
    """A ChunkedEnv that keeps a copy of every observation it hands out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def reset(self, seed=None):
        obs = super().reset(seed)
        self.seen.append({k: v.clone() for k, v in obs.items()})
        return obs

    def step_chunk(self, actions):
        out = super().step_chunk(actions)
        self.seen.append({k: v.clone() for k, v in out.obs.items()})
        return out


def _produce(env, plan, policy, *, steps, name, channels, shm_threshold=None, rank=0):
    """Run an EnvLoop (rank ``rank``) and a Rollout over four brokers for ``steps`` training
    steps; returns (trajectories read as actor:0, the rollout, the env loop's error or None)."""
    shm = {} if shm_threshold is None else {"shm_threshold": shm_threshold}
    requests = Channel.create(f"{name}-req", **shm)
    actions = Channel.create(f"{name}-act")
    traj = Channel.create(f"{name}-traj", collector="embodied_trajectory",
                          dispatcher="embodied_trajectory", producers=["rollout"],
                          consumers={"actor": 1}, options=plan.to_options(), **shm)
    sync = Channel.create(f"{name}-sync")
    channels.extend([requests, actions, traj, sync])
    WeightPublisher(sync).publish(policy.state_dict(), steps)
    rollout = Rollout(policy, plan, requests=requests, actions=actions, trajectory=traj,
                      weights=WeightReceiver(sync, policy))
    errors: dict[str, BaseException] = {}

    def env_main():
        req, act = Channel.connect(f"{name}-req"), Channel.connect(f"{name}-act")
        try:
            loop = EnvLoop(env, plan, rank, req, act)
            loop.start(seed=7)
            for step in range(steps):
                loop.run_step(step)
            loop.flush()
        except BaseException as exc:
            errors["env"] = exc
        finally:
            req.close()
            act.close()

    def rollout_main():
        try:
            rollout.run()
        except BaseException as exc:
            errors["rollout"] = exc

    threads = [threading.Thread(target=env_main), threading.Thread(target=rollout_main)]
    for t in threads:
        t.start()
    threads[0].join(120)
    requests.put(STOP, key=REQUESTS_KEY)
    threads[1].join(120)
    assert "rollout" not in errors, errors
    reader = Channel.connect(f"{name}-traj", identity="actor:0")
    channels.append(reader)
    items = []
    while traj.qsize(consumer="actor:0"):
        items.append(reader.get(timeout=30))
    return items, rollout, errors.get("env"), {"requests": requests, "trajectory": traj}


@pytest.mark.parametrize("action,obs", [("discrete", "dict"), ("multi_discrete", "tuple"),
                                        ("multi_binary", "box"), ("box", "dict")])
def test_each_action_kind_end_to_end_through_brokers(action, obs, channels):
    env = make_env(TOY, 4, {"action": action, "obs": obs})
    spec = env.spec
    plan = make_plan(source_batch_size=4, num_chunks=5, num_action_chunks=2,
                     action_dim=spec.action.dim, auto_reset=True, gamma=0.9, gae_lambda=0.9)
    torch.manual_seed(0)
    policy = ActorCritic(spec, 2)
    items, rollout, error, _ = _produce(ChunkedEnv(env, 2), plan, policy, steps=2,
                                        name=f"sp-{action}", channels=channels)
    assert error is None, error
    assert len(items) == 2 and all(isinstance(t, Trajectory) for t in items)
    D = 2 * spec.action.dim
    for traj in items:
        assert traj.actions.shape == (5, 4, D) and traj.rewards.shape == (5, 4, 2)
        assert traj.forward_inputs["states"].shape == (5, 4, spec.state_dim)
        if spec.action.discrete:
            index = traj.actions.reshape(5, 4, 2, -1)
            assert (index == index.round()).all() and (index >= 0).all()
            assert (index < torch.tensor(spec.action.nvec)).all()
        else:
            assert (traj.actions.abs() <= 1).all()  # tanh-squashed
    rows = training_rows(items[:1], plan)
    logp, _, _ = policy.evaluate({k.split("::", 1)[1]: v for k, v in rows.items()
                                  if k.startswith("forward_inputs::")}, rows["actions"])
    assert torch.allclose(logp, rows["prev_logprobs"], atol=1e-5)  # what acted is what trains
    before = [p.clone() for p in policy.parameters()]
    stats = ppo_update(policy, torch.optim.Adam(policy.parameters(), lr=1e-3), rows,
                       PPOConfig.cleanrl(), torch.Generator().manual_seed(0))
    assert np.isfinite(stats["policy_loss"]) and stats["value_loss"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))


def test_two_cameras_arrive_byte_identical_through_shared_memory(channels):
    env = RecordingEnv(make_env(CAMERAS, 4, {"size": 96}), 1)
    plan = make_plan(source_batch_size=4, num_chunks=6, num_action_chunks=1, action_dim=2,
                     auto_reset=True)
    torch.manual_seed(0)
    policy = ActorCritic(env.spec, 1)
    # 4 envs x 96x96x3 = 108 KiB per camera tensor: above a 64 KiB threshold (tensors below
    # 64 KiB travel inline in the message body), so through shared memory
    items, _, error, chans = _produce(env, plan, policy, steps=2, name="cams", channels=channels,
                                      shm_threshold=64 << 10)
    assert error is None, error
    assert len(items) == 2
    for step, traj in enumerate(items):
        for key in ("main_images", "wrist_images"):
            got = traj.forward_inputs[key]
            assert got.dtype == torch.uint8 and got.shape == (6, 4, 96, 96, 3)
            for t in range(6):  # chunk t acted on the observation handed out before it
                sent = env.seen[step * 6 + t][key]
                assert got[t].numpy().tobytes() == sent.numpy().tobytes(), (step, t, key)
    assert len({env.seen[i]["main_images"].numpy().tobytes() for i in range(12)}) > 1
    for name, ch in chans.items():  # the images went through shared-memory slots
        shm = ch.stats()["shm"]
        assert shm["enabled"] and shm["slots_in"] >= 12, (name, shm)


class _BreaksAt(gymnasium.Env):
    """Two cameras; from step ``at`` on the main camera is float32."""

    def __init__(self, at):
        self.at, self.t = at, 0
        image = spaces.Box(0, 255, (8, 8, 3), np.uint8)
        self.observation_space = spaces.Dict({"main": image, "wrist": image})
        self.action_space = spaces.Discrete(3)

    def _obs(self):
        main = np.full((8, 8, 3), self.t, np.uint8)
        return {"main": main.astype(np.float32) if self.t >= self.at else main,
                "wrist": main.copy()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, False, False, {}


def test_bad_image_mid_run_names_key_and_env_rank_and_loses_nothing(channels):
    vec = gymnasium.vector.SyncVectorEnv([lambda: ObservationCheck(_BreaksAt(5))] * 2)
    env = GymVectorEnv(vec)
    plan = make_plan(source_batch_size=2, num_chunks=4, num_action_chunks=1, action_dim=1,
                     auto_reset=True)
    policy = ActorCritic(env.spec, 1)
    items, rollout, error, chans = _produce(ChunkedEnv(env, 1), plan, policy, steps=2,
                                            name="badimg", channels=channels, rank=3)
    assert isinstance(error, ObservationError)
    assert "env rank 3" in str(error) and "'main': expected uint8 [8, 8, 3], got float32" \
        in str(error)
    # chunks 0-3 of step 0 and chunk 0 of step 1 were requested before step 5 broke: every
    # request sent was served and nothing waits on the requests broker
    assert rollout.chunks == 5
    assert chans["requests"].qsize(key=REQUESTS_KEY) == 0
    assert len(items) == 1  # step 0 flushed whole; step 1 never completed
    assert items[0].actions.shape == (4, 2, 1)


@pytest.mark.parametrize("num_chunks,trajectory_threshold", [(8, 64 << 10), (32, 0)])
def test_a_step_of_camera_tensors_too_many_for_the_pool_goes_as_frames(
        channels, num_chunks, trajectory_threshold):
    """The trajectory collector holds a step's camera tensors until the step is complete: a
    run whose step holds more of them than half a pool class's slots (32 chunks x 2 cameras)
    sends its trajectory as frames, its inference requests still through shared memory."""
    cfg = dataclasses.replace(GYM_DEFAULT, env=CAMERAS, env_kwargs={"size": 96}, env_batch=8,
                              num_chunks=num_chunks, run_id=f"camsfit{num_chunks}")
    made = runners._create_channels(cfg, cfg.plan(runners._spaces(cfg)[1]))
    channels.extend(made.values())
    assert made["requests"].stats()["shm"]["threshold"] == 64 << 10
    assert made["trajectory"].stats()["shm"]["threshold"] == trajectory_threshold
