"""The baselines of ``zchannel bench`` by kind: each a function that moves one case's items
(or round trips) over something other than a zchannel broker, registered with what it is and
why it may be unavailable on this machine.

A module that adds a baseline registers it at import (``register_baseline``); the runner
looks kinds up here (``baseline``), the report describes rows with ``describe``.  The Ray
baselines are not here: they run Ray tasks and actors, not one ``Case`` per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import click
from zchannel.cli.bench.cases import Case, Measured

RunBaseline = Callable[[Case, str], Measured]  # (case, the run's temporary directory)


def always_available() -> str | None:
    """No reason a baseline cannot run here."""
    return None


@dataclasses.dataclass(frozen=True)
class Baseline:
    """One baseline: ``run(case, tmpdir)`` measures one run of ``case``'s stream on it;
    ``unavailable()`` says why it cannot run here (None: it can); ``latency`` is what its
    latency column spans; ``suffix(case)`` is added to its rows' names (e.g. a relay's HWM)."""

    kind: str
    run: RunBaseline
    description: str
    latency: str = "e2e"
    unavailable: Callable[[], str | None] = always_available
    suffix: Callable[[Case], str] = lambda case: ""


BASELINES: dict[str, Baseline] = {}


def register_baseline(entry: Baseline) -> Baseline:
    """Add ``entry`` under its kind (a kind registered twice is an error)."""
    if entry.kind in BASELINES and BASELINES[entry.kind] != entry:
        raise ValueError(f"baseline {entry.kind!r} is registered already")
    BASELINES[entry.kind] = entry
    return entry


def baseline(kind: str) -> Baseline:
    """The baseline of ``kind`` (``click.BadParameter`` naming the known ones otherwise)."""
    try:
        return BASELINES[kind]
    except KeyError:
        raise click.BadParameter(
            f"unknown baseline {kind!r} (known: {', '.join(sorted(BASELINES))})"
        ) from None


def describe(kind: str, fallback: dict[str, str]) -> str:
    """What rows of ``kind`` measured: a registered baseline's description, else
    ``fallback[kind]``, else the kind itself."""
    entry = BASELINES.get(kind)
    return entry.description if entry is not None else fallback.get(kind, kind)
