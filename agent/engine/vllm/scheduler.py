"""A vLLM 0.26.0 scheduler that runs a trackside batch policy every step.

:class:`PolicySchedulerMixin` wraps vLLM's own ``Scheduler.schedule()`` (no copy of it): before each call it
shows the unit's :class:`~policies.base.BatchPolicy` the running and waiting requests, takes its
:class:`~policies.types.StepPlan`, and imposes the plan with vLLM's own mechanisms (``shared/VLLM.md``):

* the step's token budget: ``max_num_scheduled_tokens`` for the call (never above ``max_num_batched_tokens``);
* priority: ``self.running`` sorted by ``plan.running_order`` (its tail is vLLM's preemption victim);
* admissions: a temporary waiting queue holding only the requests the plan admits, in plan order; every other
  waiting request is merged back afterwards in its old place (requests vLLM preempted in the call go first,
  as vLLM prepends them);
* per-request token counts (a chunk cap, a request held back this step): the only per-request hook before
  KV allocation, the Mamba block-aligned split (``need_mamba_block_aligned_split``), turned on for the call
  and overridden to return ``min(vLLM's count, the plan's)``; 0 leaves a running request out of the step
  without preempting it. Valid for models without Mamba layers only (checked at start). A step where the hook
  would change nothing (every running request decodes and is planned, none can be admitted) leaves it off.

With the ``vllm`` policy the enforced plan is exactly what vLLM decides on its own (tested step by step on
randomized request streams, sync and async). :class:`PolicyScheduler` subclasses ``Scheduler`` (for
``async_scheduling=False``), :class:`PolicyAsyncScheduler` subclasses ``AsyncScheduler`` (the default: a
plain ``Scheduler`` under the async loop decodes only every other step).

Every step yields a :class:`~agent.engine.vllm.messages.StepMessage` (composition, measured and predicted time,
KV, the plan's reasons, the policy's admission budget) sent out of the engine-core process on a zmq PUSH socket
(:mod:`agent.engine.vllm.channel`) or kept in memory; control requests
(:data:`~agent.engine.vllm.messages.ControlRequest`: ``SetPolicy`` swaps the policy, ``SetParams`` changes
parameters, ``Ping`` changes nothing) arrive on a zmq PULL socket polled at the top of ``schedule()``, so a change
always applies between two steps. Each is answered with a :class:`~agent.engine.vllm.messages.ControlReply` on
the step socket, refusals included; a frame that does not decode is answered with an error when its ``id`` can be
read, and logged and skipped otherwise. An idle engine calls no ``schedule()``: the socket is also polled
whenever the engine core reads the scheduler's pause state, which it does only to answer an
``is_scheduler_paused`` utility call (handled between two steps, on the engine core's thread). The agent sends
one when it waits for a reply (``VllmUnit.reply``), so an idle engine applies a change at once.

Timing: nothing in vLLM times the forward pass. Sync scheduling: a step lasts from ``schedule()`` returning
to ``update_from_output()`` starting. Async scheduling (step N+1 is planned while N runs): step N lasts from
the later of its ``schedule()`` return and step N-1's output to step N's output. A policy under async
scheduling sees counts one step late (vLLM's own behaviour). It plans step N+1 from the time step N is predicted
to end (``ts_busy_until``: N's launch plus its predicted time), which is when N+1 starts. A request whose first
token N produces has that time as its first-token time (``ts_plan_now``). Without these, a slack-spending policy
gave N+1 the time N was still using, and held every request's second token back a whole step (docs/vllm.md).
"""

from __future__ import annotations

import logging
import operator
import time
from itertools import filterfalse
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler

from agent.engine.live import apply_control, build_policy
from agent.engine.vllm.channel import ControlInbox, StepSink, make_sink
from agent.engine.vllm.config import UnitSettings, unit_settings
from agent.engine.vllm.lifeline import watch_agent
from agent.engine.vllm.messages import ControlReply, ControlRequest, FrameError, StepMessage
from policies.base import BatchPolicy
from policies.batch.vllm_default import VllmDefault
from policies.cost.fit import OnlineStepModel
from policies.cost.step_model import StepCoefficients
from policies.types import RequestView, StepFeedback, StepMode, StepPlan, UnitView

