"""Read-only views over a :class:`~console.model.state.ConsoleState`: window summaries, sparkline trends, heatmap
grids and the cell under the heatmap cursor. Pure functions of the state (no Textual, no clock)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from console.model.metrics import METRIC_INDEX, METRICS, HeatMetric
from console.model.records import CellInfo, FlowSummary, GapSpan, HeatmapGrid, HeatRow, NodeInfo, PolicyMarker
from console.model.render import bucket_index, percentile, percentiles, window_buckets
from console.model.series import BucketRing, FlowBucket
from console.model.state import ConsoleState

TrendKind = Literal["out_tokens", "goodput", "ttft_p99", "tpot_p99"]
"""What a trend shows per bucket: output tokens/s, SLO-meeting requests/s, or a latency p99 (ms)."""


def _flow_ring(state: ConsoleState, node_id: str, unit_id: int | None) -> tuple[NodeInfo, BucketRing[FlowBucket]]:
    node = state.nodes[node_id]
    return node, node.flow if unit_id is None else node.units[unit_id].flow


def summary(state: ConsoleState, node_id: str, unit_id: int | None = None) -> FlowSummary:
    """The node's (or one unit's) flow over the sliding window ending at the state's time.

    Rates divide by the span the window covers since the node was first seen (at least one bucket), so a node
    seen for two seconds is not diluted over thirty.
    """
    node, ring = _flow_ring(state, node_id, unit_id)
    buckets = window_buckets(state.now_ns, state.window_ns, state.bucket_ns)
    start_ns = max(buckets.start * state.bucket_ns, node.first_ns)
    span_ns = max(state.now_ns - start_ns, state.bucket_ns)
    tokens = finished = met = refused = 0
    ttft: list[float] = []
    tpot: list[float] = []
    for index in buckets:
        bucket = ring.get(index)
        if bucket is None:
            continue
        tokens += bucket.out_tokens
        finished += bucket.finished
        met += bucket.met
        refused += bucket.refused
        ttft.extend(bucket.ttft_ms)
        tpot.extend(bucket.tpot_ms)
    span_s = span_ns / 1e9
    ttft_p50, ttft_p99 = percentiles(ttft, (50, 99))
    tpot_p50, tpot_p99 = percentiles(tpot, (50, 99))
    judged = finished + refused
    return FlowSummary(
        window_s=span_s,
        out_tokens_per_s=tokens / span_s,
        requests_per_s=finished / span_s,
        goodput_rps=met / span_s,
        slo_attainment=met / judged if judged else None,
        ttft_p50_ms=ttft_p50,
        ttft_p99_ms=ttft_p99,
        tpot_p50_ms=tpot_p50,
        tpot_p99_ms=tpot_p99,
        num_finished=finished,
        num_refused=refused,
    )


def trend(
    state: ConsoleState,
    node_id: str,
    unit_id: int | None = None,
    *,
    kind: TrendKind = "out_tokens",
    num_buckets: int = 20,
) -> list[float | None]:
    """One value per complete bucket, the ``num_buckets`` before the current one, oldest first (for a sparkline).

    Rates are 0 for buckets without events after the node was first seen and None before; a p99 is None for a
    bucket in which no request finished.
    """
    node, ring = _flow_ring(state, node_id, unit_id)
    bucket_s = state.bucket_ns / 1e9
    first_seen = bucket_index(node.first_ns, state.bucket_ns)
    end = state.newest_bucket
    out: list[float | None] = []
    for index in range(end - num_buckets, end):
        bucket = ring.get(index)
        if kind in ("out_tokens", "goodput"):
            if bucket is None:
                out.append(0.0 if index >= first_seen else None)
            else:
                out.append((bucket.out_tokens if kind == "out_tokens" else bucket.met) / bucket_s)
        else:
            values = [] if bucket is None else bucket.ttft_ms if kind == "ttft_p99" else bucket.tpot_ms
            out.append(percentile(sorted(values), 99) if values else None)
    return out


def markers_in(state: ConsoleState, first_bucket: int, last_bucket: int) -> dict[int, tuple[PolicyMarker, ...]]:
    """Policy markers by bucket index, for the buckets ``first_bucket..last_bucket``."""
    found: dict[int, list[PolicyMarker]] = {}
    for marker in state.markers:
        index = bucket_index(marker.time_ns, state.bucket_ns)
        if first_bucket <= index <= last_bucket:
            found.setdefault(index, []).append(marker)
    return {index: tuple(markers) for index, markers in found.items()}


def gap_at(state: ConsoleState, node: NodeInfo, bucket: int) -> GapSpan | None:
    """The newest hole of ``node``'s stream whose span touches ``bucket`` (None: none does)."""
    for gap in reversed(node.gaps):
        if bucket in gap.buckets(state.bucket_ns):
            return gap
    return None


def gap_buckets(state: ConsoleState, node: NodeInfo, first_bucket: int, last_bucket: int) -> set[int]:
    """The buckets in ``first_bucket..last_bucket`` that a hole of ``node``'s stream touches."""
    found: set[int] = set()
    for gap in node.gaps:
        span = gap.buckets(state.bucket_ns)
        found.update(range(max(span.start, first_bucket), min(span.stop, last_bucket + 1)))
    return found


def heatmap(
    state: ConsoleState,
    metric: HeatMetric,
    num_columns: int,
    last_bucket: int | None = None,
    units: Iterable[tuple[str, int]] | None = None,
) -> HeatmapGrid:
    """``metric`` for every unit (or those in ``units``) over ``num_columns`` buckets ending at ``last_bucket``
    (default: the newest), one mean per bucket, with the policy markers of those buckets by column and, per row, the
    empty columns inside a hole of the node's stream."""
    last = state.newest_bucket if last_bucket is None else last_bucket
    first = last - num_columns + 1
    index = METRIC_INDEX[metric]
    rows = []
    holes: dict[str, set[int]] = {}
    for node_id, unit_id in state.unit_keys() if units is None else units:
        node = state.nodes[node_id]
        ring = node.units[unit_id].heat
        values = []
        for b in range(first, last + 1):
            bucket = ring.get(b)
            values.append(None if bucket is None else bucket.mean(index))
        if node_id not in holes:
            holes[node_id] = gap_buckets(state, node, first, last) if node.gaps else set()
        lost = frozenset(b - first for b in holes[node_id] if values[b - first] is None)
        rows.append(HeatRow(node_id, unit_id, tuple(values), lost))
    markers = {b - first: m for b, m in markers_in(state, first, last).items()}
    return HeatmapGrid(metric, first, tuple(rows), markers)


def cell(state: ConsoleState, node_id: str, unit_id: int, bucket: int) -> CellInfo | None:
    """Every metric of one unit in one bucket (None for an unknown unit)."""
    node = state.nodes.get(node_id)
    unit = node.units.get(unit_id) if node is not None else None
    if node is None or unit is None:
        return None
    data = unit.heat.get(bucket)
    values = {m: None if data is None else data.mean(i) for i, m in enumerate(METRICS)}
    maxima = {m: None if data is None or not data.counts[i] else data.maxes[i] for i, m in enumerate(METRICS)}
    markers = tuple(
        m
        for m in markers_in(state, bucket, bucket).get(bucket, ())
        if m.node_id == node_id and (not m.unit_ids or unit_id in m.unit_ids)
    )
    gap = gap_at(state, node, bucket) if data is None and node.gaps else None
    return CellInfo(
        node_id, unit_id, bucket, bucket * state.bucket_ns, values, maxima, markers, unit.batch_policy, gap
    )
