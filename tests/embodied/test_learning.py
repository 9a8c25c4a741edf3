"""Learning that matches a reference, over brokers (slow: ``pytest -m slow``).

CartPole-v1 with CleanRL ``ppo.py``'s hyperparameters (``presets.CARTPOLE``) must reach a mean
return of 475 over the last 20 finished episodes within 500k env steps on each of 3 seeds;
Pendulum-v1 (``presets.PENDULUM``) must reach -400 within 200k env steps.  A run stops as soon as
its criterion holds (``on_step`` returns True), so the time is what reaching it takes.  The three
seeds of a task run at once (each with its own brokers and workers); the async runner (policy
lag 1) is held to the same criteria on one seed of each task.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

pytest.importorskip("gymnasium")

from zchannel.embodied.presets import CARTPOLE, PENDULUM  # noqa: E402
from zchannel.embodied.runners import run  # noqa: E402

# method="thread": a run that hangs would keep the seeds' thread pool (and pytest) waiting
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2700, method="thread")]
SEEDS = (1, 2, 3)


def _until(cfg, threshold: float, window: int = 20) -> dict:
    """Run ``cfg`` until the mean of the last ``window`` finished episodes reaches
    ``threshold``; what it took."""
    returns: list[float] = []
    start = time.monotonic()

    def on_step(record: dict) -> bool:
        returns.extend(record["returns"])
        return len(returns) >= window and sum(returns[-window:]) / window >= threshold

    result = run(cfg, on_step=on_step)
    episodes = result["episodes"]
    assert len(episodes) == len(returns)  # every finished episode is recorded
    last = [e["return"] for e in episodes[-window:]]
    return {"seed": cfg.seed, "reached": result["stopped_early"],
            "mean_last": sum(last) / len(last), "env_steps": episodes[-1]["env_steps"],
            "steps": len(result["records"]), "wall_s": round(time.monotonic() - start, 1)}


def _three_seeds(cfg, threshold: float) -> list[dict]:
    with ThreadPoolExecutor(len(SEEDS)) as pool:
        return list(pool.map(lambda s: _until(replace(cfg, seed=s), threshold), SEEDS))


def test_cartpole_reaches_475_within_500k_steps_on_three_seeds():
    outcome = _three_seeds(CARTPOLE, 475.0)
    print(f"CartPole-v1 sync: {outcome}")
    for o in outcome:
        assert o["reached"] and o["mean_last"] >= 475.0, outcome
        assert o["env_steps"] <= 500_000, outcome


def test_pendulum_reaches_minus_400_within_200k_steps_on_three_seeds():
    outcome = _three_seeds(PENDULUM, -400.0)
    print(f"Pendulum-v1 sync: {outcome}")
    for o in outcome:
        assert o["reached"] and o["mean_last"] >= -400.0, outcome
        assert o["env_steps"] <= 200_000, outcome


def test_async_runner_reaches_the_same_criteria():
    """The async runner (policy lag 1) on one seed of each task, the two runs at once."""
    with ThreadPoolExecutor(2) as pool:
        cartpole, pendulum = pool.map(
            lambda job: _until(replace(job[0], runner="async", seed=SEEDS[0]), job[1]),
            [(CARTPOLE, 475.0), (PENDULUM, -400.0)])
    print(f"async: CartPole-v1 {cartpole}, Pendulum-v1 {pendulum}")
    assert cartpole["reached"] and cartpole["env_steps"] <= 500_000, cartpole
    assert pendulum["reached"] and pendulum["env_steps"] <= 200_000, pendulum
