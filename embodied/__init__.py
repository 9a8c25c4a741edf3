"""zchannel.embodied: the trajectory contract for embodied RL (guide: docs/embodied.md).

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
from zchannel.embodied.collector import TrajectoryCollector, TrajectoryDispatcher
from zchannel.embodied.joiner import ChunkJoiner, JoinedChunk
from zchannel.embodied.lerobot import LeRobotEpisodeAccumulator
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.trajectory import (
    ActorBatch,
    EpisodeShard,
    Trajectory,
    TrajectoryStep,
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
    "ActorBatch",
    "ChunkJoiner",
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
