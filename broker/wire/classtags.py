"""Classes registered for the wire: dataclasses and Enum classes, each under a tag.

``register_type(cls)`` / ``@serializable`` put a class in the registry of this process, and
``register_module(module)`` every dataclass and Enum class a module defines; the codec
(``broker/wire/codec.py``) sends an instance as its tag plus its fields (a dataclass) or its member
name (an Enum), and rebuilds it from the registry of the receiving process.  Nothing on the wire
names a class to import: a tag this process has not registered is a ``ValueError``.

The modules published under the ``zchannel.hooks`` entry-point group are registered as
``register_module`` registers them, once per process, the first time the process meets a tag or
a dataclass or Enum class it has not registered (:func:`register_published`).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import logging
import pkgutil
import threading
import types
from collections.abc import Mapping
from typing import Any, TypeVar

from zchannel.hooks import entry_point_objects

C = TypeVar("C", bound=type)
TAG_TO_CLS: dict[str, type] = {}
CLS_TO_TAG: dict[type, str] = {}
_log = logging.getLogger("zchannel.types")


def default_tag(cls: type) -> str:
    """The tag a class is registered under unless it is given one: ``"module:qualname"``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def register_type(cls: C, name: str | None = None) -> C:
    """Allow instances of ``cls`` on the wire, tagged ``name`` (default ``"module:qualname"``).

    ``cls`` is a dataclass (an instance travels field by field and is rebuilt with the
    constructor ``@dataclass`` wrote, or restored field by field: :func:`rebuilt_by_constructor`)
    or an ``Enum`` class (a member travels as tag + member name and arrives as the member
    itself; a combination of ``Flag`` members travels as tag + value).  Re-registering the same
    class is a no-op; another class under a taken tag is a ``ValueError``; a dataclass no
    receiver could rebuild is a ``TypeError`` (:func:`check_rebuildable`).
    """
    if not isinstance(cls, type) or not (
        dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)
    ):
        raise TypeError(f"register_type takes a dataclass or an Enum class, not {cls!r}")
    check_rebuildable(cls)
    tag = name or default_tag(cls)
    owner = TAG_TO_CLS.get(tag)
    if owner is not None and owner is not cls and default_tag(owner) != default_tag(cls):
        raise ValueError(f"serializable tag {tag!r} is already registered to {owner!r}")
    TAG_TO_CLS[tag] = cls
    CLS_TO_TAG[cls] = tag
    return cls


def rebuilt_by_constructor(cls: type) -> bool:
    """Whether a receiver rebuilds dataclass ``cls`` by calling it with its ``init`` fields (so
    defaults, ``default_factory`` and ``__post_init__`` run): when its ``__init__`` is the one
    ``@dataclass`` wrote, takes every ``init`` field of ``cls`` and needs nothing else (no
    ``InitVar`` without a default, which is not a field and is never sent).

    Any other dataclass — its own ``__init__``, ``@dataclass(init=False)``, an ``__init__``
    inherited from a base that does not take this class's fields — is restored as ``pickle``
    and ``copy`` restore an object: ``cls.__new__(cls)``, then each sent field set, neither
    ``__init__`` nor ``__post_init__`` run.
    """
    init = cls.__init__  # type: ignore[misc]
    code = getattr(init, "__code__", None)
    # dataclasses compiles the methods it writes from text ("<string>"), inside a function
    # named __create_fn__ (co_qualname: Python 3.11 on)
    if code is None or code.co_filename != "<string>" or not getattr(
        code, "co_qualname", "__create_fn__."
    ).startswith("__create_fn__."):
        return False
    try:
        params = list(inspect.signature(init).parameters.values())[1:]  # (self)
    except (TypeError, ValueError):
        return False
    init_fields = {f.name for f in dataclasses.fields(cls) if f.init}
    required = {p.name for p in params if p.default is inspect.Parameter.empty}
    return init_fields <= {p.name for p in params} and required <= init_fields


def check_rebuildable(cls: type) -> None:
    """``TypeError`` naming ``cls`` and why if it is a dataclass that no receiver could rebuild:
    one restored field by field (:func:`rebuilt_by_constructor`) whose ``__new__`` cannot be
    called with the class alone (``cls.__new__(cls)``)."""
    if not dataclasses.is_dataclass(cls) or cls.__new__ is object.__new__ \
            or rebuilt_by_constructor(cls):
        return
    try:
        inspect.signature(cls.__new__).bind(cls)
    except ValueError:  # no signature to read (a builtin's __new__): cls.__new__(cls) is tried
        return
    except TypeError as exc:
        raise TypeError(
            f"cannot register {cls.__module__}.{cls.__qualname__} for the wire: its __init__ is "
            "not the one @dataclass writes for its fields, so a receiver restores it as pickle "
            f"does, with {cls.__qualname__}.__new__({cls.__qualname__}) and then its fields, but "
            f"its __new__ needs more arguments ({exc}); give those arguments defaults, or let "
            "@dataclass write its __init__"
        ) from None


