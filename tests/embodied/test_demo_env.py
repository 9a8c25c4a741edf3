"""``zchannel demo embodied --env gym:<id>``: any Gymnasium id with ``--env-kwargs``, a plot and
a JSON file it says it wrote, and bad input refused before anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("gymnasium")
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


def test_sigterm_to_the_demo_stops_it_as_ctrl_c_does(tmp_path):
    """SIGTERM (``timeout``, ``kill``, a cluster's scheduler) ends a run as Ctrl-C does: workers
    stopped quietly, exit 1 ("Aborted!"), and a LeRobot dataset being written leaves nothing
    behind, not even its hidden staging directory."""
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
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    assert "Aborted!" in err and "Traceback" not in err, err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
