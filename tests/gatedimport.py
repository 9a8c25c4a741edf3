"""A hook module whose import waits at a gate in every process but the one named by
``GATED_IMPORT_CREATOR`` (a broker's start blocked in ``import``): it writes ``started-<pid>``
into the directory ``GATED_IMPORT_DIR``, then reads one byte from the FIFO ``GATED_IMPORT_GATE``."""

from __future__ import annotations

import os

from hookmods import wait_at_gate
from zchannel.hooks import Collector

if os.environ.get("GATED_IMPORT_CREATOR", str(os.getpid())) != str(os.getpid()):
    wait_at_gate(os.environ["GATED_IMPORT_DIR"], os.environ["GATED_IMPORT_GATE"])


class PassThrough(Collector):
    def collect(self, item, key):
        yield key, item
