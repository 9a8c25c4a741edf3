"""``TrajectoryCollector.state_dict`` / ``load_state_dict``: the collector's state carried by the
channel's codec and loaded into a fresh collector gives the same outputs for the same later
puts as the collector it came from, in each output mode."""

from __future__ import annotations

import pytest
from zchannel.broker.wire import codec

from .conftest import assert_same
from .test_collector import episode_data, feed, hooks, key, make_plan, parts, pipe_plan, put


def _carried(collector):
    """``collector``'s state as the broker writes and reads it: encoded, then decoded."""
    body, buffers = codec.encode(collector.state_dict())
    return codec.decode(body, [body, *buffers])


def _restored(plan, collector):
    fresh, _, _ = hooks(plan)
    fresh.load_state_dict(_carried(collector))
    return fresh


def _same_from_here(plan, collector, rest):
    """Feed ``rest(c)`` to ``collector`` and to a fresh one loaded with its state: the same
    outputs, and both hold nothing more or less afterwards."""
    restored = _restored(plan, collector)
    assert restored.holds_state() == collector.holds_state()
    expected, got = rest(collector), rest(restored)
    assert expected  # the rest flushes something
    assert_same(got, expected)
    assert restored.holds_state() == collector.holds_state()
    assert_same(_carried(restored), _carried(collector))


def test_rollout_halves_and_open_scopes_carry_over():
    plan = make_plan(mode="rollout", num_chunks=3, rollout_epochs=2)
    collector, _, _ = hooks(plan)
    keys = [key(epoch=e, chunk=c) for e in range(2) for c in range(3)]
    assert feed(collector, plan, keys[:3]) == []  # a scope open
    policy, _ = parts(plan, keys[3])
    put(collector, policy)  # a half waiting for its other half
    assert collector.joiner.policy_parts
    _same_from_here(plan, collector, lambda c: feed(c, plan, keys[3:]))


def test_pipeline_scopes_and_shuffle_generators_carry_over():
    plan = pipe_plan(shuffle=True)
    collector, _, _ = hooks(plan)
    keys = [key(epoch=e, rank=r, chunk=c) for e in range(2) for r in range(2) for c in range(2)]
    assert feed(collector, plan, keys[:4])  # epoch 0 flushed: the generators advanced
    assert feed(collector, plan, keys[4:6]) == []  # epoch 1 open
    _same_from_here(plan, collector, lambda c: feed(c, plan, keys[6:]))


def test_lerobot_open_episodes_and_their_count_carry_over():
    plan = make_plan(mode="lerobot", num_chunks=2, num_action_chunks=2)
    collector, _, _ = hooks(plan)
    ended = feed(collector, plan, [key(chunk=c) for c in range(2)],
                 episode_data=episode_data(True))
    assert sum(len(shard.episodes) for shard in ended) == 2  # counted: episode_index 0, 1
    feed(collector, plan, [key(step=1, chunk=c) for c in range(2)],
         episode_data=episode_data(False))  # an episode open across steps
    assert collector.holds_state()
    _same_from_here(plan, collector, lambda c: feed(
        c, plan, [key(step=2, chunk=c) for c in range(2)], episode_data=episode_data(True)))


def test_a_state_of_another_mode_or_a_malformed_one_is_refused_and_changes_nothing():
    lerobot = make_plan(mode="lerobot", num_chunks=2, num_action_chunks=2)
    collector, _, _ = hooks(lerobot)
    feed(collector, lerobot, [key(chunk=0)], episode_data=episode_data(False))
    state = _carried(collector)
    rollout = make_plan(mode="rollout", num_chunks=2)
    other, _, _ = hooks(rollout)
    with pytest.raises(ValueError, match="a state of the 'lerobot' mode for the 'rollout' mode"):
        other.load_state_dict(state)
    fresh, _, _ = hooks(lerobot)
    broken = dict(state, side={"accumulators": [((0, 0), {"envs": [], "episodes": [],
                                                          "emitted": 0})]})
    with pytest.raises(ValueError, match="a recorder state of 0 environments for 1"):
        fresh.load_state_dict(broken)
    assert not fresh.holds_state() and not fresh.mode.accumulators
    with pytest.raises(ValueError, match="version 1"):
        fresh.load_state_dict({"version": 99})
