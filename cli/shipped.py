"""The config files installed with zchannel (package ``zchannel.configs``) and the ``FILE.toml``
arguments that may name them.

``zchannel broker --config configs/embodied_rollout.toml`` runs as the docs show it in a
checkout (the path exists) and anywhere else too: a ``--config`` / ``--cluster`` path that does
not exist, but whose name (``NAME.toml`` or ``configs/NAME.toml``) is a shipped config, is read
from the installed package instead.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Any

import click

PACKAGE = "zchannel.configs"


def shipped_dir() -> Path:
    """The folder of the installed configs (the checkout's ``configs/`` in an editable install)."""
    return Path(os.fspath(importlib.resources.files(PACKAGE)))


def shipped_names() -> list[str]:
    """The file names of the shipped configs, sorted."""
    return sorted(p.name for p in shipped_dir().glob("*.toml"))


def shipped_path(name: str) -> Path:
    """The installed copy of ``configs/NAME``."""
    path = shipped_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"zchannel ships no config {name!r} (it has: "
                                f"{', '.join(shipped_names())})")
    return path


def resolve(value: str) -> str:
    """``value`` when it is a file; else the shipped config it names (``NAME.toml`` or
    ``configs/NAME.toml``); else a ``FileNotFoundError`` naming the file and the shipped ones."""
    if os.path.isfile(value):
        return value
    head, name = os.path.split(os.path.normpath(value))
    if head in ("", "configs") and name in shipped_names():
        return str(shipped_path(name))
    kind = "a directory, not a file" if os.path.isdir(value) else "no such file"
    raise FileNotFoundError(f"{value}: {kind} (configs shipped with zchannel, usable as "
                            f"configs/NAME: {', '.join(shipped_names())})")


class ConfigFile(click.ParamType):
    """A TOML file argument: an existing file, or a config shipped with zchannel (``resolve``)."""

    name = "FILE.toml"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        try:
            return resolve(os.fspath(value))
        except FileNotFoundError as exc:
            self.fail(str(exc), param, ctx)


__all__ = ["ConfigFile", "resolve", "shipped_dir", "shipped_names", "shipped_path"]
