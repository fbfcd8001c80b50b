"""Import boundaries, checked at run time (import-linter checks them statically in CI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN_FOR_POLICIES = ("agent", "console", "store", "vllm", "torch", "textual", "duckdb", "websockets", "rich")


def loaded_modules_after(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out))


def loaded_after(module: str) -> set[str]:
    return {name.split(".")[0] for name in loaded_modules_after(module)}


@pytest.mark.parametrize(
    "module", ["policies.registry", "policies.cost.fit", "policies.types", "policies.batch.vllm_default"]
)
def test_policies_stay_pure(module: str) -> None:
    loaded = loaded_after(module)
    assert not loaded & set(FORBIDDEN_FOR_POLICIES), loaded & set(FORBIDDEN_FOR_POLICIES)


@pytest.mark.parametrize(
    "module",
    [
        "agent.runtime.node", "agent.bench.runner", "agent.cli.main", "agent.engine.sim", "agent.telemetry",
        "agent.telemetry.stream", "agent.service.hub", "agent.service.server", "agent.telemetry.client",
        "agent.service.metrics", "agent.cli.serve", "agent.runtime.port", "agent.runtime.events",
        "agent.engine.vllm.messages",
    ],
)
def test_agent_runtime_needs_no_vllm_or_ui(module: str) -> None:
    loaded = loaded_after(module)
    assert not loaded & {"vllm", "torch", "textual", "console", "duckdb"}


@pytest.mark.parametrize(
    "module", ["agent.engine.live", "agent.engine.sim_live", "agent.runtime.live.cluster", "agent.runtime.live.node",
               "agent.service.live_agent", "agent.cli.agent_live"]
)
def test_the_live_cluster_runs_without_vllm(module: str) -> None:
    """The live cluster, its node, the simulated live engine and the agent that serves them (``--runtime live``) load
    neither vLLM nor its transport (zmq): they run (and are tested) on a machine without the vllm extra."""
    loaded = loaded_after(module)
    assert not loaded & {"vllm", "torch", "zmq", "textual", "duckdb"}, loaded & {"vllm", "torch", "zmq"}


def test_protocol_is_light_enough_for_console_and_store() -> None:
    """The console and the store import the protocol: it must not bring the engine, the node or a server."""
    loaded = loaded_modules_after("agent.telemetry")
    assert "msgspec" in loaded
    heavy = {m for m in loaded if m.split(".")[0] in {"vllm", "torch", "textual", "duckdb", "websockets"}}
    engine = {m for m in loaded
              if m.startswith(("agent.engine", "agent.runtime", "agent.service", "agent.telemetry.stream"))}
    assert not heavy | engine, heavy | engine


def test_serve_commands_load_the_store_only_when_recording() -> None:
    loaded = loaded_modules_after("agent.cli.serve")
    assert "websockets" in loaded and not any(m == "store" or m.startswith("store.") for m in loaded)


@pytest.mark.parametrize(
    "module",
    [
        "console.model.state", "console.model.queries", "console.model.fleet", "console.model.render",
        "console.model.metrics", "console.model.steps", "console.model.slack", "console.model.stages",
        "console.model.policy_view", "console.model.playback",
    ],
)
def test_console_state_model_is_plain(module: str) -> None:
    """The state model and its pure functions load no UI, no sockets, no database and no engine."""
    loaded = loaded_modules_after(module)
    heavy = {m for m in loaded if m.split(".")[0] in {"textual", "websockets", "duckdb", "store", "vllm", "torch"}}
    engine = {m for m in loaded if m.startswith(("agent.engine", "agent.runtime", "agent.telemetry.client"))}
    assert not heavy | engine, heavy | engine


@pytest.mark.parametrize(
    "module",
    [
        "console.cli", "console.app", "console.feeds", "console.demo", "console.control", "console.recorder",
        "console.history",
    ],
)
def test_console_runs_the_agent_as_a_child_and_imports_no_engine(module: str) -> None:
    forbidden = ("agent.engine", "agent.runtime", "agent.service", "agent.cli", "agent.bench", "agent.workload", "vllm",
                 "torch")
    loaded = loaded_modules_after(module)
    engine = {m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)}
    assert not engine, engine
    assert "agent.telemetry" in loaded or module == "console.demo"


@pytest.mark.parametrize("module", ["store.replay", "store.writer", "store.cli"])
def test_store_imports_no_ui(module: str) -> None:
    assert not loaded_after(module) & {"textual", "console"}


def test_the_policy_tests_run_the_pure_layer_alone() -> None:
    """``pytest tests/policies`` tests the pure layer by itself: its tests and the helpers they use import nothing
    of agent, console or store (the node-level policy tests live in tests/agent/runtime)."""
    import ast
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    impure = {"agent", "console", "store", "node_builders", "serve_harness", "console_fixtures", "vllm_harness"}
    found = []
    for path in [*sorted((tests / "policies").glob("*.py")), tests / "builders.py", tests / "conftest.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in impure]
    assert not found, found
