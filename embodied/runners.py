"""Sync, async and decoupled runners: env, rollout and actor workers over zchannel channels.

``run(config)`` creates the four channels of a run (``<run>-requests``: env → rollout,
``<run>-actions``: rollout → env, ``<run>-trajectory``: rollout → actors, with the
``embodied_trajectory`` collector and dispatcher, ``<run>-sync``: weights, contributions and
metrics), starts the workers as processes (``multiprocessing`` spawn; ``transport="inproc"``
runs them as threads over in-process channels instead: the no-broker baseline) and collects
one record per training step.  The three runners share every part and the collector; they
differ in the rollout's ``max_staleness`` (sync 0, async 1, decoupled 2) and in the env loop's
boundary handling (decoupled: the epoch's last part carries its ``next_obs`` override and rides
on the next bootstrap request).  A worker that dies ends the run with ``WorkerDied`` naming it;
an actor's death is survived when other actors remain (rollout mode).

``mode="lerobot"`` records instead of training: the env workers attach ``episode_data`` to every
chunk, there are no actor workers, and the driver is the trajectory channel's consumer
(``recording.EpisodeRecorder``): it writes each step's episodes to ``dataset`` (a LeRobot v3
dataset, ``lerobot_writer``) or keeps them, and releases each step's version as an actor would.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from zchannel.broker import Channel
from zchannel.broker.shm import MAX_SLOTS
from zchannel.broker.wire.limits import check_settings
from zchannel.embodied.actor import ACTOR_METRICS, Actor, members_key
from zchannel.embodied.envs import ChunkedEnv, make_env
from zchannel.embodied.launch import Workers
from zchannel.embodied.lerobot import CAMERA_KEYS, camera_of
from zchannel.embodied.lerobot_writer import LeRobotDatasetWriter
from zchannel.embodied.models import ActorCritic
from zchannel.embodied.normalize import RewardScaler
from zchannel.embodied.pipeline import (
    REQUESTS_KEY,
    STOP,
    EnvLoop,
    Rollout,
    WeightPublisher,
    WeightReceiver,
)
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.policy import MLPPolicy
from zchannel.embodied.ppo import PPOConfig
from zchannel.embodied.recording import RECORDER, EpisodeRecorder
from zchannel.embodied.spaces import EnvSpec

RUNNERS = {"sync": 0, "async": 1, "decoupled": 2}  # runner -> the rollout's max_staleness
IMAGE_SHM_THRESHOLD = 64 << 10  # tensors under 64 KiB travel inline in the body anyway
ENV_METRICS = "env_metrics"
ERRORS = "errors"
# evaluation env seeds start here, above the training seeds of any run with
# seed * envs * env_batch < 2**31 (env_seed); below 2**32 for reasonable seeds, as envs that
# hand their seed to a 32-bit generator need
EVALUATION_SEED_BASE = 2**31
# the trajectory broker's liveness unless RunConfig.liveness says otherwise: heartbeats it may
# miss before its peers take it for gone.  Its collector works on a whole step in one turn (a
# pipeline-mode flush cuts every camera image of the step into micro-batches), and a broker
# loop under SCHED_BATCH on a busy host gets little CPU: such turns took 10-17 s on 2 loaded
# cores (2 camera 128x128 envs x 24 x 128 chunks); the channel default, 3, fails the run.
TRAJECTORY_LIVENESS = 30

log = logging.getLogger("zchannel.embodied")


class WorkerDied(RuntimeError):
    """A worker the run cannot go on without has died or failed: the message names the worker
    and its exception in one line; ``remote_traceback`` is the worker's traceback ("" when it
    died without raising)."""

    def __init__(self, message: str, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class RunConfig:
    runner: str = "sync"
    mode: str = "rollout"  # or "pipeline", or "lerobot": record episodes instead of training
    dataset: str = ""  # lerobot mode: write a LeRobot v3 dataset here ("": keep the episodes)
    overwrite: bool = False  # replace an existing ``dataset`` directory
    lerobot_fps: int = 10
    lerobot_only_success: bool = False
    # "rlinf": advantages normalised as RLinf does in the mode (rollout: its actor's formulas,
    # gae only; pipeline: pooled in the broker); "pooled": every estimator, pooled, in both modes
    advantage_normalization: str = "rlinf"
    envs: int = 2  # env workers (logical sources)
    env_batch: int = 32  # envs per worker
    actors: int = 1
    steps: int = 20
    seed: int = 0
    num_chunks: int = 8
    num_action_chunks: int = 2
    rollout_epochs: int = 1
    env: str = "point_reach"
    env_kwargs: dict = field(default_factory=dict)  # make_env(..., env_kwargs)
    obs_map: dict | None = None  # gym: observation leaf -> image key (docs/embodied.md)
    # "auto" (point_reach: "mlp", else "actor_critic"), "mlp", "actor_critic", or
    # "module:factory" called as factory(spec: EnvSpec, cfg: RunConfig) -> Policy
    policy: str = "auto"
    policy_kwargs: dict = field(default_factory=dict)  # ActorCritic(spec, C, **policy_kwargs)
    normalize_reward: bool = False  # env workers scale rewards (RewardScaler, gamma)
    reproducible: bool = False  # rollout: no request merging, sampling seeded per chunk key
    # requests/trajectory brokers' shared-memory threshold; None: IMAGE_SHM_THRESHOLD when the
    # env has images (camera tensors of a batch take slots; the trajectory's only while a
    # step's fit in half a pool class, else frames: _create_channels), else the channel's default
    shm_threshold: int | None = None
    # the brokers' heartbeats (seconds; heartbeats a peer may miss before it is taken for gone);
    # None: the channel's 1.0 s and 3, but TRAJECTORY_LIVENESS for the trajectory broker
    heartbeat_interval: float | None = None
    liveness: int | None = None
    transport: str = "broker"  # or "inproc": threads over in-process channels
    gamma: float = 0.95
    gae_lambda: float = 0.95
    ppo: PPOConfig = field(default_factory=PPOConfig)
    lease_timeout: float = 30.0
    run_id: str = ""

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {sorted(RUNNERS)}, got {self.runner!r}")
        if self.mode not in ("rollout", "pipeline", "lerobot"):
            raise ValueError(f"mode must be 'rollout', 'pipeline' or 'lerobot', got {self.mode!r}")
        if self.mode == "lerobot" and self.actors != 1:
            raise ValueError(f"lerobot mode records on the driver (no actors): actors must be 1, "
                             f"got {self.actors}")
        if self.advantage_normalization not in ("rlinf", "pooled"):
            raise ValueError(f"advantage_normalization must be 'rlinf' or 'pooled', got "
                             f"{self.advantage_normalization!r}")
        if self.dataset and self.mode != "lerobot":
            raise ValueError("dataset is written in lerobot mode only (mode='lerobot')")
        if self.transport not in ("broker", "inproc"):
            raise ValueError(f"transport must be 'broker' or 'inproc', got {self.transport!r}")
        for name in ("envs", "env_batch", "actors", "steps", "num_chunks", "num_action_chunks",
                     "rollout_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0 (Gymnasium needs non-negative seeds), "
                             f"got {self.seed!r}")
        check_settings({k: v for k, v in (("heartbeat_interval", self.heartbeat_interval),
                                          ("liveness", self.liveness)) if v is not None})

    def plan(self, action_dim: int) -> TrajectoryPlan:
        options = dict(
            mode=self.mode, num_sources=self.envs, source_batch_size=self.env_batch,
            num_chunks=self.num_chunks, rollout_epochs=self.rollout_epochs,
            actor_world_size=self.actors, num_action_chunks=self.num_action_chunks,
            action_dim=action_dim, adv_type="gae", gamma=self.gamma, gae_lambda=self.gae_lambda,
            auto_reset=True, reward_type="chunk_level", seed=self.seed,
            intervention_precedence="env",
            normalize_advantages=not self.ppo.minibatch_adv_norm,
            deal_by_shard=self.reproducible,  # each actor trains the same shards in every run
        )
        if self.mode == "pipeline":
            rows = self.num_chunks * self.envs * self.env_batch // self.actors
            options["micro_batch_size"] = max(1, rows // self.ppo.minibatches)
        if self.mode == "lerobot":
            options.update(lerobot_fps=self.lerobot_fps,
                           lerobot_only_success=self.lerobot_only_success)
        return TrajectoryPlan.from_options(options)

    def heartbeats(self, channel: str) -> dict[str, Any]:
        """``Channel.create``'s heartbeat arguments for the run's ``channel`` (a key of
        ``names()``): those set, and the trajectory broker's ``TRAJECTORY_LIVENESS``; none for
        in-process channels, which have no heartbeats."""
        liveness = self.liveness
        if liveness is None and channel == "trajectory":
            liveness = TRAJECTORY_LIVENESS
        given = (("heartbeat_interval", self.heartbeat_interval), ("liveness", liveness))
        return {} if self.transport == "inproc" else {k: v for k, v in given if v is not None}

    def names(self) -> dict[str, str]:
        return {k: f"{self.run_id}-{k}" for k in ("requests", "actions", "trajectory", "sync")}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _config(data: dict) -> RunConfig:
    return RunConfig(**{**data, "ppo": PPOConfig(**data["ppo"])})


_SPECS: dict[str, EnvSpec] = {}
_POLICY_LOCK = threading.Lock()


def env_spec(cfg: RunConfig) -> EnvSpec:
    """The run's ``EnvSpec`` (from a one-env instance, made once per process)."""
    key = json.dumps([cfg.env, cfg.env_kwargs, cfg.obs_map], sort_keys=True, default=str)
    if key not in _SPECS:
        env = make_env(cfg.env, 1, cfg.env_kwargs, cfg.obs_map)
        _SPECS[key] = env.spec
        close = getattr(getattr(env, "env", None), "close", None)
        if close is not None:
            close()
    return _SPECS[key]


