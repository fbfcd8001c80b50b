"""Simulator scaling (issue #21, item 4): is the cost per unit-step flat in the size of the work?

    python tests/benchmarks/bench_sim_scaling.py [--units 1,4,16,64] [--compress 1,4,16] [--hours 1,4,24]
                                                [--batch-policy vllm] [--dispatch least_loaded] [--quick]

Two tables, each row a replay in a fresh process (so that its peak memory is its own):

1. **Units x compression.** The Azure code trace (one hour, 8,819 requests) on 1, 4, 16 and 64 units, its arrivals
   compressed 1x, 4x and 16x (the same requests arriving 4 and 16 times faster: more load on the same units, or the
   same load per unit on more units). The figure is wall microseconds per unit-step, and its ratio to 4 units at
   1x. The issue's target: 64 units at 16x within 1.5x of 4 units at 1x.
2. **Length.** The trace repeated back to back (1, 4, 24 hours: each copy's arrivals shifted by the trace's span,
   its request ids made unique) on 4 units: wall time, unit-steps and peak resident memory. The target: time
   linear in the length, and a 24-hour replay under 1 GB.

Every run is ``trackside bench``'s own replay (``agent.bench.runner.run_once``). Prints markdown tables; asserts
nothing (the machine is shared and noisy: quote medians of quiet runs). ``--quick``: the first 2,000 requests and
at most 4 hours, for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "examples" / "traces" / "azure_code_2023.csv"
RESULT = "RESULT "


@dataclass(frozen=True, slots=True)
class Row:
    """One replay: its shape and what it cost."""

    units: int
    compress: float
    hours: int
    requests: int
    unit_steps: int
    wall_s: float
    max_rss_mb: float

    @property
    def us_per_step(self) -> float:
        return 1e6 * self.wall_s / max(1, self.unit_steps)


def repeated(workload: Sequence, hours: int) -> list:
    """``workload`` back to back ``hours`` times: each copy's arrivals shifted by the trace's span (rounded up to a
    whole hour), request ids suffixed with the copy's number."""
    if hours < 1:
        raise ValueError("hours must be >= 1")
    span = max(r.arrival_s for r in workload) if workload else 0.0
    period = 3600.0 * max(1, -(-int(span) // 3600))
    return [replace(r, request_id=f"{r.request_id}~{k}" if k else r.request_id, arrival_s=r.arrival_s + k * period)
            for k in range(hours) for r in workload]


def parse_list(text: str, kind: type = int) -> list:
    items = [kind(x) for x in text.split(",") if x.strip()]
    if not items or any(x <= 0 for x in items):
        raise argparse.ArgumentTypeError(f"a comma-separated list of positive numbers, got {text!r}")
    return items


def replay_here(units: int, compress: float, hours: int, limit: int | None, batch: str, dispatch: str) -> Row:
    """One replay in this process."""
    from agent.bench.runner import BenchConfig, run_once
    from agent.engine.base import StepRecord
    from agent.workload.traces import load_trace

    workload = repeated(load_trace(TRACE, limit=limit), hours)
    steps = 0

    def count(_: StepRecord) -> None:
        nonlocal steps
        steps += 1

    config = BenchConfig(units=units, batch_policy=batch, dispatch=dispatch, time_scale=1.0 / compress)
    t0 = time.perf_counter()
    run_once(config, workload, on_step=count)
    wall = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return Row(units, compress, hours, len(workload), steps, wall, rss_mb)


def replay_child(units: int, compress: float, hours: int, args: argparse.Namespace) -> Row:
    """One replay in a fresh process (its own peak memory)."""
    cmd = [sys.executable, __file__, "--child", f"{units},{compress},{hours}", "--batch-policy", args.batch_policy,
           "--dispatch", args.dispatch]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = next(x for x in out.stdout.splitlines() if x.startswith(RESULT))
    return Row(**json.loads(line[len(RESULT):]))


def table_units(rows: Sequence[Row]) -> list[str]:
    base = next((r for r in rows if r.units == 4 and r.compress == 1), rows[0])
    out = ["| units | compression | unit-steps | wall s | us per unit-step | x (4 units, 1x) | peak RSS MB |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.units} | {r.compress:g}x | {r.unit_steps:,} | {r.wall_s:.1f} | {r.us_per_step:.1f} | "
                   f"{r.us_per_step / base.us_per_step:.2f} | {r.max_rss_mb:.0f} |")
    return out


def table_hours(rows: Sequence[Row]) -> list[str]:
    base = rows[0]
    out = ["| hours | requests | unit-steps | wall s | wall / (hours x first row's per hour) | us per unit-step | "
           "peak RSS MB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        linear = r.wall_s / (base.wall_s * r.hours / base.hours)
        out.append(f"| {r.hours} | {r.requests:,} | {r.unit_steps:,} | {r.wall_s:.1f} | {linear:.2f} | "
                   f"{r.us_per_step:.1f} | {r.max_rss_mb:.0f} |")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--units", type=parse_list, default=[1, 4, 16, 64], help="units per replay (default 1,4,16,64)")
    ap.add_argument("--compress", type=lambda s: parse_list(s, float), default=[1.0, 4.0, 16.0],
                    help="arrival compression factors (default 1,4,16)")
    ap.add_argument("--hours", type=parse_list, default=[1, 4, 24], help="trace repetitions (default 1,4,24)")
    ap.add_argument("--batch-policy", default="vllm")
    ap.add_argument("--dispatch", default="least_loaded")
    ap.add_argument("--limit", type=int, help="only the first N requests of the trace")
    ap.add_argument("--quick", action="store_true", help="the first 2,000 requests, at most 4 hours")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.limit = args.limit or 2000
        args.hours = [h for h in args.hours if h <= 4] or [1]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        units, compress, hours = args.child.split(",")
        row = replay_here(int(units), float(compress), int(hours), args.limit, args.batch_policy, args.dispatch)
        print(RESULT + json.dumps({f: getattr(row, f) for f in Row.__slots__}))
        return 0
    print(f"machine: {platform.machine()} {platform.processor() or ''} python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs; {args.batch_policy} + {args.dispatch}"
          + (f"; the first {args.limit:,} requests" if args.limit else "; the whole trace"), flush=True)
    rows = []
    for units in args.units:
        for compress in args.compress:
            rows.append(replay_child(units, compress, 1, args))
            print(f"  {units} units, {compress:g}x: {rows[-1].wall_s:.1f} s", file=sys.stderr, flush=True)
    print("\n".join(table_units(rows)), flush=True)
    long = []
    for hours in args.hours:
        long.append(replay_child(4, 1.0, hours, args))
        print(f"  {hours} h: {long[-1].wall_s:.1f} s", file=sys.stderr, flush=True)
    print()
    print("\n".join(table_hours(long)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
