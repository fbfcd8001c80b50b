"""SLO strictness, as seed 003's Table 5: FairBatching's and +PAB's peak effective RPS over the best baseline's,
per (TTFT, TPOT) SLO pair (issue #19, item 10).

    python tests/benchmarks/bench_slo_strictness.py [--workload code|qwen-like|both] [--slos 500/50,2000/200]
        [--limit 2000] [--grid 512,1024,1536,2048,4096] [--json out.json] [--quick]
    python tests/benchmarks/bench_slo_strictness.py --from-json a.json [b.json ...]   # re-render, no runs

Per workload and SLO pair, as ``trackside bench --sweep knee --tune-sarathi`` does it (the same functions:
:func:`agent.bench.tuning.tune_sarathi`, :func:`agent.bench.knee.knee_sweep`): Sarathi's token budget is tuned
over the grid, vLLM's default is searched as shipped, the better of the two baselines' loads at 90% attainment is
the knee, and vllm, sarathi (tuned), fairbatching and fairbatching+pab run at ``--knee-points`` loads from 0.8x to
1.3x of it. The first-token-anchor variants of both FairBatching policies (``anchor=first_token``) then run at the
same loads. Each policy's score is its peak effective RPS in the band (offered RPS x SLO attainment, refusals
counted as misses, TPOT the worst per token: seed 003 section 5.1) over the best baseline's; a peak at the band's
top load is marked ``^`` (a lower bound: the policy's effective RPS was still rising), one at its bottom load ``v``
(it may be higher below the band), and a load at 90% ``+`` when the policy met the target at every load of the band.

Seed 003's Table 5 used one Qwen3-14B engine on QwenTrace and a 4 x 4 grid (TTFT 500-2000 ms x TPOT 50-200 ms).
Here: ``--units`` H100-8B units (profile h100-llama31-8b) behind least_loaded, and two workloads: ``code``, the
Azure code 2023 trace's first ``--limit`` requests; ``qwen-like``, Poisson arrivals with lognormal lengths fitted
to QwenTrace's mean and p90 in seed 003's Table 2 (prompt 892 / 1,776, output 377 / 742 tokens), the nearest
conversation-like workload in the repository (the Azure conversation trace is not in it). Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "examples" / "traces" / "azure_code_2023.csv"

QWEN_LIKE = ("poisson:rate=30,n={n},prompt=lognormal(6.498,0.7675,lo=1,hi=16000),"
             "output=lognormal(5.655,0.7445,lo=1,hi=4096)")
"""QwenTrace-like: lognormal (mu, sigma) solved from the mean and p90 of seed 003's Table 2 (prompt 892 / 1,776,
output 377 / 742; the first 2,000 draws of seed 0 give 914 / 1,855 and 376 / 727)."""

WORKLOADS = {
    "code": "Azure LLM inference 2023, code (examples/traces/azure_code_2023.csv, first {n} requests)",
    "qwen-like": "QwenTrace-like: Poisson, lognormal lengths fitted to seed 003 Table 2, {n} requests, seed 0",
}

PAPER_SLOS = tuple((ttft, tpot) for ttft in (500, 1000, 1500, 2000) for tpot in (50, 100, 150, 200))
"""Seed 003 Table 5's grid: TTFT x TPOT SLOs in ms."""

DEFAULT_SLOS = ((500, 50), (500, 200), (1000, 100), (2000, 50), (2000, 200))
"""The corners of Table 5's grid and its diagonal's middle (a full grid is 16 knee sweeps per workload)."""

PAPER_TABLE5: dict[str, dict[tuple[int, int], float]] = {
    "fairbatching": dict(zip(PAPER_SLOS, (15.4, 7.5, 5.6, 6.1, 11.6, 8.1, 3.9, 2.8,
                                          8.3, 4.8, 2.6, 0.6, 6.8, 4.5, 1.5, -0.4), strict=True)),
    "fairbatching+pab": dict(zip(PAPER_SLOS, (112.6, 91.8, 84.9, 78.3, 76.5, 64.9, 54.7, 55.5,
                                              63.7, 52.1, 36.2, 32.5, 59.9, 45.9, 26.5, 24.8), strict=True)),
}
"""Seed 003 Table 5: gain in peak goodput over max(vLLM-sarathi, vLLM-vanilla), percent (QwenTrace, Qwen3-14B)."""