def check_recordable(cfg: RunConfig) -> None:
    """A lerobot-mode run records every camera of the env, so each image key must be one a
    frame records (``lerobot.CAMERA_KEYS``), one per camera, and a run that writes a LeRobot
    dataset (``cfg.dataset``) needs cameras of 1 or 3 channels, what the writer stores:
    ``ValueError`` naming the image key before anything starts."""
    if cfg.mode != "lerobot":
        return
    images = env_spec(cfg).images
    recorded: dict[str, str] = {}
    for key in images:
        camera = camera_of(key)
        if camera is None or camera in recorded:
            leaf = next((leaf for leaf, target in (cfg.obs_map or {}).items() if target == key),
                        "<leaf>")
            reason = (f"records the {camera} camera from {recorded[camera]!r} already"
                      if camera is not None else f"records the image keys {list(CAMERA_KEYS)} "
                      "only")
            raise ValueError(f"image {key!r} of env {cfg.env!r} would not be recorded: lerobot "
                             f"mode {reason}; send the camera to one of them with obs_map (e.g. "
                             f"{{{leaf!r}: 'main_images'}}) or drop it (None)")
        recorded[camera] = key
    if not cfg.dataset:
        return
    for key, shape in images.items():
        if shape[-1] not in (1, 3):
            raise ValueError(f"image {key!r} of env {cfg.env!r} has {shape[-1]} channels "
                             f"(per-env shape {list(shape)}): a LeRobot dataset holds images "
                             "of 1 or 3 channels (uint8 [H, W, 3] or [H, W, 1]); drop or "
                             "convert the camera (obs_map, a wrapper) or record without dataset")


