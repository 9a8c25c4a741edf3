"""In-process channels (``Channel.create(name, local=True)``).

The same ``QueueCore`` and hook pipeline as a broker, driven under a lock in the caller's process;
items are passed by reference (no serialization), in the form a broker would deliver them
(``wireform.wire_form``: the item itself unless something in it travels in a base form, e.g. an
unregistered ``str`` Enum member as its value).  A small timer thread expires deadlines.
A local channel is not picklable; ``Channel.connect(name)`` in the same process returns another
handle to it.  It lives in the process that created it: a forked child has only a copy, whose
handles raise ``ChannelError`` and whose names are free there.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
from zchannel.broker.connection.work import Delivery, Work
from zchannel.broker.core.queuecore import QueueCore
from zchannel.broker.core.state import Client, Item
from zchannel.broker.errors import BrokerUnavailable, ChannelError
from zchannel.broker.handle.broker_channel import BrokerChannel
from zchannel.broker.shm.client import empty_array
from zchannel.broker.shm.pool import check_reserve
from zchannel.broker.wire import codec
from zchannel.broker.wire.argchecks import (
    check_peek_count,
    check_target_weight,
    check_timeout,
    check_weight,
)
from zchannel.broker.wire.protocol import (
    Ack,
    Full,
    Get,
    GetBatch,
    Peek,
    Put,
    QSize,
    Request,
    Stats,
    op_of,
)
from zchannel.broker.wire.refusals import refused_at
from zchannel.broker.wire.wireform import wire_form
from zchannel.hooks import resolve_collector, resolve_dispatcher

_registry: dict[str, _LocalBroker] = {}
_registry_lock = threading.Lock()


class _LocalBroker:
    """The state behind every handle of one local channel."""

    def __init__(self, name: str, maxsize: int, *, collector: Any, dispatcher: Any,
                 producers: list[str], consumers: list[str], options: dict[str, Any],
                 lease_timeout: float) -> None:
        self.name = name
        self.pid = os.getpid()  # the process it lives in (a forked child has a copy)
        self.lease_timeout = float(lease_timeout)  # in stats(), as a broker's
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        # each request waiting for its answer: its Work, whether to copy, the handle it is of,
        # whether it is a put
        self.pending: dict[tuple[int, int], tuple[Work, bool, LocalChannel, bool]] = {}
        self.closing = 0  # handles in ``leave`` waiting for their puts
        # the client of each identity of this process's handles, and how many hold it: as the
        # handles of one process share their connection to a broker (leases belong to it)
        self.clients: dict[str | None, tuple[Client, int]] = {}
        self.ids = itertools.count(1)
        self.closed = False
        # clients whose handle was garbage collected unclosed (its finalizer: any thread, any
        # moment), released by the timer thread as a broker drops a collected connection's
        self.collected: deque[Client] = deque()
        self.core = QueueCore(
            name=name, maxsize=maxsize,
            collector=resolve_collector(collector), dispatcher=resolve_dispatcher(dispatcher),
            producers=tuple(producers), consumers=tuple(consumers), options=options,
            reply=self._reply, decode_item=lambda item: item.payload,
            encode_item=_local_item,
            lease_timeout=lease_timeout,
        )
        self.timer = threading.Thread(target=self._run_timers, name=f"zchannel-local {name}",
                                      daemon=True)
        self.timer.start()

    def _run_timers(self) -> None:
        with self.cv:
            while not self.closed:
                while self.collected:
                    self._release(self.collected.popleft())
                deadline = self.core.next_deadline()
                now = time.monotonic()
                if deadline is not None and deadline <= now:
                    self.core.tick(now)
                    continue
                # at most TIMER_WAIT_S: a deadline years ahead would overflow the wait
                self.cv.wait(TIMER_WAIT_S if deadline is None
                             else min(deadline - now, TIMER_WAIT_S))

    def _reply(self, client: Client, rid: int, result: Any = None,
               error: BaseException | None = None, items: list[Item] | None = None,
               batch: bool = False, lease: int | None = None, origin: Any = None) -> None:
        entry = self.pending.pop((id(client), rid), None)
        if entry is None:
            return
        if self.closing:
            self.cv.notify_all()  # a closing handle may wait for this put
        work, copy = entry[0], entry[1]
        if error is not None:
            work.set_exception(error)
        elif items is not None:
            values = [_copy(item.payload) if copy else item.payload for item in items]
            if batch:
                work.set_result(values)
            elif lease is not None:
                work.set_result(Delivery(values[0], lease))
            else:
                work.set_result(values[0])
        else:
            work.set_result(result)

    def lives_here(self) -> bool:
        """Whether this process is the one the channel lives in (not a forked child's copy)."""
        return self.pid == os.getpid()

    def reads_here(self) -> bool:
        """Whether this thread is completing requests of this channel (it holds its lock: a
        done-callback or ``then()`` runs there), where a blocking call would wait for itself -
        the question a broker connection's ``Line`` answers for ``Work``."""
        return bool(self.lock._is_owned())  # type: ignore[attr-defined]

    def attach(self, handle: LocalChannel) -> Client:
        """The client of ``handle`` (made at its first request): the one of the other open
        handles of its identity, else a new one."""
        with self.cv:
            if handle._client is None:  # (two threads may ask at once: one attaches)
                identity = handle.identity
                entry = self.clients.get(identity)
                client = Client(address=self, identity=identity) if entry is None else entry[0]
                self.clients[identity] = (client, 1 if entry is None else entry[1] + 1)
                handle._client = client
                # dropped unclosed, the handle leaves as a collected broker connection does
                handle._finalizer = weakref.finalize(handle, self.collected_handle, client)
                handle._finalizer.atexit = False
            return handle._client

    def submit(self, handle: LocalChannel, client: Client, rec: Request, item: Any,
               copy: bool | None) -> Work:
        with self.cv:
            if self.closed:
                raise BrokerUnavailable(f"local channel {self.name!r} was shut down")
            rid = next(self.ids)
            work = Work(functools.partial(_cancel_of, self, client, rid))
            work._line = self  # a wait in a callback of this channel is refused (reads_here)
            self.pending[(id(client), rid)] = (work, bool(copy), handle, isinstance(rec, Put))
            core = self.core
            try:
                if isinstance(rec, Put):
                    core.put(client, rid, rec.key, Item(item, check_weight(rec.weight), 0, item, True),
                             check_timeout(rec.timeout), rec.nowait)
                elif isinstance(rec, Get):
                    core.get(client, rid, rec.key, check_timeout(rec.timeout), rec.nowait,
                             ack=rec.ack)
                elif isinstance(rec, GetBatch):
                    core.get(client, rid, rec.key, check_timeout(rec.timeout), rec.nowait,
                             batch_target=check_target_weight(rec.target))
                elif isinstance(rec, QSize):
                    self._reply(client, rid, result=core.qsize(rec.key, rec.consumer))
                elif isinstance(rec, Full):
                    self._reply(client, rid, result=core.full(rec.key, rec.consumer))
                elif isinstance(rec, Stats):
                    self._reply(client, rid, result=dict(
                        core.stats(), address=None, lease_timeout=self.lease_timeout))
                elif isinstance(rec, Ack):
                    core.ack(client, rid, rec.lease)
                elif isinstance(rec, Peek):  # (copy, weight) pairs: the items stay where they are
                    items = core.peek(rec.key, check_peek_count(rec.count), rec.consumer)
                    self._reply(client, rid, result=[(_copy(i.payload), i.weight) for i in items])
                else:
                    raise ValueError(f"unknown op {op_of(rec)!r}")
            except Exception as exc:
                self._reply(client, rid, error=exc)
            self.cv.notify()
            return work

    def cancel(self, client: Client, rid: int) -> bool:
        with self.cv:
            entry = self.pending.get((id(client), rid))
            if entry is None:
                return False
            answer = Work()
            cancel_rid = next(self.ids)
            self.pending[(id(client), cancel_rid)] = (answer, False, entry[2], False)
            self.core.cancel(client, cancel_rid, rid)
            if answer.result():
                self.pending.pop((id(client), rid), None)
                entry[0].set_exception(CancelledError("the operation was withdrawn"))
                return True
            return False

    def leave(self, handle: LocalChannel, client: Client) -> None:
        """``handle`` closed: its puts waiting for room get ``CLOSE_WAIT_S`` to get in (as a
        broker handle waits for its puts' acknowledgements), then its waiting requests are
        withdrawn and fail; its client leaves (its leases return to their queues) with the last
        handle that held it."""
        with self.cv:
            deadline = time.monotonic() + CLOSE_WAIT_S
            self.closing += 1
            try:
                while not self.closed and any(
                        entry[2] is handle and entry[3] for entry in self.pending.values()):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self.cv.wait(remaining)
            finally:
                self.closing -= 1
            # the newest first: withdrawing one lets the core serve the requests behind it,
            # which are then no longer this handle's
            for key in reversed([k for k, entry in self.pending.items() if entry[2] is handle]):
                entry = self.pending.pop(key, None)
                if entry is None:  # answered meanwhile
                    continue
                self.core.cancel(client, next(self.ids), key[1])  # its answer goes nowhere
                entry[0].set_exception(ChannelError("this channel handle is closed"))
            self._release(client)

    def _release(self, client: Client) -> None:
        """With the lock taken: one handle of ``client`` less; with its last one the client
        leaves (its leases return to their queues, its consumer id leaves)."""
        entry = self.clients.get(client.identity)
        if entry is None or entry[0] is not client:
            return
        if entry[1] > 1:
            self.clients[client.identity] = (client, entry[1] - 1)
            return
        del self.clients[client.identity]
        self.core.client_gone(client)

    def collected_handle(self, client: Client) -> None:
        """A handle of ``client`` was garbage collected without ``close()`` (any thread, maybe
        inside an operation of this channel): the timer thread releases it."""
        self.collected.append(client)
        if self.lock.acquire(blocking=False):  # else the holder's wait or return wakes it
            try:
                self.cv.notify_all()
            finally:
                self.lock.release()

    def new_handle(self, identity: str | None) -> LocalChannel:
        """Another handle to this channel (what ``Channel.connect(name)`` returns)."""
        return LocalChannel(self, identity, owner=False)

    def shutdown(self) -> None:
        with self.cv:
            self.closed = True
            pending, self.pending = self.pending, {}
            for entry in pending.values():
                entry[0].set_exception(BrokerUnavailable(f"local channel {self.name!r} was shut down"))
            self.cv.notify_all()
        # not from the timer thread, nor from a thread holding the lock (a done-callback runs
        # there): the timer thread could not take the lock to end
        if self.timer is not threading.current_thread() and not self.reads_here():
            self.timer.join()
        with _registry_lock:
            if _registry.get(self.name) is self:
                del _registry[self.name]


# the longest the timer thread sleeps before it looks at its deadlines again
TIMER_WAIT_S = 3600.0
# how long a closing handle's puts waiting for room may take to get in: a broker handle's
# wait for its puts' acknowledgements, at the default heartbeat expiry
CLOSE_WAIT_S = 3.0

SELF_CALL = ("a blocking channel call in a done-callback or then() of a local channel runs while "
             "this thread completes its requests and would wait for itself: make it with "
             "async_op=True, or from another thread")


def _forget_parent_channels() -> None:
    """In a forked child: the parent's local channels are not this process's (their handles
    raise ``ChannelError``, ``LocalChannel._live_broker``) and their names are free here; a
    lock a parent's thread held at the fork is not this process's either."""
    global _registry_lock
    _registry_lock = threading.Lock()
    _registry.clear()


os.register_at_fork(after_in_child=_forget_parent_channels)


def _cancel_of(broker: _LocalBroker, client: Client, rid: int, _work: Work) -> bool:
    """The cancel function of request ``rid`` of ``client`` (its ``Work``'s)."""
    return broker.cancel(client, rid)


def _local_item(value: Any, weight: int | float) -> Item:
    """A collector output, in wire form like a put (a broker would have to encode it)."""
    value = wire_form(value)
    return Item(value, weight, 0, value, True)


def _copy(value: Any) -> Any:
    body, buffers = codec.encode(value)
    return codec.decode(body, buffers, copy=True)


class LocalChannel(BrokerChannel):
    """A handle of an in-process channel: the API of ``Channel``, with its requests handled by an
    in-process ``QueueCore`` instead of a broker process."""

    def __init__(self, broker: _LocalBroker, identity: str | None, owner: bool) -> None:
        super().__init__(broker.name, f"local://{broker.name}", identity=identity)
        self._broker = broker
        self._owner = owner
        self.created = owner
        self._client: Client | None = None  # attached at its first request
        self._finalizer: weakref.finalize[Any, Any] | None = None  # its leaving if collected unclosed

    @classmethod
    def create_local(cls, name: str, maxsize: int, *, identity: str | None, **kwargs: Any) -> LocalChannel:
        codec.encode(kwargs.get("options"))  # msgpack-able, as a broker's: TypeError naming it
        with _registry_lock:
            existing = _registry.get(name)
            if existing is None:
                broker = _registry[name] = _LocalBroker(name, maxsize, **kwargs)
                return cls(broker, identity, owner=True)
        handle = cls(existing, identity, owner=False)
        handle._log_attached()
        return handle

    @classmethod
    def lookup(cls, name: str) -> _LocalBroker | None:
        with _registry_lock:
            return _registry.get(name)

    def _submit(self, rec: Request, item: Any = None, *, has_item: bool = False,
                copy: bool | None = None, wait: bool = False) -> Work:
        if self._closed:
            raise ChannelError("this channel handle is closed")
        broker = self._live_broker()
        if wait and broker.reads_here():  # in a done-callback, as on a broker channel
            raise RuntimeError(SELF_CALL)
        client = self._client or broker.attach(self)
        if has_item:  # no serialization, but what a broker would deliver, or its TypeError
            try:
                item = wire_form(item)
            except TypeError as exc:  # (naming where the refused value is in the item)
                raise refused_at(exc, item) from None
        return broker.submit(self, client, rec, item, copy)

    def _live_broker(self) -> _LocalBroker:
        """The channel this handle reaches: ``ChannelError`` in a forked child (the channel
        lives in its creating process; the child has a copy nobody serves: no timer thread, a
        lock maybe held for ever); once shut down, the channel created again under its name,
        if any (as a broker channel's handle reconnects to a broker serving its address again;
        its leases were the old channel's)."""
        broker = self._broker
        if not broker.lives_here():
            raise ChannelError(
                f"local channel {broker.name!r} lives in process {broker.pid}, which created "
                f"it; this process ({os.getpid()}) is a fork of it and has only a copy: share a "
                "channel between processes with a broker channel (local=False)")
        if broker.closed:
            fresh = LocalChannel.lookup(broker.name)
            if fresh is not None and fresh is not broker:
                with self._conn_lock:
                    if self._broker is broker:
                        if self._finalizer is not None:
                            self._finalizer.detach()
                        self._broker, self._client, self._finalizer = fresh, None, None
                broker = self._broker
        return broker

    @property
    def is_local(self) -> bool:
        return True

    def reserve_shm(self, nbytes: int, slots: int) -> int:
        """Items of a local channel are passed by reference: no shared memory, always 0."""
        check_reserve(nbytes, slots)
        return 0

    def empty_shm(self, shape: Any, dtype: Any = np.float32) -> Any:
        """Items of a local channel are passed by reference: a plain ``numpy.empty`` /
        ``torch.empty`` (the same checks as ``Channel.empty_shm``)."""
        return empty_array(None, shape, dtype)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._client is not None and self._broker.lives_here():  # not a fork's copy
            self._broker.leave(self, self._client)

    def shutdown(self, token: str | None = None) -> None:
        """Stop the local broker (the creating handle only; a local channel has no shutdown
        ``token``: it is not used)."""
        if not self._owner:
            raise PermissionError("only the handle that created the channel may shut it down")
        self.close()
        if self._broker.lives_here():  # a forked child's copy is nobody's to stop
            self._broker.shutdown()

    def _owns_broker(self) -> bool:
        return self._owner

    def __reduce__(self) -> Any:
        raise TypeError("a local channel cannot be pickled: it lives in one process")


__all__ = ["LocalChannel"]
