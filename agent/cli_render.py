"""Tables the ``trackside`` command prints (rich renderables from plain data; no computation here)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from agent.bench import RunResult
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
    ("goodput req/s", "goodput_rps"), ("SLO attainment", "slo_attainment"),
    ("TTFT mean / p50 ms", "ttft_ms.mid"), ("TTFT p90 / p99 ms", "ttft_ms.tail"),
    ("TPOT mean / p50 ms", "tpot_ms.mid"), ("TPOT p90 / p99 ms", "tpot_ms.tail"),
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
    if key == "slo_attainment":
        return f"{100 * value:.1f}%"
    if key == "rejected":
        return f"{value:,}"
    if key in ("duration_s", "output_tokens_per_s"):
        return f"{value:,.1f}"
    return f"{value:.3f}"


def render_runs(console: Console, results: Sequence[RunResult]) -> None:
    """One column per run, one row per metric (narrow enough for an 80-column terminal)."""
    many_scales = len({r.config.time_scale for r in results}) > 1
    table = Table(title="Summary", title_justify="left", **_COMPACT)
    table.add_column("metric")
    for r in results:
        table.add_column(_run_label(r, many_scales), justify="right")
    for title, key in SUMMARY_ROWS:
        table.add_row(title, *(_cell(r.summary, key) for r in results))
    table.caption = "a request meets its SLO when TTFT and TPOT are both within target"
    console.print(table)


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


def render_peaks(console: Console, results: Sequence[RunResult]) -> None:
    best: dict[tuple[str, str], RunResult] = {}
    for r in results:
        key = (r.config.batch_policy, r.config.dispatch)
        if key not in best or r.summary["goodput_rps"] > best[key].summary["goodput_rps"]:
            best[key] = r
    table = Table(title="Peak goodput over the sweep", title_justify="left", **_COMPACT)
    for col in ("batch", "dispatch", "peak goodput/s", "at time scale", "SLO there"):
        table.add_column(col, justify="left" if col in ("batch", "dispatch") else "right")
    for (bp, dp), r in best.items():
        table.add_row(bp, dp, f"{r.summary['goodput_rps']:.2f}", f"{r.config.time_scale:g}",
                      f"{100 * r.summary['slo_attainment']:.1f}%")
    console.print(table)


def policies_text(title: str, classes: Iterable[type[BatchPolicy] | type[DispatchPolicy]]) -> str:
    """A plain listing (it wraps well on narrow terminals, unlike a wide table)."""
    lines = [title]
    for cls in classes:
        lines.append(f"  {cls.name}: {cls.summary}")
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


def policies_json(classes: Iterable[type[BatchPolicy] | type[DispatchPolicy]]) -> list[dict[str, Any]]:
    return [
        {
            "name": cls.name,
            "summary": cls.summary,
            "params": [
                {
                    "name": p.name, "type": p.type, "default": p.default, "min": p.min, "max": p.max,
                    "choices": list(p.choices), "unit": p.unit, "live": p.live, "help": p.help,
                }
                for p in cls.params_schema
            ],
        }
        for cls in classes
    ]


def profiles_table(reports: Mapping[str, Mapping[str, Any]]) -> Table:
    table = Table(title="Calibration profiles: fit error on their own step records", title_justify="left", **_COMPACT)
    table.add_column("profile", no_wrap=True)
    for col in ("a ms", "b us", "c ns", "fit R^2", "MAPE", "holdout R^2", "MAPE"):
        table.add_column(col, justify="right")
    for name, rep in reports.items():
        fit, hold = rep["calibration"], rep["holdout"]
        table.add_row(
            name, f"{rep['a_ms']:.2f}", f"{rep['b_us_per_token']:.2f}", f"{rep['c_ns_per_context_token']:.1f}",
            f"{fit['r2']:.3f}", f"{100 * fit['mape']:.1f}%", f"{hold['r2']:.3f}", f"{100 * hold['mape']:.1f}%",
        )
    table.caption = (
        "T = a + b*new_tokens + c*context_tokens. fit: error on the calibration workloads' steps; holdout: on "
        "the ShareGPT-like run's steps, which the fit never saw (--json gives step counts)"
    )
    return table