def _spaces(cfg: RunConfig) -> tuple[int, int]:
    spec = env_spec(cfg)
    return spec.state_dim, spec.action_dim


def build_policy(cfg: RunConfig) -> torch.nn.Module:
    """The run's policy, initialised from ``cfg.seed`` (the same weights in every worker; the
    global RNG is left as it was, so threads of an in-process run do not disturb each other)."""
    spec = env_spec(cfg)
    kind = cfg.policy
    if kind == "auto":
        kind = "mlp" if cfg.env == "point_reach" else "actor_critic"
    with _POLICY_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if kind == "mlp":
            if spec.action.kind != "box" or spec.images:
                raise ValueError("policy 'mlp' takes states and Box actions only; use "
                                 "'actor_critic'")
            policy: torch.nn.Module = MLPPolicy(spec.state_dim, spec.action_dim, cfg.num_action_chunks,
                               **cfg.policy_kwargs)
        elif kind == "actor_critic":
            policy = ActorCritic(spec, cfg.num_action_chunks, **cfg.policy_kwargs)
        elif ":" in kind:
            module, _, name = kind.partition(":")
            policy = getattr(importlib.import_module(module), name)(spec, cfg)
        else:
            raise ValueError(f"policy must be 'auto', 'mlp', 'actor_critic' or "
                             f"'module:factory', got {cfg.policy!r}")
    generator = getattr(policy, "generator", None)
    if isinstance(generator, torch.Generator):
        generator.manual_seed(cfg.seed)
    return policy


_policy = build_policy


def env_seed(cfg: RunConfig, rank: int) -> int:
    """The seed env worker ``rank`` resets its envs with: ``(cfg.seed * cfg.envs + rank) *
    cfg.env_batch``.  A Gymnasium vector env seeds its sub-env i with seed + i, so sub-env i of
    worker ``rank`` starts from seed ``(seed * envs + rank) * env_batch + i``: no two sub-envs
    of a run share a seed, nor do two runs of the same ``envs`` and ``env_batch`` with different
    seeds."""
    return (cfg.seed * cfg.envs + rank) * cfg.env_batch


