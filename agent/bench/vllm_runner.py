"""Replay a workload through live vLLM units with a trackside dispatcher, in real time.

Requests arrive at their workload times (from the run's start), wait at the dispatcher, and go to the unit it
picks (:class:`~agent.runtime.live.cluster.LiveCluster`: the dispatcher is asked on every arrival, at its
``next_check_s``, and, when it ``wants_step_reports``, after every step record while requests are pending, as in
the simulated node). The result holds every request's outcome and every unit's step records, for the validation
and for ``trackside bench``-style reports. A unit keeps a bounded history (``VllmUnit(history=...)``): a run longer
than that keeps only its last records and outcomes, with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.vllm.messages import StepMessage
from agent.engine.vllm.unit import VllmUnit
from agent.runtime.live.cluster import LiveCluster
from agent.runtime.live.requests import ClusterRequest, RequestRejected, RequestStream
from agent.telemetry import DEFAULT_TPOT_METRIC, TpotMetric
from agent.workload.prompts import prompt_ids
from agent.workload.types import RequestSpec
from policies.base import DispatchPolicy

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    wall_s: float
    outcomes: list[RequestOutcome]
    rejected: list[str]
    records: dict[int, list[StepRecord]] = field(default_factory=dict)
    raw: dict[int, list[StepMessage]] = field(default_factory=dict)
    """Each unit's step messages (the records' fields and the scheduler's extras: plan time, PAB...)."""
    num_migrations: int = 0
    """Requests moved between units by recompute (for dispatchers that migrate: ``LiveCluster``)."""

    def summary(self, tpot_metric: TpotMetric = DEFAULT_TPOT_METRIC) -> dict[str, Any]:
        """Throughput, TTFT, the mean and the worst per-token TPOT, and SLO attainment with ``tpot_metric``'s TPOT."""
        out_tokens = sum(o.output_tokens for o in self.outcomes)
        in_tokens = sum(o.prompt_tokens for o in self.outcomes)
        ttft = sorted(o.ttft_s for o in self.outcomes)
        tpot = sorted(t for o in self.outcomes if (t := o.tpot_s) is not None)
        worst = sorted(t for o in self.outcomes if (t := o.tpot_by("worst")) is not None)
        met = sum(o.meets_slo(tpot_metric) for o in self.outcomes)
        n = len(self.outcomes) + len(self.rejected)
        return {
            "requests": len(self.outcomes), "rejected": len(self.rejected), "wall_s": round(self.wall_s, 3),
            "output_tokens": out_tokens, "output_tok_s": round(out_tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "total_tok_s": round((in_tokens + out_tokens) / self.wall_s, 1) if self.wall_s else 0.0,
            "ttft_mean_s": _mean(ttft), "ttft_p50_s": _q(ttft, 0.5), "ttft_p99_s": _q(ttft, 0.99),
            "tpot_mean_s": _mean(tpot), "tpot_p50_s": _q(tpot, 0.5), "tpot_p99_s": _q(tpot, 0.99),
            "max_tpot_mean_s": _mean(worst), "max_tpot_p50_s": _q(worst, 0.5), "max_tpot_p99_s": _q(worst, 0.99),
            "tpot_metric": tpot_metric, "slo_attainment": round(met / n, 4) if n else 0.0,
            "goodput_req_s": round(met / self.wall_s, 3) if self.wall_s else 0.0,
            "steps": {u: len(r) for u, r in self.records.items()},
        }


def _mean(xs: Sequence[float]) -> float | None:
    return round(sum(xs) / len(xs), 5) if xs else None


def _q(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))], 5)


async def run_workload(units: Sequence[VllmUnit], dispatcher: DispatchPolicy, requests: Sequence[RequestSpec], *,
                       ttft_slo_s: float, tpot_slo_s: float, vocab: int = 32000, seed: int = 0,
                       progress: bool = False, refuses: Callable[[int, int], bool] | None = None) -> RunResult:
    """Replay ``requests`` (arrival times relative to now) through ``units``; returns when all are done.
    ``refuses``: admission control at dispatch (``LiveCluster.refuses``: FairBatching+PAB's budget)."""
    first_record = {u.unit_id: len(u.records) for u in units}
    first_outcome = {u.unit_id: len(u.outcomes) for u in units}
    streams: list[RequestStream] = []
    rejected: list[str] = []
    prompts = {r.request_id: prompt_ids(r, vocab, seed) for r in requests}
    t0 = time.time()
    cluster = LiveCluster(units, dispatcher, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s)
    cluster.refuses = refuses

    async def arrivals() -> None:
        for spec in sorted(requests, key=lambda r: r.arrival_s):
            delay = t0 + spec.arrival_s - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            streams.append(cluster.submit(ClusterRequest(
                spec.request_id, prompts[spec.request_id], spec.output_tokens,
                ttft_slo_s=spec.ttft_slo_ms / 1e3 if spec.ttft_slo_ms else None,
                tpot_slo_s=spec.tpot_slo_ms / 1e3 if spec.tpot_slo_ms else None,
                arrival_s=t0 + spec.arrival_s,
            ), collect=False))

    cluster.start()
    feeder = asyncio.get_running_loop().create_task(arrivals())
    last_report = time.time()
    try:
        while True:
            await asyncio.sleep(0.05)
            done = sum(s.done for s in streams)
            if progress and time.time() - last_report > 10:
                last_report = time.time()
                print(f"  {time.time() - t0:6.1f}s  done {done}/{len(requests)}  pending {len(cluster.pending)}",
                      flush=True)
            if feeder.done() and feeder.exception() is not None:
                raise feeder.exception()  # type: ignore[misc]
            if feeder.done() and done >= len(requests):
                break
        for s in streams:
            try:
                await s.wait()
            except RequestRejected:
                rejected.append(s.request_id)
    finally:
        feeder.cancel()
        await cluster.close()
    for u in units:
        if not (u.records.kept_since(first_record[u.unit_id]) and u.outcomes.kept_since(first_outcome[u.unit_id])):
            log.warning("unit %d kept only the last %d records and outcomes of this run (VllmUnit(history=...))",
                        u.unit_id, u.records.maxlen)
    finished = [s.outcome for s in streams if s.outcome is not None]
    wall = max(o.finish_s for o in finished) - t0 if finished else time.time() - t0
    return RunResult(
        wall_s=wall,
        outcomes=[o for u in units for o in u.outcomes[first_outcome[u.unit_id]:]],
        rejected=rejected,
        records={u.unit_id: u.records[first_record[u.unit_id]:] for u in units},
        raw={u.unit_id: u.raw[first_record[u.unit_id]:] for u in units},
        num_migrations=cluster.num_migrations,
    )


def tasks_results(tasks: Sequence[asyncio.Task[RequestOutcome]]) -> list[RequestOutcome]:
    return [t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None]
