"""The console's state model and pure rendering functions, on hand-made events (no Textual, no sockets)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from agent.telemetry import (
    Alert,
    ControlAudit,
    Event,
    NodeHello,
    RequestFinished,
    RequestFirstToken,
    RequestRefused,
    Setting,
    StepEvent,
    UnitLoadEvent,
    UnitStatus,
)
from console.model.fleet import COLUMNS, fleet_rows
from console.model.metrics import METRIC_SPECS, METRICS, HeatMetric, next_metric
from console.model.queries import cell, heatmap, markers_in, summary, trend
from console.model.records import Connection, UnitState
from console.model.render import (
    bucket_index,
    fmt_age,
    fmt_si,
    gradient_stop,
    nice_ceiling,
    percentile,
    percentiles,
    scale_level,
    scale_range,
    sparkline,
    time_axis,
    window_buckets,
)
from console.model.series import BucketRing, FlowBucket, HeatBucket
from console.model.state import ConsoleState
from console.widgets.alert_list import alert_line
from console.widgets.cell_panel import cell_text
from policies.types import StepMode

S = 1_000_000_000
T0 = 1_800_000_000 * S
"""A bucket-aligned start (whole seconds)."""


# -- builders ------------------------------------------------------------------------------------------------------
def hello(node: str = "n1", *, units: int = 2, t: int = T0, modes: tuple[Any, ...] = ()) -> NodeHello:
    return NodeHello(
        node_id=node,
        time_ns=t,
        boot_ns=t,
        profile="h100-llama31-8b",
        dispatch_policy="least_loaded",
        dispatch_params={"alpha": 0.5},
        units=tuple(
            UnitStatus(
                unit_id=u,
                mode=modes[u] if u < len(modes) else "active",
                batch_policy="vllm",
                batch_params={"budget": 2048},
                num_blocks=100,
                max_num_seqs=10,
            )
            for u in range(units)
        ),
    )


def step(
    t: int,
    *,
    node: str = "n1",
    unit: int = 0,
    kv: int = 50,
    running: int = 4,
    measured_ms: float = 20.0,
    decode: int = 4,
    policy: str = "vllm",
) -> StepEvent:
    return StepEvent(
        node_id=node,
        time_ns=t,
        unit_id=unit,
        step_id=0,
        measured_ns=round(measured_ms * 1e6),
        predicted_ns=1,
        mode=StepMode.MIXED,
        policy=policy,
        num_prefill_tokens=0,
        num_decode_tokens=decode,
        num_prefill_reqs=0,
        num_decode_reqs=decode,
        context_tokens=0,
        budget_tokens=2048,
        kv_used_blocks=kv,
        num_blocks=100,
        num_running=running,
        num_waiting=0,
        num_preempted=0,
        num_finished=0,
    )


def load(
    t: int, *, node: str = "n1", unit: int = 0, queued: int = 300, pab: float | None = 512.0, healthy: bool = True
) -> UnitLoadEvent:
    return UnitLoadEvent(
        node_id=node,
        time_ns=t,
        unit_id=unit,
        dispatch_id=1,
        healthy=healthy,
        num_running=2,
        num_waiting=1,
        kv_used_blocks=20,
        num_blocks=100,
        kv_tokens=0,
        queued_prefill_tokens=queued,
        max_num_seqs=10,
        pab_tokens=pab,
    )


def finished(
    t: int, *, node: str = "n1", unit: int = 0, ttft: float = 100.0, tpot: float | None = 20.0, met: bool = True
) -> RequestFinished:
    return RequestFinished(
        node_id=node,
        time_ns=t,
        request_id=f"r{t}",
        unit_id=unit,
        arrival_ns=t,
        first_token_ns=t,
        prompt_tokens=10,
        output_tokens=5,
        num_preemptions=0,
        ttft_ms=ttft,
        tpot_ms=tpot,
        ttft_slo_ms=500.0,
        tpot_slo_ms=50.0,
        met_slo=met,
    )


def audit(
    t: int,
    action: Any,
    *,
    node: str = "n1",
    units: tuple[int, ...] = (1,),
    result: Any = "applied",
    old: tuple[Setting, ...] = (),
    new: tuple[Setting, ...] = (),
) -> ControlAudit:
    return ControlAudit(
        node_id=node, time_ns=t, actor="test", action=action, unit_ids=units, old=old, new=new, result=result
    )


def state_with(events: list[Event], **kwargs: Any) -> ConsoleState:
    state = ConsoleState(**kwargs)
    state.apply(events)
    return state


# -- pure functions ------------------------------------------------------------------------------------------------
def test_percentiles_match_numpy() -> None:
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 101):
        values = [rng.uniform(0, 1000) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(sorted(values), q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None
    assert percentiles([3.0, 1.0, 2.0], (50, 100)) == (2.0, 3.0)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_buckets_are_aligned_on_the_epoch_and_windows_cover_the_span() -> None:
    assert bucket_index(T0, S) == T0 // S
    assert bucket_index(T0 + S - 1, S) == T0 // S and bucket_index(T0 + S, S) == T0 // S + 1
    window = window_buckets(T0 + S // 2, 30 * S, S)
    assert len(window) == 30 and window[-1] == T0 // S
    assert len(window_buckets(T0, S // 2, S)) == 1


def test_colour_scale_levels_clamp_and_reverse() -> None:
    assert scale_level(0.0, 0, 1, 10) == 0
    assert scale_level(1.0, 0, 1, 10) == 9 and scale_level(5.0, 0, 1, 10) == 9 and scale_level(-1.0, 0, 1, 10) == 0
    assert scale_level(0.55, 0, 1, 10) == 5
    assert scale_level(0.0, 0, 1, 10, higher_is_worse=False) == 9  # no free capacity: the alarming end
    assert scale_level(float("nan"), 0, 1, 10) == 0 and scale_level(3.0, 2, 2, 10) == 0
    assert gradient_stop(0, 10) == (0, 0.0) and gradient_stop(9, 10) == (1, 1.0)
    assert [nice_ceiling(v) for v in (0, 0.7, 1, 13, 2.2, 180, 4999)] == [1.0, 1.0, 1.0, 20.0, 2.5, 200.0, 5000.0]
    assert scale_range([None, 3.0, 17.0], None) == (0.0, 20.0) and scale_range([5.0], 1.0) == (0.0, 1.0)
    assert scale_range([None], None) == (0.0, 1.0)


def test_sparklines_axes_and_numbers() -> None:
    assert sparkline([0.0, 4.0, 8.0, None], 6) == "  ▁▅█ "
    assert sparkline([0.0, 0.0], 2) == "▁▁" and sparkline([1.0], 0) == ""
    axis = time_axis(40, 1.0)
    assert len(axis) == 40 and axis.endswith("now") and "-10s" in axis and "-30s" in axis
    assert time_axis(40, 1.0, end_age_s=60).endswith("-60s")
    assert fmt_age(0) == "now" and fmt_age(300) == "-5m" and fmt_age(7200) == "-2h"
    assert [fmt_age(s) for s in (130, 179.6, 7500)] == ["-2m10s", "-3m", "-2h05m"]
    wide = time_axis(200, 1.0).split()
    assert len(wide) == len(set(wide)), "no two ticks of a wide axis read the same"
    assert [fmt_si(v) for v in (None, 7, 12.345, 1234.5, 2.5e6)] == ["-", "7", "12.3", "1.23k", "2.5M"]


def test_bucket_ring_keeps_a_bounded_history() -> None:
    ring: BucketRing[FlowBucket] = BucketRing(4, FlowBucket)
    for index in range(10, 20):
        bucket = ring.at(index)
        assert bucket is not None
        bucket.finished += index
    assert ring.newest == 19 and ring.oldest == 16 and len(ring) == 4
    assert [ring.get(i).finished for i in range(16, 20)] == [16, 17, 18, 19]  # type: ignore[union-attr]
    assert ring.get(15) is None and ring.at(15) is None and ring.at(3) is None, "older than the history: dropped"
    assert ring.get(25) is None
    recycled = ring.at(20)
    assert recycled is not None and recycled.finished == 0 and ring.get(16) is None
    heat = HeatBucket()
    heat.add(0, 2.0)
    heat.add(0, 4.0)
    assert heat.mean(0) == 3.0 and heat.maxes[0] == 4.0 and heat.mean(1) is None


def test_metric_catalogue() -> None:
    assert set(METRIC_SPECS) == set(HeatMetric) and len({s.key for s in METRIC_SPECS.values()}) == len(METRICS)
    assert next_metric(METRICS[-1]) == METRICS[0] and next_metric(METRICS[0], -1) == METRICS[-1]


# -- the state model -------------------------------------------------------------------------------------------------
def test_hello_sets_units_policies_and_modes() -> None:
    state = state_with([hello(units=3, modes=("active", "draining", "paused"))])
    node = state.nodes["n1"]
    assert node.dispatch_policy == "least_loaded" and node.dispatch_params == {"alpha": 0.5}
    assert [u.batch_policy for u in node.units.values()] == ["vllm"] * 3
    assert [state.unit_state(node, u) for u in node.units.values()] == [
        UnitState.RUNNING,
        UnitState.DRAINING,
        UnitState.PAUSED,
    ]
    state.apply([hello(units=2, t=T0 + S)])  # a restart with fewer units
    assert sorted(node.units) == [0, 1] and node.num_hellos == 2


def test_steps_and_loads_fill_the_heatmap_series() -> None:
    events: list[Event] = [
        hello(),
        step(T0, kv=40, running=2, measured_ms=10),
        step(T0 + S // 2, kv=60, running=6, measured_ms=30),
        load(T0 + S // 4, queued=300, pab=512.0),
        step(T0 + S, kv=80, running=8),
    ]
    state = state_with(events)
    first = cell(state, "n1", 0, T0 // S)
    assert first is not None
    values = first.values
    assert values[HeatMetric.KV] == pytest.approx((0.4 + 0.6 + 0.2) / 3)  # two steps and the load snapshot
    assert values[HeatMetric.BATCH] == pytest.approx((2 + 6 + 2) / 3)
    assert values[HeatMetric.STEP_TIME] == pytest.approx(20.0) and first.maxima[HeatMetric.STEP_TIME] == 30.0
    assert values[HeatMetric.QUEUED_PREFILL] == 300 and values[HeatMetric.PAB] == 512
    # capacity: the smaller of free KV and free sequence slots (max_num_seqs 10 from the hello)
    assert values[HeatMetric.CAPACITY] == pytest.approx((min(0.6, 0.8) + min(0.4, 0.4) + min(0.8, 0.8)) / 3)
    grid = heatmap(state, HeatMetric.KV, 3)
    assert grid.first_bucket == T0 // S - 1 and [(r.node_id, r.unit_id) for r in grid.rows] == [("n1", 0), ("n1", 1)]
    assert grid.rows[0].values[0] is None and grid.rows[0].values[2] == pytest.approx(0.8)
    assert grid.rows[1].values == (None, None, None)
    unit = state.nodes["n1"].units[0]
    assert unit.latest[HeatMetric.KV] == 0.8 and unit.latest[HeatMetric.PAB] == 512.0


def test_window_summary_rates_goodput_attainment_and_percentiles() -> None:
    rng = random.Random(1)
    ttfts = [rng.uniform(10, 900) for _ in range(60)]
    events: list[Event] = [hello()]
    for i, ttft in enumerate(ttfts):
        t = T0 + i * S // 6  # 60 requests over 10 s, alternating units
        events.append(finished(t, unit=i % 2, ttft=ttft, tpot=ttft / 10, met=ttft < 500))
        events.append(RequestFirstToken(node_id="n1", time_ns=t, request_id=f"r{i}", unit_id=i % 2, ttft_ms=ttft))
        events.append(step(t, unit=i % 2, decode=10))
    events.append(RequestRefused(node_id="n1", time_ns=T0 + 5 * S, request_id="x", policy="least_loaded"))
    state = state_with(events, window_s=30.0)
    state.tick(T0 + 10 * S)
    s = summary(state, "n1")
    assert s.window_s == pytest.approx(10.0), "a node seen for 10 s is not diluted over the 30 s window"
    met = sum(t < 500 for t in ttfts)
    assert s.num_finished == 60 and s.num_refused == 1
    assert s.requests_per_s == pytest.approx(6.0) and s.goodput_rps == pytest.approx(met / 10)
    assert s.slo_attainment == pytest.approx(met / 61)
    assert s.out_tokens_per_s == pytest.approx(60 * 11 / 10)
    assert s.ttft_p50_ms == pytest.approx(float(np.percentile(ttfts, 50)))
    assert s.ttft_p99_ms == pytest.approx(float(np.percentile(ttfts, 99)))
    assert s.tpot_p99_ms == pytest.approx(float(np.percentile([t / 10 for t in ttfts], 99)))
    unit0 = summary(state, "n1", 0)
    assert unit0.num_finished == 30 and unit0.ttft_p50_ms == pytest.approx(float(np.percentile(ttfts[::2], 50)))
    # the window slides: 40 s later nothing is left in it
    state.tick(T0 + 50 * S)
    quiet = summary(state, "n1")
    assert quiet.num_finished == 0 and quiet.out_tokens_per_s == 0 and quiet.slo_attainment is None
    assert quiet.ttft_p99_ms is None and quiet.window_s == pytest.approx(30.0, abs=1.0)


def test_trends_per_bucket() -> None:
    events: list[Event] = [hello(t=T0 + 2 * S)]
    events += [step(T0 + 2 * S, decode=10), step(T0 + 4 * S, decode=30), finished(T0 + 4 * S, ttft=80.0)]
    state = state_with(events)
    state.tick(T0 + 5 * S)
    tokens = trend(state, "n1", kind="out_tokens", num_buckets=5)
    assert tokens == [None, None, 10.0, 0.0, 30.0], "before the node was seen: None; quiet buckets: 0"
    assert trend(state, "n1", kind="ttft_p99", num_buckets=3) == [None, None, pytest.approx(80.0)]
    assert trend(state, "n1", 0, kind="goodput", num_buckets=1) == [1.0]


def test_many_nodes_are_kept_apart_and_grouped() -> None:
    events: list[Event] = [
        hello("b", units=1),
        hello("a", units=2),
        step(T0, node="a", unit=1, decode=7),
        step(T0, node="b", unit=0, decode=3),
        step(T0, node="a", unit=0),
    ]
    state = state_with(events)
    assert state.unit_keys() == [("b", 0), ("a", 0), ("a", 1)], "nodes in the order first seen, units by id"
    assert summary(state, "a").out_tokens_per_s == pytest.approx(11.0)
    assert summary(state, "b").out_tokens_per_s == pytest.approx(3.0)
    rows = fleet_rows(state)
    assert [r.key for r in rows] == ["node:b", "unit:b:0", "node:a", "unit:a:0", "unit:a:1"]
    assert all(len(r.cells) == len(COLUMNS) for r in rows)


def test_connection_states_come_from_the_feed() -> None:
    state = ConsoleState()
    state.set_connection("ws://a:1", Connection.CONNECTING)
    rows = fleet_rows(state)
    assert [(r.key, r.cell("state")) for r in rows] == [("source:ws://a:1", "connecting")], "a source with no node yet"
    state.set_connection("ws://a:1", Connection.LIVE)
    state.apply([hello("a"), step(T0, node="a")], source="ws://a:1")
    node = state.nodes["a"]
    assert node.source == "ws://a:1" and state.sources["ws://a:1"].node_ids == ["a"]
    assert state.node_connection(node) == Connection.LIVE
    assert {state.unit_state(node, u) for u in node.units.values()} == {UnitState.RUNNING}
    state.set_connection("ws://a:1", Connection.RECONNECTING, "retrying in 0.5 s")
    assert {state.unit_state(node, u) for u in node.units.values()} == {UnitState.RECONNECTING}
    assert [r.tone for r in fleet_rows(state)][:2] == ["warning", "warning"]
    state.set_connection("ws://a:1", Connection.RECONNECTING, "retrying in 0.5 s")  # unchanged: no second alert
    state.set_connection("ws://a:1", Connection.LIVE)
    state.set_connection("ws://a:1", Connection.OFFLINE, "unsupported_version")
    assert {state.unit_state(node, u) for u in node.units.values()} == {UnitState.OFFLINE}
    assert [(a.code, a.severity) for a in state.alerts] == [
        ("connection", "warning"),
        ("connection", "info"),
        ("connection", "error"),
    ]
    assert "unsupported_version" in state.alerts[-1].message and state.alerts[-1].node_id == "a"


def test_applied_audits_change_policies_and_leave_markers() -> None:
    swap = audit(
        T0 + 3 * S,
        "set_batch_policy",
        old=(Setting(unit_id=1, policy="vllm"),),
        new=(Setting(unit_id=1, policy="sarathi", params={"tbt_target_ms": 40}),),
    )
    params = audit(T0 + 4 * S, "set_params", units=(0,), new=(Setting(unit_id=0, params={"budget": 4096}),))
    dispatch = audit(
        T0 + 4 * S,
        "set_dispatch_policy",
        units=(),
        old=(Setting(policy="least_loaded"),),
        new=(Setting(policy="pab", params={"x": 1}),),
    )
    mode = audit(T0 + 5 * S, "set_unit_mode", units=(0,), new=(Setting(unit_id=0, mode="draining"),))
    rejected = audit(T0 + 5 * S, "set_batch_policy", result="rejected", new=(Setting(unit_id=1, policy="eb"),))
    state = state_with([hello(), step(T0), swap, params, dispatch, mode, rejected])
    node = state.nodes["n1"]
    assert node.units[1].batch_policy == "sarathi" and node.units[1].batch_params == {"tbt_target_ms": 40}
    assert node.units[0].batch_params == {"budget": 4096} and node.units[0].mode == "draining"
    assert node.dispatch_policy == "pab" and node.dispatch_params == {"x": 1}
    assert [m.text for m in state.markers] == [
        "u1 vllm -> sarathi",
        "u0 budget=4096",
        "dispatch least_loaded -> pab",
        "u0 -> draining",
    ], "the rejected change leaves no marker"
    assert len(state.audits) == 5
    by_bucket = markers_in(state, T0 // S, T0 // S + 10)
    assert sorted(by_bucket) == [T0 // S + 3, T0 // S + 4, T0 // S + 5]
    grid = heatmap(state, HeatMetric.KV, 6)  # buckets T0 .. T0+5
    assert sorted(grid.markers) == [3, 4, 5] and grid.markers[3][0].unit_ids == (1,)
    swap_cell = cell(state, "n1", 1, T0 // S + 3)
    assert swap_cell is not None and [m.text for m in swap_cell.markers] == ["u1 vllm -> sarathi"]
    other = cell(state, "n1", 0, T0 // S + 3)
    assert other is not None and other.markers == (), "a unit's marker shows on that unit only"
    assert "changed: set_batch_policy u1 vllm -> sarathi" in cell_text(swap_cell, HeatMetric.KV, T0 // S + 5, 1.0)


def test_history_and_logs_are_bounded() -> None:
    state = ConsoleState(history_buckets=10, max_alerts=5)
    events: list[Event] = [hello()]
    events += [step(T0 + i * S) for i in range(100)]
    events += [Alert(node_id="n1", time_ns=T0 + i, code="flow_control", message=f"a{i}") for i in range(20)]
    state.apply(events)
    ring = state.nodes["n1"].units[0].heat
    assert len(ring) == 10 and ring.newest == T0 // S + 99
    assert state.oldest_bucket == T0 // S + 90
    assert len(state.alerts) == 5 and state.num_alerts == 20 and state.alerts[-1].message == "a19"
    state.apply([step(T0 + 5 * S, kv=99)])  # far older than the history: dropped, nothing else disturbed
    assert cell(state, "n1", 0, T0 // S + 5) is not None
    assert cell(state, "n1", 0, T0 // S + 5).values[HeatMetric.KV] is None  # type: ignore[union-attr]
    assert state.nodes["n1"].units[0].latest[HeatMetric.KV] == 0.99, "latest values still follow"


def test_version_moves_only_on_change() -> None:
    state = ConsoleState()
    v = state.version
    state.apply([])
    state.tick(0)
    assert state.version == v
    state.apply([hello()])
    state.tick(T0 + S)
    assert state.version == v + 2


def test_text_of_cells_and_alerts() -> None:
    state = state_with([hello(), step(T0, kv=25), load(T0, queued=1500)])
    info = cell(state, "n1", 0, T0 // S)
    text = cell_text(info, HeatMetric.QUEUED_PREFILL, T0 // S + 2, 1.0)
    assert "n1 u0" in text and "(-2s)" in text and "queued prefill 1.5k tok" in text and "KV use" in text
    assert cell_text(None, HeatMetric.KV, 0, 1.0) == "no unit under the cursor"
    assert cell(state, "n1", 7, T0 // S) is None and cell(state, "zz", 0, 0) is None
    line = alert_line(state_with([Alert(node_id="n", time_ns=T0, code="gap", unit_id=3, message="lost")]).alerts[0])
    assert line.endswith("warning n u3 gap: lost")


def test_a_posted_alert_is_an_alert_not_a_policy_marker() -> None:
    posted = audit(T0 + S, "post_alert", units=())
    alert = Alert(node_id="n1", time_ns=T0 + S, code="recommendation", severity="info", message="sarathi would gain")
    state = state_with([hello(), alert, posted])
    assert not state.markers and len(state.audits) == 1
    assert [a.code for a in state.alerts] == ["recommendation"]
    swap = audit(T0 + 2 * S, "set_dispatch_policy", units=(), new=(Setting(policy="round_robin"),))
    state.apply([swap])
    assert [m.text for m in state.markers] == ["dispatch -> round_robin"]