def evaluation_seeds(cfg: RunConfig, count: int) -> list[int]:
    """Seeds for ``count`` evaluations (``evaluate``) of ``cfg.env_batch`` envs each:
    ``EVALUATION_SEED_BASE + (cfg.seed * count + i) * cfg.env_batch`` for i < ``count``.  Every
    sub-env of every evaluation gets its own seed, none shared with another run's evaluations
    (same ``env_batch``) nor with the training seeds of ``env_seed`` (those below
    ``EVALUATION_SEED_BASE``)."""
    return [EVALUATION_SEED_BASE + (cfg.seed * count + i) * cfg.env_batch for i in range(count)]


def _connect(name: str, identity: str | None = None) -> Any:
    return Channel.connect(name, identity=identity, timeout=60.0)


def _report_error(names: dict, who: str) -> None:
    """Tell the driver why worker ``who`` failed: the exception in one line, and its traceback."""
    exc = sys.exc_info()[1]
    try:
        sync = _connect(names["sync"])
        sync.put({"worker": who, "error": " ".join(f"{type(exc).__name__}: {exc}".split()),
                  "traceback": traceback.format_exc()}, key=ERRORS)
        sync.close()
    except Exception:
        pass


# ---------------------------------------------------------------------------------------------
# Worker entry points (module level: picklable for multiprocessing spawn)


def _handles(names: dict, channels: dict | None, wanted: tuple[str, ...],
             identity: str | None = None) -> list:
    """The handles passed by the driver (they bind to this worker), else connected by name."""
    if channels is not None:
        return [channels[k] for k in wanted]
    return [_connect(names[k], identity) for k in wanted]


def env_worker(data: dict, rank: int, channels: dict | None = None) -> None:
    cfg = _config(data)
    names = cfg.names()
    torch.set_num_threads(1)
    try:
        plan = cfg.plan(_spaces(cfg)[1])
        requests, actions, sync = _handles(names, channels, ("requests", "actions", "sync"))
        scaler = RewardScaler(cfg.env_batch, cfg.gamma) if cfg.normalize_reward else None
        env = ChunkedEnv(make_env(cfg.env, cfg.env_batch, cfg.env_kwargs, cfg.obs_map),
                         cfg.num_action_chunks, reward_scaler=scaler,
                         record_episodes=cfg.mode == "lerobot", name=cfg.env)
        loop = EnvLoop(env, plan, rank, requests, actions, decoupled=cfg.runner == "decoupled")
        loop.start(seed=env_seed(cfg, rank))
        for step in range(cfg.steps):
            t0, steps0 = time.monotonic(), loop.env_steps
            loop.run_step(step)
            sync.put({"rank": rank, "step": step, "env_steps": loop.env_steps - steps0,
                      "seconds": time.monotonic() - t0, **loop.env.stats.take()},
                     key=ENV_METRICS)
        loop.flush()  # decoupled: the last boundary part
        for ch in (requests, actions, sync):
            ch.close()
    except KeyboardInterrupt:  # Ctrl-C reached the whole group: the driver ends the run
        raise SystemExit(130) from None
    except BaseException:
        _report_error(names, f"env:{rank}")
        raise


def rollout_worker(data: dict, rank: int = 0, channels: dict | None = None) -> None:
    cfg = _config(data)
    names = cfg.names()
    torch.set_num_threads(1)
    try:
        plan = cfg.plan(_spaces(cfg)[1])
        policy = _policy(cfg)
        requests, actions, trajectory, sync = _handles(
            names, channels, ("requests", "actions", "trajectory", "sync"))
        rollout = Rollout(policy, plan, requests=requests, actions=actions, trajectory=trajectory,
                          weights=WeightReceiver(sync, policy, rank),
                          max_staleness=RUNNERS[cfg.runner], merge=not cfg.reproducible,
                          sample_seed=cfg.seed if cfg.reproducible else None)
        rollout.run()
        sync.put({"chunks": rollout.chunks, "lags": rollout.lags,
                  "weight_updates": rollout.weights.updates}, key="rollout_metrics")
        for ch in (requests, actions, trajectory, sync):
            ch.close()
    except KeyboardInterrupt:  # Ctrl-C reached the whole group: the driver ends the run
        raise SystemExit(130) from None
    except BaseException:
        _report_error(names, f"rollout:{rank}")
        raise


