"""Stage boundaries over time: one row per change, newest on top, each on the same log length axis as the length
histogram (``│`` at a cut, each stage's span labelled with its units), its age on the left."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Final

from rich.text import Text
from textual.widget import Widget

from agent.telemetry import StageBoundaries
from console.model.render import fmt_age
from console.model.stages import boundary_columns, fmt_units
from console.widgets.length_chart import LABEL_WIDTH
from console.widgets.rows import Row, rows_text

EMPTY: Final = "no stage boundaries from this node"


def change_cells(change: StageBoundaries, columns: int) -> list[tuple[str, str]]:
    """One change on ``columns`` cells: ``─`` spans in alternating stage styles, ``│`` at the cuts, each span's
    units centred in it where they fit."""
    cuts = boundary_columns(change.boundaries_tokens, columns)
    cells: list[tuple[str, str]] = []
    stage = 0
    for c in range(columns):
        if stage < len(cuts) and c == cuts[stage]:
            cells.append(("│", "cut"))
            while stage < len(cuts) and cuts[stage] == c:
                stage += 1
        else:
            cells.append(("─", "stage-odd" if stage % 2 else "stage-even"))
    starts = [0, *(c + 1 for c in cuts)]
    ends = [*cuts, columns]
    for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
        label = fmt_units(change.stage_unit_ids[k]) if k < len(change.stage_unit_ids) else ""
        if label and len(label) + 2 <= end - start:
            at = start + (end - start - len(label)) // 2
            style = "stage-odd" if k % 2 else "stage-even"
            for i, ch in enumerate(label):
                cells[at + i] = (ch, f"{style}-label")
    return cells


def history_rows(changes: Sequence[StageBoundaries], now_ns: int, width: int, height: int) -> list[Row]:
    """The newest ``height`` changes, newest first. Pure, for tests."""
    if not changes:
        return [[(EMPTY, "label")]]
    columns = max(1, width - LABEL_WIDTH)
    rows: list[Row] = []
    for change in list(reversed(changes))[: max(1, height)]:
        age = fmt_age((now_ns - change.time_ns) / 1e9)
        rows.append([(age.rjust(LABEL_WIDTH - 1) + " ", "label"), *change_cells(change, columns)])
    return rows


class BoundaryHistory(Widget):
    """Recent boundary changes (component classes ``history--stage-even``, ``history--stage-odd``,
    ``history--stage-even-label``, ``history--stage-odd-label``, ``history--cut``, ``history--label``)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "history--stage-even",
        "history--stage-odd",
        "history--stage-even-label",
        "history--stage-odd-label",
        "history--cut",
        "history--label",
    }

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.changes: Sequence[StageBoundaries] = ()
        """The node's boundary changes, oldest first."""
        self.now_ns = 0

    def show(self, changes: Sequence[StageBoundaries], now_ns: int) -> None:
        self.changes, self.now_ns = changes, now_ns
        self.refresh()

    def render(self) -> Text:
        return rows_text(self, history_rows(self.changes, self.now_ns, self.size.width, self.size.height), "history")
