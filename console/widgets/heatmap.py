"""The DP load heatmap: units (rows, grouped by node) by time buckets (columns), a cursor, policy markers, a legend.

The widget draws a :class:`~console.model.records.HeatmapGrid` that its screen computes for the rows and columns it can
show (attributes down); moving the cursor posts :class:`HeatmapView.CursorMoved` (messages up) and the screen
answers with a new grid. Colours blend the component classes ``heatmap--low``, ``heatmap--mid`` and
``heatmap--high`` (theme variables in ``console.tcss``) over :data:`LEVELS` levels.

Lines, top down: policy markers (``◆`` where an applied control action falls), one row per visible unit (labelled
``node-a  u0``, and ``gpu0,1`` after it when the unit runs on GPUs; an empty cell is ``·``, or ``×`` inside a hole of
its node's stream: events lost, not an idle unit), the time axis (``^`` under the cursor's column), the legend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Final

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.color import Color
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

from console.model.metrics import METRIC_SPECS, HeatMetric
from console.model.placement import clip
from console.model.records import HeatmapGrid
from console.model.render import fmt_value, gradient_stop, scale_level, scale_range, time_axis

GAP_GLYPH: Final = "×"
"""An empty cell inside a hole of its node's stream (component class ``heatmap--gap``)."""
LEVELS: Final = 10
"""Colour levels of the scale."""
LABEL_WIDTH: Final = 12
"""Columns taken by the unit labels on the left (node and unit), without GPUs."""
GPU_WIDTH: Final = 10
"""The most columns a unit's GPUs (``gpu0-3``) add to the labels: when some unit runs on GPUs, the labels widen by
the longest, plus a space."""
CHROME_LINES: Final = 3
"""Lines that are not unit rows: markers, axis, legend."""


