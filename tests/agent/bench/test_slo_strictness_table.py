"""The SLO-strictness table (``tests/benchmarks/bench_slo_strictness.py``, issue #19 item 10): its pure parts; the
runs themselves are a benchmark, run by hand."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
from bench_scripts import bench_script


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with bench_script("bench_slo_strictness") as module:
        yield module


def test_slo_pairs_parse_and_the_paper_grid_is_table_5s(bench: ModuleType) -> None:
    assert bench.parse_slos("500/50, 2000/200,500/50") == ((500, 50), (2000, 200))
    assert len(bench.parse_slos("paper")) == 16
    assert bench.PAPER_TABLE5["fairbatching"][(500, 50)] == 15.4
    assert bench.PAPER_TABLE5["fairbatching+pab"][(2000, 200)] == 24.8
    for bad in ("", "2000", "2000/x", "0/50"):
        with pytest.raises(ValueError):
            bench.parse_slos(bad)


def test_rows_score_the_peak_effective_rps_against_the_baselines(bench: ModuleType) -> None:
    band = {
        "sarathi": [(10.0, 0.95), (12.0, 0.85), (14.0, 0.7)],  # peak 10.2 at 12
        "fb": [(10.0, 1.0), (12.0, 0.95), (14.0, 0.9)],  # peak 12.6 at the top; sustained to the top
        "vllm": [(10.0, 0.7), (12.0, 0.5), (14.0, 0.3)],  # peak 7 at the bottom; never sustained
    }
    rows = {r["policy"]: r for r in bench.policy_rows(band, 11.0, "sarathi", 0.9)}
    assert rows["sarathi"]["effective_ratio"] == 1.0 and not rows["sarathi"]["peak_at_band_top"]
    assert rows["sarathi"]["sustained_rps"] == pytest.approx(11.0)
    assert rows["fb"]["effective_ratio"] == pytest.approx(12.6 / 10.2)
    assert rows["fb"]["peak_at_band_top"] and rows["fb"]["sustained_at_band_top"]
    assert rows["fb"]["knee_ratio"] == pytest.approx(14.0 / 11.0)
    assert rows["vllm"]["sustained_rps"] is None and rows["vllm"]["knee_ratio"] is None
    assert [bench.peak_mark(rows[k]) for k in ("sarathi", "fb", "vllm")] == ["", "^", "v"]


def test_the_grid_is_ttft_rows_by_tpot_columns_with_the_papers_gain(bench: ModuleType) -> None:
    def cell(ttft: int, tpot: int, ratio: float) -> dict[str, object]:
        return {"ttft_ms": ttft, "tpot_ms": tpot, "policies": [
            {"policy": "fairbatching", "effective_ratio": ratio, "peak_at_band_top": ratio > 1.1}]}

    lines = bench.render_grid([cell(500, 50, 1.154), cell(2000, 200, 0.996)], "fairbatching",
                              bench.PAPER_TABLE5["fairbatching"])
    assert lines[0] == "| TTFT SLO \\ TPOT SLO | 50 ms | 200 ms |"
    assert lines[2] == "| 500 ms | +15.4%^ (+15.4%) |  |"
    assert lines[3] == "| 2000 ms |  | -0.4% (-0.4%) |"
    assert bench.gain(None) == "n/a"
