"""A simulated engine unit: vLLM v1's continuous-batching mechanics, step times from a calibration profile.

Mechanism (the same for every policy; the policy only plans):

* **Paged KV**: ``num_blocks`` blocks of ``block_size`` tokens. A request holds
  ``ceil(computed_tokens / block_size)`` blocks; a step that computes ``n`` more tokens first allocates the
  blocks for ``computed + n`` tokens.
* **Admission**: a waiting request is admitted only if the KV cache can hold its whole known sequence
  (prompt plus outputs so far), not just its first chunk (the ``full_sequence_must_fit`` admission gate of
  vLLM's KV cache manager), and only while fewer than ``max_num_seqs`` requests run. When an admission
  fails, later waiting entries of the plan are not admitted either (vLLM breaks its waiting loop).
* **Budgets**: a plan may not schedule more than ``max_num_batched_tokens`` tokens, nor more tokens of a
  request than it has pending; violations are policy bugs and raise :class:`PlanError`.
* **Preemption by recompute**: when a running request cannot get its blocks, the lowest-priority running
  request not yet scheduled this step (the tail of ``plan.running_order``) loses its KV, goes back to the
  front of the waiting queue with ``computed_tokens = 0`` and will recompute prompt and outputs; if the
  victim is the request itself, it is skipped. A step that preempted admits no waiting request.
* **Tokens**: a step that brings a request's computed tokens up to its known tokens samples one output
  token at the step's end; the request finishes when it has its target output length (or reaches
  ``max_model_len``) and frees its blocks then. Every token after a request's first updates its worst per-token
  TPOT (a running maximum beside the first token's time: no token times are kept).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

from agent.engine.base import Migrant, PlanError, RequestOutcome, StepRecord, StepResult, SubmittedRequest
from agent.engine.timing import StepTimer
from policies.base import BatchPolicy
from policies.batch.common import mode_of
from policies.cost.step_model import StepCoefficients
from policies.params import ParamValue
from policies.types import RequestView, RunningRequest, StepFeedback, StepPlan, UnitLoad, UnitView

ROLES = ("mixed", "prefill", "decode")
"""Unit roles: ``mixed`` (colocated), or one pool of a disaggregated topology."""


_IGNORES_STEPS = BatchPolicy.observe_step
"""The default :meth:`BatchPolicy.observe_step`, which does nothing with its feedback."""


class _Req:
    """Mutable per-request state inside a unit."""

    __slots__ = (
        "blocks", "computed", "first_token_s", "load_cache", "max_tpot_s", "migrating", "num_preemptions", "output",
        "prompt", "spec", "target", "view_cache",
    )

    def __init__(self, spec: SubmittedRequest) -> None:
        self.spec = spec
        self.prompt = spec.prompt_tokens
        self.target = spec.output_tokens
        self.computed = 0
        self.output = 0
        self.blocks = 0
        self.first_token_s: float | None = None
        self.max_tpot_s: float | None = None
        """The worst per-token TPOT so far (``RequestOutcome.max_tpot_s``)."""
        self.num_preemptions = 0
        self.migrating = False
        self.view_cache: RequestView | None = None
        self.load_cache: RunningRequest | None = None

    def resident(self) -> RunningRequest:
        """The request as a rebalancing dispatcher sees it (rebuilt only when it changed)."""
        c = self.load_cache
        if c is None or c.computed_tokens != self.computed or c.output_tokens != self.output or (
            c.migrating != self.migrating
        ):
            s = self.spec
            c = RunningRequest(
                s.request_id, s.prompt_tokens + self.output, s.prompt_tokens, self.output, self.computed,
                s.arrival_s, self.migrating,
            )
            self.load_cache = c
        return c

    def migrant(self) -> Migrant:
        return Migrant(self.spec, self.output, self.computed, self.first_token_s, self.num_preemptions, self.max_tpot_s)

    def view(self) -> RequestView:
        v = self.view_cache
        if v is None:
            s = self.spec
            v = RequestView(
                s.request_id, s.arrival_s, s.prompt_tokens, self.computed, self.output,
                s.ttft_slo_s, s.tpot_slo_s, self.first_token_s, self.num_preemptions,
            )
            self.view_cache = v
        return v

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.output


class CostModel(Protocol):
    """The policy-side step model (what a policy believes): ``FixedCostModel`` or
    ``policies.cost.fit.OnlineStepModel``."""

    @property
    def coefficients(self) -> StepCoefficients: ...

    def predict_s(self, new_tokens: int, context_tokens: int) -> float: ...

    def update(self, new_tokens: int, context_tokens: int, measured_s: float) -> float: ...


class FixedCostModel:
    """A cost model that never changes."""

    def __init__(self, coefficients: StepCoefficients) -> None:
        self.coefficients = coefficients

    def predict_s(self, new_tokens: int, context_tokens: int) -> float:
        return self.coefficients.predict_s(new_tokens, context_tokens)

    def update(self, new_tokens: int, context_tokens: int, measured_s: float) -> float:
        return 0.0


class SimUnit:
    """One simulated DP unit."""

    def __init__(
        self,
        unit_id: int,
        policy: BatchPolicy,
        timer: StepTimer,
        *,
        block_size: int,
        num_blocks: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        cost_model: CostModel | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        mixed_interference: float = 0.0,
        role: str = "mixed",
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown unit role {role!r} ({', '.join(ROLES)})")
        if min(block_size, num_blocks, max_num_batched_tokens, max_num_seqs, max_model_len) <= 0:
            raise ValueError("unit sizes must be positive")
        if num_blocks * block_size < max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * block_size} tokens, less than max_model_len {max_model_len}: "
                "a long request could never finish"
            )
        self.unit_id = unit_id
        self.policy = policy
        self.timer = timer
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free_blocks = num_blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.cost_model: CostModel = cost_model or FixedCostModel(timer.coefficients)
        self.on_step = on_step
        self.mixed_interference = mixed_interference
        """The calibration profile's mixed-step interference ``kappa``, shown to policies as a prior."""
        self.role = role
        """``prefill``: a request leaves the unit (``StepResult.handoffs``) once its first token is sampled."""
        self.instance: int | None = None
        """Set by the node that groups its units in lockstep (``UnitLoad.instance``)."""
        self.running: list[_Req] = []
        self.waiting: deque[_Req] = deque()
        self.requests: dict[str, _Req] = {}
        self.step_index = 0
        self._inflight: list[tuple[_Req, int]] | None = None
        self._inflight_tokens = 0
        self._inflight_meta: tuple[float, float, float, StepPlan, int, int, int, int, int, int] | None = None
        self._preempted_now: list[str] = []
        self.queued_prefill_tokens = 0
        self.num_migrating = 0
        """Resident requests marked as being transferred (``UnitLoad.migrations_inflight``)."""
        self.last_step_s: float | None = None
        self._step_time_sum = 0.0
        self.num_steps = 0

    # -- intake ---------------------------------------------------------------------------------------
    def submit(self, request: SubmittedRequest, now_s: float) -> None:
        """Queue a request (FCFS behind the waiting queue)."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} is already on unit {self.unit_id}")
        if request.prompt_tokens < 1 or request.output_tokens < 1:
            raise ValueError(f"request {request.request_id}: prompt and output must be >= 1 token")
        if request.prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {request.prompt_tokens} tokens does not fit "
                f"max_model_len {self.max_model_len}"
            )
        req = _Req(request)
        self.requests[request.request_id] = req
        self.waiting.append(req)
        self.queued_prefill_tokens += request.prompt_tokens

    def set_policy(self, policy: BatchPolicy) -> None:
        """Swap the batch policy; takes effect at the next step (never inside one)."""
        self.policy = policy

    def set_policy_params(self, changes: Mapping[str, ParamValue]) -> None:
        """Change live parameters of the batch policy (checked by the caller: ``BatchPolicy.check_params``); they
        apply at the next step."""
        self.policy.apply_params(changes)

    # -- state ----------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._inflight is not None

    @property
    def cost(self) -> StepCoefficients:
        """The policy-side step model's current coefficients."""
        return self.cost_model.coefficients

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def view(self) -> UnitView:
        # Positional, in UnitView's field order: its __init__ is Python (fast_init), and matching keywords cost
        # ~290 ns of ~760 per unit-step.
        return UnitView(
            self.unit_id,  # unit_id
            self.step_index,  # step_index
            tuple([r.view() for r in self.running]),  # running
            tuple([r.view() for r in self.waiting]),  # waiting
            self.block_size,  # block_size
            self.num_blocks,  # num_blocks
            self.free_blocks,  # free_blocks
            self.max_num_batched_tokens,  # max_num_batched_tokens
            self.max_num_seqs,  # max_num_seqs
            self.max_model_len,  # max_model_len
            self.cost_model.coefficients,  # cost
            self.mixed_interference,  # mixed_interference
        )

    def running_views(self) -> tuple[RequestView, ...]:
        """The running requests as policies see them (cached views: cheap between steps)."""
        return tuple([r.view() for r in self.running])

    def load(self, with_requests: bool = False) -> UnitLoad:
        kv_tokens = sum(r.computed for r in self.running)
        resident = tuple(r.resident() for r in (*self.running, *self.waiting)) if with_requests else ()
        # Positional, in UnitLoad's field order (its __init__ is Python): built for every unit at every dispatch, where
        # matching 21 keywords cost more than the rest of the call.
        return UnitLoad(
            self.unit_id,  # unit_id
            True,  # healthy
            len(self.running),  # num_running
            len(self.waiting),  # num_waiting
            self.num_blocks - self.free_blocks,  # kv_used_blocks
            self.num_blocks,  # num_blocks
            kv_tokens,  # kv_tokens
            self.queued_prefill_tokens,  # queued_prefill_tokens
            self.last_step_s,  # last_step_s
            self._step_time_sum / self.num_steps if self.num_steps else None,  # mean_step_s
            self.policy.admission_budget_tokens(),  # prefill_admission_budget
            self.max_num_seqs,  # max_num_seqs
            self.role,  # role
            self.num_steps,  # steps_done
            self._inflight is not None,  # busy
            self._inflight_tokens,  # inflight_tokens
            self.max_num_batched_tokens,  # chunk_tokens
            self.block_size,  # block_size
            self.num_migrating,  # migrations_inflight
            resident,  # requests
            self.instance,  # instance
        )

    # -- moving requests between units -------------------------------------------------------------
    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def stepping(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        return req is not None and self._inflight is not None and any(r is req for r, _ in self._inflight)

    def set_migrating(self, request_id: str, migrating: bool) -> None:
        req = self.requests[request_id]
        if req.migrating != migrating:
            self.num_migrating += 1 if migrating else -1
            req.migrating = migrating

    def detach(self, request_id: str) -> Migrant:
        """Take a resident request off the unit, freeing its blocks (its KV leaves with the migrant)."""
        if self.stepping(request_id):
            raise RuntimeError(f"unit {self.unit_id}: {request_id} is in the step in flight")
        req = self.requests.pop(request_id)
        if req.migrating:
            self.num_migrating -= 1
        self.queued_prefill_tokens -= _outstanding_prefill(req)
        self.free_blocks += req.blocks
        req.blocks = 0
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        return req.migrant()

    def attach(self, migrant: Migrant, now_s: float) -> bool:
        """Take over ``migrant``: with its KV into the running set when blocks and a sequence slot are free,
        otherwise at the back of the waiting queue to recompute prompt and outputs (vLLM's recompute path)."""
        s = migrant.spec
        if s.request_id in self.requests:
            raise ValueError(f"request {s.request_id} is already on unit {self.unit_id}")
        if migrant.num_tokens >= self.max_model_len:
            raise ValueError(f"request {s.request_id}: {migrant.num_tokens} tokens exceed max_model_len")
        req = _Req(s)
        req.output = migrant.output_tokens
        req.first_token_s = migrant.first_token_s
        req.max_tpot_s = migrant.max_tpot_s
        req.num_preemptions = migrant.num_preemptions
        blocks = self._blocks_for(migrant.computed_tokens)
        kept = (
            migrant.computed_tokens > 0
            and blocks <= self.free_blocks
            and len(self.running) < self.max_num_seqs
            and migrant.num_tokens - migrant.computed_tokens <= 1
        )
        self.requests[s.request_id] = req
        if kept:
            req.computed = migrant.computed_tokens
            self._allocate(req, blocks)
            self.running.append(req)
        else:
            self.waiting.append(req)
        self.queued_prefill_tokens += _outstanding_prefill(req)
        return kept

    def evacuate(self) -> list[Migrant]:
        """The unit failed: the step in flight is lost, and so is every request's KV."""
        out = [r.migrant().without_kv() for r in (*self.running, *self.waiting)]
        self.running.clear()
        self.waiting.clear()
        self.requests.clear()
        self.num_migrating = 0
        self.free_blocks = self.num_blocks
        self.queued_prefill_tokens = 0
        self._inflight = None
        self._inflight_meta = None
        self._inflight_tokens = 0
        return out

    # -- one step -------------------------------------------------------------------------------------
    def begin_step(self, now_s: float) -> float | None:
        """Ask the policy for a plan, enforce it, and return the step's duration (None: nothing runs)."""
        if self._inflight is not None:
            raise RuntimeError(f"unit {self.unit_id}: a step is already in flight")
        if not self.running and not self.waiting:
            return None
        plan = self.policy.plan(self.view(), now_s)
        scheduled = self._enforce(plan)
        if not scheduled:
            return None
        new = ctx = pre_tok = dec_tok = pre_reqs = dec_reqs = 0
        contexts: list[int] | None = [] if self.timer.heterogeneity else None
        for req, n in scheduled:
            k = req.computed
            c = k + n
            new += n
            ctx += c
            if contexts is not None:
                contexts.append(c)
            if n == 1 and req.output > 0 and req.prompt + req.output - k == 1:
                dec_tok += 1
                dec_reqs += 1
            else:
                pre_tok += n
                pre_reqs += 1
        duration = self.timer.duration_s(new, ctx, len(scheduled), contexts, decode_tokens=dec_tok)
        predicted = self.cost_model.predict_s(new, ctx)
        self._inflight = scheduled
        self._inflight_tokens = new
        self._inflight_meta = (now_s, duration, predicted, plan, new, ctx, pre_tok, dec_tok, pre_reqs, dec_reqs)
        return duration

    def _enforce(self, plan: StepPlan) -> list[tuple[_Req, int]]:
        requests = self.requests
        running_ids = {r.spec.request_id for r in self.running}
        if len(plan.running_order) != len(running_ids) or set(plan.running_order) != running_ids:
            raise PlanError(f"{self.policy.name}: running_order must list every running request once")
        planned = 0
        for _, n in plan.entries:  # StepPlan.num_tokens, summed here in compiled code (the property is Python)
            planned += n
        if planned > self.max_num_batched_tokens:
            raise PlanError(
                f"{self.policy.name}: planned {planned} tokens, above max_num_batched_tokens "
                f"{self.max_num_batched_tokens}"
            )
        self.running = [requests[rid] for rid in plan.running_order]
        order = list(self.running)
        scheduled: list[tuple[_Req, int]] = []
        taken: set[str] = set()
        preempted: list[str] = []
        preempted_set: set[str] = set()
        admitting_stopped = False
        waiting_admitted: list[_Req] = []
        for rid, n in plan.entries:
            req = requests.get(rid)
            if req is None:
                raise PlanError(f"{self.policy.name}: unknown request {rid}")
            if rid in taken:
                raise PlanError(f"{self.policy.name}: request {rid} scheduled twice in one step")
            pending = req.prompt + req.output - req.computed
            if n <= 0 or n > pending:
                raise PlanError(f"{self.policy.name}: {n} tokens for {rid}, which has {pending} pending")
            if rid in running_ids:
                if rid in preempted_set:
                    continue
                need = self._blocks_for(req.computed + n) - req.blocks
                while need > self.free_blocks:
                    victim = self._pick_victim(order, taken)
                    if victim is None:
                        break
                    self._preempt(victim)
                    order.remove(victim)
                    preempted.append(victim.spec.request_id)
                    preempted_set.add(victim.spec.request_id)
                    if victim is req:
                        break
                if rid in preempted_set or need > self.free_blocks:
                    continue
                self._allocate(req, need)
                scheduled.append((req, n))
                taken.add(rid)
            else:
                if preempted or admitting_stopped:
                    continue
                if len(self.running) + len(waiting_admitted) >= self.max_num_seqs:
                    admitting_stopped = True
                    continue
                whole = self._blocks_for(req.num_tokens) - req.blocks
                if whole > self.free_blocks:
                    admitting_stopped = True
                    continue
                self._allocate(req, self._blocks_for(req.computed + n) - req.blocks)
                waiting_admitted.append(req)
                scheduled.append((req, n))
                taken.add(rid)
        if waiting_admitted:
            admitted_ids = {id(r) for r in waiting_admitted}
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted_ids)
            self.running.extend(waiting_admitted)
        self._preempted_now = preempted
        return scheduled

    def _pick_victim(self, order: list[_Req], taken: set[str]) -> _Req | None:
        for req in reversed(order):
            if req.spec.request_id not in taken:
                return req
        return None

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _allocate(self, req: _Req, blocks: int) -> None:
        if blocks > 0:
            self.free_blocks -= blocks
            req.blocks += blocks

    def _preempt(self, req: _Req) -> None:
        before = _outstanding_prefill(req)
        self.free_blocks += req.blocks
        req.blocks = 0
        req.computed = 0
        req.num_preemptions += 1
        req.view_cache = None
        self.queued_prefill_tokens += _outstanding_prefill(req) - before
        self.running.remove(req)
        self.waiting.appendleft(req)

    def end_step(self, now_s: float) -> StepResult:
        """Finish the in-flight step at ``now_s``: sample tokens, finish requests, record the step."""
        if self._inflight is None or self._inflight_meta is None:
            raise RuntimeError(f"unit {self.unit_id}: no step in flight")
        scheduled = self._inflight
        start_s, _, predicted, plan, new, ctx, pre_tok, dec_tok, pre_reqs, dec_reqs = self._inflight_meta
        self._inflight = None
        self._inflight_meta = None
        self._inflight_tokens = 0
        finished: list[RequestOutcome] = []
        first_tokens: list[str] = []
        done: list[_Req] = []
        queued = self.queued_prefill_tokens
        max_model_len = self.max_model_len
        for req, n in scheduled:
            queued -= _outstanding_prefill(req)
            prompt, out, computed = req.prompt, req.output, req.computed
            computed += n
            req.computed = computed
            req.view_cache = None
            if computed == prompt + out:
                out += 1
                req.output = out
                first = req.first_token_s
                if first is None:
                    req.first_token_s = now_s
                    first_tokens.append(req.spec.request_id)
                else:  # the worst per-token TPOT, as a running maximum (agent.engine.base.token_tpot_s)
                    tpot = (now_s - first) / (out - 1)
                    worst = req.max_tpot_s
                    if worst is None or tpot > worst:
                        req.max_tpot_s = tpot
                if out >= req.target or prompt + out >= max_model_len:
                    done.append(req)
            queued += _outstanding_prefill(req)
        self.queued_prefill_tokens = queued
        for req in done:
            s = req.spec
            self.free_blocks += req.blocks
            req.blocks = 0
            self.running.remove(req)
            del self.requests[s.request_id]
            if req.migrating:  # finished on its source while its KV was being copied
                self.num_migrating -= 1
            assert req.first_token_s is not None
            finished.append(
                RequestOutcome(
                    s.request_id, self.unit_id, s.arrival_s, req.first_token_s, now_s, s.prompt_tokens,
                    req.output, req.num_preemptions, s.ttft_slo_s, s.tpot_slo_s, req.max_tpot_s,
                )
            )
        measured = now_s - start_s
        self.cost_model.update(new, ctx, measured)
        mode = mode_of(dec_tok > 0, pre_tok > 0)
        policy = self.policy
        if type(policy).observe_step is not _IGNORES_STEPS:  # no feedback built for a policy that ignores it
            policy.observe_step(
                StepFeedback(
                    mode, pre_tok, dec_tok, ctx, len(scheduled), measured, predicted, len(finished),
                    tuple([o.output_tokens for o in finished]), tuple([o.prompt_tokens for o in finished]),
                    len(self.running) + len(self.waiting),
                )
            )
        self.last_step_s = measured
        self._step_time_sum += measured
        self.num_steps += 1
        record = StepRecord(
            unit_id=self.unit_id,
            step_id=self.step_index,
            start_s=start_s,
            duration_s=measured,
            predicted_s=predicted,
            mode=mode,
            policy=self.policy.name,
            num_prefill_tokens=pre_tok,
            num_decode_tokens=dec_tok,
            num_prefill_reqs=pre_reqs,
            num_decode_reqs=dec_reqs,
            context_tokens=ctx,
            budget_tokens=plan.token_budget,
            kv_used_blocks=self.num_blocks - self.free_blocks,
            num_blocks=self.num_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted=len(self._preempted_now),
            num_finished=len(finished),
            reasons=plan.reasons,
        )
        self.step_index += 1
        if self.on_step is not None:
            self.on_step(record)
        handoffs: tuple[Migrant, ...] = ()
        if self.role == "prefill":
            # Every request that has sampled a token and is now decoding leaves (a first token, or the next
            # token of a request that recomputed here after a fault).
            leaving = [r.spec.request_id for r in self.running if r.output > 0 and r.num_tokens - r.computed == 1]
            handoffs = tuple(self.detach(rid) for rid in leaving)
        return StepResult(record, tuple(finished), tuple(self._preempted_now), tuple(first_tokens), handoffs)


def _outstanding_prefill(req: _Req) -> int:
    """Tokens ``req`` must still prefill (or recompute) before it decodes; 0 in decode state."""
    pending = req.num_tokens - req.computed
    return 0 if (req.output > 0 and pending == 1) else pending


# PlanError lives in base.py and is re-exported here: mypyc (setup.py) compiles no subclass of a built-in exception.
__all__ = ["CostModel", "FixedCostModel", "PlanError", "SimUnit"]
