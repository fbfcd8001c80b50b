"""``trackside whatif`` and ``trackside export --trace`` on stores recorded from simulated agents.

The fidelity check is the point: the simulated agent and the replay are one simulator, so replaying the policy that
ran on the node's own profile must give back what was recorded, and a profile fitted on the window's steps must
come within 5% of it (goodput, TTFT p99); a larger error is a defect of the replay.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from serve_harness import TOKEN, make_hub, make_server, run
from test_calibrate import record_sim

from agent.bench.report import summarize
from agent.bench.runner import BenchConfig, RunResult
from agent.bench.whatif import fidelity, ranks, recommend, trust_margin
from agent.cli.main import main
from agent.engine.base import RequestOutcome
from agent.telemetry import ControlAudit, Setting
from agent.workload.traces import load_trace
from store.window import recorded_window
from store.writer import StoreWriter

PROFILE = "h100-llama31-8b"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """800 ShareGPT-like requests at 40 req/s on two units running vllm + least_loaded."""
    return record_sim(tmp_path_factory.mktemp("whatif") / "telemetry.duckdb", noise=False, node_id="gpu-3")


@pytest.fixture(scope="module")
def static_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A node that ran ``static`` (no chunking, no preemption-aware budget): nearly every request misses its SLO."""
    return record_sim(tmp_path_factory.mktemp("static") / "telemetry.duckdb", noise=False, units=2,
                      workload="poisson:n=120,rate=20", batch_policy="static")


