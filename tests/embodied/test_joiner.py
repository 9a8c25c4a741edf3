"""ChunkJoiner: pairing policy and env halves by key."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from zchannel.embodied.joiner import ChunkJoiner, JoinedChunk
from zchannel.embodied.types import (
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectorySource,
)

K0 = TrajectoryKey(0, 0, 0, 0, 0)
K1 = TrajectoryKey(0, 0, 0, 0, 1)


def policy(key, rows, offset=0, *, values=None):
    """A PolicyPart for rows [offset, offset+rows) whose action row r holds 10+offset+r."""
    actions = torch.arange(offset, offset + rows, dtype=torch.float32).view(rows, 1) + 10
    if values is not None:
        actions = torch.tensor(values, dtype=torch.float32).view(rows, 1)
    return PolicyPart(
        [TrajectorySource(key, rows, offset)],
        {"states": actions.clone()},
        output=PolicyOutput(forward_inputs={"action": actions}),
    )


def env(key, rows, offset=0, *, initial=None, requires_inference=False):
    """An EnvPart for rows [offset, offset+rows); chunk 0 gets an initial state by default."""
    if initial is None:
        initial = key.chunk_id == 0
    rewards = torch.arange(offset, offset + rows, dtype=torch.float32).view(rows, 1)
    init = EnvTransition(dones=torch.zeros(rows, 1, dtype=torch.bool)) if initial else None
    return EnvPart(
        [TrajectorySource(key, rows, offset)],
        EnvTransition(rewards=rewards, dones=torch.zeros(rows, 1, dtype=torch.bool)),
        requires_inference=requires_inference,
        initial_transition=init,
    )


def joiner_state(j: ChunkJoiner):
    return (
        dict(j.policy_parts),
        dict(j.env_parts),
        {k: list(v) for k, v in j.fragments.items()},
    )


def actions(chunk: JoinedChunk):
    return chunk.policy.output.forward_inputs["action"].view(-1).tolist()


def rewards(chunk: JoinedChunk):
    return chunk.env.transition.rewards.view(-1).tolist()


# -- the pairing example and basic pairing (checklist 13) ------------------------------------------


def test_spec_example_fragments_then_env():
    j = ChunkJoiner(source_batch_size=2)
    assert j.push(policy(K0, 1, 1, values=[11])) == []
    assert j.push(policy(K0, 1, 0, values=[10])) == []
    assert j.policy_parts[K0].output.forward_inputs["action"].tolist() == [[10.0], [11.0]]
    assert j.fragments == {}
    (chunk,) = j.push(env(K0, 2))
    assert chunk.key == K0 and chunk.source == (0, 0)
    assert actions(chunk) == [10.0, 11.0]
    assert chunk.env.initial_transition.dones.tolist() == [[False], [False]]
    assert chunk.policy.sources == [TrajectorySource(K0, 2, 0)]


def test_duplicate_fragment_is_non_contiguous():
    j = ChunkJoiner(2)
    j.push(policy(K0, 1, 1))
    with pytest.raises(ValueError, match="Non-contiguous trajectory fragments"):
        j.push(policy(K0, 1, 1))
    assert len(j.fragments[(PolicyPart, K0)]) == 1  # the rejected push stored nothing


@pytest.mark.parametrize("policy_first", [True, False])
def test_fast_path_either_order(policy_first):
    j = ChunkJoiner(3)
    halves = [policy(K1, 3), env(K1, 3)]
    if not policy_first:
        halves.reverse()
    assert j.push(halves[0]) == []
    (chunk,) = j.push(halves[1])
    assert chunk.policy is halves[0 if policy_first else 1]
    assert chunk.env is halves[1 if policy_first else 0]
    assert j.fragments == {}


def test_fast_path_overwrites_and_rejoins_until_acknowledged():
    j = ChunkJoiner(1)
    j.push(env(K1, 1))
    first = policy(K1, 1, values=[1])
    (chunk,) = j.push(first)
    again = policy(K1, 1, values=[2])
    (rejoined,) = j.push(again)
    assert rejoined.policy is again and rejoined.env is chunk.env
    j.acknowledge(K1)
    assert j.policy_parts == {} and j.env_parts == {}
    assert j.push(policy(K1, 1)) == []
    j.acknowledge(K0)  # unknown keys are ignored


def test_multi_source_part_joins_several_keys_in_order():
    j = ChunkJoiner(2)
    j.push(env(K0, 2))
    j.push(env(K1, 2))
    merged = PolicyPart(
        [TrajectorySource(K0, 2, 0), TrajectorySource(K1, 2, 0)],
        {"states": torch.arange(4.0).view(4, 1)},
        output=PolicyOutput(forward_inputs={"action": torch.arange(4.0).view(4, 1)}),
    )
    chunks = j.push(merged)
    assert [c.key for c in chunks] == [K0, K1]
    assert actions(chunks[0]) == [0.0, 1.0] and actions(chunks[1]) == [2.0, 3.0]


def test_interleaved_keys_and_out_of_order_fragments():
    j = ChunkJoiner(3)
    pushes = [
        env(K1, 1, 2),
        policy(K0, 2, 1),
        env(K0, 1, 1),
        policy(K1, 1, 0),
        env(K1, 2, 0),
        env(K0, 1, 2),
        policy(K1, 2, 1),
        env(K0, 1, 0),
        policy(K0, 1, 0),
    ]
    joined = [c for p in pushes for c in j.push(p)]
    assert [c.key for c in joined] == [K1, K0]
    by_key = {c.key: c for c in joined}
    for key in (K0, K1):
        assert actions(by_key[key]) == [10.0, 11.0, 12.0]
        assert rewards(by_key[key]) == [0.0, 1.0, 2.0]
    assert by_key[K0].env.initial_transition.dones.shape == (3, 1)
    assert by_key[K1].env.initial_transition is None
    assert j.fragments == {}


def fragment(kind, key, sizes_offsets):
    return [kind(key, size, offset) for offset, size in sizes_offsets]


def cut(B, points):
    bounds = [0, *sorted(set(points)), B]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 5),
    n_keys=st.integers(1, 3),
    data=st.data(),
)
def test_join_is_order_independent(B, n_keys, data):
    keys = [TrajectoryKey(0, 0, 0, 0, c) for c in range(n_keys)]
    pushes = []
    for key in keys:
        for kind in (policy, env):
            points = data.draw(st.lists(st.integers(1, max(B - 1, 1)), max_size=3))
            pushes += fragment(kind, key, cut(B, [p for p in points if p < B]))
    order = data.draw(st.permutations(range(len(pushes))))
    j = ChunkJoiner(B)
    joined = [c for i in order for c in j.push(pushes[i])]
    assert sorted(c.key for c in joined) == keys
    for chunk in joined:
        assert actions(chunk) == [10.0 + r for r in range(B)]
        assert rewards(chunk) == [float(r) for r in range(B)]
        assert chunk.policy.sources == chunk.env.sources == [TrajectorySource(chunk.key, B, 0)]
        assert (chunk.env.initial_transition is not None) == (chunk.key.chunk_id == 0)
    assert j.fragments == {}
    assert set(j.policy_parts) == set(j.env_parts) == set(keys)


# -- rejections (checklist 14) ------------------------------------------------------------------


@pytest.mark.parametrize("item", [None, "part", {"sources": []}, EnvTransition()])
def test_foreign_items_raise(item):
    with pytest.raises(ValueError, match="Unexpected trajectory part"):
        ChunkJoiner(2).push(item)


def test_oversized_fragments_raise_and_store_nothing():
    j = ChunkJoiner(2)
    j.push(policy(K0, 1, 0))
    before = joiner_state(j)
    with pytest.raises(ValueError, match="exceed source batch size"):
        j.push(policy(K0, 2, 1))
    with pytest.raises(ValueError, match="exceed source batch size"):
        j.push(policy(K1, 3, 0))
    assert joiner_state(j) == before


def test_fragment_beyond_batch_end_waits_then_is_non_contiguous():
    j = ChunkJoiner(2)
    assert j.push(policy(K0, 1, 2)) == []  # a received total below B waits
    before = joiner_state(j)
    with pytest.raises(ValueError, match="Non-contiguous trajectory fragments"):
        j.push(policy(K0, 1, 0))  # total B, offsets [0, 2]
    assert joiner_state(j) == before


def test_rejected_multi_source_part_changes_nothing():
    j = ChunkJoiner(2)
    j.push(policy(K0, 1, 0))
    j.push(policy(K1, 1, 1))
    j.push(env(K0, 2))
    before = joiner_state(j)
    # Completes K0 (would join) but duplicates K1's offset 1: the whole push is rejected.
    bad = PolicyPart(
        [TrajectorySource(K0, 1, 1), TrajectorySource(K1, 1, 1)],
        {"states": torch.zeros(2, 1)},
        output=PolicyOutput(forward_inputs={"action": torch.zeros(2, 1)}),
    )
    with pytest.raises(ValueError, match="Non-contiguous trajectory fragments"):
        j.push(bad)
    assert joiner_state(j) == before


def test_incompatible_fragments_are_rejected_before_storing():
    j = ChunkJoiner(2)
    j.push(env(K1, 1, 0, requires_inference=True))
    before = joiner_state(j)
    with pytest.raises(ValueError, match="Conflicting terminal-inference state"):
        j.push(env(K1, 1, 1, requires_inference=False))
    assert joiner_state(j) == before
    (chunk,) = [
        c for p in (env(K1, 1, 1, requires_inference=True), policy(K1, 2)) for c in j.push(p)
    ]
    assert chunk.env.requires_inference is True


def test_mixed_external_and_inferred_fragments_are_rejected():
    j = ChunkJoiner(2)
    j.push(policy(K1, 1, 0))
    external = PolicyPart(
        [TrajectorySource(K1, 1, 1)],
        {"states": torch.zeros(1, 1)},
        external_actions=torch.zeros(1, 2),
    )
    with pytest.raises(ValueError, match="inferred and external"):
        j.push(external)
    assert len(j.fragments[(PolicyPart, K1)]) == 1


# -- initial-state rules (checklist 15) ---------------------------------------------------------


def test_chunk_zero_without_initial_state_raises_and_keeps_halves():
    j = ChunkJoiner(2)
    j.push(policy(K0, 2))
    with pytest.raises(ValueError, match="Chunk zero is missing its initial state"):
        j.push(env(K0, 2, initial=False))
    assert K0 in j.policy_parts and K0 in j.env_parts
    with pytest.raises(ValueError, match="Chunk zero is missing its initial state"):
        j.push(policy(K0, 2))  # re-pushing a half re-joins and raises again
    (chunk,) = j.push(env(K0, 2, initial=True))  # the corrected half overwrites
    assert chunk.env.initial_transition is not None


def test_later_chunk_with_initial_state_raises():
    j = ChunkJoiner(2)
    j.push(env(K1, 1, 0, initial=True))
    j.push(env(K1, 1, 1, initial=True))
    with pytest.raises(ValueError, match="Only chunk zero may carry initial state"):
        j.push(policy(K1, 2))
    assert K1 in j.policy_parts and K1 in j.env_parts


def test_joined_chunk_fields():
    assert [f.name for f in dataclasses.fields(JoinedChunk)] == ["key", "source", "policy", "env"]
    with pytest.raises(ValueError):
        ChunkJoiner(0)


def test_random_fragment_storm_leaves_no_state_after_acknowledge():
    rng = random.Random(7)
    B = 4
    keys = [TrajectoryKey(1, e, r, 0, c) for e in range(2) for r in range(2) for c in range(3)]
    pushes = []
    for key in keys:
        for kind in (policy, env):
            points = rng.sample(range(1, B), rng.randint(0, B - 1))
            pushes += fragment(kind, key, cut(B, points))
    rng.shuffle(pushes)
    j = ChunkJoiner(B)
    seen = []
    for p in pushes:
        for chunk in j.push(p):
            seen.append(chunk.key)
            j.acknowledge(chunk.key)
    assert sorted(seen) == sorted(keys)
    assert joiner_state(j) == ({}, {}, {})
