"""``sbs`` and its pure pieces on hand-made numbers: interval, readiness and watchdog, PBAA water-filling,
the IQR mask, decode placement and flow control (POLICIES.md 2.2, seed 000)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import place_min_batch
from policies.dispatch.placement import (
    StepTimeWindow,
    available_tokens,
    iqr_mask,
    place_iqr_lex,
    quartiles,
    sbs_interval_s,
    water_fill,
)
from policies.dispatch.sbs import StaggeredBatch
from policies.types import DispatchDecision, HandoffRequest, PendingRequest, UnitLoad

# T_fwd = 62.5 ms and N = 2 give I = 31.25 ms and a 312.5 ms watchdog: all exact in binary, so event times
# computed by hand compare equal.
T = 0.0625


def unit(
    uid: int,
    *,
    healthy: bool = True,
    role: str = "mixed",
    chunk: int = 1000,
    queued: int = 0,
    inflight: int = 0,
    waiting: int = 0,
    running: int = 0,
    busy: bool = False,
    steps: int = 0,
    kv_used: int = 0,
    kv_tokens: int = 0,
    last_step_s: float | None = None,
    mean_step_s: float | None = None,
) -> UnitLoad:
    return UnitLoad(
        unit_id=uid,
        healthy=healthy,
        num_running=running,
        num_waiting=waiting,
        kv_used_blocks=kv_used,
        num_blocks=100,
        kv_tokens=kv_tokens,
        queued_prefill_tokens=queued,
        last_step_s=last_step_s,
        mean_step_s=mean_step_s,
        role=role,
        steps_done=steps,
        busy=busy,
        inflight_tokens=inflight,
        chunk_tokens=chunk,
    )


def req(rid: str, prompt: int, *, hits: tuple[tuple[int, int], ...] = (), waited: int = 0) -> PendingRequest:
    return PendingRequest(rid, 0.0, prompt, 1.0, 0.05, cycles_waited=waited, prefix_hits=hits)


def sbs(**params: object) -> StaggeredBatch:
    base: dict[str, object] = {"default_step_ms": T * 1e3, "net_latency_ms": 0.0}
    base.update(params)
    return StaggeredBatch(base)  # type: ignore[arg-type]


def busy_unit(uid: int, steps: int = 0) -> UnitLoad:
    """A unit in the middle of a step with a queue: not quiescent, ready only by report or watchdog."""
    return unit(uid, busy=True, waiting=1, running=1, steps=steps)


# -- the interval and T_fwd ------------------------------------------------------------------------------
def test_interval_formula() -> None:
    assert sbs_interval_s(0.040, 0.002, 4) == pytest.approx(0.0105)
    assert sbs_interval_s(0.040, 0.0, 1) == pytest.approx(0.040)
    assert sbs_interval_s(0.040, 0.002, 0) is None


def test_step_window_mean_default_eviction_and_resize() -> None:
    w = StepTimeWindow(2, 0.030)
    assert w.mean_s == 0.030
    w.add(0.010)
    w.add(0.0)  # ignored: a zero step would make the interval zero
    w.add(float("inf"))  # ignored
    assert w.mean_s == pytest.approx(0.010)
    w.add(0.020)
    w.add(0.040)  # evicts 0.010
    assert w.mean_s == pytest.approx(0.030)
    w.resize(1)
    assert w.mean_s == pytest.approx(0.040)
    assert len(w) == 1


def test_interval_reacts_at_once_when_units_leave_and_come_back() -> None:
    policy = sbs()
    four = [unit(i) for i in range(4)]
    first = policy.dispatch([req("a", 100)], four, 0.0)
    assert first.reasons["fired"] is True
    assert first.reasons["interval_ms"] == pytest.approx(T / 4 * 1e3)
    # Buffered until the interval T/4 has elapsed; the node is asked to come back then.
    early = policy.dispatch([req("b", 100)], four, 0.01)
    assert early.assignments == ()
    assert early.reasons["wait"] == "interval"
    assert early.next_check_s == pytest.approx(T / 4)
    # Two units leave: I doubles at once, so the same time is now too early.
    two = [unit(0, healthy=False), unit(1, healthy=False), unit(2), unit(3)]
    t = T / 4 + 0.001
    later = policy.dispatch([req("b", 100)], two, t)
    assert later.assignments == ()
    assert later.reasons["interval_ms"] == pytest.approx(T / 2 * 1e3)
    assert later.next_check_s == pytest.approx(T / 2)
    # They come back: I = T/4 again, already elapsed: the cycle fires now.
    back = policy.dispatch([req("b", 100)], four, t)
    assert back.reasons["fired"] is True
    assert len(back.assignments) == 1


def test_no_healthy_unit_means_no_cycle() -> None:
    decision = sbs().dispatch([req("a", 100)], [unit(0, healthy=False)], 0.0)
    assert decision.assignments == ()
    assert decision.next_check_s is None
    assert decision.reasons["no_healthy_unit"] is True


def test_t_fwd_from_reports_then_from_the_window() -> None:
    policy = sbs()
    # No report yet: the units' mean step time (80 ms) beats the default; I = 80 / 2 = 40 ms.
    d = policy.dispatch([req("a", 100)], [unit(0, mean_step_s=0.08), unit(1, mean_step_s=0.08)], 0.0)
    assert d.reasons["interval_ms"] == pytest.approx(40.0)
    # Unit 0 reports a 20 ms step: the window (W = 32) now holds one sample: I = 20 / 2 = 10 ms.
    d = policy.dispatch(
        [req("b", 100)], [unit(0, steps=1, last_step_s=0.02, mean_step_s=0.08), unit(1, mean_step_s=0.08)], 0.001
    )
    assert d.reasons["interval_ms"] == pytest.approx(10.0)


# -- readiness, watchdog, degraded mode --------------------------------------------------------------------
def test_watchdog_resets_silent_units_and_degrades_to_fixed_interval() -> None:
    policy = sbs()
    units = [busy_unit(0), busy_unit(1)]  # they never report a step
    interval, watchdog = T / 2, 5 * T
    d = policy.dispatch([req("r0", 100)], units, 0.0)
    assert d.assignments == (("r0", 0),)
    d = policy.dispatch([req("r1", 100)], units, interval)
    assert d.assignments == (("r1", 1),)  # unit 0 is waiting for its report: only unit 1 is a candidate
    # The interval has elapsed but the target (unit 0) has not reported: wait for its watchdog.
    d = policy.dispatch([req("r2", 100)], units, 2 * interval)
    assert d.assignments == ()
    assert d.reasons["wait"] == "target_not_ready"
    assert d.next_check_s == watchdog
    assert d.reasons["watchdog_resets"] == 0
    assert d.reasons["degraded"] is False
    d = policy.dispatch([req("r2", 100)], units, watchdog)
    assert d.assignments == (("r2", 0),)
    assert d.reasons["watchdog_resets"] == 1
    assert d.reasons["degraded"] is True
    d = policy.dispatch([req("r3", 100)], units, watchdog + interval)  # unit 1's watchdog: armed at I
    assert d.assignments == (("r3", 1),)
    assert d.reasons["watchdog_resets"] == 2
    # Degraded: silent units are no longer waited for; one cycle per interval, no further resets.
    for i, t in enumerate([watchdog + 2 * interval, watchdog + 3 * interval, watchdog + 4 * interval]):
        d = policy.dispatch([req(f"s{i}", 100)], units, t)
        assert d.reasons["fired"] is True
        assert d.assignments == ((f"s{i}", i % 2),)
    assert d.reasons["watchdog_resets"] == 2
    assert d.reasons["degraded_units"] == 2
    # Unit 0 reports a step again: it leaves the degraded mode.
    d = policy.dispatch([req("x", 100)], [busy_unit(0, steps=1), busy_unit(1)], watchdog + 4.5 * interval)
    assert d.reasons["degraded_units"] == 1


def test_end_of_step_report_makes_the_target_ready() -> None:
    policy = sbs()
    interval = T / 2
    policy.dispatch([req("r0", 100)], [busy_unit(0), busy_unit(1)], 0.0)
    policy.dispatch([req("r1", 100)], [busy_unit(0), busy_unit(1)], interval)
    d = policy.dispatch([req("r2", 100)], [busy_unit(0), busy_unit(1)], 2 * interval)
    assert d.assignments == ()
    d = policy.dispatch([req("r2", 100)], [busy_unit(0, steps=1), busy_unit(1)], 2 * interval + 0.001)
    assert d.assignments == (("r2", 0),)
    assert d.reasons["watchdog_resets"] == 0


def test_quiescent_unit_is_ready_without_a_report() -> None:
    policy = sbs()
    policy.dispatch([req("r0", 100)], [busy_unit(0), busy_unit(1)], 0.0)
    policy.dispatch([req("r1", 100)], [busy_unit(0), busy_unit(1)], T / 2)
    # Unit 0 emptied its queue and is between steps (its step count is not reported): ready at once.
    d = policy.dispatch([req("r2", 100)], [unit(0), busy_unit(1)], T)
    assert d.assignments == (("r2", 0),)
    assert d.reasons["watchdog_resets"] == 0


def test_next_check_is_the_next_cycle_when_requests_are_held() -> None:
    policy = sbs()
    full = [unit(0, queued=1000)]  # C_avail = 0: nothing fits
    d = policy.dispatch([req("a", 100)], full, 0.5)
    assert d.reasons["fired"] is True
    assert d.assignments == ()
    assert d.next_check_s == pytest.approx(0.5 + T)
    d = policy.dispatch([req("a", 100)], full, 0.5 + T / 3)  # an arrival before then: no cycle, same wake-up
    assert d.reasons["fired"] is False
    assert d.next_check_s == pytest.approx(0.5 + T)


# -- PBAA water-filling ------------------------------------------------------------------------------------
def test_available_tokens() -> None:
    # A prefill unit in the middle of a 2048-token chunk with 2500 prompt tokens not yet computed (the node
    # counts the chunk in flight in both fields): 452 tokens wait for the next step, which has 1596 free.
    mid_chunk = unit(0, role="prefill", chunk=2048, inflight=2048, queued=2500, running=3)
    assert available_tokens(mid_chunk, 8192) == 1596
    assert available_tokens(mid_chunk, 8192, "literal") == 2048 - 2048 - 2500
    # A colocated unit also keeps one token of the next step per resident request (its next decode).
    colocated = unit(0, chunk=2048, inflight=300, queued=500, running=40)
    assert available_tokens(colocated, 8192) == 2048 - 200 - 40
    assert available_tokens(colocated, 8192, "literal") == 1248
    assert available_tokens(unit(0, chunk=0, queued=500), 8192) == 7692  # unknown chunk: the default


def test_sbs_headroom_model() -> None:
    units = [unit(0, role="prefill", inflight=1000, queued=1200, busy=True), unit(1, role="prefill", queued=900)]
    # next_step: unit 0 has 1000 - 200 = 800 free after its step, unit 1 has 100: unit 0 takes the request.
    assert sbs(place_on="healthy").dispatch([req("a", 300)], units, 0.0).assignments == (("a", 0),)
    # literal: unit 0 shows 1000 - 1000 - 1200 < 0; unit 1 (100 > 0) takes it.
    d = sbs(place_on="healthy", headroom="literal").dispatch([req("a", 300)], units, 0.0)
    assert d.assignments == (("a", 1),)


def test_water_fill_longest_first_to_the_most_headroom() -> None:
    new = [req("a", 500), req("b", 300), req("c", 700), req("d", 200)]
    result = water_fill([], new, [(0, 1000), (1, 600), (2, 800)])
    # c(700) -> 0 (1000 -> 300); a(500) -> 2 (800 -> 300); b(300) -> 1 (600 -> 300); d(200): three-way tie at
    # 300 -> the first listed, unit 0 (300 -> 100).
    assert result.assignments == (("c", 0), ("a", 2), ("b", 1), ("d", 0))
    assert result.capacity_left == ((0, 100), (1, 300), (2, 300))
    assert result.held == ()


def test_water_fill_in_arrival_order_keeps_the_order_given() -> None:
    new = [req("a", 500), req("b", 300), req("c", 700), req("d", 200)]
    result = water_fill([], new, [(0, 1000), (1, 600), (2, 800)], longest_first=False)
    # a(500) -> 0 (1000 -> 500); b(300) -> 2 (800 -> 500); c(700) -> 1, the least negative (600 -> -100);
    # d(200): tie at 300 between 0 and 2 -> the first listed, 0. Longest first gave c, a, b, d (the test above).
    assert result.assignments == (("a", 0), ("b", 2), ("c", 1), ("d", 0))
    assert not StaggeredBatch({"fill_order": "fcfs"}).longest_first
    assert StaggeredBatch().longest_first  # the paper's order by default


def test_water_fill_leftovers_go_first() -> None:
    capacity = [(0, 500), (1, 400)]
    # As one group: y(900) -> 0 (500 -> -400), then x(100) -> 1.
    assert water_fill([], [req("x", 100), req("y", 900)], capacity).assignments == (("y", 0), ("x", 1))
    # x left over from an earlier cycle: x(100) -> 0 (500 -> 400); y(900): tie 400/400 -> unit 0.
    assert water_fill([req("x", 100)], [req("y", 900)], capacity).assignments == (("x", 0), ("y", 0))


def test_water_fill_no_capacity_means_positive_headroom_only() -> None:
    # A prompt much longer than the headroom still goes to a unit with positive headroom (it is chunked there);
    # after it the unit has none and the next request waits.
    result = water_fill([], [req("big", 5000), req("small", 50)], [(0, 100)])
    assert result.assignments == (("big", 0),)
    assert result.held == ("small",)
    # A prompt longer than a whole chunk on an empty unit: placed, never held forever.
    assert water_fill([], [req("huge", 100_000)], [(0, 2048)]).assignments == (("huge", 0),)
    # Zero or negative headroom everywhere: everything waits.
    assert water_fill([], [req("a", 1)], [(0, 0), (1, -20)]).held == ("a",)


def test_water_fill_cache_aware() -> None:
    r = req("r", 600, hits=((1, 500),))
    # Basic: scores 1000-600=400 vs 900-600=300 -> unit 0.
    assert water_fill([], [r], [(0, 1000), (1, 900)]).assignments == (("r", 0),)
    # Cache-aware: 400 vs 900-(600-500)=800 -> unit 1, which loses only the 100 uncached tokens.
    result = water_fill([], [r, req("s", 400)], [(0, 1000), (1, 900)], cache_aware=True)
    assert result.assignments == (("r", 1), ("s", 0))
    assert result.capacity_left == ((0, 600), (1, 800))


def test_sbs_places_over_ready_units_starting_at_the_target() -> None:
    policy = sbs()
    units = [unit(0), unit(1), unit(2)]
    d = policy.dispatch([req("a", 100)], units, 0.0)
    assert d.assignments == (("a", 0),)  # all tied: the target (unit 0) first
    d = policy.dispatch([req("b", 100)], units, 1.0)
    assert d.assignments == (("b", 1),)  # the rotation moved on: the tie goes to unit 1


def test_sbs_leaves_decode_units_out_of_prefill_placement() -> None:
    units = [unit(0, role="prefill", queued=900), unit(1, role="decode")]
    d = sbs().dispatch([req("a", 100), req("b", 100)], units, 0.0)
    assert d.assignments == (("a", 0),)  # unit 0 has 100 tokens of headroom; the decode unit never takes one
    assert d.reasons["healthy_units"] == 1


def test_sbs_colocated_kv_outlier_mask() -> None:
    # KV usage 0.1, 0.1, 0.2, 0.2, 0.9: Q1 = 0.1, Q3 = 0.2, threshold 0.35 -> unit 4 is masked although it has
    # the most chunk headroom (1000 against 200).
    units = [unit(i, kv_used=u, queued=800) for i, u in enumerate([10, 10, 20, 20])] + [unit(4, kv_used=90)]
    d = sbs().dispatch([req("a", 150)], units, 0.0)
    assert d.assignments == (("a", 0),)
    assert d.reasons["masked_units"] == 1
    d = sbs(kv_mask=False).dispatch([req("a", 150)], units, 0.0)
    assert d.assignments == (("a", 4),)


# -- flow control --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["throttle", "reject"])
def test_flow_control_after_n_limit_cycles(mode: str) -> None:
    policy = sbs(n_limit=2, flow_control=mode)
    full = [unit(0, queued=1000)]
    # The node's call count (cycles_waited) is not the cycle count: many calls in one interval do not count.
    decisions = [policy.dispatch([req("a", 100, waited=50)], full, k * T) for k in range(3)]
    assert [d.flow_control + d.rejected for d in decisions[:2]] == [(), ()]
    last = decisions[2]
    assert last.assignments == ()
    if mode == "throttle":
        assert last.flow_control == ("a",)
        assert last.rejected == ()
        assert last.next_check_s == pytest.approx(3 * T)  # still pending: the next cycle
        # Capacity opens: the throttled request goes first, as a leftover, although it is the shorter one:
        # a(100) -> unit 0 (500 against 300, 500 -> 400); b(900) -> unit 0 (400 against 300).
        d = policy.dispatch([req("b", 900), req("a", 100)], [unit(0, queued=500), unit(1, queued=700)], 3 * T)
        assert d.assignments == (("a", 0), ("b", 0))
    else:
        assert last.rejected == ("a",)
        assert last.flow_control == ()
        assert last.next_check_s is None


# -- IQR mask and decode placement ---------------------------------------------------------------------
def test_iqr_mask_by_hand() -> None:
    # [0, 0, 10, 10, 30]: Q1 = 0, Q3 = 10, IQR = 10; k = 1.5 -> threshold 25 masks 30; k = 2 -> 30 kept.
    assert iqr_mask([0, 10, 30, 0, 10]) == (0, 1, 3, 4)
    assert iqr_mask([0, 10, 30, 0, 10], k=2.0) == (0, 1, 2, 3, 4)
    # [10, 11, 12, 13, 100]: Q1 = 11, Q3 = 13, threshold 16.
    assert iqr_mask([10.0, 12.0, 11.0, 13.0, 100.0]) == (0, 1, 2, 3)
    assert iqr_mask([]) == ()
    assert iqr_mask([7.0]) == (0,)


def test_iqr_mask_is_lifted_when_it_would_keep_nothing() -> None:
    # Q1 = 7.5, Q3 = 22.5: with k = -10 the threshold is -127.5, below every value: no mask.
    assert iqr_mask([0, 10, 20, 30], k=-10.0) == (0, 1, 2, 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=30))
def test_quartiles_match_numpy(values: list[float]) -> None:
    q1, q3 = quartiles(values)
    assert q1 == pytest.approx(float(np.percentile(values, 25)), abs=1e-6)
    assert q3 == pytest.approx(float(np.percentile(values, 75)), abs=1e-6)


def test_decode_placement_masks_the_kv_outlier_then_takes_the_lexicographic_minimum() -> None:
    units = [
        unit(0, running=2, kv_tokens=1000),
        unit(1, running=1, kv_tokens=1200),
        unit(2, running=1, kv_tokens=1100),
        unit(3, running=0, kv_tokens=9000),  # the smallest batch, but a KV outlier
    ]
    handoffs = [HandoffRequest("a", 300, 200), HandoffRequest("b", 500, 400), HandoffRequest("c", 100, 50)]
    # b(500): K = [1000, 1200, 1100, 9000], Q1 = 1075, Q3 = 3150, threshold 6262.5 -> unit 3 masked;
    #   min (B, K) of (2, 1000), (1, 1200), (1, 1100) -> unit 2, now (2, 1600).
    # a(300): Q1 = 1150, Q3 = 3450, threshold 6900 -> unit 3 masked; (2,1000), (1,1200), (2,1600) -> unit 1.
    # c(100): Q1 = 1375, Q3 = 3450, threshold 6562.5 -> unit 3 masked; (2,1000), (2,1500), (2,1600) -> unit 0.
    expected = (("b", 2), ("a", 1), ("c", 0))
    assert place_iqr_lex(handoffs, units) == expected
    assert sbs().place_decode(handoffs, units, 0.0) == expected
    # Without the mask (the base class's rule) the outlier would take the longest request.
    assert place_min_batch(handoffs, units)[0] == ("b", 3)
    # Unhealthy units are not candidates.
    assert place_iqr_lex(handoffs[1:2], [*units[:2], unit(2, healthy=False, running=1, kv_tokens=1100)]) == (("b", 1),)


# -- properties ------------------------------------------------------------------------------------------
units_strategy = st.lists(
    st.tuples(
        st.booleans(),  # healthy
        st.sampled_from(["mixed", "mixed", "prefill", "decode"]),
        st.integers(0, 4096),  # chunk
        st.integers(0, 6000),  # queued
        st.booleans(),  # busy
        st.integers(0, 3),  # waiting
        st.integers(0, 100),  # kv used blocks
        st.integers(0, 2),  # steps done
    ),
    min_size=0,
    max_size=6,
)


def build_units(raw: list[tuple[bool, str, int, int, bool, int, int, int]], bump: int) -> list[UnitLoad]:
    return [
        unit(i, healthy=h, role=r, chunk=c, queued=q, busy=b, waiting=w, kv_used=kv, steps=s + bump)
        for i, (h, r, c, q, b, w, kv, s) in enumerate(raw)
    ]


def check_decision(d: DispatchDecision, pending: list[PendingRequest], units: list[UnitLoad], now: float) -> None:
    ids = {p.request_id for p in pending}
    placed = [rid for rid, _ in d.assignments]
    assert len(placed) == len(set(placed)), "a request placed twice"
    assert set(placed) <= ids
    assert set(d.rejected) <= ids and not set(d.rejected) & set(placed)
    assert set(d.flow_control) <= ids - set(placed) - set(d.rejected)
    ok_units = {u.unit_id for u in units if u.healthy and u.role != "decode"}
    assert {unit_id for _, unit_id in d.assignments} <= ok_units, "placed on an unhealthy or decode unit"
    assert d.next_check_s is None or d.next_check_s > now


@settings(max_examples=150, deadline=None)
@given(
    units_strategy,
    st.lists(st.integers(1, 20_000), min_size=0, max_size=12),
    st.lists(st.floats(0.0, 0.2), min_size=1, max_size=6),
    st.sampled_from(["throttle", "reject"]),
    st.sampled_from(["ready", "healthy"]),
)
def test_every_request_placed_at_most_once_and_only_on_healthy_units(
    raw_units: list[tuple[bool, str, int, int, bool, int, int, int]],
    prompts: list[int],
    gaps: list[float],
    mode: str,
    place_on: str,
) -> None:
    policy = sbs(n_limit=1, flow_control=mode, place_on=place_on)
    pending = [req(f"r{i}", p, hits=((0, p // 2),)) for i, p in enumerate(prompts)]
    seen: set[str] = set()
    now = 0.0
    for k, gap in enumerate(gaps):
        now += gap
        units = build_units(raw_units, k)
        d = policy.dispatch(pending, units, now)
        check_decision(d, pending, units, now)
        placed = {rid for rid, _ in d.assignments}
        assert not placed & seen, "a request placed in two calls"
        seen |= placed
        gone = placed | set(d.rejected)
        pending = [p for p in pending if p.request_id not in gone]


def test_live_parameter_change_keeps_the_state() -> None:
    policy = sbs()
    policy.dispatch([req("r0", 100)], [busy_unit(0)], 0.0)
    policy.dispatch([req("r1", 100)], [busy_unit(0)], 5 * T)  # the watchdog resets unit 0
    assert policy.num_watchdog_resets == 1
    old = policy.update_params({"window": 4, "n_limit": 3, "default_step_ms": 2 * T * 1e3})
    assert old == {"window": 32, "n_limit": 8, "default_step_ms": T * 1e3}
    assert policy.num_watchdog_resets == 1
    # The last cycle was at 5T; with T_fwd doubled and one unit, the next one is due at 7T.
    d = policy.dispatch([req("r2", 100)], [busy_unit(0)], 6 * T)
    assert d.next_check_s == pytest.approx(7 * T)


def test_no_cycle_without_pending_requests() -> None:
    policy = sbs()
    d = policy.dispatch([], [unit(0)], 0.0)
    assert d.reasons["fired"] is False
    # The cadence is unchanged: the first request still fires at once.
    assert policy.dispatch([req("a", 100)], [unit(0)], 0.001).assignments == (("a", 0),)
