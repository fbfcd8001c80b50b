"""``pab``: FairBatching's admission-budget load balancer (seed 003 section 3.4; POLICIES.md 2.3).

Every unit whose batch policy computes a prefill admission budget (PAB, in tokens) reports it in
``UnitLoad.prefill_admission_budget``. The balancer keeps a local copy per unit and, for each pending
request in arrival order, picks the unit whose budget covers the prompt with the largest remaining
budget, then subtracts the prompt from that unit's copy, so that several requests in one call do not all
land on the same unit. A request that no unit can take waits (``when_full=wait``; smaller requests behind
it may still be placed), for at most a fraction of its TTFT SLO before a fallback places it (rule 4 below),
or is rejected (``when_full=reject``).

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
can be lost.

Bounded wait (issue #19). Rules 1-3 alone let a prompt larger than every busy unit's budget wait without
bound under sustained load while smaller later requests are placed past it (issue #19 saw a TTFT p99 3-6
times ``least_loaded``'s at overload; 1.3-2.1 times at TTFT 500 ms in docs/dispatch-pab.md). So in
``wait`` mode a request waits at most ``max_wait_ttft_frac`` of its own TTFT SLO, counted from its arrival
(``now_s - arrival_s``; the policy reads no clock); from then on, if no unit's budget covers it still, it is
placed by the fallback:

4. ``fallback=largest_budget`` (default): the unit with the largest remaining budget, negative or not
   (units without a budget were already candidates under rules 1-2). Seed 003 section 3.4 builds the
   balancer by replacing the score of vLLM's DP load balancer with the PAB, and that balancer never holds a
   request: a request the budgets cannot cover goes where the score is best, i.e. to the unit with the least
   prefill work committed against its TTFT window, which in tokens is what a prompt-heavy request needs
   (``least_loaded`` counts requests, whatever their length). ``fallback=least_loaded``: the lowest
   ``waiting_weight * waiting + running`` instead. Either way the prompt is subtracted from the unit's copy,
   so several aged requests in one call spread over the units.

Why the default fraction is 0.5. The budget is computed for a prompt that arrives now with its whole TTFT
SLO ahead; a request that waited ``w`` has only ``TTFT - w`` left, so the wait must end while the request can
still meet its SLO, and at half of it a request placed on a unit keeps the other half (FairBatching serves
prefills by slack, so the oldest goes first there). The bound is the SLO's own scale, so it needs no retuning
when SLOs change (500 ms -> 250 ms wait; 2000 ms -> 1 s). Measured (docs/dispatch.md, docs/dispatch-pab.md):
the longest wait at the dispatcher falls from up to 13 s to the cap, and at TTFT 500 ms past the knee the
TTFT p99 from up to 2.1x ``least_loaded``'s to ``least_loaded``'s; the value of the cap between 0 and 1 x
TTFT barely matters. The price: a request placed at its cap on a unit with no budget left delays the
requests already there, so under sustained overload the unbounded wait met a few more SLOs (up to 3 points)
by sacrificing the held prompts, which missed anyway. ``inf`` restores it (and decides exactly as before).
The node is asked again when the oldest held request reaches its cap (``next_check_s``), so the cap holds
even when no step report comes. ``when_full=reject`` refuses at once and never waits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from policies._compiled import mypyc_attr
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


@mypyc_attr(allow_interpreted_subclasses=True)  # plugins subclass shipped policies
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
        ParamSpec(
            "max_wait_ttft_frac",
            "float",
            0.5,
            "longest wait for a budget, as a fraction of the request's TTFT SLO; then the fallback places it"
            " (0 = never wait, inf = no bound)",
            min=0.0,
            max=math.inf,
        ),
        ParamSpec(
            "fallback",
            "str",
            "largest_budget",
            "where a request goes once its wait is over: the largest remaining budget, or least_loaded's score",
            choices=("largest_budget", "least_loaded"),
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
        self.max_wait_frac = float(self.params["max_wait_ttft_frac"])
        self.fallback_least_loaded = self.params["fallback"] == "least_loaded"

    def wait_deadline_s(self, req: PendingRequest) -> float:
        """When ``req`` stops waiting for a budget: arrival + ``max_wait_ttft_frac`` * its TTFT SLO (inf: never)."""
        if math.isinf(self.max_wait_frac):
            return math.inf
        return req.arrival_s + self.max_wait_frac * req.ttft_slo_s

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
        fallback = overrides = aged = 0
        next_deadline = math.inf
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
            if best is None and not self.reject_when_full:
                deadline = self.wait_deadline_s(req)
                if now_s < deadline:
                    next_deadline = min(next_deadline, deadline)
                else:
                    best = min(
                        ((self._fallback_key(u, score(u)), u) for u in pool),
                        key=lambda kv: kv[0],
                    )
                    aged += 1
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
            aged_fallbacks=aged,
        )
        wake = min(now_s + self.recheck_s if held and self.recheck_s > 0 else math.inf, next_deadline)
        return DispatchDecision(
            assignments=tuple(assignments),
            rejected=tuple(rejected),
            next_check_s=wake if held and math.isfinite(wake) else None,
            reasons=reasons,
        )

    def _fallback_key(self, u: UnitLoad, score: float) -> tuple[int, float, float, int]:
        """Rule 4's order (smallest first) over the pool, once a request's wait is over."""
        budget = self._budgets[u.unit_id].local
        if self.fallback_least_loaded or budget is None:
            return (3, 0.0, score, u.unit_id)
        return (3, -budget, score, u.unit_id)
