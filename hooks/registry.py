"""Registration and resolution of hooks by name, class, instance or ``"module:ClassName"``."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, TypeVar

from zchannel.hooks.base import Collector, Dispatcher

ENTRY_POINT_GROUP = "zchannel.hooks"

T = TypeVar("T", bound=type)

_registries: dict[type, dict[str, type]] = {Collector: {}, Dispatcher: {}}
_entry_points_loaded = False
# what each entry point of the group loaded, by its (lowercased) name: a module whose import
# registers hooks, or a hook class published under that name
_entry_point_objects: dict[str, Any] = {}
# the entry points of the group that could not be loaded, by (lowercased) name: their
# ``name = target`` and what loading them raised (a lookup of that name reports it)
_entry_point_failures: dict[str, tuple[str, BaseException]] = {}

log = logging.getLogger("zchannel.hooks")


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _register(base: type, name: str) -> Callable[[T], T]:
    if not isinstance(name, str) or not name:
        raise ValueError("a hook name must be a non-empty str")
    lname = name.lower()

    def decorator(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"{cls!r} is not a subclass of {base.__name__}")
        registry = _registries[base]
        taken = registry.get(lname)
        if taken is not None and _qualified(taken) != _qualified(cls):
            raise ValueError(
                f"{base.__name__.lower()} name {lname!r} is already registered to "
                f"{_qualified(taken)}; register {_qualified(cls)} under another name"
            )
        registry[lname] = cls
        cls.hook_name = lname  # type: ignore[attr-defined]  # set on any class registered
        return cls

    return decorator


def register_collector(name: str) -> Callable[[T], T]:
    """Class decorator: register a ``Collector`` subclass under ``name`` (lowercased).

    Registering the same ``module:qualname`` again is a no-op; another class under a taken
    name is a ``ValueError``.
    """
    return _register(Collector, name)


def register_dispatcher(name: str) -> Callable[[T], T]:
    """Class decorator: register a ``Dispatcher`` subclass under ``name`` (lowercased)."""
    return _register(Dispatcher, name)


def registered(base: type) -> dict[str, type]:
    """A copy of the registry of ``base`` (``Collector`` or ``Dispatcher``)."""
    return dict(_registries[base])


def load_entry_points() -> None:
    """Load every entry point of the ``zchannel.hooks`` group (once): import the modules
    published there, take the hook classes.  One that cannot be loaded is logged in one line
    (a lookup of its name says why) and skipped: a broken plug-in must not break every channel."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        _load(ep, quiet=False)


def _load_named(lname: str) -> None:
    """Load the entry points of the group named ``lname`` (case-insensitively), and only those:
    what the others publish is not imported (nor their failures logged) for this name."""
    if _entry_points_loaded or lname in _entry_point_objects or lname in _entry_point_failures:
        return  # loaded (or failed) already, or every entry point was
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name.lower() == lname:
            _load(ep, quiet=True)  # its failure is the lookup's error, not a log line


def _load(ep: EntryPoint, *, quiet: bool) -> None:
    """Load ``ep`` into ``_entry_point_objects`` unless it was loaded, or failed, already; a
    failure (whatever its import raised, ``sys.exit`` too) is kept in ``_entry_point_failures``
    and, unless ``quiet``, logged in one line naming the entry point, its target and the error."""
    lname = ep.name.lower()
    if lname in _entry_point_objects or lname in _entry_point_failures:
        return
    try:
        _entry_point_objects[lname] = ep.load()
    except (Exception, SystemExit) as exc:
        _entry_point_failures[lname] = (f"{ep.name} = {ep.value}", exc)
        if not quiet:
            log.warning("hook entry point %s = %s (group %s) could not be loaded: %s: %s",
                        ep.name, ep.value, ENTRY_POINT_GROUP, type(exc).__name__, exc)


def forget_entry_point_scan() -> None:
    """Scan the ``zchannel.hooks`` group again at the next lookup of a name not registered
    (``sys.path`` changed: other plug-ins may be visible, a broken one may load now); modules
    imported already are not imported again."""
    global _entry_points_loaded
    _entry_points_loaded = False
    _entry_point_failures.clear()


def entry_point_objects() -> dict[str, Any]:
    """What each entry point of the ``zchannel.hooks`` group loaded (a module, a hook class...),
    by its lowercased name; the entry points are loaded first if they were not."""
    load_entry_points()
    return dict(_entry_point_objects)


