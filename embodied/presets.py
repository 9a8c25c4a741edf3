"""Reference run configurations: the hyperparameters the learning tests and the demo use.

- ``gym:CartPole-v1``: CleanRL's ``ppo.py`` — 4 envs × 128 steps per update (one env worker of
  4 envs, 128 chunks of one action), 976 updates (500k env steps), γ 0.99, λ 0.95, Adam 2.5e-4
  annealed to 0 (eps 1e-5), 4 epochs × 4 minibatches, clip 0.2, entropy 0.01, value 0.5 with
  clipping, grad norm 0.5, advantages normalised per minibatch; tanh MLP 64×64 actor and critic.
- ``gym:Pendulum-v1``: 16 envs × 64 steps per update (1024 env steps), γ 0.9, λ 0.95, Adam 1e-3,
  10 epochs × 16 minibatches, no entropy bonus, tanh-squashed Gaussian, observation and reward
  normalisation; 196 updates (200k env steps: the bound the learning test states).
- any other ``gym:`` id: CleanRL's PPO settings with 8 envs × 128 steps per update.
- ``point_reach``: the demo's toy task (``RunConfig()``'s own defaults).

``preset(env, **overrides)`` returns the ``RunConfig``; keyword overrides replace fields.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from zchannel.embodied.ppo import PPOConfig
from zchannel.embodied.runners import RunConfig

CARTPOLE = RunConfig(env="gym:CartPole-v1", envs=1, env_batch=4, num_chunks=128,
                     num_action_chunks=1, steps=976, gamma=0.99, gae_lambda=0.95,
                     ppo=PPOConfig.cleanrl())
PENDULUM = RunConfig(env="gym:Pendulum-v1", envs=1, env_batch=16, num_chunks=64,
                     num_action_chunks=1, steps=196, gamma=0.9, gae_lambda=0.95,
                     ppo=PPOConfig.cleanrl(lr=1e-3, epochs=10, minibatches=16,
                                           entropy_coef=0.0, anneal_lr=False),
                     normalize_reward=True, policy_kwargs={"normalize_obs": True})
GYM_DEFAULT = RunConfig(envs=1, env_batch=8, num_chunks=128, num_action_chunks=1, steps=100,
                        gamma=0.99, gae_lambda=0.95, ppo=PPOConfig.cleanrl())
PRESETS = {"gym:CartPole-v1": CARTPOLE, "gym:Pendulum-v1": PENDULUM}


def preset(env: str, **overrides: Any) -> RunConfig:
    """The reference ``RunConfig`` for ``env`` (see the module docstring) with ``overrides``."""
    if env in PRESETS:
        base = PRESETS[env]
    elif env.startswith("gym:"):
        base = replace(GYM_DEFAULT, env=env)
    else:
        base = RunConfig(env=env)
    return replace(base, **overrides)


__all__ = ["CARTPOLE", "PENDULUM", "PRESETS", "preset"]
