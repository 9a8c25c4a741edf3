"""The runnable examples of docs/embodied.md (docs/examples/embodied_*.py) and docs/hooks.md
(docs/examples/run_seed_example.py) stay true.

Each example is run as the docs say (``python docs/examples/NAME.py`` from the repository root),
with this test's private run directory, and its printed facts are checked.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(180)


def run_example(name: str) -> str:
    proc = subprocess.run(
        [sys.executable, os.path.join("docs", "examples", name)],
        cwd=REPO,
        env=dict(os.environ),  # ZCHANNEL_RUN_DIR: the run_dir fixture's private directory
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_rollout_example():
    out = run_example("embodied_rollout.py").splitlines()
    assert len(out) == 2
    for rank, line in enumerate(out):
        # N=3 chunks x 4 envs x D=6; boundary rows N+1 = 4; chunk-level advantages [N, W, 1]
        assert line == (
            f"actor:{rank}: 1 trajectory, actions (3, 4, 6), dones (4, 4, 2), "
            "prev_values (4, 4, 1), advantages (3, 4, 1), loss_mask (3, 4, 1)"
        )


def test_pipeline_example():
    out = run_example("embodied_pipeline.py").splitlines()
    assert len(out) == 2
    for rank, line in enumerate(out):
        assert line.startswith(
            f"actor:{rank}: 4 micro-batches (epoch, index) [(0, 0), (0, 1), (1, 0), (1, 1)]; "
        )
        keys = re.search(r"keys \[(.*)\];", line).group(1)
        for key in ("'actions'", "'advantages'", "'forward_inputs::action'", "'loss_mask'"):
            assert key in keys
        assert "'returns'" not in keys  # grpo has no returns
        assert line.endswith("advantages (4, 1)")


def test_lerobot_example():
    out = run_example("embodied_lerobot.py").splitlines()
    assert [line.split(", task")[0] for line in out] == [
        "step 0: episode 0 of 4 frames, success True",  # env 0: 2 chunks x 2 actions
        "step 1: episode 1 of 8 frames, success True",  # env 1: spans both training steps
    ]
    for line in out:
        for key in ("'observation.state'", "'observation.images.main'", "'action'",
                    "'next.done'", "'timestamp'", "'episode_index'"):
            assert key in line


def test_seed_example_finds_its_hooks_without_pythonpath():
    """``python docs/examples/run_seed_example.py`` (docs/hooks.md) imports ``seed_hooks`` from
    its own folder, and the brokers it starts (children, not forked) do too: they get the
    script's ``sys.path``, with no ``PYTHONPATH`` naming that folder."""
    examples = os.path.join(REPO, "docs", "examples")
    env = {k: v for k, v in os.environ.items() if k != "ZCHANNEL_BROKER_FORKSERVER"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and os.path.abspath(p) != examples)
    proc = subprocess.run([sys.executable, os.path.join("docs", "examples", "run_seed_example.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dealt = "{'actor:0': ['s0', 's3'], 'actor:1': ['s1', 's4'], 'actor:2': ['s2', 's5']}"
    assert proc.stdout.splitlines() == [f"built-ins: {dealt}", f"seed classes: {dealt}"]


def test_readme_and_docs_are_self_contained():
    """README.md and docs/ link only to files of this repository, and cite no '§' of files a
    user does not have."""
    for page in _pages():
        text = open(page, encoding="utf-8").read()
        name = os.path.relpath(page, REPO)
        assert "§" not in text, name
        assert "shared/spec" not in text and "../shared" not in text, name
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            assert not re.match(r"[a-z]+://", target), f"{name} links outside the repo: {target}"
            path = target.split("#", 1)[0]
            if path:
                resolved = os.path.normpath(os.path.join(os.path.dirname(page), path))
                assert resolved.startswith(REPO + os.sep), f"{name}: {target} leaves the repo"
                assert os.path.exists(resolved), f"{name}: {target} does not exist"


def _pages() -> list[str]:
    """README.md and every page under docs/."""
    pages = [os.path.join(REPO, "README.md")]
    for folder, _, files in os.walk(os.path.join(REPO, "docs")):
        pages += [os.path.join(folder, f) for f in files if f.endswith(".md")]
    return pages


def test_every_test_the_docs_cite_exists():
    """A promise names its test as ``tests/FILE.py::NAME``: that file defines that test (a
    renamed or moved test leaves no citation pointing nowhere)."""
    defined: dict[str, set[str]] = {}
    cited = 0
    for page in _pages():
        text = open(page, encoding="utf-8").read()
        for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", text):
            where = os.path.join(REPO, path)
            assert os.path.exists(where), f"{os.path.relpath(page, REPO)} cites {path}"
            if path not in defined:
                tree = ast.parse(open(where, encoding="utf-8").read())
                defined[path] = {node.name for node in ast.walk(tree) if isinstance(
                    node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            assert name in defined[path], f"{os.path.relpath(page, REPO)} cites {path}::{name}"
            cited += 1
    assert cited > 50  # the guarantees page alone cites more


def test_custom_policy_example():
    out = run_example("embodied_custom_policy.py")
    assert "trained 3 steps over brokers; policy versions [1, 2, 3]" in out
