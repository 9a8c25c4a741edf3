"""Whether a process of this host runs, by its pid (lock holders, brokers being stopped, the
creators named in shared-memory segments), and which pid namespace this process sees pids in."""

from __future__ import annotations

import functools
import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie included; another user's process included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (exited, waiting to be reaped); when
    ``/proc`` cannot tell, whether it exists."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@functools.lru_cache(maxsize=1)
def pid_namespace() -> str | None:
    """This process's pid namespace, as ``/proc/self/ns/pid`` names it (``"pid:[4026531836]"``):
    two processes that give the same name see the same pids.  None where ``/proc`` cannot
    tell (no ``/proc``, or not Linux)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
