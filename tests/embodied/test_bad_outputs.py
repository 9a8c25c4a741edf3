"""Bad numbers stop a run with an error naming their source, over real broker channels (an
EnvLoop in this thread, a Rollout in another): a non-finite reward names the env, the sub-env and
the step; a policy action of the wrong size or with NaN names ``forward_inputs["action"]`` and
what was expected, before anything is reshaped or reaches an env."""

from __future__ import annotations

import pytest
import torch
from zchannel.embodied import ChunkedEnv, MLPPolicy, PointReach, RewardError
from zchannel.embodied.pipeline import (
    RolloutFailed,
)

from embodied.conftest import make_plan, run_env_and_rollout

pytestmark = pytest.mark.timeout(120)  # a hang (the reply timeout is 600 s) fails the test

B, C, A = 2, 2, PointReach.action_dim


class _NaNRewardAt(PointReach):
    """PointReach whose sub-env ``row`` returns a NaN reward on low-level step ``at``."""

    def __init__(self, at: int, row: int) -> None:
        super().__init__(B)
        self.at, self.row, self.steps = at, row, 0

    def step(self, actions):
        obs, reward, term, trunc, info = super().step(actions)
        self.steps += 1
        if self.steps == self.at:
            reward[self.row] = float("nan")
        return obs, reward, term, trunc, info


class _BadAction(MLPPolicy):
    """An MLP policy whose action is changed by ``kind``: "wide" [B, C*A + 1], "rows"
    [B - 1, C*A], "nan" a NaN in row 1; "none" leaves it as it is."""

    def __init__(self, kind: str) -> None:
        torch.manual_seed(0)
        super().__init__(PointReach.state_dim, A, C)
        self.kind = kind

    def forward(self, obs):
        out = super().forward(obs)
        action = out.forward_inputs["action"]
        if self.kind == "wide":
            action = torch.cat([action, torch.zeros(action.shape[0], 1)], 1)
        elif self.kind == "rows":
            action = action[:-1]
        elif self.kind == "nan":
            action = action.clone()
            action[1, 0] = float("nan")
        out.forward_inputs["action"] = action
        return out


def _run(name, channels, policy, env):
    """One env loop and a rollout thread (``run_env_and_rollout``, 5 steps); returns (env
    error, rollout error, the env's low-level step count)."""
    plan = make_plan(source_batch_size=B, num_chunks=2, num_action_chunks=C, action_dim=A)
    return run_env_and_rollout(name, channels, policy, plan, ChunkedEnv(env, C, name="nan-reach"),
                               {"actor": 1}, steps=5)


def test_a_nan_reward_names_the_env_the_sub_env_and_the_step(channels):
    env_error, rollout_error, _ = _run("nan-reward", channels, _BadAction("none"),
                                       _NaNRewardAt(at=3, row=1))
    assert isinstance(env_error, RewardError), env_error
    message = str(env_error)
    assert "env rank 0, chunk TrajectoryKey(step_id=0, epoch_id=0, env_rank=0, stage_id=0, " \
           "chunk_id=1)" in message  # low-level step 3 is slot 0 of the second chunk
    assert "env 'nan-reach': sub-env 1 returned the non-finite reward nan at step 3 of its " \
           "episode (slot 0 of the action chunk)" in message
    assert rollout_error is None  # nothing of the bad chunk was sent


@pytest.mark.parametrize("kind, got", [("wide", "[2, 5]"), ("rows", "[1, 4]")])
def test_a_wrong_size_action_names_the_policy_output_and_the_expected_shape(channels, kind,
                                                                             got):
    env = PointReach(B)
    env_error, rollout_error, env_steps = _run(f"bad-{kind}", channels, _BadAction(kind), env)
    assert isinstance(env_error, RolloutFailed), env_error
    assert isinstance(rollout_error, ValueError), rollout_error
    expected = (f"field 'output.forward_inputs[\"action\"]' has shape {got}, expected "
                "[B, C*A] = [2, 2*2] = [2, 4]")
    assert expected in str(env_error) and expected in str(rollout_error)
    assert env_steps == 0  # no chunk reached the env


def test_a_nan_action_names_the_policy_output_before_it_reaches_the_env(channels):
    env = PointReach(B)
    env_error, rollout_error, env_steps = _run("bad-nan", channels, _BadAction("nan"), env)
    assert isinstance(env_error, RolloutFailed), env_error
    assert "field 'output.forward_inputs[\"action\"]' has non-finite values [nan] in rows [1]" \
        in str(env_error)
    assert env_steps == 0 and bool(torch.isfinite(env.pos).all())
