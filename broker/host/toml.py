"""The TOML reader for every configuration file zchannel loads, on every supported Python.

``tomllib`` is in the standard library from Python 3.11; on 3.10 the same parser is the
``tomli`` package (an install requirement there).  ``read_toml(path)`` reads a file and names
it when it is not valid TOML; ``tomllib`` itself is here too.
"""

from __future__ import annotations

import os
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["read_toml", "tomllib"]


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The tables of TOML file ``path``; ``ValueError`` naming the file when it is not valid
    TOML (``OSError`` when it cannot be read)."""
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid TOML: {exc}") from None
