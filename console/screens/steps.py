"""Steps: one unit's recent steps as a timeline (prefill and decode tokens, mode, predicted against measured time,
the budget) and, beside it, the step under the cursor with the policy's reasons."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Static

from agent.telemetry import StepEvent
from console.model.render import fmt_pct
from console.model.state import ConsoleState
from console.model.steps import MODE_GLYPHS, move_cursor, step_index, step_stats
from console.screens.base import UnitKey, UnitScreen
from console.widgets.step_detail import StepDetail
from console.widgets.step_timeline import StepTimeline


class StepsScreen(UnitScreen):
    """A unit's step timeline with a step cursor; keys pick the unit and move along the steps."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("down,u", "cycle_unit(1)", "Next unit", id="steps.next_unit", tooltip="Show the next unit's steps"),
        Binding(
            "up,U",
            "cycle_unit(-1)",
            "Previous unit",
            show=False,
            id="steps.previous_unit",
            tooltip="Show the previous unit's steps",
        ),
        Binding("left", "move(-1)", "Older", show=False, id="steps.older", tooltip="Cursor one step back"),
        Binding("right", "move(1)", "Newer", show=False, id="steps.newer", tooltip="Cursor one step forward"),
        Binding("pageup", "move(-10)", "10 older", show=False, id="steps.page_older", tooltip="Cursor 10 steps back"),
        Binding(
            "pagedown", "move(10)", "10 newer", show=False, id="steps.page_newer", tooltip="Cursor 10 steps forward"
        ),
        Binding("home", "oldest", "Oldest", show=False, id="steps.oldest", tooltip="Cursor on the oldest step held"),
        Binding(
            "end",
            "follow",
            "Follow",
            id="steps.follow",
            tooltip="Cursor back on the newest step, following new steps as they come",
        ),
    ]

    def __init__(self) -> None:
        super().__init__()
        # self.unit: the unit shown (None: the first one, once there is one)
        self.cursor_ns: int | None = None
        """The cursor's step, by its start time; None: the newest, following."""
        self._following: bool | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="steps-title", classes="pane-title")
        with Horizontal(id="steps-body"):
            yield StepTimeline(id="steps-timeline")
            with Vertical(id="steps-side"):
                yield StepDetail(id="steps-detail")
        yield Footer()

    def redraw(self) -> None:
        """Draw the unit's steps, the cursor's step and the heading from the last state shown."""
        state = self._state
        if state is None:
            return
        units = self._units()
        if self.unit not in units:
            self.unit, self.cursor_ns = (units[0] if units else None), None
        title = self.query_one("#steps-title", Static)
        timeline = self.query_one(StepTimeline)
        detail = self.query_one(StepDetail)
        if self.unit is None:
            title.update(Text("Steps · no units yet"))
            timeline.show((), None)
            detail.show_step("", None, state.now_ns)
            return
        node_id, unit_id = self.unit
        steps = tuple(state.steps.steps(node_id, unit_id))
        timeline.show(steps, self.cursor_ns)
        index = step_index(steps, self.cursor_ns)
        detail.show_step(node_id, steps[index] if index >= 0 else None, state.now_ns)
        title.update(Text(self._heading(state, steps, units)))
        following = self.cursor_ns is None
        if following != self._following:  # "follow" is greyed out while following: tell the footer
            self._following = following
            self.refresh_bindings()

    def _heading(self, state: ConsoleState, steps: tuple[StepEvent, ...], units: list[UnitKey]) -> str:
        assert self.unit is not None
        node_id, unit_id = self.unit
        unit = state.nodes[node_id].units.get(unit_id)
        policy = unit.batch_policy if unit is not None else ""
        window = self.query_one(StepTimeline).window()
        stats = step_stats(window.steps)
        modes = " ".join(f"{MODE_GLYPHS.get(mode, mode)}{n}" for mode, n in stats.num_by_mode.items() if n)
        parts = [
            f"{node_id} u{unit_id} ({units.index(self.unit) + 1}/{len(units)})",
            policy or "-",
            f"{len(steps)} steps held",
        ]
        if stats.num_steps:
            parts.append(modes)
            parts.append(f"pred err {fmt_pct(stats.mean_abs_error)}")
        return " · ".join(parts)

    def forget_selection(self) -> None:
        """A new unit: follow its newest step."""
        self.cursor_ns = None

    # -- actions ---------------------------------------------------------------------------------------------------

    def action_move(self, delta: int) -> None:
        """Move the cursor ``delta`` steps (negative: back in time)."""
        if self._state is not None and self.unit is not None:
            self.cursor_ns = move_cursor(self._state.steps.steps(*self.unit), self.cursor_ns, delta)
            self.redraw()

    def action_oldest(self) -> None:
        """Cursor on the oldest step held."""
        if self._state is not None and self.unit is not None:
            steps = self._state.steps.steps(*self.unit)
            self.cursor_ns = steps[0].time_ns if len(steps) > 1 else None
            self.redraw()

    def action_follow(self) -> None:
        """Cursor on the newest step, following."""
        self.cursor_ns = None
        self.redraw()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``follow`` is greyed out while following; the unit keys while there is at most one unit."""
        if action == "follow" and self.cursor_ns is None:
            return None
        return super().check_action(action, parameters)
