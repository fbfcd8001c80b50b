"""Tables the ``trackside`` command prints (rich renderables from plain data; no computation here)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.bench import RunResult
from policies.base import BatchPolicy, DispatchPolicy


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def render_runs(console: Console, results: Sequence[RunResult]) -> None:
    table = Table(title="Summary", title_justify="left")
    for col in ("batch", "dispatch", "time scale", "done/req", "rej", "dur s", "req/s", "out tok/s",
                "goodput/s", "SLO", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"):
        table.add_column(col, justify="left" if col in ("batch", "dispatch") else "right")
    for r in results:
        s = r.summary
        table.add_row(
            r.config.batch_policy, r.config.dispatch, f"{r.config.time_scale:g}",
            f"{s['completed']}/{s['requests']}", str(s["rejected"]), f"{s['duration_s']:,.1f}",
            f"{s['throughput_rps']:.2f}", f"{s['output_tokens_per_s']:,.0f}", f"{s['goodput_rps']:.2f}",
            f"{100 * s['slo_attainment']:.1f}%", _ms(s["ttft_ms"]["p50"]), _ms(s["ttft_ms"]["p99"]),
            _ms(s["tpot_ms"]["p50"]), _ms(s["tpot_ms"]["p99"]),
        )
    table.caption = "latencies in ms; a request meets its SLO when TTFT and TPOT are both within target"
    console.print(table)


def render_units(console: Console, result: RunResult) -> None:
    table = Table(title="Per-unit load", title_justify="left")
    for col in ("unit", "steps", "busy", "batch", "step ms", "KV mean", "KV max", "prefill tok",
                "decode tok", "preempt", "done", "model err"):
        table.add_column(col, justify="right")
    for u in result.units:
        err = u["step_model_mape"]
        table.add_row(
            str(u["unit_id"]), f"{u['steps']:,}", f"{100 * u['busy_fraction']:.1f}%",
            f"{u['mean_batch_size']:.1f}", _ms(u["mean_step_ms"]), f"{100 * u['kv_usage_mean']:.1f}%",
            f"{100 * u['kv_usage_max']:.1f}%", f"{u['prefill_tokens']:,}", f"{u['decode_tokens']:,}",
            str(u["preemptions"]), str(u["completed"]), "-" if err is None else f"{100 * err:.1f}%",
        )
    table.caption = "model err: mean |predicted - simulated| / simulated step time of the policy's step model"
    console.print(table)


def render_peaks(console: Console, results: Sequence[RunResult]) -> None:
    best: dict[tuple[str, str], RunResult] = {}
    for r in results:
        key = (r.config.batch_policy, r.config.dispatch)
        if key not in best or r.summary["goodput_rps"] > best[key].summary["goodput_rps"]:
            best[key] = r
    table = Table(title="Peak goodput over the sweep", title_justify="left")
    for col in ("batch", "dispatch", "peak goodput/s", "at time scale", "SLO there"):
        table.add_column(col, justify="left" if col in ("batch", "dispatch") else "right")
    for (bp, dp), r in best.items():
        table.add_row(bp, dp, f"{r.summary['goodput_rps']:.2f}", f"{r.config.time_scale:g}",
                      f"{100 * r.summary['slo_attainment']:.1f}%")
    console.print(table)


def policies_table(title: str, classes: Iterable[type[BatchPolicy] | type[DispatchPolicy]]) -> Table:
    table = Table(title=title, title_justify="left", show_lines=True)
    for col in ("policy", "parameter", "type", "default", "range", "unit", "live", "meaning"):
        table.add_column(col)
    for cls in classes:
        if not cls.params_schema:
            table.add_row(cls.name, "-", "", "", "", "", "", cls.summary)
            continue
        for i, spec in enumerate(cls.params_schema):
            table.add_row(
                cls.name if i == 0 else "", spec.name, spec.type, str(spec.default), spec.describe_range(),
                spec.unit, "yes" if spec.live else "no", (cls.summary + "\n" if i == 0 else "") + spec.help,
            )
    return table


def profiles_table(reports: Mapping[str, Mapping[str, Any]]) -> Table:
    table = Table(title="Calibration profiles: fit error on their own step records", title_justify="left")
    for col in ("profile", "a ms", "b us/tok", "c ns/ctx", "fit n", "R^2", "MAPE", "holdout n", "holdout R^2",
                "holdout MAPE"):
        table.add_column(col, justify="left" if col == "profile" else "right")
    for name, rep in reports.items():
        coef, fit, hold = rep["coefficients"], rep["fit"], rep["holdout"]
        table.add_row(
            name, f"{coef['a_ms']:.2f}", f"{coef['b_us_per_token']:.2f}", f"{coef['c_ns_per_context_token']:.1f}",
            str(fit["n"]), f"{fit['r2']:.3f}", f"{100 * fit['mape']:.1f}%", str(hold["n"]),
            f"{hold['r2']:.3f}", f"{100 * hold['mape']:.1f}%",
        )
    table.caption = "fit: the calibration workloads; holdout: the ShareGPT-like run the fit never saw"
    return table
