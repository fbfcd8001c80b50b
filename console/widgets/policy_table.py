"""The Policies screen's table of targets: each node's dispatcher and its units, with policy and parameters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual.widgets import DataTable

from console.model.policy_view import COLUMNS, TargetRow


class PolicyTable(DataTable[Text]):
    """One row per :class:`~console.model.policy_view.TargetRow` (component classes ``policies--node`` for dispatcher
    rows, ``policies--held`` for a paused or draining unit's mode)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = DataTable.COMPONENT_CLASSES | {"policies--node", "policies--held"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, id=id)
        self.rows_shown: tuple[TargetRow, ...] = ()
        """The rows on display, in order."""

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)

    @property
    def selected_row(self) -> TargetRow | None:
        """The row under the cursor, if any."""
        if not self.rows_shown or not 0 <= self.cursor_row < len(self.rows_shown):
            return None
        return self.rows_shown[self.cursor_row]

    def select_key(self, key: str) -> bool:
        """Move the cursor to the row ``key`` (``unit:NODE:UNIT``, ``dispatch:NODE``); whether it is there."""
        keys = [r.key for r in self.rows_shown]
        if key not in keys:
            return False
        self.move_cursor(row=keys.index(key), animate=False)
        return True

    def show_rows(self, rows: Sequence[TargetRow]) -> None:
        """Display ``rows``, updating cells in place while the rows stay the same, keeping the cursor's row."""
        rows = tuple(rows)
        if rows == self.rows_shown:
            return
        if [r.key for r in rows] == [r.key for r in self.rows_shown]:
            for old, new in zip(self.rows_shown, rows, strict=True):
                for (column, _), before, after in zip(COLUMNS, old.cells, new.cells, strict=True):
                    if before != after:
                        self.update_cell(new.key, column, self._cell(new, column, after), update_width=True)
        else:
            current = self.selected_row
            self.clear(columns=True)  # columns too: their widths fit the new rows
            self._add_columns()
            for row in rows:
                cells = (self._cell(row, column, text) for (column, _), text in zip(COLUMNS, row.cells, strict=True))
                self.add_row(*cells, key=row.key)
            keys = [r.key for r in rows]
            if current is not None and current.key in keys:
                self.move_cursor(row=keys.index(current.key), animate=False)
        self.rows_shown = rows

    def _cell(self, row: TargetRow, column: str, text: str) -> Text:
        style = ""
        if column == "target" and row.unit_id is None:
            style = "policies--node"
        elif column == "mode" and row.mode in ("paused", "draining"):
            style = "policies--held"
        if style:
            return Text(text, style=self.get_component_rich_style(style, partial=True), no_wrap=True)
        return Text(text, no_wrap=True)
