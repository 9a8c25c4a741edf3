"""``zchannel stat`` without a channel (this host's brokers and stale entries) and
``zchannel clean``."""

from __future__ import annotations

import json
from typing import Any

import click
from zchannel.broker import Channel, ChannelError
from zchannel.broker.handle.broker_channel import BrokerChannel
from zchannel.broker.host import paths
from zchannel.broker.server import rundir


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


def show_host(as_json: bool, timeout: float, curve_keys: Any) -> None:
    """Print the brokers serving from this host's run directory and its stale entries."""
    live, stale = rundir.scan()
    where = str(paths.run_dir())
    rows = [row for b in live for row in _rows_of(b, min(timeout, 2.0), curve_keys)]
    if as_json:
        click.echo(json.dumps({"run_dir": where, "brokers": rows, "stale": [
            {"name": e.name, "files": e.files} for e in stale]}, indent=2, sort_keys=True))
        return
    if not rows:
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
    if dry_run:
        stale = rundir.scan()[1]
        for entry in stale:
            for path in entry.files:
                click.echo(f"would remove {path}")
        if not stale:
            click.echo(f"nothing to remove in {paths.run_dir()}")
        return
    removed = rundir.clean()
    for path in removed:
        click.echo(f"removed {path}")
    if not removed:
        click.echo(f"nothing to remove in {paths.run_dir()}")