def actor_worker(data: dict, rank: int, channels: dict | None = None) -> None:
    cfg = _config(data)
    names = cfg.names()
    torch.set_num_threads(1)
    try:
        plan = cfg.plan(_spaces(cfg)[1])
        policy = _policy(cfg)
        if channels is None:
            trajectory = _connect(names["trajectory"], identity=f"actor:{rank}")
            sync = _connect(names["sync"])
        else:  # handed over by the driver: bound to this worker's identity (actor:<rank>)
            trajectory, sync = channels["trajectory"], channels["sync"]
        actor = Actor(policy, plan, cfg.ppo, rank=rank, world=cfg.actors, trajectory=trajectory,
                      sync=sync, weights=WeightPublisher(sync), seed=cfg.seed,
                      normalization="rlinf_actor" if cfg.advantage_normalization == "rlinf"
                      else "pooled", total_steps=cfg.steps)
        for step in range(cfg.steps):
            actor.train_step(step)
        if rank == min(actor.live):
            sync.put({k: v.clone() for k, v in policy.state_dict().items()}, key="final_weights")
        trajectory.close()
        sync.close()
    except KeyboardInterrupt:  # Ctrl-C reached the whole group: the driver ends the run
        raise SystemExit(130) from None
    except BaseException:
        _report_error(names, f"actor:{rank}")
        raise


# ---------------------------------------------------------------------------------------------
# The driver


class _LocalLauncher:
    """Workers as local processes (spawn) or, for ``transport="inproc"``, threads."""

    def __init__(self, inproc: bool) -> None:
        self.workers = Workers(inproc)

    def groups(self) -> tuple[list | None, Any]:
        return None, None

    def start(self, cfg: RunConfig, data: dict, channels: dict) -> Workers:
        for rank in range(cfg.envs):
            self.workers.start(f"env:{rank}", env_worker, data, rank)
        self.workers.start("rollout:0", rollout_worker, data, 0)
        for rank in range(cfg.actors if cfg.mode != "lerobot" else 0):
            self.workers.start(f"actor:{rank}", actor_worker, data, rank)
        return self.workers


def _create_channels(cfg: RunConfig, plan: TrajectoryPlan, producers: list | None = None,
                     consumers: Any = None) -> dict[str, Any]:
    names = cfg.names()
    local = cfg.transport == "inproc"
    if cfg.mode == "lerobot":  # the driver records (recording.RECORDER)
        consumers = {RECORDER.partition(":")[0]: 1}
    threshold, held = cfg.shm_threshold, cfg.shm_threshold
    images = env_spec(cfg).images
    if threshold is None and images:
        threshold = IMAGE_SHM_THRESHOLD
        # the collector holds a step's camera tensors until the step is complete: when they
        # take more than half a pool class's slots, the trajectory goes as frames (the
        # producer would otherwise wait for slots only the step's end frees)
        fits = cfg.envs * cfg.num_chunks * cfg.rollout_epochs * len(images) <= MAX_SLOTS // 2
        held = threshold if fits else 0
    shm: dict[str, Any] = {} if local or threshold is None else {"shm_threshold": threshold}
    kept: dict[str, Any] = {} if local or held is None else {"shm_threshold": held}
    return {
        "requests": Channel.create(names["requests"], local=local, **shm,
                                   **cfg.heartbeats("requests")),
        "actions": Channel.create(names["actions"], local=local, **cfg.heartbeats("actions")),
        "trajectory": Channel.create(
            names["trajectory"], collector="embodied_trajectory",
            dispatcher="embodied_trajectory", producers=producers or ["rollout"],
            consumers=consumers or {"actor": cfg.actors}, options=plan.to_options(), local=local,
            lease_timeout=cfg.lease_timeout, **kept, **cfg.heartbeats("trajectory")),
        "sync": Channel.create(names["sync"], local=local, **cfg.heartbeats("sync")),
    }


class _ActorReports:
    """Training runs: each step's report is the leading actor's metrics on the sync channel."""

    def __init__(self, sync: Any) -> None:
        self.sync = sync

    def poll(self, step: int, timeout: float) -> dict | None:
        try:
            return self.sync.get_nowait(key=ACTOR_METRICS)
        except asyncio.QueueEmpty:
            if timeout <= 0:
                return None
        try:
            return self.sync.get(key=ACTOR_METRICS, timeout=timeout)
        except TimeoutError:
            return None

    def final_weights(self) -> dict:
        return self.sync.get(key="final_weights", timeout=120)


