"""zchannel's warnings in a process whose application configured no logging name their speaker
(logger, process name, pid) instead of reaching stderr as a bare message; once the application
configures logging, its own set-up applies and nothing is printed twice."""

from __future__ import annotations

import logging
import subprocess
import sys

from zchannel.broker.server.loop import _RateLimitFilter

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


def test_the_broker_log_says_how_many_records_its_rate_limit_dropped():
    now = [0.0]
    limit = _RateLimitFilter(burst=5, period=10.0, clock=lambda: now[0])

    def record(n: int) -> logging.LogRecord:
        return logging.LogRecord("zchannel.broker", logging.WARNING, __file__, 1,
                                 "refused a connection: %d connections", (n,), None)

    first = [record(i) for i in range(12)]
    assert [limit.filter(r) for r in first] == [True] * 5 + [False] * 7
    assert all("not logged" not in r.getMessage() for r in first)
    now[0] = 10.5  # a new window: its first record tells what the last one dropped
    later = record(99)
    assert limit.filter(later)
    assert later.getMessage() == ("refused a connection: 99 connections (7 more like this were "
                                  "not logged in the previous 10 s window)")
    now[0] = 21.0  # nothing dropped in the window before: no note
    quiet = record(3)
    assert limit.filter(quiet) and quiet.getMessage() == "refused a connection: 3 connections"