def import_named(module_name: str, what: str | None = None) -> Any:
    """Import module ``module_name``; a ``ValueError`` naming ``what`` (default: the module)
    when there is no such module, or when importing it raised (a dependency that is missing, a
    ``SyntaxError``, any other exception, ``sys.exit``): it names the exception's type and
    message, and keeps the exception as its ``__cause__``."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name + ".").startswith(exc.name + "."):
            raise ValueError(f"cannot import {what or module_name!r}: No module named "
                             f"{exc.name!r}") from None
        failure: BaseException = exc
    except (Exception, SystemExit) as exc:  # the module's own code failed
        failure = exc
    raise ValueError(f"cannot import {what or module_name!r}: importing {module_name} raised "
                     f"{type(failure).__name__}: {failure}") from failure


def import_path(path: str) -> Any:
    """Import ``"module:qualname"`` and return the object."""
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"expected 'module:ClassName', got {path!r}")
    obj = import_named(module_name, path)
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"cannot import {path!r}: {getattr(obj, '__name__', obj)!r} has "
                             f"no attribute {part!r}") from None
    return obj


def _make(kind: str, cls: type) -> Any:
    """An instance of hook class ``cls``; whatever its constructor raises (a refused option,
    any other exception, ``sys.exit``) as a ``ValueError`` (a ``TypeError`` stays one) naming
    the kind, the class, and the exception's type and message (the CLI prints one line;
    ``ZCHANNEL_DEBUG=1`` and ``__cause__`` keep the traceback)."""
    try:
        return cls()
    except (Exception, SystemExit) as exc:
        raise hook_failure(kind, _qualified(cls), "could not be made", exc) from exc


def hook_failure(kind: str, name: str, doing: str, exc: BaseException) -> Exception:
    """What hook ``name`` (a ``kind``: collector or dispatcher) raised while ``doing`` (being
    made, its ``setup``) as the error ``create`` and ``zchannel broker`` report: a
    ``ValueError`` (a ``TypeError`` stays one) naming the hook and the exception's type and
    message; raise it ``from exc``."""
    error = TypeError if isinstance(exc, TypeError) else ValueError
    return error(f"{kind} {name} {doing}: {type(exc).__name__}: {exc}")


def _resolve(base: type, spec: Any) -> Any:
    kind = base.__name__.lower()
    if isinstance(spec, base):
        return spec
    if isinstance(spec, type):
        if not issubclass(spec, base):
            raise TypeError(f"{spec.__qualname__} is not a {base.__name__} subclass")
        return _make(kind, spec)
    if isinstance(spec, str):
        if ":" in spec:
            obj = import_path(spec)
            return _resolve(base, obj)
        return _resolve_name(base, spec)
    raise TypeError(
        f"a {kind} is given as an instance, a class, 'module:ClassName' or a registered name, "
        f"not {type(spec).__name__}"
    )


def _resolve_name(base: type, name: str) -> Any:
    """An instance of the hook of kind ``base`` named ``name``: registered under it, or
    published under that entry-point name (the entry point of that name is loaded first, alone;
    a ``ValueError`` naming it, its target and the error when it cannot be, the error as its
    ``__cause__``), or registered by some published module (all are loaded then); else a
    ``ValueError`` listing the known names."""
    kind = base.__name__.lower()
    lname = name.lower()
    registry = _registries[base]
    if lname not in registry:
        _load_named(lname)
        failed = _entry_point_failures.get(lname)
        if failed is not None and lname not in registry:
            raise ValueError(f"cannot load {kind} {name!r}: entry point {failed[0]} of group "
                             f"{ENTRY_POINT_GROUP} raised {type(failed[1]).__name__}: "
                             f"{failed[1]}") from failed[1]
        published = _entry_point_objects.get(lname)
        if lname not in registry and isinstance(published, type) and issubclass(published, base):
            return _make(kind, published)  # a hook class published under this entry-point name
    if lname not in registry:
        load_entry_points()  # a module published under another name may register it
    if lname not in registry:
        published = {n for n, obj in _entry_point_objects.items()
                     if isinstance(obj, type) and issubclass(obj, base)}
        known = ", ".join(sorted(set(registry) | published)) or "(none)"
        broken = ", ".join(sorted(_entry_point_failures))
        raise ValueError(f"unknown {kind} {name!r}; known {kind}s: {known}"
                         + (f" (entry points that could not be loaded: {broken})" if broken else ""))
    return _make(kind, registry[lname])


def resolve_collector(spec: Any) -> Collector:
    """Resolve a collector spec; ``None`` gives the pass-through ``Collector``."""
    if spec is None:
        return Collector()
    return _resolve(Collector, spec)


def resolve_dispatcher(spec: Any) -> Dispatcher:
    """Resolve a dispatcher spec; ``None`` gives the shared (non-dealing) ``Dispatcher``."""
    if spec is None:
        return _registries[Dispatcher]["shared"]()
    return _resolve(Dispatcher, spec)


def hook_spec(hook: Any) -> str | None:
    """A string naming ``hook`` that another process can resolve, or None for the defaults.

    Registered classes give their registered name, other classes ``module:qualname``.
    """
    if hook is None:
        return None
    if isinstance(hook, str):
        return hook
    cls = hook if isinstance(hook, type) else type(hook)
    name = getattr(cls, "hook_name", None)
    if name and _registries[Collector if issubclass(cls, Collector) else Dispatcher].get(
        name
    ) is cls:
        return name
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ValueError(
            f"hook class {cls.__qualname__} must be importable in the broker process: define it "
            "in a module (not __main__, not inside a function) or register it by name"
        )
    return _qualified(cls)
