"""FairBatching plans with the engine-loop term and a measured margin (issue 19, item 5).

The "truth" here is the simulator's step time without noise: ``a + b * new + c * ctx + d * num_requests``
(``agent.engine.timing.StepTimer`` with the profile's per-request loop overhead), computed from the plan.
"""

from __future__ import annotations

import math

from builders import rview
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import BatchPolicy
from policies.cost.step_model import StepCoefficients
from policies.registry import make_batch_policy
from policies.types import RequestView, StepFeedback, StepMode, StepPlan, UnitView

H100_LOOP = StepCoefficients(9.11e-3, 24.0e-6, 43.9e-9, 8.37e-6)
"""The H100 8B profile with its engine loop: 8.37 us per scheduled request (``loop_overhead_us_per_request``)."""
NO_LOOP = StepCoefficients(H100_LOOP.a_s, H100_LOOP.b_s, H100_LOOP.c_s)


def view(running: list[RequestView], waiting: list[RequestView], cost: StepCoefficients) -> UnitView:
    return UnitView(0, 0, tuple(running), tuple(waiting), 16, 100_000, 100_000, 8192, 1024, 16_384, cost)


def true_step_s(plan: StepPlan, reqs: list[RequestView], truth: StepCoefficients = H100_LOOP) -> float:
    """The step's duration under ``truth``: ctx counts each scheduled request's tokens after the step."""
    computed = {r.request_id: r.computed_tokens for r in reqs}
    new = sum(e.num_tokens for e in plan.entries)
    ctx = sum(computed[e.request_id] + e.num_tokens for e in plan.entries)
    return truth.predict_s(new, ctx, len(plan.entries))


def on_the_line(n: int, now: float, *, context: int = 300) -> list[RequestView]:
    """``n`` decodes whose next token is due exactly one TPOT (50 ms) from now: the step may last 50 ms."""
    out = 10
    # arrival + TTFT + TPOT * out = now + TPOT
    return [rview(f"d{i}", context - out + 1, computed=context, output=out, arrival=now + 0.05 - 0.5 - 0.05 * out)
            for i in range(n)]


def test_step_model_loop_term() -> None:
    assert H100_LOOP.predict_s(300, 90_000, 300) == NO_LOOP.predict_s(300, 90_000) + 300 * 8.37e-6
    assert H100_LOOP.predict_s(300, 90_000) == NO_LOOP.predict_s(300, 90_000)  # no count: the three-term model
    assert StepCoefficients(1.0, 2.0, 3.0).d_s == 0.0


def test_predicted_step_includes_the_loop_term() -> None:
    now = 10.0
    decodes = on_the_line(3, now)
    plan = make_batch_policy("fairbatching").plan(view(decodes, [], H100_LOOP), now)
    a, b, c, d = H100_LOOP.a_s, H100_LOOP.b_s, H100_LOOP.c_s, H100_LOOP.d_s
    want = a + 3 * (b + c * 301 + d)
    assert plan.reasons["predicted_step_ms"] == round(want * 1e3, 3)
    assert plan.reasons["loop_ms"] == round(3 * d * 1e3, 3)
    assert want == true_step_s(plan, decodes)


def test_many_small_decodes_stay_within_the_tpot_budget_only_with_the_loop_term() -> None:
    # 400 short decodes due in exactly one TPOT and a long prompt to fill the rest of the step: the planner fills
    # the 50 ms to the last token. Without the loop term the step really lasts 400 * 8.37 us = 3.3 ms longer,
    # and every one of the 400 tokens misses its deadline; with it the step ends in time.
    now = 10.0
    decodes = on_the_line(400, now)
    burst = [rview("p", 12_000, arrival=now - 0.1)]
    reqs = decodes + burst
    before = make_batch_policy("fairbatching", {"margin_quantile": 0}).plan(view(decodes, burst, NO_LOOP), now)
    after = make_batch_policy("fairbatching", {"margin_quantile": 0}).plan(view(decodes, burst, H100_LOOP), now)
    for plan in (before, after):
        assert plan.reasons["decodes_taken"] == 400 and plan.reasons["chunk_limited_by"] == "time"
    assert true_step_s(before, reqs) > 0.05 + 3e-3  # overran every decode's deadline
    assert true_step_s(after, reqs) <= 0.05
    assert 0.05 - true_step_s(after, reqs) < H100_LOOP.b_s + H100_LOOP.c_s  # and still filled to within a token
    assert after.reasons["predicted_step_ms"] == round(true_step_s(after, reqs) * 1e3, 3)


