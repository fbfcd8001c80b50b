"""The simulated unit's continuous-batching mechanics, on hand-made and generated workloads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from node_builders import make_unit, requests, run_node

from agent.engine.base import SubmittedRequest
from agent.engine.sim import PlanError
from policies.base import BatchPolicy
from policies.types import ScheduledTokens, StepMode, StepPlan, UnitView

TUTORIAL_OUTPUTS = (20, 40, 15, 30, 10)


@pytest.mark.parametrize(("policy", "iterations"), [("static", 70), ("vllm", 45)])
def test_tutorial_static_vs_continuous(policy: str, iterations: int) -> None:
    # Tutorial (seed 004): five tickets, three slots, outputs 20/40/15/30/10.
    unit = make_unit(policy=policy, max_num_seqs=3)
    node, steps, done = run_node([unit], requests([(8, o) for o in TUTORIAL_OUTPUTS]))
    assert len(steps) == iterations
    assert node.now_s == pytest.approx(iterations)
    finish = {o.request_id: o.finish_s for o in done}
    if policy == "vllm":
        # T3 ends at 15 and T4 takes its slot; T1 ends at 20 and T5 takes its slot.
        assert finish == {"r000": 20, "r001": 40, "r002": 15, "r003": 45, "r004": 30}
    else:
        assert finish == {"r000": 20, "r001": 40, "r002": 15, "r003": 70, "r004": 50}


def test_chunked_prefill_respects_budget_and_first_token_time() -> None:
    unit = make_unit(max_num_batched_tokens=512)
    _, steps, done = run_node([unit], requests([(1200, 3)]))
    # 1200 prompt tokens in chunks of 512, 512, 176; the last chunk samples token 1, then two decodes.
    assert [s.new_tokens for s in steps] == [512, 512, 176, 1, 1]
    assert done[0].first_token_s == pytest.approx(3.0)
    assert done[0].finish_s == pytest.approx(5.0)
    assert done[0].tpot_s == pytest.approx(1.0)


def test_decodes_go_first_then_prefill_fills_the_rest() -> None:
    unit = make_unit(max_num_batched_tokens=100)
    reqs = requests([(10, 50), (300, 2)], arrivals=[0.0, 2.0])
    _, steps, _ = run_node([unit], reqs)
    step = next(s for s in steps if s.start_s == 2.0)
    assert step.num_decode_tokens == 1 and step.num_prefill_tokens == 99
    assert step.mode is StepMode.MIXED


def test_preemption_by_recompute_when_kv_runs_out() -> None:
    # 12 blocks of 16 tokens = 192 token slots; three requests grow past that together.
    unit = make_unit(num_blocks=12, max_num_batched_tokens=512)
    _, steps, done = run_node([unit], requests([(40, 60), (40, 60), (40, 60)]))
    assert sum(s.num_preempted for s in steps) > 0
    assert sorted(o.request_id for o in done) == ["r000", "r001", "r002"]
    assert all(s.kv_used_blocks <= 12 for s in steps)
    assert unit.free_blocks == 12
    assert all(o.output_tokens == 60 for o in done)


def test_preemption_victim_is_the_most_recently_admitted() -> None:
    unit = make_unit(num_blocks=12, max_num_batched_tokens=512)
    for r in requests([(40, 60), (40, 60), (40, 60)]):
        unit.submit(SubmittedRequest(r.request_id, 0.0, r.prompt_tokens, r.output_tokens, 1.0, 1.0), 0.0)
    t = 0.0
    victims: list[str] = []
    while unit.has_work() and not victims:
        duration = unit.begin_step(t)
        assert duration is not None
        t += duration
        victims = list(unit.end_step(t).preempted)
    # vLLM's FCFS policy pops the tail of the running list: the last admitted request.
    assert victims == ["r002"]
    assert [r.spec.request_id for r in unit.waiting] == ["r002"]


def test_whole_prompt_admission_gate() -> None:
    # 20 blocks = 320 tokens: a 300-token prompt fits only once the first request has freed its blocks.
    unit = make_unit(num_blocks=20, max_num_batched_tokens=64)
    _, steps, done = run_node([unit], requests([(200, 5), (300, 5)]))
    first = {o.request_id: o for o in done}
    assert first["r001"].first_token_s > first["r000"].finish_s - 1e-9
    assert sum(s.num_preempted for s in steps) == 0


def test_max_num_seqs_caps_running() -> None:
    unit = make_unit(max_num_seqs=2)
    _, steps, _ = run_node([unit], requests([(8, 5)] * 5))
    assert max(s.num_running for s in steps) <= 2
    assert max(s.num_prefill_reqs + s.num_decode_reqs for s in steps) <= 2


class _Greedy(BatchPolicy):
    name = "greedy-bad"

    def plan(self, unit: UnitView, now_s: float) -> StepPlan:
        entries = tuple(ScheduledTokens(r.request_id, r.pending_tokens) for r in unit.waiting)
        return StepPlan(entries, tuple(r.request_id for r in unit.running), StepMode.PREFILL, 10**9)


def test_plan_over_the_token_budget_is_refused() -> None:
    unit = make_unit(max_num_batched_tokens=100)
    unit.set_policy(_Greedy())
    for r in requests([(80, 2), (80, 2)]):
        unit.submit(SubmittedRequest(r.request_id, 0.0, r.prompt_tokens, r.output_tokens, 1.0, 1.0), 0.0)
    with pytest.raises(PlanError, match="above max_num_batched_tokens"):
        unit.begin_step(0.0)


workloads = st.lists(
    st.tuples(st.integers(1, 700), st.integers(1, 40), st.floats(0.0, 30.0, allow_nan=False)),
    min_size=1, max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(
    workload=workloads,
    num_units=st.integers(1, 3),
    budget=st.sampled_from([32, 128, 1024]),
    num_blocks=st.integers(50, 400),
    max_num_seqs=st.integers(1, 8),
    policy=st.sampled_from(["vllm", "static", "sarathi", "fairbatching", "fairbatching+pab", "eb", "eb+"]),
    dispatch=st.sampled_from(["round_robin", "least_loaded"]),
)
def test_invariants_hold_on_random_workloads(
    workload: list[tuple[int, int, float]], num_units: int, budget: int, num_blocks: int, max_num_seqs: int,
    policy: str, dispatch: str,
) -> None:
    units = [
        make_unit(k, policy, num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
        for k in range(num_units)
    ]
    reqs = requests([(p, o) for p, o, _ in workload], arrivals=[t for _, _, t in workload])
    node, steps, done = run_node(units, reqs, dispatch)
    # Every request finishes exactly once, with exactly its output length, or (admission control only) is
    # refused and counted.
    refused = [rid for rid, s in node.states.items() if s.rejected]
    assert sorted([o.request_id for o in done] + refused) == sorted(r.request_id for r in reqs)
    assert len(refused) == node.num_refused
    if policy != "fairbatching+pab":
        assert not refused
    want = {r.request_id: r.output_tokens for r in reqs}
    assert all(o.output_tokens == want[o.request_id] for o in done)
    assert not node.unfinished()
    for s in steps:
        assert 0 < s.new_tokens <= budget
        assert s.kv_used_blocks <= num_blocks
        assert s.num_running <= max_num_seqs
    # KV is back to empty on every unit; nothing left queued.
    for u in units:
        assert u.free_blocks == u.num_blocks
        assert u.queued_prefill_tokens == 0
        assert not u.has_work()
    # Causality: first token after arrival, finish after first token.
    for o in done:
        assert o.arrival_s <= o.first_token_s <= o.finish_s


def test_same_seed_same_result_with_noise() -> None:
    def once(seed: int) -> list[tuple[str, float]]:
        units = [make_unit(k, noise_sigma=0.1, seed=seed * 10 + k) for k in range(2)]
        reqs = requests([(100 + 13 * i, 5 + i % 7) for i in range(40)], arrivals=[0.3 * i for i in range(40)])
        _, _, done = run_node(units, reqs, "least_loaded")
        return sorted((o.request_id, o.finish_s) for o in done)

    assert once(1) == once(1)
    assert once(1) != once(2)


def test_the_units_snapshots_put_each_value_in_its_field() -> None:
    """``SimUnit.view`` and ``SimUnit.load`` build ``UnitView`` and ``UnitLoad`` positionally (their ``__init__`` is
    Python; keywords cost more): every field must still hold what its name says, with distinct values throughout."""
    unit = make_unit(3, block_size=32, num_blocks=777, max_num_batched_tokens=555, max_num_seqs=11, max_model_len=999,
                     role="decode")
    unit.instance = 5
    unit.submit(SubmittedRequest("a", 0.0, 40, 4, 0.5, 0.05), 0.0)
    unit.submit(SubmittedRequest("b", 0.0, 70, 4, 0.5, 0.05), 0.0)
    view = unit.view()
    assert (view.unit_id, view.step_index, view.block_size, view.num_blocks, view.free_blocks) == (
        3, unit.step_index, 32, 777, unit.free_blocks)
    assert (view.max_num_batched_tokens, view.max_num_seqs, view.max_model_len) == (555, 11, 999)
    assert [r.request_id for r in view.waiting] == ["a", "b"] and view.running == ()
    assert view.cost == unit.cost_model.coefficients and view.mixed_interference == unit.mixed_interference
    load = unit.load(with_requests=True)
    assert (load.unit_id, load.healthy, load.num_running, load.num_waiting) == (3, True, 0, 2)
    assert (load.kv_used_blocks, load.num_blocks, load.kv_tokens, load.queued_prefill_tokens) == (
        777 - unit.free_blocks, 777, 0, unit.queued_prefill_tokens)
    assert (load.last_step_s, load.mean_step_s, load.max_num_seqs, load.role, load.steps_done, load.busy) == (
        unit.last_step_s, None, 11, "decode", 0, False)
    assert (load.chunk_tokens, load.block_size, load.migrations_inflight, load.instance) == (555, 32, 0, 5)
    assert load.prefill_admission_budget == unit.policy.admission_budget_tokens()
    assert [r.request_id for r in load.requests] == ["a", "b"]
