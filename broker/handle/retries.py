"""The puts of a handle that are in doubt, so that retrying one stores it at most once.

A put is *in doubt* when it raised ``BrokerUnavailable`` after it was sent: the broker stopped
answering (or expired this client) before its acknowledgement came, so it may or may not
have stored the item.  The handle keeps each such put's digest (its key, weight and encoded
value) with the sequence it was sent under and the connection (the producer) that sent it.
A later put on the handle that is equal to one of them, within ``IN_DOUBT_S`` seconds, is
taken as its retry: it goes out under the same sequence, and the broker, which remembers the
sequences it stored per producer (``server/producers.py``), acknowledges it without storing
it again if the first one was stored.  Guarantee and limits: docs/guarantees.md.

Digests are computed only on those paths: when a put is found in doubt (by the thread that
sees its error), and for the puts of a handle that has puts in doubt.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any

from zchannel.broker.wire import codec
from zchannel.broker.wire.packers import shared_packer

IN_DOUBT_S = 60.0  # how long a put stays in doubt (its retry is recognised that long)
MAX_IN_DOUBT = 4096  # puts in doubt kept per handle (the oldest go first)

_packer = shared_packer(use_bin_type=True)


def put_digest(key: Any, weight: int | float, item: Any) -> bytes:
    """A digest of what a put sends: its key and weight (as on the wire) and its item's encoded
    body and buffers (``codec.encode``; shared memory aside, the bytes that travel)."""
    body, buffers = codec.encode(item)
    h = hashlib.blake2b(_packer.pack([key, weight]), digest_size=16)
    h.update(len(body).to_bytes(8, "little"))
    h.update(body)
    for buf in buffers:
        view = memoryview(buf).cast("B")
        h.update(len(view).to_bytes(8, "little"))
        h.update(view)
    return h.digest()


@dataclass(frozen=True)
class InDoubt:
    digest: bytes
    seq: int  # the sequence it was sent under
    conn: Any  # the connection that sent it (its producer id)
    since: float


class InDoubtPuts:
    """A handle's puts in doubt (see the module docstring); thread-safe."""

    def __init__(self) -> None:
        self._entries: list[InDoubt] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: Any, weight: int | float, item: Any, seq: int, conn: Any) -> None:
        """The put of ``item`` sent as ``seq`` over ``conn`` is in doubt."""
        entry = InDoubt(put_digest(key, weight, item), seq, conn, time.monotonic())
        with self._lock:
            self._drop_stale(conn)
            if any(e.seq == seq and e.conn is conn for e in self._entries):
                return  # the same put, observed again
            self._entries.append(entry)
            del self._entries[:-MAX_IN_DOUBT]

    def match(self, key: Any, weight: int | float, item: Any, conn: Any) -> InDoubt | None:
        """The put in doubt that a put of ``item`` over ``conn`` repeats (``discard`` it once
        the retry is sent: it is no longer in doubt then), or None for a new put."""
        with self._lock:
            self._drop_stale(conn)
            if not self._entries:
                return None
        digest = put_digest(key, weight, item)
        with self._lock:
            for entry in self._entries:
                if entry.digest == digest and entry.conn is conn:
                    return entry
        return None

    def discard(self, entry: InDoubt) -> None:
        """``entry``'s retry was sent."""
        with self._lock:
            try:
                self._entries.remove(entry)
            except ValueError:
                pass

    def _drop_stale(self, conn: Any) -> None:
        """Forget puts older than ``IN_DOUBT_S`` and those of another connection (a forked
        child's, or one that ended): their sequences mean nothing to this one's producer."""
        cutoff = time.monotonic() - IN_DOUBT_S
        self._entries = [e for e in self._entries if e.since >= cutoff and e.conn is conn]
