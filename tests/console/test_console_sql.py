"""The SQL screen on the replay fixture: a query's rows, errors shown plainly, export to CSV and Parquet, the
history, what is greyed out; then the plain side (row cap, history walk, cells)."""

from __future__ import annotations

import csv
from pathlib import Path

import duckdb
import pytest
from console_fixtures import build_store
from console_pilot import text_of, until
from serve_harness import run
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Static, TextArea

from console.app import ConsoleApp
from console.cli import main
from console.feeds import ReplayFeed
from console.screens.confirm import PromptScreen
from console.screens.help import HelpScreen
from console.screens.sql import SqlScreen
from console.sql import ReplayDatabase, SqlHistory, cell_text, export_query, run_query
from store.queries import StoreQueryError

PER_UNIT = "SELECT node_id, unit_id, count(*) AS steps FROM steps GROUP BY ALL ORDER BY node_id, unit_id"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("console-sql") / "two-nodes.duckdb")


def expected(store: Path, query: str) -> list[tuple[object, ...]]:
    con = duckdb.connect(str(store), read_only=True)
    try:
        return con.execute(query).fetchall()
    finally:
        con.close()


async def sql_screen(pilot: Pilot[int]) -> SqlScreen:
    await pilot.press("7")
    screen = pilot.app.screen
    assert isinstance(screen, SqlScreen)
    return screen


async def run_text(pilot: Pilot[int], screen: SqlScreen, text: str, key: str = "ctrl+j") -> None:
    """Type ``text`` into the editor (replacing it), run it with ``key``, wait for the answer."""
    screen.query_one(TextArea).load_text(text)
    before = (screen.last_result, screen.last_error)
    await pilot.press(key)
    await until(pilot, lambda: not screen.running and (screen.last_result, screen.last_error) != before, "the query")


def status(screen: SqlScreen) -> str:
    return text_of(screen.query_one("#sql-status", Static))


def test_a_query_on_the_replay_shows_its_rows(store: Path) -> None:
    async def go() -> None:
        database = ReplayDatabase(store)
        app = ConsoleApp([ReplayFeed(store)], clock=None, database=database)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = await sql_screen(pilot)
            assert f"replay of {store}" in text_of(screen.query_one("#sql-source", Static))
            assert screen.check_action("export", ()) is None, "nothing to export before a query"
            await run_text(pilot, screen, PER_UNIT)
            result = screen.last_result
            assert result is not None, status(screen)
            assert result.columns == ("node_id", "unit_id", "steps")
            rows = expected(store, PER_UNIT)
            assert list(result.rows) == rows and len(rows) == 6
            table = screen.query_one("#sql-results", DataTable)
            assert table.row_count == 6 and [str(c.label) for c in table.columns.values()] == list(result.columns)
            assert table.get_row_at(0) == ["node-a", "0", str(rows[0][2])]
            assert status(screen).startswith("6 rows, 3 columns in ") and status(screen).endswith(" ms")
            assert screen.check_action("export", ()) is True
            assert {"SQL: run", "SQL: export"} <= {c.title for c in app.get_system_commands(screen)}
        database.close()

    run(go, timeout_s=60)


