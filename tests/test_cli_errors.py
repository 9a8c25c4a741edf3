"""Every ``zchannel`` command turns an expected failure into one line on stderr and exit
status 2, and the CLI refuses what the Python API refuses."""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import sys
import sysconfig

import pytest
from click.testing import CliRunner
from zchannel.broker import Channel
from zchannel.cli.main import main as cli

pytestmark = pytest.mark.timeout(90)


def _zchannel(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "zchannel.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout)


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and "Traceback" not in stderr
    return lines[0]


def test_busy_tcp_address_is_one_line(run_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _zchannel("broker", "busy", "--address", f"tcp://127.0.0.1:{port}")
    assert out.returncode == 2
    assert _one_line(out.stderr) == (
        f"error: cannot bind tcp://127.0.0.1:{port}: Address already in use")


@pytest.mark.parametrize("args, message", [
    (["broker", "neg", "--maxsize", "-1"], "maxsize must be an int >= 0"),
    (["broker", "neg", "--lease-timeout", "0"], "lease_timeout must be a number > 0"),
    (["broker", "neg", "--max-keys", "0"], "max_keys must be an int >= 1"),
    (["broker", "neg", "--shm-threshold", "-5"], "shm_threshold must be an int >= 0"),
    (["broker", "neg", "--maxsize", "many"], "Invalid value for '--maxsize'"),
    (["broker", "neg", "--config", "/nonexistent/broker.toml"],
     "/nonexistent/broker.toml: no such file (configs shipped with zchannel"),
    (["bench", "--payload-size", "12XB"], "Invalid value for '--payload-size': '12XB'"),
    (["broker", "neg", "--collector", "no_such_collector"], "unknown collector 'no_such_collector'"),
    (["broker", "neg", "--collector", "no_such_module_zz:X"],
     "cannot import 'no_such_module_zz:X': No module named 'no_such_module_zz'"),
    (["broker", "neg", "--import", "no_such_module_zz"],
     "cannot import 'no_such_module_zz': No module named 'no_such_module_zz'"),
    (["broker", "neg", "--address", "tcp://127.0.0.1:99999"], "port 99999"),
    (["broker", "neg", "--address", "tcp://127.0.0.1:-1"], "port -1"),
    (["broker", "neg", "--dispatcher", "zchannel.hooks.builtin:Nope"],
     "cannot import 'zchannel.hooks.builtin:Nope': 'zchannel.hooks.builtin' has no attribute 'Nope'"),
    (["broker", "neg", "--consumers", "actor"], "expected group:count or group:rank"),
    (["broker", "bad/name"], "invalid channel name 'bad/name'"),
    (["stat", "nothing-here"], "no channel named 'nothing-here' on this host"),
    (["stat", "--timeout", "-1"], "Invalid value for '--timeout'"),
    (["stat", "x", "--curve-secret-key", "/nonexistent/client.key_secret",
      "--curve-server-key", "/nonexistent/broker.key"],
     "cannot read the client's CURVE key pair from /nonexistent/client.key_secret: no such file"),
    (["stat", "x", "--curve-secret-key", "/nonexistent/client.key_secret"],
     "cannot read the client's CURVE key pair from /nonexistent/client.key_secret: no such file"),
    (["stat", "x", "--curve-server-key", "/nonexistent/broker.key"],
     "--curve-server-key (ZCHANNEL_CURVE_SERVER_KEY) needs this client's key pair"),
    (["no-such-command"], "No such command 'no-such-command'"),
    (["bench", "--json", "/nonexistent/dir/x.json"], "directory /nonexistent/dir does not exist"),
    (["demo", "embodied", "--json", "/nonexistent/dir/x.json"],
     "directory /nonexistent/dir does not exist"),
])
def test_expected_failures_are_one_line_and_status_2(args, message):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0]


def test_cli_refuses_what_the_api_refuses():
    with pytest.raises(ValueError, match="maxsize must be an int >= 0") as api:
        Channel.create("neg", maxsize=-1)
    out = _zchannel("broker", "neg", "--maxsize", "-1")
    assert out.returncode == 2
    line = _one_line(out.stderr)
    assert str(api.value).split(",")[0] in line  # "maxsize must be an int >= 0" in both


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "30"])
def test_create_checks_lease_timeout_as_the_cli_does(local, value):
    with pytest.raises(ValueError, match="lease_timeout must be a number > 0"):
        Channel.create("badlease", lease_timeout=value, local=local)