class _Recording(EpisodeRecorder):
    """Lerobot runs: the driver records (``EpisodeRecorder``); the weights never change."""

    def final_weights(self) -> dict:
        return self.state


def _reports(cfg: RunConfig, plan: TrajectoryPlan, channels: dict,
             writer: LeRobotDatasetWriter | None) -> _ActorReports | _Recording:
    if cfg.mode != "lerobot":
        return _ActorReports(channels["sync"])
    recorder = _connect(cfg.names()["trajectory"], identity=RECORDER)
    return _Recording(recorder, plan, WeightPublisher(channels["sync"]),
                      _policy(cfg).state_dict(), writer)


def run(cfg: RunConfig, on_step: Callable[[dict], None] | None = None,
        kill: Callable[[int, Any], None] | None = None, launcher: Any = None) -> dict:
    """Run ``cfg``; call ``on_step(record)`` per training step; return the run's summary.

    When ``on_step`` returns True the run stops after that step: the workers are ended
    (processes terminated) and the summary has ``stopped_early`` True and no final weights.
    ``kill(step, workers)`` is a test hook called after each step's record; ``launcher`` starts
    the workers (default: local processes; ``ray_runner`` passes Ray worker groups).  In lerobot
    mode the summary has ``"dataset"`` (a ``DatasetSummary``) when ``cfg.dataset`` is set, else
    ``"recorded_episodes"`` (every recorded episode, in global order); an existing ``cfg.dataset`` is
    refused with ``FileExistsError`` before anything starts unless ``cfg.overwrite``.
    """
    if not cfg.run_id:
        cfg = replace(cfg, run_id=f"emb{uuid.uuid4().hex[:8]}")
    previous = _interrupt_on_stop_signals()
    try:
        return _run(cfg, on_step, kill, launcher)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupt_on_stop_signals() -> dict[int, Any]:
    """In the main thread, SIGTERM and SIGHUP that have their default action become a
    KeyboardInterrupt, so that ``timeout``, ``kill``, Slurm or Kubernetes, or a closed
    terminal, end a run as Ctrl-C does (workers stopped, channels shut down, an unfinished
    dataset removed).  The previous handlers of those installed, by signal."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    return {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGHUP)
            if signal.getsignal(signum) is signal.SIG_DFL}


def _run(cfg: RunConfig, on_step: Callable[[dict], None] | None,
         kill: Callable[[int, Any], None] | None, launcher: Any) -> dict:
    plan = cfg.plan(_spaces(cfg)[1])
    check_recordable(cfg)
    writer = LeRobotDatasetWriter(cfg.dataset, fps=cfg.lerobot_fps, overwrite=cfg.overwrite) \
        if cfg.dataset else None
    launcher = launcher or _LocalLauncher(cfg.transport == "inproc")
    producers, consumers = launcher.groups()
    channels: dict[str, Any] = {}
    records: list[dict] = []
    dead_actors: set[int] = set()
    workers = reports = None
    stopped = False
    try:
        channels = _create_channels(cfg, plan, producers, consumers)
        sync, trajectory = channels["sync"], channels["trajectory"]
        reports = _reports(cfg, plan, channels, writer)
        workers = launcher.start(cfg, cfg.to_dict(), channels)
        t_start = t_prev = time.monotonic()
        env_reports: dict[int, list] = {}
        for step in range(cfg.steps):
            actor_report = _step_reports(step, cfg, workers, sync, reports, env_reports,
                                         dead_actors)
            now = time.monotonic()
            records.append(_record(step, env_reports.pop(step), actor_report, trajectory,
                                   now - t_prev, now - t_start, cfg))
            t_prev = now
            if on_step is not None and on_step(records[-1]):
                stopped = True
                break
            if kill is not None:
                kill(step, workers)
        if stopped:
            return {"records": records, "final_weights": None, "rollout": None,
                    "config": cfg.to_dict(), "wall_s": time.monotonic() - t_start,
                    "dead_actors": sorted(dead_actors), "episodes": episodes(records),
                    "placement": None, "stopped_early": True}
        final = reports.final_weights()
        channels["requests"].put(STOP, key=REQUESTS_KEY)
        rollout_report = sync.get(key="rollout_metrics", timeout=120)
        workers.stop()
        result = {"placement": _placement(trajectory), "records": records,
                  "final_weights": final, "rollout": rollout_report, "config": cfg.to_dict(),
                  "wall_s": time.monotonic() - t_start, "dead_actors": sorted(dead_actors),
                  "episodes": episodes(records), "stopped_early": False}
        if writer is not None:
            result["dataset"] = writer.close()
        elif isinstance(reports, _Recording):
            result["recorded_episodes"] = reports.episodes
        return result
    finally:
        _end_run(writer, workers, stopped, reports, channels)


def _step_reports(step: int, cfg: RunConfig, workers: Any, sync: Any, reports: Any,
                  env_reports: dict[int, list], dead_actors: set) -> Any:
    """Wait for training step ``step``'s reports: every env's (into ``env_reports``) and the
    actors'; checks the workers meanwhile.  The actors' report."""
    actor_report = None
    while actor_report is None or len(env_reports.get(step, [])) < cfg.envs:
        _check_workers(workers, sync, dead_actors, cfg)
        envs_done = len(env_reports.get(step, [])) >= cfg.envs
        try:
            report = sync.get(key=ENV_METRICS, timeout=0.05) if not envs_done else None
            if report is not None:
                env_reports.setdefault(report["step"], []).append(report)
        except TimeoutError:
            pass
        actor_report = actor_report or reports.poll(step, 0.05 if envs_done else 0)
    return actor_report


def _end_run(writer: LeRobotDatasetWriter | None, workers: Any, stopped: bool, reports: Any,
             channels: dict[str, Any]) -> None:
    """A run's end, however it ends: an unfinished dataset aborted, the workers stopped
    (ended at once after an early stop), the channels shut down."""
    if writer is not None and not writer.closed:
        writer.abort()
    if workers is not None:
        if stopped:
            workers.abort()
        else:
            workers.stop(timeout=5)
    if isinstance(reports, _Recording):
        reports.channel.close()
    for ch in channels.values():
        try:
            ch.shutdown()
        except Exception:
            pass
    if isinstance(workers, Workers):
        workers.join_threads()


def _placement(channel: Any) -> list | None:
    """The nodes of a Ray-placed channel's brokers (None for other channels)."""
    try:
        replicas = channel.stats().get("replicas")
    except Exception:  # only informative
        return None
    return None if not replicas else [r.get("node") for r in replicas]


