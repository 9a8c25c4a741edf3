"""The actor's share of a step when dealing does not follow steps."""

from __future__ import annotations

import pytest
import torch
from zchannel.broker import Channel
from zchannel.embodied import MLPPolicy, PointReach, Trajectory, TrajectoryPlan
from zchannel.embodied.actor import Actor, ids_per_step, items_per_actor_step
from zchannel.embodied.ppo import PPOConfig

pytestmark = pytest.mark.timeout(60)


def _item(step: int, column: int) -> Trajectory:
    return Trajectory(forward_inputs={"step_id": torch.full((1, 1, 1), step),
                                      "column": torch.tensor([[[column]]])})


def test_an_actor_stops_waiting_for_its_share_once_peers_covered_the_step(channels):
    """The rollout ran ahead, so least-loaded dealing gave the peer three of step 0's four
    items and this actor one (its share is two): the peer trained its three and sent its
    contribution, and this actor, holding one, must not wait for a second item of step 0 that
    will never come (the runner hung there)."""
    plan = TrajectoryPlan(mode="rollout", num_sources=4, source_batch_size=1, num_chunks=1,
                          rollout_epochs=1, actor_world_size=2, num_action_chunks=1,
                          action_dim=1)
    assert items_per_actor_step(plan) == 2 and ids_per_step(plan) == 4
    trajectory = Channel.create("actor-share-traj", local=True)
    sync = Channel.create("actor-share-sync", local=True)
    channels.extend([trajectory, sync])
    trajectory.put(_item(0, 3))
    trajectory.put(_item(1, 0))  # a later step's item: stashed, not taken for step 0
    sync.put({"rank": 0, "seq": 0, "ids": [0, 1, 2]}, key=("contrib", 0, 1))
    actor = Actor(MLPPolicy(PointReach.state_dim, PointReach.action_dim, 2), plan, PPOConfig(),
                  rank=1, world=2, trajectory=trajectory, sync=sync, weights=None, poll_s=0.05)
    received: dict = {}
    mine = actor._gather(0, ids_per_step(plan), received)
    assert [int(d.item.forward_inputs["column"][0, 0, 0]) for d in mine] == [3]
    assert list(received) == [(0, 0)]
    assert len(actor._stash) == 1  # step 1's item waits for step 1
