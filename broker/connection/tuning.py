"""Client tuning: how a connection batches, spins, drives its socket and uses direct links.

Read once at import; ``ZCHANNEL_SPIN_US``, ``ZCHANNEL_LAZY_MS``, ``ZCHANNEL_BATCH`` and
``ZCHANNEL_DIRECT`` change them (README, ``docs/decisions.md``).  Each is parsed strictly
(``broker/host/environ.py``: an int >= 0, or a flag 0/1, false/true, no/yes, off/on in any
case): a malformed value is a ``ValueError`` naming the variable, raised at import (and
``ZCHANNEL_DIRECT``, read again at each connect, there too).  ``connection/connection.py`` and
its parts use them; the broker's direct-link listener sizes its message limit by
``MAX_BYTES_PER_MESSAGE``.
"""

from __future__ import annotations

import os

from zchannel.broker.host.environ import env_flag, env_int

MAX_OPS_PER_MESSAGE = 512
MAX_BYTES_PER_MESSAGE = 64 << 20
# Inline bodies per message (docs/protocol.md): with 512 records this keeps a header under
# ~100 KiB, far below the broker's max_header_bytes (1 MiB by default)
MAX_INLINE_PER_MESSAGE = 64 << 10
# Frames per coalesced message (a put with more still goes, alone): far below the broker's
# max_frames, whose lowest setting is this (broker/wire/limits.py)
MAX_FRAMES_PER_MESSAGE = 4096
# Keys longer than this many characters count toward MAX_INLINE_PER_MESSAGE (4 bytes each)
LONG_KEY = 64
# How long a blocking caller drives the socket itself before leaving its reply to the I/O
# thread (which also keeps the heartbeat, so this stays well below the heartbeat interval).
DRIVE_S = 0.05


# A blocking call first polls for its reply without sleeping for up to SPIN_US: a reply that
# comes back within it skips two thread wake-ups (on a 2-vCPU VM a raw ZeroMQ round trip takes
# ~100 us with a sleeping recv and ~55 us polling).  A spin that sees its reply scores +1 (up
# to SPIN_SCORE_MAX), one that does not -2; at 0 a handle spins only every SPIN_PROBE-th call
# until a spin sees its reply again (docs/decisions.md).  ZCHANNEL_SPIN_US=0: no spinning.
SPIN_US = env_int("ZCHANNEL_SPIN_US", 250, "microseconds")
SPIN_PROBE = 32
SPIN_SCORE_MAX = 8


def spin_seconds() -> float:
    """How long a blocking call of this process spins: ``SPIN_US``, or 0 when the process may
    run on one CPU only (its reply can then only come while it does not run)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return SPIN_US / 1e6 if cpus > 1 else 0.0


# Queued async requests a caller sends itself when the socket is free, and below which an async
# request issued while replies are due is held back for the next wait (see ``request``): half
# of a 64-request window per message, so one writev (and one wake-up of the broker) per 32
# requests (32 measured 6 % more items/s and 6-11 % less CPU per item than 16 on the 64 B
# stream: docs/benchmarks.md, *Items records and the send run*).
SEND_RUN = 32


# Over a direct link a thread waiting for a reply reads the link itself (``wait_for``).  When
# it stops, the I/O thread takes over only after LAZY_S without a reader, looking every LAZY_S:
# a stream whose waits follow each other then never wakes the I/O thread per reply, and its
# async requests go out together at the next wait, LAZY_S later at most (``request``).
# ZCHANNEL_LAZY_MS=0: the I/O thread always watches and nothing is held back.
LAZY_MS = env_int("ZCHANNEL_LAZY_MS", 20, "milliseconds")
LAZY_S = LAZY_MS / 1000


# Runs of consecutive puts that leave in one message travel as one ``puts`` record, answered
# by one reply (``connection/batching.py``); only what is queued already is coalesced, nothing
# waits for more.  ZCHANNEL_BATCH=0: every put travels as a record of its own.
BATCH = env_flag("ZCHANNEL_BATCH", True)


def direct_enabled() -> bool:
    """Whether handles of this process use direct links (``ZCHANNEL_DIRECT=0``: never; a value
    that is no flag: ``ValueError`` naming the variable)."""
    return env_flag("ZCHANNEL_DIRECT", True)


direct_enabled()  # a malformed ZCHANNEL_DIRECT fails at import, as the settings above do


# How long an operation waits for the broker's hello when it makes its handle's first
# connection, or when its connection is down (``connection/revival.py``): its timeout, but at
# least CONNECT_MIN_S (a hello under load) and at most CONNECT_S; an asynchronous operation
# CONNECT_MIN_S (``connect_budget``).
CONNECT_S = 10.0
CONNECT_MIN_S = 2.0


def connect_budget(timeout: float | None, async_op: bool = False) -> float:
    """How long an operation with ``timeout`` waits for the broker's hello when it makes its
    handle's first connection (or its connection is down): its timeout, but at least
    ``CONNECT_MIN_S`` and at most ``CONNECT_S``; an asynchronous one ``CONNECT_MIN_S``."""
    if async_op:
        return CONNECT_MIN_S
    if timeout is None:
        return CONNECT_S
    return min(CONNECT_S, max(timeout, CONNECT_MIN_S))
