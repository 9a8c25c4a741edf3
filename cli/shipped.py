"""The ``FILE.toml`` arguments of the command line that may name a config installed with zchannel.

``zchannel broker --config configs/embodied_rollout.toml`` runs as the docs show it in a
checkout (the path exists) and anywhere else too: a ``--config`` / ``--cluster`` path that does
not exist, but whose name (``NAME.toml`` or ``configs/NAME.toml``) is a shipped config, is read
from the installed package instead (``broker/host/shipped.py``).
"""

from __future__ import annotations

import os
from typing import Any

import click
from zchannel.broker.host.shipped import resolve


class ConfigFile(click.ParamType):
    """A TOML file argument: an existing file, or a config shipped with zchannel (``resolve``)."""

    name = "FILE.toml"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        try:
            return resolve(os.fspath(value))
        except FileNotFoundError as exc:
            self.fail(str(exc), param, ctx)


__all__ = ["ConfigFile"]
