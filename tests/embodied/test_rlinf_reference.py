"""zchannel against transcriptions of RLinf's own code, fed identical random inputs.

The reference functions below are copied from RLinf (github.com/RLinf/RLinf, main branch as of
this writing) with only their plumbing trimmed (kwargs dicts, registries); each names its source:

* ``rlinf/algorithms/utils.py``: ``preprocess_embodied_advantages_inputs``,
  ``calculate_scores``, ``postprocess_embodied_advantages_outputs``, ``safe_normalize``;
* ``rlinf/algorithms/advantages.py``: ``compute_gae_advantages_and_returns``,
  ``compute_grpo_advantages``;
* ``rlinf/utils/distributed.py``: ``masked_stats``, ``normalize_from_stats`` (the pipeline path
  of ``rlinf/workers/env/env_worker.py``: ``send_rollout_trajectories_pipeline``);
* ``rlinf/data/schema/embodied_trajectory_builder.py``: ``EmbodiedTrajectoryBuilder``'s
  ``append_step_result``, ``mark_last_step_with_intervene_flags``, ``update_last_actions``, in
  the order ``EnvWorker._run_interact_once`` calls them.

RLinf's embodied actor (``rlinf/workers/actor/embodied_fsdp_actor_worker.py``:
``compute_advantages_and_returns``) calls ``calculate_adv_and_returns`` without
``normalize_advantages``, so gae normalises by its default (``safe_normalize``: unbiased std
+ 1e-5) and grpo does not normalise at all: zchannel's ``normalization="rlinf_actor"``.
"""

from __future__ import annotations

import pytest
import torch
from zchannel.embodied import (
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    Trajectory,
    TrajectoryKey,
    TrajectorySource,
    TrajectoryStep,
)
from zchannel.embodied.advantages import compute_advantages, compute_loss_mask
from zchannel.embodied.ppo import training_rows
from zchannel.embodied.runners import RunConfig

from .conftest import make_plan

# -- transcriptions of RLinf ------------------------------------------------------------------


def rlinf_safe_normalize(array, loss_mask):
    """rlinf/algorithms/utils.py: safe_normalize."""
    valid_array = array[loss_mask]
    if len(valid_array) > 0:
        mean = valid_array.mean()
        std = valid_array.std()
        array = (array - mean) / (std + 1e-5)
    return array


def rlinf_preprocess(rewards, dones, values, loss_mask, reward_type, adv_type):
    """rlinf/algorithms/utils.py: preprocess_embodied_advantages_inputs."""
    if reward_type == "chunk_level":
        rewards = rewards.sum(dim=-1, keepdim=True)
        dones = dones.max(dim=-1, keepdim=True)[0]
        if loss_mask is not None:
            loss_mask = loss_mask.max(dim=-1, keepdim=True)[0]
    num_chunk, bsz, chunk_size = rewards.shape
    n_steps = num_chunk * chunk_size
    rewards = rewards.transpose(1, 2).reshape(n_steps, bsz)
    if loss_mask is not None:
        loss_mask = loss_mask.transpose(1, 2).reshape(n_steps, bsz)
    flattened_dones_full = dones.transpose(1, 2).reshape((num_chunk + 1) * chunk_size, bsz)
    dones = flattened_dones_full[-(n_steps + 1):]
    if adv_type == "gae":
        flattened_values_full = values.transpose(1, 2).reshape((num_chunk + 1) * chunk_size, bsz)
        values = flattened_values_full[: n_steps + 1]
    return rewards, dones, values, loss_mask, num_chunk, chunk_size, n_steps, bsz


def rlinf_gae(rewards, gamma, gae_lambda, values, normalize_advantages, loss_mask, dones):
    """rlinf/algorithms/advantages.py: compute_gae_advantages_and_returns (with a critic)."""
    T = rewards.shape[0]
    returns = torch.zeros_like(rewards)
    gae = 0
    for step in reversed(range(T)):
        delta = rewards[step] + gamma * values[step + 1] * (~dones[step + 1]) - values[step]
        gae = delta + gamma * gae_lambda * (~dones[step + 1]) * gae
        returns[step] = gae + values[step]
    advantages = returns - values[:-1]
    if normalize_advantages:
        advantages = rlinf_safe_normalize(advantages, loss_mask=loss_mask)
    return advantages, returns


