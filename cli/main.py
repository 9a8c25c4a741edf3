"""The ``zchannel`` command: ``broker``, ``stat``, ``bench`` and friends."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from typing import Any

import click

try:  # zchannel.broker reads the client's ZCHANNEL_* settings as it loads (connection/tuning.py)
    import zchannel.broker  # noqa: F401
except ValueError as exc:  # a malformed setting: one line and status 2, whatever the command
    try:  # their reader (host/environ.py) loaded before the failing setting and stays loaded
        from zchannel.broker.host.environ import env_flag

        debug = env_flag("ZCHANNEL_DEBUG", False)
    except ValueError:  # ZCHANNEL_DEBUG is malformed too: the first failure, one line
        debug = False
    if debug:
        raise
    click.echo(f"error: {' '.join(str(exc).split())}", err=True)
    sys.exit(2)

from zchannel.broker.errors import ChannelError
from zchannel.broker.host import paths
from zchannel.broker.server.loop import read_token_file
from zchannel.broker.wire.argchecks import key_label
from zchannel.cli.failures import TOO_DEEP, Cli, require_companions
from zchannel.cli.shipped import ConfigFile
from zchannel.cli.summary import key_from_text, key_text, pad, printable, summarize, text_width
from zchannel.cli.workdir import import_from_cwd
from zchannel.hooks import expand_consumers


def _parse_consumers(values: tuple[str, ...]) -> Any:
    """The declared consumers of ``--consumers`` values: counts (``actor=3``, or the older
    ``actor:3`` alone in a value, of 2 or more) as a mapping ``{"actor": 3}``
    (``--consumers actor=3 --consumers critic=2``, or ``actor=3,critic=2``), or lists of ids
    (``actor:0,actor:2``; one id: ``actor:1,``).  A lone ``actor:0`` or ``actor:1`` reads as a
    count and as an id alike: it is refused, naming both spellings."""
    if not values:
        return None
    mapping: dict[str, int] = {}
    ids: list[str] = []
    for value in values:
        parts = [part.strip() for part in value.split(",") if part.strip()]
        for part in parts:
            group, sep, count = part.partition("=")
            if not sep and "," not in value:  # a lone group:N, the older count form
                group, sep, count = part.rpartition(":")
                _check_lone_count(part, count)
            elif not sep:
                _check_id(part)
                ids.append(part)
                continue
            if not group.strip() or not _digits(count) or int(count) < 1:
                raise _bad_consumers(f"{part!r}: a count is group=N with N >= 1 "
                                     "(actor=3 declares actor:0 to actor:2)")
            if group.strip() in mapping:
                raise _bad_consumers(f"{part!r}: group {group!r} is counted twice")
            mapping[group.strip()] = int(count)
    if mapping and ids:
        raise _bad_consumers("give either counts (actor=3 --consumers critic=2) or lists of "
                             "ids (actor:0,actor:1), not both")
    expand_consumers(mapping or ids)  # ValueError naming a group whose count is past the limit
    return mapping or ids


def _digits(text: str) -> bool:
    """Whether ``text`` is a non-negative int written in ASCII digits."""
    return text.isascii() and text.isdigit()


def _bad_consumers(message: str) -> click.BadParameter:
    """The usage error of a ``--consumers`` value."""
    return click.BadParameter(message, param_hint="'--consumers'")


def _check_id(part: str) -> None:
    """``BadParameter`` unless ``part`` has the form of a consumer id, ``group:rank``."""
    group, sep, rank = part.rpartition(":")
    if not sep or not group or not _digits(rank):
        raise _bad_consumers(f"{part!r}: expected group:count or group:rank (a count: "
                             "actor=3, or actor:3 alone; an id: actor:0)")


def _check_lone_count(part: str, count: str) -> None:
    """``BadParameter`` for a lone ``group:N`` that is no count: not of that form, or N of 0
    or 1, which reads as the one consumer ``group:N`` as well."""
    _check_id(part)
    group = part.rpartition(":")[0]
    if int(count) == 0:
        raise _bad_consumers(
            f"{part!r} alone would declare no consumer (a count of 0): for the consumer "
            f"{part} write {part}, (a list of one id); a count is written {group}=N")
    if int(count) == 1:
        raise _bad_consumers(
            f"{part!r} alone reads both as a count (one consumer, {group}:0) and as the "
            f"consumer id {part}: write {group}=1 for the count, or {part}, (a list of one "
            "id) for that consumer")


# the tables of the other TOML files zchannel reads, and what to do with such a file
_OTHER_FILES = (({"bench", "targets"}, "this looks like a `zchannel bench --config` file"),
                ({"cluster", "replica"}, "this looks like a cluster file: use `zchannel broker "
                                         "--cluster FILE --replica I`"))


def _refuse_other_files(path: str) -> None:
    """``ValueError`` for a ``--config`` file of ``zchannel bench`` or a cluster file given
    as a broker's config file: its unknown tables, and the command it is meant for."""
    from zchannel.broker.host.toml import read_toml

    unknown = sorted(set(read_toml(path)) - {"channel", "hooks", "options"})
    for tables, hint in _OTHER_FILES:
        if tables & set(unknown):
            raise ValueError(f"{path}: unknown table(s) {unknown}: {hint}")


