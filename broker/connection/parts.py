"""What the parts of a ``Connection`` share: its state and the methods one part calls on another.

``Connection`` (``connection/connection.py``) is made of ``IOThread``, ``Liveness``, ``Waiting``
and ``RequestQueue``; each derives from ``ConnectionParts``, which declares (for the type
checker; nothing here runs) the attributes ``Connection.__init__`` sets and the methods the
parts call across.  A part that reads something of another part reads it as declared here.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zchannel.broker.connection.work import Work
from zchannel.broker.errors import AuthenticationFailed
from zchannel.broker.shm.client import ShmClient
from zchannel.broker.transport.seam import Transport
from zchannel.broker.wire.protocol import HelloInfo, Request

# a reply converter: (the reply record, its frames) -> the Work's result
Convert = Callable[[Any, list], Any]

# a request in flight: (its Work, its reply converter or None, is it a put, the handle's
# share that issued it or None; see sharing.py)
Pending = tuple[Work, Convert | None, bool, Any]


class ConnectionParts:
    """The state and cross-part methods of a connection (declarations only)."""

    # the connection (connection.py)
    address: str
    identity: str | None
    hb: float
    liveness: int
    state: str
    broker_info: HelloInfo
    producer: bytes
    pid: int
    shm: ShmClient
    refused: AuthenticationFailed | None
    transport: Transport
    io_turns: int
    _state_cv: threading.Condition
    _wake: int
    _wake_lock: threading.Lock
    _wake_closed: bool
    _sock_lock: threading.Lock
    _holder: int
    _fds_closed: bool
    _woken: bool
    _io_idle: bool
    _io_lazy: bool
    _closing: bool
    _bye: bool
    _bye_id: int | None
    _hello_id: int
    _relink_at: float
    _callers_read: bool
    _readable: Any  # a zmq socket or a file descriptor, what a poll waits on for replies
    _thread: threading.Thread
    _last_recv: float
    _last_send: float
    # the request queue (requestqueue.py)
    _ids: itertools.count[int]
    _queue: deque[tuple[Request, list, Pending | None]]
    _pending: dict[int, Pending]
    # waiting callers (waiting.py)
    _read_end: float
    _sleepers: int

    if TYPE_CHECKING:
        def request(self, rec: Request, frames: list, convert: Convert | None = None,
                    cancellable: bool = False, room: bool = True, owner: Any = None) -> Work: ...
        def stop(self, bye: bool = True) -> None: ...
        def join(self, timeout: float = ...) -> None: ...
        def _set_state(self, state: str) -> None: ...
        def _send(self, records: list, frames: list) -> None: ...
        def _recv_all(self) -> None: ...
        def _recv_one(self, ready: bool = False) -> bool: ...
        # the I/O thread
        def _close_fds(self) -> None: ...
        # liveness
        def _watch_handshake(self) -> bool: ...
        def _relink(self, now: float) -> None: ...
        def _expiry_due(self) -> float: ...
        def _keepalive(self, now: float) -> None: ...
        def _send_hello(self) -> None: ...
        def _say_bye(self) -> None: ...
        # the request queue
        def _enqueue(self, rec: Request, frames: list, convert: Convert | None,
                     cancellable: bool, room: bool = True, owner: Any = None) -> Work: ...
        def _send_queued(self) -> None: ...
        def _release(self, owner: Any) -> None: ...
        def _fail_all(self, exc: BaseException) -> None: ...
        # waiting
        def _signal(self) -> None: ...
