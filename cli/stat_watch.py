"""``zchannel stat NAME --watch``: a live view of a broker, redrawn every ``--interval`` seconds.

Each refresh asks the broker for its stats (one ``stats()`` request, as ``zchannel stat`` does)
and shows rates: puts, gets and delivered items per second, and how fast each key's depth
changes, between the last two different answers of the broker, over its own clock (their
``uptime_s``).  A broker of many keys rations its stats and may answer a refresh with the
answer it gave before: that frame says so and keeps the rates it had.  On a terminal the screen
is cleared before each frame; otherwise (a pipe, a file) frames follow each other.  ``--json``
prints one JSON object per refresh (its ``rates`` and ``repeated`` included) instead.  Ctrl-C
ends it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click
from zchannel.broker import BrokerUnavailable, ChannelError
from zchannel.cli.summary import key_text, pad, text_width

COUNTERS = ("puts", "gets", "delivered")
MAX_KEY_ROWS = 20  # keys shown per frame (the deepest)
MAX_KEY_TEXT = 28  # a key wider than this many terminal columns is cut, so that a key row fits
# in WIDTH (control characters of a key are escaped: ``summary.key_text``)
WIDTH = 80  # a frame fits an 80-column terminal
LABEL = 10  # the column of the values after a line's label


def rates(prev: dict | None, cur: dict) -> dict[str, Any]:
    """Per-second rates between two stats answers of one broker, over the broker's clock
    (the change of ``uptime_s``): the counters, and each key's depth change; none ({}) without
    an earlier answer, or when the broker's clock did not move forward between them."""
    if prev is None:
        return {}
    seconds = cur.get("uptime_s", 0) - prev.get("uptime_s", 0)
    if seconds <= 0:
        return {}
    out: dict[str, Any] = {
        name: (cur.get(name, 0) - prev.get(name, 0)) / seconds for name in COUNTERS
        if name in cur and name in prev
    }
    before = prev.get("keys") or {}
    out["depth"] = {key: (ks["depth"] - before[key]["depth"]) / seconds
                    for key, ks in (cur.get("keys") or {}).items() if key in before}
    return out


def answer_mark(stats: dict) -> tuple:
    """What tells two stats answers apart: the broker process, its clock and its counters
    (an answer the broker gives again has all of them unchanged)."""
    return (stats.get("pid"), stats.get("uptime_s"), *(stats.get(name) for name in COUNTERS))


class RateTracker:
    """The rates of a watch: each new answer's against the broker's answer before it; an
    answer given again (a broker that rations its stats) keeps the rates of the last new one,
    and a broker started anew (another pid) or whose clock went back starts them over."""

    def __init__(self) -> None:
        self.last: dict | None = None  # the last answer that was new
        self.per_s: dict[str, Any] = {}

    def update(self, stats: dict) -> bool:
        """Take one answer (its rates are then in ``per_s``); whether it repeats the last."""
        if self.last is not None and answer_mark(stats) == answer_mark(self.last):
            return True
        same_broker = self.last is not None and stats.get("pid") == self.last.get("pid")
        self.per_s = rates(self.last if same_broker else None, stats)
        self.last = stats
        return False


def _human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _rate(per_s: dict, name: str) -> str:
    return f" ({per_s[name]:,.1f}/s)" if name in per_s else ""


def _packed(label: str | None, items: list[str], sep: str = "   ") -> list[str]:
    """``label`` (padded to the label column; None: no label column) and ``items`` joined by
    ``sep``, in lines of at most ``WIDTH`` terminal columns (continuations at the label
    column); an item is never split."""
    head = "" if label is None else label.ljust(LABEL)
    indent = " " * LABEL
    lines: list[str] = []
    current: list[str] = []
    for item in items:
        prefix = indent if lines else head
        if current and (len(prefix) + text_width(sep.join([*current, item]) + sep.rstrip())
                        > WIDTH):
            lines.append(prefix + sep.join(current) + sep.rstrip())  # "a, b," for sep ", "
            current = []
        current.append(item)
    lines.append(((indent if lines else head) + sep.join(current)).rstrip())
    return lines


