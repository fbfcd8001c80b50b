"""Sweep summaries: offered load and the load sustained at an SLO attainment target."""

from __future__ import annotations

import pytest

from agent.bench.report import offered_rps, slo_capacity


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


def _rec(unit: int, t: float, used_blocks: int, running: int, prefill: int = 0, decode: int = 1):
    from agent.engine.base import StepRecord
    from policies.types import StepMode

    return StepRecord(
        unit_id=unit, step_id=0, start_s=t - 1.0, duration_s=1.0, predicted_s=1.0, mode=StepMode.MIXED,
        policy="vllm", num_prefill_tokens=prefill, num_decode_tokens=decode, num_prefill_reqs=int(prefill > 0),
        num_decode_reqs=decode, context_tokens=0, budget_tokens=100, kv_used_blocks=used_blocks, num_blocks=1000,
        num_running=running, num_waiting=0, num_preempted=0, num_finished=0,
    )


def test_cluster_stats_time_weighted_spread_and_chunk_use() -> None:
    from agent.bench.report import ClusterStats

    c = ClusterStats(2, block_size=10)
    c.add(_rec(0, 1.0, 10, 2, prefill=40))  # unit 0: 100 KV tokens, 2 running; unit 1 still 0, 0
    c.add(_rec(1, 3.0, 30, 4, prefill=90, decode=0))  # for 2 s: values (100, 0) -> std 50 tokens, 1 request
    c.add(_rec(0, 4.0, 30, 4))  # for 1 s: (100, 300) -> std 100 tokens, (2, 4) -> 1 request
    d = c.as_dict(max_num_batched_tokens=100)
    assert d["kv_tokens_std"] == pytest.approx((2 * 50 + 1 * 100) / 3)
    assert d["batch_size_std"] == pytest.approx((2 * 1 + 1 * 1) / 3)
    # Two prefill-carrying steps of 41 and 90 tokens against a 100-token chunk.
    assert d["prefill_chunk_utilization"] == pytest.approx((41 + 90) / 200)


def test_cluster_stats_spread_ignores_units_outside_the_pool() -> None:
    from agent.bench.report import ClusterStats

    c = ClusterStats(3, block_size=1, balanced=[1, 2])
    c.add(_rec(1, 1.0, 10, 1))
    c.add(_rec(0, 2.0, 999, 50, prefill=10))
    c.add(_rec(2, 3.0, 10, 1))
    assert c.as_dict(max_num_batched_tokens=10)["kv_tokens_std"] == pytest.approx(5.0)
