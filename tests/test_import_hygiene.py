"""Import boundaries, checked at run time (import-linter checks them statically in CI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN_FOR_POLICIES = ("agent", "console", "store", "vllm", "torch", "textual", "duckdb", "websockets", "rich")


def loaded_after(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return {name.split(".")[0] for name in json.loads(out)}


@pytest.mark.parametrize(
    "module", ["policies.registry", "policies.cost.fit", "policies.types", "policies.batch.vllm_default"]
)
def test_policies_stay_pure(module: str) -> None:
    loaded = loaded_after(module)
    assert not loaded & set(FORBIDDEN_FOR_POLICIES), loaded & set(FORBIDDEN_FOR_POLICIES)


@pytest.mark.parametrize("module", ["agent.node", "agent.bench", "agent.cli", "agent.engine.sim"])
def test_agent_runtime_needs_no_vllm_or_ui(module: str) -> None:
    loaded = loaded_after(module)
    assert not loaded & {"vllm", "torch", "textual", "console", "duckdb"}