def _check_workers(workers: Workers, sync: Any, dead_actors: set, cfg: RunConfig) -> None:
    try:
        error = sync.get_nowait(key=ERRORS)
    except asyncio.QueueEmpty:
        error = None
    if error is not None:
        raise WorkerDied(f"worker {error['worker']} failed: {error['error']}",
                         str(error.get("traceback", "")))
    for name, how in workers.dead().items():
        group, _, rank = name.partition(":")
        if group == "actor" and cfg.mode == "rollout" and int(rank) not in dead_actors:
            dead_actors.add(int(rank))
            live = set(range(cfg.actors)) - dead_actors
            if not live:
                raise WorkerDied(f"every actor died (last: {name}, {how})")
            for peer in live:
                sync.put(("dead", int(rank)), key=members_key(peer))
            _release_consumer(cfg, name)
        elif group != "actor" or cfg.mode != "rollout":
            raise WorkerDied(f"worker {name} died ({how}); the run cannot go on without it")


def _release_consumer(cfg: RunConfig, consumer: str) -> None:
    """Make the trajectory broker see ``consumer`` leave, so that the items dealt to its private
    queue are dealt again to the live actors.  A declared consumer that died before its first
    ``get`` never joined, so its death is no departure: its items would wait for it forever and
    the survivors would wait for them.  Joining under its identity (a ``get``) and closing is
    one (the lease taken is returned on close)."""
    if cfg.transport == "inproc":
        return
    try:
        handle = _connect(cfg.names()["trajectory"], identity=consumer)
        try:
            handle.get_nowait(ack=True)
        except asyncio.QueueEmpty:
            pass
        handle.close()
    except Exception as exc:  # the broker re-deals on its own if the actor had joined
        log.warning("could not make the dead %s leave channel %r (%s): what was dealt to it "
                    "may wait for it", consumer, cfg.names()["trajectory"], exc)


def episodes(records: list[dict]) -> list[dict]:
    """Every finished episode of a run, in the order they finished: ``return``, ``length``,
    ``success`` and ``env_steps`` (the run's env steps when it finished: its env worker's count
    times the number of env workers, exact with one)."""
    out = [{"return": r, "length": n, "success": s, "env_steps": at}
           for rec in records for r, n, s, at in zip(rec["returns"], rec["lengths"],
                                                     rec["successes"], rec["finished_at"],
                                                     strict=True)]
    return sorted(out, key=lambda e: e["env_steps"])


