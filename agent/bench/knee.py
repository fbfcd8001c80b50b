"""``trackside bench --sweep knee``: compare policies where they differ, just past the best baseline's knee.

Below the baselines' knee every policy meets nearly every SLO (within 1–4% of each other on our traces), far past
it every policy fails; the research policies differ in the band between (issue #19). So, as the papers compare:

1. **The knee.** For each baseline (vLLM's default and Sarathi, under each dispatch compared), find the offered
   load at which its SLO attainment falls to the target (90% by default): run the workload at time scale 1,
   halve or double the scale until the target is bracketed, then bisect the time scale (on a log scale) until
   the bracket's loads are within :attr:`KneeSearch.tolerance` of each other; the load is interpolated between
   the last point that met the target and the first that missed it
   (:func:`~agent.bench.report.slo_capacity`). The best baseline's load is the knee, ``L*``.
2. **The band.** Every compared policy runs at :attr:`KneeSearch.points` loads evenly spread from
   ``low × L*`` to ``high × L*`` (0.8x to 1.3x by default); each policy's sustained load there (the same
   interpolation) divided by ``L*`` is its ratio, and its peak effective RPS (offered RPS × attainment, the
   papers' metric) over the band divided by the best baseline's is the other.

Loads are set by scaling the workload's arrival times (``time_scale``: 2 halves the load), so the offered load of a
scale is the workload's at scale 1 divided by it. Pure but for ``run_at``, the caller's way to run one config.
A baseline whose knee was found beforehand (Sarathi with its token budget tuned per dispatch,
:mod:`agent.bench.tuning`) is given as a :class:`KnownKnee`: it is not searched again, and its own config (its
budget) runs in the band.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agent.bench.report import slo_capacity
from agent.bench.runner import BenchConfig, RunResult

BASELINES = ("vllm", "sarathi")
"""The batch policies the knee is found for (vLLM's default and Sarathi-Serve's stall-free batching)."""


@dataclass(frozen=True, slots=True)
class KneeSearch:
    """How the knee is searched for and the band around it sampled."""

    target: float = 0.9
    """SLO attainment that defines a sustained load."""
    points: int = 8
    """Loads run in the band."""
    low: float = 0.8
    high: float = 1.3
    """The band, as multiples of the knee load."""
    tolerance: float = 0.02
    """The bisection stops when the bracket's loads are within this fraction of each other."""
    max_runs: int = 12
    """Runs at most per baseline to find its knee."""

    def __post_init__(self) -> None:
        if not 0 < self.target <= 1:
            raise ValueError("the SLO target must be in (0, 1]")
        if self.points < 2 or not 0 < self.low < self.high:
            raise ValueError("the band needs at least 2 points and 0 < low < high")
        if self.max_runs < 2 or self.tolerance <= 0:
            raise ValueError("the search needs at least 2 runs and a tolerance > 0")

    def band(self, knee_rps: float) -> list[float]:
        """The loads (req/s) run in the band around ``knee_rps``."""
        step = (self.high - self.low) / (self.points - 1)
        return [knee_rps * (self.low + i * step) for i in range(self.points)]


RunAt = Callable[[BenchConfig], RunResult]
"""Runs one config (the caller's: progress bars, warnings) and returns its result."""


def _attains(result: RunResult, target: float) -> bool:
    return bool(result.summary["slo_attainment"] >= target)


def find_knee(config: BenchConfig, run_at: RunAt, search: KneeSearch) -> tuple[float | None, list[RunResult]]:
    """The load (req/s) at which ``config``'s attainment falls to the target, and every run made to find it (None:
    it misses the target even at the lightest load tried, or meets it at the heaviest)."""
    runs: list[RunResult] = []

    def at(scale: float) -> RunResult:
        result = run_at(replace(config, time_scale=scale))
        runs.append(result)
        return result

    scale = config.time_scale
    first = at(scale)
    ok = _attains(first, search.target)
    # The bracket: `meets`, the smallest time scale (heaviest load) seen to meet the target; `misses`, the largest
    # (lightest load) seen to miss it. A smaller scale is a heavier load, so misses < meets once both are known.
    meets: float | None = scale if ok else None
    misses: float | None = None if ok else scale
    while (meets is None or misses is None) and len(runs) < search.max_runs:
        scale = scale / 2 if ok else scale * 2
        if _attains(at(scale), search.target):
            meets = scale
        else:
            misses = scale
    if meets is not None and misses is not None:
        while len(runs) < search.max_runs and meets / misses > 1 + search.tolerance:
            mid = math.sqrt(meets * misses)
            if _attains(at(mid), search.target):
                meets = mid
            else:
                misses = mid
    points = [(r.offered_rps, r.summary["slo_attainment"]) for r in runs]
    if meets is None or misses is None:
        return None, runs
    return slo_capacity(points, search.target), runs


