"""``examples/custom_policy`` stays correct (issue #18): its entry points load as a plugin (through a fake
distribution made from its ``pyproject.toml``, nothing installed), bench against the built-ins, and its own tests
pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugin_sandbox import PluginSandbox, plugin_sandbox

from agent.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_policy"
SMALL_JSONL = ROOT / "examples" / "traces" / "small.jsonl"


@pytest.fixture
def example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSandbox]:
    """The example package as if installed: its distribution's entry points, its sources on ``sys.path``."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    with plugin_sandbox(tmp_path, monkeypatch) as sandbox:
        sandbox.add(project["name"], project["entry-points"]["trackside.policies"], version=project["version"])
        sandbox.add_path(EXAMPLE / "src")
        yield sandbox


def test_the_example_is_listed_as_a_plugin(example: PluginSandbox, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err, err
    listed = json.loads(out)
    origins = {p["name"]: (p["module"], p["plugin"]) for kind in ("batch", "dispatch") for p in listed[kind]}
    assert origins["short_first"] == ("custom_policy.batch", "trackside-custom-policy 0.1.0")
    assert origins["least_tokens"] == ("custom_policy.dispatch", "trackside-custom-policy 0.1.0")


def test_the_example_benches_against_the_built_ins(example: PluginSandbox, tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    assert main(["bench", "--trace", str(SMALL_JSONL), "--units", "2", "--compare", "vllm,short_first",
                 "--dispatch", "least_loaded,least_tokens", "--param", "short_first.max_wait_ms=500", "--json",
                 str(out), "--no-progress"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert {(r["batch_policy"], r["dispatch"]) for r in runs} == {
        (b, d) for b in ("vllm", "short_first") for d in ("least_loaded", "least_tokens")}
    for r in runs:
        assert r["summary"]["completed"] == r["summary"]["requests"] > 0, r["summary"]
    assert {r["params"]["max_wait_ms"] for r in runs if r["batch_policy"] == "short_first"} == {500.0}


def test_the_examples_own_tests_pass() -> None:
    """``pytest`` in ``examples/custom_policy``, as its README says (the package need not be installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=EXAMPLE, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_the_example_is_a_what_if_candidate(
    example: PluginSandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "agent" / "cli"))
    try:
        from test_calibrate import record_sim
    finally:
        sys.path.remove(str(ROOT / "tests" / "agent" / "cli"))
    db = record_sim(tmp_path / "t.duckdb", noise=False, workload="poisson:n=100,rate=20", units=2)
    assert main(["whatif", "--db", str(db), "--profile", "h100-llama31-8b", "--compare", "short_first", "--dispatch",
                 "least_tokens", "--jobs", "1", "--progress", "none", "--json", "-"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["batch_policy"], r["dispatch"]) for r in runs] == [("vllm", "least_loaded"),
                                                                  ("short_first", "least_tokens")]
    assert runs[1]["summary"]["completed"] == 100
