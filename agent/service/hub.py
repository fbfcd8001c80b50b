"""The agent's telemetry and control hub: the Sans-I/O part of the server, between the node and connections.

The hub turns the node's records into protocol events (through ``agent.telemetry.stream``), numbers them, keeps them for
resumes and offers them to every subscription; it answers control requests (token checked, a change's
``control_id`` applied once, executed with :class:`~agent.runtime.control.NodeControl`, audited on the stream, the
refusals too); with a read token, reads and subscriptions need a token as well. It does no I/O: the asyncio server
(``agent.service.server``) calls it from the loop that also drives the node, so every control action runs between two
steps. The node is any :class:`~agent.runtime.port.ServedNode`: the simulated node, or a live one (vLLM units), whose
control changes the hub confirms with the units before it answers (:meth:`Hub.handle_async`, the only await).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.vllm.placement import UnitPlacement
from agent.runtime.control import AuditRecord, ControlIds, NodeControl
from agent.runtime.events import (
    NodeOrigin,
    policy_schemas,
    request_finished,
    request_migrated,
    request_preempted,
    slack_sample,
    step_event,
    unit_load_event,
)
from agent.runtime.port import LiveNode, ServedNode, Settled
from agent.runtime.records import MigrationRecord, RequestEventKind, RequestState
from agent.service.audit import audit_event, repeated_control_id
from agent.service.metrics import NodeMetrics, render
from agent.telemetry import (
    Alert,
    AlertCode,
    ControlAudit,
    ControlRequest,
    DrainUnit,
    DryRun,
    ErrorCode,
    ErrorReply,
    Event,
    FailUnit,
    ListPolicies,
    NodeHello,
    OkReply,
    PauseUnit,
    PolicyList,
    PostAlert,
    RecoverUnit,
    Reply,
    RequestArrived,
    RequestDispatched,
    RequestFirstToken,
    RequestRefused,
    ResumeUnit,
    SetBatchPolicy,
    SetDispatchPolicy,
    SetParams,
    StageBoundaries,
    Status,
    StatusInfo,
    StepEvent,
    Subscribe,
    Subscribed,
    UnitStatus,
)
from agent.telemetry.stream import ReplayBuffer, ResumeError, Sequencer, Subscription, token_matches
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES
from policies.types import DispatchDecision, UnitLoad

log = logging.getLogger(__name__)

Notify = Callable[[], None]


class Hub:
    """One node's stream and control plane. Attach it with :meth:`attach` before the node runs."""

    def __init__(
        self,
        node: ServedNode,
        *,
        node_id: str,
        profile: str,
        token: str = "",
        read_token: str = "",
        control_id_window_s: float = 600.0,
        control_ids_kept: int = 4096,
        replay_capacity: int = 65536,
        max_queued: int = 4096,
        get_time_ns: Callable[[], int] = time.time_ns,
        slack_sample_ms: float = 250.0,
        slack_max_requests: int = 64,
        unit_load_min_interval_ms: float = 0.0,
        boot_ns: int | None = None,
        settle_timeout_s: float = 10.0,
        placements: Mapping[int, UnitPlacement] | None = None,
        max_held: int = 256,
    ) -> None:
        if not (slack_sample_ms >= 0 and unit_load_min_interval_ms >= 0 and slack_max_requests >= 1 and max_held >= 0):
            raise ValueError("slack_sample_ms, unit_load_min_interval_ms and max_held must be >= 0, "
                             "slack_max_requests >= 1")
        self.node = node
        self.node_id = node_id
        self.profile = profile
        if read_token and read_token == token:
            raise ValueError("the read token must differ from the control token")
        self._token = token
        self._read_token = read_token
        """With it, reads (status, list_policies, subscribe) need it or the control token; without, they need none."""
        self.control_ids = ControlIds(window_ns=round(control_id_window_s * 1e9), min_kept=control_ids_kept)
        """Recent changes' ``control_id``: one seen within ``control_id_window_s`` or among the last
        ``control_ids_kept`` (whichever is longer) is refused with ``duplicate_control_id``."""
        self.max_queued = max_queued
        self._get_time_ns = get_time_ns
        self.boot_ns = boot_ns if boot_ns is not None else get_time_ns()
        """This run of the agent (sequence numbers count within it), and node time 0. A live node's origin is its
        own (``boot_ns=node.origin_ns``): its node time is wall-clock seconds since then."""
        self.origin = NodeOrigin(node_id, self.boot_ns)
        """Node time 0 is the boot; event times are boot + node time (simulated seconds at any speed)."""
        self.settle_timeout_s = settle_timeout_s
        """How long :meth:`handle_async` waits for a live node's units to acknowledge a change."""
        self.placements = dict(placements or {})
        """Where each vLLM unit runs (GPUs, parallel sizes), by unit id, for the units' description."""
        self.control = NodeControl(node, clock_ns=get_time_ns)
        self._sequencer = Sequencer()
        self._replay = ReplayBuffer(replay_capacity, convert=self._step_event_at)
        self.metrics = NodeMetrics()
        """What the metrics count from the stream (steps as of the last :meth:`flush`; :meth:`metrics_text` flushes)."""
        self.max_held = 0 if isinstance(node, LiveNode) else max_held
        """Node events held back at most before :meth:`flush` (0: each published at once, and built even while nobody
        subscribes; a live node's, whose units report from the loop between the server's flushes)."""
        self._held: list[StepRecord | Event] = []
        """The node's events since the last flush, in order: a step as its record (converted at the flush, or when
        first read if nobody subscribes), any other event built (from the node's state at its hook)."""
        self._held_steps: list[StepRecord] = []
        """The step records among them (for the metrics)."""
        self.subscriptions: dict[Subscription, Notify] = {}
        self.num_dropped_closed = 0
        """Events dropped for subscriptions that have since closed."""
        self.num_slow_dropped = 0
        """Subscribers closed for not reading (counted by the server: ``ConnectionLimits.subscriber_timeout_s``)."""
        self._batch_policies = policy_schemas(BATCH_POLICIES.values())
        self._dispatch_policies = policy_schemas(DISPATCH_POLICIES.values())
        self.slack_sample_ms = slack_sample_ms
        """Node time between two slack samples (0: none). A sample is taken at the first step end at or after
        each multiple of the period, so none is taken while no unit steps."""
        self.slack_max_requests = slack_max_requests
        """Requests per unit and sample at most (those with the least slack)."""
        self.unit_load_min_interval_ms = unit_load_min_interval_ms
        """Node time between two ``unit_load`` events of one unit at least (0: one per unit and decision)."""
        self._next_sample_s = 0.0
        self._last_load_s: dict[int, float] = {}
        self._last_boundaries: object = None
        self._watchdog_resets = 0

    @property
    def control_enabled(self) -> bool:
        return bool(self._token)

    @property
    def reads_need_token(self) -> bool:
        """Whether a read token is configured: status, list_policies and subscribe then need a token too."""
        return bool(self._read_token)

    def accepts_token(self, token: str) -> bool:
        """Whether ``token`` is one this agent accepts, its control token or its read token (compared in constant
        time; never without a token configured): the server lets a connection that presents it at connect past the
        limit on anonymous connections."""
        return token_matches(token, self._token) or token_matches(token, self._read_token)

    # -- the node's hooks ---------------------------------------------------------------------------------
    def attach(self) -> None:
        """Route the node's step, finish, request, dispatch and preemption hooks into the stream (replacing any
        set before)."""
        self.node.on_step = self._on_step
        self.node.on_finish = self._on_finish
        self.node.on_request = self._on_request
        self.node.on_dispatch = self._on_dispatch
        self.node.on_preempt = self._on_preempt
        self.node.on_migrate = self._on_migrate
        self.node.on_fault = self._on_fault
        self.node.on_recover = self._on_recover

    def _on_step(self, record: StepRecord) -> None:
        held = self._held
        held.append(record)  # a frozen record: counted by the metrics at the flush, converted then or when read
        self._held_steps.append(record)
        if len(held) > self.max_held:
            self.flush()
        if self.slack_sample_ms and self.node.now_s >= self._next_sample_s:
            self._sample_slack()

    def _sample_slack(self) -> None:
        """One ``slack_sample`` per unit (empty for a unit running nothing), at the node's current time."""
        now_s = self.node.now_s
        period_s = self.slack_sample_ms / 1e3
        self._next_sample_s = (math.floor(now_s / period_s) + 1) * period_s
        for unit in self.node.units:
            self._emit(slack_sample(unit.unit_id, unit.running_views(), self.origin, now_s,
                                      sample_period_ms=self.slack_sample_ms, max_requests=self.slack_max_requests))

    def _on_dispatch(self, dispatch_id: int, loads: Sequence[UnitLoad], decision: DispatchDecision) -> None:
        now_s = self.node.now_s
        min_s = self.unit_load_min_interval_ms / 1e3
        for load in loads:
            if min_s:
                last = self._last_load_s.get(load.unit_id)
                if last is not None and now_s - last < min_s:
                    continue
                self._last_load_s[load.unit_id] = now_s
            self._emit(unit_load_event(load, self.origin, now_s, dispatch_id))
        self._on_dispatch_outcome(decision)

    def _on_dispatch_outcome(self, decision: DispatchDecision) -> None:
        """Stage boundaries when they change, the watchdog's resets and requests held by flow control."""
        now_ns = self.origin.ns(self.node.now_s)
        dispatcher = self.node.dispatcher
        reasons = decision.reasons
        cut = reasons.get("boundaries")
        layout = dispatcher.stage_layout() if cut is not None and cut != self._last_boundaries else None
        if layout is not None:
            self._last_boundaries = cut
            self._emit(StageBoundaries(node_id=self.node_id, time_ns=now_ns, policy=dispatcher.name,
                                         boundaries_tokens=layout[0], stage_unit_ids=layout[1],
                                         reason="repartition" if reasons.get("repartitioned") else "refinement"))
        resets = reasons.get("watchdog_resets")
        if isinstance(resets, int) and resets > self._watchdog_resets:
            self._emit(Alert(node_id=self.node_id, time_ns=now_ns, code=AlertCode.WATCHDOG_RESET,
                               message=f"{dispatcher.name}: {resets - self._watchdog_resets} unit(s) reset after "
                               "no end-of-step report", num_dropped=0))
        if isinstance(resets, int):
            self._watchdog_resets = resets
        if decision.flow_control:
            self._emit(Alert(node_id=self.node_id, time_ns=now_ns, code=AlertCode.REQUESTS_HELD,
                               message=f"{dispatcher.name}: {len(decision.flow_control)} request(s) held past the "
                               "wait limit", num_dropped=len(decision.flow_control)))

    def _on_fault(self, unit_id: int, reason: str) -> None:
        self._emit(Alert(node_id=self.node_id, time_ns=self.origin.ns(self.node.now_s), code=AlertCode.UNIT_FAILED,
                           severity="error", unit_id=unit_id, message=f"unit {unit_id} failed: {reason}"))

    def _on_recover(self, unit_id: int, how: str) -> None:
        self._emit(Alert(node_id=self.node_id, time_ns=self.origin.ns(self.node.now_s),
                           code=AlertCode.UNIT_RESTARTED, severity="info", unit_id=unit_id,
                           message=f"unit {unit_id} is back: {how}"))

    def _on_migrate(self, move: MigrationRecord) -> None:
        self._emit(request_migrated(move, self.origin))

    def _on_preempt(self, record: StepRecord, request_ids: tuple[str, ...]) -> None:
        for rid in request_ids:
            self._emit(request_preempted(record, rid, self.origin))

    def _on_finish(self, outcome: RequestOutcome) -> None:
        self.metrics.observe_outcome(outcome)
        self._emit(request_finished(outcome, self.origin))

    def _on_request(self, kind: RequestEventKind, state: RequestState) -> None:
        now_ns = self.origin.ns(self.node.now_s)
        spec = state.spec
        rid, nid = spec.request_id, self.node_id
        event: Event
        if kind == "arrived":
            event = RequestArrived(node_id=nid, time_ns=now_ns, request_id=rid, prompt_tokens=spec.prompt_tokens,
                                   ttft_slo_ms=state.ttft_slo_s * 1e3, tpot_slo_ms=state.tpot_slo_s * 1e3)
        elif kind == "dispatched":
            assert state.unit_id is not None
            event = RequestDispatched(node_id=nid, time_ns=now_ns, request_id=rid, unit_id=state.unit_id,
                                      num_rounds_waited=state.num_rounds_waited)
        elif kind == "refused":
            if state.refused_by is not None:
                policy = self.node.units[self.node.unit_index(state.refused_by)].policy.name
                reason = "admission control"
            else:
                policy, reason = self.node.dispatcher.name, state.refusal_reason or "dispatcher"
            event = RequestRefused(node_id=nid, time_ns=now_ns, request_id=rid, unit_id=state.refused_by,
                                   policy=policy, reason=reason)
        else:
            assert state.unit_id is not None
            ttft_s = self.node.now_s - spec.arrival_s
            self.metrics.observe_first_token(state.unit_id, ttft_s)
            event = RequestFirstToken(node_id=nid, time_ns=now_ns, request_id=rid, unit_id=state.unit_id,
                                      ttft_ms=ttft_s * 1e3)
        self._emit(event)

    # -- the stream -----------------------------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        """Publish a node event, after the node's events held before it (at the next :meth:`flush`)."""
        held = self._held
        held.append(event)
        if len(held) > self.max_held:
            self.flush()

    def flush(self) -> None:
        """Publish the node's events held since the last flush, in order (:attr:`max_held`).

        The node's hooks hold their events (a step as its record) and this publishes them in one pass: converting,
        numbering, buffering and offering a run of events at once costs the node's thread far less than one at a
        time between its own work. Everything that reads the stream flushes first (:meth:`publish`, a subscription's
        reads, :attr:`replay`, :attr:`sequencer`, :meth:`subscribe`, :meth:`status`, :meth:`metrics_text`), so what
        anyone sees, in content, numbers and order, is what publishing each event at its hook would give; the server
        flushes before it lets its loop run the senders (``agent.service.server``).
        """
        held = self._held
        if not held:
            return
        self._held = []
        steps, self._held_steps = self._held_steps, []
        if steps:
            self.metrics.observe_steps(steps)
        if steps and not self.subscriptions and self.max_held:
            # nobody listens: the replay buffer keeps the records and builds their events only if they are read
            # (a live node's hub, max_held 0, builds them at once, as its engines' records are not ours)
            first = self._sequencer.take(len(held))
            for seq, item in enumerate(held, start=first):
                if not isinstance(item, StepRecord):
                    msgspec.structs.force_setattr(item, "seq", seq)
            self._replay.append_deferred(held, first)
            return
        origin = self.origin
        self._publish_all([step_event(item, origin) if isinstance(item, StepRecord) else item for item in held])

    def _step_event_at(self, record: StepRecord, seq: int) -> StepEvent:
        """A held step record as its event, numbered ``seq`` (what :meth:`flush` builds, later)."""
        event = step_event(record, self.origin)
        msgspec.structs.force_setattr(event, "seq", seq)
        return event

    def _publish_all(self, events: list[Event]) -> None:
        """Number freshly built ``events`` in place, keep them for resumes, offer them to every subscription, and
        notify each subscription that took any, once."""
        stamp = self._sequencer.stamp_new
        append = self._replay.append
        for event in events:
            append(stamp(event))
        for sub, notify in self.subscriptions.items():
            if sub.offer_many(events):
                notify()

    def publish(self, event: Event) -> None:
        """Number ``event``, keep it for resumes and offer it to every subscription (never blocks), after the node's
        events held so far (:meth:`flush`).

        ``event`` must be freshly built (every caller converts a record just before): it is numbered in place.
        """
        self.flush()
        self._publish_all([event])

    @property
    def replay(self) -> ReplayBuffer:
        """The stream's last events, for resumes (flushed: up to date)."""
        self.flush()
        return self._replay

    @property
    def sequencer(self) -> Sequencer:
        """Numbers the stream's events (flushed: its ``last_seq`` is the last event's)."""
        self.flush()
        return self._sequencer

    def subscribe(
        self, request: Subscribe, notify: Notify, *, who: str = "unknown"
    ) -> tuple[Subscription | None, Reply, int | None]:
        """A new live subscription, the reply, and the position its resume streams from (or None, the error, None).

        A resume is not copied: the subscription reads the replay buffer after that position as its sender sends
        (:meth:`Subscription.replay_from`: a ``gap`` alert when part of it is gone, then the buffered events the
        filter wants), before its live queue, so a long resume never drops its own events while the buffer holds
        them and costs nothing per subscriber. A resume position of another run of the agent (``resume_boot_ns`` is
        not :attr:`boot_ns`) restarts from this run's first event; the reply's ``resumed_after_seq`` (0) says so.
        ``notify`` is called when the subscription has new frames. With a read token configured, a subscription
        without it (or the control token) is refused ``unauthorized`` and audited as by ``who``.
        """
        refused = self._read_refusal(request, who)
        if refused is not None:
            return None, refused, None
        self.flush()
        sub = Subscription.from_request(request, self.node_id, max_queued=self.max_queued,
                                        get_time_ns=self._get_time_ns)
        num_replayed = 0
        position = request.resume_after_seq
        if position is not None and request.resume_boot_ns not in (None, self.boot_ns):
            position = 0  # its sequence numbers counted in an earlier run: none of them is this run's
        if position is not None:
            try:
                num_replayed = sub.replay_from(self.replay, position)
            except ResumeError as exc:
                return None, ErrorReply(control_id=request.control_id, code=exc.code, message=str(exc)), None
        sub.before_read = self.flush
        self.subscriptions[sub] = notify
        reply = OkReply(control_id=request.control_id, payload=Subscribed(
            last_seq=self.replay.last_seq, num_replayed=num_replayed, resumed_after_seq=position))
        return sub, reply, position

    def unsubscribe(self, sub: Subscription) -> None:
        self.flush()
        sub.before_read = None
        if self.subscriptions.pop(sub, None) is not None:
            self.num_dropped_closed += sub.num_dropped

    @property
    def num_dropped(self) -> int:
        self.flush()
        return self.num_dropped_closed + sum(s.num_dropped for s in self.subscriptions)

    # -- reads ----------------------------------------------------------------------------------------------
    def unit_statuses(self) -> tuple[UnitStatus, ...]:
        out = []
        for index, unit in enumerate(self.node.units):
            load = unit.load()
            where = self.placements.get(unit.unit_id)
            out.append(UnitStatus(
                unit_id=unit.unit_id, mode=self.node.unit_modes[index],  # type: ignore[arg-type]
                batch_policy=unit.policy.name, batch_params=dict(unit.policy.params), num_blocks=load.num_blocks,
                max_num_seqs=load.max_num_seqs, num_running=load.num_running, num_waiting=load.num_waiting,
                gpu_ids=where.gpu_ids if where else (), tensor_parallel_size=where.tensor_parallel_size if where else 0,
                pipeline_parallel_size=where.pipeline_parallel_size if where else 0,
                engine_pid=getattr(unit, "engine_pid", None),  # vLLM units only
                failure=getattr(unit, "failure", None) or "",
            ))
        return tuple(out)

    def hello(self) -> NodeHello:
        """The first frame of every connection (a notice: ``seq`` 0)."""
        return NodeHello(
            node_id=self.node_id, time_ns=self._get_time_ns(), boot_ns=self.boot_ns, profile=self.profile,
            units=self.unit_statuses(), dispatch_policy=self.node.dispatcher.name,
            dispatch_params=dict(self.node.dispatcher.params), batch_policies=self._batch_policies,
            dispatch_policies=self._dispatch_policies, **self.shape(),
        )

    def shape(self) -> dict[str, Any]:
        """The hello's ``topology``, ``prefill_units``, ``lockstep`` and ``instance_size``, from the units' roles (a
        unit without one, a vLLM engine, is ``mixed``) and the node's lockstep groups (one group of every unit is
        ``lockstep``; equal groups of fewer are instances)."""
        roles = [getattr(unit, "role", "mixed") for unit in self.node.units]
        prefill = sum(1 for role in roles if role == "prefill")
        groups: tuple[tuple[int, ...], ...] = tuple(getattr(self.node, "lockstep_groups", ()))
        instances = len(groups) > 1 or (len(groups) == 1 and len(groups[0]) < len(self.node.units))
        return {"topology": "disaggregated" if prefill else "colocated", "prefill_units": prefill,
                "lockstep": bool(groups) and not instances,
                "instance_size": len(groups[0]) if instances else 0}

    def status(self) -> StatusInfo:
        self.flush()
        return StatusInfo(
            node_id=self.node_id, dispatch_policy=self.node.dispatcher.name,
            dispatch_params=dict(self.node.dispatcher.params), units=self.unit_statuses(),
            last_seq=self.replay.last_seq, oldest_seq=self.replay.oldest_seq,
            num_subscribers=len(self.subscriptions), num_slow_dropped=self.num_slow_dropped,
        )

    def metrics_text(self) -> str:
        self.flush()
        return render(self.node, self.metrics, model_name=self.profile, num_dropped=self.num_dropped,
                      num_subscribers=len(self.subscriptions), num_slow_dropped=self.num_slow_dropped)

    # -- control --------------------------------------------------------------------------------------------
    def handle(self, request: ControlRequest, *, who: str) -> Reply:
        """Answer any request but :class:`Subscribe` (which needs a connection: :meth:`subscribe`).

        A read (status, list_policies) needs no token, or with a read token configured that one or the control
        token. A change needs the control token and a ``control_id`` not seen within the window
        (:attr:`control_ids`); it is refused otherwise (``unauthorized``, ``invalid_field``,
        ``duplicate_control_id``) and changes nothing. Every refusal and every change is audited on the stream
        (``who``: the peer).

        For a live node this answers a change as soon as it was sent to the units: :meth:`handle_async` waits
        for their acknowledgement (the server uses that one).
        """
        done = self._decide(request, who)
        return self._answer(done, request.control_id) if isinstance(done, AuditRecord) else done

    async def handle_async(self, request: ControlRequest, *, who: str) -> Reply:
        """:meth:`handle`, except that for a :class:`~agent.runtime.port.LiveNode` an applied change is answered (and
        audited) once the units it went to have acknowledged it (:meth:`~agent.runtime.port.LiveNode.settle`): a unit
        that refused it makes the change ``rejected`` (code ``unit_refused``; that unit keeps its previous
        setting), one that did not answer in time is named in the audit's message. Never awaits otherwise."""
        done = self._decide(request, who)
        if not isinstance(done, AuditRecord):
            return done
        node = self.node
        if done.result == "applied" and isinstance(node, LiveNode):
            try:
                settled = await node.settle(self.settle_timeout_s)
            except Exception as exc:  # as in handle(): answer, log, carry on
                log.exception("settling control request %s failed", request.__struct_config__.tag)
                settled = Settled(refused=(f"internal error: {exc}",))
            if settled.refused:
                done = self.control.amend(done, result="rejected", error="; ".join(settled.refused),
                                          error_code="unit_refused")
            elif settled.unconfirmed:
                done = self.control.amend(done, note="; ".join(settled.unconfirmed))
        return self._answer(done, request.control_id)

    def _decide(self, request: ControlRequest, who: str) -> AuditRecord | Reply:
        """The reply to a read or a refused request, or the audit record of an executed change."""
        cid = request.control_id
        if not request.needs_token:
            refused = self._read_refusal(request, who)
            if refused is not None:
                return refused
        if isinstance(request, Status):
            return OkReply(control_id=cid, payload=self.status())
        if isinstance(request, ListPolicies):
            return OkReply(control_id=cid, payload=PolicyList(batch_policies=self._batch_policies,
                                                              dispatch_policies=self._dispatch_policies))
        if isinstance(request, Subscribe):
            return ErrorReply(control_id=cid, code=ErrorCode.INTERNAL, message="subscribe needs a connection")
        if request.needs_token and not token_matches(request.token, self._token):
            if not self._token:
                why = "control is disabled on this agent (no token file)"
            elif token_matches(request.token, self._read_token):
                why = "a read token cannot change anything: changes need the control token"
            else:
                why = "wrong or missing token"
            return self._refuse(request, who, ErrorCode.UNAUTHORIZED, why)
        if not cid:
            return self._refuse(request, who, ErrorCode.INVALID_FIELD,
                                "control_id: a change needs one of its own (e.g. a random UUID), never reused")
        now_ns = self._get_time_ns()
        first = self.control_ids.first_use(cid, now_ns)
        if first is not None:
            return self._refuse(request, who, ErrorCode.DUPLICATE_CONTROL_ID, repeated_control_id(cid, first, now_ns))
        use = self.control_ids.use(cid, now_ns)
        try:
            return self._execute(request, who)
        except Exception as exc:  # a bug must not take the agent down: answer, log, carry on
            log.exception("control request %s failed", request.__struct_config__.tag)
            use.result = "rejected"
            return ErrorReply(control_id=cid, code=ErrorCode.INTERNAL, message=f"internal error: {exc}")

    def _read_refusal(self, request: ControlRequest, who: str) -> ErrorReply | None:
        """None when the read ``request`` may be answered (no read token configured, or it carries one of the
        tokens); else the (audited) refusal."""
        if not self._read_token or self.accepts_token(request.token):
            return None
        return self._refuse(request, who, ErrorCode.UNAUTHORIZED,
                            "wrong or missing token: this agent's reads need its read token (or its control token)")

    def _refuse(self, request: ControlRequest, who: str, code: str, message: str) -> ErrorReply:
        """Answer a request refused before it ran with ``code``, audited (the request's kind as the action)."""
        self.audit_refusal(str(request.__struct_config__.tag), code, message, who=who, control_id=request.control_id)
        return ErrorReply(control_id=request.control_id, code=code, message=message)

    def audit_refusal(self, action: str, code: str, message: str, *, who: str, control_id: str = "") -> ControlAudit:
        """Publish the audit event (``rejected``, ``code``) of something refused before it ran: the hub's own
        refusals (``action``: the request's kind), and the server's, e.g. a wrong token presented at connect
        (``action`` ``connect``). ``message`` must not hold the token."""
        audit = audit_event(self.control.refuse(action, code, message, who=who), self.node_id, control_id)
        self.publish(audit)
        return audit

    def _answer(self, record: AuditRecord, cid: str) -> Reply:
        """Publish ``record``'s audit event and answer with it (an error reply when it was rejected)."""
        audit = audit_event(record, self.node_id, cid)
        self.publish(audit)
        self.metrics.observe_control(record)
        self.control_ids.settle(cid, record.result, audit.seq)
        if record.result == "rejected":
            return ErrorReply(control_id=cid, code=record.error_code or ErrorCode.INTERNAL,
                              message=record.error or "rejected")
        return OkReply(control_id=cid, payload=audit)

    def _execute(self, request: ControlRequest, who: str, dry_run: bool = False) -> AuditRecord:
        c = self.control
        if isinstance(request, DryRun):
            return self._execute(request.change, who, dry_run=True)
        if isinstance(request, SetBatchPolicy):
            return c.set_batch_policy(request.policy, request.params, units=request.unit_ids or None, who=who,
                                      dry_run=dry_run)
        if isinstance(request, SetDispatchPolicy):
            return c.set_dispatch_policy(request.policy, request.params, who=who, dry_run=dry_run)
        if isinstance(request, SetParams):
            return c.set_params(request.params, target=request.target, units=request.unit_ids or None, who=who,
                                dry_run=dry_run)
        if isinstance(request, PauseUnit | DrainUnit | ResumeUnit):
            mode = {PauseUnit: "paused", DrainUnit: "draining", ResumeUnit: "active"}[type(request)]
            return c.set_unit_mode(request.unit_id, mode, who=who)
        if isinstance(request, FailUnit):
            return c.fail_unit(request.unit_id, request.reason, who=who)
        if isinstance(request, RecoverUnit):
            return c.recover_unit(request.unit_id, who=who)
        if isinstance(request, PostAlert):
            record = c.post_alert(request.code, request.message, request.severity, who=who)
            self.publish(Alert(node_id=self.node_id, time_ns=self.origin.ns(self.node.now_s), code=request.code,
                               severity=request.severity, message=request.message))
            return record
        raise TypeError(f"not a control action: {type(request).__name__}")