@dataclass(frozen=True, slots=True)
class Variant:
    """One compared row: a batch policy and its parameters."""

    label: str
    policy: str
    params: tuple[tuple[str, str], ...] = ()


FIRST_TOKEN = (("anchor", "first_token"),)
ARRIVAL = (("anchor", "arrival"),)
FAIRBATCHING = ("fairbatching", "fairbatching+pab")
"""The knee sweep's FairBatching rows pin the arrival anchor (the paper's envelope), the policy's default until
2026-11-26, so that they keep measuring what they measured when the default became ``first_token``; the first-token
rows are the extra variants."""
EXTRA_VARIANTS = (
    Variant("fairbatching, first-token anchor", "fairbatching", FIRST_TOKEN),
    Variant("fairbatching+pab, first-token anchor", "fairbatching+pab", FIRST_TOKEN),
)
"""Run at the knee sweep's band loads after it (the sweep groups runs by policy name, so these go apart)."""

ROW_ORDER = ("vllm", "sarathi", "fairbatching", "fairbatching, first-token anchor", "fairbatching+pab",
             "fairbatching+pab, first-token anchor")


def parse_slos(text: str) -> tuple[tuple[int, int], ...]:
    """``500/50,2000/200`` as ((500, 50), (2000, 200)); ``paper`` is Table 5's 4 x 4 grid."""
    if text.strip() == "paper":
        return PAPER_SLOS
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        ttft, sep, tpot = item.partition("/")
        try:
            pair = (int(ttft), int(tpot))
        except ValueError:
            raise ValueError(f"an SLO pair is TTFT_MS/TPOT_MS, e.g. 2000/50 (got {item!r})") from None
        if not sep or min(pair) <= 0:
            raise ValueError(f"an SLO pair is TTFT_MS/TPOT_MS with both > 0 (got {item!r})")
        out.append(pair)
    if not out:
        raise ValueError("give at least one SLO pair, e.g. 2000/50")
    return tuple(dict.fromkeys(out))


