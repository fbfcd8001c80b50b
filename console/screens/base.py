"""What every mode's screen has in common: it is shown the state by the app (attributes down)."""

from __future__ import annotations

from textual.screen import Screen

from console.state import ConsoleState


class StateScreen(Screen[None]):
    """A screen that draws the console's state. The app calls :meth:`show_state` at most every ``--refresh``
    seconds while the screen is active and the state has changed (and once when the screen becomes active)."""

    shown_version = -1
    """The state's version when last drawn (-1: never)."""

    def show_state(self, state: ConsoleState) -> None:
        """Draw ``state`` (called by the app; never from a worker)."""
        raise NotImplementedError
