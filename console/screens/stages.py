"""Stages: a length-staged dispatcher (CascadeInfer) on one node: recent request lengths on a log axis with the
current boundaries, the boundaries over time, each stage's load and migrations per second by reason. A node
without a staged dispatcher says so."""

from __future__ import annotations

from typing import ClassVar, Final

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.widgets import Footer, Header, Static

from console.model.records import NodeInfo
from console.model.render import cycled, fmt_age
from console.model.stages import migration_rates, migration_trend, stage_loads, stage_range
from console.model.state import ConsoleState
from console.screens.base import StateScreen
from console.widgets.boundary_history import BoundaryHistory
from console.widgets.length_chart import LengthChart
from console.widgets.migration_panel import MigrationPanel
from console.widgets.stage_load import StageLoadPanel

TREND_BUCKETS: Final = 26
"""Buckets in the migration trend."""
NO_STAGES: Final = "no staged dispatcher is running: stage boundaries come from a length-staged one (cascade)"


def stages_heading(state: ConsoleState, node: NodeInfo) -> str:
    """The node's dispatcher and its stages in a line (or that it has none)."""
    nodes = list(state.nodes)
    where = f"{node.node_id} ({nodes.index(node.node_id) + 1}/{len(nodes)})"
    stages = node.stages
    if stages is None:
        return f"{where} · dispatch {node.dispatch_policy or '-'} · {NO_STAGES}"
    cuts = stages.boundaries_tokens
    ranges = " | ".join(
        stage_range(cuts[k - 1] if k else 0, cuts[k] if k < len(cuts) else None) for k in range(len(cuts) + 1)
    )
    parts = [
        where,
        stages.policy,
        f"{len(cuts) + 1} stage{'s' if cuts else ''}: {ranges}",
        f"changed {fmt_age((state.now_ns - stages.time_ns) / 1e9)}" + (f" ({stages.reason})" if stages.reason else ""),
    ]
    if node.dispatch_policy and node.dispatch_policy != stages.policy:
        parts.append(f"the dispatcher is now {node.dispatch_policy}: these are the last stages reported")
    return " · ".join(parts)


class StagesScreen(StateScreen):
    """One node's length stages; ``n`` picks the node."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("n", "cycle_node(1)", "Next node", id="stages.next_node", tooltip="Show the next node's stages"),
        Binding(
            "N",
            "cycle_node(-1)",
            "Previous node",
            show=False,
            id="stages.previous_node",
            tooltip="Show the previous node's stages",
        ),
    ]

    def __init__(self) -> None:
        super().__init__()
        self._state: ConsoleState | None = None
        self.node_id: str | None = None
        """The node shown (None: the first with stages, else the first)."""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="stages-title", classes="pane-title")
        yield Static(id="stages-lengths-title", classes="pane-title")
        yield LengthChart(id="stages-lengths")
        yield Static("stage boundaries over time (newest on top)", id="stages-history-title", classes="pane-title")
        yield BoundaryHistory(id="stages-history")
        with Horizontal(id="stages-bottom"):
            yield StageLoadPanel(id="stages-load")
            yield MigrationPanel(id="stages-migrations")
        yield Footer()

    def show_state(self, state: ConsoleState) -> None:
        self._state = state
        self.redraw()

    def redraw(self) -> None:
        """Draw the node's stages from the last state shown."""
        state = self._state
        if state is None:
            return
        if self.node_id not in state.nodes:
            staged = [n.node_id for n in state.nodes.values() if n.stages is not None]
            self.node_id = staged[0] if staged else next(iter(state.nodes), None)
        title = self.query_one("#stages-title", Static)
        if self.node_id is None:
            title.update(Text("Stages · no nodes yet"))
            return
        node = state.nodes[self.node_id]
        record = state.stages.record(node.node_id)
        stages = node.stages
        title.update(Text(stages_heading(state, node)))
        lengths = tuple(record.lengths)
        self.query_one("#stages-lengths-title", Static).update(
            Text(f"prompt lengths of the last {len(lengths)} arrivals (log axis) with the current cuts")
        )
        self.query_one(LengthChart).show(lengths, None if stages is None else stages.boundaries_tokens)
        self.query_one(BoundaryHistory).show(tuple(record.changes), state.now_ns)
        self.query_one(StageLoadPanel).show_loads(None if stages is None else stage_loads(node, stages, lengths))
        rates = migration_rates(record, state.now_ns, state.window_ns, state.bucket_ns, node.first_ns)
        trend = migration_trend(record, state.newest_bucket, TREND_BUCKETS)
        self.query_one(MigrationPanel).show_rates(rates, trend, state.window_ns / 1e9, record.num_migrations)

    def action_cycle_node(self, step: int) -> None:
        """Show the node ``step`` places on (wrapping)."""
        if self._state is None or not self._state.nodes:
            return
        self.node_id = cycled(list(self._state.nodes), self.node_id, step)
        self.redraw()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The node keys are greyed out while there is at most one node."""
        if action == "cycle_node" and (self._state is None or len(self._state.nodes) < 2):
            return None
        return True
