"""Plug your own model into the runners (docs/embodied-envs.md, "Your own policy").

A policy is any torch module with the ``Policy`` protocol: ``forward(obs) -> PolicyOutput`` and
``evaluate(forward_inputs, actions) -> (logprobs, values, entropy)``.  The runners build it from
``RunConfig(policy="module:factory")`` in every worker (``factory(spec, cfg)``), so nothing in
the runners changes.  Here: a two-camera "VLA-like" model (a shared image tower, a state MLP, a
Gaussian action head over chunks of 2 actions) trained for 3 steps over brokers on the
two-camera toy task.

Run: python docs/examples/embodied_custom_policy.py
"""

from __future__ import annotations

import math

import torch
from torch import nn
from zchannel.embodied import PolicyOutput
from zchannel.embodied.runners import RunConfig, run
from zchannel.embodied.spaces import EnvSpec


# --8<-- [start:class]
class TinyVLA(nn.Module):
    def __init__(self, spec: EnvSpec, chunks: int) -> None:
        super().__init__()
        self.num_action_chunks, self.action_dim = chunks, spec.action_dim
        self.tower = nn.Sequential(nn.Conv2d(3, 8, 4, stride=4), nn.ReLU(),
                                   nn.AdaptiveAvgPool2d(2), nn.Flatten())  # 32 per camera
        self.state = nn.Sequential(nn.Linear(spec.state_dim, 32), nn.Tanh())
        self.head = nn.Linear(32 * 3, chunks * spec.action_dim)
        self.value = nn.Linear(32 * 3, 1)
        self.log_std = nn.Parameter(torch.full((chunks * spec.action_dim,), -0.5))

    def _features(self, inputs: dict) -> torch.Tensor:
        cams = [self.tower(inputs[k].permute(0, 3, 1, 2).float() / 255)
                for k in ("main_images", "wrist_images")]
        return torch.cat([*cams, self.state(inputs["states"])], dim=-1)

    def _logp(self, mean: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return (-0.5 * ((action - mean) / self.log_std.exp()).pow(2) - self.log_std
                - 0.5 * math.log(2 * math.pi))

    @torch.no_grad()
    def forward(self, obs: dict) -> PolicyOutput:
        inputs = {k: obs[k] for k in ("main_images", "wrist_images", "states")}
        feats = self._features(inputs)
        mean = self.head(feats)
        action = mean + self.log_std.exp() * torch.randn_like(mean)
        inputs["action"] = action  # what the env executes: [B, C·A] (the env clips to [-1, 1])
        return PolicyOutput(forward_inputs=inputs, prev_logprobs=self._logp(mean, action),
                            prev_values=self.value(feats))

    def evaluate(self, forward_inputs: dict, actions: torch.Tensor):
        feats = self._features(forward_inputs)
        mean = self.head(feats)
        entropy = (self.log_std + 0.5 * (1 + math.log(2 * math.pi))).sum().expand(len(feats))
        return self._logp(mean, actions), self.value(feats), entropy


def make_policy(spec: EnvSpec, cfg: RunConfig) -> TinyVLA:
    """The factory a RunConfig names: called in every worker with the env's spec."""
    return TinyVLA(spec, cfg.num_action_chunks)
# --8<-- [end:class]


if __name__ == "__main__":
    cfg = RunConfig(env="gym:zchannel.embodied.toyenvs:TwoCameraReach-v0",
                    env_kwargs={"size": 32}, policy="embodied_custom_policy:make_policy",
                    envs=1, env_batch=4, num_chunks=8, num_action_chunks=2, steps=3)
    result = run(cfg)
    weights = result["final_weights"]
    print(f"trained {len(result['records'])} steps over brokers; policy versions "
          f"{[r['version'] for r in result['records']]}; final weights hold "
          f"{sorted(weights)[:3]}...")
