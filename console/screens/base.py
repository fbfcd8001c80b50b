"""What every mode's screen has in common: it is shown the state by the app (attributes down)."""

from __future__ import annotations

from collections.abc import Iterator

from textual.app import SystemCommand
from textual.screen import Screen

from console.model.render import cycled
from console.model.state import ConsoleState


class StateScreen(Screen[None]):
    """A screen that draws the console's state. The app calls :meth:`show_state` at most every ``--refresh``
    seconds while the screen is active and the state has changed (and once when the screen becomes active)."""

    shown_version = -1
    """The state's version when last drawn (-1: never)."""

    def show_state(self, state: ConsoleState) -> None:
        """Draw ``state`` (called by the app; never from a worker)."""
        raise NotImplementedError

    def system_commands(self) -> Iterator[SystemCommand]:
        """The command palette's entries for this screen (the app lists them after its own): the same actions as
        the screen's keys, when they can run. None by default."""
        yield from ()


UnitKey = tuple[str, int]
"""``(node_id, unit_id)``."""


class UnitScreen(StateScreen):
    """A screen about one unit at a time (Steps, Slack): the unit keys, :meth:`select_unit` and the greying of
    the unit keys while there is at most one unit. Subclasses draw in :meth:`redraw` and say in
    :meth:`forget_selection` what a change of unit resets."""

    def __init__(self) -> None:
        super().__init__()
        self._state: ConsoleState | None = None
        self.unit: UnitKey | None = None
        """The unit shown (None: the screen's default once there is one)."""

    def show_state(self, state: ConsoleState) -> None:
        self._state = state
        self.redraw()

    def redraw(self) -> None:
        raise NotImplementedError

    def forget_selection(self) -> None:
        """Reset what was selected on the previous unit (called when the unit changes)."""

    def _units(self) -> list[UnitKey]:
        return [] if self._state is None else self._state.unit_keys()

    def select_unit(self, node_id: str, unit_id: int) -> None:
        """Show ``unit_id`` of ``node_id``."""
        if (node_id, unit_id) in self._units():
            self.unit = (node_id, unit_id)
            self.forget_selection()
            self.redraw()

    def action_cycle_unit(self, step: int) -> None:
        """Show the unit ``step`` places on (wrapping)."""
        units = self._units()
        if units:
            self.unit = cycled(units, self.unit, step)
            self.forget_selection()
            self.redraw()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The unit keys are greyed out while there is at most one unit."""
        if action == "cycle_unit" and len(self._units()) < 2:
            return None
        return True
