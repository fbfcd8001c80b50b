"""Sweep summaries: offered load and the load sustained at an SLO attainment target."""

from __future__ import annotations

import pytest

from agent.report import offered_rps, slo_capacity


def test_offered_rps_is_requests_over_the_arrival_span() -> None:
    assert offered_rps([0.0, 1.0, 2.0, 4.0]) == pytest.approx(1.0)
    assert offered_rps([3.0]) == 0.0
    assert offered_rps([2.0, 2.0]) == 0.0


def test_slo_capacity_interpolates_the_first_crossing() -> None:
    # 2 req/s: 99%; 4 req/s: 95%; 6 req/s: 85% -> 90% is crossed halfway between 4 and 6.
    pts = [(6.0, 0.85), (2.0, 0.99), (4.0, 0.95)]
    assert slo_capacity(pts, 0.9) == pytest.approx(5.0)
    assert slo_capacity(pts, 0.8) == pytest.approx(6.0)  # never below: the highest load of the sweep
    assert slo_capacity(pts, 0.995) is None  # even the lightest load misses
    # A later recovery does not move the answer past the first crossing.
    assert slo_capacity([*pts, (8.0, 0.95)], 0.9) == pytest.approx(5.0)
