"""Same curve on any transport: with fixed seeds and ``reproducible=True`` the sync runner gives
step for step the same training rows (their digest), the same losses, the same finished
episodes and the same final weights over in-process channels, over brokers, and with the
workers as Ray actor groups (Ray-placed brokers)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("gymnasium")

from zchannel.embodied.ppo import PPOConfig  # noqa: E402
from zchannel.embodied.runners import RunConfig, run  # noqa: E402

CFG = RunConfig(env="gym:CartPole-v1", envs=2, env_batch=2, num_chunks=16, num_action_chunks=1,
                steps=3, seed=11, gamma=0.99, ppo=PPOConfig.cleanrl(), reproducible=True)


def _trace(result: dict) -> list[tuple]:
    return [(r["step"], r["rows_digest"], r["policy_loss"], r["value_loss"], r["entropy"],
             sorted(r["returns"])) for r in result["records"]]


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(900)
def test_inproc_broker_and_ray_give_identical_trajectories_and_losses():
    inproc = run(replace(CFG, transport="inproc"))
    broker = run(CFG)
    reference = _trace(inproc)
    assert len({digest for _, digest, *_ in reference}) == CFG.steps  # every step differs
    assert _trace(broker) == reference
    assert _same_weights(broker["final_weights"], inproc["final_weights"])
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is already connected in this process")
    from zchannel.embodied.ray_runner import run_on_ray

    on_ray = run_on_ray(CFG, nodes=1)
    assert _trace(on_ray) == reference
    assert _same_weights(on_ray["final_weights"], inproc["final_weights"])
