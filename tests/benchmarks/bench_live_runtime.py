"""The live runtime against the simulator, on the same units: what does the agent's own runtime add? (issue #14)

    python tests/benchmarks/bench_live_runtime.py [--workload poisson:n=1200,rate=20] [--trace FILE --limit N]
                                                 [--units 4] [--batch-policy vllm] [--dispatch least_loaded]
                                                 [--time-scale 1.0] [--seed 0]

The same requests replayed twice on the same simulated units (the calibration profile's step times, batch policy,
KV cache and online step model, as ``trackside bench`` builds them):

1. **sim**: the discrete-event node on simulated time (``trackside bench``'s replay: a step lasts exactly what the
   unit's timer says, dispatch takes no time);
2. **live**: the live cluster and node that serve vLLM units (``agent.runtime.live``: the dispatch desk, the
   streams, the observer that feeds the hub), over :class:`~agent.engine.sim_live.SimLiveUnit` s stepping in wall
   time in one asyncio loop.

What differs between the two is the runtime: the event loop's delays (a step ends when the loop gets to it), the
dispatcher asked as the loop delivers arrivals and step reports, streams and callbacks. The table gives TTFT, the
worst per-token TPOT and end-to-end latency (p50, p90, p99), requests finished, SLO attainment, unit-steps and the
loop's lateness (how much later than their duration the live steps ended). The live run takes the workload's span in
wall time. A GPU run compares the agent with plain ``vllm serve`` (``docs/vllm.md``); this isolates the part of that
difference that is the runtime's, on any machine. Prints markdown; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from agent.bench.runner import BenchConfig, build_node, split_params, unit_makers
from agent.engine.base import RequestOutcome
from agent.engine.profiles import load_profile
from agent.engine.sim_live import SimLiveUnit
from agent.runtime.live.cluster import LiveCluster
from agent.runtime.live.node import LiveClusterNode
from agent.telemetry import DEFAULT_TPOT_METRIC, TpotMetric
from agent.workload.spec import parse_workload
from agent.workload.traces import load_trace
from agent.workload.types import RequestSpec
from policies.registry import make_batch_policy, make_dispatch_policy

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Run:
    """One replay: what finished, and what it cost."""

    outcomes: list[RequestOutcome]
    unit_steps: int
    wall_s: float
    refused: int
    """Refused by a unit's admission control (FairBatching+PAB's budget) at dispatch."""
    late_s: tuple[float, ...] = ()
    """Live: for each step, how long after it ended the event loop got to its outputs."""


def run_sim(config: BenchConfig, work: Sequence[RequestSpec]) -> Run:
    profile = load_profile(config.profile)
    batch, dispatch = split_params(config.params, config.batch_policy, config.dispatch)
    outcomes: list[RequestOutcome] = []
    t0 = time.perf_counter()
    node = build_node(config, profile, work, batch, dispatch, on_finish=outcomes.append)
    node.run()
    steps = sum(u.num_steps for u in node.units)  # type: ignore[attr-defined]
    return Run(outcomes, steps, time.perf_counter() - t0, node.num_refused)


def run_live(config: BenchConfig, work: Sequence[RequestSpec]) -> Run:
    profile = load_profile(config.profile)
    batch, dispatch = split_params(config.params, config.batch_policy, config.dispatch)

    makers = unit_makers(config, profile)

    async def main() -> Run:
        units = [SimLiveUnit(make) for make in makers]
        late: list[float] = []
        for u in units:
            u.lateness = late
            u.start()
        cluster = LiveCluster(units, make_dispatch_policy(config.dispatch, dispatch),
                              ttft_slo_s=config.ttft_slo_ms / 1e3, tpot_slo_s=config.tpot_slo_ms / 1e3,
                              pending_timeout_s=None)
        node = LiveClusterNode(cluster, [make_batch_policy(config.batch_policy, batch) for _ in units], requests=work)
        outcomes: list[RequestOutcome] = []
        node.on_finish = outcomes.append
        done = asyncio.Event()
        t0 = time.perf_counter()
        serving = asyncio.get_running_loop().create_task(node.serve(done))
        await done.wait()
        wall = time.perf_counter() - t0
        serving.cancel()
        await node.close()
        for u in units:
            await u.stop()
        steps = sum(u.num_steps for u in units)
        return Run(outcomes, steps, wall, cluster.num_refused, tuple(late))

    return asyncio.run(main())


def stats(outcomes: Sequence[RequestOutcome]) -> dict[str, float]:
    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) * 1e3 if values else float("nan")

    ttft = [o.ttft_s for o in outcomes]
    tpot = [t for o in outcomes if (t := o.tpot_by(DEFAULT_TPOT_METRIC)) is not None]
    e2e = [o.finish_s - o.arrival_s for o in outcomes]
    out = {f"{name} p{q}": pct(v, q) for name, v in (("TTFT", ttft), ("TPOT", tpot), ("E2E", e2e))
           for q in (50, 90, 99)}
    metrics: tuple[TpotMetric, ...] = ("worst", "mean")
    for metric in metrics:
        out[f"SLO met % ({metric} TPOT)"] = 100 * sum(o.meets_slo(metric) for o in outcomes) / max(1, len(outcomes))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="poisson:n=1200,rate=20", help="synthetic workload (default %(default)s)")
    ap.add_argument("--trace", type=Path, help="a trace file instead (Azure CSV or trackside JSONL)")
    ap.add_argument("--limit", type=int, default=None, help="--trace: its first N requests")
    ap.add_argument("--time-scale", type=float, default=1.0, help="--trace: arrival times multiplied by this")
    ap.add_argument("--units", type=int, default=4)
    ap.add_argument("--batch-policy", default="vllm")
    ap.add_argument("--dispatch", default="least_loaded")
    ap.add_argument("--profile", default="h100-llama31-8b")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="policy parameter (repeatable; POLICY.NAME=VALUE targets one policy)")
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.trace is not None:
        work = load_trace(args.trace, time_scale=args.time_scale, limit=args.limit)
    else:
        work = parse_workload(args.workload, seed=args.seed)
    first = min(r.arrival_s for r in work)
    work = sorted((replace(r, arrival_s=r.arrival_s - first) for r in work), key=lambda r: r.arrival_s)
    params = dict(p.split("=", 1) for p in args.param)
    config = BenchConfig(profile=args.profile, units=args.units, batch_policy=args.batch_policy,
                         dispatch=args.dispatch, params=params, ttft_slo_ms=args.slo_ttft_ms,
                         tpot_slo_ms=args.slo_tpot_ms, seed=args.seed)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    span = work[-1].arrival_s
    print(f"{len(work)} requests over {span:.1f} s; {args.units} units, {args.batch_policy} + {args.dispatch}, "
          f"SLOs {args.slo_ttft_ms:g}/{args.slo_tpot_ms:g} ms, "
          f"profile {args.profile}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
          f"tree {rev.strip()}")
    sim = run_sim(config, work)
    live = run_live(config, work)
    a, b = stats(sim.outcomes), stats(live.outcomes)
    print()
    print("| | sim (simulated time) | live (wall time) | live / sim |")
    print("|---|---|---|---|")
    for key in a:
        unit = "" if "%" in key else " ms"
        ratio = b[key] / a[key] if a[key] else float("nan")
        print(f"| {key} | {a[key]:.1f}{unit} | {b[key]:.1f}{unit} | {ratio:.3f} |")
    print(f"| finished | {len(sim.outcomes)} | {len(live.outcomes)} | |")
    print(f"| refused at dispatch | {sim.refused} | {live.refused} | |")
    print(f"| unit-steps | {sim.unit_steps} | {live.unit_steps} | {live.unit_steps / max(1, sim.unit_steps):.3f} |")
    print(f"| wall s | {sim.wall_s:.1f} | {live.wall_s:.1f} | |")
    print()
    late = np.array(live.late_s) * 1e3
    print(f"live: the event loop got to a step's outputs after it ended by p50 {np.percentile(late, 50):.2f} ms, "
          f"p99 {np.percentile(late, 99):.2f} ms, max {late.max():.1f} ms (mean {late.mean():.2f}); "
          f"{live.unit_steps / live.wall_s:,.0f} unit-steps per second")

if __name__ == "__main__":
    main()
