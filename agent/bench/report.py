"""Run summaries: latency percentiles, goodput, SLO attainment and per-unit load, as plain dicts.

Definitions (the same everywhere the project reports them):

* TTFT = first token time - arrival. TPOT is per request, one of two (:data:`agent.telemetry.TpotMetric`, picked
  by ``tpot_metric``; ``trackside bench --tpot-metric``): ``worst``, the worst per-token TPOT of seed 003 (the
  largest ``(time of token j - time of token 1) / (j - 1)`` over the request's tokens), or ``mean``, ``(last token
  time - first token time) / (output tokens - 1)``. Both are undefined for a single output token (such a request
  meets the TPOT SLO trivially). ``tpot_ms`` reports the chosen one.
* A request meets its SLO when both its TTFT and its (chosen) TPOT are within its targets; rejected and unfinished
  requests do not.
* ``duration_s`` runs from time 0 (the workload's start) to the last request's completion.
* ``goodput_rps`` = requests that met their SLO per second of the run; ``slo_attainment`` = the fraction of
  all requests (rejected included) that met it.
* ``offered_rps`` = requests over the arrival span (:func:`offered_rps`); ``effective_rps`` = ``offered_rps x
  slo_attainment``, seed 003's effective RPS (5.1). Unlike ``goodput_rps`` it has no drain tail in its denominator.
* ``normalized_latency_ms`` = (finish - arrival) / output tokens per request (seed 001's normalized latency, 6.2);
  ``input_tokens_per_s`` = completed requests' prompt tokens per second of the run (seed 002's prefill tokens/s).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.engine.base import RequestOutcome, StepRecord
from agent.telemetry import DEFAULT_TPOT_METRIC, TpotMetric
from policies.types import DispatchDecision

SUMMARY_KEYS = (
    "requests", "completed", "rejected", "duration_s", "throughput_rps", "output_tokens_per_s",
    "input_tokens_per_s", "goodput_rps", "offered_rps", "effective_rps", "slo_attainment", "ttft_ms", "tpot_ms",
    "normalized_latency_ms", "e2e_ms",
)


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """``mean``, ``p50``, ``p90``, ``p99`` in milliseconds (None for an empty sample)."""
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values_s, dtype=float) * 1e3
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(
    outcomes: Iterable[RequestOutcome], *, num_requests: int, num_rejected: int, duration_s: float,
    offered_rps: float | None = None, tpot_metric: TpotMetric = DEFAULT_TPOT_METRIC,
) -> dict[str, Any]:
    """The ``summary`` object of ``trackside bench``'s JSON (keys: :data:`SUMMARY_KEYS`); ``offered_rps`` None
    (not known) makes ``effective_rps`` None."""
    done = list(outcomes)
    ttft = [o.ttft_s for o in done]
    tpot = [t for t in (o.tpot_by(tpot_metric) for o in done) if t is not None]
    met = sum(1 for o in done if o.meets_slo(tpot_metric))
    out_tokens = sum(o.output_tokens for o in done)
    in_tokens = sum(o.prompt_tokens for o in done)
    normalized = [(o.finish_s - o.arrival_s) / o.output_tokens for o in done if o.output_tokens > 0]
    e2e = [o.finish_s - o.arrival_s for o in done]
    span = duration_s if duration_s > 0 else float("nan")
    attainment = met / num_requests if num_requests else 0.0
    return {
        "requests": num_requests,
        "completed": len(done),
        "rejected": num_rejected,
        "duration_s": duration_s,
        "throughput_rps": len(done) / span if done else 0.0,
        "output_tokens_per_s": out_tokens / span if done else 0.0,
        "input_tokens_per_s": in_tokens / span if done else 0.0,
        "goodput_rps": met / span if done else 0.0,
        "offered_rps": offered_rps,
        "effective_rps": None if offered_rps is None else offered_rps * attainment,
        "slo_attainment": attainment,
        "ttft_ms": latency_stats(ttft),
        "tpot_ms": latency_stats(tpot),
        "normalized_latency_ms": latency_stats(normalized),
        "e2e_ms": latency_stats(e2e),
    }


def offered_rps(arrivals_s: Sequence[float]) -> float:
    """Offered load: requests per second over the arrival span (0 for fewer than two distinct arrivals)."""
    if len(arrivals_s) < 2:
        return 0.0
    span = max(arrivals_s) - min(arrivals_s)
    return len(arrivals_s) / span if span > 0 else 0.0


def slo_capacity(points: Iterable[tuple[float, float]], target: float = 0.9) -> float | None:
    """The highest offered load at which SLO attainment still reaches ``target`` (DistServe's goodput).

    ``points`` are ``(offered_rps, slo_attainment)`` pairs of a load sweep. Walking up in load, the answer is
    the load where attainment first falls below ``target``, interpolated linearly between that point and the
    one before it; the highest load when it never falls below; None when even the lightest load misses.
    """
    pts = sorted(points)
    if not pts or pts[0][1] < target:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if y1 < target:
            return x0 + (x1 - x0) * (y0 - target) / (y0 - y1)
    return pts[-1][0]


@dataclass(slots=True)
class UnitStats:
    """Per-unit load, accumulated step by step (no step records are kept)."""

    unit_id: int
    steps: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    batch_sum: int = 0
    kv_weighted: float = 0.0
    kv_max: float = 0.0
    preemptions: int = 0
    completed: int = 0
    pred_abs_err: float = 0.0
    modes: dict[str, int] = field(default_factory=dict)

    def add(self, rec: StepRecord) -> None:
        # Once per unit-step: locals, no property or enum-value lookups (the same arithmetic).
        duration = rec.duration_s
        self.steps += 1
        self.busy_s += duration
        self.prefill_tokens += rec.num_prefill_tokens
        self.decode_tokens += rec.num_decode_tokens
        self.batch_sum += rec.num_prefill_reqs + rec.num_decode_reqs
        num_blocks = rec.num_blocks
        usage = rec.kv_used_blocks / num_blocks if num_blocks else 0.0  # StepRecord.kv_usage
        self.kv_weighted += usage * duration
        if usage > self.kv_max:
            self.kv_max = usage
        self.preemptions += rec.num_preempted
        self.completed += rec.num_finished
        if duration > 0:
            self.pred_abs_err += abs(rec.predicted_s - duration) / duration
        modes = self.modes
        key = rec.mode._value_  # StepMode's string (``.value`` goes through the enum's descriptor)
        modes[key] = modes.get(key, 0) + 1

    def as_dict(self, duration_s: float) -> dict[str, Any]:
        return {
            "unit_id": self.unit_id,
            "steps": self.steps,
            "busy_fraction": self.busy_s / duration_s if duration_s > 0 else 0.0,
            "mean_batch_size": self.batch_sum / self.steps if self.steps else 0.0,
            "mean_step_ms": 1e3 * self.busy_s / self.steps if self.steps else None,
            "kv_usage_mean": self.kv_weighted / self.busy_s if self.busy_s > 0 else 0.0,
            "kv_usage_max": self.kv_max,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "preemptions": self.preemptions,
            "completed": self.completed,
            "step_model_mape": self.pred_abs_err / self.steps if self.steps else None,
            "steps_by_mode": dict(sorted(self.modes.items())),
        }


class ClusterStats:
    """Balance across units over time, prefill chunk utilization, and what the dispatcher did.

    * Balance: after every step the unit's KV tokens and batch size (running requests) are its current
      values; the spread across units is their standard deviation (SBS paper, 5.2.2: the +-1 sigma band of KV
      load across DP units), averaged over time (each value weighted by how long it held).
    * Prefill chunk utilization: over steps that carry prefill work, tokens in the step over the chunk capacity
      (``max_num_batched_tokens``).
    * Pass chunk utilization, with lockstep ``groups`` (seed 000's metric, 5.2.1: "the percentage of theoretical
      token capacity utilized per forward pass" of a DP+EP instance): over the passes that carry prefill work,
      the tokens of every member over the group's size times the chunk. A member with nothing to do in the pass
      still takes part in it (a DP+EP pass runs every DP unit, idle ones on a dummy batch), so it counts as empty
      capacity, where the per-step figure above leaves it out.
    """

    def __init__(
        self, num_units: int, block_size: int, balanced: Iterable[int] | None = None,
        groups: Sequence[Sequence[int]] = (),
    ) -> None:
        self.block_size = block_size
        self._members = set(range(num_units) if balanced is None else balanced)
        """Units whose spread is measured (a disaggregated cluster: the decode pool, where KV lives)."""
        self._kv = [0.0] * num_units
        self._batch = [0.0] * num_units
        self._sums = [0.0, 0.0, 0.0, 0.0]  # sum kv, sum kv^2, sum batch, sum batch^2 over units
        self._n = max(len(self._members), 1)
        self._t_last: float | None = None
        self._area = [0.0, 0.0]
        self._t_first: float | None = None
        self.prefill_steps = 0
        self.prefill_step_tokens = 0
        self._group_of = {u: g for g, members in enumerate(groups) for u in members}
        self._group_sizes = [len(members) for members in groups]
        self._passes: list[list[float]] = [[-1.0, 0.0, 0.0] for _ in groups]
        """Per group, the pass being added up: its start, its tokens, whether it carries prefill (its members'
        records come in together at its end)."""
        self.pass_slots = 0
        """Prefill-carrying passes times their group's size."""
        self.pass_tokens = 0
        self.migrations: dict[str, int] = {}
        self.mechanisms: dict[str, int] = {}
        self.flow_controlled: set[str] = set()
        self.flow_control_events = 0
        self.boundaries: list[dict[str, Any]] = []

    def _std(self, total: float, squares: float) -> float:
        mean = total / self._n
        return float(max(squares / self._n - mean * mean, 0.0) ** 0.5)

    def add(self, rec: StepRecord) -> None:
        prefill = rec.num_prefill_tokens
        if prefill:
            self.prefill_steps += 1
            self.prefill_step_tokens += prefill + rec.num_decode_tokens
        u = rec.unit_id
        g = self._group_of.get(u)
        if g is not None:
            current = self._passes[g]
            if current[0] != rec.start_s:
                self._close_pass(g)
                current[0] = rec.start_s
            current[1] += prefill + rec.num_decode_tokens
            current[2] = current[2] or float(prefill > 0)
        if u not in self._members:
            return
        t = rec.start_s + rec.duration_s
        last = self._t_last
        sums = self._sums
        if last is None:
            self._t_first = self._t_last = t
        else:
            if t > last:
                dt = t - last
                area = self._area
                area[0] += dt * self._std(sums[0], sums[1])
                area[1] += dt * self._std(sums[2], sums[3])
                self._t_last = t
        kv = float(rec.kv_used_blocks * self.block_size)
        batch = float(rec.num_running)
        old_kv, old_b = self._kv[u], self._batch[u]
        sums[0] += kv - old_kv
        sums[1] += kv * kv - old_kv * old_kv
        sums[2] += batch - old_b
        sums[3] += batch * batch - old_b * old_b
        self._kv[u], self._batch[u] = kv, batch

    def _close_pass(self, g: int) -> None:
        current = self._passes[g]
        if current[2]:
            self.pass_slots += self._group_sizes[g]
            self.pass_tokens += int(current[1])
        current[:] = [-1.0, 0.0, 0.0]

    def add_decision(self, now_s: float, decision: DispatchDecision) -> None:
        if decision.flow_control:
            self.flow_control_events += 1
            self.flow_controlled.update(decision.flow_control)
        cut = decision.reasons.get("boundaries")
        if cut is not None and (not self.boundaries or self.boundaries[-1]["boundaries"] != cut):
            self.boundaries.append({"t_s": now_s, "boundaries": cut})

    def add_migration(self, reason: str, mechanism: str) -> None:
        self.migrations[reason] = self.migrations.get(reason, 0) + 1
        self.mechanisms[mechanism] = self.mechanisms.get(mechanism, 0) + 1

    def as_dict(self, *, max_num_batched_tokens: int) -> dict[str, Any]:
        span = (self._t_last or 0.0) - (self._t_first or 0.0)
        cap = self.prefill_steps * max_num_batched_tokens
        for g in range(len(self._passes)):
            self._close_pass(g)
        pass_cap = self.pass_slots * max_num_batched_tokens
        return {
            "kv_tokens_std": self._area[0] / span if span > 0 else 0.0,
            "batch_size_std": self._area[1] / span if span > 0 else 0.0,
            "prefill_chunk_utilization": self.prefill_step_tokens / cap if cap else None,
            "pass_chunk_utilization": self.pass_tokens / pass_cap if pass_cap else None,
            "migrations": sum(self.migrations.values()),
            "migrations_by_reason": dict(sorted(self.migrations.items())),
            "migrations_by_mechanism": dict(sorted(self.mechanisms.items())),
            "flow_control_events": self.flow_control_events,
            "flow_controlled_requests": len(self.flow_controlled),
            "stage_boundaries": self.boundaries,
        }
