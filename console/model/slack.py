"""Slack of running requests: the latest ``slack_sample`` of every unit, each request's progress over time, and the
pure queries behind the Slack screen.

A slack sample lists a unit's running requests with the least slack (up to :data:`SAMPLE_MAX_REQUESTS`): the deadline of
each one's next output token, ``arrival + ttft_slo + tpot_slo * output_tokens``, and the slack to it. :class:`SlackBook`
keeps the latest sample per unit and, per request, a bounded trace of ``(time, tokens done)`` from successive samples,
with the request's arrival and SLOs from ``request_arrived`` (recent requests only: the least recently seen are
forgotten first). From a trace, :func:`envelope` gives the request's deadline line: token ``j`` is due at ``arrival +
ttft_slo + tpot_slo * j``, so by time ``t`` the tokens due are ``floor((t - first_deadline) / tpot) + 1``. No Textual,
no clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from agent.telemetry import RequestArrived, RequestFinished, SlackSample
from console.model.render import fmt_si

SAMPLE_MAX_REQUESTS: Final = 64
"""The most requests a slack sample lists (the agent's ``Hub(slack_max_requests=64)``): a sample with fewer lists
every running request of its unit at its instant."""
DEFAULT_TPOT_MS: Final = 50.0
"""The TPOT target assumed for a node before any of its requests said theirs."""
SLACK_EDGES_TPOT: Final[tuple[float, ...]] = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
"""Bucket edges of the slack distribution, in TPOT targets: late (below 0), then up to 1, 2, 5, ... TPOTs."""

TracePoint = tuple[int, int]
"""``(time_ns, output_tokens)``: a request's tokens done at one sample (or at its finish)."""


@dataclass(slots=True)
class RequestTrace:
    """One request as the slack samples saw it (mutable: the book adds to it)."""

    node_id: str
    request_id: str
    points: deque[TracePoint]
    unit_id: int | None = None
    """The unit of its latest sample."""
    arrival_ns: int | None = None
    """From ``request_arrived`` (None: it arrived before the console saw the node)."""
    prompt_tokens: int | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    deadline_ns: int = 0
    """The deadline of its next token at the latest sample (0: not sampled yet)."""
    finished_ns: int | None = None


class SlackBook:
    """The latest slack sample per unit and traces of recent requests, across nodes."""

    __slots__ = ("latest", "max_points", "max_requests", "tpot_slo_ms", "traces")

    def __init__(self, *, max_requests: int = 1024, max_points: int = 120) -> None:
        if max_requests < 1 or max_points < 2:
            raise ValueError("keep at least one request and two points per request")
        self.max_requests = max_requests
        """Requests traced at most (the least recently seen are dropped)."""
        self.max_points = max_points
        """Points kept per request (at the default 250 ms period, 30 s)."""
        self.latest: dict[tuple[str, int], SlackSample] = {}
        """By ``(node_id, unit_id)``."""
        self.traces: OrderedDict[tuple[str, str], RequestTrace] = OrderedDict()
        """By ``(node_id, request_id)``, least recently seen first."""
        self.tpot_slo_ms: dict[str, float] = {}
        """Each node's TPOT target, from its latest ``request_arrived`` or ``request_finished``."""

    def _trace(self, node_id: str, request_id: str) -> RequestTrace:
        key = (node_id, request_id)
        trace = self.traces.get(key)
        if trace is None:
            trace = self.traces[key] = RequestTrace(node_id, request_id, deque(maxlen=self.max_points))
            if len(self.traces) > self.max_requests:
                self.traces.popitem(last=False)
        else:
            self.traces.move_to_end(key)
        return trace

    def on_arrived(self, event: RequestArrived, node_id: str) -> None:
        trace = self._trace(node_id, event.request_id)
        trace.arrival_ns, trace.prompt_tokens = event.time_ns, event.prompt_tokens
        trace.ttft_slo_ms, trace.tpot_slo_ms = event.ttft_slo_ms, event.tpot_slo_ms
        self.tpot_slo_ms[node_id] = event.tpot_slo_ms

    def on_sample(self, event: SlackSample, node_id: str) -> None:
        self.latest[(node_id, event.unit_id)] = event
        for point in event.requests:
            trace = self._trace(node_id, point.request_id)
            trace.unit_id, trace.deadline_ns = event.unit_id, point.deadline_ns
            trace.points.append((event.time_ns, point.output_tokens))

    def on_finished(self, event: RequestFinished, node_id: str) -> None:
        self.tpot_slo_ms[node_id] = event.tpot_slo_ms
        trace = self.traces.get((node_id, event.request_id))
        if trace is not None:  # only requests already traced: finishing adds no new ones
            trace.finished_ns = event.time_ns
            trace.points.append((event.time_ns, event.output_tokens))

    def tpot_ms(self, node_id: str) -> float:
        """The node's TPOT target (:data:`DEFAULT_TPOT_MS` until one is known)."""
        return self.tpot_slo_ms.get(node_id, DEFAULT_TPOT_MS)


# -- the distribution ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SlackBucket:
    """One bar of the slack distribution: requests whose slack is in ``[low_ms, high_ms)``."""

    low_ms: float
    high_ms: float
    count: int

    @property
    def label(self) -> str:
        if math.isinf(self.low_ms):
            return "late <0"
        if math.isinf(self.high_ms):
            return f">={fmt_si(self.low_ms)}"
        return f"{fmt_si(self.low_ms)}-{fmt_si(self.high_ms)}"


@dataclass(frozen=True, slots=True)
class SlackRow:
    """A sampled request, nearest to a miss first."""

    request_id: str
    slack_ms: float
    output_tokens: int
    computed_tokens: int
    tokens_ahead: float
    """Slack in TPOT targets: tokens ahead of its deadline line (negative: behind)."""


@dataclass(frozen=True, slots=True)
class SlackSummary:
    """A unit's latest slack sample, summed up against a TPOT target."""

    unit_id: int
    time_ns: int
    tpot_ms: float
    buckets: tuple[SlackBucket, ...]
    num_late: int
    """Requests past their next token's deadline (slack below 0)."""
    num_urgent: int
    """Requests with less than one TPOT of slack (the late ones included)."""
    policy_urgent: int | None
    """The batch policy's own count (``urgent_decodes`` in its latest step's reasons), when it reports one."""
    num_ahead: int
    num_behind: int
    tokens_ahead: float
    """Summed over the requests ahead of their deadline lines, in tokens."""
    tokens_behind: float
    """Summed over the requests behind, in tokens (not positive)."""
    rows: tuple[SlackRow, ...]
    """Every sampled request, least slack first."""
    num_running: int = 0
    """The unit's running requests at the sample, never fewer than it lists: the sample's own count when it is below
    :data:`SAMPLE_MAX_REQUESTS` (it lists them all), else the unit's latest batch size when that is larger (a step or
    a load snapshot, from another instant), else the sample's count (:func:`running_at_sample`)."""
    capped: bool = False
    """The sample is at :data:`SAMPLE_MAX_REQUESTS`: it lists those with the least slack, and more may be running."""

    @property
    def running_text(self) -> str:
        """``23 running``; at the cap, ``64 of 80 running`` (or ``64 of 64+ running`` without a larger batch size)."""
        sampled = len(self.rows)
        if not self.capped:
            return f"{sampled} running"
        return f"{sampled} of {self.num_running if self.num_running > sampled else f'{sampled}+'} running"


def slack_edges_ms(tpot_ms: float) -> list[float]:
    """The distribution's bucket edges in ms for a TPOT target (:data:`SLACK_EDGES_TPOT` times it)."""
    return [edge * tpot_ms for edge in SLACK_EDGES_TPOT]


def slack_distribution(slacks_ms: Sequence[float], tpot_ms: float) -> tuple[SlackBucket, ...]:
    """How many of ``slacks_ms`` fall in each bucket: late, then between successive edges, then the rest."""
    edges = [-math.inf, *slack_edges_ms(tpot_ms), math.inf]
    counts = [0] * (len(edges) - 1)
    for slack in slacks_ms:
        for i in range(len(counts)):
            if slack < edges[i + 1]:
                counts[i] += 1
                break
    return tuple(SlackBucket(edges[i], edges[i + 1], counts[i]) for i in range(len(counts)))


def running_at_sample(num_sampled: int, batch_size: float | None) -> tuple[int, bool]:
    """The unit's running requests at a sample that lists ``num_sampled``, and whether the sample is at the cap.

    ``batch_size`` (the unit's latest ``num_running``, from a step or a load snapshot) is from another instant than
    the sample, so it never overrides a sample below :data:`SAMPLE_MAX_REQUESTS`, which lists every running request:
    set side by side, the two read "23 of 21 running". At the cap it says how many more run, when it is larger."""
    capped = num_sampled >= SAMPLE_MAX_REQUESTS
    if capped and batch_size is not None and batch_size > num_sampled:
        return int(batch_size), capped
    return num_sampled, capped


def slack_summary(
    sample: SlackSample, tpot_ms: float, policy_urgent: int | None = None, batch_size: float | None = None
) -> SlackSummary:
    """The distribution, urgent and late counts and aggregate progress of ``sample`` against ``tpot_ms``;
    ``batch_size``: the unit's latest batch size, for the running count beyond a capped sample."""
    tpot = tpot_ms if tpot_ms > 0 else DEFAULT_TPOT_MS
    rows = tuple(
        SlackRow(p.request_id, p.slack_ms, p.output_tokens, p.computed_tokens, p.slack_ms / tpot)
        for p in sorted(sample.requests, key=lambda p: p.slack_ms)
    )
    num_running, capped = running_at_sample(len(rows), batch_size)
    ahead = [r.tokens_ahead for r in rows if r.slack_ms >= 0]
    behind = [r.tokens_ahead for r in rows if r.slack_ms < 0]
    return SlackSummary(
        unit_id=sample.unit_id,
        time_ns=sample.time_ns,
        tpot_ms=tpot,
        buckets=slack_distribution([r.slack_ms for r in rows], tpot),
        num_late=len(behind),
        num_urgent=sum(1 for r in rows if r.slack_ms < tpot),
        policy_urgent=policy_urgent,
        num_ahead=len(ahead),
        num_behind=len(behind),
        tokens_ahead=sum(ahead),
        tokens_behind=sum(behind),
        rows=rows,
        num_running=num_running,
        capped=capped,
    )


# -- one request's envelope -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Envelope:
    """A request's tokens done over time against its deadline line."""

    request_id: str
    unit_id: int | None
    first_deadline_ns: int
    """When its first token was due: ``arrival + ttft_slo``."""
    tpot_ns: int
    arrival_ns: int | None
    """None: the console did not see it arrive."""
    start_ns: int
    """The left end of its chart: its arrival when known, else its first point."""
    points: tuple[TracePoint, ...]
    finished_ns: int | None

    def due(self, time_ns: int) -> int:
        """Tokens whose deadline is at or before ``time_ns``."""
        if time_ns < self.first_deadline_ns:
            return 0
        return (time_ns - self.first_deadline_ns) // self.tpot_ns + 1

    def end_ns(self, now_ns: int) -> int:
        """The right end of its chart: its finish, else ``now_ns`` (or its latest point, if later)."""
        return self.finished_ns if self.finished_ns is not None else max(now_ns, self.points[-1][0])

    def done(self, time_ns: int) -> int | None:
        """Tokens done at the latest point at or before ``time_ns`` (None before the first point)."""
        found = None
        for t, tokens in self.points:
            if t > time_ns:
                break
            found = tokens
        return found


def envelope(trace: RequestTrace, fallback_tpot_ms: float) -> Envelope | None:
    """``trace``'s envelope (None before any point). The deadline line comes from the arrival and SLOs when the
    console saw the request arrive, else from its latest sampled deadline and ``fallback_tpot_ms``."""
    if not trace.points:
        return None
    tpot_ns = max(1, round((trace.tpot_slo_ms or fallback_tpot_ms) * 1e6))
    if trace.arrival_ns is not None and trace.ttft_slo_ms is not None:
        first = trace.arrival_ns + round(trace.ttft_slo_ms * 1e6)
    elif trace.deadline_ns:
        sampled = [p for p in trace.points if p[0] != trace.finished_ns]
        first = trace.deadline_ns - tpot_ns * (sampled[-1][1] if sampled else 0)
    else:
        return None
    points = tuple(sorted(trace.points))
    start = trace.arrival_ns if trace.arrival_ns is not None else points[0][0]
    return Envelope(trace.request_id, trace.unit_id, first, tpot_ns, trace.arrival_ns, start, points, trace.finished_ns)


def envelope_columns(env: Envelope, width: int, end_ns: int) -> list[tuple[int | None, int]]:
    """``(tokens done, tokens due)`` at the right edge of each of ``width`` columns spanning ``env.start_ns`` to
    ``end_ns`` (the request's finish when it has one)."""
    span = max(1, env.end_ns(end_ns) - env.start_ns)
    out = []
    for col in range(max(1, width)):
        t = env.start_ns + span * (col + 1) // max(1, width)
        out.append((env.done(t), env.due(t)))
    return out
