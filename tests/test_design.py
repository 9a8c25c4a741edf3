"""Guards of the package's shape, read from the sources with ``ast``: no process, no
import of zchannel, well under a second.

- the modules of ``zchannel.broker`` (and of ``hooks``, ``embodied``) import each other without a
  circle (imports at the top and inside functions alike);
- no function imports a zchannel module in ``broker/``, ``hooks/`` or ``embodied/`` (function-level
  imports are for optional dependencies such as ray, and for the CLI's lazy subcommands);
- dependencies point one way: ``hooks`` imports nothing of zchannel, ``broker`` only ``hooks``,
  ``embodied`` no ``cli``, and nothing but ``cli`` imports ``cli``;
- the modules of ``zchannel.broker`` live in layer folders and import downward only;
- no file over 800 lines, no class over 300 lines, no function body over 60 lines (their
  branching: ruff's C901, complexity at most 12);
- no unconditional ``import tomllib`` (3.10 is supported: ``broker/host/toml.py``);
- ``broker/wire/`` imports no zmq; no code cites a tracker number.

An import under ``if TYPE_CHECKING:`` (a type for the checker) is no edge of an import circle.

A shape that is still being fixed is listed in a ``_PENDING_*`` set naming who fixes it; an
entry that no longer matches fails its test, so the list cannot outlive the fix.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from functools import cache

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"broker": "zchannel.broker", "hooks": "zchannel.hooks",
            "embodied": "zchannel.embodied", "cli": "zchannel.cli"}  # setup.cfg package_dir
MAX_FILE_LINES = 800
MAX_CLASS_LINES = 300
# a function's body (its docstring left out) at most this long; its branching is capped by
# ruff (mccabe C901, max-complexity 12 in pyproject.toml)
MAX_FUNCTION_LINES = 60

# (importing file, imported module): function-level imports other helpers are removing
_PENDING_FUNCTION_IMPORTS: set[tuple[str, str]] = set()
# files over MAX_FILE_LINES being split
_PENDING_LONG_FILES: set[str] = set()
# functions over MAX_FUNCTION_LINES being split
_PENDING_LONG_FUNCTIONS: set[tuple[str, str]] = set()
# classes over MAX_CLASS_LINES being split
_PENDING_LONG_CLASSES: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    file: str  # path relative to the repository, e.g. "broker/handle/broker_channel.py"
    module: str  # the zchannel module imported, e.g. "zchannel.broker.wire.codec"
    line: int
    in_function: bool
    type_only: bool = False  # under ``if TYPE_CHECKING:`` (read by the type checker, never run)


def _module_name(path: str) -> str:
    folder, _, rest = path.partition("/")
    name = PACKAGES[folder] + "." + rest[: -len(".py")].replace("/", ".")
    return name.removesuffix(".__init__")


@cache
def _files() -> dict[str, str]:
    """Every Python file of the package: relative path -> source."""
    out = {}
    for folder in PACKAGES:
        for root, _dirs, names in os.walk(os.path.join(REPO, folder)):
            for name in names:
                if name.endswith(".py"):
                    full = os.path.join(root, name)
                    with open(full, encoding="utf-8") as f:
                        out[os.path.relpath(full, REPO)] = f.read()
    return dict(sorted(out.items()))


@cache
def _trees() -> dict[str, ast.Module]:
    return {path: ast.parse(src, path) for path, src in _files().items()}


def _modules() -> set[str]:
    return {_module_name(path) for path in _files()}


def _walk(node: ast.AST, in_function: bool = False, type_only: bool = False):
    """(node, inside a function?, under ``if TYPE_CHECKING:``?) for every node under ``node``."""
    for child in ast.iter_child_nodes(node):
        yield child, in_function, type_only
        yield from _walk(child, in_function or isinstance(
            child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
            type_only or _is_type_checking(child))


def _is_type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@cache
def _imports() -> tuple[Import, ...]:
    """Every import of a zchannel module, resolved to the module (``from P import name`` is an
    import of ``P.name`` when that is a module, else of ``P``)."""
    modules = _modules()
    out = []
    for path, tree in _trees().items():
        me = _module_name(path)
        package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
        for node, in_function, type_only in _walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                if target.split(".")[0] == "zchannel":
                    out.append(Import(path, target, node.lineno, in_function, type_only))
    return tuple(out)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _describe(cycle: list[str]) -> str:
    lines = []
    for a, b in zip(cycle, cycle[1:], strict=False):
        where = sorted({f"{i.file}:{i.line}{' (in a function)' if i.in_function else ''}"
                        for i in _imports() if _module_name(i.file) == a and i.module == b})
        lines.append(f"  {a} -> {b}   ({', '.join(where)})")
    return "\n".join(lines)


# -- the helpers themselves -----------------------------------------------------------------------


def test_the_guards_see_the_package():
    """The file walk and the import resolution find what they must (else every guard passes)."""
    assert {"broker/__init__.py", "broker/handle/broker_channel.py", "hooks/__init__.py",
            "embodied/__init__.py", "cli/main.py"} <= set(_files())
    assert _module_name("broker/__init__.py") == "zchannel.broker"
    assert _module_name("broker/handle/broker_channel.py") == "zchannel.broker.handle.broker_channel"
    imported = {(i.file, i.module) for i in _imports()}
    assert ("broker/__init__.py", "zchannel.broker.handle.channel") in imported  # from P import name
    assert ("broker/handle/broker_channel.py", "zchannel.broker.wire.codec") in imported  # from P import module
    assert ("broker/handle/local.py", "zchannel.hooks") in imported
    assert any(i.in_function for i in _imports() if i.file == "cli/main.py")  # lazy subcommands


def test_find_cycle_reports_a_circle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


# -- imports ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("package", ["zchannel.broker", "zchannel.hooks", "zchannel.embodied"])
def test_no_import_circle(package):
    """No circle among the modules of ``package`` (the package's ``__init__`` is one of them),
    through top-level and function-level imports alike: a function-level import hides a circle,
    it does not remove it.  An import under ``if TYPE_CHECKING:`` names a type for the checker
    and never runs: it is no edge (the layer guard still sees it)."""
    graph: dict[str, set[str]] = {}
    for i in _imports():
        if i.type_only:
            continue
        me = _module_name(i.file)
        inside = me.startswith(package) and i.module.startswith(package) and me != i.module
        if inside and (i.file, i.module) not in _PENDING_FUNCTION_IMPORTS:
            graph.setdefault(me, set()).add(i.module)
    assert graph or package == "zchannel.hooks", f"no imports found inside {package}"
    cycle = _find_cycle(graph)
    assert cycle is None, f"import circle in {package}:\n" + _describe(cycle)


def test_no_function_level_import_of_zchannel_outside_cli():
    """Inside ``broker/``, ``hooks/`` and ``embodied/`` every zchannel import is at the top of its
    module (function-level imports are only for optional dependencies, and in ``cli/``)."""
    found = [i for i in _imports() if i.in_function and not i.file.startswith("cli/")]
    unexpected = {f"{i.file}:{i.line} imports {i.module}" for i in found
                  if (i.file, i.module) not in _PENDING_FUNCTION_IMPORTS}
    assert not unexpected, "function-level imports of zchannel modules:\n" + "\n".join(
        sorted(unexpected))
    fixed = _PENDING_FUNCTION_IMPORTS - {(i.file, i.module) for i in found}
    assert not fixed, f"fixed: remove {sorted(fixed)} from _PENDING_FUNCTION_IMPORTS"


def test_dependencies_point_one_way():
    """hooks <- broker <- embodied <- cli: ``hooks`` imports nothing of zchannel, ``broker`` only
    ``hooks``, ``embodied`` anything but ``cli``, and nothing outside ``cli`` imports ``cli``."""
    allowed = {"hooks": {"hooks"}, "broker": {"hooks", "broker"},
               "embodied": {"hooks", "broker", "embodied"},
               "cli": {"hooks", "broker", "embodied", "cli"}}
    wrong = [f"{i.file}:{i.line} imports {i.module}" for i in _imports()
             if i.module.split(".")[1] not in allowed[i.file.split("/")[0]]]
    assert not wrong, "imports against the direction hooks <- broker <- embodied <- cli:\n" + \
        "\n".join(wrong)


# The layers of ``zchannel.broker``, highest first: a module imports modules of its own layer or
# of a lower one, never of a higher one (docs/architecture.md draws them). ``shm`` and ``core`` share
# a floor and import nothing of each other; ``errors`` (the package root) is the bottom.
BROKER_LAYERS = {
    "handle": 10, "server": 9, "journal": 8, "cluster": 7, "connection": 6, "shm": 5, "core": 5,
    "transport": 4, "wire": 3, "host": 2, "": 1,
}


def _broker_layer(module: str) -> str:
    """The layer folder of a ``zchannel.broker`` module ("" for the package root)."""
    rest = module.removeprefix("zchannel.broker").lstrip(".")
    head = rest.split(".")[0]
    return head if head in BROKER_LAYERS and head else ""


def test_every_broker_module_is_in_a_layer():
    """Every module of ``zchannel.broker`` lives in a layer folder, but the package's face
    (``__init__``, ``__main__``) and its vocabulary of errors."""
    loose = sorted(p for p in _files() if p.startswith("broker/") and p.count("/") == 1
                   and p not in ("broker/__init__.py", "broker/__main__.py", "broker/errors.py"))
    assert not loose, f"modules outside a layer folder of broker/: {loose}"
    folders = {p.split("/")[1] for p in _files() if p.startswith("broker/") and p.count("/") == 2}
    assert folders == set(BROKER_LAYERS) - {""}, folders


def test_broker_layers_import_downward_only():
    """A broker module imports its own layer or a lower one (``BROKER_LAYERS``); layers on one
    floor do not import each other. ``broker/__init__`` and ``__main__`` are the top."""
    wrong = []
    for i in _imports():
        me = _module_name(i.file)
        if not (me.startswith("zchannel.broker") and i.module.startswith("zchannel.broker")):
            continue
        if i.file in ("broker/__init__.py", "broker/__main__.py"):
            continue
        mine, theirs = _broker_layer(me), _broker_layer(i.module)
        if mine == theirs:
            continue
        if BROKER_LAYERS[theirs] >= BROKER_LAYERS[mine]:
            wrong.append(f"{i.file}:{i.line} ({mine or 'root'}) imports {i.module} "
                         f"({theirs or 'root'})")
    assert not wrong, "imports against the layers of zchannel.broker:\n" + "\n".join(wrong)


def test_the_layer_guard_sees_a_wrong_import():
    assert _broker_layer("zchannel.broker.wire.codec") == "wire"
    assert _broker_layer("zchannel.broker.errors") == ""
    assert _broker_layer("zchannel.broker") == ""
    assert BROKER_LAYERS[_broker_layer("zchannel.broker.handle.channel")] > \
        BROKER_LAYERS[_broker_layer("zchannel.broker.server.loop")]


def test_no_unconditional_tomllib_import():
    """``tomllib`` is 3.11+; 3.10 is supported, so it is imported only inside a ``try`` that
    falls back (``broker/host/toml.py``: ``tomli``) or under a ``sys.version_info`` test."""

    def guarded(parents: list[ast.AST]) -> bool:
        for node in parents:
            if isinstance(node, ast.Try) and node.handlers:
                return True
            if isinstance(node, ast.If) and "version_info" in ast.unparse(node.test):
                return True
        return False

    def visit(node: ast.AST, parents: list[ast.AST], path: str, out: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                names = [child.module or ""]
            if "tomllib" in names and not guarded(parents + [node]):
                out.append(f"{path}:{child.lineno}")
            visit(child, parents + [node], path, out)

    unguarded: list[str] = []
    for path, tree in _trees().items():
        visit(tree, [], path, unguarded)
    assert not unguarded, ("unconditional `import tomllib` (use `from zchannel.broker.host.toml "
                           "import tomllib`): " + ", ".join(unguarded))


# -- sizes ------------------------------------------------------------------------------------------


def _only_pending_over_cap(long: dict, pending: set, pending_name: str, what: str) -> None:
    """Everything in ``long`` (over its cap) is listed in ``pending``, and nothing listed there
    is under the cap any more (the list shrinks as the code is split)."""
    unexpected = {k: n for k, n in long.items() if k not in pending}
    assert not unexpected, f"{what}: {unexpected}"
    fixed = pending - set(long)
    assert not fixed, f"split: remove {sorted(fixed)} from {pending_name}"


def test_no_file_over_800_lines():
    lengths = {path: len(src.splitlines()) for path, src in _files().items()}
    long = {path: n for path, n in lengths.items() if n > MAX_FILE_LINES}
    _only_pending_over_cap(long, _PENDING_LONG_FILES, "_PENDING_LONG_FILES",
                           f"files over {MAX_FILE_LINES} lines (split by responsibility)")


def test_no_class_over_300_lines():
    long = {}
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    long[(path, node.name)] = n
    _only_pending_over_cap(long, _PENDING_LONG_CLASSES, "_PENDING_LONG_CLASSES",
                           f"classes over {MAX_CLASS_LINES} lines")


def test_the_architecture_walk_names_real_code():
    """docs/architecture.md walks a put through the code: every module it names exists under
    ``broker/``, every ``Class.method`` it names is defined there, and every ``file: function``
    is defined in that file (so the page cannot drift from the code unnoticed)."""
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as f:
        page = f.read()
    trees = {path: tree for path, tree in _trees().items() if path.startswith("broker/")}
    defined: dict[str, set[str]] = {}  # class name -> its methods
    functions: dict[str, set[str]] = {}  # file -> names defined at any depth
    for path, tree in trees.items():
        names = functions.setdefault(path, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, set()).update(
                    n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    missing = []
    for module in set(re.findall(r"`((?:\w+/)*\w+\.py)", page)):
        if module.startswith("tests/"):
            continue
        path = module if module.startswith("broker/") else f"broker/{module}"
        if path not in trees:
            missing.append(module)
    for cls, method in re.findall(r"`([A-Z]\w+)\.(\w+)`", page):
        if method not in defined.get(cls, ()):
            missing.append(f"{cls}.{method}")
    for module, name in re.findall(r"`((?:\w+/)*\w+\.py): (?:\w+\.)?(\w+)`", page):
        path = module if module.startswith("broker/") else f"broker/{module}"
        if name not in functions.get(path, ()):
            missing.append(f"{module}: {name}")
    assert not missing, f"docs/architecture.md names code that does not exist: {sorted(missing)}"


def test_code_says_what_it_does_not_which_ticket_asked():
    """No module or test cites a tracker number (the word issue and a number): the code says
    what it does."""
    cite = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    sources = dict(_files())
    for root, _dirs, names in os.walk(os.path.join(REPO, "tests")):
        for name in names:
            if name.endswith(".py"):
                full = os.path.join(root, name)
                with open(full, encoding="utf-8") as f:
                    sources[os.path.relpath(full, REPO)] = f.read()
    found = [f"{path}:{n}" for path, src in sources.items()
             for n, line in enumerate(src.splitlines(), 1) if cite.search(line)]
    assert not found, f"tracker numbers cited in code: {found}"


def test_the_wire_layer_does_not_import_zmq():
    """``broker/wire/`` is records and values, no sockets: ZeroMQ is the transports' own
    (``broker/transport/sockets.py``)."""
    found = []
    for path, tree in _trees().items():
        if not path.startswith("broker/wire/"):
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path}:{node.lineno}" for n in names if n.split(".")[0] == "zmq"]
    assert not found, f"wire modules importing zmq: {found}"


def test_no_function_over_60_lines():
    """A function that holds several steps is split into them: no body (its docstring left
    out) over ``MAX_FUNCTION_LINES`` lines."""
    long = {}
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if len(body) > 1 and isinstance(body[0], ast.Expr) \
                        and isinstance(body[0].value, ast.Constant) \
                        and isinstance(body[0].value.value, str):
                    body = body[1:]
                n = node.end_lineno - body[0].lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[(path, node.name)] = n
    _only_pending_over_cap(long, _PENDING_LONG_FUNCTIONS, "_PENDING_LONG_FUNCTIONS",
                           f"functions over {MAX_FUNCTION_LINES} lines")

def test_no_class_is_made_of_zchannel_mixins():
    """A class holds its parts (composition) instead of inheriting from several zchannel
    classes that share its attributes: the class cap then counts what a class is, and each part
    gets what it needs through its constructor.  One zchannel base (a subclass) is fine."""
    ours = {node.name for tree in _trees().values() for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef)}
    found = set()
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in ours]
                if len(bases) > 1:
                    found.add((path, node.name))
    assert not found, f"classes made of several zchannel classes: {sorted(found)}"
