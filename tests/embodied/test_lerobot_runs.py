"""LeRobot mode from the runners: env, rollout and driver over real brokers record the toy task's
episodes, from the sync, async and decoupled runners, into a LeRobot v3 dataset read back here;
``zchannel demo embodied --mode lerobot --dataset DIR``."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from zchannel.cli.main import main as cli
from zchannel.embodied.runners import RunConfig, run

pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.timeout(240)

SPEED = 0.15  # PointReach: pos += SPEED * clip(action), clipped to [-1.5, 1.5]


def _episodes(root):
    """The dataset's frames, episode by episode (pyarrow only)."""
    rows = pq.read_table(os.path.join(root, "data/chunk-000/file-000.parquet")).to_pylist()
    meta = pq.read_table(os.path.join(root, "meta/episodes/chunk-000/file-000.parquet"))
    bounds = meta.select(["dataset_from_index", "dataset_to_index"]).to_pylist()
    return [rows[b["dataset_from_index"]:b["dataset_to_index"]] for b in bounds]


def _check_pointreach_frames(episodes):
    """Each frame pairs the observation an action was taken in with that action and the reward
    it earned: the next frame's state follows from PointReach's dynamics."""
    for episode in episodes:
        assert [f["next.done"] for f in episode] == [False] * (len(episode) - 1) + [True]
        assert len({f["next.success"] for f in episode}) == 1
        for now, nxt in zip(episode, episode[1:], strict=False):
            state, action = np.float32(now["observation.state"]), np.float32(now["action"])
            moved = np.clip(state[:2] + SPEED * np.clip(action, -1, 1), -1.5, 1.5)
            np.testing.assert_allclose(np.float32(nxt["observation.state"])[:2], moved,
                                       atol=1e-5)
            gained = 10 * (np.linalg.norm(state[2:]) - np.linalg.norm(
                np.float32(nxt["observation.state"])[2:]))
            assert now["next.reward"] == pytest.approx(gained, abs=1e-4)


@pytest.mark.parametrize("runner", ["sync", "async",
                                    pytest.param("decoupled", marks=pytest.mark.slow)])
def test_every_runner_records_a_lerobot_dataset_over_brokers(runner, tmp_path):
    root = str(tmp_path / "ds")
    cfg = RunConfig(runner=runner, mode="lerobot", envs=2, env_batch=3, steps=3, seed=1,
                    dataset=root)
    result = run(cfg)
    records = result["records"]
    assert [r["version"] for r in records] == [1, 2, 3]
    for r in records:  # every episode the envs finished in a step is recorded in that step
        assert r["episodes_recorded"] == r["episodes"] > 0
        assert r["frames_recorded"] == pytest.approx(r["episodes"] * r["episode_length"])
        assert r["policy_lag"] is None
    summary = result["dataset"]
    assert summary.root == root
    assert summary.episodes == sum(r["episodes"] for r in records)
    assert summary.frames == sum(r["frames_recorded"] for r in records)
    info = json.load(open(os.path.join(root, "meta/info.json")))
    assert info["total_episodes"] == summary.episodes and info["fps"] == 10
    assert info["features"]["observation.state"]["shape"] == [4]
    assert info["features"]["action"]["shape"] == [2]
    episodes = _episodes(root)
    assert len(episodes) == summary.episodes
    assert [f["episode_index"] for e in episodes for f in e] == [
        i for i, e in enumerate(episodes) for _ in e]
    assert [f["index"] for e in episodes for f in e] == list(range(summary.frames))
    _check_pointreach_frames(episodes)


def test_without_a_dataset_the_episodes_are_returned():
    cfg = RunConfig(mode="lerobot", transport="inproc", envs=2, env_batch=2, steps=2, seed=2,
                    lerobot_only_success=True)
    result = run(cfg)
    episodes = result["recorded_episodes"]
    assert "dataset" not in result
    assert len(episodes) == sum(r["episodes_recorded"] for r in result["records"])
    assert all(f["next.success"] for e in episodes for f in e)  # only successes kept
    assert all(len(e) <= 16 for e in episodes)  # PointReach's time limit is 16 steps
    assert all(e[-1]["next.done"] and [f["frame_index"] for f in e] == list(range(len(e)))
               for e in episodes)


