"""``trackside bench --outcomes`` (issue #21, item 7): one row per finished request, CSV or Parquet."""

from __future__ import annotations

import csv
from pathlib import Path

import duckdb
import pytest

from agent.bench.outcomes import COLUMNS, outcome_rows, write_outcomes_csv
from agent.bench.runner import BenchConfig, run_once
from agent.cli.main import main as trackside
from agent.workload.spec import parse_workload


def test_the_rows_are_the_runs_outcomes_and_agree_with_its_summary(tmp_path: Path) -> None:
    workload = parse_workload("poisson:n=30,rate=20", seed=3)
    result = run_once(BenchConfig(units=2, time_scale=0.5), workload)
    rows = list(outcome_rows([result]))
    assert len(rows) == result.summary["completed"] == 30 and all(list(r) == list(COLUMNS) for r in rows)
    assert {r["request_id"] for r in rows} == {s.request_id for s in workload}
    assert sum(r["met_slo"] for r in rows) == pytest.approx(result.summary["slo_attainment"] * 30)
    e2e = sorted(r["e2e_ms"] for r in rows)
    assert e2e[0] > 0 and result.summary["e2e_ms"]["mean"] == pytest.approx(sum(e2e) / 30)
    assert all(r["finish_s"] >= r["first_token_s"] >= r["arrival_s"] and r["time_scale"] == 0.5 for r in rows)
    path = tmp_path / "o.csv"
    assert write_outcomes_csv([result], path) == 30
    with path.open() as f:
        read = list(csv.DictReader(f))
    assert [r["request_id"] for r in read] == [r["request_id"] for r in rows]


def test_the_command_writes_every_runs_rows_as_parquet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs" / "o.parquet"
    assert trackside(["bench", "--workload", "poisson:n=12,rate=5", "--units", "2", "--compare", "vllm,sarathi",
                      "--no-progress", "--outcomes", str(out)]) == 0
    assert "wrote 24 request outcomes" in " ".join(capsys.readouterr().out.split())
    got = duckdb.sql(f"SELECT batch_policy, count(*) FROM '{out}' GROUP BY 1 ORDER BY 1").fetchall()
    assert got == [("sarathi", 12), ("vllm", 12)]
    assert trackside(["bench", "--workload", "poisson:n=2", "--outcomes", str(tmp_path / "o.txt")]) == 2