def _parse_options(values: tuple[str, ...]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for value in values:
        key, sep, raw = value.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{value!r}: expected key=value (a non-empty key)",
                                     param_hint="'--option'")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
        except RecursionError:  # Python's parser recurses once per array or object
            raise click.BadParameter(f"the value of {key}: {TOO_DEEP}",
                                     param_hint="'--option'") from None
    return options


@click.group(cls=Cli)
@click.version_option(package_name="zchannel")
def main() -> None:
    """zchannel: ZeroMQ channels for distributed RL workers.

    An expected failure (a bad option, a busy address, a key file that cannot be read, no
    broker) prints one line, "error: ...", on stderr and exits with status 2
    (ZCHANNEL_DEBUG=1: a traceback instead).
    """


@main.command()
@click.argument("name", required=False)
@click.option("--address", help="ipc://PATH or tcp://HOST:PORT (port 0 = any free port)")
@click.option("--maxsize", type=int, help="per-queue capacity (0 = unbounded)")
@click.option("--config", "config_file", type=ConfigFile(),
              help="a TOML file ([channel], [hooks], [options]); configs/NAME.toml also finds "
                   "the copy installed with zchannel")
@click.option("--collector", help="collector: registered name, module:Class")
@click.option("--dispatcher", help="dispatcher: registered name, module:Class")
@click.option("--consumers", multiple=True,
              help="declared consumers: a count, actor=3 (actor:0 to actor:2; actor:3 alone "
                   "too), or ids, actor:0,actor:2 (one id: actor:1,); repeat for more groups")
@click.option("--producers", multiple=True, help="producer group names")
@click.option("--option", "options", multiple=True, help="hook option key=value (JSON values)")
@click.option("--import", "imports", multiple=True, help="module to import before resolving hooks (modules of the working "
                   "directory are found, as by python script.py)")
@click.option("--lease-timeout", type=float, help="seconds before an unacknowledged delivery returns")
@click.option("--max-bytes", type=int, help="bytes of items held before puts wait (payload + 320 "
              "per item), and again of waiting requests before they are refused (0 = no limit)")
@click.option("--max-keys", type=int, help="number of keys the broker holds at most (default 100000)")
@click.option("--max-message-bytes", type=int, help="largest message accepted, in bytes (0 = no limit, else at least 262144)")
@click.option("--shm-threshold", type=int,
              help="arrays/tensors of at least this many bytes use same-host shared memory "
                   "(default 1048576; 0 = off)")
@click.option("--direct/--no-direct", default=None,
              help="same-host clients of an ipc address talk over a Unix stream socket beside it, "
                   "without libzmq (default: on; docs/protocol.md)")
@click.option("--sched-batch/--no-sched-batch", default=None,
              help="run the broker's loop under Linux's SCHED_BATCH policy: a waking broker "
                   "does not preempt a busy client (default: on; docs/decisions.md)")
@click.option("--insecure", is_flag=True, default=None, help="allow a non-loopback tcp bind without CURVE")
@click.option("--curve-secret-key", type=click.Path(exists=True, dir_okay=False),
              help="the broker's CURVE key pair file (zchannel keygen)")
@click.option("--curve-public-keys", type=click.Path(exists=True, file_okay=False),
              help="directory of the public key files of the clients let in")
@click.option("--cluster", type=ConfigFile(),
              help="cluster file of a distributed channel (docs/distributed.md); needs --replica")
@click.option("--replica", type=int, help="the index of the replica to run (with --cluster)")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="serve Prometheus metrics over HTTP on this port (0 = any free port; needs "
                   "pip install 'zchannel[metrics]'; docs/metrics.md)")
@click.option("--metrics-address", help="address the metrics endpoint binds (default 127.0.0.1)")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False),
              help="read the shutdown token from this file's first line (default: a random "
                   "one; either way it is kept in NAME.token in the run directory)")
@click.option("--curve-admin-keys", type=click.Path(exists=True),
              help="public key file, or directory of them, of CURVE clients that may stop this "
                   "broker without its shutdown token")
@click.option("--max-clients", type=int,
              help="connections served at once; more are refused, with a log line (default: "
                   "from the descriptor limit, docs/security.md)")
