"""The Gymnasium adapter: any Gymnasium vector env as a ``VectorEnv`` (optional extra ``gym``).

``make_gym_env("CartPole-v1", 4, env_kwargs={...})`` builds ``gymnasium.make_vec(id, num_envs,
vectorization_mode="sync", **env_kwargs)`` with an observation check on every sub-env and wraps
it in ``GymVectorEnv``, which

- describes the env once (``spec``, an ``EnvSpec``) and refuses, at construction, a space it
  cannot carry, naming it (Text, Graph, Sequence, OneOf; Dict/Tuple action spaces; non-numeric
  Box dtypes; a Discrete / MultiDiscrete action index of more than ``MAX_ACTION_CLASSES``
  classes, which float32 chunks would round; a Discrete / MultiDiscrete observation leaf of
  more than ``MAX_ONE_HOT_WIDTH`` one-hot columns);
- checks every sub-env's observation against its space (``ObservationCheck``: each Dict a
  mapping of exactly its keys, each Tuple a tuple or list of its length, as Gymnasium's
  ``contains`` accepts, each leaf of its dtype and shape; an ``ObservationError`` naming the
  leaf otherwise);
- turns each batched observation into the flat dict of ``zchannel.embodied.spaces``: uint8
  images (3-D uint8 Box leaves, H x W x C) keep their shape under ``main_images`` /
  ``wrist_images`` / ``extra_view_images`` (or the keys ``obs_map`` names), every other leaf
  (Box, Discrete and MultiDiscrete as one-hot, MultiBinary), and an image ``obs_map`` sends to
  ``states``, is flattened into float32 ``states`` (a finite value beyond float32's range is
  an ``ObservationError`` naming the leaf and the value);
- refuses, at construction, a 3-D uint8 Box that looks channel-first (``_looks_channel_first``:
  C x H x W, or a stack of k H x W frames) unless ``obs_map`` sends it to ``states`` or drops it,
  with a ``ValueError`` naming the leaf, its shape and the remedies;
- reads ``info["success"]`` only when its values are bools or numbers (``_info_flags``: any other
  value, such as the string ``"no"``, is a ``ValueError`` naming the key and the dtype);
- turns action chunks back into the action space (Box: [-1, 1] onto the bounds, for an
  integer Box cut into one equal-width bin per integer of the bounds; Discrete, MultiDiscrete,
  MultiBinary: integer indices of the right shape and dtype), and an env's
  ``info["intervene_action"]`` (the action it executed, in its action space) back into the
  policy's (``from_space``), so training and recording see what the policy would have emitted;
- refuses a non-finite action (NaN, inf) with a ``ValueError`` naming the policy output and the
  env rows, instead of handing it to the env (``np.clip`` would pass NaN through);
- gives same-step auto-reset in each of Gymnasium's autoreset modes (the vector env's
  ``metadata["autoreset_mode"]``, set by ``env_kwargs={"vector_kwargs": {"autoreset_mode":
  ...}}``): ``info["final_observation"]`` holds the observation a finished env ended in and the
  returned observation is the reset one.  ``NextStep`` (Gymnasium's default) and ``Disabled``:
  the finished sub-envs are reset at once with Gymnasium's ``reset_mask``; ``SameStep``:
  Gymnasium already reset them, the final observation comes from its ``info["final_obs"]`` and
  the step's ``success`` from its ``info["final_info"]``.  Any other mode is a ``ValueError``.

Ids: ``"CartPole-v1"``; ``"module:EnvId"`` imports ``module`` first (Gymnasium's form:
``"gym_pusht:gym_pusht/PushT-v0"``); a namespaced ``"ns/Name-v0"`` whose namespace is not
registered imports the module ``ns`` (``"gym_pusht/PushT-v0"``), as Gymnasium's namespace
packages register on import.  An id that still cannot be found is a ``ValueError`` naming the
forms that work.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from zchannel.embodied.spaces import (
    FINAL_MASK,
    FINAL_OBS,
    MAX_ACTION_CLASSES,
    RECORDED_INFO_KEYS,
    ActionSpec,
    EnvSpec,
    ObservationError,
)

try:  # the optional extra: this module only works with it, the package imports without it
    import gymnasium
    from gymnasium import spaces as gs
    from gymnasium.envs.registration import find_highest_version, parse_env_id
    from gymnasium.vector.utils import concatenate, create_empty_array, iterate
except ImportError:  # pragma: no cover - exercised only without the extra
    gymnasium = None  # type: ignore[assignment]  # without the extra: checked before use
    gs = None  # type: ignore[assignment]  # without the extra: checked before use
    concatenate = create_empty_array = iterate = None  # type: ignore[assignment]  # same
    find_highest_version = parse_env_id = None  # type: ignore[assignment]  # same

MAX_DEPTH = 8  # nesting of Dict / Tuple observation spaces
# the widest one-hot encoding of one Discrete / MultiDiscrete observation leaf, in columns of
# states (MultiDiscrete: the sum of its nvec): 256 KiB of float32 per env and step
MAX_ONE_HOT_WIDTH = 2**16
FLOAT32_MAX = float(np.finfo(np.float32).max)
# Gymnasium's autoreset modes (the values of gymnasium.vector.AutoresetMode, Gymnasium >= 1.1)
NEXT_STEP, SAME_STEP, DISABLED = "NextStep", "SameStep", "Disabled"
_WRAPPER_BASE: Any = gymnasium.Wrapper if gymnasium is not None else object


def _need_gymnasium() -> None:
    if gymnasium is None:
        raise RuntimeError("gym: environments need gymnasium; install the extra: "
                           "pip install 'zchannel[gym]'")


@dataclass(frozen=True)
class _Leaf:
    path: tuple[str, ...]  # keys / tuple indexes from the observation's root
    space: Any
    image: bool

    @property
    def name(self) -> str:
        return "/".join(self.path) or "<observation>"


IMAGE_CHANNELS = (1, 3, 4)  # the channel counts of an H x W x C image: gray, RGB, RGBA


def _is_uint8_3d(space: Any) -> bool:
    return isinstance(space, gs.Box) and space.dtype == np.uint8 and len(space.shape) == 3


def _looks_channel_first(space: Any) -> bool:
    """A 3-D uint8 Box whose last dimension is not a channel count (1, 3, 4) while its first is
    smaller than the other two: C x H x W, or a stack of k H x W frames (Gymnasium's
    ``FrameStackObservation`` over grayscale frames gives (k, H, W))."""
    if not _is_uint8_3d(space):
        return False
    first, middle, last = space.shape
    return last not in IMAGE_CHANNELS and first < min(middle, last)


def _is_image(space: Any) -> bool:
    """A 3-D uint8 Box taken as an H x W x C image (not one that looks channel-first)."""
    return _is_uint8_3d(space) and not _looks_channel_first(space)


def _channel_first_error(leaf: _Leaf) -> ValueError:
    shape = tuple(leaf.space.shape)
    return ValueError(
        f"observation leaf {leaf.name!r} is a uint8 Box of shape {shape}, which looks "
        f"channel-first (C x H x W, or a stack of {shape[0]} frames of {shape[1]} x {shape[2]});"
        " zchannel takes 3-D uint8 observations as H x W x C images (channels last) and will "
        "not guess: wrap the env so the channels come last (e.g. "
        "gymnasium.wrappers.TransformObservation(env, lambda obs: np.moveaxis(obs, 0, -1), "
        "<the Box with the channels last>) in a module that registers it, named "
        "gym:<module>:<EnvId>), or set obs_map "
        f"{{{leaf.name!r}: 'states'}} to carry it as flat float32 states, or "
        f"{{{leaf.name!r}: None}} to drop it (docs/embodied-envs.md)")


def _leaves(space: Any, path: tuple[str, ...] = ()) -> list[_Leaf]:
    """The observation's leaves in key order; refuses what cannot be carried, naming it."""
    where = "/".join(path) or "the observation"
    if len(path) > MAX_DEPTH:
        raise ValueError(f"observation space nested deeper than {MAX_DEPTH} at {where!r}")
    if isinstance(space, gs.Dict):
        return [leaf for key, sub in space.spaces.items() for leaf in _leaves(sub, (*path, key))]
    if isinstance(space, gs.Tuple):
        return [leaf for i, sub in enumerate(space.spaces) for leaf in _leaves(sub, (*path, str(i)))]
    if isinstance(space, gs.Box):
        if not (np.issubdtype(space.dtype, np.number) or space.dtype == np.bool_):
            raise ValueError(f"observation space {space} at {where!r}: a Box of dtype "
                             f"{space.dtype} cannot be carried (numeric dtypes only)")
        return [_Leaf(path, space, _is_image(space))]
    if isinstance(space, (gs.Discrete, gs.MultiDiscrete, gs.MultiBinary)):
        return [_Leaf(path, space, False)]
    raise ValueError(f"observation space {space} at {where!r} cannot be carried: zchannel "
                     "carries Box, Discrete, MultiDiscrete and MultiBinary leaves in Dict / "
                     f"Tuple spaces, not {type(space).__name__}")


