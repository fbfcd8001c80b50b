"""Baseline dispatch: ``round_robin`` and ``least_loaded`` (POLICIES.md 2.1).

Both place every pending request at once. ``least_loaded`` scores a unit ``4 * waiting + running`` (the
score of vLLM's DP load balancer) and takes the minimum, lowest unit id on ties; within one decision it
counts its own placements, so a burst is spread instead of piling onto one unit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import ClassVar

from policies._compiled import mypyc_attr
from policies.base import DispatchPolicy
from policies.params import ParamSpec
from policies.types import DispatchDecision, HandoffRequest, PendingRequest, UnitLoad


@mypyc_attr(allow_interpreted_subclasses=True)  # plugins subclass shipped policies
class RoundRobin(DispatchPolicy):
    """Healthy units in turn."""

    name: ClassVar[str] = "round_robin"
    summary: ClassVar[str] = "each request to the next healthy unit in turn"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = ()

    def configure(self) -> None:
        self._next = 0
        self._next_decode = 0

    def dispatch(
        self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float
    ) -> DispatchDecision:
        healthy = sorted(u.unit_id for u in units if u.healthy)
        if not healthy:
            return DispatchDecision(reasons={"no_healthy_unit": True})
        out, self._next = _in_turn([r.request_id for r in pending], healthy, self._next)
        return DispatchDecision(assignments=tuple(out), reasons={"placed": len(out)})

    def place_decode(
        self, handoffs: Sequence[HandoffRequest], units: Sequence[UnitLoad], now_s: float
    ) -> tuple[tuple[str, int], ...]:
        """The decode pool in turn as well (its own position in the turn)."""
        healthy = sorted(u.unit_id for u in units if u.healthy) or sorted(u.unit_id for u in units)
        out, self._next_decode = _in_turn([h.request_id for h in handoffs], healthy, self._next_decode)
        return tuple(out)


def _in_turn(request_ids: Sequence[str], unit_ids: Sequence[int], start: int) -> tuple[list[tuple[str, int]], int]:
    """Each request to the next unit id at or after ``start`` (wrapping); returns the placements and the next start."""
    out: list[tuple[str, int]] = []
    for rid in request_ids:
        unit = next((u for u in unit_ids if u >= start), unit_ids[0])
        out.append((rid, unit))
        start = unit + 1
    return out, start


VLLM_WAITING_WEIGHT = 4.0
"""The weight of a waiting request in vLLM's DP load balancer's score."""


class LoadScores:
    """vLLM's DP load balancer's score of each unit, ``waiting_weight * waiting + running``, kept through one dispatch
    decision: a request placed on a unit counts as waiting there (``least_loaded``; cascade inside a stage)."""

    __slots__ = ("loads", "waiting_weight")

    def __init__(self, units: Iterable[UnitLoad], waiting_weight: float = VLLM_WAITING_WEIGHT) -> None:
        self.loads: dict[int, list[int]] = {u.unit_id: [u.num_waiting, u.num_running] for u in units}
        """Unit id -> [waiting, running], this decision's placements included."""
        self.waiting_weight = waiting_weight

    def place(self, candidates: Iterable[int]) -> int:
        """The candidate with the lowest score, lowest id on ties; the placement is counted."""
        loads, weight = self.loads, self.waiting_weight
        unit = min(candidates, key=lambda k: (weight * loads[k][0] + loads[k][1], k))
        loads[unit][0] += 1
        return unit


@mypyc_attr(allow_interpreted_subclasses=True)  # plugins subclass shipped policies
class LeastLoaded(DispatchPolicy):
    """Minimum of ``waiting_weight * waiting + running``."""

    name: ClassVar[str] = "least_loaded"
    summary: ClassVar[str] = "each request to the unit with the lowest 4*waiting + running (vLLM's DP LB score)"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (
        ParamSpec("waiting_weight", "float", VLLM_WAITING_WEIGHT, "weight of a waiting request in the load score",
                  min=0.0, max=1000.0),
    )

    def configure(self) -> None:
        self.waiting_weight = float(self.params["waiting_weight"])

    def dispatch(
        self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float
    ) -> DispatchDecision:
        if not any(u.healthy for u in units):
            return DispatchDecision(reasons={"no_healthy_unit": True})
        out = self._least_loaded([r.request_id for r in pending], units)
        return DispatchDecision(assignments=tuple(out), reasons={"placed": len(out)})

    def place_decode(
        self, handoffs: Sequence[HandoffRequest], units: Sequence[UnitLoad], now_s: float
    ) -> tuple[tuple[str, int], ...]:
        """The same score over the decode pool (every unit when none is healthy: the KV exists already)."""
        pool = [u for u in units if u.healthy] or [replace(u, healthy=True) for u in units]
        return tuple(self._least_loaded([h.request_id for h in handoffs], pool))

    def _least_loaded(self, request_ids: Sequence[str], units: Sequence[UnitLoad]) -> list[tuple[str, int]]:
        scores = LoadScores((u for u in units if u.healthy), self.waiting_weight)
        return [(rid, scores.place(scores.loads)) for rid in request_ids]

