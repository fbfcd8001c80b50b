"""The wire protocol between an agent and its consoles and recorders: versioned, tagged msgspec structs.

Everything an agent streams is an :data:`Event`; everything a client may ask is a :data:`ControlRequest`,
answered by a :data:`Reply`. Each struct is frozen and tagged: its ``kind`` field names it on the wire
(``{"kind": "step", ...}``), and decoders pick the type from it.

Conventions (STYLE example 5): counts are ``num_*``, ids ``*_id(s)``, units in names (``_tokens``,
``_blocks``, ``_ns``, ``_ms``). Instants are wall-clock nanoseconds since the epoch (``time.time_ns()``
style ints, never a monotonic clock); step durations are integer nanoseconds; request latencies and SLOs
are float milliseconds (the unit operators and the workload files use). No prompt or output text is ever
on the wire. Every event carries the node's id and a sequence number.

Event decoders skip unknown fields (an older console reads a newer agent's events); control requests
forbid them (a misspelt field in a command is an error, never silently ignored). This module imports
no vLLM, torch, engine or UI code: the console and the store import it.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Final, Literal, cast, get_args

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
    """Position in the node's stream, from 1, assigned by ``agent.wire.Sequencer``; 0 marks a notice made
    for one subscriber (flow control, gap), which is not part of the stream."""
    node_id: str
    time_ns: int
    """When it happened (wall clock, ns since the epoch)."""


UnitMode = Literal["active", "draining", "paused"]
"""``active`` takes new requests; ``draining`` finishes what it holds; ``paused`` runs no steps."""


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
    """None for a single output token."""
    ttft_slo_ms: float
    tpot_slo_ms: float
    met_slo: bool


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
    control_id: str = ""
    """The control request that asked for it."""
    action: Literal["set_batch_policy", "set_dispatch_policy", "set_params", "set_unit_mode"]
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


def _tags(union: object) -> frozenset[str]:
    return frozenset(str(cls.__struct_config__.tag) for cls in get_args(union))


EVENT_KINDS: Final = _tags(Event)
REQUEST_EVENT_KINDS: Final = frozenset(k for k in EVENT_KINDS if k.startswith("request_"))


# -- control -------------------------------------------------------------------------------------------------
class RequestBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", forbid_unknown_fields=True):
    needs_token: ClassVar[bool] = True
    """Whether the server must check ``token`` (read-only requests need none)."""
    control_id: str = ""
    """Chosen by the client; echoed in the reply and the audit event."""
    token: str = ""


class Status(RequestBase, frozen=True, kw_only=True, tag="status"):
    needs_token: ClassVar[bool] = False


class ListPolicies(RequestBase, frozen=True, kw_only=True, tag="list_policies"):
    needs_token: ClassVar[bool] = False


class SetBatchPolicy(RequestBase, frozen=True, kw_only=True, tag="set_batch_policy"):
    policy: str
    params: dict[str, ParamValue] = {}
    unit_ids: tuple[NonNegative, ...] = ()
    """Empty: every unit."""


class SetDispatchPolicy(RequestBase, frozen=True, kw_only=True, tag="set_dispatch_policy"):
    policy: str
    params: dict[str, ParamValue] = {}


class SetParams(RequestBase, frozen=True, kw_only=True, tag="set_params"):
    """Live parameter changes of the running batch (or dispatch) policy."""

    target: Literal["batch", "dispatch"]
    params: Annotated[dict[str, ParamValue], msgspec.Meta(min_length=1)]
    unit_ids: tuple[NonNegative, ...] = ()


class DryRun(RequestBase, frozen=True, kw_only=True, tag="dry_run"):
    """Validate a change and report what it would do, changing nothing (the inner token is ignored)."""

    change: SetBatchPolicy | SetDispatchPolicy | SetParams


class PauseUnit(RequestBase, frozen=True, kw_only=True, tag="pause_unit"):
    unit_id: NonNegative


class DrainUnit(RequestBase, frozen=True, kw_only=True, tag="drain_unit"):
    """Stop dispatching to the unit; it finishes what it holds."""

    unit_id: NonNegative


class ResumeUnit(RequestBase, frozen=True, kw_only=True, tag="resume_unit"):
    unit_id: NonNegative


class Subscribe(RequestBase, frozen=True, kw_only=True, tag="subscribe"):
    """Start (or resume) the event stream on this connection. Read-only: no token needed."""

    needs_token: ClassVar[bool] = False
    protocol_version: int = PROTOCOL_VERSION
    unit_ids: tuple[NonNegative, ...] | None = None
    """None: every unit. Node-level events (hello, dispatcher changes, node alerts) always pass."""
    kinds: tuple[str, ...] | None = None
    """Event kinds (:data:`EVENT_KINDS`); None: all."""
    resume_after_seq: NonNegative | None = None
    """The last sequence number the client has; the stream restarts after it (None: live only)."""
    resume_boot_ns: int | None = None
    """The run of the agent (its hello's ``boot_ns``) that ``resume_after_seq`` counts in; None: the current
    run. When it names another run (the agent restarted, its sequence numbers with it), the stream restarts
    from the first event this run still buffers, after a ``gap`` alert when that is not seq 1."""
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH_EVENTS)] = 1
    """Events per frame at most: above 1, whatever is queued for this subscriber when it can send goes as one
    :class:`EventBatch` (never waiting for more; at most :data:`MAX_FRAME_BYTES` bytes); 1: one event per
    frame. Needs ``protocol_version`` 2."""


ControlRequest = (
    Status | ListPolicies | SetBatchPolicy | SetDispatchPolicy | SetParams | DryRun | PauseUnit | DrainUnit
    | ResumeUnit | Subscribe
)
CONTROL_KINDS: Final = _tags(ControlRequest)


class StatusInfo(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="status_info"):
    protocol_version: int = PROTOCOL_VERSION
    node_id: str
    dispatch_policy: str
    dispatch_params: dict[str, ParamValue] = {}
    units: tuple[UnitStatus, ...]
    last_seq: int
    oldest_seq: int
    """Oldest sequence number still buffered for resume."""
    num_subscribers: int = 0


class PolicyList(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="policy_list"):
    batch_policies: tuple[PolicySchema, ...]
    dispatch_policies: tuple[PolicySchema, ...]


class Subscribed(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="subscribed"):
    last_seq: int
    """The stream's position when the subscription started."""
    num_replayed: int = 0
    """Buffered events queued for this subscriber by the resume."""
    resumed_after_seq: int | None = None
    """Where the stream restarts: the request's ``resume_after_seq``, or 0 when its ``resume_boot_ns`` named
    another run of the agent (None: live only)."""


Payload = StatusInfo | PolicyList | ControlAudit | Subscribed


class OkReply(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="ok"):
    control_id: str = ""
    payload: Payload | None = None


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="error"):
    control_id: str = ""
    code: str
    """An :class:`ErrorCode`, or a code of the control plane."""
    message: str


