"""Tables the ``trackside`` command prints (rich renderables from plain data; no computation here)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from agent.bench.knee import KneeResult
from agent.bench.report import slo_capacity
from agent.bench.runner import RunResult
from agent.bench.tuning import TUNED_POLICY, SarathiTuning
from agent.plugins import PluginReport
from policies.base import BatchPolicy, DispatchPolicy

_COMPACT: dict[str, Any] = {"box": box.SIMPLE_HEAD, "padding": (0, 1), "pad_edge": False, "collapse_padding": True}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _run_label(r: RunResult, many_scales: bool) -> str:
    label = f"{r.config.batch_policy}/{r.config.dispatch}"
    return f"{label} x{r.config.time_scale:g}" if many_scales else label


SUMMARY_ROWS: tuple[tuple[str, str], ...] = (
    ("completed / requests", "done"), ("rejected", "rejected"), ("duration s", "duration_s"),
    ("throughput req/s", "throughput_rps"), ("output tok/s", "output_tokens_per_s"),
    ("goodput req/s", "goodput_rps"), ("offered req/s", "offered_rps"), ("effective req/s", "effective_rps"),
    ("SLO attainment", "slo_attainment"),
    ("TTFT mean / p50 ms", "ttft_ms.mid"), ("TTFT p90 / p99 ms", "ttft_ms.tail"),
    ("TPOT mean / p50 ms", "tpot_ms.mid"), ("TPOT p90 / p99 ms", "tpot_ms.tail"),
    ("E2E mean / p50 ms", "e2e_ms.mid"), ("E2E p90 / p99 ms", "e2e_ms.tail"),
)


def _cell(summary: dict[str, Any], key: str) -> str:
    if key == "done":
        return f"{summary['completed']:,} / {summary['requests']:,}"
    if key.endswith((".mid", ".tail")):
        group, part = key.split(".")
        stats = summary[group]
        a, b = ("mean", "p50") if part == "mid" else ("p90", "p99")
        return f"{_ms(stats[a])} / {_ms(stats[b])}"
    value = summary[key]
    if value is None:
        return "-"
    if key == "slo_attainment":
        return f"{100 * value:.1f}%"
    if key == "rejected":
        return f"{value:,}"
    if key in ("duration_s", "output_tokens_per_s"):
        return f"{value:,.1f}"
    return f"{value:.3f}"


WIDE_AFTER = 4
"""More runs than this are printed one row per run (columns would not fit a terminal)."""


def render_runs(console: Console, results: Sequence[RunResult]) -> None:
    """Up to ``WIDE_AFTER`` runs: one column per run, one row per metric; more: one row per run."""
    if len(results) > WIDE_AFTER:
        render_run_rows(console, results)
        return
    many_scales = len({r.config.time_scale for r in results}) > 1
    table = Table(title="Summary", title_justify="left", **_COMPACT)
    table.add_column("metric")
    for r in results:
        table.add_column(_run_label(r, many_scales), justify="right")
    for title, key in SUMMARY_ROWS:
        table.add_row(title, *(_cell(r.summary, key) for r in results))
    table.caption = (f"a request meets its SLO when TTFT and TPOT are both within target; TPOT: "
                     f"{_tpot_caption(results)}; effective: offered x SLO attainment")
    console.print(table)


def render_run_rows(console: Console, results: Sequence[RunResult]) -> None:
    """One row per run: the numbers a comparison or a sweep is read for."""
    many_dispatch = len({r.config.dispatch for r in results}) > 1
    table = Table(title="Summary", title_justify="left", **_COMPACT)
    cols = ["batch", *(["dispatch"] if many_dispatch else []), "scale", "load/s", "goodput/s", "eff/s", "SLO",
            "TTFT p50/p99 ms", "TPOT p50/p99 ms", "rej"]
    width = max(len(r.config.batch_policy) for r in results)
    for col in cols:
        if col == "batch":
            table.add_column(col, no_wrap=True, min_width=width)
        else:
            table.add_column(col, justify="left" if col == "dispatch" else "right")
    for r in results:
        s = r.summary
        ttft, tpot = s["ttft_ms"], s["tpot_ms"]
        row = [r.config.batch_policy, *([r.config.dispatch] if many_dispatch else []), f"{r.config.time_scale:g}",
               f"{r.offered_rps:,.1f}", f"{s['goodput_rps']:,.2f}", f"{s['effective_rps']:,.2f}",
               f"{100 * s['slo_attainment']:.1f}%",
               f"{_ms0(ttft['p50'])}/{_ms0(ttft['p99'])}", f"{_ms(tpot['p50'])}/{_ms(tpot['p99'])}",
               f"{s['rejected']:,}"]
        table.add_row(*row)
    table.caption = ("load: offered req/s; eff: load x SLO; SLO: requests meeting TTFT and TPOT targets; TPOT: "
                     f"{_tpot_caption(results)}; rej: rejected or refused")
    console.print(table)


def _tpot_caption(results: Sequence[RunResult]) -> str:
    metrics = sorted({r.config.tpot_metric for r in results})
    names = {"worst": "worst per-token", "mean": "mean per request"}
    return ", ".join(names.get(m, m) for m in metrics)


def _capacity_cell(cap: float | None, never_below: bool) -> str:
    if cap is None:
        return "below the sweep"
    return f">= {cap:.2f} req/s" if never_below else f"{cap:.2f} req/s"


def _ms0(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _count(n: int) -> str:
    """Compact counts: 950, 12.3k, 4.56M."""
    if n < 10_000:
        return f"{n:,}"
    if n < 10_000_000:
        return f"{n / 1e3:,.1f}k"
    return f"{n / 1e6:,.2f}M"


def render_units(console: Console, result: RunResult) -> None:
    table = Table(title="Per-unit load", title_justify="left", **_COMPACT)
    for col in ("unit", "steps", "busy", "batch", "ms", "KV", "KVmax", "prefill", "decode", "preempt", "done"):
        table.add_column(col, justify="right")
    for u in result.units:
        table.add_row(
            str(u["unit_id"]), _count(u["steps"]), f"{100 * u['busy_fraction']:.0f}%",
            f"{u['mean_batch_size']:.1f}", _ms(u["mean_step_ms"]), f"{100 * u['kv_usage_mean']:.0f}%",
            f"{100 * u['kv_usage_max']:.0f}%", _count(u["prefill_tokens"]), _count(u["decode_tokens"]),
            str(u["preemptions"]), _count(u["completed"]),
        )
    table.caption = "batch: requests per step; ms: mean step time; KV: mean and peak use; prefill, decode: tokens"
    console.print(table)


def render_cluster(console: Console, results: Sequence[RunResult]) -> None:
    """Per run: balance across units, prefill chunk use (per lockstep pass too, with lockstep), and what the dispatcher
    moved or held back."""
    many_scales = len({r.config.time_scale for r in results}) > 1
    passes = any(r.cluster.get("pass_chunk_utilization") is not None for r in results)
    table = Table(title="Cluster", title_justify="left", **_COMPACT)
    columns = ("run", "KV std tok", "batch std", "chunk use", *(("pass use",) if passes else ()), "migrations",
               "flow ctl", "faults", "stages")
    for col in columns:
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=col == "run")
    for r in results:
        c = r.cluster
        moves = c.get("migrations", 0)
        stages = c.get("stage_boundaries") or []
        uses = [c.get("prefill_chunk_utilization"), *((c.get("pass_chunk_utilization"),) if passes else ())]
        table.add_row(
            _run_label(r, many_scales), _count(round(c.get("kv_tokens_std", 0.0))),
            f"{c.get('batch_size_std', 0.0):.1f}",
            *("-" if util is None else f"{100 * util:.0f}%" for util in uses), f"{moves:,}",
            f"{c.get('flow_controlled_requests', 0):,}", str(c.get("faults", 0)),
            str(len(stages)) if stages else "-",
        )
    table.caption = (
        "std: spread across units over time (KV tokens, running requests; decode pool when disaggregated); "
        "chunk use: tokens per prefill-carrying step over the chunk capacity; "
        + ("pass use: the same per lockstep pass over every member's chunk (seed 000's metric: idle members count "
           "empty); " if passes else "")
        + "migrations: moves between units (JSON: by reason); flow ctl: requests held past the dispatcher's wait "
        "limit; stages: stage boundary changes (JSON: each change)"
    )
    console.print(table)


def render_peaks(console: Console, results: Sequence[RunResult], target: float = 0.9) -> None:
    """Per policy pair: the highest goodput of the sweep, and the load it sustains at ``target`` attainment."""
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.config.batch_policy, r.config.dispatch), []).append(r)
    table = Table(title="Peak goodput over the sweep", title_justify="left", **_COMPACT)
    cols = ("batch", "dispatch", "peak goodput/s", "at time scale", "SLO there", f"load at {100 * target:g}% SLO")
    width = max(len(bp) for bp, _ in groups)
    for col in cols:
        if col == "batch":
            table.add_column(col, no_wrap=True, min_width=width)
        else:
            table.add_column(col, justify="left" if col == "dispatch" else "right")
    for (bp, dp), runs in groups.items():
        best = max(runs, key=lambda r: r.summary["goodput_rps"])
        cap = slo_capacity([(r.offered_rps, r.summary["slo_attainment"]) for r in runs], target)
        table.add_row(bp, dp, f"{best.summary['goodput_rps']:.2f}", f"{best.config.time_scale:g}",
                      f"{100 * best.summary['slo_attainment']:.1f}%",
                      _capacity_cell(cap, all(r.summary["slo_attainment"] >= target for r in runs)))
    table.caption = "goodput: requests meeting both SLOs per second; load: offered req/s, interpolated"
    console.print(table)


def render_knee(console: Console, found: KneeResult) -> None:
    """``--sweep knee``: the baselines' knees, then each policy's sustained load and peak effective RPS in the band."""
    target = found.search.target
    knees = Table(title=f"Knee: offered load at {100 * target:g}% SLO attainment", title_justify="left", **_COMPACT)
    for col in ("baseline", "load req/s", ""):
        knees.add_column(col, justify="left" if col != "load req/s" else "right")
    for name, knee_rps in found.baseline_knees.items():
        knees.add_row(name, "not found" if knee_rps is None else f"{knee_rps:.2f}",
                      "best" if name == found.baseline else "")
    console.print(knees)
    if found.knee_rps is None:
        return
    band = found.search.band(found.knee_rps)
    table = Table(title=f"Around the knee ({found.search.points} loads, {band[0]:.2f}-{band[-1]:.2f} req/s)",
                  title_justify="left", **_COMPACT)
    cols = ("policy", f"load at {100 * target:g}% SLO", "x knee", "peak effective req/s", "x best baseline")
    for col in cols:
        table.add_column(col, no_wrap=col == "policy", justify="left" if col == "policy" else "right")
    for row in found.per_policy():
        sustained = row["sustained_rps"]
        load = "misses at the lowest" if sustained is None else (
            f">= {sustained:.2f}" if row["sustained_at_band_top"] else f"{sustained:.2f}")
        ratio = row["knee_ratio"]
        eff = row["effective_ratio"]
        table.add_row(row["policy"], load, "-" if ratio is None else f"{ratio:.3f}",
                      f"{row['peak_effective_rps']:.2f}", "-" if eff is None else f"{eff:.3f}")
    table.caption = (f"knee: {found.baseline} at {found.knee_rps:.2f} req/s; effective req/s: offered x SLO "
                     "attainment (the papers' goodput); load: interpolated offered req/s")
    console.print(table)


def render_tuning(console: Console, tunings: Mapping[str, SarathiTuning], target: float, wall_s: float) -> None:
    """``--tune-sarathi``: each budget's sustained load per dispatch, the chosen one and the derived one."""
    table = Table(title=f"Sarathi's token budget, tuned: load at {100 * target:g}% SLO attainment",
                  title_justify="left", **_COMPACT)
    for col in ("dispatch", "budget", "load req/s", "runs", ""):
        table.add_column(col, justify="right" if col in ("budget", "load req/s", "runs") else "left")
    notes = []
    for dispatch, tuning in tunings.items():
        chosen = tuning.chosen
        for s in tuning.scores:
            score = s.score
            load = "misses at the lightest" if score is None else (
                f">= {score:.2f}" if s.met_at_heaviest else f"{score:.2f}")
            mark = ", ".join(m for m, on in (("chosen", s.budget == chosen), ("derived", s.budget == tuning.derived))
                             if on)
            table.add_row(dispatch, f"{s.budget:,}", load, str(len(s.runs)), mark)
        outcome = (f"every budget missed at the lightest load: keeps its derived {tuning.derived:,}" if chosen is None
                   else f"runs with {chosen:,} below (derived: {tuning.derived:,})")
        notes.append(f"{TUNED_POLICY}/{dispatch} {outcome}")
    runs = sum(t.num_runs for t in tunings.values())
    table.caption = (f"{'; '.join(notes)}. load: offered req/s at the target, interpolated as for the knee (>=: met at "
                     f"every load tried); the highest wins, ties to the smaller budget. {runs} runs in {wall_s:.0f} s")
    console.print(table)


