"""LeRobot episode recording from action chunks (docs/embodied.md: "LeRobot mode").

``LeRobotEpisodeAccumulator`` decodes each action chunk of one logical source into per-step,
per-environment records, runs the per-env recording state machine (``record_reset``,
``pre_record``, ``segment_advance``, the pending reset seed of auto-resetting environments) and
collects finished episodes as lists of LeRobot frame dicts.  The accumulator persists across
training steps, so unfinished episodes carry over; ``drain_episodes`` hands out only the
finished ones.

It is a facade over two parts: ``_ChunkDecoder`` checks a chunk's inputs and turns it into
``(env, step record)`` pairs; ``_EpisodeRecorder`` runs the state machine on them, buffers each
env's open episode and writes the finished ones as LeRobot frames (built by ``_build_frame``).

``policy_output`` is read through attribute access only (``forward_inputs`` and
``intervene_flags``), so any object with those attributes works.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["CAMERA_KEYS", "LeRobotEpisodeAccumulator", "camera_of"]

_MAIN_KEYS = ("main_images", "image", "full_image")
_WRIST_KEYS = ("wrist_images", "wrist_image")
_EXTRA_KEYS = ("extra_view_images", "extra_view_image")
_CAMERAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("main", _MAIN_KEYS),
    ("wrist", _WRIST_KEYS),
    ("extra_view", _EXTRA_KEYS),
)
CAMERA_KEYS = _MAIN_KEYS + _WRIST_KEYS + _EXTRA_KEYS  # the image keys a frame records


def camera_of(key: str) -> str | None:
    """The recorded camera (``main``, ``wrist``, ``extra_view``) of the observation image key
    ``key``; None for a key no frame records."""
    return next((camera for camera, keys in _CAMERAS if key in keys), None)


_SUCCESS_KEYS = ("success_once", "success_at_end", "success")
_FINAL_KEYS = ("final_observation", "final_info")
_UNKNOWN_TASK = "unknown task"


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _truthy(value: Any) -> bool:
    """``any()`` over a scalar, tensor, array or list; None is False."""
    if value is None:
        return False
    if isinstance(value, (bool, int, float, np.bool_)):
        return bool(value)
    arr = _to_numpy(value)
    return bool(arr.any()) if arr.size else False


def _leading(value: Any) -> int | None:
    """The leading (batch) dim of a tensor/array/list, or None."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return int(value.shape[0]) if value.ndim >= 1 else None
    if isinstance(value, (list, tuple)):
        return len(value)
    return None


def _slice_env(value: Any, index: int, num_envs: int) -> Any:
    """Env ``index`` of ``value``: tensors/arrays with leading dim B and lists of length B are
    indexed, dicts recursively; everything else is shared."""
    if isinstance(value, Mapping):
        return {k: _slice_env(v, index, num_envs) for k, v in value.items()}
    if _leading(value) == num_envs:
        return value[index]
    return value


def _strip_final(info: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k not in _FINAL_KEYS}


def _auto_reset_step(obs_b: Any, info_b: Any, action: Any, reward: float, terminated: bool,
                     done: bool) -> _Step:
    """The record of one env step without a valid-action mask: an env that auto-resets
    gives its final observation (and info) in ``info_b``, and its next episode's start."""
    step = _Step(own_obs=obs_b, obs=obs_b, info=info_b, action=action, reward=reward,
                 done=done, terminated=terminated)
    if done and isinstance(info_b, Mapping) and info_b.get("final_observation") is not None:
        step.obs = info_b["final_observation"]
        final_info = info_b.get("final_info")
        step.info = final_info if final_info is not None else _strip_final(info_b)
        step.reset_seed = (obs_b, _strip_final(info_b))
    return step


def _step_success(info: Any) -> bool:
    """First present key of success_once/success_at_end/success in info["episode"], then info."""
    if not isinstance(info, Mapping):
        return False
    containers = []
    episode = info.get("episode")
    if isinstance(episode, Mapping):
        containers.append(episode)
    containers.append(info)
    for container in containers:
        for key in _SUCCESS_KEYS:
            if container.get(key) is not None:
                return _truthy(container[key])
    return False


def _image_uint8(image: Any) -> np.ndarray:
    arr = _to_numpy(image)
    if np.issubdtype(arr.dtype, np.floating):
        if arr.size and float(np.nanmax(arr)) <= 1.0:
            arr = arr * 255.0
        arr = np.clip(np.nan_to_num(arr), 0, 255)
    return np.ascontiguousarray(arr.astype(np.uint8))