def _state_width(space: Any) -> int:
    if isinstance(space, gs.Discrete):
        return int(space.n)
    if isinstance(space, gs.MultiDiscrete):
        return int(np.sum(space.nvec))
    return int(np.prod(space.shape))


def _check_one_hot_widths(leaves: list[_Leaf]) -> None:
    """``ValueError`` naming the first Discrete / MultiDiscrete leaf of ``leaves`` whose one-hot
    encoding would be wider than ``MAX_ONE_HOT_WIDTH`` columns of ``states``."""
    for leaf in leaves:
        if not isinstance(leaf.space, (gs.Discrete, gs.MultiDiscrete)):
            continue
        width = _state_width(leaf.space)
        if width > MAX_ONE_HOT_WIDTH:
            drop = f" or drop the leaf with obs_map {{{leaf.name!r}: None}}" if leaf.path else ""
            raise ValueError(
                f"observation leaf {leaf.name!r} is {leaf.space}: its one-hot encoding would be "
                f"{width} float32 columns of states per env, more than the {MAX_ONE_HOT_WIDTH} "
                "zchannel encodes; carry the index as a number (wrap the env so the leaf is a "
                f"Box){drop} (docs/embodied-envs.md)")


def _one_hot(space: Any, value: np.ndarray, batch: int) -> np.ndarray:
    """The indices of a Discrete / MultiDiscrete leaf of a batch as float32 one-hot ``[batch,
    width]``: one block of ``n`` columns per (sub-)space, set by index into zeros."""
    if isinstance(space, gs.Discrete):
        nvec = np.array([int(space.n)], dtype=np.int64)
        index = value.reshape(batch, 1) - int(space.start)
    else:
        nvec = space.nvec.reshape(-1).astype(np.int64)
        index = (value - space.start).reshape(batch, -1)
    offsets = np.concatenate(([0], np.cumsum(nvec)[:-1]))
    out = np.zeros((batch, int(nvec.sum())), dtype=np.float32)
    out[np.arange(batch)[:, None], offsets + index] = 1.0
    return out


