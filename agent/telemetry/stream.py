"""The Sans-I/O core of the agent's telemetry stream: sequence numbers, replay, per-subscriber queues and
control parsing.

Nothing here does I/O, awaits, or reads a clock on its own: the websocket server (``agent.service.server``)
feeds events in and takes frames out, and wall-clock time comes from an injected ``get_time_ns``. Everything is
single-threaded: the server calls it from its event loop.

Flow: the node's records are converted to events by the runtime (``agent.runtime.events``), stamped by the
:class:`Sequencer`, appended to the :class:`ReplayBuffer` and offered to every :class:`Subscription`; each
subscriber's sender pops from its own bounded queue, so a slow reader loses events (counted, announced) instead
of stalling the engines.
"""

from __future__ import annotations

import hmac
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from itertools import islice
from typing import TypeVar

import msgspec

from agent.telemetry import (
    CODECS,
    EVENT_KINDS,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Alert,
    AlertCode,
    ControlAudit,
    ControlRequest,
    ErrorCode,
    ErrorReply,
    Event,
    EventBase,
    Format,
    ProtocolError,
    RequestMigrated,
    Subscribe,
)

E = TypeVar("E", bound=EventBase)


# -- sequence and replay -------------------------------------------------------------------------------------
class Sequencer:
    """Numbers the node's events 1, 2, 3, ... in the order they enter the stream."""

    def __init__(self, first_seq: int = 1) -> None:
        self._next = first_seq

    @property
    def last_seq(self) -> int:
        """The last number given (``first_seq - 1`` before any)."""
        return self._next - 1

    def stamp(self, event: E) -> E:
        """A copy of ``event`` carrying the next sequence number."""
        seq = self._next
        self._next += 1
        return msgspec.structs.replace(event, seq=seq)

    def stamp_new(self, event: E) -> E:
        """``event`` itself, given the next sequence number in place (no copy of its fields).

        Only for an event the caller has just built and not shared yet: frozen structs are otherwise never
        mutated. The hub's per-step path uses it; copying a step event cost a quarter of that path.
        """
        msgspec.structs.force_setattr(event, "seq", self._next)
        self._next += 1
        return event


@dataclass(frozen=True, slots=True)
class Replay:
    """What a resume gets: the buffered events after its position, and what is lost before them."""

    events: tuple[Event, ...]
    gap: tuple[int, int] | None = None
    """``(first, last)`` sequence numbers that were asked for but are no longer buffered."""


class ResumeError(ProtocolError):
    """A resume position ahead of the stream (sequence numbers restart with every run of the agent)."""


class ReplayBuffer:
    """The last ``capacity`` events of the stream, for clients that reconnect (a ring: the oldest go first).

    Events must arrive with consecutive sequence numbers, so a position maps to an index without a search.
    """

    def __init__(self, capacity: int, *, first_seq: int = 1) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._events: deque[Event] = deque(maxlen=capacity)
        self._last_seq = first_seq - 1

    @property
    def last_seq(self) -> int:
        """The newest buffered sequence number (``first_seq - 1`` before any event)."""
        return self._last_seq

    @property
    def oldest_seq(self) -> int:
        """The oldest buffered sequence number (``last_seq + 1`` when empty)."""
        return self._last_seq - len(self._events) + 1

    def __len__(self) -> int:
        return len(self._events)

    def append(self, event: Event) -> None:
        if event.seq != self._last_seq + 1:
            raise ValueError(f"expected seq {self._last_seq + 1}, got {event.seq}")
        self._events.append(event)
        self._last_seq = event.seq

    def since(self, after_seq: int) -> Replay:
        """The buffered events after ``after_seq``, and the gap when some of them are gone.

        Raises :class:`ResumeError` when ``after_seq`` is past the newest event or negative.
        """
        if after_seq < 0 or after_seq > self._last_seq:
            raise ResumeError(
                ErrorCode.BAD_RESUME_SEQ,
                f"cannot resume after seq {after_seq}: the stream is at {self._last_seq} "
                "(sequence numbers restart when the agent restarts)",
            )
        oldest = self.oldest_seq
        if after_seq + 1 >= oldest:
            return Replay(tuple(islice(self._events, after_seq + 1 - oldest, None)))
        return Replay(tuple(self._events), (after_seq + 1, oldest - 1))


