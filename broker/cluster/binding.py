"""The replicated key-binding table of a distributed channel (broker side).

Every replica holds the whole table (key -> replica index).  New bindings are decided by one
replica, the **binder**: in a replica's view, the lowest-index replica that may be alive (it was
heard from within one heartbeat expiry, judged at the moment of the request, or it asked this
replica for the table less than one expiry ago) -- if that is itself, and only once it is
**ready**.  So the next replica takes over the moment the binder's expiry ends.  The binder records a binding, sends it
to every other live replica (``learn``) and waits for their acknowledgements (at most
``REPLICATE_WAIT_S``) before it answers; so when it dies, the next binder already holds every
binding that was answered.  A replica that starts (or restarts) is not ready: it asks every
other replica for its table (``sync``) and becomes ready once each has answered or is known to
be down (missed heartbeats); only then does it answer binding requests.  A replica that answers
the ``sync`` of a lower-index replica stops deciding at once (that replica takes over when it is
ready), so two replicas never decide at the same time while their links work.

The binder binds a key to the replica of the caller's node as before (``choose_replica``), among
the replicas that are up: while a node's replicas are all down, its new keys bind elsewhere.

A ``learn`` never overwrites a binding the receiver holds; it reports the conflict, and the
binder adopts the existing binding (it may have been answered by a binder that died meanwhile)
and corrects the others.  Requests a replica does not decide are answered with a redirect
(``BindAnswer``: ``{binder: i}``) or ``{retry: reason}``; clients and replicas follow them
(``broker/handle/distributed.py``).  Choice and limits: ``docs/decisions.md``, ``docs/distributed.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from zchannel.broker.cluster.clusterfile import Replica, choose_replica
from zchannel.broker.connection.connection import CLOSED, DOWN, UP, Connection
from zchannel.broker.errors import ChannelError
from zchannel.broker.wire.argchecks import check_key
from zchannel.broker.wire.protocol import (
    Bind,
    BindAnswer,
    Learn,
    Sync,
    SyncAnswer,
    key_from_wire,
    sync_answer,
)

log = logging.getLogger("zchannel.broker")

PEER_IDENTITY = "zchannel-replica:"
# how long the binder waits for a replica's acknowledgement of a new binding before it answers
# anyway (a replica that does not answer in time is not waited for again for one expiry)
REPLICATE_WAIT_S = 1.0


class BindingTable:
    """Replica ``index``'s copy of the binding table and its links to the other replicas."""

    def __init__(self, name: str, index: int, replicas: list[Replica],
                 curve_for: Callable[[int], Any] = lambda peer: None,
                 heartbeat_interval: float = 1.0, liveness: int = 3) -> None:
        self.name = name
        self.index = index
        self.replicas = replicas
        self.table: dict[Any, int] = {}
        self.ready = len(replicas) == 1
        self.expiry = heartbeat_interval * liveness
        self._hb, self._liveness = heartbeat_interval, liveness
        self._curve_for = curve_for  # peer index -> CURVE settings of the link to it
        self._peers: dict[int, Connection] = {}
        self._syncs: dict[int, Any] = {}  # peer -> pending sync Work (while joining)
        self._synced: set[int] = set()
        self._lower_seen: dict[int, float] = {}  # lower-index peer -> when it asked to sync
        self._slow_until: dict[int, float] = {}
        self._owed: dict[int, list] = {}  # peer -> bindings whose learn failed (sent again)
        self._judged_hello: dict[int, Any] = {}  # peer -> the hello its link was last judged by
        self._foreign: set[int] = set()  # peers whose address is served by another broker

    # -- links ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the links to the other replicas and ask each for its table (joining)."""
        for i, r in enumerate(self.replicas):
            if i != self.index and i not in self._peers:
                self._peers[i] = Connection(r.address, identity=f"{PEER_IDENTITY}{self.index}",
                                            heartbeat_interval=self._hb, liveness=self._liveness,
                                            curve=self._curve_for(i), shm=False)
        self.progress()

    def peer(self, index: int) -> Connection:
        return self._peers[index]

    def close(self) -> None:
        peers, self._peers = self._peers, {}
        for conn in peers.values():
            conn.close()

    # -- joining -------------------------------------------------------------------------------

    def progress(self) -> None:
        """Joining: collect the tables of the other replicas; ready once each answered or is
        down.  Cheap when ready (called on every binding request and heartbeat tick)."""
        if self.ready:
            return
        now = time.monotonic()
        for i, conn in self._peers.items():
            if i in self._synced:
                continue
            work = self._syncs.get(i)
            if self.foreign(i):  # another channel's broker: nothing to learn from it
                self._syncs.pop(i, None)
                self._synced.add(i)
                continue
            if work is not None and work.done():
                del self._syncs[i]
                if self._learned_from(i, conn, work):
                    continue
            if conn.state == DOWN:
                continue
            if i not in self._syncs:
                try:
                    self._syncs[i] = conn.request(Sync(id=0, sender=self.index,
                                                       channel=self.name), [])
                except ChannelError:
                    pass
        pending = [i for i in self._peers if i not in self._synced and self.alive(i, now)]
        if not pending:
            self.ready = True
            self._syncs.clear()
            log.info("replica %d of %r ready: %d binding(s) learned from %s", self.index,
                     self.name, len(self.table),
                     sorted(self._synced - self._foreign) or "no live replica")

    def _learned_from(self, i: int, conn: Connection, work: Any) -> bool:
        """Merge peer ``i``'s answered table request ``work``; True when peer ``i`` is synced
        (its table merged, or it answered with an error: nothing to learn), False to ask
        again (the link went down or expired meanwhile)."""
        if conn.state != UP:
            return False  # the link went down since: this peer's hello was not judged
        try:
            self._merge(sync_answer(work.result()).entries)
        except ChannelError:
            return False  # expired or went down: asked again, or counted as down
        except Exception as exc:  # not a replica of this channel: nothing to learn
            log.warning("replica %d did not answer the table request: %s", i, exc)
        self._synced.add(i)
        return True

    def _entries(self, entries: Any) -> list[tuple[Any, int]]:
        """Validated ``[[key, replica], ...]`` from the wire (``ValueError`` names the cause)."""
        out = []
        for entry in entries:
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise ValueError(f"a binding is [key, replica], not {entry!r}")
            key, r = check_key(key_from_wire(entry[0])), entry[1]
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < len(self.replicas):
                raise ValueError(f"binding of {key!r} to an unknown replica {r!r}")
            out.append((key, r))
        return out

    def _merge(self, entries: Any) -> list:
        conflicts = []
        for key, r in self._entries(entries):
            held = self.table.get(key)
            if held is None:
                self.table[key] = r
            elif held != r:
                conflicts.append([key, held])
        return conflicts

    # -- requests from clients and replicas ----------------------------------------------------

    def handle(self, rec: Bind | Learn | Sync) -> Any:
        if type(rec) is Bind:
            return self.bind(key_from_wire(rec.key), rec.node, rec.replica, rec.sender)
        if type(rec) is Learn:
            entries = rec.entries or ()
            if rec.force:
                self.table.update(self._entries(entries))
                return []
            return self._merge(entries)
        if isinstance(rec, Sync) and rec.channel not in (None, self.name):  # before its hello check
            raise ValueError(f"replica {self.index} serves channel {self.name!r}, not "
                             f"{rec.channel!r}: its table is not that channel's")
        sender = rec.sender
        if isinstance(sender, int) and not isinstance(sender, bool) and sender < self.index:
            self._lower_seen[sender] = time.monotonic()  # it takes over once ready: stop deciding
        return SyncAnswer(ready=self.ready, entries=[[k, r] for k, r in self.table.items()])

    def foreign(self, index: int) -> bool:
        """True when the link to replica ``index`` reached a broker that is not replica
        ``index`` of this channel (its hello names another channel or replica: a cluster file
        that gives two channels one address).  Such a peer is never synced from, told
        bindings or bound to; judged once per hello of the link (an error logged once)."""
        conn = self._peers.get(index)
        if conn is None or conn.state != UP:
            return index in self._foreign  # the last verdict holds until the next hello
        info = conn.broker_info
        if self._judged_hello.get(index) is info:
            return index in self._foreign
        self._judged_hello[index] = info
        if info.name == self.name and info.replica == index:
            if index in self._foreign:
                log.warning("replica %d of %r at %s serves this channel again", index, self.name,
                            conn.address)
            self._foreign.discard(index)
            return False
        if index not in self._foreign:
            log.error("replica %d of %r: the broker at %s (listed as replica %d) serves channel "
                      "%r as replica %s: it is not used (no bindings learned from or sent to "
                      "it; give each channel its own addresses: {name} in the cluster file)",
                      self.index, self.name, conn.address, index, info.name, info.replica)
        self._foreign.add(index)
        return True

    def alive(self, index: int, now: float) -> bool:
        """Replica ``index`` may be alive in this replica's view: it is this one, or its link
        is not down, reached this channel's replica ``index`` (``foreign``) and it was heard
        from within one heartbeat expiry, judged now (not at the link's next keepalive tick):
        a replica is dead for binding the moment its expiry ends."""
        if index == self.index:
            return True
        conn = self._peers.get(index)
        if conn is None or conn.state in (DOWN, CLOSED) or self.foreign(index):
            return False
        return conn.silent_for(now) <= conn.hb * conn.liveness

    def binder(self) -> int:
        """The replica that decides new bindings, in this replica's view."""
        now = time.monotonic()
        for i in range(self.index):
            if self.alive(i, now) or now - self._lower_seen.get(i, -1e9) < self.expiry:
                return i
        return self.index

    def bind(self, key: Any, node: Any = None, replica: Any = None, sender: Any = None) -> Any:
        """The replica ``key`` is bound to, deciding it now if this replica is the binder;
        else a ``BindAnswer``: ``binder`` (ask replica i) or ``retry`` (why to ask again)."""
        key = check_key(key)
        bound = self.table.get(key)
        if bound is not None:
            return bound
        self.progress()
        if not self.ready:
            return BindAnswer(retry=f"replica {self.index} is joining (learning the bindings)")
        binder = self.binder()
        if binder != self.index:
            return BindAnswer(binder=binder)
        if replica is not None:
            if isinstance(replica, bool) or not isinstance(replica, int) \
                    or not 0 <= replica < len(self.replicas):
                raise ValueError(f"no replica {replica!r}")
            bound = replica
        else:
            if node is not None and not isinstance(node, str):
                raise TypeError("node must be a str")
            bound = self._choose(node, key)
        self.table[key] = bound
        held = self._replicate([[key, bound]], sender).get(key)
        if held is not None and held != bound:
            log.warning("key %r was bound to replica %d already (learned late): kept", key, held)
            self.table[key] = bound = held
            self._send_all([[key, held]], force=True)
        return bound

    def _choose(self, node: str | None, key: Any) -> int:
        """``choose_replica`` over the replicas that are up: a key first touched from a node
        whose replicas are all down binds to a live replica (it is served now, not lost)."""
        live = self.live_replicas()
        index = choose_replica([self.replicas[i] for i in live], node, key)
        return live[index]

    def live_replicas(self) -> list[int]:
        """The replicas a new binding may go to, in this replica's view: this one, and those
        whose link is up and that were heard from within one heartbeat expiry."""
        now = time.monotonic()
        return [i for i in range(len(self.replicas)) if i == self.index or (
            i in self._peers and self._peers[i].state == UP and self.alive(i, now))]

    def _replicate(self, entries: list, skip: Any) -> dict:
        """Send ``entries`` to every live replica but ``skip``; wait for the acknowledgements
        (at most ``REPLICATE_WAIT_S``); the conflicts they report (key -> held replica)."""
        now = time.monotonic()
        works = []
        for i, conn in self._peers.items():
            if i == skip or not self.alive(i, now):
                continue  # a dead one learns everything by joining when it is back
            try:
                work = conn.request(Learn(id=0, entries=entries), [])
            except ChannelError:
                self._owed.setdefault(i, []).extend(entries)
                continue
            if self._slow_until.get(i, 0.0) <= now:
                works.append((i, work, entries))
            else:
                work.add_done_callback(self._owe_on_failure(i, entries))
        deadline = now + REPLICATE_WAIT_S
        conflicts: dict = {}
        for i, work, sent in works:
            try:
                for k, r in work.wait(max(0.0, deadline - time.monotonic())) or ():
                    conflicts[key_from_wire(k)] = r
            except TimeoutError:
                self._slow_until[i] = time.monotonic() + self.expiry
                work.add_done_callback(self._owe_on_failure(i, sent))
            except ChannelError:
                self._owed.setdefault(i, []).extend(sent)
        return conflicts

    def _owe_on_failure(self, peer: int, entries: list):
        def done(work: Any) -> None:  # runs in the link's I/O thread: only appends
            if work.exception() is not None:
                self._owed.setdefault(peer, []).extend(entries)
        return done

    def live_peers(self) -> list[int]:
        """The other replicas that may be alive now (``alive``)."""
        now = time.monotonic()
        return [i for i in self._peers if self.alive(i, now)]

    def _send_all(self, entries: list, force: bool = False) -> None:
        for i, conn in self._peers.items():
            if conn.state != DOWN and not self.foreign(i):
                try:
                    conn.request(Learn(id=0, entries=entries, force=force), [])
                except ChannelError:
                    pass

    def tick(self) -> None:
        """Every heartbeat: go on joining; send again the bindings a live replica missed."""
        self.progress()
        for i in list(self._owed):
            conn = self._peers.get(i)
            if conn is None or conn.state == DOWN or self.foreign(i):
                self._owed.pop(i, None)  # it learns everything by joining when it is back
                continue
            if conn.state != UP:
                continue
            entries = self._owed.pop(i)
            try:
                conn.request(Learn(id=0, entries=entries), []).add_done_callback(
                    self._owe_on_failure(i, entries))
            except ChannelError:
                self._owed.setdefault(i, []).extend(entries)

    def peer_clients(self, identities: Any) -> int:
        """How many of the clients (by identity) are other replicas' links."""
        return sum(1 for ident in identities if ident and ident.startswith(PEER_IDENTITY))


__all__ = ["PEER_IDENTITY", "BindingTable"]
