"""The hub's unit_load, request_preempted and slack_sample events, on small deterministic runs without sockets."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import TypeVar

import pytest
from builders import rview
from node_builders import make_unit, requests
from serve_harness import make_hub

from agent.bench.runner import BenchConfig
from agent.cli.serve import main as serve_main
from agent.cli.serve import make_node
from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.sim import SimUnit
from agent.runtime.events import NodeOrigin, slack_sample
from agent.runtime.node import Node
from agent.service.hub import Hub
from agent.telemetry import (
    Event,
    RequestDispatched,
    RequestFinished,
    RequestPreempted,
    SlackSample,
    StepEvent,
    UnitLoadEvent,
)
from agent.workload.spec import parse_workload
from agent.workload.types import RequestSpec
from policies.registry import make_dispatch_policy

BOOT_NS = 10**18
T = TypeVar("T")


def events(hub: Hub) -> list[Event]:
    return list(hub.replay.since(0).events)


def of(kind: type[Event], stream: Sequence[Event]) -> list:  # type: ignore[type-arg]
    return [e for e in stream if isinstance(e, kind)]


def node_of(units: Sequence[SimUnit], reqs: Sequence[RequestSpec], **hooks: object) -> Node:
    return Node(units, make_dispatch_policy("round_robin"), reqs, ttft_slo_s=0.5, tpot_slo_s=0.05,
                **hooks)  # type: ignore[arg-type]


def hub_of(node: Node, **kwargs: object) -> Hub:
    hub = Hub(node, node_id="n", profile="test", get_time_ns=lambda: BOOT_NS, **kwargs)  # type: ignore[arg-type]
    hub.attach()
    return hub


# -- unit_load ----------------------------------------------------------------------------------------------
def test_one_unit_load_per_unit_and_decision_showing_what_the_units_hold() -> None:
    hub = make_hub(units=2, workload="poisson:n=60,rate=40")
    hub.attach()
    hub.node.set_unit_mode(1, "paused")
    hub.node.advance(0.5)
    hub.node.set_unit_mode(1, "active")
    hub.node.run()
    stream = events(hub)
    loads = of(UnitLoadEvent, stream)
    num = hub.node.num_dispatches
    assert num >= 60 and len(loads) == 2 * num
    assert [(e.dispatch_id, e.unit_id) for e in loads] == [(d, u) for d in range(1, num + 1) for u in (0, 1)]
    on_units = 0  # dispatched and not yet finished, in stream order: what the units hold at each decision
    by_decision: dict[int, list[UnitLoadEvent]] = {}
    for e in stream:
        if isinstance(e, RequestDispatched):
            on_units += 1
        elif isinstance(e, RequestFinished):
            on_units -= 1
        elif isinstance(e, UnitLoadEvent):
            by_decision.setdefault(e.dispatch_id, []).append(e)
            if len(by_decision[e.dispatch_id]) == 2:
                pair = by_decision[e.dispatch_id]
                assert sum(x.num_running + x.num_waiting for x in pair) == on_units
                assert pair[0].time_ns == pair[1].time_ns
    first = by_decision[1]
    arrival_ns = hub.origin.ns(hub.node.arrivals[0].arrival_s)
    assert all(e.time_ns == arrival_ns and e.num_running == e.num_waiting == e.kv_used_blocks == 0 for e in first)
    assert first[0].num_blocks > 0 and first[0].max_num_seqs > 0 and first[0].mean_step_ns is None
    paused_until = hub.origin.ns(0.5)
    assert {e.healthy for e in loads if e.unit_id == 1 and e.time_ns < paused_until} == {False}
    assert all(e.healthy for e in loads if e.unit_id == 0 or e.time_ns > paused_until)


def test_unit_load_rate_limit_keeps_a_minimum_interval_per_unit() -> None:
    workload = parse_workload("poisson:n=200,rate=100", seed=1)
    every = hub_of(make_node(BenchConfig(units=2), workload))
    every.node.run()
    hub = hub_of(make_node(BenchConfig(units=2), workload), unit_load_min_interval_ms=100.0)
    hub.node.run()
    loads = of(UnitLoadEvent, events(hub))
    assert 0 < len(loads) < len(of(UnitLoadEvent, events(every))) // 3
    for unit in (0, 1):
        times = [e.time_ns for e in loads if e.unit_id == unit]
        assert times and min(b - a for a, b in pairwise(times)) >= 100_000_000


# -- request_preempted ---------------------------------------------------------------------------------------
def _tiny_kv_run(with_hub: bool) -> tuple[Node, Hub | None, list[StepRecord], list[RequestOutcome]]:
    steps: list[StepRecord] = []
    done: list[RequestOutcome] = []
    unit = make_unit(num_blocks=64, max_model_len=1024)  # 1024 tokens of KV: eight 200+300 requests must preempt
    node = node_of([unit], requests([(200, 300)] * 8), on_step=steps.append, on_finish=done.append)
    hub = None
    if with_hub:
        hub = hub_of(node)  # replaces the hooks: chain them
        node.on_step, node.on_finish = _both(steps.append, node.on_step), _both(done.append, node.on_finish)
    node.run()
    return node, hub, steps, done


def _both(first: Callable[[T], None], then: Callable[[T], None] | None) -> Callable[[T], None]:
    def call(item: T) -> None:
        first(item)
        if then is not None:
            then(item)

    return call


def test_preempted_events_match_the_sims_preemptions() -> None:
    node, hub, steps, done = _tiny_kv_run(with_hub=True)
    assert hub is not None and node.num_finished == 8
    stream = events(hub)
    preempted = of(RequestPreempted, stream)
    by_step = {(s.unit_id, s.step_id): s for s in steps}
    expected = Counter({key: s.num_preempted for key, s in by_step.items() if s.num_preempted})
    assert sum(expected.values()) >= 3, "the tiny cache must force preemptions"
    assert Counter((e.unit_id, e.step_id) for e in preempted) == expected
    assert Counter(e.request_id for e in preempted) == Counter(
        {o.request_id: o.num_preemptions for o in done if o.num_preemptions}
    )
    step_start = {(e.unit_id, e.step_id): e.time_ns for e in of(StepEvent, stream)}
    assert all(e.time_ns == step_start[(e.unit_id, e.step_id)] for e in preempted)
    seqs = {id(e): e.seq for e in stream}
    step_seq = {(e.unit_id, e.step_id): e.seq for e in of(StepEvent, stream)}
    assert all(seqs[id(e)] > step_seq[(e.unit_id, e.step_id)] for e in preempted), "after their step's event"


def test_hooks_default_to_none_and_change_nothing() -> None:
    node = node_of([make_unit()], requests([(10, 2)]))
    assert node.on_dispatch is None and node.on_preempt is None and node.on_request is None
    plain, _, plain_steps, plain_done = _tiny_kv_run(with_hub=False)
    hooked, _, hooked_steps, hooked_done = _tiny_kv_run(with_hub=True)
    assert plain_steps == hooked_steps and plain_done == hooked_done
    assert plain.num_dispatches == hooked.num_dispatches == 8, "one decision per arrival"


# -- slack_sample --------------------------------------------------------------------------------------------
def test_slack_hand_checked_for_one_request() -> None:
    # Every step lasts 1 s. Both requests arrive at 0.25 and prefill in the step 0.25-1.25, which samples their
    # first output token; the first sample is at that step's end (1.25 s).
    reqs = [RequestSpec("a", 0.25, 100, 3), RequestSpec("b", 0.25, 100, 3, ttft_slo_ms=10_000.0)]
    hub = hub_of(node_of([make_unit()], reqs), slack_sample_ms=250.0)
    hub.node.run()
    samples = of(SlackSample, events(hub))
    assert [s.time_ns - BOOT_NS for s in samples] == [1_250_000_000, 2_250_000_000, 3_250_000_000]
    first = samples[0]
    assert (first.unit_id, first.sample_period_ms) == (0, 250.0)
    a, b = first.requests  # least slack first
    # a: deadline of its token 1 = arrival 0.25 + TTFT SLO 0.5 + TPOT SLO 0.05 * 1 = 0.80 s; slack 0.80 - 1.25.
    assert (a.request_id, a.deadline_ns - BOOT_NS, a.output_tokens, a.computed_tokens) == ("a", 800_000_000, 1, 100)
    assert a.slack_ms == pytest.approx(-450.0)
    # b: 0.25 + 10 + 0.05 = 10.30 s; slack 9050 ms.
    assert (b.request_id, b.deadline_ns - BOOT_NS, b.slack_ms) == ("b", 10_300_000_000, pytest.approx(9050.0))
    # Second sample (2.25 s): token 2 of a is due at 0.85 s.
    assert samples[1].requests[0].slack_ms == pytest.approx(-1400.0) and samples[1].requests[0].output_tokens == 2
    assert samples[2].requests == (), "both finished at 3.25 s"

    capped = hub_of(node_of([make_unit()], reqs), slack_max_requests=1)
    capped.node.run()
    assert [[p.request_id for p in s.requests] for s in of(SlackSample, events(capped))] == [["a"], ["a"], []]


def test_at_most_one_slack_sample_per_unit_and_period() -> None:
    hub = make_hub(units=2, workload="poisson:n=100,rate=40")
    hub.attach()
    hub.node.run()
    samples = of(SlackSample, events(hub))
    periods = [(s.time_ns - hub.boot_ns) // 250_000_000 for s in samples if s.unit_id == 0]
    assert len(periods) > 5 and periods == sorted(set(periods))
    assert [s.unit_id for s in samples] == [0, 1] * len(periods)
    assert any(s.requests for s in samples) and all(len(s.requests) <= 64 for s in samples)
    assert all(
        [p.slack_ms for p in s.requests] == sorted(p.slack_ms for p in s.requests) for s in samples
    )


def test_sampling_off_emits_no_slack_sample() -> None:
    reqs = [RequestSpec("a", 0.25, 100, 3)]
    hub = hub_of(node_of([make_unit()], reqs), slack_sample_ms=0.0)
    hub.node.run()
    assert hub.node.num_finished == 1 and not of(SlackSample, events(hub))


def test_slack_sample_keeps_the_least_slack() -> None:
    views = [rview(f"r{i}", 100, output=k, arrival=0.0) for i, k in enumerate((5, 1, 9, 3))]
    sample = slack_sample(7, views, NodeOrigin("n", BOOT_NS), 1.0, sample_period_ms=100.0, max_requests=2)
    assert [p.request_id for p in sample.requests] == ["r1", "r3"]
    assert [p.slack_ms for p in sample.requests] == pytest.approx([-450.0, -350.0])


def test_agent_refuses_a_negative_slack_period(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_main(["agent", "--workload", "poisson:n=1", "--slack-sample-ms", "-1"]) == 2
    assert "--slack-sample-ms" in capsys.readouterr().err


# -- dispatch across units: migrations, stage boundaries, dispatcher alerts -----------------------------------
def test_migrations_and_faults_become_request_migrated_events() -> None:
    from agent.telemetry import RequestMigrated

    units = [make_unit(0), make_unit(1)]
    node = node_of(units, requests([(8, 10)] * 4))
    hub = hub_of(node)
    node.advance(3.5)
    moved = {rid for rid, s in node.states.items() if s.unit_id == 0}
    node.fail_unit(0)
    node.run()
    migrated = of(RequestMigrated, events(hub))
    lost = [e for e in migrated if e.unit_id is None]
    assert {e.request_id for e in lost} == moved
    assert all(e.from_unit_id == 0 and e.reason == "fault:lost" for e in lost)
    # ... and each is dispatched again to the surviving unit right after.
    again = [e for e in of(RequestDispatched, events(hub)) if e.request_id in moved and e.unit_id == 1]
    assert {e.request_id for e in again} == moved


def test_cascade_publishes_stage_boundaries_when_they_change() -> None:
    from agent.telemetry import StageBoundaries

    units = [make_unit(k) for k in range(4)]
    reqs = requests([(16 if i % 2 else 4000, 20) for i in range(80)], [0.01 * i for i in range(80)])
    node = Node(units, make_dispatch_policy("cascade", {"min_partition_samples": 8, "repartition_interval_s": 0.5}),
                reqs, ttft_slo_s=5, tpot_slo_s=1)
    hub = hub_of(node)
    node.run()
    stages = of(StageBoundaries, events(hub))
    assert stages, "no stage_boundaries event"
    for e in stages:
        assert e.policy == "cascade"
        assert len(e.stage_unit_ids) == len(e.boundaries_tokens) + 1
        assert sorted(u for group in e.stage_unit_ids for u in group) == [0, 1, 2, 3]
        assert list(e.boundaries_tokens) == sorted(e.boundaries_tokens)
    assert all(a.boundaries_tokens != b.boundaries_tokens or a.stage_unit_ids != b.stage_unit_ids
               for a, b in pairwise(stages))


def test_dispatcher_watchdog_resets_and_held_requests_become_alerts() -> None:
    from typing import ClassVar

    from agent.telemetry import Alert, AlertCode
    from policies.base import DispatchPolicy
    from policies.types import DispatchDecision

    class Holding(DispatchPolicy):
        """Holds every request twice (reporting it), counts one watchdog reset per call, then places it."""

        name: ClassVar[str] = "holding"

        def configure(self) -> None:
            self.calls = 0

        def dispatch(self, pending, units, now_s):  # type: ignore[no-untyped-def]
            self.calls += 1
            reasons = {"watchdog_resets": self.calls}
            held = tuple(p.request_id for p in pending if p.cycles_waited < 2)
            go = tuple((p.request_id, 0) for p in pending if p.cycles_waited >= 2)
            return DispatchDecision(assignments=go, flow_control=held, reasons=reasons,
                                    next_check_s=now_s + 0.1 if held else None)

    node = Node([make_unit(0)], Holding(), requests([(8, 2)]), ttft_slo_s=5, tpot_slo_s=1)
    hub = hub_of(node)
    node.run()
    alerts = of(Alert, events(hub))
    held = [a for a in alerts if a.code == AlertCode.REQUESTS_HELD]
    resets = [a for a in alerts if a.code == AlertCode.WATCHDOG_RESET]
    assert len(held) == 2 and all(a.num_dropped == 1 for a in held)
    assert len(resets) == 3  # one per dispatcher call whose count grew


# -- request_finished ----------------------------------------------------------------------------------------
def test_request_finished_carries_the_worst_per_token_tpot_the_unit_tracked() -> None:
    from builders import H100_LIKE

    def stalled(**hooks: object) -> Node:  # r000 decodes when an 8,000-token prompt takes a ~200 ms step
        return node_of([make_unit(0, cost=H100_LIKE, max_num_batched_tokens=8192)],
                       requests([(100, 200), (8000, 5)], arrivals=[0.0, 0.03]), **hooks)

    done: list[RequestOutcome] = []
    stalled(on_finish=done.append).run()
    hub = hub_of(stalled())
    hub.node.run()
    finished = {e.request_id: e for e in of(RequestFinished, events(hub))}
    for o in done:
        e = finished[o.request_id]
        assert o.max_tpot_s is not None and e.max_tpot_ms == pytest.approx(o.max_tpot_s * 1e3)
        assert e.met_slo == o.meets_slo("worst")
    r0 = finished["r000"]
    assert r0.tpot_ms is not None and r0.max_tpot_ms is not None and r0.max_tpot_ms > 4 * r0.tpot_ms
    assert r0.tpot_ms < 50.0 < r0.max_tpot_ms and not r0.met_slo  # the mean would have met the 50 ms target
