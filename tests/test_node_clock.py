"""The node under a wall clock (injected time, so no real sleeping) and its event ordering."""

from __future__ import annotations

import pytest
from builders import make_unit, requests

from agent.clock import WallClock
from agent.node import Node
from policies.registry import make_dispatch_policy


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
