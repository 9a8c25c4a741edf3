"""The producer side of the trajectory contract: Env → PolicyInput → Rollout → PolicyPart/EnvPart.

``EnvLoop`` drives one env worker (one logical source, ``B`` envs): for every chunk it sends a
``PolicyInput`` (observation, the chunk's ``TrajectoryKey``, the previous chunk's ``EnvPart``)
on the requests channel, waits for the action chunk on its own key of the actions channel,
executes it and builds the chunk's ``EnvPart``.

``Rollout`` serves those requests: it runs the policy, sends the actions back, publishes the
``PolicyPart`` and completes and publishes every attached ``EnvPart`` (``complete_env_part``) on
the trajectory channel, of which it is the only producer.  Weights arrive from the actors on the
weights channel (``WeightPublisher`` / ``WeightReceiver``; tensors travel as frames) and every
``PolicyOutput`` is stamped with the version that produced it.

The three runners differ only in two knobs of these loops (``docs/embodied.md``):
``max_staleness`` (how many versions the rollout may lag behind the step it collects: sync 0,
async 1, decoupled 2) and ``decoupled`` (an epoch's last ``EnvPart`` carries an explicit
``next_obs`` boundary override and rides on the next epoch's bootstrap request instead of an
``is_last`` request).

A rollout that fails (a ``HookError`` from the trajectory channel, a policy error) tells every
env worker at once: it puts a ``RolloutFailure`` on each env's actions key before it raises,
and the env loop waiting there raises it (``HookError`` stays ``HookError``) instead of waiting
out its reply timeout.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from zchannel.broker import DEFAULT_KEY, HookError
from zchannel.embodied.checks import check_env_part, check_policy_part
from zchannel.embodied.envs import ChunkedEnv
from zchannel.embodied.plan import TrajectoryPlan
from zchannel.embodied.policy import chunk_actions, stamp_version
from zchannel.embodied.spaces import ObservationError, RewardError
from zchannel.embodied.types import (
    COLUMN_STRIDE,
    EnvPart,
    EnvTransition,
    PolicyInput,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectorySource,
)

REQUESTS_KEY = "requests"
MAX_INFLIGHT = 64  # a rollout's unacknowledged puts
WEIGHTS_KEY = "weights"
WEIGHTS_POLL_S = 0.02  # a rollout that has the weights it needs looks for newer ones this often
STOP = "stop"
ROLLOUT_FAILURE = "rollout_failure"
RLT_FEATURES = {"rlt_transition_z_rl": "z_rl", "rlt_transition_proprio": "proprio",
                "rlt_transition_ref_chunk": "ref_chunk"}


def actions_key(env_rank: int) -> str:
    """The key on the actions channel where env worker ``env_rank`` receives its chunks."""
    return f"actions:{env_rank}"


def weights_key(rollout_rank: int) -> str:
    return f"{WEIGHTS_KEY}:{rollout_rank}"


class RolloutFailed(RuntimeError):
    """The rollout an env worker depends on failed with an error other than a ``HookError``."""


@dataclass
class RolloutFailure:
    """What a failing rollout puts on each env's actions key instead of an action chunk (as the
    plain dict ``to_message()``: ``{"rollout_failure": {fields}}``).

    ``error_type`` is the exception's class name; ``exc_type`` and ``remote_traceback`` are a
    ``HookError``'s own (the collector's exception type and traceback), empty otherwise.
    """

    error_type: str
    message: str
    exc_type: str = ""
    remote_traceback: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> RolloutFailure:
        if isinstance(exc, HookError):
            return cls("HookError", str(exc), exc.exc_type, exc.remote_traceback)
        return cls(type(exc).__name__, str(exc), "",
                   "".join(traceback.format_exception(exc)))

    def to_message(self) -> dict[str, dict[str, str]]:
        return {ROLLOUT_FAILURE: asdict(self)}

    @classmethod
    def from_message(cls, message: Any) -> RolloutFailure | None:
        """The failure a reply carries, or None for an action chunk."""
        if isinstance(message, dict) and isinstance(message.get(ROLLOUT_FAILURE), dict):
            return cls(**message[ROLLOUT_FAILURE])
        return None

    def error(self) -> Exception:
        """The exception the env loop raises: a ``HookError`` as it was, else ``RolloutFailed``."""
        if self.error_type == "HookError":
            return HookError(self.message, self.exc_type, self.remote_traceback)
        return RolloutFailed(f"the rollout failed: {self.error_type}: {self.message}")


# ---------------------------------------------------------------------------------------------
# Completion (spec: producer protocol, completion and terminal inference)


def rlt_features(forward_inputs: dict[str, Any], key: Any) -> dict[str, Any]:
    """The RLT next-state features of a forward-input dict: only ``z_rl``, ``proprio`` and
    ``ref_chunk`` (renamed from ``rlt_transition_*``), never the whole dict."""
    missing = [name for name in RLT_FEATURES if name not in forward_inputs]
    if missing:
        raise ValueError(f"EnvPart {key}: RLT completion needs forward_inputs {missing}")
    return {short: forward_inputs[name] for name, short in RLT_FEATURES.items()}


def complete_env_part(
    part: EnvPart,
    request_obs: dict[str, Any] | None,
    infer: Callable[[dict[str, Any]], PolicyOutput],
    plan: TrajectoryPlan,
    request_output: PolicyOutput | None = None,
) -> EnvPart:
    """Complete ``part``, carried by a request whose observation is ``request_obs`` (and whose
    own inference, if any, gave ``request_output``).

    The effective next observation is ``part.next_obs`` (a boundary override) if set, else
    ``request_obs``.  When the part requires inference the policy runs on it and its values
    become ``final_prev_values`` (hence ``bootstrap_values``); with ``enable_rlt`` the three RLT
    features come from that inference, else from ``request_output``.  ``next_obs`` is kept only
    when ``collect_transitions`` without RLT.
    """
    key = part.sources[0].key if part.sources else None
    next_obs = part.next_obs if part.next_obs is not None else request_obs
    final_values = rlt = None
    if part.requires_inference:
        if next_obs is None:
            raise ValueError(f"EnvPart {key}: terminal inference needs next_obs (none on the "
                             "part or its request)")
        terminal = infer(next_obs)
        final_values = terminal.prev_values
        if plan.enable_rlt:
            rlt = rlt_features(terminal.forward_inputs, key)
    elif plan.enable_rlt:
        if request_output is None:
            raise ValueError(f"EnvPart {key}: RLT completion needs the carrying request's "
                             "inference")
        rlt = rlt_features(request_output.forward_inputs, key)
    keep = next_obs if plan.collect_transitions and not plan.enable_rlt else None
    return part.complete(next_obs=keep, next_rlt_obs=rlt, final_prev_values=final_values)


# ---------------------------------------------------------------------------------------------
# Weight sync


class WeightPublisher:
    """Actor side: put ``{"version", "state"}`` (a state dict: tensors go as frames) on each
    rollout worker's weights key."""

    def __init__(self, channel: Any, rollout_ranks: int = 1) -> None:
        self.channel, self.rollout_ranks = channel, rollout_ranks

    def publish(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Publish; returns the bytes of tensor data sent per rollout worker."""
        state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        for r in range(self.rollout_ranks):
            self.channel.put({"version": int(version), "state": state}, key=weights_key(r))
        return sum(v.numel() * v.element_size() for v in state.values())


class WeightReceiver:
    """Rollout side: load the newest published weights into ``model`` and track ``version``."""

    def __init__(self, channel: Any, model: torch.nn.Module, rank: int = 0) -> None:
        self.channel, self.model, self.key = channel, model, weights_key(rank)
        self.version = 0
        self.updates = 0
        self.polled = 0.0  # time.monotonic() of the last poll

    def _load(self, message: dict) -> None:
        if message["version"] > self.version:
            self.model.load_state_dict(message["state"])
            self.version = message["version"]
            self.updates += 1

    def poll(self) -> int:
        """Take every waiting update (keep the newest); return the current version."""
        self.polled = time.monotonic()
        while True:
            try:
                message = self.channel.get_nowait(key=self.key)
            except asyncio.QueueEmpty:
                return self.version
            self._load(message)

    def wait_for(self, version: int, timeout: float = 600.0, quiet: bool = False) -> int:
        """Block until the loaded version is at least ``version``; ``TimeoutError`` after
        ``timeout`` seconds (``quiet=True``: return the version reached instead)."""
        deadline = time.monotonic() + timeout
        self.poll()
        while self.version < version:
            left = deadline - time.monotonic()
            if left <= 0:
                if quiet:
                    break
                raise TimeoutError(f"no weights of version {version} within {timeout}s "
                                   f"(have {self.version})")
            try:
                self._load(self.channel.get(key=self.key, timeout=min(left, 0.5)))
            except TimeoutError:
                pass
        return self.version


# ---------------------------------------------------------------------------------------------
# Env side


@dataclass
class EnvLoop:
    """One env worker: source ``(env_rank, stage_id=0)`` of ``plan.source_batch_size`` envs."""

    env: ChunkedEnv
    plan: TrajectoryPlan
    env_rank: int
    requests: Any  # channel handle: PolicyInput -> Rollout (key REQUESTS_KEY)
    actions: Any  # channel handle: action chunks <- Rollout (key actions_key(env_rank))
    decoupled: bool = False
    reply_timeout: float = 600.0
    env_steps: int = 0
    _pending: EnvPart | None = field(default=None, init=False, repr=False)
    _boundary: EnvTransition | None = field(default=None, init=False, repr=False)
    _sent: Any = field(default=None, init=False, repr=False)  # the Work of the last request put

    def start(self, seed: int) -> None:
        try:
            self.env.reset(seed=seed)
        except ObservationError as exc:
            raise ObservationError(f"env rank {self.env_rank}, reset: {exc}") from None
        B, C = self.plan.source_batch_size, self.plan.num_action_chunks
        false = torch.zeros(B, C, dtype=torch.bool)
        self._boundary = EnvTransition(dones=false, terminations=false, truncations=false)

    def _send(self, request: PolicyInput) -> None:
        # asynchronous: the reply to this request proves its arrival; a failed put raises at
        # the next send (or at ``flush``)
        if self._sent is not None:
            self._sent.wait()
        self._sent = self.requests.put(request, key=REQUESTS_KEY, async_op=True)

    def run_step(self, step_id: int) -> None:
        """Collect every epoch of training step ``step_id``."""
        plan = self.plan
        for epoch in range(plan.rollout_epochs):
            for chunk in range(plan.num_chunks):
                key = TrajectoryKey(step_id, epoch, self.env_rank, 0, chunk)
                sources = [TrajectorySource(key, plan.source_batch_size, 0)]
                self._send(PolicyInput(obs=self.env.obs, sources=sources,
                                       env_parts=[self._pending],
                                       request_sizes=[plan.source_batch_size]))
                self._pending = None
                actions = self.actions.get(key=actions_key(self.env_rank),
                                           timeout=self.reply_timeout)
                failure = RolloutFailure.from_message(actions)
                if failure is not None:
                    raise failure.error()
                try:
                    out = self.env.step_chunk(actions)
                except (ObservationError, RewardError) as exc:
                    # nothing of the chunk was sent; the requests already put are delivered
                    if self._sent is not None:
                        self._sent.wait()
                    raise type(exc)(f"env rank {self.env_rank}, chunk {key}: {exc}") from None
                self.env_steps += plan.source_batch_size * plan.num_action_chunks
                last = chunk == plan.num_chunks - 1
                dones = out.dones
                boundary = None
                if out.final_obs is not None:
                    boundary = out.final_obs
                elif self.decoupled and last:
                    boundary = out.obs  # the explicit boundary marker of a decoupled epoch
                self._pending = EnvPart(
                    sources, out.transition, next_obs=boundary,
                    requires_inference=plan.mode != "lerobot" and (
                        last or (dones is not None and bool(dones.any()))),
                    initial_transition=self._boundary if chunk == 0 else None,
                )
                if chunk == 0:
                    self._boundary = None
                if last:
                    t = out.transition
                    self._boundary = EnvTransition(dones=t.dones, terminations=t.terminations,
                                                   truncations=t.truncations)
            if not self.decoupled:
                self.flush()

    def flush(self) -> None:
        """Deliver the pending EnvPart on an ``is_last`` request (asks for no action)."""
        if self._pending is not None:
            self._send(PolicyInput(obs=self.env.obs, env_parts=[self._pending],
                                   request_sizes=[self.plan.source_batch_size], is_last=True))
            self._pending = None
        if self._sent is not None:
            self._sent.wait()
            self._sent = None


# ---------------------------------------------------------------------------------------------
# Rollout side


class Rollout:
    """Serves env requests and is the only producer of the trajectory channel.  With
    ``sample_seed`` (reproducible runs) it re-seeds the policy's ``generator`` per chunk key: a
    policy without one is a ``ValueError``."""

    def __init__(self, policy: torch.nn.Module, plan: TrajectoryPlan, *, requests: Any,
                 actions: Any, trajectory: Any, weights: WeightReceiver,
                 max_staleness: int = 0, merge: bool = True,
                 tag_columns: bool = True, sample_seed: int | None = None) -> None:
        self.policy, self.plan = policy, plan
        self.requests, self.actions, self.trajectory = requests, actions, trajectory
        self.weights, self.max_staleness, self.merge = weights, max_staleness, merge
        self.tag_columns = tag_columns
        if sample_seed is not None and not isinstance(getattr(policy, "generator", None),
                                                       torch.Generator):
            raise ValueError(
                f"reproducible sampling needs a policy that samples from its 'generator' (a "
                f"torch.Generator the rollout re-seeds per chunk); {type(policy).__name__} has "
                f"none, so its samples would not be reproducible")
        self.sample_seed = sample_seed
        self.chunks = 0
        self.lags: list[int] = []
        self._held: list[Any] = []  # requests taken off the channel, to serve in order
        self._inflight: list[Any] = []  # Work handles of puts not yet acknowledged
        self._ranks: set[int] = set()  # env ranks whose requests were seen

    def infer(self, obs: dict[str, Any]) -> PolicyOutput:
        return stamp_version(self.policy(obs), self.weights.version)

    def _next(self, timeout: float | None) -> PolicyInput | str | None:
        if self._held:
            return self._held.pop(0)
        try:
            if timeout == 0:
                return self.requests.get_nowait(key=REQUESTS_KEY)
            return self.requests.get(key=REQUESTS_KEY, timeout=timeout)
        except (asyncio.QueueEmpty, TimeoutError):
            return None

    def _gather(self, first: PolicyInput) -> list[PolicyInput]:
        """``first`` plus the inference requests of the same step already waiting (at most one
        per source); other requests waiting are held for later, in arrival order."""
        batch = [first]
        if not self.merge or first.is_last or not first.sources:
            return batch
        step = first.sources[0].key.step_id
        skipped = []
        while len(batch) < self.plan.num_sources:
            try:
                more = self.requests.get_nowait(key=REQUESTS_KEY)
            except asyncio.QueueEmpty:
                break
            if isinstance(more, PolicyInput) and not more.is_last and more.sources \
                    and more.sources[0].key.step_id == step:
                batch.append(more)
            else:
                skipped.append(more)
        self._held[:0] = skipped
        return batch

    def serve(self, request: PolicyInput) -> None:
        """Serve ``request`` (and the requests merged with it)."""
        requests = self._gather(request)
        head = requests[0]
        # parts of the previous chunk complete with the weights that produced that chunk
        early = not self.plan.enable_rlt
        if early:
            self._complete(requests, [None] * len(requests))
        if head.sources:
            step = head.sources[0].key.step_id
            self._await_version(step - self.max_staleness)
            self.lags.append(step - self.weights.version)
        outputs: list[PolicyOutput | None] = [None] * len(requests)
        if not head.is_last and head.sources:
            outputs = list(self._act(requests))
        if not early:
            self._complete(requests, outputs)

    def _await_version(self, version: int) -> None:
        """Load weights of at least ``version``; meanwhile serve the waiting requests the loaded
        weights may serve (other sources' earlier chunks and last parts), holding the others in
        arrival order."""
        if self.weights.version < version or \
                time.monotonic() - self.weights.polled >= WEIGHTS_POLL_S:
            self.weights.poll()
        if self.weights.version < version:
            self.drain()  # the step's last parts go out before the rollout sits waiting
        while self.weights.version < version:
            self.weights.wait_for(self.weights.version + 1, timeout=0.05, quiet=True)
            waiting, self._held = self._held, []
            while True:
                try:
                    waiting.append(self.requests.get_nowait(key=REQUESTS_KEY))
                except asyncio.QueueEmpty:
                    break
            for request in waiting:
                if self._needed(request) <= self.weights.version:
                    self.serve(request)
                else:
                    self._held.append(request)

    def _needed(self, request: Any) -> int:
        """The weight version a request must wait for (0: none)."""
        if not isinstance(request, PolicyInput) or request.is_last or not request.sources:
            return 0 if isinstance(request, PolicyInput) else 1 << 62
        return request.sources[0].key.step_id - self.max_staleness

    def _act(self, requests: list[PolicyInput]) -> list[PolicyOutput]:
        head = requests[0]
        if not head.requires_inference:
            raise ValueError("external (smooth-intervention) actions are only valid in lerobot "
                             "mode")
        merged = head if len(requests) == 1 else PolicyInput.merge(requests)
        generator = getattr(self.policy, "generator", None)
        if self.sample_seed is not None and isinstance(generator, torch.Generator):
            k = head.sources[0].key  # reproducible sampling: one stream per chunk key
            generator.manual_seed(hash((self.sample_seed, k.step_id, k.epoch_id, k.env_rank,
                                        k.stage_id, k.chunk_id)) & ((1 << 63) - 1))
        if merged.obs is None:
            raise ValueError("a policy request that needs inference carries no observations")
        output = self.infer(merged.obs)
        if self.tag_columns:
            _tag(output, merged)
        part = PolicyPart(merged.sources, merged.obs, output=output)
        check_policy_part(part, self.plan)  # before chunk_actions reshapes the action
        pieces = output.split([r.request_sizes[0] for r in requests]) \
            if len(requests) > 1 else [output]
        for request, piece in zip(requests, pieces, strict=True):
            rank = request.sources[0].key.env_rank
            self._ranks.add(rank)
            # on the env's critical path: sent at once (an async put may wait for the
            # connection's next wait while earlier replies are due)
            self.actions.put(chunk_actions(piece, self.plan.num_action_chunks),
                             key=actions_key(rank))
        self._put(self.trajectory, part)
        self.chunks += len(requests)
        return pieces

    def _complete(self, requests: list[PolicyInput], outputs: list[Any]) -> None:
        for request, output in zip(requests, outputs, strict=True):
            for part in request.env_parts:
                if part is None:
                    continue
                check_env_part(part, self.plan)
                self._put(self.trajectory,
                          complete_env_part(part, request.obs, self.infer, self.plan, output))

    def _put(self, channel: Any, item: Any, key: Any = DEFAULT_KEY) -> None:
        """Put without waiting for the broker's acknowledgement; finished puts are checked
        (their errors raised) on later puts and at ``drain``, at most ``MAX_INFLIGHT`` wait."""
        inflight = self._inflight
        while inflight and (inflight[0].done() or len(inflight) >= MAX_INFLIGHT):
            inflight.pop(0).wait()
        inflight.append(channel.put(item, key=key, async_op=True))

    def drain(self) -> None:
        """Wait for every put in flight (raising the first error)."""
        while self._inflight:
            self._inflight.pop(0).wait()

    def run(self, stop_after: int | None = None, poll_s: float = 0.5) -> None:
        """Serve until a ``STOP`` request, or until ``stop_after`` is_last requests.

        Puts that finished with an error are checked at least every ``poll_s`` seconds while no
        request comes.  On any error the rollout first puts a ``RolloutFailure`` on the actions
        key of every env it serves (``fail_envs``), then raises.
        """
        finals = 0
        try:
            while True:
                request = self._next(poll_s)
                if request is None:
                    self._check_finished()
                    continue
                if isinstance(request, str):  # STOP
                    self.drain()
                    return
                self.serve(request)
                if request.is_last:
                    finals += 1
                    if stop_after is not None and finals >= stop_after:
                        self.drain()
                        return
        except BaseException as exc:
            self.fail_envs(exc)
            raise

    def _check_finished(self) -> None:
        """Raise the error of the oldest finished put, if it failed (finished puts are dropped)."""
        while self._inflight and self._inflight[0].done():
            self._inflight.pop(0).wait()

    def fail_envs(self, exc: BaseException) -> None:
        """Tell every env worker this rollout serves (ranks ``0..num_sources-1`` and any other
        rank seen) that it failed with ``exc``, so that none waits for an action chunk."""
        message = RolloutFailure.of(exc).to_message()
        for rank in sorted(self._ranks | set(range(self.plan.num_sources))):
            try:
                self.actions.put(message, key=actions_key(rank))
            except Exception:  # the actions channel itself may be what failed
                pass


def _tag(output: PolicyOutput, request: PolicyInput) -> None:
    """Record each row's training step and global env column in ``forward_inputs`` (float32
    ``[B, 1]``): actors use them to identify trajectory items."""
    step, column = [], []
    for source in request.sources:
        k = source.key
        step.append(torch.full((source.size, 1), float(k.step_id)))
        column.append(torch.arange(source.offset, source.offset + source.size,
                                   dtype=torch.float32).reshape(-1, 1)
                      + float(k.env_rank * COLUMN_STRIDE))
    output.forward_inputs["step_id"] = torch.cat(step)
    output.forward_inputs["column"] = torch.cat(column)


__all__ = [
    "REQUESTS_KEY",
    "STOP",
    "EnvLoop",
    "Rollout",
    "RolloutFailed",
    "RolloutFailure",
    "WeightPublisher",
    "WeightReceiver",
    "actions_key",
    "complete_env_part",
    "rlt_features",
    "weights_key",
]
