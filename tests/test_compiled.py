"""The simulator's hot path compiled with mypyc (``setup.py``, issue #21 item 3) and the check that decides, at import,
whether the compiled modules or their source run (``policies/_compiled.py``)."""

from __future__ import annotations

import ast
import copyreg
import dataclasses
import hashlib
import importlib
import os
import pickle
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from policies import _compiled
from policies.frozen import picklable
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES

ROOT = Path(__file__).resolve().parents[1]
SETUP = runpy.run_path(str(ROOT / "setup.py"), run_name="not_main")
COMPILED: tuple[str, ...] = SETUP["COMPILED"]
MODULES = [path.removesuffix(".py").replace("/", ".") for path in COMPILED]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def test_the_compiled_list_names_existing_modules_of_the_hot_path() -> None:
    assert len(set(COMPILED)) == len(COMPILED)
    assert all((ROOT / path).is_file() for path in COMPILED)
    assert {"agent.engine.sim", "agent.runtime.node", "policies.batch.fairbatching", "policies.dispatch.sbs"} <= set(
        MODULES)
    assert "policies._compiled" not in MODULES and not any(m.startswith("agent.engine.vllm") for m in MODULES)


@pytest.mark.parametrize(("argv", "only"), [
    (["setup.py", "egg_info"], True),  # pip's build requirements
    (["setup.py", "dist_info", "--output-dir", "/tmp/x", "--keep-egg-info"], True),  # pip's metadata
    (["setup.py", "editable_wheel", "--dist-dir", "/tmp/x"], False),  # pip install -e .
    (["setup.py", "bdist_wheel", "--dist-dir", "/tmp/x"], False),  # pip install .
    (["setup.py", "-q", "build_ext", "--inplace"], False),  # the GPU machine's in-place build
])
def test_only_the_runs_that_build_compile(argv: list[str], only: bool) -> None:
    """pip runs setup.py three times per install; mypyc runs in the one that builds (``metadata_only``), and a
    metadata run neither compiles nor removes what an earlier build left."""
    assert SETUP["metadata_only"](argv) is only


def _tree(tmp_path: Path, source: str = "VALUE = 'source'\n") -> dict[str, str]:
    """A package ``pkg`` with module ``mod`` and a file where its compiled extension would be; the manifest entry."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(source)
    (tmp_path / "pkg" / f"mod{SUFFIX}").write_bytes(b"not a shared object")
    return {"pkg.mod": hashlib.sha256(source.encode()).hexdigest()}


def test_current_compiled_modules_run(tmp_path: Path) -> None:
    manifest = _tree(tmp_path)
    assert _compiled.decide(manifest, pure=False, root=tmp_path) == ("compiled", {})


def test_an_edited_source_runs_all_of_them_from_source(tmp_path: Path) -> None:
    manifest = _tree(tmp_path)
    (tmp_path / "other.py").write_text("X = 1\n")
    (tmp_path / f"other{SUFFIX}").write_bytes(b"")
    manifest["other"] = hashlib.sha256(b"X = 1\n").hexdigest()
    (tmp_path / "pkg" / "mod.py").write_text("VALUE = 'edited'\n")
    state, sources = _compiled.decide(manifest, pure=False, root=tmp_path)
    assert state.startswith("pure: pkg.mod changed since it was compiled")
    assert sources == {"pkg.mod": tmp_path / "pkg" / "mod.py", "other": tmp_path / "other.py"}  # all or none


def test_trackside_pure_runs_the_source_and_nothing_built_is_pure(tmp_path: Path) -> None:
    manifest = _tree(tmp_path)
    state, sources = _compiled.decide(manifest, pure=True, root=tmp_path)
    assert state == _compiled.PURE_BY_REQUEST and set(sources) == {"pkg.mod"}
    (tmp_path / "pkg" / f"mod{SUFFIX}").unlink()
    assert _compiled.decide(manifest, pure=False, root=tmp_path) == ("pure", {})


def test_the_finder_loads_the_source_ahead_of_the_extension_beside_it(tmp_path: Path) -> None:
    _tree(tmp_path)
    probe = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        try:
            import pkg.mod
        except ImportError:
            print("the extension was tried")
        for name in [n for n in sys.modules if n.startswith("pkg")]:
            del sys.modules[name]
        from pathlib import Path
        from policies._compiled import SourceFinder
        sys.meta_path.insert(0, SourceFinder({{"pkg.mod": Path({str(tmp_path / "pkg" / "mod.py")!r})}}))
        import pkg.mod
        print(pkg.mod.VALUE)
    """)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["the", "extension", "was", "tried", "source"]