def policies_text(
    title: str, classes: Iterable[type[BatchPolicy] | type[DispatchPolicy]], plugins: PluginReport | None = None
) -> str:
    """A plain listing (it wraps well on narrow terminals, unlike a wide table); a plugin's policy says where it comes
    from on the line under its name."""
    lines = [title]
    for cls in classes:
        lines.append(f"  {cls.name}: {cls.summary}")
        origin = plugins.origin(cls.name) if plugins is not None else None
        if origin is not None:
            lines.append(f"      [plugin] {origin.value} from {origin.distribution}")
        if not cls.params_schema:
            lines.append("      (no parameters)")
        for spec in cls.params_schema:
            unit = f" {spec.unit}" if spec.unit else ""
            live = "live" if spec.live else "restart"
            lines.append(
                f"      {spec.name} ({spec.type}, default {spec.default}{unit}, range {spec.describe_range()}, {live})"
            )
            lines.append(f"          {spec.help}")
    return "\n".join(lines)


def policies_json(
    classes: Iterable[type[BatchPolicy] | type[DispatchPolicy]], plugins: PluginReport | None = None
) -> list[dict[str, Any]]:
    """Each policy's name, summary, origin (``module``: where its class is defined; ``plugin``: the distribution
    that declares it, null for a built-in) and parameter schema."""
    out = []
    for cls in classes:
        origin = plugins.origin(cls.name) if plugins is not None else None
        out.append({
            "name": cls.name,
            "summary": cls.summary,
            "module": cls.__module__,
            "plugin": None if origin is None else origin.distribution,
            "params": [
                {
                    "name": p.name, "type": p.type, "default": p.default, "min": p.bounds[0], "max": p.bounds[1],
                    "choices": list(p.choices), "unit": p.unit, "live": p.live, "help": p.help,
                }
                for p in cls.params_schema
            ],
        })
    return out


