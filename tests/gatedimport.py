"""A hook module whose import waits at a gate in every process but the one named by
``GATED_IMPORT_CREATOR`` (a broker's start blocked in ``import``): it writes ``started-<pid>``
into the directory ``GATED_IMPORT_DIR``, then reads one byte from the FIFO ``GATED_IMPORT_GATE``."""

from __future__ import annotations

import os

from zchannel.hooks import Collector

if os.environ.get("GATED_IMPORT_CREATOR", str(os.getpid())) != str(os.getpid()):
    with open(os.path.join(os.environ["GATED_IMPORT_DIR"], f"started-{os.getpid()}"), "w"):
        pass
    with open(os.environ["GATED_IMPORT_GATE"], "rb") as gate:
        gate.read(1)


class PassThrough(Collector):
    def collect(self, item, key):
        yield key, item
