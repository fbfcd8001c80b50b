"""Telemetry events: everything an agent streams (:data:`Event`), the protocol's version and limits, and its
error codes. Conventions are the package's (:mod:`agent.telemetry`)."""

from __future__ import annotations

import enum
from typing import Annotated, Final, Literal, get_args

import msgspec

from policies.params import ParamValue
from policies.types import ReasonValue, StepMode

PROTOCOL_VERSION: Final = 2
"""Bumped on any change that an older peer cannot decode (a removed or retyped field, a new required one, a new
kind of frame). 2: :class:`EventBatch` frames, ``Subscribe.max_batch`` and ``Subscribe.resume_boot_ns``."""

MIN_PROTOCOL_VERSION: Final = 1
"""The oldest protocol whose subscriptions an agent still serves: a version-1 subscriber gets the version-1
stream (one event per frame; its resume position counts in the agent's current run)."""

MAX_FRAME_BYTES: Final = 1 << 20
"""Frames longer than this are refused before decoding (bytes, or characters for a text frame)."""

MAX_BATCH_EVENTS: Final = 4096
"""The most events a subscriber may ask for in one :class:`EventBatch` (``Subscribe.max_batch``)."""

NonNegative = Annotated[int, msgspec.Meta(ge=0)]

TpotMetric = Literal["worst", "mean"]
"""Which TPOT of a request a report and its SLO check use (``docs/benchmarks.md``, "TPOT"):

* ``worst``: the worst per-token TPOT, FairBatching's (seed 003, sections 2.2 and 5.1): the largest, over the
  request's output tokens ``j >= 2``, of ``(time of token j - time of token 1) / (j - 1)`` (a running mean from the
  first token, not the largest gap between two tokens: a stall counts in full just after the first token and less
  the later it comes);
* ``mean``: ``(time of the last token - time of the first) / (outputs - 1)``, which is the worst's value at the last
  token (so never above the worst).

Both are undefined for a single output token (such a request meets its TPOT target trivially)."""

TPOT_METRICS: Final[tuple[TpotMetric, ...]] = get_args(TpotMetric)
DEFAULT_TPOT_METRIC: Final[TpotMetric] = "worst"
"""The TPOT ``met_slo`` (wire, store) and ``trackside bench`` use unless told otherwise."""


class ErrorCode(enum.StrEnum):
    """Why a frame or a command was refused: the codes this module and the wire core give.

    :class:`ErrorReply.code` is a plain string, an open set: the control plane adds its own codes, and a
    client must not fail on a code a newer agent introduced.
    """

    FRAME_TOO_LARGE = "frame_too_large"
    MALFORMED_FRAME = "malformed_frame"
    """Not valid JSON / MessagePack, or nested too deeply."""
    NOT_AN_OBJECT = "not_an_object"
    """Valid, but not a map with a ``kind``."""
    UNKNOWN_KIND = "unknown_kind"
    """``kind`` missing, not a string, or not a known command (or event)."""
    INVALID_FIELD = "invalid_field"
    """A field of the wrong type, out of range, missing, or unknown."""
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_EVENT_KIND = "unknown_event_kind"
    """A subscription names an event kind that does not exist."""
    # Decided by the server, after parsing:
    UNAUTHORIZED = "unauthorized"
    """A change without the control token, or (with a read token configured) a read without either token."""
    DUPLICATE_CONTROL_ID = "duplicate_control_id"
    """A change whose ``control_id`` the agent has seen within its window (``docs/protocol.md``): nothing applied."""
    UNKNOWN_POLICY = "unknown_policy"
    BAD_PARAM = "bad_param"
    UNKNOWN_UNIT = "unknown_unit"
    BAD_RESUME_SEQ = "bad_resume_seq"
    """``resume_after_seq`` is ahead of the stream (a client of an earlier run of the agent)."""
    INTERNAL = "internal_error"


