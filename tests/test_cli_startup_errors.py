"""A hook that fails while ``zchannel broker`` starts it (its module does not import, its
constructor or ``setup`` raises or calls ``sys.exit``) is one line on stderr, naming the hook and
the exception, and exit status 2; and the run directory is left empty.  A ``zchannel bench``
config or a cluster file given to ``zchannel broker --config`` names the command it is for; the
help lists the benchmark's baselines."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

MODULES = {
    "hk_dep": "import no_such_dependency_zz\n",
    "hk_syntax": "def broken(:\n",
    "hk_raises": "raise RuntimeError('module init failed')\n",
    "hk_classes": (
        "import sys\n"
        "from zchannel.hooks import Collector, Dispatcher\n"
        "class InitValue(Collector):\n"
        "    def __init__(self):\n"
        "        raise ValueError('refused in init')\n"
        "class InitExit(Collector):\n"
        "    def __init__(self):\n"
        "        sys.exit(3)\n"
        "class SetupRaises(Collector):\n"
        "    def setup(self, ctx):\n"
        "        raise RuntimeError('boom in setup')\n"
        "class SetupExits(Dispatcher):\n"
        "    def setup(self, ctx):\n"
        "        super().setup(ctx)\n"
        "        sys.exit(4)\n"
    ),
}


@pytest.mark.parametrize("args, message", [
    (["--collector", "hk_dep:X"], "cannot import 'hk_dep:X': importing hk_dep raised "
     "ModuleNotFoundError: No module named 'no_such_dependency_zz'"),
    (["--import", "hk_syntax"], "cannot import 'hk_syntax': importing hk_syntax raised "
     "SyntaxError: invalid syntax"),
    (["--import", "hk_raises"], "cannot import 'hk_raises': importing hk_raises raised "
     "RuntimeError: module init failed"),
    (["--collector", "hk_classes:InitValue"],
     "collector hk_classes:InitValue could not be made: ValueError: refused in init"),
    (["--collector", "hk_classes:InitExit"],
     "collector hk_classes:InitExit could not be made: SystemExit: 3"),
    (["--collector", "hk_classes:SetupRaises"],
     "collector hk_classes:SetupRaises failed in setup: RuntimeError: boom in setup"),
    (["--dispatcher", "hk_classes:SetupExits"],
     "dispatcher hk_classes:SetupExits failed in setup: SystemExit: 4"),
])
def test_a_hook_that_fails_to_start_is_one_line_naming_it(run_dir, tmp_path, args, message):
    for name, text in MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", "hkstart", *args],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"error: {message}"), lines[0]
    assert os.listdir(run_dir) == []  # the lock and files of the failed start are given back


@pytest.mark.parametrize("config, hint", [
    ("configs/bench_quick.toml", "unknown table(s) ['bench']: this looks like a `zchannel bench "
     "--config` file"),
    ("configs/cluster_example.toml", "unknown table(s) ['cluster', 'replica']: this looks like a "
     "cluster file: use `zchannel broker --cluster FILE --replica I`"),
])
def test_a_bench_or_cluster_file_given_to_broker_config_names_its_command(run_dir, config, hint):
    out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", "broker", "--config", config],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "ready" not in out.stdout, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(hint), lines


def test_the_help_lists_the_redis_baselines():
    for args in (["--help"], ["bench", "--help"]):
        out = subprocess.run([sys.executable, "-m", "zchannel.cli.main", *args],
                             capture_output=True, text=True, timeout=60)
        line = next(li for li in out.stdout.splitlines() if "Benchmark a" in li)
        assert "Redis" in line and "Ray" in line and "mp" in line, line
