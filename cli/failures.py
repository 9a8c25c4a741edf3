"""How the ``zchannel`` command reports an expected failure: one line on stderr, exit status 2.

Expected failures are bad options and arguments (click's usage errors), zchannel's own errors
(``ChannelError`` and its subclasses), invalid values (``ValueError``, ``TypeError``), files
that cannot be read (``OSError``), ZeroMQ errors such as a busy address, and an ``ImportError``
that names the optional extra to install (``pip install 'zchannel[ray]'``).  Set
``ZCHANNEL_DEBUG=1`` to get the traceback of such a failure instead (a flag as the client's
others: ``0``/``1``, ``false``/``true``, ``no``/``yes``, ``off``/``on``; another value is itself
an expected failure).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click
import zmq
from zchannel.broker.errors import ChannelError
from zchannel.broker.host.environ import env_flag

USAGE_STATUS = 2
DEBUG_ENV = "ZCHANNEL_DEBUG"  # set: tracebacks instead of the one line
EXPECTED = (ChannelError, ValueError, TypeError, OSError, zmq.ZMQError)
# JSON on the command line nested past Python's recursion limit (its parser recurses)
TOO_DEEP = "JSON nested too deeply to parse (arrays and objects inside each other)"
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


def fail(message: str, status: int = USAGE_STATUS) -> NoReturn:
    """Print ``error: MESSAGE`` (one line) on stderr and exit with ``status`` (2 by default)."""
    click.echo(f"error: {' '.join(message.split())}", err=True)
    sys.exit(status)


class CommandFailure(click.ClickException):
    """A run that failed (not its usage): one line on stderr, and its own ``exit_code``."""


class Cli(click.Group):
    """The ``zchannel`` group: every command's expected failures become ``fail()``;
    ``zchannel broker stop [OPTIONS] TARGET`` runs the command registered as ``"broker stop"``
    (``broker stop`` alone, or followed only by options ``zchannel broker`` takes, with their
    values, and none only the stop command has, still runs the broker of a channel named
    stop)."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        if len(args) > 2 and args[:2] == ["broker", "stop"]:
            command = self.get_command(ctx, "broker stop")
            if command is not None and self._stops(ctx, command, args[2:]):
                return "broker stop", command, args[2:]
        return super().resolve_command(ctx, args)

    def _stops(self, ctx: click.Context, stop: click.Command, rest: list[str]) -> bool:
        """Whether ``broker stop REST`` means the stop command: REST holds ``--help``, a
        target (an argument that is no option's value: ``zchannel broker`` takes one name,
        ``stop`` here), or an option only the stop command has."""
        broker = self.get_command(ctx, "broker")
        broker_opts = {o for p in (broker.params if broker else ()) for o in p.opts}
        valued = {o for p in (*stop.params, *(broker.params if broker else ()))
                  if isinstance(p, click.Option) and not p.is_flag for o in p.opts}
        stop_only = {o for p in stop.params for o in p.opts} - broker_opts
        i = 0
        while i < len(rest):
            arg = rest[i]
            if arg == "--":  # a target follows, or nothing does (the broker named stop)
                return i + 1 < len(rest)
            if arg == "--help" or not arg.startswith("-"):
                return True
            name = arg.split("=", 1)[0]
            if name in stop_only:
                return True
            i += 2 if name in valued and "=" not in arg else 1
        return False

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **kwargs)
        try:
            debug = env_flag(DEBUG_ENV, False)
        except ValueError as exc:  # neither of the flag's words
            fail(str(exc))
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


def given_on_command_line(name: str) -> bool:
    """Whether the current command's option ``name`` (its parameter name) was given on the
    command line."""
    source = click.get_current_context().get_parameter_source(name)
    return source is click.core.ParameterSource.COMMANDLINE


def require_companions(needs: dict[str, str]) -> None:
    """A usage error for an option given (on the command line) without the option it works
    with: ``needs`` maps an option's parameter name to its companion's, which counts as
    missing when it is None (not given) or False (a flag not set): an empty value such as
    ``--peek ''`` is given."""
    ctx = click.get_current_context()
    params = {p.name: p for p in ctx.command.params}
    for name, companion in needs.items():
        value = ctx.params.get(companion)
        if given_on_command_line(name) and (value is None or value is False):
            raise click.UsageError(f"{params[name].opts[-1]} does nothing without "
                                   f"{params[companion].opts[-1]}")
