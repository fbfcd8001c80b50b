"""``short_first``: a batch policy that admits the shortest waiting prompts first, with aging.

Every step, the running requests go first, oldest admission first (a decode takes its one token, a request still
prefilling takes what is left of the budget, in chunks of at most ``max_chunk_tokens``). Then waiting requests are
admitted while the token budget and ``max_num_seqs`` allow, fewest prompt tokens still to compute first (shortest job
first: the TTFT of short requests stops depending on the long ones ahead of them), except that a request that has
waited ``max_wait_ms`` or more goes ahead of every fresh one, oldest first (aging: a long prompt is passed over for a
bounded time, not forever).

Written against trackside's public policy API only (``docs/extending.md``): a frozen :class:`UnitView` and the time
in, a :class:`StepPlan` with its reasons out; no I/O, no clock (``now_s`` is the node's time), state only in
``configure()``.
"""

from __future__ import annotations

from typing import ClassVar

from policies.base import BatchPolicy
from policies.params import MAX_SLO_MS, MAX_STEP_TOKENS, ParamSpec
from policies.types import RequestView, ScheduledTokens, StepMode, StepPlan, UnitView


class ShortFirst(BatchPolicy):
    """Running requests first, then the shortest waiting prompts, a request waiting too long ahead of them."""

    name: ClassVar[str] = "short_first"
    summary: ClassVar[str] = "running first, then the shortest waiting prompts first; one waiting max_wait_ms goes ahead"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (
        ParamSpec(
            "max_wait_ms", "float", 2000.0, "a request waiting this long is admitted before shorter ones (aging)",
            unit="ms", min=0.0, max=MAX_SLO_MS,
        ),
        ParamSpec(
            "max_chunk_tokens", "int", 0, "cap on one request's prefill chunk per step; 0 = no cap", unit="tokens",
            min=0, max=MAX_STEP_TOKENS,
        ),
    )

    def configure(self) -> None:
        self.max_wait_s = float(self.params["max_wait_ms"]) / 1000.0
        self.max_chunk = int(self.params["max_chunk_tokens"])

    def plan(self, unit: UnitView, now_s: float) -> StepPlan:
        budget_total = unit.max_num_batched_tokens
        budget = budget_total
        entries: list[ScheduledTokens] = []
        num_decodes = num_prefills = 0
        for req in unit.running:
            n = self._tokens(req, budget, unit)
            if n <= 0:
                continue
            entries.append(ScheduledTokens(req.request_id, n))
            budget -= n
            if req.is_decode:
                num_decodes += 1
            else:
                num_prefills += 1
        aged = [r for r in unit.waiting if now_s - r.arrival_s >= self.max_wait_s]
        fresh = [r for r in unit.waiting if now_s - r.arrival_s < self.max_wait_s]
        order = sorted(aged, key=lambda r: r.arrival_s) + sorted(fresh, key=lambda r: (r.pending_tokens, r.arrival_s))
        seats = unit.max_num_seqs - len(unit.running)
        admitted = admitted_aged = 0
        for req in order:
            if admitted >= seats:
                break
            n = self._tokens(req, budget, unit)
            if n <= 0:
                break
            entries.append(ScheduledTokens(req.request_id, n))
            budget -= n
            admitted += 1
            num_prefills += 1
            if now_s - req.arrival_s >= self.max_wait_s:
                admitted_aged += 1
        return StepPlan(
            entries=tuple(entries),
            running_order=tuple(r.request_id for r in unit.running),
            mode=_mode(num_decodes > 0, num_prefills > 0),
            token_budget=budget_total,
            reasons={
                "admitted": admitted,
                "admitted_aged": admitted_aged,
                "waiting_aged": len(aged),
                "num_decodes": num_decodes,
                "unused_budget_tokens": budget,
            },
        )

    def _tokens(self, req: RequestView, budget: int, unit: UnitView) -> int:
        """Tokens to compute for ``req`` this step: what it has pending, capped by the chunk size, the budget left and
        the model length (a request never computes past ``max_model_len - 1`` tokens)."""
        n = req.pending_tokens
        if self.max_chunk and not req.is_decode:
            n = min(n, self.max_chunk)
        return max(0, min(n, budget, unit.max_model_len - 1 - req.computed_tokens))


def _mode(has_decode: bool, has_prefill: bool) -> StepMode:
    if has_decode:
        return StepMode.MIXED if has_prefill else StepMode.DECODE
    return StepMode.PREFILL if has_prefill else StepMode.IDLE
