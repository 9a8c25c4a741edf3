"""The producer side: EnvLoop and Rollout over real broker channels, EnvPart completion, checks."""

from __future__ import annotations

import threading

import pytest
import torch
from zchannel.broker import Channel, HookError
from zchannel.embodied import (
    ChunkedEnv,
    EnvPart,
    EnvTransition,
    MLPPolicy,
    PointReach,
    PolicyOutput,
    Trajectory,
    TrajectoryKey,
    TrajectorySource,
    TrajectoryStep,
    check_env_part,
    complete_env_part,
)
from zchannel.embodied.pipeline import (
    REQUESTS_KEY,
    STOP,
    EnvLoop,
    Rollout,
    WeightPublisher,
    WeightReceiver,
)
from zchannel.embodied.ppo import training_rows

from embodied.test_collector import make_plan

pytestmark = pytest.mark.timeout(120)

K = TrajectoryKey(0, 0, 0, 0, 0)


def _policy(seed=0):
    torch.manual_seed(seed)
    return MLPPolicy(PointReach.state_dim, PointReach.action_dim, 2)


def _part(requires_inference=True, next_obs=None, chunk=0, B=2, C=2):
    flags = torch.zeros(B, C, dtype=torch.bool)
    key = TrajectoryKey(0, 0, 0, 0, chunk)
    return EnvPart([TrajectorySource(key, B, 0)],
                   EnvTransition(rewards=torch.ones(B, C), dones=flags, terminations=flags,
                                 truncations=flags),
                   next_obs=next_obs, requires_inference=requires_inference,
                   initial_transition=EnvTransition(dones=flags) if chunk == 0 else None)


class _Recorder:
    def __init__(self, values):
        self.values, self.seen = values, []

    def __call__(self, obs):
        self.seen.append(obs)
        B = obs["states"].shape[0]
        return PolicyOutput(
            forward_inputs={"action": torch.zeros(B, 4), "states": obs["states"],
                            "rlt_transition_z_rl": torch.full((B, 3), 1.0),
                            "rlt_transition_proprio": torch.full((B, 2), 2.0),
                            "rlt_transition_ref_chunk": torch.full((B, 4), 3.0),
                            "big_image": torch.zeros(B, 64, 64)},
            prev_values=self.values.expand(B, 2).clone())


def test_completion_resolves_next_obs_and_bootstraps():
    plan = make_plan(source_batch_size=2, num_action_chunks=2, action_dim=2,
                     collect_transitions=True)
    request_obs = {"states": torch.full((2, 4), 7.0)}
    override = {"states": torch.full((2, 4), 9.0)}
    infer = _Recorder(torch.tensor([[4.0, 5.0]]))
    done = complete_env_part(_part(), request_obs, infer, plan)
    assert torch.equal(infer.seen[-1]["states"], request_obs["states"])  # from the request
    assert torch.equal(done.final_prev_values, torch.tensor([[4.0, 5.0]] * 2))
    assert torch.equal(done.bootstrap_values, torch.tensor([[4.0]] * 2))
    assert torch.equal(done.next_obs["states"], request_obs["states"])
    assert not done.requires_inference
    done = complete_env_part(_part(next_obs=override), request_obs, infer, plan)
    assert torch.equal(infer.seen[-1]["states"], override["states"])  # the override wins
    assert torch.equal(done.next_obs["states"], override["states"])
    # no inference asked: no final value, no policy call
    calls = len(infer.seen)
    plain = complete_env_part(_part(requires_inference=False), request_obs, infer,
                              make_plan(source_batch_size=2, num_action_chunks=2, action_dim=2))
    assert len(infer.seen) == calls and plain.final_prev_values is None
    assert plain.next_obs is None  # collect_transitions off: the observation is not kept


def test_rlt_completion_keeps_only_the_three_features():
    plan = make_plan(source_batch_size=2, num_action_chunks=2, action_dim=2, enable_rlt=True)
    infer = _Recorder(torch.tensor([[1.0, 1.0]]))
    done = complete_env_part(_part(), {"states": torch.zeros(2, 4)}, infer, plan)
    assert set(done.next_rlt_obs) == {"z_rl", "proprio", "ref_chunk"}
    assert torch.equal(done.next_rlt_obs["proprio"], torch.full((2, 2), 2.0))
    assert done.next_obs is None  # never the whole next forward-input dict
    # without terminal inference the features come from the carrying request's inference
    own = infer({"states": torch.zeros(2, 4)})
    done = complete_env_part(_part(requires_inference=False), {"states": torch.zeros(2, 4)},
                             infer, plan, request_output=own)
    assert set(done.next_rlt_obs) == {"z_rl", "proprio", "ref_chunk"}
    with pytest.raises(ValueError, match="RLT completion needs the carrying request"):
        complete_env_part(_part(requires_inference=False), {"states": torch.zeros(2, 4)},
                          infer, plan)


