"""Microbenchmark of policies.batch.eb_model: the per-step and per-update costs of the EB math.

    python tests/benchmarks/bench_eb_model.py [--window 2000] [--slots 256]

Prints microseconds per call of PhaseCostEstimator.observe() and costs() (cached and with a refit),
LengthWindow.add() and survival(), optimal_theta (empirical and linear-hazard curves), closed_form_theta,
eb_throughput, and memory_safe_batch_size. Not a test: nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import itertools
import math
import platform
import time
from collections.abc import Callable

import numpy as np

from policies.batch.eb_costs import PhaseCostEstimator
from policies.batch.eb_memory import cycle_peak_demand, memory_safe_batch_size
from policies.batch.eb_model import (
    closed_form_theta,
    eb_throughput,
    optimal_theta,
)
from policies.batch.eb_survival import LengthWindow
from policies.cost.step_model import StepCoefficients
from policies.types import StepFeedback, StepMode

H100_8B = StepCoefficients(a_s=9.1e-3, b_s=24e-6, c_s=44e-9)


def per_call_us(fn: Callable[[], object], number: int, repeat: int = 5) -> float:
    """Best of ``repeat`` runs of ``number`` calls, in microseconds per call."""
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=2000, help="finished requests in the length window")
    parser.add_argument("--slots", type=int, default=256, help="N, the batch size")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"python {platform.python_version()} numpy {np.__version__} on {platform.machine()}")

    steps = []
    for _ in range(4096):
        kind = int(rng.integers(3))
        n_d = 0 if kind == 1 else int(rng.integers(16, 512))
        n_p = 0 if kind == 0 else int(rng.integers(256, 8192))
        t = 9e-3 + 30e-6 * n_p + 70e-6 * n_d
        mode = (StepMode.DECODE, StepMode.PREFILL, StepMode.MIXED)[kind]
        steps.append(StepFeedback(mode, n_p, n_d, n_d * 1500 + n_p, n_d + 1, t, t))
    est = PhaseCostEstimator(H100_8B)
    it = itertools.cycle(steps)
    print(f"PhaseCostEstimator.observe      {per_call_us(lambda: est.observe(next(it)), 20_000):9.2f} us")
    est.costs(refresh=True)
    print(f"PhaseCostEstimator.costs cached {per_call_us(est.costs, 20_000):9.2f} us")

    def observe_and_refit() -> None:
        est.observe(next(it))
        est.costs(refresh=True)

    print(f"observe + costs(refresh=True)   {per_call_us(observe_and_refit, 500):9.2f} us  (a refit every step)")

    def observe_and_costs() -> None:
        est.observe(next(it))
        est.costs()

    print(f"observe + costs (refit_every=16){per_call_us(observe_and_costs, 5000):9.2f} us  (amortized)")

    outputs = np.maximum(1, rng.lognormal(math.log(300), 0.8, args.window)).astype(np.int64)
    prompts = rng.integers(50, 2000, args.window)
    window = LengthWindow(args.window)
    pairs = itertools.cycle(zip(prompts.tolist(), outputs.tolist(), strict=True))
    print(f"LengthWindow.add                {per_call_us(lambda: window.add(*next(pairs)), 20_000):9.2f} us")
    print(f"LengthWindow.survival           {per_call_us(window.survival, 200):9.2f} us  ({args.window} requests)")
    lh = window.survival(model="linear_hazard")
    print(f"survival(model=linear_hazard)   "
          f"{per_call_us(lambda: window.survival(model='linear_hazard'), 200):9.2f} us")
    s = window.survival()
    c = est.costs(refresh=True)
    mu_in = window.mean_prompt
    print(f"optimal_theta (empirical)       "
          f"{per_call_us(lambda: optimal_theta(s, c, args.slots, mu_in), 500):9.2f} us  (curve of {len(s)} points)")
    t_us = per_call_us(lambda: optimal_theta(lh, c, args.slots, mu_in), 500)
    print(f"optimal_theta (linear hazard)   {t_us:9.2f} us")
    print(f"closed_form_theta               {per_call_us(lambda: closed_form_theta(0.05), 20_000):9.2f} us")
    t_us = per_call_us(lambda: eb_throughput(0.3, s, c, args.slots, mu_in), 2000)
    print(f"eb_throughput                   {t_us:9.2f} us")

    theta = optimal_theta(s, c, args.slots, mu_in)
    print(f"cycle_peak_demand N={args.slots}        "
          f"{per_call_us(lambda: cycle_peak_demand(prompts, outputs, args.slots, theta), 3, 3) / 1e3:9.2f} ms"
          f"  (2000 cycles, theta {theta:.2f})")
    capacity = 400_000.0
    n_safe = memory_safe_batch_size(prompts, outputs, capacity, theta)
    t_ms = per_call_us(lambda: memory_safe_batch_size(prompts, outputs, capacity, theta), 1, 3) / 1e3
    print(f"memory_safe_batch_size          {t_ms:9.2f} ms  (-> N = {n_safe} for {capacity:,.0f} KV tokens)")


if __name__ == "__main__":
    main()