def _as_float32(leaf: _Leaf, columns: np.ndarray) -> np.ndarray:
    """``columns`` (``[batch, width]``) as float32; ``ObservationError`` naming the leaf, the
    sub-env and the value when a finite value is beyond float32's range (the cast would make it
    inf)."""
    if columns.dtype.kind != "f" or columns.dtype.itemsize <= 4:
        return columns.astype(np.float32, copy=False)
    with np.errstate(over="ignore"):
        states = columns.astype(np.float32)
    beyond = np.isinf(states) & np.isfinite(columns)
    if beyond.any():
        row, column = (int(i) for i in np.argwhere(beyond)[0])
        raise ObservationError(
            f"observation {leaf.name!r}: sub-env {row} returned the value "
            f"{float(columns[row, column])!r} (entry {column} of the leaf), beyond the range of "
            f"float32 (+-{FLOAT32_MAX:.8g}) that states are carried in; scale the observation "
            "into it (a wrapper) or drop the leaf with obs_map (sub-envs beyond it: "
            f"{np.flatnonzero(beyond.any(axis=1)).tolist()})")
    return states


def _state_columns(leaf: _Leaf, value: Any, batch: int) -> np.ndarray:
    """One state leaf of a batch as float32 ``[batch, width]`` (indices one-hot)."""
    value = np.asarray(value)
    if isinstance(leaf.space, (gs.Discrete, gs.MultiDiscrete)):
        return _one_hot(leaf.space, value, batch)
    return _as_float32(leaf, value.reshape(batch, -1))


def _image_groups(leaves: list[_Leaf], obs_map: dict[str, str | None]) -> dict[str, list[_Leaf]]:
    """Output key -> the image leaves stacked under it (the documented default naming, or
    ``obs_map``)."""
    groups: dict[str, list[_Leaf]] = {}
    default_main = None
    for leaf in leaves:
        if not leaf.image:
            continue
        if leaf.name in obs_map:
            key = obs_map[leaf.name]
            if key is None or key == "states":  # dropped, or flattened into the states
                continue
        elif "wrist" in leaf.name.lower():
            key = "wrist_images"
        elif default_main is None:
            key = default_main = "main_images"
        else:
            key = "extra_view_images"
        groups.setdefault(key, []).append(leaf)
    for key, group in groups.items():
        shapes = {tuple(leaf.space.shape) for leaf in group}
        if len(shapes) > 1:
            raise ValueError(f"images {[leaf.name for leaf in group]} go to {key!r} but have "
                             f"different shapes {sorted(shapes)}; name each with obs_map")
    return groups


def _described(value: Any) -> str:
    """What ``value`` is, for an error: its type, and its keys, length or dtype and shape."""
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with the keys {list(value)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype} {list(value.shape)}"
    return f"the {type(value).__name__} {repr(value)[:60]}"


