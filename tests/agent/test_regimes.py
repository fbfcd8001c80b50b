"""The regime map (``trackside regimes``): re-timed arrivals, the ranking of each cell with a stand-in for the
simulator, and the command end to end on a tiny workload (JSON, PNG, terminal, a bad argument)."""

from __future__ import annotations

import io
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from agent.bench.regimes import (
    Cell,
    RegimeError,
    RegimeGrid,
    RegimeMap,
    Score,
    SloPair,
    margin,
    parse_burstiness,
    parse_slos,
    rank,
    regime_map,
    retime,
)
from agent.bench.report import offered_rps
from agent.bench.runner import BenchConfig, RunResult
from agent.cli import regimes_render as render
from agent.cli.main import main
from agent.workload.spec import parse_workload
from agent.workload.types import RequestSpec, request_id_for

TINY = "poisson:n=30,rate=20,output=fixed(8)"
"""A workload that simulates in a few milliseconds a run."""
CAPACITY = {"vllm": 40.0, "sarathi": 60.0, "fairbatching": 50.0}
"""The stand-in's load (req/s) up to which each policy meets every SLO, at TTFT 500 ms."""


def fake_run(config: BenchConfig, workload: Sequence[RequestSpec]) -> RunResult:
    """Attainment 1 up to the policy's capacity (larger with a looser TTFT target), then falling with the load."""
    load = offered_rps([r.arrival_s for r in workload]) / config.time_scale
    cap = CAPACITY[config.batch_policy] * config.ttft_slo_ms / 500.0
    attainment = min(1.0, cap / load)
    summary = {"effective_rps": load * attainment, "slo_attainment": attainment, "goodput_rps": load * attainment / 2,
               "ttft_ms": {"p99": 100.0}}
    return RunResult(config, summary, [], 0, {}, {}, offered_rps=load)


def slow_first_run(config: BenchConfig, workload: Sequence[RequestSpec]) -> RunResult:
    """:func:`fake_run`, slower for the first policy: worker processes finish runs out of their order."""
    if config.batch_policy == "vllm":
        time.sleep(0.05)
    return fake_run(config, workload)


def requests(n: int, seed: int = 3) -> list[RequestSpec]:
    return parse_workload(f"poisson:n={n},rate=10", seed=seed)


# -- re-timing -------------------------------------------------------------------------------------------------
def test_retiming_keeps_the_requests_their_order_and_the_mean_rate() -> None:
    reqs = requests(400)
    bursty = retime(reqs, 4.0, seed=1)
    assert len(bursty) == len(reqs)
    assert [(r.request_id, r.prompt_tokens, r.output_tokens) for r in bursty] == [
        (r.request_id, r.prompt_tokens, r.output_tokens) for r in reqs]
    arrivals = [r.arrival_s for r in bursty]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] == pytest.approx(reqs[0].arrival_s) and arrivals[-1] == pytest.approx(reqs[-1].arrival_s)
    assert offered_rps(arrivals) == pytest.approx(offered_rps([r.arrival_s for r in reqs]))
    assert arrivals != [r.arrival_s for r in reqs]
    assert retime(reqs, 4.0, seed=1) == bursty and retime(reqs, 4.0, seed=2) != bursty  # seeded


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_the_gaps_have_the_coefficient_of_variation_asked_for(cv: float) -> None:
    evenly = [RequestSpec(request_id_for(k), 0.1 * k, 10, 10) for k in range(5_000)]
    gaps = np.diff([r.arrival_s for r in retime(evenly, cv, seed=0)])
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_trace_keeps_the_arrivals_and_cv_0_spaces_them_evenly() -> None:
    reqs = requests(50)
    assert retime(reqs, None, seed=1) == reqs
    gaps = np.diff([r.arrival_s for r in retime(reqs, 0.0, seed=1)])
    assert gaps == pytest.approx(np.full(49, gaps.mean()))


# -- ranking ---------------------------------------------------------------------------------------------------
def test_each_cell_names_the_best_policy_and_its_margin_over_the_runner_up() -> None:
    grid = RegimeGrid((1.0, 0.2, 0.1), parse_slos("500/50,2000/50"), (None,), tuple(CAPACITY))
    rmap = regime_map(requests(60), BenchConfig(), grid, jobs=1, run=fake_run)
    assert len(rmap.cells) == 6
    light = rmap.cell(None, SloPair(500, 50), 1.0)  # about 10 req/s: every policy meets every SLO
    assert set(light.tied) == set(CAPACITY) and light.margin == 0.0
    for cell in rmap.cells:
        eff = {s.policy: s.effective_rps for s in cell.ranked}
        best, second = sorted(eff.values(), reverse=True)[:2]
        assert eff[cell.winner] == max(eff.values())
        assert cell.margin == pytest.approx(best / second - 1)
        assert cell.runner_up != cell.winner and eff[cell.runner_up] == second
    heavy = rmap.cell(None, SloPair(500, 50), 0.1)  # about 100 req/s: sarathi 60 vs fairbatching 50
    assert (heavy.winner, heavy.runner_up) == ("sarathi", "fairbatching")
    assert heavy.margin == pytest.approx(0.2)
    doc = rmap.as_json()
    assert doc["cells"][-1]["policies"]["vllm"]["slo_attainment"] == pytest.approx(
        rmap.cells[-1].ranked[-1].slo_attainment)


