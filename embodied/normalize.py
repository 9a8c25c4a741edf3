"""Running mean / variance normalisation of observations and rewards (options of a run).

- ``ObsNormalizer`` is part of a policy (``nn.Module`` buffers ``mean``, ``var``, ``count``, so
  the statistics travel with the weights and a trained policy carries them): ``forward`` maps
  ``states`` to ``clip((x − mean) / sqrt(var + eps), ±clip)``; ``update(states)`` folds a batch
  in (the actor calls it once per training step, after the update, on the step's rows, so the
  rollout acts with the statistics the actor trained with).
- ``RewardScaler`` lives in an env worker (Gymnasium's ``NormalizeReward``): each reward is
  divided by the standard deviation of a running discounted return, and clipped.  Episode
  returns are recorded before scaling.

Both use the parallel-variance update (Chan et al.) that Gymnasium's ``RunningMeanStd`` uses.
"""

from __future__ import annotations

import torch
from torch import nn


def _merge(mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor, batch: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The statistics of the data seen so far plus ``batch`` (rows on dim 0)."""
    batch = batch.reshape(-1, *mean.shape).to(torch.float64)
    n = batch.shape[0]
    b_mean, b_var = batch.mean(0), batch.var(0, unbiased=False)
    delta = b_mean - mean
    total = count + n
    new_mean = mean + delta * n / total
    m2 = var * count + b_var * n + delta.pow(2) * count * n / total
    return new_mean, m2 / total, total


class ObsNormalizer(nn.Module):
    """Normalises ``states`` ``[..., dim]`` with running statistics (see the module doc)."""

    def __init__(self, dim: int, *, clip: float = 10.0, eps: float = 1e-8) -> None:
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(dim, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        scale = (self.var + self.eps).rsqrt().to(states.dtype)
        return ((states - self.mean.to(states.dtype)) * scale).clamp(-self.clip, self.clip)

    @torch.no_grad()
    def update(self, states: torch.Tensor) -> None:
        mean, var, count = _merge(self.mean, self.var, self.count, states)
        self.mean.copy_(mean)
        self.var.copy_(var)
        self.count.copy_(count)


class RewardScaler:
    """Scales ``[B]`` rewards by the running std of each env's discounted return."""

    def __init__(self, num_envs: int, gamma: float, *, clip: float = 10.0,
                 eps: float = 1e-8) -> None:
        self.gamma, self.clip, self.eps = gamma, clip, eps
        self.returns = torch.zeros(num_envs, dtype=torch.float64)
        self.mean = torch.zeros((), dtype=torch.float64)
        self.var = torch.ones((), dtype=torch.float64)
        self.count = torch.tensor(1e-4, dtype=torch.float64)

    def __call__(self, reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        self.returns = self.returns * self.gamma + reward.to(torch.float64)
        self.mean, self.var, self.count = _merge(self.mean, self.var, self.count, self.returns)
        self.returns[done] = 0.0
        scaled = reward / float((self.var + self.eps).sqrt())
        return scaled.clamp(-self.clip, self.clip).to(torch.float32)


__all__ = ["ObsNormalizer", "RewardScaler"]
