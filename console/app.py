"""The operator console: a Textual app whose screens are modes (:mod:`console.screens.registry`), fed by feed workers.

Data flow (STYLE example 8): one async worker per feed folds its updates into a plain
:class:`~console.model.state.ConsoleState`; a timer every ``refresh_s`` hands the state to the active screen when it
changed (so screens redraw at most ``1 / refresh_s`` times a second, however fast events arrive); screens
compute what they draw with the pure queries and pass it down to their widgets.

Time: in live mode the app ticks the state with its injected ``clock`` (wall-clock ns) at every refresh, so
rates fall to zero when a node goes quiet; a replay ticks it to its cursor's position (:class:`Playback`), which the
``replay_*`` keys move (:mod:`console.replay_keys`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, ClassVar, Final

from textual.app import App, ScreenStackError, SystemCommand
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.screen import Screen

from console.feeds import Feed, ReplayFeed
from console.model.playback import Playback, Where, describe
from console.model.records import Connection
from console.model.state import ConsoleState
from console.replay_keys import REPLAY_BINDINGS, replay_commands
from console.screens.base import StateScreen
from console.screens.focus import LEAVE_INPUT_BINDING, leave_input, takes_text
from console.screens.heatmap import HeatmapScreen
from console.screens.help import HelpScreen, key_help
from console.screens.overview import OverviewScreen
from console.screens.policies import PoliciesScreen
from console.screens.registry import SCREEN_BINDINGS, SCREENS
from console.screens.slack import SlackScreen
from console.screens.steps import StepsScreen
from console.screens.whatif import WhatIfScreen
from console.sql import Database
from console.themes import THEMES
from console.whatif import WHATIF_COMMAND

Clock = Callable[[], int]
"""Wall-clock nanoseconds (``time.time_ns``), injectable for tests."""

FEED_CLOSE_TIMEOUT_S = 0.5
"""How long an exiting console waits for its feeds to close their connections (a closing handshake on a healthy
agent takes milliseconds; one that does not answer is left, so that quitting never waits long)."""
MODE_TITLES: Final[dict[str, str]] = {spec.name: spec.title for spec in SCREENS}
"""Each mode's title (the header's subtitle starts with it)."""


class ConsoleApp(App[int]):
    """The console. ``feeds``: where events come from (live agents, or a store file)."""

    CSS_PATH = "console.tcss"
    TITLE = "trackside"
    MODES: ClassVar[dict[str, str | Callable[[], Screen[Any]]]] = {spec.name: spec.screen for spec in SCREENS}
    DEFAULT_MODE: ClassVar[str] = SCREENS[0].name
    BINDINGS: ClassVar[list[BindingType]] = [
        *SCREEN_BINDINGS,
        Binding("question_mark,f1", "help", "Help", id="console.help", tooltip="List the keys of this screen"),
        Binding("q", "quit", "Quit", id="console.quit", tooltip="Leave the console"),
        LEAVE_INPUT_BINDING,
        *REPLAY_BINDINGS,
    ]

    def __init__(
        self,
        feeds: Sequence[Feed],
        *,
        read_only: bool = False,
        refresh_s: float = 0.1,
        exit_after_s: float | None = None,
        clock: Clock | None = time.time_ns,
        state: ConsoleState | None = None,
        keymap: Mapping[str, str] | None = None,
        token: str = "",
        ssl_context: ssl.SSLContext | None = None,
        database: Database | None = None,
        playback: Playback | None = None,
        theme: str | None = None,
        whatif_command: Sequence[str] = WHATIF_COMMAND,
    ) -> None:
        super().__init__()
        for custom in THEMES:
            self.register_theme(custom)
        if theme is not None:
            self.theme = theme  # an unknown name raises InvalidThemeError (the command line checks it first)
        if refresh_s <= 0:
            raise ValueError("refresh_s must be positive")
        self.feeds = tuple(feeds)
        self.read_only = read_only
        """Watch only: control actions are refused."""
        self.token = token
        """The agents' control token (``--token-file``; "": control is off)."""
        self.ssl_context = ssl_context
        """How control requests verify ``wss://`` agents (``--ca-file``; None: the system's trust store)."""
        self.database = database
        """What the SQL screen queries: the replayed file, or the console's own recording (None: neither)."""
        self.whatif_command = tuple(whatif_command)
        """What the What-if screen runs, before its arguments (``python -m agent.cli whatif``)."""
        self.refresh_s = refresh_s
        self.exit_after_s = exit_after_s
        self.clock = clock
        self.state = state or ConsoleState()
        self.playback = playback or next((f.playback for f in self.feeds if isinstance(f, ReplayFeed)), None)
        """The replay cursor (None: live); the ``replay_*`` actions move it."""
        self.num_refreshes = 0
        """Screen updates so far (for the performance check)."""
        if keymap:
            self.set_keymap(dict(keymap))

    # -- life cycle ---------------------------------------------------------------------------------------------
    def on_mount(self) -> None:
        for feed in self.feeds:
            self.state.set_connection(feed.source, Connection.CONNECTING)
            self.run_worker(self._follow(feed), name=f"feed {feed.source}", group="feeds", exit_on_error=False)
        self.set_interval(self.refresh_s, self.refresh_views)
        if self.exit_after_s is not None:
            self.set_timer(self.exit_after_s, self._exit_after)
        self.refresh_views(force=True)

    async def _follow(self, feed: Feed) -> None:
        """Fold one feed's updates into the state (the worker; it never touches a widget)."""
        state = self.state
        try:
            async for update in feed.updates():
                if update.reset:
                    state.reset()
                if update.connection is not None:
                    state.set_connection(update.source, update.connection, update.detail)
                if update.events:
                    state.apply(update.events, update.source)
        except Exception as exc:  # a broken feed must not take the console down: show it as offline
            state.set_connection(feed.source, Connection.OFFLINE, str(exc) or type(exc).__name__)

    async def on_unmount(self) -> None:
        """Stop the feeds and let them close their connections before the loop ends (not at its shutdown)."""
        workers = self.workers.cancel_group(self, "feeds")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.workers.wait_for_complete(workers), FEED_CLOSE_TIMEOUT_S)

    def _exit_after(self) -> None:
        self.exit(0)

    # -- drawing ------------------------------------------------------------------------------------------------
    def refresh_views(self, force: bool = False) -> None:
        """Hand the state to the active screen if it changed since that screen last drew it (the refresh timer;
        also right after a mode switch)."""
        state = self.state
        if self.clock is not None and any(s.connection != Connection.REPLAY for s in state.sources.values()):
            state.tick(self.clock())
        elif self.playback is not None and (position := self.playback.position()) is not None:
            state.tick(position)  # a replay's time is its cursor's: rates fall to zero in a quiet stretch
        try:
            screen = self.screen
        except ScreenStackError:  # the app is closing: its screens are gone before its timers
            return
        if not isinstance(screen, StateScreen) or not screen.is_mounted:
            return
        if force or screen.shown_version != state.version:
            try:
                screen.show_state(state)
            except NoMatches:  # its widgets are still being mounted: draw it at the next refresh
                return
            screen.shown_version = state.version
            self.sub_title = self.describe_sources()
            self.num_refreshes += 1

    def describe_sources(self) -> str:
        """The header's subtitle: the mode, read-only, the node count, the replay cursor, each source's connection
        (in that order, so that what matters most still shows when an 80-column header cuts the end)."""
        parts = [MODE_TITLES.get(self.current_mode, self.current_mode)]
        if self.read_only:
            parts.append("READ-ONLY")
        parts.append(f"{len(self.state.nodes)} node{'s' if len(self.state.nodes) != 1 else ''}")
        if self.playback is not None and (cursor := describe(self.playback)):
            parts.append(cursor)
        for info in self.state.sources.values():
            parts.append(f"{info.source} {info.connection.value}")
        return " · ".join(parts)

    # -- actions --------------------------------------------------------------------------------------------------
    async def action_show_mode(self, mode: str) -> None:
        """Switch to the screen of ``mode`` (a screen's name in :data:`~console.screens.registry.SCREENS`)."""
        if mode != self.current_mode:
            await self.switch_mode(mode)
        self.refresh_views(force=True)
        self.refresh_bindings()

    def action_leave_input(self) -> None:
        """Leave the editor or input that has the focus, so the screen keys work again
        (:mod:`console.screens.focus`)."""
        leave_input(self.screen)

    def action_help(self) -> None:
        """Open the help screen with the keys of the current screen."""
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(key_help(self.screen), read_only=self.read_only))

    # -- the replay cursor (keys: console.replay_keys) ----------------------------------------------------------
    def action_replay_toggle(self) -> None:
        """Play the replay from its cursor, or pause it."""
        if self.playback is not None:
            self.playback.toggle()
            self.sub_title = self.describe_sources()

    def action_replay_seek(self, seconds: float) -> None:
        """Move the replay's cursor ``seconds`` (negative: back; the feed rebuilds the state)."""
        if self.playback is not None:
            self.playback.seek(seconds)
            self.sub_title = self.describe_sources()

    def action_replay_jump(self, where: Where) -> None:
        """The replay's cursor to the start or the end of the file."""
        if self.playback is not None:
            self.playback.jump(where)
            self.sub_title = self.describe_sources()

    def action_replay_speed(self, factor: float) -> None:
        """Multiply the replay's speed by ``factor``."""
        if self.playback is not None:
            self.playback.change_speed(factor)
            self.sub_title = self.describe_sources()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A mode's key is greyed out on that mode's own screen; the replay's keys are hidden when live; ``escape``
        (leave the editor) is shown only while an editor or input has the focus."""
        if action == "show_mode" and parameters and parameters[0] == self.current_mode:
            return None
        if action.startswith("replay_"):
            return self.playback is not None
        if action == "leave_input":
            return takes_text(self.focused)
        return True

    async def on_overview_screen_unit_chosen(self, message: OverviewScreen.UnitChosen) -> None:
        """The Overview's unit (or a node's first unit) on the heatmap, Steps or Slack screen."""
        await self.action_show_mode(message.mode)
        screen = self.screen
        if isinstance(screen, HeatmapScreen):
            screen.select_unit(message.node_id, message.unit_id)
            return
        node = self.state.nodes.get(message.node_id)
        unit_id = message.unit_id
        if unit_id is None and node is not None and node.units:
            unit_id = min(node.units)
        if unit_id is not None and isinstance(screen, StepsScreen | SlackScreen):
            screen.select_unit(message.node_id, unit_id)

    async def on_what_if_screen_apply_requested(self, message: WhatIfScreen.ApplyRequested) -> None:
        """The What-if screen's recommendation goes through the Policies screen: dry run, confirm, apply."""
        await self.action_show_mode("policies")
        screen = self.screen
        if isinstance(screen, PoliciesScreen):
            screen.propose(message.change)

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        """The command palette: the app's own commands, then the console's actions (the same methods as keys)."""
        yield from super().get_system_commands(screen)
        for spec in SCREENS:
            yield SystemCommand(
                spec.title, f"{spec.tooltip} (key {spec.key})", partial(self.action_show_mode, spec.name)
            )
        yield SystemCommand("Help", "List the keys of this screen, with their ids (key ?)", self.action_help)
        if self.playback is not None:
            yield from replay_commands(self)
        if isinstance(screen, StateScreen):
            yield from screen.system_commands()
