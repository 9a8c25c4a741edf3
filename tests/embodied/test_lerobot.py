"""Tests of zchannel.embodied.lerobot: chunk decoding, state machine, frames."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from zchannel.embodied.lerobot import LeRobotEpisodeAccumulator

F, T = False, True

FRAME_KEYS = {
    "observation.state",
    "action",
    "next.reward",
    "next.done",
    "next.success",
    "task",
    "intervention",
    "segment_id",
    "frame_index",
    "episode_index",
    "timestamp",
}


def policy_output(actions, flags):
    """Anything with ``forward_inputs`` and ``intervene_flags`` works as a policy output."""
    try:
        from zchannel.embodied.types import PolicyOutput
    except ImportError:  # pragma: no cover - the types module is written by another helper
        return SimpleNamespace(
            forward_inputs={"action": torch.as_tensor(actions, dtype=torch.float32)},
            intervene_flags=torch.as_tensor(flags, dtype=torch.bool),
        )
    return PolicyOutput(
        forward_inputs={"action": torch.as_tensor(actions, dtype=torch.float32)},
        intervene_flags=torch.as_tensor(flags, dtype=torch.bool),
    )


def acc(B=1, C=1, A=1, only_success=False, fps=10):
    return LeRobotEpisodeAccumulator(
        num_envs=B, only_success=only_success, num_action_chunks=C, action_dim=A, fps=fps
    )


def states(*rows):
    """``{"states": [B, 1]}`` observation with the given per-env states."""
    return {"states": torch.tensor([[float(r)] for r in rows])}


def append(accumulator, **kw):
    B = accumulator.num_envs
    C = accumulator.num_action_chunks
    kw.setdefault("policy_output", None)
    kw.setdefault("rewards", None)
    kw.setdefault("terminations", torch.zeros(B, C, dtype=torch.bool))
    kw.setdefault("truncations", torch.zeros(B, C, dtype=torch.bool))
    kw.setdefault("infos_list", {})
    accumulator.append_chunk(**kw)


def test_constructor_rejects_non_positive_sizes():
    for kw in (
        dict(num_envs=0),
        dict(num_action_chunks=0),
        dict(action_dim=-1),
        dict(fps=0),
        dict(fps=-2.5),
    ):
        args = dict(num_envs=1, only_success=False, num_action_chunks=1, action_dim=1, fps=10)
        args.update(kw)
        with pytest.raises(ValueError):
            LeRobotEpisodeAccumulator(**args)


def test_vectorised_example():
    a = acc(B=2, C=2, A=1)
    done = torch.tensor([[F, T], [F, T]])
    append(
        a,
        chunk_actions=torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        obs_list=[states(10, 20), states(11, 21)],
        terminations=done,
        rewards=torch.tensor([[0.5, 1.5], [2.5, 3.5]]),
    )
    episodes = a.drain_episodes()
    assert len(episodes) == 2
    env0, env1 = episodes
    assert [f["action"].tolist() for f in env0] == [[1.0], [2.0]]
    assert [f["action"].tolist() for f in env1] == [[3.0], [4.0]]
    assert [f["observation.state"].tolist() for f in env0] == [[10.0], [11.0]]
    assert [f["next.reward"] for f in env1] == [2.5, 3.5]
    # emitted at step index 1, env 0 first
    assert [env0[0]["episode_index"], env1[0]["episode_index"]] == [0, 1]


def test_vectorised_example_without_dones_keeps_frames():
    a = acc(B=2, C=2, A=1)
    append(
        a,
        chunk_actions=torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        obs_list=[states(10, 20), states(11, 21)],
    )
    assert a.drain_episodes() == []
    append(
        a,
        chunk_actions=torch.tensor([[5.0, 6.0], [7.0, 8.0]]),
        obs_list=[states(12, 22), states(13, 23)],
        terminations=torch.tensor([[F, T], [F, T]]),
    )
    env0, env1 = a.drain_episodes()
    assert [f["action"].item() for f in env0] == [1.0, 2.0, 5.0, 6.0]
    assert [f["action"].item() for f in env1] == [3.0, 4.0, 7.0, 8.0]
    assert [f["frame_index"] for f in env0] == [0, 1, 2, 3]


def test_frame_keys_and_types():
    a = acc(B=2, C=1, A=2, fps=4)
    H, W = 3, 5
    obs = {
        "states": torch.arange(6, dtype=torch.float64).view(2, 3),
        "main_images": torch.full((2, H, W, 3), 0.5),
        "wrist_images": torch.full((2, 2, H, W, 3), 7.0),
        "extra_view_images": np.full((2, 1, H, W, 3), 9, dtype=np.uint8),
        "task_descriptions": ["open the drawer", "close the drawer"],
    }
    append(
        a,
        chunk_actions=torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        obs_list=[obs, obs, obs],
        rewards=torch.tensor([[1.0], [2.0]]),
        terminations=torch.tensor([F, F]),
        infos_list=[{}, {}, {"success": torch.tensor([T, F])}],
        truncations=torch.tensor([[F], [F]]),
    )
    # [B] flags: no done yet; now finish both envs
    append(
        a,
        chunk_actions=torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        obs_list=[obs],
        terminations=torch.tensor([T, T]),
    )
    episodes = a.drain_episodes()
    assert len(episodes) == 2
    cameras = {
        "observation.images.main",
        "observation.images.wrist_0",
        "observation.images.wrist_1",
        "observation.images.extra_view",
    }
    for env, episode in enumerate(episodes):
        assert len(episode) == 4
        for i, frame in enumerate(episode):
            assert set(frame) == FRAME_KEYS | cameras
            assert frame["observation.state"].dtype == np.float32
            assert frame["observation.state"].shape == (3,)
            assert frame["observation.state"].tolist() == [3.0 * env, 3.0 * env + 1, 3.0 * env + 2]
            for key in cameras:
                assert frame[key].dtype == np.uint8 and frame[key].shape == (H, W, 3)
            assert (frame["observation.images.main"] == 127).all()
            assert (frame["observation.images.wrist_1"] == 7).all()
            assert (frame["observation.images.extra_view"] == 9).all()
            assert frame["action"].dtype == np.float32 and frame["action"].shape == (2,)
            assert type(frame["next.reward"]) is float
            assert type(frame["next.done"]) is bool
            assert frame["next.done"] == (i == 3)
            assert type(frame["next.success"]) is bool
            assert frame["next.success"] == (env == 0)
            assert frame["task"] == ["open the drawer", "close the drawer"][env]
            assert type(frame["intervention"]) is bool
            assert type(frame["segment_id"]) is int
            assert type(frame["frame_index"]) is int and frame["frame_index"] == i
            assert type(frame["episode_index"]) is int and frame["episode_index"] == env
            assert type(frame["timestamp"]) is float
            assert frame["timestamp"] == i / 4
        # reward only on step 0 (s < C), 0.0 afterwards
        assert [f["next.reward"] for f in episode] == [float(env + 1), 0.0, 0.0, 0.0]


def test_unknown_task_and_state_alias():
    a = acc()
    append(
        a,
        chunk_actions=torch.tensor([[1.0]]),
        obs_list=[{"state": np.array([[4.0, 5.0]]), "image": np.zeros((1, 2, 2, 3), np.uint8)}],
        terminations=torch.tensor([[T]]),
    )
    (episode,) = a.drain_episodes()
    assert episode[0]["task"] == "unknown task"
    assert episode[0]["observation.state"].tolist() == [4.0, 5.0]
    assert "observation.images.main" in episode[0]


def test_policy_intervention_example():
    a = acc(B=1, C=2, A=1)
    append(
        a,
        chunk_actions=torch.tensor([[1.0, 2.0]]),
        obs_list=[states(0), states(1)],
        policy_output=policy_output([[9.0, 8.0]], [[F, T]]),
        terminations=torch.tensor([[F, T]]),
    )
    (episode,) = a.drain_episodes()
    assert [f["action"].item() for f in episode] == [1.0, 8.0]
    assert [f["intervention"] for f in episode] == [F, T]


def test_env_recorded_intervention_takes_precedence():
    a = acc(B=1, C=2, A=1)
    info = {"intervene_action": torch.tensor([[5.0]]), "intervene_flag": torch.tensor([T])}
    append(
        a,
        chunk_actions=torch.tensor([[1.0, 2.0]]),
        obs_list=[states(0), states(1)],
        policy_output=policy_output([[9.0, 8.0]], [[F, T]]),
        infos_list=[info, {}],
        terminations=torch.tensor([[F, T]]),
    )
    (episode,) = a.drain_episodes()
    assert [f["action"].item() for f in episode] == [5.0, 8.0]
    assert [f["intervention"] for f in episode] == [T, T]


def test_intervention_with_more_than_a_values_uses_last_slot():
    a = acc(B=1, C=2, A=2)
    info = {
        "intervene_action": np.array([[[1.0, 1.0], [7.0, 6.0]]]),  # [B, C, A]
        "intervene_flag": np.array([[F, T]]),
    }
    append(
        a,
        chunk_actions=torch.tensor([[0.0, 0.0, 3.0, 3.0]]),
        obs_list=[states(0)],
        infos_list=[info],
        terminations=torch.tensor([[T, F]]),
    )
    (episode,) = a.drain_episodes()
    assert episode[0]["action"].tolist() == [7.0, 6.0]
    assert episode[0]["intervention"] is True
    info["intervene_flag"] = np.array([[T, F]])  # the last slot's flag is False
    append(
        a,
        chunk_actions=torch.tensor([[0.0, 0.0, 3.0, 3.0]]),
        obs_list=[states(0)],
        infos_list=[info],
        terminations=torch.tensor([[T, F]]),
    )
    (episode,) = a.drain_episodes()
    assert episode[0]["action"].tolist() == [0.0, 0.0]
    assert episode[0]["intervention"] is False


def auto_reset_chunks(a, *, first_success=True, first_termination=True):
    append(
        a,
        chunk_actions=torch.tensor([[1.0]]),
        obs_list=[states(100)],
        terminations=torch.tensor([[first_termination]]),
        truncations=torch.tensor([[not first_termination]]),
        infos_list=[
            {
                "final_observation": states(10),
                "final_info": {"success": torch.tensor([first_success])},
            }
        ],
    )
    first = a.drain_episodes()
    append(a, chunk_actions=torch.tensor([[2.0]]), obs_list=[states(101)])
    return first


def test_auto_reset_example():
    a = acc()
    (episode,) = auto_reset_chunks(a)
    assert len(episode) == 1
    frame = episode[0]
    assert frame["observation.state"].tolist() == [10.0]
    assert frame["action"].tolist() == [1.0]
    assert frame["next.done"] is True and frame["next.success"] is True
    # chunk 2: the first frame of the next episode has the seed state and the new action
    append(
        a,
        chunk_actions=torch.tensor([[3.0]]),
        obs_list=[states(102)],
        terminations=torch.tensor([[T]]),
    )
    (episode,) = a.drain_episodes()
    assert [f["observation.state"].item() for f in episode] == [100.0, 102.0]
    assert [f["action"].item() for f in episode] == [2.0, 3.0]
    assert [f["episode_index"] for f in episode] == [1, 1]
    assert [f["next.success"] for f in episode] == [False, False]


def test_only_success_drops_failed_termination_and_successful_truncation():
    a = acc(only_success=True)
    assert auto_reset_chunks(a, first_success=False, first_termination=True) == []
    b = acc(only_success=True)
    assert auto_reset_chunks(b, first_success=True, first_termination=False) == []
    c = acc(only_success=True)
    (episode,) = auto_reset_chunks(c, first_success=True, first_termination=True)
    assert episode[0]["episode_index"] == 0
    # dropped episodes take no index
    append(
        b,
        chunk_actions=torch.tensor([[3.0]]),
        obs_list=[states(5)],
        terminations=torch.tensor([[T]]),
        infos_list=[{"episode": {"success_once": torch.tensor([T])}}],
    )
    (episode,) = b.drain_episodes()
    assert episode[0]["episode_index"] == 0
    assert len(episode) == 2 and episode[-1]["next.success"] is True


def test_policy_flag_and_not_done_with_final_info():
    """At a done step whose info has final_info, the policy flag is AND'ed with ¬done."""
    a = acc(B=1, C=1, A=1)
    append(
        a,
        chunk_actions=torch.tensor([[1.0]]),
        obs_list=[states(100)],
        policy_output=policy_output([[9.0]], [[T]]),
        terminations=torch.tensor([[T]]),
        infos_list=[{"final_observation": states(10), "final_info": {"success": [T]}}],
    )
    (episode,) = a.drain_episodes()
    assert episode[0]["action"].item() == 1.0 and episode[0]["intervention"] is False
    # the seed info carries the AND'ed (False) flag into the next frame
    append(
        a,
        chunk_actions=torch.tensor([[2.0]]),
        obs_list=[states(101)],
        terminations=torch.tensor([[T]]),
    )
    (episode,) = a.drain_episodes()
    assert episode[0]["observation.state"].item() == 100.0
    assert episode[0]["action"].item() == 2.0 and episode[0]["intervention"] is False