@dataclass(frozen=True, slots=True)
class KnownKnee:
    """A baseline's knee found beforehand with the same search (e.g. while tuning it): its config as found, what
    :func:`find_knee` returned and the runs it made."""

    config: BenchConfig
    knee_rps: float | None
    runs: Sequence[RunResult]


@dataclass(slots=True)
class KneeResult:
    """What ``--sweep knee`` found and ran."""

    search: KneeSearch
    knee_rps: float | None
    """The best baseline's sustained load; None when no baseline's knee was found."""
    baseline: str
    """``batch/dispatch`` of the best baseline ("" when none)."""
    baseline_knees: dict[str, float | None]
    search_runs: list[RunResult]
    band_runs: list[RunResult]

    def per_policy(self) -> list[dict[str, Any]]:
        """Per compared policy pair over the band: its sustained load, ratio to the knee, peak effective RPS and its
        ratio to the best baseline's."""
        groups: dict[str, list[RunResult]] = {}
        for r in self.band_runs:
            groups.setdefault(f"{r.config.batch_policy}/{r.config.dispatch}", []).append(r)

        def peak_effective(runs: Sequence[RunResult]) -> float:
            return max(float(r.offered_rps * r.summary["slo_attainment"]) for r in runs)

        base = peak_effective(groups[self.baseline]) if self.baseline in groups else None
        out = []
        for name, runs in groups.items():
            points = [(r.offered_rps, r.summary["slo_attainment"]) for r in runs]
            sustained = slo_capacity(points, self.search.target)
            eff = peak_effective(runs)
            out.append({
                "policy": name, "sustained_rps": sustained,
                "knee_ratio": None if sustained is None or not self.knee_rps else sustained / self.knee_rps,
                "sustained_at_band_top": all(y >= self.search.target for _, y in points),
                "peak_effective_rps": eff,
                "effective_ratio": eff / base if base else None,
            })
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "target": self.search.target, "knee_rps": self.knee_rps, "baseline": self.baseline,
            "baseline_knees": self.baseline_knees,
            "band_rps": self.search.band(self.knee_rps) if self.knee_rps else [],
            "policies": self.per_policy(),
            "search": [{"policy": f"{r.config.batch_policy}/{r.config.dispatch}", "time_scale": r.config.time_scale,
                        "offered_rps": r.offered_rps, "slo_attainment": r.summary["slo_attainment"]}
                       for r in self.search_runs],
        }


def knee_sweep(configs: Sequence[BenchConfig], run_at: RunAt, search: KneeSearch,
               rps_at_scale_1: float, known: Mapping[str, KnownKnee] | None = None) -> KneeResult:
    """Find the best baseline's knee among ``configs``' dispatches, then run every config over the band.

    ``configs`` are the compared policy pairs (time scale 1); the baselines are :data:`BASELINES` under each of
    their dispatches (run for the search even when not compared). ``rps_at_scale_1`` is the workload's offered load
    at time scale 1. ``known``: baselines (by ``batch/dispatch``) whose knee was found beforehand with ``search``;
    their runs count as search runs and their config is the one run in the band when not compared."""
    if rps_at_scale_1 <= 0:
        raise ValueError("the workload's offered load is 0 (fewer than two distinct arrival times)")
    known = known or {}
    base = configs[0]
    dispatches = list(dict.fromkeys(c.dispatch for c in configs))
    knees: dict[str, float | None] = {}
    baseline_configs: dict[str, BenchConfig] = {}
    search_runs: list[RunResult] = []
    for dispatch in dispatches:
        for batch in BASELINES:
            key = f"{batch}/{dispatch}"
            if key in known:
                config, knee, runs = known[key].config, known[key].knee_rps, list(known[key].runs)
            else:
                config = replace(base, batch_policy=batch, dispatch=dispatch, time_scale=1.0)
                knee, runs = find_knee(config, run_at, search)
            knees[key] = knee
            baseline_configs[key] = config
            search_runs += runs
    found = {k: v for k, v in knees.items() if v is not None}
    if not found:
        return KneeResult(search, None, "", knees, search_runs, [])
    baseline = max(found, key=lambda k: found[k])
    knee_rps = found[baseline]
    wanted = list(configs)
    b_batch, b_dispatch = baseline.split("/", 1)
    if not any(c.batch_policy == b_batch and c.dispatch == b_dispatch for c in wanted):
        wanted.insert(0, replace(baseline_configs[baseline], time_scale=1.0))
    band_runs = [run_at(replace(c, time_scale=rps_at_scale_1 / load))
                 for load in search.band(knee_rps) for c in wanted]
    return KneeResult(search, knee_rps, baseline, knees, search_runs, band_runs)
