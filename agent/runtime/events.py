"""The node's in-process records as telemetry events: steps, request outcomes, loads, moves, slack samples and
policy schemas, with node time (seconds since the run's start) mapped to wall-clock nanoseconds by a
:class:`NodeOrigin`. The hub calls these; the protocol itself (``agent.telemetry``) knows no engine record.
``docs/records.md`` maps each record's fields to the event's, with their units.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agent.engine.base import RequestOutcome, StepRecord
from agent.runtime.records import MigrationRecord
from agent.telemetry import (
    ParamSchema,
    PolicySchema,
    RequestFinished,
    RequestMigrated,
    RequestPreempted,
    SlackPoint,
    SlackSample,
    StepEvent,
    UnitLoadEvent,
)
from policies.base import BatchPolicy, DispatchPolicy
from policies.params import ParamSpec
from policies.types import ReasonValue, RequestView, UnitLoad


# -- in-process records -> events ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NodeOrigin:
    """Maps node time (seconds since the run's start) to wall-clock nanoseconds."""

    node_id: str
    origin_ns: int
    """Wall-clock time of node time 0 (``time.time_ns()`` when the run started)."""

    def ns(self, t_s: float) -> int:
        return self.origin_ns + round(t_s * 1e9)


def wire_reasons(reasons: Mapping[str, ReasonValue]) -> dict[str, ReasonValue]:
    """A copy of a policy's reasons that both codecs carry unchanged.

    Non-finite floats become "inf", "-inf" or "nan" (JSON has no such numbers; the policies already write
    ``"inf"`` this way); numpy scalars, which no codec encodes, become the Python value they hold.
    """
    values = reasons.values()
    if _PLAIN_TYPES.issuperset(map(type, values)):  # the usual case, checked without a Python loop
        return dict(reasons)
    for value in values:
        if type(value) is float:
            if value - value != 0.0:  # inf or nan
                break
        elif type(value) not in _PLAIN_TYPES:
            break
    else:
        return dict(reasons)
    return {key: _wire_value(value) for key, value in reasons.items()}


_PLAIN_TYPES: frozenset[type] = frozenset((int, str, bool))


def _wire_value(value: object) -> ReasonValue:
    item = getattr(value, "item", None)  # numpy scalars
    if item is not None and not isinstance(value, str):
        value = item()
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    return str(value)


def _ns(duration_s: float) -> int:
    return round(duration_s * 1e9)


def step_event(record: StepRecord, origin: NodeOrigin) -> StepEvent:
    """``record`` as a ``step`` event (the hub's per-step path: the times computed inline, no helper calls)."""
    return StepEvent(
        node_id=origin.node_id,
        time_ns=origin.origin_ns + round(record.start_s * 1e9),
        unit_id=record.unit_id,
        step_id=record.step_id,
        measured_ns=round(record.duration_s * 1e9),
        predicted_ns=round(record.predicted_s * 1e9),
        mode=record.mode,
        policy=record.policy,
        num_prefill_tokens=record.num_prefill_tokens,
        num_decode_tokens=record.num_decode_tokens,
        num_prefill_reqs=record.num_prefill_reqs,
        num_decode_reqs=record.num_decode_reqs,
        context_tokens=record.context_tokens,
        budget_tokens=record.budget_tokens,
        kv_used_blocks=record.kv_used_blocks,
        num_blocks=record.num_blocks,
        num_running=record.num_running,
        num_waiting=record.num_waiting,
        num_preempted=record.num_preempted,
        num_finished=record.num_finished,
        reasons=wire_reasons(record.reasons),
    )


def request_finished(outcome: RequestOutcome, origin: NodeOrigin) -> RequestFinished:
    tpot, worst = outcome.tpot_s, outcome.tpot_by("worst")
    return RequestFinished(
        node_id=origin.node_id,
        time_ns=origin.ns(outcome.finish_s),
        request_id=outcome.request_id,
        unit_id=outcome.unit_id,
        arrival_ns=origin.ns(outcome.arrival_s),
        first_token_ns=origin.ns(outcome.first_token_s),
        prompt_tokens=outcome.prompt_tokens,
        output_tokens=outcome.output_tokens,
        num_preemptions=outcome.num_preemptions,
        ttft_ms=outcome.ttft_s * 1e3,
        tpot_ms=None if tpot is None else tpot * 1e3,
        ttft_slo_ms=outcome.ttft_slo_s * 1e3,
        tpot_slo_ms=outcome.tpot_slo_s * 1e3,
        met_slo=outcome.met_slo,
        max_tpot_ms=None if worst is None else worst * 1e3,
    )


def unit_load_event(load: UnitLoad, origin: NodeOrigin, now_s: float, dispatch_id: int) -> UnitLoadEvent:
    """``load`` as the dispatcher saw it at its decision number ``dispatch_id``, made at node time ``now_s``."""
    return UnitLoadEvent(
        node_id=origin.node_id,
        time_ns=origin.ns(now_s),
        unit_id=load.unit_id,
        dispatch_id=dispatch_id,
        healthy=load.healthy,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        kv_used_blocks=load.kv_used_blocks,
        num_blocks=load.num_blocks,
        kv_tokens=load.kv_tokens,
        queued_prefill_tokens=load.queued_prefill_tokens,
        max_num_seqs=load.max_num_seqs,
        pab_tokens=load.prefill_admission_budget,
        last_step_ns=None if load.last_step_s is None else _ns(load.last_step_s),
        mean_step_ns=None if load.mean_step_s is None else _ns(load.mean_step_s),
    )


def request_preempted(record: StepRecord, request_id: str, origin: NodeOrigin) -> RequestPreempted:
    """``request_id`` lost its KV in the step ``record``, when the step was planned (its start)."""
    return RequestPreempted(node_id=origin.node_id, time_ns=origin.ns(record.start_s), request_id=request_id,
                            unit_id=record.unit_id, step_id=record.step_id)


def request_migrated(move: MigrationRecord, origin: NodeOrigin) -> RequestMigrated:
    """A move between units (or back to the dispatcher), at its end."""
    return RequestMigrated(node_id=origin.node_id, time_ns=origin.ns(move.end_s), request_id=move.request_id,
                           from_unit_id=move.from_unit_id, unit_id=move.unit_id,
                           reason=f"{move.reason}:{move.mechanism}")


def slack_sample(
    unit_id: int, running: Iterable[RequestView], origin: NodeOrigin, now_s: float, *, sample_period_ms: float,
    max_requests: int,
) -> SlackSample:
    """One unit's running requests at node time ``now_s``, least slack first, at most ``max_requests`` of them.

    A request's deadline is its next output token's: ``arrival + ttft_slo + tpot_slo * output_tokens``
    (:meth:`RequestView.token_deadline_s`); its slack is that deadline minus ``now_s``.
    """
    timed = [(v.token_deadline_s(v.output_tokens), v) for v in running]
    chosen = (heapq.nsmallest(max_requests, timed, key=_first) if len(timed) > max_requests
              else sorted(timed, key=_first))
    points = tuple(
        SlackPoint(request_id=v.request_id, deadline_ns=origin.ns(deadline_s), slack_ms=(deadline_s - now_s) * 1e3,
                   output_tokens=v.output_tokens, computed_tokens=v.computed_tokens)
        for deadline_s, v in chosen
    )
    return SlackSample(node_id=origin.node_id, time_ns=origin.ns(now_s), unit_id=unit_id,
                       sample_period_ms=sample_period_ms, requests=points)


def _first(pair: tuple[float, RequestView]) -> float:
    return pair[0]


def param_schema(spec: ParamSpec) -> ParamSchema:
    return ParamSchema(
        name=spec.name,
        type=spec.type,
        default=spec.default,
        help=spec.help,
        unit=spec.unit,
        min=None if spec.bounds[0] is None else float(spec.bounds[0]),  # None: no bound (inf travels as None)
        max=None if spec.bounds[1] is None else float(spec.bounds[1]),
        choices=spec.choices,
        live=spec.live,
    )


def policy_schemas(classes: Iterable[type[BatchPolicy] | type[DispatchPolicy]]) -> tuple[PolicySchema, ...]:
    """Wire schemas of policy classes (e.g. the registry's values), sorted by name."""
    return tuple(
        PolicySchema(name=cls.name, summary=cls.summary, params=tuple(param_schema(s) for s in cls.params_schema))
        for cls in sorted(classes, key=lambda c: c.name)
    )