def registrations() -> list[list[str]]:
    """``[tag, "module:qualname"]`` of each class this process registered that another process
    can import by that path (not ``__main__``'s, not a local class, not zchannel's own): what
    ``Channel.create`` hands the broker it starts, which registers them (``register_paths``)."""
    return [[tag, default_tag(cls)] for cls, tag in CLS_TO_TAG.items()
            if cls.__module__ != "__main__" and "<locals>" not in cls.__qualname__
            and not cls.__module__.startswith("zchannel.")]


def register_paths(pairs: list[list[str]], find: Any) -> None:
    """``register_type(find(path), tag)`` of each ``[tag, path]`` of ``pairs`` (a broker's
    ``types``, from its creator).  One this process cannot import or register is logged and
    skipped: its items stay unknown here (a ``ValueError`` for a put that needs them
    decoded), as they were before this process was told of them."""
    for tag, path in pairs:
        try:
            register_type(find(path), tag)
        except (ImportError, ValueError, TypeError) as exc:
            _log.warning("type %r (%s) not registered in this process: %s", tag, path, exc)


def serializable(cls: C | None = None, *, name: str | None = None) -> Any:
    """Class decorator form of :func:`register_type`: ``@serializable`` or
    ``@serializable(name="tag")``, on a dataclass or an Enum class."""
    if cls is None:
        return lambda c: register_type(c, name)
    return register_type(cls, name)


def register_module(module_or_name: types.ModuleType | str, *,
                    recursive: bool = False) -> list[type]:
    """Allow on the wire every dataclass and every ``Enum`` class *defined* in a module.

    ``module_or_name`` is a module or its dotted name (imported if need be), e.g.
    ``register_module("rlinf.data.io_struct")``.  Each class whose ``__module__`` is that module
    (classes nested in its classes too) is registered as :func:`register_type` registers it,
    under its default tag ``"module:qualname"``; a class merely imported there is left to the
    module that defines it.  With ``recursive=True`` the submodules of a package are imported and
    registered too (``__main__`` modules excepted).

    Idempotent: calling it again, or on a class registered before, changes nothing (a class
    registered under another tag keeps it).  Nothing is registered if one class cannot be (its
    default tag belongs to another class: ``ValueError``; a dataclass no receiver could rebuild:
    ``TypeError``, :func:`check_rebuildable`; a submodule that fails to import:
    ``ImportError``).  Returns the dataclasses and Enum classes of the module(s), in definition
    order: each is registered when it returns (the same list on every call).

    Every process that sends or receives these classes calls it (a receiver only rebuilds classes
    it registered itself; ``docs/values.md``), or the module is published under the
    ``zchannel.hooks`` entry-point group, which registers it wherever zchannel meets an unknown
    tag or class.
    """
    classes: list[type] = []
    for module in _modules(module_or_name, recursive):
        classes += [cls for cls in _defined_classes(module) if cls not in classes]
    new = [cls for cls in classes if cls not in CLS_TO_TAG]
    for cls in new:
        owner = TAG_TO_CLS.get(default_tag(cls))
        if owner is not None and owner is not cls and default_tag(owner) != default_tag(cls):
            raise ValueError(
                f"cannot register {default_tag(cls)}: its tag {default_tag(cls)!r} is already "
                f"registered to {owner!r}; nothing of {module_or_name!r} was registered"
            )
        try:
            check_rebuildable(cls)
        except TypeError as exc:
            raise TypeError(f"{exc}; nothing of {module_or_name!r} was registered") from None
    for cls in new:
        register_type(cls)
    return classes


def _modules(module_or_name: Any, recursive: bool) -> list[types.ModuleType]:
    """The module named or given, then (``recursive``) its submodules, depth first."""
    if isinstance(module_or_name, str):
        module = importlib.import_module(module_or_name)
    elif isinstance(module_or_name, types.ModuleType):
        module = module_or_name
    else:
        raise TypeError(
            f"register_module takes a module or its dotted name, not {type(module_or_name).__name__}"
        )
    out = [module]
    path = getattr(module, "__path__", None)
    if recursive and path is not None:
        for info in pkgutil.iter_modules(path, module.__name__ + "."):
            if info.name.rpartition(".")[2] == "__main__":
                continue  # runs a program when imported
            try:
                sub = importlib.import_module(info.name)
            except Exception as exc:
                raise ImportError(
                    f"register_module({module.__name__!r}, recursive=True): cannot import "
                    f"{info.name} ({type(exc).__name__}: {exc}); nothing was registered — register "
                    "the modules you need one by one"
                ) from exc
            out += _modules(sub, True)
    return out