def _fit_cell(stats: Mapping[str, Any] | None) -> str:
    return "derived" if stats is None else f"{stats['r2']:.3f}/{100 * stats['mape']:.1f}%"


def profiles_table(reports: Mapping[str, Mapping[str, Any]]) -> Table:
    # One space between columns: the derived profile's long name must not push the table past 80 columns.
    table = Table(title="Calibration profiles: fit error on their own step records", title_justify="left",
                  **{**_COMPACT, "padding": 0})
    table.add_column("profile", no_wrap=True)
    for col in ("a ms", "b us", "c ns", "kappa", "fit\nR^2/MAPE", "holdout\nR^2/MAPE"):
        table.add_column(col, justify="right", no_wrap=True)
    for name, rep in reports.items():
        table.add_row(
            name, f"{rep['a_ms']:.2f}", f"{rep['b_us_per_token']:.2f}", f"{rep['c_ns_per_context_token']:.1f}",
            f"{rep['interference_kappa']:.2f}", _fit_cell(rep["calibration"]), _fit_cell(rep["holdout"]),
        )
    table.caption = (
        "T = (a + b*new_tokens + c*context_tokens) * (1 + kappa*rho*(1-rho)), rho: decode share of new_tokens "
        "(kappa: simulator only). fit: error on the calibration workloads' steps; holdout: on the ShareGPT-like "
        "run's steps, which the a, b, c fit never saw (--json gives step counts). derived: computed from another "
        "profile and a paper's figures, not measured, so no fit error"
    )
    return table