def _check_dict(space: Any, value: Any, path: tuple[str, ...]) -> None:
    """``value`` is a mapping with exactly the keys of the Dict ``space`` (as Gymnasium's
    ``Dict.contains`` asks); ``ObservationError`` naming the dict, and a missing leaf, if not."""
    name = "/".join(path) or "<observation>"
    keys = list(space.spaces)
    if not isinstance(value, Mapping):
        raise ObservationError(f"observation {name!r}: expected a dict with the keys {keys}, "
                               f"got {_described(value)}")
    missing = [key for key in keys if key not in value]
    if missing:
        raise ObservationError(f"observation {'/'.join((*path, missing[0]))!r} is missing: "
                               f"the env's dict {name!r} has the keys {list(value)}, its "
                               f"space {keys}")
    extra = [key for key in value if key not in space.spaces]
    if extra:
        raise ObservationError(f"observation {name!r}: the keys {extra} are not in its space "
                               f"(keys {keys}); they would be dropped")


def _check_tuple(space: Any, value: Any, path: tuple[str, ...]) -> None:
    """``value`` is a tuple, list or array of as many entries as the Tuple ``space`` (what
    Gymnasium's ``Tuple.contains`` accepts); ``ObservationError`` naming it if not."""
    name = "/".join(path) or "<observation>"
    count = len(space.spaces)
    sequence = isinstance(value, (tuple, list)) or (isinstance(value, np.ndarray)
                                                     and value.ndim > 0)
    if not sequence or len(value) != count:
        raise ObservationError(f"observation {name!r}: expected a tuple (or list) of {count} "
                               f"entries, got {_described(value)}")


def _check_leaf(space: Any, value: Any, name: str) -> None:
    """A Box leaf has the space's dtype and shape, any other leaf is in its space
    (``ObservationError`` naming the leaf)."""
    value = np.asarray(value)
    if isinstance(space, gs.Box) and (value.dtype != space.dtype or value.shape != space.shape):
        raise ObservationError(f"observation {name!r}: expected {space.dtype} "
                               f"{list(space.shape)}, got {value.dtype} {list(value.shape)}")
    if not isinstance(space, gs.Box) and not space.contains(value):
        # an index outside the space would pick a wrong one-hot column (or none)
        raise ObservationError(f"observation {name!r}: {value.tolist()!r} is not in its space "
                               f"{space}")


def _check_value(space: Any, value: Any, path: tuple[str, ...] = ()) -> None:
    """``value`` fits ``space`` leaf by leaf: each Dict a mapping of its keys, each Tuple a
    tuple or list of its length, each leaf of its dtype and shape (``ObservationError`` naming
    the first leaf, or dict or tuple, that does not)."""
    if isinstance(space, gs.Dict):
        _check_dict(space, value, path)
        for key, sub in space.spaces.items():
            _check_value(sub, value[key], (*path, key))
    elif isinstance(space, gs.Tuple):
        _check_tuple(space, value, path)
        for i, sub in enumerate(space.spaces):
            _check_value(sub, value[i], (*path, str(i)))
    else:
        _check_leaf(space, value, "/".join(path) or "<observation>")


class ObservationCheck(_WRAPPER_BASE):
    """A sub-env wrapper: every observation must fit the observation space (``_check_value``:
    each Dict a mapping of its keys, each Tuple a tuple or list of its entries, each leaf of
    the space's dtype and shape; ``ObservationError`` naming the leaf, raised before the vector
    env batches it)."""

    def __init__(self, env: Any) -> None:
        super().__init__(env)
        self._space = env.observation_space
        _leaves(self._space)  # refuses, naming it, a space that cannot be carried

    def _check(self, obs: Any) -> Any:
        _check_value(self._space, obs, ())
        return obs

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        return self._check(obs), info

    def step(self, action: Any) -> Any:
        obs, *rest = self.env.step(action)
        return (self._check(obs), *rest)


