"""Engine failures on vLLM units: an engine-core process killed under load (whole ``AsyncLLM`` engines on the CPU,
fake executor).

The unit is marked failed within a second (vLLM's own dead-engine signal, or the unit's watchdog), the dispatcher
sees it unhealthy, a ``unit_failed`` alert goes on the stream, and its requests go on elsewhere by recompute: every
client stream ends with its full token count. ``/health`` of the OpenAI intake is 503 once no unit serves.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

pytest.importorskip("vllm")

from vllm_units import fake_unit, read_all, wait_until

from agent.runtime.live.cluster import LiveCluster
from agent.runtime.live.node import LiveClusterNode
from agent.runtime.live.requests import ClusterRequest
from agent.runtime.live.restarts import backoff
from agent.service.hub import Hub
from agent.service.openai_server import build_app
from agent.telemetry import Alert, AlertCode, RequestMigrated
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES

pytestmark = pytest.mark.vllm

NUM_REQUESTS = 200
MAX_TOKENS = 48


def test_killed_engine_core_fails_its_unit_and_its_requests_go_on() -> None:
    async def main() -> None:
        units = [fake_unit(i) for i in range(2)]
        for u in units:
            u.start()
        cluster = LiveCluster(units, DISPATCH_POLICIES["round_robin"](), ttft_slo_s=5.0, tpot_slo_s=1.0)
        node = LiveClusterNode(cluster, [BATCH_POLICIES["vllm"]() for _ in units])
        hub = Hub(node, node_id="test-node", profile="cpu")
        hub.attach()
        app = await build_app(cluster)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent")
        cluster.start()
        try:
            pids = [u.engine_pid for u in units]
            assert all(isinstance(p, int) and p != os.getpid() for p in pids) and pids[0] != pids[1]
            assert [s.engine_pid for s in hub.status().units] == pids
            assert (await http.get("/health")).status_code == 200

            streams = [cluster.submit(ClusterRequest(f"r{i}", [1 + (i + j) % 900 for j in range(24)], MAX_TOKENS))
                       for i in range(NUM_REQUESTS)]
            reads = [asyncio.ensure_future(read_all(s)) for s in streams]
            # Kill unit 0's engine core once its requests are streaming (some tokens out, none finished).
            on_0 = [s for s in streams if s.unit_id == 0]
            assert on_0 and len(on_0) < NUM_REQUESTS
            await wait_until(lambda: sum(len(s.output_token_ids) for s in on_0) >= 2 * len(on_0), 60)
            assert not any(s.done for s in on_0)
            os.kill(pids[0], signal.SIGKILL)
            noticed_s = await wait_until(lambda: 0 in cluster.failed, 5)
            assert noticed_s < 1.0, f"the failure took {noticed_s:.3f} s to notice"
            assert node.unit_modes == ["failed", "active"]
            assert not units[0].load(healthy=cluster.accepting[0]).healthy

            got = await asyncio.wait_for(asyncio.gather(*reads), 240)
            assert got == [MAX_TOKENS] * NUM_REQUESTS
            outcomes = [await s.wait() for s in streams]
            assert all(o.output_tokens == MAX_TOKENS and o.prompt_tokens == 24 for o in outcomes)
            evacuated = {s.request_id for s in on_0}
            assert all(o.unit_id == 1 for o in outcomes if o.request_id in evacuated)
            assert cluster.num_evacuated == len(on_0)

            events = hub.replay.since(0).events
            alerts = [e for e in events if isinstance(e, Alert) and e.code == AlertCode.UNIT_FAILED]
            assert len(alerts) == 1 and alerts[0].unit_id == 0 and alerts[0].severity == "error"
            moved = [e for e in events if isinstance(e, RequestMigrated)]
            assert moved and all(e.from_unit_id == 0 and e.unit_id == 1 and e.reason == "unit_failed:recompute"
                                 for e in moved)
            status = {s.unit_id: s for s in hub.status().units}
            assert status[0].mode == "failed" and str(pids[0]) in status[0].failure
            assert status[1].mode == "active" and not status[1].failure
            with pytest.raises(ValueError, match="has failed"):
                node.set_unit_mode(0, "active")

            # One unit still serves: healthy. The last one dies (idle: its watchdog sees it): 503.
            assert (await http.get("/health")).status_code == 200
            os.kill(pids[1], signal.SIGKILL)
            assert await wait_until(lambda: 1 in cluster.failed, 5) < 1.0
            health = await http.get("/health")
            assert health.status_code == 503
        finally:
            await http.aclose()
            await cluster.close()
            for u in units:
                await u.stop()

    asyncio.run(main())


def test_failed_unit_restarts_with_backoff_and_rejoins() -> None:
    async def main() -> None:
        units = [fake_unit(i, tokenizer=True) for i in range(2)]
        for u in units:
            u.start()
        cluster = LiveCluster(units, DISPATCH_POLICIES["round_robin"](), ttft_slo_s=5.0, tpot_slo_s=1.0,
                              restart_delays=lambda: backoff(0.2))
        node = LiveClusterNode(cluster, [BATCH_POLICIES["vllm"]() for _ in units])
        hub = Hub(node, node_id="test-node", profile="cpu")
        hub.attach()
        app = await build_app(cluster)  # its renderer (tokenizer) is unit 0's: the unit that dies here
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent")
        cluster.start()
        try:
            old_pid = units[0].engine_pid
            assert old_pid is not None
            streams = [cluster.submit(ClusterRequest(f"a{i}", [5 + i] * 16, MAX_TOKENS)) for i in range(20)]
            reads = [asyncio.ensure_future(read_all(s)) for s in streams]
            await wait_until(lambda: sum(len(s.output_token_ids) for s in streams) >= 40, 60)
            os.kill(old_pid, signal.SIGKILL)
            await wait_until(lambda: 0 in cluster.failed, 5)
            assert await asyncio.wait_for(asyncio.gather(*reads), 120) == [MAX_TOKENS] * 20
            await wait_until(lambda: 0 not in cluster.failed, 120)  # a fresh engine started and rejoined
            assert units[0].engine_pid not in (None, old_pid) and node.unit_modes == ["active", "active"]
            assert cluster.num_restarts == 1 and hub.status().units[0].engine_pid == units[0].engine_pid
            settled = await node.settle(10.0)  # the agent's copy of the batch policy, sent to the fresh engine
            assert settled == type(settled)((), ())
            after = [cluster.submit(ClusterRequest(f"b{i}", [7 + i] * 16, MAX_TOKENS)) for i in range(6)]
            assert {s.unit_id for s in after} == {0, 1}
            assert await asyncio.wait_for(asyncio.gather(*(read_all(s) for s in after)), 60) == [MAX_TOKENS] * 6
            assert {(await s.wait()).unit_id for s in after} == {0, 1}
            steps = [r.step_id for r in units[0].records]  # the fresh engine counts from 0; the unit's ids go on
            assert len(steps) > 1 and steps == sorted(set(steps))
            codes = [e.code for e in hub.replay.since(0).events if isinstance(e, Alert) and e.unit_id == 0]
            assert codes == [AlertCode.UNIT_FAILED, AlertCode.UNIT_RESTARTED]
            # Text still goes through vLLM's front end: the dead engine's shutdown left the app's renderer alone.
            for i in range(4):
                r = await http.post("/v1/completions", json={"model": "tiny", "prompt": f"hi there {i}",
                                                             "max_tokens": 4, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 4
        finally:
            await http.aclose()
            await cluster.close()
            for u in units:
                await u.stop()

    asyncio.run(main())
