"""``eb``: exclusive batching with an adaptive threshold, EB(theta*) (seed 002; POLICIES.md 1.5).

Every step is either decode-only or prefill-only, never mixed. With ``N`` slots (the batch size), a decode
phase runs until ``theta * N`` slots are free; then one prefill phase refills them (chunked to the token
budget, as many steps as it takes) and the next decode phase starts. Requests not in the current phase wait
with their KV in place. The formulas (fluid-model throughput, its maximizer ``theta*``, the constant-hazard
closed form, the memory-safe ``N``, the KV reserve) are derived in :mod:`policies.batch.eb_model`
(the survival curve in :mod:`policies.batch.eb_survival`, ``N`` and the reserve in :mod:`policies.batch.eb_memory`).

What the policy does with them:

* ``theta``: fixed when the parameter is > 0, else ``theta*``, recomputed every ``update_every`` completions
  once ``min_samples`` are in (until then ``theta_init``). By default (``theta_method=cfr``, since 2026-11-26)
  ``theta*`` is the paper's closed form (section 3.2.1): :func:`closed_form_theta` of ``alpha_p / (alpha_d
  mu_out)``, with the phase costs fitted online from this unit's own steps (:class:`PhaseCostEstimator`) and the
  window's mean output, clipped to ``[theta_min, theta_max]``. The paper adds a first-order correction for a
  linear hazard (section 3.2.2, Eq. 5), whose equation its text lost: not applied. Measured on one unit, four
  saturated workloads and two profiles, it beat ``theta_method=fluid`` in all eight cells, by 2.5-7.5 points of
  throughput against vLLM's default (docs/policies.md, seed 002's claims): the fluid model assumes every decode
  phase starts with a fresh cohort, while in steady state the ages are mixed, and on the increasing-hazard
  lengths of real workloads it puts ``theta*`` at 0.6-0.8 where throughput peaks near the lower clip.
  ``theta_method=fluid`` is :func:`optimal_theta` over the empirical survival curve of the last ``window``
  finished requests with the same costs. It is optimized for ``N = max_batch or max_num_seqs``
  (``theta_slots=max``, the default) even when the memory-safe ``N`` below is smaller; the paper (seed 002,
  section 3.4) evaluates its IFR correction at the previous cycle's ``N``, which ``theta_slots=in_use``
  does. ``survival=linear_hazard`` replaces the empirical curve by the paper's estimator (a linear hazard
  fitted up to the 95th percentile, :func:`policies.batch.eb_survival.linear_hazard_survival`) for
  ``theta*`` (with ``fluid``), ``t*`` and the reserve; both options are off by default (docs/policies.md,
  "Fidelity to the papers").
* ``N = min(max_batch or max_num_seqs, N_safe)``, ``N_safe`` = :func:`memory_safe_batch_size` over the same
  window with the unit's KV capacity and ``delta`` (off with ``memory_safe=false``), recomputed every
  ``memory_update_every`` completions: it is a Monte Carlo of tens of milliseconds, run inside ``plan()``.
* Decode -> prefill when work waits and ``free slots >= theta * N`` and the free KV blocks cover the
  reserve (:func:`kv_reserve_blocks`; the runtime gate defers the switch otherwise), or when no decode is
  left. Prefill -> decode when nothing is left to prefill or no slot (or KV for a whole prompt) is free.
* Prefill steps: requests already prefilling (or recomputing) first, then waiting requests FCFS while a slot
  is free and the KV cache can hold the whole sequence (the engine's admission gate; checking it here keeps
  a prefill step from coming out empty).
* Preemption order: admission order (the newest request is the victim, as in vLLM).
"""

from __future__ import annotations

import math
from typing import ClassVar

from policies._compiled import mypyc_attr
from policies.base import BatchPolicy
from policies.batch.common import chunk, request_id_of
from policies.batch.eb_costs import PhaseCostEstimator
from policies.batch.eb_memory import kv_reserve_blocks, memory_safe_batch_size
from policies.batch.eb_model import cfr_ratio, closed_form_theta, optimal_theta
from policies.batch.eb_survival import LengthWindow, SurvivalModel, phase_end_iteration
from policies.params import MAX_EVENTS, MAX_KV_BLOCKS, MAX_REQUESTS, MAX_STEP_TOKENS, ParamSpec
from policies.types import ReasonValue, RequestView, ScheduledTokens, StepFeedback, StepMode, StepPlan, UnitView