def _camera_images(camera: str, value: Any) -> dict[str, np.ndarray]:
    """``observation.images.<camera>`` entries; several images become ``<camera>_i``."""
    if isinstance(value, (list, tuple)):
        images = [_to_numpy(v) for v in value]
    else:
        arr = _to_numpy(value)
        if arr.ndim >= 4:
            images = list(arr) if arr.shape[0] != 1 else [arr[0]]
        else:
            images = [arr]
    if len(images) == 1:
        return {f"observation.images.{camera}": _image_uint8(images[0])}
    return {
        f"observation.images.{camera}_{i}": _image_uint8(image) for i, image in enumerate(images)
    }


def _task(obs: Mapping[str, Any]) -> str:
    task = obs.get("task_descriptions")
    while isinstance(task, (list, tuple)):
        task = task[0] if task else None
    if task is None:
        return _UNKNOWN_TASK
    if isinstance(task, bytes):
        return task.decode()
    return str(task)


def _executed_action(
    info: Any, action: np.ndarray | None, action_dim: int
) -> tuple[np.ndarray | None, bool]:
    """The executed action after env-recorded intervention, and the intervention flag.

    Intervention needs both ``intervene_action`` and ``intervene_flag`` in the info; it is
    any(flag).  An action with more than ``action_dim`` values uses its last slot and that
    slot's flag (the last flag, or the last ``action_dim`` flags when there is one per value).
    """
    if not isinstance(info, Mapping):
        return action, False
    expert, flag = info.get("intervene_action"), info.get("intervene_flag")
    if expert is None or flag is None:
        return action, False
    values = _to_numpy(expert).astype(np.float32).reshape(-1)
    flags = _to_numpy(flag).reshape(-1)
    if values.size > action_dim:
        if flags.size == values.size:
            flags = flags[-action_dim:]
        elif flags.size > 1:
            flags = flags[-1:]
        values = values[-action_dim:]
    intervened = bool(flags.any()) if flags.size else False
    if intervened and values.size == action_dim:
        return values, True
    return action, intervened


def _bool_array(value: Any) -> np.ndarray:
    """``value`` as a numpy bool array (non-zero is True)."""
    arr = _to_numpy(value)
    if arr.dtype != np.bool_:
        arr = arr != 0
    return arr


def _flag_at(flags: np.ndarray, b: int, s: int) -> bool:
    """Flag of env ``b`` at step ``s`` in a ``()``, ``[B]`` or ``[B, C']`` flag array; a step
    past the last column is False."""
    if flags.ndim == 0:
        return bool(flags)
    if flags.ndim == 1:
        return bool(flags[b])
    return bool(flags[b, s]) if s < flags.shape[1] else False


@dataclass
class _EnvState:
    """Recording state of one environment: the frames of its open episode."""

    frames: list[dict[str, Any]] = field(default_factory=list)
    success: bool = False
    segment_id: int = 0
    seed: tuple[Any, Any] | None = None

    def clear(self) -> None:
        self.frames = []
        self.success = False
        self.segment_id = 0


@dataclass
class _Step:
    """One decoded (step, env) record."""

    own_obs: Any
    obs: Any
    info: Any
    action: np.ndarray | None
    reward: float
    done: bool
    terminated: bool
    reset_seed: tuple[Any, Any] | None = None
    extra_success: bool = False


def _build_frame(
    obs: Any, info: Any, step: _Step, segment_id: int, action_dim: int
) -> dict[str, Any] | None:
    """The LeRobot frame of one recorded step, or None without an action or an observation.

    The observation is the state vector (``observation.state``, from ``states`` or ``state``)
    and the camera images (``observation.images.<camera>``); a camera-only env has no state and
    its frames no ``observation.state`` (LeRobot's features are whatever the frames hold).
    The per-episode keys (``next.done``, ``next.success``, ``frame_index``, ``episode_index``,
    ``timestamp``) hold placeholders until ``_EpisodeRecorder`` finishes the episode.
    """
    if not isinstance(obs, Mapping):
        return None
    state_value = obs.get("states")
    if state_value is None:
        state_value = obs.get("state")
    action, intervened = _executed_action(info, step.action, action_dim)
    if action is None:
        return None
    frame: dict[str, Any] = {}
    if state_value is not None:
        frame["observation.state"] = np.ascontiguousarray(
            _to_numpy(state_value).astype(np.float32).reshape(-1)
        )
    for camera, keys in _CAMERAS:
        for key in keys:
            if obs.get(key) is not None:
                frame.update(_camera_images(camera, obs[key]))
                break
    if not frame:
        return None
    frame.update(
        {
            "action": np.ascontiguousarray(np.asarray(action, dtype=np.float32).reshape(-1)),
            "next.reward": float(step.reward),
            "next.done": False,
            "next.success": False,
            "task": _task(obs),
            "intervention": bool(intervened),
            "segment_id": int(segment_id),
            "frame_index": 0,
            "episode_index": -1,
            "timestamp": 0.0,
        }
    )
    return frame


