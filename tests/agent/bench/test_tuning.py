"""``--tune-sarathi``: the grid, the choice and the tuning loop with a stand-in for the simulator (attainment a known
function of load and budget), then once end to end through ``trackside bench`` on a tiny workload."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.bench.knee import KneeSearch, KnownKnee, knee_sweep
from agent.bench.runner import BenchConfig, RunResult, split_params
from agent.bench.tuning import (
    DEFAULT_GRID,
    TUNED_KEY,
    apply_tuning,
    choose_budget,
    clip_grid,
    derived_budget,
    parse_grid,
    tune_sarathi,
    with_budget,
)
from agent.cli.main import main

RPS_AT_SCALE_1 = 100.0


def capacity_of(config: BenchConfig, by_budget: dict[int, float], others: float) -> float:
    if config.batch_policy != "sarathi":
        return others
    return by_budget[int(config.params.get(TUNED_KEY, "0"))]


def fake_run(by_budget: dict[int, float], calls: list[BenchConfig], others: float = 150.0,
             ) -> Callable[[BenchConfig], RunResult]:
    """Attainment 1.0 up to the capacity (Sarathi's by its budget, 0 = derived), then falling linearly to 0 at twice
    it."""

    def run_at(config: BenchConfig) -> RunResult:
        calls.append(config)
        load = RPS_AT_SCALE_1 / config.time_scale
        cap = capacity_of(config, by_budget, others)
        attainment = 1.0 if load <= cap else max(0.0, 1.0 - (load - cap) / cap)
        return RunResult(config, {"slo_attainment": attainment}, [], 0, {}, {}, offered_rps=load)

    return run_at


def test_a_grid_is_parsed_sorted_and_without_repeats() -> None:
    assert parse_grid("1024, 256,512,,1024") == (256, 512, 1024)
    assert parse_grid(",".join(map(str, DEFAULT_GRID))) == DEFAULT_GRID
    for bad in ("", " , ", "512,abc", "0,512", "1.5", str(2**21)):
        with pytest.raises(ValueError):
            parse_grid(bad)


def test_budgets_at_or_above_the_cap_are_one_budget() -> None:
    assert clip_grid([256, 4096, 512, 8192, 16384], cap=4096) == (256, 512, 4096)
    assert clip_grid([1024], cap=8192) == (1024,)


def test_the_highest_score_wins_and_ties_go_to_the_smaller_budget() -> None:
    assert choose_budget([(256, 5.0), (512, 7.5), (1024, 7.0)]) == 512
    assert choose_budget([(2048, 7.5), (512, 7.5), (1024, None)]) == 512
    assert choose_budget([(256, None), (512, None)]) is None
    assert choose_budget([]) is None


def test_the_budget_reaches_sarathi_only_and_overrides_an_unqualified_one() -> None:
    config = with_budget(BenchConfig(params={"token_budget": "64", "sarathi.token_budget": "8"}), 1024)
    assert list(config.params)[-1] == TUNED_KEY and config.params[TUNED_KEY] == "1024"
    assert split_params(config.params, "sarathi", "least_loaded")[0]["token_budget"] == "1024"
    assert split_params(config.params, "fairbatching", "least_loaded")[0]["token_budget"] == "64"
    assert split_params(with_budget(BenchConfig(), 512).params, "vllm", "least_loaded") == ({}, {})


def test_the_derived_budget_is_the_one_sarathi_derives() -> None:
    # H100 8B profile, 50 ms target, 32,768 context tokens (policies/batch/sarathi.py).
    assert derived_budget(BenchConfig()) == 1638
    assert derived_budget(BenchConfig(params={"sarathi.tbt_target_ms": "100"})) > 1638
    assert derived_budget(BenchConfig(max_num_batched_tokens=512)) == 512


def test_every_budget_is_searched_as_the_knee_is_and_the_best_is_chosen() -> None:
    calls: list[BenchConfig] = []
    by_budget = {256: 120.0, 512: 300.0, 1024: 300.0, 2048: 200.0}
    seen: list[int] = []
    tuning = tune_sarathi(BenchConfig(batch_policy="vllm", dispatch="round_robin", time_scale=0.5),
                          fake_run(by_budget, calls), KneeSearch(), [2048, 256, 1024, 512],
                          on_budget=lambda s: seen.append(s.budget))
    assert seen == [256, 512, 1024, 2048] == [s.budget for s in tuning.scores]
    assert tuning.chosen == 512  # 512 and 1,024 sustain the same load: the smaller
    assert tuning.scores[1].score == pytest.approx(330.0, rel=0.03)  # 90% at 1.1x the capacity
    assert all(c.batch_policy == "sarathi" and c.dispatch == "round_robin" for c in calls)
    assert calls[0].time_scale == 1.0 and tuning.num_runs == len(calls)
    assert tuning.known_knee() == KnownKnee(with_budget(tuning.config, 512), tuning.scores[1].knee_rps,
                                            tuning.scores[1].runs)
    again = tune_sarathi(BenchConfig(dispatch="round_robin"), fake_run(by_budget, []), KneeSearch(),
                         [256, 512, 1024, 2048])
    assert again.as_json() == tuning.as_json()  # deterministic
    assert json.dumps(tuning.as_json())


def test_unbracketed_searches_score_as_slo_capacity_does() -> None:
    search = KneeSearch(max_runs=3)
    tuning = tune_sarathi(BenchConfig(), fake_run({256: 1e-6, 512: 1e9}, []), search, [256, 512])
    lost, held = tuning.scores
    assert lost.score is None and not lost.met_at_heaviest
    assert held.knee_rps is None and held.met_at_heaviest and held.score == pytest.approx(400.0)
    assert tuning.chosen == 512 and tuning.known_knee() is not None
    none = tune_sarathi(BenchConfig(), fake_run({256: 1e-6}, []), search, [256])
    assert none.chosen is None and none.known_knee() is None
    assert none.tuned(BenchConfig(batch_policy="sarathi")) == BenchConfig(batch_policy="sarathi")


def test_the_knee_sweep_reuses_the_tuned_search_and_runs_the_tuned_budget() -> None:
    calls: list[BenchConfig] = []
    run_at = fake_run({0: 100.0, 512: 300.0, 1024: 200.0}, calls)
    tuning = tune_sarathi(BenchConfig(), run_at, KneeSearch(), [512, 1024])
    tuned_calls = len(calls)
    configs = apply_tuning([BenchConfig(batch_policy=p) for p in ("vllm", "fairbatching")], {"least_loaded": tuning})
    assert all(TUNED_KEY not in c.params for c in configs)
    known = tuning.known_knee()
    assert known is not None
    found = knee_sweep(configs, run_at, KneeSearch(points=3), RPS_AT_SCALE_1, {"sarathi/least_loaded": known})
    assert found.baseline == "sarathi/least_loaded" and found.knee_rps == tuning.scores[0].knee_rps
    # Only vLLM's knee was searched again; the tuned Sarathi ran in the band with its budget.
    searched = calls[tuned_calls:len(calls) - len(found.band_runs)]
    assert {c.batch_policy for c in searched} == {"vllm"}
    assert {c.params.get(TUNED_KEY) for c in (r.config for r in found.band_runs) if c.batch_policy == "sarathi"} \
        == {"512"}
    sarathi = apply_tuning([BenchConfig(batch_policy="sarathi"), BenchConfig(batch_policy="sarathi",
                                                                             dispatch="round_robin")],
                           {"least_loaded": tuning})
    assert sarathi[0].params[TUNED_KEY] == "512" and TUNED_KEY not in sarathi[1].params


def test_trackside_bench_tune_sarathi(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tuned.json"
    # Short outputs: a run takes a few hundred steps, the whole command about 2 s.
    workload = "poisson:n=30,rate=20,output=uniform(8,32),prompt=uniform(200,2000)"
    code = main(["bench", "--workload", workload, "--compare", "vllm,sarathi", "--sweep", "knee",
                 "--knee-points", "2", "--tune-sarathi", "256,1024", "--no-progress", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    payload = json.loads(out.read_text())
    tuning = payload["sarathi_tuning"]
    assert tuning["grid"] == [256, 1024] and tuning["param"] == TUNED_KEY
    (case,) = tuning["dispatches"]
    assert case["dispatch"] == "least_loaded" and case["derived_budget"] == 1638
    assert [b["budget"] for b in case["budgets"]] == [256, 1024] and case["chosen_budget"] in (256, 1024)
    assert case["num_runs"] == sum(b["num_runs"] for b in case["budgets"]) == len(
        [b for b in case["budgets"] for _ in b["search"]])
    assert "Sarathi's token budget, tuned" in printed and "chosen" in printed
    budgets = [r["params"]["token_budget"] for r in payload["runs"] if r["batch_policy"] == "sarathi"]
    assert budgets and set(budgets) == {case["chosen_budget"]}
    assert main(["bench", "--workload", "poisson:n=5", "--compare", "vllm", "--tune-sarathi"]) == 2
    assert main(["bench", "--workload", "poisson:n=5", "--compare", "sarathi", "--tune-sarathi", "512,x"]) == 2
    assert "--tune-sarathi" in capsys.readouterr().err