# -- subscriptions -------------------------------------------------------------------------------------------
def event_unit_ids(event: Event) -> tuple[int, ...]:
    """The units an event concerns; empty for node-level events (which pass every unit filter)."""
    if isinstance(event, RequestMigrated):
        return (event.from_unit_id,) if event.unit_id is None else (event.from_unit_id, event.unit_id)
    if isinstance(event, ControlAudit):
        return event.unit_ids
    unit_id: int | None = getattr(event, "unit_id", None)
    return () if unit_id is None else (unit_id,)


class Subscription:
    """One subscriber's filter and bounded queue.

    Drop policy: when the queue is full, the **oldest** queued event is dropped to make room, so a reader that
    falls behind keeps seeing the present (a live view wants the newest steps; the recorder can fetch the
    dropped range again by resuming, as long as the replay buffer still has it). Drops are counted; the
    next :meth:`pop` returns one ``flow_control`` :class:`Alert` covering every event dropped since the last
    announcement (``num_dropped``, ``first_seq..last_seq``) before any later event. Notices (that alert, a
    resume's ``gap`` alert) take no queue space and carry ``seq`` 0. Offering never blocks and costs O(1).
    """

    def __init__(
        self,
        node_id: str,
        *,
        unit_ids: Collection[int] | None = None,
        kinds: Collection[str] | None = None,
        max_queued: int = 4096,
        max_batch: int = 1,
        get_time_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        if max_queued < 1 or max_batch < 1:
            raise ValueError("max_queued and max_batch must be at least 1")
        unknown = sorted(set(kinds or ()) - EVENT_KINDS)
        if unknown:
            raise ValueError(f"unknown event kinds: {', '.join(unknown)}")
        self.node_id = node_id
        self.unit_ids = frozenset(unit_ids) if unit_ids is not None else None
        self.kinds = frozenset(kinds) if kinds is not None else None
        self.max_queued = max_queued
        self.max_batch = max_batch
        """Events per frame at most (1: one event per frame; more: ``EventBatch`` frames)."""
        self._get_time_ns = get_time_ns
        self._queue: deque[Event] = deque()
        self._notices: deque[Alert] = deque()
        self._drop_count = 0
        self._drop_first = 0
        self._drop_last = 0
        self.num_dropped = 0
        """Events dropped over the subscription's life."""
        self.num_delivered = 0

    @classmethod
    def from_request(
        cls, request: Subscribe, node_id: str, *, max_queued: int = 4096, get_time_ns: Callable[[], int] = time.time_ns
    ) -> Subscription:
        return cls(
            node_id, unit_ids=request.unit_ids, kinds=request.kinds, max_queued=max_queued,
            max_batch=request.max_batch, get_time_ns=get_time_ns,
        )

    def __len__(self) -> int:
        """Frames waiting for the sender (queued events and notices)."""
        return len(self._queue) + len(self._notices) + (1 if self._drop_count else 0)

    def wants(self, event: Event) -> bool:
        if self.kinds is not None and event.__struct_config__.tag not in self.kinds:
            return False
        if self.unit_ids is None:
            return True
        units = event_unit_ids(event)
        return not units or not self.unit_ids.isdisjoint(units)

    def offer(self, event: Event) -> bool:
        """Queue ``event`` if the filter wants it (dropping the oldest when full); False when filtered out."""
        if not self.wants(event):
            return False
        if len(self._queue) >= self.max_queued:
            dropped = self._queue.popleft()
            if not self._drop_count:
                self._drop_first = dropped.seq
            self._drop_count += 1
            self._drop_last = dropped.seq
            self.num_dropped += 1
        self._queue.append(event)
        return True

    def resume(self, replay: Replay) -> None:
        """Queue a resume's events, after a ``gap`` notice when some are lost."""
        if replay.gap is not None:
            first, last = replay.gap
            self._notices.append(
                self._alert(
                    AlertCode.GAP, f"events {first}..{last} are no longer buffered", first_seq=first, last_seq=last
                )
            )
        for event in replay.events:
            self.offer(event)

    def pop(self) -> Event | None:
        """The next frame for this subscriber, or None when there is nothing to send."""
        if self._notices:
            return self._notices.popleft()
        if self._drop_count:
            count, first, last = self._drop_count, self._drop_first, self._drop_last
            self._drop_count = 0
            return self._alert(
                AlertCode.FLOW_CONTROL,
                f"subscriber too slow: dropped {count} events ({first}..{last})",
                num_dropped=count,
                first_seq=first,
                last_seq=last,
            )
        if not self._queue:
            return None
        self.num_delivered += 1
        return self._queue.popleft()

    def pop_many(self, limit: int) -> list[Event]:
        """The next ``limit`` frames at most, in the order :meth:`pop` gives them (one call per batch frame)."""
        out: list[Event] = []
        while len(out) < limit and (self._notices or self._drop_count):
            notice = self.pop()
            assert notice is not None
            out.append(notice)
        queue = self._queue
        num = min(limit - len(out), len(queue))
        if num == len(queue):
            out.extend(queue)
            queue.clear()
        else:
            popleft = queue.popleft
            out.extend(popleft() for _ in range(num))
        self.num_delivered += num
        return out

    def _alert(
        self, code: AlertCode, message: str, *, first_seq: int, last_seq: int, num_dropped: int = 0
    ) -> Alert:
        return Alert(
            node_id=self.node_id,
            time_ns=self._get_time_ns(),
            code=code,
            message=message,
            num_dropped=num_dropped,
            first_seq=first_seq,
            last_seq=last_seq,
        )


# -- control -------------------------------------------------------------------------------------------------
def parse_control(frame: bytes | str, *, fmt: Format = "json") -> ControlRequest | ErrorReply:
    """A client's command, or the error to send back; never raises on bad input.

    The frame size limit is the codec's (:data:`agent.telemetry.MAX_FRAME_BYTES`). Beyond decoding, a
    subscription must speak a protocol version this agent serves (:data:`MIN_PROTOCOL_VERSION` to
    :data:`PROTOCOL_VERSION`), use only its version's fields, and name only known event kinds.
    """
    codec = CODECS[fmt]
    try:
        request = codec.decode_request(frame)
    except ProtocolError as exc:
        return ErrorReply(control_id=codec.control_id_of(frame), code=exc.code, message=str(exc))
    if isinstance(request, Subscribe):
        refusal = _refuse_subscription(request)
        if refusal is not None:
            code, message = refusal
            return ErrorReply(control_id=request.control_id, code=code, message=message)
    return request


def _refuse_subscription(request: Subscribe) -> tuple[ErrorCode, str] | None:
    version = request.protocol_version
    if not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
        return ErrorCode.UNSUPPORTED_VERSION, (
            f"this agent speaks protocol {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}, not {version}"
        )
    if version < 2 and (request.max_batch != 1 or request.resume_boot_ns is not None):
        return ErrorCode.INVALID_FIELD, "max_batch and resume_boot_ns need protocol_version 2"
    unknown = sorted(set(request.kinds or ()) - EVENT_KINDS)
    if unknown:
        return ErrorCode.UNKNOWN_EVENT_KIND, (
            f"unknown event kinds {', '.join(unknown)} (known: {', '.join(sorted(EVENT_KINDS))})"
        )
    return None


def token_matches(given: str, expected: str) -> bool:
    """Constant-time token comparison; always False when no token is configured (control is then off)."""
    if not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