def render(stats: dict, per_s: dict, interval: float, repeated: bool = False) -> list[str]:
    """The lines of one frame, each at most ``WIDTH`` terminal columns (but an address that
    long); ``repeated``: the broker answered as before (said on the channel line)."""
    held = sum(ks["depth"] for ks in (stats.get("keys") or {}).values())
    lines = _packed(None, [f"zchannel stat {stats.get('name')} --watch", f"every {interval:g}s",
                         "Ctrl-C to stop", time.strftime("%H:%M:%S")])
    lines += _packed("channel", [f"{stats.get('name')} (pid {stats.get('pid')})",
                                 f"uptime {stats.get('uptime_s', 0):.1f}s",
                                 f"clients {stats.get('clients', 0)}"]
                     + (["repeated answer (rates as before)"] if repeated else []))
    lines.append(f"{'address'.ljust(LABEL)}{stats.get('address')}")
    counters = [f"{name} {stats.get(name, 0):,}{_rate(per_s, name)}" for name in COUNTERS
                if name in stats]
    lines += _packed("requests", counters or ["(this broker reports no request counters)"])
    lines += _packed("held", [f"{held:,} items, {_human_bytes(stats.get('bytes_held', 0))}",
                              f"leases {stats.get('leases', 0)}"])
    lines += _packed("consumers", list(stats.get("consumers") or ["-"]), sep=", ")
    shm = stats.get("shm") or {}
    if shm.get("enabled"):
        lines += _packed("shm", [f"slots used {shm.get('slots_used')}",
                                 f"bytes held {_human_bytes(shm.get('bytes_held', 0))}",
                                 f"held by consumers {_human_bytes(shm.get('consumer_bytes', 0))}"])
    if stats.get("metrics"):
        lines.append(f"{'metrics'.ljust(LABEL)}{stats['metrics']}")
    keys = stats.get("keys") or {}
    depth_rate = per_s.get("depth", {})
    shown = sorted(keys.items(), key=lambda kv: -kv[1]["depth"])[:MAX_KEY_ROWS]
    rows = [("key", "depth", "depth/s", "getters", "putters", "leases")]
    for key, ks in shown:
        change = f"{depth_rate[key]:+,.1f}" if key in depth_rate else "-"
        rows.append((key_text(key, MAX_KEY_TEXT), f"{ks['depth']:,}", change,
                     str(ks.get("getters", 0)), str(ks.get("putters", 0)),
                     str(ks.get("leases", 0))))
    widths = [max(text_width(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(pad(c, w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    if len(keys) > len(shown):
        lines.append(f"... {len(keys) - len(shown)} more keys (the {len(shown)} deepest shown)")
    return lines


def watch_stats(channel: Any, interval: float, count: int | None,
                to_json: Callable[[dict], str] | None = None) -> None:
    """Refresh until Ctrl-C, or ``count`` times; with ``to_json`` one JSON line per refresh."""
    tracker = RateTracker()
    shown = 0
    try:
        while count is None or shown < count:
            t = time.monotonic()
            try:
                stats = channel.stats(exclude_self=True)
            except (BrokerUnavailable, ChannelError, TimeoutError) as exc:
                raise click.ClickException(f"the broker stopped answering: {exc}") from None
            repeated = tracker.update(stats)
            if to_json is not None:
                click.echo(to_json(dict(stats, rates=tracker.per_s, repeated=repeated)))
            else:
                click.clear()
                click.echo("\n".join(render(stats, tracker.per_s, interval, repeated)))
                click.echo("")
            shown += 1
            if count is None or shown < count:
                time.sleep(max(0.0, interval - (time.monotonic() - t)))
    except KeyboardInterrupt:
        pass
