"""What the heatmap cursor points at: the unit, the bucket's time, every metric there, the policy changes."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from console.model.metrics import METRIC_SPECS, METRICS, HeatMetric
from console.model.records import CellInfo
from console.model.render import fmt_age, fmt_clock, fmt_value


def cell_text(cell: CellInfo | None, metric: HeatMetric, newest_bucket: int, bucket_s: float) -> str:
    """Two lines (three with policy changes, or inside a hole of the node's stream): where and when, the selected
    metric (mean and max), every other metric's mean. Pure, for tests."""
    if cell is None:
        return "no unit under the cursor"
    age = (newest_bucket - cell.bucket) * bucket_s
    spec = METRIC_SPECS[metric]
    mean, peak = cell.values[metric], cell.maxima[metric]
    head = (
        f"{cell.node_id} u{cell.unit_id} · {fmt_clock(cell.start_ns)} ({fmt_age(age)}) · policy "
        f"{cell.batch_policy or '-'} · {spec.label} {fmt_value(mean, spec.unit, spec.percent)}"
        f" (max {fmt_value(peak, spec.unit, spec.percent)})"
    )
    others = " · ".join(
        f"{METRIC_SPECS[m].label} {fmt_value(cell.values[m], METRIC_SPECS[m].unit, METRIC_SPECS[m].percent)}"
        for m in METRICS
        if m != metric
    )
    lines = [head, others]
    if cell.markers:
        lines.append("changed: " + "; ".join(f"{m.action} {m.text}" for m in cell.markers))
    if cell.gap is not None:
        lines.append(
            f"lost: events {cell.gap.first_seq}..{cell.gap.last_seq} of {cell.node_id} (a gap: the agent no longer "
            "buffered them when the stream resumed)"
        )
    return "\n".join(lines)


class CellPanel(Static):
    """The cursor's cell, in words."""

    def show_cell(self, cell: CellInfo | None, metric: HeatMetric, newest_bucket: int, bucket_s: float) -> None:
        self.update(Text(cell_text(cell, metric, newest_bucket, bucket_s)))