def policy_rows(band: Mapping[str, Sequence[tuple[float, float]]], knee_rps: float, baseline: str,
                target: float) -> list[dict[str, Any]]:
    """Per label, from its band runs ``(offered_rps, attainment)``: the load sustained at ``target`` and its ratio
    to ``knee_rps``, the peak effective RPS, whether the peak is at the band's top load, and the ratio of the peak
    to ``baseline``'s (a label of ``band``)."""

    def peak(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
        best = max(points, key=lambda p: p[0] * p[1])
        return best[0] * best[1], best[0]

    base_peak = peak(band[baseline])[0]
    rows = []
    for label, points in band.items():
        sustained = _capacity(points, target)
        eff, at = peak(points)
        rows.append({
            "policy": label, "sustained_rps": sustained,
            "knee_ratio": None if sustained is None else sustained / knee_rps,
            "sustained_at_band_top": all(y >= target for _, y in points),
            "peak_effective_rps": eff,
            "peak_at_band_top": at == max(x for x, _ in points),
            "peak_at_band_bottom": at == min(x for x, _ in points),
            "effective_ratio": eff / base_peak if base_peak > 0 else None,
        })
    return rows


def peak_mark(row: Mapping[str, Any]) -> str:
    """``^`` when a row's peak effective RPS is at the band's top load (it was still rising: a lower bound), ``v``
    at its bottom (it may be higher at lighter loads, below the band), else nothing."""
    return "^" if row["peak_at_band_top"] else "v" if row.get("peak_at_band_bottom") else ""


def _capacity(points: Iterable[tuple[float, float]], target: float) -> float | None:
    # agent.bench.report.slo_capacity, imported late so that --help and the pure helpers need no simulator.
    from agent.bench.report import slo_capacity

    return slo_capacity(points, target)


def gain(ratio: float | None) -> str:
    """A ratio as the paper's gain, e.g. 1.154 -> ``+15.4%``."""
    return "n/a" if ratio is None else f"{(ratio - 1) * 100:+.1f}%"


def render_grid(cells: Sequence[Mapping[str, Any]], label: str, paper: Mapping[tuple[int, int], float] | None) -> \
        list[str]:
    """Table 5's layout for one policy: TTFT SLO rows x TPOT SLO columns, each cell this run's gain (``^``: the
    policy's peak was at the band's top load) and, when given, the paper's in parentheses."""
    slos = {(c["ttft_ms"], c["tpot_ms"]): c for c in cells}
    ttfts = sorted({t for t, _ in slos})
    tpots = sorted({p for _, p in slos})
    lines = ["| TTFT SLO \\ TPOT SLO | " + " | ".join(f"{p} ms" for p in tpots) + " |",
             "|---" * (len(tpots) + 1) + "|"]
    for t in ttfts:
        row = []
        for p in tpots:
            cell = slos.get((t, p))
            if cell is None:
                row.append("")
                continue
            r = next((x for x in cell["policies"] if x["policy"] == label), None)
            text = "n/a" if r is None else gain(r["effective_ratio"]) + peak_mark(r)
            if paper is not None and (t, p) in paper:
                text += f" ({paper[(t, p)]:+.1f}%)"
            row.append(text)
        lines.append(f"| {t} ms | " + " | ".join(row) + " |")
    return lines


def render_detail(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """One row per SLO pair and policy: the knee, Sarathi's budget, sustained load and peak effective RPS."""
    lines = ["| SLO TTFT/TPOT ms | knee req/s (baseline) | sarathi budget (derived) | policy | load at 90% "
             "req/s (x knee) | peak effective RPS (x best baseline) | runs, s |",
             "|---|---|---|---|---|---|---|"]
    for c in cells:
        first = True
        by_label = {r["policy"]: r for r in c["policies"]}
        for label in [x for x in ROW_ORDER if x in by_label]:
            r = by_label[label]
            sus = "below band" if r["sustained_rps"] is None else (
                f"{r['sustained_rps']:.2f} ({r['knee_ratio']:.3f}{'+' if r['sustained_at_band_top'] else ''})")
            eff = f"{r['peak_effective_rps']:.2f} ({r['effective_ratio']:.3f}{peak_mark(r)})"
            head = (f"{c['ttft_ms']}/{c['tpot_ms']} | {c['knee_rps']:.2f} ({c['baseline']}) | "
                    f"{c['sarathi_budget']} ({c['sarathi_derived']}) | " if first else "| | | | ")
            tail = f"{c['num_runs']}, {c['wall_s']:.0f}" if first else ""
            lines.append(("| " if first else "") + head + f"{label} | {sus} | {eff} | {tail} |")
            first = False
    return lines


def render(cells: Sequence[Mapping[str, Any]]) -> str:
    """The Markdown report: per workload, Table 5's grid for each FairBatching row, then the details."""
    out: list[str] = []
    for workload in dict.fromkeys(c["workload"] for c in cells):
        mine = [c for c in cells if c["workload"] == workload]
        out += [f"### {mine[0]['description']}", ""]
        for label, paper_key in (("fairbatching", "fairbatching"), ("fairbatching, first-token anchor", None),
                                 ("fairbatching+pab", "fairbatching+pab"),
                                 ("fairbatching+pab, first-token anchor", None)):
            paper = PAPER_TABLE5.get(paper_key) if paper_key else None
            note = " (paper's Table 5 in parentheses)" if paper else ""
            out += [f"{label}: peak effective RPS over the best baseline's{note}", ""]
            out += [*render_grid(mine, label, paper), ""]
        out += [*render_detail(mine), ""]
    return "\n".join(out)


def run_cell(workload: str, requests: Sequence[Any], ttft_ms: int, tpot_ms: int, args: argparse.Namespace) -> \
        dict[str, Any]:
    """One SLO pair on one workload: tune Sarathi, the knee sweep, the first-token variants at the band's loads."""
    from agent.bench.knee import KneeSearch, knee_sweep
    from agent.bench.report import offered_rps
    from agent.bench.runner import BenchConfig, RunResult, run_once
    from agent.bench.tuning import TUNED_POLICY, apply_tuning, tune_sarathi

    started = time.monotonic()
    runs = 0

    def run_at(config: BenchConfig) -> RunResult:
        nonlocal runs
        runs += 1
        result = run_once(config, requests)
        if not args.no_progress:
            print(f"  {workload} {ttft_ms}/{tpot_ms} {config.batch_policy} {dict(config.params)} "
                  f"x{config.time_scale:.3g}: {result.offered_rps:.2f} req/s, "
                  f"{result.summary['slo_attainment']:.1%}", file=sys.stderr, flush=True)
        return result

    search = KneeSearch(target=args.slo_target, points=args.knee_points, low=args.band[0], high=args.band[1])
    base = BenchConfig(profile=args.profile, units=args.units, ttft_slo_ms=float(ttft_ms), tpot_slo_ms=float(tpot_ms),
                       tpot_metric="worst", seed=args.seed)
    configs = [replace(base, batch_policy=p, params={f"{p}.{k}": v for k, v in ARRIVAL} if p in FAIRBATCHING else {})
               for p in ("vllm", "sarathi", *FAIRBATCHING)]
    tuning = tune_sarathi(base, run_at, search, args.grid)
    configs = apply_tuning(configs, {base.dispatch: tuning})
    known = {f"{TUNED_POLICY}/{base.dispatch}": k for k in [tuning.known_knee()] if k is not None}
    rps1 = offered_rps([r.arrival_s for r in requests])
    found = knee_sweep(configs, run_at, search, rps1, known)
    cell: dict[str, Any] = {
        "workload": workload, "description": WORKLOADS[workload].format(n=f"{len(requests):,}"),
        "ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "knee_rps": found.knee_rps, "baseline": found.baseline.split("/")[0],
        "baseline_knees": found.baseline_knees, "sarathi_budget": tuning.chosen, "sarathi_derived": tuning.derived,
        "sarathi_scores": {s.budget: s.score for s in tuning.scores},
        "band_low": search.low, "band_high": search.high, "policies": [], "band": {},
    }
    if found.knee_rps is None:
        cell.update(num_runs=runs, wall_s=time.monotonic() - started)
        return cell
    band: dict[str, list[tuple[float, float]]] = {}
    details: dict[str, list[dict[str, Any]]] = {}

    def keep(label: str, r: RunResult) -> None:
        band.setdefault(label, []).append((r.offered_rps, r.summary["slo_attainment"]))
        details.setdefault(label, []).append({
            "offered_rps": r.offered_rps, "slo_attainment": r.summary["slo_attainment"], "refused": r.refused,
            "ttft_p99_ms": r.summary["ttft_ms"]["p99"], "tpot_p99_ms": r.summary["tpot_ms"]["p99"],
            "params": {k: v for k, v in r.batch_params.items() if k in ("token_budget", "anchor")}})

    for r in found.band_runs:
        keep(r.config.batch_policy, r)
    for v in EXTRA_VARIANTS:
        config = replace(base, batch_policy=v.policy, params={f"{v.policy}.{k}": x for k, x in v.params})
        for load in search.band(found.knee_rps):
            keep(v.label, run_at(replace(config, time_scale=rps1 / load)))
    cell["policies"] = policy_rows(band, found.knee_rps, cell["baseline"], search.target)
    cell["band"] = details
    cell.update(num_runs=runs, wall_s=time.monotonic() - started)
    return cell


def load_workload(name: str, limit: int) -> list[Any]:
    from agent.workload.spec import parse_workload
    from agent.workload.traces import load_trace

    if name == "code":
        return load_trace(TRACE, limit=limit)
    return parse_workload(QWEN_LIKE.format(n=limit), seed=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("code", "qwen-like", "both"), default="both")
    parser.add_argument("--slos", type=parse_slos, default=DEFAULT_SLOS, metavar="T1/P1,T2/P2|paper",
                        help="TTFT/TPOT SLO pairs in ms (default 500/50,500/200,1000/100,2000/50,2000/200; "
                             "'paper': Table 5's 16)")
    parser.add_argument("--limit", type=int, default=2000, help="requests per workload (default 2000)")
    parser.add_argument("--units", type=int, default=4)
    parser.add_argument("--profile", default="h100-llama31-8b")
    parser.add_argument("--grid", type=_grid, default=(512, 1024, 1536, 2048, 4096), metavar="B1,B2,...",
                        help="Sarathi's token budgets tried (default 512,1024,1536,2048,4096)")
    parser.add_argument("--knee-points", type=int, default=8)
    parser.add_argument("--band", type=_band, default=(0.8, 1.3), metavar="LOW,HIGH",
                        help="the band around the knee (default 0.8,1.3, as --sweep knee)")
    parser.add_argument("--slo-target", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every cell's numbers here")
    parser.add_argument("--from-json", type=Path, nargs="+", help="re-render from --json files, no runs")
    parser.add_argument("--no-progress", action="store_true", help="no line per run on stderr")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: code trace, 300 requests, 2000/50 only, budgets 1024,1536, 3 band points")
    return parser


def _grid(text: str) -> tuple[int, ...]:
    from agent.bench.tuning import parse_grid

    try:
        return parse_grid(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _band(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    try:
        band = (float(low), float(high))
    except ValueError:
        raise argparse.ArgumentTypeError(f"LOW,HIGH, e.g. 0.8,1.3 (got {text!r})") from None
    if not 0 < band[0] < band[1]:
        raise argparse.ArgumentTypeError(f"0 < LOW < HIGH (got {text!r})")
    return band


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        cells = [c for p in args.from_json for c in json.loads(p.read_text())["cells"]]
        for c in cells:  # the rows again from the band runs kept, as this version scores them
            if c.get("band"):
                c["policies"] = policy_rows({k: [(x["offered_rps"], x["slo_attainment"]) for x in v]
                                             for k, v in c["band"].items()}, c["knee_rps"], c["baseline"],
                                            args.slo_target)
        print(render(cells))
        return 0
    if args.quick:
        args.workload, args.limit, args.slos, args.grid, args.knee_points = "code", 300, ((2000, 50),), (1024, 1536), 3
    names = ("code", "qwen-like") if args.workload == "both" else (args.workload,)
    started = time.monotonic()
    cpu0 = time.process_time()
    cells = []
    for name in names:
        requests = load_workload(name, args.limit)
        for ttft, tpot in args.slos:
            cells.append(run_cell(name, requests, ttft, tpot, args))
            if args.json:  # after every cell, so that an interrupted run keeps what it finished
                _write(args, cells, started, cpu0)
    print(render(cells))
    print(f"\n{sum(c['num_runs'] for c in cells)} runs, {time.monotonic() - started:.0f} s wall, "
          f"{time.process_time() - cpu0:.0f} s CPU (python {platform.python_version()}, {platform.machine()})")
    return 0


def _write(args: argparse.Namespace, cells: list[dict[str, Any]], started: float, cpu0: float) -> None:
    meta = {"argv": sys.argv[1:], "wall_s": time.monotonic() - started, "cpu_s": time.process_time() - cpu0,
            "grid": list(args.grid), "limit": args.limit, "units": args.units, "profile": args.profile}
    args.json.write_text(json.dumps({"meta": meta, "cells": cells}, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
