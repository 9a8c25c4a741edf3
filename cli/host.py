"""``zchannel stat`` without a channel (this host's brokers and stale entries) and
``zchannel clean``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
from zchannel.broker import Channel, ChannelError
from zchannel.broker.handle.broker_channel import BrokerChannel
from zchannel.broker.host import paths
from zchannel.broker.server import rundir
from zchannel.broker.shm.segment import SHM_DIR, list_segments, run_prefix


def _rows_of(broker: rundir.HostBroker, timeout: float, curve_keys: Any) -> list[dict[str, Any]]:
    """The rows of a channel: one, or one per replica of a distributed channel served here
    (each replica under its lock name, at the address its token file names)."""
    replicas = [lock for lock in broker.locks if lock != broker.name]
    if not replicas:
        return [_broker_row(broker.name, broker.address, broker.locks, timeout, curve_keys)]
    rows = []
    for lock in replicas:
        try:
            found = paths.read_token_file(lock)
        except (ValueError, ChannelError):  # unreadable, or its broker is gone by now
            found = None
        rows.append(_broker_row(lock, found["address"] if found else None, [lock], timeout,
                                curve_keys, replica=True))
    return rows


def _broker_row(name: str, address: str | None, locks: list[str], timeout: float,
                curve_keys: Any, replica: bool = False) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, "address": address, "locks": locks}
    if address is None:
        row["error"] = ("no address file yet (a broker still starting, or a distributed "
                        "channel: stat one of its replicas)")
        return row
    try:
        # a replica's own figures: a plain handle (Channel.connect would merge the replicas)
        channel = (BrokerChannel(name, address, curve_keys=curve_keys) if replica
                   else Channel.connect(address, timeout=timeout, curve_keys=curve_keys))
    except ChannelError as exc:
        row["error"] = str(exc)
        return row
    try:
        stats = channel.stats(exclude_self=True)  # this listing is not one of its clients
    except ChannelError as exc:
        row["error"] = str(exc)
        return row
    finally:
        channel.close()
    keys = stats.get("keys") or {}
    row.update(pid=stats.get("pid"), clients=stats.get("clients"), keys=len(keys),
               items=sum(k.get("depth", 0) for k in keys.values()))
    return row


def _missing_run_dir() -> Path | None:
    """The run directory when nothing is at its path (``zchannel stat`` and ``clean`` then
    report on it without making it), else None: ``paths.run_dir`` checks what is there, and
    refuses a path whose parent is no directory (a mistyped ``ZCHANNEL_RUN_DIR``)."""
    where = paths.run_dir_path()
    return None if os.path.lexists(where) or not os.path.isdir(where.parent) else where


def _orphan_segments(where: Path) -> list[rundir.StaleEntry]:
    """The shared-memory segments of brokers of the run directory ``where``, which does not
    exist: no broker serves from it, so each is stale (by the lock name it was made under)."""
    prefix = run_prefix(str(where))
    stale: dict[str, rundir.StaleEntry] = {}
    for segment in list_segments(prefix):
        lock_name = segment[len(prefix):].split("+", 1)[0]
        stale.setdefault(lock_name, rundir.StaleEntry(lock_name)).add(
            [os.path.join(SHM_DIR, segment)])
    return list(stale.values())


def _scan() -> tuple[str, bool, list[rundir.HostBroker], list[rundir.StaleEntry]]:
    """(the run directory, whether it exists, its live brokers, its stale entries); a missing
    one is not made: it has no brokers, and its stale entries are segments its brokers left."""
    missing = _missing_run_dir()
    if missing is not None:
        return str(missing), False, [], _orphan_segments(missing)
    live, stale = rundir.scan()
    return str(paths.run_dir()), True, live, stale


def show_host(as_json: bool, timeout: float, curve_keys: Any) -> None:
    """Print the brokers serving from this host's run directory and its stale entries."""
    where, exists, live, stale = _scan()
    rows = [row for b in live for row in _rows_of(b, min(timeout, 2.0), curve_keys)]
    if as_json:
        click.echo(json.dumps({"run_dir": where, "run_dir_exists": exists, "brokers": rows,
                               "stale": [{"name": e.name, "files": e.files} for e in stale]},
                              indent=2, sort_keys=True))
        return
    if not exists:
        click.echo(f"no brokers: the run directory {where} does not exist")
    elif not rows:
        click.echo(f"no brokers in {where}")
    else:
        click.echo(f"brokers in {where}")
        table = [("name", "address", "pid", "clients", "keys", "items")]
        for row in rows:
            if "error" in row:
                table.append((row["name"], str(row["address"] or "-"), "-", "-", "-", "-"))
            else:
                table.append((row["name"], row["address"], str(row["pid"]), str(row["clients"]),
                              str(row["keys"]), str(row["items"])))
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        for line in table:
            click.echo("  " + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        for row in rows:
            if "error" in row:
                click.echo(f"  {row['name']}: {row['error']}")
    if stale:
        click.echo("stale entries (no live broker; `zchannel clean` removes them)")
        for entry in stale:
            click.echo(f"  {entry.name}: {', '.join(entry.files)}")
    else:
        click.echo("no stale entries")


@click.command()
@click.option("--dry-run", is_flag=True, help="list what would be removed, remove nothing")
def clean(dry_run: bool) -> None:
    """Remove the stale entries of this host's run directory: lock, address and socket files
    and shared-memory segments of channels whose broker is gone.  Live brokers keep theirs."""
    where, exists, _, stale = _scan()
    if not stale:  # (a missing run directory is not made)
        click.echo(f"nothing to remove in {where}" if exists
                   else f"nothing to remove: the run directory {where} does not exist")
        return
    if dry_run:
        for entry in stale:
            for path in entry.files:
                click.echo(f"would remove {path}")
        return
    removed = rundir.clean()
    for path in removed:
        click.echo(f"removed {path}")
    if not removed:
        click.echo(f"nothing to remove in {where}")