class _ChunkDecoder:
    """Decodes one action chunk of ``num_envs`` environments into per-(step, env) records."""

    def __init__(self, num_envs: int, num_action_chunks: int, action_dim: int) -> None:
        self.num_envs = num_envs
        self.num_action_chunks = num_action_chunks
        self.action_dim = action_dim

    def decode(
        self,
        *,
        policy_output: Any,
        rewards: Any,
        chunk_actions: Any,
        obs_list: Sequence[Mapping[str, Any]] | Mapping[str, Any],
        terminations: Any,
        truncations: Any,
        infos_list: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None,
        valid_action_mask: Any,
    ) -> Iterator[tuple[int, _Step, Any]]:
        """Yield ``(env index, step record, the env's own info)`` step by step, env by env.

        The arguments are those of ``LeRobotEpisodeAccumulator.append_chunk``; the inputs are
        checked (and ``ValueError`` raised) before the first record is yielded.
        """
        B = self.num_envs
        actions = self._normalize_actions(chunk_actions, "chunk_actions")
        if isinstance(obs_list, Mapping):
            obs_list = [obs_list]
        obs_list = list(obs_list)
        num_steps = len(obs_list)
        infos = self._normalize_infos(infos_list, num_steps)
        reward_arr = self._normalize_rewards(rewards)
        mask = self._valid_mask(valid_action_mask)
        term = self._flags(terminations, "terminations", require_2d=mask is not None)
        trunc = self._flags(truncations, "truncations", require_2d=mask is not None)
        infos = self._add_policy_intervention(policy_output, infos, term, trunc)

        if mask is not None:
            row_term = np.asarray(term.reshape(B, -1).any(axis=1))
            row_done = row_term | np.asarray(trunc.reshape(B, -1).any(axis=1))
            last_valid = [
                int(np.flatnonzero(mask[b]).max()) if mask[b].any() else -1 for b in range(B)
            ]
            completion = infos[-1] if infos else {}
            if isinstance(completion, Mapping) and completion.get("final_info") is not None:
                completion = completion["final_info"]

        for s in range(num_steps):
            for b in range(B):
                obs_b = _slice_env(obs_list[s], b, B)
                info_b = _slice_env(infos[s], b, B)
                action = None
                if actions is not None:
                    action = actions[b, min(s, actions.shape[1] - 1)]
                reward = 0.0
                if reward_arr is not None and s < reward_arr.shape[1]:
                    reward = float(reward_arr[b, s])
                if mask is not None:
                    if s >= mask.shape[1] or not mask[b, s]:
                        continue
                    done = bool(row_done[b]) and s == last_valid[b]
                    step = _Step(
                        own_obs=obs_b,
                        obs=obs_b,
                        info=info_b,
                        action=action,
                        reward=reward,
                        done=done,
                        terminated=bool(row_term[b]),
                    )
                    if done:
                        step.extra_success = _step_success(_slice_env(completion, b, B))
                else:
                    t_flag = _flag_at(term, b, s)
                    step = _auto_reset_step(obs_b, info_b, action, reward, t_flag,
                                            t_flag or _flag_at(trunc, b, s))
                yield b, step, info_b

    def _valid_mask(self, valid_action_mask: Any) -> np.ndarray | None:
        """``valid_action_mask`` as a bool ``[B, C]`` array (None stays None)."""
        if valid_action_mask is None:
            return None
        mask = _bool_array(valid_action_mask)
        if mask.shape != (self.num_envs, self.num_action_chunks):
            raise ValueError(
                f"valid_action_mask must be [B, C] = [{self.num_envs}, "
                f"{self.num_action_chunks}], got {tuple(mask.shape)}."
            )
        return mask

    def _normalize_actions(self, value: Any, name: str) -> np.ndarray | None:
        """``[B,C,A]`` float32 from ``[B,C,A]``, ``[B,D]`` or ``[B,A]``; None stays None."""
        if value is None:
            return None
        arr = _to_numpy(value).astype(np.float32)
        B, C, A = self.num_envs, self.num_action_chunks, self.action_dim
        if arr.ndim == 3:
            out = arr
        elif arr.ndim == 2 and arr.shape[1] == C * A:
            out = arr.reshape(arr.shape[0], C, A)
        elif arr.ndim == 2 and arr.shape[1] == A:
            out = arr.reshape(arr.shape[0], 1, A)
        else:
            raise ValueError(
                f"{name} must be [B, C, A], [B, C*A] or [B, A] with C={C}, A={A}, "
                f"got {tuple(arr.shape)}."
            )
        if out.shape[0] != B or out.shape[1] < 1:
            raise ValueError(f"{name} must have batch size {B}, got {tuple(arr.shape)}.")
        return out

    def _normalize_infos(self, infos_list: Any, num_steps: int) -> list[Any]:
        if infos_list is None:
            return [{} for _ in range(num_steps)]
        if isinstance(infos_list, Mapping):
            return [infos_list for _ in range(num_steps)]
        infos = list(infos_list)
        if len(infos) != num_steps:
            raise ValueError(
                f"infos_list must have one entry per observation ({num_steps}), got {len(infos)}."
            )
        return infos

    def _normalize_rewards(self, rewards: Any) -> np.ndarray | None:
        if rewards is None:
            return None
        arr = _to_numpy(rewards).astype(np.float64)
        if arr.ndim == 0:
            arr = np.full((self.num_envs, 1), float(arr))
        elif arr.ndim == 1:
            arr = arr.reshape(-1, 1)
        elif arr.ndim > 2:
            arr = arr.reshape(arr.shape[0], -1)
        if arr.shape[0] != self.num_envs:
            raise ValueError(f"rewards must have batch size {self.num_envs}, got {arr.shape}.")
        return arr

    def _flags(self, value: Any, name: str, *, require_2d: bool) -> np.ndarray:
        """Flags as a bool array of shape ``[B, C']``, ``[B]`` or ``()``."""
        B, C = self.num_envs, self.num_action_chunks
        arr = np.zeros((), dtype=bool) if value is None else _bool_array(value)
        if require_2d:
            if arr.shape != (B, C):
                raise ValueError(
                    f"A valid_action_mask requires {name} [B, C] = [{B}, {C}], "
                    f"got {tuple(arr.shape)}."
                )
            return arr
        if arr.ndim == 0:
            return arr
        if arr.ndim in (1, 2) and arr.shape[0] == B:
            return arr
        raise ValueError(f"{name} must be [B, C], [B] or a scalar with B={B}, got {arr.shape}.")

    def _flags_at_step(self, flags: np.ndarray, s: int) -> np.ndarray:
        """``[B]`` flags of step ``s`` for any flag layout."""
        return np.array([_flag_at(flags, b, s) for b in range(self.num_envs)], dtype=bool)

    def _add_policy_intervention(
        self, policy_output: Any, infos: list[Any], term: np.ndarray, trunc: np.ndarray
    ) -> list[Any]:
        """Add the policy's intervention action/flag of step s to infos that lack one."""
        if policy_output is None:
            return infos
        flags = getattr(policy_output, "intervene_flags", None)
        forward_inputs = getattr(policy_output, "forward_inputs", None) or {}
        policy_actions = (
            forward_inputs.get("action") if isinstance(forward_inputs, Mapping) else None
        )
        if flags is None or policy_actions is None:
            return infos
        actions = self._normalize_actions(policy_actions, "policy action")
        if actions is None:  # only None for None
            return infos
        flag_arr = _bool_array(flags)
        if flag_arr.ndim == 1:
            flag_arr = flag_arr.reshape(-1, 1)
        if flag_arr.ndim != 2 or flag_arr.shape[0] != self.num_envs:
            raise ValueError(
                f"policy intervene_flags must be [B, C] with B={self.num_envs}, "
                f"got {tuple(flag_arr.shape)}."
            )
        out = []
        for s, info in enumerate(infos):
            if not isinstance(info, Mapping) or "intervene_action" in info:
                out.append(info)
                continue
            step_flags = flag_arr[:, min(s, flag_arr.shape[1] - 1)].copy()
            if info.get("final_info") is not None:
                step_flags &= ~(self._flags_at_step(term, s) | self._flags_at_step(trunc, s))
            info = dict(info)
            info["intervene_action"] = actions[:, min(s, actions.shape[1] - 1)].copy()
            info["intervene_flag"] = step_flags
            out.append(info)
        return out


