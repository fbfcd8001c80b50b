"""The What-if screen's ranked table: the recorded window, then each simulated run by rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual.widgets import DataTable

from console.model.whatif import COLUMNS, ResultRow

NUMERIC = frozenset({"rank", "effective", "slo", "ttft", "tpot", "delta"})
"""Columns whose cells are right-aligned."""


class WhatIfTable(DataTable[Text]):
    """One row per :class:`~console.model.whatif.ResultRow` (component classes ``whatif--recorded`` for the recorded
    window, ``whatif--recommended`` for the recommended run)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = DataTable.COMPONENT_CLASSES | {"whatif--recorded", "whatif--recommended"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, id=id)
        self.rows_shown: tuple[ResultRow, ...] = ()
        """The rows on display, in order."""

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)

    def show_rows(self, rows: Sequence[ResultRow]) -> None:
        """Display ``rows`` (none: an empty table)."""
        rows = tuple(rows)
        if rows == self.rows_shown:
            return
        self.clear(columns=True)  # columns too: their widths fit the new rows
        self._add_columns()
        for row in rows:
            style = {"recorded": "whatif--recorded"}.get(row.kind, "whatif--recommended" if row.recommended else "")
            rich_style = self.get_component_rich_style(style, partial=True) if style else ""
            cells = (
                Text(cell, style=rich_style, no_wrap=True, justify="right" if key in NUMERIC else "left")
                for (key, _), cell in zip(COLUMNS, row.cells, strict=True)
            )
            self.add_row(*cells, key=row.key)
        self.rows_shown = rows