def _action_spec(space: Any) -> ActionSpec:
    """The ``ActionSpec`` of a Gymnasium action space; ``ValueError`` naming a space that
    cannot be carried (an unknown kind, one with no action at all, or an index of more classes
    than float32 chunks hold exactly: ``MAX_ACTION_CLASSES``)."""
    if isinstance(space, (gs.Box, gs.MultiBinary, gs.MultiDiscrete)) and not np.prod(space.shape):
        raise ValueError(f"action space {space} has no action to take (shape {space.shape})")
    if isinstance(space, gs.Box):
        dim = int(np.prod(space.shape))
        return ActionSpec("box", dim, low=tuple(float(x) for x in space.low.reshape(-1)),
                          high=tuple(float(x) for x in space.high.reshape(-1)))
    if isinstance(space, (gs.Discrete, gs.MultiDiscrete)):
        nvec = (int(space.n),) if isinstance(space, gs.Discrete) else \
            tuple(int(n) for n in space.nvec.reshape(-1))
        if max(nvec) > MAX_ACTION_CLASSES:
            raise ValueError(f"action space {space} cannot be carried: an index of {max(nvec)} "
                             f"classes, more than the {MAX_ACTION_CLASSES} (2**24) whose indices "
                             "float32 action chunks hold exactly")
        kind = "discrete" if isinstance(space, gs.Discrete) else "multi_discrete"
        return ActionSpec(kind, len(nvec), nvec=nvec,
                          start=tuple(int(s) for s in np.asarray(space.start).reshape(-1)))
    if isinstance(space, gs.MultiBinary):
        dim = int(np.prod(space.shape))
        return ActionSpec("multi_binary", dim, nvec=(2,) * dim)
    raise ValueError(f"action space {space} cannot be carried: zchannel carries Box, Discrete, "
                     f"MultiDiscrete and MultiBinary actions, not {type(space).__name__}")


def _autoreset_mode(env: Any) -> str:
    """The vector env's autoreset mode as its string value (``NEXT_STEP`` when unset, as in
    Gymnasium 1.0); ``ValueError`` naming any other mode."""
    mode = getattr(env, "metadata", {}).get("autoreset_mode", NEXT_STEP)
    value = str(getattr(mode, "value", mode))
    if value not in (NEXT_STEP, SAME_STEP, DISABLED):
        raise ValueError(f"vector env {env}: metadata['autoreset_mode'] is {mode!r}, expected "
                         f"one of {[NEXT_STEP, SAME_STEP, DISABLED]}")
    return value


def _is_flag_value(value: Any) -> bool:
    """A bool or a real number (Python's or NumPy's), the values a flag may have."""
    return isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating))


def _info_flags(info: dict[str, Any], key: str, batch: int) -> np.ndarray:
    """The bool ``[batch]`` flags ``info[key]`` where its mask ``info["_" + key]`` is set
    (False where the key or the mask is missing).  The values must be bools or numbers (nonzero
    is True): a bool or numeric array, or Gymnasium's object array of them (what it builds for
    NumPy bools); any other value (a string, say) is a ``ValueError`` naming the key and the
    dtype, never read as a truth value."""
    if key not in info:
        return np.zeros(batch, dtype=np.bool_)
    mask = np.broadcast_to(np.asarray(info.get(f"_{key}", True), dtype=np.bool_), (batch,))
    values = np.asarray(info[key])
    if values.dtype == object:
        flat = values.reshape(batch)
        bad = [value for value, masked in zip(flat, mask, strict=True)
               if masked and not _is_flag_value(value)]
        if bad:
            raise ValueError(f"info[{key!r}] has dtype object with values such as {bad[0]!r} "
                             f"({type(bad[0]).__name__}): {key} flags must be bools or numbers")
        values = np.array([bool(value) if masked else False
                           for value, masked in zip(flat, mask, strict=True)])
    elif values.dtype != np.bool_ and not np.issubdtype(values.dtype, np.number):
        raise ValueError(f"info[{key!r}] has dtype {values.dtype}: {key} flags must be bools "
                         "or numbers")
    return values.astype(bool).reshape(batch) & mask


def _recorded_info(info: dict[str, Any], key: str, batch: int,
                   rows: np.ndarray | None = None) -> np.ndarray | None:
    """The batched ``info[key]`` as a numeric array ``[batch, ...]`` with the rows Gymnasium's
    mask ``info["_" + key]`` (and ``rows``, if given) leaves unset zeroed; None without the key.
    Object arrays (Gymnasium's batch of NumPy scalars) must hold bools or numbers."""
    if key not in info:
        return None
    values = np.asarray(info[key])
    mask = np.broadcast_to(np.asarray(info.get(f"_{key}", True), dtype=np.bool_), (batch,))
    if rows is not None:
        mask = mask & rows
    values = np.where(mask.reshape((batch,) + (1,) * (values.ndim - 1)), values,
                      np.zeros_like(values))
    if values.dtype == object:
        values = np.array(values.tolist())
    if values.dtype != np.bool_ and not np.issubdtype(values.dtype, np.number):
        raise ValueError(f"info[{key!r}] has dtype {values.dtype}: recorded info must be bools "
                         "or numbers")
    return values


