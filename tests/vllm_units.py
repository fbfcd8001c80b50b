"""Whole vLLM engines on the CPU (fake executor) as units, and what the engine-failure tests wait on: shared by
``tests/agent/runtime/test_vllm_engine_failure.py`` and ``test_vllm_unit_faults.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from agent.engine.vllm.config import UnitSettings
from agent.engine.vllm.cpu import cpu_vllm_config
from agent.engine.vllm.fake_executor import FakeExecutor
from agent.engine.vllm.options import EngineOptions
from agent.engine.vllm.unit import ENGINE_HANG_S, VllmUnit
from agent.runtime.live.requests import RequestStream


def fake_unit(unit_id: int, hang_s: float | None = ENGINE_HANG_S, tokenizer: bool = False) -> VllmUnit:
    """A unit of the tiny model on the fake executor (2 ms steps), room for 128 requests (not started);
    ``tokenizer``: with the tiny model's tokenizer (text prompts through the OpenAI app)."""
    config = cpu_vllm_config(num_blocks=2000, max_num_seqs=128, step_model=(0.002, 2e-6, 1e-8), tokenizer=tokenizer)
    return VllmUnit(unit_id, EngineOptions(model="tiny", max_num_batched_tokens=512, max_num_seqs=128),
                    UnitSettings(policy="vllm"), vllm_config=config, executor_class=FakeExecutor, hang_s=hang_s)


async def read_all(stream: RequestStream) -> int:
    """Tokens the client got; the stream must end with a finish reason."""
    n = 0
    finish = None
    async for delta in stream:
        n += len(delta.token_ids)
        finish = delta.finish_reason or finish
    assert finish == "length"
    return n


async def wait_until(what: Callable[[], object], timeout_s: float) -> float:
    """Seconds until ``what()`` is true; ``AssertionError`` after ``timeout_s``."""
    start = time.monotonic()
    while not what():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s")
        await asyncio.sleep(0.005)
    return time.monotonic() - start
