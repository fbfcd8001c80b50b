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
        sim, sim_steps, _ = bench.run_sim(config, work)
        live, live_steps, _, late, max_late = bench.run_live(config, work)
        table = bench.stats(live)
    expected = {r.request_id: (r.prompt_tokens, r.output_tokens) for r in work}
    assert {o.request_id: (o.prompt_tokens, o.output_tokens) for o in sim} == expected
    assert {o.request_id: (o.prompt_tokens, o.output_tokens) for o in live} == expected
    assert sim_steps > 0 and live_steps > 0 and 0 <= late <= max_late
    assert table["TTFT p50"] > 0 and table["E2E p99"] >= table["E2E p50"]
