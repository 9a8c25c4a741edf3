"""Pipeline mode: the broker computes advantages and deals ready micro-batches to actor ranks.

Two sources of 4 environments, 2 chunks per epoch, 2 epochs, two actors, GRPO over groups of
4 environments (no value head).  Nothing comes out until every source has finished an epoch;
then each actor rank gets its micro-batches (``ActorBatch``) on its own private queue.

Run it: ``python docs/examples/embodied_pipeline.py`` (tests/test_docs_examples.py does).
"""

from __future__ import annotations

import torch
from zchannel.broker import Channel
from zchannel.embodied import (
    ActorBatch,
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectoryPlan,
    TrajectorySource,
)

plan = TrajectoryPlan(
    mode="pipeline",
    num_sources=2,
    source_batch_size=4,
    num_chunks=2,
    rollout_epochs=2,
    actor_world_size=2,
    num_action_chunks=1,
    action_dim=2,
    adv_type="grpo",
    group_size=4,  # must divide gcd(B, actor_width) = 4: a group never straddles two actors
    micro_batch_size=4,  # rows per ActorBatch; must divide num_chunks * actor_width = 8
    seed=1,  # shuffle seed of actor a is seed + a
)
B, C, D = plan.source_batch_size, plan.num_action_chunks, plan.action_chunk_dim
NAME = "trajectory-pipeline-example"


def chunk_halves(key: TrajectoryKey) -> tuple[PolicyPart, EnvPart]:
    sources = [TrajectorySource(key, B)]
    policy = PolicyPart(
        sources,
        {"states": torch.randn(B, 5)},
        output=PolicyOutput(forward_inputs={"action": torch.randn(B, D)},
                            prev_logprobs=torch.randn(B, D)),  # no prev_values: critic-free
    )
    no_flags = torch.zeros(B, C, dtype=torch.bool)
    env = EnvPart(
        sources,
        EnvTransition(rewards=torch.rand(B, C), dones=no_flags, terminations=no_flags,
                      truncations=no_flags),
        initial_transition=(
            EnvTransition(dones=no_flags, terminations=no_flags, truncations=no_flags)
            if key.chunk_id == 0
            else None
        ),
    )
    return policy, env


with Channel.create(
    NAME,
    collector="embodied_trajectory",
    dispatcher="embodied_trajectory",
    producers=["rollout"],
    consumers={"actor": plan.actor_world_size},  # required: one consumer id per rank
    options=plan.to_options(),
) as channel:
    for epoch in range(plan.rollout_epochs):
        for env_rank in range(plan.num_sources):
            for chunk in range(plan.num_chunks):
                policy, env = chunk_halves(TrajectoryKey(0, epoch, env_rank, 0, chunk))
                channel.put(env)  # env half first: the order does not matter
                channel.put(policy)

    assert plan.micro_batch_size is not None  # set above: a pipeline plan deals micro-batches
    per_epoch = plan.num_chunks * plan.actor_width // plan.micro_batch_size
    for rank in range(plan.actor_world_size):
        actor = Channel.connect(NAME, identity=f"actor:{rank}")  # "actor:1" is rank 1
        batches = [actor.get(timeout=30) for _ in range(per_epoch * plan.rollout_epochs)]
        assert all(isinstance(b, ActorBatch) and b.actor_rank == rank for b in batches)
        first = batches[0]
        print(
            f"actor:{rank}: {len(batches)} micro-batches "
            f"(epoch, index) {[(b.epoch_id, b.micro_batch_index) for b in batches]}; "
            f"keys {sorted(first.data)}; advantages {tuple(first.data['advantages'].shape)}"
        )
        actor.close()
