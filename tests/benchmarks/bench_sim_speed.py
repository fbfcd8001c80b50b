"""Simulator speed: replay the whole Azure code trace on simulated H100 units in virtual time.

    python tests/benchmarks/bench_sim_speed.py [--units 4] [--repeat 3] [--batch-policy vllm]

Prints wall time, unit-steps per second and requests per second for each repetition and the median.
Target (issue #2): the full trace (8,819 requests, one hour) on 4 units under 30 s on the 2-core machine.
Results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

from agent.bench.runner import BenchConfig, run_once
from agent.engine.base import StepRecord
from agent.workload.traces import load_trace

TRACE = Path(__file__).resolve().parents[2] / "examples" / "traces" / "azure_code_2023.csv"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch-policy", default="vllm")
    parser.add_argument("--dispatch", default="least_loaded")
    parser.add_argument("--profile", default="h100-llama31-8b")
    parser.add_argument("--trace", type=Path, default=TRACE)
    args = parser.parse_args()

    t0 = time.perf_counter()
    workload = load_trace(args.trace)
    load_s = time.perf_counter() - t0
    print(f"machine: {platform.machine()} {platform.processor() or ''} python {platform.python_version()}")
    print(f"trace: {args.trace.name}, {len(workload):,} requests, loaded in {load_s:.2f} s")
    config = BenchConfig(profile=args.profile, units=args.units, batch_policy=args.batch_policy, dispatch=args.dispatch)
    walls = []
    for i in range(args.repeat):
        steps = 0

        def count(_: StepRecord) -> None:
            nonlocal steps
            steps += 1

        t0 = time.perf_counter()
        result = run_once(config, workload, on_step=count)
        wall = time.perf_counter() - t0
        walls.append(wall)
        print(
            f"run {i + 1}: {wall:.2f} s wall, {steps:,} unit-steps ({steps / wall:,.0f}/s), "
            f"{len(workload) / wall:,.0f} requests/s, simulated {result.summary['duration_s']:,.0f} s"
        )
    med = statistics.median(walls)
    print(f"median: {med:.2f} s wall for the whole trace on {args.units} units (target < 30 s)")


if __name__ == "__main__":
    main()