EB_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec(
        "theta", "float", 0.0, "fraction of slots that must be free before a prefill phase; 0 = adaptive theta*",
        min=0.0, max=1.0,
    ),
    ParamSpec("theta_init", "float", 0.3, "theta before enough requests finished to estimate theta*",
              min=0.01, max=1.0),
    ParamSpec("theta_min", "float", 0.05, "lower clip of theta*", min=0.01, max=1.0),
    ParamSpec("theta_max", "float", 0.95, "upper clip of theta*", min=0.01, max=1.0),
    ParamSpec("max_batch", "int", 0, "slots N; 0 = the unit's max_num_seqs", unit="requests", min=0,
              max=MAX_REQUESTS),
    ParamSpec("memory_safe", "bool", True, "cap N at the memory-safe batch size"),
    ParamSpec("delta", "float", 0.01, "allowed probability that a cycle's KV demand exceeds capacity",
              min=1e-4, max=0.5),
    ParamSpec("reserve_kappa", "float", 1.5, "KV reserve = kappa * expected decode-phase KV growth + base",
              min=0.0, max=100.0),
    ParamSpec("reserve_base_blocks", "int", 1, "constant part of the KV reserve", unit="blocks", min=0,
              max=MAX_KV_BLOCKS),
    ParamSpec("window", "int", 2000, "finished requests in the length window", unit="requests", min=16,
              max=MAX_REQUESTS, live=False),
    ParamSpec("min_samples", "int", 64, "finished requests needed before theta* and N_safe adapt",
              unit="requests", min=8, max=MAX_REQUESTS),
    ParamSpec("memory_update_every", "int", 1000,
              "finished requests between two recomputations of N_safe (a Monte Carlo of tens of ms)",
              unit="requests", min=1, max=MAX_EVENTS),
    ParamSpec("update_every", "int", 200, "finished requests between two updates of theta* and the reserve",
              unit="requests", min=1, max=MAX_EVENTS),
    ParamSpec("token_budget", "int", 0, "tokens per prefill step; 0 = the unit's max_num_batched_tokens",
              unit="tokens", min=0, max=MAX_STEP_TOKENS),
    ParamSpec("survival", "str", "empirical",
              "survival curve of theta*, t* and the reserve: the window's empirical one, or linear_hazard (seed 002 "
              "3.4's estimator: a linear hazard fitted by weighted least squares up to the 95th percentile)",
              choices=("empirical", "linear_hazard")),
    ParamSpec("theta_method", "str", "cfr",
              "how theta* is found: cfr (seed 002's closed form for constant hazard, the root of theta/(1-theta) + "
              "ln(1-theta) = alpha_p/(alpha_d mu_out), without its linear-hazard correction, whose equation the "
              "paper's text lost) or fluid (the fluid model's throughput maximized on the survival curve)",
              choices=("cfr", "fluid")),
    ParamSpec("theta_slots", "str", "max",
              "N that theta* is optimized for: max (max_batch or max_num_seqs) or in_use (the N in use, the last "
              "memory-safe N included: seed 002 3.4's one-step fixed point on the previous cycle's N)",
              choices=("max", "in_use")),
)


