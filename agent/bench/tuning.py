"""``trackside bench --tune-sarathi``: Sarathi's token budget, the best of a grid per case, before comparing.

The papers compare against a tuned Sarathi: seed 003 (FairBatching, 5.1) runs "vLLM-sarathi" with its "most
important hyperparameter, TokenBudget, ... best tuned for each testcase", and seed 004 (the continuous-batching
chapter) warns that there is no universal budget: larger ones tend to improve TTFT and throughput, smaller ones
inter-token latency, so one profiles on the target hardware and workload and picks the budget that serves most
without missing the SLOs. Our ``sarathi`` derives its budget once from the TBT target instead (POLICIES.md 1.3,
:mod:`policies.batch.sarathi`); vLLM's default stays as shipped.

**A case** is everything a :class:`~agent.bench.runner.BenchConfig` holds (workload, profile, units, SLOs, TPOT
metric, topology...) and the dispatch policy: the budget is tuned once per dispatch compared.

**The score** of a budget is the criterion of ``--sweep knee``: the offered load Sarathi with that budget sustains
at the SLO target, found by :func:`~agent.bench.knee.find_knee` with the same :class:`~agent.bench.knee.KneeSearch`
(from the workload at time scale 1). When the search never brackets the target the score is, as in
:func:`~agent.bench.report.slo_capacity`, the heaviest load tried if every run met it (a lower bound) and none if
even the lightest missed.

**The choice**: the highest score, ties to the smaller budget (exact ties: budgets that ran the same); none when
every budget missed at the lightest load, and then Sarathi keeps its derived budget. Deterministic for a seed, as
every run is. Pure but for ``run_at``; the grid and the choice (:func:`parse_grid`, :func:`clip_grid`,
:func:`choose_budget`) need no simulation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agent.bench.knee import KneeSearch, KnownKnee, RunAt, find_knee
from agent.bench.report import slo_capacity
from agent.bench.runner import BenchConfig, RunResult, split_params
from agent.engine.profiles import load_profile
from policies.batch.sarathi import budget_for_target
from policies.params import MAX_STEP_TOKENS
from policies.registry import make_batch_policy

TUNED_POLICY = "sarathi"
TUNED_PARAM = "token_budget"
TUNED_KEY = f"{TUNED_POLICY}.{TUNED_PARAM}"
"""The ``--param`` assignment a tuned budget is given as (it reaches Sarathi only)."""

DEFAULT_GRID: tuple[int, ...] = (256, 512, 1024, 1536, 2048, 4096)
"""Budgets tried by default: the 512 and 1,024-token chunks seed 004 cites, halved and up to half the 8,192-token
cap of our profiles (the derived budget on the H100 8B profile, 1,638, lies between 1,536 and 2,048)."""


def parse_grid(text: str) -> tuple[int, ...]:
    """``256,512,1024`` as sorted distinct budgets; ValueError naming what is wrong."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError("give at least one token budget, e.g. 512,1024,2048")
    try:
        budgets = {int(x) for x in items}
    except ValueError:
        raise ValueError(f"token budgets are whole numbers of tokens, e.g. 512,1024,2048 (got {text!r})") from None
    bad = sorted(b for b in budgets if not 1 <= b <= MAX_STEP_TOKENS)
    if bad:
        raise ValueError(f"token budgets must be 1..{MAX_STEP_TOKENS:,} (got {', '.join(map(str, bad))})")
    return tuple(sorted(budgets))


def clip_grid(grid: Iterable[int], cap: int) -> tuple[int, ...]:
    """The budgets as Sarathi runs them: none above the unit's ``max_num_batched_tokens`` (it clips them to it), so
    budgets at or above the cap are one budget, the cap."""
    return tuple(sorted({min(b, cap) for b in grid}))


def choose_budget(scores: Iterable[tuple[int, float | None]]) -> int | None:
    """The budget with the highest score (sustained req/s), the smaller one on a tie; None when no budget has one."""
    scored = [(b, s) for b, s in scores if s is not None]
    if not scored:
        return None
    return min(scored, key=lambda bs: (-bs[1], bs[0]))[0]


def case_grid(config: BenchConfig, grid: Iterable[int]) -> tuple[int, ...]:
    """``grid`` clipped (:func:`clip_grid`) to ``config``'s token cap (its override, else its profile's)."""
    return clip_grid(grid, config.max_num_batched_tokens or load_profile(config.profile).max_num_batched_tokens)


def with_budget(config: BenchConfig, budget: int) -> BenchConfig:
    """``config`` with Sarathi's token budget set to ``budget`` (other policies ignore it). The assignment comes last,
    so it overrides an unqualified ``token_budget=`` for Sarathi."""
    params = {k: v for k, v in config.params.items() if k != TUNED_KEY}
    params[TUNED_KEY] = str(budget)
    return replace(config, params=params)