log = logging.getLogger(__name__)
_new_tuple = tuple.__new__
_REQUEST_ID = operator.attrgetter("request_id")
_FIRST = operator.itemgetter(0)
_COMPUTED = operator.attrgetter("num_computed_tokens")

DEFAULT_COEFFICIENTS = StepCoefficients(9.11e-3, 24.0e-6, 43.9e-9)
"""H100, Llama-3.1-8B, CUDA graphs (``shared/calibration``): the prior when a unit names none."""


class UnsupportedModelError(RuntimeError):
    """The model needs vLLM's Mamba block alignment, the hook the plan enforcement borrows."""


class _Pending:
    """What the scheduler remembers of a step between ``schedule()`` and ``update_from_output()``."""

    __slots__ = ("ctx", "decode_ids", "index", "plan", "plan_s", "predicted_s", "scheduled_s")

    def __init__(self, index: int, plan: StepPlan, decode_ids: set[str], predicted_s: float, scheduled_s: float,
                 plan_s: float, ctx: int) -> None:
        self.index = index
        self.ctx = ctx
        self.plan = plan
        self.decode_ids = decode_ids
        self.predicted_s = predicted_s
        self.scheduled_s = scheduled_s
        self.plan_s = plan_s


class PolicySchedulerMixin:
    """Runs a trackside batch policy inside a vLLM scheduler. Put it before ``Scheduler`` in the bases."""

    # Attributes of vLLM's Scheduler this mixin uses (declared for readers; set by Scheduler.__init__).
    running: list[Any]
    waiting: Any
    skipped_waiting: Any
    requests: dict[str, Any]
    max_num_scheduled_tokens: int
    max_num_running_reqs: int
    num_waiting_for_streaming_input: int
    max_model_len: int
    need_mamba_block_aligned_split: bool
    kv_cache_manager: Any
    cache_config: Any
    scheduler_config: Any
    vllm_config: Any
    policy: Any

    ts_native_steps = True
    """Let vLLM's own scheduler decide the steps of the ``vllm`` policy with its defaults (:meth:`_ts_native`). The
    tests turn it off on an instance to check that the policy itself reproduces vLLM."""

    def _ts_setup(self) -> None:
        if self.need_mamba_block_aligned_split:
            raise UnsupportedModelError(
                "trackside enforces per-request token counts through vLLM's Mamba alignment hook: "
                "models with Mamba layers in 'align' cache mode are not supported"
            )
        if self.policy != SchedulingPolicy.FCFS:
            raise UnsupportedModelError("trackside policies replace vLLM's priority scheduling: use the fcfs policy")
        settings = unit_settings(self.vllm_config.additional_config)
        self.ts_settings: UnitSettings = settings
        self.ts_unit_id = settings.unit_id
        self.ts_policy: BatchPolicy = build_policy(settings.policy, dict(settings.params))
        prior = StepCoefficients(*settings.coefficients) if settings.coefficients else DEFAULT_COEFFICIENTS
        self.ts_cost = OnlineStepModel(prior, forgetting=0.99)
        self.ts_online = settings.online_fit
        self.ts_max_tokens = self.max_num_scheduled_tokens
        self.ts_block_size = int(self.cache_config.block_size)
        # vLLM counts usage over num_gpu_blocks - 1 (block 0 is its null block).
        self.ts_num_blocks = max(1, int(self.kv_cache_manager.block_pool.num_gpu_blocks) - 1)
        self.ts_caps: dict[str, int] | None = None
        self.ts_slo: dict[str, tuple[float, float, float]] = {}
        """request id -> (TTFT SLO, TPOT SLO, arrival): ``extra_args`` ``ttft_slo_s``, ``tpot_slo_s``, ``arrival_s``
        (the time the request reached the agent, so that its wait at the dispatcher counts against its slack)."""
        self.ts_first_token: dict[str, float] = {}
        self.ts_queued_tokens = 0
        self.ts_decoding: set[str] = set()
        """The running requests that decode in the step being planned (built with the view)."""
        self.ts_waiting_prev: tuple[tuple[Any, ...], tuple[RequestView, ...]] = ((), ())
        self.ts_pending: dict[int, _Pending] = {}
        self.ts_finishing: dict[str, tuple[int, int]] | None = None
        """While vLLM applies a step's output: the requests that finished in it (their output and prompt lengths)."""
        self.ts_step_index = 0
        self.ts_last_output_s: float | None = None
        self.ts_busy_until = 0.0
        """When the steps in flight are expected to have ended (``perf_counter``; async scheduling): the step planned
        next starts then."""
        self.ts_plan_now = 0.0
        """The time the step being planned starts (wall clock; the policy's ``now``)."""
        self.ts_sink: StepSink = make_sink(settings.step_addr)
        self.ts_inbox: ControlInbox | None = ControlInbox(settings.control_addr) if settings.control_addr else None
        self.ts_paused = False
        self.ts_lifeline = watch_agent(settings.agent_pid) if settings.agent_pid else None
        """The thread that stops this engine core when its agent is gone (None: none watched)."""

    # -- the policy's view ------------------------------------------------------------------------
    def _ts_slo_of(self, r: Any) -> tuple[float, float, float]:
        """A request's (TTFT SLO, TPOT SLO, arrival), read once from its ``extra_args`` and kept."""
        extra = r.sampling_params.extra_args if r.sampling_params is not None else None
        s = self.ts_settings
        if extra:
            slo = (float(extra.get("ttft_slo_s", s.ttft_slo_s)), float(extra.get("tpot_slo_s", s.tpot_slo_s)),
                   float(extra.get("arrival_s", r.arrival_time)))
        else:
            slo = (s.ttft_slo_s, s.tpot_slo_s, r.arrival_time)
        self.ts_slo[r.request_id] = slo
        return slo

    def _ts_views(self, requests: Any) -> tuple[list[RequestView], set[str]]:
        """The policy's views of ``requests`` (running or waiting, in order), and which of them decode in the step
        being planned. Built afresh each time: a decoding request's view changes every step (this runs for every
        running request every step), and the waiting requests' views are kept while their queue is unchanged."""
        ft = self.ts_first_token.get
        slo_of = self.ts_slo.get
        plan_now = self.ts_plan_now
        new = _new_tuple
        views: list[RequestView] = []
        decoding: set[str] = set()
        for r in requests:
            rid = r.request_id
            slo = slo_of(rid)
            if slo is None:
                slo = self._ts_slo_of(r)
            placeholders = r.num_output_placeholders
            raw_outputs = r.num_output_tokens
            computed = r.num_computed_tokens
            prompt = r.num_prompt_tokens
            outputs = raw_outputs + placeholders
            first = ft(rid)
            if placeholders > 0:
                if computed + 2 - placeholders >= prompt + r.max_tokens:
                    # Async scheduling: its last token is already in flight; vLLM skips it (nothing left to compute).
                    computed = prompt + outputs
                if first is None and raw_outputs == 0:
                    # Async scheduling: its first token is in flight, out when the step in flight ends, which is
                    # when the step being planned starts (``ts_plan_now``). Without this its next token's deadline
                    # would still be its TTFT envelope's (seconds away), so a slack-spending policy would hold it
                    # back a whole step.
                    first = plan_now
            # RequestView(...) without the named tuple's Python-level __new__.
            views.append(new(RequestView, (rid, slo[2], prompt, computed, outputs, slo[0], slo[1], first,
                                           r.num_preemptions)))
            if outputs > 0 and prompt + outputs - computed == 1:  # RequestView.is_decode, inlined
                decoding.add(rid)
        return views, decoding

    def _ts_waiting(self) -> tuple[RequestView, ...]:
        """The waiting requests' views (skipped ones first, as vLLM looks at them), rebuilt only when the queue
        changed; the queued prefill tokens with them (``ts_queued_tokens``)."""
        queue = (*self.skipped_waiting, *self.waiting)
        prev = self.ts_waiting_prev
        if queue == prev[0]:
            # The same requests in the same order (``Request`` has no ``__eq__``: tuples of them compare by identity,
            # in C): waiting requests compute nothing, so their views hold.
            return prev[1]
        waiting = tuple(self._ts_views(queue)[0])
        queued = 0
        for w in waiting:
            queued += w.prompt_tokens + w.output_tokens - w.computed_tokens
        self.ts_queued_tokens = queued
        self.ts_waiting_prev = (queue, waiting)
        return waiting

    def _ts_view(self) -> UnitView:
        waiting = self._ts_waiting()
        running, self.ts_decoding = self._ts_views(self.running)
        return UnitView(
            unit_id=self.ts_unit_id,
            step_index=self.ts_step_index,
            running=tuple(running),
            waiting=waiting,
            block_size=self.ts_block_size,
            num_blocks=self.ts_num_blocks,
            free_blocks=int(self.kv_cache_manager.block_pool.get_num_free_blocks()),
            max_num_batched_tokens=self.ts_max_tokens,
            max_num_seqs=self.max_num_running_reqs,
            max_model_len=self.max_model_len,
            cost=self.ts_cost.coefficients,
            mixed_interference=self.ts_settings.mixed_interference,
        )

    def _ts_native_scan(self) -> None:
        """What a native step (:meth:`_ts_native`) needs of the views: the decoding requests (for its record) and
        the queued prefill tokens, without a view of any running request."""
        self._ts_waiting()
        decoding: set[str] = set()
        for r in self.running:
            outputs = r.num_output_tokens + r.num_output_placeholders
            if outputs > 0 and r.num_prompt_tokens + outputs - r.num_computed_tokens == 1:
                decoding.add(r.request_id)
        self.ts_decoding = decoding

    # -- vLLM's hooks -----------------------------------------------------------------------------
    def _mamba_block_aligned_split(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> int:
        caps = self.ts_caps
        if caps is None:
            return super()._mamba_block_aligned_split(request, num_new_tokens, *args, **kwargs)  # type: ignore[misc, no-any-return]
        return min(num_new_tokens, caps.get(request.request_id, 0))

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._ts_poll_control()
        t0 = time.perf_counter()
        now = time.time()
        in_flight = bool(self.ts_pending)
        if in_flight:
            # Async scheduling: this step runs once the steps in flight end, so it is planned from then (a policy
            # that spends slack would otherwise give this step time that the step in flight is already using).
            ahead = self.ts_busy_until - t0
            if ahead > 0.0:
                now += ahead
        self.ts_plan_now = now
        if self._ts_native():
            running_before = len(self.running)
            waiting_before = len(self.waiting) + len(self.skipped_waiting)
            self._ts_native_scan()
            plan_s = time.perf_counter() - t0
            out = super().schedule(*args, **kwargs)  # type: ignore[misc]
            plan = self._ts_native_plan(out, running_before, waiting_before)
        else:
            view = self._ts_view()
            plan = self.ts_policy.plan(view, now)
            plan_s = time.perf_counter() - t0
            out = self._ts_enforce(plan, *args, **kwargs)
        scheduled = out.num_scheduled_tokens
        if scheduled:
            self.ts_step_index += 1
            decodes = self.ts_decoding
            # Each scheduled request's context after the step: vLLM's ``_update_after_schedule`` has advanced its
            # ``num_computed_tokens`` by the tokens scheduled.
            ctx = sum(map(_COMPUTED, map(self.requests.__getitem__, scheduled)))
            predicted = self.ts_cost.predict_s(sum(scheduled.values()), ctx)
            t_ret = time.perf_counter()
            busy = self.ts_busy_until
            self.ts_busy_until = (busy if in_flight and busy > t_ret else t_ret) + predicted
            self.ts_pending[id(out)] = _Pending(self.ts_step_index, plan, decodes, predicted, t_ret, plan_s, ctx)
        return out

    def _ts_native(self) -> bool:
        """Whether vLLM's own scheduler decides this step: the policy is ``vllm`` (vLLM's default) with its
        defaults or the engine's own prefill threshold, which it reproduces step by step
        (``tests/agent/engine/test_vllm_scheduler.py``), so a native step builds no view of a running request,
        asks no plan and sets no caps: the same decisions for a fraction of the CPU on the engine's critical path
        (docs/benchmarks.md)."""
        policy = self.ts_policy
        # A threshold of 0 ("no cap") on an engine with a threshold of its own is native too: vLLM caps each
        # chunk at the engine's threshold anyway, and a policy planning uncapped chunks would leave the budget it
        # planned for them unused, admitting fewer requests than vLLM's own scheduler (found 2026-11-26).
        return (self.ts_native_steps and type(policy) is VllmDefault and not policy.budget_cap
                and policy.threshold in (0, self.scheduler_config.long_prefill_token_threshold))

    def _ts_native_plan(self, out: Any, running_before: int, waiting_before: int) -> StepPlan:
        """A native step's plan, with the ``vllm`` policy's reasons read from what vLLM scheduled. They equal the
        policy's own except in a step where vLLM could not take an admission the policy would have planned (the
        KV blocks ran out, or it preempted): the policy's plan counts what it planned, these count what vLLM did
        (8 of 192 driven runs, all short of KV blocks, differ so; the scheduled tokens never do)."""
        budget = self.ts_max_tokens
        admitted = len(self.running) - running_before + len(out.preempted_req_ids or ())
        num_running = running_before + admitted
        return StepPlan(entries=(), running_order=(), mode=StepMode.IDLE, token_budget=budget, reasons={
            "budget_tokens": budget,
            "unused_budget_tokens": budget - out.total_num_scheduled_tokens,
            "admitted": admitted,
            "waiting_left": waiting_before - admitted,
            "seq_cap_reached": num_running >= self.max_num_running_reqs,
        })

    def _ts_enforce(self, plan: StepPlan, *args: Any, **kwargs: Any) -> Any:
        running = self.running
        order = plan.running_order
        running_ids = tuple(map(_REQUEST_ID, running))
        if running_ids != tuple(order):
            pos = {rid: i for i, rid in enumerate(order)}
            last = len(pos)
            running.sort(key=lambda r: pos.get(r.request_id, last))
        admits = list(filterfalse(set(running_ids).__contains__, map(_FIRST, plan.entries)))
        self.max_num_scheduled_tokens = max(0, min(int(plan.token_budget), self.ts_max_tokens))
        caps = self.ts_caps = dict(plan.entries)
        self.need_mamba_block_aligned_split = self._ts_caps_bind(caps, len(running))
        try:
            if not self.skipped_waiting and len(self.waiting) >= len(admits) and all(
                r.request_id == rid for r, rid in zip(self.waiting, admits, strict=False)
            ):
                # The plan admits the head of the queue in queue order (FCFS): vLLM's own loop takes exactly
                # those, and the next one's cap of 0 ends its admissions.
                return super().schedule(*args, **kwargs)  # type: ignore[misc]
            return self._ts_schedule_reordered(admits, *args, **kwargs)
        finally:
            self.need_mamba_block_aligned_split = False
            self.ts_caps = None
            self.max_num_scheduled_tokens = self.ts_max_tokens

    def _ts_caps_bind(self, caps: dict[str, int], num_running: int) -> bool:
        """Whether the per-request hook must cap this step's requests at their planned tokens. It must not when it
        would change nothing, which spares vLLM a Python call for every request it schedules (~0.3 us each, 70-80 us
        at 256 running): every running request decodes (one token) and is planned at least one, and no waiting
        request can be admitted (vLLM's waiting loop stops at ``max_num_seqs`` before it reaches the hook; a step
        that preempts admits nothing). Then vLLM schedules exactly the plan's tokens on its own."""
        decoding = self.ts_decoding
        if len(decoding) != num_running or (
            num_running + self.num_waiting_for_streaming_input < self.max_num_running_reqs
            and (self.waiting or self.skipped_waiting)
        ):
            return True  # the cheap checks first: a prefill running, or an admission possible
        return not caps.keys() >= decoding or min(caps.values(), default=1) < 1

    def _ts_schedule_reordered(self, admits: list[str], *args: Any, **kwargs: Any) -> Any:
        """Admit ``admits`` in plan order through a temporary waiting queue; the others keep their places."""
        old_waiting = self.waiting
        old_skipped = self.skipped_waiting
        waiting_ids = {r.request_id for r in old_waiting}
        queue = create_request_queue(self.policy)
        admitted: set[str] = set()
        for rid in admits:
            if rid in waiting_ids and rid not in admitted:
                queue.add_request(self.requests[rid])
                admitted.add(rid)
        self.waiting = queue
        self.skipped_waiting = create_request_queue(self.policy)
        try:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            left = list(self.waiting)  # preempted this call (prepended), then admissions vLLM did not take
            left_ids = {r.request_id for r in left}
            merged = create_request_queue(self.policy)
            for r in left:
                if r.request_id not in admitted:
                    merged.add_request(r)
            for r in old_waiting:
                rid = r.request_id
                if rid not in admitted or rid in left_ids:
                    merged.add_request(r)
            newly_skipped = list(self.skipped_waiting)
            self.waiting = merged
            for r in newly_skipped:
                old_skipped.add_request(r)
            self.skipped_waiting = old_skipped

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        t_out = time.perf_counter()
        pending = self.ts_pending.pop(id(scheduler_output), None)
        if self.ts_pending:  # the steps still in flight run from now on
            self.ts_busy_until = t_out + sum(p.predicted_s for p in self.ts_pending.values())
        finishing: dict[str, tuple[int, int]] = {}
        self.ts_finishing = finishing
        try:
            result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        finally:
            self.ts_finishing = None
        if pending is not None:
            self._ts_record(pending, scheduler_output, finishing, t_out)
        return result

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """A request finished or was aborted: the policy's per-request state leaves with it, and while an output is
        applied its output and prompt lengths are kept for the step's record (vLLM forgets the request when it frees
        its blocks, in this call or later)."""
        rid = request.request_id
        finishing = self.ts_finishing
        if finishing is not None:
            finishing[rid] = (request.num_output_tokens, request.num_prompt_tokens)
        self.ts_first_token.pop(rid, None)
        self.ts_slo.pop(rid, None)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    # -- records ----------------------------------------------------------------------------------
    def _ts_record(self, pending: _Pending, out: Any, finishing: dict[str, tuple[int, int]], t_out: float) -> None:
        start = pending.scheduled_s
        if self.ts_last_output_s is not None and self.ts_last_output_s > start:
            start = self.ts_last_output_s
        self.ts_last_output_s = t_out
        measured = max(t_out - start, 1e-6)
        now = time.time()
        scheduled = out.num_scheduled_tokens
        decoded = pending.decode_ids & scheduled.keys()
        dec_tok = sum(map(scheduled.__getitem__, decoded))
        dec_reqs = len(decoded)
        pre_tok = out.total_num_scheduled_tokens - dec_tok
        pre_reqs = len(scheduled) - dec_reqs
        ctx = pending.ctx
        finished_out: list[int] = []
        finished_prompt: list[int] = []
        if finishing:
            for rid in scheduled:  # in the step's order
                lengths = finishing.get(rid)
                if lengths is not None:
                    finished_out.append(lengths[0])
                    finished_prompt.append(lengths[1])
        ft = self.ts_first_token
        started = scheduled.keys() - ft.keys()
        if started:
            get = self.requests.get  # a request that finished has left it (and has no first-token entry to keep)
            for rid in started:
                r = get(rid)
                if r is not None and r.num_output_tokens > 0:
                    ft[rid] = now
        plan = pending.plan
        mode = _mode(pre_tok, dec_tok)
        if self.ts_online and pre_tok + dec_tok:
            self.ts_cost.update(pre_tok + dec_tok, ctx, measured)
        preempted = out.preempted_req_ids or ()
        used_blocks = self.ts_num_blocks - int(self.kv_cache_manager.block_pool.get_num_free_blocks())
        self.ts_policy.observe_step(StepFeedback(
            mode, pre_tok, dec_tok, ctx, pre_reqs + dec_reqs, measured, pending.predicted_s, len(finished_out),
            tuple(finished_out), tuple(finished_prompt), len(self.running) + len(self.waiting),
        ))
        pab = self.ts_policy.admission_budget_tokens()
        # StepRecord's fields by name (agent.engine.vllm.unit.record_from), then extras (docs/records.md).
        self.ts_sink.emit(StepMessage(
            unit_id=self.ts_unit_id,
            step_id=pending.index,
            start_s=now - measured,
            duration_s=measured,
            predicted_s=pending.predicted_s,
            mode=mode,
            policy=self.ts_policy.name,
            num_prefill_tokens=pre_tok,
            num_decode_tokens=dec_tok,
            num_prefill_reqs=pre_reqs,
            num_decode_reqs=dec_reqs,
            context_tokens=ctx,
            budget_tokens=int(plan.token_budget),
            kv_used_blocks=used_blocks,
            num_blocks=self.ts_num_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.skipped_waiting),
            num_preempted=len(preempted),
            num_finished=len(finished_out),
            reasons=dict(plan.reasons),
            preempted=tuple(sorted(preempted)),
            plan_us=round(pending.plan_s * 1e6, 1),
            admission_budget=pab,
            queued_prefill_tokens=self.ts_queued_tokens,
        ))

    # -- control ----------------------------------------------------------------------------------
    @property
    def pause_state(self) -> Any:
        """vLLM's pause state; reading it first applies the control messages that arrived (see the module's
        docstring: the engine core reads it only for ``is_scheduler_paused``, which the agent sends to an idle
        engine to have it look at its control channel)."""
        self._ts_poll_control()
        return super().pause_state  # type: ignore[misc]

    def _ts_poll_control(self) -> None:
        inbox = getattr(self, "ts_inbox", None)  # None before _ts_setup (vLLM's __init__ may read the state)
        if inbox is not None:
            for message in inbox.poll():
                self._ts_control(message)

    def _ts_control(self, message: ControlRequest | FrameError) -> None:
        """Apply a control request and answer it; a frame that did not decode is answered with its error when it
        carried an id (otherwise nobody waits for an answer: logged and skipped)."""
        if isinstance(message, FrameError):
            if message.id is None:
                log.warning("unit %d: control frame skipped: %s", self.ts_unit_id, message)
            else:
                self.ts_sink.emit(ControlReply(unit_id=self.ts_unit_id, id=message.id, ok=False, error=str(message)))
            return
        self.ts_policy, reply = apply_control(self.ts_policy, message, self.ts_unit_id, build_policy)
        self.ts_sink.emit(reply)

    def shutdown(self) -> None:
        self.ts_sink.close()
        if self.ts_inbox is not None:
            self.ts_inbox.close()
        super().shutdown()  # type: ignore[misc]


def _mode(pre_tok: int, dec_tok: int) -> StepMode:
    if pre_tok and dec_tok:
        return StepMode.MIXED
    if pre_tok:
        return StepMode.PREFILL
    return StepMode.DECODE if dec_tok else StepMode.IDLE


class PolicyScheduler(PolicySchedulerMixin, Scheduler):  # type: ignore[misc]
    """vLLM's ``Scheduler`` with a trackside policy (``async_scheduling=False``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ts_setup()


class PolicyAsyncScheduler(PolicySchedulerMixin, AsyncScheduler):  # type: ignore[misc]
    """vLLM's ``AsyncScheduler`` with a trackside policy (the default, ``async_scheduling=True``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ts_setup()


SCHEDULER_PATHS = {
    False: f"{__name__}.PolicyScheduler",
    True: f"{__name__}.PolicyAsyncScheduler",
}
"""Dotted paths for ``scheduler_cls`` by ``async_scheduling`` (vLLM resolves them in the engine-core process)."""

__all__ = ["SCHEDULER_PATHS", "PolicyAsyncScheduler", "PolicyScheduler", "PolicySchedulerMixin"]
