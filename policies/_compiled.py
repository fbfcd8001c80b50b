"""Which source runs: the modules compiled with mypyc, or their ``.py`` files (see ``setup.py``).

An install compiles the simulator's hot path (``setup.py``'s ``COMPILED``) and records the sha256 of each compiled
source in ``_compiled.json``. An editable install puts the compiled modules beside their ``.py`` files, where Python
prefers them, so a source edited after the install would silently not run. At the first import of ``policies`` (and
``agent`` imports ``policies`` first) this module compares the recorded hashes with the files; if any differ, or if
``TRACKSIDE_PURE=1`` is set, it puts a finder in front of ``sys.meta_path`` that loads every compiled module from its
source instead. All or none: compiled modules call each other directly, so mixing a compiled module with the source of
another would run two different copies of the same classes.

:data:`STATE` says which it is: ``"compiled"``, ``"pure"`` (nothing compiled), ``"pure: TRACKSIDE_PURE=1"`` or
``"pure: <module> changed since it was compiled ..."``. This module reads files at import; it decides nothing about
scheduling (policies stay pure).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TypeVar

_T = TypeVar("_T")

try:
    # Re-exported for the compiled policies (mypy, and so mypyc, resolve it to mypy_extensions.mypyc_attr).
    from mypy_extensions import mypyc_attr as mypyc_attr
except ImportError:  # the source run where mypy_extensions is not installed (the GPU machine's bundle): a no-op
    def mypyc_attr(*attrs: str, **kwattrs: object) -> Callable[[_T], _T]:
        return lambda cls: cls

ROOT = Path(__file__).resolve().parent.parent
"""The directory that holds the ``policies`` and ``agent`` packages (the project root, or site-packages)."""

MANIFEST = Path(__file__).resolve().with_name("_compiled.json")

PURE_BY_REQUEST = "pure: TRACKSIDE_PURE=1"


class SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the listed modules as their ``.py`` source, ahead of the compiled extension beside it."""

    def __init__(self, sources: dict[str, Path]) -> None:
        self.sources = sources

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        source = self.sources.get(fullname)
        if source is None:
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def source_of(module: str, root: Path = ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def is_compiled(module: str, root: Path = ROOT) -> bool:
    """Whether a compiled extension of ``module`` lies beside its source."""
    stem = root.joinpath(*module.split("."))
    return any(stem.with_name(stem.name + suffix).exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def decide(manifest: dict[str, str], *, pure: bool, root: Path = ROOT) -> tuple[str, dict[str, Path]]:
    """The state, and the modules to load from source (none when the compiled ones are current)."""
    built = {module: digest for module, digest in manifest.items() if is_compiled(module, root)}
    if not built:
        return "pure", {}
    sources = {module: source_of(module, root) for module in built}
    if pure:
        return PURE_BY_REQUEST, sources
    for module, digest in sorted(built.items()):
        source = sources[module]
        if not source.exists() or hashlib.sha256(source.read_bytes()).hexdigest() != digest:
            return (f"pure: {module} changed since it was compiled (`pip install -e .` compiles it again; "
                    "TRACKSIDE_PURE=1 runs the source without this warning)"), sources
    return "compiled", {}


def _install() -> str:
    try:
        manifest = json.loads(MANIFEST.read_text())["modules"]
    except (OSError, ValueError, KeyError, TypeError):
        return "pure"
    state, sources = decide(manifest, pure=os.environ.get("TRACKSIDE_PURE") == "1")
    if sources:
        sys.meta_path.insert(0, SourceFinder(sources))
        if state != PURE_BY_REQUEST:
            warnings.warn(f"trackside runs its source, not its compiled modules: {state[6:]}", stacklevel=2)
    return state


STATE = _install()
"""Which code runs: ``"compiled"``, or ``"pure..."`` with the reason."""
