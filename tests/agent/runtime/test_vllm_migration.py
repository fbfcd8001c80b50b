"""Migration by recompute on vLLM units (``LiveCluster``): whole ``AsyncLLM`` engines on the CPU, fake executor.

A migrated request is aborted on its source (its KV freed) and submitted again on its target with the original
prompt plus its outputs so far as prompt and ``max_tokens`` reduced; its client stream goes on seamlessly.
"""

from __future__ import annotations

import asyncio
import random

import pytest

pytest.importorskip("vllm")

from builders import MoveOne

from agent.bench.vllm_runner import run_workload
from agent.engine.live import LiveRequest
from agent.engine.vllm.config import UnitSettings
from agent.engine.vllm.cpu import cpu_vllm_config
from agent.engine.vllm.fake_executor import FakeExecutor
from agent.engine.vllm.options import EngineOptions
from agent.engine.vllm.unit import VllmUnit
from agent.runtime.live.cluster import LiveCluster
from agent.runtime.live.node import LiveClusterNode
from agent.runtime.live.requests import ClusterRequest
from agent.runtime.records import MigrationRecord
from agent.service.hub import Hub
from agent.telemetry import RequestFinished, RequestMigrated, StageBoundaries
from agent.workload.types import RequestSpec
from policies.dispatch.cascade import CascadeInfer
from policies.registry import BATCH_POLICIES

pytestmark = pytest.mark.vllm


def _unit(unit_id: int, *, async_scheduling: bool = False) -> VllmUnit:
    config = cpu_vllm_config(async_scheduling=async_scheduling, num_blocks=400, step_model=(0.002, 2e-6, 1e-8))
    return VllmUnit(unit_id, EngineOptions(model="tiny", max_num_batched_tokens=512, max_num_seqs=32),
                    UnitSettings(policy="vllm"), vllm_config=config, executor_class=FakeExecutor)


@pytest.mark.parametrize(("async_scheduling", "after"), [(False, 20), (True, 20), (False, 0)])
def test_forced_migration_keeps_the_stream_whole(async_scheduling: bool, after: int) -> None:
    """``after=0``: moved as soon as the dispatcher sees it, most likely before its first token."""
    async def main() -> None:
        units = [_unit(i, async_scheduling=async_scheduling) for i in range(2)]
        for u in units:
            u.start()
        policy = MoveOne("m", after=after)
        cluster = LiveCluster(units, policy, ttft_slo_s=1.0, tpot_slo_s=0.1)
        node = LiveClusterNode(cluster, [BATCH_POLICIES["vllm"]() for _ in units])
        moves: list[MigrationRecord] = []
        node.on_migrate = moves.append
        firsts: list[str] = []
        node.on_request = lambda kind, state: firsts.append(state.spec.request_id) if kind == "first_token" else None
        try:
            cluster.start()
            prompt = [1000 + i for i in range(200)]
            stream = cluster.submit(ClusterRequest("m", prompt, 120))
            tokens: list[int] = []
            finishes: list[str | None] = []
            async for delta in stream:
                tokens.extend(delta.token_ids)
                finishes.append(delta.finish_reason)
            outcome = await stream.wait()
            assert policy.asked
            assert len(tokens) == 120 and finishes[-1] == "length" and finishes.count("length") == 1
            assert stream.output_token_ids == tokens
            assert stream.unit_id == 1 and stream.num_migrations == 1 and cluster.num_migrations == 1
            assert outcome.unit_id == 1 and outcome.output_tokens == 120 and outcome.prompt_tokens == 200
            assert outcome.first_token_s <= outcome.finish_s
            assert outcome.tpot_s is not None and outcome.max_tpot_s is not None
            assert outcome.max_tpot_s >= outcome.tpot_s - 1e-9  # tracked across the move (the mean is its last value)
            assert firsts == ["m"], "one first-token report"
            # the dispatcher saw the request with its outputs so far, not migrating
            seen = {r.request_id: r for r in policy.seen[0].requests}["m"]
            assert seen.prompt_tokens == 200 and seen.context_tokens == 200 + seen.output_tokens
            assert not seen.migrating and seen.output_tokens >= after
            assert seen.computed_tokens == (seen.context_tokens - 1 if seen.output_tokens else 0)
            # the target recomputed prompt + outputs; the source has no outcome, the target one
            assert [o.request_id for o in units[0].outcomes] == []
            assert [o.request_id for o in units[1].outcomes] == ["m"]
            assert sum(r.num_prefill_tokens for r in units[1].records) >= 200 + seen.output_tokens
            assert sum(r.num_decode_tokens for r in units[1].records) < 120
            assert [(m.request_id, m.from_unit_id, m.unit_id, m.reason, m.mechanism, m.kv_tokens)
                    for m in moves] == [("m", 0, 1, "test", "recompute", 0)]
            assert node.states == {} and node.num_finished == 1 and node.num_ended == 0
            # unit 0 freed the request's KV: a later small request there finds the cache otherwise empty
            mark = len(units[0].records)
            assert units[0].load().num_running == units[0].load().num_waiting == 0
            policy.asked = True
            small = cluster.submit(ClusterRequest("s", [1000 + i for i in range(16)], 4))
            assert (await small.wait()).unit_id == 0
            later = units[0].records[mark:]
            assert later and max(r.kv_used_blocks for r in later) <= 2
            assert units[0].load(with_requests=True).requests == ()
        finally:
            await cluster.close()
            for u in units:
                await u.stop()

    asyncio.run(main())


