"""The replies the broker coalesced for one client in one turn of its loop."""

from __future__ import annotations

from typing import Any

from zchannel.broker.wire.protocol import Reply

# Frame bytes per reply message at most (a single record may exceed it): replies coalesced in
# one turn for a client with many gets out would otherwise make one message of hundreds of MiB,
# which arrives whole only after seconds, with the heartbeats queued behind it.
MAX_REPLY_BYTES = 64 << 20
# Frames per reply message at most, likewise (a record of more goes alone): a message of many
# small frames costs far more memory than its bytes, and a client that stops reading is ended
# after a number of messages (``direct_broker.MAX_QUEUED_MESSAGES``), so this bounds what it
# holds in the broker.
MAX_REPLY_FRAMES = 4096


class Outbox:
    """The replies of one turn for one client, sent as few messages as ``MAX_REPLY_BYTES``
    and ``MAX_REPLY_FRAMES`` allow (``cuts``: where a new message starts, as record, frame and
    delivery indices: the deliveries of a message are those its records made)."""

    __slots__ = ("records", "frames", "deliveries", "cuts", "nbytes", "f_cut")

    def __init__(self) -> None:
        self.records: list[Reply] = []
        self.frames: list[Any] = []
        self.deliveries: list[tuple] = []
        self.cuts: list[tuple[int, int, int]] = []
        self.nbytes = 0  # frame bytes since the last cut
        self.f_cut = 0  # the index of the first frame since the last cut

    def record_added(self, r0: int, f0: int) -> None:
        """A reply record was added at ``records[r0]`` with its frames from ``frames[f0]`` on
        (its delivery, if any, not added yet): it starts a new message if the current one
        would exceed ``MAX_REPLY_BYTES`` or ``MAX_REPLY_FRAMES``."""
        frames = self.frames
        nbytes = sum(len(f) for f in frames[f0:])
        if f0 > self.f_cut and (self.nbytes + nbytes > MAX_REPLY_BYTES
                                or len(frames) - self.f_cut > MAX_REPLY_FRAMES):
            self.cuts.append((r0, f0, len(self.deliveries)))
            self.nbytes, self.f_cut = 0, f0
        self.nbytes += nbytes

    def messages(self) -> list[tuple[list[Reply], list, int]]:
        """``(records, frames, first)`` of each message to send: ``first``, the index of its
        first delivery (those before it were made by the messages before it)."""
        if not self.cuts:
            return [(self.records, self.frames, 0)]
        out: list[tuple[list[Reply], list, int]] = []
        r0, f0, d0 = 0, 0, 0
        for r1, f1, d1 in self.cuts:
            out.append((self.records[r0:r1], self.frames[f0:f1], d0))
            r0, f0, d0 = r1, f1, d1
        out.append((self.records[r0:], self.frames[f0:], d0))
        return out
