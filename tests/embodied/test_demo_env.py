"""``zchannel demo embodied --env gym:<id>``: any Gymnasium id with ``--env-kwargs``, a plot and
a JSON file it says it wrote, and bad input refused before anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("gymnasium")

from click.testing import CliRunner  # noqa: E402
from zchannel.cli.main import main as cli  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TOY = "gym:zchannel.embodied.toyenvs:SpacesToy-v0"


def _demo(*args: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zchannel.cli.main", "demo", "embodied", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)


def test_demo_trains_on_a_gymnasium_id_with_env_kwargs(tmp_path):
    pytest.importorskip("matplotlib")
    proc = _demo("--env", TOY, "--env-kwargs", '{"action": "multi_binary", "obs": "dict"}',
                 "--env-batch", "4", "--steps", "2", "--json", "run.json", "--plot", "run.png",
                 tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {tmp_path / 'run.json'} (config, one record per step, evaluation)" in proc.stdout
    assert f"wrote {tmp_path / 'run.png'} (learning curve: mean return per step)" in proc.stdout
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["config"]["env_kwargs"] == {"action": "multi_binary", "obs": "dict"}
    assert [r["step"] for r in data["steps"]] == [0, 1]
    # every finished episode (8 steps each: 128 steps x 4 envs / 8 = 64 per training step)
    assert len(data["episodes"]) == sum(len(r["returns"]) for r in data["steps"]) == 128
    assert os.path.getsize(tmp_path / "run.png") > 1000


@pytest.mark.parametrize("args,match", [
    (["--env", "gym:NoSuchEnv-v0"], "forms that work"),
    (["--env", "gym:no_such_module:NoSuchEnv-v0"], "forms that work"),  # the import fails
    (["--env", TOY, "--env-kwargs", "{not json"], "--env-kwargs.*not JSON"),
    (["--env", TOY, "--env-kwargs", '{"action": "teleport"}'], "SpacesToy: action in"),
])
def test_demo_refuses_bad_env_input_before_starting(args, match, tmp_path):
    proc = _demo(*args, "--steps", "1", tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert re.search(match, proc.stderr), proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--envs", "3", "--env-batch", "1", "--actors", "2"],
     "--env-batch 1 must be a multiple of --actors 2: each env worker's envs are split evenly "
     "among the actors"),
    (["--envs", "2", "--env-batch", "3", "--actors", "4"],
     "--env-batch 3 must be a multiple of 2 (--actors 4 / gcd(--envs 2, --actors 4))"),
    (["--mode", "pipeline", "--envs", "1", "--env-batch", "3", "--actors", "2"],
     "--envs 1 x --env-batch 3 = 3 envs cannot be split evenly among --actors 2"),
])
def test_envs_that_cannot_be_split_among_the_actors_are_named_in_the_demos_options(args,
                                                                                   message):
    """A usage error in the options the user gave (it named ``TrajectoryPlan.source_batch_size``
    and ``shards_per_source``, which a demo user never set)."""
    result = CliRunner().invoke(cli, ["demo", "embodied", *args, "--steps", "1", "--quiet"])
    assert result.exit_code == 2, result.output
    assert message in result.output and "TrajectoryPlan" not in result.output, result.output


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_sigterm_to_the_demo_stops_it_as_ctrl_c_does(tmp_path, sig):
    """SIGTERM (``timeout``, ``kill``, a cluster's scheduler) and SIGHUP (its terminal closed)
    end a run as Ctrl-C does: workers stopped quietly, exit 1 ("Aborted!"), and a LeRobot
    dataset being written leaves nothing behind, not even its hidden staging directory."""
    pytest.importorskip("pyarrow")
    proc = subprocess.Popen(
        [sys.executable, "-m", "zchannel.cli.main", "demo", "embodied", "--mode", "lerobot",
         "--dataset", "out", "--steps", "1000"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # a step's row: the run is under way, the dataset staged
            if re.match(r"\s+0\s", line):
                break
        else:
            pytest.fail(f"the demo printed no step: {proc.stderr.read()}")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    assert "Aborted!" in err and "Traceback" not in err, err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def _spawned_children(pid: int) -> list[int]:
    """The PIDs of ``pid``'s children that are multiprocessing spawn workers."""
    out = []
    for child in open(f"/proc/{pid}/task/{pid}/children").read().split():
        try:
            cmdline = open(f"/proc/{child}/cmdline", "rb").read()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline:
            out.append(int(child))
    return out


def _loading_torch(pid: int) -> bool:
    """Whether process ``pid`` has mapped torch's library (it is importing torch, or did)."""
    try:
        return "libtorch" in open(f"/proc/{pid}/maps").read()
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_ctrl_c_while_the_workers_start_is_quiet(tmp_path):
    """Ctrl-C reaches the whole process group: workers still importing (torch takes seconds)
    printed a KeyboardInterrupt traceback each.  They are spawned with SIGINT held, and take
    it once they run: exit 1, "Aborted!", no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "zchannel.cli.main", "demo", "embodied", "--runner", "async",
         "--steps", "1000"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not any(_loading_torch(child) for child in _spawned_children(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "no worker started"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does, mid-import
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err
    assert "Aborted!" in err and "Traceback" not in err, err
