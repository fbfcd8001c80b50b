"""Canned queries against agent.bench.report's definitions, arbitrary SQL, Parquet export, and the CLI handlers
(sql, export, prune)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import time
from pathlib import Path

import duckdb
import msgspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from agent.bench.report import SUMMARY_KEYS, UnitStats, summarize
from agent.engine.base import RequestOutcome, StepRecord
from agent.runtime.events import NodeOrigin, request_finished, step_event
from agent.telemetry import Event, RequestRefused, TpotMetric
from policies.types import StepMode
from store.cli import add_store_commands, cmd_export, cmd_prune, cmd_sql, duration_s
from store.queries import StoreQueryError, export_parquet, policy_summary, sql, unit_balance
from store.schema import TABLES
from store.writer import StoreWriter

ORIGIN = NodeOrigin("node-q", 1_800_000_000_000_000_000)
POLICY_OF_UNIT = {0: "vllm", 1: "sarathi"}


def records(n: int = 400, seed: int = 1) -> list[StepRecord]:
    rng = random.Random(seed)
    out = []
    clock = {0: 0.0, 1: 0.0}
    for i in range(n):
        unit = i % 2
        duration = rng.uniform(0.005, 0.05)
        out.append(StepRecord(
            unit_id=unit, step_id=i // 2, start_s=clock[unit], duration_s=duration,
            predicted_s=duration * rng.uniform(0.8, 1.2), mode=rng.choice(list(StepMode)), policy=POLICY_OF_UNIT[unit],
            num_prefill_tokens=rng.randrange(0, 2048), num_decode_tokens=rng.randrange(0, 64),
            num_prefill_reqs=rng.randrange(0, 3), num_decode_reqs=rng.randrange(0, 64), context_tokens=1000,
            budget_tokens=2048, kv_used_blocks=rng.randrange(0, 1000), num_blocks=1000, num_running=8, num_waiting=2,
            num_preempted=rng.randrange(0, 2), num_finished=rng.randrange(0, 3),
        ))
        clock[unit] += duration + rng.uniform(0, 0.01)
    return out


def outcomes(unit: int, n: int, seed: int) -> list[RequestOutcome]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        arrival = 0.0 if i == 0 else rng.uniform(0.0, 3.0)  # time 0: the workload's start
        first = arrival + rng.uniform(0.05, 0.8)
        tokens = rng.choice([1, 2, 50, 300])
        finish = first + (tokens - 1) * rng.uniform(0.01, 0.06) + 0.25
        mean = (finish - first) / (tokens - 1) if tokens > 1 else None
        out.append(RequestOutcome(
            request_id=f"u{unit}-r{i}", unit_id=unit, arrival_s=arrival, first_token_s=first,
            finish_s=finish, prompt_tokens=100, output_tokens=tokens,
            num_preemptions=0, ttft_slo_s=0.5, tpot_slo_s=0.04,
            max_tpot_s=None if mean is None else mean * rng.uniform(1.0, 3.0),
        ))
    return out


def refusal(i: int, policy: str) -> RequestRefused:
    return RequestRefused(node_id=ORIGIN.node_id, time_ns=ORIGIN.ns(1.0), request_id=f"x{i}", unit_id=1, policy=policy)


def populated(path: str | Path = ":memory:") -> tuple[StoreWriter, list[StepRecord], dict[int, list[RequestOutcome]]]:
    steps = records()
    done = {0: outcomes(0, 60, 7), 1: outcomes(1, 45, 8)}
    events: list[Event] = [step_event(r, ORIGIN) for r in steps]
    events += [request_finished(o, ORIGIN) for unit in (0, 1) for o in done[unit]]
    events += [refusal(i, "sarathi") for i in range(5)]
    events.sort(key=lambda e: e.time_ns)
    numbered = [e.__class__(**{**{f: getattr(e, f) for f in e.__struct_fields__}, "seq": i + 1})
                for i, e in enumerate(events)]
    writer = StoreWriter(path, batch_rows=97)
    writer.write(numbered)
    writer.flush()
    return writer, steps, done


@pytest.mark.parametrize("tpot_metric", ["worst", "mean", None])
def test_policy_summary_matches_agent_report(tpot_metric: TpotMetric | None) -> None:
    writer, _, done = populated()
    by_metric = {} if tpot_metric is None else {"tpot_metric": tpot_metric}
    with writer:
        rows = {row["policy"]: row for row in policy_summary(writer.cursor(), **by_metric)}
    assert set(rows) == {"vllm", "sarathi"}
    for unit, policy in POLICY_OF_UNIT.items():
        outs = done[unit]
        rejected = 5 if policy == "sarathi" else 0
        duration = max(o.finish_s for o in outs)  # from time 0, the group's first arrival
        arrivals = [o.arrival_s for o in outs]  # the store knows no refused request's arrival
        offered = (len(outs) + rejected) / (max(arrivals) - min(arrivals))
        expected = summarize(outs, num_requests=len(outs) + rejected, num_rejected=rejected, duration_s=duration,
                             offered_rps=offered, **by_metric)
        got = rows[policy]
        assert set(got) == {"policy", *SUMMARY_KEYS}
        for key in ("requests", "completed", "rejected"):
            assert got[key] == expected[key]
        for key in ("duration_s", "throughput_rps", "output_tokens_per_s", "input_tokens_per_s", "goodput_rps",
                    "slo_attainment", "offered_rps", "effective_rps"):
            assert got[key] == pytest.approx(expected[key], rel=1e-9), key
        for metric in ("ttft_ms", "tpot_ms", "normalized_latency_ms", "e2e_ms"):
            for stat, value in expected[metric].items():
                assert got[metric][stat] == pytest.approx(value, rel=1e-9), (metric, stat)
        assert 0 < got["slo_attainment"] < 1  # the sample has both outcomes
        mean_met = sum(o.meets_slo("mean") for o in outs)
        if tpot_metric == "mean":
            assert got["slo_attainment"] * got["requests"] == pytest.approx(mean_met)
        else:  # the worst TPOTs of the sample are up to 3x the means: fewer requests meet the TPOT target
            assert got["slo_attainment"] * got["requests"] < mean_met


def test_policy_summary_by_window_and_hand_computed_percentiles() -> None:
    writer, _, done = populated()
    with writer:
        con = writer.cursor()
        start = ORIGIN.ns(1.0)
        windowed = policy_summary(con, start_ns=start, end_ns=ORIGIN.ns(2.0))
        buckets = policy_summary(con, window_s=1.0)
        assert policy_summary(con, start_ns=ORIGIN.ns(1e6)) == []
    vllm = next(r for r in windowed if r["policy"] == "vllm")
    inside = [o for o in done[0] if 1.0 <= o.finish_s < 2.0]
    ttft = np.array([o.ttft_s for o in inside]) * 1e3
    assert vllm["completed"] == len(inside) > 3
    assert vllm["ttft_ms"]["p90"] == pytest.approx(float(np.percentile(ttft, 90)))
    assert vllm["duration_s"] == pytest.approx(max(o.finish_s for o in inside) - 1.0)
    assert vllm["goodput_rps"] == pytest.approx(sum(o.met_slo for o in inside) / vllm["duration_s"])
    assert sum(b["requests"] for b in buckets) == 60 + 45 + 5
    assert all(b["duration_s"] == 1.0 and b["window_start_ns"] % 10**9 == 0 for b in buckets)


def test_unit_balance_matches_unit_stats() -> None:
    writer, steps, _ = populated()
    with writer:
        rows = unit_balance(writer.cursor())
    span = max(r.start_s + r.duration_s for r in steps) - min(r.start_s for r in steps)
    for row in rows:
        stats = UnitStats(row["unit_id"])
        for rec in steps:
            if rec.unit_id == row["unit_id"]:
                stats.add(rec)
        expected = stats.as_dict(span)
        for key, value in expected.items():
            if key != "steps_by_mode":
                assert row[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
        assert row["policies"] == [POLICY_OF_UNIT[row["unit_id"]]]
    assert [r["unit_id"] for r in rows] == [0, 1]


def test_sql_returns_columns_and_rows_and_refuses_writes() -> None:
    writer, steps, _ = populated()
    with writer:
        con = writer.cursor()
        result = sql(con, "SELECT unit_id, count(*) AS n FROM steps GROUP BY ALL ORDER BY unit_id")
        assert result.columns == ("unit_id", "n") and result.rows == [(0, 200), (1, 200)]
        assert sql(con, "DESCRIBE steps").rows[0][0] == "node_id"
        with pytest.raises(StoreQueryError, match="syntax error"):
            sql(con, "selec 1")
        with pytest.raises(StoreQueryError, match="read-only"):
            sql(con, "DELETE FROM steps")
        with pytest.raises(StoreQueryError, match="one SQL statement"):
            sql(con, "SELECT 1; SELECT 2")
        with pytest.raises(StoreQueryError, match="nope"):
            sql(con, "SELECT nope FROM steps")
        assert sql(con, "SELECT count(*) FROM steps").rows == [(len(steps),)]


def test_export_writes_one_parquet_file_per_table(tmp_path: Path) -> None:
    writer, steps, _ = populated(tmp_path / "q.duckdb")
    writer.close()
    paths = export_parquet(tmp_path / "q.duckdb", tmp_path / "out" / "nested")
    assert sorted(p.stem for p in paths) == sorted([*TABLES, "gaps"])
    assert pq.read_table(tmp_path / "out" / "nested" / "steps.parquet").num_rows == len(steps)
    requests = tmp_path / "out" / "nested" / "requests.parquet"
    assert duckdb.sql(f"SELECT count(*) FROM '{requests}'").fetchall() == [(110,)]


# -- CLI handlers --------------------------------------------------------------------------------------------
def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trackside")
    add_store_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.fixture
def db_file(tmp_path: Path) -> Path:
    writer, _, _ = populated(tmp_path / "cli.duckdb")
    writer.close()
    return tmp_path / "cli.duckdb"


def test_cli_sql_prints_table_json_and_csv(db_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    console = Console(width=200, force_terminal=False)
    query = "SELECT unit_id, count(*) AS n, list(DISTINCT policy) AS p FROM steps GROUP BY ALL ORDER BY 1"
    assert cmd_sql(parse("sql", "--db", str(db_file), query), console) == 0
    out = capsys.readouterr().out
    assert "unit_id" in out and "200" in out and "2 rows" in out
    assert cmd_sql(parse("sql", "--db", str(db_file), "--json", query), console) == 0
    assert json.loads(capsys.readouterr().out) == [{"unit_id": 0, "n": 200, "p": ["vllm"]},
                                                    {"unit_id": 1, "n": 200, "p": ["sarathi"]}]
    assert cmd_sql(parse("sql", "--db", str(db_file), "--csv", "SELECT 1 AS a, 'x,y' AS b"), console) == 0
    assert capsys.readouterr().out == 'a,b\n1,"x,y"\n'


@pytest.mark.parametrize(
    ("query", "message"),
    [("selec 1", "syntax error"), ("DROP TABLE steps", "read-only"), ("SELECT * FROM nope", "nope")],
)
def test_cli_sql_errors_are_one_line_and_exit_2(
    db_file: Path, capsys: pytest.CaptureFixture[str], query: str, message: str
) -> None:
    assert cmd_sql(parse("sql", "--db", str(db_file), query), Console()) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("trackside sql: error: ") and message in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_cli_bad_paths(tmp_path: Path, db_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_sql(parse("sql", "--db", str(tmp_path / "missing.duckdb"), "SELECT 1"), Console()) == 2
    assert "no database at" in capsys.readouterr().err
    not_db = tmp_path / "notes.txt"
    not_db.write_text("hello\n" * 2000)
    assert cmd_sql(parse("sql", "--db", str(not_db), "SELECT 1"), Console()) == 2
    assert "cannot open" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cmd_export(parse("export", "--db", str(db_file), "--to", str(blocker / "dir")), Console()) == 2
    assert capsys.readouterr().err.startswith("trackside export: error: cannot create")
    assert cmd_export(parse("export", "--db", str(db_file), "--to", str(tmp_path / "pq")), Console()) == 0
    assert (tmp_path / "pq" / "steps.parquet").is_file()


def test_cli_on_a_file_another_process_writes(db_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    code = f"import duckdb, sys; con = duckdb.connect({str(db_file)!r}); print('ok', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ok"
        assert cmd_sql(parse("sql", "--db", str(db_file), "SELECT 1"), Console()) == 2
        err = capsys.readouterr().err
        assert "open for writing by another process" in err and err.count("\n") == 1
    finally:
        child.kill()
        child.wait()


def test_store_imports_stay_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, json, store.cli; a = sorted(sys.modules); import store.writer, store.replay, store.queries; "
        "print(json.dumps([a, sorted(sys.modules)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    cli_only, everything = (set(m) for m in json.loads(out))
    assert "duckdb" not in cli_only  # agent.cli may import store.cli for its other commands
    heavy = {m for m in everything if m.split(".")[0] in {"vllm", "torch", "textual", "console", "websockets"}}
    engine = {m for m in everything if m.startswith(("agent.engine", "agent.runtime.node", "agent.telemetry.stream"))}
    assert "duckdb" in everything and not heavy | engine, heavy | engine


def test_cli_prune_deletes_what_is_older_than_the_duration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    now_ns = time.time_ns()
    days_ago = [now_ns - d * 86_400 * 10**9 for d in (10, 3, 1)]
    events = [step_event(r, NodeOrigin("node-p", t)) for r, t in zip(records(3), days_ago, strict=True)]
    db = tmp_path / "prune.duckdb"
    with StoreWriter(db) as writer:
        writer.write([msgspec.structs.replace(e, seq=i + 1) for i, e in enumerate(events)])
    console = Console(width=200, force_terminal=False)
    assert cmd_prune(parse("prune", "--db", str(db), "--older-than", "2d"), console) == 0
    assert capsys.readouterr().out.startswith(f"deleted 2 rows older than {dt.date.today().year}")
    with StoreWriter(db) as writer:
        assert writer.cursor().execute("SELECT seq FROM steps").fetchall() == [(3,)]
    assert cmd_prune(parse("prune", "--db", str(tmp_path / "missing.duckdb"), "--older-than", "1h"), console) == 2
    assert capsys.readouterr().err == f"trackside prune: error: no database at {tmp_path / 'missing.duckdb'}\n"


@pytest.mark.parametrize("text", ["7", "7 days", "-1d", "0h", "1.5", "d"])
def test_cli_prune_refuses_bad_durations(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse("prune", "--db", "x.duckdb", f"--older-than={text}")
    assert info.value.code == 2
    assert f"argument --older-than: invalid duration {text!r}" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("12h", 43_200), ("7d", 604_800), ("1h30m", 5400),
                                               ("1.5w", 907_200), ("2D", 172_800)])
def test_durations(text: str, seconds: float) -> None:
    assert duration_s(text) == seconds