class GymVectorEnv:
    """A Gymnasium vector env as a ``VectorEnv`` (see the module docstring)."""

    def __init__(self, env: Any, obs_map: dict[str, str | None] | None = None) -> None:
        _need_gymnasium()
        self.env = env
        self.num_envs = int(env.num_envs)
        self.obs_map = dict(obs_map or {})
        self.action_space = env.single_action_space
        self.autoreset_mode = _autoreset_mode(env)
        action = _action_spec(self.action_space)
        self._leaves = _leaves(env.single_observation_space)
        not_keys = {leaf: target for leaf, target in self.obs_map.items()
                    if target is not None and not isinstance(target, str)}
        if not_keys:
            raise ValueError(f"obs_map maps {not_keys}: each leaf goes to an image key (a "
                             "string such as 'main_images'), to 'states' or to None (dropped)")
        known = {leaf.name for leaf in self._leaves}
        unknown = sorted(set(self.obs_map) - known)
        if unknown:
            raise ValueError(f"obs_map names {unknown}, which are not observation leaves "
                             f"(leaves: {sorted(known)})")
        for leaf in self._leaves:
            target = self.obs_map.get(leaf.name, "states")
            if _looks_channel_first(leaf.space) and (leaf.name not in self.obs_map
                                                     or target not in ("states", None)):
                raise _channel_first_error(leaf)
            if not leaf.image and target not in ("states", None):
                raise ValueError(f"obs_map maps the non-image leaf {leaf.name!r} to {target!r}:"
                                 " non-image leaves go to 'states' (or None: dropped)")
        # the non-image leaves and the images obs_map sends to "states", flattened to float32
        self._states = [leaf for leaf in self._leaves
                        if self.obs_map.get(leaf.name, None if leaf.image else "states")
                        == "states"]
        _check_one_hot_widths(self._states)
        self._images = _image_groups(self._leaves, self.obs_map)
        images = {}
        for key, group in self._images.items():
            shape = tuple(group[0].space.shape)
            stacked = len(group) > 1 or key == "extra_view_images"
            images[key] = (len(group), *shape) if stacked else shape
        self.spec = EnvSpec(sum(_state_width(leaf.space) for leaf in self._states), action,
                            images)
        if not self.spec.state_dim and not images:
            raise ValueError(
                f"the observation leaves {sorted(known)} give a policy nothing to see: no state "
                "column and no image (an empty Box, or obs_map drops every leaf); keep at least "
                "one leaf (obs_map: 'states' or an image key)")
        # the observation leaf of each column of ``states`` (names the leaf of a bad value)
        self.state_names = tuple(leaf.name for leaf in self._states
                                 for _ in range(_state_width(leaf.space)))
        self.state_dim = self.spec.state_dim
        self.action_dim = action.dim
        if action.kind == "box":
            low = np.asarray(action.low, dtype=np.float32)
            high = np.asarray(action.high, dtype=np.float32)
            self._scaled = np.isfinite(low) & np.isfinite(high)
            self._low, self._high = np.where(self._scaled, low, -1), np.where(self._scaled, high, 1)

    # -- observations ---------------------------------------------------------------------

    def _leaf(self, obs: Any, leaf: _Leaf) -> Any:
        for key in leaf.path:
            obs = obs[key] if isinstance(obs, Mapping) else obs[int(key)]
        return obs

    def convert(self, obs: Any) -> dict[str, torch.Tensor]:
        """A batched Gymnasium observation as the flat tensor dict of ``self.spec``."""
        B = self.num_envs
        out: dict[str, torch.Tensor] = {}
        if self._states:
            columns = [_state_columns(leaf, self._leaf(obs, leaf), B)
                       for leaf in self._states]
            states = columns[0] if len(columns) == 1 else np.concatenate(columns, axis=1)
            out["states"] = torch.from_numpy(np.array(states, dtype=np.float32))
        for key, group in self._images.items():
            shape = self.spec.images[key]
            arrays = [np.asarray(self._leaf(obs, leaf)) for leaf in group]
            image = arrays[0] if len(arrays) == 1 and len(shape) == 3 else np.stack(arrays, 1)
            if image.dtype != np.uint8 or image.shape != (B, *shape):
                raise ObservationError(f"observation {key!r}: expected uint8 {[B, *shape]}, got "
                                       f"{image.dtype} {list(image.shape)}")
            out[key] = torch.from_numpy(np.array(image, copy=True))
        return out

    # -- actions --------------------------------------------------------------------------

    def to_space(self, actions: torch.Tensor) -> np.ndarray:
        """A ``[B, A]`` float action batch in the action space's form (an integer Box: one
        equal-width bin of [-1, 1] per integer of ``[low, high]``, ``_to_integers``)."""
        a = torch.as_tensor(actions, dtype=torch.float32).reshape(self.num_envs, -1).numpy()
        spec, space = self.spec.action, self.action_space
        if a.shape[1] != spec.dim:
            raise ValueError(f"actions have {a.shape[1]} numbers per env, the action space "
                             f"{space} takes {spec.dim}")
        bad = ~np.isfinite(a)
        if bad.any():
            rows = np.flatnonzero(bad.any(axis=1)).tolist()
            raise ValueError(f"the policy output forward_inputs['action'] has non-finite values "
                             f"{a[bad][:4].tolist()} for env rows {rows}: actions for the action "
                             f"space {space} must be finite")
        if spec.kind == "box":
            if np.issubdtype(space.dtype, np.integer):
                return self._to_integers(a)
            scaled = self._low + (np.clip(a, -1, 1) + 1) * 0.5 * (self._high - self._low)
            a = np.where(self._scaled, scaled, a).reshape(self.num_envs, *space.shape)
            return a.astype(space.dtype, copy=False)
        index = np.rint(a).astype(np.int64)
        nvec = np.asarray(spec.nvec)
        if (index < 0).any() or (index >= nvec).any():
            raise ValueError(f"action indices {index.tolist()} outside the action space {space}")
        if spec.kind == "discrete":
            return index.reshape(self.num_envs) + spec.start[0]
        if spec.kind == "multi_discrete":
            index = index + np.asarray(spec.start)
        return index.reshape(self.num_envs, *space.shape).astype(space.dtype, copy=False)

    def _to_integers(self, a: np.ndarray) -> np.ndarray:
        """``[B, A]`` floats as an integer Box's values: [-1, 1] cut into one equal-width bin
        per integer of ``[low, high]`` (the last bin closed), so a uniform output reaches each
        integer equally often."""
        space = self.action_space
        low = np.asarray(space.low, dtype=np.float64).reshape(-1)
        high = np.asarray(space.high, dtype=np.float64).reshape(-1)
        n = high - low + 1
        index = np.minimum(np.floor((np.clip(a, -1, 1) + 1) * 0.5 * n), n - 1)
        values = (low + index).reshape(self.num_envs, *space.shape)
        return values.astype(space.dtype, copy=False)

    def from_space(self, values: Any) -> np.ndarray:
        """The inverse of ``to_space``: a batch of actions of the action space (e.g. an env's
        executed ``intervene_action``) as the policy's float32 ``[B, A]``: Box values mapped
        from ``[low, high]`` back onto [-1, 1] (clipped; infinite bounds pass through; an
        integer Box's value onto the middle of its bin), indices without the space's
        ``start``."""
        a = np.asarray(values, dtype=np.float32).reshape(self.num_envs, -1)
        spec = self.spec.action
        if a.shape[1] != spec.dim:
            raise ValueError(f"an action of the action space {self.action_space} has "
                             f"{spec.dim} numbers per env, got {a.shape[1]}")
        if spec.kind == "box" and np.issubdtype(self.action_space.dtype, np.integer):
            n = self._high - self._low + 1
            return np.clip(2 * (a - self._low + 0.5) / n - 1, -1, 1).astype(np.float32)
        if spec.kind == "box":
            unscaled = np.clip(2 * (a - self._low) / (self._high - self._low) - 1, -1, 1)
            return np.where(self._scaled, unscaled, a).astype(np.float32)
        if spec.start:
            a = a - np.asarray(spec.start, dtype=np.float32)
        return a

    # -- the VectorEnv protocol -------------------------------------------------------------

    def reset(self, seed: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        obs, info = self.env.reset(seed=seed)
        return self.convert(obs), info

    def step(self, actions: torch.Tensor) -> tuple[
        dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]
    ]:
        obs, reward, term, trunc, info = self.env.step(self.to_space(actions))
        term = torch.as_tensor(np.asarray(term), dtype=torch.bool)
        trunc = torch.as_tensor(np.asarray(trunc), dtype=torch.bool)
        done = term | trunc
        # e.g. Meta-World: per-env "success" flags with a "_success" mask; none: no success
        success = _info_flags(info, "success", self.num_envs)
        out_info: dict[str, Any] = {}
        converted = self.convert(obs)
        if bool(done.any()):
            out_info[FINAL_MASK] = done
            if self.autoreset_mode == SAME_STEP:
                # Gymnasium reset the finished rows already; their step's info is "final_info"
                out_info[FINAL_OBS] = self.convert(self._same_step_final(obs, info, done.numpy()))
                final_success = _info_flags(info.get("final_info", {}), "success",
                                            self.num_envs)
                success = np.where(done.numpy(), final_success, success)
            else:
                # NextStep would reset on the next step() and Disabled never: reset them now
                out_info[FINAL_OBS] = converted
                reset_obs, _ = self.env.reset(options={"reset_mask": done.numpy()})
                fresh = self.convert(reset_obs)
                converted = {k: torch.where(done.reshape((-1,) + (1,) * (v.dim() - 1)),
                                            fresh[k], v) for k, v in converted.items()}
        out_info["success"] = torch.as_tensor(success)
        # the recording info of lerobot mode (ChunkedEnv keeps RECORDED_INFO_KEYS); SameStep:
        # a finished row's step info is Gymnasium's final_info
        final_info = info.get("final_info", {}) if self.autoreset_mode == SAME_STEP else {}
        done_rows = done.numpy()
        for key in (key for key in RECORDED_INFO_KEYS if key != "success"):
            value = _recorded_info(info, key, self.num_envs)
            final = _recorded_info(final_info, key, self.num_envs, done_rows)
            if value is not None and final is not None:
                value = np.where(done_rows.reshape((-1,) + (1,) * (value.ndim - 1)), final,
                                 value)
            value = final if value is None else value
            if value is not None and key == "intervene_action":
                value = self.from_space(value)  # the env's executed action, as the policy's
            if value is not None:
                out_info[key] = torch.as_tensor(value)
        reward = torch.as_tensor(np.asarray(reward), dtype=torch.float32)
        return converted, reward, term, trunc, out_info

    def _same_step_final(self, obs: Any, info: dict[str, Any], done: np.ndarray) -> Any:
        """The batched observation with the ``done`` rows replaced by the observations they
        finished in (SameStep: Gymnasium's per-env ``info["final_obs"]``)."""
        final, mask = info.get("final_obs"), info.get("_final_obs")
        if final is None or mask is None or not np.asarray(mask)[done].all():
            raise ValueError(f"vector env {self.env}: autoreset mode {SAME_STEP!r} finished env "
                             f"rows {np.flatnonzero(done).tolist()} but info['final_obs'] does "
                             "not hold their final observations")
        single = self.env.single_observation_space
        rows = list(iterate(self.env.observation_space, obs))
        for i in np.flatnonzero(done):
            rows[i] = final[i]
        out: Any = create_empty_array(single, self.num_envs)  # a Box / Dict / Tuple batch
        return concatenate(single, rows, out)


