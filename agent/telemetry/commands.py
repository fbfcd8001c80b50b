"""Commands a client sends an agent (:data:`ControlRequest`: read-only queries, authenticated changes, a
subscription) and the agent's replies (:data:`Reply`); :data:`AgentFrame` is anything a client receives.
Commands forbid unknown fields: a misspelt field is an error, never silently ignored."""

from __future__ import annotations

from typing import Annotated, ClassVar, Final, Literal

import msgspec

from agent.telemetry.events import (
    MAX_BATCH_EVENTS,
    PROTOCOL_VERSION,
    ControlAudit,
    Event,
    EventBatch,
    NonNegative,
    PolicySchema,
    UnitStatus,
    union_tags,
)
from policies.params import ParamValue

# -- control -------------------------------------------------------------------------------------------------
MAX_CONTROL_ID_CHARS: Final = 128
"""The longest ``control_id`` a request may carry (a UUID's hex is 32)."""
MAX_ALERT_MESSAGE_CHARS: Final = 500
"""The longest message a :class:`PostAlert` may carry."""


class RequestBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", forbid_unknown_fields=True):
    needs_token: ClassVar[bool] = True
    """Whether this is a change: it needs the control token and a ``control_id`` of its own. A read (``status``,
    ``list_policies``, ``subscribe``) changes nothing: it needs no token, or, when the agent has a read token, that
    one or the control token, and no ``control_id`` (its repeats are harmless and answered every time)."""
    control_id: Annotated[str, msgspec.Meta(max_length=MAX_CONTROL_ID_CHARS)] = ""
    """Chosen by the client; echoed in the reply and the audit event. A change must carry one that this agent has not
    seen within its window (10 minutes and the last 4,096 changes by default): a repeat (a replayed frame, a retry
    after a lost reply) is refused ``duplicate_control_id`` and applies nothing, an empty one ``invalid_field``.
    The clients here send a random UUID's hex."""
    token: str = ""
    """The control token for a change; for a read, the read token or the control token when the agent has a read
    token (otherwise ignored)."""


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


class FailUnit(RequestBase, frozen=True, kw_only=True, tag="fail_unit"):
    """Take the unit out as a failure would: it is ``failed``, its requests go on other units. A vLLM unit's
    engine keeps running and is not restarted until :class:`RecoverUnit`."""

    unit_id: NonNegative
    reason: str = ""
    """Said in the ``unit_failed`` alert and the unit's ``failure`` (after who asked)."""


class RecoverUnit(RequestBase, frozen=True, kw_only=True, tag="recover_unit"):
    """Bring a ``failed`` unit back (a vLLM unit whose engine is dead is restarted now); it rejoins empty."""

    unit_id: NonNegative


class PostAlert(RequestBase, frozen=True, kw_only=True, tag="post_alert"):
    """An alert from the operator's tooling (``trackside record --advise-every``: the advisor) that the agent publishes
    on its stream as an ``alert`` event of its own: numbered, buffered for resumes, recorded, replayed. A change: it
    needs the control token and a ``control_id``, and is audited (action ``post_alert``). An agent older than it
    answers ``unknown_kind``."""

    code: Literal["recommendation"]
    """A closed set: ``recommendation`` (a policy that the what-if on the last window says would do better, or what
    the autopilot did about it)."""
    message: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ALERT_MESSAGE_CHARS)]
    severity: Literal["info", "warning"] = "info"


class Subscribe(RequestBase, frozen=True, kw_only=True, tag="subscribe"):
    """Start (or resume) the event stream on this connection. A read: no token needed unless the agent has a read
    token (then that one or the control token)."""

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
    | ResumeUnit | FailUnit | RecoverUnit | PostAlert | Subscribe
)
CONTROL_KINDS: Final = union_tags(ControlRequest)


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
    num_slow_dropped: int = 0
    """Subscribers the agent closed for not reading (``--subscriber-timeout-s``); 0 from an agent older than it."""


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