def test_apply_interventions_is_a_public_step_method():
    step = TrajectoryStep(actions=torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
                          forward_inputs={"action": torch.zeros(2, 2), "model_action": 1})
    out = step.apply_interventions(torch.tensor([[9.0, 8.0], [7.0, 6.0]]),
                                   torch.tensor([[False, True], [True, False]]))
    assert out is step
    assert step.actions.tolist() == [[1.0, 8.0], [7.0, 4.0]]
    assert step.intervene_flags.tolist() == [[False, True], [True, False]]
    assert torch.equal(step.forward_inputs["action"], step.actions)
    assert "model_action" not in step.forward_inputs
    with pytest.raises(ValueError, match="intervene_flags"):
        step.apply_interventions(torch.zeros(2, 2), None)


@pytest.mark.parametrize("field, bad, match", [
    ("rewards", torch.ones(2, 3), "field 'transition.rewards' has shape"),
    ("dones", None, "field 'transition.dones' is missing"),
    ("rewards", torch.tensor([[0.0, 0.0], [float("nan"), 1.0]]),
     r"field 'transition.rewards' has non-finite values \[nan\] in rows \[1\]"),
])
def test_malformed_env_part_names_field_and_key(field, bad, match):
    plan = make_plan(source_batch_size=2, num_action_chunks=2, action_dim=2)
    part = _part()
    setattr(part.transition, field, bad)
    with pytest.raises(ValueError, match=match) as err:
        check_env_part(part, plan)
    assert "TrajectoryKey(step_id=0" in str(err.value)


def test_malformed_part_through_the_broker_loses_nothing(channels):
    from embodied.test_collector import key, parts

    plan = make_plan(source_batch_size=2, num_action_chunks=2, action_dim=1)
    ch = Channel.create("traj-bad", collector="embodied_trajectory",
                        dispatcher="embodied_trajectory", producers=["rollout"],
                        consumers={"actor": 1}, options=plan.to_options())
    channels.append(ch)
    policy, env = parts(plan, key(step=0))
    ch.put(policy)  # in flight: one half of step 0
    bad = parts(plan, key(step=1))[1]
    bad.transition.rewards = torch.ones(2, 5)
    with pytest.raises(HookError) as err:
        ch.put(bad)
    assert "transition.rewards" in str(err.value) and "step_id=1" in str(err.value)
    ch.put(env)  # the step-0 chunk still completes
    actor = Channel.connect("traj-bad", identity="actor:0")
    out = actor.get(timeout=30)
    actor.close()
    assert isinstance(out, Trajectory) and out.actions.shape == (1, 2, 2)


def test_a_policy_output_without_an_action_makes_a_trajectory_without_actions(channels):
    """``actions = output.forward_inputs.get("action")``: an output that carries no action (a
    policy that keeps its action elsewhere) is not an error; its trajectory has no actions,
    and the other fields are there as usual."""
    from embodied.test_collector import key, parts

    plan = make_plan(source_batch_size=2, num_action_chunks=2, action_dim=1)
    ch = Channel.create("traj-noaction", collector="embodied_trajectory",
                        dispatcher="embodied_trajectory", producers=["rollout"],
                        consumers={"actor": 1}, options=plan.to_options())
    channels.append(ch)
    policy, env = parts(plan, key())
    del policy.output.forward_inputs["action"]
    policy.output.forward_inputs["obs_emb"] = torch.ones(2, 4)
    ch.put(policy)
    ch.put(env)
    actor = Channel.connect("traj-noaction", identity="actor:0")
    out = actor.get(timeout=30)
    actor.close()
    assert isinstance(out, Trajectory) and out.actions is None
    assert out.rewards.shape == (1, 2, 2) and out.forward_inputs["obs_emb"].shape == (1, 2, 4)


