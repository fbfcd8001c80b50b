"""``pab``: FairBatching's admission-budget balancer on hand-made budgets (POLICIES.md 2.3, seed 003 3.4)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.dispatch.pab import PabBalancer
from policies.types import PendingRequest, UnitLoad


def unit(
    uid: int,
    pab: float | None,
    *,
    steps: int = 0,
    running: int = 1,
    waiting: int = 0,
    busy: bool = True,
    healthy: bool = True,
    role: str = "mixed",
) -> UnitLoad:
    """A unit with a budget; busy by default (an idle unit is a special case of the balancer)."""
    return UnitLoad(
        unit_id=uid,
        healthy=healthy,
        num_running=running,
        num_waiting=waiting,
        kv_used_blocks=0,
        num_blocks=100,
        kv_tokens=0,
        queued_prefill_tokens=0,
        prefill_admission_budget=pab,
        role=role,
        steps_done=steps,
        busy=busy,
    )


def idle(uid: int, pab: float | None) -> UnitLoad:
    return unit(uid, pab, running=0, waiting=0, busy=False)


def req(rid: str, prompt: int, *, arrival: float = 0.0, ttft: float = 1.0) -> PendingRequest:
    return PendingRequest(rid, arrival, prompt, ttft, 0.05)


def test_budgets_are_decremented_within_one_call() -> None:
    policy = PabBalancer()
    units = [unit(0, 1000.0), unit(1, 600.0)]
    d = policy.dispatch([req("r0", 700), req("r1", 500), req("r2", 200)], units, 0.0)
    # r0(700): only unit 0 covers it (1000 -> 300). r1(500): unit 0's copy is 300 now, unit 1's 600 covers it
    # (600 -> 100). r2(200): 300 against 100 -> unit 0 (300 -> 100).
    assert d.assignments == (("r0", 0), ("r1", 1), ("r2", 0))
    assert policy.local_budget(0) == 100.0
    assert policy.local_budget(1) == 100.0


def test_local_copy_is_refreshed_by_a_new_step_report() -> None:
    policy = PabBalancer()
    policy.dispatch([req("r0", 900), req("r1", 500)], [unit(0, 1000.0), unit(1, 600.0)], 0.0)
    # Same reports (no step since): the copies stay at 100 and 100, so 150 tokens fit nowhere: wait.
    d = policy.dispatch([req("r2", 150)], [unit(0, 1000.0), unit(1, 600.0)], 0.01)
    assert d.assignments == ()
    assert d.rejected == ()
    assert d.reasons["held"] == 1
    # Unit 1 finishes a step and reports the same budget: its copy is refreshed to 600.
    d = policy.dispatch([req("r2", 150)], [unit(0, 1000.0), unit(1, 600.0, steps=1)], 0.02)
    assert d.assignments == (("r2", 1),)
    assert policy.local_budget(1) == 450.0
    # A changed report is adopted too (a node that reads budgets afresh shows its own decrement).
    policy.dispatch([], [unit(0, 800.0), unit(1, 600.0, steps=1)], 0.03)
    assert policy.local_budget(0) == 800.0


@pytest.mark.parametrize("when_full", ["wait", "reject"])
def test_wait_or_reject_when_no_budget_covers_the_prompt(when_full: str) -> None:
    policy = PabBalancer({"when_full": when_full})
    d = policy.dispatch([req("big", 5000), req("small", 100)], [unit(0, 1000.0), unit(1, 2000.0)], 0.0)
    # small(100) goes to the largest budget; big(5000) fits nowhere.
    assert d.assignments == (("small", 1),)
    if when_full == "wait":
        assert d.rejected == ()
        assert d.reasons["held"] == 1
        assert d.next_check_s == 0.5  # its wait ends at half its TTFT SLO (1 s): the node asks again then
    else:
        assert d.rejected == ("big",)
        assert d.reasons["held"] == 0
        assert d.next_check_s is None  # nothing held


def test_recheck_timer_when_holding() -> None:
    d = PabBalancer({"recheck_ms": 50}).dispatch([req("big", 5000, arrival=1.0)], [unit(0, 10.0)], 1.0)
    assert d.next_check_s == pytest.approx(1.05)  # before the wait cap at 1.5
    d = PabBalancer({"recheck_ms": 0, "max_wait_ttft_frac": "inf"}).dispatch([req("big", 5000)], [unit(0, 10.0)], 1.0)
    assert d.next_check_s is None  # unbounded wait and no timer: only step reports wake the balancer


def test_idle_unit_takes_a_prompt_larger_than_its_budget() -> None:
    units = [idle(0, 300.0), unit(1, 200.0)]
    d = PabBalancer().dispatch([req("long", 5000), req("next", 100)], units, 0.0)
    # long: no budget covers 5000; unit 0 is idle, so it takes it. next(100): unit 0's copy is negative now,
    # unit 1 covers it.
    assert d.assignments == (("long", 0), ("next", 1))
    assert d.reasons["idle_overrides"] == 1
    d = PabBalancer({"idle_takes_any": False}).dispatch([req("long", 5000)], units, 0.0)
    assert d.assignments == ()


def test_units_without_a_budget() -> None:
    # Busy units without a budget are a fallback, scored like least_loaded: 4*waiting + running.
    units = [unit(0, None, waiting=1, running=0), unit(1, None, waiting=0, running=3), unit(2, 50.0)]
    d = PabBalancer().dispatch([req("a", 100), req("b", 100)], units, 0.0)
    # a: unit 2's 50 does not cover 100; scores 4 vs 3 -> unit 1 (now 4*1+3 = 7); b: 4 vs 7 -> unit 0.
    assert d.assignments == (("a", 1), ("b", 0))
    assert d.reasons["fallback_placements"] == 2
    # An idle unit without a budget is as free as a unit gets: it comes before a covering budget, once.
    d = PabBalancer().dispatch([req("a", 100), req("b", 100)], [unit(0, 1000.0), idle(1, None)], 0.0)
    assert d.assignments == (("a", 1), ("b", 0))


def test_unhealthy_and_decode_units_take_nothing() -> None:
    units = [unit(0, 9000.0, healthy=False), unit(1, 9000.0, role="decode"), unit(2, 100.0)]
    d = PabBalancer().dispatch([req("a", 50), req("b", 60)], units, 0.0)
    assert d.assignments == (("a", 2),)
    d = PabBalancer().dispatch([req("a", 50)], [unit(0, 9000.0, healthy=False)], 0.0)
    assert d.assignments == ()
    assert d.reasons["no_healthy_unit"] is True


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.one_of(st.none(), st.floats(-1000, 20_000, allow_nan=False)),
            st.integers(0, 3),
            st.booleans(),
            st.sampled_from(["mixed", "prefill", "decode"]),
        ),
        max_size=5,
    ),
    st.lists(st.tuples(st.integers(1, 10_000), st.floats(0.0, 3.0), st.floats(0.1, 2.0)), max_size=10),
    st.sampled_from(["wait", "reject"]),
    st.sampled_from([0.0, 0.25, 0.5, 1.0, float("inf")]),
    st.integers(1, 4),
)
def test_every_request_placed_at_most_once_and_only_on_healthy_units(
    raw: list[tuple[bool, float | None, int, bool, str]],
    reqs: list[tuple[int, float, float]],
    when_full: str,
    frac: float,
    calls: int,
) -> None:
    policy = PabBalancer({"when_full": when_full, "max_wait_ttft_frac": frac})
    pending = [req(f"r{i}", p, arrival=a, ttft=t) for i, (p, a, t) in enumerate(reqs)]
    prompt_of = {p.request_id: p.prompt_tokens for p in pending}
    deadline = {p.request_id: policy.wait_deadline_s(p) for p in pending}
    seen: set[str] = set()
    for k in range(calls):
        now = float(k)
        units = [
            unit(i, pab, steps=k, running=n, waiting=n, busy=b, healthy=h, role=role)
            for i, (h, pab, n, b, role) in enumerate(raw)
        ]
        d = policy.dispatch(pending, units, now)
        placed = [rid for rid, _ in d.assignments]
        ids = {p.request_id for p in pending}
        assert len(placed) == len(set(placed)) and set(placed) <= ids
        assert not set(placed) & seen
        assert set(d.rejected) <= ids and not set(d.rejected) & set(placed)
        ok = {u.unit_id for u in units if u.healthy and u.role != "decode"}
        assert {unit_id for _, unit_id in d.assignments} <= ok
        held = ids - set(placed) - set(d.rejected)
        if ok:
            # Bounded wait: a request past its cap is never held while some unit can take work.
            assert all(now < deadline[rid] for rid in held)
            if when_full == "wait" and held and frac != float("inf"):
                assert d.next_check_s == min(deadline[rid] for rid in held)
            aged = d.reasons["aged_fallbacks"]
            assert isinstance(aged, int) and aged <= sum(now >= deadline[rid] for rid in ids)
        # Budget never exceeded: on a busy unit with a budget (fresh each call: steps_done changes), the prompts
        # placed in one call within their wait sum to at most its reported budget (an idle unit may take one
        # request beyond it; a request past its wait goes to the fallback whatever the budgets say).
        for u in units:
            if u.prefill_admission_budget is not None and (u.num_running or u.num_waiting or u.busy):
                spent = sum(
                    prompt_of[rid] for rid, unit_id in d.assignments if unit_id == u.unit_id and now < deadline[rid]
                )
                assert spent == 0 or spent <= u.prefill_admission_budget
        seen |= set(placed)
        gone = set(placed) | set(d.rejected)
        pending = [p for p in pending if p.request_id not in gone]


# -- bounded wait (issue #19 item 9) ------------------------------------------------------------------------------
def test_smaller_requests_go_first_until_the_cap_then_the_large_one_is_placed() -> None:
    policy = PabBalancer()  # max_wait_ttft_frac 0.5: with TTFT 2 s, the wait ends 1 s after arrival
    big = req("big", 5000, ttft=2.0)
    units = [unit(0, 1000.0), unit(1, 2000.0)]
    d = policy.dispatch([big, req("s1", 100, arrival=0.1, ttft=2.0)], units, 0.1)
    assert d.assignments == (("s1", 1),)
    assert d.next_check_s == 1.0
    assert d.reasons["aged_fallbacks"] == 0
    # Steps go on, budgets stay below 5000: later small requests keep passing the large one before its cap.
    d = policy.dispatch(
        [big, req("s2", 100, arrival=0.5, ttft=2.0)], [unit(0, 1000.0, steps=1), unit(1, 2000.0, steps=1)], 0.999
    )
    assert d.assignments == (("s2", 1),)
    assert d.reasons["held"] == 1
    # At the cap the fallback places it on the largest remaining budget (unit 1: 2000 > 1000), in arrival order.
    d = policy.dispatch(
        [big, req("s3", 100, arrival=0.9, ttft=2.0)], [unit(0, 1000.0, steps=2), unit(1, 2000.0, steps=2)], 1.0
    )
    assert d.assignments == (("big", 1), ("s3", 0))
    assert d.reasons["aged_fallbacks"] == 1
    assert d.reasons["held"] == 0
    assert d.next_check_s is None
    assert policy.local_budget(1) == 2000.0 - 5000


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.0, 5.0),
    st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0]),
    st.floats(0.05, 5.0),
    st.lists(st.floats(0.0, 3.0), max_size=8),
)
def test_the_cap_bounds_the_wait_with_a_frozen_clock(
    arrival: float, frac: float, ttft: float, events: list[float]
) -> None:
    """A node asks at the arrival, at each step report (``events``, seconds after arrival) and at
    ``next_check_s``; the clock is only what it passes. A request that no budget covers is held at every call
    before arrival + frac * TTFT and placed exactly then, whatever the reports in between."""
    policy = PabBalancer({"max_wait_ttft_frac": frac})
    big = req("big", 10**6, arrival=arrival, ttft=ttft)
    cap = arrival + frac * ttft
    reports = sorted(arrival + e for e in events)
    now, timer, k = arrival, None, 0
    while True:
        units = [unit(0, 100.0, steps=k), unit(1, 50.0, steps=k)]
        d = policy.dispatch([big], units, now)
        if d.assignments:
            assert now == cap  # never earlier; never later either, the policy's timer fires at the cap
            assert d.assignments == (("big", 0),)  # the larger remaining budget
            assert d.reasons["aged_fallbacks"] == 1
            return
        assert now < cap
        assert d.reasons["held"] == 1 and d.next_check_s == cap
        # Asking again at the same instant changes nothing.
        assert policy.dispatch([big], units, now).assignments == ()
        timer = d.next_check_s
        later = [t for t in reports if t > now]
        now, k = min([*later, timer]), k + 1


@pytest.mark.parametrize(("fallback", "first"), [("largest_budget", 1), ("least_loaded", 0)])
def test_the_fallbacks(fallback: str, first: int) -> None:
    # unit 0: small budget, lightly loaded; unit 1: larger budget, more waiting requests.
    units = [unit(0, 100.0, waiting=0, running=2), unit(1, 800.0, waiting=1, running=1)]
    policy = PabBalancer({"fallback": fallback, "max_wait_ttft_frac": 0.0})
    d = policy.dispatch([req("a", 3000), req("b", 3000)], units, 0.0)
    # Both past their (zero) wait: the first goes by the rule, its prompt is counted, the second spreads.
    assert d.assignments == (("a", first), ("b", 1 - first))
    assert d.reasons["aged_fallbacks"] == 2
    assert d.reasons["fallback_placements"] == 0  # that count is for busy units without a budget (rule 2)


def test_reject_mode_does_not_wait() -> None:
    policy = PabBalancer({"when_full": "reject", "max_wait_ttft_frac": 10.0})
    d = policy.dispatch([req("big", 5000)], [unit(0, 100.0)], 0.0)
    assert d.rejected == ("big",)
    assert d.reasons["aged_fallbacks"] == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.floats(-500, 8000, allow_nan=False)), min_size=1, max_size=4),
    st.lists(st.lists(st.integers(1, 4000), max_size=5), min_size=1, max_size=4),
    st.floats(0.0, 1.0),
)
def test_requests_within_their_wait_are_placed_as_before(
    budgets: list[float | None], rounds: list[list[int]], frac: float
) -> None:
    """Until a request's wait ends, the default policy decides exactly what the unbounded one did."""
    default, unbounded = PabBalancer({"max_wait_ttft_frac": frac}), PabBalancer({"max_wait_ttft_frac": "inf"})
    pending: list[PendingRequest] = []
    for k, prompts in enumerate(rounds):
        now = 0.1 * k
        pending += [req(f"r{k}.{i}", p, arrival=now, ttft=2.0) for i, p in enumerate(prompts)]
        units = [unit(i, b, steps=k) for i, b in enumerate(budgets)]
        a, b = default.dispatch(pending, units, now), unbounded.dispatch(pending, units, now)
        if a.reasons["aged_fallbacks"]:
            return  # from here on the local copies differ, by design
        assert a.assignments == b.assignments and a.rejected == b.rejected
        assert {k: v for k, v in a.reasons.items() if k != "aged_fallbacks"} == {
            k: v for k, v in b.reasons.items() if k != "aged_fallbacks"
        }
        gone = {rid for rid, _ in a.assignments}
        pending = [p for p in pending if p.request_id not in gone]
