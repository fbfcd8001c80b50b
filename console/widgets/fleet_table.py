"""The Overview's table of nodes and units (a ``DataTable`` fed with :class:`~console.model.fleet.FleetRow`\\ s)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.cells import cell_len
from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from console.model.fleet import COLUMNS, FleetRow, shown_columns


class FleetTable(DataTable[Text]):
    """Nodes and their units, one row each; the state column coloured by tone (component classes
    ``fleet--ok``, ``fleet--warning``, ``fleet--error``, ``fleet--muted``; ``fleet--node`` for node names)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = DataTable.COMPONENT_CLASSES | {
        "fleet--ok",
        "fleet--warning",
        "fleet--error",
        "fleet--muted",
        "fleet--node",
    }

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, id=id)
        self.rows_shown: tuple[FleetRow, ...] = ()
        """The rows on display, in order."""
        self.columns_shown: tuple[int, ...] = shown_columns(())
        """The indexes into :data:`~console.model.fleet.COLUMNS` on display (an optional column only when a row
        fills it)."""

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        for i in self.columns_shown:
            key, label = COLUMNS[i]
            self.add_column(label, key=key)

    def show_rows(self, rows: Sequence[FleetRow]) -> None:
        """Display ``rows``: cells are updated in place while the set and order of rows and the columns stay the
        same; otherwise the table is rebuilt, keeping the cursor on the same row key when it is still there."""
        columns = shown_columns(rows)
        if [r.key for r in rows] != [r.key for r in self.rows_shown] or columns != self.columns_shown:
            self.columns_shown = columns
            self._rebuild(rows)
        else:
            for old, new in zip(self.rows_shown, rows, strict=True):
                if old == new:
                    continue
                for i in columns:
                    column, before, after = COLUMNS[i][0], old.cells[i], new.cells[i]
                    if before != after or (column == "state" and old.tone != new.tone):
                        # Re-measuring a column walks all its cells: only when the new text is wider.
                        grows = cell_len(after) > self.columns[ColumnKey(column)].content_width
                        self.update_cell(new.key, column, self._cell(new, column, after), update_width=grows)
        self.rows_shown = tuple(rows)

    @property
    def selected_row(self) -> FleetRow | None:
        """The row under the cursor, if any."""
        if not self.rows_shown or not 0 <= self.cursor_row < len(self.rows_shown):
            return None
        return self.rows_shown[self.cursor_row]

    def _rebuild(self, rows: Sequence[FleetRow]) -> None:
        current = self.selected_row
        self.clear(columns=True)  # columns too: their widths fit the new rows, not every row ever shown
        self._add_columns()
        for row in rows:
            self.add_row(*(self._cell(row, COLUMNS[i][0], row.cells[i]) for i in self.columns_shown), key=row.key)
        # Size the columns now: the table measures new rows only when it is next idle, and rows drawn before that
        # keep their header-wide cells (``runni``) until a cell changes, which on a quiet agent may be never.
        for i in self.columns_shown:
            column = self.columns[ColumnKey(COLUMNS[i][0])]
            column.content_width = max([column.content_width, *(cell_len(row.cells[i]) for row in rows)])
        keys = [r.key for r in rows]
        if current is not None and current.key in keys:
            self.move_cursor(row=keys.index(current.key), animate=False)

    def _cell(self, row: FleetRow, column: str, text: str) -> Text:
        if column == "state":
            return Text(text, style=self.get_component_rich_style(f"fleet--{row.tone}", partial=True), no_wrap=True)
        if column == "name" and row.unit_id is None:
            return Text(text, style=self.get_component_rich_style("fleet--node", partial=True), no_wrap=True)
        return Text(text, no_wrap=True)