def test_a_hook_path_that_does_not_resolve_is_a_value_error_from_create(channels):
    for spec, message in (("no_such_module_zz:X", "No module named 'no_such_module_zz'"),
                          ("zchannel.hooks.builtin:Nope", "has no attribute 'Nope'")):
        for local in (False, True):
            with pytest.raises(ValueError, match=message):
                channels.append(Channel.create("badpath", collector=spec, local=local))


def test_keygen_keeps_a_pair_that_exists_unless_forced(tmp_path):
    keys = str(tmp_path / "keys")
    assert CliRunner().invoke(cli, ["keygen", keys]).exit_code == 0
    secret = (tmp_path / "keys" / "broker.key_secret").read_bytes()
    again = CliRunner().invoke(cli, ["keygen", keys])
    assert again.exit_code == 2 and "broker.key exists" in again.output and "--force" in again.output
    assert (tmp_path / "keys" / "broker.key_secret").read_bytes() == secret
    assert CliRunner().invoke(cli, ["keygen", keys, "--force"]).exit_code == 0
    assert (tmp_path / "keys" / "broker.key_secret").read_bytes() != secret


def test_an_open_bind_names_the_remedy_of_the_interface_used():
    """The Python API names its arguments, the command its flags, never the other's."""
    with pytest.raises(ValueError, match="without CURVE keys") as api:
        Channel.create("open", address="tcp://0.0.0.0:0")
    assert "insecure=True" in str(api.value) and "--" not in str(api.value)
    result = CliRunner().invoke(cli, ["broker", "open", "--address", "tcp://0.0.0.0:0"])
    assert result.exit_code == 2, result.output
    assert "or --insecure on a trusted network" in result.output
    assert "insecure=True" not in result.output and "curve_keys" not in result.output


def test_config_file_values_are_checked_too(tmp_path):
    config = tmp_path / "broker.toml"
    config.write_text('[channel]\nname = "fromfile"\nmaxsize = -3\n')
    out = _zchannel("broker", "--config", str(config))
    assert out.returncode == 2
    assert f"{config}: maxsize must be an int >= 0" in _one_line(out.stderr)
    out = _zchannel("broker", "--config", str(config), "--maxsize", "-4")  # the flag's value
    assert out.returncode == 2
    assert _one_line(out.stderr).startswith("error: maxsize must be an int >= 0")
    config.write_text('[channel]\nname = "fromfile"\n\n[bench]\nmessages = 10\n')
    out = _zchannel("broker", "--config", str(config))
    assert out.returncode == 2 and "ready" not in out.stdout
    assert f"{config}: unknown table(s) ['bench']" in _one_line(out.stderr)
    config.write_text("[channel\n")
    out = _zchannel("broker", "--config", str(config))
    assert out.returncode == 2
    assert f"{config} is not valid TOML" in _one_line(out.stderr)


BENCH_CONFIGS = [
    ('scenario = "nope"', "scenario = 'nope' in [bench] of"),
    ("messages = -5", "messages = -5 in [bench] of"),
    ('window = "wide"', "window = 'wide' in [bench] of"),
    ("bench = 3", "must be a table"),
    ("[bench", "is not valid TOML"),
    ("messages = 1.9", "messages = 1.9 in [bench] of"),  # not cast to 1
    ("window = true", "window = True in [bench] of"),
    ('json = "/nonexistent/dir/x.json"', "directory /nonexistent/dir does not exist"),
    ("[bnch]\nmessages = 10", "unknown table(s) ['bnch']"),  # a typo, not the default suite
]


