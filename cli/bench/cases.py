"""What ``zchannel bench`` measures: a case (``Case``), the raw figures of one run of it
(``Measured``), the cases of each scenario, and the size helpers of the options."""

from __future__ import annotations

import dataclasses
import re

import click
import numpy as np

SCENARIOS = (
    "quick",
    "channel",
    "put_only",
    "get_only",
    "random_key",
    "batch",
    "hooks",
    "all",
    "targets",
    "trajectory",
    "shm",
    "durable",
    "scaling",
)


ALL_SCENARIOS = ("channel", "put_only", "get_only", "random_key", "batch", "hooks")
DEFAULT_KEYS = 128
MAX_BYTES_PER_CASE = 1 << 30  # large payloads: at most this many bytes per case
MAX_INFLIGHT_BYTES = 256 << 20  # large payloads: window capped to this many bytes per worker
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Case:
    """One measurement: a scenario with its payload, process counts and transport."""

    scenario: str
    ptype: str = "bytes"
    size: int = 64
    messages: int = 20000
    producers: int = 1
    consumers: int = 1
    transport: str = "ipc"
    window: int = 64
    keys: int = 1
    hooks: bool = False
    label: str = ""
    shm: bool = True  # same-host shared memory for large arrays/tensors (docs/shm.md)
    maxsize: int = 0  # the channel's maxsize (0: unbounded)
    max_bytes: int = MAX_BYTES_PER_CASE  # payload bytes per case (``bounded``)
    max_inflight: int = MAX_INFLIGHT_BYTES  # payload bytes in flight per worker (``bounded``)
    reserve: bool = True  # producers preallocate their shared-memory slots (``reserve_shm``)
    in_slot: bool = False  # producers write each tensor in a slot (``empty_shm``), no put copy
    views: bool = False  # consumers get views of the slots (``copy=False``), no get copy
    brokers: int = 1  # broker processes of the channel on this host (replicas, keys spread)
    compare: bool = True  # measured against the --baseline transport (else against another case)
    journal: str = ""  # a durable channel with this fsync policy (docs/durability.md); "": none

    @property
    def name(self) -> str:
        extra = f" keys={self.keys}" if self.scenario == "random_key" else ""
        extra += " +hooks" if self.hooks else (" nohooks" if self.scenario == "hooks" else "")
        extra += f" journal={self.journal}" if self.journal else ""
        return (
            self.label
            or f"{self.scenario} {self.ptype} {fmt_size(self.size)} "
            f"{self.producers}P/{self.consumers}C w{self.window}{extra}"
        )


@dataclasses.dataclass
class Measured:
    """Raw figures of one run of a case."""

    items: int
    seconds: float
    lat_ns: np.ndarray
    rss_peak: int | None = None
    extra: dict = dataclasses.field(default_factory=dict)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str | int) -> int:
    """``64``, ``64B``, ``1KB``, ``16MB``, ``1GiB`` -> bytes (binary multiples)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise click.BadParameter(f"{text!r}: expected a size like 64B, 1KB, 16MB, 1GB")
    unit = m.group(2).lower()[:1]
    if unit == "b":
        unit = ""
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 16:
        raise click.BadParameter(f"{text!r}: payloads are at least 16 bytes (the item header)")
    return value


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal counts."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def bounded(case: Case) -> Case:
    """Cap messages and window of large payloads (bytes per case, bytes in flight; at least
    one item and a window of one, so an item larger than the cap runs alone); a label that
    names the window names the one run."""
    nbytes = max(case.size, 1)
    messages = min(case.messages, max(1, case.max_bytes // nbytes))
    window = max(1, min(case.window, case.max_inflight // nbytes))
    label = case.label
    if window != case.window:
        label = re.sub(rf"\bw{case.window}\b", f"w{window}", label)
    return dataclasses.replace(case, messages=messages, window=window, label=label)


def keys_named(case: Case) -> int:
    """The distinct keys the items of ``case`` are put on: one, except in ``random_key``,
    where each producer spreads its items over ``keys`` keys of its own."""
    if case.scenario != "random_key":
        return 1
    return sum(min(n, max(1, case.keys)) for n in split(case.messages, case.producers))


def percentiles(lat_ns: np.ndarray) -> tuple[float, float]:
    if lat_ns.size == 0:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(lat_ns, [50, 99])
    return float(p50) / 1e3, float(p99) / 1e3


def stream_figures(prod: list[dict], cons: list[dict], t_go: int) -> tuple[float, np.ndarray]:
    """(seconds from the first producer's start to the last consumer's end, the consumers'
    latencies)."""
    t0 = min([r["t_start"] for r in prod] or [t_go])
    t1 = max(r["t_end"] for r in cons)
    lat = np.concatenate([r["lat_ns"] for r in cons]) if cons else np.zeros(0, np.int64)
    return max(1e-9, (t1 - t0) / 1e9), lat


def cpu_figures(results: list[dict], items: int, server_cpu_ns: int | None = None) -> dict:
    """CPU microseconds per item of the producers, the consumers (all their threads, from the
    start signal to their end) and the process between them (the broker, a relay) when its CPU
    time over the run is known."""
    out: dict[str, float] = {}
    for role in ("producer", "consumer"):
        cpu = [r["cpu_ns"] for r in results if r["name"].startswith(role) and "cpu_ns" in r]
        if cpu:
            out[f"{role}_cpu_us_item"] = sum(cpu) / 1e3 / max(1, items)
    if server_cpu_ns is not None:
        out["server_cpu_us_item"] = server_cpu_ns / 1e3 / max(1, items)
    return out


def scenario_cases(scenario: str, base: Case, keys: int | None) -> list[Case]:
    """The cases of one scenario, from the options in ``base``."""
    if scenario == "quick":
        small = dataclasses.replace(base, ptype="bytes", size=64, messages=min(base.messages, 5000))
        return [
            dataclasses.replace(small, scenario="channel"),
            dataclasses.replace(small, scenario="get_only", window=1, messages=1000),
            dataclasses.replace(small, scenario="batch"),
            dataclasses.replace(
                base, scenario="channel", ptype="tensor", size=MIB, messages=256, window=8
            ),
        ]
    if scenario == "all":
        return [c for s in ALL_SCENARIOS for c in scenario_cases(s, base, keys)]
    if scenario == "random_key":
        return [
            dataclasses.replace(
                base, scenario="random_key", keys=keys or min(DEFAULT_KEYS, base.messages)
            )
        ]
    if scenario == "hooks":
        consumers = max(2, base.consumers)
        return [
            dataclasses.replace(base, scenario="hooks", consumers=consumers, hooks=False),
            dataclasses.replace(base, scenario="hooks", consumers=consumers, hooks=True),
        ]
    return [dataclasses.replace(base, scenario=scenario)]
