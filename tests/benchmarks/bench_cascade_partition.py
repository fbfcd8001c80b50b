"""Microbenchmark of CascadeInfer's planning (policies.dispatch.cascade_partition) and of one dispatch call.

    python tests/benchmarks/bench_cascade_partition.py [--units 16] [--samples 4096]

Prints milliseconds per stage partition (exact DP and the two-phase fast path, table construction
included) for 128K context over exponential buckets, the pipeline quality each finds, the cost of one
range refinement, and microseconds per ``CascadeInfer.dispatch`` call with 16 units of 256 resident
requests (a step report from one unit, nothing pending). The paper's target: 16 instances, 128K context,
0.06 s. Not a test: nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import time
from collections.abc import Callable

import numpy as np

from policies.cost.step_model import StepCoefficients
from policies.dispatch.cascade import CascadeInfer
from policies.dispatch.cascade_model import QoeCoefficients
from policies.dispatch.cascade_partition import (
    StageCostTable,
    exponential_edges,
    partition_dp,
    partition_fast,
    refine_boundary,
)
from policies.types import RunningRequest, UnitLoad

H100_8B = StepCoefficients(9.11e-3, 24e-6, 43.9e-9)


def best_ms(fn: Callable[[], object], repeat: int = 7) -> float:
    """Best of ``repeat`` single calls, in milliseconds."""
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Log-normal prompts (median ~400) and outputs (median ~150), a ShareGPT-like heavy tail, cut at 128K."""
    rng = np.random.default_rng(seed)
    prompts = np.minimum(np.exp(rng.normal(6.0, 1.5, n)) + 1, 120_000).astype(np.int64)
    contexts = prompts + np.exp(rng.normal(5.0, 1.2, n)).astype(np.int64)
    return prompts, np.minimum(contexts, 131_072)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--units", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4096)
    args = ap.parse_args()
    print(
        f"{platform.python_implementation()} {platform.python_version()}, numpy {np.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs"
    )
    coefs = QoeCoefficients.from_step_model(H100_8B, mean_output_tokens=256, chunk_tokens=8192)
    cut = 5e-6 / 256
    print(f"\npartition of {args.units} units over 128K context (ms, best of 7; table construction included)")
    print(f"{'buckets':>18} {'samples':>8} {'dp ms':>8} {'fast ms':>8} {'dp stages':>10} {'fast/dp cost':>13}")
    for base, growth in ((64, 2.0), (64, math.sqrt(2.0)), (16, 1.25)):
        edges = exponential_edges(131_072, base, growth)
        for n in (1000, args.samples, 4 * args.samples):
            prompts, contexts = lengths(n, seed=n)

            def run_dp(p: np.ndarray = prompts, c: np.ndarray = contexts, e: tuple[int, ...] = edges) -> object:
                return partition_dp(StageCostTable(p, c, e, coefs, cut), args.units)

            def run_fast(p: np.ndarray = prompts, c: np.ndarray = contexts, e: tuple[int, ...] = edges) -> object:
                return partition_fast(StageCostTable(p, c, e, coefs, cut), args.units)

            table = StageCostTable(prompts, contexts, edges, coefs, cut)
            dp, fast = partition_dp(table, args.units), partition_fast(table, args.units)
            label = f"{len(edges) - 1} (g={growth:.3g})"
            print(
                f"{label:>18} {n:>8} {best_ms(run_dp):>8.2f} {best_ms(run_fast):>8.2f} {dp.num_stages:>10} "
                f"{fast.cost / dp.cost:>13.4f}"
            )

    prompts, contexts = lengths(512, seed=1)
    own = list(zip(prompts[:256].tolist(), contexts[:256].tolist(), strict=True))
    succ = [
        list(
            zip(
                prompts[256 + 64 * k : 320 + 64 * k].tolist(),
                contexts[256 + 64 * k : 320 + 64 * k].tolist(),
                strict=True,
            )
        )
        for k in range(4)
    ]
    ms = best_ms(lambda: refine_boundary(own, succ, coefs, 2048.0, alpha=0.3), repeat=50)
    print(f"\nrefine_boundary, 256 own + 4 successors of 64: {ms * 1e3:.0f} us")

    prompts, contexts = lengths(16 * 256, seed=2)
    reqs = [
        RunningRequest(f"r{i}", int(c), int(p), int(c - p), int(c) - 1, 0.0)
        for i, (p, c) in enumerate(zip(prompts, contexts, strict=True))
    ]
    mixed = [tuple(reqs[u * 256 : (u + 1) * 256]) for u in range(16)]
    policy = CascadeInfer({"refine_interval_s": 3600.0, "repartition_interval_s": 86_400.0})
    policy.dispatch([], make_units(mixed), 0.0)  # first call: partition from the 4,096 residents
    print(f"stages after the first call: {policy.stage_boundaries} units {policy.stage_units}")
    # steady state: every request on a unit of the stage covering its length
    staged: list[list[RunningRequest]] = [[] for _ in range(16)]
    for i, r in enumerate(reqs):
        members = policy.stage_units[policy.stage_for_length(r.context_tokens)]
        staged[members[i % len(members)]].append(r)
    for label, layout in (
        ("lengths mixed on every unit (hand-overs queued)", mixed),
        ("steady state (requests in their stages)", [tuple(x) for x in staged]),
    ):
        policy = CascadeInfer({"refine_interval_s": 3600.0, "repartition_interval_s": 86_400.0})
        units = make_units(layout)
        policy.dispatch([], units, 0.0)
        n_calls = 2000
        t0 = time.perf_counter()
        for k in range(n_calls):
            u = k % 16
            units[u] = dataclasses.replace(units[u], steps_done=k + 1)
            policy.dispatch([], units, 1.0)
        per_call = (time.perf_counter() - t0) / n_calls * 1e6
        print(
            f"dispatch, 16 units x 256 residents, one step report, nothing pending, {label}: {per_call:.0f} us per call"
        )
    policy = CascadeInfer({"refine_interval_s": 0.001, "repartition_interval_s": 86_400.0})
    units = make_units([tuple(x) for x in staged])
    policy.dispatch([], units, 0.0)
    t0 = time.perf_counter()
    for k in range(200):
        policy.dispatch([], units, 1.0 + k)
    print(f"dispatch with a range refinement in every call: {(time.perf_counter() - t0) / 200 * 1e3:.2f} ms per call")
    policy = CascadeInfer({"refine_interval_s": 0.001, "repartition_interval_s": 0.1})
    t0 = time.perf_counter()
    for k in range(50):
        policy.dispatch([], units, 1.0 + k)
    print(f"dispatch with a full repartition in every call: {(time.perf_counter() - t0) / 50 * 1e3:.2f} ms per call")


def make_units(layout: list[tuple[RunningRequest, ...]]) -> list[UnitLoad]:
    return [
        UnitLoad(
            u,
            True,
            len(reqs),
            0,
            1000,
            1_000_000,
            sum(r.context_tokens for r in reqs),
            0,
            mean_step_s=0.02,
            chunk_tokens=8192,
            requests=reqs,
        )
        for u, reqs in enumerate(layout)
    ]


if __name__ == "__main__":
    main()
