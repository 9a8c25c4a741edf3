"""The ranges of a broker's numeric settings, checked wherever a broker is configured
(``Channel.create``, ``zchannel broker`` flags, a TOML file): one rule for all three."""

from __future__ import annotations

import math
from typing import Any

from zchannel.broker.wire.argchecks import shown

# field -> (lowest value, ints only, what it means)
RANGES: dict[str, tuple[float, bool, str]] = {
    "maxsize": (0, True, "per-queue capacity, 0 = unbounded"),
    "lease_timeout": (0, False, "seconds"),
    # (a client takes a broker's heartbeat interval from 1 ms: wire/protocol.py HelloInfo)
    "heartbeat_interval": (0.001, False, "seconds"),
    "liveness": (1, True, "heartbeats"),
    "max_bytes": (0, True, "bytes, 0 = no limit"),
    "max_keys": (1, True, "keys"),
    "max_message_bytes": (0, True, "bytes, 0 = no limit"),
    # not below what a client puts in one coalesced message (broker/connection/tuning.py):
    # a broker below it drops ordinary traffic (BrokerUnavailable, or puts that never return)
    "max_frames": (4096, True, "frames"),
    "max_header_bytes": (256 << 10, True, "bytes"),
    "shm_threshold": (0, True, "bytes, 0 = off"),
    "shm_pool_bytes": (0, True, "bytes"),
    "key_grace": (0, False, "seconds"),
    "max_clients": (0, True, "connections, 0 = from the descriptor limit"),
    "producer_grace": (0, False, "seconds"),
    "fsync_interval": (0, False, "seconds"),
    "max_journal_bytes": (0, True, "bytes, 0 = no limit"),
    "journal_segment_bytes": (65536, True, "bytes"),
}
_POSITIVE = {"lease_timeout", "fsync_interval"}
# the longest time setting, in seconds (about 317 years): a deadline that far stays an
# ordinary float; the broker's poll waits at most half a heartbeat_interval, and a local
# channel's timer thread a short while, at a time (a heartbeat_interval of 1e300 ended the
# loop in an OverflowError once the broker was serving)
MAX_SECONDS = 10**10
# field -> its highest value (the others: MAX_INT); a client adopts the heartbeat interval
# and liveness of a broker's hello reply only up to 3600 s and 1000 (connection/liveness.py)
HIGHEST: dict[str, float] = {
    "heartbeat_interval": 3600, "liveness": 1000, "lease_timeout": MAX_SECONDS,
    "key_grace": MAX_SECONDS, "producer_grace": MAX_SECONDS, "fsync_interval": MAX_SECONDS,
    # a segment is preallocated whole when it is made: a typo must not take the host's disk
    "journal_segment_bytes": 1 << 30,
}
# a journal limit below this could not hold a segment of the least size and its removals
MIN_JOURNAL_LIMIT = 1 << 20
# field -> its least value other than 0 (0: no limit): a client's coalesced message has one
# header frame of up to 512 records with their inline bodies and keys (~200 KiB at most:
# broker/connection/tuning.py), checked against max_message_bytes like any frame; a broker
# below it drops ordinary traffic of small items (at 10 bytes, every hello)
OFF_OR_AT_LEAST: dict[str, int] = {"max_message_bytes": 256 << 10}
# the largest int setting: what msgpack (a broker's hello reply) and a C long (ZeroMQ's
# socket options) hold; 2**64 made a broker crash on its first hello
MAX_INT = 2**63 - 1


def check_settings(values: dict[str, Any]) -> None:
    """``ValueError`` naming the first setting of ``values`` out of its range (others pass):
    below its lowest value, above its highest, or between 0 and its ``OFF_OR_AT_LEAST``."""
    for name, value in values.items():
        if name not in RANGES:
            continue
        low, ints, meaning = RANGES[name]
        high = HIGHEST.get(name, MAX_INT)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        finite = isinstance(value, int) or (number and math.isfinite(value))  # ints of any size
        ok = number and (isinstance(value, int) or not ints) and finite and (
            value > low if name in _POSITIVE else value >= low) and value <= high
        floor = OFF_OR_AT_LEAST.get(name, 0)
        if floor and (not ok or 0 < value < floor):
            raise ValueError(f"{name} must be an int >= {floor} and <= {high}, or 0 for no "
                             "limit (bytes; less would refuse a client's ordinary messages), "
                             f"got {shown(value)}")
        if not ok:
            bound = f"> {low} and <= {high}" if name in _POSITIVE else f">= {low} and <= {high}"
            kind = "an int" if ints else "a number"
            raise ValueError(f"{name} must be {kind} {bound} ({meaning}), got {shown(value)}")