def test_a_bad_query_shows_the_error_and_keeps_the_last_rows(store: Path) -> None:
    async def go() -> None:
        database = ReplayDatabase(store)
        app = ConsoleApp([ReplayFeed(store)], clock=None, database=database)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = await sql_screen(pilot)
            await run_text(pilot, screen, "SELECT count(*) AS n FROM steps", key="f5")
            assert screen.last_result is not None
            assert screen.last_result.rows == tuple(expected(store, "SELECT count(*) AS n FROM steps"))
            await run_text(pilot, screen, "SELEC node_id FROM steps")
            assert (
                status(screen)
                == 'error: Parser Error: syntax error at or near "SELEC" (LINE 1: SELEC node_id FROM steps)'
            )
            assert screen.query_one("#sql-status").has_class("-error")
            assert screen.query_one("#sql-results", DataTable).row_count == 1, "the last good result stays"
            await run_text(pilot, screen, "SELECT nope FROM steps")
            assert 'Referenced column "nope" not found' in status(screen)
            await run_text(pilot, screen, "DELETE FROM steps")
            assert status(screen) == "error: only read-only queries (SELECT, EXPLAIN) are allowed, not DELETE"
            assert expected(store, "SELECT count(*) FROM steps")[0][0] > 0, "nothing was deleted"
        database.close()

    run(go, timeout_s=60)


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_export_writes_the_last_querys_rows(store: Path, tmp_path: Path, suffix: str) -> None:
    target = tmp_path / "out" / f"per-unit.{suffix}"

    async def go() -> None:
        database = ReplayDatabase(store)
        app = ConsoleApp([ReplayFeed(store)], clock=None, database=database)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = await sql_screen(pilot)
            await run_text(pilot, screen, PER_UNIT + ";")
            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, PromptScreen), "the path prompt")
            app.screen.query_one(Input).value = str(target)
            await pilot.press("enter")
            await until(pilot, lambda: screen.last_export is not None or "failed" in status(screen), "the export")
            assert screen.last_export is not None and screen.last_export.num_rows == 6
            assert status(screen).startswith(f"exported 6 rows to {target}")
        database.close()

    run(go, timeout_s=60)
    rows = expected(store, PER_UNIT)
    if suffix == "csv":
        with target.open() as f:
            lines = list(csv.reader(f))
        assert lines[0] == ["node_id", "unit_id", "steps"]
        assert [(n, int(u), int(s)) for n, u, s in lines[1:]] == rows
    else:
        con = duckdb.connect()
        assert con.execute(f"SELECT * FROM read_parquet('{target}')").fetchall() == rows


def test_history_walks_back_and_forth(store: Path) -> None:
    async def go() -> None:
        database = ReplayDatabase(store)
        app = ConsoleApp([ReplayFeed(store)], clock=None, database=database)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = await sql_screen(pilot)
            editor = screen.query_one(TextArea)
            await run_text(pilot, screen, "SELECT 1 AS one")
            await run_text(pilot, screen, "SELECT 2 AS two")
            editor.load_text("SELECT 3 -- draft")
            await pilot.press("ctrl+up")
            assert editor.text == "SELECT 2 AS two"
            await pilot.press("ctrl+up", "ctrl+up")
            assert editor.text == "SELECT 1 AS one", "stops at the oldest"
            await pilot.press("ctrl+down", "ctrl+down")
            assert editor.text == "SELECT 3 -- draft", "past the newest: the draft back"
        database.close()

    run(go, timeout_s=60)


def footer_keys(app: ConsoleApp) -> list[str]:
    """What the footer offers, ``key description`` per binding (a group by its description; the snapshot tests check
    that the footer shows them)."""
    shown = [active.binding for active in app.screen.active_bindings.values() if active.binding.show]
    return [b.group.description if b.group else f"{app.get_key_display(b)} {b.description}" for b in shown]


def test_escape_leaves_the_editor_and_the_footer_says_so() -> None:
    async def go() -> None:
        app = ConsoleApp([], clock=None)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = await sql_screen(pilot)
            editor = screen.query_one(TextArea)
            assert app.focused is editor, "the editor has the focus on arrival"
            await until(pilot, lambda: "esc Leave editor" in footer_keys(app), "the footer's way out")
            assert "q Quit" not in footer_keys(app), "the editor takes q: not offered"
            await pilot.press("1")  # typed: the editor keeps its keys while it has the focus
            assert app.current_mode == "sql" and editor.text.startswith("1SELECT")
            await pilot.press("escape")
            assert app.focused is screen.query_one("#sql-results", DataTable) and editor.text.startswith("1SELECT")
            await until(pilot, lambda: "q Quit" in footer_keys(app), "the single keys back in the footer")
            assert "esc Leave editor" not in footer_keys(app) and "screens" in footer_keys(app)
            await pilot.press("escape")  # nothing left to leave: nothing happens
            assert app.current_mode == "sql"
            await pilot.press("2")
            assert app.current_mode == "heatmap", "a screen key works once the editor is left"
            await pilot.press("7", "1")
            assert app.current_mode == "overview", "back on SQL the focus is still out of the editor"
            await pilot.press("7", "tab")
            assert app.focused is editor, "tab goes back in"

    run(go, timeout_s=60)


