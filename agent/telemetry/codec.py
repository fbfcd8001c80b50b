"""The two wire formats (MessagePack and JSON): typed encoders and decoders, batch framing, frame-size checks.
Decoding raises only :class:`~agent.telemetry.events.ProtocolError`."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, cast

import msgspec

from agent.telemetry.commands import CONTROL_KINDS, AgentFrame, ControlRequest, Message
from agent.telemetry.events import (
    EVENT_KINDS,
    MAX_FRAME_BYTES,
    ErrorCode,
    Event,
    EventBatch,
    ProtocolError,
    union_tags,
)

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


_AGENT_FRAME_KINDS: Final = union_tags(AgentFrame)


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
