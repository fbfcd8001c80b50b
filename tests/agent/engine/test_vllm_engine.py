"""Whole vLLM engines on the CPU: ``AsyncLLM`` with its engine-core process, our scheduler inside it, the fake
executor instead of a GPU. Telemetry and control cross the process boundary over our zmq channel."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("vllm")

from agent.bench.vllm_runner import run_workload
from agent.engine.vllm.config import UnitSettings
from agent.engine.vllm.cpu import cpu_vllm_config
from agent.engine.vllm.fake_executor import FakeExecutor
from agent.engine.vllm.messages import Ping, SetParams, SetPolicy, StepMessage
from agent.engine.vllm.options import EngineOptions
from agent.engine.vllm.unit import VllmUnit
from agent.workload.types import RequestSpec
from policies.registry import DISPATCH_POLICIES
from policies.types import StepMode

pytestmark = pytest.mark.vllm


def _unit(unit_id: int, policy: str = "fairbatching", *, plain: bool = False, async_scheduling: bool = False
          ) -> VllmUnit:
    config = cpu_vllm_config(async_scheduling=async_scheduling, num_blocks=400, step_model=(0.002, 2e-6, 1e-8))
    return VllmUnit(unit_id, EngineOptions(model="tiny", max_num_batched_tokens=512, max_num_seqs=32, plain=plain),
                    UnitSettings(policy=policy), vllm_config=config, executor_class=FakeExecutor)


def _work(n: int, rate: float = 40.0) -> list[RequestSpec]:
    return [RequestSpec(f"q{i:03d}", i / rate, 50 + 13 * i % 300, 5 + 7 * i % 40) for i in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_two_units_under_a_dispatcher(async_scheduling: bool) -> None:
    async def main() -> None:
        units = [_unit(i, async_scheduling=async_scheduling) for i in range(2)]
        for u in units:
            u.start()
        try:
            work = _work(40)
            res = await run_workload(units, DISPATCH_POLICIES["least_loaded"](), work, ttft_slo_s=1.0,
                                     tpot_slo_s=0.1, vocab=1024)
            assert not res.rejected
            assert sorted(o.request_id for o in res.outcomes) == sorted(w.request_id for w in work)
            want = {w.request_id: w.output_tokens for w in work}
            assert all(o.output_tokens == want[o.request_id] for o in res.outcomes)
            assert all(o.first_token_s <= o.finish_s for o in res.outcomes)
            for u in units:
                recs = res.records[u.unit_id]
                assert recs, "step records crossed the process boundary"
                assert {r.policy for r in recs} == {"fairbatching"}
                assert [r.step_id for r in recs] == sorted(r.step_id for r in recs)
                assert sum(r.num_prefill_tokens for r in recs) >= sum(
                    o.prompt_tokens for o in res.outcomes if o.unit_id == u.unit_id)
                # every request it took was finished: nothing resident at the end
                assert u.load().num_running == u.load().num_waiting == 0
            assert {o.unit_id for o in res.outcomes} == {0, 1}
        finally:
            for u in units:
                await u.stop()

    asyncio.run(main())


def test_control_across_the_process_boundary() -> None:
    async def main() -> None:
        unit = _unit(0, "vllm")
        unit.start()
        try:
            # A busy engine answers at the top of its next step.
            run = asyncio.create_task(run_workload([unit], DISPATCH_POLICIES["round_robin"](), _work(30, rate=20),
                                                   ttft_slo_s=1.0, tpot_slo_s=0.1, vocab=1024))
            while not unit.records:
                await asyncio.sleep(0.01)
            reply = await unit.control(SetPolicy(name="sarathi", params={"token_budget": 128}))
            assert reply.ok and reply.policy == "sarathi"
            bad = await unit.control(SetParams(changes={"token_budget": -5}))
            assert not bad.ok and "token_budget" in bad.error
            res = await run
            policies = [r.policy for r in res.records[0]]
            assert policies[0] == "vllm" and policies[-1] == "sarathi"
            assert max(r.budget_tokens for r in res.records[0] if r.policy == "sarathi") == 128
            assert all(r.num_prefill_tokens + r.num_decode_tokens <= 128
                       for r in res.records[0] if r.policy == "sarathi")
        finally:
            await unit.stop()

    asyncio.run(main())


def test_plain_vllm_unit_serves_without_records() -> None:
    async def main() -> None:
        unit = _unit(0, plain=True)
        unit.start()
        try:
            res = await run_workload([unit], DISPATCH_POLICIES["round_robin"](), _work(10), ttft_slo_s=1.0,
                                     tpot_slo_s=0.1, vocab=1024)
            assert len(res.outcomes) == 10 and res.records[0] == []
            with pytest.raises(RuntimeError, match="plain"):
                unit.send_control(Ping())
        finally:
            await unit.stop()

    asyncio.run(main())


def test_idle_unit_reports_no_stale_admission_budget() -> None:
    """An idle engine does not step: the PAB of its last record is stale and must not steer a balancer."""
    unit = _unit(0)  # not started: load() reads only the last record and the front end's requests
    unit.last = StepMessage(
        unit_id=0, step_id=1, start_s=0.0, duration_s=0.01, predicted_s=0.01, mode=StepMode.PREFILL, policy="vllm",
        num_prefill_tokens=64, num_decode_tokens=0, num_prefill_reqs=1, num_decode_reqs=0, context_tokens=64,
        budget_tokens=512, kv_used_blocks=10, num_blocks=100, num_running=3, num_waiting=0, num_preempted=0,
        num_finished=0, plan_us=1.0, admission_budget=50.0, queued_prefill_tokens=0,
    )
    load = unit.load()
    assert load.prefill_admission_budget is None
    assert load.num_running == load.num_waiting == 0 and not load.busy
    unit.live["x"] = object()  # type: ignore[assignment]
    unit.submitted_prompt_since_record = 20
    load = unit.load()
    assert load.prefill_admission_budget == 30.0 and load.busy


def test_the_fake_executor_runs_a_launched_step_while_the_caller_goes_on() -> None:
    """A non-blocking ``execute_model`` returns at once and the step's time passes on the executor's thread, as a
    GPU runs a launched step, so async scheduling plans the next step while this one runs; a blocking call waits."""
    import time
    from types import SimpleNamespace

    step_s = 0.5
    executor = FakeExecutor(cpu_vllm_config(async_scheduling=True, step_model=(step_s, 0.0, 0.0)))
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), all_token_ids={}, num_computed_tokens=[])

    def output(rid: str) -> SimpleNamespace:
        new = SimpleNamespace(req_id=rid, prompt_token_ids=[1, 2, 3], num_computed_tokens=0, sampling_params=None)
        return SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                               num_scheduled_tokens={rid: 3}, total_num_scheduled_tokens=3)

    try:
        t = time.perf_counter()
        future = executor.execute_model(output("a"), non_block=True)
        launched_s = time.perf_counter() - t
        assert executor.sample_tokens(None, non_block=True) is future
        assert future.result().sampled_token_ids == [[7]]
        assert launched_s < step_s / 2 <= time.perf_counter() - t
        t = time.perf_counter()
        out = executor.execute_model(output("b"), non_block=False)
        assert time.perf_counter() - t >= step_s and out.sampled_token_ids == [[7]]
    finally:
        executor.shutdown()


def test_an_output_callback_that_raises_ends_its_request_alone() -> None:
    """A unit hands each output to its request in vLLM's own output handler, which serves every request: an error
    in one request's ``on_output`` must end that request (its task raises it, the engine aborts it) and leave the
    others, the handler and the unit running."""
    from agent.engine.vllm.sampling import TokenDelta

    async def main() -> None:
        unit = _unit(0, "vllm", async_scheduling=True)
        unit.start()
        try:
            got: dict[str, int] = {}

            def collect(rid: str, fail_at: int | None = None) -> Any:
                def on_output(delta: TokenDelta) -> None:
                    got[rid] = got.get(rid, 0) + len(delta.token_ids)
                    if fail_at is not None and got[rid] >= fail_at:
                        raise RuntimeError("a consumer broke")
                return on_output

            def submit(rid: str, fail_at: int | None = None) -> asyncio.Task[Any]:
                return unit.submit(rid, list(range(1, 40)), 12, arrival_s=0.0, ttft_slo_s=1.0, tpot_slo_s=0.1,
                                   on_output=collect(rid, fail_at))

            tasks = [submit("ok-1"), submit("bad", fail_at=3), submit("ok-2")]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert isinstance(results[1], RuntimeError)
            assert [r.output_tokens for r in (results[0], results[2])] == [12, 12]
            assert got["ok-1"] == got["ok-2"] == 12 and 3 <= got["bad"] < 12
            assert not unit.failed and "bad" not in unit.live
            after = await submit("after")
            assert after.output_tokens == 12
        finally:
            await unit.stop()

    asyncio.run(main())
