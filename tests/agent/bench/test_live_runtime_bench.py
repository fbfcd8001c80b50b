"""bench_live_runtime.py's two replays (the discrete-event node, and the live cluster over simulated live units) on a
small workload: the same requests finish in both, each with its own prompt and output length (timings not asserted:
the machine is shared)."""

from __future__ import annotations

from bench_scripts import bench_script

from agent.bench.runner import BenchConfig
from agent.workload.spec import parse_workload


def test_both_replays_finish_the_same_requests_whole() -> None:
    work = parse_workload("poisson:n=24,rate=60,output=uniform(4,24)", seed=3)
    config = BenchConfig(units=2)
    with bench_script("bench_live_runtime") as bench:
        sim = bench.run_sim(config, work)
        live = bench.run_live(config, work)
        table = bench.stats(live.outcomes)
    expected = {r.request_id: (r.prompt_tokens, r.output_tokens) for r in work}
    assert {o.request_id: (o.prompt_tokens, o.output_tokens) for o in sim.outcomes} == expected
    assert {o.request_id: (o.prompt_tokens, o.output_tokens) for o in live.outcomes} == expected
    assert sim.unit_steps > 0 and live.unit_steps == len(live.late_s) > 0 and min(live.late_s) > -1e-6
    assert sim.refused == live.refused == 0
    assert table["TTFT p50"] > 0 and table["E2E p99"] >= table["E2E p50"]
