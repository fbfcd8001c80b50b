"""``--sweep knee``: the knee search and the band around it, with a stand-in for the simulator (attainment a known
function of load), then once end to end through ``trackside bench`` on a small workload."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.bench.knee import KneeSearch, find_knee, knee_sweep
from agent.bench.runner import BenchConfig, RunResult
from agent.cli.main import main

RPS_AT_SCALE_1 = 100.0


def fake_run(capacity: dict[str, float], calls: list[BenchConfig]) -> Callable[[BenchConfig], RunResult]:
    """Attainment 1.0 up to a policy's capacity, then falling linearly to 0 at twice it."""

    def run_at(config: BenchConfig) -> RunResult:
        calls.append(config)
        load = RPS_AT_SCALE_1 / config.time_scale
        cap = capacity[config.batch_policy]
        attainment = 1.0 if load <= cap else max(0.0, 1.0 - (load - cap) / cap)
        return RunResult(config, {"slo_attainment": attainment}, [], 0, {}, {}, offered_rps=load)

    return run_at


def test_the_knee_is_found_within_the_tolerance() -> None:
    calls: list[BenchConfig] = []
    run_at = fake_run({"vllm": 300.0}, calls)
    knee, runs = find_knee(BenchConfig(batch_policy="vllm"), run_at, KneeSearch(tolerance=0.01, max_runs=20))
    assert knee == pytest.approx(330.0, rel=0.02)  # 90% attainment at 1.1x the capacity
    assert len(runs) == len(calls) <= 20
    # From scale 1 (100 req/s, met) the load doubled until missed, then the bracket was bisected.
    assert [c.time_scale for c in calls[:3]] == [1.0, 0.5, 0.25]


def test_a_workload_that_misses_at_the_lightest_load_tried_has_no_knee() -> None:
    calls: list[BenchConfig] = []
    knee, runs = find_knee(BenchConfig(batch_policy="vllm"), fake_run({"vllm": 1e-6}, calls),
                           KneeSearch(max_runs=4))
    assert knee is None and len(runs) == 4 and calls[1].time_scale == 2.0  # it looked at lighter loads


def test_every_policy_runs_in_the_band_around_the_best_baselines_knee() -> None:
    calls: list[BenchConfig] = []
    run_at = fake_run({"vllm": 200.0, "sarathi": 300.0, "fairbatching": 360.0}, calls)
    search = KneeSearch(points=8)
    configs = [BenchConfig(batch_policy=p) for p in ("vllm", "fairbatching")]
    found = knee_sweep(configs, run_at, search, RPS_AT_SCALE_1)
    assert found.baseline == "sarathi/least_loaded" and found.knee_rps == pytest.approx(330.0, rel=0.03)
    assert set(found.baseline_knees) == {"vllm/least_loaded", "sarathi/least_loaded"}
    loads = sorted({r.offered_rps for r in found.band_runs})
    assert len(loads) == 8 and loads[0] == pytest.approx(0.8 * found.knee_rps)
    assert loads[-1] == pytest.approx(1.3 * found.knee_rps)
    # The best baseline runs in the band too, though not compared, so that ratios have their reference.
    assert {r.config.batch_policy for r in found.band_runs} == {"sarathi", "vllm", "fairbatching"}
    rows = {row["policy"]: row for row in found.per_policy()}
    assert rows["sarathi/least_loaded"]["effective_ratio"] == pytest.approx(1.0)
    assert rows["fairbatching/least_loaded"]["knee_ratio"] == pytest.approx(396 / found.knee_rps, rel=0.03)
    assert rows["fairbatching/least_loaded"]["effective_ratio"] > 1.0 > rows["vllm/least_loaded"]["effective_ratio"]
    assert json.dumps(found.as_json())  # plain data


def test_bad_bands_are_refused() -> None:
    for kwargs in ({"points": 1}, {"low": 1.3, "high": 0.8}, {"target": 0.0}):
        with pytest.raises(ValueError):
            KneeSearch(**kwargs)  # type: ignore[arg-type]


def test_trackside_bench_sweep_knee(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "knee.json"
    code = main(["bench", "--workload", "poisson:n=40,rate=20", "--compare", "vllm", "--sweep", "knee",
                 "--knee-points", "3", "--no-progress", "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    payload = json.loads(out.read_text())
    knee = payload["knee"]
    assert knee["knee_rps"] > 0 and knee["baseline"] in knee["baseline_knees"]
    assert len(knee["band_rps"]) == 3 and len(payload["runs"]) >= 3
    assert "Around the knee" in capsys.readouterr().out
    assert main(["bench", "--workload", "poisson:n=5", "--sweep", "knee", "--knee-band", "1.3,0.8"]) == 2