def _defined_classes(module: types.ModuleType) -> list[type]:
    """The dataclasses and Enum classes defined in ``module`` (at its top level or nested in a
    class defined there), in definition order; imported names and aliases are skipped."""
    out: list[type] = []

    def visit(namespace: Mapping[str, Any], prefix: str) -> None:
        for name, obj in list(namespace.items()):
            if not (isinstance(obj, type) and getattr(obj, "__module__", None) == module.__name__
                    and getattr(obj, "__qualname__", None) == prefix + name and obj not in out):
                continue
            if dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum):
                out.append(obj)
            visit(vars(obj), f"{obj.__qualname__}.")

    visit(vars(module), "")
    return out


_published_lock = threading.RLock()
_published_running = False
# emptied once register_published has run: until then the codec asks published_tag about a
# dataclass or Enum it would refuse or send as its base value
PUBLISHED_PENDING: list[bool] = [True]


def register_published() -> None:
    """Register the dataclasses and Enums of every module published under the ``zchannel.hooks``
    entry-point group (once per process; a module that cannot be registered is logged and
    skipped).  Another thread calling meanwhile waits for the first to finish."""
    global _published_running
    if not PUBLISHED_PENDING:
        return
    with _published_lock:
        if not PUBLISHED_PENDING or _published_running:  # done, or this thread's import came back
            return
        _published_running = True
        try:
            for name, obj in entry_point_objects().items():
                if isinstance(obj, types.ModuleType):
                    try:
                        register_module(obj)
                    except Exception:
                        _log.warning("could not register the classes of entry point %s (%s)",
                                     name, obj.__name__, exc_info=True)
        finally:
            PUBLISHED_PENDING.clear()
            _published_running = False


def published_tag(cls: type) -> str | None:
    """The tag of ``cls``, or None if it is not registered.  For an unregistered dataclass or
    Enum class the published modules are registered first (once: :func:`register_published`)."""
    tag = CLS_TO_TAG.get(cls)
    if tag is None and PUBLISHED_PENDING and (
        dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)
    ):
        register_published()
        tag = CLS_TO_TAG.get(cls)
    return tag


def registration_hint(cls: type) -> str:
    """How to register ``cls`` for the wire (the fix a ``TypeError`` at ``put`` names)."""
    decorator = ("decorate it with @zchannel.broker.serializable or call "
                 "zchannel.broker.register_type(cls)")
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        return (f"{decorator}, with a name= tag that the receivers register too (a class of "
                "__main__ or of a function has no module for them to register)")
    return (f'call zchannel.broker.register_module("{cls.__module__}") (every dataclass and Enum '
            f"defined in {cls.__module__}) in the sending and the receiving processes, or "
            f"{decorator}")


def lookup_tag(tag: str) -> type:
    """The class registered under ``tag`` (the published modules are registered once if it is
    unknown: :func:`register_published`); ``ValueError`` naming the tag and the fix if there is
    none.  The tag is never imported: only classes this process registered are rebuilt."""
    cls = TAG_TO_CLS.get(tag)
    if cls is None:
        register_published()
        cls = TAG_TO_CLS.get(tag)
    if cls is None:
        raise ValueError(unknown_tag_message(tag))
    return cls


def unknown_tag_message(tag: str) -> str:
    """The words of the ``ValueError`` for a tag this process has not registered."""
    shown = repr(tag) if len(tag) <= 200 else repr(tag[:200]) + "..."
    module, sep, qualname = tag.partition(":")
    if sep and module and qualname and module != "__main__" and all(
        part.isidentifier() for part in module.split(".")
    ):
        fix = f'call zchannel.broker.register_module("{module}")'
    else:
        fix = "register the class under this tag (zchannel.broker.register_type(cls, name=tag))"
    return (f"unknown serializable type tag {shown}: the process decoding the item (the getter, "
            f"or a broker whose hooks decode items) has not registered it; {fix} in that process, "
            "or import the module that registers it there (docs/values.md); a received tag never "
            "makes a process import anything")


def member_ref(member: enum.Enum) -> str | int:
    """How a member of a registered Enum is named on the wire: its member name, or for a
    combination of ``Flag`` members (no single name) its int value."""
    name = member._name_
    if name is not None and type(member).__members__.get(name) is member:
        return name
    return member._value_


def member_from_ref(cls: type[enum.Enum], ref: Any) -> enum.Enum:
    """The member of registered Enum ``cls`` that :func:`member_ref` named ``ref``;
    ``ValueError`` for anything else."""
    if isinstance(ref, str):
        member = cls.__members__.get(ref)
        if member is None:
            raise ValueError(f"{cls.__qualname__} has no member {ref!r}")
        return member
    if isinstance(ref, int) and not isinstance(ref, bool) and issubclass(cls, enum.Flag):
        try:
            return cls(ref)
        except ValueError:
            raise ValueError(f"{ref} is not a valid {cls.__qualname__} value") from None
    raise ValueError(f"malformed {cls.__qualname__} member reference {ref!r}")
