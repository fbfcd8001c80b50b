"""What-if benchmark: ``trackside whatif`` on a one-hour recorded window of 4 units with 5 candidates.

    python tests/benchmarks/bench_whatif.py [--store FILE] [--jobs N] [--profile auto|NAME]

1. A store recorded from a simulated agent (the real ``Hub``, its events written by ``StoreWriter``) replaying the
   first hour of the Azure code trace on 4 units, vllm + least_loaded, unless ``--store`` exists already (then it
   is reused: recording takes a few minutes).
2. ``trackside whatif`` on it, the whole window, candidates sarathi, fairbatching, fairbatching+pab, eb, eb+ (with
   the replay of the running policy, 6 runs), timed end to end in a fresh process, and its phases from its own
   report. Prints numbers and the fidelity; asserts nothing. The issue's target: under 60 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent.bench.runner import BenchConfig
from agent.cli.serve import make_node
from agent.service.hub import Hub
from agent.workload.traces import load_trace
from store.writer import StoreWriter

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "examples" / "traces" / "azure_code_2023.csv"
CANDIDATES = "sarathi,fairbatching,fairbatching+pab,eb,eb+"


def record(path: Path, hours: float = 1.0) -> None:
    requests = [r for r in load_trace(TRACE) if r.arrival_s < hours * 3600]
    node = make_node(BenchConfig(units=4), requests)
    hub = Hub(node, node_id="bench-node", profile="h100-llama31-8b", replay_capacity=1 << 24, slack_sample_ms=0)
    hub.attach()
    hello = hub.hello()
    t = 0.0
    with StoreWriter(path) as writer:
        writer.write([hello])
        while not node.done:
            t += 60.0
            node.advance(t)
            writer.write(hub.replay.since(writer.last_seq("bench-node") or 0).events)
            writer.flush()
    print(f"recorded {len(requests):,} requests ({hours:g} h) into {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, default=Path(tempfile.gettempdir()) / "trackside-bench-whatif.duckdb")
    parser.add_argument("--jobs", type=int, help="whatif --jobs (default: one per CPU)")
    parser.add_argument("--profile", default="auto")
    args = parser.parse_args()
    print(f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}")
    if not args.store.exists():
        t0 = time.perf_counter()
        record(args.store)
        print(f"recording: {time.perf_counter() - t0:.1f} s")
    out = args.store.with_suffix(".whatif.json")
    cmd = [sys.executable, "-m", "agent.cli", "whatif", "--db", str(args.store), "--compare", CANDIDATES,
           "--profile", args.profile, "--progress", "none", "--json", str(out)]
    if args.jobs:
        cmd += ["--jobs", str(args.jobs)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    report = json.loads(out.read_text())
    w = report["window"]
    print(f"whatif: {w['requests']:,} requests over {(w['end_ns'] - w['start_ns']) / 1e9 / 60:.1f} min, "
          f"{report['shape']['units']} units, {len(report['runs'])} runs (the replay + 5 candidates), profile "
          f"{report['profile']['source']}: {wall:.1f} s wall")
    print("fidelity: " + ", ".join(f"{k} {v:.2%}" for k, v in report["fidelity"].items() if v is not None))
    for run in sorted(report["runs"], key=lambda r: r["rank"]):
        s = run["summary"]
        print(f"  {run['rank']}. {run['label']}: effective {s['effective_rps']:.2f}/s, SLO {s['slo_attainment']:.1%}")
    print(f"recommendation: {report['recommendation']['action']} {report['recommendation']['batch_policy']}: "
          f"{report['recommendation']['reason']}")


if __name__ == "__main__":
    main()
