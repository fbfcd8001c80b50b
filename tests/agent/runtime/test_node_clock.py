"""The node under a wall clock (injected time, so no real sleeping) and its event ordering."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from node_builders import make_unit, requests

from agent.runtime.clock import WallClock
from agent.runtime.node import Node
from policies.base import DispatchPolicy
from policies.registry import make_dispatch_policy
from policies.types import DispatchDecision, PendingRequest, UnitLoad


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


@pytest.mark.parametrize("speed", [1.0, 4.0])
def test_wall_clock_paces_node_time(speed: float) -> None:
    fake = FakeTime()
    unit = make_unit()
    reqs = requests([(8, 3), (8, 2)], arrivals=[0.0, 10.0])
    node = Node([unit], make_dispatch_policy("round_robin"), reqs, ttft_slo_s=1.0, tpot_slo_s=1.0)
    node.run(WallClock(speed, monotonic=fake.monotonic, sleep=fake.sleep))
    # Steps of 1 s: request 0 runs 0..3, request 1 arrives at 10 and runs 10..12. Real time = node time / speed.
    assert node.now_s == pytest.approx(12.0)
    assert fake.t - 100.0 == pytest.approx(12.0 / speed)
    assert sum(fake.sleeps) == pytest.approx(12.0 / speed)


def test_run_until_stops_and_resumes_without_losing_requests() -> None:
    unit = make_unit()
    reqs = requests([(8, 5)] * 4, arrivals=[0.0, 1.0, 2.0, 30.0])
    node = Node([unit], make_dispatch_policy("least_loaded"), reqs, ttft_slo_s=1.0, tpot_slo_s=1.0)
    node.run(until_s=5.0)
    assert not node.done and node.num_finished < 4
    node.run()
    assert node.done and node.num_finished == 4 and not node.unfinished()


def test_requests_arriving_at_the_same_instant_share_the_first_step() -> None:
    unit = make_unit()
    steps = []
    node = Node(
        [unit], make_dispatch_policy("round_robin"), requests([(8, 2)] * 3), ttft_slo_s=1.0, tpot_slo_s=1.0,
        on_step=steps.append,
    )
    node.run()
    assert steps[0].num_prefill_reqs == 3


class _HoldThenRelease(DispatchPolicy):
    """Holds everything until ``release_at``, asking to be woken then; optionally wants step reports."""

    name = "hold-test"

    def __init__(self, release_at: float, step_reports: bool) -> None:
        super().__init__()
        self.release_at = release_at
        self.wants_step_reports = step_reports  # type: ignore[misc]
        self.calls: list[float] = []

    def dispatch(
        self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float
    ) -> DispatchDecision:
        self.calls.append(now_s)
        if now_s < self.release_at:
            return DispatchDecision(next_check_s=self.release_at)
        return DispatchDecision(assignments=tuple((p.request_id, 0) for p in pending))


def test_held_requests_are_dispatched_at_the_requested_check_time() -> None:
    policy = _HoldThenRelease(release_at=7.5, step_reports=False)
    node = Node([make_unit()], policy, requests([(8, 2)] * 2, arrivals=[0.0, 1.0]), ttft_slo_s=1, tpot_slo_s=1)
    node.run()
    assert node.num_finished == 2
    outcomes = [s.outcome for s in node.states.values()]
    assert all(o is not None and o.first_token_s == pytest.approx(8.5) for o in outcomes)
    assert policy.calls == [0.0, 1.0, 7.5]
    assert all(s.num_rounds_waited == (2 if s.spec.arrival_s == 0.0 else 1) for s in node.states.values())


class _FirstNowRestLater(_HoldThenRelease):
    """Places requests that arrived at 0 at once; holds later ones until ``release_at``."""

    def dispatch(
        self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float
    ) -> DispatchDecision:
        self.calls.append(now_s)
        go = [p for p in pending if p.arrival_s == 0.0 or now_s >= self.release_at]
        return DispatchDecision(assignments=tuple((p.request_id, 0) for p in go), next_check_s=self.release_at)


@pytest.mark.parametrize("step_reports", [False, True])
def test_step_reports_wake_a_dispatcher_that_asks_for_them(step_reports: bool) -> None:
    policy = _FirstNowRestLater(release_at=3.0, step_reports=step_reports)
    reqs = requests([(8, 6), (8, 2)], arrivals=[0.0, 0.5])
    node = Node([make_unit()], policy, reqs, ttft_slo_s=1, tpot_slo_s=1)
    node.run()
    assert node.num_finished == 2
    # Request 1 waits from 0.5 to 3.0; unit 0's steps end at 1.0 and 2.0 in between.
    held = [t for t in policy.calls if 0.5 <= t <= 3.0]
    assert held == ([0.5, 1.0, 2.0, 3.0] if step_reports else [0.5, 3.0])
