"""The Sans-I/O core of the agent's telemetry stream: sequence numbers, replay, per-subscriber queues and
control parsing.

Nothing here does I/O, awaits, or reads a clock on its own: the websocket server (``agent.service.server``)
feeds events in and takes frames out, and wall-clock time comes from an injected ``get_time_ns``. Everything is
single-threaded: the server calls it from its event loop.

Flow: the node's records are converted to events by the runtime (``agent.runtime.events``), stamped by the
:class:`Sequencer`, appended to the :class:`ReplayBuffer` and offered to every :class:`Subscription`; each
subscriber's sender pops from its own bounded queue, so a slow reader loses events (counted, announced) instead
of stalling the engines. A resume is read from the replay buffer itself (:class:`ReplayCursor`) as it is sent, so it
costs a subscriber a position, not a copy of the events.
"""

from __future__ import annotations

import hmac
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

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

    def take(self, num: int) -> int:
        """Give the next ``num`` numbers to entries that carry none yet (:meth:`ReplayBuffer.append_deferred`); the
        first of them."""
        first = self._next
        self._next += num
        return first


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

    Events must arrive with consecutive sequence numbers, so a position maps to a slot of the ring without a
    search: :meth:`get` is O(1), which lets every resuming subscriber read the one shared buffer through its own
    :class:`ReplayCursor` instead of copying the events it has yet to send.

    With ``convert``, the buffer may also hold *deferred* entries (:meth:`append_deferred`): something that is not
    an event yet (the hub's step records while nobody subscribes), turned into its event by ``convert(entry, seq)``
    the first time it is read, and kept as that event from then on. Every read returns events only.
    """

    def __init__(
        self, capacity: int, *, first_seq: int = 1, convert: Callable[[Any, int], Event] | None = None
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._convert = convert
        self._ring: list[Any] = []
        """Event ``seq`` lives at ``(seq - first_seq) % capacity`` (the list grows to ``capacity``, then wraps)."""
        self._first_seq = first_seq
        self._last_seq = first_seq - 1

    @property
    def last_seq(self) -> int:
        """The newest buffered sequence number (``first_seq - 1`` before any event)."""
        return self._last_seq

    @property
    def oldest_seq(self) -> int:
        """The oldest buffered sequence number (``last_seq + 1`` when empty)."""
        return self._last_seq - len(self._ring) + 1

    def __len__(self) -> int:
        return len(self._ring)

    def append(self, event: Event) -> None:
        seq = event.seq
        if seq != self._last_seq + 1:
            raise ValueError(f"expected seq {self._last_seq + 1}, got {seq}")
        ring = self._ring
        if len(ring) < self.capacity:
            ring.append(event)
        else:
            ring[(seq - self._first_seq) % self.capacity] = event
        self._last_seq = seq

    def append_deferred(self, entries: list[Any], first_seq: int) -> None:
        """Keep ``entries`` as the events ``first_seq``, ``first_seq + 1``, ... without building them: each becomes
        its event (``convert``) when first read. Entries must not be events."""
        if self._convert is None:
            raise ValueError("a buffer without convert holds events only")
        if first_seq != self._last_seq + 1:
            raise ValueError(f"expected seq {self._last_seq + 1}, got {first_seq}")
        ring, cap, num = self._ring, self.capacity, len(entries)
        room = min(cap - len(ring), num)  # as append: the list grows to capacity, then wraps
        if room > 0:
            ring += entries[:room]
        for k in range(max(room, 0), num):
            ring[(first_seq + k - self._first_seq) % cap] = entries[k]
        self._last_seq += num

    def get(self, seq: int) -> Event:
        """The buffered event ``seq`` (``oldest_seq <= seq <= last_seq``, else IndexError)."""
        if not self.oldest_seq <= seq <= self._last_seq:
            raise IndexError(f"seq {seq} is not buffered ({self.oldest_seq}..{self._last_seq})")
        return self._event((seq - self._first_seq) % self.capacity, seq)

    def _event(self, slot: int, seq: int) -> Event:
        """The event in ``slot`` (which holds ``seq``), built now from a deferred entry."""
        entry = self._ring[slot]
        if isinstance(entry, EventBase) or self._convert is None:
            return entry  # type: ignore[no-any-return]
        event = self._ring[slot] = self._convert(entry, seq)
        return event

    def read(self, first_seq: int, limit: int, wants: Callable[[Event], bool] | None = None) -> tuple[list[Event], int]:
        """The first ``limit`` buffered events at most from ``first_seq`` on that ``wants`` accepts (all without it),
        and the sequence number after the last one looked at. ``first_seq`` must still be buffered (or be
        ``last_seq + 1``)."""
        if not self.oldest_seq <= first_seq <= self._last_seq + 1:
            raise IndexError(f"seq {first_seq} is not buffered ({self.oldest_seq}..{self._last_seq})")
        ring, cap, base, last = self._ring, self.capacity, self._first_seq, self._last_seq
        if wants is None:
            end = min(last, first_seq + limit - 1)
            if end < first_seq:
                return [], first_seq
            if self._convert is not None:  # deferred entries become their events
                return [self._event((seq - base) % cap, seq) for seq in range(first_seq, end + 1)], end + 1
            i, j = (first_seq - base) % cap, (end - base) % cap
            return (ring[i:j + 1] if i <= j else ring[i:] + ring[:j + 1]), end + 1
        out: list[Event] = []
        seq = first_seq
        while seq <= last and len(out) < limit:
            event = self._event((seq - base) % cap, seq)
            seq += 1
            if wants(event):
                out.append(event)
        return out, seq

    def check_position(self, after_seq: int) -> None:
        """Raise :class:`ResumeError` when ``after_seq`` is past the newest event or negative."""
        if after_seq < 0 or after_seq > self._last_seq:
            raise ResumeError(
                ErrorCode.BAD_RESUME_SEQ,
                f"cannot resume after seq {after_seq}: the stream is at {self._last_seq} "
                "(sequence numbers restart when the agent restarts)",
            )

    def since(self, after_seq: int) -> Replay:
        """The buffered events after ``after_seq`` as one tuple, and the gap when some of them are gone (tests and
        tools; the server streams a resume through a :class:`ReplayCursor` instead).

        Raises :class:`ResumeError` when ``after_seq`` is past the newest event or negative.
        """
        self.check_position(after_seq)
        oldest = self.oldest_seq
        first = max(after_seq + 1, oldest)
        events = tuple(self.read(first, self._last_seq - first + 1)[0])
        return Replay(events, None if after_seq + 1 >= oldest else (after_seq + 1, oldest - 1))


class ReplayCursor:
    """A resume's read position in the shared :class:`ReplayBuffer`: the subscriber's sender takes the next events
    from the buffer as it sends them, so a resume costs a number per subscriber, not a copy of its backlog, and a
    subscriber that does not read holds nothing. Events that the ring overwrites before the cursor reaches them are
    skipped and reported (:meth:`skip_lost`)."""

    __slots__ = ("buffer", "next_seq")

    def __init__(self, buffer: ReplayBuffer, after_seq: int) -> None:
        self.buffer = buffer
        self.next_seq = after_seq + 1
        """The next sequence number to read."""

    @property
    def done(self) -> bool:
        """True once every buffered event has been read (the subscriber is live from then on)."""
        return self.next_seq > self.buffer.last_seq

    def __len__(self) -> int:
        """Buffered events still to read (before any filter)."""
        return max(0, self.buffer.last_seq - max(self.next_seq, self.buffer.oldest_seq) + 1)

    def skip_lost(self) -> tuple[int, int] | None:
        """Move past events the ring no longer holds; their ``(first, last)`` sequence numbers, or None."""
        oldest = self.buffer.oldest_seq
        if self.next_seq >= oldest:
            return None
        lost = (self.next_seq, oldest - 1)
        self.next_seq = oldest
        return lost

    def take(self, limit: int, wants: Callable[[Event], bool] | None = None) -> list[Event]:
        """The next ``limit`` buffered events at most that ``wants`` accepts (all without it), in order. Call
        :meth:`skip_lost` first: the events read here must still be buffered."""
        events, self.next_seq = self.buffer.read(self.next_seq, limit, wants)
        return events

    def count(self, wants: Callable[[Event], bool] | None = None) -> int:
        """The buffered events from the position on that ``wants`` accepts (a scan when filtered; nothing kept)."""
        first = max(self.next_seq, self.buffer.oldest_seq)
        if wants is None:
            return max(0, self.buffer.last_seq - first + 1)
        get = self.buffer.get
        return sum(1 for seq in range(first, self.buffer.last_seq + 1) if wants(get(seq)))


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

    A resume (:meth:`replay_from`) reads the shared :class:`ReplayBuffer` through a :class:`ReplayCursor` as the
    sender takes frames: until the cursor has caught up with the stream, offered events are not queued (the buffer
    holds them already), and the subscription costs a number, however long the resume; from the moment it has
    caught up, events are queued as for any subscriber. Events the ring overwrites before the cursor reaches them
    are announced by a ``gap`` alert and skipped.
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
        self._cursor: ReplayCursor | None = None
        self.before_read: Callable[[], None] | None = None
        """Called before anything reads the subscription (its frames, its length): a source that holds events back to
        offer them in runs (the hub, ``Hub.flush``) offers the ones it holds, so a reader never sees fewer."""

    @classmethod
    def from_request(
        cls, request: Subscribe, node_id: str, *, max_queued: int = 4096, get_time_ns: Callable[[], int] = time.time_ns
    ) -> Subscription:
        return cls(
            node_id, unit_ids=request.unit_ids, kinds=request.kinds, max_queued=max_queued,
            max_batch=request.max_batch, get_time_ns=get_time_ns,
        )

    def __len__(self) -> int:
        """Frames waiting for the sender (queued events and notices; a resume's buffered events still to read count
        before the filter, and one for a gap they may have)."""
        if self.before_read is not None:
            self.before_read()
        waiting = len(self._queue) + len(self._notices) + (1 if self._drop_count else 0)
        cursor = self._cursor
        if cursor is not None:
            waiting += len(cursor) + (1 if cursor.next_seq < cursor.buffer.oldest_seq else 0)
        return waiting

    @property
    def num_queued(self) -> int:
        """Events in the live queue (what the subscription holds; a resume still to read is the buffer's)."""
        if self.before_read is not None:
            self.before_read()
        return len(self._queue)

    @property
    def replaying(self) -> bool:
        """True while a resume is read from the replay buffer (live events are not queued meanwhile)."""
        return self._cursor is not None

    def wants(self, event: Event) -> bool:
        if self.kinds is not None and event.__struct_config__.tag not in self.kinds:
            return False
        if self.unit_ids is None:
            return True
        units = event_unit_ids(event)
        return not units or not self.unit_ids.isdisjoint(units)

    def offer(self, event: Event) -> bool:
        """Queue ``event`` if the filter wants it (dropping the oldest when full); False when filtered out. While a
        resume is read (:attr:`replaying`) the event is not queued: the cursor reads it from the replay buffer, to
        which it must have been appended first."""
        if not self.wants(event):
            return False
        if self._cursor is not None:
            return True
        if len(self._queue) >= self.max_queued:
            dropped = self._queue.popleft()
            if not self._drop_count:
                self._drop_first = dropped.seq
            self._drop_count += 1
            self._drop_last = dropped.seq
            self.num_dropped += 1
        self._queue.append(event)
        return True

    def offer_many(self, events: Sequence[Event]) -> bool:
        """:meth:`offer` each of ``events`` in order; True when the filter wanted any. Without a filter, a resume or
        a drop to make, the whole run is queued at once."""
        if (self.kinds is None and self.unit_ids is None and self._cursor is None
                and len(self._queue) + len(events) <= self.max_queued):
            self._queue.extend(events)
            return bool(events)
        took = False
        for event in events:
            if self.offer(event):
                took = True
        return took

    def replay_from(self, buffer: ReplayBuffer, after_seq: int) -> int:
        """Stream the buffered events after ``after_seq`` before live ones, read from ``buffer`` as they are sent (a
        ``gap`` notice first when some are no longer buffered); the number of frames that makes now (events the
        filter wants, and the notice), counted without keeping them. Raises :class:`ResumeError` for a position
        ahead of the stream."""
        buffer.check_position(after_seq)
        cursor = ReplayCursor(buffer, after_seq)
        num = cursor.count(None if self.unit_ids is None and self.kinds is None else self.wants)
        num += 1 if after_seq + 1 < buffer.oldest_seq else 0
        self._cursor = None if cursor.done else cursor
        return num

    def resume(self, replay: Replay) -> None:
        """Queue a resume's events, after a ``gap`` notice when some are lost (a materialised :class:`Replay`, for
        tests and tools; the hub uses :meth:`replay_from`)."""
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
        if self.before_read is not None:
            self.before_read()
        if self._cursor is not None:
            replayed = self._replayed(1)
            if replayed:
                return replayed[0]
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
        if self.before_read is not None:
            self.before_read()
        out: list[Event] = self._replayed(limit) if self._cursor is not None else []
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

    def _replayed(self, limit: int) -> list[Event]:
        """The resume's next frames (a ``gap`` notice, then buffered events), up to ``limit``; live from the moment
        the cursor has caught up (nothing offered is lost: the hub appends to the buffer before it offers)."""
        cursor = self._cursor
        assert cursor is not None
        out: list[Event] = []
        lost = cursor.skip_lost()
        if lost is not None:
            first, last = lost
            out.append(self._alert(AlertCode.GAP, f"events {first}..{last} are no longer buffered", first_seq=first,
                                   last_seq=last))
        events = cursor.take(limit - len(out), None if self.unit_ids is None and self.kinds is None else self.wants)
        self.num_delivered += len(events)
        out += events
        if cursor.done:
            self._cursor = None
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


