"""The ``trackside`` command end to end on small traces (real files, real JSON, a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.bench.report import SUMMARY_KEYS
from agent.cli.main import main

ROOT = Path(__file__).resolve().parents[3]
SMALL_AZURE = ROOT / "examples" / "traces" / "small_azure.csv"
SMALL_JSONL = ROOT / "examples" / "traces" / "small.jsonl"
LATENCY_KEYS = {"mean", "p50", "p90", "p99"}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_bench_on_a_small_azure_trace_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = run_cli(
        "bench", "--trace", str(SMALL_AZURE), "--units", "4", "--batch-policy", "vllm", "--dispatch",
        "least_loaded", "--profile", "h100-llama31-8b", "--json", str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Summary" in proc.stdout and "Per-unit load" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"summary", "config", "units", "cluster"}
    summary = data["summary"]
    assert set(summary) == set(SUMMARY_KEYS)
    assert set(summary["ttft_ms"]) == LATENCY_KEYS and set(summary["tpot_ms"]) == LATENCY_KEYS
    assert summary["requests"] == 200 and summary["completed"] + summary["rejected"] == 200
    assert len(data["units"]) == 4
    assert sum(u["completed"] for u in data["units"]) == summary["completed"]
    # Throughput is what the numbers say it is.
    assert summary["throughput_rps"] == pytest.approx(summary["completed"] / summary["duration_s"])
    assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
    assert data["config"]["profile"] == "h100-llama31-8b"


def test_compare_and_sweep_write_runs(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    code = main([
        "bench", "--trace", str(SMALL_JSONL), "--units", "2", "--compare", "vllm,static",
        "--dispatch", "round_robin,least_loaded", "--sweep", "time-scale=0.5,1", "--json", str(out),
        "--no-progress",
    ])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2 * 2 * 2
    assert {(r["batch_policy"], r["dispatch"], r["time_scale"]) for r in runs} == {
        (b, d, t) for b in ("vllm", "static") for d in ("round_robin", "least_loaded") for t in (0.5, 1.0)
    }
    for r in runs:
        assert set(r["summary"]) == set(SUMMARY_KEYS)
        assert set(r) >= {"batch_policy", "dispatch", "params", "time_scale", "summary"}
    by = {(r["batch_policy"], r["dispatch"], r["time_scale"]): r["summary"] for r in runs}
    # Halving the gaps (time scale 0.5) makes the run shorter, never longer, for the same requests.
    assert by[("vllm", "round_robin", 0.5)]["duration_s"] < by[("vllm", "round_robin", 1.0)]["duration_s"]


def test_synthetic_workload_and_params(tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    code = main([
        "bench", "--workload", "poisson:rate=20,n=60", "--units", "2", "--param", "long_prefill_token_threshold=256",
        "--param", "least_loaded.waiting_weight=2", "--json", str(out), "--no-progress",
    ])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["config"]["batch_params"]["long_prefill_token_threshold"] == 256
    assert data["config"]["dispatch_params"]["waiting_weight"] == 2.0
    assert data["summary"]["completed"] == 60


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-policy", "fastest"], "unknown batch policy 'fastest'"),
        (["--param", "nonsense=1"], "parameter 'nonsense'"),
        (["--param", "long_prefill_token_threshold=-5"], "below the minimum"),
        (["--profile", "a100-nope"], "a100-nope"),
        (["--sweep", "rate=1,2"], "--sweep takes time-scale"),
        (["--param", "vlm.long_prefill_token_threshold=4"], "no policy named 'vlm'"),
        (["--param", "vllm.threshold=4"], "vllm has no parameter 'threshold'"),
        (["--fault", "x@3"], "UNIT@SECONDS"),
        (["--fault", "1@-2"], "times >= 0"),
        (["--fault", "7@1"], "beyond --units 4"),
        (["--topology", "disaggregated", "--prefill-units", "4"], "4 prefill units of 4"),
        (["--kv-bandwidth-gb-s", "0"], "must be > 0"),
    ],
)
def test_bad_arguments_get_one_clear_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--trace", str(SMALL_JSONL), "--no-progress", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_bad_trace_line_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,48,10\n2023-11-16 18:17:04.0,x,8\n"
    )
    proc = run_cli("bench", "--trace", str(bad), "--no-progress")
    assert proc.returncode == 2
    assert "bad.csv:3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_policies_lists_every_policy_with_parameters() -> None:
    proc = run_cli("policies")
    assert proc.returncode == 0
    for name in ("static", "vllm", "round_robin", "least_loaded", "long_prefill_token_threshold", "waiting_weight"):
        assert name in proc.stdout


def test_profiles_reports_fit_error() -> None:
    proc = run_cli("profiles", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {"h100-llama31-8b", "h100-llama31-8b-eager", "h100-llama32-1b"} <= set(report)
    fit = report["h100-llama31-8b"]["calibration"]
    assert fit["r2"] > 0.99


def test_help_explains_the_bench_flags() -> None:
    proc = run_cli("bench", "--help")
    assert proc.returncode == 0
    for flag in ("--trace", "--workload", "--compare", "--sweep", "--param", "--slo-ttft-ms", "--json"):
        assert flag in proc.stdout


def test_the_issue_comparison_prints_one_row_per_run_and_the_sustained_load(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    proc = run_cli(
        "bench", "--trace", str(SMALL_AZURE), "--units", "2", "--compare",
        "vllm,sarathi,fairbatching,fairbatching+pab,eb,eb+", "--sweep", "time-scale=1,0.05", "--json", str(out),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # Twelve runs: one row each, policy names in full.
    for policy in ("vllm", "sarathi", "fairbatching", "fairbatching+pab", "eb", "eb+"):
        rows = [ln for ln in lines if ln.split() and ln.split()[0] == policy]
        assert len(rows) == 3, (policy, rows)  # two sweep rows plus its line in the peak table
    peak = proc.stdout[proc.stdout.index("Peak goodput over the sweep"):]
    peak_rows = [ln for ln in peak.splitlines() if ln.split() and ln.split()[0] in ("vllm", "eb+")]
    assert len(peak_rows) == 2
    # (the last cell may wrap on an 80-column terminal: "below the" / "sweep")
    assert all(ln.rstrip().endswith(("req/s", "below the sweep", "below the")) for ln in peak_rows)
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 12
    for r in runs:
        assert r["offered_rps"] > 0 and r["refused"] <= r["summary"]["rejected"]
    assert {r["time_scale"] for r in runs} == {1.0, 0.05}


def test_dispatch_comparison_reports_cluster_balance_and_faults(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = run_cli(
        "bench", "--trace", str(SMALL_AZURE), "--units", "4", "--dispatch", "round_robin,least_loaded",
        "--topology", "disaggregated", "--prefill-units", "1", "--lockstep", "--fault", "2@5+10",
        "--no-progress", "--json", str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Cluster" in proc.stdout
    data = json.loads(out.read_text())
    assert [r["dispatch"] for r in data["runs"]] == ["round_robin", "least_loaded"]
    assert data["config"]["topology"] == "disaggregated" and data["config"]["lockstep"] is True
    for run in data["runs"]:
        c = run["cluster"]
        assert c["faults"] == 1
        # Every request that got past its prefill was handed to a decode unit with its KV (or lost in the fault).
        assert c["migrations_by_reason"]["handoff"] > 0
        assert run["summary"]["completed"] + run["summary"]["rejected"] == 200
        decode_units = [u for u in run["units"] if u["unit_id"] > 0]
        assert all(u["prefill_tokens"] == 0 for u in decode_units)


def test_instances_step_in_lockstep_inside_and_a_bad_size_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    code = main(["bench", "--trace", str(SMALL_AZURE), "--limit", "120", "--units", "6", "--topology",
                 "disaggregated", "--prefill-units", "2", "--instance-size", "2", "--no-progress", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["config"]["instance_size"] == 2 and data["config"]["lockstep"] is False
    assert data["summary"]["completed"] + data["summary"]["rejected"] == 120
    for size, units, why in (("4", "6", "does not divide"), ("3", "6", "spans the prefill and decode pools")):
        proc = run_cli("bench", "--trace", str(SMALL_AZURE), "--limit", "20", "--units", units, "--topology",
                       "disaggregated", "--prefill-units", "2", "--instance-size", size, "--no-progress")
        assert proc.returncode == 2 and why in proc.stderr
    proc = run_cli("bench", "--trace", str(SMALL_AZURE), "--limit", "20", "--lockstep", "--instance-size", "2",
                   "--no-progress")
    assert proc.returncode == 2 and "not both" in proc.stderr


def test_interference_on_attention_is_a_bench_option(tmp_path: Path) -> None:
    runs = {}
    for on in ("step", "attention"):
        out = tmp_path / f"{on}.json"
        code = main(["bench", "--trace", str(SMALL_AZURE), "--limit", "60", "--profile",
                     "rtxpro6000-llama31-8b-derived", "--interference-on", on, "--no-progress", "--json", str(out)])
        assert code == 0
        runs[on] = json.loads(out.read_text())
    assert [r["config"]["interference_on"] for r in runs.values()] == ["step", "attention"]
    busy = {on: sum(u["mean_step_ms"] * u["steps"] for u in r["units"]) for on, r in runs.items()}
    assert busy["step"] != busy["attention"], "the shapes time mixed steps differently"
    proc = run_cli("bench", "--trace", str(SMALL_AZURE), "--limit", "5", "--interference-on", "weights")
    assert proc.returncode == 2 and "--interference-on" in proc.stderr


def test_a_pass_sync_cost_slows_lockstep_passes_and_needs_them(tmp_path: Path) -> None:
    runs = {}
    for sync in ("0", "20"):
        out = tmp_path / f"sync{sync}.json"
        code = main(["bench", "--trace", str(SMALL_AZURE), "--limit", "60", "--units", "4", "--instance-size", "2",
                     "--pass-sync-ms", sync, "--no-progress", "--json", str(out)])
        assert code == 0
        runs[sync] = json.loads(out.read_text())
    assert runs["20"]["config"]["pass_sync_ms"] == 20.0
    steps = {k: sum(u["steps"] for u in r["units"]) for k, r in runs.items()}
    busy = {k: sum(u["mean_step_ms"] * u["steps"] for u in r["units"]) / steps[k] for k, r in runs.items()}
    assert busy["20"] > busy["0"] + 15, busy  # every step of a unit is a pass of its instance: 20 ms longer
    for r in runs.values():
        util = r["cluster"]["pass_chunk_utilization"]
        assert util is not None and 0 < util <= r["cluster"]["prefill_chunk_utilization"]
    proc = run_cli("bench", "--trace", str(SMALL_AZURE), "--limit", "20", "--pass-sync-ms", "5", "--no-progress")
    assert proc.returncode == 2 and "needs passes" in proc.stderr
    proc = run_cli("bench", "--trace", str(SMALL_AZURE), "--limit", "20", "--lockstep", "--pass-sync-ms", "-1",
                   "--no-progress")
    assert proc.returncode == 2 and ">= 0" in proc.stderr


def test_the_tpot_metric_picks_what_percentiles_and_attainment_use(tmp_path: Path) -> None:
    # One unit under vLLM's default schedule: prefills stall decodes, more so just after a request's first token.
    summaries = {}
    for metric in ("worst", "mean", None):
        out = tmp_path / f"{metric}.json"
        code = main(["bench", "--trace", str(SMALL_AZURE), "--limit", "120", "--units", "1", "--json", str(out),
                     "--no-progress", *(["--tpot-metric", metric] if metric else [])])
        assert code == 0
        data = json.loads(out.read_text())
        assert data["config"]["tpot_metric"] == (metric or "worst")
        summaries[metric] = data["summary"]
    worst, mean = summaries["worst"], summaries["mean"]
    assert summaries[None] == worst  # the default
    assert worst["slo_attainment"] < mean["slo_attainment"]
    assert worst["tpot_ms"]["p50"] > mean["tpot_ms"]["p50"]
    assert worst["ttft_ms"] == mean["ttft_ms"] and worst["offered_rps"] == mean["offered_rps"]
    for s in (worst, mean):
        assert s["effective_rps"] == pytest.approx(s["offered_rps"] * s["slo_attainment"])
