"""The regime map: which batch policy wins where, over load, SLO strictness and burstiness (issue #15, item 4).

A map is a grid of cells, one per (burstiness, SLO pair, load). In each cell every candidate batch policy replays
the same workload (:func:`agent.bench.runner.run_once`) and the policies are ranked by ``effective_rps`` (offered
load x SLO attainment, seed 003's effective RPS): the offered load is the same for every policy of a cell, so this
ranks by attainment. Ties go to the higher ``goodput_rps``, then the lower TTFT p99, then the policy listed first.
A cell records its winner, its runner-up, the margin (winner / runner-up - 1) and every policy's numbers.

* **Load** is set by scaling arrival times (``time_scale``: 2 halves the load), as ``trackside bench --sweep``; or
  as multiples of the best baseline's knee (:func:`knee_time_scales`, ``agent.bench.knee``).
* **SLO strictness** is a (TTFT, TPOT) target pair in milliseconds, as in seed 003's Table 5 (TTFT 500 to 2000 ms
  by TPOT 50 to 200 ms).
* **Burstiness** keeps the workload's order and lengths and re-times its arrivals with gamma-distributed gaps of
  coefficient of variation ``cv`` over the same span (so at the same mean rate), seeded (:func:`retime`); ``None``
  (written ``trace``) keeps the original arrivals.

Pure but for the worker processes of :func:`regime_map` (``jobs`` > 1). Deterministic for a seed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from agent.bench.knee import BASELINES, KneeSearch, find_knee
from agent.bench.report import offered_rps
from agent.bench.runner import BenchConfig, RunResult, run_once
from agent.plugins import load_plugins
from agent.workload.types import RequestSpec

RunFn = Callable[[BenchConfig, Sequence[RequestSpec]], RunResult]
"""How one config runs on a workload (:func:`run_once`; tests pass a stand-in)."""
Progress = Callable[[int, int], None]
"""``progress(done, total)``: called after each finished run."""
Burstiness = float | None
"""A gap coefficient of variation, or None for the workload's own arrivals (``trace``)."""

_T = TypeVar("_T")

DEFAULT_SLOS = "500/50,1000/50,2000/50,2000/100"
DEFAULT_BURSTINESS = "trace,1,4"


class RegimeError(ValueError):
    """A grid or workload that cannot be mapped (one line, for the user as is)."""


@dataclass(frozen=True, slots=True)
class SloPair:
    """A TTFT and a TPOT target, in milliseconds."""

    ttft_ms: float
    tpot_ms: float

    @property
    def label(self) -> str:
        return f"{self.ttft_ms:g}/{self.tpot_ms:g}"


def parse_slos(text: str) -> tuple[SloPair, ...]:
    """``"500/50,2000/100"``: TTFT/TPOT pairs in ms, each > 0, no pair twice."""
    pairs = []
    for item in (x.strip() for x in text.split(",")):
        ttft, _, tpot = item.partition("/")
        try:
            pair = SloPair(float(ttft), float(tpot))
        except ValueError:
            pair = None
        if pair is None or not all(math.isfinite(v) and v > 0 for v in (pair.ttft_ms, pair.tpot_ms)):
            raise RegimeError(f"an SLO pair is TTFT_MS/TPOT_MS with both > 0, e.g. 500/50 (got {item!r})")
        pairs.append(pair)
    return _distinct(pairs, "SLO pair")


def parse_burstiness(text: str) -> tuple[Burstiness, ...]:
    """``"trace,1,4"``: ``trace`` (the original arrivals) or a gap CV >= 0 (0: evenly spaced; 1: Poisson-like)."""
    values: list[Burstiness] = []
    for item in (x.strip() for x in text.split(",")):
        if item == "trace":
            values.append(None)
            continue
        try:
            cv = float(item)
        except ValueError:
            cv = -1.0
        if not (math.isfinite(cv) and cv >= 0):
            raise RegimeError(f"burstiness is 'trace' or a gap coefficient of variation >= 0 (got {item!r})")
        values.append(cv)
    return _distinct(values, "burstiness value")


