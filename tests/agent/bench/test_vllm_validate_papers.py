"""The ``papers`` part of the GPU validation (issue #19 item 11), the parts that run before any engine starts:
the trace window with seed 003's SLOs, the simulator's knee and the refusal of a plan too long for a GPU slot."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from agent.bench.vllm_validate import (
    PAPER_SLO,
    PAPER_TRACE,
    SEEDS,
    _window,
    main,
    paper_knee,
    policy_arg,
    step_percentiles,
)
from policies.params import ParamError

pytestmark = pytest.mark.vllm


def test_the_window_starts_at_zero_with_the_papers_slos() -> None:
    window = _window(PAPER_TRACE, 30)
    assert len(window) == 30 and window[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(window))
    assert {(r.ttft_slo_ms, r.tpot_slo_ms) for r in window} == {(PAPER_SLO[0] * 1e3, PAPER_SLO[1] * 1e3)}


def test_the_knee_is_the_best_baselines_and_a_plan_over_the_time_limit_is_refused(tmp_path: Path) -> None:
    knee, knees = paper_knee(_window(PAPER_TRACE, 30), "h100-llama31-8b")
    assert set(knees) == {"vllm", "sarathi"} and knee is not None
    assert knee == max(k for k in knees.values() if k is not None)
    # 30 requests at 4 policies and 3 loads around the knee: minutes of arrivals, refused before an engine starts.
    with pytest.raises(SystemExit, match="over --max-minutes"):
        main(["papers", "--requests", "30", "--max-minutes", "0.01", "--out", str(tmp_path)])
    partial = json.loads((tmp_path / "papers.partial.json").read_text())
    assert partial["sim_knee_rps"] == pytest.approx(knee) and partial["estimate_s"] > 0.6


def test_a_policy_takes_parameters_and_a_bad_one_fails_before_anything_runs(tmp_path: Path) -> None:
    assert policy_arg("sarathi") == ("sarathi", {})
    assert policy_arg("fairbatching:anchor=first_token;margin_quantile=0.5") == (
        "fairbatching", {"anchor": "first_token", "margin_quantile": "0.5"})
    with pytest.raises(SystemExit, match="not key=value"):
        policy_arg("fairbatching:anchor")
    with pytest.raises(ParamError):
        main(["papers", "--requests", "30", "--policies", "sarathi,fairbatching:anchor=sideways",
              "--out", str(tmp_path)])
    assert not (tmp_path / "papers.partial.json").exists()  # not even the knee was searched


def test_every_run_gets_its_own_prompt_seed() -> None:
    # One seed for all runs replayed the same prompts on one engine, and its prefix cache answered them.
    a, b = next(SEEDS), next(SEEDS)
    assert a != b and 0 not in (a, b)  # 0 is the warm-up's


def test_a_tuned_sarathi_joins_the_runs_with_the_simulators_best_budget(tmp_path: Path) -> None:
    # Seed 003's baseline is Sarathi with its budget tuned per case: the grid is run in the simulator on the same
    # window, before any engine starts, and the chosen budget joins the runs as sarathi:token_budget=N.
    with pytest.raises(SystemExit, match="over --max-minutes"):
        main(["papers", "--requests", "30", "--policies", "sarathi", "--tune-sarathi", "--max-minutes", "0",
              "--out", str(tmp_path)])
    partial = json.loads((tmp_path / "papers.partial.json").read_text())
    tuning = partial["sarathi_tuning"]
    chosen = tuning["chosen_budget"]
    assert chosen in [b["budget"] for b in tuning["budgets"]]
    best = max(b["sustained_rps"] or 0.0 for b in tuning["budgets"])
    assert next(b for b in tuning["budgets"] if b["budget"] == chosen)["sustained_rps"] == best
    # Two policies now (the derived and the tuned Sarathi): the estimate counts both.
    tmp2 = tmp_path / "plain"
    with pytest.raises(SystemExit, match="over --max-minutes"):
        main(["papers", "--requests", "30", "--policies", "sarathi", "--max-minutes", "0", "--out", str(tmp2)])
    plain = json.loads((tmp2 / "papers.partial.json").read_text())
    assert "sarathi_tuning" not in plain
    assert partial["estimate_s"] == pytest.approx(2 * plain["estimate_s"], abs=1)


def test_step_percentiles_count_only_steps_that_ran_tokens() -> None:
    from types import SimpleNamespace

    steps = [SimpleNamespace(duration_s=(i + 1) / 1e3, num_prefill_tokens=0, num_decode_tokens=1) for i in range(200)]
    steps.append(SimpleNamespace(duration_s=9.0, num_prefill_tokens=0, num_decode_tokens=0))  # idle: not counted
    got = step_percentiles(steps)  # type: ignore[arg-type]
    assert got == {"p50": 101.0, "p99": 199.0, "max": 200.0}
    assert step_percentiles([]) == {}
