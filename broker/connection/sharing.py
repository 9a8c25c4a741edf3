"""One connection per process per broker, shared by every handle to it.

RLinf-style jobs pass a channel handle into a worker method on every step, so a process may
unpickle thousands of handles of one channel.  A ``Channel`` therefore owns no socket: it holds
a ``Share`` of this process's ``Connection`` (one I/O thread, one socket or direct link, one
shared-memory client) to the broker's address, for the same consumer identity, CURVE keys and
shared-memory/direct-link settings.  Handles that differ in any of these get their own
connection: the broker sees one client per connection, and a consumer id is a client.

A new broker at an address whose broker died does not know the connections that said hello
to the dead one: a request over one of them is answered ``expired`` (unknown client), fails
with ``BrokerUnavailable`` and makes the connection say hello again.  A handle that knows
which broker process serves its address -- ``Channel.create`` that just started it, or
``Channel.connect`` by name (the channel's lock file names its broker) -- therefore never
shares a connection whose hello another process answered: ``acquire(..., broker_pid=)`` makes
a new connection, which new handles share from then on; the handles of the old one keep it
(it registers again by itself, ``connection/liveness.py``).

A share goes when its handle is closed or garbage collected; the connection goes with its last
share (its I/O thread stops and is joined; the thread closes the descriptors as its last act,
see ``connection/connection.py``).  A request in flight holds its handle's share: a ``Work`` outlives the
handle that issued it.  A forked child never uses its parent's connections: its handles connect
anew (``_after_fork``).  At interpreter exit ``close_all`` stops every connection in
order.  A new connection is refused at once (``ChannelNotFound``) where nothing can be
listening -- an ipc address without a socket file or with a killed broker's, a tcp connection
refused (``paths.probe``), a tcp host that does not resolve (``check_host``) --, not left to
wait out the hello's timeout.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
import weakref
from collections import deque
from typing import Any

from zchannel.broker.connection import connection
from zchannel.broker.connection.connection import JOIN_S, Connection
from zchannel.broker.connection.flowcontrol import Flow
from zchannel.broker.connection.liveness import CLOSED, GONE_CHECK_S, UP
from zchannel.broker.connection.tuning import direct_enabled
from zchannel.broker.connection.work import Work
from zchannel.broker.errors import ChannelError, ChannelNotFound
from zchannel.broker.host.paths import probe, tcp_host_port
from zchannel.broker.shm.client import env_enabled as shm_env_enabled
from zchannel.broker.wire.protocol import Cancel

# Guards _by_key, _count and _keys.  A garbage collection can run a share's finalizer while
# a thread (maybe the collecting one) holds it: that release is then deferred (_deferred) and
# applied by whoever gives the lock back (_apply_deferred).
_lock = threading.Lock()
_deferred: deque[Connection] = deque()
_by_key: dict[tuple, Connection] = {}  # the connection new handles of a key share
_count: dict[Connection, int] = {}  # shares per connection
_keys: dict[Connection, tuple] = {}
_exiting = False  # close_all ran: no new connections


class Share(Flow):
    """One handle's use of a shared connection (``conn``), with its own flow control (each
    handle may have ``max_inflight`` requests outstanding); ``close`` or garbage collection
    gives it back."""

    __slots__ = ("conn", "closed", "last", "given_back", "_finalizer", "__weakref__")

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self.conn = conn
        self.closed = False  # set first by close(): the connection drops its unsent requests
        self.last: bool | None = None  # whether it was the connection's last share (``_let_go``)
        self.given_back = False  # close() ended: nothing of it is left to do
        self._finalizer = weakref.finalize(self, _collected, conn)
        self._finalizer.atexit = False  # at exit close_all stops every connection in order

    def close(self, settle_puts: bool = True, withdraw: bool = True, bye: bool = True) -> None:
        """Wait (at most the heartbeat expiry) for this handle's put acknowledgements, then give
        the share back.  The last share closes the connection (``bye``: the broker withdraws
        its parked requests); otherwise this handle's own parked requests are cancelled at the
        broker (``withdraw``).  Requests it leaves fail with ``ChannelError``.  An interruption
        (Ctrl-C) of the wait for acknowledgements ends that wait: the share is given back all
        the same; one while it is given back leaves the rest to the next call.  Idempotent."""
        if self.given_back:
            return
        conn = self.conn
        try:
            if settle_puts and not self.closed and conn.pid == os.getpid() \
                    and not conn.holds_socket():
                settle(conn, self, conn.hb * conn.liveness)
        finally:
            self._give_back(withdraw, bye)

    def _give_back(self, withdraw: bool, bye: bool) -> None:
        """``close`` after the wait for acknowledgements; each step is done once, whichever
        interruption cut an earlier call short."""
        conn = self.conn
        if self.last is None:
            self.closed = True
            self._finalizer.detach()
            conn.drop_waiting(self)
            _let_go(conn, self)
        if self.last:
            conn.close(bye=bye)  # (again after an interruption: it only waits again)
        elif withdraw:
            withdraw_requests(conn, self, conn.hb * conn.liveness)
        self.given_back = True


def share_key(address: str, identity: str | None, curve: Any, shm: bool | None) -> tuple:
    """What makes two handles' connections different (``curve``: ``curve.CurveKeys``)."""
    return (address, identity, curve, shm_env_enabled() if shm is None else bool(shm),
            direct_enabled())


