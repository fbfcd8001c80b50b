"""The node runtime: N engine units, a dispatcher and an arrival stream, in one discrete-event core.

Events are arrivals, step ends and dispatcher wake-ups. :meth:`Node.advance` processes every event up to a
time; a clock (``agent.clock``) decides how fast node time passes, so the same core runs a trace replay as
fast as possible (virtual time, deterministic for a seed) or live (wall clock).

Every request is accounted for exactly once: it is pending at the dispatcher, on a unit, finished, or
rejected; nothing is dropped silently.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from agent.clock import Clock, VirtualClock
from agent.engine.base import Engine, RequestOutcome, StepRecord, SubmittedRequest
from agent.gc_control import GcController
from agent.workload.types import RequestSpec
from policies.base import DispatchPolicy
from policies.types import DispatchDecision, PendingRequest, UnitLoad

# Event kinds, in the order they are processed when they share a time: step ends first, then dispatcher
# wake-ups, then arrivals, then step starts (so that every request arriving at an instant can join the step
# that starts at that instant).
_STEP_END = 0
_TICK = 1
_START = 2

RequestEventKind = Literal["arrived", "dispatched", "refused", "first_token"]
"""What :attr:`Node.on_request` reports: a request arrived, was placed on a unit, was refused (by the dispatcher
or a unit's admission control; ``RequestState.refused_by`` tells which), or produced its first token."""

DispatchHook = Callable[[int, Sequence[UnitLoad], DispatchDecision], None]
"""``on_dispatch(dispatch_id, loads, decision)``: the dispatcher's decision number ``dispatch_id`` (from 1), the
loads it was shown (one per unit, in unit order; units not ``active`` appear unhealthy) and what it decided."""
PreemptHook = Callable[[StepRecord, tuple[str, ...]], None]
"""``on_preempt(record, request_ids)``: the step ``record`` preempted ``request_ids`` (when it was planned, at
``record.start_s``; the node learns it at the step's end, after ``on_step``)."""


@dataclass(slots=True)
class RequestState:
    """Where one request is, and what happened to it."""

    spec: RequestSpec
    ttft_slo_s: float
    tpot_slo_s: float
    unit_id: int | None = None
    dispatched_s: float | None = None
    outcome: RequestOutcome | None = None
    rejected: bool = False
    refused_by: int | None = None
    """The unit whose batch policy refused the request at admission (it is then also ``rejected``)."""
    cycles_waited: int = 0


class Node:
    """Units + dispatcher + arrivals. Time is seconds since the start of the run."""

    def __init__(
        self,
        units: Sequence[Engine],
        dispatcher: DispatchPolicy,
        requests: Sequence[RequestSpec],
        *,
        ttft_slo_s: float,
        tpot_slo_s: float,
        on_step: Callable[[StepRecord], None] | None = None,
        on_finish: Callable[[RequestOutcome], None] | None = None,
        on_request: Callable[[RequestEventKind, RequestState], None] | None = None,
        on_dispatch: DispatchHook | None = None,
        on_preempt: PreemptHook | None = None,
    ) -> None:
        if not units:
            raise ValueError("a node needs at least one unit")
        self.units = list(units)
        self.dispatcher = dispatcher
        self.arrivals = sorted(requests, key=lambda r: r.arrival_s)
        ids = {r.request_id for r in self.arrivals}
        if len(ids) != len(self.arrivals):
            raise ValueError("request ids must be unique")
        self._next_arrival = 0
        self.default_ttft_slo_s = ttft_slo_s
        self.default_tpot_slo_s = tpot_slo_s
        self.on_step = on_step
        self.on_finish = on_finish
        self.on_request = on_request
        """Optional lifecycle hook (telemetry), called at ``now_s`` with the request's state."""
        self.on_dispatch = on_dispatch
        """Optional hook (telemetry) called at every dispatch decision, before it is applied."""
        self.on_preempt = on_preempt
        """Optional hook (telemetry) called at the end of a step that preempted requests."""
        self.num_dispatches = 0
        """Dispatch decisions taken so far (the last one's ``dispatch_id``)."""
        self.states: dict[str, RequestState] = {}
        self.pending: dict[str, None] = {}
        """Requests at the dispatcher, in arrival order (a dict as an ordered set)."""
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._tick_at: float | None = None
        self._start_pending = [False] * len(self.units)
        self.now_s = 0.0
        self.num_finished = 0
        self.num_rejected = 0
        self.num_refused = 0
        """Rejected by a unit's admission control (a subset of ``num_rejected``)."""
        self.unit_modes: list[str] = ["active"] * len(self.units)
        """Per unit: ``active``; ``draining`` (finishes its requests, gets no new ones); ``paused`` (no new
        requests and no new steps; its requests wait on it). Change with :meth:`set_unit_mode`."""

    # -- time ---------------------------------------------------------------------------------------
    def next_event_s(self) -> float | None:
        """Time of the next event, or None when the run is over."""
        t = self._heap[0][0] if self._heap else None
        if self._next_arrival < len(self.arrivals):
            a = self.arrivals[self._next_arrival].arrival_s
            t = a if t is None else min(t, a)
        return t

    def advance(self, until_s: float) -> None:
        """Process every event at or before ``until_s``."""
        while True:
            t = self.next_event_s()
            if t is None or t > until_s:
                break
            self.now_s = max(self.now_s, t)
            top = self._heap[0] if self._heap else None
            arrival_due = (
                self._next_arrival < len(self.arrivals) and self.arrivals[self._next_arrival].arrival_s <= t
            )
            if top is not None and top[0] <= t and not (arrival_due and top[1] == _START):
                _, kind, _, unit_index = heapq.heappop(self._heap)
                if kind == _STEP_END:
                    self._on_step_end(unit_index)
                elif kind == _START:
                    self._start_pending[unit_index] = False
                    self._start_step(unit_index)
                else:
                    self._tick_at = None
                    self._dispatch()
            else:
                spec = self.arrivals[self._next_arrival]
                self._next_arrival += 1
                self._on_arrival(spec)
        self.now_s = max(self.now_s, until_s)

    def run(
        self, clock: Clock | None = None, *, until_s: float | None = None, gc_control: GcController | None = None
    ) -> None:
        """Run until no event is left (or ``until_s``), waiting on ``clock`` (virtual by default).

        With ``gc_control`` (entered by the caller), the loop tells it before each wait how many real seconds
        the wait will last, so that it can collect garbage then rather than in the middle of a step.
        """
        clock = clock or VirtualClock()
        while True:
            t = self.next_event_s()
            if t is None or (until_s is not None and t > until_s):
                break
            if gc_control is not None:
                gc_control.before_wait(clock.seconds_until(t))
            clock.wait_until(t)
            self.advance(t)

    @property
    def done(self) -> bool:
        return self.next_event_s() is None

    # -- events -------------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, unit_index: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, unit_index))

    def _schedule_start(self, index: int) -> None:
        if self.unit_modes[index] == "paused":
            return
        if not self._start_pending[index] and not self.units[index].busy:
            self._start_pending[index] = True
            self._push(self.now_s, _START, index)

    def _on_arrival(self, spec: RequestSpec) -> None:
        ttft = spec.ttft_slo_ms / 1e3 if spec.ttft_slo_ms is not None else self.default_ttft_slo_s
        tpot = spec.tpot_slo_ms / 1e3 if spec.tpot_slo_ms is not None else self.default_tpot_slo_s
        self.states[spec.request_id] = RequestState(spec, ttft, tpot)
        self.pending[spec.request_id] = None
        if self.on_request is not None:
            self.on_request("arrived", self.states[spec.request_id])
        self._dispatch()

    def _dispatch(self) -> None:
        if not self.pending:
            return
        now = self.now_s
        views = [
            PendingRequest(
                s.spec.request_id, s.spec.arrival_s, s.spec.prompt_tokens, s.ttft_slo_s, s.tpot_slo_s,
                s.cycles_waited,
            )
            for s in (self.states[rid] for rid in self.pending)
        ]
        loads = [
            u.load() if self.unit_modes[i] == "active" else replace(u.load(), healthy=False)
            for i, u in enumerate(self.units)
        ]
        decision = self.dispatcher.dispatch(views, loads, now)
        self.num_dispatches += 1
        if self.on_dispatch is not None:
            self.on_dispatch(self.num_dispatches, loads, decision)
        placed: set[str] = set()
        by_id = {u.unit_id: i for i, u in enumerate(self.units)}
        for rid, unit_id in decision.assignments:
            if rid in placed or rid not in self.states or rid not in self.pending:
                raise RuntimeError(f"dispatcher {self.dispatcher.name} placed {rid} twice or unknown")
            if unit_id not in by_id:
                raise RuntimeError(f"dispatcher {self.dispatcher.name} chose unknown unit {unit_id}")
            placed.add(rid)
            state = self.states[rid]
            index = by_id[unit_id]
            unit = self.units[index]
            spec = state.spec
            if unit.policy.refuses(spec.prompt_tokens, unit.cost):
                # Admission control of the unit's batch policy (e.g. FairBatching's PAB): counted, not lost.
                state.rejected = True
                state.refused_by = unit_id
                self.num_rejected += 1
                self.num_refused += 1
                if self.on_request is not None:
                    self.on_request("refused", state)
                continue
            state.unit_id = unit_id
            state.dispatched_s = now
            unit.submit(
                SubmittedRequest(
                    rid, spec.arrival_s, spec.prompt_tokens, spec.output_tokens, state.ttft_slo_s,
                    state.tpot_slo_s,
                ),
                now,
            )
            if self.on_request is not None:
                self.on_request("dispatched", state)
            self._schedule_start(index)
        for rid in decision.rejected:
            if rid in placed or rid not in self.pending:
                raise RuntimeError(f"dispatcher {self.dispatcher.name} rejected {rid} twice or unknown")
            placed.add(rid)
            self.states[rid].rejected = True
            self.num_rejected += 1
            if self.on_request is not None:
                self.on_request("refused", self.states[rid])
        for rid in placed:
            del self.pending[rid]
        for rid in self.pending:
            self.states[rid].cycles_waited += 1
        if decision.next_check_s is not None and self.pending:
            t = max(decision.next_check_s, now)
            if self._tick_at is None or t < self._tick_at:
                self._tick_at = t
                self._push(t, _TICK, -1)

    def _start_step(self, index: int) -> None:
        unit = self.units[index]
        duration = unit.begin_step(self.now_s)
        if duration is not None:
            self._push(self.now_s + duration, _STEP_END, index)

    def _on_step_end(self, index: int) -> None:
        unit = self.units[index]
        result = unit.end_step(self.now_s)
        if self.on_step is not None:
            self.on_step(result.record)
        if result.preempted and self.on_preempt is not None:
            self.on_preempt(result.record, result.preempted)
        if self.on_request is not None:
            for rid in result.first_tokens:
                self.on_request("first_token", self.states[rid])
        for outcome in result.finished:
            self.states[outcome.request_id].outcome = outcome
            self.num_finished += 1
            if self.on_finish is not None:
                self.on_finish(outcome)
        if unit.has_work():
            self._schedule_start(index)
        if self.pending and self.dispatcher.wants_step_reports:
            self._dispatch()

    # -- control (between steps: the caller runs in the loop that drives ``advance``) ---------------------
    def set_unit_mode(self, unit_id: int, mode: str) -> str:
        """Pause, drain or resume (``active``) a unit; returns the previous mode.

        Nothing is dropped: a paused unit keeps its requests and its in-flight step finishes; a draining one
        keeps stepping until empty. Requests held at the dispatcher because no unit took them are offered
        again when a unit becomes active.
        """
        if mode not in ("active", "draining", "paused"):
            raise ValueError(f"unknown unit mode {mode!r} (active, draining, paused)")
        index = self.unit_index(unit_id)
        old = self.unit_modes[index]
        self.unit_modes[index] = mode
        if mode != "paused" and self.units[index].has_work():
            self._schedule_start(index)
        if mode == "active" and self.pending:
            self._dispatch()
        return old

    def set_dispatcher(self, dispatcher: DispatchPolicy) -> None:
        """Replace the dispatch policy; requests waiting at the dispatcher are offered to the new one now."""
        self.dispatcher = dispatcher
        if self.pending:
            self._dispatch()

    def unit_index(self, unit_id: int) -> int:
        for i, u in enumerate(self.units):
            if u.unit_id == unit_id:
                return i
        raise KeyError(f"no unit {unit_id} (units: {', '.join(str(u.unit_id) for u in self.units)})")

    # -- accounting ---------------------------------------------------------------------------------
    def unfinished(self) -> list[str]:
        """Requests neither finished nor rejected (pending, queued or running)."""
        return [rid for rid, s in self.states.items() if s.outcome is None and not s.rejected]
