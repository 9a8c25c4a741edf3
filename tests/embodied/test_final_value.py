"""gae mode refuses an epoch's last chunk without ``final_prev_values``:
``prev_values`` would come out with N rows per epoch where ``Trajectory`` documents N+1."""

from __future__ import annotations

import pytest
import torch
from zchannel.broker import Channel, HookError
from zchannel.embodied.types import EnvPart

from embodied.test_collector import hooks, key, make_plan, parts, put

pytestmark = pytest.mark.timeout(120)


def _without_final_value(env):
    return EnvPart(env.sources, env.transition, next_obs=env.next_obs,
                   initial_transition=env.initial_transition)


def test_gae_without_final_value_is_refused_naming_field_and_key():
    plan = make_plan(num_chunks=2)
    collector, _, _ = hooks(plan)
    for chunk in range(2):
        policy, env = parts(plan, key(chunk=chunk))
        assert put(collector, policy) == []
        if chunk == 1:
            env = _without_final_value(env)
            with pytest.raises(ValueError, match=r"final_prev_values") as err:
                put(collector, env)
            assert "chunk_id=1" in str(err.value) and "adv_type='gae'" in str(err.value)
        else:
            assert put(collector, env) == []  # only the epoch's last chunk needs it
    policy, env = parts(plan, key(chunk=1))  # the refused put changed nothing: send it right
    (traj,) = put(collector, env)
    assert traj.prev_values.shape[0] == plan.num_chunks + 1  # N+1 rows, as documented


@pytest.mark.parametrize("options", [dict(adv_type="raw", group_size=1),
                                     dict(collect_prev_infos=False)])
def test_final_value_is_optional_where_nothing_uses_it(options):
    plan = make_plan(**options)
    collector, _, _ = hooks(plan)
    policy, env = parts(plan, key())
    put(collector, policy)
    (traj,) = put(collector, _without_final_value(env))
    if plan.collect_prev_infos:
        assert traj.prev_values.shape[0] == plan.num_chunks  # no final row was given
    else:
        assert traj.prev_values is None


def test_gae_refusal_reaches_the_putter_through_a_broker(channels):
    plan = make_plan()
    ch = Channel.create("gae-final", collector="embodied_trajectory",
                        dispatcher="embodied_trajectory", consumers={"actor": 1},
                        options=plan.to_options())
    channels.append(ch)
    policy, env = parts(plan, key(step=3))
    ch.put(policy)
    with pytest.raises(HookError, match="final_prev_values") as err:
        ch.put(_without_final_value(env))
    assert err.value.exc_type == "ValueError"
    assert "step_id=3" in str(err.value)
    ch.put(env)  # the complete half is accepted after the refusal
    got = Channel.connect(ch.address, identity="actor:0")
    try:
        traj = got.get(timeout=30)
    finally:
        got.close()
    assert traj.prev_values.shape[0] == 2
    assert torch.equal(traj.prev_values[-1], env.final_prev_values)
