"""Rollout mode: whole trajectories for actors that compute their own advantages.

Two logical sources (env workers) of 4 environments each, 3 action chunks per epoch, one epoch,
two actors.  A stand-in for the Env/Rollout loop puts the two halves of every chunk; each actor
then takes its trajectory shard and turns it into a training batch with advantages.

Run it: ``python docs/examples/embodied_rollout.py`` (tests/test_docs_examples.py does).
"""

from __future__ import annotations

import torch
from zchannel.broker import Channel
from zchannel.embodied import (
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    Trajectory,
    TrajectoryKey,
    TrajectoryPlan,
    TrajectorySource,
    compute_advantages,
    to_training_batch,
)

plan = TrajectoryPlan(
    mode="rollout",
    num_sources=2,  # S: env workers (env_rank, stage_id) feeding this channel
    source_batch_size=4,  # B: environments per source
    num_chunks=3,  # N: action chunks per epoch
    rollout_epochs=1,  # E
    actor_world_size=2,  # AW: actor consumers "actor:0", "actor:1"
    num_action_chunks=2,  # C: actions per chunk
    action_dim=3,  # A
    adv_type="gae",
    gamma=0.99,
    gae_lambda=0.95,
)
B, C, A = plan.source_batch_size, plan.num_action_chunks, plan.action_dim
D = C * A


def policy_half(key: TrajectoryKey, obs: dict) -> PolicyPart:
    """What Rollout publishes after inference: the pre-action obs and what the model produced."""
    output = PolicyOutput(
        forward_inputs={"action": torch.randn(B, D)},  # the executed action, flattened [B, C*A]
        prev_logprobs=torch.randn(B, D),
        prev_values=torch.randn(B, 1),  # chunk-level value V(obs before the chunk)
        versions=torch.full((B, D), 7.0),  # weight version that produced the action
    )
    return PolicyPart([TrajectorySource(key, B)], obs, output=output)


def env_half(key: TrajectoryKey) -> EnvPart:
    """What Env reports after executing the chunk, as Rollout publishes it."""
    dones = torch.zeros(B, C, dtype=torch.bool)
    dones[0, -1] = key.chunk_id == 1  # env 0 ends its episode at the end of chunk 1
    transition = EnvTransition(
        rewards=torch.rand(B, C),
        dones=dones,
        terminations=dones,
        truncations=torch.zeros(B, C, dtype=torch.bool),
    )
    first = key.chunk_id == 0
    last = key.chunk_id == plan.num_chunks - 1
    no_flags = torch.zeros(B, C, dtype=torch.bool)
    return EnvPart(
        [TrajectorySource(key, B)],
        transition,
        # chunk 0 only: the boundary flags before the epoch's first action
        initial_transition=(
            EnvTransition(dones=no_flags, terminations=no_flags, truncations=no_flags)
            if first
            else None
        ),
        # last chunk only: V(obs after the epoch), from Rollout's terminal inference
        final_prev_values=torch.randn(B, 1) if last else None,
    )


with Channel.create(
    "trajectory-rollout-example",
    collector="embodied_trajectory",
    dispatcher="embodied_trajectory",
    producers=["rollout"],
    consumers={"actor": plan.actor_world_size},
    options=plan.to_options(),
) as channel:
    step = 0
    for env_rank in range(plan.num_sources):
        for chunk in range(plan.num_chunks):
            key = TrajectoryKey(step, 0, env_rank, 0, chunk)  # (step, epoch, env_rank, stage, chunk)
            obs = {"states": torch.randn(B, 8), "task_descriptions": ["pick the cube"] * B}
            channel.put(policy_half(key, obs))  # the two halves may arrive in any order
            channel.put(env_half(key))

    for rank in range(plan.actor_world_size):
        actor = Channel.connect("trajectory-rollout-example", identity=f"actor:{rank}")
        items = [actor.get(timeout=30) for _ in range(plan.items_per_actor)]
        assert all(isinstance(item, Trajectory) for item in items)
        batch = compute_advantages(to_training_batch(items, plan), plan)
        print(
            f"actor:{rank}: {len(items)} trajectory, actions {tuple(batch['actions'].shape)}, "
            f"dones {tuple(batch['dones'].shape)}, prev_values {tuple(batch['prev_values'].shape)}, "
            f"advantages {tuple(batch['advantages'].shape)}, loss_mask "
            f"{tuple(batch['loss_mask'].shape)}"
        )
        actor.close()