def test_lerobot_run_configuration_is_checked():
    with pytest.raises(ValueError, match="actors must be 1"):
        RunConfig(mode="lerobot", actors=2)
    with pytest.raises(ValueError, match="lerobot mode only"):
        RunConfig(mode="rollout", dataset="out")
    with pytest.raises(ValueError, match="'rollout', 'pipeline' or 'lerobot'"):
        RunConfig(mode="replay")


def test_demo_writes_the_dataset_and_says_where(tmp_path):
    root = tmp_path / "demo-ds"
    root.mkdir()
    (root / "old.txt").write_text("an earlier recording")
    args = ["demo", "embodied", "--mode", "lerobot", "--dataset", str(root), "--steps", "2",
            "--envs", "1", "--env-batch", "2", "--quiet"]
    refused = CliRunner().invoke(cli, args)  # refused before anything starts
    assert refused.exit_code != 0 and "--overwrite" in refused.output
    assert os.listdir(root) == ["old.txt"]
    result = CliRunner().invoke(cli, [*args, "--overwrite"])
    assert result.exit_code == 0, result.output
    assert f"LeRobot v3.0 dataset written to {root}" in result.output
    info = json.load(open(root / "meta" / "info.json"))
    assert info["total_episodes"] > 0 and info["codebase_version"] == "v3.0"
    assert sorted(os.listdir(root)) == ["data", "meta"]
    assert os.listdir(tmp_path) == ["demo-ds"]  # no staging directory left


def test_a_camera_only_env_records_episodes_without_a_state(tmp_path):
    """TwoCameraReach with its state leaf dropped (``obs_map``): the frames hold the two
    cameras and no ``observation.state``, and the dataset has no such feature."""
    pytest.importorskip("gymnasium")
    root = str(tmp_path / "cams")
    cfg = RunConfig(env="gym:zchannel.embodied.toyenvs:TwoCameraReach-v0",
                    env_kwargs={"size": 16, "max_steps": 4}, obs_map={"state": None},
                    mode="lerobot", transport="inproc", envs=1, env_batch=2, steps=2,
                    num_chunks=4, num_action_chunks=1, seed=3, dataset=root)
    result = run(cfg)
    records = result["records"]
    assert all(r["episodes_recorded"] == r["episodes"] > 0 for r in records)
    info = json.load(open(os.path.join(root, "meta/info.json")))
    assert info["total_episodes"] == sum(r["episodes"] for r in records)
    features = info["features"]
    assert "observation.state" not in features
    assert features["observation.images.main"]["shape"] == [16, 16, 3]
    assert features["observation.images.wrist"]["shape"] == [16, 16, 3]
    assert all(1 <= len(e) <= 4 for e in _episodes(root))  # max_steps (or success) ends each


@pytest.mark.parametrize("obs_map, refused", [
    ({"state": None, "wrist": "top_images"}, "image 'top_images' of env "),
    ({"wrist": "image"}, "records the main camera from 'main_images' already"),
])
def test_a_camera_lerobot_mode_would_not_record_is_refused_before_the_run(tmp_path, obs_map,
                                                                          refused):
    """An image key that is no recorded camera (or a second key for one camera) would leave the
    camera out of every frame (a camera-only env would record nothing): refused, naming the key
    and the keys that are recorded, before anything starts."""
    pytest.importorskip("gymnasium")
    root = tmp_path / "cams"
    cfg = RunConfig(env="gym:zchannel.embodied.toyenvs:TwoCameraReach-v0",
                    env_kwargs={"size": 16, "max_steps": 4}, obs_map=obs_map, mode="lerobot",
                    transport="inproc", envs=1, env_batch=2, steps=1, num_chunks=4,
                    num_action_chunks=1, dataset=str(root))
    with pytest.raises(ValueError, match="would not be recorded") as err:
        run(cfg)
    assert refused in str(err.value)
    assert "'main_images'" in str(err.value) and "obs_map" in str(err.value)
    assert os.listdir(tmp_path) == []  # nothing started, nothing written
    result = CliRunner().invoke(cli, [
        "demo", "embodied", "--mode", "lerobot", "--env", cfg.env, "--env-kwargs",
        json.dumps(cfg.env_kwargs), "--obs-map", json.dumps(obs_map), "--steps", "1",
        "--quiet"])
    assert result.exit_code != 0 and refused in result.output, result.output
