"""The TOML reader for every configuration file zchannel loads, on every supported Python.

``tomllib`` is in the standard library from Python 3.11; on 3.10 the same parser is the
``tomli`` package (an install requirement there).  Import it as
``from zchannel.broker.host.toml import tomllib``.
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["tomllib"]
