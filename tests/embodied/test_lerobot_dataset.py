"""The LeRobot v3 dataset writer: its output read back against the published v3.0 layout (with
pyarrow, everywhere) and loaded by ``lerobot.datasets.LeRobotDataset`` where lerobot is
installed (Python >= 3.12: docs/embodied.md, "Checking a dataset with LeRobot")."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
from zchannel.embodied import EpisodeShard
from zchannel.embodied.lerobot_features import episode_features, to_lerobot_frame
from zchannel.embodied.lerobot_writer import LeRobotDatasetWriter

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
Image = pytest.importorskip("PIL.Image")

FPS = 10


def frames(n, *, seed, task="stack the cubes", episode_index=0, images=True, size=(6, 5)):
    """One episode of ``n`` frames as the lerobot mode emits them (per-source episode_index)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        frame = {"observation.state": rng.standard_normal(4).astype(np.float32)}
        if images:
            frame["observation.images.main"] = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            frame["observation.images.wrist"] = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
        frame.update({
            "action": rng.standard_normal(2).astype(np.float32), "next.reward": float(i) / 2,
            "next.done": i == n - 1, "next.success": seed % 2 == 0, "task": task,
            "intervention": i % 3 == 1, "segment_id": i // 4, "frame_index": i,
            "episode_index": episode_index, "timestamp": i / FPS,
        })
        out.append(frame)
    return out


def shard(step, env_rank, episodes, shard_index=0):
    return EpisodeShard(step_id=step, env_rank=env_rank, stage_id=0, shard_index=shard_index,
                        episodes=episodes)


def write(root, episodes, **kw):
    with LeRobotDatasetWriter(root, fps=FPS, **kw) as writer:
        for episode in episodes:
            writer.add_episode(episode)
    return writer.summary


def read_data(root):
    return pq.read_table(os.path.join(root, "data/chunk-000/file-000.parquet"))


def png(cell):
    return np.asarray(Image.open(io.BytesIO(cell["bytes"])))


