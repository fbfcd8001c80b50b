"""Snapshot tests: every screen at 120x36 and at 80x24, driven with Pilot from a replayed store, compared with the
files in ``tests/snapshots/`` (the arrangement: ``tests/console_snapshot.py`` and docs/console.md, "Snapshot
tests"). Then the layout at 80 and 200 columns: every footer key readable at 80, the wide screens use the width.

Rewrite the files after an intended change (and read the diff before committing it):

    TRACKSIDE_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/test_console_snapshots.py

Deterministic by construction: the store's events are simulated with node time 0 at a fixed instant
(``console_fixtures.SNAPSHOT_ORIGIN_NS``); a replay never reads the clock (``clock=None``: "x s ago" is against the
newest event); the file is named relative to the working directory (the header and the SQL screen show the name);
the time zone is UTC (clock times are local) and the theme is fixed; the SQL editor's cursor does not blink; a
query's time is the one thing measured on the wall clock, and the test replaces it with a fixed one through the
screen's own message.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Final

import pytest
from console_fixtures import build_snapshot_store
from console_pilot import text_of, until
from console_snapshot import Picture, compare, picture_of_svg
from serve_harness import run
from textual.pilot import Pilot
from textual.widgets import Static, TextArea

from console.app import MODE_TITLES, ConsoleApp
from console.feeds import ReplayFeed
from console.screens.help import HelpScreen
from console.screens.sql import SqlScreen
from console.screens.whatif import WhatIfScreen
from console.sql import ReplayDatabase
from console.widgets import HeatmapView

STORE: Final = Path("snapshot.duckdb")
"""Relative to the store's folder (the test's working directory): the header names it the same on every run."""
THEME: Final = "textual-dark"
WIDE: Final = (120, 36)
SMALL: Final = (80, 24)
QUERY_TIME_S: Final = 0.0123
"""What the SQL screen says its query took (the real time varies)."""
MAX_SETTLE_TRIES: Final = 100
WHATIF_FAKE: Final = Path(__file__).resolve().parents[1] / "whatif_fake.py"
"""The What-if screen's stand-in child (fixed numbers, the real command's arguments and output)."""

Drive = Callable[[Pilot[int]], Awaitable[None]]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("console-snapshots")
    build_snapshot_store(folder / STORE)
    return folder


@pytest.fixture
def store(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The store, by its relative name, with the working directory in its folder, in UTC (clock times are local)."""
    monkeypatch.chdir(store_dir)
    monkeypatch.delenv("NO_COLOR", raising=False)  # the styles are part of the snapshot
    zone = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    try:
        yield STORE
    finally:
        if zone is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = zone
        time.tzset()


async def replayed(pilot: Pilot[int]) -> None:
    """Wait until the replay has been read whole and the active screen has drawn it."""
    app = pilot.app
    assert isinstance(app, ConsoleApp)
    await until(pilot, lambda: any(s.detail == "end of file" for s in app.state.sources.values()), "the replay")
    app.refresh_views(force=True)
    await pilot.pause()


async def settled_screenshot(pilot: Pilot[int]) -> str:
    """The screen's SVG once it has stopped changing (two screenshots in a row the same, animations done)."""
    app = pilot.app
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()
    before = app.export_screenshot()
    for _ in range(MAX_SETTLE_TRIES):
        await pilot.pause(0.02)
        now = app.export_screenshot()
        if now == before:
            return now
        before = now
    raise AssertionError("the screen kept changing")


def screenshot(store: Path, key: str, size: tuple[int, int], drive: Drive | None = None) -> str:
    """The console on the replayed ``store``, switched to a screen by its ``key``, then ``drive``\\ n; its SVG."""

    async def go() -> str:
        database = ReplayDatabase(store)
        try:
            app = ConsoleApp([ReplayFeed(store)], clock=None, database=database)
            async with app.run_test(size=size) as pilot:
                app.theme = THEME
                await replayed(pilot)
                await pilot.press(key)
                if drive is not None:
                    await drive(pilot)
                return await settled_screenshot(pilot)
        finally:
            database.close()

    return run(go, timeout_s=90)


def check(store: Path, tmp_path: Path, name: str, size: tuple[int, int]) -> Picture:
    """The screen ``name`` (a key of :data:`SCREENS`) at ``size``, against its snapshot file."""
    key, drive = SCREENS[name]
    svg = screenshot(store, key, size, drive)
    picture = picture_of_svg(svg, *size)
    compare(picture, f"{name}-{size[0]}x{size[1]}", svg=svg, failures=tmp_path / "snapshots")
    return picture


