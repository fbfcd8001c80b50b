"""The simulator's hot path, compiled with mypyc (issue #21, item 3).

Everything else about the package is in ``pyproject.toml``; this file only adds the extension modules. The modules in
``COMPILED`` are the ones a simulated step runs through (the unit, the node, the step timer and online fit, the bench's
bookkeeping, every batch and dispatch policy). mypyc compiles the same typed source that ``mypy --strict`` already
checks: there is one source of truth, and a pure-Python install runs the very same files.

- ``pip install -e .`` builds the extensions in place, beside their ``.py`` files (that is how setuptools' editable
  installs place extension modules). ``policies/_compiled.py`` notices at import when a compiled module's source has
  changed since it was built and then runs all of them from source, with a warning, until the next install.
- ``TRACKSIDE_PURE=1`` at install time builds nothing; at run time it runs the pure source even where compiled
  modules exist (for profilers such as py-spy and cProfile, which do not see inside compiled functions).
- If the compiler is missing or fails, the install goes on without extensions and says so: the package is the same,
  only slower.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

COMPILED = (
    "agent/bench/report.py",
    "agent/engine/sim.py",
    "agent/engine/timing.py",
    "agent/runtime/node.py",
    "agent/runtime/records.py",
    "policies/cost/fit.py",
    "policies/cost/step_model.py",
    *sorted(
        str(p.relative_to(ROOT))
        for folder in ("policies/batch", "policies/dispatch")
        for p in (ROOT / folder).glob("*.py")
        if p.name != "__init__.py"
    ),
)
"""Source files compiled with mypyc, relative to the project root."""

MANIFEST = ROOT / "policies" / "_compiled.json"
"""What was compiled from which source: module name -> sha256 of its ``.py`` when built (read by
``policies/_compiled.py``; written at every build, not in git)."""


class OptionalBuildExt(build_ext):
    """Builds the extensions, or none: a failed compile removes what it built and the install goes on pure."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # any compiler or linker failure: install the pure source
            for ext in self.extensions:
                Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            pure(f"compiling the simulator's hot path failed ({exc})")


def remove_stale_extensions(*, keep_compiled: bool = True) -> None:
    """Delete compiled modules left in the source tree by an earlier editable install that no longer compiles them,
    or all of them (``keep_compiled=False``: this build compiles nothing); Python would still import them ahead of
    their source."""
    names = {path.removesuffix(".py") for path in COMPILED} | {"policies/_native__mypyc"} if keep_compiled else set()
    for folder in ("agent", "policies"):
        for path in (ROOT / folder).rglob("*.so"):
            if str(path.relative_to(ROOT)).split(".")[0] not in names:
                path.unlink()


def pure(why: str) -> list[Any]:
    """Build no extension (and leave none from an earlier build in the source tree)."""
    remove_stale_extensions(keep_compiled=False)
    MANIFEST.unlink(missing_ok=True)
    if why:
        print(f"trackside: {why}; installing pure Python (the same code, slower)", file=sys.stderr)
    return []


def write_manifest() -> None:
    remove_stale_extensions()
    modules = {
        path.removesuffix(".py").replace("/", "."): hashlib.sha256((ROOT / path).read_bytes()).hexdigest()
        for path in COMPILED
    }
    MANIFEST.write_text(json.dumps({"modules": modules}, indent=1, sort_keys=True) + "\n")


def ext_modules() -> list[Any]:
    if os.environ.get("TRACKSIDE_PURE") == "1":
        return pure("")
    try:
        from mypyc.build import mypycify
    except ImportError:  # building without the build-system requirements (e.g. --no-build-isolation, no mypy)
        return pure("mypyc not found")
    old_cwd = os.getcwd()
    os.chdir(ROOT)  # mypycify takes paths relative to the project root and names modules after them
    try:
        extensions = list(mypycify(list(COMPILED), opt_level="3", debug_level="1", group_name="policies._native"))
    except (Exception, SystemExit) as exc:  # mypyc's type check failed (it exits): install the pure source
        return pure(f"mypyc could not compile the hot path ({exc!r}; its errors are above)")
    finally:
        os.chdir(old_cwd)
    write_manifest()
    return extensions


BUILDS = frozenset({"build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop", "bdist_egg"})
"""setuptools commands that build extensions. pip runs this file three times per install, in separate processes:
``egg_info`` (the build requirements), ``dist_info`` (the metadata), then ``bdist_wheel`` or ``editable_wheel``. Only
the last builds, so only it runs mypyc (each run of mypyc type-checks and writes the C code again: ~10 s apiece)."""


def metadata_only(argv: list[str]) -> bool:
    """Whether this run of setup.py only writes metadata (no extension is built, and none is removed)."""
    return not BUILDS.intersection(argv[1:])


if __name__ == "__main__":  # setuptools runs this file as __main__; tests read COMPILED without building
    setup(ext_modules=[] if metadata_only(sys.argv) else ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
