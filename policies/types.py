"""Frozen views in, plans out: the types every policy speaks.

A batch policy sees a :class:`UnitView` (one DP unit between two steps) and returns a :class:`StepPlan`.
A dispatch policy sees :class:`PendingRequest` and :class:`UnitLoad` snapshots and returns a
:class:`DispatchDecision`. Nothing here does I/O or reads a clock: time is always an argument.

Token accounting follows vLLM v1 (``vllm/v1/request.py``): a request holds ``num_tokens`` known tokens
(prompt plus outputs sampled so far) of which ``computed_tokens`` already have KV entries. A step that
brings ``computed_tokens`` up to ``num_tokens`` samples one new output token. A running decode therefore
has exactly one pending token; a request that is prefilling (or recomputing after a preemption) has more.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from policies.cost.step_model import StepCoefficients
from policies.frozen import fast_init

ReasonValue = int | float | str | bool
"""A value in a plan's machine-readable reasons."""


class StepMode(enum.StrEnum):
    """What kind of work a step does."""

    MIXED = "mixed"
    """Prefill chunks and decodes together (vLLM's default shape)."""
    PREFILL = "prefill"
    """Only prefill (or recompute) chunks."""
    DECODE = "decode"
    """Only decodes."""
    IDLE = "idle"
    """Nothing scheduled."""