def parse_positive(text: str, what: str) -> tuple[float, ...]:
    """``"1,0.5,0.3"``: numbers > 0, none twice."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise RegimeError(f"{what}: comma-separated numbers > 0 (got {text!r})") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise RegimeError(f"{what}: comma-separated numbers > 0 (got {text!r})")
    return _distinct(values, what)


def _distinct(values: Sequence[_T], what: str) -> tuple[_T, ...]:
    if len(set(values)) != len(values):
        raise RegimeError(f"a {what} is given twice")
    return tuple(values)


def burstiness_label(b: Burstiness) -> str:
    return "trace" if b is None else f"{b:g}"


def retime(requests: Sequence[RequestSpec], cv: Burstiness, seed: int) -> list[RequestSpec]:
    """The same requests (order, ids, lengths) with gamma-distributed gaps of coefficient of variation ``cv``.

    The gaps are scaled to span the original first to last arrival, so the mean rate (and ``offered_rps``) is the
    original's exactly; scaling leaves their CV as drawn. ``cv`` 0 spaces them evenly; None returns the requests."""
    if cv is None or len(requests) < 2:
        return list(requests)
    first, last = min(r.arrival_s for r in requests), max(r.arrival_s for r in requests)
    n = len(requests) - 1
    if cv == 0:
        gaps = np.ones(n)
    else:
        shape = 1.0 / (cv * cv)
        gaps = np.random.default_rng(seed).gamma(shape, 1.0, n)
    times = np.concatenate(([0.0], np.cumsum(gaps)))
    times = first + (last - first) * times / times[-1] if times[-1] > 0 else np.full(n + 1, first)
    return [replace(r, arrival_s=float(t)) for r, t in zip(requests, times, strict=True)]


@dataclass(frozen=True, slots=True)
class Score:
    """One policy's numbers in one cell."""

    policy: str
    effective_rps: float
    slo_attainment: float
    goodput_rps: float
    ttft_p99_ms: float | None

    @classmethod
    def of(cls, result: RunResult) -> Score:
        s = result.summary
        eff = s.get("effective_rps")
        return cls(result.config.batch_policy, float(eff if eff is not None else 0.0), float(s["slo_attainment"]),
                   float(s.get("goodput_rps", 0.0)), s.get("ttft_ms", {}).get("p99"))

    def as_json(self) -> dict[str, Any]:
        return {"effective_rps": self.effective_rps, "slo_attainment": self.slo_attainment,
                "goodput_rps": self.goodput_rps, "ttft_p99_ms": self.ttft_p99_ms}


def rank(scores: Iterable[Score], order: Sequence[str]) -> list[Score]:
    """Best first: effective RPS, then goodput, then the lower TTFT p99 (none: last), then ``order``."""
    position = {p: k for k, p in enumerate(order)}

    def key(s: Score) -> tuple[float, float, float, int]:
        p99 = s.ttft_p99_ms if s.ttft_p99_ms is not None else math.inf
        return (-s.effective_rps, -s.goodput_rps, p99, position.get(s.policy, len(position)))

    return sorted(scores, key=key)


def margin(winner: float, runner_up: float) -> float:
    """``winner / runner_up - 1`` (0 when both are 0; infinite when only the runner-up is)."""
    if runner_up > 0:
        return winner / runner_up - 1.0
    return 0.0 if winner <= 0 else math.inf


@dataclass(frozen=True, slots=True)
class Cell:
    """One point of the grid, its policies ranked best first."""

    burstiness: Burstiness
    slo: SloPair
    time_scale: float
    offered_rps: float
    ranked: tuple[Score, ...]

    @property
    def winner(self) -> str:
        return self.ranked[0].policy

    @property
    def runner_up(self) -> str | None:
        return self.ranked[1].policy if len(self.ranked) > 1 else None

    @property
    def margin(self) -> float | None:
        """Winner's effective RPS over the runner-up's, minus 1 (None with one policy)."""
        return margin(self.ranked[0].effective_rps, self.ranked[1].effective_rps) if len(self.ranked) > 1 else None

    @property
    def tied(self) -> tuple[str, ...]:
        """Every policy with the winner's effective RPS (the winner alone when it wins outright)."""
        return tuple(s.policy for s in self.ranked if s.effective_rps == self.ranked[0].effective_rps)

    def as_json(self) -> dict[str, Any]:
        m = self.margin
        return {
            "burstiness": "trace" if self.burstiness is None else self.burstiness, "slo": self.slo.label,
            "ttft_ms": self.slo.ttft_ms, "tpot_ms": self.slo.tpot_ms, "time_scale": self.time_scale,
            "offered_rps": self.offered_rps, "winner": self.winner, "runner_up": self.runner_up,
            "margin": None if m is None or math.isinf(m) else m, "tied": list(self.tied),
            "policies": {s.policy: s.as_json() for s in self.ranked},
        }


