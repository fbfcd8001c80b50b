"""``pab``: FairBatching's admission-budget load balancer (seed 003 section 3.4; POLICIES.md 2.3).

Every unit whose batch policy computes a prefill admission budget (PAB, in tokens) reports it in
``UnitLoad.prefill_admission_budget``. The balancer keeps a local copy per unit and, for each pending
request in arrival order, picks the unit whose budget covers the prompt with the largest remaining
budget, then subtracts the prompt from that unit's copy, so that several requests in one call do not all
land on the same unit. A request that no unit can take waits (``when_full=wait``; smaller requests behind
it may still be placed) or is rejected (``when_full=reject``).

Refreshing the local copy. The copy is replaced by the reported value when the unit reports a new step
(``steps_done`` changed) *or* when the reported value itself changed. The second rule matters because
FairBatching's own exported budget already subtracts the prompts its unit accepted since its last step:
a node that reads loads afresh at each call then shows our decrement in the report, and adopting it
avoids subtracting twice; a node whose reports lag keeps our decremented copy until a new report.

Units without a budget (``None``: their batch policy has no PAB, or a FairBatching unit that has never
received a request) are handled as follows, in order of preference for a request:

1. a unit whose copy covers the prompt (``budget >= prompt``), or an *idle* unit without a budget (no
   running, no waiting, no step in flight and nothing placed on it in this call), which is as free as a
   unit can be: the largest budget first, idle units without a budget counting as infinite;
2. a busy unit without a budget, scored like ``least_loaded`` (``waiting_weight * waiting + running``,
   counting this call's placements);
3. with ``idle_takes_any``: an idle unit whose budget is too small. A prompt larger than an empty unit's
   budget would otherwise wait forever in ``wait`` mode (no step would ever change the budgets); serving it
   late on an idle unit is better than holding or refusing it there.

Ties go to the lower load score, then the lower unit id. Liveness in ``wait`` mode: a held request waits
for a step report (``wants_step_reports``), which comes as long as some candidate unit has work; when none
has any, rule 3 places it. ``recheck_ms`` adds a periodic wake-up as a safety net for nodes whose reports
can be lost. A prompt larger than every busy unit's budget can still wait a long time under sustained load;
``when_full=reject`` is the overload answer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from policies.base import DispatchPolicy
from policies.params import ParamSpec, ParamValue
from policies.types import DispatchDecision, PendingRequest, ReasonValue, UnitLoad


@dataclass(slots=True)
class _Budget:
    """The local view of one unit's budget."""

    steps_seen: int
    reported: float | None
    local: float | None
    """Reported budget minus what this balancer placed since (None: the unit reports none)."""


class PabBalancer(DispatchPolicy):
    """Each request to the unit with the largest prefill admission budget that covers its prompt."""

    name: ClassVar[str] = "pab"
    summary: ClassVar[str] = "FairBatching's balancer: each request to the unit whose admission budget covers it"
    wants_step_reports: ClassVar[bool] = True
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (
        ParamSpec(
            "when_full",
            "str",
            "wait",
            "when no unit's budget covers a prompt: wait for a report, or reject",
            choices=("wait", "reject"),
        ),
        ParamSpec(
            "idle_takes_any",
            "bool",
            True,
            "an idle unit takes a request its budget does not cover",
        ),
        ParamSpec(
            "waiting_weight",
            "float",
            4.0,
            "weight of a waiting request in the score of units without a budget",
            min=0.0,
            max=1000.0,
        ),
        ParamSpec(
            "recheck_ms",
            "float",
            0.0,
            "wake up this long after holding a request (0 = only on reports)",
            unit="ms",
            min=0.0,
            max=60_000.0,
        ),
    )

    def __init__(self, params: Mapping[str, ParamValue] | None = None) -> None:
        self._budgets: dict[int, _Budget] = {}
        super().__init__(params)

    def configure(self) -> None:
        self.reject_when_full = self.params["when_full"] == "reject"
        self.idle_takes_any = bool(self.params["idle_takes_any"])
        self.waiting_weight = float(self.params["waiting_weight"])
        self.recheck_s = float(self.params["recheck_ms"]) / 1e3

    def local_budget(self, unit_id: int) -> float | None:
        """The balancer's current copy of a unit's budget (None: unknown unit or no budget)."""
        st = self._budgets.get(unit_id)
        return None if st is None else st.local

    def _refresh(self, units: Sequence[UnitLoad]) -> None:
        seen: set[int] = set()
        for u in units:
            seen.add(u.unit_id)
            st = self._budgets.get(u.unit_id)
            reported = u.prefill_admission_budget
            if st is None or u.steps_done != st.steps_seen or reported != st.reported:
                self._budgets[u.unit_id] = _Budget(u.steps_done, reported, reported)
        for unit_id in set(self._budgets) - seen:
            del self._budgets[unit_id]

    def dispatch(self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float) -> DispatchDecision:
        self._refresh(units)
        pool = [u for u in units if u.healthy and u.role != "decode"]
        if not pool:
            return DispatchDecision(reasons={"no_healthy_unit": True, "held": len(pending)})
        placed_on = {u.unit_id: 0 for u in pool}
        known = [b for u in pool if (b := self._budgets[u.unit_id].local) is not None]
        reasons: dict[str, ReasonValue] = {
            "units_with_budget": len(known),
            "max_budget_tokens": round(max(known), 1) if known else 0.0,
        }

        def idle(u: UnitLoad) -> bool:
            return u.num_running == 0 and u.num_waiting == 0 and not u.busy and placed_on[u.unit_id] == 0

        def score(u: UnitLoad) -> float:
            return self.waiting_weight * (u.num_waiting + placed_on[u.unit_id]) + u.num_running

        assignments: list[tuple[str, int]] = []
        held: list[str] = []
        rejected: list[str] = []
        fallback = overrides = 0
        for req in pending:
            best: tuple[tuple[int, float, float, int], UnitLoad] | None = None
            for u in pool:
                budget = self._budgets[u.unit_id].local
                if budget is None:
                    key = (0, -math.inf, score(u), u.unit_id) if idle(u) else (1, 0.0, score(u), u.unit_id)
                elif budget >= req.prompt_tokens:
                    key = (0, -budget, score(u), u.unit_id)
                elif self.idle_takes_any and idle(u):
                    key = (2, -budget, score(u), u.unit_id)
                else:
                    continue
                if best is None or key < best[0]:
                    best = (key, u)
            if best is None:
                (rejected if self.reject_when_full else held).append(req.request_id)
                continue
            key, unit = best
            fallback += key[0] == 1
            overrides += key[0] == 2
            st = self._budgets[unit.unit_id]
            if st.local is not None:
                st.local -= req.prompt_tokens
            placed_on[unit.unit_id] += 1
            assignments.append((req.request_id, unit.unit_id))
        reasons.update(
            placed=len(assignments),
            held=len(held),
            rejected=len(rejected),
            fallback_placements=fallback,
            idle_overrides=overrides,
        )
        wake = now_s + self.recheck_s if held and self.recheck_s > 0 else None
        return DispatchDecision(
            assignments=tuple(assignments), rejected=tuple(rejected), next_check_s=wake, reasons=reasons
        )
