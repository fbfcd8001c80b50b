"""Baseline policies as plain functions over hand-made views: vllm, static, round_robin, least_loaded."""

from __future__ import annotations

import dataclasses

import pytest
from builders import rview, uview
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.batch.common import chunk, step_mode
from policies.params import ParamError, ParamSpec, parse_assignments, resolve_params
from policies.registry import (
    BATCH_POLICIES,
    DISPATCH_POLICIES,
    UnknownPolicyError,
    make_batch_policy,
    make_dispatch_policy,
)
from policies.types import PendingRequest, RequestView, ScheduledTokens, StepMode, UnitLoad, UnitView


def entries(plan: object) -> list[tuple[str, int]]:
    return [(e.request_id, e.num_tokens) for e in plan.entries]  # type: ignore[attr-defined]


def test_vllm_running_first_then_waiting_fcfs_with_chunking() -> None:
    running = [rview("d1", 100, computed=104, output=5), rview("p1", 3000, computed=1000)]
    waiting = [rview("w1", 600), rview("w2", 900)]
    plan = make_batch_policy("vllm").plan(uview(running, waiting, budget=2048), 0.0)
    # d1 decodes 1 token; p1 takes 2000 of its remaining 2000; w1 gets the last 47 tokens; w2 none.
    assert entries(plan) == [("d1", 1), ("p1", 2000), ("w1", 47)]
    assert plan.mode is StepMode.MIXED
    assert plan.running_order == ("d1", "p1")
    assert plan.reasons["admitted"] == 1
    assert plan.num_tokens == 2048


def test_vllm_respects_max_num_seqs_and_threshold() -> None:
    waiting = [rview(f"w{i}", 300) for i in range(5)]
    policy = make_batch_policy("vllm", {"long_prefill_token_threshold": "128"})
    plan = policy.plan(uview([], waiting, budget=4096, max_num_seqs=3), 0.0)
    assert entries(plan) == [("w0", 128), ("w1", 128), ("w2", 128)]
    assert plan.reasons["seq_cap_reached"] is True
    assert plan.mode is StepMode.PREFILL


def test_vllm_budget_parameter_lowers_the_budget() -> None:
    plan = make_batch_policy("vllm", {"max_num_batched_tokens": 256}).plan(uview([], [rview("w", 1000)]), 0.0)
    assert entries(plan) == [("w", 256)]
    assert plan.token_budget == 256


def test_static_waits_for_the_whole_batch() -> None:
    policy = make_batch_policy("static", {"batch_size": 2})
    first = policy.plan(uview([], [rview("a", 10), rview("b", 10), rview("c", 10)]), 0.0)
    assert entries(first) == [("a", 10), ("b", 10)]
    # While a batch runs, newcomers wait even though slots are free.
    running = [rview("a", 10, computed=10, output=1)]
    later = policy.plan(uview(running, [rview("c", 10)], max_num_seqs=8), 1.0)
    assert entries(later) == [("a", 1)]
    assert later.mode is StepMode.DECODE


def _static_reference(view: UnitView, batch_size: int) -> tuple[list[tuple[str, int]], StepMode, int]:
    """Static batching read straight from its rule with the shared helpers (``chunk``, ``step_mode``): the plan's
    entries, mode and admissions, for checking the policy's inlined loop."""
    budget, found, admitted = view.max_num_batched_tokens, [], 0
    if view.running:
        for req in view.running:
            if budget <= 0:
                break
            n = chunk(req, budget, view.max_model_len)
            if n:
                found.append(ScheduledTokens(req.request_id, n))
                budget -= n
    else:
        for req in view.waiting[:min(batch_size or view.max_num_seqs, view.max_num_seqs)]:
            n = chunk(req, budget, view.max_model_len) if budget > 0 else 0
            if n <= 0:
                break
            found.append(ScheduledTokens(req.request_id, n))
            budget -= n
            admitted += 1
    by_id = {r.request_id: r for r in (*view.running, *view.waiting)}
    return [(e.request_id, e.num_tokens) for e in found], step_mode(found, by_id), admitted


_REQUEST = st.tuples(st.integers(1, 3000), st.one_of(st.integers(0, 3), st.integers(0, 3100)), st.integers(0, 40))
"""(prompt, tokens still to compute, outputs) of a random request, decodes and nearly-decodes often."""


@settings(max_examples=300, deadline=None)
@given(running=st.lists(_REQUEST, max_size=12), waiting=st.lists(_REQUEST, max_size=12),
       budget=st.integers(1, 4096), max_len=st.integers(2, 3200), batch_size=st.integers(0, 6))
def test_static_plans_what_its_rule_says(running: list[tuple[int, int, int]], waiting: list[tuple[int, int, int]],
                                         budget: int, max_len: int, batch_size: int) -> None:
    def views(reqs: list[tuple[int, int, int]], tag: str) -> list[RequestView]:
        return [rview(f"{tag}{i}", p, computed=max(p + o - left, 0), output=o) for i, (p, left, o) in enumerate(reqs)]

    base = uview(views(running, "r"), views(waiting, "w"), budget=budget, max_num_seqs=8)
    view = dataclasses.replace(base, max_model_len=max_len)
    plan = make_batch_policy("static", {"batch_size": batch_size}).plan(view, 0.0)
    expected, mode, admitted = _static_reference(view, batch_size)
    assert entries(plan) == expected
    assert plan.mode is mode
    assert plan.reasons["admitted"] == admitted


