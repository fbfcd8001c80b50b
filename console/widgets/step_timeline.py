"""One unit's recent steps as a timeline: a column per step, newest on the right, with a cursor on one step.

Rows, top down: stacked token bars (decode at the bottom, prefill above, the token budget as ``╌`` where it is on
the scale), the mode of each step (``M`` mixed, ``P`` prefill, ``D`` decode, ``·`` idle), measured and predicted
step time as sparklines on one scale, the step numbers with ``^`` under the cursor, a legend. The screen hands
the widget the unit's steps and the cursor (attributes down); the picture is :func:`timeline_rows`, a pure
function of them and the size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Final

from rich.text import Text
from textual.widget import Widget

from agent.telemetry import StepEvent
from console.model.render import fmt_ms, fmt_si, sparkline
from console.model.steps import MODE_GLYPHS, StepWindow, bar_rows, level_row, step_window
from console.widgets.rows import Row, rows_text

LABEL_WIDTH: Final = 7
"""Columns taken by the row labels on the left."""
CHROME_LINES: Final = 5
"""Rows that are not token bars: mode, measured, predicted, axis, legend."""


def timeline_rows(window: StepWindow, width: int, height: int) -> list[Row]:
    """The timeline of ``window`` on ``width`` x ``height`` cells (see the module's docstring)."""
    if not window.steps:
        return [[("no steps from this unit yet", "label")]]
    bars = max(1, height - CHROME_LINES)
    steps, cursor = window.steps, window.cursor
    parts = [bar_rows(s.num_prefill_tokens, s.num_decode_tokens, window.top_tokens, bars) for s in steps]
    budgets = [level_row(s.budget_tokens, window.top_tokens, bars) for s in steps]
    rows: list[Row] = []
    for r in range(bars):
        level = bars - r
        label = fmt_si(window.top_tokens) if r == 0 else "tok" if r == 1 and bars > 2 else "0" if level == 1 else ""
        row: Row = [(label.rjust(LABEL_WIDTH - 1) + " ", "label")]
        for i, ((decode, prefill), budget) in enumerate(zip(parts, budgets, strict=True)):
            if level <= decode:
                row.append(("█", "decode"))
            elif level <= decode + prefill:
                row.append(("█", "prefill"))
            elif budget == level:
                row.append(("╌", "budget"))
            elif i == cursor:
                row.append(("┊", "cursor"))
            else:
                row.append((" ", ""))
        rows.append(row)
    modes: Row = [("mode".ljust(LABEL_WIDTH), "label")]
    for i, s in enumerate(steps):
        modes.append((MODE_GLYPHS.get(str(s.mode), "?"), "cursor" if i == cursor else f"mode-{s.mode}"))
    rows.append(modes)
    n = len(steps)
    measured = sparkline([s.measured_ns / 1e6 for s in steps], n, high=window.top_ms)
    predicted = sparkline([s.predicted_ns / 1e6 for s in steps], n, high=window.top_ms)
    rows.append([("meas".ljust(LABEL_WIDTH), "label"), (measured, "measured")])
    rows.append([("pred".ljust(LABEL_WIDTH), "label"), (predicted, "predicted")])
    rows.append([("step".ljust(LABEL_WIDTH), "label"), (_axis(steps, cursor, width - LABEL_WIDTH), "axis")])
    rows.append(
        [
            ("".ljust(LABEL_WIDTH), "label"),
            ("█", "decode"),
            (" decode ", "axis"),
            ("█", "prefill"),
            (" prefill ", "axis"),
            ("╌", "budget"),
            (f" budget · time ≤{fmt_ms(window.top_ms)} ms", "axis"),
        ]
    )
    return rows[:height] if height > 0 else rows


def _axis(steps: Sequence[StepEvent], cursor: int, width: int) -> str:
    """``^`` under the cursor, the first step's number at the left and the last one's at the right, where they
    fit."""
    cells = [" "] * max(len(steps), 1)
    if 0 <= cursor < len(cells):
        cells[cursor] = "^"
    first, last = f"#{steps[0].step_id}", f"#{steps[-1].step_id}"
    n = len(cells)
    if len(last) < n and (cursor < n - len(last) - 1 or cursor < 0):
        cells[n - len(last) :] = last
    if len(first) + len(last) + 2 < n and cursor > len(first):
        cells[: len(first)] = first
    return "".join(cells)[: max(0, width)]


class StepTimeline(Widget):
    """The selected unit's steps as a timeline (component classes ``steps--decode``, ``steps--prefill``,
    ``steps--budget``, ``steps--cursor``, ``steps--mode-*``, ``steps--measured``, ``steps--predicted``,
    ``steps--label``, ``steps--axis``)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "steps--decode",
        "steps--prefill",
        "steps--budget",
        "steps--cursor",
        "steps--mode-mixed",
        "steps--mode-prefill",
        "steps--mode-decode",
        "steps--mode-idle",
        "steps--measured",
        "steps--predicted",
        "steps--label",
        "steps--axis",
    }

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.steps: Sequence[StepEvent] = ()
        """The unit's steps held, oldest first."""
        self.cursor_ns: int | None = None
        """The cursor's step (its start time); None: the newest."""

    @property
    def num_columns(self) -> int:
        """Steps that fit across."""
        return max(1, self.size.width - LABEL_WIDTH)

    def window(self) -> StepWindow:
        """The steps on display and their scales."""
        return step_window(self.steps, self.num_columns, self.cursor_ns)

    def show(self, steps: Sequence[StepEvent], cursor_ns: int | None) -> None:
        """Draw ``steps`` with the cursor on ``cursor_ns``."""
        self.steps, self.cursor_ns = steps, cursor_ns
        self.refresh()

    def render(self) -> Text:
        return rows_text(self, timeline_rows(self.window(), self.size.width, self.size.height), "steps")
