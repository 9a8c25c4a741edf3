"""LeRobot v3 features and statistics of recorded episodes (docs/embodied.md: "LeRobot datasets").

The lerobot mode's frames (``EpisodeShard.episodes``) use LeRobot's feature names with plain
Python scalars and per-source episode numbers.  This module describes them the way a LeRobot v3
dataset does, with numpy only (no LeRobot, no pyarrow):

* ``episode_features(frames)`` — the ``features`` dict of ``meta/info.json``: every frame key but
  ``task`` (which becomes ``task_index``), scalars as shape ``(1,)``, ``observation.images.*`` as
  ``"image"`` features ``(H, W, C)``, then LeRobot's own ``timestamp``, ``frame_index``,
  ``episode_index``, ``index`` and ``task_index``;
* ``check_episode(frames, features, fps)`` — every frame has exactly those keys, dtypes and
  shapes, float values are finite, and ``frame_index``/``timestamp`` count from 0 at ``fps``
  (``ValueError`` naming the frame and key otherwise);
* ``to_lerobot_frame(frame, features)`` — the frame as ``LeRobotDataset.add_frame`` takes it
  (shape-``(1,)`` arrays, no keys LeRobot assigns itself), for users who record with LeRobot's
  own writer (videos, Hub upload);
* ``episode_stats`` / ``aggregate_stats`` — per-episode statistics (min, max, mean, std, count,
  q01…q99; images per channel in [0, 1]) and their dataset-wide aggregate, with LeRobot's
  formulas (``lerobot.datasets.compute_stats``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

IMAGE_PREFIX = "observation.images."
TASK = "task"
# the keys LeRobot's own writer assigns (DEFAULT_FEATURES of lerobot.utils.constants)
LEROBOT_FEATURES: dict[str, dict[str, Any]] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
_NUMERIC = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
            "float16", "float32", "float64")
_MAX_IMAGE_SAMPLES = 100  # frames per episode sampled for image statistics (LeRobot: ~100)


def as_array(value: Any) -> np.ndarray:
    """A frame value as a numpy array (tensors are copied to numpy; Python scalars keep their
    kind: bool → bool, int → int64, float → float32)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, (bool, np.bool_)):
        return np.asarray(value, dtype=np.bool_)
    if isinstance(value, int):
        return np.asarray(value, dtype=np.int64)
    if isinstance(value, float):
        return np.asarray(value, dtype=np.float32)
    return np.asarray(value)


def _feature(key: str, value: Any) -> dict[str, Any]:
    """The LeRobot feature of one frame value (``ValueError`` for what LeRobot cannot hold)."""
    arr = as_array(value)
    if key.startswith(IMAGE_PREFIX):
        if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] not in (1, 3):
            raise ValueError(f"frame key {key!r}: an image must be uint8 [H, W, 3] (or "
                             f"[H, W, 1]), got {arr.dtype} {list(arr.shape)}")
        return {"dtype": "image", "shape": list(arr.shape),
                "names": ["height", "width", "channels"]}
    if arr.dtype.name not in _NUMERIC:
        raise ValueError(f"frame key {key!r}: {arr.dtype} values cannot be a LeRobot feature "
                         f"(numbers, bools, uint8 images under {IMAGE_PREFIX!r}, and the "
                         f"{TASK!r} string)")
    if arr.ndim == 0 or arr.shape == (1,):
        return {"dtype": arr.dtype.name, "shape": [1], "names": None}
    if arr.ndim == 1:
        short = key.rsplit(".", 1)[-1]
        return {"dtype": arr.dtype.name, "shape": [int(arr.shape[0])],
                "names": [f"{short}_{i}" for i in range(arr.shape[0])]}
    raise ValueError(f"frame key {key!r}: only scalars, vectors and images under "
                     f"{IMAGE_PREFIX!r} are supported, got shape {list(arr.shape)}")


