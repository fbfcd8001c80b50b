"""Small helpers shared by batch policies (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from operator import itemgetter

from policies.types import RequestView, ScheduledTokens, StepMode

request_id_of = itemgetter(0)
"""``RequestView.request_id`` (its first field) as a C-level callable, for ``map`` over the running requests."""


def step_mode(entries: Iterable[ScheduledTokens], by_id: Mapping[str, RequestView]) -> StepMode:
    """Classify a step by what its entries compute: decodes, prefill chunks, both or nothing."""
    has_decode = has_prefill = False
    for entry in entries:
        if by_id[entry.request_id].is_decode:
            has_decode = True
        else:
            has_prefill = True
    if has_decode and has_prefill:
        return StepMode.MIXED
    if has_decode:
        return StepMode.DECODE
    if has_prefill:
        return StepMode.PREFILL
    return StepMode.IDLE


def mode_of(has_decode: bool, has_prefill: bool) -> StepMode:
    """The step mode from what a plan schedules."""
    if has_decode:
        return StepMode.MIXED if has_prefill else StepMode.DECODE
    return StepMode.PREFILL if has_prefill else StepMode.IDLE


def chunk(request: RequestView, budget: int, max_model_len: int, threshold: int = 0) -> int:
    """Tokens vLLM would schedule for ``request`` with ``budget`` tokens left.

    The pending tokens, capped by the budget, by ``long_prefill_token_threshold`` when set (> 0), and by
    the model length (a request never computes beyond ``max_model_len - 1`` tokens, as in vLLM).
    """
    n = request.pending_tokens
    if 0 < threshold < n:
        n = threshold
    n = min(n, budget, max_model_len - 1 - request.computed_tokens)
    return max(n, 0)