@pytest.mark.parametrize("text,message", BENCH_CONFIGS, ids=[b[0] for b in BENCH_CONFIGS])
def test_bench_config_values_are_checked_as_the_options_are(tmp_path, text, message):
    """A ``[bench]`` value gets the checks of its command-line option (type, choices, range):
    one line naming the key and the file, status 2, nothing run."""
    config = tmp_path / "bench.toml"
    config.write_text(text if text.startswith(("[", "bench")) else f"[bench]\n{text}\n")
    out = _zchannel("bench", "--config", str(config), "--baseline", "none", "--repeat", "1")
    assert out.returncode == 2, out.stderr
    line = _one_line(out.stderr)
    assert message in line and (str(config) in line or "table" in line), line


WRONG_TYPES = [
    ('insecure = "false"\naddress = "tcp://0.0.0.0:0"', "insecure must be true or false"),
    ('direct = "no"', "direct must be true or false"),
    ("curve_secret_key = 5", "curve_secret_key must be a str"),
    ("token_file = 3", "token_file must be a str"),
    ("address = 5", "address must be a str"),
    ('max_rank = "x"', "max_rank must be an int"),
    ("metrics_address = 5", "metrics_address must be a str"),
    ("[hooks]\nproducers = \"rollout\"", "producers must be a list of str"),
    ("[hooks]\nimports = \"json\"", "imports must be a list"),
    ("[hooks]\nconsumers = 3", "consumers must be a list of consumer ids"),
    ("[hooks]\ncollector = 5", "broker.toml: collector must be a hook name"),
    ("[hooks]\ndispatcher = [\"round_robin\"]", "broker.toml: dispatcher must be a hook name"),
    ("[hooks]\ndispatcher = \"round_robin\"\nconsumers = [\"actor\"]",
     "broker.toml: consumers must be a list of consumer ids ('group:rank'"),
]


@pytest.mark.parametrize("lines,message", WRONG_TYPES, ids=[w[1] for w in WRONG_TYPES])
def test_config_file_values_of_the_wrong_type_are_named(run_dir, tmp_path, lines, message):
    """A value of another type names its key (a string "false" used to count as true, a
    number as a file descriptor to open), and no broker starts."""
    config = tmp_path / "broker.toml"
    config.write_text(f'[channel]\nname = "typed"\n{lines}\n')
    out = _zchannel("broker", "--config", str(config))
    assert out.returncode == 2 and "ready" not in out.stdout
    assert message in _one_line(out.stderr)


@pytest.mark.parametrize("table", ["channel = 3", "hooks = \"x\"", "options = 3"])
def test_a_config_table_that_is_not_a_table_is_named(tmp_path, table):
    config = tmp_path / "broker.toml"
    config.write_text(f"{table}\n")
    out = _zchannel("broker", "typed", "--config", str(config))
    assert out.returncode == 2 and "must be a table" in _one_line(out.stderr)


def test_second_broker_of_a_name_is_one_line(run_dir):
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "twice"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("ready ")
        out = _zchannel("broker", "twice")
        assert out.returncode == 2
        assert _one_line(out.stderr) == (  # where the running one is: its pid and address
            f"error: a broker already serves channel 'twice' on this host (pid {proc.pid}, at "
            f"{ready.split()[1]}); stop it, or choose another name (zchannel stat lists this "
            "host's brokers)")
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def test_second_broker_names_the_broker_create_started(run_dir):
    """The pid named is the broker's own, not that of the process whose create() started it
    (and took the lock for it)."""
    with Channel.create("spawned") as ch:
        pid = ch.stats()["pid"]
        assert pid != os.getpid()
        out = _zchannel("broker", "spawned")
        assert out.returncode == 2
        assert f"(pid {pid}, at {ch.address})" in _one_line(out.stderr)


def test_help_and_debug_tracebacks(monkeypatch):
    runner = CliRunner()
    result = runner.invoke(cli, [])  # no command: click's help, not an error line
    assert "Usage: " in result.output and "Commands:" in result.output
    monkeypatch.setenv("ZCHANNEL_DEBUG", "1")
    result = runner.invoke(cli, ["broker", "neg", "--maxsize", "-1"])
    assert isinstance(result.exception, ValueError)  # raised, for the traceback
    assert "maxsize must be an int >= 0" in str(result.exception)


