"""The TOML reader for every configuration file zchannel loads, on every supported Python.

``tomllib`` is in the standard library from Python 3.11; on 3.10 the same parser is the
``tomli`` package (an install requirement there).  ``read_toml(path)`` reads a file and names
it when it is not valid TOML; ``tomllib`` itself is here too.

What is read is bounded before it is parsed: only a regular file (a FIFO, a device such as
``/dev/zero`` or a directory is refused after a ``stat``, never opened), of at most
``MAX_TOML_BYTES`` (``host/regularfile.py``, which reads key and token files alike); nesting
deeper than the parser's recursion allows is refused as invalid TOML, not raised as a
``RecursionError``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from zchannel.broker.host.regularfile import read_regular_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["MAX_TOML_BYTES", "read_toml", "tomllib"]

MAX_TOML_BYTES = 1 << 20  # 1 MiB: far above any configuration or cluster file zchannel reads


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The tables of TOML file ``path``; ``ValueError`` naming the file when it is not a
    regular file, is larger than ``MAX_TOML_BYTES`` or is not valid TOML (nested too deeply
    included); ``OSError`` when it cannot be read (missing, no permission)."""
    data = read_regular_file(path, MAX_TOML_BYTES, "a configuration file")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path} is not valid TOML: nested too deeply") from None
