"""Length stages of a staged dispatcher (CascadeInfer): boundary changes over time, recent request lengths,
migrations, and the pure queries behind the Stages screen.

A ``stage_boundaries`` event gives the interior cuts in tokens (stage ``k`` takes lengths below cut ``k`` and at
or above cut ``k - 1``; one more stage than cuts) and each stage's units. :class:`StageBook` keeps, per node,
the latest boundary changes, the prompt lengths of recent arrivals and ``request_migrated`` counts by reason in
fixed time buckets (the state's buckets). Lengths are drawn on a log axis (:data:`LENGTH_AXIS`), one log bucket
per column, so the histogram and the boundaries share it. No Textual, no clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from agent.telemetry import RequestArrived, RequestMigrated, StageBoundaries
from console.model.metrics import HeatMetric
from console.model.records import NodeInfo
from console.model.render import fmt_si, window_buckets
from console.model.series import BucketRing

LENGTH_AXIS: Final = (16, 131072)
"""The log length axis, in tokens: shorter lengths go in the first column, longer in the last."""


class MigrationBucket:
    """Migrations of one node within one time bucket, by reason (``why:how``)."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def reset(self) -> None:
        self.counts = {}


@dataclass(slots=True)
class NodeStages:
    """What one node's staging looked like lately (mutable: the book adds to it)."""

    changes: deque[StageBoundaries]
    """Boundary changes, oldest first."""
    lengths: deque[int]
    """Prompt lengths of recent arrivals, oldest first."""
    migrations: BucketRing[MigrationBucket]
    num_migrations: int = 0


class StageBook:
    """Stage changes, recent lengths and migrations of every node."""

    __slots__ = ("history_buckets", "max_changes", "max_lengths", "nodes")

    def __init__(self, *, history_buckets: int = 240, max_changes: int = 100, max_lengths: int = 1000) -> None:
        if max_changes < 1 or max_lengths < 1:
            raise ValueError("keep at least one change and one length")
        self.history_buckets = history_buckets
        self.max_changes = max_changes
        self.max_lengths = max_lengths
        """Recent arrivals whose lengths make the histogram."""
        self.nodes: dict[str, NodeStages] = {}

    def _empty(self) -> NodeStages:
        return NodeStages(
            deque(maxlen=self.max_changes),
            deque(maxlen=self.max_lengths),
            BucketRing(self.history_buckets, MigrationBucket),
        )

    def _node(self, node_id: str) -> NodeStages:
        record = self.nodes.get(node_id)
        if record is None:
            record = self.nodes[node_id] = self._empty()
        return record

    def record(self, node_id: str) -> NodeStages:
        """The node's record (an empty one, not kept, for a node that sent none of these events)."""
        return self.nodes.get(node_id) or self._empty()

    def on_stages(self, event: StageBoundaries, node_id: str) -> None:
        self._node(node_id).changes.append(event)

    def on_arrived(self, event: RequestArrived, node_id: str) -> None:
        self._node(node_id).lengths.append(event.prompt_tokens)

    def on_migrated(self, event: RequestMigrated, bucket: int, node_id: str) -> None:
        """A migration in time bucket ``bucket``."""
        record = self._node(node_id)
        record.num_migrations += 1
        slot = record.migrations.at(bucket)
        if slot is not None:
            reason = event.reason or "unknown"
            slot.counts[reason] = slot.counts.get(reason, 0) + 1


# -- the log length axis ---------------------------------------------------------------------------------------------
def log_column(tokens: float, width: int, axis: tuple[int, int] = LENGTH_AXIS) -> int:
    """The column (0..width-1) of a length on the log axis: column ``c`` holds lengths from ``lo * r**c`` up to
    ``lo * r**(c+1)``, ``r = (hi / lo) ** (1 / width)``; lengths off the axis are clamped."""
    lo, hi = axis
    if width <= 1 or tokens <= lo:
        return 0
    frac = math.log(tokens / lo) / math.log(hi / lo)
    return min(width - 1, max(0, math.floor(frac * width + 1e-9)))


def column_low(column: int, width: int, axis: tuple[int, int] = LENGTH_AXIS) -> float:
    """The shortest length of a column."""
    lo, hi = axis
    return float(lo * (hi / lo) ** (column / max(1, width)))


def length_histogram(lengths: Iterable[int], width: int, axis: tuple[int, int] = LENGTH_AXIS) -> list[int]:
    """Counts of ``lengths`` per column of the log axis."""
    counts = [0] * max(1, width)
    for tokens in lengths:
        counts[log_column(tokens, width, axis)] += 1
    return counts


def boundary_columns(boundaries: Sequence[int], width: int, axis: tuple[int, int] = LENGTH_AXIS) -> list[int]:
    """The column of each cut (the column whose lengths start at or just below it)."""
    return [log_column(b, width, axis) for b in boundaries]