@click.option("--producer-grace", type=float,
              help="seconds a producer's put sequences are kept after its connection ended "
                   "(retry-safe puts, default 60)")
@click.option("--journal", type=click.Path(file_okay=False),
              help="a durable channel: record every item in this directory and serve what it "
                   "holds when started again (docs/durability.md)")
@click.option("--fsync", type=click.Choice(("always", "interval", "never")),
              help="when journal records reach the disk: before the reply, within "
                   "--fsync-interval (default), or when the OS writes them")
@click.option("--fsync-interval", type=click.FloatRange(min=0, min_open=True),
              help="seconds between the journal's syncs with --fsync interval (default 0.01; "
                   "refused with another --fsync, where it would do nothing)")
@click.option("--max-journal-bytes", type=click.IntRange(min=0),
              help="puts wait while the journal would take more disk than this (0 = no limit)")
def broker(name: str | None, config_file: str | None, consumers: tuple[str, ...],
           producers: tuple[str, ...], options: tuple[str, ...], imports: tuple[str, ...],
           **flags: Any) -> None:
    """Run the broker of channel NAME in the foreground.

    Prints ``ready <address>`` on stdout once bound; logs go to stderr, among them where its
    shutdown token is kept; SIGINT, SIGTERM and SIGHUP (its terminal closed; not under nohup)
    stop it, and so does ``zchannel broker stop NAME`` (with that token), from any process of
    the same user.
    """
    from zchannel.broker.server.config import build_config, read_config_file
    from zchannel.broker.server.entry import run_broker

    import_from_cwd()  # --import myhooks, --collector myhooks:Pass: myhooks.py of the cwd
    if config_file:
        _refuse_other_files(config_file)
    # expected failures (bad values, unreadable files, a busy address, a name already served)
    # become one line on stderr and exit status 2 (cli/failures.py)
    config = build_config(
        config_file, name=name, consumers=_parse_consumers(consumers),
        producers=list(producers), options=_parse_options(options), imports=list(imports),
        **flags,
    )
    paths.check_name(config.name)
    in_file = read_config_file(config_file) if config_file else {}

    def given(*fields: str) -> list[str]:  # the options set on the command line or in the file
        return [f"--{f.replace('_', '-')}" if flags.get(f) is not None else f"{f} in {config_file}"
                for f in fields if flags.get(f) is not None or f in in_file]

    journal_only = given("fsync", "fsync_interval", "max_journal_bytes", "journal_segment_bytes")
    if journal_only and not config.journal:
        raise _journal_missing(journal_only, config_file)
    if given("fsync_interval") and config.fsync != "interval":
        raise _interval_unused(given("fsync_interval")[0], config.fsync, given("fsync"),
                               config_file)
    if given("metrics_address") and config.metrics_port is None:
        raise click.UsageError(f"{given('metrics_address')[0]} sets the metrics endpoint: give "
                               "--metrics-port PORT too")
    if config.cluster is not None or config.replica is not None:  # one replica of a cluster
        if config.cluster is None or config.replica is None:
            raise ValueError("--cluster FILE and --replica I go together")
        from zchannel.broker.cluster.replica import replica_state

        replica_state(config)  # its address (and insecure) come from the cluster file
    remedy = ("pass --curve-secret-key FILE and --curve-public-keys DIR (zchannel keygen), or "
              "--insecure on a trusted network")
    if config.cluster is not None:
        remedy = (f"give the replicas CURVE keys (zchannel keygen --replicas N), or set "
                  f"insecure = true in [cluster] of {config.cluster}")
    paths.check_bind_address(config.address if config.address is not None else "ipc://",
                             config.curve_secret_key is not None
                             and config.curve_public_keys is not None,
                             bool(config.insecure), remedy=remedy)
    try:
        sys.exit(run_broker(config))
    except RuntimeError as exc:  # a broker already serves the name
        raise ChannelError(str(exc)) from None


def _journal_missing(settings: list[str], config_file: str | None) -> Exception:
    """The error of journal ``settings`` (``--fsync``, ``fsync in FILE``...) given without a
    journal directory: a usage error pointing to ``--journal``, or, for a broker given a
    ``config_file``, a ``ValueError`` pointing to that file's ``journal`` key as well."""
    message = f"{', '.join(settings)} set(s) the journal: give --journal DIR too"
    if config_file is None:
        return click.UsageError(message)
    return ValueError(f'{message}, or a journal key in [channel] of {config_file} (journal = '
                      '"DIR", the directory of the channel\'s journal)')


