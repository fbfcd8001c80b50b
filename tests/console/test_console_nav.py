"""From the Overview to a unit's Steps or Slack screen (keys and palette), and the console's themes (``--theme``,
the palette's Theme list)."""

from __future__ import annotations

from pathlib import Path

import pytest
from console_fixtures import build_store
from console_pilot import until
from serve_harness import run
from textual.color import Color
from textual.command import CommandPalette
from textual.pilot import Pilot
from textual.theme import ThemeProvider
from textual.widgets import Input

from agent.telemetry import NodeHello, ParamSchema, PolicySchema, UnitStatus
from console.app import ConsoleApp
from console.cli import build_parser, main
from console.feeds import ReplayFeed
from console.model.state import ConsoleState
from console.screens.confirm import PromptScreen
from console.screens.help import HelpScreen
from console.screens.overview import OverviewScreen
from console.screens.policy_edit import PolicyEditScreen
from console.screens.slack import SlackScreen
from console.screens.steps import StepsScreen
from console.themes import THEMES, theme_names
from console.widgets import FleetTable


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("nav") / "two-nodes.duckdb")


async def replayed(pilot: Pilot[int]) -> None:
    app = pilot.app
    assert isinstance(app, ConsoleApp)
    await until(pilot, lambda: any(s.detail == "end of file" for s in app.state.sources.values()), "the replay")
    app.refresh_views(force=True)
    await pilot.pause()


def selected_key(app: ConsoleApp) -> str | None:
    row = app.screen.query_one(FleetTable).selected_row
    return None if row is None else row.key


# -- Overview -> Steps / Slack ---------------------------------------------------------------------------------------
def test_t_and_s_open_the_selected_unit_on_steps_and_slack(store: Path) -> None:
    async def go() -> None:
        app = ConsoleApp([ReplayFeed(store)], clock=None)
        async with app.run_test(size=(100, 30)) as pilot:
            await replayed(pilot)
            await pilot.press("down", "down", "down")  # node-a, u0, u1, u2
            assert selected_key(app) == "unit:node-a:2"
            await pilot.press("t")
            await pilot.pause()
            assert app.current_mode == "steps" and isinstance(app.screen, StepsScreen)
            assert app.screen.unit == ("node-a", 2) and app.screen.cursor_ns is None
            assert "node-a u2" in str(app.screen.query_one("#steps-title").render())
            await pilot.press("1")
            assert selected_key(app) == "unit:node-a:2", "the Overview kept its row"
            await pilot.press("down", "down")  # u3, node-b (a node row: its first unit)
            assert selected_key(app) == "node:node-b"
            await pilot.press("s")
            await pilot.pause()
            assert app.current_mode == "slack" and isinstance(app.screen, SlackScreen)
            assert app.screen.unit == ("node-b", 0)
            await pilot.press("1", "down", "t")  # node-b u0 on Steps, the screen already made
            await pilot.pause()
            assert isinstance(app.screen, StepsScreen) and app.screen.unit == ("node-b", 0)

    run(go, timeout_s=60)


def test_the_jumps_are_in_the_palette_and_the_help_and_remappable(store: Path) -> None:
    async def go() -> None:
        app = ConsoleApp([ReplayFeed(store)], clock=None, keymap={"overview.open_slack": "x"})
        async with app.run_test(size=(100, 30)) as pilot:
            await replayed(pilot)
            await pilot.press("down", "down")
            commands = {c.title: c for c in app.get_system_commands(app.screen)}
            assert {f"Overview: node-a u1 on {name}" for name in ("Heatmap", "Steps", "Slack")} <= set(commands)
            commands["Overview: node-a u1 on Steps"].callback()
            await pilot.pause()
            assert isinstance(app.screen, StepsScreen) and app.screen.unit == ("node-a", 1)
            await pilot.press("1")
            await pilot.press("s")  # remapped away: nothing
            await pilot.pause()
            assert isinstance(app.screen, OverviewScreen)
            await pilot.press("x")
            await pilot.pause()
            assert isinstance(app.screen, SlackScreen) and app.screen.unit == ("node-a", 1)
            await pilot.press("1", "question_mark")
            assert isinstance(app.screen, HelpScreen)
            ids = {k.binding_id: k for k in app.screen.keys}
            assert {"overview.open_unit", "overview.open_steps", "overview.open_slack"} <= set(ids)
            assert ids["overview.open_slack"].key == "x" and ids["overview.open_steps"].tooltip

    run(go, timeout_s=60)


def test_the_jumps_are_greyed_out_without_a_row() -> None:
    async def go() -> None:
        app = ConsoleApp([], clock=None)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            assert screen.check_action("open_unit", ("steps",)) is None
            assert not [c for c in app.get_system_commands(screen) if c.title.startswith("Overview:")]
            await pilot.press("t", "s")
            assert app.current_mode == "overview"

    run(go, timeout_s=30)


