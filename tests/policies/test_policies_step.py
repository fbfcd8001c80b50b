"""Per-step policies over hand-made views: sarathi, fairbatching, fairbatching+pab (formulas and behaviour)."""

from __future__ import annotations

import pytest
from builders import H100_LIKE, rview
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.batch.sarathi import budget_for_target
from policies.cost.step_model import StepCoefficients
from policies.params import ParamError
from policies.registry import make_batch_policy
from policies.types import RequestView, StepFeedback, StepMode, UnitView

EASY = StepCoefficients(0.01, 1e-4, 1e-6)
"""Round numbers for hand computations: a = 10 ms, b = 100 us, c = 1 us."""


def view(
    running: list[RequestView], waiting: list[RequestView] = [], *, cost: StepCoefficients = H100_LIKE,  # noqa: B006
    budget: int = 8192, max_num_seqs: int = 256,
) -> UnitView:
    return UnitView(0, 0, tuple(running), tuple(waiting), 16, 100_000, 100_000, budget, max_num_seqs, 16_384, cost)


def entries(plan: object) -> dict[str, int]:
    return {e.request_id: e.num_tokens for e in plan.entries}  # type: ignore[attr-defined]


def decode(rid: str, *, prompt: int = 100, output: int = 3, arrival: float = 0.0) -> RequestView:
    return rview(rid, prompt, computed=prompt + output - 1, output=output, arrival=arrival)


# -- sarathi -------------------------------------------------------------------------------------------
def test_sarathi_budget_from_tbt_target_by_hand() -> None:
    # tau = floor((T* - a - c*C) / (b + c)) = floor((0.05 - 0.01 - 1e-6*1000) / 1.01e-4) = floor(386.13...) = 386
    assert budget_for_target(EASY, 0.05, 1000, 8192) == 386
    assert budget_for_target(EASY, 0.05, 1000, 300) == 300  # the unit's hard cap wins
    assert budget_for_target(EASY, 0.005, 0, 8192) == 1  # a target below a: one token, never zero
    policy = make_batch_policy("sarathi", {"tbt_target_ms": 50, "reference_context_tokens": 1000})
    plan = policy.plan(view([], [rview("w", 5000)], cost=EASY), 0.0)
    assert entries(plan) == {"w": 386}
    assert plan.token_budget == 386


def test_sarathi_takes_every_decode_then_fills_with_prefill_fcfs() -> None:
    running = [decode(f"d{i}") for i in range(10)] + [rview("p", 3000, computed=1000)]
    waiting = [rview("w1", 200), rview("w2", 200)]
    plan = make_batch_policy("sarathi", {"token_budget": 300}).plan(view(running, waiting), 0.0)
    got = entries(plan)
    assert all(got[f"d{i}"] == 1 for i in range(10))
    assert got["p"] == 290 and "w1" not in got
    assert plan.mode is StepMode.MIXED and plan.reasons["decodes"] == 10


def test_sarathi_never_drops_decodes_even_over_budget() -> None:
    running = [decode(f"d{i}") for i in range(50)]
    plan = make_batch_policy("sarathi", {"token_budget": 16}).plan(view(running, [rview("w", 100)]), 0.0)
    assert len(entries(plan)) == 50 and "w" not in entries(plan)
    assert plan.reasons["decodes_over_budget"] == 34


unit_states = st.lists(
    st.tuples(st.booleans(), st.integers(1, 3000), st.integers(0, 50)), min_size=0, max_size=40
)


