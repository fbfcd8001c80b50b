"""What goes over a vLLM unit's channel (:mod:`agent.engine.vllm.channel`), one msgpack frame per message.

* In (agent -> our scheduler in the engine-core process): a :data:`ControlRequest`, tagged by ``op``:
  :class:`SetPolicy`, :class:`SetParams`, :class:`Ping`, each with the ``id`` its reply echoes.
* Out (scheduler -> agent): an :data:`EngineMessage`, tagged by ``kind``: a :class:`StepMessage` per step and a
  :class:`ControlReply` per control request.

Both ends run the same code, so every message forbids unknown fields, and a frame that is not one of these
messages (not msgpack, an unknown tag, a missing or mistyped field) is a :class:`FrameError` from
:func:`decode_control` / :func:`decode_engine`; the scheduler answers a refused control frame that carries an
``id`` with an error reply. No vLLM imports: the agent's side reads these without vLLM.
"""

from __future__ import annotations

from typing import Final

import msgspec

from policies.params import ParamValue
from policies.types import ReasonValue, StepMode


class FrameError(ValueError):
    """A frame that does not decode to the messages expected; ``id``: the control id it carried, if readable (so
    that the scheduler can answer it)."""

    def __init__(self, message: str, id: str | None = None) -> None:
        super().__init__(message)
        self.id = id


# -- in: control requests ----------------------------------------------------------------------------------
class ControlBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="op", forbid_unknown_fields=True):
    id: str = ""
    """Set by the agent's unit when it sends the request (``VllmUnit.send_control``); the reply echoes it."""


class SetPolicy(ControlBase, frozen=True, kw_only=True, tag="set_policy"):
    """Replace the unit's batch policy with a fresh ``name`` (``params`` over its defaults)."""

    name: str
    params: dict[str, ParamValue] = {}


class SetParams(ControlBase, frozen=True, kw_only=True, tag="set_params"):
    """Change parameters of the running batch policy (it validates them: nothing changes on an error)."""

    changes: dict[str, ParamValue] = {}


class Ping(ControlBase, frozen=True, kw_only=True, tag="ping"):
    """Change nothing; the reply carries the policy's parameters."""


ControlRequest = SetPolicy | SetParams | Ping


# -- out: step messages and control replies ------------------------------------------------------------------
class EngineBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", forbid_unknown_fields=True,
                 omit_defaults=True, gc=False):
    """Fields of everything the scheduler sends. Not tracked by the cyclic garbage collector (``gc=False``): only
    scalars, tuples and maps of scalars, and a unit keeps thousands (``VllmUnit.raw``)."""

    unit_id: int
    dropped_before: int = 0
    """Messages the scheduler's sink dropped just before this one (the agent did not read: a full queue)."""


class StepMessage(EngineBase, frozen=True, kw_only=True, tag="step"):
    """One engine step, as the scheduler measured and planned it. The fields up to ``reasons`` are
    :class:`~agent.engine.base.StepRecord`'s (``agent.engine.vllm.unit.record_from``; ``docs/records.md``)."""

    step_id: int
    """The unit's step counter, from 1."""
    start_s: float
    """Wall clock (``time.time()``), s."""
    duration_s: float
    """Measured, s (see :mod:`agent.engine.vllm.scheduler` for where a step starts and ends)."""
    predicted_s: float
    """The unit's online step model, before the step, s."""
    mode: StepMode
    policy: str
    """The batch policy that planned the step."""
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_reqs: int
    num_decode_reqs: int
    context_tokens: int
    """Tokens the step's requests attend to (computed before the step plus scheduled in it)."""
    budget_tokens: int
    """The plan's token budget (``StepPlan.token_budget``)."""
    kv_used_blocks: int
    """KV blocks in use after the step."""
    num_blocks: int
    """KV blocks of the unit (vLLM's null block not counted)."""
    num_running: int
    num_waiting: int
    num_preempted: int
    num_finished: int
    reasons: dict[str, ReasonValue] = {}
    """The plan's reasons (``StepPlan.reasons``)."""
    preempted: tuple[str, ...] = ()
    """vLLM's ids of the requests preempted in the step (our ids plus vLLM's suffix), sorted."""
    plan_us: float
    """The policy's ``plan()`` time, µs."""
    admission_budget: float | None = None
    """The policy's prefill admission budget (``admission_budget_tokens()``), tokens; None: it has none."""
    queued_prefill_tokens: int
    """Tokens the waiting requests still have to compute when the step was planned."""


class ControlReply(EngineBase, frozen=True, kw_only=True, tag="control"):
    """The answer to a control request, sent once the scheduler has applied it (or refused it)."""

    id: str
    """The request's ``id``."""
    ok: bool
    error: str = ""
    """Why it was refused (``ok`` False): a bad parameter, an unknown policy, a frame that did not decode."""
    policy: str = ""
    """:class:`SetPolicy`: the new policy's name."""
    old: dict[str, ParamValue] = {}
    """:class:`SetParams`: the changed parameters' previous values."""
    params: dict[str, ParamValue] = {}
    """The policy's parameters after the request (``ok`` only)."""


EngineMessage = StepMessage | ControlReply


# -- codec -------------------------------------------------------------------------------------------------
class _Envelope(msgspec.Struct):
    """What a refused control frame may still tell: its id (other fields ignored)."""

    id: str | None = None


_encoder: Final = msgspec.msgpack.Encoder()
_controls: Final[msgspec.msgpack.Decoder[ControlRequest]] = msgspec.msgpack.Decoder(ControlRequest)
_engine: Final[msgspec.msgpack.Decoder[EngineMessage]] = msgspec.msgpack.Decoder(EngineMessage)
_envelope: Final = msgspec.msgpack.Decoder(_Envelope)


def encode(message: ControlRequest | EngineMessage) -> bytes:
    return _encoder.encode(message)


def decode_control(frame: bytes) -> ControlRequest:
    """A control request from a frame; raises :class:`FrameError` (with the frame's ``id`` when it has one)."""
    try:
        return _controls.decode(frame)
    except msgspec.DecodeError as exc:
        try:
            mid = _envelope.decode(frame).id
        except msgspec.DecodeError:
            mid = None
        raise FrameError(f"bad control frame: {exc}", mid) from None


def decode_engine(frame: bytes) -> EngineMessage:
    """A step message or control reply from a frame; raises :class:`FrameError`."""
    try:
        return _engine.decode(frame)
    except msgspec.DecodeError as exc:
        raise FrameError(f"bad engine frame: {exc}") from None


__all__ = [
    "ControlReply", "ControlRequest", "EngineMessage", "FrameError", "Ping", "SetParams", "SetPolicy", "StepMessage",
    "decode_control", "decode_engine", "encode",
]
