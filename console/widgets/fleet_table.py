"""The Overview's table of nodes and units (a ``DataTable`` fed with :class:`~console.model.fleet.FleetRow`\\ s)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.cells import cell_len
from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from console.model.fleet import COLUMNS, FleetRow


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

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)

    def show_rows(self, rows: Sequence[FleetRow]) -> None:
        """Display ``rows``: cells are updated in place while the set and order of rows stay the same; otherwise
        the table is rebuilt, keeping the cursor on the same row key when it is still there."""
        if [r.key for r in rows] != [r.key for r in self.rows_shown]:
            self._rebuild(rows)
        else:
            for old, new in zip(self.rows_shown, rows, strict=True):
                if old == new:
                    continue
                for (column, _), before, after in zip(COLUMNS, old.cells, new.cells, strict=True):
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
            self.add_row(
                *(self._cell(row, column, text) for (column, _), text in zip(COLUMNS, row.cells, strict=True)),
                key=row.key,
            )
        keys = [r.key for r in rows]
        if current is not None and current.key in keys:
            self.move_cursor(row=keys.index(current.key), animate=False)

    def _cell(self, row: FleetRow, column: str, text: str) -> Text:
        if column == "state":
            return Text(text, style=self.get_component_rich_style(f"fleet--{row.tone}", partial=True), no_wrap=True)
        if column == "name" and row.unit_id is None:
            return Text(text, style=self.get_component_rich_style("fleet--node", partial=True), no_wrap=True)
        return Text(text, no_wrap=True)