def rlinf_scores(rewards, dones, n_steps, batch_size, group_size):
    """rlinf/algorithms/utils.py: calculate_scores."""
    scores = torch.zeros(batch_size)
    for step in reversed(range(n_steps)):
        scores = scores * ~dones[step + 1]
        scores += rewards[step]
    return scores.reshape(-1, group_size)


def rlinf_grpo(rewards, loss_mask, group_size):
    """rlinf/algorithms/advantages.py: compute_grpo_advantages."""
    grouped_rewards = rewards.view(-1, group_size)
    grouped_reward_mean = grouped_rewards.mean(dim=-1, keepdim=True).expand_as(grouped_rewards)
    grouped_reward_std = grouped_rewards.std(dim=-1, keepdim=True).expand_as(grouped_rewards)
    advantages = grouped_rewards - grouped_reward_mean
    advantages = advantages / (grouped_reward_std + 1e-6)
    advantages = (torch.zeros_like(loss_mask) + advantages.view(1, -1)) * loss_mask
    return advantages


def rlinf_postprocess(advantages, num_chunk, chunk_size):
    """rlinf/algorithms/utils.py: postprocess_embodied_advantages_outputs."""
    return advantages.reshape(num_chunk, chunk_size, -1).transpose(1, 2)


def rlinf_masked_stats(x, mask=None):
    """rlinf/utils/distributed.py: masked_stats."""
    x = x.to(dtype=torch.float64)
    x = x[mask.bool()] if mask is not None else x.reshape(-1)
    return torch.tensor([x.numel(), x.sum(), x.square().sum()], dtype=torch.float64)


def rlinf_normalize_from_stats(x, stats):
    """rlinf/utils/distributed.py: normalize_from_stats."""
    count = stats[0].clamp_min(1.0)
    mean = stats[1] / count
    var = stats[2] / count - mean.square()
    return ((x.to(dtype=torch.float64) - mean) * torch.rsqrt(var.clamp_min(0.0) + 1e-5)).float()


def rlinf_actor_advantages(batch, adv_type, reward_type, gamma, gae_lambda, group_size):
    """EmbodiedFSDPActor.compute_advantages_and_returns → calculate_adv_and_returns (embodied)."""
    r, d, v, m, num_chunk, chunk_size, n_steps, bsz = rlinf_preprocess(
        batch["rewards"], batch["dones"], batch.get("prev_values"), batch.get("loss_mask"),
        reward_type, adv_type)
    if adv_type == "gae":  # normalize_advantages is not passed: the default True applies
        adv, ret = rlinf_gae(r, gamma, gae_lambda, v, True, m, d)
        return rlinf_postprocess(adv, num_chunk, chunk_size), \
            rlinf_postprocess(ret, num_chunk, chunk_size)
    scores = rlinf_scores(r, d, n_steps, bsz, group_size)
    return rlinf_postprocess(rlinf_grpo(scores, m, group_size), num_chunk, chunk_size), None


# -- inputs -----------------------------------------------------------------------------------


def random_batch(seed, *, n=4, width=8, slots=3, reward_type="action_level", mask="computed"):
    g = torch.Generator().manual_seed(seed)
    dones = torch.rand(n + 1, width, slots, generator=g) < 0.15
    dones[0] = False
    k = 1 if reward_type == "chunk_level" else slots
    batch = {"rewards": torch.randn(n, width, slots, generator=g),
             "dones": dones, "prev_values": torch.randn(n + 1, width, k, generator=g)}
    if mask == "computed":  # what to_training_batch adds without auto_reset
        batch["loss_mask"], batch["loss_mask_sum"] = compute_loss_mask(dones, "action_level")
    elif mask == "random":
        batch["loss_mask"] = torch.rand(n, width, slots, generator=g) < 0.7
    return batch


def plan_for(adv_type, reward_type, **kw):
    return make_plan(adv_type=adv_type, reward_type=reward_type, gamma=0.9, gae_lambda=0.8,
                     num_action_chunks=3, group_size=4, source_batch_size=8, **kw)


CASES = [(seed, reward_type, mask) for seed in range(3)
         for reward_type in ("action_level", "chunk_level")
         for mask in ("computed", "random", None)]


