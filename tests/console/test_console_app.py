"""The console app driven with Pilot from a replay fixture, the live feed against a real agent, the command line,
and ``python -m console demo`` as a subprocess."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest
from console_fixtures import build_store
from serve_harness import free_port, make_hub, make_server, run
from textual.binding import Binding
from textual.pilot import Pilot

from agent.telemetry import StepEvent
from console.app import ConsoleApp
from console.cli import main
from console.feeds import FeedUpdate, LiveFeed, ReplayFeed
from console.model.fleet import COLUMNS
from console.model.metrics import HeatMetric
from console.model.records import Connection
from console.screens.heatmap import HeatmapScreen
from console.screens.help import HelpScreen
from console.screens.overview import OverviewScreen
from console.widgets import AlertList, CellPanel, FleetTable, HeatmapView

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("console") / "two-nodes.duckdb")


def replay_app(db: Path, **kwargs: object) -> ConsoleApp:
    return ConsoleApp([ReplayFeed(db)], clock=None, **kwargs)  # type: ignore[arg-type]


async def until(pilot: Pilot[int], predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def replayed(pilot: Pilot[int]) -> None:
    """Wait until the replay has been read whole and the active screen has drawn it."""
    app = pilot.app
    assert isinstance(app, ConsoleApp)
    await until(pilot, lambda: any(s.detail == "end of file" for s in app.state.sources.values()), "the replay")
    app.refresh_views(force=True)
    await pilot.pause()


def text_of(widget: object) -> str:
    return str(getattr(widget, "content", ""))


# -- Overview ------------------------------------------------------------------------------------------------------
def test_overview_lists_nodes_units_policies_and_alerts(store: Path) -> None:
    async def go() -> None:
        app = replay_app(store, read_only=True)
        async with app.run_test(size=(80, 24)) as pilot:
            await replayed(pilot)
            assert isinstance(app.screen, OverviewScreen)
            rows = {r.key: r for r in app.screen.query_one(FleetTable).rows_shown}
            assert list(rows) == [
                "node:node-a",
                *(f"unit:node-a:{u}" for u in range(4)),
                "node:node-b",
                "unit:node-b:0",
                "unit:node-b:1",
            ]
            node_a, unit_a1 = rows["node:node-a"], rows["unit:node-a:1"]
            assert (node_a.cell("state"), node_a.cell("policy")) == ("replay", "least_loaded")
            assert (unit_a1.cell("state"), unit_a1.cell("policy")) == ("running", "sarathi"), "the swap on replay"
            assert rows["unit:node-a:0"].cell("policy") == "vllm" and rows["node:node-b"].cell("policy") == "pab"
            assert rows["unit:node-b:0"].cell("policy") == "fairbatching+pab"
            assert rows["node:node-a"].cell("tok_s") not in ("-", "0"), "throughput over the window"
            assert "%" in rows["node:node-a"].cell("slo") and "/" in rows["node:node-a"].cell("ttft")
            shown = [COLUMNS[i][0] for i in app.screen.query_one(FleetTable).columns_shown]
            assert "gpus" not in shown and node_a.cell("gpus") == "", "simulated units: no GPU column"
            alerts = app.screen.query_one(AlertList)
            assert "slo_breach: unit 2 is missing its TPOT target" in text_of(alerts)
            assert "READ-ONLY" in app.sub_title and "replay" in app.sub_title and "2 nodes" in app.sub_title

    run(go, timeout_s=60)


def test_screens_switch_by_key_and_from_the_command_palette(store: Path) -> None:
    async def go() -> None:
        app = replay_app(store)
        async with app.run_test(size=(80, 24)) as pilot:
            await replayed(pilot)
            assert app.check_action("show_mode", ("overview",)) is None, "the current mode's key is greyed out"
            await pilot.press("2")
            assert app.current_mode == "heatmap" and isinstance(app.screen, HeatmapScreen)
            assert app.screen.query_one(HeatmapView).grid is not None, "drawn at once, not at the next tick"
            assert app.check_action("show_mode", ("heatmap",)) is None and app.check_action("show_mode", ("overview",))
            await pilot.press("1")
            assert app.current_mode == "overview" and isinstance(app.screen, OverviewScreen)
            commands = {c.title: c for c in app.get_system_commands(app.screen)}
            assert {"Overview", "Heatmap", "Help"} <= set(commands)
            await commands["Heatmap"].callback()
            await pilot.pause()
            assert app.current_mode == "heatmap"
            metric_commands = {c.title: c for c in app.get_system_commands(app.screen)}
            metric_commands["Heatmap: step time"].callback()
            await pilot.pause()
            assert isinstance(app.screen, HeatmapScreen) and app.screen.metric == HeatMetric.STEP_TIME

    run(go, timeout_s=60)


def test_enter_on_a_unit_row_opens_the_heatmap_on_that_unit(store: Path) -> None:
    async def go() -> None:
        app = replay_app(store)
        async with app.run_test(size=(80, 24)) as pilot:
            await replayed(pilot)
            await pilot.press("down", "down", "enter")  # node-a, u0, u1
            await pilot.pause()
            assert isinstance(app.screen, HeatmapScreen)
            assert app.screen.query_one(HeatmapView).cursor_unit == ("node-a", 1)

    run(go, timeout_s=60)


# -- Heatmap -------------------------------------------------------------------------------------------------------
def test_heatmap_metric_is_chosen_by_key(store: Path) -> None:
    async def go() -> None:
        app = replay_app(store)
        async with app.run_test(size=(80, 24)) as pilot:
            await replayed(pilot)
            await pilot.press("2")
            screen = app.screen
            assert isinstance(screen, HeatmapScreen)
            view = screen.query_one(HeatmapView)
            assert screen.metric == HeatMetric.KV and view.grid is not None and view.grid.metric == HeatMetric.KV
            for key, metric in [
                ("m", HeatMetric.BATCH),
                ("M", HeatMetric.KV),
                ("M", HeatMetric.STEP_TIME),
                ("w", HeatMetric.QUEUED_PREFILL),
                ("c", HeatMetric.CAPACITY),
                ("b", HeatMetric.BATCH),
                ("s", HeatMetric.STEP_TIME),
                ("p", HeatMetric.PAB),
                ("k", HeatMetric.KV),
            ]:
                await pilot.press(key)
                assert screen.metric == metric, key
                assert view.grid is not None and view.grid.metric == metric
            await pilot.press("p")
            assert view.grid is not None
            pab = {(r.node_id, r.unit_id): any(v is not None for v in r.values) for r in view.grid.rows}
            assert pab[("node-b", 0)] and not pab[("node-a", 0)], "only FairBatching+PAB units have a PAB"
            assert "PAB" in text_of(screen.query_one("#heatmap-title"))

    run(go, timeout_s=60)


def test_heatmap_cursor_moves_and_shows_the_cell_and_policy_markers(store: Path) -> None:
    async def go() -> None:
        app = replay_app(store)
        async with app.run_test(size=(80, 24)) as pilot:
            await replayed(pilot)
            await pilot.press("2")
            view = app.screen.query_one(HeatmapView)
            panel = app.screen.query_one(CellPanel)
            assert view.cursor_unit == ("node-a", 0) and view.cursor_bucket is None
            assert view.check_action("follow", ()) is None, "already following: greyed out"
            newest = app.state.newest_bucket
            await pilot.press("down", "left", "left")
            assert view.cursor_unit == ("node-a", 1) and view.cursor_bucket == newest - 2
            assert "node-a u1" in text_of(panel) and "(-2s)" in text_of(panel)
            await pilot.press("end")
            assert view.cursor_bucket is None
            # the swap of unit 1 is marked on the time axis; the cursor on its bucket lists it
            assert view.grid is not None
            markers = [m for ms in view.grid.markers.values() for m in ms]
            assert [m.text for m in markers] == ["u1 vllm -> sarathi"]
            swap_bucket = markers[0].time_ns // app.state.bucket_ns
            await pilot.press(*["left"] * (newest - swap_bucket))
            assert view.cursor_bucket == swap_bucket
            assert "changed: set_batch_policy u1 vllm -> sarathi" in text_of(panel)
            await pilot.press("down")  # another unit: the marker is unit 1's
            assert "changed:" not in text_of(panel)
            # back to the oldest bucket held: the view scrolls with the cursor
            await pilot.press("home")
            assert view.cursor_bucket == app.state.oldest_bucket
            assert view.last_bucket() == app.state.oldest_bucket + view.num_columns - 1
            await pilot.press(*["down"] * 10)
            assert view.cursor_unit == ("node-b", 1), "clamped at the last unit"

    run(go, timeout_s=60)


def test_heatmap_at_a_small_size_scrolls_rows_to_the_cursor(store: Path) -> None:
    async def go() -> None:
        app = replay_app(store)
        async with app.run_test(size=(60, 14)) as pilot:
            await replayed(pilot)
            await pilot.press("2")
            view = app.screen.query_one(HeatmapView)
            assert view.grid is not None and len(view.grid.rows) == view.num_visible_rows < 6
            await pilot.press(*["down"] * 5)
            assert view.cursor_unit == ("node-b", 1) and view.row_offset > 0
            assert view.grid is not None and view.grid.rows[-1].unit_id == 1 and view.grid.rows[-1].node_id == "node-b"

    run(go, timeout_s=60)


# -- keys ----------------------------------------------------------------------------------------------------------
def test_help_screen_lists_the_keys_with_their_ids(store: Path) -> None:
    async def go() -> None:
        app = replay_app(store)
        async with app.run_test(size=(80, 24)) as pilot:
            await replayed(pilot)
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            ids = {k.binding_id for k in app.screen.keys}
            assert {"console.overview", "console.heatmap", "console.help", "console.quit", "overview.open_unit"} <= ids
            await pilot.press("escape")
            assert isinstance(app.screen, OverviewScreen)
            await pilot.press("2", "f1")
            assert isinstance(app.screen, HelpScreen)
            ids = {k.binding_id for k in app.screen.keys}
            assert {
                "heatmap.next_metric",
                "heatmap.metric_kv",
                "heatmap.metric_pab",
                "heatmap.follow",
                "heatmap.cursor_left",
            } <= ids
            await pilot.press("escape")
            assert isinstance(app.screen, HeatmapScreen)

    run(go, timeout_s=60)


def test_every_binding_has_a_stable_id_and_a_tooltip() -> None:
    from console.widgets.heatmap import HeatmapView as View

    ids: list[str] = []
    for cls in (ConsoleApp, OverviewScreen, HeatmapScreen, View, HelpScreen):
        for binding in cls.BINDINGS:
            assert isinstance(binding, Binding), (cls, binding)
            assert binding.id and binding.tooltip, (cls, binding)
            ids.append(binding.id)
    assert len(ids) == len(set(ids))


def test_a_binding_is_remapped_by_its_id() -> None:
    async def go() -> None:
        app = ConsoleApp([], clock=None, keymap={"console.heatmap": "h"})
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("2")
            assert app.current_mode == "overview"
            await pilot.press("h")
            assert app.current_mode == "heatmap"
            assert "no units yet" in str(app.screen.query_one(HeatmapView).render_line(0).text)

    run(go, timeout_s=30)


def test_exit_after_ends_the_app_by_itself(store: Path) -> None:
    async def go() -> None:
        app = replay_app(store, exit_after_s=0.3)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.return_code is not None, "the app to exit")
        assert app.return_value == 0

    run(go, timeout_s=30)


# -- live ------------------------------------------------------------------------------------------------------------
def fast_delays():  # type: ignore[no-untyped-def]
    while True:
        yield 0.05


def test_live_feed_reports_connecting_live_and_reconnecting() -> None:
    async def go() -> None:
        port = free_port()
        server = make_server(make_hub(units=2), port=port, speed=10.0)
        feed = LiveFeed(f"ws://127.0.0.1:{port}", delays=fast_delays)
        seen: list[FeedUpdate] = []

        async def consume() -> None:
            async for update in feed.updates():
                seen.append(update)

        def states() -> list[Connection]:
            return [u.connection for u in seen if u.connection is not None]

        async def until_(predicate: Callable[[], bool], what: str) -> None:
            for _ in range(1000):
                if predicate():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(what)

        task = asyncio.create_task(consume())
        await until_(lambda: Connection.RECONNECTING in states(), "a failed attempt before the agent is up")
        assert states()[0] == Connection.CONNECTING
        await server.start()
        await until_(lambda: Connection.LIVE in states(), "live")
        await until_(lambda: any(isinstance(e, StepEvent) for u in seen for e in u.events), "steps")
        await server.stop()
        await until_(lambda: states()[-1] == Connection.RECONNECTING, "reconnecting after the agent stopped")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(go, timeout_s=60)


def test_live_feed_gives_up_on_an_unusable_uri() -> None:
    async def go() -> list[FeedUpdate]:
        return [u async for u in LiveFeed("ws://", delays=fast_delays).updates()]

    updates = run(go, timeout_s=30)
    assert [u.connection for u in updates] == [Connection.CONNECTING, Connection.OFFLINE] and updates[-1].detail


def test_live_console_follows_an_agent_and_shows_it_reconnecting() -> None:
    async def go() -> None:
        server = make_server(make_hub(units=2), speed=10.0)
        await server.start()
        app = ConsoleApp([LiveFeed(server.url, delays=fast_delays)], refresh_s=0.05)
        async with app.run_test(size=(100, 30)) as pilot:
            table = app.screen.query_one(FleetTable)

            def row_states() -> dict[str, str]:
                return {r.key: r.cell("state") for r in table.rows_shown}

            await until(pilot, lambda: row_states().get("unit:test-node:1") == "running", "the agent's units")
            assert row_states()["node:test-node"] == "live"
            await until(pilot, lambda: app.state.nodes["test-node"].num_events > 50, "events")
            await server.stop()
            await until(pilot, lambda: row_states().get("unit:test-node:0") == "reconnecting", "reconnecting")
            assert any(a.code == "connection" for a in app.state.alerts)

    run(go, timeout_s=60)


# -- command line ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["console"], "give at least one agent URI"),
        (["console", "http://host:7700"], "must start with ws:// or wss://"),
        (["console", "ws://host:port"], "bad agent URI"),
        (["console", "ws://:7700"], "no host"),
        (["console", "--replay", "nowhere.duckdb"], "cannot replay nowhere.duckdb: no database at"),
        (["console", "ws://a:1", "--replay", "x.duckdb"], "not both"),
        (["console", "ws://a:1", "--token-file", "no-such-token"], "cannot read token file"),
        (["console", "ws://a:1", "--key", "console.help"], "--key takes ID=KEY"),
        (["demo", "--units", "0"], "--units must be at least 1"),
        (["demo", "--trace", "no-such-trace.csv"], "no trace file"),
    ],
)
def test_command_line_errors_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith(f"trackside {argv[0]}: error: ")


def test_command_line_refuses_a_file_that_is_not_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "notes.duckdb"
    bogus.write_text("not a database")
    assert main(["console", "--replay", str(bogus)]) == 2
    assert "cannot replay" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["console", "ws://a:1", "--refresh", "0"])
    assert exc.value.code == 2


def test_console_replays_a_store_headless_and_exits(store: Path) -> None:
    assert main(["console", "--replay", str(store), "--exit-after", "0.5", "--headless", "--read-only"]) == 0


@pytest.mark.slow
def test_demo_runs_headless_records_and_stops_its_agent(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "console", "demo", "--scenario", "steady", "--exit-after", "3", "--headless"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    agent_pid = int(re.search(r"agent pids (\d+)", proc.stderr).group(1))  # type: ignore[union-attr]
    gone_by = time.monotonic() + 15  # SIGTERMed; at worst killed in the background 10 s later
    while time.monotonic() < gone_by and running(agent_pid):
        time.sleep(0.05)
    assert not running(agent_pid)
    db = tmp_path / "trackside" / "demo.duckdb"
    assert "the console records to" in proc.stderr, "no recorder child: the console records"
    assert "; recorded to" in proc.stderr and str(db) in proc.stderr
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM steps").fetchone()[0] > 0  # type: ignore[index]
        assert con.execute("SELECT node_id FROM nodes").fetchall() == [("demo",)]
    finally:
        con.close()
    log = tmp_path / "trackside" / "demo-agent-demo.log"
    assert log.read_text().startswith("trackside agent demo: ws://127.0.0.1:")


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not reaped yet, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