# -- what each screen is driven to -----------------------------------------------------------------------------------
async def select_second_unit(pilot: Pilot[int]) -> None:
    await pilot.press("down", "down")


async def heatmap_cursor_back(pilot: Pilot[int]) -> None:
    """The cursor three buckets back on node-a u1 (the cell panel shows that cell), batch size."""
    await pilot.press("b", "down", "left", "left", "left")
    view = pilot.app.screen.query_one(HeatmapView)
    assert view.cursor_unit == ("node-a", 1) and view.cursor_bucket is not None


async def steps_cursor_back(pilot: Pilot[int]) -> None:
    await pilot.press(*["left"] * 6)


async def slack_second_request(pilot: Pilot[int]) -> None:
    await pilot.press("down")


async def sql_starter_query(pilot: Pilot[int]) -> None:
    """Run the starter query; its time replaced by :data:`QUERY_TIME_S` (through the screen's own message)."""
    screen = pilot.app.screen
    assert isinstance(screen, SqlScreen)
    editor = screen.query_one(TextArea)
    editor.cursor_blink = False
    editor.notify_style_update()  # forget lines drawn in a blink's off phase (TextArea caches them by a key without it)
    await pilot.press("ctrl+j")
    await until(pilot, lambda: screen.last_result is not None and not screen.running, "the query")
    assert screen.last_result is not None
    screen.post_message(SqlScreen.QueryFinished(dataclasses.replace(screen.last_result, elapsed_s=QUERY_TIME_S)))
    await until(pilot, lambda: "12.3 ms" in text_of(screen.query_one("#sql-status", Static)), "the fixed time")


async def whatif_result(pilot: Pilot[int]) -> None:
    """A what-if of node-a's last 10 minutes (the whole file) run to its end, by the stand-in child."""
    app = pilot.app
    assert isinstance(app, ConsoleApp)
    app.whatif_command = (sys.executable, str(WHATIF_FAKE), "switch")
    screen = app.screen
    assert isinstance(screen, WhatIfScreen)
    await pilot.press("r")
    await until(pilot, lambda: screen.job is None and screen.result is not None, "the what-if")


SCREENS: Final[dict[str, tuple[str, Drive | None]]] = {
    "overview": ("1", select_second_unit),
    "heatmap": ("2", heatmap_cursor_back),
    "steps": ("3", steps_cursor_back),
    "slack": ("4", slack_second_request),
    "stages": ("5", None),
    "policies": ("6", select_second_unit),
    "whatif": ("8", whatif_result),
    "sql": ("7", sql_starter_query),
}
"""Each screen: its key and what is done on it before the screenshot (SQL last: its editor takes the keys after it)."""


# -- one class per screen --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [WIDE, SMALL], ids=["120x36", "80x24"])
class TestOverview:
    def test_nodes_units_and_alerts(self, store: Path, tmp_path: Path, size: tuple[int, int]) -> None:
        picture = check(store, tmp_path, "overview", size)
        assert "node-c" in "\n".join(picture.text) and "slo_breach" in "\n".join(picture.text)


@pytest.mark.parametrize("size", [WIDE, SMALL], ids=["120x36", "80x24"])
class TestHeatmap:
    def test_batch_size_with_the_cursor_back(self, store: Path, tmp_path: Path, size: tuple[int, int]) -> None:
        picture = check(store, tmp_path, "heatmap", size)
        assert "node-a u1" in "\n".join(picture.text)


@pytest.mark.parametrize("size", [WIDE, SMALL], ids=["120x36", "80x24"])
class TestSteps:
    def test_timeline_and_the_cursor_step(self, store: Path, tmp_path: Path, size: tuple[int, int]) -> None:
        picture = check(store, tmp_path, "steps", size)
        assert "budget_tokens" in "\n".join(picture.text)


@pytest.mark.parametrize("size", [WIDE, SMALL], ids=["120x36", "80x24"])
class TestSlack:
    def test_distribution_nearest_and_envelope(self, store: Path, tmp_path: Path, size: tuple[int, int]) -> None:
        picture = check(store, tmp_path, "slack", size)
        assert "node-c u0" in "\n".join(picture.text)


@pytest.mark.parametrize("size", [WIDE, SMALL], ids=["120x36", "80x24"])
class TestStages:
    def test_lengths_boundaries_loads_migrations(self, store: Path, tmp_path: Path, size: tuple[int, int]) -> None:
        picture = check(store, tmp_path, "stages", size)
        assert "cascade" in "\n".join(picture.text)