def _resolve_id(env_id: str) -> str:
    """``env_id`` with a namespace module imported when Gymnasium needs it (see module doc)."""
    if ":" in env_id or "/" not in env_id:
        return env_id
    namespace = env_id.split("/", 1)[0]
    if any(spec.namespace == namespace for spec in gymnasium.registry.values()):
        return env_id
    try:
        importlib.import_module(namespace)
    except ImportError as exc:
        raise ValueError(
            f"gym:{env_id}: no env of namespace {namespace!r} is registered and importing the "
            f"module {namespace!r} failed ({exc}); install the package that registers it, or "
            "name the module that does: gym:<module>:<EnvId> (e.g. "
            "gym:gym_pusht:gym_pusht/PushT-v0)") from None
    return env_id


def _names_an_env(env_id: str) -> bool:
    """Whether ``env_id`` (``[<module>:]<EnvId>``) names an env: its module is there (importing
    it fails, if at all, on something else it imports) and the id, or an unversioned id's
    latest version, is registered."""
    module, _, name = env_id.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if module == missing or module.startswith(f"{missing}."):
                return False
            return True  # the module is there; a dependency of it is not
        except ImportError:
            return True
    if name in gymnasium.registry:
        return True
    try:
        namespace, base, version = parse_env_id(name)
    except gymnasium.error.Error:
        return False
    return version is None and find_highest_version(namespace, base) is not None


