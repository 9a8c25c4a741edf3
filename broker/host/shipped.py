"""The config files installed with zchannel (package ``zchannel.configs``), and the paths that
may name them: a path that does not exist, but whose name (``NAME.toml`` or
``configs/NAME.toml``) is a shipped config, names the installed copy, so the docs' examples
(``configs/cluster_example.toml``) run outside a checkout too."""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

PACKAGE = "zchannel.configs"


def shipped_dir() -> Path:
    """The folder of the installed configs (the checkout's ``configs/`` in an editable install)."""
    folder = importlib.resources.files(PACKAGE)
    if not isinstance(folder, os.PathLike):  # e.g. inside a zip: no folder to hand out
        raise RuntimeError(f"the configs of {PACKAGE} are not on the file system ({folder!r})")
    return Path(os.fspath(folder))


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
    """``value`` when something other than a directory is there (a FIFO or a device as well
    as a file: its reader, ``read_toml``, refuses what is not a regular file, naming it);
    else the shipped config it names (``NAME.toml`` or ``configs/NAME.toml``); else a
    ``FileNotFoundError`` naming the file and the shipped ones."""
    if os.path.exists(value) and not os.path.isdir(value):
        return value
    head, name = os.path.split(os.path.normpath(value))
    if head in ("", "configs") and name in shipped_names():
        return str(shipped_path(name))
    kind = "a directory, not a file" if os.path.isdir(value) else "no such file"
    raise FileNotFoundError(f"{value}: {kind} (configs shipped with zchannel, usable as "
                            f"configs/NAME: {', '.join(shipped_names())})")


__all__ = ["PACKAGE", "resolve", "shipped_dir", "shipped_names", "shipped_path"]
