"""A hand-driven direct link (``PATH.d`` beside a broker's ipc socket) for tests that speak the
wire protocol themselves: it frames messages as clients do and reads whole replies with a
deadline."""

from __future__ import annotations

import os
import select
import socket

import msgpack
from zchannel.broker.transport import direct_framing
from zchannel.broker.wire.protocol import pack_header


def frame(parts: list) -> bytes:
    """``parts`` (a header and its frames) framed as one direct-link message."""
    return b"".join(bytes(p) for p in direct_framing.iovec(parts)[0])


class RawLink:
    """A direct link to the broker at ``address`` (``ipc://PATH``), connected at once."""

    def __init__(self, address: str) -> None:
        path = direct_framing.link_path(address[len("ipc://"):])
        assert path is not None and os.path.exists(path), address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.reader = direct_framing.Reader(1 << 20, 1 << 30)
        self.kept: dict[int, tuple[dict, list]] = {}  # replies read, not yet asked for

    def send(self, records: list[dict], frames: list = ()) -> None:
        """One message: ``records`` packed as its header, then ``frames``."""
        self.send_parts([pack_header(records), *frames])

    def send_parts(self, parts: list) -> None:
        """One message of ``parts`` as given (a header made by hand first)."""
        self.sock.sendall(frame(parts))

    def replies(self, ids: set[int]) -> dict[int, tuple[dict, list]]:
        """The reply records (with their frames) to the requests ``ids``; replies to other
        requests read meanwhile are kept for a later call, records without an id skipped."""
        while not ids <= self.kept.keys():
            while not self.reader.messages:
                ready, _, _ = select.select([self.sock], [], [], 120)
                assert ready, f"no reply from the broker for {ids - self.kept.keys()}"
                assert self.reader.read(self.sock.fileno()), "the broker closed the link"
            parts = self.reader.messages.popleft()
            pos = 1
            for rec in msgpack.unpackb(parts[0], raw=False):
                nf = rec.get("nf", 0)
                if "id" in rec:
                    self.kept[rec["id"]] = (rec, parts[pos : pos + nf])
                pos += nf
        return {rid: self.kept.pop(rid) for rid in ids}

    def close(self) -> None:
        self.sock.close()
