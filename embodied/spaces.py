"""What an env's observations and actions look like on the wire: ``EnvSpec``, ``ActionSpec``.

Env workers, rollouts and policies agree on one description of an env (``EnvSpec``), built by
the env (``GymVectorEnv.spec`` from the Gymnasium spaces, ``PointReach.spec``) and passed to the
policy constructors (``zchannel.embodied.models``):

- observations are a flat dict of batch-first tensors: ``states`` float32 ``[B, S]`` (every
  non-image leaf, flattened and concatenated in key order) and named uint8 images that keep
  their shape: ``main_images`` ``[B, H, W, C]``, ``wrist_images`` ``[B, H, W, C]`` (or
  ``[B, n, H, W, C]`` for several wrist cameras), ``extra_view_images`` ``[B, n, H, W, C]``, or
  any key a user's ``obs_map`` names (``docs/embodied.md``, "Spaces");
- actions travel as float32 ``[B, C·A]`` chunks of ``A = ActionSpec.dim`` numbers per step:
  Box values (the policy's [-1, 1] range, mapped onto the Box bounds by the env), or class
  indices (Discrete, MultiDiscrete: one index per sub-space; MultiBinary: 0/1 per bit), which
  float32 holds exactly: an index may have at most ``MAX_ACTION_CLASSES`` (2**24) classes,
  float32's last run of exact whole numbers (``ActionSpec`` refuses more).

``check_observation`` checks a batch against the spec; a wrong dtype or shape is an
``ObservationError`` naming the key.  ``ChunkedEnv`` raises ``RewardError`` for a non-finite
reward and ``ObservationError`` for a non-finite observation value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

FINAL_OBS = "final_observation"  # info key: the observation finished envs ended in
FINAL_MASK = "_final_observation"  # info key: which rows of FINAL_OBS are set
ACTION_KINDS = ("box", "discrete", "multi_discrete", "multi_binary")
# the most classes of one action index: float32 chunks hold every whole number up to 2**24
# exactly (2**24 + 1 is already rounded to 2**24)
MAX_ACTION_CLASSES = 2**24
IMAGE_KEYS = ("main_images", "wrist_images", "extra_view_images")
# the info keys a recorded step keeps (lerobot mode): success, expert intervention, recording
RECORDED_INFO_KEYS = ("success", "success_once", "success_at_end", "intervene_action",
                      "intervene_flag", "record_reset", "pre_record", "segment_advance")


class ObservationError(ValueError):
    """An observation does not match the env's ``EnvSpec`` (the message names the key)."""


class RewardError(ValueError):
    """An env returned a non-finite reward (NaN, inf); the message names the env, the sub-env
    and the step."""


@dataclass(frozen=True)
class ActionSpec:
    """One env step's action: ``dim`` numbers of ``kind``.

    - ``box``: ``dim`` floats; ``low``/``high`` are the Box bounds (the env maps the policy's
      [-1, 1] onto them; infinite bounds pass the value through).
    - ``discrete``: one index in ``[0, nvec[0])`` (``start`` is added by the env).
    - ``multi_discrete``: ``dim`` indices, index ``i`` in ``[0, nvec[i])``.
    - ``multi_binary``: ``dim`` bits (``nvec`` is all 2s).

    A class count above ``MAX_ACTION_CLASSES`` is a ``ValueError``: float32 action chunks could
    not hold its indices exactly.
    """

    kind: str
    dim: int
    nvec: tuple[int, ...] = ()
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()
    start: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"ActionSpec.kind must be one of {ACTION_KINDS}, got {self.kind!r}")
        if self.dim < 1:
            raise ValueError(f"ActionSpec.dim must be >= 1, got {self.dim}")
        if self.kind != "box" and (len(self.nvec) != self.dim or min(self.nvec) < 1):
            raise ValueError(f"ActionSpec {self.kind}: nvec {self.nvec} must give the class "
                             f"count of each of the {self.dim} action numbers")
        if self.kind != "box" and max(self.nvec) > MAX_ACTION_CLASSES:
            raise ValueError(f"ActionSpec {self.kind}: {max(self.nvec)} classes in one action "
                             f"index, more than the {MAX_ACTION_CLASSES} (2**24) whose indices "
                             "float32 action chunks hold exactly")

    @property
    def discrete(self) -> bool:
        return self.kind != "box"


@dataclass(frozen=True)
class EnvSpec:
    """The observation layout and the action of one env (per env: no batch dim)."""

    state_dim: int
    action: ActionSpec
    images: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """image key -> per-env shape, ``(H, W, C)`` or ``(n, H, W, C)``; dtype uint8"""

    @property
    def action_dim(self) -> int:
        return self.action.dim

    def to_dict(self) -> dict[str, Any]:
        a = self.action
        return {"state_dim": self.state_dim, "images": {k: list(v) for k, v in self.images.items()},
                "action": {"kind": a.kind, "dim": a.dim, "nvec": list(a.nvec),
                           "low": list(a.low), "high": list(a.high), "start": list(a.start)}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EnvSpec:
        a = data["action"]
        action = ActionSpec(a["kind"], a["dim"], tuple(a["nvec"]), tuple(a["low"]),
                            tuple(a["high"]), tuple(a["start"]))
        return cls(data["state_dim"], action,
                   {k: tuple(v) for k, v in data["images"].items()})


def box_spec(state_dim: int, action_dim: int) -> EnvSpec:
    """A state-only env with a [-1, 1] Box action (PointReach)."""
    return EnvSpec(state_dim, ActionSpec("box", action_dim, low=(-1.0,) * action_dim,
                                         high=(1.0,) * action_dim))


def check_observation(obs: dict[str, Any], spec: EnvSpec, batch: int) -> None:
    """Raise ``ObservationError`` naming the key when ``obs`` does not match ``spec``: each
    image uint8 ``[batch, *shape]``, ``states`` float32 ``[batch, state_dim]``."""
    for key, shape in spec.images.items():
        value = obs.get(key)
        if value is None:
            raise ObservationError(f"observation {key!r} is missing (expected uint8 "
                                   f"{[batch, *shape]})")
        dtype = getattr(value, "dtype", type(value).__name__)
        if dtype not in (torch.uint8, np.uint8) or tuple(value.shape) != (batch, *shape):
            raise ObservationError(
                f"observation {key!r}: expected uint8 {[batch, *shape]}, got {dtype} "
                f"{list(getattr(value, 'shape', ()))}")
    if spec.state_dim:
        states = obs.get("states")
        if not isinstance(states, torch.Tensor) or states.dtype != torch.float32 or \
                tuple(states.shape) != (batch, spec.state_dim):
            got = (f"{states.dtype} {list(states.shape)}" if isinstance(states, torch.Tensor)
                   else type(states).__name__)
            raise ObservationError(f"observation 'states': expected float32 "
                                   f"{[batch, spec.state_dim]}, got {got}")


__all__ = ["ACTION_KINDS", "FINAL_MASK", "FINAL_OBS", "IMAGE_KEYS", "MAX_ACTION_CLASSES",
           "RECORDED_INFO_KEYS",
           "ActionSpec", "EnvSpec", "ObservationError", "RewardError", "box_spec",
           "check_observation"]
