"""``sbs``: staggered batch scheduling (seed 000; POLICIES.md 2.2).

Arrivals are buffered and dispatched in batches, one *cycle* every ``I = (T_fwd + L_net) / N_active``:
``T_fwd`` is the mean of the last ``W`` reported forward times (``default_step_ms`` before any, or the
units' reported ``mean_step_s``), ``L_net`` the dispatch latency, ``N_active`` the healthy units *at this
call* (a unit leaving or joining changes the interval at once). Units are targets in turn; a cycle fires
when the interval has elapsed since the previous one *and* the target unit is ready:

- **quiescence**: a unit with nothing queued and no step in flight (``num_waiting == 0 and not busy``) is
  ready at once;
- **end-of-step report** (fast path): a unit we dispatched to is ready again once its ``steps_done`` grew;
- **watchdog** (safety path): ``watchdog_factor * T_fwd`` after a dispatch with no report the unit is reset
  to ready and counted (``watchdog_resets``). Such a unit is *silent*: until it reports a step again it is
  never waited for, so the policy degrades to fixed-interval dispatch for it instead of stalling
  ``5 * T_fwd`` on every turn (the paper: "reverts to a fixed-interval batch processing mode"); it never
  deadlocks.

A unit never dispatched to (or back from being unhealthy) is ready. The policy asks the node to wake it at
the next fire time (``next_check_s``: the end of the interval, or the target's watchdog deadline); end-of-step
reports wake it earlier (``wants_step_reports``). Every ``next_check_s`` lies strictly after ``now_s``.

Placement in a cycle is PBAA water-filling (:func:`policies.dispatch.placement.water_fill`): requests held
in earlier cycles first, then new ones, each group longest prompt first (``fill_order=fcfs``: in arrival order;
on real prompt lengths the longest-first order is what makes SBS's mean TTFT worse than immediate dispatch,
``docs/dispatch.md``), each to the unit with the most
headroom ``C_avail`` (cache-aware with ``prefix_hits``; parameter ``headroom`` picks how ``C_avail`` reads
a load, see :func:`policies.dispatch.placement.available_tokens`), among the *ready* units by default
(``place_on=ready``: a unit in the middle of a step would queue the batch on the device, which is what
staggering removes; ``place_on=healthy`` uses every healthy unit). Ties go to the target, then the units
after it in turn.

Colocated units (role ``mixed``) also hold their requests' KV for the whole decode, so where a request is
placed is also "where it lives": the spec's decode placement applies there. We apply its outlier half
before water-filling: units whose KV usage exceeds ``Q3 + iqr_k * IQR`` over the healthy mixed units are
left out of the cycle (unless that leaves no candidate); the lexicographic half (batch size, KV) is not
used for prefill, where chunk headroom is the balance that matters. ``kv_mask=false`` turns this off.
Units with role ``decode`` never take new requests; :meth:`StaggeredBatch.place_decode` places handed-off
requests on the decode pool with the IQR-masked lexicographic rule.

Flow control counts *cycles*, not calls: the node's ``PendingRequest.cycles_waited`` grows on every
dispatcher call (each arrival and step report), which for a buffering dispatcher says nothing about how
long a request was passed over. A request held in more than ``n_limit`` cycles is listed in
``DispatchDecision.flow_control`` at each cycle that holds it (``throttle``: it stays pending and keeps its
priority as a leftover) or in ``rejected`` (``reject``). With no healthy unit there is no cycle: requests
wait (the node asks again when a unit comes back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from policies._compiled import mypyc_attr
from policies.base import DispatchPolicy
from policies.dispatch.placement import (
    HeadroomModel,
    StepTimeWindow,
    available_tokens,
    iqr_mask,
    place_iqr_lex,
    sbs_interval_s,
    water_fill,
)
from policies.params import ParamSpec, ParamValue
from policies.types import DispatchDecision, HandoffRequest, PendingRequest, ReasonValue, UnitLoad

_MIN_WAKE_S = 1e-6
"""Smallest gap between ``now_s`` and a returned ``next_check_s`` (and the smallest interval)."""
_EARLY = 0.05
"""A cycle may fire this fraction of the interval early: a target whose end-of-step report lands a hair before
the interval is up (step times jitter; float sums) must get its batch before its next step starts, not one
whole step later."""


@dataclass(slots=True)
class _UnitState:
    """What the policy remembers about one unit between calls."""

    steps_seen: int
    """``steps_done`` at the last call (a growth is an end-of-step report)."""
    armed_at_s: float | None = None
    """When the policy last dispatched to the unit and is still waiting for its report (None: not waiting)."""
    armed_steps: int = 0
    """``steps_done`` at that dispatch."""
    silent: bool = False
    """Reset by the watchdog and no report since: dispatched to at fixed intervals, never waited for."""
    silent_steps: int = 0
    """``steps_done`` at the watchdog reset."""


@mypyc_attr(allow_interpreted_subclasses=True)  # plugins subclass shipped policies
class StaggeredBatch(DispatchPolicy):
    """Buffered, staggered dispatch cycles with chunk-capacity water-filling."""

    name: ClassVar[str] = "sbs"
    summary: ClassVar[str] = (
        "staggered batch scheduling: a dispatch cycle every (T_fwd + L_net)/N, water-filled by chunk headroom"
    )
    wants_step_reports: ClassVar[bool] = True
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (
        ParamSpec("window", "int", 32, "reported forward times averaged into T_fwd", unit="steps", min=1, max=4096),
        ParamSpec("net_latency_ms", "float", 1.0, "estimated dispatch latency L_net", unit="ms", min=0.0, max=1000.0),
        ParamSpec(
            "default_step_ms",
            "float",
            30.0,
            "T_fwd before any step is reported (from the calibration profile); units' mean_step_s when known",
            unit="ms",
            min=0.01,
            max=60_000.0,
        ),
        ParamSpec(
            "watchdog_factor",
            "float",
            5.0,
            "reset a unit to ready after this many T_fwd without a report",
            min=1.0,
            max=1000.0,
        ),
        ParamSpec(
            "n_limit",
            "int",
            8,
            "cycles a request may be held before flow control",
            unit="cycles",
            min=0,
            max=1_000_000,
        ),
        ParamSpec(
            "flow_control",
            "str",
            "throttle",
            "past n_limit: throttle (keep it pending, report it) or reject it",
            choices=("throttle", "reject"),
        ),
        ParamSpec("iqr_k", "float", 1.5, "IQR multiplier of the KV outlier mask", min=0.0, max=100.0),
        ParamSpec("cache_aware", "bool", True, "count prefix-cache hits in the water-filling score"),
        ParamSpec("kv_mask", "bool", True, "colocated: leave KV-usage outlier units out of a cycle"),
        ParamSpec(
            "place_on",
            "str",
            "ready",
            "candidate units of a cycle: ready units or every healthy unit",
            choices=("ready", "healthy"),
        ),
        ParamSpec(
            "headroom",
            "str",
            "next_step",
            "C_avail: the next step's room (C_chunk - backlog after the step in flight - decodes) or the literal "
            "C_chunk - inflight - queued (counts the step in flight twice)",
            choices=("next_step", "literal"),
        ),
        ParamSpec(
            "fill_order",
            "str",
            "longest_first",
            "order in which a cycle water-fills its requests: longest_first (the paper's PBAA) or fcfs (arrival "
            "order, which keeps short prompts from waiting behind long ones)",
            choices=("longest_first", "fcfs"),
        ),
        ParamSpec(
            "default_chunk_tokens",
            "int",
            8192,
            "C_chunk of a unit that reports none (chunk_tokens = 0)",
            unit="tokens",
            min=1,
            max=1_048_576,
        ),
    )

    def __init__(self, params: Mapping[str, ParamValue] | None = None) -> None:
        self._window = StepTimeWindow(32, 0.03)
        self._units: dict[int, _UnitState] = {}
        self._held: dict[str, int] = {}
        """Request id -> cycles it was held in (present only for requests held at least once)."""
        self._last_fire_s: float | None = None
        self._next_target = 0
        self.num_watchdog_resets = 0
        """Watchdog resets since the policy started."""
        self.num_cycles = 0
        """Dispatch cycles fired since the policy started."""
        super().__init__(params)

    def configure(self) -> None:
        self._window.resize(int(self.params["window"]))
        self._window.default_s = float(self.params["default_step_ms"]) / 1e3
        self.net_latency_s = float(self.params["net_latency_ms"]) / 1e3
        self.watchdog_factor = float(self.params["watchdog_factor"])
        self.n_limit = int(self.params["n_limit"])
        self.reject_over_limit = self.params["flow_control"] == "reject"
        self.iqr_k = float(self.params["iqr_k"])
        self.cache_aware = bool(self.params["cache_aware"])
        self.kv_mask = bool(self.params["kv_mask"])
        self.ready_only = self.params["place_on"] == "ready"
        self.default_chunk_tokens = int(self.params["default_chunk_tokens"])
        self.longest_first = self.params["fill_order"] == "longest_first"
        self.headroom: HeadroomModel = "literal" if self.params["headroom"] == "literal" else "next_step"

    # -- state ----------------------------------------------------------------------------------------
    def t_fwd_s(self, units: Sequence[UnitLoad] = ()) -> float:
        """``T_fwd``: the window's mean; before any report, the units' mean step time, else the default."""
        if len(self._window):
            return self._window.mean_s
        known = [u.mean_step_s for u in units if u.healthy and u.mean_step_s is not None and u.mean_step_s > 0]
        return sum(known) / len(known) if known else self._window.default_s

    def _observe(self, units: Sequence[UnitLoad]) -> set[int]:
        """Fold end-of-step reports into the window and the readiness state; the units that reported now."""
        seen: set[int] = set()
        reported: set[int] = set()
        for u in units:
            seen.add(u.unit_id)
            st = self._units.get(u.unit_id)
            if st is None:
                self._units[u.unit_id] = _UnitState(steps_seen=u.steps_done)
                continue
            if u.steps_done > st.steps_seen:
                reported.add(u.unit_id)
                if u.last_step_s is not None:
                    self._window.add(u.last_step_s)
                if st.armed_at_s is not None and u.steps_done > st.armed_steps:
                    st.armed_at_s = None
                if st.silent and u.steps_done > st.silent_steps:
                    st.silent = False
            elif u.steps_done < st.steps_seen:  # the unit restarted: start afresh
                self._units[u.unit_id] = _UnitState(steps_seen=u.steps_done)
                continue
            st.steps_seen = u.steps_done
            if not u.healthy:
                st.armed_at_s = None  # a unit that comes back is ready at once
        for unit_id in set(self._units) - seen:
            del self._units[unit_id]
        return reported

    def _ready(self, u: UnitLoad, watchdog_s: float, now_s: float) -> bool:
        """Readiness of a healthy unit (quiescence, report, watchdog); fires the watchdog when due."""
        st = self._units[u.unit_id]
        if st.armed_at_s is None:
            return True
        if u.num_waiting == 0 and not u.busy:
            st.armed_at_s = None
            return True
        if now_s >= st.armed_at_s + watchdog_s:
            st.armed_at_s = None
            st.silent = True
            st.silent_steps = u.steps_done
            self.num_watchdog_resets += 1
            return True
        return False

    # -- the decision ---------------------------------------------------------------------------------
    def dispatch(self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float) -> DispatchDecision:
        reported = self._observe(units)
        pending_ids = {p.request_id for p in pending}
        for rid in [r for r in self._held if r not in pending_ids]:
            del self._held[rid]
        pool = sorted((u for u in units if u.healthy and u.role != "decode"), key=lambda u: u.unit_id)
        t_fwd = self.t_fwd_s(units)
        interval = sbs_interval_s(t_fwd, self.net_latency_s, len(pool))
        if interval is None:
            return DispatchDecision(
                reasons={"no_healthy_unit": True, "fired": False, "held": len(pending), **self._counters()}
            )
        interval = max(interval, _MIN_WAKE_S)
        watchdog_s = self.watchdog_factor * t_fwd
        ready = {u.unit_id for u in pool if self._ready(u, watchdog_s, now_s)}
        ids = [u.unit_id for u in pool]
        reporters = [i for i in ids if i in reported and i in ready]
        target = next((i for i in ids if i >= self._next_target), ids[0])
        if reporters:
            # Fast path: a unit that just ended its step is about to start the next one; this is the moment
            # the interval aims at, so it fires now (the cadence follows the reports, not the arrivals).
            target = next((i for i in reporters if i >= self._next_target), reporters[0])
        reasons: dict[str, ReasonValue] = {
            "interval_ms": round(interval * 1e3, 3),
            "t_fwd_ms": round(t_fwd * 1e3, 3),
            "healthy_units": len(pool),
            "ready_units": len(ready),
            "target_unit": target,
        }
        wake: float | None = None
        if not reporters and self._last_fire_s is not None and now_s < self._last_fire_s + interval * (1.0 - _EARLY):
            wake = self._last_fire_s + interval
            reasons["wait"] = "interval"
        elif target not in ready:
            armed_at = self._units[target].armed_at_s
            assert armed_at is not None  # not ready means armed
            wake = armed_at + watchdog_s
            reasons["wait"] = "target_not_ready"
        elif not pending:
            reasons["wait"] = "nothing_pending"  # a cycle with nothing to place would only shift the cadence
        if wake is None and pending:
            return self._fire(pending, pool, ready, ids.index(target), interval, now_s, reasons)
        reasons.update(fired=False, placed=0, held=len(pending), **self._counters())
        next_check = None if wake is None else max(wake, now_s + _MIN_WAKE_S)
        return DispatchDecision(next_check_s=next_check, reasons=reasons)

    def _fire(
        self,
        pending: Sequence[PendingRequest],
        pool: Sequence[UnitLoad],
        ready: set[int],
        target_index: int,
        interval: float,
        now_s: float,
        reasons: dict[str, ReasonValue],
    ) -> DispatchDecision:
        """One PBAA cycle over the candidate units, starting the rotation at the target."""
        rotated = [*pool[target_index:], *pool[:target_index]]
        candidates = [u for u in rotated if u.unit_id in ready] if self.ready_only else rotated
        masked: set[int] = set()
        mixed = [u for u in pool if u.role == "mixed"]
        if self.kv_mask and mixed:
            kept = {mixed[i].unit_id for i in iqr_mask([u.kv_usage for u in mixed], self.iqr_k)}
            masked = {u.unit_id for u in candidates if u.role == "mixed" and u.unit_id not in kept}
            if masked and all(u.unit_id in masked for u in candidates):
                masked = set()  # no mask if it leaves no candidate
        capacity = [
            (u.unit_id, available_tokens(u, self.default_chunk_tokens, self.headroom))
            for u in candidates
            if u.unit_id not in masked
        ]
        leftover = [p for p in pending if p.request_id in self._held]
        new = [p for p in pending if p.request_id not in self._held]
        result = water_fill(leftover, new, capacity, cache_aware=self.cache_aware, longest_first=self.longest_first)

        by_id = {u.unit_id: u for u in pool}
        for rid, unit_id in result.assignments:
            self._held.pop(rid, None)
            st = self._units[unit_id]
            if not st.silent:
                st.armed_at_s = now_s
                st.armed_steps = by_id[unit_id].steps_done
        over: list[str] = []
        for rid in result.held:
            self._held[rid] = self._held.get(rid, 0) + 1
            if self._held[rid] > self.n_limit:
                over.append(rid)
        rejected: tuple[str, ...] = ()
        flow: tuple[str, ...] = ()
        if self.reject_over_limit:
            rejected = tuple(over)
            for rid in over:
                del self._held[rid]
        else:
            flow = tuple(over)

        self._last_fire_s = now_s
        self._next_target = pool[target_index].unit_id + 1
        self.num_cycles += 1
        still_pending = len(result.held) - len(rejected)
        reasons.update(
            fired=True,
            placed=len(result.assignments),
            held=still_pending,
            candidate_units=len(capacity),
            masked_units=len(masked),
            flow_control=len(flow),
            rejected=len(rejected),
            **self._counters(),
        )
        return DispatchDecision(
            assignments=result.assignments,
            rejected=rejected,
            next_check_s=now_s + interval if still_pending else None,
            reasons=reasons,
            flow_control=flow,
        )

    def _counters(self) -> dict[str, ReasonValue]:
        degraded = sum(1 for st in self._units.values() if st.silent)
        return {
            "watchdog_resets": self.num_watchdog_resets,
            "degraded": degraded > 0,
            "degraded_units": degraded,
            "cycles": self.num_cycles,
        }

    def place_decode(
        self, handoffs: Sequence[HandoffRequest], units: Sequence[UnitLoad], now_s: float
    ) -> tuple[tuple[str, int], ...]:
        """Longest first, IQR mask on KV tokens, then the least (batch size, KV tokens) (Algorithm 3)."""
        return place_iqr_lex(handoffs, units, self.iqr_k)