class _EpisodeRecorder:
    """The per-env recording state machine and the writer of finished LeRobot episodes.

    Each env's open episode is buffered in an ``_EnvState``; an episode that ends is kept (all
    of them, or only successful terminated ones with ``only_success``), gets its per-episode
    frame keys and waits in a list until ``drain``.
    """

    def __init__(self, num_envs: int, only_success: bool, action_dim: int, fps: float) -> None:
        self.only_success = only_success
        self.action_dim = action_dim
        self.fps = fps
        self._states = [_EnvState() for _ in range(num_envs)]
        self._episodes: list[list[dict[str, Any]]] = []
        self.num_emitted = 0

    def drain(self) -> list[list[dict[str, Any]]]:
        """Return the finished episodes and clear only that list (unfinished ones stay)."""
        episodes, self._episodes = self._episodes, []
        return episodes

    def open_episodes(self) -> int:
        """Environments whose episode is open (frames recorded, or a first observation kept)."""
        return sum(bool(s.frames) or s.seed is not None for s in self._states)

    def state_dict(self) -> dict[str, Any]:
        """Each env's open episode, the finished episodes not drained and the count emitted
        (the frames shared: they are not changed once recorded)."""
        return {
            "envs": [(list(s.frames), s.success, s.segment_id, s.seed) for s in self._states],
            "episodes": list(self._episodes),
            "emitted": self.num_emitted,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what ``state_dict`` returned (``ValueError`` if it does not fit)."""
        envs = state["envs"]
        if len(envs) != len(self._states):
            raise ValueError(f"a recorder state of {len(envs)} environments for "
                             f"{len(self._states)}")
        self._states = [_EnvState(list(frames), bool(success), int(segment_id), seed)
                        for frames, success, segment_id, seed in envs]
        self._episodes = list(state["episodes"])
        self.num_emitted = int(state["emitted"])

    def check_step(self, step: _Step, own_info: Any) -> None:
        """Build, and drop, every frame ``advance`` could build from ``step``'s own values: its
        observation, or the first observation it keeps for the next step, with its action
        (``ValueError`` or ``TypeError`` as ``_build_frame`` raises them)."""
        flags = own_info if isinstance(own_info, Mapping) else {}
        if _truthy(flags.get("record_reset")):
            seen = [(step.own_obs, own_info)]
        else:
            seen = [] if _truthy(flags.get("pre_record")) else [(step.obs, step.info)]
            if step.reset_seed is not None:
                seen.append(step.reset_seed)
        for obs, info in seen:
            _build_frame(obs, info, step, 0, self.action_dim)

    def advance(self, env: int, step: _Step, own_info: Any) -> None:
        """Run the state machine of env ``env`` (docs/embodied.md: "LeRobot mode") for one step."""
        state = self._states[env]
        flags = own_info if isinstance(own_info, Mapping) else {}
        if _truthy(flags.get("record_reset")):
            state.clear()
            state.seed = (step.own_obs, own_info)
            return
        if _truthy(flags.get("pre_record")):
            if step.reset_seed is not None:
                state.seed = step.reset_seed
            return
        if _truthy(flags.get("segment_advance")):
            state.segment_id += 1
        if state.seed is not None:
            obs, info = state.seed
            state.seed = None
        else:
            obs, info = step.obs, step.info
        if step.reset_seed is not None:
            state.seed = step.reset_seed
        frame = _build_frame(obs, info, step, state.segment_id, self.action_dim)
        if frame is None:
            return
        state.frames.append(frame)
        state.success = state.success or _step_success(info) or step.extra_success
        if step.done:
            if not self.only_success or (state.success and step.terminated):
                self._emit(state)
            state.clear()

    def _emit(self, state: _EnvState) -> None:
        """Fill the per-episode frame keys of ``state``'s frames and keep them as an episode."""
        episode_index = self.num_emitted
        self.num_emitted += 1
        frames = state.frames
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            frame["next.done"] = i == last
            frame["next.success"] = bool(state.success)
            frame["frame_index"] = i
            frame["episode_index"] = episode_index
            frame["timestamp"] = i / self.fps
        self._episodes.append(frames)


class LeRobotEpisodeAccumulator:
    """Turns action chunks of ``num_envs`` environments into LeRobot episodes (docs/embodied.md).

    Frames carry exactly the keys ``observation.state`` (absent for a camera-only env),
    ``observation.images.<camera>``,
    ``action``, ``next.reward``, ``next.done``, ``next.success``, ``task``, ``intervention``,
    ``segment_id``, ``frame_index``, ``episode_index`` and ``timestamp``.  ``episode_index``
    counts the episodes this accumulator emitted before (dropped episodes take none).  The
    sizes, ``only_success`` and ``fps`` are fixed at construction (read-only attributes).

    Raises ``ValueError`` for non-positive sizes or fps.
    """

    def __init__(
        self,
        num_envs: int,
        only_success: bool,
        num_action_chunks: int,
        action_dim: int,
        fps: float,
    ) -> None:
        for name, value in (
            ("num_envs", num_envs),
            ("num_action_chunks", num_action_chunks),
            ("action_dim", action_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LeRobotEpisodeAccumulator.{name} must be an int > 0: {value!r}")
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
            raise ValueError(f"LeRobotEpisodeAccumulator.fps must be > 0: {fps!r}")
        self._decoder = _ChunkDecoder(num_envs, num_action_chunks, action_dim)
        self._recorder = _EpisodeRecorder(num_envs, bool(only_success), action_dim, float(fps))

    @property
    def num_envs(self) -> int:
        """Number of environments ``B`` of every chunk."""
        return self._decoder.num_envs

    @property
    def num_action_chunks(self) -> int:
        """Actions per chunk ``C``."""
        return self._decoder.num_action_chunks

    @property
    def action_dim(self) -> int:
        """Values per action ``A``."""
        return self._decoder.action_dim

    @property
    def only_success(self) -> bool:
        """Keep only episodes that succeeded and ended by termination."""
        return self._recorder.only_success

    @property
    def fps(self) -> float:
        """Frames per second: ``timestamp = frame_index / fps``."""
        return self._recorder.fps

    @property
    def num_emitted(self) -> int:
        """Episodes emitted so far (the next ``episode_index``)."""
        return self._recorder.num_emitted

    @property
    def open_episodes(self) -> int:
        """Environments whose episode is open: its frames wait for the episode's end."""
        return self._recorder.open_episodes()

    def state_dict(self) -> dict[str, Any]:
        """What the accumulator holds between chunks: each environment's open episode (its
        frames, success, segment and kept first observation), finished episodes not drained
        and ``num_emitted`` -- plain lists, tuples and the recorded values, which a channel
        carries (a durable channel's journal writes it, docs/durability.md)."""
        return self._recorder.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back a ``state_dict`` of an accumulator of the same sizes.

        Raises ``ValueError`` when its number of environments differs.
        """
        self._recorder.load_state_dict(state)

    def drain_episodes(self) -> list[list[dict[str, Any]]]:
        """Return the finished episodes and clear only that list (unfinished ones stay)."""
        return self._recorder.drain()

    def check_chunk(self, **chunk: Any) -> None:
        """Raise what ``append_chunk(**chunk)`` would raise for this chunk's own values
        (actions, flags, infos, observations and images, each step's frame built and dropped),
        recording nothing."""
        for _env, step, own_info in self._decoder.decode(**chunk):
            self._recorder.check_step(step, own_info)

    def append_chunk(
        self,
        *,
        policy_output: Any,
        rewards: Any,
        chunk_actions: Any,
        obs_list: Sequence[Mapping[str, Any]] | Mapping[str, Any],
        terminations: Any,
        truncations: Any,
        infos_list: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None,
        valid_action_mask: Any = None,
    ) -> None:
        """Record one action chunk of all environments.

        ``chunk_actions`` is ``[B,C,A]``, ``[B,D]`` or ``[B,A]``; ``obs_list`` one observation
        dict per low-level step; ``infos_list`` one info per step or one info for all steps;
        ``terminations``/``truncations`` ``[B,C]``, ``[B]`` or scalar; ``valid_action_mask``
        bool ``[B,C]`` (then the flags must be ``[B,C]``).  ``policy_output`` (or None) supplies
        intervention metadata from ``forward_inputs["action"]`` and ``intervene_flags``.

        Raises ``ValueError`` for malformed actions, a wrong number of infos, mask/flag shapes
        that do not match, and batched values whose batch size is not ``num_envs``; then
        nothing is recorded.
        """
        records = self._decoder.decode(
            policy_output=policy_output,
            rewards=rewards,
            chunk_actions=chunk_actions,
            obs_list=obs_list,
            terminations=terminations,
            truncations=truncations,
            infos_list=infos_list,
            valid_action_mask=valid_action_mask,
        )
        for env, step, own_info in records:
            self._recorder.advance(env, step, own_info)
