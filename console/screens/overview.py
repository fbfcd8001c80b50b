"""Overview: every node and unit (state, policy, throughput, goodput, SLO attainment, TTFT/TPOT, trends) and the
recent alerts."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Footer, Header, Static

from console.fleet import fleet_rows
from console.screens.base import StateScreen
from console.state import ConsoleState
from console.widgets import AlertList, FleetTable


class OverviewScreen(StateScreen):
    """Nodes and units in a table, alerts below."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(
            "enter",
            "open_unit",
            "Unit heatmap",
            id="overview.open_unit",
            tooltip="Open the heatmap with its cursor on the selected unit (or the node's first unit)",
            priority=True,  # before the table's own Enter (select), so the help screen lists this one
        ),
    ]

    class UnitChosen(Message):
        """The operator chose a unit (or a node: its first unit) to look at in the heatmap."""

        def __init__(self, node_id: str, unit_id: int | None) -> None:
            super().__init__()
            self.node_id = node_id
            self.unit_id = unit_id

    def __init__(self) -> None:
        super().__init__()
        self._can_open: bool | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="fleet-pane"):
            yield FleetTable(id="fleet")
        yield Static("Alerts", id="alerts-title", classes="pane-title")
        with Vertical(id="alerts-pane"):
            yield AlertList(id="alerts")
        yield Footer()

    def show_state(self, state: ConsoleState) -> None:
        self.query_one(FleetTable).show_rows(fleet_rows(state))
        self.query_one(AlertList).show_alerts(state.alerts, state.num_alerts)
        self._update_bindings()

    def _update_bindings(self) -> None:
        """Tell the footer when whether a unit can be opened changed (not at every refresh)."""
        can_open = self.check_action("open_unit", ()) is True
        if can_open != self._can_open:
            self._can_open = can_open
            self.refresh_bindings()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._update_bindings()

    def action_open_unit(self) -> None:
        row = self.query_one(FleetTable).selected_row
        if row is not None and row.node_id is not None:
            self.post_message(self.UnitChosen(row.node_id, row.unit_id))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``open_unit`` is greyed out unless a node or unit row is selected."""
        if action == "open_unit":
            tables = self.query(FleetTable)
            row = tables.first().selected_row if tables else None
            return True if row is not None and row.node_id is not None else None
        return True

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on the table (the table handles the key) opens the unit as the binding does."""
        event.stop()
        self.action_open_unit()
