"""A LeRobot v3 dataset on disk from the lerobot mode's episodes (docs/embodied.md).

``LeRobotDatasetWriter(root, fps=...)`` takes finished episodes (lists of frame dicts, as in
``EpisodeShard.episodes``) and writes the LeRobot v3.0 layout that
``lerobot.datasets.LeRobotDataset(repo_id, root=root)`` loads::

    meta/info.json                          codebase_version "v3.0", fps, features, totals, paths
    meta/stats.json                         per-feature min/max/mean/std/count/q01…q99
    meta/tasks.parquet                      task_index per task string (the pandas index)
    meta/episodes/chunk-000/file-000.parquet  one row per episode: length, tasks, frame range,
                                            data file, per-episode stats
    data/chunk-000/file-000.parquet         one row per frame, one row group per episode

Episodes get **global** indices in the order they are added (``add_shards`` orders shards by
step, env rank, stage and shard first); ``index`` counts frames over the dataset; ``task_index``
numbers the task strings in order of appearance.  Scalars are shape-``(1,)`` features,
``observation.images.*`` are ``image`` features stored as PNG bytes inside the data parquet
(LeRobot's image layout; no video encoding), vectors are fixed-size lists.  Data files roll over
at ``data_files_size_in_mb``.

Everything is written into a hidden sibling directory and renamed to ``root`` by ``close``, so
``root`` never holds a half-written dataset; an existing ``root`` is refused
(``FileExistsError``) unless ``overwrite=True``.  Needs the ``dataset`` extra (pyarrow, Pillow).
"""

from __future__ import annotations

import io
import json
import shutil
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from zchannel.embodied.lerobot_features import (
    LEROBOT_FEATURES,
    TASK,
    aggregate_stats,
    as_array,
    check_episode,
    column,
    episode_features,
    episode_stats,
)

CODEBASE_VERSION = "v3.0"
CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DATA_PATH = "data/" + CHUNK_FILE + ".parquet"
EPISODES_PATH = "meta/episodes/" + CHUNK_FILE + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE + ".mp4"
TASKS_PATH = "meta/tasks.parquet"
_EXTRA_HINT = "the LeRobot dataset writer needs pyarrow and Pillow: pip install 'zchannel[dataset]'"


def _libraries() -> tuple[Any, Any, Any]:
    """``(pyarrow, pyarrow.parquet, PIL.Image)``, or ``RuntimeError`` naming the extra."""
    try:
        import pyarrow
        import pyarrow.parquet
        from PIL import Image
    except ImportError as exc:
        raise RuntimeError(f"{_EXTRA_HINT} ({exc})") from None
    return pyarrow, pyarrow.parquet, Image


@dataclass(frozen=True)
class DatasetSummary:
    """What ``LeRobotDatasetWriter.close`` wrote."""

    root: str
    episodes: int
    frames: int
    tasks: list[str]
    features: dict[str, dict[str, Any]] = field(repr=False)


