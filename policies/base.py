"""Abstract bases of the two policy kinds.

Policies are pure decision makers: they see frozen snapshots and the time as arguments, and return
plans. They may keep state between calls (an EMA, a phase), but do no I/O and read no clock.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import ClassVar

from policies.cost.step_model import StepCoefficients
from policies.params import ParamSpec, ParamValue, resolve_params
from policies.types import (
    DispatchDecision,
    HandoffRequest,
    PendingRequest,
    StepFeedback,
    StepPlan,
    UnitLoad,
    UnitView,
)


class _Configurable:
    name: ClassVar[str] = ""
    """Registry name (what users type)."""
    summary: ClassVar[str] = ""
    """One line for ``trackside policies``."""
    params_schema: ClassVar[tuple[ParamSpec, ...]] = ()

    def __init__(self, params: Mapping[str, ParamValue] | None = None) -> None:
        self.params: dict[str, ParamValue] = resolve_params(self.name, self.params_schema, params or {})
        self.configure()

    def configure(self) -> None:
        """Read ``self.params`` into attributes; called at construction and after a live change."""

    def check_params(self, changes: Mapping[str, ParamValue]) -> dict[str, ParamValue]:
        """``changes`` validated against the schema (known name, type, range, changeable live), typed as the
        policy holds them; nothing changes. The one validation of a live change: the control plane calls this for
        every targeted policy before any is touched, then hands the result to :meth:`apply_params`.

        Raises :class:`policies.params.ParamError` for an unknown name, a bad value or a parameter that cannot
        change live.
        """
        from policies.params import ParamError

        schema = {spec.name: spec for spec in self.params_schema}
        frozen = [n for n in changes if n in schema and not schema[n].live]
        if frozen:
            raise ParamError(f"{self.name}: {', '.join(frozen)} cannot change while running")
        merged = resolve_params(self.name, self.params_schema, {**self.params, **changes})
        return {n: merged[n] for n in changes}

    def apply_params(self, checked: Mapping[str, ParamValue]) -> dict[str, ParamValue]:
        """Apply changes that :meth:`check_params` returned (not validated again); returns the previous values of
        the changed parameters (applying those undoes the change)."""
        old = {n: self.params[n] for n in checked}
        self.params = {**self.params, **checked}
        self.configure()
        return old

    def update_params(self, changes: Mapping[str, ParamValue]) -> dict[str, ParamValue]:
        """Validate and apply live changes (:meth:`check_params`, then :meth:`apply_params`); returns the previous
        values of the changed parameters. On a :class:`policies.params.ParamError` nothing changes."""
        return self.apply_params(self.check_params(changes))


class BatchPolicy(_Configurable, abc.ABC):
    """Decides each step of one DP unit."""

    @abc.abstractmethod
    def plan(self, unit: UnitView, now_s: float) -> StepPlan:
        """The plan for the next step of ``unit`` at time ``now_s``."""

    def observe_step(self, feedback: StepFeedback) -> None:
        """Feedback after one of this policy's steps ran (for online fits). Default: ignore."""

    def admission_budget_tokens(self) -> float | None:
        """Prompt tokens this unit can still take without missing SLOs, if the policy computes it.

        Exported in :class:`UnitLoad` as ``prefill_admission_budget`` (FairBatching's PAB). None: the
        policy has no such budget.
        """
        return None

    def refuses(self, prompt_tokens: int, cost: StepCoefficients) -> bool:
        """True when the policy refuses a new request of this prompt length (admission control).

        ``cost`` is the unit's current step model. Called when the dispatcher places a request on the unit;
        the node counts a refused request as rejected, it is never dropped silently. Default: admit all.
        """
        return False

    def refuses_within(self, prompt_tokens: int, budget_tokens: float | None) -> bool:
        """True when the policy refuses a new request of this prompt length, given the admission budget the unit
        last reported (``UnitLoad.prefill_admission_budget``, None: none known).

        What a node asks where the policy itself runs elsewhere (a live engine's process) and only its reported
        budget is at hand; :meth:`refuses` is the same decision made with the policy's own state. Default: admit.
        """
        return False


class DispatchPolicy(_Configurable, abc.ABC):
    """Spreads arriving requests over the DP units of a node.

    The node asks on every arrival, at ``DispatchDecision.next_check_s``, and, when
    ``wants_step_reports`` is set, after every unit's step while requests are pending.
    """

    wants_step_reports: ClassVar[bool] = False
    needs_requests: ClassVar[bool] = False
    """The node fills ``UnitLoad.requests`` (resident requests) for this dispatcher (costs a copy per call)."""
    rebalances: ClassVar[bool] = False
    """Ask after every step even when nothing is pending (for migrations between units)."""

    @abc.abstractmethod
    def dispatch(
        self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float
    ) -> DispatchDecision:
        """Which pending requests go to which unit now (and, for rebalancing policies, what moves)."""

    def stage_layout(self) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]] | None:
        """A length-staged dispatcher's stages: the interior cuts in tokens and each stage's unit ids (one more
        stage than cuts); None for a dispatcher without stages (the default)."""
        return None

    def place_decode(
        self, handoffs: Sequence[HandoffRequest], units: Sequence[UnitLoad], now_s: float
    ) -> tuple[tuple[str, int], ...]:
        """Decode units for requests whose prefill finished on a prefill unit (disaggregated topology).

        ``units`` are the decode pool's units. Every handoff must be placed (its KV already exists); the
        default takes, longest first, the lexicographic minimum of (batch size, KV tokens) among healthy units.
        """
        return place_min_batch(handoffs, units)


def place_min_batch(
    handoffs: Sequence[HandoffRequest], units: Sequence[UnitLoad]
) -> tuple[tuple[str, int], ...]:
    """Longest first, each to the healthy unit with the least (batch size, KV tokens), updating both."""
    state = {u.unit_id: [u.num_running + u.num_waiting, u.kv_tokens] for u in units if u.healthy}
    if not state:
        state = {u.unit_id: [u.num_running + u.num_waiting, u.kv_tokens] for u in units}
    if not state:
        return ()
    out: list[tuple[str, int]] = []
    for h in sorted(handoffs, key=lambda h: -h.context_tokens):
        unit = min(state, key=lambda k: (state[k][0], state[k][1], k))
        state[unit][0] += 1
        state[unit][1] += h.context_tokens
        out.append((h.request_id, unit))
    return tuple(out)
