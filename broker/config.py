"""Broker configuration files (TOML) and their merge with command-line flags.

A file has up to three tables::

    [channel]                 # name, address, maxsize, lease_timeout, heartbeat_interval,
    name = "samples"          # liveness, max_bytes, max_keys, max_message_bytes, max_frames,
                              # max_header_bytes, insecure, key_grace, curve_secret_key,
                              # metrics_port, metrics_address, ...
    maxsize = 64

    [hooks]                   # collector, dispatcher, consumers, producers, imports
    collector = "flatten_batch"
    dispatcher = "round_robin"
    consumers = { actor = 3 } # or a list of ids
    producers = ["rollout"]

    [options]                 # free-form, handed to the hooks as ctx.options
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zchannel.broker.server import BrokerConfig
from zchannel.broker.toml import tomllib

_CHANNEL_KEYS = {
    "name", "address", "maxsize", "lease_timeout", "heartbeat_interval", "liveness",
    "max_bytes", "max_keys", "max_message_bytes", "max_frames", "max_header_bytes", "insecure",
    "key_grace", "curve_secret_key", "curve_public_keys", "allowed_dtypes", "max_rank",
    "shm_threshold", "shm_pool_bytes", "direct", "metrics_port", "metrics_address",
}
_HOOK_KEYS = {"collector", "dispatcher", "consumers", "producers", "imports"}


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a broker TOML file into ``BrokerConfig`` fields; unknown keys are a ``ValueError``."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    fields: dict[str, Any] = {}
    unknown = set(data) - {"channel", "hooks", "options", "bench"}
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {sorted(unknown)}")
    for table, allowed in (("channel", _CHANNEL_KEYS), ("hooks", _HOOK_KEYS)):
        section = data.get(table, {})
        bad = set(section) - allowed
        if bad:
            raise ValueError(f"{path}: unknown key(s) {sorted(bad)} in [{table}]")
        fields.update(section)
    if "options" in data:
        fields["options"] = dict(data["options"])
    return fields


def build_config(file: str | Path | None = None, **overrides: Any) -> BrokerConfig:
    """A ``BrokerConfig`` from an optional file, with non-None ``overrides`` taking precedence."""
    fields = read_config_file(file) if file else {}
    for key, value in overrides.items():
        if value is None or value == () or value == []:
            continue
        if key == "options":
            fields["options"] = {**fields.get("options", {}), **value}
        else:
            fields[key] = value
    if not fields.get("name"):
        raise ValueError("a broker needs a channel name (argument NAME or [channel] name)")
    return BrokerConfig(**fields)
