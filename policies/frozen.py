"""A faster constructor for the frozen, slotted dataclasses built on the per-step hot path.

A frozen dataclass's generated ``__init__`` sets every field through ``object.__setattr__`` (its own ``__setattr__``
raises), several times a plain attribute store on CPython 3.11: a 20-field ``StepRecord`` took ~4.7 us to build on the
2-core machine (~2.5 us with this), and the simulator builds several such snapshots per unit-step (issue #21, item 3).
:func:`fast_init`
replaces that ``__init__`` by one with the same signature that writes each slot through its member descriptor, which
skips the generic ``__setattr__`` machinery. Nothing else changes: the class is still the same frozen dataclass
(``dataclasses.replace``, ``fields``, equality, hashing, ``FrozenInstanceError`` on assignment all as before).
"""

from __future__ import annotations

import copyreg
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

class _Factory:
    def __repr__(self) -> str:
        return "<factory>"  # as dataclasses shows it in a signature


_FACTORY = _Factory()
"""Default of a parameter whose field has a ``default_factory`` (the factory runs when the caller leaves it out)."""


def fast_init(cls: type[T]) -> type[T]:
    """Give a frozen, slotted dataclass (applied above ``@dataclass(frozen=True, slots=True)``) a faster ``__init__``
    with the same signature and defaults. Refuses what it does not reproduce: ``__post_init__``, ``InitVar``,
    keyword-only or ``init=False`` fields."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__qualname__}: fast_init is for frozen dataclasses with slots=True")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__qualname__}: fast_init does not call __post_init__")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    init_names = set(cls.__init__.__code__.co_varnames[1 : cls.__init__.__code__.co_argcount])
    if any(not f.init or f.kw_only for f in fields) or init_names != {f.name for f in fields}:
        raise TypeError(f"{cls.__qualname__}: fast_init takes only plain positional-or-keyword fields")
    namespace: dict[str, Any] = {"_FACTORY": _FACTORY}
    args, body = [], []
    for i, f in enumerate(fields):
        descriptor = cls.__dict__[f.name]
        namespace[f"_set{i}"] = descriptor.__set__
        value = f.name
        if f.default is not dataclasses.MISSING:
            namespace[f"_default{i}"] = f.default
            args.append(f"{f.name}=_default{i}")
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory{i}"] = f.default_factory
            args.append(f"{f.name}=_FACTORY")
            value = f"_factory{i}() if {f.name} is _FACTORY else {f.name}"
        else:
            args.append(f.name)
        body.append(f"    _set{i}(self, {value})")
    source = f"def __init__(self, {', '.join(args)}) -> None:\n" + "\n".join(body or ["    pass"]) + "\n"
    exec(source, namespace)  # the same technique as dataclasses' own generated methods
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(cls.__init__.__annotations__)
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


def _reduce(obj: Any) -> tuple[type[Any], tuple[Any, ...]]:
    return type(obj), tuple(getattr(obj, f.name) for f in dataclasses.fields(obj))


def picklable(*classes: type[Any]) -> None:
    """Pickle and copy instances of these frozen dataclasses by calling the constructor with their fields.

    For the frozen dataclasses of the modules that ``setup.py`` compiles with mypyc: a compiled frozen dataclass
    unpickles by setting its fields one by one, which its frozen ``__setattr__`` refuses (the process pools of
    ``trackside whatif`` and ``bench --jobs`` send configs and results that way). The constructor gives the same
    object, compiled or not. Call it once, after the classes, in the module that defines them."""
    for cls in classes:
        params = getattr(cls, "__dataclass_params__", None)
        if params is None or not params.frozen:
            raise TypeError(f"{cls.__qualname__}: picklable is for frozen dataclasses")
        if any(not f.init or f.kw_only for f in dataclasses.fields(cls)):
            raise TypeError(f"{cls.__qualname__}: picklable takes only plain positional-or-keyword fields")
        copyreg.pickle(cls, _reduce)


__all__ = ["fast_init", "picklable"]