def _interval_unused(setting: str, policy: str, policy_given: list[str],
                     config_file: str | None) -> Exception:
    """The error of an fsync interval (``setting``: ``--fsync-interval`` or ``fsync_interval
    in FILE``) given with an fsync ``policy`` other than ``interval``, which syncs on no
    interval: it would do nothing.  A usage error, or, for a broker given a ``config_file``,
    a ``ValueError`` naming that file's keys too."""
    where = f" ({policy_given[0]})" if policy_given else ""
    message = (f"{setting} sets how often the journal syncs under --fsync interval: with "
               f"fsync {policy}{where} it would do nothing; drop it, or use --fsync interval")
    if config_file is None:
        return click.UsageError(message)
    return ValueError(f"{message} (fsync = \"interval\" in [channel] of {config_file})")


def _client_curve_options(command: Any) -> Any:
    """The options of a command that connects to a broker with CURVE keys (``_stat_keys``)."""
    command = click.option(
        "--curve-server-key", type=click.Path(dir_okay=False), envvar="ZCHANNEL_CURVE_SERVER_KEY",
        show_envvar=True, help="the broker's CURVE public key file (NAME.key)")(command)
    return click.option(
        "--curve-secret-key", type=click.Path(dir_okay=False), envvar="ZCHANNEL_CURVE_SECRET_KEY",
        show_envvar=True,
        help="this client's CURVE key pair file, for a broker with CURVE keys")(command)


@main.command("broker stop", hidden=True)  # called as `zchannel broker stop NAME` (cli/failures.py)
@click.argument("target")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False),
              help="the shutdown token's file (a first line), for a TARGET address")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="seconds to wait for the broker to answer and exit")
@_client_curve_options
def broker_stop(target: str, token_file: str | None, timeout: float,
                curve_secret_key: str | None, curve_server_key: str | None) -> None:
    """Stop the broker of TARGET cleanly.

    TARGET is a channel name served on this host (NAME.replicaI: one replica of a distributed
    channel): the broker's pid is read from NAME.token in the run directory (readable by its
    owner only), the broker gets SIGTERM, which stops it as Ctrl-C does (even when it holds
    --max-clients connections), and the command waits until the process exited.  A broker
    busy in a hook call stops once that call returns: if it has not exited within --timeout,
    the command says so (status 2), and running it again (a second stop signal) interrupts
    the call and stops the broker at once (docs/hooks.md).  Or TARGET is an address: a
    shutdown request with the token from --token-file, or from a CURVE admin key (the
    broker's --curve-admin-keys) without one.
    """
    if paths.is_address(target):
        if not token_file and not curve_secret_key:
            raise click.UsageError(
                f"{target} is an address: give --token-file FILE (the broker's shutdown token), "
                "or stop it with a CURVE admin key (--curve-secret-key, --curve-server-key); "
                "`zchannel broker stop NAME` reads the token of a broker of this host")
        info: dict = {"address": target, "token": ""}
        if token_file:
            info["token"] = read_token_file(token_file)
    else:
        paths.check_name(target)
        found = paths.read_token_file(target)
        if found is None:
            raise ChannelError(f"no shutdown token for {target!r} in {paths.run_dir()}: no "
                               "broker of this user serves it on this host (`zchannel stat` "
                               "lists them)")
        info = found
    keys = _stat_keys(curve_secret_key, curve_server_key, target)
    if "pid" in info and _takes_stop_signal(target, info["pid"]):
        _stop_by_signal(target, info["pid"], info["address"], timeout)
    else:
        _stop_by_request(target, info, timeout, keys)


def _stop_by_signal(name: str, pid: int, address: str, timeout: float) -> None:
    """Stop the broker of ``name`` (process ``pid``, ``_takes_stop_signal``) with SIGTERM and
    wait ``timeout`` seconds for it to exit; a ``ChannelError`` saying what to do when it
    did not (a hook call that has not returned)."""
    os.kill(pid, signal.SIGTERM)
    if not _exits_within(pid, timeout):
        raise ChannelError(
            f"broker {name!r} (pid {pid}) got the stop signal but has not exited within "
            f"{timeout}s: it is busy (in a hook call that has not returned?) and stops once "
            f"its loop runs again; run `zchannel broker stop {name}` again (or kill -TERM "
            f"{pid}): a second stop signal interrupts the hook call and stops it now")
    click.echo(f"stopped {name} (pid {pid}, {address})")


