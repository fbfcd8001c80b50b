"""Baseline dispatch: ``round_robin`` and ``least_loaded`` (POLICIES.md 2.1).

Both place every pending request at once. ``least_loaded`` scores a unit ``4 * waiting + running`` (the
score of vLLM's DP load balancer) and takes the minimum, lowest unit id on ties; within one decision it
counts its own placements, so a burst is spread instead of piling onto one unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from policies.base import DispatchPolicy
from policies.params import ParamSpec
from policies.types import DispatchDecision, PendingRequest, UnitLoad


class RoundRobin(DispatchPolicy):
    """Healthy units in turn."""

    name: ClassVar[str] = "round_robin"
    summary: ClassVar[str] = "each request to the next healthy unit in turn"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = ()

    def configure(self) -> None:
        self._next = 0

    def dispatch(
        self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float
    ) -> DispatchDecision:
        healthy = sorted(u.unit_id for u in units if u.healthy)
        if not healthy:
            return DispatchDecision(reasons={"no_healthy_unit": True})
        out: list[tuple[str, int]] = []
        for req in pending:
            unit = next((u for u in healthy if u >= self._next), healthy[0])
            out.append((req.request_id, unit))
            self._next = unit + 1
        return DispatchDecision(assignments=tuple(out), reasons={"placed": len(out)})


class LeastLoaded(DispatchPolicy):
    """Minimum of ``waiting_weight * waiting + running``."""

    name: ClassVar[str] = "least_loaded"
    summary: ClassVar[str] = "each request to the unit with the lowest 4*waiting + running (vLLM's DP LB score)"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (
        ParamSpec("waiting_weight", "float", 4.0, "weight of a waiting request in the load score", min=0.0),
    )

    def configure(self) -> None:
        self.waiting_weight = float(self.params["waiting_weight"])

    def dispatch(
        self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float
    ) -> DispatchDecision:
        loads = {u.unit_id: (u.num_waiting, u.num_running) for u in units if u.healthy}
        if not loads:
            return DispatchDecision(reasons={"no_healthy_unit": True})
        out: list[tuple[str, int]] = []
        for req in pending:
            unit = min(loads, key=lambda k: (self.waiting_weight * loads[k][0] + loads[k][1], k))
            waiting, running = loads[unit]
            loads[unit] = (waiting + 1, running)
            out.append((req.request_id, unit))
        return DispatchDecision(assignments=tuple(out), reasons={"placed": len(out)})
