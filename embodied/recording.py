"""The consumer of a lerobot-mode run: ``EpisodeRecorder`` takes each training step's episodes.

In lerobot mode (``RunConfig(mode="lerobot")``) nothing is trained: the trajectory channel's
one consumer is the driver itself, as ``recorder:0``.  For training step ``k`` it takes the
step's ``num_sources · shards_per_source`` ``EpisodeShard`` items (shards of later steps wait
until their turn), hands their episodes to a ``LeRobotDatasetWriter`` in a fixed order — step,
env rank, stage, shard — (or keeps them, without a writer), and then releases version ``k + 1``
of the unchanged weights on the weights channel, as an actor would after training: so the
sync, async and decoupled runners pace the rollout exactly as they do when training.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch
from zchannel.broker import BrokerUnavailable
from zchannel.embodied.pipeline import WeightPublisher
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.trajectory import EpisodeShard

RECORDER = "recorder:0"


class EpisodeRecorder:
    """Takes a lerobot-mode run's episodes step by step (see the module docstring).

    ``channel`` is the trajectory channel connected as ``RECORDER``; ``state`` the weights the
    rollout started from (published unchanged as each step's new version); ``writer`` a
    ``LeRobotDatasetWriter`` or None (then ``episodes`` keeps every episode in memory).

    A broker that expired the recorder's handle (a driver starved of CPU for longer than the
    broker's heartbeat expiry) drops the request in flight, which took nothing, and the handle
    registers again by itself: the recorder retries for up to ``unavailable_s`` seconds before
    it raises the ``BrokerUnavailable``.
    """

    unavailable_s = 30.0

    def __init__(self, channel: Any, plan: TrajectoryPlan, publisher: WeightPublisher,
                 state: dict[str, torch.Tensor], writer: Any = None) -> None:
        if plan.mode != "lerobot":
            raise ValueError(f"EpisodeRecorder needs a lerobot-mode plan, not {plan.mode!r}")
        self.channel, self.plan, self.publisher = channel, plan, publisher
        self.state, self.writer = state, writer
        self.per_step = plan.num_sources * plan.shards_per_source
        self.episodes: list[list[dict[str, Any]]] = []
        self.frames = 0
        self._shards: dict[int, list[EpisodeShard]] = {}
        self._unavailable_since: float | None = None

    def _take(self, timeout: float) -> bool:
        """Store the next shard (waiting up to ``timeout`` s; 0: only if one is waiting)."""
        try:
            if timeout <= 0:
                item = self.channel.get_nowait()
            else:
                item = self.channel.get(timeout=timeout)
        except (asyncio.QueueEmpty, TimeoutError):
            return False
        except BrokerUnavailable:
            now = time.monotonic()
            self._unavailable_since = self._unavailable_since or now
            if now - self._unavailable_since > self.unavailable_s:
                raise
            return False
        self._unavailable_since = None
        if not isinstance(item, EpisodeShard):
            raise TypeError(f"a lerobot-mode trajectory channel delivered a "
                            f"{type(item).__name__}, not an EpisodeShard")
        self._shards.setdefault(item.step_id, []).append(item)
        return True

    def poll(self, step: int, timeout: float) -> dict[str, Any] | None:
        """Step ``step``'s report once all its shards are in (episodes recorded, version
        released), else None after waiting up to ``timeout`` seconds for one more shard."""
        while self._take(0):
            pass
        if len(self._shards.get(step, [])) < self.per_step:
            self._take(timeout)
        if len(self._shards.get(step, [])) < self.per_step:
            return None
        shards = sorted(self._shards.pop(step),
                        key=lambda s: (s.env_rank, s.stage_id, s.shard_index))
        episodes = [episode for shard in shards for episode in shard.episodes]
        if self.writer is not None:
            self.writer.add_shards(shards)
        else:
            self.episodes.extend(episodes)
        frames = sum(len(e) for e in episodes)
        self.frames += frames
        self.publisher.publish(self.state, step + 1)
        return {"step": step, "version": step + 1, "lag": None, "policy_loss": None,
                "value_loss": None, "episodes_recorded": len(episodes),
                "frames_recorded": frames}


__all__ = ["RECORDER", "EpisodeRecorder"]
