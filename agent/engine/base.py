"""What every engine unit reports, and the interface the node drives.

An engine unit (simulated here, vLLM in ``agent.engine.vllm`` later) runs one step at a time: the node calls
:meth:`Engine.begin_step` at the step's start time, gets its duration, and calls :meth:`Engine.end_step`
when that time has passed. Every step yields a :class:`StepRecord`; requests yield
:class:`RequestOutcome` when they finish.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec

from agent.telemetry import DEFAULT_TPOT_METRIC, TpotMetric
from policies.base import BatchPolicy
from policies.cost.step_model import StepCoefficients
from policies.params import ParamValue
from policies.types import ReasonValue, RequestView, StepMode, UnitLoad


class PlanError(RuntimeError):
    """A batch policy returned a plan the mechanism cannot execute (raised by the simulated unit)."""


class SubmittedRequest(msgspec.Struct, frozen=True):
    """A request handed to a unit. Output length is known to the simulator, never to policies."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_slo_s: float
    tpot_slo_s: float


class StepRecord(msgspec.Struct, frozen=True):
    """One step of one unit: its composition, timing, KV state and the policy's reasons.

    Fields are named as in the ``step`` event (``StepEvent``), but for the times: node seconds here
    (``start_s``, ``duration_s``, ``predicted_s``), ns on the wire (``docs/records.md`` maps every field)."""

    unit_id: int
    step_id: int
    """The unit's step counter."""
    start_s: float
    duration_s: float
    predicted_s: float
    """The policy-side cost model's prediction for this step (before its online update)."""
    mode: StepMode
    policy: str
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_reqs: int
    num_decode_reqs: int
    context_tokens: int
    budget_tokens: int
    """The plan's token budget."""
    kv_used_blocks: int
    num_blocks: int
    num_running: int
    num_waiting: int
    num_preempted: int
    num_finished: int
    reasons: Mapping[str, ReasonValue] = msgspec.field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.num_blocks if self.num_blocks else 0.0


def token_tpot_s(first_token_s: float, index: int, time_s: float) -> float:
    """The TPOT of a request's output token number ``index`` (from 1; ``index >= 2``) out at ``time_s``: seed 003's
    ``TPOT_ij = (OutputTime_ij - OutputTime_i1) / (j - 1)`` (:data:`agent.telemetry.TpotMetric`)."""
    return (time_s - first_token_s) / (index - 1)


def worst_tpot_s(token_times_s: Sequence[float]) -> float | None:
    """The worst per-token TPOT of a request whose output tokens came out at ``token_times_s`` (in order; a token
    delivered with others has their common time); None for fewer than two tokens. Engines track the same running
    maximum token by token (:func:`token_tpot_s`) instead of keeping the times."""
    if len(token_times_s) < 2:
        return None
    first = token_times_s[0]
    return max(token_tpot_s(first, j, t) for j, t in enumerate(token_times_s[1:], start=2))


class RequestOutcome(msgspec.Struct, frozen=True):
    """A finished request's timeline on one unit."""

    request_id: str
    unit_id: int
    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    num_preemptions: int
    ttft_slo_s: float
    tpot_slo_s: float
    max_tpot_s: float | None = None
    """The worst per-token TPOT (:func:`worst_tpot_s`), tracked by the engine as tokens come out (across
    migrations); None for a single output token, or where nothing tracked it (an outcome built by hand): the
    ``worst`` metric then falls back to the mean."""

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """The mean TPOT, ``(last token - first token) / (outputs - 1)``; None for a single output token."""
        if self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    def tpot_by(self, metric: TpotMetric) -> float | None:
        """The TPOT that ``metric`` names (``worst``: :attr:`max_tpot_s`; ``mean``: :attr:`tpot_s`)."""
        mean = self.tpot_s
        if metric == "mean" or mean is None or self.max_tpot_s is None:
            return mean
        return self.max_tpot_s

    def meets_slo(self, metric: TpotMetric) -> bool:
        """TTFT and the ``metric`` TPOT both within their targets (a single output token meets the TPOT's)."""
        tpot = self.tpot_by(metric)
        return self.ttft_s <= self.ttft_slo_s and (tpot is None or tpot <= self.tpot_slo_s)

    @property
    def met_slo(self) -> bool:
        """:meth:`meets_slo` with :data:`agent.telemetry.DEFAULT_TPOT_METRIC` (what the wire's ``met_slo`` says)."""
        return self.meets_slo(DEFAULT_TPOT_METRIC)


