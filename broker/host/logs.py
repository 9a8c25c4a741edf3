"""Who says a zchannel warning, when the application has not set up logging.

zchannel logs on the ``zchannel.*`` loggers (``zchannel.client`` in every process with a handle,
``zchannel.broker`` in a broker) and configures nothing in the processes it does not own.  With
no logging configured, Python prints a warning through ``logging.lastResort`` as the bare
message: in a job of many worker processes, a line such as ``the broker at tcp://… is silent for
3.0s: unavailable`` does not say which process saw it.  ``LabelledLastResort`` takes that place
for the ``zchannel`` loggers: it prints the record with its logger, process name and pid
(``zchannel.client in env:0 (pid 4242) WARNING: …``), and prints nothing where the record
reaches another handler (the application's logging set-up then applies, as without it).
A broker process sets up its own handler (``server/loop.py: setup_logging``).
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(name)s in %(processName)s (pid %(process)d) %(levelname)s: %(message)s"


class LabelledLastResort(logging.StreamHandler):
    """``logging.lastResort`` for the ``zchannel`` loggers, with the speaker named."""

    def __init__(self) -> None:
        super().__init__()
        self.setLevel(logging.WARNING)
        self.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if not self._other_handlers(record.name):  # the application configured no logging
            self.stream = sys.stderr  # the current one, as Python's last resort writes to
            super().emit(record)

    def _other_handlers(self, name: str) -> bool:
        """Whether a record of logger ``name`` reaches a handler besides this one (the way
        ``Logger.callHandlers`` walks up; Python's own last resort is used only when not)."""
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False


def install() -> None:
    """Give the ``zchannel`` logger its labelled last resort (once per process)."""
    logger = logging.getLogger("zchannel")
    if not any(isinstance(h, LabelledLastResort) for h in logger.handlers):
        logger.addHandler(LabelledLastResort())


__all__ = ["FORMAT", "LabelledLastResort", "install"]