@mypyc_attr(allow_interpreted_subclasses=True)  # plugins subclass shipped policies
class ExclusiveBatching(BatchPolicy):
    """Decode-only and prefill-only phases, switching at an adaptive threshold."""

    name: ClassVar[str] = "eb"
    summary: ClassVar[str] = "exclusive batching EB(theta*): decode and prefill phases, adaptive threshold (seed 002)"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = EB_PARAMS

    def configure(self) -> None:
        p = self.params
        self.theta_fixed = float(p["theta"])
        self.theta_init = float(p["theta_init"])
        self.theta_lo = float(p["theta_min"])
        self.theta_hi = max(float(p["theta_max"]), self.theta_lo)
        self.max_batch = int(p["max_batch"])
        self.memory_safe = bool(p["memory_safe"])
        self.delta = float(p["delta"])
        self.reserve_kappa = float(p["reserve_kappa"])
        self.reserve_base = int(p["reserve_base_blocks"])
        self.min_samples = int(p["min_samples"])
        self.update_every = int(p["update_every"])
        self.memory_update_every = int(p["memory_update_every"])
        self.token_cap = int(p["token_budget"])
        self.survival_model: SurvivalModel = "linear_hazard" if p["survival"] == "linear_hazard" else "empirical"
        self.theta_in_use = p["theta_slots"] == "in_use"
        self.theta_cfr = p["theta_method"] == "cfr"
        if not hasattr(self, "window"):
            self.window = LengthWindow(int(p["window"]))
            self.estimator: PhaseCostEstimator | None = None
            self.phase = StepMode.DECODE
            self.theta_star: float | None = None
            self.n_safe: int | None = None
            self.reserve_blocks = self.reserve_base
            self._t_star = 0.0
            self.ready = False
            """True once theta*, N_safe, t* and the reserve come from the window (``min_samples`` reached)."""
            self._since_update = 0
            self._since_memory = 0
            self._dirty = False
            self.switches = 0
        self._dirty = True

    # -- learning --------------------------------------------------------------------------------------
    def observe_step(self, feedback: StepFeedback) -> None:
        added = self.window.observe(feedback)
        if self.estimator is not None:
            self.estimator.observe(feedback)
        self._since_update += added
        self._since_memory += added
        if self._since_update >= self.update_every or (not self.ready and len(self.window) >= self.min_samples):
            self._dirty = True

    @property
    def theta(self) -> float:
        if self.theta_fixed > 0.0:
            return self.theta_fixed
        return self.theta_star if self.theta_star is not None else self.theta_init

    def refresh_if_due(self, unit: UnitView) -> None:
        """Recompute the window-derived quantities when enough requests finished since the last time."""
        if self._dirty or self.estimator is None:
            self._refresh(unit)

    def _refresh(self, unit: UnitView) -> None:
        """Recompute theta*, N_safe and the KV reserve from the window (every ``update_every`` completions)."""
        self._dirty = False
        self._since_update = 0
        if self.estimator is None:
            self.estimator = PhaseCostEstimator(unit.cost)
        if len(self.window) < self.min_samples:
            return
        survival = self.window.survival(model=self.survival_model)
        n_cap = self.max_batch or unit.max_num_seqs
        theta = self.theta
        if self.theta_fixed <= 0.0:
            # theta* depends on N only through the increasing-hazard terms; ``theta_slots=in_use`` optimizes for
            # the N in use (the last memory-safe N), as the paper's one-step fixed point does.
            n_theta = self._slots(unit) if self.theta_in_use else n_cap
            if self.theta_cfr:
                root = closed_form_theta(cfr_ratio(self.estimator.costs(), self.window.mean_output))
                theta = min(max(root, self.theta_lo), self.theta_hi)
            else:
                theta = optimal_theta(
                    survival, self.estimator.costs(), n_theta, self.window.mean_prompt, self.theta_lo, self.theta_hi
                )
            self.theta_star = theta
        if self.memory_safe and (self.n_safe is None or self._since_memory >= self.memory_update_every):
            self._since_memory = 0
            self.n_safe = memory_safe_batch_size(
                self.window.prompts(), self.window.outputs(), unit.num_blocks * unit.block_size, theta, self.delta,
                max_n=n_cap, seed=unit.unit_id, block_size=unit.block_size,
            )
        self._t_star = phase_end_iteration(theta, survival)
        self.ready = True
        n = self._slots(unit)
        self.reserve_blocks = kv_reserve_blocks(
            n, survival, theta, unit.block_size, self.reserve_kappa, self.reserve_base,
            lo=self.reserve_base, hi=max(unit.num_blocks // 2, self.reserve_base),
        )

    def _slots(self, unit: UnitView) -> int:
        n = self.max_batch or unit.max_num_seqs
        n = min(n, unit.max_num_seqs)
        if self.n_safe is not None:
            n = min(n, max(self.n_safe, 1))
        return n

    def t_star(self) -> float:
        """Decode-phase length ``t*`` (iterations) at the current theta (0 before the window has data).

        Computed at each refresh (the survival curve costs tens of microseconds to build)."""
        return self._t_star

    # -- the step --------------------------------------------------------------------------------------
    def plan(self, unit: UnitView, now_s: float) -> StepPlan:
        self.refresh_if_due(unit)
        n_slots = self._slots(unit)
        theta = self.theta
        decodes: list[RequestView] = []
        prefilling: list[RequestView] = []
        for r in unit.running:  # is_decode inlined: this loop runs every step over every running request
            out = r.output_tokens
            (decodes if out > 0 and r.prompt_tokens + out - r.computed_tokens == 1 else prefilling).append(r)
        free_slots = n_slots - len(unit.running)
        threshold = max(1, math.ceil(theta * n_slots))
        head_fits = bool(unit.waiting) and unit.blocks_for(unit.waiting[0].num_tokens) <= unit.free_blocks
        can_prefill = bool(prefilling) or (free_slots > 0 and head_fits)
        gate_deferred = False
        switched = False
        if self.phase is StepMode.DECODE:
            if can_prefill and not decodes:
                switched = True
            elif can_prefill and (prefilling or free_slots >= threshold):
                if unit.free_blocks >= self.reserve_blocks or prefilling:
                    switched = True
                else:
                    gate_deferred = True
            if switched:
                self.phase = StepMode.PREFILL
        elif not can_prefill and decodes:
            self.phase = StepMode.DECODE
            switched = True
        if switched:
            self.switches += 1

        budget_total = unit.max_num_batched_tokens
        if self.token_cap:
            budget_total = min(budget_total, self.token_cap)
        entries: list[ScheduledTokens] = []
        admitted = 0
        if self.phase is StepMode.DECODE:
            new = tuple.__new__
            entries = [new(ScheduledTokens, (r.request_id, 1)) for r in decodes[:budget_total]]
        else:
            budget = budget_total
            for r in prefilling:
                if budget <= 0:
                    break
                n = chunk(r, budget, unit.max_model_len)
                if n:
                    entries.append(ScheduledTokens(r.request_id, n))
                    budget -= n
            free_blocks = unit.free_blocks
            running = len(unit.running)
            for r in unit.waiting:
                if budget <= 0 or running >= n_slots:
                    break
                need = unit.blocks_for(r.num_tokens)
                if need > free_blocks:
                    break
                n = chunk(r, budget, unit.max_model_len)
                if n <= 0:
                    break
                entries.append(ScheduledTokens(r.request_id, n))
                budget -= n
                free_blocks -= need
                running += 1
                admitted += 1
        reasons: dict[str, ReasonValue] = {
            "phase": self.phase.value,
            "switched": switched,
            "theta": round(theta, 4),
            "theta_adaptive": self.theta_fixed <= 0.0 and self.theta_star is not None,
            "slots": n_slots,
            "free_slots": free_slots,
            "threshold_slots": threshold,
            "reserve_blocks": self.reserve_blocks,
            "free_blocks": unit.free_blocks,
            "gate_deferred": gate_deferred,
            "decodes": len(decodes) if self.phase is StepMode.DECODE else 0,
            "decodes_waiting": len(decodes) if self.phase is StepMode.PREFILL else 0,
            "admitted": admitted,
        }
        if self.n_safe is not None:
            reasons["memory_safe_slots"] = self.n_safe
        mode = self.phase if entries else StepMode.IDLE
        return StepPlan(  # positional: entries, running_order, mode, token_budget, reasons (a Python
            # __init__: keywords cost ~175 ns more per step)
            tuple(entries),
            tuple(map(request_id_of, unit.running)),
            mode,
            budget_total,
            reasons,
        )
