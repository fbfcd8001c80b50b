"""Migrations per second over the window, by reason (``why:how``), with a per-bucket trend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from textual.widgets import Static

from console.model.render import fmt_si, sparkline
from console.widgets.rows import Row, rows_text

REASON_WIDTH = 17
"""Columns of the reason (``why:how``) before its rate."""


def migration_rows(
    rates: Sequence[tuple[str, float, int]], trend: Sequence[float], window_s: float, total: int
) -> list[Row]:
    """The heading with the total rate and count in the window, one line per reason (most frequent first), the
    trend (migrations per bucket). Pure, for tests."""
    rate = sum(r for _, r, _ in rates)
    count = sum(n for _, _, n in rates)
    rows: list[Row] = [[(f"migr/s {fmt_si(rate)} · {count} in {window_s:g}s", "heading")]]
    if not rates:
        rows.append([(f"none in the window ({total} in all)", "muted")])
    width = min(REASON_WIDTH, max((len(reason) for reason, _, _ in rates), default=0) + 1)
    for reason, per_s, _ in rates:
        rows.append([(reason[: width - 1].ljust(width), "label"), (f"{fmt_si(per_s):>5}/s", "")])
    if trend:
        rows.append([(sparkline(list(trend), len(trend)), "trend")])
    return rows


class MigrationPanel(Static):
    """Migration rates (component classes ``migrations--heading``, ``migrations--label``, ``migrations--muted``,
    ``migrations--trend``)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "migrations--heading",
        "migrations--label",
        "migrations--muted",
        "migrations--trend",
    }

    def show_rates(
        self, rates: Sequence[tuple[str, float, int]], trend: Sequence[float], window_s: float, total: int
    ) -> None:
        self.update(rows_text(self, migration_rows(rates, trend, window_s, total), "migrations"))
