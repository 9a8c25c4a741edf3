"""``ChunkJoiner``: pair the policy and environment halves of each action chunk (docs/embodied.md).

Parts covering a whole source batch are stored directly; fragments are buffered per
``(part type, key)`` until they add up to the source batch, then merged.  A rejected push changes
nothing.  The joiner never forgets a pair by itself: the caller ``acknowledge``s a key once it has
used the joined chunk, so a failed emit can be retried by pushing either half again.
"""

from __future__ import annotations

from dataclasses import dataclass

from zchannel.embodied.types import (
    EnvPart,
    PolicyPart,
    SourceID,
    TrajectoryKey,
    TrajectoryPart,
)

FragmentKey = tuple[type, TrajectoryKey]


def _merge(kind: type, buffer: list[TrajectoryPart]) -> TrajectoryPart:
    """The contiguous fragments ``buffer`` of one source, all of ``kind``, merged."""
    if kind is PolicyPart:
        return PolicyPart.merge([p for p in buffer if isinstance(p, PolicyPart)])
    return EnvPart.merge([p for p in buffer if isinstance(p, EnvPart)])


@dataclass(frozen=True, eq=False)
class JoinedChunk:
    """Both halves of one action chunk of one logical source."""

    key: TrajectoryKey
    source: SourceID
    policy: PolicyPart
    env: EnvPart


class ChunkJoiner:
    """Joins ``PolicyPart`` and ``EnvPart`` halves by ``TrajectoryKey`` for sources of
    ``source_batch_size`` rows."""

    def __init__(self, source_batch_size: int) -> None:
        if isinstance(source_batch_size, bool) or not isinstance(source_batch_size, int):
            raise TypeError(f"source_batch_size must be an int, not {source_batch_size!r}.")
        if source_batch_size < 1:
            raise ValueError(f"source_batch_size must be >= 1, got {source_batch_size}.")
        self.source_batch_size = source_batch_size
        self.policy_parts: dict[TrajectoryKey, PolicyPart] = {}
        self.env_parts: dict[TrajectoryKey, EnvPart] = {}
        self.fragments: dict[FragmentKey, list[TrajectoryPart]] = {}

    def push(self, part: TrajectoryPart) -> list[JoinedChunk]:
        """Store ``part`` (or its fragments) and return the chunks it completes, in order.

        Raises ``ValueError`` for a foreign item, fragments exceeding the source batch size,
        non-contiguous or incompatible fragments (nothing is stored then), and for the
        initial-state rules at join time (both halves stay stored then).
        """
        if not isinstance(part, (PolicyPart, EnvPart)):
            raise ValueError(
                f"Unexpected trajectory part {type(part).__module__}.{type(part).__qualname__}: "
                "expected a PolicyPart or an EnvPart."
            )
        B = self.source_batch_size
        sources = part.sources
        if len(sources) == 1 and sources[0].offset == 0 and sources[0].size == B:
            completed = {sources[0].key: part}
            buffers: dict[FragmentKey, list[TrajectoryPart]] = {}
        else:
            completed, buffers = self._assemble(part)
        # Validation passed: commit.
        for fkey, buffer in buffers.items():
            if buffer:
                self.fragments[fkey] = buffer
            else:
                self.fragments.pop(fkey, None)
        # the completed parts are of ``part``'s kind (the buffers are per kind)
        if isinstance(part, PolicyPart):
            self.policy_parts.update(
                {k: p for k, p in completed.items() if isinstance(p, PolicyPart)})
        else:
            self.env_parts.update({k: p for k, p in completed.items() if isinstance(p, EnvPart)})
        joined, error = [], None
        for key in completed:
            try:
                chunk = self._join(key)
            except ValueError as exc:
                error = error or exc
                continue
            if chunk is not None:
                joined.append(chunk)
        if error is not None:
            raise error
        return joined

    def acknowledge(self, key: TrajectoryKey) -> None:
        """Forget both stored halves of ``key`` (buffered fragments are kept)."""
        self.policy_parts.pop(key, None)
        self.env_parts.pop(key, None)

    def _assemble(
        self, part: TrajectoryPart
    ) -> tuple[dict[TrajectoryKey, TrajectoryPart], dict[FragmentKey, list[TrajectoryPart]]]:
        """Add ``part``'s single-source fragments to copies of the buffers, merging every buffer
        that reaches the source batch.  Returns the merged parts and the new buffers; touches no
        state, so an error leaves the joiner unchanged."""
        B = self.source_batch_size
        kind = type(part)
        buffers: dict[FragmentKey, list[TrajectoryPart]] = {}
        completed: dict[TrajectoryKey, TrajectoryPart] = {}
        for fragment in part.split():
            if not fragment.sources:  # a zero-row source carries nothing
                continue
            (source,) = fragment.sources
            fkey = (kind, source.key)
            if fkey not in buffers:
                buffers[fkey] = list(self.fragments.get(fkey, []))
            buffer = buffers[fkey]
            buffer.append(fragment)
            total = sum(f.sources[0].size for f in buffer)
            # only a received total above B exceeds the batch; a fragment outside [0, B)
            # waits and is refused as non-contiguous once the total reaches B
            if total > B:
                raise ValueError(
                    f"{kind.__name__} fragments for {source.key} exceed source batch size {B}: "
                    f"{_describe(buffer)}."
                )
            if total < B:
                continue
            buffer.sort(key=lambda f: f.sources[0].offset)
            expected = 0
            for f in buffer:
                if f.sources[0].offset != expected:
                    raise ValueError(
                        f"Non-contiguous trajectory fragments for {source.key}: "
                        f"{_describe(buffer)}."
                    )
                expected += f.sources[0].size
            completed[source.key] = _merge(kind, buffer)
            buffers[fkey] = []
        return completed, buffers

    def _join(self, key: TrajectoryKey) -> JoinedChunk | None:
        policy, env = self.policy_parts.get(key), self.env_parts.get(key)
        if policy is None or env is None:
            return None
        if key.chunk_id == 0 and env.initial_transition is None:
            raise ValueError(
                f"Chunk zero is missing its initial state (initial_transition) for {key}."
            )
        if key.chunk_id != 0 and env.initial_transition is not None:
            raise ValueError(
                f"Only chunk zero may carry initial state (initial_transition); got one for {key}."
            )
        return JoinedChunk(key, key.source, policy, env)


def _describe(buffer: list[TrajectoryPart]) -> str:
    return ", ".join(f"(offset {f.sources[0].offset}, size {f.sources[0].size})" for f in buffer)
