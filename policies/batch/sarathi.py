"""``sarathi``: stall-free, decode-first batching with a fixed token budget (POLICIES.md 1.3).

Every step takes every running decode (one token each), then fills what is left of a fixed token budget
``tau`` with prefill chunks: requests already prefilling first (admission order), then waiting requests
FCFS. A decode is never left out for a prefill, so a step's time is bounded by the budget, not by a
prefill burst (Sarathi-Serve's stall-free batching; FairBatching, seed 003, section 2, calls it the
decode-prioritizing baseline).

Choosing ``tau``. Sarathi-Serve profiles the largest budget whose step stays under the TBT target; here
the unit's step model ``T = a + b * new + c * ctx`` (POLICIES.md 4) gives it directly. A step of ``tau``
tokens over a batch that already holds ``C`` context tokens (``reference_context_tokens``: what the running
decodes typically carry) plus the ``tau`` new ones costs ``a + b * tau + c * (C + tau)``; setting that equal
to the target ``T*`` gives

    tau = floor((T* - a - c * C) / (b + c))

On the H100 8B profile (a = 9.1 ms, b = 24 us, c = 44 ns), T* = 50 ms and C = 32,768 give tau = 1,638
tokens. ``tau`` is fixed: computed once from the cost model the unit reports at the first step (the
calibrated prior) and again only when a parameter changes, never step by step (that is FairBatching's
adaptive time budget). ``token_budget`` > 0 overrides the derivation. The budget never exceeds the unit's
``max_num_batched_tokens``; when running decodes alone exceed ``tau`` they all still run (the unit's hard
cap permitting) and no prefill does.
"""

from __future__ import annotations

from typing import ClassVar

from policies._compiled import mypyc_attr
from policies.base import BatchPolicy
from policies.batch.common import chunk, mode_of, request_id_of
from policies.cost.step_model import StepCoefficients
from policies.params import MAX_CONTEXT_TOKENS, MAX_STEP_TOKENS, ParamSpec
from policies.types import RequestView, ScheduledTokens, StepPlan, UnitView


def budget_for_target(cost: StepCoefficients, target_s: float, context_tokens: int, cap: int) -> int:
    """Largest token count ``tau`` with ``a + b*tau + c*(context + tau) <= target`` (at least 1, at most cap)."""
    per_token = cost.b_s + cost.c_s
    room = target_s - cost.a_s - cost.c_s * context_tokens
    if per_token <= 0:
        return cap
    return max(1, min(cap, int(room // per_token)))


@mypyc_attr(allow_interpreted_subclasses=True)  # plugins subclass shipped policies
class Sarathi(BatchPolicy):
    """Decode-first with a fixed token budget derived from a TBT target."""

    name: ClassVar[str] = "sarathi"
    summary: ClassVar[str] = "Sarathi stall-free batching: all decodes every step, prefill chunks fill a fixed budget"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (
        ParamSpec(
            "tbt_target_ms", "float", 50.0, "step-time (TBT) target the token budget is derived from",
            unit="ms", min=1.0, max=10_000.0,
        ),
        ParamSpec(
            "reference_context_tokens", "int", 32_768,
            "context the running decodes are assumed to hold when deriving the budget", unit="tokens", min=0,
            max=MAX_CONTEXT_TOKENS,
        ),
        ParamSpec(
            "token_budget", "int", 0, "fixed token budget per step; 0 = derive it from tbt_target_ms",
            unit="tokens", min=0, max=MAX_STEP_TOKENS,
        ),
    )

    def configure(self) -> None:
        self.target_s = float(self.params["tbt_target_ms"]) / 1e3
        self.reference_context = int(self.params["reference_context_tokens"])
        self.fixed_budget = int(self.params["token_budget"])
        self.tau: int | None = None
        """The budget in force; derived at the next step after a (re)configuration."""

    def _budget(self, unit: UnitView) -> int:
        if self.tau is None:
            cap = unit.max_num_batched_tokens
            if self.fixed_budget:
                self.tau = min(self.fixed_budget, cap)
            else:
                self.tau = budget_for_target(unit.cost, self.target_s, self.reference_context, cap)
        return self.tau

    def plan(self, unit: UnitView, now_s: float) -> StepPlan:
        tau = self._budget(unit)
        cap = unit.max_num_batched_tokens
        entries: list[ScheduledTokens] = []
        decodes = 0
        prefilling: list[RequestView] = []
        new = tuple.__new__
        for req in unit.running:  # the hot loop: is_decode inlined, RequestView's fields unpacked in order
            rid, _, prompt, computed, out, _, _, _, _ = req
            if out > 0 and prompt + out - computed == 1:
                if decodes < cap:
                    entries.append(new(ScheduledTokens, (rid, 1)))
                    decodes += 1
            else:
                prefilling.append(req)
        budget = tau - decodes
        chunks = prefill_tokens = 0
        for req in prefilling:
            if budget <= 0:
                break
            n = chunk(req, budget, unit.max_model_len)
            if n:
                entries.append(ScheduledTokens(req.request_id, n))
                budget -= n
                chunks += 1
                prefill_tokens += n
        num_running = len(unit.running)
        admitted = 0
        for req in unit.waiting:
            if budget <= 0 or num_running >= unit.max_num_seqs:
                break
            n = chunk(req, budget, unit.max_model_len)
            if n <= 0:
                break
            entries.append(ScheduledTokens(req.request_id, n))
            budget -= n
            num_running += 1
            admitted += 1
            prefill_tokens += n
        return StepPlan(  # positional: entries, running_order, mode, token_budget, reasons (a Python
            # __init__: keywords cost ~175 ns more per step)
            tuple(entries),
            tuple(map(request_id_of, unit.running)),
            mode_of(decodes > 0, chunks + admitted > 0),
            tau,
            {
                "budget_tokens": tau,
                "decodes": decodes,
                "decodes_over_budget": max(decodes - tau, 0),
                "prefill_chunks": chunks,
                "admitted": admitted,
                "prefill_tokens": prefill_tokens,
                "unused_budget_tokens": max(budget, 0),
                "waiting_left": len(unit.waiting) - admitted,
            },
        )
