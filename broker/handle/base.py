"""``ChannelHandle``: what a channel handle is apart from its operations.

A handle takes its share of this process's connection to its broker (``connection/sharing.py``) at first
use, and again in a forked child or after the connection ended; gives it back on ``close``;
stops the broker on ``shutdown`` if its ``create`` started it; pickles to its name, address,
identity, keys and shared-memory switch (an unpickled copy connects anew).  At interpreter exit
the brokers this process started are stopped and every connection closed.  The operations
(``put``, ``get``, ...) are ``BrokerChannel``'s (``handle/broker_channel.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing.Self is Python 3.11+
    from typing_extensions import Self

from zchannel.broker.connection import sharing
from zchannel.broker.connection.connection import CLOSED, Connection
from zchannel.broker.connection.tuning import connect_budget
from zchannel.broker.errors import ChannelError, ChannelNotFound
from zchannel.broker.host import paths
from zchannel.broker.host.procs import process_running
from zchannel.broker.server import rundir
from zchannel.broker.server.starting import BrokerProcess, stop_broker
from zchannel.broker.shm.client import check_shm_switch
from zchannel.broker.transport.curve import client_keys
from zchannel.broker.wire.protocol import Shutdown
from zchannel.hooks import check_consumer_id

log = logging.getLogger("zchannel.client")

_open_handles: weakref.WeakSet[ChannelHandle] = weakref.WeakSet()
# os.getpid() on every request is a system call; a forked child updates the cached value.
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


def _identity(identity: str | None) -> str | None:
    if identity is None:
        identity = os.environ.get("ZCHANNEL_IDENTITY") or None
    return None if identity is None else check_consumer_id(identity)


class ChannelHandle:
    """A handle's name, address, identity and its share of the process's connection to its
    broker, and its lifetime (``close``, ``shutdown``, pickling); ``BrokerChannel`` adds the
    operations."""

    _stopped_broker = False  # this handle's shutdown() stopped its broker (again: a no-op)
    # a replica's handle within a distributed one (``DistributedChannel._sub``): a new
    # connection first checks that something can listen at the address (``paths.probe``)
    _probes_before_connecting = False

    def __init__(self, name: str | None, address: str, *, identity: str | None = None,
                 curve_keys: Any = None, shm: bool | None = None) -> None:
        self._name = name
        self._address = address
        self._explicit_identity = identity
        self._identity: str | None = None
        self._identity_read = False
        self._curve_keys = curve_keys
        self._proc: BrokerProcess | None = None  # the broker this handle started (_adopt)
        self._token: str | None = None  # the shutdown token that broker accepts
        # the broker process known to serve the address when this handle was made (its first
        # connection must have said hello to that one: ``sharing.acquire``)
        self._broker_pid: int | None = None
        self._creator_pid = os.getpid()
        self._share: sharing.Share | None = None  # of this process's connection to the broker
        self._leaving: sharing.Share | None = None  # its share while ``_give_back`` gives it back
        self._conn_lock = threading.Lock()
        self._closed = False
        # same-host shared memory: None = on unless ZCHANNEL_SHM=0 (TypeError for a non-bool)
        self._shm = check_shm_switch(shm)
        self._keeper: Any = None  # the BrokerKeeper watching the broker it started (keeper.py)
        self.created = False
        _open_handles.add(self)

    def _adopt(self, proc: BrokerProcess, token: str) -> Self:
        """Make this handle the owner of the broker ``proc`` its ``create`` started: ``created``
        is True, and ``shutdown`` stops that broker with ``token``."""
        self._proc, self._token, self.created = proc, token, True
        self._broker_pid = proc.pid
        return self

    def _log_attached(self) -> None:
        """The warning of a ``create`` that attached to a running broker instead of starting
        one (``created`` is False); ``stats`` is the subclass's operation."""
        try:
            stats = self.stats()
        except ChannelError:
            stats = {}
        held = sum(k.get("depth", 0) for k in (stats.get("keys") or {}).values())
        log.warning("channel %r: attached to the broker already serving it (pid %s at %s, "
                    "%d items held) instead of starting one; its settings win, and shutdown() "
                    "is left to its creator", self._name, stats.get("pid", os.getpid()),
                    stats.get("address") or self._address, held)

    if TYPE_CHECKING:  # the operations are the subclass's (``BrokerChannel``)
        def stats(self, *, exclude_self: bool = False) -> dict[str, Any]: ...

    # -- connection --------------------------------------------------------------------------

    def _connection(self, timeout: float = 10.0) -> Connection:
        return self._acquired(timeout).conn

    @property
    def _conn(self) -> Connection | None:
        """The connection this handle uses (None before its first use and after ``close``)."""
        share = self._share
        return None if share is None else share.conn

    def _acquired(self, timeout: float = 10.0) -> sharing.Share:
        """This handle's share of the process's connection to its broker, taken at first use
        (and again in a forked child, or after the connection ended), waiting at most
        ``timeout`` seconds for the broker's hello: ``ChannelNotFound`` then, or at once when
        ``_probes_before_connecting`` and nothing can be listening at the address."""
        share = self._share
        if share is not None and share.conn.pid == _pid[0] and share.conn.state != CLOSED:
            return share
        if self._closed:
            raise ChannelError("this channel handle is closed")
        with self._conn_lock:
            share = self._share
            if share is not None:
                if share.conn.pid == os.getpid() and share.conn.state != CLOSED:
                    return share
                self._share = None  # a forked child's copy, or a connection that ended
                share.close(settle_puts=False, withdraw=False, bye=False)
            if self._closed:
                raise ChannelError("this channel handle is closed")
            deadline = time.monotonic() + timeout
            if self._probes_before_connecting:
                paths.probe(self._address)  # a dead replica's stale socket: no 10 s wait
            share = sharing.acquire(self._address, self.identity, client_keys(self._curve_keys),
                                    self._shm, self._broker_pid)
            if not share.conn.wait_up(max(0.0, deadline - time.monotonic())):
                share.close(settle_puts=False, withdraw=False)
                if share.conn.refused is not None:  # a CURVE mismatch (AuthenticationFailed)
                    raise share.conn.refused
                raise ChannelNotFound(f"no broker answered at {self._address} within {timeout}s")
            if self._name is None:
                self._name = share.conn.broker_info.name
            self._share, self._broker_pid = share, None
            return share

    def _acquired_for(self, rec: Any, async_op: bool = False) -> sharing.Share:
        """``_acquired`` for an operation's request ``rec``: a first connection waits for the
        broker's hello ``connect_budget`` of the operation's timeout (``timeout=0`` for a
        ``nowait`` one), and the time it took counts against that timeout (``rec.timeout`` is
        what is left of it)."""
        share = self._share
        if share is not None and share.conn.pid == _pid[0] and share.conn.state != CLOSED:
            return share
        nowait = getattr(rec, "nowait", False)
        timeout = 0.0 if nowait else getattr(rec, "timeout", None)
        start = time.monotonic()
        share = self._acquired(connect_budget(timeout, async_op))
        if timeout is not None and not nowait:
            rec.timeout = max(0.0, timeout - (time.monotonic() - start))
        return share

    def _give_back(self, settle_puts: bool = True, withdraw: bool = True, bye: bool = True) -> None:
        """Give this handle's share of the connection back (``sharing.Share.close``); a share
        whose giving back an interruption (Ctrl-C) cut short is finished here."""
        with self._conn_lock:
            share = self._share if self._share is not None else self._leaving
            self._share, self._leaving = None, share
        if share is not None:
            share.close(settle_puts=settle_puts, withdraw=withdraw, bye=bye)
            self._leaving = None

    @property
    def name(self) -> str | None:
        """The channel's name (for a handle connected by address: the name its broker reports)."""
        return self._name

    @property
    def address(self) -> str:
        """The broker's real address (``ipc://…`` or ``tcp://HOST:PORT``)."""
        return self._address

    @property
    def is_local(self) -> bool:
        """True for an in-process channel (``local=True``), False for one served by brokers."""
        return False

    @property
    def identity(self) -> str | None:
        """This handle's consumer id: ``identity=``, else ``ZCHANNEL_IDENTITY`` at first use."""
        if not self._identity_read:
            self._identity = _identity(self._explicit_identity)
            self._identity_read = True
        return self._identity

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait (at most the heartbeat expiry) for this handle's put acknowledgements, withdraw
        its parked requests, and give back its share of the process's connection to the broker,
        which closes with the last handle using it (``docs/decisions.md``).  Interrupted
        (Ctrl-C) while it waits for the acknowledgements, it stops waiting and still withdraws
        and gives back; what an interruption leaves undone, the next call does.  Idempotent."""
        self._closed = True
        self._give_back()

    def shutdown(self, token: str | None = None) -> None:
        """Stop the broker.  The handle whose ``create`` started it may; any other handle
        needs the broker's shutdown ``token`` (``zchannel broker stop NAME`` reads it from the
        run directory, ``docs/security.md``), else ``PermissionError`` (client-side, or from
        the broker for a wrong token; nothing changes).  This handle is closed afterwards; a
        second call on the handle that stopped the broker does nothing."""
        if self._stopped_broker:
            return
        if token is not None:
            if not isinstance(token, str):
                raise TypeError("token must be a str")
            self._request_shutdown(token, timeout=10.0)
            self._closed = self._stopped_broker = True
            self._give_back(settle_puts=False, withdraw=False, bye=False)  # the broker stops
            return
        if self._proc is None or self._creator_pid != os.getpid():
            raise PermissionError("only the handle that created the channel's broker may shut "
                                  "it down (or pass its shutdown token: docs/security.md)")
        if self._keeper is not None:
            self._keeper.stop()  # a broker stopped on purpose is not started again
        proc = self._proc
        try:
            # poll() says None while the keeper's thread reaps a dead broker (it holds Popen's
            # waitpid lock): one that exited (a zombie) is not asked to stop
            if proc.poll() is None and process_running(proc.pid):
                if self._closed:  # no connection to ask on: SIGTERM stops it the same way
                    proc.terminate()
                else:
                    self._request_shutdown(self._token, timeout=5.0)
        except (ChannelError, TimeoutError) as exc:  # it died meanwhile: it stopped already
            exc.__traceback__ = None  # its frames refer back to it: no cycle left for the GC
        self._closed = True
        self._give_back(settle_puts=False, withdraw=False, bye=False)  # the broker stops
        try:
            proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self._kill_broker()
        keeper, self._keeper = self._keeper, None
        if keeper is not None:  # its watch ends with the broker: no thread outlives this
            keeper.join()  # (a restart under way ends with its broker stopped)
        if proc.poll() not in (None, 0) and self._name is not None:
            # killed: it removed nothing of its own (its socket files too, wherever they are:
            # a replica's are outside the channel's default place)
            clean_after_dead_broker(self._name, (self.address,))
        self._proc = None
        self._stopped_broker = True

    def _request_shutdown(self, token: str | None, timeout: float) -> None:
        """Ask the broker to stop, with ``token``; its answer (``PermissionError`` for a wrong
        token) within ``timeout`` seconds."""
        share = self._acquired()  # past the in-flight limit: parked gets must not hold it
        share.conn.request(Shutdown(id=0, token=token), [], room=False,
                           owner=share).wait(timeout=timeout)

    def _kill_broker(self) -> None:
        """Stop the broker this handle started (``starting.stop_broker``: SIGTERM, SIGKILL)."""
        if self._keeper is not None:
            self._keeper.stop()
        if self._proc is not None:
            stop_broker(self._proc)

    def _broker_restarted(self, proc: BrokerProcess, token: str) -> None:
        """The keeper started this handle's broker again (a durable channel's broker died)."""
        self._proc, self._token = proc, token

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        """The owner of the broker shuts it down; any other handle closes."""
        if self._owns_broker():
            self.shutdown()
        else:
            self.close()

    def _owns_broker(self) -> bool:
        """Whether this handle started the broker, in this process (``__exit__`` stops it)."""
        return self._proc is not None and self._creator_pid == os.getpid()

    def __reduce__(self) -> Any:
        return (_unpickle, (type(self), self._name, self._address, self._explicit_identity,
                            self._curve_keys, self._shm))

    def __repr__(self) -> str:
        # cheap and local on purpose: no request (RLinf's str() fetched items; see peek())
        state = ", closed" if self._closed else ""
        return (f"{type(self).__name__}(name={self._name!r}, address={self._address!r}, "
                f"identity={self._explicit_identity!r}, created={self.created}{state})")


def _unpickle(cls: type[ChannelHandle], name: str | None, address: str, identity: str | None,
              curve_keys: Any, shm: bool | None = None) -> ChannelHandle:
    """A pickled handle again (``shm``: absent from pickles of older versions, which did not
    keep it)."""
    return cls(name, address, identity=identity, curve_keys=curve_keys, shm=shm)


def clean_after_dead_broker(name: str, addresses: tuple[str, ...] = ()) -> None:
    """The files and segments a broker this process started left when it was killed
    (``zchannel clean`` for its channel alone, under the channel's lock; ``addresses``:
    ``rundir.clean_channel``'s)."""
    try:
        removed = rundir.clean_channel(name, addresses)
    except OSError:
        return
    if removed:
        log.info("removed %d file(s) of channel %r's killed broker", len(removed), name)


@atexit.register
def _close_all() -> None:
    """At interpreter exit: stop the brokers this process started, then every connection of
    the process, in order (``sharing.close_all``); nothing is left running or open."""
    for handle in list(_open_handles):
        try:
            if handle._proc is not None and handle._creator_pid == os.getpid():
                handle.shutdown()
        except Exception:
            pass
    sharing.close_all()
