"""What-if: replay recorded traffic under other policies, measure how far the replay is from the record, rank.

The input is a recorded window turned into a workload (:class:`Recorded`: the arrivals to replay and the outcomes
the node really gave them, on one time base) and the node's shape (a :class:`BenchConfig`). The first run replays
the policy that ran: its distance to the record is the **fidelity** (:func:`fidelity`), what the simulator gets
wrong about this node and this window. Every candidate is then ranked against that replay, not against the record,
so the model's error cancels in the comparison; a candidate is **recommended** only when it beats the replay by
more than the fidelity error (:func:`recommend`), else the answer is to keep the running policy.

Ranking is by ``effective_rps`` (offered load x SLO attainment, seed 003's measure; every run of one window has the
same offered load, so it ranks as attainment), then ``goodput_rps``, then the lower TTFT p99. Runs are independent
and go to worker processes with ``jobs`` > 1 (:func:`run_all`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any, Final

from agent.bench.report import offered_rps, summarize
from agent.bench.runner import BenchConfig, RunResult, run_once
from agent.engine.base import RequestOutcome
from agent.workload.types import RequestSpec

FIDELITY_KEYS: Final = (
    "goodput_rel_err", "slo_attainment_abs_err", "ttft_p50_rel_err", "ttft_p99_rel_err", "tpot_p50_rel_err",
    "tpot_p99_rel_err",
)
MIN_GAIN: Final = 0.02
"""The least gain over the replayed running policy worth a swap, however good the fidelity (2%)."""
POOR_FIDELITY: Final = 0.10
"""A replay further than this from the record (goodput or SLO attainment) is flagged as untrustworthy."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """A recorded window as a workload: what to replay and what the node did with it (one time base, seconds from
    the window's start)."""

    requests: tuple[RequestSpec, ...]
    """Every finished or refused request, in arrival order (refused ones with ``output_tokens`` estimated)."""
    outcomes: tuple[RequestOutcome, ...]
    """The finished requests' recorded outcomes."""
    num_refused: int


@dataclass(frozen=True, slots=True)
class Candidate:
    batch_policy: str
    dispatch: str
    params: Mapping[str, str]

    @property
    def label(self) -> str:
        return f"{self.batch_policy} + {self.dispatch}"


def recorded_summary(recorded: Recorded, config: BenchConfig) -> dict[str, Any]:
    """The record's summary, computed exactly as a run's (``agent.bench.report.summarize``)."""
    duration = max((o.finish_s for o in recorded.outcomes), default=0.0)
    return summarize(
        recorded.outcomes, num_requests=len(recorded.requests), num_rejected=recorded.num_refused,
        duration_s=duration, offered_rps=offered_rps([r.arrival_s for r in recorded.requests]),
        tpot_metric=config.tpot_metric,
    )


def _rel(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return new / old - 1.0


def _pct(summary: Mapping[str, Any], metric: str, q: str) -> float | None:
    value = summary[metric][q]
    return None if value is None else float(value)


def delta(summary: Mapping[str, Any], recorded: Mapping[str, Any]) -> dict[str, float | None]:
    """A run's differences to the record: relative for rates and latencies, absolute for SLO attainment."""
    return {
        "effective_rps_rel": _rel(summary["effective_rps"], recorded["effective_rps"]),
        "slo_attainment_abs": float(summary["slo_attainment"] - recorded["slo_attainment"]),
        "ttft_p99_rel": _rel(_pct(summary, "ttft_ms", "p99"), _pct(recorded, "ttft_ms", "p99")),
        "tpot_p99_rel": _rel(_pct(summary, "tpot_ms", "p99"), _pct(recorded, "tpot_ms", "p99")),
    }


def fidelity(replay: Mapping[str, Any], recorded: Mapping[str, Any]) -> dict[str, float | None]:
    """How far the replay of the running policy is from the record (:data:`FIDELITY_KEYS`; None: undefined, e.g. no
    request met its SLO in the record)."""

    def err(new: float | None, old: float | None) -> float | None:
        rel = _rel(new, old)
        return None if rel is None else abs(rel)

    return {
        "goodput_rel_err": err(replay["goodput_rps"], recorded["goodput_rps"]),
        "slo_attainment_abs_err": abs(float(replay["slo_attainment"] - recorded["slo_attainment"])),
        "ttft_p50_rel_err": err(_pct(replay, "ttft_ms", "p50"), _pct(recorded, "ttft_ms", "p50")),
        "ttft_p99_rel_err": err(_pct(replay, "ttft_ms", "p99"), _pct(recorded, "ttft_ms", "p99")),
        "tpot_p50_rel_err": err(_pct(replay, "tpot_ms", "p50"), _pct(recorded, "tpot_ms", "p50")),
        "tpot_p99_rel_err": err(_pct(replay, "tpot_ms", "p99"), _pct(recorded, "tpot_ms", "p99")),
    }


def score(summary: Mapping[str, Any]) -> tuple[float, float, float]:
    """The ranking key (higher is better): effective RPS, goodput, then the lower TTFT p99."""
    p99 = _pct(summary, "ttft_ms", "p99")
    return (float(summary["effective_rps"] or 0.0), float(summary["goodput_rps"]), -(p99 if p99 is not None else 1e18))


def ranks(summaries: Sequence[Mapping[str, Any]]) -> list[int]:
    """1-based rank of each summary by :func:`score` (ties share the better rank)."""
    keys = [score(s) for s in summaries]
    return [1 + sum(1 for other in keys if other > key) for key in keys]


def trust_margin(fid: Mapping[str, float | None], min_gain: float = MIN_GAIN) -> float:
    """The gain a candidate must beat: the replay's error on what ranking reads (goodput, SLO attainment), at least
    ``min_gain``."""
    errors = [fid.get("goodput_rel_err"), fid.get("slo_attainment_abs_err")]
    return max([min_gain, *(e for e in errors if e is not None)])


def recommend(
    replay: RunResult, candidates: Sequence[RunResult], fid: Mapping[str, float | None], *, min_gain: float = MIN_GAIN
) -> dict[str, Any]:
    """``switch`` to the best candidate when it beats the replayed running policy by more than
    :func:`trust_margin`, else ``keep``; ``expected_gain`` is the best candidate's effective-RPS gain over the
    replay (a fraction; None when the replay served nothing within its SLO)."""
    running = replay.config
    keep = {"action": "keep", "batch_policy": running.batch_policy, "dispatch": running.dispatch,
            "params": {**replay.batch_params, **replay.dispatch_params}}
    others = [c for c in candidates if (c.config.batch_policy, c.config.dispatch) != (running.batch_policy,
                                                                                      running.dispatch)]
    if not others:
        return {**keep, "expected_gain": None, "reason": "no candidate other than the running policy"}
    best = max(others, key=lambda r: score(r.summary))
    base = float(replay.summary["effective_rps"] or 0.0)
    gain = None if base <= 0 else float(best.summary["effective_rps"] or 0.0) / base - 1.0
    margin = trust_margin(fid, min_gain)
    poor = [k for k in ("goodput_rel_err", "slo_attainment_abs_err") if (fid.get(k) or 0.0) > POOR_FIDELITY]
    caveat = f"; fidelity is poor ({', '.join(poor)} > {POOR_FIDELITY:.0%})" if poor else ""
    name = f"{best.config.batch_policy} + {best.config.dispatch}"
    if gain is None:
        if float(best.summary["effective_rps"] or 0.0) > 0:
            return {"action": "switch", "batch_policy": best.config.batch_policy, "dispatch": best.config.dispatch,
                    "params": {**best.batch_params, **best.dispatch_params}, "expected_gain": None,
                    "reason": f"the running policy met no SLO in the replay; {name} met some{caveat}"}
        return {**keep, "expected_gain": None, "reason": f"no policy met any SLO on this window{caveat}"}
    if gain <= margin:
        return {**keep, "expected_gain": gain,
                "reason": f"the best candidate, {name}, gains {gain:+.1%} effective RPS, "
                f"within the replay's error ({margin:.1%}){caveat}"}
    return {"action": "switch", "batch_policy": best.config.batch_policy, "dispatch": best.config.dispatch,
            "params": {**best.batch_params, **best.dispatch_params}, "expected_gain": gain,
            "reason": f"{name} gains {gain:+.1%} effective RPS over the replayed running policy, more than the "
            f"replay's error ({margin:.1%}){caveat}"}


def _run(config: BenchConfig, requests: Sequence[RequestSpec]) -> RunResult:
    return run_once(config, requests)


def run_all(
    configs: Sequence[BenchConfig],
    requests: Sequence[RequestSpec],
    *,
    jobs: int | None = None,
    progress: Callable[[int, int, BenchConfig], None] | None = None,
    executor: Executor | None = None,
) -> list[RunResult]:
    """One :func:`run_once` per config over the same requests, in ``jobs`` worker processes (default: one per CPU,
    at most one per config; 1: in this process), or in ``executor``'s workers when given (a pool kept across calls:
    the recorder's advisor; ``jobs`` is then ignored). Results in ``configs`` order; ``progress(done, total,
    config)`` after each run."""
    total = len(configs)
    workers = max(1, min(jobs or os.cpu_count() or 1, total))
    results: list[RunResult | None] = [None] * total
    if workers == 1 and executor is None:
        for i, config in enumerate(configs):
            results[i] = run_once(config, requests)
            if progress is not None:
                progress(i + 1, total, config)
    else:
        pool = executor or ProcessPoolExecutor(max_workers=workers)
        try:
            futures = {pool.submit(_run, config, tuple(requests)): i for i, config in enumerate(configs)}
            for done, future in enumerate(as_completed(futures), start=1):
                i = futures[future]
                results[i] = future.result()
                if progress is not None:
                    progress(done, total, configs[i])
        finally:
            if executor is None:
                pool.shutdown()
    return [r for r in results if r is not None]


def candidate_configs(base: BenchConfig, candidates: Sequence[Candidate]) -> list[BenchConfig]:
    """``base`` (the replay of the running policy) first, then one config per candidate."""
    return [base, *(replace(base, batch_policy=c.batch_policy, dispatch=c.dispatch, params=dict(c.params))
                    for c in candidates)]


def whatif_report(
    recorded: Recorded, results: Sequence[RunResult], *, min_gain: float = MIN_GAIN
) -> dict[str, Any]:
    """``recorded``, ``runs`` (bench's run entries plus ``label``, ``role``, ``rank`` and ``delta``), ``fidelity``
    and ``recommendation``: ``results[0]`` is the replay of the running policy, the rest are candidates."""
    replay, candidates = results[0], results[1:]
    rec = recorded_summary(recorded, replay.config)
    fid = fidelity(replay.summary, rec)
    order = ranks([r.summary for r in results])
    runs = []
    for i, result in enumerate(results):
        runs.append({
            **result.as_run(),
            "label": f"{result.config.batch_policy} + {result.config.dispatch}" + (" (running, replayed)" if i == 0
                                                                                     else ""),
            "role": "replay" if i == 0 else "candidate",
            "rank": order[i],
            "delta": delta(result.summary, rec),
        })
    return {"recorded": rec, "runs": runs, "fidelity": fid,
            "recommendation": recommend(replay, candidates, fid, min_gain=min_gain)}
