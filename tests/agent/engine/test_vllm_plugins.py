"""A plugin batch policy inside vLLM's engine-core process (issue #18): the engine core is a process of its own, and
the policy scheduler registers the installed plugins there before it resolves the policy's name; a broken plugin
beside it does not stop the engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from plugin_sandbox import PluginSandbox, plugin_sandbox

from agent.bench.vllm_runner import run_workload
from agent.engine.vllm.config import UnitSettings
from agent.engine.vllm.cpu import cpu_vllm_config
from agent.engine.vllm.fake_executor import FakeExecutor
from agent.engine.vllm.messages import SetParams
from agent.engine.vllm.options import EngineOptions
from agent.engine.vllm.unit import VllmUnit
from agent.workload.types import RequestSpec
from policies.dispatch.baseline import RoundRobin
from policies.registry import BATCH_POLICIES

pytestmark = pytest.mark.vllm


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSandbox]:
    with plugin_sandbox(tmp_path, monkeypatch) as box:
        box.add_good()
        box.add("ts-broken", {"import_error": "ts_broken_import:Policy"},
                {"ts_broken_import": "import nosuch_module_for_a_test\n"})
        # However vLLM starts its engine core (fork or spawn), it finds the fake distributions as installed ones.
        monkeypatch.setenv("PYTHONPATH", box.env()["PYTHONPATH"])
        yield box


def test_the_engine_core_registers_plugins_itself(sandbox: PluginSandbox) -> None:
    assert "plugin_fcfs" not in BATCH_POLICIES  # not in this process: only the engine core can resolve the name

    async def main() -> None:
        config = cpu_vllm_config(num_blocks=400, step_model=(0.002, 2e-6, 1e-8))
        unit = VllmUnit(0, EngineOptions(model="tiny", max_num_batched_tokens=512, max_num_seqs=32),
                        UnitSettings(policy="plugin_fcfs", params={"plugin_knob": 4}), vllm_config=config,
                        executor_class=FakeExecutor)
        unit.start()
        try:
            work = [RequestSpec(f"q{i}", i / 40, 40 + 11 * i, 4 + i % 5) for i in range(12)]
            res = await run_workload([unit], RoundRobin(), work, ttft_slo_s=1.0, tpot_slo_s=0.1, vocab=1024)
            assert len(res.outcomes) == 12 and not res.rejected
            assert res.records[0] and {r.policy for r in res.records[0]} == {"plugin_fcfs"}
            reply = await unit.control(SetParams(changes={"plugin_knob": 6}))
            assert reply.ok and reply.old == {"plugin_knob": 4} and reply.params["plugin_knob"] == 6
        finally:
            await unit.stop()

    asyncio.run(main())
