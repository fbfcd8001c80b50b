"""The Overview's table as plain rows: one per node, one per unit under it, one per source without a node yet.

Pure: a function of the state, tested without Textual; the table widget only draws the cells (the columns that
:func:`shown_columns` keeps: the GPU column only when some unit runs on GPUs) and colours the state column by
:attr:`FleetRow.tone`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from console.model.metrics import HeatMetric
from console.model.placement import clip, node_label, unit_label
from console.model.queries import summary, trend
from console.model.records import Connection, NodeInfo, UnitState
from console.model.render import fmt_pair, fmt_pct, fmt_si, sparkline
from console.model.state import ConsoleState

Tone = Literal["ok", "warning", "error", "muted"]
"""How the state column is coloured (``fleet--ok`` ... component classes)."""

TREND_WIDTH: Final = 16
"""Sparkline columns (one bucket each)."""
GPU_WIDTH: Final = 16
"""The most characters of the GPU column (longer placements end in ``…``)."""

COLUMNS: Final[tuple[tuple[str, str], ...]] = (
    ("name", "node / unit"),
    ("gpus", "GPUs"),
    ("state", "state"),
    ("policy", "policy"),
    ("tok_s", "tok/s"),
    ("good_s", "good/s"),
    ("slo", "SLO"),
    ("ttft", "TTFT p50/p99"),
    ("tpot", "TPOT p50/p99"),
    ("kv", "KV"),
    ("trend", "tok/s trend"),
    ("ttft_trend", "TTFT p99 trend"),
)
"""Column keys and headers, left to right."""

_COLUMN_INDEX: Final = {key: i for i, (key, _) in enumerate(COLUMNS)}

OPTIONAL_COLUMNS: Final = frozenset({"gpus"})
"""Columns shown only when a row has something in them (a simulated fleet has no GPUs)."""

_TONES: Final[dict[str, Tone]] = {
    Connection.LIVE: "ok",
    Connection.REPLAY: "ok",
    Connection.CONNECTING: "muted",
    Connection.RECONNECTING: "warning",
    Connection.OFFLINE: "error",
    UnitState.RUNNING: "ok",
    UnitState.DRAINING: "warning",
    UnitState.PAUSED: "warning",
    UnitState.RECONNECTING: "warning",
    UnitState.OFFLINE: "error",
}


@dataclass(frozen=True, slots=True)
class FleetRow:
    """One row of the Overview table."""

    key: str
    """Stable: ``node:ID``, ``unit:ID:UNIT`` or ``source:URI``."""
    node_id: str | None
    unit_id: int | None
    cells: tuple[str, ...]
    """One per :data:`COLUMNS` entry."""
    tone: Tone

    def cell(self, key: str) -> str:
        """The cell of the column ``key`` (a :data:`COLUMNS` key)."""
        return self.cells[_COLUMN_INDEX[key]]


def fleet_rows(state: ConsoleState, trend_width: int = TREND_WIDTH) -> list[FleetRow]:
    """Every node with its units (nodes in the order first seen), then sources that have no node yet."""
    rows: list[FleetRow] = []
    for node in state.nodes.values():
        rows.append(_node_row(state, node, trend_width))
        for unit_id in sorted(node.units):
            rows.append(_unit_row(state, node, unit_id, trend_width))
    for info in state.sources.values():
        if not info.node_ids:
            cells = (info.source, "", info.connection.value, info.detail, *("",) * (len(COLUMNS) - 4))
            rows.append(FleetRow(f"source:{info.source}", None, None, cells, _TONES.get(info.connection, "muted")))
    return rows


def _node_row(state: ConsoleState, node: NodeInfo, trend_width: int) -> FleetRow:
    s = summary(state, node.node_id)
    connection = state.node_connection(node)
    kv = [u.latest[HeatMetric.KV] for u in node.units.values() if HeatMetric.KV in u.latest]
    cells = (
        node.node_id,
        clip(node_label(node), GPU_WIDTH),
        connection.value,
        node.dispatch_policy,
        fmt_si(s.out_tokens_per_s),
        fmt_si(s.goodput_rps),
        fmt_pct(s.slo_attainment),
        fmt_pair(s.ttft_p50_ms, s.ttft_p99_ms),
        fmt_pair(s.tpot_p50_ms, s.tpot_p99_ms),
        fmt_pct(sum(kv) / len(kv) if kv else None),
        sparkline(trend(state, node.node_id, kind="out_tokens", num_buckets=trend_width), trend_width),
        sparkline(trend(state, node.node_id, kind="ttft_p99", num_buckets=trend_width), trend_width),
    )
    return FleetRow(f"node:{node.node_id}", node.node_id, None, cells, _TONES.get(connection, "muted"))


def _unit_row(state: ConsoleState, node: NodeInfo, unit_id: int, trend_width: int) -> FleetRow:
    unit = node.units[unit_id]
    s = summary(state, node.node_id, unit_id)
    unit_state = state.unit_state(node, unit)
    tone: Tone = _TONES.get(unit_state, "muted")
    if unit_state == UnitState.RUNNING and not unit.healthy:
        tone = "warning"
    cells = (
        f"  u{unit_id}",
        clip(unit_label(unit), GPU_WIDTH),
        unit_state.value,
        unit.batch_policy,
        fmt_si(s.out_tokens_per_s),
        fmt_si(s.goodput_rps),
        fmt_pct(s.slo_attainment),
        fmt_pair(s.ttft_p50_ms, s.ttft_p99_ms),
        fmt_pair(s.tpot_p50_ms, s.tpot_p99_ms),
        fmt_pct(unit.latest.get(HeatMetric.KV)),
        sparkline(trend(state, node.node_id, unit_id, kind="out_tokens", num_buckets=trend_width), trend_width),
        sparkline(trend(state, node.node_id, unit_id, kind="ttft_p99", num_buckets=trend_width), trend_width),
    )
    return FleetRow(f"unit:{node.node_id}:{unit_id}", node.node_id, unit_id, cells, tone)


def shown_columns(rows: Sequence[FleetRow]) -> tuple[int, ...]:
    """The indexes into :data:`COLUMNS` to display for ``rows``: every column, less the optional ones that are
    empty in every row."""
    return tuple(
        i for i, (key, _) in enumerate(COLUMNS) if key not in OPTIONAL_COLUMNS or any(row.cells[i] for row in rows)
    )
