"""zchannel's warnings in a process whose application configured no logging name their speaker
(logger, process name, pid) instead of reaching stderr as a bare message; once the application
configures logging, its own set-up applies and nothing is printed twice."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import logging
import multiprocessing

import zchannel.broker

multiprocessing.current_process().name = "env:0"
logging.getLogger("zchannel.client").warning("the broker at %s is silent", "tcp://127.0.0.1:9")
logging.getLogger("zchannel.client").info("not shown: below WARNING")
logging.basicConfig(format="app %(name)s: %(message)s")
logging.getLogger("zchannel.client").warning("configured")
"""


def test_a_warning_names_its_process_until_the_application_configures_logging():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    pid = proc.stderr.split("(pid ")[1].split(")")[0]
    assert proc.stderr.splitlines() == [
        f"zchannel.client in env:0 (pid {pid}) WARNING: the broker at tcp://127.0.0.1:9 is silent",
        "app zchannel.client: configured",
    ]