def _run_producers(plan, *, decoupled, steps, name, channels, capture_parts=False):
    """EnvLoop threads and a Rollout thread over real broker channels; returns the items on
    the trajectory channel (raw parts when ``capture_parts``)."""
    hooks = {} if capture_parts else dict(
        collector="embodied_trajectory", dispatcher="embodied_trajectory",
        producers=["rollout"], consumers={"actor": plan.actor_world_size},
        options=plan.to_options())
    requests = Channel.create(f"{name}-req")
    actions = Channel.create(f"{name}-act")
    traj = Channel.create(f"{name}-traj", **hooks)
    sync = Channel.create(f"{name}-sync")
    channels.extend([requests, actions, traj, sync])
    policy = _policy()
    WeightPublisher(sync).publish(policy.state_dict(), steps)  # every step's weights exist
    rollout = Rollout(policy, plan, requests=requests, actions=actions, trajectory=traj,
                      weights=WeightReceiver(sync, policy), max_staleness=0)
    errors = []

    def env_main(rank):
        req, act = Channel.connect(f"{name}-req"), Channel.connect(f"{name}-act")
        try:
            loop = EnvLoop(ChunkedEnv(PointReach(plan.source_batch_size, max_steps=4),
                                      plan.num_action_chunks), plan, rank, req, act,
                           decoupled=decoupled)
            loop.start(seed=rank)
            for step in range(steps):
                loop.run_step(step)
            loop.flush()
        except BaseException as exc:
            errors.append(exc)
        finally:
            req.close()
            act.close()

    def rollout_main():
        try:
            rollout.run()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=env_main, args=(r,)) for r in range(plan.num_sources)]
    threads.append(threading.Thread(target=rollout_main))
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join(60)
    requests.put(STOP, key=REQUESTS_KEY)
    threads[-1].join(60)
    assert not errors, errors
    reader = Channel.connect(f"{name}-traj", identity="actor:0")
    out = []
    while traj.qsize() if capture_parts else traj.qsize(consumer="actor:0"):
        out.append(reader.get(timeout=10))
    reader.close()
    return out


GEOMETRY = dict(num_sources=2, source_batch_size=4, num_chunks=3, rollout_epochs=2,
                actor_world_size=1, num_action_chunks=2, action_dim=2, auto_reset=True,
                reward_type="chunk_level", gamma=0.9, gae_lambda=0.9)


def _layout(traj):
    return {name: (tuple(v.shape), v.dtype) for name, v in vars(traj).items()
            if isinstance(v, torch.Tensor)}


def test_decoupled_boundaries_give_the_contract_layout(channels):
    plan = make_plan(mode="rollout", **GEOMETRY)
    sync = _run_producers(plan, decoupled=False, steps=2, name="lay-s", channels=channels)
    dec = _run_producers(plan, decoupled=True, steps=2, name="lay-d", channels=channels)
    assert len(sync) == len(dec) == 2 * plan.num_sources  # one shard per source and step
    E, N, B, C, D = 2, 3, 4, 2, 4
    for traj in sync + dec:
        assert traj.actions.shape == (E * N, B, D)
        assert traj.rewards.shape == (E * N, B, C)
        assert traj.dones.shape == (E * (N + 1), B, C)  # a boundary row per epoch
        assert traj.prev_values.shape == (E * (N + 1), B, 1)  # and a final value per epoch
        assert torch.isfinite(traj.prev_values).all()
    assert {frozenset(_layout(t).items()) for t in sync} == \
        {frozenset(_layout(t).items()) for t in dec}
    # the decoupled epoch boundary is marked by the next_obs override on the last chunk
    parts = _run_producers(plan, decoupled=True, steps=1, name="lay-p", channels=channels,
                           capture_parts=True)
    last = [p for p in parts if isinstance(p, EnvPart)
            and p.sources[0].key.chunk_id == N - 1]
    assert len(last) == E * plan.num_sources
    assert all(p.final_prev_values is not None for p in last)


def test_rollout_and_pipeline_modes_give_identical_advantages(channels):
    rollout_plan = make_plan(mode="rollout", **{**GEOMETRY, "rollout_epochs": 1})
    parts = _run_producers(rollout_plan, decoupled=False, steps=1, name="adv",
                           channels=channels, capture_parts=True)
    assert parts
    pipeline_plan = make_plan(mode="pipeline", micro_batch_size=6, shuffle=False,
                              **{**GEOMETRY, "rollout_epochs": 1})
    results = {}
    for plan in (rollout_plan, pipeline_plan):
        ch = Channel.create(f"adv-{plan.mode}", collector="embodied_trajectory",
                            dispatcher="embodied_trajectory", producers=["rollout"],
                            consumers={"actor": 1}, options=plan.to_options())
        channels.append(ch)
        for part in parts:
            ch.put(part)
        actor = Channel.connect(f"adv-{plan.mode}", identity="actor:0")
        items = [actor.get(timeout=30) for _ in range(ch.qsize(consumer="actor:0") or 1)]
        actor.close()
        # pooled: the pipeline's normalisation (rollout actors default to RLinf's actor one)
        results[plan.mode] = training_rows(sorted(items, key=_order), plan,
                                           normalization="pooled")
    a, b = results["rollout"], results["pipeline"]
    assert a["advantages"].shape[0] == 2 * 4 * 3
    assert a["advantages"].abs().sum() > 0 and a["returns"].abs().sum() > 0
    for name in ("advantages", "returns", "actions", "prev_logprobs"):
        torch.testing.assert_close(a[name], b[name], msg=name)


def _order(item):
    return getattr(item, "micro_batch_index", 0), int(
        item.forward_inputs["column"].min()) if isinstance(item, Trajectory) else 0
