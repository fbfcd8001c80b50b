"""Heatmap: one metric of every unit over time (rows labelled with their GPUs where they run on GPUs), a cursor
with the cell's values, policy-change markers."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.reactive import reactive
from textual.widgets import Footer, Header, Static

from console.model.metrics import METRIC_SPECS, HeatMetric, next_metric
from console.model.placement import unit_gpus
from console.model.queries import cell, heatmap
from console.model.state import ConsoleState
from console.screens.base import StateScreen
from console.widgets import CellPanel, HeatmapView
from console.widgets.heatmap import metric_title


def _metric_bindings() -> list[BindingType]:
    bindings: list[BindingType] = [
        Binding(
            "m",
            "cycle_metric(1)",
            "Next metric",
            id="heatmap.next_metric",
            tooltip="Show the next metric (KV use, batch size, queued prefill, capacity, PAB, step time)",
        ),
        Binding(
            "M",
            "cycle_metric(-1)",
            "Previous metric",
            show=False,
            id="heatmap.previous_metric",
            tooltip="Show the previous metric",
        ),
    ]
    for metric, spec in METRIC_SPECS.items():
        bindings.append(
            Binding(
                spec.key,
                f"set_metric('{metric.value}')",
                spec.label,
                show=False,
                id=f"heatmap.metric_{metric.value}",
                tooltip=f"Show {spec.label} per unit",
            )
        )
    return bindings


class HeatmapScreen(StateScreen):
    """Units as rows (grouped by node), time buckets as columns; the metric is chosen by key."""

    BINDINGS: ClassVar[list[BindingType]] = _metric_bindings()

    metric: reactive[HeatMetric] = reactive(HeatMetric.KV, init=False)
    """The metric on display."""

    def __init__(self) -> None:
        super().__init__()
        self._state: ConsoleState | None = None
        self._following: bool | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="heatmap-title", classes="pane-title")
        yield HeatmapView(id="heatmap")
        yield CellPanel(id="cell")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(HeatmapView).focus()
        self._title()

    def show_state(self, state: ConsoleState) -> None:
        self._state = state
        self.redraw()

    def redraw(self) -> None:
        """Recompute the visible grid and the cursor's cell from the last state shown."""
        state = self._state
        view = self.query_one(HeatmapView)
        if state is None:
            return
        view.set_extent(
            state.unit_keys(), state.newest_bucket, state.oldest_bucket, state.bucket_ns / 1e9, unit_gpus(state)
        )
        view.show(heatmap(state, self.metric, view.num_columns, view.last_bucket(), units=view.visible_units()))
        target = view.cursor_unit
        info = None if target is None else cell(state, target[0], target[1], view.cursor_at)
        self.query_one(CellPanel).show_cell(info, self.metric, state.newest_bucket, state.bucket_ns / 1e9)
        following = view.cursor_bucket is None
        if following != self._following:  # "follow" is greyed out while following: tell the footer
            self._following = following
            self.refresh_bindings()

    def select_unit(self, node_id: str, unit_id: int | None) -> None:
        """Put the cursor on a unit (a node's first unit when ``unit_id`` is None)."""
        state = self._state
        if state is None or node_id not in state.nodes:
            return
        units = sorted(state.nodes[node_id].units)
        if unit_id is None and units:
            unit_id = units[0]
        if unit_id is not None:
            self.redraw()
            self.query_one(HeatmapView).select(node_id, unit_id)

    def watch_metric(self) -> None:
        self._title()
        self.redraw()

    def _title(self) -> None:
        keys = " ".join(f"{spec.key}:{spec.short}" for spec in METRIC_SPECS.values())
        self.query_one("#heatmap-title", Static).update(Text(f"{metric_title(self.metric)} · m next · {keys}"))

    def on_heatmap_view_cursor_moved(self, event: HeatmapView.CursorMoved) -> None:
        self.redraw()

    def on_heatmap_view_resized(self, event: HeatmapView.Resized) -> None:
        self.redraw()

    def system_commands(self) -> Iterator[SystemCommand]:
        """The command palette's entries for this screen: one per metric (as the metric keys)."""
        for metric, spec in METRIC_SPECS.items():
            yield SystemCommand(
                f"Heatmap: {spec.label}",
                f"Show {spec.label} per unit (key {spec.key})",
                partial(self.action_set_metric, metric.value),
            )

    def action_cycle_metric(self, step: int) -> None:
        """Show the metric ``step`` places on (wrapping)."""
        self.metric = next_metric(self.metric, step)

    def action_set_metric(self, name: str) -> None:
        """Show the metric named ``name`` (a :class:`HeatMetric` value)."""
        self.metric = HeatMetric(name)