@pytest.mark.parametrize(("seed", "reward_type", "mask"), CASES)
def test_gae_matches_rlinfs_actor(seed, reward_type, mask):
    batch = random_batch(seed, reward_type=reward_type, mask=mask)
    ref_adv, ref_ret = rlinf_actor_advantages(
        {k: v.clone() for k, v in batch.items()}, "gae", reward_type, 0.9, 0.8, 4)
    ours = compute_advantages(dict(batch), plan_for("gae", reward_type),
                              normalization="rlinf_actor")
    torch.testing.assert_close(ours["advantages"], ref_adv, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ours["returns"], ref_ret, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("seed", "reward_type", "mask"),
                         [c for c in CASES if c[2] is not None])
def test_grpo_matches_rlinfs_actor_unnormalised(seed, reward_type, mask):
    batch = random_batch(seed, reward_type=reward_type, mask=mask)
    del batch["prev_values"]
    ref_adv, _ = rlinf_actor_advantages(
        {k: v.clone() for k, v in batch.items()}, "grpo", reward_type, 1.0, 1.0, 4)
    plan = plan_for("grpo", reward_type)
    ours = compute_advantages(dict(batch), plan, normalization="rlinf_actor")
    torch.testing.assert_close(ours["advantages"], ref_adv.float(), atol=1e-5, rtol=1e-5)
    pooled = compute_advantages(dict(batch), plan)["advantages"]  # the spec's pooled default
    assert not torch.allclose(pooled, ref_adv.float(), atol=1e-3)


@pytest.mark.parametrize(("seed", "reward_type", "adv_type"),
                         [(s, r, a) for s in range(3) for r in ("action_level", "chunk_level")
                          for a in ("gae", "grpo")])
def test_pooled_normalisation_matches_rlinfs_pipeline_path(seed, reward_type, adv_type):
    """RLinf's pipeline (env_worker.send_rollout_trajectories_pipeline) computes the estimator
    without normalising, then normalises every estimator from masked_stats: the collector's
    pipeline mode and compute_advantages' default."""
    batch = random_batch(seed, reward_type=reward_type, mask="random")
    if reward_type == "chunk_level":
        batch["loss_mask"] = batch["loss_mask"].any(-1, keepdim=True)
    r, d, v, m, num_chunk, chunk_size, n_steps, bsz = rlinf_preprocess(
        batch["rewards"], batch["dones"], batch["prev_values"], batch["loss_mask"],
        reward_type, adv_type)
    if adv_type == "gae":
        raw, _ = rlinf_gae(r, 0.9, 0.8, v, False, m, d)
    else:
        raw = rlinf_grpo(rlinf_scores(r, d, n_steps, bsz, 4), m, 4)
    raw = rlinf_postprocess(raw, num_chunk, chunk_size)
    ref = rlinf_normalize_from_stats(raw, rlinf_masked_stats(raw, batch["loss_mask"]))
    ours = compute_advantages(dict(batch), plan_for(adv_type, reward_type))["advantages"]
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)


# -- interventions ----------------------------------------------------------------------------


class RLinfBuilder:
    """rlinf/data/schema/embodied_trajectory_builder.py: EmbodiedTrajectoryBuilder, the three
    methods EnvWorker._run_interact_once calls per chunk, in its order."""

    def __init__(self):
        self.actions, self.intervene_flags, self.forward_inputs = [], [], []

    def append_step_result(self, actions, forward_inputs):
        self.actions.append(actions)
        self.intervene_flags.append(torch.zeros_like(actions, dtype=torch.bool))
        self.forward_inputs.append(forward_inputs)

    def mark_last_step_with_intervene_flags(self, intervene_flags):
        if intervene_flags.dim() == 1:
            intervene_flags = intervene_flags[:, None]
        last_action = self.actions[-1]
        bsz, num_action_chunks = intervene_flags.shape
        expanded_flags = intervene_flags.reshape(bsz, num_action_chunks, 1).expand_as(
            last_action.reshape(bsz, num_action_chunks, -1))
        self.intervene_flags[-1] = expanded_flags.reshape(bsz, -1).to(torch.bool)

    def update_last_actions(self, intervene_actions, intervene_flags):
        last_action = self.actions[-1]
        if intervene_flags.dim() == 1:
            intervene_flags = intervene_flags[:, None]
        bsz, num_action_chunks = intervene_flags.shape[:2]
        flags = intervene_flags.reshape(-1, num_action_chunks, 1)
        last_full_action = intervene_actions.reshape(bsz, num_action_chunks, -1) * flags \
            + last_action.reshape(bsz, num_action_chunks, -1) * (~flags)
        self.actions[-1] = last_full_action.reshape(bsz, -1)
        self.intervene_flags[-1] = flags.expand_as(last_full_action).reshape(bsz, -1)
        last_fi = self.forward_inputs[-1]
        if "action" in last_fi:
            last_fi["action"] = last_full_action.reshape(bsz, -1).cpu().contiguous()
        last_fi.pop("model_action", None)