def test_the_way_out_is_in_the_help_and_remappable() -> None:
    async def go() -> None:
        app = ConsoleApp([], clock=None, keymap={"console.leave_input": "ctrl+g"})
        async with app.run_test(size=(80, 24)) as pilot:
            screen = await sql_screen(pilot)
            editor = screen.query_one(TextArea)
            await pilot.press("f1")  # ? types into the editor; f1 opens the help
            assert isinstance(app.screen, HelpScreen)
            keys = {k.binding_id: k for k in app.screen.keys}
            assert keys["console.leave_input"].key == "^g" and keys["console.leave_input"].tooltip
            await pilot.press("escape")
            assert app.screen is screen and app.focused is editor
            await pilot.press("escape")
            assert app.focused is editor, "remapped away"
            await pilot.press("ctrl+g")
            assert app.focused is not editor
            await pilot.press("f1")
            assert isinstance(app.screen, HelpScreen)
            assert "console.leave_input" not in {k.binding_id for k in app.screen.keys}, "only while in an editor"

    run(go, timeout_s=60)


def test_without_a_database_run_is_greyed_out() -> None:
    async def go() -> None:
        app = ConsoleApp([], clock=None)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = await sql_screen(pilot)
            assert "no database" in text_of(screen.query_one("#sql-source", Static))
            assert screen.check_action("run_query", ()) is None and screen.check_action("export", ()) is None
            await pilot.press("f5")
            assert not screen.running and screen.last_result is None

    run(go, timeout_s=30)


def test_db_is_for_live_consoles(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["console", "--replay", str(store), "--db", "x.duckdb"]) == 2
    assert "--db records a live console" in capsys.readouterr().err


# -- the plain side --------------------------------------------------------------------------------------------------
def test_run_query_caps_the_rows_it_converts_and_counts_the_rest() -> None:
    con = duckdb.connect()
    ticks = iter([1.0, 1.25])
    result = run_query(
        con, "SELECT range AS i, 'x' AS a, 2 AS a FROM range(2500)", max_rows=1000, clock=lambda: next(ticks)
    )
    assert result.num_rows == 2500 and len(result.rows) == 1000 and result.rows[999] == (999, "x", 2)
    assert result.columns == ("i", "a", "a") and result.elapsed_s == 0.25
    assert result.summary() == "1,000 of 2,500 rows, 3 columns in 250.0 ms"
    with pytest.raises(StoreQueryError, match="expected one SQL statement, got 2"):
        run_query(con, "SELECT 1; SELECT 2")
    with pytest.raises(StoreQueryError, match="type a query first"):
        run_query(con, "  ;  ")


def test_export_needs_a_known_suffix(tmp_path: Path) -> None:
    con = duckdb.connect()
    with pytest.raises(StoreQueryError, match=r"a \.csv or \.parquet file"):
        export_query(con, "SELECT 1", tmp_path / "out.xlsx")
    with pytest.raises(StoreQueryError, match="only read-only"):
        export_query(con, "CREATE TABLE t (x INT)", tmp_path / "out.csv")
    assert not (tmp_path / "out.csv").exists()


def test_history_keeps_each_query_once_newest_last() -> None:
    history = SqlHistory(limit=3)
    for text in ["a", "b", "a", "c", "d"]:
        history.add(text)
    assert history.entries == ["a", "c", "d"]
    assert history.newer() is None, "not walking yet"
    assert [history.older("draft"), history.older(""), history.older(""), history.older("")] == ["d", "c", "a", "a"]
    assert [history.newer(), history.newer(), history.newer()] == ["c", "d", "draft"]


def test_cells() -> None:
    assert [cell_text(None), cell_text(0.1 + 0.2), cell_text("x" * 100, width=5)] == ["NULL", "0.3", "xxxx…"]