def test_recording_controls():
    """record_reset (state 10), then a terminated segment_advance step (state 20, action 3)."""
    a = acc(B=1, C=2, A=1)
    append(
        a,
        chunk_actions=torch.tensor([[1.0, 2.0]]),
        obs_list=[states(5), states(6)],
    )
    append(
        a,
        chunk_actions=torch.tensor([[9.0, 3.0]]),
        obs_list=[states(10), states(20)],
        terminations=torch.tensor([[F, T]]),
        infos_list=[{"record_reset": True}, {"segment_advance": True}],
    )
    (episode,) = a.drain_episodes()
    assert len(episode) == 1
    frame = episode[0]
    assert frame["observation.state"].tolist() == [10.0]
    assert frame["action"].tolist() == [3.0]
    assert frame["segment_id"] == 1
    assert frame["next.done"] is True and frame["frame_index"] == 0


def test_pre_record_seeds_reset_observation():
    a = acc()
    append(
        a,
        chunk_actions=torch.tensor([[1.0]]),
        obs_list=[states(100)],
        terminations=torch.tensor([[T]]),
        infos_list=[
            {"pre_record": [T], "final_observation": states(10), "final_info": {"success": [T]}}
        ],
    )
    assert a.drain_episodes() == []  # no frame, so the done does not close an episode
    append(a, chunk_actions=torch.tensor([[2.0]]), obs_list=[states(7)], terminations=[[T]])
    (episode,) = a.drain_episodes()
    assert [f["observation.state"].item() for f in episode] == [100.0]