@settings(max_examples=80, deadline=None)
@given(state=unit_states, waiting=st.lists(st.integers(1, 4000), max_size=20), budget=st.integers(1, 4096))
def test_sarathi_never_leaves_a_decode_out(
    state: list[tuple[bool, int, int]], waiting: list[int], budget: int
) -> None:
    running = []
    for i, (is_decode, prompt, out) in enumerate(state):
        if is_decode:
            running.append(decode(f"r{i}", prompt=prompt, output=out + 1))
        else:
            running.append(rview(f"r{i}", prompt, computed=prompt // 2))
    wait = [rview(f"w{i}", p) for i, p in enumerate(waiting)]
    plan = make_batch_policy("sarathi", {"token_budget": budget}).plan(view(running, wait, max_num_seqs=64), 0.0)
    got = entries(plan)
    assert all(got.get(r.request_id) == 1 for r in running if r.is_decode)
    decodes = sum(1 for r in running if r.is_decode)
    assert plan.num_tokens <= max(budget, decodes)
    assert sorted(plan.running_order) == sorted(r.request_id for r in running)


# -- fairbatching ----------------------------------------------------------------------------------------
def test_fairbatching_urgent_decodes_first_and_non_urgent_held_during_a_burst() -> None:
    now = 10.0
    # Urgent: slack 0.01 s (< init 0.05 + min tpot 0.05). Relaxed: slack 0.45 s. A long prompt just arrived.
    urgent = rview("u", 100, computed=109, output=10, arrival=now + 0.01 - 0.5 - 0.05 * 10)
    relaxed = [rview(f"n{i}", 100, computed=100, output=1, arrival=now - 0.1) for i in range(3)]
    burst = rview("p", 8000, arrival=now - 0.05)
    plan = make_batch_policy("fairbatching", {"margin_floor": 0}).plan(view([urgent, *relaxed], [burst]), now)
    got = entries(plan)
    assert got["u"] == 1
    # The prefill chunk uses the rest of the time budget: (0.05 - a - cost(u)) / (b + c) tokens.
    a, b, c = H100_LIKE.a_s, H100_LIKE.b_s, H100_LIKE.c_s
    left = 0.05 - a - ((b + c) + c * 109)
    assert got["p"] == int(left // (b + c))
    assert not any(f"n{i}" in got for i in range(3))
    assert plan.reasons["decodes_held_back"] == 3
    assert plan.reasons["urgent_decodes_taken"] == 1
    assert plan.reasons["chunk_limited_by"] == "time"
    assert plan.reasons["held_back_min_slack_ms"] == pytest.approx(450.0)
    # Preemption victims come from the relaxed tail, not the urgent head.
    assert plan.running_order[0] == "u"


def test_fairbatching_takes_relaxed_decodes_when_there_is_room() -> None:
    now = 10.0
    relaxed = [rview(f"n{i}", 100, computed=100, output=1, arrival=now - 0.1) for i in range(3)]
    plan = make_batch_policy("fairbatching").plan(view(relaxed, [rview("p", 50, arrival=now)]), now)
    assert entries(plan) == {"n0": 1, "n1": 1, "n2": 1, "p": 50}
    assert plan.reasons["decodes_held_back"] == 0


def test_fairbatching_time_budget_uses_the_most_urgent_slack() -> None:
    now = 10.0
    # Every request has lots of slack (0.3 s): the step may last 0.3 s, so the whole prompt fits at once.
    reqs = [rview("p", 6000, arrival=now - 0.2)]
    plan = make_batch_policy("fairbatching").plan(view([], reqs), now)
    assert plan.reasons["time_budget_ms"] == pytest.approx((0.3 - H100_LIKE.a_s) * 1e3, abs=1e-3)
    assert entries(plan) == {"p": 6000}
    # A late request (negative slack) does not shrink the budget below one TPOT.
    late = [rview("p", 6000, arrival=now - 2.0)]
    plan = make_batch_policy("fairbatching").plan(view([], late), now)
    assert plan.reasons["time_budget_ms"] == pytest.approx((0.05 - H100_LIKE.a_s) * 1e3, abs=1e-3)


def test_first_token_anchor_tightens_deadlines_after_an_early_first_token() -> None:
    now = 10.0
    # First token at 9.95 after arriving at 9.9: the arrival envelope leaves 9.9 + 0.5 + 0.05 - 10 = 0.45 s;
    # the first-token anchor only 9.95 + 0.05 - 10 = 0.
    early = RequestView("e", 9.9, 100, 100, 1, 0.5, 0.05, 9.95, 0)
    arrival = make_batch_policy("fairbatching", {"anchor": "arrival"}).plan(view([early]), now)
    anchored = make_batch_policy("fairbatching", {"anchor": "first_token"}).plan(view([early]), now)
    default = make_batch_policy("fairbatching").plan(view([early]), now)  # the first-token anchor since 2026-11-26
    assert default.reasons["min_slack_ms"] == anchored.reasons["min_slack_ms"]
    assert arrival.reasons["min_slack_ms"] == pytest.approx(450.0)
    assert anchored.reasons["min_slack_ms"] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ParamError):
        make_batch_policy("fairbatching", {"anchor": "later"})


def test_prefill_admission_budget_by_hand() -> None:
    now = 1.0
    d1 = rview("d1", 100, computed=101, output=2, arrival=0.6)  # slack 0.6 + 0.5 + 0.1 - 1 = 0.2, L = 102
    d2 = rview("d2", 50, computed=59, output=10, arrival=0.0)  # slack 0.0, L = 60
    p1 = rview("p1", 300, arrival=0.9)  # waiting, slack 0.4, L = 300
    policy = make_batch_policy("fairbatching")
    plan = policy.plan(view([d1, d2], [p1], cost=EASY), now)
    # N = (0.5 - 0)/0.05 + 1 = 11; used = 11*a + 6*(b + 102c) + 10*(b + 60c) + 2*(b + 300c)
    used = 11 * 0.01 + 6 * (1e-4 + 102e-6) + 10 * (1e-4 + 60e-6) + 2 * (1e-4 + 300e-6)
    want = (0.5 - used) / 1.01e-4 - 300
    assert want == pytest.approx(3525.62, abs=0.01)
    assert policy.admission_budget_tokens() == pytest.approx(want)
    assert plan.reasons["pab_tokens"] == pytest.approx(want, abs=0.1)
    # Accepted prompts come off the exported budget until the next step recomputes it.
    assert policy.refuses(1000, EASY) is False
    assert policy.admission_budget_tokens() == pytest.approx(want - 1000)


def test_pab_variant_refuses_over_budget_and_resets_when_idle() -> None:
    policy = make_batch_policy("fairbatching+pab")
    # Before any step the unit is empty: budget (TTFT - a) / (b + c) = 0.49 / 1.01e-4 = 4851 tokens.
    assert policy.refuses(4900, EASY) is True
    assert policy.refuses(4000, EASY) is False
    assert policy.admission_budget_tokens() == pytest.approx(0.49 / 1.01e-4 - 4000)
    assert policy.refuses(900, EASY) is True
    d = rview("d", 100, computed=101, output=2, arrival=0.0)
    policy.plan(view([d], cost=EASY), 0.2)
    budget = policy.admission_budget_tokens()
    assert budget is not None and 0 < budget < 5000
    assert policy.refuses(int(budget) + 1, EASY) is True
    assert policy.refuses(int(budget) - 1, EASY) is False
    assert policy.refuses(10, EASY) is True  # the accepted prompt used the budget up
    policy.observe_step(StepFeedback(StepMode.DECODE, 0, 1, 102, 1, 0.01, 0.01, num_unfinished=0))
    assert policy.admission_budget_tokens() == pytest.approx((0.5 - 0.01) / 1.01e-4)
