"""The node runtime: N engine units, a dispatcher and an arrival stream, in one discrete-event core.

Events are arrivals, step ends and dispatcher wake-ups. :meth:`Node.advance` processes every event up to a
time; a clock (``agent.runtime.clock``) decides how fast node time passes, so the same core runs a trace replay as
fast as possible (virtual time, deterministic for a seed) or live (wall clock).

Every request is accounted for exactly once: it is pending at the dispatcher, on a unit, in transit between
units, finished, or rejected; nothing is dropped silently.

Cluster shapes (POLICIES.md sections 2.2 and 3):

* **colocated** (every unit ``mixed``) or **disaggregated**: ``prefill`` units take new requests and let each
  go once its first token is sampled; the dispatcher's :meth:`~policies.base.DispatchPolicy.place_decode`
  picks a ``decode`` unit and the KV follows over the configured link (:class:`MigrationConfig`).
* **lockstep** (DP+EP): every unit starts its step at the same instant and the step lasts as long as the
  slowest unit's; idle units wait. **Lockstep groups** (``lockstep_groups``): seed 000's instances, each a
  group of DP units in lockstep inside, the groups stepping independently of each other (out of phase); a unit
  in no group steps on its own. ``lockstep=True`` is one group of every unit.
* **migrations** a dispatcher asks for (``DispatchDecision.migrations``): ``live`` copies the KV while the
  request keeps decoding on its source, then switches between two of the source's steps; ``recompute``
  moves it at once and the target prefills prompt and outputs again. A target without room for the KV
  falls back to recompute. Every move is reported (``on_migrate``).
* **faults**: :meth:`Node.fail_unit` loses a unit's step in flight and its KV; its requests go back to the
  dispatcher with the tokens they already produced and recompute elsewhere. :meth:`Node.recover_unit`
  brings it back empty.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import replace

from agent.engine.base import Engine, Migrant, RequestOutcome, StepRecord
from agent.runtime.clock import Clock, VirtualClock
from agent.runtime.desk import DispatchDesk
from agent.runtime.gc_control import GcController
from agent.runtime.lockstep import lockstep_groups_of
from agent.runtime.node_driver import NodeDriver
from agent.runtime.port import check_settable
from agent.runtime.records import (
    DispatchHook,
    MigrateHook,
    MigrationConfig,
    MigrationRecord,
    PreemptHook,
    RequestEventKind,
    RequestState,
    Transfer,
)
from agent.workload.types import RequestSpec
from policies.base import DispatchPolicy
from policies.types import HandoffRequest, Migration, PendingRequest, UnitLoad

# Event kinds, in the order they are processed when they share a time: step ends first, then transfer ends,
# then dispatcher wake-ups, then arrivals, then step starts (so that every request arriving at an instant can
# join the step that starts at that instant). Step starts are always due at the current instant: they wait in a
# queue of their own (``Node._starts``, in the order they were asked for) instead of the heap.
_STEP_END = 0
_XFER = 1
_TICK = 2
# A lockstep group's step start or end has ``unit_index`` ``-1 - g`` (group ``g``; -1 with ``lockstep=True``).

UNIT_MODES = ("active", "draining", "paused", "failed")


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
        on_migrate: MigrateHook | None = None,
        lockstep: bool = False,
        lockstep_groups: Sequence[Sequence[int]] | None = None,
        pass_sync_s: float = 0.0,
        migration: MigrationConfig | None = None,
        pending_timeout_s: float | None = None,
        keep_finished: bool = True,
    ) -> None:
        if not units:
            raise ValueError("a node needs at least one unit")
        self.units = list(units)
        roles = {u.role for u in self.units}
        if roles & {"prefill", "decode"} and not {"prefill", "decode"} <= roles:
            raise ValueError("a disaggregated node needs at least one prefill and one decode unit")
        if "mixed" in roles and len(roles) > 1:
            raise ValueError("units are either all mixed (colocated) or prefill and decode (disaggregated)")
        self.disaggregated = "prefill" in roles
        self._index = {u.unit_id: i for i, u in enumerate(self.units)}
        self.lockstep_groups = lockstep_groups_of(self._index, lockstep, lockstep_groups)
        """Unit ids of each lockstep group (an instance); empty without lockstep."""
        self.lockstep = bool(self.lockstep_groups)
        if pass_sync_s < 0 or (pass_sync_s and not self.lockstep):
            raise ValueError("pass_sync_s is a lockstep pass's synchronisation cost: >= 0, and only with lockstep")
        self.pass_sync_s = pass_sync_s
        """Added to every lockstep pass (a DP+EP pass's all-to-all and barrier): it ends at the slowest member's step
        end plus this, however full the pass (issue #19, item 7); 0 by default."""
        self._group_of = [-1] * len(self.units)
        """Per unit index: its lockstep group, -1 for none."""
        self._group_indices = [sorted(self._index[u] for u in members) for members in self.lockstep_groups]
        for g, indices in enumerate(self._group_indices):
            for index in indices:
                self._group_of[index] = g
                self.units[index].instance = g  # its loads say so (UnitLoad.instance)
        self.migration = migration or MigrationConfig()
        self.on_migrate = on_migrate
        """Optional hook (telemetry) called when a request has moved (or went back to the dispatcher)."""
        self.on_fault: Callable[[int, str], None] | None = None
        """Optional hook (telemetry): ``on_fault(unit_id, reason)`` when a unit fails (:meth:`fail_unit`)."""
        self.on_recover: Callable[[int, str], None] | None = None
        """Optional hook (telemetry): ``on_recover(unit_id, how)`` when a failed unit is back (:meth:`recover_unit`)."""
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
        self.states: dict[str, RequestState] = {}
        """Every request that arrived, by id; with ``keep_finished=False`` (a live agent that runs for months) only
        those not yet finished or rejected: an ended request leaves once its hooks have run (the stream and the
        recorder have it), so the node's memory does not grow with the requests it served."""
        self.keep_finished = keep_finished
        self._num_arrived = 0
        self.desk: DispatchDesk[Migrant] = DispatchDesk(strict=True, pending_timeout_s=pending_timeout_s)
        """The requests at the dispatcher and the dispatch round over them (``agent.runtime.desk``, as on live vLLM
        units; strict: a decision that cannot be applied raises); a request back from a failed unit carries its
        progress (a :class:`~agent.engine.base.Migrant` without KV). With ``pending_timeout_s`` a request no unit
        took within that long is rejected (``refusal_reason`` ``pending_timeout``); None (the default, as replays
        measure queueing): it waits."""
        self._driver = NodeDriver(self)
        self._heap: list[tuple[float, int, int, int]] = []
        self._starts: list[int] = []
        """Step starts due now, in the order they were asked for: unit indices, ``-1 - g`` for a start of lockstep
        group ``g``."""
        self._arrival_s = [r.arrival_s for r in self.arrivals]
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
        requests and no new steps; its requests wait on it); ``failed`` (see :meth:`fail_unit`). Change with
        :meth:`set_unit_mode`."""
        self._step_end_seq = [0] * len(self.units)
        """Heap sequence number of each unit's pending step end (a failed unit's stale one is skipped)."""
        groups = len(self.lockstep_groups)
        self._lock_members: list[list[int]] = [[] for _ in range(groups)]
        """Per lockstep group: the unit indices in its step in flight."""
        self._lock_seq = [0] * groups
        self._lock_start_pending = [False] * groups
        self.transfers: dict[str, Transfer] = {}
        """Moves under way, by request id."""
        self._xfer_at: dict[int, str] = {}
        self.num_migrations = 0
        self.num_migrations_skipped = 0
        """Migrations a dispatcher asked for that could not start (request gone, moving already, bad target)."""
        self.num_faults = 0

    def unit_group(self, unit_id: int) -> int | None:
        """The lockstep group (instance) of a unit, None when it steps on its own."""
        g = self._group_of[self.unit_index(unit_id)]
        return g if g >= 0 else None

    # -- time ---------------------------------------------------------------------------------------
    def next_event_s(self) -> float | None:
        """Time of the next event, or None when the run is over."""
        t = self._heap[0][0] if self._heap else None
        if self._starts and (t is None or self.now_s < t):
            t = self.now_s
        if self._next_arrival < len(self._arrival_s):
            a = self._arrival_s[self._next_arrival]
            t = a if t is None or a < t else t
        return t

    def advance(self, until_s: float) -> None:
        """Process every event at or before ``until_s``."""
        heap, starts, arrival_s = self._heap, self._starts, self._arrival_s
        num_arrivals = len(arrival_s)
        while True:
            # The next event: the heap's first (step end, transfer, wake-up) unless an arrival comes strictly
            # earlier; then the step starts due now (after everything else at this instant); then the arrival.
            top = heap[0] if heap else None
            i = self._next_arrival
            a = arrival_s[i] if i < num_arrivals else None
            if top is not None and (a is None or top[0] <= a) and (not starts or top[0] <= self.now_s):
                t = top[0]
                if t > until_s:
                    break
                if t > self.now_s:
                    self.now_s = t
                _, kind, seq, unit_index = heapq.heappop(heap)
                if kind == _STEP_END:
                    if unit_index < 0:
                        if seq == self._lock_seq[-1 - unit_index]:
                            self._on_lockstep_end(-1 - unit_index)
                    elif seq == self._step_end_seq[unit_index]:
                        self._on_step_end(unit_index)
                elif kind == _XFER:
                    self._on_transfer_due(self._xfer_at.pop(seq))
                else:
                    self._tick_at = None
                    self._dispatch()
            elif a is not None and (not starts or a <= self.now_s):
                if a > until_s:
                    break
                if a > self.now_s:
                    self.now_s = a
                self._next_arrival = i + 1
                self._on_arrival(self.arrivals[i])
            elif starts:
                if self.now_s > until_s:
                    break
                unit_index = starts.pop(0)
                if unit_index < 0:
                    self._lock_start_pending[-1 - unit_index] = False
                    self._start_lockstep(-1 - unit_index)
                else:
                    self._start_pending[unit_index] = False
                    self._start_step(unit_index)
            else:
                break
        if until_s > self.now_s:
            self.now_s = until_s

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
    def _push(self, t: float, kind: int, unit_index: int) -> int:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, unit_index))
        return self._seq

    def _steps(self, index: int) -> bool:
        return self.unit_modes[index] not in ("paused", "failed")

    def _schedule_start(self, index: int) -> None:
        if not self._steps(index):
            return
        g = self._group_of[index]
        if g >= 0:
            if not self._lock_start_pending[g] and not self._lock_members[g]:
                self._lock_start_pending[g] = True
                self._starts.append(-1 - g)
        elif not self._start_pending[index] and not self.units[index].busy:
            self._start_pending[index] = True
            self._starts.append(index)

    def _on_arrival(self, spec: RequestSpec) -> None:
        ttft = spec.ttft_slo_ms / 1e3 if spec.ttft_slo_ms is not None else self.default_ttft_slo_s
        tpot = spec.tpot_slo_ms / 1e3 if spec.tpot_slo_ms is not None else self.default_tpot_slo_s
        self.states[spec.request_id] = RequestState(spec, ttft, tpot)
        self._num_arrived += 1
        self.desk.add(PendingRequest(spec.request_id, spec.arrival_s, spec.prompt_tokens, ttft, tpot), self.now_s)
        if self.on_request is not None:
            self.on_request("arrived", self.states[spec.request_id])
        self._dispatch()

    def _dispatch(self) -> None:
        """One dispatch round (``agent.runtime.desk``), then a wake-up at the time the dispatcher asks for."""
        if not self.desk.wants_round(self.dispatcher):
            return
        t = self.desk.round(self.dispatcher, self._loads(intake=True), self.now_s, self._driver)
        if t is not None and (self._tick_at is None or t < self._tick_at):
            self._tick_at = t
            self._push(t, _TICK, -1)

    def _start_step(self, index: int) -> None:
        if not self._steps(index):
            return
        unit = self.units[index]
        duration = unit.begin_step(self.now_s)
        if duration is not None:
            self._step_end_seq[index] = self._push(self.now_s + duration, _STEP_END, index)

    def _start_lockstep(self, g: int) -> None:
        """Every unit of group ``g`` that can step starts now; the pass ends at the slowest end plus the sync."""
        durations: dict[int, float] = {}
        for index in self._group_indices[g]:
            unit = self.units[index]
            if self._steps(index) and not unit.busy:
                d = unit.begin_step(self.now_s)
                if d is not None:
                    durations[index] = d
        if durations:
            self._lock_members[g] = sorted(durations)
            self._lock_seq[g] = self._push(self.now_s + max(durations.values()) + self.pass_sync_s, _STEP_END, -1 - g)

    def _on_lockstep_end(self, g: int) -> None:
        """Every member's step ends at once: all their reports are in before the dispatcher is asked."""
        members, self._lock_members[g] = self._lock_members[g], []
        for index in members:
            self._on_step_end(index, ask_dispatcher=False)
        self._schedule_any()  # units that got work during the step (none of them was a member) join the next
        if (self.pending and self.dispatcher.wants_step_reports) or self.dispatcher.rebalances:
            self._dispatch()

    def _on_step_end(self, index: int, *, ask_dispatcher: bool = True) -> None:
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
            if self.transfers.pop(outcome.request_id, None) is not None:
                self.num_migrations_skipped += 1  # finished on its source while its KV was being copied
            self.num_finished += 1
            if self.on_finish is not None:
                self.on_finish(outcome)
            self.let_go(outcome.request_id)
        if self.transfers:
            for rid in [rid for rid, t in self.transfers.items() if t.switch_due and t.source_index == index]:
                self._switch(self.transfers[rid])
        if result.handoffs:
            self._hand_off(index, result.handoffs)
        if unit.has_work():
            self._schedule_start(index)
        if ask_dispatcher and ((self.pending and self.dispatcher.wants_step_reports) or self.dispatcher.rebalances):
            self._dispatch()

    # -- control (between steps: the caller runs in the loop that drives ``advance``) ---------------------
    def set_unit_mode(self, unit_id: int, mode: str) -> str:
        """Pause, drain or resume (``active``) a unit; returns the previous mode.

        Nothing is dropped: a paused unit keeps its requests and its in-flight step finishes; a draining one
        keeps stepping until empty. Requests held at the dispatcher because no unit took them are offered
        again when a unit becomes active.
        """
        check_settable(mode)
        index = self.unit_index(unit_id)
        old = self.unit_modes[index]
        if old == "failed":
            raise ValueError(f"unit {unit_id} has failed: recover it first")
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

    def fail_unit(self, unit_id: int, reason: str = "") -> int:
        """Simulate a unit fault now: its step in flight and its KV are lost, its requests go back to the
        dispatcher with the tokens they produced (they recompute elsewhere). Returns how many moved back;
        ``reason`` goes to ``on_fault`` (default: a simulated fault)."""
        index = self.unit_index(unit_id)
        if self.unit_modes[index] == "failed":
            raise ValueError(f"unit {unit_id} has failed already")
        self.unit_modes[index] = "failed"
        self.num_faults += 1
        self._step_end_seq[index] = 0
        self._start_pending[index] = False
        g = self._group_of[index]
        if g >= 0 and index in self._lock_members[g]:
            self._lock_members[g].remove(index)
            if not self._lock_members[g]:
                self._lock_seq[g] = 0
                self._schedule_any()
        for rid, t in list(self.transfers.items()):
            if t.source_index == index and t.migrant is None:
                del self.transfers[rid]  # its copy is lost with the source; the request is evacuated below
        migrants = self.units[index].evacuate()
        self._requeue(migrants, index, "fault")
        if self.on_fault is not None:
            self.on_fault(unit_id, f"{reason or 'simulated fault'} ({len(migrants)} request(s) back to the dispatcher)")
        self._dispatch()
        return len(migrants)

    def recover_unit(self, unit_id: int) -> None:
        """Bring a failed unit back, empty; it takes requests again at once."""
        index = self.unit_index(unit_id)
        if self.unit_modes[index] != "failed":
            raise ValueError(f"unit {unit_id} has not failed")
        self.unit_modes[index] = "active"
        if self.on_recover is not None:
            self.on_recover(unit_id, "recovered (simulated)")
        self._dispatch()

    def let_go(self, request_id: str) -> None:
        """An ended request (finished, refused or rejected; its hooks have run) leaves ``states`` unless the node keeps
        finished ones (``keep_finished``)."""
        if not self.keep_finished:
            del self.states[request_id]

    def unit_index(self, unit_id: int) -> int:
        for i, u in enumerate(self.units):
            if u.unit_id == unit_id:
                return i
        raise KeyError(f"no unit {unit_id} (units: {', '.join(str(u.unit_id) for u in self.units)})")

    # -- moving requests ----------------------------------------------------------------------------
    def _loads(self, *, intake: bool) -> list[UnitLoad]:
        """Loads shown to the dispatcher: the units that take new requests (``intake``) or the decode pool;
        units not ``active`` appear unhealthy."""
        want = self.dispatcher.needs_requests
        out = []
        for i, u in enumerate(self.units):
            if self.disaggregated and (u.role == "prefill") != intake:
                continue
            load = u.load(want)
            out.append(load if self.unit_modes[i] == "active" else replace(load, healthy=False))
        return out

    def _start_migration(self, m: Migration) -> None:
        """Start a move that passed the desk's rules (``DispatchDesk.movable``)."""
        src, dst = self._index[m.source_unit], self._index[m.target_unit]
        t = Transfer(m.request_id, src, dst, m.reason or "rebalance", self.now_s)
        self.transfers[m.request_id] = t
        source = self.units[src]
        source.set_migrating(m.request_id, True)
        if self.migration.mechanism == "live":
            view = source.load(True).requests
            tokens = next(r.computed_tokens for r in view if r.request_id == m.request_id)
            self._xfer_at[self._push(self.now_s + self.migration.transfer_s(tokens), _XFER, -1)] = m.request_id
        elif source.stepping(m.request_id):
            t.switch_due = True
        else:
            self._switch(t)

    def _on_transfer_due(self, request_id: str) -> None:
        t = self.transfers.get(request_id)
        if t is None:
            return  # cancelled: its source failed
        if t.migrant is not None:
            self._arrive(t)
        elif self.units[t.source_index].stepping(request_id):
            t.switch_due = True
        else:
            self._switch(t)

    def _switch(self, t: Transfer) -> None:
        """Take the request off its source (its copied KV goes along when ``live``) and place it; when the
        target failed meanwhile, the move is called off and the request stays where it is."""
        source = self.units[t.source_index]
        if self.unit_modes[t.target_index] == "failed":
            del self.transfers[t.request_id]
            source.set_migrating(t.request_id, False)
            self.num_migrations_skipped += 1
            return
        migrant = source.detach(t.request_id)
        if self.migration.mechanism == "recompute":
            migrant = migrant.without_kv()
        t.migrant = migrant
        self._arrive(t)

    def _arrive(self, t: Transfer) -> None:
        del self.transfers[t.request_id]
        assert t.migrant is not None
        if self.unit_modes[t.target_index] == "failed":
            self._requeue([t.migrant], t.source_index, t.reason)
            self._dispatch()
            return
        target = self.units[t.target_index]
        kept = target.attach(t.migrant, self.now_s)
        state = self.states[t.request_id]
        state.unit_id = target.unit_id
        self.num_migrations += 1
        if self.on_migrate is not None:
            self.on_migrate(
                MigrationRecord(
                    t.request_id, self.units[t.source_index].unit_id, target.unit_id, t.reason,
                    "live" if kept else "recompute", t.start_s, self.now_s, t.migrant.computed_tokens if kept else 0,
                )
            )
        self._schedule_start(t.target_index)

    def _hand_off(self, index: int, handoffs: Sequence[Migrant]) -> None:
        """Disaggregated: requests that finished prefill on unit ``index`` go to decode units with their KV."""
        views = [HandoffRequest(m.request_id, m.computed_tokens, m.spec.prompt_tokens) for m in handoffs]
        placement = dict(self.dispatcher.place_decode(views, self._loads(intake=False), self.now_s))
        by_id = {u.unit_id: i for i, u in enumerate(self.units)}
        for m in handoffs:
            unit_id = placement.get(m.request_id)
            target = by_id.get(unit_id) if unit_id is not None else None
            if target is None or self.units[target].role != "decode":
                raise RuntimeError(f"dispatcher {self.dispatcher.name} gave hand-off {m.request_id} no decode unit")
            t = Transfer(m.request_id, index, target, "handoff", self.now_s, migrant=m)
            self.transfers[m.request_id] = t
            self._xfer_at[self._push(self.now_s + self.migration.transfer_s(m.computed_tokens), _XFER, -1)] = (
                m.request_id
            )

    def _requeue(self, migrants: Sequence[Migrant], source_index: int, reason: str) -> None:
        """Back to the dispatcher (KV lost), at the front of its queue, keeping the tokens produced so far (the next
        unit prefills prompt and outputs); placed again without admission control."""
        entries = []
        source = self.units[source_index].unit_id
        for m in migrants:
            rid = m.request_id
            carried = m.without_kv()
            state = self.states[rid]
            state.unit_id = None
            entries.append((
                PendingRequest(rid, state.spec.arrival_s, carried.num_tokens, state.ttft_slo_s, state.tpot_slo_s,
                               state.num_rounds_waited),
                carried,
            ))
            if self.on_migrate is not None:
                self.on_migrate(MigrationRecord(rid, source, None, reason, "lost", self.now_s, self.now_s, 0))
        self.desk.requeue(entries, self.now_s)

    def _schedule_any(self) -> None:
        for index, unit in enumerate(self.units):
            if unit.has_work():
                self._schedule_start(index)

    # -- accounting ---------------------------------------------------------------------------------
    @property
    def num_arrived(self) -> int:
        """Requests that reached the dispatcher so far."""
        return self._num_arrived

    @property
    def num_pending(self) -> int:
        """Requests waiting at the dispatcher."""
        return len(self.desk)

    @property
    def pending(self) -> dict[str, PendingRequest]:
        """Requests waiting at the dispatcher, in queue order."""
        return self.desk.pending

    @property
    def num_dispatches(self) -> int:
        """Dispatch decisions taken so far (the last one's ``dispatch_id``)."""
        return self.desk.num_rounds

    def unfinished(self) -> list[str]:
        """Requests neither finished nor rejected (pending, queued or running)."""
        return [rid for rid, s in self.states.items() if s.outcome is None and not s.rejected]

