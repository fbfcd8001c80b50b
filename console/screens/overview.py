"""Overview: every node and unit (GPUs where they run on GPUs, state, policy, throughput, goodput, SLO attainment,
TTFT/TPOT, trends) and the recent alerts."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import ClassVar

from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Footer, Header, Static

from console.model.fleet import fleet_rows
from console.model.state import ConsoleState
from console.screens.base import StateScreen
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
        Binding(
            "t",
            "open_unit('steps')",
            "Unit steps",
            show=False,
            id="overview.open_steps",
            tooltip="Open the Steps screen on the selected unit (or the node's first unit)",
        ),
        Binding(
            "s",
            "open_unit('slack')",
            "Unit slack",
            show=False,
            id="overview.open_slack",
            tooltip="Open the Slack screen on the selected unit (or the node's first unit)",
        ),
    ]

    class UnitChosen(Message):
        """The operator chose a unit (or a node: its first unit) to look at on another screen."""

        def __init__(self, node_id: str, unit_id: int | None, mode: str = "heatmap") -> None:
            super().__init__()
            self.node_id = node_id
            self.unit_id = unit_id
            self.mode = mode
            """The screen (mode) to show it on: ``heatmap``, ``steps`` or ``slack``."""

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

    def action_open_unit(self, mode: str = "heatmap") -> None:
        """Show the selected unit (a node row: its first unit) on the screen of ``mode``."""
        row = self.query_one(FleetTable).selected_row
        if row is not None and row.node_id is not None:
            self.post_message(self.UnitChosen(row.node_id, row.unit_id, mode))

    def system_commands(self) -> Iterator[SystemCommand]:
        """The command palette's entries for this screen: the selected unit on another screen (as the keys)."""
        row = self.query_one(FleetTable).selected_row
        if row is None or row.node_id is None:
            return
        name = row.node_id if row.unit_id is None else f"{row.node_id} u{row.unit_id}"
        for mode, title, key in (("heatmap", "Heatmap", "enter"), ("steps", "Steps", "t"), ("slack", "Slack", "s")):
            yield SystemCommand(
                f"Overview: {name} on {title}",
                f"The selected unit on the {title} screen (key {key})",
                partial(self.action_open_unit, mode),
            )

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
