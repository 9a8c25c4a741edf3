"""Smoke test of an installed zchannel: ``python smoke_installed.py`` in a fresh virtual
environment where the wheel was installed (not editable) without extras.

``.ci/run`` copies this file out of the checkout and runs it from a temporary directory, so it
can import only the installed package.  Each check prints one line; the first failure raises
(exit status 1).  The checks:

- the package is imported from this environment's site-packages, and its version is the
  distribution's (``zchannel.broker.__version__``, ``zchannel --version``);
- every module of the installed package imports, except one that needs an optional extra and
  says so (``pip install 'zchannel[EXTRA]'``); ``py.typed`` and the config files are installed;
- the README quickstart on ``ipc://``: ``Channel.create`` starts the broker, a producer process
  puts 100 ``{"step", "obs"}`` items and ``None``, a consumer process takes all 101; then the
  README's ``Channel.create("scratch")`` block prints what the README says;
- a 16 MiB tensor from a producer process arrives intact through same-host shared memory;
- ``zchannel --help``; ``zchannel broker --config configs/NAME.toml`` from the installed
  configs; ``zchannel demo embodied --steps 2 --json FILE``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.resources
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time

DIST = "zchannel"
DEADLINE_S = 300  # for each child process: generous on a loaded 2-core machine

PRODUCER = """
import sys, torch
from zchannel.broker import Channel

ch = Channel.connect(sys.argv[1])
for step in range(100):
    ch.put({"step": step, "obs": torch.randn(64, 3, 84, 84)}, key="train", weight=64)
ch.put(None, key="train")
ch.close()
"""

CONSUMER = """
import sys
from zchannel.broker import Channel

ch = Channel.connect(sys.argv[1])
steps = []
while (batch := ch.get(key="train", timeout=60)) is not None:
    assert tuple(batch["obs"].shape) == (64, 3, 84, 84), batch["obs"].shape
    steps.append(batch["step"])
ch.close()
print(len(steps), steps == list(range(100)))
"""

SCRATCH = """
from zchannel.broker import Channel

with Channel.create("scratch", maxsize=64) as ch:
    ch.put("s0", key="train", weight=1)
    ch.put("s1", key="train", weight=3)
    work = ch.get(key="train", async_op=True)
    print(work.wait())
    print(ch.get_batch(target_weight=4, key="train", timeout=0.1))
"""

TENSOR_PRODUCER = """
import sys, torch
from zchannel.broker import Channel

