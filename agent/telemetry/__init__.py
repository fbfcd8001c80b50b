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
forbid them (a misspelt field in a command is an error, never silently ignored). This package imports
no vLLM, torch, engine or UI code, and nothing else of ``agent``: the console and the store import it.

The package holds the protocol (:mod:`.events`, :mod:`.commands`, :mod:`.codec`, all re-exported here), the
Sans-I/O stream core that an agent serves it with (:mod:`.stream`: sequence numbers, replay, subscriptions,
control parsing) and the client that consoles, recorders and ``trackside ctl`` read it with (:mod:`.client`).
Importing the package loads msgspec only; the client (websockets) loads when imported.
"""

from __future__ import annotations

from agent.telemetry.codec import (
    CODECS,
    JSON,
    MSGPACK,
    Codec,
    Format,
)
from agent.telemetry.commands import (
    CONTROL_KINDS,
    AgentFrame,
    ControlRequest,
    DrainUnit,
    DryRun,
    ErrorReply,
    ListPolicies,
    Message,
    OkReply,
    PauseUnit,
    Payload,
    PolicyList,
    Reply,
    RequestBase,
    ResumeUnit,
    SetBatchPolicy,
    SetDispatchPolicy,
    SetParams,
    Status,
    StatusInfo,
    Subscribe,
    Subscribed,
)
from agent.telemetry.events import (
    EVENT_KINDS,
    MAX_BATCH_EVENTS,
    MAX_FRAME_BYTES,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    REQUEST_EVENT_KINDS,
    Alert,
    AlertCode,
    ControlAudit,
    ErrorCode,
    Event,
    EventBase,
    EventBatch,
    NodeHello,
    NonNegative,
    ParamSchema,
    PolicySchema,
    ProtocolError,
    RequestArrived,
    RequestDispatched,
    RequestFinished,
    RequestFirstToken,
    RequestMigrated,
    RequestPreempted,
    RequestRefused,
    Setting,
    SlackPoint,
    SlackSample,
    StageBoundaries,
    StepEvent,
    UnitLoadEvent,
    UnitMode,
    UnitStatus,
)

__all__ = [
    "CODECS",
    "CONTROL_KINDS",
    "EVENT_KINDS",
    "JSON",
    "MAX_BATCH_EVENTS",
    "MAX_FRAME_BYTES",
    "MIN_PROTOCOL_VERSION",
    "MSGPACK",
    "PROTOCOL_VERSION",
    "REQUEST_EVENT_KINDS",
    "AgentFrame",
    "Alert",
    "AlertCode",
    "Codec",
    "ControlAudit",
    "ControlRequest",
    "DrainUnit",
    "DryRun",
    "ErrorCode",
    "ErrorReply",
    "Event",
    "EventBase",
    "EventBatch",
    "Format",
    "ListPolicies",
    "Message",
    "NodeHello",
    "NonNegative",
    "OkReply",
    "ParamSchema",
    "PauseUnit",
    "Payload",
    "PolicyList",
    "PolicySchema",
    "ProtocolError",
    "Reply",
    "RequestArrived",
    "RequestBase",
    "RequestDispatched",
    "RequestFinished",
    "RequestFirstToken",
    "RequestMigrated",
    "RequestPreempted",
    "RequestRefused",
    "ResumeUnit",
    "SetBatchPolicy",
    "SetDispatchPolicy",
    "SetParams",
    "Setting",
    "SlackPoint",
    "SlackSample",
    "StageBoundaries",
    "Status",
    "StatusInfo",
    "StepEvent",
    "Subscribe",
    "Subscribed",
    "UnitLoadEvent",
    "UnitMode",
    "UnitStatus",
]
