"""A unit's slack at its latest sample: a bar per slack bucket, the urgent and late counts, and how far the sampled
requests are ahead of or behind their TPOT target in all."""

from __future__ import annotations

from typing import ClassVar, Final

from rich.text import Text
from textual.widget import Widget

from console.model.render import fmt_ms, fmt_si
from console.model.slack import SlackSummary
from console.widgets.rows import Row, rows_text

LABEL_WIDTH: Final = 12
"""Columns of the bucket labels (with the count after them)."""


def distribution_rows(summary: SlackSummary | None, width: int) -> list[Row]:
    """The heading (the running count at the sample, :attr:`SlackSummary.running_text`), one bar per bucket (late in
    the alarming style, under one TPOT in the warning one), then the urgent/late counts and the aggregate progress.
    Pure, for tests."""
    if summary is None:
        return [
            [("no slack sample from this unit", "muted")],
            [("(the agent samples every --slack-sample-ms; 0 turns sampling off)", "muted")],
        ]
    rows: list[Row] = [[(f"{summary.running_text} · TPOT {fmt_ms(summary.tpot_ms)} ms", "heading")]]
    top = max((b.count for b in summary.buckets), default=0)
    bar_width = max(1, width - LABEL_WIDTH - 5)
    for i, bucket in enumerate(summary.buckets):
        style = "late" if i == 0 else "urgent" if i == 1 else "ok"
        length = 0 if not top else round(bucket.count / top * bar_width)
        if bucket.count and not length:
            length = 1
        rows.append([(bucket.label.ljust(LABEL_WIDTH), "label"), (f"{bucket.count:>4} ", ""), ("█" * length, style)])
    urgent = f"urgent {summary.num_urgent} · late {summary.num_late}"
    if summary.policy_urgent is not None:
        urgent += f" · policy {summary.policy_urgent}"
    rows.append([(urgent, "urgent" if summary.num_urgent else "")])
    behind = f"behind {summary.num_behind}"
    if summary.num_behind:
        behind += f" {fmt_si(summary.tokens_behind)} tok"
    rows.append(
        [
            (f"ahead {summary.num_ahead} +{fmt_si(summary.tokens_ahead)} tok", "ok"),
            (" · ", ""),
            (behind, "late" if summary.num_behind else ""),
        ]
    )
    return rows


class SlackDistribution(Widget):
    """The slack distribution (component classes ``slack--heading``, ``slack--label``, ``slack--late``,
    ``slack--urgent``, ``slack--ok``, ``slack--muted``)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "slack--heading",
        "slack--label",
        "slack--late",
        "slack--urgent",
        "slack--ok",
        "slack--muted",
    }

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.summary: SlackSummary | None = None
        """The unit's latest sample, summed up (None: no sample)."""

    def show(self, summary: SlackSummary | None) -> None:
        self.summary = summary
        self.refresh()

    def render(self) -> Text:
        return rows_text(self, distribution_rows(self.summary, self.size.width), "slack")