def _record(step: int, envs: list[dict], actor: dict, trajectory: Any, step_s: float,
            wall_s: float, cfg: RunConfig) -> dict:
    returns = [r for e in envs for r in e["returns"]]
    lengths = [n for e in envs for n in e["lengths"]]
    successes = [s for e in envs for s in e["successes"]]
    finished_at = [at * cfg.envs for e in envs for at in e["at"]]
    env_steps = sum(e["env_steps"] for e in envs)
    chunks = cfg.envs * cfg.num_chunks * cfg.rollout_epochs
    try:
        stats = trajectory.stats()
        held = int(stats.get("bytes_held", 0)) + int(
            (stats.get("collector_stats") or {}).get("held_bytes", 0))
    except Exception:  # a stats failure must not end a training run
        held = None
    return {
        "step": step,
        "mean_return": sum(returns) / len(returns) if returns else None,
        "episode_length": sum(lengths) / len(lengths) if lengths else None,
        "success_rate": sum(successes) / len(successes) if successes else None,
        "episodes": len(returns),
        "returns": returns,  # every episode that finished in this step
        "lengths": lengths,
        "successes": successes,
        "finished_at": finished_at,
        "env_steps": env_steps,
        "policy_lag": actor["lag"],
        "version": actor["version"],
        "env_steps_per_s": env_steps / step_s if step_s > 0 else None,
        "chunks_per_s": chunks / step_s if step_s > 0 else None,
        "broker_bytes_held": held,
        "step_s": step_s,
        "wall_s": wall_s,
        "policy_loss": actor["policy_loss"],
        "value_loss": actor["value_loss"],
        **{k: actor[k] for k in ("episodes_recorded", "frames_recorded") if k in actor},
        "entropy": actor.get("entropy"),
        "approx_kl": actor.get("approx_kl"),
        "rows_digest": actor.get("rows_digest"),
    }


def evaluate(cfg: RunConfig, policy: torch.nn.Module, *, episodes_seed: int,
             max_chunks: int = 2000) -> dict:
    """Mean return and success rate of ``policy`` over the first episode of each of
    ``cfg.env_batch`` fresh envs reset with seed ``episodes_seed`` (in process, no channel):
    the demo's trained-versus-random comparison.

    Every env counts once, whatever its episode length: the envs are stepped until each has
    finished its first episode, and the episodes they start after it are not counted (an
    average over every finished episode would favour the envs whose episodes are short).  An
    env without a finished episode after ``max_chunks`` action chunks is left out and counted
    in ``unfinished``.  The result: ``mean_return`` (undiscounted, the env's own rewards),
    ``success_rate`` (both None when no env finished an episode: there is nothing to average),
    ``episodes`` (the envs counted) and ``unfinished``."""
    env = ChunkedEnv(make_env(cfg.env, cfg.env_batch, cfg.env_kwargs, cfg.obs_map),
                     cfg.num_action_chunks, name=cfg.env)
    env.reset(seed=episodes_seed)
    first: dict[int, tuple[float, bool]] = {}  # env row -> its first episode's return, success
    for _ in range(max_chunks):
        out = policy(env.obs)
        step = env.step_chunk(out.forward_inputs["action"].reshape(cfg.env_batch,
                                                                   cfg.num_action_chunks, -1))
        dones = step.transition.dones
        if dones is None:
            raise ValueError(f"env {cfg.env!r} gave a step without dones")
        # the chunk's episodes in the order ChunkedEnv records them: by chunk slot, then env row
        rows = [b for c in range(dones.shape[1]) for b in torch.nonzero(dones[:, c]).flatten().tolist()]
        stats = env.stats.take()
        for row, ret, success in zip(rows, stats["returns"], stats["successes"], strict=True):
            first.setdefault(row, (ret, success))
        if len(first) == cfg.env_batch:
            break
    n = len(first)
    return {"mean_return": sum(ret for ret, _ in first.values()) / n if n else None,
            "success_rate": sum(success for _, success in first.values()) / n if n else None,
            "episodes": n, "unfinished": cfg.env_batch - n}


def trained_policy(cfg: RunConfig, final_weights: dict) -> torch.nn.Module:
    policy = _policy(cfg)
    policy.load_state_dict(final_weights)
    return policy


__all__ = ["EVALUATION_SEED_BASE", "RUNNERS", "RunConfig", "WorkerDied", "build_policy",
           "check_recordable", "env_seed", "env_spec", "episodes", "evaluate",
           "evaluation_seeds", "run", "trained_policy"]