def make_gym_env(env_id: str, num_envs: int, env_kwargs: dict[str, Any] | None = None,
                 obs_map: dict[str, str | None] | None = None) -> GymVectorEnv:
    """``GymVectorEnv`` over ``gymnasium.make_vec(env_id, num_envs, vectorization_mode="sync",
    **env_kwargs)`` with ``ObservationCheck`` on every sub-env."""
    _need_gymnasium()
    resolved = _resolve_id(env_id)
    try:
        vec = gymnasium.make_vec(resolved, num_envs=num_envs, vectorization_mode="sync",
                                 wrappers=[ObservationCheck], **dict(env_kwargs or {}))
    except (gymnasium.error.Error, ImportError) as exc:
        if _names_an_env(resolved):  # it was found: making it failed (a missing dependency)
            raise ValueError(f"gym:{env_id}: {exc}") from exc
        raise ValueError(
            f"gym:{env_id}: {exc} (forms that work: gym:<EnvId> for registered ids, "
            "gym:<namespace>/<EnvId> when importing the module <namespace> registers it, "
            "gym:<module>:<EnvId> to import <module> first)") from None
    try:
        return GymVectorEnv(vec, obs_map)
    except BaseException:
        vec.close()
        raise


__all__ = ["GymVectorEnv", "ObservationCheck", "make_gym_env"]