@pytest.mark.parametrize("args,message", [
    (["broker", "nojournal", "--fsync", "always"], "--fsync set(s) the journal: give --journal DIR"),
    (["broker", "nojournal", "--max-journal-bytes", "100"], "--max-journal-bytes set(s) the journal"),
    (["broker", "halfcurve", "--curve-public-keys", "."], "curve_public_keys (the clients' keys let "
                                                          "in) needs the broker's own key pair"),
    (["bench", "--scenario", "get_only", "--plot", "."], "--plot draws the scaling curves"),
    (["broker", "nometrics", "--metrics-address", "0.0.0.0"],
     "--metrics-address sets the metrics endpoint: give --metrics-port PORT too"),
    (["stat", "somechannel", "--count", "3"], "--count does nothing without --watch"),
    (["stat", "somechannel", "-n", "3"], "-n does nothing without --peek"),
    (["stat", "somechannel", "--consumer", "actor:0"], "--consumer does nothing without --peek"),
    (["demo", "embodied", "--ray-nodes", "3", "--steps", "1"],
     "--ray-nodes does nothing without --ray"),
    (["demo", "embodied", "--overwrite", "--steps", "1"],
     "--overwrite does nothing without --dataset"),
    (["demo", "embodied", "--fps", "5", "--steps", "1"],
     "--dataset, --only-success and --fps need --mode lerobot"),
], ids=["fsync", "max-journal-bytes", "public-keys", "plot", "metrics-address", "stat-count",
        "stat-n", "stat-consumer", "ray-nodes", "overwrite", "fps"])
def test_options_that_would_do_nothing_are_refused(run_dir, args, message):
    """An option whose companion is missing would be silently ignored: it is one line naming
    what to add, status 2, and nothing starts."""
    out = _zchannel(*args)
    assert out.returncode == 2 and "ready" not in out.stdout
    assert message in _one_line(out.stderr)


@pytest.mark.parametrize("value", ["=3", " =3", "x"])
def test_a_hook_option_needs_a_key(run_dir, value):
    """``--option KEY=VALUE`` without a key (``=3``) or without ``=`` is one line naming
    ``--option``, status 2, and no broker starts."""
    out = _zchannel("broker", "optkey", "--option", value)
    assert out.returncode == 2 and "ready" not in out.stdout
    assert "--option" in _one_line(out.stderr) and "expected key=value" in out.stderr


# runs the zchannel command in a Python where ``import matplotlib`` fails (the plot extra missing)
_WITHOUT_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'zchannel'; "
                       "from zchannel.cli.main import main; main()")