Reply = OkReply | ErrorReply
AgentFrame = Event | EventBatch | Reply
"""Anything a client receives."""
Message = Event | EventBatch | ControlRequest | Reply


# -- codecs --------------------------------------------------------------------------------------------------
Format = Literal["msgpack", "json"]


class Codec:
    """One wire format: a reusable encoder and typed decoders, a size check, and one error type.

    Decoding never raises anything but :class:`ProtocolError`, whose ``code`` tells a malformed frame from
    an unknown kind or a bad field. Encoding our own structs raises only on values no format can hold
    (an int beyond 64 bits; in JSON, a non-finite float becomes ``null`` and will not decode back).
    """

    def __init__(self, fmt: Format, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if fmt not in ("msgpack", "json"):
            raise ValueError(f"unknown format {fmt!r} (msgpack or json)")
        self.format: Format = fmt
        self.max_frame_bytes = max_frame_bytes
        encoder = msgspec.msgpack.Encoder() if fmt == "msgpack" else msgspec.json.Encoder()
        self._encode = encoder.encode
        self._encode_into = encoder.encode_into
        self._batch = _BATCH_FRAMING[fmt]
        self._events = _decoder(fmt, Event)
        self._requests = _decoder(fmt, ControlRequest)
        self._agent_frames = _decoder(fmt, AgentFrame)
        self._untyped = _decoder(fmt, object)

    def encode(self, message: Message) -> bytes:
        return self._encode(message)

    def encode_batch(self, events: Sequence[Event], max_bytes: int | None = None) -> tuple[bytes, int]:
        """An :class:`EventBatch` frame of the longest prefix of ``events`` that fits in ``max_bytes`` (default:
        this codec's frame limit), and how many events it holds: at least one, even one alone over the limit.

        The whole batch is encoded in one call; only when that is too long is it built again event by event,
        each encoded straight into the frame until the next one would not fit. The frame decodes as
        ``EventBatch(events=tuple(events[:n]))``.
        """
        limit = self.max_frame_bytes if max_bytes is None else max_bytes
        whole = self._encode(EventBatch(events=tuple(events)))
        if len(whole) <= limit:
            return whole, len(events)
        framing = self._batch
        frame = bytearray(framing.head)
        budget = limit - len(framing.tail)
        encode_into = self._encode_into
        num = 0
        for event in events:
            mark = len(frame)
            if num:
                frame += framing.separator
            encode_into(event, frame, -1)
            if len(frame) > budget and num:
                del frame[mark:]
                break
            num += 1
        framing.finish(frame, num)
        return bytes(frame), num

    def decode_event(self, frame: bytes | str) -> Event:
        """What the store and replay read."""
        return cast(Event, self._decode(self._events, frame, "event", EVENT_KINDS))

    def decode_request(self, frame: bytes | str) -> ControlRequest:
        """What the agent reads from a client."""
        return cast(ControlRequest, self._decode(self._requests, frame, "command", CONTROL_KINDS))

    def decode_agent_frame(self, frame: bytes | str) -> AgentFrame:
        """What a client reads from an agent: events and replies on one connection."""
        return cast(AgentFrame, self._decode(self._agent_frames, frame, "agent frame", _AGENT_FRAME_KINDS))

    def control_id_of(self, frame: bytes | str) -> str:
        """The ``control_id`` of a frame that may not decode as a command ("" when there is none)."""
        if len(frame) > self.max_frame_bytes:
            return ""
        raw = self._peek(frame)
        value = raw.get("control_id") if isinstance(raw, dict) else None
        return value if isinstance(value, str) else ""

    def _decode(
        self,
        decode: Callable[[Any], Any],
        frame: bytes | str,
        what: str,
        kinds: frozenset[str],
    ) -> Any:
        if len(frame) > self.max_frame_bytes:
            raise ProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"{what} frame of {len(frame)} bytes is over the limit of {self.max_frame_bytes}",
            )
        if isinstance(frame, str) and self.format == "msgpack":
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"a MessagePack {what} frame must be binary, got text")
        try:
            return decode(frame)
        except msgspec.ValidationError as exc:
            raise self._classify(frame, exc, what, kinds) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # invalid UTF-8 in a MessagePack str
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"malformed {self.format} {what} frame: {exc}") from None
        except RecursionError:
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"{what} frame is nested too deeply") from None

    def _peek(self, frame: bytes | str) -> object:
        try:
            return self._untyped(frame)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError, TypeError):
            return None

    def _classify(
        self, frame: bytes | str, exc: msgspec.ValidationError, what: str, kinds: frozenset[str]
    ) -> ProtocolError:
        raw = self._peek(frame)
        if raw is None:
            return ProtocolError(ErrorCode.MALFORMED_FRAME, f"malformed {self.format} {what} frame: {exc}")
        if not isinstance(raw, dict):
            return ProtocolError(
                ErrorCode.NOT_AN_OBJECT, f"a {what} must be an object with a 'kind', got {type(raw).__name__}"
            )
        kind = raw.get("kind")
        if kind is None:
            return ProtocolError(ErrorCode.UNKNOWN_KIND, f"{what} has no 'kind'")
        if not isinstance(kind, str) or kind not in kinds:
            return ProtocolError(
                ErrorCode.UNKNOWN_KIND, f"unknown {what} kind {kind!r} (known: {', '.join(sorted(kinds))})"
            )
        return ProtocolError(ErrorCode.INVALID_FIELD, f"invalid {kind}: {exc}")