def load(unit_id: int, waiting: int, running: int, healthy: bool = True) -> UnitLoad:
    return UnitLoad(unit_id, healthy, running, waiting, 0, 100, 0, 0)


def pending(n: int) -> list[PendingRequest]:
    return [PendingRequest(f"r{i}", 0.0, 100, 0.5, 0.05) for i in range(n)]


def test_round_robin_cycles_over_healthy_units() -> None:
    policy = make_dispatch_policy("round_robin")
    units = [load(0, 0, 0), load(1, 0, 0, healthy=False), load(2, 0, 0)]
    first = policy.dispatch(pending(3), units, 0.0)
    assert [u for _, u in first.assignments] == [0, 2, 0]
    second = policy.dispatch(pending(1), units, 1.0)
    assert [u for _, u in second.assignments] == [2]


def test_least_loaded_uses_vllm_score_and_spreads_a_burst() -> None:
    policy = make_dispatch_policy("least_loaded")
    # Scores: 4*1+0 = 4, 4*0+3 = 3, 4*0+5 = 5 -> unit 1 first; then its score is 7.
    units = [load(0, waiting=1, running=0), load(1, waiting=0, running=3), load(2, waiting=0, running=5)]
    decision = policy.dispatch(pending(3), units, 0.0)
    assert [u for _, u in decision.assignments] == [1, 0, 2]


def test_dispatch_with_no_healthy_unit_keeps_requests_pending() -> None:
    for name in ("round_robin", "least_loaded"):
        decision = make_dispatch_policy(name).dispatch(pending(2), [load(0, 0, 0, healthy=False)], 0.0)
        assert decision.assignments == () and decision.rejected == ()


def test_registry_errors_name_the_known_policies() -> None:
    with pytest.raises(UnknownPolicyError, match="least_loaded"):
        make_dispatch_policy("fastest")
    with pytest.raises(UnknownPolicyError, match="vllm"):
        make_batch_policy("nope")
    assert {"static", "vllm"} <= set(BATCH_POLICIES)
    assert {"round_robin", "least_loaded"} <= set(DISPATCH_POLICIES)


def test_params_are_validated() -> None:
    spec = ParamSpec("tau", "int", 512, "budget", unit="tokens", min=16, max=8192)
    assert resolve_params("p", [spec], {"tau": "1024"}) == {"tau": 1024}
    with pytest.raises(ParamError, match="below the minimum"):
        resolve_params("p", [spec], {"tau": 8})
    with pytest.raises(ParamError, match="expected int"):
        resolve_params("p", [spec], {"tau": "lots"})
    with pytest.raises(ParamError, match="has no parameter taus"):
        resolve_params("p", [spec], {"taus": 3})
    with pytest.raises(ParamError, match="name=value"):
        parse_assignments(["tau"])
    assert ParamSpec("on", "bool", False, "x").coerce("yes") is True


def test_live_parameter_update_keeps_old_values_on_error() -> None:
    policy = make_batch_policy("vllm")
    old = policy.update_params({"long_prefill_token_threshold": 64})
    assert old == {"long_prefill_token_threshold": 0}
    assert policy.threshold == 64  # type: ignore[attr-defined]
    with pytest.raises(ParamError):
        policy.update_params({"long_prefill_token_threshold": -1})
    assert policy.params["long_prefill_token_threshold"] == 64


def test_check_params_validates_without_changing_and_apply_params_takes_the_checked_values() -> None:
    policy = make_batch_policy("eb")
    before = dict(policy.params)
    checked = policy.check_params({"min_samples": "128"})
    assert checked == {"min_samples": 128}  # typed as the policy holds it
    assert policy.params == before  # checking changes nothing
    with pytest.raises(ParamError, match="cannot change while running"):
        policy.check_params({"window": 500})
    with pytest.raises(ParamError, match="below the minimum"):
        policy.check_params({"min_samples": 1})
    old = policy.apply_params(checked)
    assert old == {"min_samples": before["min_samples"]} and policy.params["min_samples"] == 128
    policy.apply_params(old)  # applying the old values undoes the change
    assert policy.params == before


def test_baselines_place_decode_hand_offs_by_their_own_rule() -> None:
    from policies.types import HandoffRequest

    decode = [_load(4, running=3), _load(5, running=0), _load(6, running=1, healthy=False)]
    hand = [HandoffRequest("a", 100, 90), HandoffRequest("b", 50, 40), HandoffRequest("c", 10, 9)]
    rr = make_dispatch_policy("round_robin")
    # The prefill pool's turn (units 0, 1) and the decode pool's turn do not disturb each other.
    first = rr.dispatch([PendingRequest("p", 0.0, 10, 1.0, 1.0)], [_load(0), _load(1)], 0.0)
    assert first.assignments == (("p", 0),)
    assert rr.place_decode(hand, decode, 0.0) == (("a", 4), ("b", 5), ("c", 4))
    second = rr.dispatch([PendingRequest("q", 0.0, 10, 1.0, 1.0)], [_load(0), _load(1)], 0.0)
    assert second.assignments == (("q", 1),)
    # least_loaded, score 4 * waiting + running over the healthy units: a -> 5 (0 < 3, then 5 scores 4),
    # b -> 4 (3 < 4, then 4 scores 7), c -> 5 (4 < 7).
    ll = make_dispatch_policy("least_loaded")
    assert ll.place_decode(hand, decode, 0.0) == (("a", 5), ("b", 4), ("c", 5))


def _load(unit: int, running: int = 0, healthy: bool = True) -> UnitLoad:
    return UnitLoad(unit, healthy, running, 0, 0, 100, 0, 0)
