"""SBS in seed 000's topology: instances of DP units in lockstep, out of phase, P/D-separated (issue #19, item 7).

    python tests/benchmarks/bench_sbs_instances.py [--limit 2000] [--units 8] [--prefill-units 4]
        [--instance-size 2] [--chunk 3072] [--scales 0.2,0.1,0.07,0.05] [--shapes free,instances,lockstep]
        [--dispatches least_loaded,sbs,sbs fcfs,round_robin] [--pass-sync-ms 0,10,20] [--capacity MS [--steps 8]]
        [--json out.json]

Seed 000 runs prefill and decode on separate instances, each instance several DP units stepping in lockstep
(DP+EP), the instances out of phase, and dispatches new requests to the prefill instances. Its claims there,
against immediate dispatch: mean TTFT 30-40% lower, prefill throughput 15-20% higher, prefill chunk utilisation
52% -> 88%.

Here: the Azure code 2023 trace's first ``--limit`` requests (real prompt lengths, mean about 2,000 tokens),
``--units`` simulated H100-8B units in the disaggregated topology (``--prefill-units`` of them prefill and hand
each request with its KV to the decode pool), vLLM's default batch policy, ``--chunk`` tokens per step (the
paper's 3K), SLO 2,000 / 50 ms (worst per-token TPOT). Three shapes of the units: ``free`` (every unit steps on
its own), ``instances`` (consecutive groups of ``--instance-size`` units in lockstep: ``bench --instance-size``)
and ``lockstep`` (every unit in one group), each with ``least_loaded`` (vLLM's balancer: immediate dispatch),
``sbs``, and ``sbs`` with ``fill_order=fcfs`` (``round_robin`` on request), at each arrival time scale, and with
each ``--pass-sync-ms`` (a synchronisation cost added to every lockstep pass: ``bench --pass-sync-ms``). Per run:
mean and p99 TTFT, SLO attainment, prompt tokens per second (prefill throughput), the prefill chunk utilisation
(tokens per prefill-carrying step over the chunk capacity) and seed 000's own (per lockstep pass, every member of
the instance counted). With ``--capacity MS``, instead of fixed scales, each dispatcher's highest load whose mean
TTFT stays within MS, as seed 000's Table 1 measures (800 ms at the 3K chunk, 1,000 ms at 5K). Prints a table;
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent.bench.runner import BenchConfig, run_once  # noqa: E402
from agent.workload.traces import load_trace  # noqa: E402

SHAPES = ("free", "instances", "lockstep")
DISPATCHES = (("least_loaded", "least_loaded", {}), ("sbs", "sbs", {}), ("sbs fcfs", "sbs", {"sbs.fill_order": "fcfs"}),
              ("round_robin", "round_robin", {}))
"""Label, dispatch policy, parameters: ``sbs fcfs`` water-fills in arrival order instead of longest first."""


def cells(args: argparse.Namespace) -> list[tuple[str, float]]:
    """Each shape with each pass sync cost (free-running units have no passes: 0 only)."""
    return [(shape, sync) for shape in args.shapes for sync in (args.pass_sync_ms if shape != "free" else [0.0])]


def dispatches(args: argparse.Namespace) -> list[tuple[str, str, dict[str, str]]]:
    unknown = set(args.dispatches) - {label for label, _, _ in DISPATCHES}
    if unknown:
        raise SystemExit(f"unknown dispatch {sorted(unknown)[0]!r}: choose from {[d[0] for d in DISPATCHES]}")
    return [d for d in DISPATCHES if d[0] in args.dispatches]


def base_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(units=args.units, topology="disaggregated", prefill_units=args.prefill_units,
                       ttft_slo_ms=2000.0, tpot_slo_ms=50.0, batch_policy="vllm", max_num_batched_tokens=args.chunk)


def measure(config: BenchConfig, workload: Any) -> dict[str, Any]:
    started = time.perf_counter()
    r = run_once(config, workload)
    s = r.summary
    return {
        "scale": config.time_scale, "offered_rps": round(r.offered_rps, 2),
        "ttft_mean_ms": round(s["ttft_ms"]["mean"], 1), "ttft_p99_ms": round(s["ttft_ms"]["p99"], 1),
        "slo_attainment": round(s["slo_attainment"], 4), "prompt_tok_s": round(s["input_tokens_per_s"], 1),
        "chunk_utilization": r.cluster.get("prefill_chunk_utilization"),
        "pass_chunk_utilization": r.cluster.get("pass_chunk_utilization"),
        "flow_controlled": r.cluster.get("flow_controlled_requests", 0),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    workload = load_trace(str(ROOT / "examples" / "traces" / "azure_code_2023.csv"), limit=args.limit)
    base = base_config(args)
    rows = []
    for scale in args.scales:
        for shape, sync_ms in cells(args):
            for dispatch, policy, params in dispatches(args):
                config = replace(_shape(base, shape, args.instance_size), dispatch=policy, params=params,
                                 time_scale=scale, pass_sync_ms=sync_ms)
                rows.append({"shape": shape, "pass_sync_ms": sync_ms, "dispatch": dispatch,
                             **measure(config, workload)})
                print(_line(rows[-1]), flush=True)
    return rows


def capacity(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Seed 000's Table 1: each dispatcher's highest load whose mean TTFT stays within ``--capacity`` ms (the arrival
    time scale bisected ``--steps`` times between ``--scales``' largest and smallest), with the chunk use there."""
    workload = load_trace(str(ROOT / "examples" / "traces" / "azure_code_2023.csv"), limit=args.limit)
    base = base_config(args)
    rows = []
    for shape, sync_ms in cells(args):
        for dispatch, policy, params in dispatches(args):
            config = replace(_shape(base, shape, args.instance_size), dispatch=policy, params=params,
                             pass_sync_ms=sync_ms)
            slow, fast = max(args.scales), min(args.scales)  # a larger scale spreads arrivals: a lighter load
            best = None
            for _ in range(args.steps):
                mid = (slow * fast) ** 0.5
                row = measure(replace(config, time_scale=mid), workload)
                if row["ttft_mean_ms"] <= args.capacity:
                    best, slow = row, mid
                else:
                    fast = mid
            if best is None:
                best = measure(replace(config, time_scale=max(args.scales)), workload)
                best["within_limit"] = best["ttft_mean_ms"] <= args.capacity
            rows.append({"shape": shape, "pass_sync_ms": sync_ms, "dispatch": dispatch, **best})
            print(_line(rows[-1]), flush=True)
    return rows


