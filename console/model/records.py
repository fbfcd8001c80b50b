"""The records the state model keeps and hands out: nodes, units, sources, alerts, policy markers, summaries.

Plain mutable dataclasses (the state folds events into them in place) and frozen results of queries. No
Textual imports: widgets receive these and render them.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from agent.telemetry import PolicySchema, StageBoundaries, UnitMode
from console.model.metrics import HeatMetric
from console.model.series import BucketRing, FlowBucket, HeatBucket
from policies.params import ParamValue


class Connection(enum.StrEnum):
    """A source's connection, as its feed reports it."""

    CONNECTING = "connecting"
    """Not connected yet (the first attempt is under way)."""
    LIVE = "live"
    RECONNECTING = "reconnecting"
    """The connection was lost or refused; retrying with backoff."""
    OFFLINE = "offline"
    """Given up (a fatal error, or the feed stopped)."""
    REPLAY = "replay"
    """Events read back from a store file."""


class UnitState(enum.StrEnum):
    """What the console shows for a unit: its mode when its node is connected, else the connection's state."""

    RUNNING = "running"
    DRAINING = "draining"
    PAUSED = "paused"
    RECONNECTING = "reconnecting"
    OFFLINE = "offline"


MODE_STATES: dict[str, UnitState] = {
    "active": UnitState.RUNNING,
    "draining": UnitState.DRAINING,
    "paused": UnitState.PAUSED,
}


@dataclass(slots=True)
class UnitInfo:
    """One unit of one node: configuration, latest values and rolling series."""

    unit_id: int
    heat: BucketRing[HeatBucket]
    flow: BucketRing[FlowBucket]
    mode: UnitMode = "active"
    batch_policy: str = ""
    batch_params: dict[str, ParamValue] = field(default_factory=dict)
    num_blocks: int = 0
    max_num_seqs: int = 0
    healthy: bool = True
    """As the dispatcher last saw it (``unit_load``)."""
    latest: dict[HeatMetric, float] = field(default_factory=dict)
    """The latest value of each heatmap metric."""
    num_waiting: int = 0
    last_step_ns: int = 0
    """When its latest step started (0: none seen)."""
    gpu_ids: tuple[int, ...] = ()
    """The GPUs its engine runs on, from the hello (empty: simulated, or not said)."""
    tensor_parallel_size: int = 0
    """GPUs per pipeline stage (0: simulated, or not said)."""
    pipeline_parallel_size: int = 0
    """Pipeline stages (0: simulated, or not said)."""


MAX_GAPS: Final = 64
"""Holes in a node's stream kept at most (the oldest go first)."""