def derived_budget(config: BenchConfig) -> int:
    """The budget Sarathi derives for ``config`` at its first step (its TBT target and reference context, as given
    by ``config.params``, on the profile's step model: the calibrated prior a unit starts from)."""
    profile = load_profile(config.profile)
    batch_params, _ = split_params(config.params, TUNED_POLICY, config.dispatch)
    batch_params.pop(TUNED_PARAM, None)
    params = make_batch_policy(TUNED_POLICY, batch_params).params
    cap = config.max_num_batched_tokens or profile.max_num_batched_tokens
    return budget_for_target(profile.coefficients, float(params["tbt_target_ms"]) / 1e3,
                             int(params["reference_context_tokens"]), cap)


@dataclass(slots=True)
class BudgetScore:
    """One budget of the grid: its knee search and what it sustains."""

    budget: int
    knee_rps: float | None
    """What :func:`find_knee` returned (None: the target was never bracketed)."""
    runs: list[RunResult]
    target: float

    @property
    def score(self) -> float | None:
        """Sustained req/s at the target: the knee; when not bracketed, the heaviest load tried if every run met the
        target, None if the lightest missed."""
        if self.knee_rps is not None:
            return self.knee_rps
        return slo_capacity([(r.offered_rps, r.summary["slo_attainment"]) for r in self.runs], self.target)

    @property
    def met_at_heaviest(self) -> bool:
        """Every run met the target: the score is a lower bound."""
        return bool(self.runs) and all(r.summary["slo_attainment"] >= self.target for r in self.runs)

    def as_json(self) -> dict[str, Any]:
        return {
            "budget": self.budget, "sustained_rps": self.score, "met_at_heaviest": self.met_at_heaviest,
            "num_runs": len(self.runs),
            "search": [{"time_scale": r.config.time_scale, "offered_rps": r.offered_rps,
                        "slo_attainment": r.summary["slo_attainment"]} for r in self.runs],
        }


@dataclass(slots=True)
class SarathiTuning:
    """Sarathi's budget tuned for one case (one dispatch)."""

    config: BenchConfig
    """The case: Sarathi under the dispatch, at time scale 1, with its own (derived or given) budget."""
    derived: int
    """The budget Sarathi would derive (not run unless it is in the grid)."""
    scores: list[BudgetScore] = field(default_factory=list)

    @property
    def chosen(self) -> int | None:
        """The best budget of the grid (None: every budget missed the target at the lightest load tried)."""
        return choose_budget((s.budget, s.score) for s in self.scores)

    @property
    def num_runs(self) -> int:
        return sum(len(s.runs) for s in self.scores)

    def tuned(self, config: BenchConfig) -> BenchConfig:
        """``config`` with the chosen budget (unchanged when none was chosen)."""
        return config if self.chosen is None else with_budget(config, self.chosen)

    def known_knee(self) -> KnownKnee | None:
        """The chosen budget's knee search, for ``--sweep knee`` not to run it again."""
        best = next((s for s in self.scores if s.budget == self.chosen), None)
        if best is None:
            return None
        return KnownKnee(with_budget(self.config, best.budget), best.knee_rps, best.runs)

    def as_json(self) -> dict[str, Any]:
        return {
            "dispatch": self.config.dispatch, "chosen_budget": self.chosen, "derived_budget": self.derived,
            "num_runs": self.num_runs, "budgets": [s.as_json() for s in self.scores],
        }


def tune_sarathi(base: BenchConfig, run_at: RunAt, search: KneeSearch, grid: Sequence[int],
                 on_budget: Callable[[BudgetScore], None] | None = None) -> SarathiTuning:
    """Score every budget of ``grid`` (as :func:`case_grid` leaves it) for Sarathi under ``base``'s dispatch and
    settings; ``on_budget`` is called after each one (progress)."""
    case = replace(base, batch_policy=TUNED_POLICY, time_scale=1.0)
    tuning = SarathiTuning(case, derived_budget(case))
    for budget in case_grid(case, grid):
        knee, runs = find_knee(with_budget(case, budget), run_at, search)
        score = BudgetScore(budget, knee, runs, search.target)
        tuning.scores.append(score)
        if on_budget is not None:
            on_budget(score)
    return tuning


def apply_tuning(configs: Sequence[BenchConfig], tunings: Mapping[str, SarathiTuning]) -> list[BenchConfig]:
    """``configs`` with each Sarathi config given its dispatch's chosen budget (the others as they are)."""
    return [tunings[c.dispatch].tuned(c) if c.batch_policy == TUNED_POLICY and c.dispatch in tunings else c
            for c in configs]


def tuning_json(tunings: Mapping[str, SarathiTuning], search: KneeSearch, grid: Sequence[int]) -> dict[str, Any]:
    """The ``sarathi_tuning`` object of ``trackside bench --json``."""
    return {
        "criterion": f"offered req/s sustained at {search.target:g} SLO attainment (the --sweep knee search); "
                     "ties to the smaller budget",
        "target": search.target, "grid": list(grid), "param": TUNED_KEY,
        "dispatches": [t.as_json() for t in tunings.values()],
    }