class _ParquetFiles:
    """The data parquet files: one row group per episode, a new file past ``limit`` bytes."""

    def __init__(self, root: Path, pq: Any, limit: int, chunks_size: int) -> None:
        self.root, self.pq, self.limit, self.chunks_size = root, pq, limit, chunks_size
        self.chunk = self.file = 0
        self.writer: Any = None
        self.size = 0

    def write(self, table: Any) -> tuple[int, int]:
        """Append ``table`` (one episode); returns its ``(chunk_index, file_index)``."""
        if self.writer is not None and self.size + table.nbytes > self.limit:
            self.close()
            self.file += 1
            if self.file == self.chunks_size:
                self.chunk, self.file = self.chunk + 1, 0
        if self.writer is None:
            path = self.root / DATA_PATH.format(chunk_index=self.chunk, file_index=self.file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.writer = self.pq.ParquetWriter(str(path), table.schema, compression="snappy")
            self.size = 0
        self.writer.write_table(table)
        self.size += table.nbytes
        return self.chunk, self.file

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class LeRobotDatasetWriter:
    """Writes episodes as a LeRobot v3.0 dataset under ``root`` (see the module docstring).

    ``fps`` must be a positive integer (LeRobot's ``info.json`` holds an int) equal to the plan's
    ``lerobot_fps``: frame timestamps are checked against it.  The first episode fixes the
    features; an episode whose frames differ (keys, dtypes, shapes) is refused with a
    ``ValueError`` naming the frame and key, and nothing of it is written.  Use it as a context
    manager, or call ``close()`` (``abort()`` drops everything written).
    """

    def __init__(self, root: str | Path, *, fps: int, robot_type: str | None = None,
                 overwrite: bool = False, data_files_size_in_mb: int = 100,
                 chunks_size: int = 1000, png_compress_level: int = 1) -> None:
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0 \
                or float(fps) != int(fps):
            raise ValueError(f"fps must be a positive integer (LeRobot stores an int), got {fps!r}")
        self.pa, self.pq, self.image = _libraries()
        self.root = Path(root)
        if self.root.exists() and not overwrite:
            raise FileExistsError(f"{self.root} exists: pass overwrite=True (CLI: --overwrite) "
                                  "to replace it")
        self.fps, self.robot_type, self.overwrite = int(fps), robot_type, overwrite
        self.sizes = {"data_files_size_in_mb": int(data_files_size_in_mb),
                      "chunks_size": int(chunks_size)}
        self.png_compress_level = png_compress_level
        self.root.parent.mkdir(parents=True, exist_ok=True)
        self.staging = self.root.parent / f".{self.root.name}.partial-{uuid.uuid4().hex[:8]}"
        self.staging.mkdir()
        self.files = _ParquetFiles(self.staging, self.pq, int(data_files_size_in_mb) << 20,
                                   int(chunks_size))
        self.features: dict[str, dict[str, Any]] | None = None
        self.tasks: dict[str, int] = {}
        self.episodes: list[dict[str, Any]] = []
        self.stats: list[dict[str, dict[str, np.ndarray]]] = []
        self.frames = 0
        self.closed = False
        self.summary: DatasetSummary | None = None  # set by close

    def __enter__(self) -> LeRobotDatasetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Close on success (``summary`` holds the result); abort when the block raised."""
        if exc_type is not None:
            self.abort()
        elif not self.closed:
            self.close()

    # -- adding episodes ---------------------------------------------------------------------

    def add_episode(self, frames: Sequence[Mapping[str, Any]]) -> int:
        """Write one episode; returns its global ``episode_index``."""
        if self.closed:
            raise ValueError(f"the writer of {self.root} is closed")
        index = len(self.episodes)
        features = self.features or episode_features(frames)
        check_episode(frames, features, self.fps, where=f"episode {index}")
        self.features = features
        tasks = [str(f[TASK]) for f in frames]
        task_ids = dict(self.tasks)  # committed once the episode is written
        for task in tasks:
            task_ids.setdefault(task, len(task_ids))
        own = [k for k in features if k not in LEROBOT_FEATURES]
        columns = {key: column(frames, key, features[key]) for key in own}
        n = len(frames)
        columns.update({
            "timestamp": (np.arange(n) / self.fps).astype(np.float32),
            "frame_index": np.arange(n, dtype=np.int64),
            "episode_index": np.full(n, index, dtype=np.int64),
            "index": np.arange(self.frames, self.frames + n, dtype=np.int64),
            "task_index": np.array([task_ids[t] for t in tasks], dtype=np.int64),
        })
        stats = episode_stats(columns, features)
        chunk, file = self.files.write(self._table(columns, features))
        self.episodes.append({
            "episode_index": index, "tasks": list(dict.fromkeys(tasks)), "length": n,
            "data/chunk_index": chunk, "data/file_index": file,
            "dataset_from_index": self.frames, "dataset_to_index": self.frames + n,
        })
        self.stats.append(stats)
        self.tasks = task_ids
        self.frames += n
        return index

    def add_shards(self, shards: Iterable[Any]) -> list[int]:
        """Write the episodes of ``EpisodeShard`` items, ordered by ``(step_id, env_rank,
        stage_id, shard_index)`` and then as listed; returns their global indices."""
        ordered = sorted(shards, key=lambda s: (s.step_id, s.env_rank, s.stage_id, s.shard_index))
        return [self.add_episode(episode) for shard in ordered for episode in shard.episodes]

    def _png(self, image: np.ndarray) -> bytes:
        array = image[:, :, 0] if image.shape[2] == 1 else image
        buffer = io.BytesIO()
        self.image.fromarray(array).save(buffer, format="PNG",
                                         compress_level=self.png_compress_level)
        return buffer.getvalue()

    def _table(self, columns: Mapping[str, np.ndarray], features: Mapping[str, dict]) -> Any:
        """One episode as an arrow table in the feature order (LeRobot's parquet types)."""
        pa = self.pa
        arrays, names = [], []
        for key, data in columns.items():
            feature = features[key]
            if feature["dtype"] == "image":
                array = pa.array([{"bytes": self._png(img), "path": None} for img in data],
                                 type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
            elif list(feature["shape"]) == [1]:
                array = pa.array(data)
            else:
                width = int(feature["shape"][0])
                array = pa.FixedSizeListArray.from_arrays(pa.array(data.reshape(-1)), width)
            arrays.append(array)
            names.append(key)
        return pa.Table.from_arrays(arrays, names=names)

    # -- finishing ---------------------------------------------------------------------------

    def close(self) -> DatasetSummary:
        """Write the metadata and move the dataset to ``root`` (replacing an existing ``root``
        only with ``overwrite``).  Raises ``ValueError`` when no episode was added (nothing is
        written then)."""
        if self.closed:
            raise ValueError(f"the writer of {self.root} is closed")
        self.files.close()
        if not self.episodes:
            self.abort()
            raise ValueError(f"no episodes were recorded: nothing was written to {self.root}")
        try:
            self._write_metadata()
            self._publish()
        except BaseException:
            self.abort()
            raise
        self.closed = True
        assert self.features is not None
        self.summary = DatasetSummary(str(self.root), len(self.episodes), self.frames,
                                      list(self.tasks), self.features)
        return self.summary

    def abort(self) -> None:
        """Drop everything written (``root`` is left as it was)."""
        self.files.close()
        shutil.rmtree(self.staging, ignore_errors=True)
        self.closed = True

    def _publish(self) -> None:
        if self.root.exists():
            if not self.overwrite:
                raise FileExistsError(f"{self.root} appeared while writing: pass overwrite=True "
                                      "to replace it")
            old = self.root.parent / f".{self.root.name}.old-{uuid.uuid4().hex[:8]}"
            self.root.rename(old)
            self.staging.rename(self.root)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self.staging.rename(self.root)

    def _write_metadata(self) -> None:
        assert self.features is not None
        pa, pq, root = self.pa, self.pq, self.staging
        (root / "meta").mkdir(exist_ok=True)
        stats = aggregate_stats(self.stats)
        info = {
            "codebase_version": CODEBASE_VERSION, "robot_type": self.robot_type,
            "total_episodes": len(self.episodes), "total_frames": self.frames,
            "total_tasks": len(self.tasks), "chunks_size": self.sizes["chunks_size"],
            "data_files_size_in_mb": self.sizes["data_files_size_in_mb"],
            "video_files_size_in_mb": 200, "fps": self.fps,
            "splits": {"train": f"0:{len(self.episodes)}"},
            "data_path": DATA_PATH, "video_path": None, "features": self.features,
        }
        (root / "meta" / "info.json").write_text(json.dumps(info, indent=4))
        (root / "meta" / "stats.json").write_text(json.dumps(_listed(stats), indent=4))
        rows = [{**episode, **{f"stats/{k}/{s}": v.tolist() for k, per in ep_stats.items()
                               for s, v in per.items()},
                 "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0}
                for episode, ep_stats in zip(self.episodes, self.stats, strict=True)]
        path = root / EPISODES_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), str(path))
        pq.write_table(_tasks_table(pa, list(self.tasks)), str(root / TASKS_PATH))


def _listed(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, Any]]:
    return {key: {name: as_array(value).tolist() for name, value in per.items()}
            for key, per in stats.items()}


def _tasks_table(pa: Any, tasks: list[str]) -> Any:
    """``meta/tasks.parquet``: columns ``task_index`` and ``task``, with the pandas metadata
    that makes ``task`` the index of ``pandas.read_parquet`` (what LeRobot reads)."""
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
             "numpy_type": "int64", "metadata": None},
            {"name": "task", "field_name": "task", "pandas_type": "unicode",
             "numpy_type": "object", "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.0.0",
    }
    table = pa.table({"task_index": pa.array(range(len(tasks)), type=pa.int64()),
                      "task": pa.array(tasks, type=pa.string())})
    return table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)})


__all__ = ["CODEBASE_VERSION", "DatasetSummary", "LeRobotDatasetWriter"]