def test_ties_go_to_goodput_then_ttft_p99_and_margins_at_zero() -> None:
    a = Score("a", 5.0, 0.5, 1.0, 300.0)
    b = Score("b", 5.0, 0.5, 2.0, 900.0)
    c = Score("c", 5.0, 0.5, 2.0, 400.0)
    cell = Cell(None, SloPair(500, 50), 1.0, 10.0, tuple(rank([a, b, c], ["a", "b", "c"])))
    assert (cell.winner, cell.runner_up, cell.tied) == ("c", "b", ("c", "b", "a"))
    assert margin(0.0, 0.0) == 0.0 and math.isinf(margin(1.0, 0.0)) and margin(3.0, 2.0) == pytest.approx(0.5)


def test_worker_processes_give_the_same_map_and_report_progress() -> None:
    grid = RegimeGrid((1.0, 0.1), parse_slos("500/50"), (None, 2.0), tuple(CAPACITY))
    seen: list[tuple[int, int]] = []
    one = regime_map(requests(60), BenchConfig(), grid, jobs=1, run=fake_run, seed=4)
    two = regime_map(requests(60), BenchConfig(), grid, jobs=2, run=slow_first_run, seed=4,
                     progress=lambda d, t: seen.append((d, t)))
    assert two.as_json() == one.as_json()
    assert RegimeMap.from_json(json.loads(json.dumps(one.as_json()))) == one
    assert seen[-1] == (grid.num_runs, grid.num_runs) and len(seen) == grid.num_runs


def test_a_cell_is_the_stronger_in_its_winners_colour_the_larger_its_margin() -> None:
    def fill(*effective: float) -> tuple[int, int, int]:
        scores = tuple(Score(f"p{k}", e, 0.5, 1.0, 100.0) for k, e in enumerate(effective))
        return render.cell_fill((0, 114, 178), Cell(None, SloPair(500, 50), 1.0, 10.0, scores))

    shades = [fill(5.0, 5.0), fill(5.1, 5.0), fill(6.0, 5.0), fill(7.0, 5.0)]  # a tie, +2%, +20%, +40%
    whiteness = [sum(rgb) for rgb in shades]
    assert whiteness == sorted(whiteness, reverse=True) and len(set(whiteness)) == 4
    assert fill(5.0 * (1 + render.FULL_MARGIN), 5.0) == fill(50.0, 5.0) == (0, 114, 178)


@pytest.mark.parametrize("text", ["500", "500/0", "a/50", "500/50,500/50", ""])
def test_bad_slo_pairs_are_refused(text: str) -> None:
    with pytest.raises(RegimeError):
        parse_slos(text)


def test_burstiness_values() -> None:
    assert parse_burstiness("trace,1,4") == (None, 1.0, 4.0)
    for bad in ("-1", "bursty", "1,1"):
        with pytest.raises(RegimeError):
            parse_burstiness(bad)


# -- the command -----------------------------------------------------------------------------------------------
def test_trackside_regimes_writes_the_map_as_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "map.json", tmp_path / "map.png"
    code = main(["regimes", "--workload", TINY, "--policies", "vllm,sarathi", "--slo", "500/50,2000/100",
                 "--time-scales", "1,0.5", "--burstiness", "trace", "--jobs", "1", "--no-progress",
                 "--json", str(out), "--png", str(png)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "Burstiness: trace" in printed and "500/50" in printed and "2000/100" in printed
    doc = json.loads(out.read_text())
    assert doc["policies"] == ["vllm", "sarathi"] and doc["slos"] == ["500/50", "2000/100"]
    assert doc["time_scales"] == [1.0, 0.5] and doc["burstiness"] == ["trace"] and doc["requests"] == 30
    assert doc["offered_rps"][1] == pytest.approx(2 * doc["offered_rps"][0])
    assert len(doc["cells"]) == 4
    for cell in doc["cells"]:
        assert set(cell) >= {"burstiness", "slo", "time_scale", "offered_rps", "winner", "runner_up", "margin",
                             "tied", "policies"}
        assert set(cell["policies"]) == {"vllm", "sarathi"} and cell["winner"] in cell["policies"]
        assert set(cell["policies"]["vllm"]) >= {"effective_rps", "slo_attainment"}
    image = Image.open(io.BytesIO(png.read_bytes()))
    assert image.format == "PNG"
    r = render
    width = max(r.MIN_WIDTH, 2 * r.MARGIN + r.ROW_LABEL_W + 2 * r.CELL_W)
    height = (3 * r.MARGIN + r.TITLE_H + r.PANEL_TITLE_H + r.COL_HEADER_H + 2 * r.CELL_H + r.LEGEND_ROW_H
              + r.NOTE_H)
    assert image.size == (width, height)
    # The top-left cell is painted in its winner's colour.
    first = doc["cells"][0]
    ranked = tuple(Score(p, v["effective_rps"], v["slo_attainment"], v["goodput_rps"], v["ttft_p99_ms"])
                   for p, v in first["policies"].items())
    cell = Cell(None, SloPair(500, 50), 1.0, first["offered_rps"], ranked)
    x, y = r.MARGIN + r.ROW_LABEL_W + 6, r.MARGIN + r.TITLE_H + r.PANEL_TITLE_H + r.COL_HEADER_H + 6
    expected = r.cell_fill(r.colours(("vllm", "sarathi"))[first["winner"]], cell)
    assert image.convert("RGB").getpixel((x, y)) == expected


@pytest.mark.parametrize("args", [["--slo", "500-50"], ["--burstiness", "x"], ["--policies", "nope"]])
def test_bad_arguments_exit_2_with_one_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["regimes", "--workload", TINY, "--no-progress", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("trackside regimes: error: "), err
