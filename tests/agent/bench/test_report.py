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


def test_pass_chunk_use_counts_every_member_of_a_lockstep_pass() -> None:
    from agent.bench.report import ClusterStats

    # Group {0, 1} (a DP+EP instance) and unit 2 on its own; a 100-token chunk.
    c = ClusterStats(3, block_size=1, groups=[[0, 1]])
    c.add(_rec(0, 1.0, 1, 1, prefill=80, decode=0))  # pass at 0 s: unit 0 alone (unit 1 idle, a dummy batch)
    c.add(_rec(2, 1.0, 1, 1, prefill=50, decode=0))  # not in a group: in the per-step figure only
    c.add(_rec(0, 2.0, 1, 1, prefill=0, decode=3))  # pass at 1 s: decodes only, not a prefill pass
    c.add(_rec(1, 2.0, 1, 1, prefill=0, decode=2))
    c.add(_rec(0, 3.0, 1, 1, prefill=60, decode=0))  # pass at 2 s: both members
    c.add(_rec(1, 3.0, 1, 1, prefill=30, decode=10))
    d = c.as_dict(max_num_batched_tokens=100)
    assert d["prefill_chunk_utilization"] == pytest.approx((80 + 50 + 60 + 40) / 400)
    assert d["pass_chunk_utilization"] == pytest.approx((80 + 100) / 400), "two prefill passes of two members"
    assert ClusterStats(2, block_size=1).as_dict(max_num_batched_tokens=100)["pass_chunk_utilization"] is None


def _outcome(rid: str, ttft_s: float, tokens: int, mean_s: float, worst_s: float | None, prompt: int = 100):
    from agent.engine.base import RequestOutcome

    first = 1.0 + ttft_s
    return RequestOutcome(rid, 0, 1.0, first, first + mean_s * (tokens - 1), prompt, tokens, 0, ttft_slo_s=0.5,
                          tpot_slo_s=0.05, max_tpot_s=worst_s)


def test_effective_rps_is_offered_load_times_attainment_and_the_tpot_metric_decides() -> None:
    from agent.bench.report import summarize

    done = [
        _outcome("ok", 0.1, 11, 0.02, 0.03),  # meets both
        _outcome("one-token", 0.2, 1, 0.0, None),  # meets both (no TPOT)
        _outcome("slow-start", 0.6, 11, 0.02, 0.03),  # misses TTFT
        _outcome("stalled", 0.1, 11, 0.04, 0.12),  # mean 40 ms meets, worst 120 ms misses
    ]
    kw = {"num_requests": 5, "num_rejected": 1, "duration_s": 10.0, "offered_rps": 2.5}
    worst, mean = summarize(done, **kw, tpot_metric="worst"), summarize(done, **kw, tpot_metric="mean")
    assert worst["slo_attainment"] == pytest.approx(2 / 5) and mean["slo_attainment"] == pytest.approx(3 / 5)
    assert worst["effective_rps"] == pytest.approx(2.5 * 2 / 5) and mean["effective_rps"] == pytest.approx(2.5 * 3 / 5)
    assert worst["goodput_rps"] == pytest.approx(2 / 10.0) and worst["offered_rps"] == 2.5
    assert worst["tpot_ms"]["mean"] == pytest.approx((30 + 30 + 120) / 3)  # the one-token request has no TPOT
    assert mean["tpot_ms"]["mean"] == pytest.approx((20 + 20 + 40) / 3)
    assert summarize(done, num_requests=5, num_rejected=1, duration_s=10.0)["effective_rps"] is None  # load unknown
    # seed 001's normalized latency and seed 002's prefill throughput
    per_token = [(0.1 + 0.2) / 11, 0.2 / 1, (0.6 + 0.2) / 11, (0.1 + 0.4) / 11]
    assert worst["normalized_latency_ms"]["mean"] == pytest.approx(1e3 * sum(per_token) / 4)
    e2e = [0.1 + 0.2, 0.2, 0.6 + 0.2, 0.1 + 0.4]  # what vLLM's benchmark reports as E2EL
    assert worst["e2e_ms"]["mean"] == pytest.approx(1e3 * sum(e2e) / 4) and worst["e2e_ms"]["p50"] == pytest.approx(400)
    assert worst["input_tokens_per_s"] == pytest.approx(4 * 100 / 10.0)