def _shape(base: BenchConfig, shape: str, size: int) -> BenchConfig:
    if shape == "instances":
        return replace(base, instance_size=size)
    if shape == "lockstep":
        return replace(base, lockstep=True)
    return base


def _line(r: dict[str, Any]) -> str:
    cu, pu = r["chunk_utilization"], r["pass_chunk_utilization"]
    return (f"x{r['scale']:<7.4g} {r['offered_rps']:6.2f}/s {r['shape']:9s} sync {r['pass_sync_ms']:g} ms "
            f"{r['dispatch']:12s} "
            f"TTFT mean {r['ttft_mean_ms']:8.1f} p99 {r['ttft_p99_ms']:8.1f} ms  "
            f"SLO {100 * r['slo_attainment']:5.1f}%  "
            f"prompt {r['prompt_tok_s']:9.1f} tok/s  chunk {100 * cu if cu is not None else float('nan'):5.1f}%  "
            f"pass {100 * pu if pu is not None else float('nan'):5.1f}%  "
            f"({r['wall_s']} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--prefill-units", type=int, default=4)
    ap.add_argument("--instance-size", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=3072, help="max_num_batched_tokens (the paper's 3K by default)")
    ap.add_argument("--scales", type=lambda t: [float(x) for x in t.split(",")], default=[0.2, 0.1, 0.07, 0.05])
    ap.add_argument("--shapes", type=lambda t: t.split(","), default=list(SHAPES),
                    help=f"which of {','.join(SHAPES)} to run (default all)")
    ap.add_argument("--dispatches", type=lambda t: t.split(","), default=[d[0] for d in DISPATCHES[:3]],
                    help=f"which of {','.join(d[0] for d in DISPATCHES)} to run (default the first three)")
    ap.add_argument("--pass-sync-ms", type=lambda t: [float(x) for x in t.split(",")], default=[0.0],
                    help="synchronisation costs added to every lockstep pass, each run in turn (default 0; "
                    "bench --pass-sync-ms)")
    ap.add_argument("--capacity", type=float, metavar="MS",
                    help="instead of the fixed scales: each dispatcher's highest load at a mean TTFT within MS (seed "
                    "000's Table 1: 800 at the 3K chunk, 1000 at 5K), bisected between the largest and smallest scale")
    ap.add_argument("--steps", type=int, default=8, help="bisection steps for --capacity (default 8)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = capacity(args) if args.capacity else run(args)
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "json"},
                                         "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