ch = Channel.connect(sys.argv[1])
ch.put(torch.arange(4 * 1024 * 1024, dtype=torch.float32), key="big")  # 16 MiB
ch.close()
"""


def check(title: str) -> None:
    print(f"ok  {title}", flush=True)


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=DEADLINE_S, **kwargs)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n"
                             f"{proc.stderr}")
    return proc


def python(code: str, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-c", code, *args])


def cli(*args: str) -> subprocess.CompletedProcess:
    script = os.path.join(os.path.dirname(sys.executable), "zchannel")
    return run([script, *args])


def check_installed_here() -> None:
    import zchannel.broker

    purelib = os.path.realpath(sysconfig.get_paths()["purelib"])
    where = os.path.realpath(zchannel.broker.__file__)
    assert where.startswith(purelib + os.sep), f"zchannel.broker from {where}, not {purelib}"
    direct_url = json.loads(importlib.metadata.distribution(DIST).read_text("direct_url.json")
                            or "{}")
    assert not direct_url.get("dir_info", {}).get("editable"), f"an editable install: {direct_url}"
    version = importlib.metadata.version(DIST)
    assert zchannel.broker.__version__ == version, zchannel.broker.__version__
    printed = cli("--version").stdout
    assert version in printed, printed
    check(f"zchannel {version} installed in {purelib} (zchannel --version: {printed.strip()})")


def _installed_modules() -> list[str]:
    """Every module of the distribution, from its RECORD (not from a walk of a source tree)."""
    names = []
    for file in importlib.metadata.distribution(DIST).files or ():
        path = str(file)
        if path.startswith("zchannel/") and path.endswith(".py"):
            names.append(path[: -len(".py")].replace("/", ".").removesuffix(".__init__"))
    return sorted(names)


def check_every_module_imports() -> None:
    extras = set(importlib.metadata.metadata(DIST).get_all("Provides-Extra") or ())
    modules = _installed_modules()
    packages = {str(f.parent).replace("/", ".") for f in importlib.metadata.files(DIST) or ()
                if f.name == "__init__.py"}
    assert {"zchannel.broker", "zchannel.broker.shm", "zchannel.hooks", "zchannel.embodied",
            "zchannel.cli", "zchannel.cli.bench", "zchannel.configs"} <= packages, packages
    needs_extra = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            extra = re.search(r"pip install 'zchannel\[(\w+)\]'", str(exc))
            if extra is None or extra.group(1) not in extras:
                raise AssertionError(f"import {name}: {exc!r}") from exc
            needs_extra[name] = extra.group(1)
    for package in ("zchannel.broker", "zchannel.hooks", "zchannel.embodied", "zchannel.cli"):
        assert importlib.resources.files(package).joinpath("py.typed").is_file(), package
    configs = sorted(p.name for p in importlib.resources.files("zchannel.configs").iterdir()
                     if p.name.endswith(".toml"))
    assert "bench_targets.toml" in configs and "embodied_rollout.toml" in configs, configs
    check(f"{len(modules) - len(needs_extra)} of {len(modules)} modules import without extras "
          f"(needing an extra: {needs_extra or 'none'}); py.typed; configs {configs}")


def check_quickstart() -> None:
    from zchannel.broker import Channel

    name = f"smoke-{os.getpid()}"
    with Channel.create(name, maxsize=64) as ch:
        assert ch.created and ch.address.startswith("ipc://"), (ch.created, ch.address)
        consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, name],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            python(PRODUCER, name)
            out, err = consumer.communicate(timeout=DEADLINE_S)
        finally:
            if consumer.poll() is None:
                consumer.kill()
                consumer.wait()
        assert consumer.returncode == 0, err
        assert out.split() == ["100", "True"], out
        depth = sum(k.get("depth", 0) for k in (ch.stats().get("keys") or {}).values())
        assert depth == 0, ch.stats()
    check(f"quickstart over {ch.address}: a producer process put 101 items, a consumer process "
          "took all of them in order")
    lines = python(SCRATCH).stdout.splitlines()
    assert lines == ["s0", "['s1']"], lines
    check("the README's Channel.create('scratch') block prints s0 and ['s1']")


def check_shared_memory_tensor() -> None:
    import torch
    from zchannel.broker import Channel

    with Channel.create(f"smoke-shm-{os.getpid()}") as ch:
        before = ch.stats()["shm"]["slots_in"]
        python(TENSOR_PRODUCER, ch.name)
        tensor = ch.get(key="big", timeout=60)
        slots = ch.stats()["shm"]["slots_in"] - before
    assert tensor.dtype == torch.float32 and tensor.nbytes == 16 << 20, (tensor.dtype, tensor.nbytes)
    assert torch.equal(tensor, torch.arange(4 * 1024 * 1024, dtype=torch.float32))
    assert slots == 1, f"the 16 MiB tensor took {slots} shared-memory slots, not 1"
    check("a 16 MiB tensor from a producer process arrived intact through shared memory")


def check_cli(workdir: str) -> None:
    helped = cli("--help").stdout
    for command in ("broker", "stat", "bench", "demo", "clean", "keygen"):
        assert re.search(rf"^\s+{command}\b", helped, re.M), f"{command} not in --help:\n{helped}"
    check("zchannel --help lists broker, stat, bench, demo, clean, keygen")
    script = os.path.join(os.path.dirname(sys.executable), "zchannel")
    broker = subprocess.Popen([script, "broker", "--config", "configs/flatten_round_robin.toml"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = broker.stdout.readline()
        assert ready.startswith("ready ipc://"), (ready, broker.stderr.read())
        stat = cli("stat", "samples").stdout
        assert "flatten_batch" in stat and "round_robin" in stat, stat
    finally:
        broker.terminate()
        broker.communicate(timeout=DEADLINE_S)
    assert broker.returncode == 0, broker.returncode
    from zchannel.cli.bench.targets import load_thresholds

    assert {"T1", "T2s", "T9"} <= set(load_thresholds())
    check("zchannel broker --config configs/flatten_round_robin.toml runs the installed config "
          "outside a checkout; the bench thresholds load")
    out = os.path.join(workdir, "demo.json")
    started = time.monotonic()
    demo = cli("demo", "embodied", "--steps", "2", "--json", out)
    assert "trained policy: return" in demo.stdout, demo.stdout
    assert os.path.isfile(out) and out in demo.stdout + demo.stderr, demo.stdout
    check(f"zchannel demo embodied --steps 2 --json FILE ({time.monotonic() - started:.0f} s)")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="zchannel-smoke-") as workdir:
        os.environ["ZCHANNEL_RUN_DIR"] = os.path.join(workdir, "run")
        os.chdir(workdir)
        check_installed_here()
        check_every_module_imports()
        check_quickstart()
        check_shared_memory_tensor()
        check_cli(workdir)
    print("smoke test of the installed package: all checks passed", flush=True)


if __name__ == "__main__":
    main()
