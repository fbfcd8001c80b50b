"""Policy plugins without installing anything: fake distributions in a folder put on ``sys.path``.

A distribution is a ``NAME-VERSION.dist-info`` folder holding ``METADATA`` and ``entry_points.txt``; the modules its
entry points name lie beside it. ``importlib.metadata`` finds such a folder on ``sys.path`` as it finds an installed
package, and a child process finds it through ``PYTHONPATH`` (:meth:`PluginSandbox.env`). :func:`plugin_sandbox`
puts everything back afterwards (the registries, ``agent.plugins``' once-per-process report, ``sys.modules``), so
that no other test sees the plugins.
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

import agent.plugins
from agent.plugins import GROUP
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES

GOOD_MODULE = '''
from typing import ClassVar

from policies.batch.vllm_default import VllmDefault
from policies.dispatch.baseline import LeastLoaded
from policies.params import ParamSpec


class PluginFcfs(VllmDefault):
    name: ClassVar[str] = "plugin_fcfs"
    summary: ClassVar[str] = "vLLM's default, from a plugin"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (
        *VllmDefault.params_schema,
        ParamSpec("plugin_knob", "int", 3, "a parameter of the plugin's own", min=0, max=10),
    )


class PluginSpread(LeastLoaded):
    name: ClassVar[str] = "plugin_spread"
    summary: ClassVar[str] = "least loaded, from a plugin"
'''
"""A module with one good batch policy and one good dispatch policy."""

GOOD_ENTRY_POINTS = {"plugin_fcfs": "ts_good_plugin:PluginFcfs", "plugin_spread": "ts_good_plugin:PluginSpread"}


class PluginSandbox:
    """A folder on ``sys.path`` to write fake distributions and their modules into."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.paths = [root]
        """Folders put on ``sys.path``: their modules are forgotten afterwards."""
        self._monkeypatch = monkeypatch
        monkeypatch.syspath_prepend(str(root))

    def add_path(self, path: Path) -> None:
        """Put ``path`` (e.g. a package's ``src`` folder, for a distribution whose modules lie elsewhere) on
        ``sys.path`` too."""
        self.paths.append(path)
        self._monkeypatch.syspath_prepend(str(path))

    def add(self, dist: str, entry_points: Mapping[str, str], modules: Mapping[str, str] | None = None,
            version: str = "0.1") -> None:
        """A distribution ``dist`` whose ``trackside.policies`` entry points are ``entry_points`` (name -> value), and
        the modules (name -> source) they point at."""
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = [f"[{GROUP}]", *(f"{name} = {value}" for name, value in entry_points.items())]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for name, source in (modules or {}).items():
            (self.root / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()

    def add_good(self) -> None:
        """``ts-good-plugin``: ``plugin_fcfs`` (batch) and ``plugin_spread`` (dispatch)."""
        self.add("ts-good-plugin", GOOD_ENTRY_POINTS, {"ts_good_plugin": GOOD_MODULE})

    def env(self) -> dict[str, str]:
        """The environment of a child process that finds these distributions (and trackside)."""
        root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (*map(str, self.paths), root, os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "PYTHONPATH": path}


@contextmanager
def plugin_sandbox(root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSandbox]:
    """A :class:`PluginSandbox` in ``root`` (an existing folder, put first on ``sys.path``); afterwards the registries
    hold what they held, the next :func:`agent.plugins.load_plugins` searches again, and the sandbox's modules are
    forgotten."""
    batch, dispatch = dict(BATCH_POLICIES), dict(DISPATCH_POLICIES)
    monkeypatch.setattr(agent.plugins, "_report", None)
    sandbox = PluginSandbox(root, monkeypatch)
    try:
        yield sandbox
    finally:
        BATCH_POLICIES.clear()
        BATCH_POLICIES.update(batch)
        DISPATCH_POLICIES.clear()
        DISPATCH_POLICIES.update(dispatch)
        folders = tuple(str(path) for path in sandbox.paths)
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(folders):
                del sys.modules[name]