@dataclass(frozen=True, slots=True)
class RegimeGrid:
    """What a map runs: the axes and the candidate batch policies (every other setting from ``base``)."""

    time_scales: tuple[float, ...]
    slos: tuple[SloPair, ...]
    burstiness: tuple[Burstiness, ...]
    policies: tuple[str, ...]

    def __post_init__(self) -> None:
        if not (self.time_scales and self.slos and self.burstiness and self.policies):
            raise RegimeError("the grid needs at least one load, SLO pair, burstiness value and policy")
        if len(set(self.policies)) != len(self.policies):
            raise RegimeError("a policy is named twice")

    @property
    def num_runs(self) -> int:
        return len(self.time_scales) * len(self.slos) * len(self.burstiness) * len(self.policies)


@dataclass(frozen=True, slots=True)
class RegimeMap:
    """A computed map: the grid, its cells (burstiness, then SLO, then load, in the grid's order), what it ran."""

    grid: RegimeGrid
    base: BenchConfig
    workload: str
    num_requests: int
    cells: tuple[Cell, ...]
    knee: dict[str, Any] | None = None
    """How the loads were chosen when they are multiples of the knee (:func:`knee_time_scales`)."""

    def cell(self, burstiness: Burstiness, slo: SloPair, time_scale: float) -> Cell:
        for c in self.cells:
            if c.burstiness == burstiness and c.slo == slo and c.time_scale == time_scale:
                return c
        raise KeyError((burstiness, slo, time_scale))

    def offered_rps(self, time_scale: float) -> float:
        return next(c.offered_rps for c in self.cells if c.time_scale == time_scale)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RegimeMap:
        """The map :meth:`as_json` wrote (to draw it again, or to read it as advice)."""
        grid = RegimeGrid(tuple(doc["time_scales"]), parse_slos(",".join(doc["slos"])),
                          tuple(None if b == "trace" else float(b) for b in doc["burstiness"]), tuple(doc["policies"]))
        base = BenchConfig(profile=doc["profile"], units=doc["units"], dispatch=doc["dispatch"], seed=doc["seed"],
                           tpot_metric=doc["tpot_metric"], params=doc["params"])
        cells = tuple(
            Cell(None if c["burstiness"] == "trace" else float(c["burstiness"]), SloPair(c["ttft_ms"], c["tpot_ms"]),
                 c["time_scale"], c["offered_rps"], tuple(Score(p, **v) for p, v in c["policies"].items()))
            for c in doc["cells"]
        )
        return cls(grid, base, doc["workload"], doc["requests"], cells, doc.get("knee"))

    def as_json(self) -> dict[str, Any]:
        b = self.base
        return {
            "workload": self.workload, "requests": self.num_requests, "profile": b.profile, "units": b.units,
            "dispatch": b.dispatch, "seed": b.seed, "tpot_metric": b.tpot_metric, "params": dict(b.params),
            "policies": list(self.grid.policies), "time_scales": list(self.grid.time_scales),
            "offered_rps": [self.offered_rps(t) for t in self.grid.time_scales],
            "slos": [s.label for s in self.grid.slos],
            "burstiness": ["trace" if x is None else x for x in self.grid.burstiness],
            "rank_by": "effective_rps", "knee": self.knee, "cells": [c.as_json() for c in self.cells],
        }


# -- running ---------------------------------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}
"""A worker process's workloads (one per burstiness value) and run function, set once by :func:`_init_worker`."""


def _init_worker(workloads: list[list[RequestSpec]], run: RunFn) -> None:
    _WORKER["workloads"], _WORKER["run"] = workloads, run


def _init_pool_worker(workloads: list[list[RequestSpec]], run: RunFn) -> None:
    """A worker process: the installed policy plugins registered (a forked worker has them already; one started
    afresh, as with the ``spawn`` or ``forkserver`` start methods, does not), then :func:`_init_worker`."""
    load_plugins()
    _init_worker(workloads, run)


def _score_task(index: int, config: BenchConfig) -> Score:
    return Score.of(_WORKER["run"](config, _WORKER["workloads"][index]))


def _knee_task(index: int, config: BenchConfig, search: KneeSearch) -> float | None:
    workload, run = _WORKER["workloads"][index], _WORKER["run"]
    return find_knee(config, lambda c: run(c, workload), search)[0]