def stage_of(tokens: int, boundaries: Sequence[int]) -> int:
    """The stage taking a length: the first whose cut is above it (the last stage past every cut)."""
    for k, cut in enumerate(boundaries):
        if tokens < cut:
            return k
    return len(boundaries)


# -- per-stage load and migrations -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StageLoad:
    """One stage: its length range, its units and their latest load."""

    index: int
    low_tokens: int
    """Lengths at or above this (0 for the first stage)."""
    high_tokens: int | None
    """Lengths below this (None for the last stage)."""
    unit_ids: tuple[int, ...]
    num_running: int
    """Running requests of its units (their latest batch size)."""
    num_waiting: int
    kv: float | None
    """Mean KV use of its units (0..1; None when none reported)."""
    queued_prefill_tokens: int
    share: float | None
    """The fraction of recent arrivals whose length falls in it (None without arrivals)."""


def stage_loads(node: NodeInfo, stages: StageBoundaries, lengths: Sequence[int] = ()) -> tuple[StageLoad, ...]:
    """Every stage of ``stages`` with its units' latest load on ``node`` and its share of ``lengths``."""
    cuts = stages.boundaries_tokens
    shares = [0] * (len(cuts) + 1)
    for tokens in lengths:
        shares[stage_of(tokens, cuts)] += 1
    out = []
    for k, unit_ids in enumerate(stages.stage_unit_ids):
        units = [node.units[u] for u in unit_ids if u in node.units]
        kv = [u.latest[HeatMetric.KV] for u in units if HeatMetric.KV in u.latest]
        out.append(
            StageLoad(
                index=k,
                low_tokens=cuts[k - 1] if 0 < k <= len(cuts) else 0,
                high_tokens=cuts[k] if k < len(cuts) else None,
                unit_ids=tuple(unit_ids),
                num_running=sum(int(u.latest.get(HeatMetric.BATCH, 0)) for u in units),
                num_waiting=sum(u.num_waiting for u in units),
                kv=sum(kv) / len(kv) if kv else None,
                queued_prefill_tokens=sum(int(u.latest.get(HeatMetric.QUEUED_PREFILL, 0)) for u in units),
                share=shares[k] / len(lengths) if lengths and k < len(shares) else None,
            )
        )
    return tuple(out)


def migration_rates(
    record: NodeStages, now_ns: int, window_ns: int, bucket_ns: int, first_ns: int
) -> list[tuple[str, float, int]]:
    """``(reason, migrations per second, count)`` over the window ending at ``now_ns`` (the span since
    ``first_ns`` when shorter, at least a bucket), most frequent first."""
    buckets = window_buckets(now_ns, window_ns, bucket_ns)
    span_s = max(now_ns - max(buckets.start * bucket_ns, first_ns), bucket_ns) / 1e9
    counts: dict[str, int] = {}
    for index in buckets:
        bucket = record.migrations.get(index)
        if bucket is not None:
            for reason, n in bucket.counts.items():
                counts[reason] = counts.get(reason, 0) + n
    return sorted(((r, n / span_s, n) for r, n in counts.items()), key=lambda x: (-x[2], x[0]))


def migration_trend(record: NodeStages, newest_bucket: int, num_buckets: int) -> list[float]:
    """Migrations per bucket (all reasons), the ``num_buckets`` up to and including ``newest_bucket``."""
    out = []
    for index in range(newest_bucket - num_buckets + 1, newest_bucket + 1):
        bucket = record.migrations.get(index)
        out.append(float(sum(bucket.counts.values())) if bucket is not None else 0.0)
    return out


# -- words -----------------------------------------------------------------------------------------------------------
def fmt_tokens(tokens: float) -> str:
    """A length: whole multiples of 1024 as ``1k``, ``4k``, ``128k`` (how cuts and the axis read), others compact."""
    if tokens >= 1024 and tokens % 1024 == 0:
        return f"{int(tokens) // 1024}k"
    return fmt_si(tokens)


def stage_range(low_tokens: int, high_tokens: int | None) -> str:
    """A stage's lengths: ``<512``, ``512-1k``, ``>=4k``."""
    if high_tokens is None:
        return f">={fmt_tokens(low_tokens)}" if low_tokens else "all"
    if not low_tokens:
        return f"<{fmt_tokens(high_tokens)}"
    return f"{fmt_tokens(low_tokens)}-{fmt_tokens(high_tokens)}"


def fmt_units(unit_ids: Sequence[int]) -> str:
    """Unit ids as ``u0``, ``u2,3``; ``-`` for none."""
    return "u" + ",".join(str(u) for u in unit_ids) if unit_ids else "-"