def test_layout_features_and_frames_follow_lerobot_v3(tmp_path):
    root = str(tmp_path / "ds")
    episodes = [frames(3, seed=0), frames(5, seed=1, task="open the drawer"), frames(1, seed=2)]
    summary = write(root, episodes)
    assert (summary.episodes, summary.frames) == (3, 9)
    assert sorted(os.listdir(root)) == ["data", "meta"]
    assert sorted(os.listdir(os.path.join(root, "meta"))) == [
        "episodes", "info.json", "stats.json", "tasks.parquet"]
    info = json.load(open(os.path.join(root, "meta/info.json")))
    assert info["codebase_version"] == "v3.0" and info["fps"] == FPS
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 9, 2)
    assert info["splits"] == {"train": "0:3"} and info["video_path"] is None
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    features = info["features"]
    # every frame key but task, then LeRobot's own five; nothing else
    assert list(features) == [
        "observation.state", "observation.images.main", "observation.images.wrist", "action",
        "next.reward", "next.done", "next.success", "intervention", "segment_id",
        "timestamp", "frame_index", "episode_index", "index", "task_index"]
    assert features["observation.state"]["dtype"] == "float32"
    assert features["observation.state"]["shape"] == [4]
    assert features["observation.images.main"] == {
        "dtype": "image", "shape": [6, 5, 3], "names": ["height", "width", "channels"]}
    for key, dtype in (("next.reward", "float32"), ("next.done", "bool"),
                       ("next.success", "bool"), ("intervention", "bool"),
                       ("segment_id", "int64"), ("timestamp", "float32"),
                       ("frame_index", "int64"), ("episode_index", "int64"),
                       ("index", "int64"), ("task_index", "int64")):
        assert features[key] == {"dtype": dtype, "shape": [1], "names": None}, key

    table = read_data(root)
    assert table.column_names == list(features)
    assert table.num_rows == 9
    assert pq.ParquetFile(os.path.join(root, "data/chunk-000/file-000.parquet")
                          ).metadata.num_row_groups == 3  # one row group per episode
    schema = table.schema
    assert schema.field("observation.state").type == pa.list_(pa.float32(), 4)
    assert schema.field("observation.images.main").type == pa.struct(
        [("bytes", pa.binary()), ("path", pa.string())])
    assert schema.field("next.reward").type == pa.float32()
    assert schema.field("next.done").type == pa.bool_()
    rows = table.to_pylist()
    flat = [f for episode in episodes for f in episode]
    assert [r["index"] for r in rows] == list(range(9))
    assert [r["episode_index"] for r in rows] == [0] * 3 + [1] * 5 + [2]  # global, not per source
    assert [r["frame_index"] for r in rows] == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    assert [r["task_index"] for r in rows] == [0] * 3 + [1] * 5 + [0]
    for row, frame in zip(rows, flat, strict=True):
        np.testing.assert_array_equal(np.float32(row["observation.state"]),
                                      frame["observation.state"])
        np.testing.assert_array_equal(np.float32(row["action"]), frame["action"])
        for camera in ("main", "wrist"):  # PNG: byte-identical pixels
            np.testing.assert_array_equal(png(row[f"observation.images.{camera}"]),
                                          frame[f"observation.images.{camera}"])
        assert row["next.reward"] == pytest.approx(frame["next.reward"])
        assert row["timestamp"] == pytest.approx(row["frame_index"] / FPS)
        for key in ("next.done", "next.success", "intervention", "segment_id"):
            assert row[key] == frame[key], key

    meta = pq.read_table(os.path.join(root, "meta/episodes/chunk-000/file-000.parquet"))
    eps = meta.select(["episode_index", "tasks", "length", "dataset_from_index",
                       "dataset_to_index", "data/chunk_index", "data/file_index"]).to_pylist()
    assert [(e["dataset_from_index"], e["dataset_to_index"], e["length"]) for e in eps] == [
        (0, 3, 3), (3, 8, 5), (8, 9, 1)]
    assert [e["tasks"] for e in eps] == [["stack the cubes"], ["open the drawer"],
                                         ["stack the cubes"]]
    assert {(e["data/chunk_index"], e["data/file_index"]) for e in eps} == {(0, 0)}
    assert "stats/action/mean" in meta.column_names

    tasks = pq.read_table(os.path.join(root, "meta/tasks.parquet"))
    assert tasks.to_pylist() == [{"task_index": 0, "task": "stack the cubes"},
                                 {"task_index": 1, "task": "open the drawer"}]
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]

    stats = json.load(open(os.path.join(root, "meta/stats.json")))
    states = np.stack([f["observation.state"] for f in flat]).astype(np.float64)
    np.testing.assert_allclose(stats["observation.state"]["mean"], states.mean(0), rtol=1e-6)
    np.testing.assert_allclose(stats["observation.state"]["std"], states.std(0), rtol=1e-6)
    np.testing.assert_allclose(stats["observation.state"]["min"], states.min(0))
    assert stats["observation.state"]["count"] == [9]
    assert np.asarray(stats["observation.images.main"]["mean"]).shape == (3, 1, 1)
    assert set(stats["next.reward"]) == {"min", "max", "mean", "std", "count", "q01", "q10",
                                         "q50", "q90", "q99"}


def test_shards_get_global_indices_in_step_and_rank_order(tmp_path):
    root = str(tmp_path / "ds")
    # per-source episode indices as the collector assigns them (both sources start at 0)
    shards = [shard(1, 0, [frames(2, seed=5, episode_index=1, images=False)]),
              shard(0, 1, [frames(3, seed=4, episode_index=0, images=False)]),
              shard(0, 0, [frames(1, seed=3, episode_index=0, images=False)]),
              shard(0, 0, [], shard_index=1)]
    with LeRobotDatasetWriter(root, fps=FPS) as writer:
        assert writer.add_shards(shards) == [0, 1, 2]
    rows = read_data(root).select(["episode_index", "index"]).to_pylist()
    assert [r["episode_index"] for r in rows] == [0, 1, 1, 1, 2, 2]
    assert [r["index"] for r in rows] == list(range(6))


