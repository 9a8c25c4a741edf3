"""The slots a broker delivered to same-host consumers that they have not released yet.

Each delivered slot is a ``Hold`` (``shm/broker.py``) under a hold id the reply names; the
consumer releases it by that id (``shm_rel``) when it copied the slot out or its view was
collected.  A consumer that leaves has its holds dropped, except one the broker expired while
its process still runs (stopped, in a debugger): its views live on, so its holds are kept by
(pid, identity) until that process registers again (``adopt``) or ends (``sweep``).  A release
of an id the client does not hold is ignored: the client sends a release again, after it
proved the same host anew, when it cannot know whether the broker took it in time
(``shm/client.py``, ``Releases``), and hold ids are never used twice.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Any

from zchannel.broker.host.procs import process_running


class ConsumerHolds:
    """Hold ids -> holds, the ids each client holds, and those of stalled processes."""

    def __init__(self) -> None:
        self.holds: dict[int, Any] = {}  # hold id -> Hold (dropping it frees its slot)
        self.by_client: dict[Any, set[int]] = {}
        self.stalled: dict[tuple[int, Any], set[int]] = {}  # (pid, identity) -> hold ids
        # ids start at random: a view of an earlier broker of the channel is released by its
        # old id, which must not name a hold of this one
        self._ids = itertools.count(secrets.randbits(52) + 1)

    def __len__(self) -> int:
        return len(self.holds)

    def add(self, client: Any, hold: Any) -> int:
        """``hold`` delivered to ``client``: its hold id."""
        hid = next(self._ids)
        self.holds[hid] = hold
        self.by_client.setdefault(client, set()).add(hid)
        return hid

    def release(self, client: Any, ids: list[Any]) -> None:
        """``client`` released these hold ids (ids it does not hold are ignored)."""
        mine = self.by_client.get(client)
        if not mine:
            return
        for hid in ids:
            if isinstance(hid, int) and hid in mine:
                mine.discard(hid)
                self.holds.pop(hid, None)

    def client_gone(self, client: Any, stalled_pid: int | None = None) -> None:
        """``client`` left: its holds go, or, when ``stalled_pid`` (the pid of an expired
        client whose process still runs), they wait for that process."""
        held = self.by_client.pop(client, set())
        if stalled_pid is not None and held:
            key = (stalled_pid, getattr(client, "identity", None))
            self.stalled.setdefault(key, set()).update(held)
            return
        for hid in held:
            self.holds.pop(hid, None)

    def adopt(self, client: Any, pid: int) -> None:
        """``client`` proved it runs as ``pid``: the holds its process kept while stalled are
        its own again."""
        held = self.stalled.pop((pid, getattr(client, "identity", None)), None)
        if held:
            self.by_client.setdefault(client, set()).update(held)

    def sweep(self) -> None:
        """Drop the kept holds of stalled processes that ended."""
        for key in [key for key in self.stalled if not process_running(key[0])]:
            for hid in self.stalled.pop(key):
                self.holds.pop(hid, None)

    def clear(self) -> None:
        self.holds.clear()
        self.by_client.clear()
        self.stalled.clear()