def feedback(plan: StepPlan, reqs: list[RequestView], slowdown: float) -> StepFeedback:
    """The step ran ``slowdown`` times the planner's own prediction."""
    computed = {r.request_id: r.computed_tokens for r in reqs}
    new = sum(e.num_tokens for e in plan.entries)
    ctx = sum(computed[e.request_id] + e.num_tokens for e in plan.entries)
    measured = H100_LOOP.predict_s(new, ctx, len(plan.entries)) * slowdown
    return StepFeedback(StepMode.MIXED, new, 0, ctx, len(plan.entries), measured, measured, num_unfinished=1)


def burst_on_the_line(now: float) -> tuple[list[RequestView], list[RequestView], list[RequestView]]:
    """100 decodes due in one TPOT and a 12,000-token prompt behind them (the step is filled to its deadline): the
    decodes, the burst, and both."""
    decodes = on_the_line(100, now)
    burst = [rview("p", 12_000, arrival=now - 0.1)]
    return decodes, burst, decodes + burst


def margin_ms(policy: BatchPolicy, decodes: list[RequestView], burst: list[RequestView], now: float) -> object:
    return policy.plan(view(decodes, burst, H100_LOOP), now).reasons["margin_ms"]


def expected_ms(rel: float) -> float:
    """The margin of a 50 ms deadline planned to end early by the relative error ``rel``."""
    return round(0.05 * rel / (1 + rel) * 1e3, 3)


def test_measured_margin_keeps_steps_in_time_when_they_run_long() -> None:
    # Steps run 4% longer than the model says (an engine cost the model lacks): after a window of such steps the
    # planner ends its steps early by that 4%, and the real step fits the deadline again.
    now = 10.0
    decodes, burst, reqs = burst_on_the_line(now)
    policy = make_batch_policy("fairbatching", {"margin_floor": 0})
    plan = policy.plan(view(decodes, burst, H100_LOOP), now)
    assert plan.reasons["margin_ms"] == 0.0 and true_step_s(plan, reqs) * 1.04 > 0.05
    for _ in range(16):
        policy.observe_step(feedback(plan, reqs, 1.04))
    plan = policy.plan(view(decodes, burst, H100_LOOP), now)
    assert plan.reasons["margin_ms"] == expected_ms(0.04)
    assert true_step_s(plan, reqs) * 1.04 <= 0.05 + 1e-12
    # Off: the paper's zero margin.
    off = make_batch_policy("fairbatching", {"margin_quantile": 0})
    off.plan(view(decodes, burst, H100_LOOP), now)
    for _ in range(16):
        off.observe_step(feedback(plan, reqs, 1.04))
    assert margin_ms(off, decodes, burst, now) == 0.0


def test_a_new_policy_takes_its_margin_from_its_first_measured_step() -> None:
    # A policy just started or hot-swapped has no errors yet. Before the fix it planned 16 steps to the deadline
    # itself (the margin was recomputed every 16 steps only), and on seed 003's metric the first requests of the
    # GPU's papers run failed by microseconds. Now each step refreshes the margin until the window holds 16.
    now = 10.0
    decodes, burst, reqs = burst_on_the_line(now)
    policy = make_batch_policy("fairbatching", {"margin_floor": 0})
    plan = policy.plan(view(decodes, burst, H100_LOOP), now)
    assert plan.reasons["margin_ms"] == 0.0
    policy.observe_step(feedback(plan, reqs, 1.04))
    assert margin_ms(policy, decodes, burst, now) == expected_ms(0.04)
    policy.observe_step(feedback(plan, reqs, 1.08))  # the window's largest error so far
    assert margin_ms(policy, decodes, burst, now) == expected_ms(0.08)
    # Once the window is full, the margin moves only every ``margin_refresh`` steps again.
    for _ in range(30):
        policy.observe_step(feedback(plan, reqs, 1.08))
    held = margin_ms(policy, decodes, burst, now)
    policy.observe_step(feedback(plan, reqs, 1.3))
    assert margin_ms(policy, decodes, burst, now) == held