# -- inputs never trap ------------------------------------------------------------------------------------------------
def test_escape_closes_the_dialogs_from_their_inputs() -> None:
    """The policy edit form's parameter inputs and the export prompt: keys type into the input (no screen key fires
    under a modal), escape closes the dialog with nothing sent; the console's own escape is not offered there."""
    state = ConsoleState()
    sarathi = PolicySchema(name="sarathi", params=(ParamSchema(name="tbt_target_ms", type="float", default=50.0),))
    units = (UnitStatus(unit_id=0, batch_policy="sarathi", batch_params={"tbt_target_ms": 50.0}),)
    hello = NodeHello(
        node_id="n", time_ns=1, boot_ns=1, profile="p", units=units, dispatch_policy="x", batch_policies=(sarathi,)
    )
    state.apply([hello])
    node = state.nodes["n"]

    async def go() -> None:
        app = ConsoleApp([], clock=None)
        answers: list[object] = []
        async with app.run_test(size=(80, 24)) as pilot:
            app.push_screen(PolicyEditScreen(node, 0), answers.append)
            await until(pilot, lambda: isinstance(app.screen, PolicyEditScreen) and bool(app.screen.inputs), "form")
            form = app.screen
            assert isinstance(form, PolicyEditScreen)
            for _ in range(4):  # from the policy chooser to the parameter's input, as an operator would
                if isinstance(app.focused, Input):
                    break
                await pilot.press("tab")
            field = form.inputs["tbt_target_ms"]
            assert app.focused is field
            await pilot.press("end", "2", "q")
            assert field.value == "50.02q" and app.current_mode == "overview" and app.screen is form
            assert "console.leave_input" not in {a.binding.id for a in form.active_bindings.values()}
            await pilot.press("escape")
            assert answers == [None] and app.screen is not form
            app.push_screen(PromptScreen("Export to", value="out.csv"), answers.append)
            await pilot.pause()
            assert isinstance(app.screen, PromptScreen) and isinstance(app.focused, Input)
            await pilot.press("1", "escape")
            assert answers == [None, None] and isinstance(app.screen, OverviewScreen)

    run(go, timeout_s=30)


# -- themes ----------------------------------------------------------------------------------------------------------
def test_the_themes_define_colours_by_name_not_hex() -> None:
    assert [t.name for t in THEMES] == ["trackside-dark", "trackside-light"]
    for theme in THEMES:
        for field in ("primary", "secondary", "accent", "warning", "error", "success", "foreground", "background"):
            value = getattr(theme, field)
            assert value and not value.startswith("#"), (theme.name, field, value)
    tcss = (Path(__file__).resolve().parents[2] / "console" / "console.tcss").read_text()
    values = [line.split(":", 1)[1] for line in tcss.splitlines() if ":" in line and line.strip().endswith(";")]
    assert values and not [v for v in values if "#" in v], "the stylesheet uses theme variables, no hex colours"
    assert {"trackside-dark", "trackside-light", "textual-dark", "textual-light"} <= set(theme_names())


def test_a_theme_is_chosen_at_start_and_listed_in_the_palette(store: Path) -> None:
    async def go() -> None:
        app = ConsoleApp([ReplayFeed(store)], clock=None, theme="trackside-light")
        async with app.run_test(size=(100, 30)) as pilot:
            await replayed(pilot)
            assert app.theme == "trackside-light" and not app.current_theme.dark
            assert app.screen.styles.background == Color.parse("whitesmoke"), "the theme's colours are in use"
            assert {"trackside-dark", "trackside-light"} <= set(app.available_themes)
            assert "Theme" in {c.title for c in app.get_system_commands(app.screen)}
            app.action_change_theme()  # the palette's Theme entry
            await pilot.pause()
            assert isinstance(app.screen, CommandPalette)
            names = dict(ThemeProvider(app.screen).commands)
            assert {"trackside-dark", "trackside-light", "textual-dark"} <= set(names)
            names["trackside-dark"]()
            await pilot.press("escape")
            assert app.theme == "trackside-dark" and app.current_theme.dark

    run(go, timeout_s=60)


def test_theme_on_the_command_line(store: Path) -> None:
    parser = build_parser()
    assert parser.parse_args(["console", "ws://a:1", "--theme", "trackside-dark"]).theme == "trackside-dark"
    assert parser.parse_args(["demo"]).theme is None
    with pytest.raises(SystemExit):
        parser.parse_args(["console", "ws://a:1", "--theme", "no-such-theme"])
    argv = ["console", "--replay", str(store), "--theme", "trackside-light", "--exit-after", "0.3", "--headless"]
    assert main(argv) == 0
