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


def req(rid: str, prompt: int) -> PendingRequest:
    return PendingRequest(rid, 0.0, prompt, 1.0, 0.05)


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
    else:
        assert d.rejected == ("big",)
        assert d.reasons["held"] == 0
    assert d.next_check_s is None  # step reports wake the balancer


def test_recheck_timer_when_holding() -> None:
    d = PabBalancer({"recheck_ms": 50}).dispatch([req("big", 5000)], [unit(0, 10.0)], 1.0)
    assert d.next_check_s == pytest.approx(1.05)


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
    st.lists(st.integers(1, 10_000), max_size=10),
    st.sampled_from(["wait", "reject"]),
    st.integers(1, 4),
)
def test_every_request_placed_at_most_once_and_only_on_healthy_units(
    raw: list[tuple[bool, float | None, int, bool, str]], prompts: list[int], when_full: str, calls: int
) -> None:
    policy = PabBalancer({"when_full": when_full})
    pending = [req(f"r{i}", p) for i, p in enumerate(prompts)]
    seen: set[str] = set()
    for k in range(calls):
        units = [
            unit(i, pab, steps=k, running=n, waiting=n, busy=b, healthy=h, role=role)
            for i, (h, pab, n, b, role) in enumerate(raw)
        ]
        d = policy.dispatch(pending, units, float(k))
        placed = [rid for rid, _ in d.assignments]
        ids = {p.request_id for p in pending}
        assert len(placed) == len(set(placed)) and set(placed) <= ids
        assert not set(placed) & seen
        assert set(d.rejected) <= ids and not set(d.rejected) & set(placed)
        ok = {u.unit_id for u in units if u.healthy and u.role != "decode"}
        assert {unit_id for _, unit_id in d.assignments} <= ok
        # Budget never exceeded: on a busy unit with a budget (fresh each call: steps_done changes), the prompts
        # placed in one call sum to at most its reported budget (an idle unit may take one request beyond it).
        prompt_of = {p.request_id: p.prompt_tokens for p in pending}
        for u in units:
            if u.prefill_admission_budget is not None and (u.num_running or u.num_waiting or u.busy):
                spent = sum(prompt_of[rid] for rid, unit_id in d.assignments if unit_id == u.unit_id)
                assert spent == 0 or spent <= u.prefill_admission_budget
        seen |= set(placed)
        gone = set(placed) | set(d.rejected)
        pending = [p for p in pending if p.request_id not in gone]