def test_trackside_pure_at_run_time_imports_no_compiled_module() -> None:
    probe = "import agent.engine.sim as s, policies._compiled as c; print(c.STATE); print(s.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**_env(), "TRACKSIDE_PURE": "1"})
    assert done.returncode == 0, done.stderr
    state, path = done.stdout.split("\n")[:2]
    assert state in ("pure", _compiled.PURE_BY_REQUEST) and path.endswith("sim.py")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRACKSIDE_PURE"}


def _bare_sum(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sum" and len(
        node.args) == 1 and not node.keywords


def test_no_compiled_module_combines_two_sums_without_start_values() -> None:
    """mypyc 2.4 compiles ``sum(a) + sum(b)`` (any operator) over floats as an integer operation, which raises
    ``TypeError: int object expected; got float`` at run time: such sums take an explicit ``0.0``."""
    found = []
    for path in COMPILED:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.BinOp) and _bare_sum(node.left) and _bare_sum(node.right):
                found.append(f"{path}:{node.lineno}")
    assert not found


@pytest.mark.parametrize("module", MODULES)
def test_every_frozen_dataclass_of_a_compiled_module_pickles_by_its_constructor(module: str) -> None:
    mod = importlib.import_module(module)
    for obj in vars(mod).values():
        if (isinstance(obj, type) and obj.__module__ == module and dataclasses.is_dataclass(obj)
                and obj.__dataclass_params__.frozen):  # type: ignore[attr-defined]
            assert obj in copyreg.dispatch_table, f"{module}.{obj.__qualname__}: call policies.frozen.picklable on it"


def test_picklable_round_trips_and_refuses_what_it_cannot_rebuild() -> None:
    from agent.bench.runner import BenchConfig

    config = BenchConfig(batch_policy="sarathi", params={"chunk": "256"}, units=2)
    assert pickle.loads(pickle.dumps(config)) == config

    @dataclasses.dataclass(frozen=True)
    class KwOnly:
        x: int = dataclasses.field(kw_only=True)

    with pytest.raises(TypeError, match="positional-or-keyword"):
        picklable(KwOnly)
    with pytest.raises(TypeError, match="frozen dataclasses"):
        picklable(int)


@pytest.mark.parametrize("name", sorted({*BATCH_POLICIES, *DISPATCH_POLICIES}))
def test_every_shipped_policy_can_be_subclassed_by_a_plugin(name: str) -> None:
    cls = BATCH_POLICIES.get(name) or DISPATCH_POLICIES[name]
    sub = type(f"Plugin{cls.__name__}", (cls,), {"__module__": __name__})
    assert issubclass(sub, cls)


def test_the_source_runs_without_mypy_extensions() -> None:
    """The GPU machine runs the source from PYTHONPATH with a bundle that lacks mypy_extensions: mypyc_attr is then
    a no-op of policies/_compiled.py's own."""
    probe = ("import sys; sys.modules['mypy_extensions'] = None\n"
             "from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES\n"
             "from policies.batch.vllm_default import VllmDefault\n"
             "class Mine(VllmDefault):\n    name = 'mine'\n"
             "print(len(BATCH_POLICIES) + len(DISPATCH_POLICIES), Mine().name)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**_env(), "TRACKSIDE_PURE": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(len(BATCH_POLICIES) + len(DISPATCH_POLICIES)), "mine"]


@pytest.mark.parametrize("pure", [False, True])
def test_trackside_version_says_which_code_runs(pure: bool) -> None:
    env = {**_env(), "TRACKSIDE_PURE": "1"} if pure else _env()
    done = subprocess.run([sys.executable, "-m", "agent.cli", "--version"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith("trackside ") and f"python {sys.version.split()[0]}; code: " in line
    if pure:
        assert line.endswith("code: pure: TRACKSIDE_PURE=1)") or line.endswith("code: pure)")
    else:
        assert line.endswith(f"code: {_compiled.STATE})")