def _stop_by_request(target: str, info: dict, timeout: float, keys: Any) -> None:
    """Stop the broker at ``info["address"]`` with a shutdown request carrying
    ``info["token"]`` (or the CURVE admin key ``keys``); for a ``target`` name, wait until
    its process (``info["pid"]``) exited."""
    from zchannel.broker import Channel
    from zchannel.broker.errors import ChannelNotFound

    try:
        handle = Channel.connect(info["address"], timeout=timeout, curve_keys=keys)
    except ChannelNotFound as exc:
        raise ChannelNotFound(f"{exc}{_silent_broker_hint(target, info)}") from None
    pid = handle.stats(exclude_self=True).get("pid") if "pid" not in info else info["pid"]
    handle.shutdown(token=info["token"])
    if not paths.is_address(target) and isinstance(pid, int) and not _exits_within(pid, timeout):
        raise ChannelError(f"broker {target!r} (pid {pid}) accepted the shutdown but did not "
                           f"exit within {timeout}s")
    click.echo(f"stopped {target} (pid {pid}, {info['address']})")


def _exits_within(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (no child of this one) exited within ``timeout`` seconds."""
    from zchannel.broker.host.procs import process_running

    deadline = time.monotonic() + timeout
    while process_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _takes_stop_signal(lock_name: str, pid: object) -> bool:
    """Whether process ``pid`` (from the token file of ``lock_name``) is that broker and a
    SIGTERM stops it cleanly: it runs, has the channel's lock file open (``/proc/PID/fd``: the
    pid is no other process's, of another pid namespace sharing the run directory, say), and
    catches SIGTERM (``SigCgt``: a broker ``Channel.create`` started catches it only once it
    serves).  False where ``/proc`` cannot tell."""
    from zchannel.broker.host.procs import process_running

    if not isinstance(pid, int) or isinstance(pid, bool) or not process_running(pid):
        return False
    try:
        lock = os.stat(paths.lock_path(lock_name))
        with open(f"/proc/{pid}/status") as f:
            caught = next((int(line.split()[1], 16) for line in f
                           if line.startswith("SigCgt:")), 0)
        if not caught >> (signal.SIGTERM - 1) & 1:
            return False
        fds = f"/proc/{pid}/fd"
        for fd in os.listdir(fds):
            try:
                held = os.stat(os.path.join(fds, fd))
            except OSError:  # closed meanwhile
                continue
            if (held.st_dev, held.st_ino) == (lock.st_dev, lock.st_ino):
                return True
    except (OSError, ValueError, IndexError):
        return False
    return False


def _silent_broker_hint(target: str, info: dict) -> str:
    """What to add to "no broker answered" when a broker of this host serving ``target``
    (its name, or ``info["address"]`` in a token file of the run directory) runs all the
    same: it is busy or holds all the connections it serves."""
    from zchannel.broker.host.procs import process_running

    found = _local_broker(target, info["address"])
    if found is None or not process_running(found[1]):
        return ""
    name, pid = found
    return (f"; yet broker {name!r} of this host (pid {pid}) serves it and runs: it is busy "
            "(a hook call that has not returned?) or holds --max-clients connections; "
            f"`zchannel broker stop {name}` stops it with a signal")


def _local_broker(target: str, address: str) -> tuple[str, int] | None:
    """The lock name and pid of the broker of this host serving ``target`` (a name) or
    ``address``, from the token files of the run directory; None if there is none."""
    names = [target] if not paths.is_address(target) else sorted(
        path.stem for path in paths.run_dir().glob("*.token"))
    for name in names:
        try:
            found = paths.read_token_file(name)
        except (ChannelError, ValueError):  # a killed broker's, or no token file
            continue
        if found is not None and found["address"] == address \
                and isinstance(found.get("pid"), int):
            return name, found["pid"]
    return None


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="broker", show_default=True, help="file name stem")
@click.option("--replicas", type=click.IntRange(min=1),
              help="keys for a cluster file instead: replicaI pairs, NAME as the client pair, "
                   "their public keys in DIRECTORY/clients; prints the [cluster] lines")
@click.option("--force", is_flag=True,
              help="replace key files that exist (their holders are locked out)")
def keygen(directory: str, name: str, replicas: int | None, force: bool) -> None:
    """Write a CURVE key pair: DIRECTORY/NAME.key (public) and NAME.key_secret (mode 0600).

    Give the broker its NAME.key_secret (--curve-secret-key) and a directory holding the clients'
    public .key files (--curve-public-keys); give each client its own .key_secret and the
    broker's .key (curve_keys=(secret, server_public) or ZCHANNEL_CURVE_SECRET_KEY /
    ZCHANNEL_CURVE_SERVER_KEY).  With --replicas N: a pair per replica of a cluster file
    (docs/distributed.md), one client pair NAME, and DIRECTORY/clients holding every public key
    let in (the replicas authenticate each other with their own pairs).  Key files that exist
    are kept (an error names them) unless --force.
    """
    import shutil

    from zchannel.broker.transport.curve_keys import keygen as make_keys

    paths.check_name(name)  # a file name stem: no separators
    replica_stems = [f"replica{i}" for i in range(replicas or 0)]
    if name in replica_stems:  # the client pair would be written over that replica's pair
        raise click.BadParameter(
            f"{name!r} is the file name stem of replica {replica_stems.index(name)}'s pair "
            f"(--replicas {replicas} writes replica0 .. {replica_stems[-1]}): give the client "
            "pair another name", param_hint="'--name'")
    stems = replica_stems + [name]
    taken = [f for stem in stems for f in (os.path.join(directory, f"{stem}.key"),
                                           os.path.join(directory, f"{stem}.key_secret"))
             if os.path.exists(f)]
    if taken and not force:
        raise ValueError(f"{taken[0]} exists (a new pair would lock out whoever holds it): "
                         "use another --name or directory, or --force to replace it")
    if replicas is None:
        public, secret = make_keys(directory, name)
        click.echo(f"public {public}")
        click.echo(f"secret {secret}")
        return
    clients = os.path.join(directory, "clients")
    os.makedirs(clients, exist_ok=True)
    for stem in stems:
        public, secret = make_keys(directory, stem)
        shutil.copy(public, os.path.join(clients, f"{stem}.key"))
        click.echo(f"secret {secret}")
    keys = ", ".join(f'"{os.path.join(directory, s)}.key"' for s in stems[:-1])
    click.echo("[cluster]")
    click.echo(f"server_keys = [{keys}]")
    click.echo(f'client_keys = "{clients}"')


@main.command()
@click.argument("target", required=False)
@click.option("--json", "as_json", is_flag=True, help="print the raw stats as JSON")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=5.0,
              show_default=True, help="seconds to wait for the broker")
@_client_curve_options
@click.option("--peek", "peek_key", metavar="KEY",
              help="also show copies of the head items of KEY, left in place; KEY as stat "
                   "prints it (int, bytes and tuple keys as Python literals: 7, b'x', "
                   "('train', 3); in a str key \\n is a newline, \\\\ a backslash)")
@click.option("-n", "peek_count", type=click.IntRange(1, 1024), default=10, show_default=True,
              help="how many head items --peek shows")
@click.option("--consumer", "peek_consumer", metavar="ID",
              help="--peek shows what consumer ID would take next (its private queue, then the "
                   "shared one) instead of the shared queue")
@click.option("--watch", is_flag=True,
              help="refresh a live view (with puts/gets/delivered per second) until Ctrl-C")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="seconds between refreshes of --watch")
@click.option("--count", type=click.IntRange(min=1),
              help="stop --watch after this many refreshes (default: until Ctrl-C)")
def stat(target: str | None, as_json: bool, timeout: float, curve_secret_key: str | None,
         curve_server_key: str | None, peek_key: str | None, peek_count: int,
         peek_consumer: str | None, watch: bool, interval: float, count: int | None) -> None:
    """Show the state of the broker serving TARGET (a channel name or an address).

    This command's own connection is not counted in ``clients``.  With --watch, redraw it
    every --interval seconds with rates computed from successive stats; --json then prints
    one JSON object per refresh (its "rates" included).

    Without TARGET: list the brokers of this host (from the run directory) and the stale
    entries that brokers which did not stop cleanly left behind ("zchannel clean" removes
    them).
    """
    from zchannel.broker import Channel

    require_companions({"count": "watch", "interval": "watch", "peek_count": "peek_key",
                        "peek_consumer": "peek_key"})
    try:
        key = None if peek_key is None else key_from_text(peek_key)  # as stat prints it
    except ValueError as exc:  # a backslash that starts no escape stat prints
        raise click.BadParameter(str(exc), param_hint="'--peek'") from None
    curve_keys = _stat_keys(curve_secret_key, curve_server_key, target)
    if target is None:
        from zchannel.cli.host import show_host

        if peek_key is not None or watch:
            raise click.UsageError("--peek and --watch need a channel NAME or ADDRESS")
        show_host(as_json, timeout, curve_keys)
        return
    channel = Channel.connect(target, timeout=timeout, curve_keys=curve_keys)
    if watch:
        from zchannel.cli.stat_watch import watch_stats

        if peek_key is not None:
            channel.close()
            raise click.UsageError("--peek and --watch do not go together")
        try:
            watch_stats(channel, interval, count, (lambda s: json.dumps(
                _json_keys(s), default=_jsonable, sort_keys=True)) if as_json else None)
        finally:
            channel.close()
        return
    try:
        stats = channel.stats(exclude_self=True)
        peeked = None if peek_key is None else (key, channel.peek(
            key, peek_count, consumer=peek_consumer, weights=True))
    except (ValueError, TypeError) as exc:  # a key or consumer id the channel refuses
        raise click.UsageError(str(exc)) from None
    finally:
        channel.close()
    if peek_consumer is not None:
        _check_peek_consumer(peek_consumer, key, stats)
    if as_json:
        if peeked is not None:
            stats["peek"] = {"key": key_label(peeked[0]), "items": [
                {"weight": w, "summary": summarize(item)} for item, w in peeked[1]]}
        click.echo(json.dumps(_json_keys(stats), default=_jsonable, indent=2, sort_keys=True))
        return
    _echo_stats(stats)
    _echo_key_table(stats)
    if peeked is not None:
        _echo_peek(*peeked, stats, peek_consumer)


def _check_peek_consumer(consumer: str, key: Any, stats: dict) -> None:
    """``UsageError`` (status 2) for a ``--consumer`` of ``stat --peek KEY`` that is no consumer
    of the channel (not among its consumers now, and no private queue of ``key`` waits for
    it), naming those there are: its peek would show nothing of its own."""
    consumers = list(stats.get("consumers") or [])
    private = (stats.get("keys") or {}).get(key, {}).get("private") or {}
    if consumer in consumers or consumer in private:
        return
    known = ", ".join(consumers + sorted(set(private) - set(consumers)))
    raise click.UsageError(
        f"--consumer {consumer}: no consumer of channel {stats.get('name')!r} has that id "
        + (f"(its consumers: {known})" if known else
           "(it has none: its dispatcher deals no items, or none joined yet)"))


def _echo_stats(stats: dict) -> None:
    """``stat``'s summary lines: the broker, its counters, hooks, shared memory, replicas."""
    click.echo(f"channel   {stats.get('name')}  at {stats.get('address')}  (pid {stats.get('pid')})")
    click.echo(f"uptime    {stats.get('uptime_s', 0):.1f}s   clients {stats.get('clients', 0)}   "
               f"bytes held {stats.get('bytes_held', 0)}   maxsize {stats.get('maxsize', 0)}")
    failures = stats.get("hook_failures") or 0
    last_failure = printable(str(stats.get("last_hook_failure")))  # it may quote a key
    click.echo(f"hooks     collector={stats.get('collector')}  dispatcher={stats.get('dispatcher')}"
               + (f"  failures {failures} (last: {last_failure})"
                  if failures else ""))
    if "puts" in stats:  # request counters since the broker started (--watch shows their rates)
        click.echo(f"requests  puts {stats['puts']}   gets {stats['gets']}   "
                   f"delivered {stats['delivered']}")
    if stats.get("metrics"):
        click.echo(f"metrics   {stats['metrics']}")
    shm = stats.get("shm") or {}
    if shm.get("enabled"):
        click.echo(f"shm       threshold {shm.get('threshold')}   segments {shm.get('segments')}   "
                   f"slots used {shm.get('slots_used')}   bytes held {shm.get('bytes_held')}   "
                   f"held by consumers {shm.get('consumer_bytes')}   same-host clients "
                   f"{shm.get('clients')}")
    journal = stats.get("journal")
    if journal:  # a durable channel (docs/durability.md)
        limit = journal.get("max_journal_bytes") or "none"
        click.echo(f"journal   {journal.get('directory')}   fsync {journal.get('fsync')}   "
                   f"bytes {journal.get('bytes')} (limit {limit})   segments "
                   f"{journal.get('segments')}   items {journal.get('items')}   fsync lag "
                   f"{journal.get('fsync_lag_ms')} ms   last fsync "
                   f"{journal.get('last_fsync_ms')} ms   recovered "
                   f"{journal.get('recovered_items')} ({journal.get('redelivered')} redelivered)   "
                   f"compacted {journal.get('compacted_bytes')} bytes, "
                   f"{journal.get('compacted_segments')} segments"
                   + (f"   FAILED: {journal['failed']}" if journal.get("failed") else ""))
    if stats.get("collector_stats"):
        click.echo(f"collector {json.dumps(stats['collector_stats'], default=_jsonable)}")
    click.echo(f"consumers {', '.join(stats.get('consumers') or []) or '-'}")
    for rep in stats.get("replicas") or ():  # a distributed channel: one line per replica
        state = rep.get("error") or (f"pid {rep.get('pid')}  keys {rep.get('keys')}  "
                                     f"bytes held {rep.get('bytes_held')}")
        click.echo(f"replica   {rep['replica']}  node {rep['node']}  at {rep['address']}  {state}")