def acquire(address: str, identity: str | None, curve: Any, shm: bool | None,
            broker_pid: int | None = None) -> Share:
    """A share of this process's connection for these settings, made now if there is none
    (``wait_up`` on it before use; ``ChannelNotFound`` at once when none is and nothing can be
    listening at ``address``).  ``broker_pid``: the broker process known to serve
    ``address`` now (one ``Channel.create`` just started, or the one a channel's lock file
    names); a connection whose hello another process answered is not shared then: a broker
    that replaced a dead one at the same address does not know it (see the module
    docstring)."""
    if _exiting:
        raise ChannelError("the interpreter is exiting: no new connections")
    key = share_key(address, identity, curve, shm)
    with _lock:
        conn = _take(key, broker_pid)
    _apply_deferred()
    if conn is None:
        check_host(address)
        probe(address)  # nothing can be listening (no socket file...): at once, no hello wait
        fresh = Connection(address, identity=identity, curve=curve, shm=shm, revives=True)
        with _lock:
            conn = _take(key, broker_pid)
            if conn is None:
                conn = fresh
                _by_key[key], _keys[conn], _count[conn] = conn, key, 1
        _apply_deferred()
        if conn is not fresh:  # another thread made one first
            fresh.close(bye=False)
    return Share(conn)


def check_host(address: str) -> None:
    """``ChannelNotFound`` at once for a tcp ``address`` whose host is neither an IP address
    nor a name that resolves (``tcp://256.1.1.1:5555``, ``tcp://example.invalid:5555``):
    ZeroMQ would try it in the background until the hello's timeout.  One lookup, made for a
    new connection only; a lookup that fails for another reason (no answer from the name
    server) is left to the hello."""
    hp = tcp_host_port(address)
    if hp is None or hp[0] == "*":
        return
    try:
        socket.getaddrinfo(hp[0], hp[1], type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_SUCH_HOST:
            raise ChannelNotFound(f"no broker at {address}: its host {hp[0]!r} is no IP address "
                                  f"and no name that resolves ({exc.strerror})") from None
    except (OSError, UnicodeError):
        pass  # what ZeroMQ makes of it is the hello's to tell


# getaddrinfo's answers that the host does not exist (not that no name server answered)
_NO_SUCH_HOST = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def _take(key: tuple, broker_pid: int | None = None) -> Connection | None:
    conn = _by_key.get(key)
    if conn is None or conn.closing or conn.state == CLOSED or conn.pid != os.getpid():
        return None
    if broker_pid is not None and conn.broker_info.pid != broker_pid:
        return None  # said hello to another broker (or none yet): the caller makes a new one
    _count[conn] += 1
    return conn


def _let_go(conn: Connection, share: Share) -> None:
    """One share of ``conn`` less: ``share.last`` says whether it was the last (then no new
    handle can get the connection), set in the same step (an interruption leaves no share
    dropped twice).  A forked child's copy counts as the last: its parent closes it."""
    if conn.pid != os.getpid():
        share.last = True
        return
    with _lock:  # (``with``: an interruption never leaves it taken)
        share.last = _drop(conn)
    _apply_deferred()


def _collected(conn: Connection) -> None:
    """A share was garbage collected (its finalizer: any thread, any moment)."""
    if conn.pid == os.getpid():
        _deferred.append(conn)
        _apply_deferred()


def _drop(conn: Connection) -> bool:
    """With ``_lock`` taken: one share of ``conn`` less; True when it was the last (then no
    new handle can get it)."""
    left = _count.get(conn, 1) - 1
    if left > 0:
        _count[conn] = left
        return False
    _count.pop(conn, None)
    key = _keys.pop(conn, None)
    if key is not None and _by_key.get(key) is conn:
        del _by_key[key]
    return True


def _apply_deferred() -> None:
    """Apply the releases of collected shares, unless a thread holds ``_lock`` (it applies
    them when it gave the lock back)."""
    while _deferred and _lock.acquire(blocking=False):
        try:
            conn = _deferred.popleft() if _deferred else None
            last = conn is not None and _drop(conn)
        finally:
            _lock.release()
        if last and conn is not None:
            conn.close()


def shares(conn: Connection) -> int:
    """How many handles of this process share ``conn`` now."""
    with _lock:
        count = _count.get(conn, 0)
    _apply_deferred()
    return count


def settle(conn: Connection, owner: Share | None, limit: float) -> None:
    """Wait up to ``limit`` seconds for the acknowledgements of ``owner``'s puts (None: of
    every handle's), while the broker can still answer them (``Connection.broker_gone``)."""
    deadline = time.monotonic() + limit
    while conn.state == UP and not conn.closing and conn.pid == os.getpid():
        puts = [work for _, work, is_put in conn.requests_of(owner) if is_put]
        remaining = deadline - time.monotonic()
        if not puts or remaining <= 0 or conn.broker_gone():
            return
        try:
            puts[0].wait(min(remaining, GONE_CHECK_S))
        except Exception:  # failed, or not yet: look again
            pass


def withdraw_requests(conn: Connection, owner: Share, limit: float) -> None:
    """Withdraw the requests of ``owner``, a closed share whose connection other handles keep:
    unsent ones are dropped, sent ones cancelled at the broker; each fails with
    ``ChannelError`` unless its reply came first.  Waits up to ``limit`` for the broker's
    answers, unless the caller holds the socket (a done-callback): they are applied as they
    come then."""
    inside = conn.holds_socket()
    if not inside:
        conn.flush()  # after this, no request of the closed owner can go out
    # the newest first: withdrawing one lets the broker serve the requests behind it, which
    # would take items for this closed share if they were its own
    mine = [rid for rid, _, _ in conn.requests_of(owner)][::-1]
    closed = ChannelError("this channel handle is closed")
    asks = []
    for rid in mine:
        try:
            ask = conn.request(Cancel(id=0, request_id=rid), [], room=False)
        except ChannelError:  # the connection closes: its I/O thread fails what is left
            return
        # withdrawn, or its reply came before the answer: either way nothing more comes
        ask.add_done_callback(functools.partial(_forget, conn, rid, closed))
        asks.append(ask)
    if inside:
        return
    deadline = time.monotonic() + limit
    for ask in asks:
        try:
            ask.wait(max(0.0, deadline - time.monotonic()))
        except (ChannelError, TimeoutError):
            pass
    for rid in mine:  # no answer in time (a silent broker): not delivered here
        conn.forget(rid, closed)


def _forget(conn: Connection, rid: int, exc: BaseException, _work: Work) -> None:
    conn.forget(rid, exc)


def close_all() -> None:
    """At interpreter exit: every connection of this process waits (at most the heartbeat
    expiry, less when its broker is gone) for its put acknowledgements, then stops its I/O
    thread, which closes its descriptors last; all are joined before the interpreter goes on,
    so that no daemon thread polls a descriptor while the interpreter shuts down.  Handles
    used after this raise ``ChannelError``."""
    global _exiting
    _exiting = True
    conns = [c for c in list(connection.running)
             if isinstance(c, connection.Connection) and c.pid == os.getpid()]
    for conn in conns:
        settle(conn, None, conn.hb * conn.liveness)
    for conn in conns:
        conn.stop()
    deadline = time.monotonic() + JOIN_S
    for conn in conns:
        conn.join(max(0.0, deadline - time.monotonic()))


def _after_fork() -> None:
    """In a forked child: the parent's connections are dead here (their threads did not fork).
    Close this process's copies of their link and wake-up descriptors (a parent's link must end
    when the parent closes it, not when its children exit) and mark them closing: nothing in
    the child sends on them, and its handles connect anew.  Their ZeroMQ sockets belong to the
    parent's context, which a child must not touch."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    _deferred.clear()
    _by_key.clear()
    _count.clear()
    _keys.clear()
    for conn in list(connection.running):
        conn.after_fork()
    connection.running.clear()


os.register_at_fork(after_in_child=_after_fork)
