"""The replay's keys and command-palette entries: app-level, so they work on every screen of a replay.

The keys run the app's ``replay_*`` actions, which move the :class:`~console.model.playback.Playback`; a live console
hides them (``check_action``). The palette's entries run the same actions (STYLE example 10).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Final

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.keys import format_key

STEP_S: Final = 10.0
"""What ``[`` and ``]`` seek."""
BIG_STEP_S: Final = 60.0
"""What ``{`` and ``}`` seek."""

REPLAY_BINDINGS: Final[list[Binding]] = [
    Binding(
        "space",
        "replay_toggle",
        "Play/pause",
        show=False,
        id="replay.play_pause",
        tooltip="Replay: play from the cursor at the replay's speed (from the start when at the end), or pause",
    ),
    Binding(
        "left_square_bracket",
        f"replay_seek({-STEP_S})",
        f"Back {STEP_S:g} s",
        show=False,
        id="replay.back",
        tooltip=f"Replay: the cursor {STEP_S:g} s back (the view is rebuilt as it was then)",
    ),
    Binding(
        "right_square_bracket",
        f"replay_seek({STEP_S})",
        f"Forward {STEP_S:g} s",
        show=False,
        id="replay.forward",
        tooltip=f"Replay: the cursor {STEP_S:g} s forward",
    ),
    Binding(
        "left_curly_bracket",
        f"replay_seek({-BIG_STEP_S})",
        f"Back {BIG_STEP_S:g} s",
        show=False,
        id="replay.back_more",
        tooltip=f"Replay: the cursor {BIG_STEP_S:g} s back (the view is rebuilt as it was then)",
    ),
    Binding(
        "right_curly_bracket",
        f"replay_seek({BIG_STEP_S})",
        f"Forward {BIG_STEP_S:g} s",
        show=False,
        id="replay.forward_more",
        tooltip=f"Replay: the cursor {BIG_STEP_S:g} s forward",
    ),
    Binding(
        "less_than_sign",
        "replay_jump('start')",
        "To the start",
        show=False,
        id="replay.start",
        tooltip="Replay: the cursor to the first event of the file",
    ),
    Binding(
        "greater_than_sign",
        "replay_jump('end')",
        "To the end",
        show=False,
        id="replay.end",
        tooltip="Replay: the cursor to the last event of the file",
    ),
    Binding(
        "minus",
        "replay_speed(0.5)",
        "Slower",
        show=False,
        id="replay.slower",
        tooltip="Replay: half the speed (down to 1/16 of the recorded pace)",
    ),
    Binding(
        "plus,equals_sign",
        "replay_speed(2.0)",
        "Faster",
        show=False,
        id="replay.faster",
        tooltip="Replay: twice the speed (up to 1024 times the recorded pace)",
    ),
]
"""The replay's keys, by id (remappable with ``--key replay.back=b``)."""


def replay_commands(app: App[int]) -> Iterator[SystemCommand]:
    """One palette entry per replay key, running the key's own action."""
    for binding in REPLAY_BINDINGS:
        yield SystemCommand(
            f"Replay: {binding.description.lower()}",
            f"{binding.tooltip.removeprefix('Replay: ')} (key {format_key(binding.key.split(',')[0])})",
            partial(app.run_action, binding.action),
        )