def episode_features(frames: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The LeRobot ``features`` dict of an episode's frames (its first frame decides).

    Raises ``ValueError`` for an empty episode, a frame without a ``task`` string, or a value
    LeRobot cannot hold.
    """
    if not frames:
        raise ValueError("an episode needs at least one frame")
    first = frames[0]
    if not isinstance(first.get(TASK), str):
        raise ValueError(f"frame 0: {TASK!r} must be a string, got {first.get(TASK)!r}")
    features = {key: _feature(key, value) for key, value in first.items()
                if key != TASK and key not in LEROBOT_FEATURES}
    return {**features, **{k: dict(v) for k, v in LEROBOT_FEATURES.items()}}


def _kind(arr: np.ndarray) -> str:
    return "image" if arr.dtype == np.uint8 and arr.ndim == 3 else arr.dtype.name


def check_episode(frames: Sequence[Mapping[str, Any]], features: Mapping[str, dict],
                  fps: float, where: str = "episode") -> None:
    """Check an episode against ``features`` before anything of it is written.

    Every frame has exactly the feature keys (less ``index``, ``task_index`` and the per-episode
    keys, which are optional: ``frame_index``, ``episode_index``, ``timestamp``) plus ``task``;
    values keep the feature's dtype and shape, and float values are finite (no NaN or
    infinity: the statistics would not be valid JSON); ``frame_index`` (if present) is the frame's
    position and ``timestamp`` (if present) ``frame_index / fps`` within 1e-4 s.  Raises
    ``ValueError`` naming ``where``, the frame and the key.
    """
    if not frames:
        raise ValueError(f"{where}: no frames")
    own = set(features) - set(LEROBOT_FEATURES)
    optional = {"frame_index", "episode_index", "timestamp"}
    for i, frame in enumerate(frames):
        keys = set(frame) - {TASK} - optional
        if keys != own:
            raise ValueError(f"{where}, frame {i}: keys differ from the dataset's features: "
                             f"missing {sorted(own - keys)}, unexpected {sorted(keys - own)}")
        if not isinstance(frame.get(TASK), str):
            raise ValueError(f"{where}, frame {i}: {TASK!r} must be a string")
        for key in own:
            feature = features[key]
            arr = as_array(frame[key])
            shape = list(arr.shape) if feature["dtype"] == "image" or arr.ndim else [1]
            dtype = _kind(arr) if feature["dtype"] == "image" else arr.dtype.name
            if dtype != feature["dtype"] or shape != list(feature["shape"]):
                raise ValueError(f"{where}, frame {i}, key {key!r}: {dtype} {shape} where the "
                                 f"dataset has {feature['dtype']} {list(feature['shape'])}")
            if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
                raise ValueError(f"{where}, frame {i}, key {key!r}: non-finite values "
                                 f"{arr[~np.isfinite(arr)][:4].tolist()}: a dataset's values "
                                 "(and its statistics) must be finite")
        if "frame_index" in frame and int(frame["frame_index"]) != i:
            raise ValueError(f"{where}, frame {i}: frame_index is {frame['frame_index']}")
        if "timestamp" in frame and abs(float(frame["timestamp"]) - i / fps) > 1e-4:
            raise ValueError(f"{where}, frame {i}: timestamp {frame['timestamp']} is not "
                             f"frame_index / fps = {i / fps} (fps {fps}: does the writer's fps "
                             "match the plan's lerobot_fps?)")


def to_lerobot_frame(frame: Mapping[str, Any], features: Mapping[str, dict]) -> dict[str, Any]:
    """``frame`` as ``LeRobotDataset.add_frame`` accepts it for a dataset created with
    ``features`` (``episode_features``): scalars become shape-``(1,)`` arrays of the feature's
    dtype, images stay ``[H, W, C]`` uint8, ``task`` stays, and the keys LeRobot assigns itself
    (``frame_index``, ``episode_index``, ``timestamp``, ``index``, ``task_index``) are left out."""
    out: dict[str, Any] = {}
    for key, value in frame.items():
        if key == TASK:
            out[key] = value
        elif key in features and key not in LEROBOT_FEATURES:
            feature = features[key]
            arr = as_array(value)
            if feature["dtype"] != "image":
                arr = arr.astype(feature["dtype"]).reshape(feature["shape"])
            out[key] = np.ascontiguousarray(arr)
    return out


def column(frames: Sequence[Mapping[str, Any]], key: str, feature: Mapping[str, Any]) -> np.ndarray:
    """The values of ``key`` over an episode: ``[n]`` for scalars, ``[n, d]`` for vectors,
    ``[n, H, W, C]`` for images, in the feature's dtype."""
    if feature["dtype"] == "image":
        return np.stack([as_array(f[key]) for f in frames])
    values = np.stack([as_array(f[key]).reshape(-1) for f in frames]).astype(feature["dtype"])
    return values.reshape(len(frames)) if list(feature["shape"]) == [1] else values