@pytest.mark.parametrize("size", [WIDE, SMALL], ids=["120x36", "80x24"])
class TestPolicies:
    def test_targets_parameters_and_audit_log(self, store: Path, tmp_path: Path, size: tuple[int, int]) -> None:
        picture = check(store, tmp_path, "policies", size)
        assert "control off" in "\n".join(picture.text)


@pytest.mark.parametrize("size", [WIDE, SMALL], ids=["120x36", "80x24"])
class TestSql:
    def test_the_starter_query(self, store: Path, tmp_path: Path, size: tuple[int, int]) -> None:
        picture = check(store, tmp_path, "sql", size)
        assert "mean_step_ms" in "\n".join(picture.text)


class TestWhatIf:
    def test_a_finished_what_if(self, store: Path, tmp_path: Path) -> None:
        picture = check(store, tmp_path, "whatif", WIDE)
        text = "\n".join(picture.text)
        assert "sarathi" in text and "+12.0%" in text and "recommendation: switch to sarathi" in text


# -- layout at 80 and 200 columns ------------------------------------------------------------------------------------
def footer_items(app: ConsoleApp) -> list[str]:
    """What the footer should read for the active screen: each shown action's first key with its description (a
    group's keys run together, then its description)."""
    items: list[str] = []
    actions: set[str] = set()
    for active in app.screen.active_bindings.values():
        binding = active.binding
        if not binding.show or binding.action in actions:
            continue
        actions.add(binding.action)
        if binding.group is not None:
            if binding.group.description not in items:
                items.append(binding.group.description)
        else:
            items.append(f"{app.get_key_display(binding)} {binding.description}")
    return items


def tour(store: Path, size: tuple[int, int]) -> dict[str, tuple[Picture, list[str]]]:
    """Every screen in one console at ``size``: its picture and what its footer should read."""

    async def go() -> dict[str, tuple[Picture, list[str]]]:
        seen = {}
        app = ConsoleApp([ReplayFeed(store)], clock=None, database=ReplayDatabase(store))
        async with app.run_test(size=size) as pilot:
            app.theme = THEME
            await replayed(pilot)
            for name, (key, _) in SCREENS.items():
                await pilot.press(key)
                svg = await settled_screenshot(pilot)
                seen[name] = (picture_of_svg(svg, *size), footer_items(app))
        return seen

    return run(go, timeout_s=90)


def test_every_footer_key_is_readable_at_80_columns(store: Path) -> None:
    for name, (picture, items) in tour(store, SMALL).items():
        footer = picture.text[-1]
        assert footer.endswith("^p palette"), (name, footer)
        for item in items:
            assert item in footer, f"{name}: {item!r} is cut from the footer {footer!r}"
        if name != "sql":  # the SQL editor has the focus and takes the single keys: they are not offered
            assert {"screens", "? Help", "q Quit"} <= set(items), (name, items)
        assert f"trackside — {MODE_TITLES[name]}" in picture.text[0], picture.text[0]


def test_screens_use_the_width_at_200_columns(store: Path) -> None:
    seen = tour(store, (200, 60))
    overview = "\n".join(seen["overview"][0].text)
    assert "TPOT p50/p99" in overview and "TTFT p99 trend" in overview, "every column of the fleet table shows"
    heatmap = seen["heatmap"][0]
    axis = next(line for line in heatmap.text if line.startswith("1s/col"))
    ticks = axis.split()[1:]
    assert len(ticks) >= 15 and len(ticks) == len(set(ticks)), f"a tick every 10 columns, no two alike: {axis}"
    for name, (picture, items) in seen.items():
        footer = picture.text[-1]
        assert all(item in footer for item in items), (name, footer)


def test_keys_left_out_of_the_footer_are_in_the_help_screen(store: Path) -> None:
    async def go() -> None:
        app = ConsoleApp([ReplayFeed(store)], clock=None)
        async with app.run_test(size=SMALL) as pilot:
            await replayed(pilot)
            await pilot.press("6", "question_mark")
            assert isinstance(app.screen, HelpScreen)
            ids = {k.binding_id for k in app.screen.keys}
            assert {"policies.pause", "policies.drain", "policies.resume"} <= ids
            assert {f"console.{mode}" for mode in MODE_TITLES} <= ids, "each screen key, by its own id"

    run(go, timeout_s=60)