def _echo_key_table(stats: dict) -> None:
    """``stat``'s table of keys (depth, weight, waiting getters and putters, private queues);
    a key shows as ``key_text`` makes it (escaped, at most ``KEY_WIDTH`` terminal columns), and
    the columns line up in terminal columns (a wide character takes two)."""
    keys = stats.get("keys") or {}
    nodes = "replicas" in stats
    rows = [("key", "depth", "weight", "getters", "putters", "private") + (("node",) if nodes else ())]
    for key, ks in sorted(keys.items(), key=lambda kv: repr(kv[0])):
        private = " ".join(f"{c}={d}" for c, d in sorted(ks.get("private", {}).items()))
        rows.append((key_text(key), str(ks["depth"]), str(ks["weight"]), str(ks["getters"]),
                     str(ks["putters"]), private or "-") + ((str(ks.get("node")),) if nodes else ()))
    widths = [max(text_width(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(pad(cell, w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _echo_peek(key: Any, items: list, stats: dict, consumer: str | None) -> None:
    """The ``--peek`` section: one line per head item (index, weight, summary); without
    ``consumer``, a hint when items of the key wait in private queues, which the shared
    queue's head leaves out."""
    key_stats = (stats.get("keys") or {}).get(key, {})
    taker = f", as consumer {consumer} would take them" if consumer is not None else ""
    click.echo(f"peek      {key_text(key)}: {len(items)} of {key_stats.get('depth', len(items))} "
               f"item(s), head first{taker}, left in place")
    for i, (item, weight) in enumerate(items):
        click.echo(f"  [{i}] weight {weight}  {summarize(item)}")
    if key_stats.get("private") and consumer is None:
        click.echo("  (items dealt to consumers wait in private queues: --consumer ID shows "
                   "what ID would take next)")


def _stat_keys(secret: str | None, server: str | None, target: str | None = None) -> Any:
    """The CURVE keys ``stat`` and ``broker stop`` connect with: this client's key pair file
    with the broker's public key file; with the pair alone, the public key the broker of a
    ``target`` name left in its token file (a broker of this user on this host), else none
    but ``$ZCHANNEL_CURVE_SECRET_KEY`` set to the pair: a distributed channel's replicas
    send their public keys in its replica table."""
    if server and not secret:
        raise click.UsageError("--curve-server-key (ZCHANNEL_CURVE_SERVER_KEY) needs this "
                               "client's key pair: --curve-secret-key (ZCHANNEL_CURVE_SECRET_KEY)")
    from zchannel.broker.transport.curve import (
        CurveKeys,
        ReplicaCurveKeys,
        name_key_settings,
        reset_key_settings,
    )
    from zchannel.broker.transport.curve_keys import load_key_file

    # this command's CURVE errors name its options (or the variable the key pair came from),
    # until the command ends
    context = click.get_current_context()
    context.call_on_close(reset_key_settings)
    source = context.get_parameter_source("curve_secret_key")
    name_key_settings("ZCHANNEL_CURVE_SECRET_KEY"
                      if source is click.core.ParameterSource.ENVIRONMENT
                      else "--curve-secret-key", "--curve-server-key")
    if not secret:
        return None

    found = {} if server else _token_record(target)
    if server:
        keys = CurveKeys(secret, server)
    elif found.get("curve_public_key"):
        keys = ReplicaCurveKeys(secret, str(found["curve_public_key"]))
    else:
        load_key_file(secret, "the client's CURVE key pair")
        # what the option stands for, while the command runs (given back when it ends: a
        # command run inside a Python process leaves its environment as it was)
        context.call_on_close(functools.partial(_restore_environ, "ZCHANNEL_CURVE_SECRET_KEY",
                                                os.environ.get("ZCHANNEL_CURVE_SECRET_KEY")))
        os.environ["ZCHANNEL_CURVE_SECRET_KEY"] = secret
        return None
    keys.load()  # a file that does not hold a key: say which, now
    return keys


def _restore_environ(name: str, value: str | None) -> None:
    """Set the environment variable ``name`` back to ``value`` (None: unset)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _token_record(target: str | None) -> dict:
    """The token file's record of the broker of the name ``target`` ({} for an address, or
    when there is none to read)."""
    if target is None or paths.is_address(target):
        return {}
    try:
        return paths.read_token_file(paths.check_name(target)) or {}
    except ValueError:  # not a name, or not a token file: the connection says what is wrong
        return {}


def _json_keys(value: Any) -> Any:
    """JSON objects need str keys: str keys stay, other keys (int, bytes, tuple) become their
    repr(), and a str key that reads as one of those is quoted (``key_label``)."""
    if isinstance(value, dict):
        return {key_label(k): _json_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_keys(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple):
        return list(value)
    return str(value)


def _register_commands() -> None:
    from zchannel.cli.bench import bench
    from zchannel.cli.host import clean

    main.add_command(bench)
    main.add_command(clean)
    main.add_command(__import__("zchannel.cli.demo", fromlist=["demo"]).demo)


_register_commands()

if __name__ == "__main__":
    main()