def test_unfinished_episodes_persist_across_drains():
    a = acc(B=2, C=1, A=1)
    for step in range(3):
        append(
            a,
            chunk_actions=torch.tensor([[float(step)], [float(10 + step)]]),
            obs_list=[states(step, 10 + step)],
            terminations=torch.tensor([[F], [step == 0]]),
        )
        drained = a.drain_episodes()
        if step == 0:
            assert len(drained) == 1 and drained[0][0]["action"].item() == 10.0
        else:
            assert drained == []
    append(
        a,
        chunk_actions=torch.tensor([[3.0], [13.0]]),
        obs_list=[states(3, 13)],
        terminations=torch.tensor([[T], [T]]),
    )
    env0, env1 = a.drain_episodes()
    assert [f["action"].item() for f in env0] == [0.0, 1.0, 2.0, 3.0]
    assert [f["action"].item() for f in env1] == [11.0, 12.0, 13.0]
    assert {f["episode_index"] for f in env0} == {1}
    assert {f["episode_index"] for f in env1} == {2}
    assert a.num_emitted == 3


def test_valid_action_mask():
    a = acc(B=2, C=3, A=1)
    append(
        a,
        chunk_actions=torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),
        obs_list=[states(0, 10), states(1, 11), states(2, 12)],
        valid_action_mask=torch.tensor([[T, T, F], [T, T, T]]),
        terminations=torch.tensor([[F, F, T], [F, F, F]]),
        truncations=torch.zeros(2, 3, dtype=torch.bool),
        infos_list=[{}, {}, {"final_info": {"success": torch.tensor([T, F])}}],
    )
    (episode,) = a.drain_episodes()
    # env 0: the third slot is masked out, done lands on the last valid slot
    assert [f["action"].item() for f in episode] == [1.0, 2.0]
    assert [f["next.done"] for f in episode] == [F, T]
    assert episode[0]["next.success"] is True  # completion info of infos[-1]["final_info"]
    append(
        a,
        chunk_actions=torch.tensor([[0.0, 0.0, 0.0], [7.0, 8.0, 9.0]]),
        obs_list=[states(0, 13), states(0, 14), states(0, 15)],
        valid_action_mask=torch.tensor([[F, F, F], [T, F, F]]),
        terminations=torch.zeros(2, 3, dtype=torch.bool),
        truncations=torch.tensor([[F, F, F], [F, T, F]]),
        infos_list={},
    )
    (episode,) = a.drain_episodes()
    assert [f["action"].item() for f in episode] == [4.0, 5.0, 6.0, 7.0]
    assert episode[-1]["next.done"] is True and episode[-1]["next.success"] is False


def test_chunk_decoding_errors():
    a = acc(B=1, C=2, A=2)
    with pytest.raises(ValueError):
        append(a, chunk_actions=torch.zeros(1, 3), obs_list=[states(0)])
    with pytest.raises(ValueError):
        append(a, chunk_actions=torch.zeros(1, 2, 2, 2).view(1, -1, 2, 2)[0], obs_list=[states(0)])
    with pytest.raises(ValueError):
        append(a, chunk_actions=torch.zeros(1, 4), obs_list=[states(0)], infos_list=[{}, {}])
    with pytest.raises(ValueError):
        append(
            a,
            chunk_actions=torch.zeros(1, 4),
            obs_list=[states(0)],
            valid_action_mask=torch.ones(1, 2, dtype=torch.bool),
            terminations=torch.zeros(1, dtype=torch.bool),
        )
    # [B, A] actions are one slot: every step reuses it
    append(
        a,
        chunk_actions=torch.tensor([[5.0, 6.0]]),
        obs_list=[states(0), states(1)],
        terminations=torch.tensor([[F, T]]),
    )
    (episode,) = a.drain_episodes()
    assert [f["action"].tolist() for f in episode] == [[5.0, 6.0], [5.0, 6.0]]
