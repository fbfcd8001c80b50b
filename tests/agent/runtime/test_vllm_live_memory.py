"""What a live vLLM agent keeps while requests pass (issue #21, item 9): a workload replay lets go of the streams
that ended (each holds its prompt's and outputs' token ids), and the agent's units keep a short history. Whole
vLLM engines on the CPU (fake executor), as ``tests/vllm_units.py`` sets them up."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

pytest.importorskip("vllm")

from vllm_units import fake_unit

from agent.engine.vllm.options import EngineOptions
from agent.runtime.live import node as live_node
from agent.runtime.live.cluster import LiveCluster
from agent.runtime.live.node import LiveClusterNode
from agent.runtime.live.requests import RequestStream
from agent.service.launch import LIVE_HISTORY, VllmAgentConfig, build_units
from agent.workload.types import RequestSpec
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES

pytestmark = pytest.mark.vllm


def test_a_replay_lets_go_of_the_streams_that_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the pruning threshold at 4, a replay of 40 short requests one after another holds a handful of streams,
    not 40, and the ended ones are garbage (nothing else keeps them); every request still finishes."""
    monkeypatch.setattr(live_node, "REPLAY_PRUNE", 4)

    async def main() -> None:
        units = [fake_unit(0)]
        units[0].start()
        cluster = LiveCluster(units, DISPATCH_POLICIES["round_robin"](), ttft_slo_s=5.0, tpot_slo_s=1.0)
        work = [RequestSpec(f"r{i}", i * 0.03, 16, 4) for i in range(40)]
        node = LiveClusterNode(cluster, [BATCH_POLICIES["vllm"]()], requests=work, vocab=1024)
        seen: list[weakref.ref[RequestStream]] = []
        submit = cluster.submit

        def submit_and_watch(*args: object, **kwargs: object) -> RequestStream:
            stream = submit(*args, **kwargs)  # type: ignore[arg-type]
            seen.append(weakref.ref(stream))
            return stream

        monkeypatch.setattr(cluster, "submit", submit_and_watch)
        held = []
        done = asyncio.Event()
        serving = asyncio.get_running_loop().create_task(node.serve(done))
        try:
            while not done.is_set():
                held.append(len(node.replaying))
                await asyncio.sleep(0.01)
            assert node.num_finished == len(work)
            assert len(seen) == len(work)
            assert max(held) < 12, held  # without the pruning it reaches 40
            gc.collect()
            gone = sum(ref() is None for ref in seen)
            assert gone >= len(work) - 12, f"only {gone} of {len(work)} ended streams were freed"
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await node.close()
            await units[0].stop()

    asyncio.run(main())


def test_the_agents_units_keep_a_short_history() -> None:
    config = VllmAgentConfig(units=2, batch_policy="vllm", batch_params={}, dispatch="round_robin",
                             dispatch_params={}, engine=EngineOptions(model="tiny"), fake_executor=True)
    units = build_units(config)  # not started: nothing runs
    assert LIVE_HISTORY < 20_000
    for unit in units:
        assert unit.records.maxlen == unit.raw.maxlen == unit.outcomes.maxlen == LIVE_HISTORY
