"""The lengths of recent requests as a histogram on a log axis, one log bucket per column, with the current stage
boundaries drawn on it (``│`` above the bars, the cut under them) and the bars coloured by the stage that takes
them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Final

from rich.text import Text
from textual.widget import Widget

from console.model.stages import boundary_columns, column_low, fmt_tokens, length_histogram, log_column, stage_of
from console.widgets.rows import Row, rows_text

LABEL_WIDTH: Final = 7
AXIS_TICKS: Final = (16, 64, 256, 1024, 4096, 16384, 65536)
"""Lengths labelled on the axis."""
CHROME_LINES: Final = 2
"""Rows that are not bars: the cuts and the axis."""


def place(cells: list[str], column: int, label: str) -> bool:
    """Write ``label`` into ``cells`` from ``column`` when it fits over blanks with a blank before it."""
    end = column + len(label)
    if column < 0 or end > len(cells) or any(c != " " for c in cells[max(0, column - 1) : end]):
        return False
    cells[column:end] = label
    return True


def length_rows(lengths: Sequence[int], boundaries: Sequence[int] | None, width: int, height: int) -> list[Row]:
    """The histogram of ``lengths`` with ``boundaries`` (None: no staged dispatcher) on ``width`` x ``height``
    cells. Pure, for tests."""
    columns = max(1, width - LABEL_WIDTH)
    counts = length_histogram(lengths, columns)
    cuts = list(boundaries or ())
    cut_cols = set(boundary_columns(cuts, columns))
    top = max(counts)
    bars = max(1, height - CHROME_LINES)
    stages = [stage_of(math.ceil(column_low(c, columns)), cuts) for c in range(columns)]
    rows: list[Row] = []
    for r in range(bars):
        level = bars - r
        label = str(top) if r == 0 else "req" if r == 1 and bars > 2 else "0" if level == 1 else ""
        row: Row = [(label.rjust(LABEL_WIDTH - 1) + " ", "label")]
        for c, count in enumerate(counts):
            filled = 0 if not count or not top else max(1, math.ceil(count / top * bars - 1e-9))
            if level <= filled:
                row.append(("█", "stage-odd" if stages[c] % 2 else "stage-even"))
            elif c in cut_cols:
                row.append(("│", "cut"))
            else:
                row.append((" ", ""))
        rows.append(row)
    marks = [" "] * columns
    for cut in cuts:
        column = log_column(cut, columns)
        if not place(marks, column, f"┴{fmt_tokens(cut)}"):
            marks[column] = "┴"
    rows.append([("cuts".ljust(LABEL_WIDTH), "label"), ("".join(marks), "cut")])
    axis = [" "] * columns
    for tick in AXIS_TICKS:
        place(axis, log_column(tick, columns), fmt_tokens(tick))
    rows.append([("tokens".ljust(LABEL_WIDTH), "label"), ("".join(axis), "axis")])
    return rows[:height] if height > 0 else rows


class LengthChart(Widget):
    """Recent lengths and the stage cuts (component classes ``lengths--stage-even``, ``lengths--stage-odd``,
    ``lengths--cut``, ``lengths--label``, ``lengths--axis``)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "lengths--stage-even",
        "lengths--stage-odd",
        "lengths--cut",
        "lengths--label",
        "lengths--axis",
    }

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.lengths: Sequence[int] = ()
        """Prompt lengths of recent arrivals."""
        self.boundaries: Sequence[int] | None = None
        """The current cuts (None: no staged dispatcher)."""

    def show(self, lengths: Sequence[int], boundaries: Sequence[int] | None) -> None:
        self.lengths, self.boundaries = lengths, boundaries
        self.refresh()

    def render(self) -> Text:
        return rows_text(self, length_rows(self.lengths, self.boundaries, self.size.width, self.size.height), "lengths")
