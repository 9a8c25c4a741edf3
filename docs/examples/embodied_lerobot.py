"""LeRobot mode: record finished episodes as LeRobot frames, across training steps.

One source of 2 environments, 2 chunks of 2 actions per training step, one consumer.  Env 0
succeeds at the end of step 0; env 1 runs on and terminates in step 1: its episode spans both
steps (unfinished episodes stay in the broker between steps).

Run it: ``python docs/examples/embodied_lerobot.py`` (tests/test_docs_examples.py does).
"""

from __future__ import annotations

import torch
from zchannel.broker import Channel
from zchannel.embodied import (
    EnvPart,
    EnvTransition,
    EpisodeShard,
    PolicyPart,
    TrajectoryKey,
    TrajectoryPlan,
    TrajectorySource,
)

plan = TrajectoryPlan(
    mode="lerobot",
    num_sources=1,
    source_batch_size=2,
    num_chunks=2,
    rollout_epochs=1,
    actor_world_size=1,
    num_action_chunks=2,
    action_dim=2,
    lerobot_fps=10,  # frame timestamps are frame_index / fps
)
B, C, A = plan.source_batch_size, plan.num_action_chunks, plan.action_dim
NAME = "trajectory-lerobot-example"


def chunk_halves(key: TrajectoryKey, done_env: int | None) -> tuple[PolicyPart, EnvPart]:
    sources = [TrajectorySource(key, B)]
    actions = torch.randn(B, C, A)
    obs = {"states": torch.randn(B, 4), "main_images": torch.zeros(B, 16, 16, 3, dtype=torch.uint8),
           "task_descriptions": ["open the drawer"] * B}
    # teleoperated / scripted actions: lerobot mode also accepts parts without inference
    policy = PolicyPart(sources, obs, external_actions=actions.reshape(B, C * A))
    terminations = torch.zeros(B, C, dtype=torch.bool)
    if done_env is not None:
        terminations[done_env, -1] = True
    episode_data = {
        "chunk_actions": actions,  # [B, C, A]: what was executed
        "obs_list": [obs] * C,  # one observation dict per low-level step
        "terminations": terminations,
        "truncations": torch.zeros(B, C, dtype=torch.bool),
        "infos_list": [{"success": terminations[:, s]} for s in range(C)],  # one info per step
    }
    no_flags = torch.zeros(B, C, dtype=torch.bool)
    env = EnvPart(
        sources,
        EnvTransition(rewards=terminations.float(), dones=terminations,
                      terminations=terminations, truncations=no_flags,
                      episode_data=episode_data),
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
    consumers={"recorder": 1},
    options=plan.to_options(),
) as channel:
    recorder = Channel.connect(NAME, identity="recorder:0")
    for step, done_env in ((0, 0), (1, 1)):
        for chunk in range(plan.num_chunks):
            last = chunk == plan.num_chunks - 1
            policy, env = chunk_halves(TrajectoryKey(step, 0, 0, 0, chunk),
                                       done_env if last else None)
            channel.put(policy)
            channel.put(env)
        shard = recorder.get(timeout=30)  # one EpisodeShard per source and step (may be empty)
        assert isinstance(shard, EpisodeShard) and shard.step_id == step
        for episode in shard.episodes:
            frame = episode[-1]
            print(
                f"step {step}: episode {frame['episode_index']} of {len(episode)} frames, "
                f"success {frame['next.success']}, task {frame['task']!r}, "
                f"keys {sorted(frame)}"
            )
    recorder.close()
