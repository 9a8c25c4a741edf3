"""The package as users install it: the wheel holds every package folder and data file, the
default import path needs no extra, and the version is written in one place.

The wheel is built once per run (``python -m build --wheel`` on a copy of the checkout, so the
checkout gets no ``build/`` folder).  ``.ci/run`` goes further: it installs the wheel in a fresh
virtual environment and runs ``tests/smoke_installed.py`` there.
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    return config


def _package_dir() -> dict[str, str]:
    """``setup.cfg``'s ``package_dir``: package name -> folder of the checkout."""
    lines = _setup_cfg().get("options", "package_dir").strip().splitlines()
    return dict((part.strip() for part in line.split("=", 1)) for line in lines)


def _package_folders() -> dict[str, str]:
    """Every folder with an ``__init__.py`` under the mapped folders: package -> folder."""
    out = {}
    for package, folder in _package_dir().items():
        top = os.path.join(REPO, folder)
        for root, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(root, top)
                out[package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"] = root
    return out


def _requirement_name(line: str) -> str:
    return re.split(r"[\s<>=!~;\[]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _requirements(value: str) -> set[str]:
    return {_requirement_name(line) for line in value.splitlines()
            if line.strip() and not line.strip().startswith("#")}


def _extras() -> dict[str, set[str]]:
    section = _setup_cfg()["options.extras_require"]
    return {extra: _requirements(section[extra]) for extra in section}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Iterator[zipfile.ZipFile]:
    """The wheel built from a copy of this checkout, as ``pip install .`` would build it."""
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "src"
    shutil.copytree(REPO, tree, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "site", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"))
    proc = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp / "out"),
                           str(tree)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = (tmp / "out").glob("*.whl")
    with zipfile.ZipFile(built) as whl:
        yield whl


def test_every_package_folder_is_in_the_wheel(wheel):
    """A folder with an ``__init__.py`` that the wheel lacks is an ``import`` that fails for
    every user who installs the package (but not in an editable checkout)."""
    names = set(wheel.namelist())
    packages = _package_folders()
    assert {"zchannel.broker", "zchannel.broker.shm", "zchannel.broker.wire", "zchannel.hooks",
            "zchannel.embodied", "zchannel.cli.bench", "zchannel.configs"} <= set(packages)
    missing = sorted(p for p in packages if f"{p.replace('.', '/')}/__init__.py" not in names)
    assert not missing, f"package folders missing from the wheel: {missing}"
    for package, folder in packages.items():  # and every module of each
        for file in os.listdir(folder):
            if file.endswith(".py"):
                assert f"{package.replace('.', '/')}/{file}" in names, f"{folder}/{file}"


def test_the_wheel_makes_zchannel_a_regular_package(wheel):
    """The wheel holds ``zchannel/__init__.py`` (setup.py writes it): an installed ``zchannel``
    is a regular package, which a folder named ``zchannel`` on ``sys.path`` (a clone of the
    repository) cannot join, and which ``pip uninstall`` removes whole (its RECORD lists it)."""
    names = set(wheel.namelist())
    assert "zchannel/__init__.py" in names
    (record,) = [n for n in names if n.endswith(".dist-info/RECORD")]
    assert "zchannel/__init__.py," in wheel.read(record).decode()
    source = wheel.read("zchannel/__init__.py").decode()
    compile(source, "zchannel/__init__.py", "exec")  # a module, not an empty marker
    assert "zchannel.broker" in source


def test_package_data_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    for package in ("broker", "hooks", "embodied", "cli", "configs"):
        assert f"zchannel/{package}/py.typed" in names
    configs = sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.endswith(".toml"))
    assert configs and all(f"zchannel/configs/{f}" in names for f in configs), configs
    version = _setup_cfg().get("metadata", "version")
    tops = {n.split("/")[0] for n in names}
    assert tops == {"zchannel", f"zchannel-{version}.dist-info"}, f"stray top-level entries: {tops}"


def test_wheel_metadata(wheel):
    """The version of ``setup.cfg``, the ``zchannel`` command, the extras of ``setup.cfg``,
    the licence and the classifiers."""
    version = _setup_cfg().get("metadata", "version")
    meta = wheel.read(f"zchannel-{version}.dist-info/METADATA").decode()
    assert re.search(rf"^Version: {re.escape(version)}$", meta, re.M)
    assert set(re.findall(r"^Provides-Extra: (\S+)$", meta, re.M)) == set(_extras())
    points = wheel.read(f"zchannel-{version}.dist-info/entry_points.txt").decode()
    assert "zchannel = zchannel.cli.main:main" in points
    # the licence: an SPDX expression (PEP 639, no License :: classifier) and its text
    assert re.search(r"^License-Expression: Apache-2\.0$", meta, re.M), meta[:2000]
    assert re.search(r"^License-File: LICENSE$", meta, re.M), meta[:2000]
    (licence,) = [n for n in wheel.namelist()
                  if re.fullmatch(rf"zchannel-{re.escape(version)}\.dist-info/(licenses/)?LICENSE", n)]
    assert "Apache License" in wheel.read(licence).decode()
    assert "Version 2.0, January 2004" in wheel.read(licence).decode()
    classifiers = set(re.findall(r"^Classifier: (.+)$", meta, re.M))
    assert "Typing :: Typed" in classifiers
    floor = re.search(r">=3\.(\d+)", _setup_cfg().get("options", "python_requires"))
    assert floor and f"Programming Language :: Python :: 3.{floor.group(1)}" in classifiers


def test_version_is_written_once():
    """``setup.cfg`` holds the version; the package and ``zchannel --version`` read it from the
    installed distribution's metadata."""
    import zchannel.broker
    from zchannel.cli.main import main

    version = _setup_cfg().get("metadata", "version")
    assert importlib.metadata.version("zchannel") == zchannel.broker.__version__ == version
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and version in result.output, result.output
    for folder in set(_package_dir().values()):  # no second copy of the number in the code
        for root, _dirs, files in os.walk(os.path.join(REPO, folder)):
            for file in files:
                if file.endswith(".py"):
                    with open(os.path.join(root, file), encoding="utf-8") as f:
                        assert f'"{version}"' not in f.read(), os.path.join(root, file)


def test_the_version_has_its_changelog_release():
    """Each release moves the version on: a wheel of new code under an old number would not
    replace an installed older one (pip keeps a wheel whose version is already installed), so
    the version in ``setup.cfg`` is the newest release named in ``CHANGELOG.md``."""
    version = _setup_cfg().get("metadata", "version")
    with open(os.path.join(REPO, "CHANGELOG.md"), encoding="utf-8") as f:
        releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", f.read(), re.M)
    assert releases and releases[0] == version, (version, releases[:3])


def test_each_extra_pulls_only_what_it_needs():
    """An extra names the distributions of its feature, none of the install requirements."""
    required = _requirements(_setup_cfg().get("options", "install_requires"))
    extras = _extras()
    assert {"ray", "metrics", "plot", "gym", "docs", "test"} <= set(extras)
    assert extras["ray"] == {"ray"}
    assert extras["metrics"] == {"prometheus-client"}
    assert extras["plot"] == {"matplotlib"}
    assert extras["gym"] == {"gymnasium"}
    assert extras["docs"] == {"mkdocs", "mkdocs-material", "mkdocstrings-python"}
    for extra, names in extras.items():
        assert not names & required, f"[{extra}] repeats install requirements {names & required}"


# -- the types a user's type checker sees ---------------------------------------------------------

# checked as a user's script against the installed wheel: no error
_TYPED_USE = """\
import importlib.resources

import zchannel.configs
from zchannel.broker import Channel, Work

with Channel.create("typed", maxsize=64) as ch:
    ch.put("s0", key="train", weight=1)
    ch.put("s1", key="train", weight=3, async_op=True).wait()
    ch.put("s2", 1, "train", True).wait()
    items = ch.get_batch(target_weight=4, key="train", timeout=0.1)
    print(len(items), items[0])
    work: Work = ch.get_batch(4, "train", async_op=True)
    work.wait()
    ch.get_batch(4, "train", True).wait()
    got: Work = ch.get("train", async_op=True)
    got.wait()
    ch.get("train", True, 1.0).wait()
    delivery = ch.get("train", timeout=1.0, ack=True)
    print(delivery.item)
    ch.ack(delivery)
    ch.ack(ch.get_nowait("train", ack=True))
print(importlib.resources.files(zchannel.configs))
"""

# every line marked ``# E`` is an error, and no other line
_WRONG_USE = """\
from zchannel.broker import Channel


def run(ch: Channel, flag: bool) -> None:
    ch.put("s0", async_op=False).wait()  # E: a put that waited returns None
    len(ch.get_batch(4, async_op=True))  # E: a Work is no list
    ch.get_batch(4)[0].wait()
    ch.get_batch(4).wait()  # E: the items are a list
    ch.put("s1", async_op=flag).wait()  # E: None when flag is False
    ch.get(async_op=True).items  # E: a Work has no items
    ch.get(ack=True).akc()  # E: a Delivery has no akc
    ch.get_nowait(ack=True).akc()  # E: a Delivery has no akc
"""


# the user's mypy configuration: torch's and numpy's own types (no part of what is checked
# here) are skipped, which halves the run
_USER_MYPY_INI = """\
[mypy]
[mypy-torch,torch.*,numpy,numpy.*]
follow_imports = skip
follow_imports_for_stubs = True
"""


@pytest.mark.timeout(400)  # the wheel's build and a cold mypy run
def test_a_users_type_checker_sees_precise_types(wheel, tmp_path):
    """``put``/``get_batch`` return None / a list when they wait and a ``Work`` with
    ``async_op=True`` (``get`` a ``Work`` too; with ``ack=True`` a ``Delivery``), as mypy sees them on ``Channel.create``'s
    handle from the installed wheel; ``zchannel.configs`` is typed too (its ``py.typed``)."""
    pytest.importorskip("mypy", reason="the test extra is not installed")
    site = tmp_path / "site"
    wheel.extractall(site)
    (tmp_path / "typed_use.py").write_text(_TYPED_USE)
    (tmp_path / "wrong_use.py").write_text(_WRONG_USE)
    (tmp_path / "mypy.ini").write_text(_USER_MYPY_INI)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir",
         str(tmp_path / "cache"), "--no-error-summary", "--show-error-codes",
         "typed_use.py", "wrong_use.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(site), MYPYPATH=""))
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert not [e for e in errors if e.startswith("typed_use.py")], proc.stdout + proc.stderr
    flagged = {int(e.split(":")[1]) for e in errors if e.startswith("wrong_use.py")}
    marked = {n for n, line in enumerate(_WRONG_USE.splitlines(), 1) if "# E" in line}
    assert flagged == marked, proc.stdout + proc.stderr


# -- the default import path ----------------------------------------------------------------------


def _module_files() -> dict[str, str]:
    """zchannel module name -> file, for every module of the checkout's packages."""
    out = {}
    for package, folder in _package_folders().items():
        for file in os.listdir(folder):
            if file.endswith(".py"):
                stem = file[: -len(".py")]
                out[package if stem == "__init__" else f"{package}.{stem}"] = \
                    os.path.join(folder, file)
    return out


def _top_level_imports(path: str, package: str) -> set[str]:
    """Modules imported when ``path`` runs: its imports outside functions (``from P import x``
    as ``P`` and ``P.x``), relative ones resolved against ``package``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(ast.Module(body=child.orelse, type_ignores=[]))
                continue
            if isinstance(child, ast.Try) and any(
                    h.type is not None and "ImportError" in ast.unparse(h.type)
                    for h in child.handlers):
                # ``try: import extra / except ImportError:`` imports without the extra too
                visit(ast.Module(body=child.orelse + child.finalbody, type_ignores=[]))
                for handler in child.handlers:
                    visit(handler)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    return found


# import names that differ from the distribution's name (for extras not installed here)
_IMPORT_NAMES = {"prometheus-client": ["prometheus_client"], "mkdocs-material": ["material"],
                 "mkdocstrings-python": ["mkdocstrings_handlers", "mkdocstrings"],
                 "pytest-timeout": ["pytest_timeout"]}


def _extra_only_imports() -> dict[str, str]:
    """Top-level import name -> extra, for the distributions that only an extra brings (from
    the installed metadata where a distribution is installed, else from its name)."""
    required = _requirements(_setup_cfg().get("options", "install_requires"))
    by_dist = {}
    for extra, names in _extras().items():
        for name in names - required:
            by_dist.setdefault(name, extra)
    out = {}
    for dist, extra in by_dist.items():
        for module in _IMPORT_NAMES.get(dist, [dist.replace("-", "_")]):
            out[module] = extra
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            name = dist.lower().replace("_", "-")
            if name in by_dist and not module.startswith("_"):
                out[module] = by_dist[name]
    return out


def test_the_default_import_path_imports_no_extra():
    """``import zchannel.broker`` / ``.hooks`` / ``.embodied`` and the ``zchannel`` command
    import, module by module, nothing that an extra brings: a minimal install runs them.
    Optional dependencies are imported inside the functions that use them, or at module level
    under ``try: ... except ImportError:``."""
    extra_imports = _extra_only_imports()
    assert {"ray", "prometheus_client", "gymnasium"} <= set(extra_imports), extra_imports
    files = _module_files()
    pending = ["zchannel.broker", "zchannel.hooks", "zchannel.embodied", "zchannel.cli.main"]
    seen: set[str] = set()
    wrong = []
    while pending:
        module = pending.pop()
        if module in seen or module not in files:
            continue
        seen.add(module)
        package = module if files[module].endswith("__init__.py") else module.rpartition(".")[0]
        for name in _top_level_imports(files[module], package):
            top = name.split(".")[0]
            if top in extra_imports:
                wrong.append(f"{module} imports {name} (extra {extra_imports[top]!r})")
            if top == "zchannel":
                parts = name.split(".")
                pending += [".".join(parts[:i]) for i in range(2, len(parts) + 1)]
    assert len(seen) > 50, sorted(seen)  # the walk reached the package's modules
    assert not wrong, "the default import path imports optional extras:\n" + "\n".join(wrong)


# -- the config files shipped as package data ----------------------------------------------------


def test_configs_named_as_in_the_docs_resolve_anywhere(tmp_path, monkeypatch):
    """``--config configs/NAME.toml`` reads the checkout's file in a checkout and the installed
    copy elsewhere; a path that is neither names the shipped configs."""
    from zchannel.broker.host.shipped import resolve, shipped_names

    assert "bench_targets.toml" in shipped_names() and "embodied_rollout.toml" in shipped_names()
    monkeypatch.chdir(REPO)
    assert resolve("configs/embodied_rollout.toml") == "configs/embodied_rollout.toml"
    monkeypatch.chdir(tmp_path)
    found = resolve("configs/embodied_rollout.toml")
    assert os.path.isabs(found) and open(found).read() == open(
        os.path.join(REPO, "configs", "embodied_rollout.toml")).read()
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "embodied_rollout.toml").write_text("[channel]\nname = 'mine'\n")
    assert resolve("configs/embodied_rollout.toml") == "configs/embodied_rollout.toml"  # yours
    with pytest.raises(FileNotFoundError, match=r"nope\.toml: no such file .*bench_quick\.toml"):
        resolve("configs/nope.toml")
    with pytest.raises(FileNotFoundError, match="no such file"):
        resolve("elsewhere/embodied_rollout.toml")


def test_the_cluster_example_named_in_the_environment_resolves_anywhere(tmp_path,
                                                                         monkeypatch):
    """``ZCHANNEL_CLUSTER=configs/cluster_example.toml``, as the file's own header tells
    clients, reads the installed copy outside a checkout (as ``--cluster`` does); a missing
    file that is not a shipped one is the ``ValueError`` naming the variable."""
    from zchannel.broker.cluster.clusterfile import ENV_CLUSTER, load_found

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ENV_CLUSTER, "configs/cluster_example.toml")
    found = load_found("samples")
    assert found is not None and found.name == "samples" and len(found.replicas) == 3
    monkeypatch.setenv(ENV_CLUSTER, "configs/no_such_cluster.toml")
    with pytest.raises(ValueError, match=r"\$ZCHANNEL_CLUSTER names the cluster file "
                                         r"configs/no_such_cluster\.toml"):
        load_found("samples")
