"""zchannel.embodied: the trajectory contract for embodied RL (guide: docs/embodied.md) and the
pipeline that runs it (docs/embodied.md).

The contract (types, joiner, collector, output modes, advantages) and the producer side that
feeds it (``envs``: the ``VectorEnv`` protocol and action chunks; ``gymenv``: the Gymnasium
adapter; ``spaces``: ``EnvSpec`` / ``ActionSpec``; ``policy``: the ``Policy`` protocol;
``models``: ``ActorCritic``; ``pipeline``: the env loop, the rollout and weight sync).  The runners
(``zchannel.embodied.runners``), actors (``actor``), PPO (``ppo``) and worker groups
(``groups``) are imported from their modules.

Importing this package registers every transport dataclass (TrajectoryKey, TrajectorySource,
EnvTransition, EnvOutput, PolicyOutput, PolicyPart, EnvPart, PolicyInput, TrajectoryStep,
Trajectory, ActorBatch, EpisodeShard) with zchannel's serializer, and the
``embodied_trajectory`` collector and dispatcher with the hook registry.
"""

from zchannel.embodied.advantages import compute_advantages, compute_loss_mask, to_training_batch
from zchannel.embodied.batch import (
    merge_batch_values,
    merge_episode_data,
    split_batch_value,
    split_episode_data,
)
from zchannel.embodied.checks import check_env_part, check_part, check_policy_part
from zchannel.embodied.collector import TrajectoryCollector, TrajectoryDispatcher
from zchannel.embodied.envs import ChunkedEnv, GymVectorEnv, PointReach, VectorEnv, make_env
from zchannel.embodied.joiner import ChunkJoiner, JoinedChunk
from zchannel.embodied.lerobot import LeRobotEpisodeAccumulator
from zchannel.embodied.models import ActorCritic
from zchannel.embodied.pipeline import (
    EnvLoop,
    Rollout,
    WeightPublisher,
    WeightReceiver,
    complete_env_part,
    rlt_features,
)
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.policy import MLPPolicy, Policy, RandomPolicy, chunk_actions
from zchannel.embodied.spaces import ActionSpec, EnvSpec, ObservationError, RewardError
from zchannel.embodied.trajectory import (
    ActorBatch,
    EpisodeShard,
    Trajectory,
    TrajectoryStep,
    apply_interventions,
    get_model_weights_id,
)
from zchannel.embodied.types import (
    EnvOutput,
    EnvPart,
    EnvTransition,
    PolicyInput,
    PolicyOutput,
    PolicyPart,
    SourceID,
    TrajectoryKey,
    TrajectoryPart,
    TrajectorySource,
)

__all__ = [
    "ActionSpec",
    "ActorBatch",
    "ActorCritic",
    "EnvSpec",
    "ObservationError",
    "ChunkJoiner",
    "ChunkedEnv",
    "EnvLoop",
    "GymVectorEnv",
    "MLPPolicy",
    "PointReach",
    "Policy",
    "RandomPolicy",
    "RewardError",
    "Rollout",
    "VectorEnv",
    "WeightPublisher",
    "WeightReceiver",
    "apply_interventions",
    "check_env_part",
    "check_part",
    "check_policy_part",
    "chunk_actions",
    "complete_env_part",
    "make_env",
    "rlt_features",
    "EnvOutput",
    "EnvPart",
    "EnvTransition",
    "EpisodeShard",
    "JoinedChunk",
    "LeRobotEpisodeAccumulator",
    "PolicyInput",
    "PolicyOutput",
    "PolicyPart",
    "SourceID",
    "Trajectory",
    "TrajectoryCollector",
    "TrajectoryDispatcher",
    "TrajectoryKey",
    "TrajectoryPart",
    "TrajectoryPlan",
    "TrajectorySource",
    "TrajectoryStep",
    "compute_advantages",
    "compute_loss_mask",
    "get_model_weights_id",
    "merge_batch_values",
    "merge_episode_data",
    "split_batch_value",
    "split_episode_data",
    "to_training_batch",
]