def _decoder(fmt: Format, type_: Any) -> Callable[[Any], Any]:
    if fmt == "msgpack":
        return msgspec.msgpack.Decoder(type_).decode
    return msgspec.json.Decoder(type_).decode


_AGENT_FRAME_KINDS: Final = _tags(AgentFrame)


@dataclass(frozen=True, slots=True)
class _BatchFraming:
    """How a format writes an :class:`EventBatch` around events encoded one after the other."""

    head: bytes
    separator: bytes
    tail: bytes
    count_at: int | None
    """MessagePack: where the array's 32-bit length goes (known only at the end); JSON has no count."""

    def finish(self, frame: bytearray, num_events: int) -> None:
        if self.count_at is not None:
            struct.pack_into(">I", frame, self.count_at, num_events)
        frame += self.tail


_MSGPACK_HEAD = b"\x82\xa4kind\xa5batch\xa6events\xdd\x00\x00\x00\x00"
"""``{"kind": "batch", "events": [...]}``: a map of two, then an array in its 32-bit form (``0xdd``, length)."""
_BATCH_FRAMING: Final[dict[Format, _BatchFraming]] = {
    "msgpack": _BatchFraming(_MSGPACK_HEAD, b"", b"", count_at=len(_MSGPACK_HEAD) - 4),
    "json": _BatchFraming(b'{"kind":"batch","events":[', b",", b"]}", count_at=None),
}

MSGPACK: Final = Codec("msgpack")
"""Binary frames (the default for agents and the store)."""
JSON: Final = Codec("json")
"""Text frames (debugging, ``websocat``, browser tools)."""
CODECS: Final[dict[Format, Codec]] = {"msgpack": MSGPACK, "json": JSON}
