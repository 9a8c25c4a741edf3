"""The replies the broker coalesced for one client in one turn of its loop."""

from __future__ import annotations

from typing import Any

from zchannel.broker.wire.protocol import UNSET, Reply

# Frame bytes per reply message at most (a single record may exceed it): replies coalesced in
# one turn for a client with many gets out would otherwise make one message of hundreds of MiB,
# which arrives whole only after seconds, with the heartbeats queued behind it.
MAX_REPLY_BYTES = 64 << 20


class Outbox:
    """The replies of one turn for one client, sent as few messages as ``MAX_REPLY_BYTES``
    allows (``cuts``: where a new message starts, as record and frame indices)."""

    __slots__ = ("records", "frames", "deliveries", "cuts", "nbytes")

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.frames: list[Any] = []
        self.deliveries: list[tuple] = []
        self.cuts: list[tuple[int, int]] = []
        self.nbytes = 0  # frame bytes since the last cut

    def record_added(self, r0: int, f0: int) -> None:
        """A reply record was added at ``records[r0]`` with its frames from ``frames[f0]`` on:
        it starts a new message if the current one would exceed ``MAX_REPLY_BYTES``."""
        nbytes = sum(len(f) for f in self.frames[f0:])
        if self.nbytes and self.nbytes + nbytes > MAX_REPLY_BYTES:
            self.cuts.append((r0, f0))
            self.nbytes = 0
        self.nbytes += nbytes

    def messages(self) -> list[tuple[list[dict], list]]:
        """``(records, frames)`` of each message to send."""
        if not self.cuts:
            return [(self.records, self.frames)]
        out, r0, f0 = [], 0, 0
        for r1, f1 in self.cuts:
            out.append((self.records[r0:r1], self.frames[f0:f1]))
            r0, f0 = r1, f1
        out.append((self.records[r0:], self.frames[f0:]))
        return out

    def mark(self) -> tuple[int, int]:
        """Where the records of this turn stand now (for ``take_acks``)."""
        return len(self.records), len(self.cuts)

    def take_acks(self, mark: tuple[int, int], ids: set[int]) -> list[int]:
        """Take the bare acknowledgements of requests ``ids`` added since ``mark`` out of this
        outbox and return their ids, in order (none while a message cut was made since: the
        cuts index the records)."""
        r0, cuts = mark
        if len(self.cuts) != cuts:
            return []
        kept, taken = [], []
        for rec in self.records[r0:]:
            if type(rec) is Reply and rec.id in ids and rec.error is None and rec.result is None \
                    and rec.nf == 0 and rec.body is UNSET and rec.lease is None:
                taken.append(rec.id)
            else:
                kept.append(rec)
        if taken:
            self.records[r0:] = kept
        return taken
