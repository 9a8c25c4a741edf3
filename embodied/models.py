"""Policies a user starts from: ``ActorCritic`` for any ``EnvSpec`` (docs/embodied.md, "Policies").

``ActorCritic(spec, num_action_chunks)`` implements the ``Policy`` protocol:

- **Encoder.** ``states`` (optionally through an ``ObsNormalizer``) and, for every image key of
  the spec, a small CNN (``ImageEncoder``: three stride-2 3×3 convolutions, ReLU, a 4×4 adaptive
  average pool and a linear layer; uint8 ``[B, H, W, C]`` scaled to [0, 1]; stacked views
  ``[B, n, H, W, C]`` share it and are concatenated).  The features are concatenated.
- **Actor and critic.** Two tanh MLPs on the features (CleanRL's layout: orthogonal init,
  gain √2, 0.01 for the action head and 1 for the value head).  The value is chunk-level
  ``[B, 1]``.
- **Heads.** Box: a diagonal Gaussian with a state-independent log-std; ``squash="tanh"``
  executes ``tanh(u)`` and its log-probability carries the change-of-variables correction
  ``− log(1 − tanh(u)²)`` per dimension, ``squash="clip"`` executes ``u`` (the env clips to the
  bounds) with the plain Gaussian log-probability.  Discrete / MultiDiscrete / MultiBinary: one
  categorical per action number (MultiBinary: two classes per bit), factorised, over padded
  logits.  Log-probabilities are per action number ``[B, C·A]``; PPO sums them.

``forward`` samples from ``generator`` (a ``torch.Generator`` the rollout may seed per chunk for
reproducible runs; ``deterministic=True`` on the module: the mode); ``forward_inputs`` keeps the
raw ``states``, the images and, for Box, the pre-squash sample ``raw_action``, so ``evaluate``
re-scores exactly what was executed (an action replaced by an intervention is scored through
``atanh`` instead).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from zchannel.embodied.normalize import ObsNormalizer
from zchannel.embodied.spaces import EnvSpec
from zchannel.embodied.types import PolicyOutput

LOG_2PI = math.log(2 * math.pi)
MASKED = -1e9  # logit of a class an action number does not have (MultiDiscrete padding)


def layer(inputs: int, outputs: int, gain: float = math.sqrt(2)) -> nn.Linear:
    """A linear layer with orthogonal weights of ``gain`` and zero bias (CleanRL's init)."""
    lin = nn.Linear(inputs, outputs)
    nn.init.orthogonal_(lin.weight, gain)
    nn.init.zeros_(lin.bias)
    return lin


def mlp(inputs: int, hidden: int, layers: int, outputs: int, out_gain: float) -> nn.Sequential:
    mods: list[nn.Module] = []
    width = inputs
    for _ in range(layers):
        mods += [layer(width, hidden), nn.Tanh()]
        width = hidden
    mods.append(layer(width, outputs, out_gain))
    return nn.Sequential(*mods)


class ImageEncoder(nn.Module):
    """uint8 ``[B, H, W, C]`` (or ``[B, n, H, W, C]``: views share the weights) → ``[B, n·out]``."""

    def __init__(self, shape: tuple[int, ...], out: int = 128, channels: int = 32) -> None:
        super().__init__()
        self.views = shape[0] if len(shape) == 4 else 1
        c = shape[-1]
        self.conv = nn.Sequential(
            nn.Conv2d(c, channels // 2, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(channels // 2, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        )
        self.fc = nn.Sequential(layer(channels * 16, out), nn.ReLU())
        self.out_dim = out * self.views

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        batch = images.shape[0]
        x = images.reshape(-1, *images.shape[-3:]).permute(0, 3, 1, 2).float() / 255.0
        return self.fc(self.conv(x)).reshape(batch, -1)


class ActorCritic(nn.Module):
    """The ``Policy`` for any ``EnvSpec`` (see the module docstring)."""

    def __init__(self, spec: EnvSpec, num_action_chunks: int = 1, *, hidden: int = 64,
                 layers: int = 2, squash: str = "tanh", init_log_std: float = 0.0,
                 normalize_obs: bool = False, image_features: int = 128) -> None:
        super().__init__()
        if squash not in ("tanh", "clip"):
            raise ValueError(f"squash must be 'tanh' or 'clip', got {squash!r}")
        self.spec, self.squash = spec, squash
        self.num_action_chunks, self.action_dim = num_action_chunks, spec.action.dim
        self.deterministic = False
        self.generator = torch.Generator()
        self.normalizer = ObsNormalizer(spec.state_dim) if normalize_obs and spec.state_dim \
            else None
        self.images = nn.ModuleDict({k: ImageEncoder(shape, image_features)
                                     for k, shape in spec.images.items()})
        features = spec.state_dim + sum(e.out_dim for e in self.images.values())
        if features == 0:
            raise ValueError("the env spec has neither states nor images")
        action = spec.action
        self.classes = max(action.nvec) if action.discrete else 0
        width = num_action_chunks * action.dim * (self.classes or 1)
        self.actor = mlp(features, hidden, layers, width, 0.01)
        self.critic = mlp(features, hidden, layers, 1, 1.0)
        if action.discrete:
            nvec = torch.tensor(action.nvec)
            mask = torch.arange(self.classes).expand(action.dim, -1) >= nvec[:, None]
            self.register_buffer("logit_mask", mask.float() * MASKED, persistent=False)
        else:
            self.log_std = nn.Parameter(torch.full((width,), float(init_log_std)))

    # -- encoding ---------------------------------------------------------------------------

    def inputs(self, obs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The observation entries the model reads (kept as ``forward_inputs``)."""
        out = {}
        if self.spec.state_dim:
            out["states"] = torch.as_tensor(obs["states"], dtype=torch.float32)
        for key in self.spec.images:
            out[key] = torch.as_tensor(obs[key])
        return out

    def features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = []
        if self.spec.state_dim:
            states = inputs["states"]
            parts.append(self.normalizer(states) if self.normalizer is not None else states)
        parts += [enc(inputs[key]) for key, enc in self.images.items()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    @torch.no_grad()
    def update_normalization(self, forward_inputs: dict[str, torch.Tensor]) -> None:
        """Fold a training batch's ``states`` into the observation statistics (the actor calls
        this once per training step, after the update)."""
        if self.normalizer is not None:
            self.normalizer.update(forward_inputs["states"].reshape(-1, self.spec.state_dim))

    # -- distributions ----------------------------------------------------------------------

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        out = self.actor(features).reshape(features.shape[0], -1, self.action_dim, self.classes)
        return F.log_softmax(out + self.logit_mask, dim=-1)  # [B, C, A, K]

    def _gaussian_logp(self, mean: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        log_std = self.log_std.expand_as(mean)
        logp = -0.5 * ((u - mean) * (-log_std).exp()).pow(2) - log_std - 0.5 * LOG_2PI
        if self.squash == "tanh":  # log |d tanh(u) / du| = 2 (log 2 − u − softplus(−2u))
            logp = logp - 2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))
        return logp

    @torch.no_grad()
    def forward(self, obs: dict[str, Any]) -> PolicyOutput:  # type: ignore[override]
        inputs = self.inputs(obs)
        feats = self.features(inputs)
        batch = feats.shape[0]
        if self.spec.action.discrete:
            logp_all = self._logits(feats)
            if self.deterministic:
                index = logp_all.argmax(-1)
            else:
                gumbel = -torch.empty_like(logp_all).exponential_(generator=self.generator).log()
                index = (logp_all + gumbel).argmax(-1)
            logp = logp_all.gather(-1, index.unsqueeze(-1)).reshape(batch, -1)
            action = index.reshape(batch, -1).float()
        else:
            mean = self.actor(feats)
            noise = torch.randn(mean.shape, generator=self.generator)
            u = mean if self.deterministic else mean + self.log_std.exp() * noise
            logp = self._gaussian_logp(mean, u)
            action = torch.tanh(u) if self.squash == "tanh" else u
            inputs["raw_action"] = u
        inputs["action"] = action
        return PolicyOutput(forward_inputs=inputs, prev_logprobs=logp,
                            prev_values=self.critic(feats))

    def evaluate(self, forward_inputs: dict[str, Any], actions: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor
    ]:
        """``(logprobs [N, C·A], values [N, 1], entropy [N])`` of ``actions`` with gradients."""
        feats = self.features(forward_inputs)
        n = feats.shape[0]
        value = self.critic(feats)
        if self.spec.action.discrete:
            logp_all = self._logits(feats)
            index = actions.reshape(n, -1, self.action_dim).round().long().unsqueeze(-1)
            logp = logp_all.gather(-1, index).reshape(n, -1)
            entropy = -(logp_all.exp() * logp_all).sum(-1).reshape(n, -1).sum(-1)
            return logp, value, entropy
        mean = self.actor(feats)
        actions = actions.reshape(mean.shape)
        if self.squash == "tanh":
            u = torch.atanh(actions.clamp(-1 + 1e-6, 1 - 1e-6))
            raw = forward_inputs.get("raw_action")
            if raw is not None:  # the exact sample, unless an intervention replaced the action
                raw = raw.reshape(mean.shape)
                u = torch.where((torch.tanh(raw) - actions).abs() < 1e-6, raw, u)
        else:
            u = actions
        logp = self._gaussian_logp(mean, u)
        entropy = (self.log_std + 0.5 * (1.0 + LOG_2PI)).sum().expand(n)
        return logp, value, entropy


__all__ = ["ActorCritic", "ImageEncoder", "layer", "mlp"]