class ProtocolError(ValueError):
    """A frame that cannot be decoded; ``code`` says why, the message says where."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- events ------------------------------------------------------------------------------------------------
class EventBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", gc=False):
    """Fields every event carries.

    Events are not tracked by the cyclic garbage collector (``gc=False``): they hold only scalars, tuples of
    structs and maps of scalars, so they cannot form a cycle, and the agent's replay buffer and a recorder's
    pending rows (hundreds of thousands of events) would otherwise be scanned by every full collection.
    """

    seq: int = 0
    """Position in the node's stream, from 1, assigned by ``agent.telemetry.stream.Sequencer``; 0 marks a notice made
    for one subscriber (flow control, gap), which is not part of the stream."""
    node_id: str
    time_ns: int
    """When it happened (wall clock, ns since the epoch)."""


UnitMode = Literal["active", "draining", "paused", "failed"]
"""``active`` takes new requests; ``draining`` finishes what it holds; ``paused`` runs no steps; ``failed``: its
engine died (or a simulated fault), it takes nothing and its requests went elsewhere (a state, not a command)."""


class UnitStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One unit's configuration and state (in the hello and the status reply)."""

    unit_id: int
    mode: UnitMode = "active"
    batch_policy: str
    batch_params: dict[str, ParamValue] = {}
    num_blocks: int = 0
    max_num_seqs: int = 0
    num_running: int = 0
    num_waiting: int = 0
    gpu_ids: tuple[int, ...] = ()
    """The GPUs a vLLM unit's engine runs on, as the agent's machine numbers them (empty: simulated, on the CPU, or
    not said)."""
    tensor_parallel_size: int = 0
    """GPUs per pipeline stage of a vLLM unit's engine (0: simulated or not said)."""
    pipeline_parallel_size: int = 0
    """Pipeline stages of a vLLM unit's engine (0: simulated or not said)."""
    engine_pid: int | None = None
    """The process id of a vLLM unit's engine core (None: simulated, or no process)."""
    failure: str = ""
    """Why the unit failed (``mode`` ``failed``), e.g. its engine core's exit code."""


class ParamSchema(msgspec.Struct, frozen=True, kw_only=True):
    """One parameter of a policy (``policies.params.ParamSpec`` on the wire)."""

    name: str
    type: Literal["int", "float", "bool", "str"]
    default: ParamValue
    help: str = ""
    unit: str = ""
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()
    live: bool = True
    """Whether it may change while the policy runs."""


class PolicySchema(msgspec.Struct, frozen=True, kw_only=True):
    """A registered policy and its parameters."""

    name: str
    summary: str = ""
    params: tuple[ParamSchema, ...] = ()


class NodeHello(EventBase, frozen=True, kw_only=True, tag="hello"):
    """First frame on every connection: who the node is and what it can be told."""

    protocol_version: int = PROTOCOL_VERSION
    boot_ns: int
    """When this run of the agent started; sequence numbers restart at 1 with every run."""
    profile: str
    """The hardware/model profile the units run (calibration name, or the real model on vLLM)."""
    units: tuple[UnitStatus, ...]
    dispatch_policy: str
    dispatch_params: dict[str, ParamValue] = {}
    batch_policies: tuple[PolicySchema, ...] = ()
    dispatch_policies: tuple[PolicySchema, ...] = ()
    topology: str = ""
    """``colocated`` (every unit takes requests and decodes them) or ``disaggregated`` (a prefill pool hands requests
    to a decode pool); "" from an agent that did not say (before this field)."""
    prefill_units: int = 0
    """Disaggregated: the units in the prefill pool (the first ``prefill_units`` of ``units``); 0 otherwise."""
    lockstep: bool = False
    """Every unit starts its step together (DP+EP lockstep)."""
    instance_size: int = 0
    """Seed 000's instances: consecutive groups of this many units step in lockstep, each group on its own; 0: none
    (or an agent from before this field)."""


class StepEvent(EventBase, frozen=True, kw_only=True, tag="step"):
    """One step of one unit. ``time_ns`` is the step's start; it ended at ``time_ns + measured_ns``."""

    unit_id: int
    step_id: int
    """The unit's step counter."""
    measured_ns: int
    predicted_ns: int
    """What the unit's cost model predicted before the step."""
    mode: StepMode
    policy: str
    """The batch policy that planned the step."""
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
    reasons: dict[str, ReasonValue] = {}
    """The policy's machine-readable account of the plan (non-finite floats travel as strings)."""


class RequestArrived(EventBase, frozen=True, kw_only=True, tag="request_arrived"):
    request_id: str
    prompt_tokens: int
    ttft_slo_ms: float
    tpot_slo_ms: float


class RequestDispatched(EventBase, frozen=True, kw_only=True, tag="request_dispatched"):
    request_id: str
    unit_id: int
    num_rounds_waited: int = 0
    """Dispatch rounds the request was held back at the dispatcher."""


