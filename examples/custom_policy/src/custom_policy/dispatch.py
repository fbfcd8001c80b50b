"""``least_tokens``: a dispatch policy that sends each request to the unit with the least token work.

A unit's work is the prompt tokens dispatched to it and not yet computed, plus ``kv_weight`` times the tokens its
running requests hold in KV (a long context slows every decode step of the unit). Each pending request goes to the
healthy unit with the least work, lowest unit id on ties, and its prompt counts on that unit at once: a burst spreads
over the units instead of piling onto the one that looked idle.

Written against trackside's public policy API only (``docs/extending.md``): frozen :class:`PendingRequest` and
:class:`UnitLoad` snapshots and the time in, a :class:`DispatchDecision` with its reasons out; no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from policies.base import DispatchPolicy
from policies.params import ParamSpec
from policies.types import DispatchDecision, PendingRequest, UnitLoad


class LeastTokens(DispatchPolicy):
    """Each request to the healthy unit with the fewest queued prefill tokens plus weighted KV tokens."""

    name: ClassVar[str] = "least_tokens"
    summary: ClassVar[str] = "each request to the unit with the least queued prefill + kv_weight x KV tokens"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (
        ParamSpec(
            "kv_weight", "float", 0.1, "weight of a token held in KV against a prompt token still to compute",
            min=0.0, max=100.0,
        ),
    )

    def configure(self) -> None:
        self.kv_weight = float(self.params["kv_weight"])

    def dispatch(
        self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float
    ) -> DispatchDecision:
        work = {u.unit_id: u.queued_prefill_tokens + self.kv_weight * u.kv_tokens for u in units if u.healthy}
        if not work:
            return DispatchDecision(reasons={"no_healthy_unit": True})
        assignments: list[tuple[str, int]] = []
        for req in pending:
            unit = min(work, key=lambda k: (work[k], k))
            work[unit] += req.prompt_tokens
            assignments.append((req.request_id, unit))
        return DispatchDecision(
            assignments=tuple(assignments),
            reasons={"placed": len(assignments), "spread_tokens": round(max(work.values()) - min(work.values()))},
        )
