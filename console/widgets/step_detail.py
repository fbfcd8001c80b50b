"""The step under the Steps cursor in words: its numbers, then the policy's reasons ("why did it decide that")."""

from __future__ import annotations

from typing import ClassVar

from textual.widgets import Static

from agent.telemetry import StepEvent
from console.model.render import fmt_age
from console.model.steps import reason_lines, step_facts
from console.widgets.rows import Row, rows_text

FACT_WIDTH = 10
"""Columns of the fact labels."""


def detail_rows(node_id: str, step: StepEvent | None, now_ns: int) -> list[Row]:
    """A heading (step number, unit, age), the step's facts, then its reasons. Pure, for tests."""
    if step is None:
        return [[("no step selected", "muted")]]
    age = fmt_age((now_ns - step.time_ns) / 1e9)
    rows: list[Row] = [[(f"step #{step.step_id} · {node_id} u{step.unit_id} · {age}", "heading")]]
    for label, value in step_facts(step):
        rows.append([(label.ljust(FACT_WIDTH), "label"), (value, "")])
    rows.append([("why (the policy's reasons)", "heading")])
    reasons = reason_lines(step.reasons)
    if not reasons:
        rows.append([("none reported", "muted")])
    width = max((len(name) for name, _ in reasons), default=0) + 1
    for name, value in reasons:
        rows.append([(name.ljust(width), "label"), (value, "")])
    return rows


class StepDetail(Static):
    """The cursor's step (component classes ``step-detail--heading``, ``step-detail--label``,
    ``step-detail--muted``)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"step-detail--heading", "step-detail--label", "step-detail--muted"}

    def show_step(self, node_id: str, step: StepEvent | None, now_ns: int) -> None:
        """Describe ``step`` of a unit of ``node_id`` as of ``now_ns``."""
        self.update(rows_text(self, detail_rows(node_id, step, now_ns), "step-detail"))