def test_migrating_request_is_flagged_until_its_first_token_on_the_target() -> None:
    unit = _unit(0)  # not started: the front end's bookkeeping only
    unit.live["x"] = unit_live = LiveRequest(1.0, 100, 50, 1.0, 0.1, 1.0, None, None, 0.5, 30, 30, True)
    load = unit.load(with_requests=True)
    (r,) = load.requests
    assert r.migrating and r.context_tokens == 130 and r.output_tokens == 30 and r.computed_tokens == 0
    assert load.migrations_inflight == 1
    unit_live.outputs, unit_live.migrating = 31, False
    (r,) = unit.load(with_requests=True).requests
    assert not r.migrating and r.computed_tokens == 130
    assert unit.load().requests == ()


def test_cascade_hands_requests_over_across_a_stage_boundary() -> None:
    """Stages pinned (units 0-1: contexts below 300, unit 2: above): requests outgrow stage 0 and are handed
    over by recompute; each still produces exactly its output length."""
    async def main() -> None:
        units = [_unit(i) for i in range(3)]
        for u in units:
            u.start()
        try:
            cascade = CascadeInfer({"min_partition_samples": 1_000_000, "ema_alpha": 0.0, "rebalance": False})
            cascade.set_stages([0, 300, 131_072], [[0, 1], [2]])
            # long-tailed outputs: most short, every fifth long enough to cross the boundary
            work = [RequestSpec(f"q{i:03d}", i * 0.02, 60 + 37 * i % 180, 400 if i % 5 == 0 else 8 + 11 * i % 40)
                    for i in range(40)]
            res = await run_workload(units, cascade, work, ttft_slo_s=2.0, tpot_slo_s=0.2, vocab=1024)
            assert not res.rejected
            want = {w.request_id: w for w in work}
            assert sorted(o.request_id for o in res.outcomes) == sorted(want)
            for o in res.outcomes:
                assert o.output_tokens == want[o.request_id].output_tokens
                assert o.prompt_tokens == want[o.request_id].prompt_tokens
                if o.prompt_tokens + o.output_tokens > 300:
                    assert o.unit_id == 2, "outgrew stage 0: handed over"
            moved = [o for o in res.outcomes if o.unit_id == 2]
            assert moved, "at least one hand-over"
            assert sum(r.num_prefill_tokens for r in res.records[2]) > sum(o.prompt_tokens for o in moved)
            for u in units:
                assert u.load().num_running == u.load().num_waiting == 0
        finally:
            for u in units:
                await u.stop()

    asyncio.run(main())


def test_cascade_rebalances_a_long_tailed_workload() -> None:
    """Cascade as configured for a small cluster (its own partition and bid-ask rebalancing): it migrates, and
    every request still produces exactly its output length."""
    async def main() -> None:
        units = [_unit(i) for i in range(3)]
        for u in units:
            u.start()
        try:
            rng = random.Random(1)
            work = [RequestSpec(f"q{i:03d}", i * 0.01, rng.randint(30, 300),
                                int(min(900, rng.paretovariate(1.2) * 20))) for i in range(120)]
            cascade = CascadeInfer({"min_partition_samples": 16, "refine_interval_s": 0.2,
                                    "max_context_tokens": 4096})
            res = await run_workload(units, cascade, work, ttft_slo_s=2.0, tpot_slo_s=0.2, vocab=1024)
            assert not res.rejected and res.num_migrations >= 1
            want = {w.request_id: w for w in work}
            assert sorted(o.request_id for o in res.outcomes) == sorted(want)
            assert all(o.output_tokens == want[o.request_id].output_tokens for o in res.outcomes)
            assert all(o.prompt_tokens == want[o.request_id].prompt_tokens for o in res.outcomes)
            for u in units:
                assert u.load().num_running == u.load().num_waiting == 0
        finally:
            for u in units:
                await u.stop()

    asyncio.run(main())


def test_live_node_streams_migrations_and_stage_boundaries() -> None:
    """Through the hub, as ``trackside agent --engine vllm`` streams them: ``stage_boundaries`` when cascade's
    stages are installed, ``request_migrated`` (``handover:recompute``) for each hand-over."""
    async def main() -> None:
        units = [_unit(i) for i in range(3)]
        for u in units:
            u.start()
        cascade = CascadeInfer({"min_partition_samples": 1_000_000, "ema_alpha": 0.0, "rebalance": False})
        cascade.set_stages([0, 300, 131_072], [[0, 1], [2]])
        cluster = LiveCluster(units, cascade, ttft_slo_s=2.0, tpot_slo_s=0.2)
        work = [RequestSpec(f"r{i}", i * 0.02, 100 + 20 * i, 300 if i % 2 else 10) for i in range(6)]
        node = LiveClusterNode(cluster, [BATCH_POLICIES["vllm"]() for _ in units], requests=work, vocab=1024)
        hub = Hub(node, node_id="test-node", profile="cpu")
        hub.attach()
        done = asyncio.Event()
        serving = asyncio.get_running_loop().create_task(node.serve(done))
        try:
            await asyncio.wait_for(done.wait(), 60)
            events = hub.replay.since(0).events
            moved = [e for e in events if isinstance(e, RequestMigrated)]
            assert sorted(e.request_id for e in moved) == ["r1", "r3", "r5"]
            assert all(e.from_unit_id in (0, 1) and e.unit_id == 2 and e.reason == "handover:recompute"
                       for e in moved)
            stages = [e for e in events if isinstance(e, StageBoundaries)]
            assert stages and stages[0].boundaries_tokens == (300,)
            assert stages[0].stage_unit_ids == ((0, 1), (2,)) and stages[0].policy == "cascade"
            finished = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
            assert sorted(finished) == [w.request_id for w in work]
            assert all(finished[w.request_id].output_tokens == w.output_tokens for w in work)
            assert node.num_migrations == 3 and node.num_finished == 6
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await node.close()
            for u in units:
                await u.stop()

    asyncio.run(main())