def whatif(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any] | None, str, str]:
    code = main(["whatif", "--progress", "none", "--jobs", "1", "--json", "-", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 and out.startswith("{") else None), out, err


def test_the_running_policy_replays_to_the_record(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report, _, err = whatif(capsys, "--db", str(store), "--profile", PROFILE, "--compare", "sarathi")
    assert code == 0 and report is not None, err
    assert report["window"]["requests"] == 800 and report["shape"]["units"] == 2
    assert report["shape"]["topology"] == "colocated" and report["shape"]["batch_policy"] == "vllm"
    assert [r["role"] for r in report["runs"]] == ["replay", "candidate"]
    assert [r["batch_policy"] for r in report["runs"]] == ["vllm", "sarathi"]
    fid = report["fidelity"]
    assert set(fid) == {"goodput_rel_err", "slo_attainment_abs_err", "ttft_p50_rel_err", "ttft_p99_rel_err",
                        "tpot_p50_rel_err", "tpot_p99_rel_err"}
    assert all(v is not None and v < 1e-6 for v in fid.values()), fid  # one simulator, one profile: the same run
    assert report["recorded"]["completed"] == report["runs"][0]["summary"]["completed"] == 800
    assert set(report["recommendation"]) == {"action", "batch_policy", "dispatch", "params", "expected_gain", "reason"}


def test_a_node_of_instances_replays_as_instances(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Four units as two instances of two, behind sbs: the store keeps the instance size, and the replay of the
    # running policy on the same profile is the same run (it would differ as free units or one lockstep group).
    path = record_sim(tmp_path / "instances.duckdb", noise=False, units=4, workload="poisson:n=200,rate=40",
                      dispatch="sbs", instance_size=2)
    code, report, _, err = whatif(capsys, "--db", str(path), "--profile", PROFILE, "--compare", "sarathi")
    assert code == 0 and report is not None, err
    assert report["shape"]["instance_size"] == 2 and report["shape"]["lockstep"] is False
    assert all(v is not None and v < 1e-6 for v in report["fidelity"].values()), report["fidelity"]


def test_a_profile_fitted_on_the_window_replays_within_five_percent(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, _, err = whatif(capsys, "--db", str(store), "--compare", "sarathi")
    assert code == 0 and report is not None, err
    assert report["profile"]["source"] == "auto" and report["profile"]["engine_limits_from"] == PROFILE
    fid = report["fidelity"]
    assert fid["goodput_rel_err"] < 0.05 and fid["ttft_p99_rel_err"] < 0.05, fid


def test_a_bad_running_policy_is_replaced_and_the_table_says_why(
    static_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["whatif", "--db", str(static_store), "--jobs", "1", "--profile", PROFILE, "--compare", "vllm,eb",
                 "--progress", "none"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "recommendation: switch to vllm + least_loaded" in " ".join(out.split())
    assert "every run dispatches with least_loaded" in " ".join(out.split()) and "static *" in out


def test_window_selection_and_errors(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    window = recorded_window(store)
    first, last = window.requests[0].arrival_ns, window.requests[-1].arrival_ns
    middle = (first + last) // 2
    half = recorded_window(store, node_id="gpu-3", start_ns=middle)
    assert half.start_ns == middle and all(r.arrival_ns >= middle for r in half.requests)
    assert 300 < len(half.requests) < 500 and half.num_unfinished == 0
    code, _, _, err = whatif(capsys, "--db", str(store), "--node", "gpu-9")
    assert code == 2
    assert err.strip() == "trackside whatif: error: no arrivals of node 'gpu-9' in the store (it has gpu-3)"
    code, _, _, err = whatif(capsys, "--db", str(tmp_path / "none.duckdb"))
    assert code == 2 and "no database at" in err
    code, _, _, err = whatif(capsys, "--db", str(store), "--compare", "nosuch")
    assert code == 2 and "unknown batch policy 'nosuch'" in err
    code, _, _, err = whatif(capsys, "--db", str(store), "--since", "2099-01-01T00:00")
    assert code == 2 and "no request of node 'gpu-3' arrived in the window" in err


def test_a_window_over_two_runs_is_refused_and_changes_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = record_sim(tmp_path / "two.duckdb", noise=False, workload="poisson:n=100,rate=20", units=2)
    window = recorded_window(db)
    swap = ControlAudit(node_id=window.node_id, time_ns=window.requests[50].arrival_ns, seq=10**6, actor="ops",
                        action="set_dispatch_policy", old=(Setting(policy="least_loaded"),),
                        new=(Setting(policy="round_robin"),), result="applied")
    with StoreWriter(db) as writer:
        writer.write([swap])
    later = recorded_window(db)
    assert later.dispatch_policy == "least_loaded" and [c.action for c in later.changes] == ["set_dispatch_policy"]
    after = recorded_window(db, start_ns=window.requests[60].arrival_ns)
    assert after.dispatch_policy == "round_robin" and not after.changes
    code, _, _, err = whatif(capsys, "--db", str(db), "--profile", PROFILE, "--compare", "vllm")
    assert code == 0 and "1 control changes inside the window (1 set_dispatch_policy)" in err
    record_sim(db, noise=False, workload="poisson:n=50,rate=20", units=2)
    code, _, _, err = whatif(capsys, "--db", str(db))
    assert code == 2 and "the window spans 2 runs of the agent" in err


def test_export_round_trips_through_bench(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "window.jsonl"
    assert main(["export", "--db", str(store), "--trace", str(trace)]) == 0
    assert "wrote 800 requests of node gpu-3" in capsys.readouterr().out
    requests = load_trace(trace)
    window = recorded_window(store)
    assert len(requests) == 800 and requests[0].arrival_s == 0.0
    assert [r.prompt_tokens for r in requests] == [r.prompt_tokens for r in window.requests]
    assert [r.output_tokens for r in requests] == [r.output_tokens for r in window.requests]
    out = tmp_path / "bench.json"
    assert main(["bench", "--trace", str(trace), "--units", "2", "--json", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["summary"]["requests"] == 800
    assert main(["export", "--db", str(store), "--to", str(tmp_path / "pq")]) == 0  # the Parquet export still works
    assert (tmp_path / "pq" / "requests.parquet").is_file()


def test_apply_sends_the_recommendation_and_is_refused_with_a_wrong_token(
    static_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = static_store
    good, bad = tmp_path / "token", tmp_path / "wrong"
    good.write_text(TOKEN + "\n")
    bad.write_text("not-the-token\n")
    good.chmod(0o600)
    bad.chmod(0o600)
    common = ["whatif", "--db", str(db), "--profile", PROFILE, "--compare", "vllm", "--progress", "none", "--yes",
              "--jobs", "1"]

    async def go() -> tuple[int, int, list[str]]:
        hub = make_hub(units=2)
        async with make_server(hub) as server:
            refused = await asyncio.to_thread(main, [*common, "--apply", server.url, "--token-file", str(bad)])
            applied = await asyncio.to_thread(main, [*common, "--apply", server.url, "--token-file", str(good)])
            return refused, applied, [u.policy.name for u in hub.node.units]

    refused, applied, policies = run(go, timeout_s=60)
    out, err = capsys.readouterr()
    assert refused == 1 and "HTTP 401: the token presented at connect" in err, err
    assert applied == 0 and policies == ["vllm", "vllm"]
    assert "dry run: dry_run: set_batch_policy" in out and "applied: set_batch_policy" in out


# -- the ranking and the recommendation, on made-up runs -----------------------------------------------------------
def _result(batch: str, met: int, *, n: int = 100, ttft_s: float = 0.1) -> RunResult:
    outcomes = [RequestOutcome(f"r{i}", 0, i * 0.1, i * 0.1 + (ttft_s if i < met else 9.0), i * 0.1 + 1.0, 10, 10,
                               0, 0.5, 0.5) for i in range(n)]
    summary = summarize(outcomes, num_requests=n, num_rejected=0, duration_s=n * 0.1 + 1.0, offered_rps=10.0)
    return RunResult(BenchConfig(batch_policy=batch), summary, [], 0, {}, {})


def test_recommendation_needs_a_gain_beyond_the_replays_error() -> None:
    replay, small, big = _result("vllm", 80), _result("sarathi", 81), _result("fairbatching", 95)
    assert ranks([replay.summary, small.summary, big.summary]) == [3, 2, 1]
    exact = fidelity(replay.summary, replay.summary)
    assert trust_margin(exact) == 0.02
    rec = recommend(replay, [small, big], exact)
    assert rec["action"] == "switch" and rec["batch_policy"] == "fairbatching"
    assert rec["expected_gain"] == pytest.approx(95 / 80 - 1)
    assert recommend(replay, [small], exact)["action"] == "keep"  # +1.25% < 2%
    loose = {**exact, "goodput_rel_err": 0.25}
    kept = recommend(replay, [small, big], loose)
    assert kept["action"] == "keep" and "within the replay's error (25.0%)" in kept["reason"]
    assert "fidelity is poor" in kept["reason"]
    assert recommend(replay, [_result("vllm", 99)], exact)["reason"] == "no candidate other than the running policy"


def test_the_hello_says_the_nodes_shape() -> None:
    from agent.cli.serve import make_node
    from agent.service.hub import Hub

    def hello(**shape: Any) -> tuple[str, int, bool, int]:
        node = make_node(BenchConfig(units=4, **shape), [])
        h = Hub(node, node_id="n", profile=PROFILE).hello()
        return h.topology, h.prefill_units, h.lockstep, h.instance_size

    assert hello() == ("colocated", 0, False, 0)
    assert hello(topology="disaggregated", prefill_units=1) == ("disaggregated", 1, False, 0)
    assert hello(lockstep=True) == ("colocated", 0, True, 0)
    assert hello(instance_size=2) == ("colocated", 0, False, 2)
    assert hello(instance_size=4) == ("colocated", 0, True, 0)  # one instance of every unit is lockstep