def test_margin_floor_is_a_guard_band_from_the_first_step() -> None:
    now = 10.0
    decodes, burst, reqs = burst_on_the_line(now)
    floor = 0.01
    policy = make_batch_policy("fairbatching", {"margin_floor": floor})
    plan = policy.plan(view(decodes, burst, H100_LOOP), now)
    assert plan.reasons["margin_ms"] == expected_ms(floor)  # before any measured error
    policy.observe_step(feedback(plan, reqs, 1.002))  # errors below the floor: the floor holds
    assert margin_ms(policy, decodes, burst, now) == expected_ms(floor)
    policy.observe_step(feedback(plan, reqs, 1.04))  # above it: the measured error
    assert margin_ms(policy, decodes, burst, now) == expected_ms(0.04)
    # With the measured margin off (the paper's zero margin), the floor is off too.
    off = make_batch_policy("fairbatching", {"margin_floor": floor, "margin_quantile": 0})
    assert margin_ms(off, decodes, burst, now) == 0.0


def test_margin_is_capped_and_ignores_fast_steps() -> None:
    now = 10.0
    decodes = on_the_line(10, now)
    policy = make_batch_policy("fairbatching", {"margin_quantile": 1.0, "margin_floor": 0})
    plan = policy.plan(view(decodes, [], H100_LOOP), now)
    for _ in range(16):
        policy.observe_step(feedback(plan, decodes, 0.5))  # faster than predicted: no negative margin
    assert policy.plan(view(decodes, [], H100_LOOP), now).reasons["margin_ms"] == 0.0
    for _ in range(16):
        policy.observe_step(feedback(plan, decodes, 10.0))  # a stop-the-world pause: at most half the step
    assert policy.plan(view(decodes, [], H100_LOOP), now).reasons["margin_ms"] == round(0.05 / 3 * 1e3, 3)


unit_states = st.lists(st.tuples(st.booleans(), st.integers(1, 3000), st.integers(0, 40), st.floats(-0.2, 1.0)),
                       max_size=60)


@settings(max_examples=100, deadline=None)
@given(state=unit_states, waiting=st.lists(st.integers(1, 6000), max_size=10),
       d_us=st.floats(0.0, 50.0), now=st.floats(1.0, 5.0))
def test_planned_step_never_outlasts_its_time_budget_unless_urgent_decodes_alone_do(
    state: list[tuple[bool, int, int, float]], waiting: list[int], d_us: float, now: float
) -> None:
    cost = StepCoefficients(H100_LOOP.a_s, H100_LOOP.b_s, H100_LOOP.c_s, d_us * 1e-6)
    running = []
    for i, (is_decode, prompt, out, slack) in enumerate(state):
        if is_decode:  # next token (number out + 1) due ``slack`` seconds from now
            arrival = now + slack - 0.5 - 0.05 * (out + 1)
            running.append(rview(f"r{i}", prompt, computed=prompt + out, output=out + 1, arrival=arrival))
        else:
            running.append(rview(f"r{i}", prompt, computed=prompt // 2, arrival=now - 0.1))
    wait = [rview(f"w{i}", p, arrival=now - 0.01 * i) for i, p in enumerate(waiting)]
    if not running and not wait:
        return
    plan = make_batch_policy("fairbatching").plan(view(running, wait, cost), now)
    init = plan.reasons["time_budget_ms"] / 1e3 + cost.a_s  # type: ignore[operator]
    if plan.reasons["urgent_over_budget"] == 0:
        assert true_step_s(plan, running + wait, cost) <= init + 1e-9
    assert abs(plan.reasons["predicted_step_ms"] - true_step_s(plan, running + wait, cost) * 1e3) < 1e-3  # type: ignore[operator]


def test_an_empty_unit_plans_nothing_and_no_nan() -> None:
    # Nothing to plan: the predicted step was inf - inf (NaN) in the reasons, which JSON exports cannot carry.
    plan = make_batch_policy("fairbatching").plan(view([], [], H100_LOOP), 10.0)
    assert plan.entries == () and plan.reasons["predicted_step_ms"] == 0.0
    assert not any(isinstance(v, float) and math.isnan(v) for v in plan.reasons.values())
