"""``RunConfig(reproducible=True)``: two runs of the same config give the same training rows and
final weights with the default policy of ``point_reach`` (``MLPPolicy``, which sampled from the
global RNG) and with two actors (which actor trained which shard followed the order the sources
flushed in); the rollout refuses a policy that has no sampling ``generator`` to re-seed."""

from __future__ import annotations

import pytest
import torch
from zchannel.embodied.collector import TrajectoryDispatcher
from zchannel.embodied.pipeline import Rollout
from zchannel.embodied.policy import MLPPolicy
from zchannel.embodied.runners import RunConfig, run
from zchannel.embodied.trajectory import Trajectory
from zchannel.hooks import ChannelContext

from .conftest import make_plan

pytestmark = pytest.mark.timeout(120)


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _digests(result: dict) -> list[str]:
    return [r["rows_digest"] for r in result["records"]]


def test_two_reproducible_point_reach_runs_are_identical():
    cfg = RunConfig(envs=2, env_batch=4, num_chunks=4, steps=2, reproducible=True,
                    transport="inproc", run_id="repro-mlp")
    first, second = run(cfg), run(cfg)
    assert _digests(first) == _digests(second)
    assert _same_weights(first["final_weights"], second["final_weights"])


class NoGenerator(MLPPolicy):
    """An MLP policy without a ``generator`` (as a user's policy that samples globally)."""

    def __init__(self) -> None:
        super().__init__(2, 1, 1)
        del self.generator


def test_reproducible_sampling_refuses_a_policy_without_a_generator():
    with pytest.raises(ValueError, match="NoGenerator has none"):
        Rollout(NoGenerator(), make_plan(), requests=None, actions=None, trajectory=None,
                weights=None, sample_seed=0)
    Rollout(MLPPolicy(2, 1, 1), make_plan(), requests=None, actions=None, trajectory=None,
            weights=None, sample_seed=0)  # MLPPolicy samples from its generator


def test_two_reproducible_runs_with_two_actors_are_identical():
    cfg = RunConfig(envs=2, env_batch=4, num_chunks=4, steps=2, actors=2, reproducible=True,
                    transport="inproc", run_id="repro-actors")
    first, second = run(cfg), run(cfg)
    assert _digests(first) == _digests(second)
    assert _same_weights(first["final_weights"], second["final_weights"])


def _shard(env_rank: int, first_row: int, width: int) -> Trajectory:
    column = torch.arange(first_row, first_row + width, dtype=torch.float32) \
        + env_rank * 1_000_000
    return Trajectory(actions=torch.zeros(1, width, 1),
                      forward_inputs={"column": column.reshape(1, width, 1)})


def test_deal_by_shard_gives_each_shard_to_the_same_actor_in_any_flush_order():
    """``deal_by_shard`` (what ``reproducible=True`` sets): shard i of env rank r goes to actor
    ``(r·k + i) mod AW`` however the sources' flushes interleave (least-loaded dealing gave the
    first source to flush to actor 0); an absent actor's shards go least-loaded."""
    plan = make_plan(num_sources=3, source_batch_size=4, actor_world_size=2,
                     deal_by_shard=True)  # k = 2 shards of 2 columns per source
    consumers = ("actor:0", "actor:1")
    dispatcher = TrajectoryDispatcher()
    dispatcher.setup(ChannelContext(name="t", consumers=consumers, options=plan.to_options()))
    flushes = [(2, 0), (2, 2), (0, 2), (1, 0), (0, 0), (1, 2)]  # (env rank, first row)
    dealt = {f: dispatcher.route(_shard(*f, 2), "default") for f in flushes}
    assert dealt == {(r, row): f"actor:{(r * 2 + row // 2) % 2}" for r, row in flushes}
    dispatcher.ctx.consumers = ("actor:1",)  # actor:0 left: its shards go to who is there
    assert dispatcher.route(_shard(0, 0, 2), "default") == "actor:1"