def _basic_stats(data: np.ndarray, count: int) -> dict[str, np.ndarray]:
    """min, max, mean, std (population), count and quantiles over axis 0 of ``data [n, d]``."""
    stats = {"min": data.min(axis=0), "max": data.max(axis=0), "mean": data.mean(axis=0),
             "std": data.std(axis=0), "count": np.array([count])}
    for q, value in zip(QUANTILES, np.quantile(data, QUANTILES, axis=0), strict=True):
        stats[f"q{round(q * 100):02d}"] = value
    return stats


def episode_stats(columns: Mapping[str, np.ndarray],
                  features: Mapping[str, dict]) -> dict[str, dict[str, np.ndarray]]:
    """Per-feature statistics of one episode (``columns`` from ``column``), as LeRobot computes
    them: vectors per dimension (scalars as shape ``(1,)``), images per channel over at most
    100 evenly spaced frames, divided by 255, shape ``(C, 1, 1)``."""
    out = {}
    for key, data in columns.items():
        feature = features[key]
        if feature["dtype"] == "image":
            n = data.shape[0]
            picks = np.unique(np.round(np.linspace(0, n - 1, min(n, _MAX_IMAGE_SAMPLES))))
            images = data[picks.astype(int)]
            step = max(1, max(images.shape[1:3]) // 150) if max(images.shape[1:3]) >= 300 else 1
            images = images[:, ::step, ::step]
            pixels = images.reshape(-1, images.shape[-1]).astype(np.float64) / 255.0
            stats = _basic_stats(pixels, images.shape[0])
            out[key] = {k: v if k == "count" else v.reshape(-1, 1, 1) for k, v in stats.items()}
        else:
            values = data.astype(np.float64)
            out[key] = _basic_stats(values.reshape(len(values), -1), len(values))
    return out


def aggregate_stats(stats_list: Sequence[Mapping[str, Mapping[str, np.ndarray]]]
                    ) -> dict[str, dict[str, np.ndarray]]:
    """Dataset statistics from per-episode ones (LeRobot's ``aggregate_stats``): min of mins,
    max of maxes, count-weighted mean, pooled variance, count-weighted quantiles."""
    keys = list(dict.fromkeys(k for stats in stats_list for k in stats))
    out = {}
    for key in keys:
        parts = [stats[key] for stats in stats_list if key in stats]
        counts = np.stack([p["count"] for p in parts]).astype(np.float64)
        total = counts.sum(axis=0)
        means = np.stack([p["mean"] for p in parts])
        weights = counts.reshape(-1, *([1] * (means.ndim - 1)))
        mean = (means * weights).sum(axis=0) / total
        variance = ((np.stack([p["std"] for p in parts]) ** 2 + (means - mean) ** 2)
                    * weights).sum(axis=0) / total
        agg = {"min": np.min(np.stack([p["min"] for p in parts]), axis=0),
               "max": np.max(np.stack([p["max"] for p in parts]), axis=0),
               "mean": mean, "std": np.sqrt(variance), "count": total.astype(np.int64)}
        for q in QUANTILES:
            name = f"q{round(q * 100):02d}"
            agg[name] = (np.stack([p[name] for p in parts]) * weights).sum(axis=0) / total
        out[key] = agg
    return out


__all__ = [
    "IMAGE_PREFIX",
    "LEROBOT_FEATURES",
    "QUANTILES",
    "aggregate_stats",
    "as_array",
    "check_episode",
    "column",
    "episode_features",
    "episode_stats",
    "to_lerobot_frame",
]