class RequestFirstToken(EventBase, frozen=True, kw_only=True, tag="request_first_token"):
    request_id: str
    unit_id: int
    ttft_ms: float


class RequestFinished(EventBase, frozen=True, kw_only=True, tag="request_finished"):
    """A finished request's timeline; ``time_ns`` is its finish."""

    request_id: str
    unit_id: int
    arrival_ns: int
    first_token_ns: int
    prompt_tokens: int
    output_tokens: int
    num_preemptions: int
    ttft_ms: float
    tpot_ms: float | None
    """The mean TPOT (:data:`TpotMetric` ``mean``); None for a single output token."""
    ttft_slo_ms: float
    tpot_slo_ms: float
    met_slo: bool
    """TTFT and the :data:`DEFAULT_TPOT_METRIC` TPOT within their targets (an agent without ``max_tpot_ms``: the
    mean TPOT)."""
    max_tpot_ms: float | None = None
    """The worst per-token TPOT (:data:`TpotMetric` ``worst``); None for a single output token, and from an agent that
    predates the field (an optional field, added without a protocol version change)."""


class RequestPreempted(EventBase, frozen=True, kw_only=True, tag="request_preempted"):
    request_id: str
    unit_id: int
    step_id: int


class RequestMigrated(EventBase, frozen=True, kw_only=True, tag="request_migrated"):
    """A request moved between units (``time_ns``: when it arrived), or went back to the dispatcher because its
    unit failed (``unit_id`` None)."""

    request_id: str
    from_unit_id: int
    unit_id: int | None
    """The destination; None: back at the dispatcher (its KV lost, it recomputes where it is placed next)."""
    reason: str = ""
    """``why:how``: why (the dispatcher's ``handover``, ``rebalance``, ``starvation``; ``handoff`` from a prefill
    to a decode unit; ``fault``) and how the KV travelled (``live``, ``recompute``, ``lost``)."""


class RequestRefused(EventBase, frozen=True, kw_only=True, tag="request_refused"):
    """Rejected by the dispatcher (``unit_id`` None) or by a unit's admission control."""

    request_id: str
    unit_id: int | None = None
    policy: str
    reason: str = ""


class UnitLoadEvent(EventBase, frozen=True, kw_only=True, tag="unit_load"):
    """A unit's load as the dispatcher saw it at one decision (free capacity: ``num_blocks -
    kv_used_blocks`` blocks and ``max_num_seqs - num_running`` sequences)."""

    unit_id: int
    dispatch_id: int
    """Numbers the dispatcher's decisions; the snapshots of one decision share it."""
    healthy: bool
    num_running: int
    """The batch size."""
    num_waiting: int
    kv_used_blocks: int
    num_blocks: int
    kv_tokens: int
    queued_prefill_tokens: int
    max_num_seqs: int = 0
    pab_tokens: float | None = None
    """FairBatching's prefill admission budget, when the unit's policy computes one."""
    last_step_ns: int | None = None
    mean_step_ns: int | None = None


class StageBoundaries(EventBase, frozen=True, kw_only=True, tag="stage_boundaries"):
    """Length-staged dispatch (e.g. CascadeInfer): which units serve which context lengths, after a change.

    Stage ``k`` takes requests whose context is below ``boundaries_tokens[k]`` (and at or above the previous
    boundary); the last stage takes the rest, so there is one more stage than boundaries.
    """

    policy: str
    boundaries_tokens: tuple[int, ...]
    stage_unit_ids: tuple[tuple[int, ...], ...]
    reason: str = ""


class SlackPoint(msgspec.Struct, frozen=True, kw_only=True):
    """One running request in a slack sample."""

    request_id: str
    deadline_ns: int
    """Deadline of the request's next output token."""
    slack_ms: float
    """Deadline minus the sample time; negative when late."""
    output_tokens: int
    computed_tokens: int


class SlackSample(EventBase, frozen=True, kw_only=True, tag="slack_sample"):
    """The running requests of one unit at one instant, sampled every ``sample_period_ms``."""

    unit_id: int
    sample_period_ms: float
    requests: tuple[SlackPoint, ...]


