"""The rollout side's model contract: the ``Policy`` protocol and a small Gaussian MLP policy.

A ``Policy`` is a ``torch.nn.Module`` whose ``forward(obs)`` returns a ``PolicyOutput``:
``forward_inputs`` holds what training needs to re-run the model (here ``states``) and the
sampled flattened chunk ``action`` ``[B, C·A]``; ``prev_logprobs`` ``[B, C·A]``; ``prev_values``
``[B, 1]`` (chunk-level value, or None without a value head).  The rollout stamps ``versions``
(the weight version that produced the output, float32 with the shape of ``prev_logprobs``).
``evaluate(forward_inputs, actions)`` gives ``(logprobs [.., D], values [.., 1], entropy [..])``
with gradients, for the actor's loss.  ``actions(output)`` returns the chunk ``[B, C, A]`` the
env executes.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from zchannel.embodied.spaces import ActionSpec
from zchannel.embodied.types import PolicyOutput


@runtime_checkable
class Policy(Protocol):
    """What the rollout and the actor call on a model."""

    num_action_chunks: int
    action_dim: int

    def forward(self, obs: dict[str, Any]) -> PolicyOutput:
        ...

    def evaluate(self, forward_inputs: dict[str, Any], actions: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor | None, torch.Tensor
    ]:
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> Any:
        ...


def chunk_actions(output: PolicyOutput, num_action_chunks: int) -> torch.Tensor:
    """The executed action chunk ``[B, C, A]`` of an output (its ``forward_inputs["action"]``)."""
    action = output.forward_inputs.get("action")
    if action is None:
        raise ValueError("PolicyOutput.forward_inputs has no 'action' to execute")
    return action.reshape(action.shape[0], num_action_chunks, -1)


def stamp_version(output: PolicyOutput, version: int) -> PolicyOutput:
    """Set ``output.versions`` to ``version`` (float32, the shape of ``prev_logprobs``)."""
    like = output.prev_logprobs
    if like is None:
        like = output.forward_inputs["action"]
    output.versions = torch.full(like.shape, float(version), dtype=torch.float32)
    return output


class MLPPolicy(nn.Module):
    """A tanh MLP with a diagonal Gaussian over the flattened chunk and a value head; ``forward``
    samples from ``generator`` (a ``torch.Generator``: the runners seed it, and a reproducible
    run re-seeds it per chunk), never from the global RNG."""

    def __init__(self, state_dim: int, action_dim: int, num_action_chunks: int, *,
                 hidden: int = 64, init_log_std: float = -0.5) -> None:
        super().__init__()
        self.state_dim, self.action_dim = state_dim, action_dim
        self.num_action_chunks = num_action_chunks
        out = action_dim * num_action_chunks
        self.body = nn.Sequential(nn.Linear(state_dim, hidden), nn.Tanh(),
                                  nn.Linear(hidden, hidden), nn.Tanh())
        self.mean = nn.Linear(hidden, out)
        self.value = nn.Sequential(nn.Linear(state_dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.log_std = nn.Parameter(torch.full((out,), init_log_std))
        nn.init.orthogonal_(self.mean.weight, 0.01)
        nn.init.zeros_(self.mean.bias)
        self.generator = torch.Generator()

    def _dist(self, states: torch.Tensor) -> torch.distributions.Normal:
        mean = self.mean(self.body(states))
        return torch.distributions.Normal(mean, self.log_std.exp().expand_as(mean))

    @torch.no_grad()
    def forward(self, obs: dict[str, Any]) -> PolicyOutput:
        states = torch.as_tensor(obs["states"], dtype=torch.float32)
        dist = self._dist(states)
        action = dist.loc + dist.scale * torch.randn(dist.loc.shape, generator=self.generator)
        return PolicyOutput(
            forward_inputs={"states": states, "action": action},
            prev_logprobs=dist.log_prob(action),
            prev_values=self.value(states),
        )

    def evaluate(self, forward_inputs: dict[str, Any], actions: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor
    ]:
        states = forward_inputs["states"]
        dist = self._dist(states)
        return dist.log_prob(actions), self.value(states), dist.entropy().sum(-1)


class RandomPolicy(nn.Module):
    """Uniform actions: in [-1, 1] for Box actions, uniform class indices for the discrete kinds
    of ``action`` (an ``ActionSpec``): the baseline the demo compares against."""

    def __init__(self, action_dim: int, num_action_chunks: int, seed: int = 0,
                 action: ActionSpec | None = None) -> None:
        super().__init__()
        self.action_dim, self.num_action_chunks = action_dim, num_action_chunks
        self.nvec = torch.tensor(action.nvec, dtype=torch.float32) \
            if action is not None and action.discrete else None
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def forward(self, obs: dict[str, Any]) -> PolicyOutput:
        batch = next(v for v in obs.values() if isinstance(v, torch.Tensor)).shape[0]
        d = self.action_dim * self.num_action_chunks
        action = torch.rand(batch, d, generator=self.generator)
        if self.nvec is None:
            action = action * 2 - 1
        else:
            action = (action.reshape(batch, -1, self.action_dim) * self.nvec).floor()
            action = action.reshape(batch, d)
        return PolicyOutput(forward_inputs={"action": action},
                            prev_logprobs=torch.zeros(batch, d))

    def evaluate(self, forward_inputs: dict[str, Any], actions: torch.Tensor) -> tuple[
        torch.Tensor, None, torch.Tensor
    ]:
        raise NotImplementedError("a random policy is not trained")


__all__ = ["MLPPolicy", "Policy", "RandomPolicy", "chunk_actions", "stamp_version"]