@pytest.mark.parametrize("seed", range(6))
def test_interventions_match_rlinfs_builder(seed):
    """With ``intervention_precedence="env"`` (the runners' setting) the env's executed
    intervention wins where it and the model's flags both mark a chunk."""
    g = torch.Generator().manual_seed(seed)
    B, C, A = 4, 3, 2
    actions = torch.randn(B, C * A, generator=g)
    model_flags = torch.rand(B, C, generator=g) < 0.5
    env_flags = torch.rand(B, C, generator=g) < 0.5
    expert = torch.randn(B, C, A, generator=g)
    with_env = seed % 3 != 2  # some chunks without an env intervention
    with_model = seed % 3 != 1

    ref = RLinfBuilder()
    ref.append_step_result(actions.clone(), {"action": actions.clone(),
                                             "model_action": actions.clone()})
    if with_model:
        ref.mark_last_step_with_intervene_flags(model_flags)
    if with_env:
        ref.update_last_actions(expert.reshape(B, -1), env_flags)

    key = TrajectoryKey(0, 0, 0, 0, 1)
    policy = PolicyPart([TrajectorySource(key, B)], {"states": torch.zeros(B, 2)},
                        output=PolicyOutput(
                            forward_inputs={"action": actions.clone(),
                                            "model_action": actions.clone()},
                            intervene_flags=model_flags if with_model else None))
    env = EnvPart([TrajectorySource(key, B)], EnvTransition(
        rewards=torch.zeros(B, C), intervene_actions=expert if with_env else None,
        intervene_flags=env_flags if with_env else None))
    step = TrajectoryStep.from_parts(policy, env, rewards=None, collect_prev_infos=True,
                                     collect_transitions=False, enable_rlt=False,
                                     include_final_value=False, intervention_precedence="env")
    torch.testing.assert_close(step.actions, ref.actions[-1])
    assert torch.equal(step.intervene_flags, ref.intervene_flags[-1])
    torch.testing.assert_close(step.forward_inputs["action"], ref.forward_inputs[-1]["action"])
    assert ("model_action" in step.forward_inputs) == ("model_action" in ref.forward_inputs[-1])


# -- the runners' default ---------------------------------------------------------------------


def test_the_runners_let_the_env_intervention_win():
    assert RunConfig().plan(action_dim=2).intervention_precedence == "env"


def test_rollout_mode_actors_default_to_rlinfs_actor_normalisation():
    assert RunConfig().advantage_normalization == "rlinf"
    assert RunConfig(advantage_normalization="pooled").advantage_normalization == "pooled"
    with pytest.raises(ValueError, match="advantage_normalization"):
        RunConfig(advantage_normalization="per-minibatch")
    with pytest.raises(ValueError, match="normalization must be one of"):
        compute_advantages(random_batch(0), plan_for("gae", "action_level"),
                           normalization="unbiased")
    # training_rows (what a rollout-mode actor trains on) defaults to RLinf's actor formulas
    plan = plan_for("gae", "action_level", auto_reset=True)
    traj = Trajectory(
        actions=torch.randn(2, 8, 6), rewards=torch.randn(2, 8, 3),
        dones=torch.zeros(3, 8, 3, dtype=torch.bool), prev_logprobs=torch.randn(2, 8, 6),
        prev_values=torch.randn(3, 8, 3), forward_inputs={"states": torch.randn(2, 8, 4)})
    rows = training_rows([traj], plan)
    batch = compute_advantages(
        {"rewards": traj.rewards, "dones": traj.dones, "prev_values": traj.prev_values},
        plan, normalization="rlinf_actor")
    torch.testing.assert_close(rows["advantages"], batch["advantages"].reshape(16, 3))