class HeatmapView(Widget, can_focus=True):
    """A heatmap of one metric with a cell cursor."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "move(-1, 0)", "Up", show=False, id="heatmap.cursor_up", tooltip="Cursor to the unit above"),
        Binding("down", "move(1, 0)", "Down", show=False, id="heatmap.cursor_down", tooltip="Cursor to the unit below"),
        Binding(
            "left",
            "move(0, -1)",
            "Older",
            show=False,
            id="heatmap.cursor_left",
            tooltip="Cursor one bucket back in time",
        ),
        Binding(
            "right",
            "move(0, 1)",
            "Newer",
            show=False,
            id="heatmap.cursor_right",
            tooltip="Cursor one bucket forward in time",
        ),
        Binding(
            "home",
            "oldest",
            "Oldest",
            show=False,
            id="heatmap.oldest",
            tooltip="Cursor to the oldest bucket still held",
        ),
        Binding(
            "end",
            "follow",
            "Follow",
            id="heatmap.follow",
            tooltip="Cursor back on the newest bucket, following it as time goes on",
        ),
    ]

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "heatmap--low",
        "heatmap--mid",
        "heatmap--high",
        "heatmap--empty",
        "heatmap--gap",
        "heatmap--label",
        "heatmap--node",
        "heatmap--cursor",
        "heatmap--marker",
        "heatmap--axis",
    }

    class CursorMoved(Message):
        """The cursor moved (by a key): the screen recomputes the grid and the cell details."""

        def __init__(self, view: HeatmapView) -> None:
            super().__init__()
            self.view = view

    class Resized(Message):
        """The view's size changed: the screen recomputes the grid for the rows and columns that fit now."""

        def __init__(self, view: HeatmapView) -> None:
            super().__init__()
            self.view = view

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.grid: HeatmapGrid | None = None
        """What is drawn: the visible rows and columns."""
        self.units: Sequence[tuple[str, int]] = ()
        """Every unit that has a row, in order (the grid holds only the visible ones)."""
        self.gpus: Mapping[tuple[str, int], str] = {}
        """The GPUs of the units that run on GPUs (``0-3``), by ``(node_id, unit_id)``."""
        self.label_width = LABEL_WIDTH
        """Columns taken by the labels on the left: :data:`LABEL_WIDTH`, and room for the longest GPUs."""
        self.cursor_row = 0
        """Index into :attr:`units`."""
        self.cursor_bucket: int | None = None
        """The cursor's bucket; None: the newest, following time."""
        self.row_offset = 0
        """The first visible row."""
        self.newest = 0
        self.oldest = 0
        self.bucket_s = 1.0
        self._palette: tuple[str, list[Style]] | None = None

    # -- geometry (what the screen asks for) ---------------------------------------------------------------------
    @property
    def num_columns(self) -> int:
        """Buckets that fit across."""
        return max(1, self.size.width - self.label_width)

    @property
    def num_visible_rows(self) -> int:
        """Unit rows that fit."""
        return max(1, self.size.height - CHROME_LINES)

    @property
    def cursor_unit(self) -> tuple[str, int] | None:
        """The ``(node_id, unit_id)`` under the cursor (None without units)."""
        return self.units[self.cursor_row] if self.units else None

    @property
    def cursor_at(self) -> int:
        """The cursor's bucket index (the newest when following)."""
        return self.newest if self.cursor_bucket is None else self.cursor_bucket

    def set_extent(
        self,
        units: Sequence[tuple[str, int]],
        newest: int,
        oldest: int,
        bucket_s: float,
        gpus: Mapping[tuple[str, int], str] | None = None,
    ) -> None:
        """The rows (and the GPUs of those that run on GPUs) and the buckets there are; clamps the cursor and
        scrolls to keep it visible."""
        self.units, self.newest, self.oldest, self.bucket_s = units, newest, oldest, bucket_s
        self.gpus = gpus or {}
        longest = max((len(self._gpu_text(g)) for g in self.gpus.values()), default=-1)
        self.label_width = LABEL_WIDTH + longest + 1
        self.cursor_row = min(max(0, self.cursor_row), max(0, len(units) - 1))
        if self.cursor_bucket is not None:
            self.cursor_bucket = max(oldest, self.cursor_bucket)
            if self.cursor_bucket >= newest:
                self.cursor_bucket = None
        visible = self.num_visible_rows
        if self.cursor_row < self.row_offset:
            self.row_offset = self.cursor_row
        elif self.cursor_row >= self.row_offset + visible:
            self.row_offset = self.cursor_row - visible + 1
        self.row_offset = max(0, min(self.row_offset, max(0, len(units) - visible)))

    def visible_units(self) -> Sequence[tuple[str, int]]:
        """The units of the rows on display."""
        return self.units[self.row_offset : self.row_offset + self.num_visible_rows]

    def last_bucket(self) -> int:
        """The rightmost column's bucket: the newest, unless the cursor went further back than the view."""
        cursor = self.cursor_at
        if cursor <= self.newest - self.num_columns:
            return cursor + self.num_columns - 1
        return self.newest

    def select(self, node_id: str, unit_id: int) -> None:
        """Put the cursor on a unit's row (when it has one)."""
        if (node_id, unit_id) in self.units:
            self.cursor_row = list(self.units).index((node_id, unit_id))
            self.post_message(self.CursorMoved(self))

    def show(self, grid: HeatmapGrid) -> None:
        """Draw ``grid`` (computed by the screen for :meth:`visible_units` and :meth:`last_bucket`)."""
        self.grid = grid
        self.refresh()

    def on_resize(self, event: events.Resize) -> None:
        self.post_message(self.Resized(self))

    # -- actions -----------------------------------------------------------------------------------------------
    def action_move(self, rows: int, columns: int) -> None:
        """Move the cursor ``rows`` units down and ``columns`` buckets forward in time."""
        if rows and self.units:
            self.cursor_row = min(max(0, self.cursor_row + rows), len(self.units) - 1)
        if columns:
            target = max(self.oldest, self.cursor_at + columns)
            self.cursor_bucket = None if target >= self.newest else target
        self.post_message(self.CursorMoved(self))

    def action_oldest(self) -> None:
        self.cursor_bucket = self.oldest
        self.post_message(self.CursorMoved(self))

    def action_follow(self) -> None:
        self.cursor_bucket = None
        self.post_message(self.CursorMoved(self))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``follow`` is greyed out while the cursor already follows the newest bucket."""
        if action == "follow" and self.cursor_bucket is None:
            return None
        return True

    # -- drawing -------------------------------------------------------------------------------------------------
    def palette(self) -> list[Style]:
        """One background style per colour level (recomputed when the theme changes)."""
        theme = self.app.theme
        if self._palette is None or self._palette[0] != theme:
            _, base = self.background_colors
            stops = [base + self.get_component_styles(f"heatmap--{name}").color for name in ("low", "mid", "high")]
            styles = []
            for level in range(LEVELS):
                segment, frac = gradient_stop(level, LEVELS)
                colour: Color = stops[segment].blend(stops[segment + 1], frac)
                styles.append(Style(bgcolor=colour.rich_color, color=colour.get_contrast_text().rich_color))
            self._palette = (theme, styles)
        return self._palette[1]

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        grid = self.grid
        if grid is None or not grid.rows:
            text = "no units yet" if y == 0 else ""
            return Strip([Segment(text, base)]).adjust_cell_length(width, base)
        num_rows = len(grid.rows)
        if y == 0:
            segments = self._marker_line(grid)
        elif y <= num_rows:
            segments = self._row_line(grid, y - 1)
        elif y == num_rows + 1:
            segments = self._axis_line(grid)
        elif y == num_rows + 2:
            segments = self._legend_line(grid)
        else:
            segments = []
        return Strip(segments).adjust_cell_length(width, base).simplify()

    @staticmethod
    def _gpu_text(gpus: str) -> str:
        """A unit's GPUs (``0-3``) as its label shows them: ``gpu0-3``, at most :data:`GPU_WIDTH` columns."""
        return clip(f"gpu{gpus}", GPU_WIDTH)

    def _style(self, name: str) -> Style:
        return self.rich_style + self.get_component_rich_style(f"heatmap--{name}")

    def _cursor_column(self, grid: HeatmapGrid) -> int:
        return self.cursor_at - grid.first_bucket

    def _marker_line(self, grid: HeatmapGrid) -> list[Segment]:
        segments = [Segment("policy Δ".ljust(self.label_width), self._style("label"))]
        marker, plain = self._style("marker"), self.rich_style
        segments.extend(
            Segment("◆", marker) if col in grid.markers else Segment(" ", plain) for col in range(grid.num_columns)
        )
        return segments

    def _row_line(self, grid: HeatmapGrid, index: int) -> list[Segment]:
        row = grid.rows[index]
        unit_index = self.row_offset + index
        first_of_node = unit_index == 0 or self.units[unit_index - 1][0] != row.node_id
        name = row.node_id[: LABEL_WIDTH - 5] if first_of_node else ""
        label = f"{name:<{LABEL_WIDTH - 5}} u{row.unit_id:<3}"[: LABEL_WIDTH - 1]
        gpus = self.gpus.get((row.node_id, row.unit_id))
        if gpus:
            label += " " + self._gpu_text(gpus)
        is_cursor_row = unit_index == self.cursor_row
        label_style = self._style("cursor" if is_cursor_row else "node" if first_of_node else "label")
        segments = [Segment(label.ljust(self.label_width - 1) + " ", label_style)]
        spec = METRIC_SPECS[grid.metric]
        low, high = self._scale(grid)
        palette = self.palette()
        empty, lost = self._style("empty"), self._style("gap")
        cursor_col = self._cursor_column(grid) if is_cursor_row else -1
        base = self.rich_style
        for col, value in enumerate(row.values):
            if value is None:
                style, glyph = (lost, GAP_GLYPH) if col in row.gaps else (empty, "·")
            else:
                style, glyph = (
                    base + palette[scale_level(value, low, high, LEVELS, higher_is_worse=spec.higher_is_worse)],
                    " ",
                )
            if col == cursor_col:  # a block in the cell's contrast colour (the cursor style where empty)
                style, glyph = (self._style("cursor") if value is None else style), "◼"
            segments.append(Segment(glyph, style))
        return segments

    def _scale(self, grid: HeatmapGrid) -> tuple[float, float]:
        return scale_range((v for row in grid.rows for v in row.values), METRIC_SPECS[grid.metric].fixed_max)

    def _axis_line(self, grid: HeatmapGrid) -> list[Segment]:
        columns = grid.num_columns
        last = grid.first_bucket + columns - 1
        axis = list(time_axis(columns, self.bucket_s, end_age_s=(self.newest - last) * self.bucket_s))
        cursor_col = self._cursor_column(grid)
        if 0 <= cursor_col < columns:
            axis[cursor_col] = "^"
        return [
            Segment(f"{self.bucket_s:g}s/col".ljust(self.label_width), self._style("label")),
            Segment("".join(axis), self._style("axis")),
        ]

    def _legend_line(self, grid: HeatmapGrid) -> list[Segment]:
        spec = METRIC_SPECS[grid.metric]
        low, high = self._scale(grid)
        palette = self.palette()
        segments = [
            Segment(spec.label[: self.label_width - 1].ljust(self.label_width), self._style("label")),
            Segment(fmt_value(low, spec.unit, spec.percent) + " ", self._style("axis")),
        ]
        for i in range(LEVELS):
            value = low + (high - low) * (i + 0.5) / LEVELS
            segments.append(
                Segment(
                    "  ",
                    self.rich_style
                    + palette[scale_level(value, low, high, LEVELS, higher_is_worse=spec.higher_is_worse)],
                )
            )
        segments.append(Segment(" " + fmt_value(high, spec.unit, spec.percent) + "  ", self._style("axis")))
        segments.append(Segment("·", self._style("empty")))
        segments.append(Segment(" no data", self._style("axis")))
        if any(row.gaps for row in grid.rows):
            segments.append(Segment("  ", self._style("axis")))
            segments.append(Segment(GAP_GLYPH, self._style("gap")))
            segments.append(Segment(" lost (gap)", self._style("axis")))
        return segments


def metric_title(metric: HeatMetric) -> str:
    """The heading of a heatmap of ``metric``: its name, its unit and the key that selects it."""
    spec = METRIC_SPECS[metric]
    unit = "%" if spec.percent else spec.unit
    return f"{spec.label} ({unit})" if unit else spec.label