class Migrant(msgspec.Struct, frozen=True):
    """A request taken off a unit with its progress, to be placed on another (migration, hand-over, fault).

    ``computed_tokens`` is the KV that travels with it (0 when it must be recomputed on the target: the
    target then prefills prompt and generated tokens again, vLLM's recompute path).
    """

    spec: SubmittedRequest
    output_tokens: int
    computed_tokens: int
    first_token_s: float | None
    num_preemptions: int
    max_tpot_s: float | None = None
    """The worst per-token TPOT so far (None before a second output token), carried to the next unit."""

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus outputs so far."""
        return self.spec.prompt_tokens + self.output_tokens

    def without_kv(self) -> Migrant:
        """The same request after its KV was lost (it recomputes on its next unit)."""
        return msgspec.structs.replace(self, computed_tokens=0)


class StepResult(msgspec.Struct, frozen=True):
    """What :meth:`Engine.end_step` hands back to the node."""

    record: StepRecord
    finished: tuple[RequestOutcome, ...]
    preempted: tuple[str, ...]
    first_tokens: tuple[str, ...]
    handoffs: tuple[Migrant, ...] = ()
    """Requests a prefill-role unit finished prefilling and let go (disaggregated topology), with their KV."""


class Engine(Protocol):
    """One DP unit, as the node drives it."""

    unit_id: int
    policy: BatchPolicy
    role: str
    """``mixed`` (colocated), ``prefill`` or ``decode`` (disaggregated pools)."""
    instance: int | None
    """The lockstep group the node put the unit in (``UnitLoad.instance``); None: it steps on its own."""

    def submit(self, request: SubmittedRequest, now_s: float) -> None: ...

    def has_work(self) -> bool: ...

    @property
    def busy(self) -> bool:
        """A step is in flight."""
        ...

    def begin_step(self, now_s: float) -> float | None:
        """Plan and start a step; its duration in seconds, or None when there is nothing to run."""
        ...

    def end_step(self, now_s: float) -> StepResult: ...

    def load(self, with_requests: bool = False) -> UnitLoad:
        """The unit's load; ``with_requests`` also lists its resident requests (for rebalancing dispatchers)."""
        ...

    def has_request(self, request_id: str) -> bool: ...

    def stepping(self, request_id: str) -> bool:
        """The request is part of the step in flight (it cannot move before that step ends)."""
        ...

    def set_migrating(self, request_id: str, migrating: bool) -> None:
        """Mark a resident request as being transferred (shown in :meth:`load`)."""
        ...

    def detach(self, request_id: str) -> Migrant:
        """Take a resident request off the unit (not while it is :meth:`stepping`), freeing its KV blocks."""
        ...

    def attach(self, migrant: Migrant, now_s: float) -> bool:
        """Take over a request with its progress; True when its KV was kept (room for it), else it recomputes."""
        ...

    def evacuate(self) -> list[Migrant]:
        """The unit failed: drop the step in flight and every request (their KV is lost)."""
        ...

    def running_views(self) -> tuple[RequestView, ...]:
        """The running requests (admitted, holding KV) as policies see them, in the unit's running order."""
        ...

    def set_policy(self, policy: BatchPolicy) -> None: ...

    def set_policy_params(self, changes: Mapping[str, ParamValue]) -> None:
        """Change live parameters of the batch policy, as ``BatchPolicy.check_params`` returned them (not checked
        again); they apply at the next step."""
        ...

    @property
    def cost(self) -> StepCoefficients:
        """The unit's current step-time model (what its policy plans with)."""
        ...
