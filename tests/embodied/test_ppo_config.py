"""``PPOConfig`` checks its fields when it is made (``ValueError`` naming the field), as
``RunConfig`` and ``TrajectoryPlan`` do: ``minibatches=0`` was a ``ZeroDivisionError`` and
``lr=nan`` a NaN loss inside the actors, after every worker had started."""

from __future__ import annotations

import math

import numpy as np
import pytest
from zchannel.embodied.ppo import PPOConfig
from zchannel.embodied.presets import PRESETS


@pytest.mark.parametrize(("field", "value"), [
    ("minibatches", 0), ("minibatches", 2.0), ("minibatches", True), ("epochs", 0),
    ("epochs", -1), ("lr", math.nan), ("lr", 0.0), ("lr", -1e-3), ("lr", math.inf), ("lr", "1e-3"),
    ("clip", 0.0), ("clip", math.nan), ("value_coef", -1.0), ("entropy_coef", math.nan),
    ("adam_eps", -1e-8), ("max_grad_norm", 0.0), ("max_grad_norm", math.nan),
    ("target_kl", 0.0), ("target_kl", math.nan), ("anneal_lr", 1), ("clip_vloss", "yes"),
    ("minibatch_adv_norm", None),
])
def test_a_bad_field_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"^PPOConfig\.{field} must be .*, got "):
        PPOConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"^PPOConfig\.{field} "):
        PPOConfig.cleanrl(**{field: value})


def test_the_defaults_presets_and_edge_values_are_accepted():
    PPOConfig()
    PPOConfig.cleanrl()
    assert all(isinstance(cfg.ppo, PPOConfig) for cfg in PRESETS.values())
    PPOConfig(lr=np.float32(1e-3), epochs=np.int64(2), entropy_coef=0, max_grad_norm=math.inf,
              adam_eps=0.0, target_kl=0.01)