def _execute(tasks: list[tuple[Callable[..., Any], tuple[Any, ...]]], workloads: list[list[RequestSpec]], run: RunFn,
             jobs: int | None, progress: Progress | None) -> list[Any]:
    """Each task's result, in task order: in this process with one job, else in ``jobs`` worker processes."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    results: list[Any] = [None] * len(tasks)
    if jobs == 1:
        saved = dict(_WORKER)
        _init_worker(workloads, run)
        try:
            for k, (fn, args) in enumerate(tasks):
                results[k] = fn(*args)
                if progress is not None:
                    progress(k + 1, len(tasks))
        finally:
            _WORKER.clear()
            _WORKER.update(saved)
        return results
    with ProcessPoolExecutor(jobs, initializer=_init_pool_worker, initargs=(workloads, run)) as pool:
        futures: dict[Future[Any], int] = {pool.submit(fn, *args): k for k, (fn, args) in enumerate(tasks)}
        try:
            for done, fut in enumerate(as_completed(futures), 1):
                results[futures[fut]] = fut.result()
                if progress is not None:
                    progress(done, len(tasks))
        except BaseException:  # a run failed or the user interrupted: drop the runs not started
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return results


def regime_map(
    requests: Sequence[RequestSpec], base: BenchConfig, grid: RegimeGrid, *, workload: str = "", seed: int = 0,
    jobs: int | None = None, progress: Progress | None = None, run: RunFn = run_once,
    knee: dict[str, Any] | None = None,
) -> RegimeMap:
    """Run every policy of ``grid`` in every cell and rank them. ``base`` gives everything else (profile, units,
    dispatch, parameters, TPOT metric, seed); ``seed`` draws the re-timed arrivals (the same for every load, SLO and
    policy). ``jobs``: worker processes (default: one per CPU); ``run`` must then be a module-level function."""
    if len(requests) < 2:
        raise RegimeError("the workload needs at least two requests")
    workloads = [retime(requests, b, seed) for b in grid.burstiness]
    rps_at_1 = offered_rps([r.arrival_s for r in requests])
    keys = [(bi, slo, ts) for bi in range(len(grid.burstiness)) for slo in grid.slos for ts in grid.time_scales]
    tasks: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
        (_score_task, (bi, replace(base, batch_policy=p, ttft_slo_ms=slo.ttft_ms, tpot_slo_ms=slo.tpot_ms,
                                   time_scale=ts)))
        for bi, slo, ts in keys for p in grid.policies
    ]
    scores: list[Score] = _execute(tasks, workloads, run, jobs, progress)
    n = len(grid.policies)
    cells = tuple(
        Cell(grid.burstiness[bi], slo, ts, rps_at_1 / ts, tuple(rank(scores[k * n:(k + 1) * n], grid.policies)))
        for k, (bi, slo, ts) in enumerate(keys)
    )
    return RegimeMap(grid, base, workload, len(requests), cells, knee)


def knee_time_scales(
    requests: Sequence[RequestSpec], base: BenchConfig, multiples: Sequence[float], *, search: KneeSearch | None = None,
    jobs: int | None = None, run: RunFn = run_once,
) -> tuple[tuple[float, ...], dict[str, Any]]:
    """Time scales that put the load at ``multiples`` of the best baseline's knee (vLLM's default or Sarathi, at
    ``base``'s SLO and the workload's own arrivals; :func:`agent.bench.knee.find_knee`), and what was found."""
    search = search or KneeSearch()
    rps_at_1 = offered_rps([r.arrival_s for r in requests])
    if rps_at_1 <= 0:
        raise RegimeError("the workload's offered load is 0 (fewer than two distinct arrival times)")
    tasks: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
        (_knee_task, (0, replace(base, batch_policy=b, time_scale=1.0), search)) for b in BASELINES
    ]
    knees: list[float | None] = _execute(tasks, [list(requests)], run, jobs, None)
    found = {b: k for b, k in zip(BASELINES, knees, strict=True) if k is not None}
    if not found:
        raise RegimeError(f"no baseline's knee at SLO {base.ttft_slo_ms:g}/{base.tpot_slo_ms:g} ms was found: give "
                          "time scales instead")
    baseline = max(found, key=lambda b: found[b])
    knee_rps = found[baseline]
    info = {"baseline": baseline, "knee_rps": knee_rps, "target": search.target, "multiples": list(multiples),
            "slo": f"{base.ttft_slo_ms:g}/{base.tpot_slo_ms:g}", "baseline_knees": dict(zip(BASELINES, knees,
                                                                                             strict=True))}
    return tuple(rps_at_1 / (m * knee_rps) for m in multiples), info
