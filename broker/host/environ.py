"""Settings read from the environment (``ZCHANNEL_*``): an int, or a yes/no flag, each
checked, with the variable named in the error."""

from __future__ import annotations

import os


def env_int(name: str, default: int, unit: str) -> int:
    """An int >= 0 from the environment (``ValueError`` naming it otherwise)."""
    text = os.environ.get(name, str(default))
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0 ({unit}), got {text!r}")
    return value


def env_flag(name: str, default: bool) -> bool:
    """A yes/no setting from the environment: 0/false/no/off or 1/true/yes/on (``ValueError``
    naming it otherwise)."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in ("0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be 0 or 1 (or false/true, no/yes, off/on), got {text!r}")
