"""Per-step batch policies side by side: goodput over a load sweep, and saturation throughput (issue #3).

    python tests/benchmarks/bench_batch_policies.py [--out docs/batch-policies.md] [--jobs 2] [--quick]

Part 1, goodput. On the H100 8B profile with SLOs TTFT 500 ms and TPOT 50 ms, every policy replays (a) the
Azure LLM inference 2023 code trace and (b) a bursty synthetic workload (sharegpt-like lengths, gamma
arrivals with cv 4) on 4 units behind ``least_loaded``, at a sweep of arrival time scales. For each policy
it reports the peak goodput (requests meeting both SLOs per second, refused requests counting as misses),
the offered load sustained at 90% attainment (interpolated) and latency percentiles at a reference load.

Part 2, saturation throughput. ``all-at-once`` (3,000 sharegpt-like requests at t = 0) on one unit of the
H100 8B profile and of the derived bandwidth-constrained profile: output tokens per second of ``vllm``
(mixed batching), ``eb`` and ``eb+``.

The targets in the issue come from the papers (FairBatching seed 003, EB seed 002); the report states each
target and what the simulator measured, pass or not. Nothing here tunes the simulator. Writes a Markdown
report (the numbers in docs/batch-policies.md come from this script) and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.bench.report import slo_capacity
from agent.bench.runner import BenchConfig, run_once
from agent.workload.spec import parse_workload
from agent.workload.traces import load_trace
from agent.workload.types import RequestSpec

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "examples" / "traces" / "azure_code_2023.csv"


@dataclass(frozen=True)
class Variant:
    label: str
    policy: str
    params: tuple[tuple[str, str], ...] = ()


VARIANTS = (
    Variant("vllm", "vllm"),
    Variant("sarathi", "sarathi"),
    # The rows without "(first-token anchor)" pin the arrival anchor (the paper's envelope), the policy's default
    # until 2026-11-26, so that they keep measuring what they measured when the default became first_token.
    Variant("fairbatching", "fairbatching", (("anchor", "arrival"),)),
    Variant("fairbatching (first-token anchor)", "fairbatching", (("anchor", "first_token"),)),
    Variant("fairbatching+pab", "fairbatching+pab", (("anchor", "arrival"),)),
    Variant("fairbatching+pab (first-token anchor)", "fairbatching+pab", (("anchor", "first_token"),)),
    Variant("eb", "eb"),
    Variant("eb+", "eb+"),
)

WORKLOADS = {
    "azure-code": ("Azure LLM inference 2023, code (8,819 requests, 1 h)", (1.0, 0.7, 0.5, 0.4, 0.3, 0.22, 0.15)),
    "bursty": (
        "bursty: sharegpt-like lengths, gamma arrivals cv 4, 6,000 requests at 100 req/s",
        (1.0, 0.7, 0.5, 0.4, 0.3, 0.25),
    ),
}
"""Name -> (description, time scales from light to heavy load)."""


def load(name: str) -> list[RequestSpec]:
    if name == "azure-code":
        return load_trace(TRACE)
    if name == "bursty":
        return parse_workload("bursty:rate=100,n=6000", seed=0)
    return parse_workload(name, seed=0)


def one_run(job: tuple[str, Variant, float, str, int]) -> dict[str, Any]:
    workload, variant, scale, profile, units = job
    params = {f"{variant.policy}.{k}": v for k, v in variant.params}
    config = BenchConfig(profile=profile, units=units, batch_policy=variant.policy, time_scale=scale, params=params)
    t0 = time.perf_counter()
    result = run_once(config, load(workload))
    return {
        "workload": workload, "variant": variant.label, "scale": scale, "profile": profile,
        "offered_rps": result.offered_rps, "refused": result.refused, "summary": result.summary,
        "wall_s": time.perf_counter() - t0,
    }


def fmt(x: float | None, nd: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{nd}f}"


def goodput_section(runs: list[dict[str, Any]], workload: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
    desc, scales = WORKLOADS[workload]
    lines = [f"### {desc}", ""]
    mine = [r for r in runs if r["workload"] == workload]
    ref_scale = sorted(scales)[len(scales) // 2]
    lines.append(
        f"| policy | peak goodput (req/s) | at offered load (req/s) | load at 90% SLO (req/s) | "
        f"TTFT p50 / p99 ms at {ref_scale:g}x | TPOT p50 / p99 ms | SLO at {ref_scale:g}x | refused at {ref_scale:g}x |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    table: dict[str, dict[str, Any]] = {}
    for v in VARIANTS:
        rs = sorted((r for r in mine if r["variant"] == v.label), key=lambda r: r["offered_rps"])
        if not rs:
            continue
        best = max(rs, key=lambda r: r["summary"]["goodput_rps"])
        cap = slo_capacity([(r["offered_rps"], r["summary"]["slo_attainment"]) for r in rs], 0.9)
        ref = next(r for r in rs if r["scale"] == ref_scale)
        s = ref["summary"]
        table[v.label] = {"peak": best["summary"]["goodput_rps"], "cap90": cap}
        lines.append(
            f"| {v.label} | {fmt(best['summary']['goodput_rps'])} | {fmt(best['offered_rps'])} | {fmt(cap)} | "
            f"{fmt(s['ttft_ms']['p50'], 0)} / {fmt(s['ttft_ms']['p99'], 0)} | "
            f"{fmt(s['tpot_ms']['p50'], 1)} / {fmt(s['tpot_ms']['p99'], 1)} | "
            f"{100 * s['slo_attainment']:.1f}% | {ref['refused']} |"
        )
    lines.append("")
    return lines, table


def ratio_line(table: dict[str, dict[str, Any]], key: str, name: str, base: tuple[str, ...], target: float) -> str:
    if name not in table:
        return ""
    ref_vals = [table[b][key] for b in base if b in table and table[b][key] is not None]
    val = table[name][key]
    if not ref_vals or val is None:
        return f"- {name} vs best of {', '.join(base)} ({key}): n/a"
    ref = max(ref_vals)
    r = val / ref if ref else float("inf")
    verdict = "meets" if r >= target else "misses"
    return f"- {name} / best of {', '.join(base)} ({key}): **{r:.2f}x** (target {target:.2f}x: {verdict})"


TPOT_TEXT = {
    "worst": "the worst per-token TPOT, max over tokens j >= 2 of (token j - token 1) / (j - 1), seed 003's",
    "mean": "(last - first token) / (outputs - 1)",
}
"""How the header states the TPOT the runs use (``BenchConfig.tpot_metric``; ``docs/benchmarks.md``, "TPOT")."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "batch-policies.md")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="two load points per workload (a smoke run)")
    parser.add_argument("--save-json", type=Path, help="also write every run's numbers here")
    parser.add_argument("--from-json", type=Path, help="re-render the report from a --save-json file, no runs")
    args = parser.parse_args()
    started = time.perf_counter()
    jobs: list[tuple[str, Variant, float, str, int]] = []
    for workload, (_, scales) in WORKLOADS.items():
        use = scales[2:4] if args.quick else scales
        for scale in use:
            for v in VARIANTS:
                jobs.append((workload, v, scale, "h100-llama31-8b", 4))
    sat_variants = (
        *(Variant(p, p) for p in ("vllm", "eb", "eb+")),
        Variant("eb theta=0.05", "eb", (("theta", "0.05"),)),
    )
    sat_jobs = [
        ("all-at-once:n=3000", v, 1.0, prof, 1)
        for prof in ("h100-llama31-8b", "rtxpro6000-llama31-8b-derived")
        for v in sat_variants
    ]
    runs: list[dict[str, Any]] = []
    if args.from_json:
        runs = json.loads(args.from_json.read_text())
    else:
        with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
            for i, r in enumerate(pool.map(one_run, jobs + sat_jobs)):
                runs.append(r)
                print(f"[{i + 1}/{len(jobs) + len(sat_jobs)}] {r['workload']} {r['variant']} x{r['scale']:g} "
                      f"{r['profile']}: goodput {r['summary']['goodput_rps']:.2f}/s ({r['wall_s']:.1f} s)",
                      flush=True)
    if args.save_json:
        args.save_json.write_text(json.dumps(runs, indent=1) + "\n")
    if args.quick:
        for w in WORKLOADS:
            WORKLOADS[w] = (WORKLOADS[w][0], WORKLOADS[w][1][2:4])

    out: list[str] = [
        "# Per-step batch policies: measured in the simulator",
        "",
        f"Generated by `python tests/benchmarks/bench_batch_policies.py` on {datetime.date.today()} "
        f"({platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{time.perf_counter() - started:.0f} s). Simulated units (`agent/engine/sim.py`) with the calibration "
        f"profiles; the simulator is not tuned for any policy. SLOs: TTFT 500 ms, TPOT 50 ms (TPOT = "
        f"{TPOT_TEXT[BenchConfig().tpot_metric]} per request; a request counts when it meets both). Goodput = such "
        "requests per second of the run; refused requests count as misses. Load at 90% SLO: the offered "
        "load where attainment first falls below 90%, interpolated between sweep points. The rows `fairbatching` "
        "and `fairbatching+pab` run with `anchor=arrival` (the paper's envelope alone), the rows marked "
        "\"first-token anchor\" with `anchor=first_token` (the policies' default since 2026-11-26).",
        "",
        "## Goodput over a load sweep (H100 8B profile, 4 units, least_loaded)",
        "",
    ]
    tables = {}
    for w in WORKLOADS:
        lines, tables[w] = goodput_section(runs, w)
        out += lines
    out += ["### Against the papers' targets", ""]
    for w, t in tables.items():
        out.append(f"{WORKLOADS[w][0]}:")
        for name in ("fairbatching", "fairbatching (first-token anchor)"):
            out.append(ratio_line(t, "peak", name, ("vllm", "sarathi"), 1.15))
            out.append(ratio_line(t, "cap90", name, ("vllm", "sarathi"), 1.15))
        for name in ("fairbatching+pab", "fairbatching+pab (first-token anchor)"):
            out.append(ratio_line(t, "peak", name, ("vllm", "sarathi"), 1.5))
            out.append(ratio_line(t, "cap90", name, ("vllm", "sarathi"), 1.5))
        out.append("")
    out += [
        "## Saturation throughput (all-at-once, 3,000 sharegpt-like requests, one unit)",
        "",
        "| profile | vllm (mixed) out tok/s | eb out tok/s | eb+ out tok/s | eb / vllm | eb+ / best | eb, theta fixed "
        "at 0.05 | its ratio to vllm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for prof in ("h100-llama31-8b", "rtxpro6000-llama31-8b-derived"):
        tput = {r["variant"]: r["summary"]["output_tokens_per_s"] for r in runs if r["profile"] == prof
                and r["workload"].startswith("all-at-once")}
        best = max(tput["vllm"], tput["eb"])
        out.append(
            f"| {prof} | {tput['vllm']:,.0f} | {tput['eb']:,.0f} | {tput['eb+']:,.0f} | "
            f"{tput['eb'] / tput['vllm']:.3f} | {tput['eb+'] / best:.3f} | {tput['eb theta=0.05']:,.0f} | "
            f"{tput['eb theta=0.05'] / tput['vllm']:.3f} |"
        )
    out += [
        "",
        "Targets (seed 002): EB within 3% of mixed batching on the H100 profile (eb / vllm >= 0.97), at least "
        "10% ahead on the bandwidth-constrained one (>= 1.10), EB+ never more than 2% behind the better of the "
        "two (eb+ / best >= 0.98).",
        "",
    ]
    text = "\n".join(line for line in out) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
