"""The benchmark scripts under ``tests/benchmarks/`` as modules, for the tests of their pure parts."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent / "benchmarks"


@contextmanager
def bench_script(name: str) -> Iterator[ModuleType]:
    """``tests/benchmarks/NAME.py`` imported as the module ``NAME`` (registered while in use: its dataclasses need
    it in ``sys.modules``), removed again afterwards."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
