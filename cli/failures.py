"""How the ``zchannel`` command reports an expected failure: one line on stderr, exit status 2.

Expected failures are bad options and arguments (click's usage errors), zchannel's own errors
(``ChannelError`` and its subclasses), invalid values (``ValueError``, ``TypeError``), files
that cannot be read (``OSError``), ZeroMQ errors such as a busy address, and an ``ImportError``
that names the optional extra to install (``pip install 'zchannel[ray]'``).  Set
``ZCHANNEL_DEBUG=1`` to get the traceback of such a failure instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import click
import zmq
from zchannel.broker.errors import ChannelError

USAGE_STATUS = 2
EXPECTED = (ChannelError, ValueError, TypeError, OSError, zmq.ZMQError)
EXTRA_HINT = "pip install 'zchannel["  # an ImportError naming the extra to install is expected
# click >= 8.2 raises this for a group called without arguments (it shows the help)
_NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())


def output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback for an option naming a file to write at the end of a run: its
    directory must exist and be writable now (not only after the run), else a usage error."""
    if value is None or value == "-":
        return value
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise click.BadParameter(f"{value}: directory {folder} does not exist", ctx, param)
    if not os.access(folder, os.W_OK):
        raise click.BadParameter(f"{value}: directory {folder} is not writable", ctx, param)
    return value


def fail(message: str, status: int = USAGE_STATUS) -> None:
    """Print ``error: MESSAGE`` (one line) on stderr and exit with ``status`` (2 by default)."""
    click.echo(f"error: {' '.join(message.split())}", err=True)
    sys.exit(status)


class CommandFailure(click.ClickException):
    """A run that failed (not its usage): one line on stderr, and its own ``exit_code``."""


class Cli(click.Group):
    """The ``zchannel`` group: every command's expected failures become ``fail()``;
    ``zchannel broker stop NAME`` runs the command registered as ``"broker stop"`` (``broker
    stop`` alone, or followed by options, still runs the broker of a channel named stop)."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        if len(args) > 2 and args[:2] == ["broker", "stop"] and (
                not args[2].startswith("-") or args[2] == "--help"):
            command = self.get_command(ctx, "broker stop")
            if command is not None:
                return "broker stop", command, args[2:]
        return super().resolve_command(ctx, args)

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **kwargs)
        debug = os.environ.get("ZCHANNEL_DEBUG", "").strip() not in ("", "0")
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **kwargs)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except click.ClickException as exc:  # a bad option, argument or file argument
            if debug or isinstance(exc, _NO_ARGS):  # no arguments at all: the help, as click does
                if not debug:
                    exc.show()
                    sys.exit(exc.exit_code)
                raise
            fail(_click_message(exc),
                 exc.exit_code if isinstance(exc, CommandFailure) else USAGE_STATUS)
        except EXPECTED as exc:
            if debug:
                raise
            fail(str(exc) or type(exc).__name__)
        except ImportError as exc:  # an optional extra that is not installed, if it says so
            if debug or EXTRA_HINT not in str(exc):
                raise
            fail(str(exc))
        sys.exit(result if isinstance(result, int) else 0)


def _click_message(exc: click.ClickException) -> str:
    message = exc.format_message()
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        return f"{message} (see '{ctx.command_path} --help')"
    return message