class RequestView(NamedTuple):
    """One request as a batch policy sees it. Output lengths are unknown to policies.

    A named tuple rather than a frozen dataclass, like :class:`ScheduledTokens`: engines build one per running
    request per step (hundreds per step on the per-step hot path), and tuple construction costs a fifth of a
    frozen dataclass's (which sets every field through ``object.__setattr__``).
    """

    request_id: str
    arrival_s: float
    """Arrival time on the node clock (seconds)."""
    prompt_tokens: int
    computed_tokens: int
    """Tokens whose KV is computed (prompt and output prefix)."""
    output_tokens: int
    """Output tokens sampled so far."""
    ttft_slo_s: float
    tpot_slo_s: float
    first_token_s: float | None = None
    """When the first output token was sampled, if it was."""
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus outputs so far."""
        return self.prompt_tokens + self.output_tokens

    @property
    def pending_tokens(self) -> int:
        """Tokens still to compute before the next output token is sampled."""
        return self.num_tokens - self.computed_tokens

    @property
    def is_decode(self) -> bool:
        """True when the request needs exactly one token to produce its next output token."""
        return self.output_tokens > 0 and self.pending_tokens == 1

    @property
    def context_tokens(self) -> int:
        """Sequence length ``L_i = I_i + o_i`` (POLICIES.md notation)."""
        return self.num_tokens

    def token_deadline_s(self, j: int) -> float:
        """Deadline of output token ``j`` (0-based): ``t_i + ttft_slo_i + tpot_slo_i * j``."""
        return self.arrival_s + self.ttft_slo_s + self.tpot_slo_s * j


@fast_init
@dataclass(frozen=True, slots=True)
class UnitView:
    """A DP unit between two steps, as its batch policy sees it."""

    unit_id: int
    step_index: int
    running: tuple[RequestView, ...]
    """Admitted requests, oldest admission first (vLLM's ``self.running`` order)."""
    waiting: tuple[RequestView, ...]
    """Queue order: preempted requests first (they were prepended), then new ones FCFS."""
    block_size: int
    num_blocks: int
    free_blocks: int
    max_num_batched_tokens: int
    """Hard cap of tokens in one step (sizes the engine's buffers)."""
    max_num_seqs: int
    max_model_len: int
    cost: StepCoefficients
    """The unit's current step-time model (calibrated, refined online)."""
    mixed_interference: float = 0.0
    """Calibrated slowdown of mixed steps: a step with decode share ``rho`` takes ``1 + k * rho * (1 - rho)``
    times the linear model's time (the profile's fitted ``k``; 0 = none known). A prior for EB+."""

    def blocks_for(self, tokens: int) -> int:
        """KV blocks needed to hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)


class ScheduledTokens(NamedTuple):
    """One line of a plan: compute ``num_tokens`` tokens of ``request_id`` this step.

    A named tuple rather than a frozen dataclass: a plan holds one per scheduled request (hundreds per step)
    and tuple construction is the cheaper of the two on the per-step hot path.
    """

    request_id: str
    num_tokens: int


@fast_init
@dataclass(frozen=True, slots=True)
class StepPlan:
    """A batch policy's decision for one step of one unit.

    The engine applies ``entries`` in order. Entries for running requests come first; entries for waiting
    requests admit them. When KV blocks run out the engine preempts (recompute) from the tail of
    ``running_order``, skipping requests already scheduled this step, exactly as vLLM pops the tail of
    ``self.running``; after any preemption no waiting request is admitted in that step.
    """

    entries: tuple[ScheduledTokens, ...]
    running_order: tuple[str, ...]
    """Every running request, highest priority first; the tail is the preemption victim."""
    mode: StepMode
    token_budget: int
    reasons: Mapping[str, ReasonValue] = field(default_factory=dict)
    """Machine-readable account of why (e.g. ``{"budget_tokens": 8192, "num_decodes": 12}``)."""

    @property
    def num_tokens(self) -> int:
        """Tokens planned in this step."""
        return sum([n for _, n in self.entries])


@fast_init
@dataclass(frozen=True, slots=True)
class StepFeedback:
    """What a batch policy learns after one of its steps ran (for online cost fits).

    The engine computes this from the step it ran; ``measured_s`` is the real (or simulated) duration and
    ``predicted_s`` what the unit's cost model predicted before the step.
    """

    mode: StepMode
    num_prefill_tokens: int
    num_decode_tokens: int
    context_tokens: int
    """Sum over scheduled requests of their context after the step (the ``ctx`` of the step model)."""
    num_requests: int
    measured_s: float
    predicted_s: float
    num_finished: int = 0
    finished_output_tokens: tuple[int, ...] = ()
    """Output lengths of the requests that finished in this step (for survival curves)."""
    finished_prompt_tokens: tuple[int, ...] = ()
    num_unfinished: int = 0
    """Requests left on the unit (running and waiting) after the step; 0 means the unit is now idle."""

    @property
    def new_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def decode_share(self) -> float:
        """Decode tokens over all tokens of the step (``rho``); 0 for an empty step."""
        n = self.new_tokens
        return self.num_decode_tokens / n if n else 0.0


@fast_init
@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A request waiting at the dispatcher, not yet given to a unit."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    ttft_slo_s: float
    tpot_slo_s: float
    cycles_waited: int = 0
    """Dispatch rounds this request was held back."""
    prefix_hits: tuple[tuple[int, int], ...] = ()
    """``(unit_id, tokens)``: prompt tokens already in that unit's prefix cache, when known (cache-aware SBS)."""


@fast_init
@dataclass(frozen=True, slots=True)
class UnitLoad:
    """A unit's last reported load, as a dispatch policy sees it."""

    unit_id: int
    healthy: bool
    num_running: int
    num_waiting: int
    kv_used_blocks: int
    num_blocks: int
    kv_tokens: int
    """Tokens held in KV (computed tokens of resident requests)."""
    queued_prefill_tokens: int
    """Prompt tokens dispatched to the unit and not yet computed."""
    last_step_s: float | None = None
    mean_step_s: float | None = None
    prefill_admission_budget: float | None = None
    """FairBatching's PAB in tokens, when the unit's batch policy computes one."""
    max_num_seqs: int = 0
    role: str = "mixed"
    """``mixed`` (colocated: prefills and decodes), ``prefill`` or ``decode`` (disaggregated pools)."""
    steps_done: int = 0
    """Steps the unit has completed; a change since the dispatcher last looked is an end-of-step report."""
    busy: bool = False
    """A step is in flight."""
    inflight_tokens: int = 0
    """Tokens of the step in flight (0 when idle)."""
    chunk_tokens: int = 0
    """Token capacity of one step (``C_chunk``: the unit's ``max_num_batched_tokens``)."""
    block_size: int = 16
    migrations_inflight: int = 0
    """Transfers under way from or to this unit."""
    requests: tuple[RunningRequest, ...] = ()
    """Resident requests (running and waiting); filled only for dispatchers with ``needs_requests``."""
    instance: int | None = None
    """The lockstep group the unit steps with (seed 000's instance: DP units in lockstep, instances out of phase);
    None: it steps on its own."""

    @property
    def free_kv_tokens(self) -> int:
        """Tokens the unit's free KV blocks can hold."""
        return (self.num_blocks - self.kv_used_blocks) * self.block_size

    @property
    def kv_usage(self) -> float:
        """Used over total KV blocks (0 when the unit reports no capacity)."""
        return self.kv_used_blocks / self.num_blocks if self.num_blocks else 0.0


@fast_init
@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request resident on a unit, as a rebalancing dispatcher sees it (no output length: unknown)."""

    request_id: str
    context_tokens: int
    """Known tokens: prompt plus outputs so far (``L_i``)."""
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    arrival_s: float
    migrating: bool = False
    """A transfer of this request is under way."""


@fast_init
@dataclass(frozen=True, slots=True)
class Migration:
    """Move a resident request from one unit to another (CascadeInfer's hand-over and rebalancing)."""

    request_id: str
    source_unit: int
    target_unit: int
    reason: str = ""
    """Why (``handover``, ``rebalance``, ``starvation``...): shown in telemetry."""


@fast_init
@dataclass(frozen=True, slots=True)
class HandoffRequest:
    """A request whose prefill finished on a prefill unit and needs a decode unit (disaggregated topology)."""

    request_id: str
    context_tokens: int
    """Tokens whose KV moves with the request."""
    prompt_tokens: int


@fast_init
@dataclass(frozen=True, slots=True)
class DispatchDecision:
    """Where pending requests go now; requests not named stay pending."""

    assignments: tuple[tuple[str, int], ...] = ()
    """``(request_id, unit_id)`` pairs, in dispatch order."""
    rejected: tuple[str, ...] = ()
    """Requests refused outright (counted, never silently dropped)."""
    next_check_s: float | None = None
    """Ask the policy again at this time even if nothing arrives (None: only on events)."""
    reasons: Mapping[str, ReasonValue] = field(default_factory=dict)
    migrations: tuple[Migration, ...] = ()
    """Resident requests to move (the node starts at most what its mechanism allows; see ``Node``)."""
    flow_control: tuple[str, ...] = ()
    """Pending requests held past the dispatcher's wait limit (throttled; reported as alerts)."""
