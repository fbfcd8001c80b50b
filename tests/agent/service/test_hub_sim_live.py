"""The hub over the live cluster, without vLLM: simulated live units (agent/engine/sim_live.py) stream the same
telemetry as vLLM units do, through an engine death and its restart; control changes reach the engines."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from node_builders import make_unit

from agent.engine.sim import SimUnit
from agent.engine.sim_live import SimLiveUnit
from agent.runtime.live.cluster import LiveCluster
from agent.runtime.live.node import LiveClusterNode
from agent.service.hub import Hub
from agent.telemetry import (
    Alert,
    ControlAudit,
    RequestArrived,
    RequestDispatched,
    RequestFinished,
    RequestFirstToken,
    RequestMigrated,
    StepEvent,
)
from agent.telemetry.commands import ErrorReply, OkReply, SetBatchPolicy, SetParams
from agent.workload.types import RequestSpec
from policies.cost.step_model import StepCoefficients
from policies.registry import BATCH_POLICIES, make_dispatch_policy

FAST = StepCoefficients(2e-3, 1e-6, 0.0)
TOKEN = "t0ken"


def maker(unit_id: int) -> Callable[[], SimUnit]:
    return lambda: make_unit(unit_id, "vllm", cost=FAST, num_blocks=2_000, max_num_seqs=32)


def test_the_stream_of_a_live_node_through_an_engine_death_and_restart() -> None:
    async def main() -> None:
        units = [SimLiveUnit(maker(i)) for i in range(2)]
        for u in units:
            u.start()
        cluster = LiveCluster(units, make_dispatch_policy("round_robin"), ttft_slo_s=1.0, tpot_slo_s=0.1,
                              restart_delays=lambda: iter([0.02] * 3))
        work = [RequestSpec(f"r{i:02d}", 0.01 * i, 64, 60) for i in range(12)]
        node = LiveClusterNode(cluster, [BATCH_POLICIES["vllm"]() for _ in units], requests=work)
        hub = Hub(node, node_id="sim-live", profile="test")
        hub.attach()
        done = asyncio.Event()
        serving = asyncio.get_running_loop().create_task(node.serve(done))
        for _ in range(2000):
            if len(units[1].live) >= 3 and all(r.outputs > 5 for r in units[1].live.values()):
                break
            await asyncio.sleep(0.005)
        units[1].kill("engine core process 77 exited with code -9")
        await asyncio.wait_for(done.wait(), 30)
        for _ in range(2000):
            if node.unit_modes[1] == "active":
                break
            await asyncio.sleep(0.005)
        serving.cancel()
        await node.close()
        events = hub.replay.since(0).events
        kinds = collections.Counter(type(e).__name__ for e in events)
        ids = {r.request_id for r in work}
        for cls in (RequestArrived, RequestDispatched, RequestFirstToken, RequestFinished):
            got = [e.request_id for e in events if isinstance(e, cls)]
            assert sorted(got) == sorted(ids) if cls is not RequestDispatched else set(got) == ids, (cls, kinds)
        finished = [e for e in events if isinstance(e, RequestFinished)]
        assert all(e.output_tokens == 60 and e.prompt_tokens == 64 for e in finished)
        moved = [e for e in events if isinstance(e, RequestMigrated)]
        assert len(moved) >= 3
        assert all((e.from_unit_id, e.unit_id, e.reason) == (1, 0, "unit_failed:recompute") for e in moved)
        alerts = [(e.code, e.unit_id) for e in events if isinstance(e, Alert)]
        assert ("unit_failed", 1) in alerts and ("unit_restarted", 1) in alerts
        for uid in (0, 1):
            steps = [e.step_id for e in events if isinstance(e, StepEvent) and e.unit_id == uid]
            assert steps and steps == sorted(steps)
        assert [e.seq for e in events] == sorted(e.seq for e in events)

    asyncio.run(main())


def test_control_changes_through_the_hub_reach_the_engines() -> None:
    """The control plane's changes go to each engine as control messages (what a vLLM unit's engine core gets), and
    the hub settles them before it answers; a bad value is refused before it reaches them."""
    async def main() -> None:
        units = [SimLiveUnit(maker(i)) for i in range(2)]
        for u in units:
            u.start()
        cluster = LiveCluster(units, make_dispatch_policy("round_robin"), ttft_slo_s=1.0, tpot_slo_s=0.1)
        node = LiveClusterNode(cluster, [BATCH_POLICIES["vllm"]() for _ in units])
        hub = Hub(node, node_id="sim-live", profile="test", token=TOKEN)
        hub.attach()
        async with cluster:
            swap = await hub.handle_async(SetBatchPolicy(policy="sarathi", params={"token_budget": 512}, unit_ids=(1,),
                                                         token=TOKEN, control_id="a"), who="op")
            assert isinstance(swap, OkReply) and isinstance(swap.payload, ControlAudit)
            assert [u.sim.policy.name for u in units] == ["vllm", "sarathi"]
            assert units[1].sim.policy.params["token_budget"] == 512
            tune = await hub.handle_async(SetParams(target="batch", params={"token_budget": 1024}, unit_ids=(1,),
                                                    token=TOKEN, control_id="b"), who="op")
            assert isinstance(tune, OkReply) and units[1].sim.policy.params["token_budget"] == 1024
            bad = await hub.handle_async(SetParams(target="batch", params={"token_budget": -1}, unit_ids=(1,),
                                                   token=TOKEN, control_id="c"), who="op")
            assert isinstance(bad, ErrorReply) and units[1].sim.policy.params["token_budget"] == 1024
            assert [s.batch_policy for s in hub.status().units] == ["vllm", "sarathi"]

    asyncio.run(main())
