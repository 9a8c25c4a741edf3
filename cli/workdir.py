"""Modules of the working directory, importable by the ``zchannel`` command as by ``python
script.py``: a console script's ``sys.path[0]`` is the folder of the script (the environment's
``bin``), not the directory it runs in, so ``--import myhooks``, ``--collector myhooks:Pass``,
a config file's ``[hooks]`` and ``demo --env mymodule`` would not find ``myhooks.py`` there."""

from __future__ import annotations

import os
import sys


def import_from_cwd() -> None:
    """Make the modules of the working directory importable, here (``sys.path``) and in the
    processes started from now on (spawned ones get ``sys.path``, others ``PYTHONPATH``): the
    directory goes first on both, unless ``sys.path`` holds it (or ``''``) already."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
        paths = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = cwd + (os.pathsep + paths if paths else "")
