"""Helpers shared by the embodied tests: a small rollout plan, deep equality of transport
values, and an encode/decode round trip (import them with ``from .conftest import ...``)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import torch
from zchannel.broker import Channel
from zchannel.broker.wire.codec import decode, encode
from zchannel.embodied.pipeline import (
    REQUESTS_KEY,
    STOP,
    EnvLoop,
    Rollout,
    WeightPublisher,
    WeightReceiver,
)
from zchannel.embodied.plan import TrajectoryPlan

ROLLOUT = dict(
    mode="rollout",
    num_sources=1,
    source_batch_size=1,
    num_chunks=1,
    rollout_epochs=1,
    actor_world_size=1,
    num_action_chunks=1,
    action_dim=1,
)


def make_plan(**overrides: Any) -> TrajectoryPlan:
    """A rollout plan with one source of one env and one actor, with ``overrides`` applied."""
    return TrajectoryPlan.from_options({**ROLLOUT, **overrides})


def assert_same(a: Any, b: Any, path: str = "value") -> None:
    """Deep equality: same types, dict keys in the same order, tensors and arrays with equal
    dtype, shape and values; ``path`` names the first difference."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a, b), f"{path}: {a} != {b}"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        assert np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def roundtrip(obj: Any) -> Any:
    """``obj`` encoded and decoded as a broker would carry it (never pickled)."""
    body, buffers = encode(obj)
    assert b"pickle" not in body
    return decode(body, [bytes(memoryview(b).cast("B")) for b in buffers])


def run_env_and_rollout(name: str, channels: list, policy: Any, plan: TrajectoryPlan,
                        env: Any, consumers: dict, steps: int) -> tuple[Any, Any, int]:
    """One env loop (this thread, rank 0, stepping ``env``, a ``ChunkedEnv``) against a
    rollout thread serving ``policy`` over real brokers, for ``steps`` steps or until the env
    loop raises; ``(the env loop's error, the rollout's error, the env's low-level steps)``."""
    plain = Channel.create(f"{name}-plain")  # requests, actions and weights on distinct keys
    traj = Channel.create(f"{name}-traj", collector="embodied_trajectory",
                          dispatcher="embodied_trajectory", producers=["rollout"],
                          consumers=consumers, options=plan.to_options())
    channels.extend([plain, traj])
    WeightPublisher(plain).publish(policy.state_dict(), 100)  # no step waits for weights
    rollout = Rollout(policy, plan, requests=plain, actions=plain, trajectory=traj,
                      weights=WeightReceiver(plain, policy))
    rollout_error: list[BaseException] = []

    def rollout_main() -> None:
        try:
            rollout.run()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            rollout_error.append(exc)

    thread = threading.Thread(target=rollout_main)
    thread.start()
    env_side = Channel.connect(f"{name}-plain")
    loop = EnvLoop(env, plan, 0, env_side, env_side, reply_timeout=600)
    loop.start(seed=0)
    env_error = None
    try:
        for step in range(steps):
            loop.run_step(step)
    except Exception as exc:
        env_error = exc
    if thread.is_alive():
        env_side.put(STOP, key=REQUESTS_KEY)  # the rollout waits for requests: it may end
    env_side.close()
    thread.join(60)
    assert not thread.is_alive()
    return env_error, rollout_error[0] if rollout_error else None, loop.env_steps
