"""The PAB balancer measured as seed 003 section 5.5 measures it (issue #19 item 9).

    python tests/benchmarks/bench_pab_balancer.py [--out docs/dispatch-pab.md] [--jobs 2] [--quick]
    python tests/benchmarks/bench_pab_balancer.py --from-json docs/dispatch-pab.json   # re-render, no runs

Seed 003's Figure 8 compares, on a DP group of single-GPU engines, vLLM's load balancer (``least_loaded`` here:
``4 * waiting + running``) in front of vLLM's default scheduler, of Sarathi and of FairBatching, against the PAB
balancer in front of FairBatching, by peak goodput = the best effective RPS over a load sweep. Here: 4 simulated
units of the H100 8B profile, the Azure LLM inference 2023 code trace (8,819 requests), each arrival time scale a
load point. Effective RPS = offered RPS x SLO attainment (computed here, seed 003 section 5.1); the load at 90%
attainment is interpolated between points (``agent.bench.report.slo_capacity``).

* ``paper``: SLOs TTFT 2000 ms / TPOT 50 ms (the paper's for the Azure traces), all seven configurations.
* ``overload``: TTFT 500 ms / TPOT 50 ms past the knee, FairBatching behind ``least_loaded`` and both ``pab``
  versions: where the unbounded wait showed.

``pab (unbounded wait)`` is the balancer before issue #19 (``max_wait_ttft_frac=inf`` decides exactly as the old
code did). ``-ft``: FairBatching with ``anchor=first_token``. Every run is ``trackside bench --trace
examples/traces/azure_code_2023.csv --units 4 --batch-policy B --dispatch D --slo-ttft-ms T --slo-tpot-ms 50
--time-scale S [--param ...]``. "Longest wait" is the longest any request spent at the dispatcher before a unit
took it (read from the balancer's decisions; only ``pab`` holds requests). Writes a Markdown report
(docs/dispatch-pab.md comes from this script) and the raw numbers beside it (``.json``), and prints the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.bench.report import slo_capacity
from agent.bench.runner import BenchConfig, run_once
from agent.workload.traces import load_trace
from policies.dispatch.pab import PabBalancer
from policies.types import DispatchDecision, PendingRequest, UnitLoad

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "examples" / "traces" / "azure_code_2023.csv"
FT = ("fairbatching.anchor", "first_token")
ARR = ("fairbatching.anchor", "arrival")
"""The rows without ``-ft`` pin the arrival anchor (the paper's envelope), the policy's default until 2026-11-26,
so that they measure what they measured before the default became ``first_token``."""
UNBOUNDED = ("pab.max_wait_ttft_frac", "inf")


@dataclass(frozen=True)
class Variant:
    label: str
    batch_policy: str
    dispatch: str
    params: tuple[tuple[str, str], ...] = ()
    baseline: bool = False
    """One of the paper's baselines (vLLM's balancer in front of vLLM's or Sarathi's scheduler)."""


@dataclass(frozen=True)
class Experiment:
    title: str
    ttft_slo_ms: float
    scales: tuple[float, ...]
    """Arrival time scales, light to heavy (1.0 = the trace's own 2.4 req/s)."""
    variants: tuple[Variant, ...]


PAPER = (
    Variant("vllm / least_loaded", "vllm", "least_loaded", baseline=True),
    Variant("sarathi / least_loaded", "sarathi", "least_loaded", baseline=True),
    Variant("fairbatching / least_loaded", "fairbatching", "least_loaded", (ARR,)),
    Variant("fairbatching / pab (unbounded wait)", "fairbatching", "pab", (ARR, UNBOUNDED)),
    Variant("fairbatching / pab", "fairbatching", "pab", (ARR,)),
    Variant("fairbatching-ft / least_loaded", "fairbatching", "least_loaded", (FT,)),
    Variant("fairbatching-ft / pab (unbounded wait)", "fairbatching", "pab", (FT, UNBOUNDED)),
    Variant("fairbatching-ft / pab", "fairbatching", "pab", (FT,)),
)
EXPERIMENTS = {
    "paper": Experiment(
        "Seed 003 5.5's conditions: TTFT 2000 ms, TPOT 50 ms",
        2000.0,
        (0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.12, 0.1),
        PAPER,
    ),
    "overload": Experiment(
        "Past the knee at TTFT 500 ms, TPOT 50 ms",
        500.0,
        (0.2, 0.15, 0.12),
        tuple(v for v in PAPER if v.label.startswith("fairbatching /")),
    ),
}

_WAIT = {"longest_s": 0.0, "aged": 0}
_dispatch = PabBalancer.dispatch


def _observed(
    self: PabBalancer, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float
) -> DispatchDecision:
    """``PabBalancer.dispatch``, noting the longest wait of a request it places and its aged fallbacks."""
    d = _dispatch(self, pending, units, now_s)
    placed = {rid for rid, _ in d.assignments}
    waits = [now_s - p.arrival_s for p in pending if p.request_id in placed]
    _WAIT["longest_s"] = max(_WAIT["longest_s"], *waits) if waits else _WAIT["longest_s"]
    aged = d.reasons.get("aged_fallbacks", 0)
    _WAIT["aged"] += aged if isinstance(aged, int) else 0
    return d


PabBalancer.dispatch = _observed  # type: ignore[method-assign]


def one_run(job: tuple[str, Variant, float]) -> dict[str, Any]:
    exp_name, variant, scale = job
    exp = EXPERIMENTS[exp_name]
    config = BenchConfig(
        units=4,
        batch_policy=variant.batch_policy,
        dispatch=variant.dispatch,
        params=dict(variant.params),
        ttft_slo_ms=exp.ttft_slo_ms,
        tpot_slo_ms=50.0,
        time_scale=scale,
    )
    _WAIT.update(longest_s=0.0, aged=0)
    t0 = time.perf_counter()
    result = run_once(config, load_trace(TRACE))
    s = result.summary
    return {
        "experiment": exp_name,
        "tpot_metric": getattr(config, "tpot_metric", "mean"),
        "variant": variant.label,
        "scale": scale,
        "offered_rps": result.offered_rps,
        "effective_rps": result.offered_rps * s["slo_attainment"],
        "refused": result.refused,
        "longest_wait_s": _WAIT["longest_s"],
        "aged_fallbacks": _WAIT["aged"],
        "summary": s,
        "wall_s": time.perf_counter() - t0,
    }


def fmt(x: float | None, nd: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{nd}f}"


def render(exp_name: str, runs: list[dict[str, Any]]) -> list[str]:
    exp = EXPERIMENTS[exp_name]
    runs = [r for r in runs if r["experiment"] == exp_name]
    scales = sorted({r["scale"] for r in runs}, reverse=True)
    labels = [v.label for v in exp.variants if any(r["variant"] == v.label for r in runs)]
    by = {(r["variant"], r["scale"]): r for r in runs}
    offered = {s: next(r["offered_rps"] for r in runs if r["scale"] == s) for s in scales}
    out = [f"### {exp.title}", ""]
    out.append("| batch / dispatch | " + " | ".join(f"{offered[s]:.2f} req/s" for s in scales) + " |")
    out.append("|---|" + "---|" * len(scales))
    for label in labels:
        cells = []
        for s in scales:
            r = by.get((label, s))
            q = r["summary"] if r else None
            cells.append(
                ""
                if r is None or q is None
                else f"{100 * q['slo_attainment']:.1f}% · {r['effective_rps']:.2f} · {q['ttft_ms']['p99'] / 1e3:.2f} s"
                + (f" · {r['longest_wait_s']:.2f} s" if label.endswith("pab") or "(unbounded" in label else "")
            )
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out += [
        "",
        "Each cell: SLO attainment · effective RPS (offered x attainment) · TTFT p99 · for `pab`, the longest wait "
        "at the dispatcher.",
        "",
    ]
    peaks: dict[str, tuple[float, float, float | None]] = {}
    for label in labels:
        rs = sorted((r for r in runs if r["variant"] == label), key=lambda r: r["offered_rps"])
        best = max(rs, key=lambda r: r["effective_rps"])
        cap = slo_capacity([(r["offered_rps"], r["summary"]["slo_attainment"]) for r in rs], 0.9)
        peaks[label] = (best["effective_rps"], best["offered_rps"], cap)
    bases = [peaks[v.label][0] for v in exp.variants if v.baseline and v.label in peaks]
    base = max(bases) if bases else peaks[labels[0]][0]
    against = "best baseline" if bases else f"`{labels[0]}`"
    out += [
        f"| batch / dispatch | peak effective RPS | at offered | load at 90% SLO | peak vs {against} |",
        "|---|---|---|---|---|",
    ]
    for label in labels:
        peak, at, cap = peaks[label]
        out.append(f"| {label} | {peak:.2f} | {at:.2f} | {fmt(cap)} | {peak / base:.2f}x |")
    out.append("")
    return out


def verdicts(runs: list[dict[str, Any]]) -> list[str]:
    """The issue's goal (+PAB >= 1.5x the best baseline's peak effective RPS) and PAB's own gain over vLLM's
    balancer on the same FairBatching units, per anchor."""
    exp = EXPERIMENTS["paper"]
    mine = [r for r in runs if r["experiment"] == "paper"]

    def peak(label: str) -> float | None:
        vals = [r["effective_rps"] for r in mine if r["variant"] == label]
        return max(vals) if vals else None

    bases = [p for v in exp.variants if v.baseline and (p := peak(v.label)) is not None]
    if not bases:
        return []
    base = max(bases)
    out = [f"### Against the goal ({exp.title})", ""]
    for anchor in ("fairbatching", "fairbatching-ft"):
        after, before, ll = (peak(f"{anchor} / {d}") for d in ("pab", "pab (unbounded wait)", "least_loaded"))
        if after is None:
            continue
        verdict = "met" if after >= 1.5 * base else "not met"
        out.append(
            f"- `{anchor} / pab` peak effective RPS {after:.2f} = **{after / base:.2f}x** the best baseline's "
            f"{base:.2f} (goal 1.5x: {verdict})"
            + (f"; {after / ll:.2f}x `{anchor} / least_loaded`" if ll else "")
            + (f"; unbounded wait {before / base:.2f}x" if before else "")
            + "."
        )
    out += [
        "",
        "For scale: on the Azure trace the paper's own cluster result (section 5.5, Figure 8, DP 8) is +7.7% for the "
        "PAB balancer over FairBatching behind vLLM's balancer, and +38.3% or +10.2% over the best baseline (its "
        "text lists four overall gains for three traces); the 1.5x goal comes from the single-node "
        "FairBatching-PAB (1.90x, refused requests counted as misses), not from the cluster experiment.",
        "",
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dispatch-pab.md")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="two load points per experiment (a smoke run)")
    parser.add_argument("--from-json", type=Path, help="re-render the report from this file's runs")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        meta, runs = saved["meta"], saved["runs"]
    else:
        jobs = [
            (name, v, s)
            for name, exp in EXPERIMENTS.items()
            for s in (exp.scales[1:3] if args.quick else exp.scales)
            for v in exp.variants
        ]
        runs = []
        with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
            for i, r in enumerate(pool.map(one_run, jobs)):
                runs.append(r)
                print(
                    f"[{i + 1}/{len(jobs)}] {r['experiment']} {r['variant']} x{r['scale']:g}: "
                    f"{r['offered_rps']:.2f}/s, attainment {100 * r['summary']['slo_attainment']:.1f}%, TTFT p99 "
                    f"{r['summary']['ttft_ms']['p99']:.0f} ms, longest wait {r['longest_wait_s']:.2f} s "
                    f"({r['wall_s']:.1f} s)",
                    flush=True,
                )
        u = platform.uname()
        meta = {
            "date": str(datetime.date.today()),
            "machine": f"{u.system} {u.release} {u.machine}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}",
            "wall_s": round(time.perf_counter() - started),
            "tpot_metric": sorted({r["tpot_metric"] for r in runs}),
        }
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    out = [
        "# The PAB balancer: measured as seed 003 section 5.5 measures it",
        "",
        f"Generated by `python tests/benchmarks/bench_pab_balancer.py` on {meta['date']} ({meta['machine']}; "
        f"{meta['wall_s']} s); raw runs in `{args.out.with_suffix('.json').name}`. H100 8B profile, 4 simulated "
        "units, Azure LLM inference 2023 code trace (8,819 requests), arrivals scaled to each load. TPOT: "
        f"{' / '.join(meta['tpot_metric'])} per request (`mean` = (last - first token) / (outputs - 1)); a request "
        "meets its SLO when it meets both targets. Effective RPS = offered RPS x SLO attainment (seed 003 "
        "section 5.1); the load at 90% SLO is interpolated between points. `-ft`: FairBatching with "
        "`anchor=first_token`; without `-ft`: `anchor=arrival` (the policy's default until 2026-11-26); "
        "`pab (unbounded wait)`: `max_wait_ttft_frac=inf`, the balancer before issue #19. "
        "Baselines: vLLM's balancer (`least_loaded`) in front of `vllm` and `sarathi`, as in the paper's Figure 8. "
        "See the script's docstring.",
        "",
    ]
    for name in EXPERIMENTS:
        if any(r["experiment"] == name for r in runs):
            out += render(name, runs)
    out += verdicts(runs)
    text = "\n".join(out)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