def test_existing_directory_needs_overwrite(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    (root / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        LeRobotDatasetWriter(root, fps=FPS)
    assert (root / "keep.txt").read_text() == "mine"
    write(str(root), [frames(2, seed=0)], overwrite=True)
    assert not (root / "keep.txt").exists() and (root / "meta/info.json").exists()
    assert [p for p in os.listdir(tmp_path) if p != "ds"] == []  # no staging left behind


def test_a_mismatching_episode_is_refused_and_nothing_of_it_written(tmp_path):
    root = str(tmp_path / "ds")
    writer = LeRobotDatasetWriter(root, fps=FPS)
    writer.add_episode(frames(2, seed=0))
    bad = frames(3, seed=1)
    bad[2]["action"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"episode 1, frame 2, key 'action'"):
        writer.add_episode(bad)
    extra = frames(2, seed=1)
    extra[1]["reward_model"] = 1.0
    with pytest.raises(ValueError, match=r"unexpected \['reward_model'\]"):
        writer.add_episode(extra)
    wrong_type = frames(2, seed=1)
    wrong_type[0]["segment_id"] = 1.5
    with pytest.raises(ValueError, match="segment_id"):
        writer.add_episode(wrong_type)
    shifted = frames(2, seed=1)
    shifted[1]["timestamp"] = 0.5
    with pytest.raises(ValueError, match="lerobot_fps"):
        writer.add_episode(shifted)
    assert writer.add_episode(frames(1, seed=2)) == 1
    summary = writer.close()
    assert (summary.episodes, summary.frames) == (2, 3)
    assert read_data(root).column("episode_index").to_pylist() == [0, 0, 1]


@pytest.mark.parametrize("key", ["observation.state", "next.reward"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_is_refused_naming_its_feature(tmp_path, key, bad):
    """A NaN or infinite float value (in the first episode too, which sets the features) is a
    ``ValueError`` naming the frame and the key, and nothing of the episode is written: it was
    written, and ``meta/stats.json`` held bare ``NaN`` tokens (not JSON)."""
    root = str(tmp_path / "ds")
    writer = LeRobotDatasetWriter(root, fps=FPS)
    for index in (0, 1):
        episode = frames(3, seed=index, images=False)
        episode[1][key] = bad if key == "next.reward" else np.full(4, bad, np.float32)
        with pytest.raises(ValueError, match=rf"episode {index}, frame 1, key '{key}': "
                                             "non-finite values"):
            writer.add_episode(episode)
        assert writer.add_episode(frames(2, seed=index, images=False)) == index
    writer.close()
    stats = json.loads((tmp_path / "ds/meta/stats.json").read_text(),
                       parse_constant=lambda c: pytest.fail(f"{c} in stats.json"))
    assert np.isfinite(stats["observation.state"]["mean"]).all()


def test_bad_writer_arguments(tmp_path):
    with pytest.raises(ValueError, match="fps must be a positive integer"):
        LeRobotDatasetWriter(tmp_path / "a", fps=12.5)
    writer = LeRobotDatasetWriter(tmp_path / "b", fps=FPS)
    with pytest.raises(ValueError, match="no episodes were recorded"):
        writer.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="image must be uint8"):
        episode_features([{**frames(1, seed=0)[0],
                           "observation.images.main": np.zeros((4, 4, 3), np.float32)}])
    with pytest.raises(ValueError, match="'task' must be a string"):
        episode_features([{"action": np.zeros(2, np.float32)}])


def test_data_files_roll_over_past_their_size(tmp_path):
    root = str(tmp_path / "ds")
    episodes = [frames(6, seed=s, size=(128, 128)) for s in range(4)]  # ~0.6 MB of PNG each
    write(root, episodes, data_files_size_in_mb=1)
    meta = pq.read_table(os.path.join(root, "meta/episodes/chunk-000/file-000.parquet"))
    files = meta.column("data/file_index").to_pylist()
    assert files[0] == 0 and files[-1] > 0 and files == sorted(files)
    total = 0
    for episode, file_index in enumerate(files):
        table = pq.read_table(os.path.join(root, f"data/chunk-000/file-{file_index:03d}.parquet"))
        rows = [r for r in table.select(["episode_index"]).to_pylist()
                if r["episode_index"] == episode]
        total += len(rows)
    assert total == 24


def test_to_lerobot_frame_gives_what_add_frame_takes():
    episode = frames(2, seed=0)
    features = episode_features(episode)
    frame = to_lerobot_frame(episode[1], features)
    assert set(frame) == {"observation.state", "observation.images.main",
                          "observation.images.wrist", "action", "next.reward", "next.done",
                          "next.success", "intervention", "segment_id", "task"}
    for key in ("next.reward", "next.done", "next.success", "intervention", "segment_id"):
        assert isinstance(frame[key], np.ndarray) and frame[key].shape == (1,), key
        assert frame[key].dtype == np.dtype(features[key]["dtype"]), key
    assert frame["observation.images.main"].shape == (6, 5, 3)
    tensor_frame = {**episode[0], "action": torch.tensor([1.0, 2.0])}
    assert to_lerobot_frame(tensor_frame, features)["action"].tolist() == [1.0, 2.0]


# -- with LeRobot itself (Python >= 3.12: pip install 'zchannel[lerobot]') ----------------------


def _lerobot_dataset():
    datasets = pytest.importorskip("lerobot.datasets",
                                   reason="lerobot is not installed (Python >= 3.12 extra)")
    return datasets.LeRobotDataset


def test_lerobot_loads_the_written_dataset(tmp_path):
    LeRobotDataset = _lerobot_dataset()
    root = str(tmp_path / "ds")
    episodes = [frames(3, seed=0), frames(4, seed=1, task="open the drawer"), frames(2, seed=2)]
    write(root, episodes)
    dataset = LeRobotDataset("zchannel/test", root=root)
    assert (len(dataset), dataset.num_episodes, dataset.fps) == (9, 3, FPS)
    assert list(dataset.meta.episodes["dataset_from_index"]) == [0, 3, 7]
    assert list(dataset.meta.episodes["dataset_to_index"]) == [3, 7, 9]
    assert dataset.meta.camera_keys == ["observation.images.main", "observation.images.wrist"]
    flat = [(e, f) for e, episode in enumerate(episodes) for f in episode]
    for index, (episode_index, frame) in enumerate(flat):
        item = dataset[index]
        assert int(item["episode_index"]) == episode_index
        assert int(item["index"]) == index
        assert item["task"] == frame["task"]
        assert item["observation.state"].shape == (4,) and item["action"].shape == (2,)
        torch.testing.assert_close(item["observation.state"],
                                   torch.from_numpy(frame["observation.state"]))
        image = item["observation.images.main"]
        assert image.shape == (3, 6, 5)  # LeRobot's channel-first float images
        torch.testing.assert_close(
            (image * 255).round().to(torch.uint8),
            torch.from_numpy(frame["observation.images.main"]).permute(2, 0, 1))
        assert bool(item["next.done"]) == frame["next.done"]
        assert float(item["next.reward"]) == pytest.approx(frame["next.reward"])
    assert dataset.meta.stats["observation.images.main"]["mean"].shape == (3, 1, 1)


def test_lerobot_add_frame_accepts_converted_frames(tmp_path):
    LeRobotDataset = _lerobot_dataset()
    episode = frames(3, seed=0)
    features = {k: {**v, "shape": tuple(v["shape"])} for k, v in
                episode_features(episode).items()}
    dataset = LeRobotDataset.create("zchannel/own-writer", fps=FPS, root=tmp_path / "ds",
                                    features=features, use_videos=False)
    for frame in episode:
        dataset.add_frame(to_lerobot_frame(frame, features))
    dataset.save_episode()
    dataset.finalize()
    loaded = LeRobotDataset("zchannel/own-writer", root=tmp_path / "ds")
    assert len(loaded) == 3
    torch.testing.assert_close(loaded[2]["action"], torch.from_numpy(episode[2]["action"]))