def test_bench_plot_without_matplotlib_is_refused_before_the_run(tmp_path):
    """``bench --scenario scaling --plot DIR`` needs matplotlib: without it the command stops
    at once with the line ``demo embodied --plot`` gives, not after minutes of measuring."""
    out = subprocess.run([sys.executable, "-c", _WITHOUT_MATPLOTLIB, "bench", "--scenario",
                          "scaling", "--plot", str(tmp_path / "plots")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert _one_line(out.stderr) == (
        "error: --plot needs matplotlib; install the extra: pip install 'zchannel[plot]' "
        "(see 'zchannel bench --help')")
    assert not out.stdout and not (tmp_path / "plots").exists()


# the same for the baselines' extras: Ray's package and Redis's client missing
_WITHOUT_RAY_AND_REDIS = ("import sys; sys.modules['ray'] = sys.modules['redis'] = None; "
                          "sys.argv[0] = 'zchannel'; from zchannel.cli.main import main; main()")


@pytest.mark.parametrize("kind, extra", [("ray", "ray"), ("redis", "redis"),
                                         ("redis-mem.single", "redis")])
def test_bench_baseline_that_cannot_run_here_is_refused_before_the_run(kind, extra):
    """``bench --baseline ray|redis...`` without its extra stops at once with one line naming
    the extra, instead of measuring every case and skipping the baseline asked for."""
    out = subprocess.run([sys.executable, "-c", _WITHOUT_RAY_AND_REDIS, "bench", "--baseline",
                          kind], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    line = _one_line(out.stderr)
    assert line.startswith(f"error: --baseline {kind} cannot run here: "), line
    assert f"pip install 'zchannel[{extra}]'" in line and not out.stdout


def test_companion_settings_in_a_config_file_are_refused_too(run_dir, tmp_path):
    """``fsync`` in a config file without a journal would start a broker that is not durable."""
    config = tmp_path / "broker.toml"
    config.write_text('[channel]\nfsync = "always"\n')
    out = _zchannel("broker", "nojournal", "--config", str(config))
    assert out.returncode == 2 and "ready" not in out.stdout
    assert f"fsync in {config} set(s) the journal: give --journal DIR" in _one_line(out.stderr)


CLUSTER_FILES = [
    ('[cluster]\ninsecure = "false"\n', "[cluster] insecure is true or false, not 'false'"),
    ("cluster = 5\n", "[cluster] must be a table"),
    ("", "hostnames must be a list of str"),
]


@pytest.mark.parametrize("head,message", CLUSTER_FILES, ids=["insecure", "table", "hostnames"])
def test_cluster_file_values_of_the_wrong_type_are_named(run_dir, tmp_path, head, message):
    """A string "false" counted as true (and skipped the refusal to bind a non-loopback
    address without CURVE); a ``hostnames`` string was split into its characters."""
    path = tmp_path / "cluster.toml"
    row = '[[replica]]\nnode = "a"\naddress = "tcp://10.0.0.1:5555"\n'
    path.write_text(head + row + ("" if head else 'hostnames = "localhost"\n'))
    out = _zchannel("broker", "cl", "--cluster", str(path), "--replica", "0")
    assert out.returncode == 2 and "ready" not in out.stdout
    line = _one_line(out.stderr)
    assert message in line and str(path) in line


def test_consumer_groups_given_twice_are_counts_each(run_dir):
    """``--consumers actor:3 --consumers critic:2`` declares actor:0-2 and critic:0-1 (it used
    to declare the two ids actor:3 and critic:2); counts and id lists do not mix."""
    proc = subprocess.Popen([sys.executable, "-m", "zchannel.cli.main", "broker", "groups",
                             "--collector", "flatten_batch", "--dispatcher", "round_robin",
                             "--consumers", "actor:3", "--consumers", "critic:2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("ready ")
        ch = Channel.connect("groups")
        try:
            assert sorted(ch.stats()["consumers"]) == [
                "actor:0", "actor:1", "actor:2", "critic:0", "critic:1"]
        finally:
            ch.close()
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
    out = _zchannel("broker", "mixed", "--consumers", "actor:3", "--consumers", "a:0,a:1")
    assert out.returncode == 2 and "not both" in _one_line(out.stderr)


def test_bench_against_an_address_without_a_broker_is_status_2():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = _zchannel("bench", "--address", f"tcp://127.0.0.1:{port}", "--messages", "10",
                    "--repeat", "1", "--baseline", "none")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "items/s" not in out.stdout


def test_a_hook_whose_constructor_fails_is_one_line(run_dir, tmp_path):
    (tmp_path / "badhook.py").write_text(
        "from zchannel.hooks import Collector\n"
        "class C(Collector):\n"
        "    def __init__(self):\n"
        "        raise KeyError('bad init')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", "hk",
                          "--collector", "badhook:C"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 2
    assert "collector badhook:C could not be made: KeyError: 'bad init'" in _one_line(out.stderr)


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    config = tmp_path / "broker.toml"
    config.write_bytes(b"\xff\xfe")
    out = _zchannel("broker", "enc", "--config", str(config))
    assert out.returncode == 2 and f"{config} is not valid TOML" in _one_line(out.stderr)


def test_broker_stop_takes_its_options_before_the_target(run_dir, tmp_path):
    """``Usage: zchannel broker stop [OPTIONS] TARGET``: an option before the target is the
    stop command's (it was taken for a broker of a channel named stop, and refused)."""
    out = _zchannel("broker", "stop", "--timeout", "3", "nosuchchannel")
    assert out.returncode == 2
    assert "no shutdown token for 'nosuchchannel'" in _one_line(out.stderr)
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    out = _zchannel("broker", "stop", "--token-file", str(token), "tcp://127.0.0.1:1")
    assert out.returncode == 2
    assert "no broker at tcp://127.0.0.1:1" in _one_line(out.stderr)


def _console_script() -> str:
    """The installed ``zchannel`` console script (whose ``sys.path[0]`` is its own folder, not
    the directory it runs in, unlike ``python -m zchannel.cli.main``)."""
    path = os.path.join(sysconfig.get_path("scripts"), "zchannel")
    path = path if os.access(path, os.X_OK) else shutil.which("zchannel")
    if path is None:
        pytest.skip("no zchannel console script installed")
    return path


@pytest.mark.parametrize("where", ["options", "config file"])
def test_broker_imports_hook_modules_of_the_working_directory(run_dir, tmp_path, where):
    """``zchannel broker NAME --import cwdhooks --collector cwdhooks:Doubling`` (or a config
    file naming ``cwdhooks:Doubling``) run from the directory holding ``cwdhooks.py`` finds it,
    as ``python script.py`` would; the console script's ``sys.path[0]`` is its ``bin`` folder."""
    (tmp_path / "cwdhooks.py").write_text(
        "from zchannel.hooks import Collector\n"
        "class Doubling(Collector):\n"
        "    def collect(self, item, key):\n"
        "        yield key, item * 2\n")
    args = ["broker", "cwdhk", "--import", "cwdhooks", "--collector", "cwdhooks:Doubling"]
    if where == "config file":
        (tmp_path / "cwdhooks.toml").write_text(
            '[channel]\nname = "cwdhk"\n[hooks]\ncollector = "cwdhooks:Doubling"\n')
        args = ["broker", "--config", "cwdhooks.toml"]
    assert str(tmp_path) not in os.environ.get("PYTHONPATH", "")
    proc = subprocess.Popen([_console_script(), *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # a generous start deadline
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("ready "):
            proc.kill()
            _, err = proc.communicate(timeout=20)
            pytest.fail(f"the broker did not start: {line!r} {err}")
        with Channel.connect("cwdhk") as ch:
            assert ch.stats()["collector"] == "cwdhooks:Doubling"
            ch.put(21)
            assert ch.get(timeout=10) == 42
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def test_the_broker_child_run_by_hand_says_what_it_is():
    """``python -m zchannel.broker`` is the process ``Channel.create`` starts (its settings come
    as msgpack on stdin): ``--help`` says so and names ``zchannel broker``; no settings on
    stdin is one line on stderr and status 2, not a traceback."""
    run = [sys.executable, "-m", "zchannel.broker"]
    helped = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "zchannel broker NAME" in helped.stdout, helped.stderr
    for stdin in (b"", b"hello\n"):
        out = subprocess.run(run, input=stdin, capture_output=True, timeout=60)
        err = out.stderr.decode()
        assert out.returncode == 2 and "Traceback" not in err, err
        assert _one_line(err).startswith("error: no broker settings on stdin"), err


_WITHOUT_PYARROW = ("import sys; sys.modules['pyarrow'] = None; sys.argv[0] = 'zchannel'; "
                    "from zchannel.cli.main import main; main()")


def test_demo_dataset_without_its_extra_is_refused_before_the_run(tmp_path):
    """``demo embodied --mode lerobot --dataset DIR`` without the ``dataset`` extra stops at once
    with one line naming it, before any broker or worker starts (nothing recorded)."""
    out = subprocess.run([sys.executable, "-c", _WITHOUT_PYARROW, "demo", "embodied", "--mode",
                          "lerobot", "--dataset", str(tmp_path / "d"), "--steps", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert _one_line(out.stderr).startswith(
        "error: --dataset needs pyarrow and Pillow; install the extra: "
        "pip install 'zchannel[dataset]'"), out.stderr
    assert "recording" not in out.stdout and not (tmp_path / "d").exists()