class Setting(msgspec.Struct, frozen=True, kw_only=True):
    """One target's configuration before or after a control action."""

    unit_id: int | None = None
    """None: the dispatcher."""
    policy: str = ""
    """"" when the action leaves the policy alone (parameter and mode changes)."""
    params: dict[str, ParamValue] = {}
    """Every parameter after a policy swap; the changed ones for ``set_params``."""
    mode: UnitMode | None = None
    """For ``set_unit_mode``."""


class ControlAudit(EventBase, frozen=True, kw_only=True, tag="audit"):
    """Audit record of a control action, whatever its result: who, when (``time_ns``), old, new, result."""

    actor: str
    """Who asked: the connection's peer (``ws:HOST:PORT``)."""
    control_id: str = ""
    """The control request that asked for it."""
    action: str
    """``set_batch_policy``, ``set_dispatch_policy``, ``set_params``, ``set_unit_mode`` or ``post_alert`` (an alert
    posted on the stream: no settings, its severity, code and message in ``message``); for a request refused
    before it ran (``unauthorized``, a missing or repeated ``control_id``) the request's kind (``subscribe``,
    ``status``, ``pause_unit``, ...), or ``connect`` for a token refused at connect. A string on the wire: newer
    agents may add actions."""
    unit_ids: tuple[int, ...] = ()
    """Units concerned; empty for the dispatcher."""
    old: tuple[Setting, ...] = ()
    """One entry per target, before the action (units may differ)."""
    new: tuple[Setting, ...] = ()
    """One entry per target, after the action (or what a dry run would set; what was asked when rejected)."""
    result: Literal["applied", "dry_run", "rejected"]
    error_code: str = ""
    message: str = ""


class AlertCode(enum.StrEnum):
    FLOW_CONTROL = "flow_control"
    """This subscriber was too slow: ``num_dropped`` events, ``first_seq..last_seq``, were dropped."""
    GAP = "gap"
    """A resume asked for events no longer buffered: ``first_seq..last_seq`` are lost."""
    WATCHDOG_RESET = "watchdog_reset"
    """The dispatcher's watchdog reset a unit that did not report a step in time (``unit_id``)."""
    SLO_BREACH = "slo_breach"
    REQUESTS_HELD = "requests_held"
    """The dispatcher held ``num_dropped`` requests past its wait limit (SBS flow control; they stay pending)."""
    UNIT_FAILED = "unit_failed"
    """A unit failed (``unit_id``; its engine core died): it takes no requests, its own went to other units."""
    UNIT_RESTARTED = "unit_restarted"
    """A failed unit (``unit_id``) runs again (a fresh engine) and takes requests."""
    EVENT_LOOP_BUSY = "event_loop_busy"
    """The agent's event loop (on a vLLM node: the OpenAI front end, the dispatch and the telemetry, in one thread)
    was busy nearly all the time for a while (``warning``): it, not the GPUs, may limit the node. ``info`` when it is
    no longer (``agent.service.loop_watch``)."""
    RECOMMENDATION = "recommendation"
    """Posted by a client with the control token (``post_alert``: the recorder's advisor): a policy the what-if on the
    last window says would do better, or what the autopilot applied or rolled back."""


class Alert(EventBase, frozen=True, kw_only=True, tag="alert"):
    code: str
    """An :class:`AlertCode` (a string on the wire: newer agents may add codes)."""
    severity: Literal["info", "warning", "error"] = "warning"
    unit_id: int | None = None
    message: str
    num_dropped: int = 0
    first_seq: int = 0
    last_seq: int = 0


Event = (
    NodeHello | StepEvent | RequestArrived | RequestDispatched | RequestFirstToken | RequestFinished
    | RequestPreempted | RequestMigrated | RequestRefused | UnitLoadEvent | StageBoundaries | SlackSample
    | ControlAudit | Alert
)
"""Everything an agent streams."""


class EventBatch(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="batch"):
    """Several events in one frame, in stream order (protocol 2; only to a subscriber that set
    ``Subscribe.max_batch`` above 1). Any event or notice may be in it; a lone event still travels alone."""

    events: tuple[Event, ...]


def union_tags(union: object) -> frozenset[str]:
    return frozenset(str(cls.__struct_config__.tag) for cls in get_args(union))


EVENT_KINDS: Final = union_tags(Event)
REQUEST_EVENT_KINDS: Final = frozenset(k for k in EVENT_KINDS if k.startswith("request_"))