@dataclass(slots=True)
class GapSpan:
    """Events of a node's stream that never arrived: the agent no longer buffered them when the stream resumed (its
    ``gap`` alert, live or read back from a store). The heatmap marks its time span where it has no data."""

    boot_ns: int
    """The run it is a hole in."""
    first_seq: int
    last_seq: int
    start_ns: int
    """The newest stream event of the run before the hole (the run's start when there was none)."""
    announced_ns: int
    """The alert's time: live, when the agent answered the resume; read back from a store, when the stream resumed
    after the hole. The hole ends there at the latest."""
    end_ns: int | None = None
    """The first stream event after the hole, or :attr:`announced_ns` if earlier (None: no event after it yet)."""

    def buckets(self, bucket_ns: int) -> range:
        """The time buckets its span touches (to :attr:`announced_ns` while no event after it has arrived)."""
        end = self.announced_ns if self.end_ns is None else self.end_ns
        return range(self.start_ns // bucket_ns, max(self.start_ns, end) // bucket_ns + 1)


@dataclass(slots=True)
class NodeInfo:
    """One node (one agent run after another): its dispatcher, its units and its node-level flow."""

    node_id: str
    flow: BucketRing[FlowBucket]
    source: str | None = None
    """The feed it came from (None: applied without one, e.g. in tests)."""
    boot_ns: int = 0
    profile: str = ""
    dispatch_policy: str = ""
    dispatch_params: dict[str, ParamValue] = field(default_factory=dict)
    units: dict[int, UnitInfo] = field(default_factory=dict)
    batch_policies: tuple[PolicySchema, ...] = ()
    dispatch_policies: tuple[PolicySchema, ...] = ()
    stages: StageBoundaries | None = None
    """The latest stage boundaries of a staged dispatcher."""
    first_ns: int = 0
    """The earliest event time seen (the start of its rate windows)."""
    last_ns: int = 0
    num_events: int = 0
    num_hellos: int = 0
    """Hellos seen: one per connection, so more than one means it reconnected or restarted."""
    stream_ns: int = 0
    """The newest time of its stream events (``seq`` > 0: not hellos or notices), where a hole would start."""
    gaps: deque[GapSpan] = field(default_factory=lambda: deque(maxlen=MAX_GAPS))
    """Holes in its stream, oldest first."""
    open_gap: GapSpan | None = None
    """The newest hole while no event after it has arrived."""


@dataclass(slots=True)
class SourceInfo:
    """One feed (an agent URI or a store file) and its connection."""

    source: str
    connection: Connection
    detail: str = ""
    """Why (the last error), when there is one."""
    node_ids: list[str] = field(default_factory=list)
    since_ns: int = 0
    """When the connection last changed (state time)."""


@dataclass(frozen=True, slots=True)
class AlertEntry:
    """An agent's alert, or one the console raises (connection changes: code ``connection``)."""

    time_ns: int
    node_id: str
    code: str
    severity: str
    message: str
    unit_id: int | None = None


@dataclass(frozen=True, slots=True)
class PolicyMarker:
    """An applied control action (from an ``audit`` event), marked on the time axis."""

    time_ns: int
    node_id: str
    action: str
    unit_ids: tuple[int, ...]
    """Empty: the dispatcher."""
    text: str
    """What changed, in a few words (``u1 vllm -> sarathi``)."""


@dataclass(frozen=True, slots=True)
class FlowSummary:
    """A node's or unit's request flow over the sliding window."""

    window_s: float
    """The span actually covered (shorter than the window while the node is new)."""
    out_tokens_per_s: float
    requests_per_s: float
    goodput_rps: float
    """Finished requests that met their SLO, per second."""
    slo_attainment: float | None
    """Met over finished and refused (None when none of either)."""
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    num_finished: int
    num_refused: int


@dataclass(frozen=True, slots=True)
class HeatRow:
    """One unit's row of a heatmap."""

    node_id: str
    unit_id: int
    values: tuple[float | None, ...]
    """One mean per column, oldest first (None: no sample in that bucket)."""
    gaps: frozenset[int] = frozenset()
    """Columns without a sample inside a hole of its node's stream (events lost, not an idle unit)."""


@dataclass(frozen=True, slots=True)
class HeatmapGrid:
    """A heatmap of one metric: units (grouped by node) by time buckets, with the policy changes among them."""

    metric: HeatMetric
    first_bucket: int
    """The bucket index of the first (leftmost) column."""
    rows: tuple[HeatRow, ...]
    markers: dict[int, tuple[PolicyMarker, ...]]
    """Policy changes by column (0 = the first)."""

    @property
    def num_columns(self) -> int:
        return len(self.rows[0].values) if self.rows else 0


@dataclass(frozen=True, slots=True)
class CellInfo:
    """Everything known about one unit in one bucket (the heatmap cursor)."""

    node_id: str
    unit_id: int
    bucket: int
    start_ns: int
    values: dict[HeatMetric, float | None]
    """The mean of every metric in the bucket."""
    maxima: dict[HeatMetric, float | None]
    markers: tuple[PolicyMarker, ...]
    batch_policy: str
    gap: GapSpan | None = None
    """The hole of its node's stream the bucket lies in, when it has no sample there."""
