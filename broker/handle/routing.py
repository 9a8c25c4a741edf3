"""Key routing of a distributed channel handle (client side): which replica holds a key.

``KeyRouting`` is held by a ``DistributedChannel`` (``handle/distributed.py``): it binds keys
and follows them, knowing of the handle only its replica table, its node and how to reach a
replica (``sub(index)``).  The first operation of any kind on a key asks the binder (``broker/cluster/binding.py``):
it starts with the replica that answered last, follows ``BindAnswer`` redirects, goes on to the
next replica when one is unavailable, and waits while a replica joins.  A replica that has not
answered within ``BIND_HEDGE_S`` stays asked and the next one is asked meanwhile: a binder that
died is replaced the moment its heartbeat expiry ends, before this handle's own connection to it
notices; a replica that cannot be connected (nothing can be listening at its address:
``paths.probe``) is passed over at once.  The answer is cached; a channel that moves keys (``steal``, ``broker/cluster/moving.py``)
answers an operation on a key that moved with ``KeyMoved``, and the cached binding follows it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from zchannel.broker.cluster.clusterfile import Replica
from zchannel.broker.connection.tuning import CONNECT_S
from zchannel.broker.connection.work import Work
from zchannel.broker.errors import BrokerUnavailable, ChannelError, KeyMoved
from zchannel.broker.handle.broker_channel import DEFAULT_KEY, BrokerChannel
from zchannel.broker.wire.argchecks import check_key
from zchannel.broker.wire.protocol import Bind, bind_answer

# binding a key: how long one replica may take to accept a connection, the pause before asking
# again (a replica joins, the binder changes), when to try a replica that was unavailable, and
# the limit for the whole (generous: a failover takes one heartbeat expiry, a join as long)
BIND_CONNECT_S = 3.0
BIND_RETRY_S = 0.02
BIND_RECHECK_S = 0.5  # a replica found unavailable is asked again after this (it may be back)
BIND_DEADLINE_S = 30.0
BIND_HEDGE_S = 0.25  # a replica silent this long on a bind request: ask the next one too


_T = TypeVar("_T")


class KeyRouting:
    """Binding and following the keys of one distributed handle (see the module docstring):
    ``replicas``, its replica table; ``node``, the node it runs on; ``name``, the channel (for
    messages); ``sub(index)``, its handle of replica ``index``."""

    def __init__(self, replicas: list[Replica], node: str, name: str | None,
                 sub: Callable[[int], BrokerChannel]) -> None:
        self._replicas = replicas
        self._node = node
        self._name = name
        self._sub = sub
        self._bindings: dict[Any, int] = {}  # key -> its replica, as bound or last told
        self._binder = 0  # the replica that answered the last binding request

    def replica_of(self, key: Any = DEFAULT_KEY) -> int:
        """The index of the replica ``key`` is bound to, binding it now (first touch) if this
        handle has not seen it yet."""
        key = check_key(key)
        index = self._bindings.get(key)
        if index is not None:
            return index
        index = 0 if len(self._replicas) == 1 else self._bind(key)
        self._bindings[key] = index
        return index

    def node_of(self, key: Any = DEFAULT_KEY) -> str:
        """The node whose replica holds ``key`` (binds it on first touch, like any operation)."""
        return self._replicas[self.replica_of(key)].node

    def _bind(self, key: Any) -> int:
        """Ask the binder (``broker/cluster/binding.py``) for ``key``'s replica: start with the last
        binder, follow redirects, go on to the next replica when one is unavailable; wait
        while a replica joins.  A replica that has not answered within ``BIND_HEDGE_S`` stays
        asked, and the next one is asked meanwhile (it takes over the moment the silent
        binder's heartbeat expiry ends, before this handle's own connection notices).
        ``BrokerUnavailable`` when every replica failed in a row or no answer came within
        ``BIND_DEADLINE_S``."""
        n = len(self._replicas)
        deadline = time.monotonic() + BIND_DEADLINE_S
        target, unavailable, last_error = self._binder, 0, None
        failed: dict[int, float] = {}  # replica -> when it was last found unavailable
        asked: dict[int, Work] = {}  # replicas asked that have not answered yet
        while True:
            answers = []  # (replica, answer) of this turn
            work = asked.pop(target, None)
            try:
                if work is None:
                    sub = self._sub(target)
                    sub._connection(timeout=BIND_CONNECT_S)
                    work = sub._submit(Bind(id=0, key=key, node=self._node))
                answers.append((target, work.wait(
                    max(0.0, min(BIND_HEDGE_S, deadline - time.monotonic())))))
                unavailable = 0
            except BrokerUnavailable as exc:
                unavailable, last_error = unavailable + 1, exc
                failed[target] = time.monotonic()
                if unavailable >= n:
                    raise BrokerUnavailable(f"no replica of {self._name!r} answers to bind "
                                            f"{key!r}: {last_error}") from exc
                target = (target + 1) % n
            except TimeoutError:
                if work is not None:
                    asked[target] = work  # slow, or dead before its expiry: ask the next meanwhile
                target = (target + 1) % n
            answers += _late_answers(asked, failed)
            bound = _bound(answers, key, n)
            if bound is not None:
                self._binder, replica = bound
                return replica
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(f"no replica of {self._name!r} bound {key!r} within "
                                        f"{BIND_DEADLINE_S}s")
            answer = answers[0][1] if answers and answers[0][0] == target else None
            told = bind_answer(answer)
            redirect = told.redirect() if told is not None else None
            if redirect is not None and 0 <= redirect < n and redirect != target \
                    and redirect not in asked \
                    and time.monotonic() - failed.get(redirect, -1e9) >= BIND_RECHECK_S:
                target = redirect
            elif answer is not None:
                time.sleep(BIND_RETRY_S)  # a replica joins, or the binder changes: ask again

    def on(self, key: Any, call: Callable[[BrokerChannel, int], _T], *,
           connect_s: float = CONNECT_S, async_op: bool = False) -> _T:
        """``call(handle, index)`` on the replica holding ``key``, after at most ``connect_s``
        seconds for this handle's first connection to that replica (``ChannelNotFound`` then,
        or at once when nothing can be listening there: a replica that died; for an
        asynchronous operation, ``async_op``, a ``Work`` failed with it).  A channel that moves keys
        (``steal``) answers an operation on a key that moved with ``KeyMoved`` (nothing
        happened): the cached binding is corrected and the operation sent again, there.  An
        asynchronous operation's ``Work`` fails with it instead (its binding corrected: send it
        again)."""
        deadline = None
        while True:
            index = self.replica_of(key)
            sub = self._sub(index)
            try:
                sub._acquired(connect_s)  # a first connection: at once when nothing listens
            except BrokerUnavailable as exc:
                if not async_op:
                    raise
                failed = Work()
                failed.set_exception(exc)
                return cast(_T, failed)
            try:
                result = call(sub, index)
            except KeyMoved as moved:
                deadline = deadline or time.monotonic() + BIND_DEADLINE_S
                self._moved(key, index, moved, deadline)
                continue
            if isinstance(result, Work):
                result.add_done_callback(functools.partial(self._moved_async, key, index))
            return result

    def _moved(self, key: Any, index: int, moved: KeyMoved, deadline: float) -> None:
        if not 0 <= moved.replica < len(self._replicas) or moved.replica == index:
            raise ChannelError(f"replica {index} says {key!r} moved to replica {moved.replica}")
        if time.monotonic() > deadline:
            raise BrokerUnavailable(f"key {key!r} did not settle on a replica of {self._name!r} "
                                    f"within {BIND_DEADLINE_S}s") from moved
        if self._bindings.get(key) == index:
            self._bindings[key] = moved.replica
        time.sleep(BIND_RETRY_S)  # the new replica may not have learned the move yet

    def _moved_async(self, key: Any, index: int, work: Work) -> None:
        moved = work.exception()
        if isinstance(moved, KeyMoved) and 0 <= moved.replica < len(self._replicas) \
                and self._bindings.get(key) == index:
            self._bindings[key] = moved.replica


__all__ = ["BIND_DEADLINE_S", "BIND_HEDGE_S", "KeyRouting"]


def _late_answers(asked: dict[int, Work], failed: dict[int, float]) -> list[tuple[int, Any]]:
    """The answers of replicas asked earlier that came since (taken out of ``asked``; one
    that failed is marked in ``failed``)."""
    answers = []
    for i, late in list(asked.items()):
        if late.done():
            del asked[i]
            try:
                answers.append((i, late.result()))
            except BrokerUnavailable:
                failed[i] = time.monotonic()
    return answers


def _bound(answers: list[tuple[int, Any]], key: Any, n: int) -> tuple[int, int] | None:
    """``(binder, replica)`` of the first answer that bound ``key`` (None: none did);
    ``ChannelError`` for a replica out of range."""
    for i, answer in answers:
        if isinstance(answer, int) and not isinstance(answer, bool):
            if not 0 <= answer < n:
                raise ChannelError(f"replica {i} bound {key!r} to an unknown replica "
                                   f"{answer!r}")
            return i, answer
    return None
