"""A replay with a cursor: the pure playback (pace, pause, seek, speed), the store read back at one time (a rebuild,
then a timeline), the state started over, and the keys, palette and header of a replaying console (Pilot)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from console_fixtures import SWAP_AT_S, build_store
from console_pilot import text_of, until
from serve_harness import run
from textual.pilot import Pilot

from agent.telemetry import Alert, ControlAudit, Event, NodeHello
from console.app import ConsoleApp
from console.cli import main
from console.feeds import ReplayFeed
from console.history import CARRIED_KINDS, read_back, rebuild_events
from console.model.fleet import fleet_rows
from console.model.playback import MAX_SPEED, MIN_SPEED, Playback, describe, fmt_offset
from console.model.records import Connection
from console.model.state import ConsoleState
from console.screens.heatmap import HeatmapScreen
from console.screens.help import HelpScreen
from console.widgets import FleetTable, HeatmapView
from store.replay import node_ids, recent_start, replay, time_span
from store.schema import connect


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("replay") / "two-nodes.duckdb")


@pytest.fixture(scope="module")
def events(store: Path) -> list[Event]:
    return list(replay(store))


@pytest.fixture(scope="module")
def span(store: Path) -> tuple[int, int]:
    found = time_span(store)
    assert found is not None
    return found


def key(event: Event) -> tuple[str, str, int, int]:
    return event.node_id, type(event).__name__, event.seq, event.time_ns


def upto(events: list[Event], end_ns: int) -> Counter[tuple[str, str, int, int]]:
    """What a console had received by ``end_ns``: each node's stream (``events`` in stream order) up to its first
    event stamped later."""
    cut: set[str] = set()
    taken = []
    for event in events:
        if event.node_id in cut:
            continue
        if event.time_ns > end_ns:
            cut.add(event.node_id)
            continue
        taken.append(key(event))
    return Counter(taken)


# -- the playback (pure) ---------------------------------------------------------------------------------------------
def test_playback_opens_at_the_end_paused_and_plays_from_the_cursor_at_its_speed() -> None:
    clock = FakeClock()
    playback = Playback(clock=clock)
    assert playback.position() is None and describe(playback) == ""
    playback.set_span(1_000_000_000, 9_000_000_000)
    assert playback.position() == 9_000_000_000 and playback.at_end and not playback.playing
    playback.seek(-5)
    assert playback.position() == 4_000_000_000
    clock.now += 3
    assert playback.position() == 4_000_000_000, "paused: the cursor stays"
    playback.toggle()
    clock.now += 1.5
    assert playback.playing and playback.position() == 5_500_000_000
    playback.change_speed(2)
    clock.now += 1
    assert playback.position() == 7_500_000_000, "twice as fast from where it was"
    playback.toggle()
    clock.now += 10
    assert not playback.playing and playback.position() == 7_500_000_000
    playback.toggle()
    clock.now += 10
    assert playback.position() == 9_000_000_000 and not playback.playing, "stops at the end"
    playback.toggle()
    assert playback.playing and playback.position() == 1_000_000_000, "play at the end: from the start again"


def test_playback_seeks_within_the_span_and_bounds_its_speed() -> None:
    clock = FakeClock()
    playback = Playback(speed=4, playing=True, start="start", clock=clock)
    playback.set_span(0, 100_000_000_000)
    assert playback.position() == 0
    clock.now += 2
    assert playback.position() == 8_000_000_000
    playback.seek(-60)
    assert playback.position() == 0, "clamped at the start"
    playback.jump("end")
    assert playback.position() == 100_000_000_000 and not playback.playing
    playback.seek(10)
    assert playback.position() == 100_000_000_000, "clamped at the end"
    playback.jump("start")
    assert playback.position() == 0
    for _ in range(20):
        playback.change_speed(2)
    assert playback.speed == MAX_SPEED
    for _ in range(40):
        playback.change_speed(0.5)
    assert playback.speed == MIN_SPEED
    with pytest.raises(ValueError):
        Playback(speed=0)


def test_the_cursor_is_described_for_the_header() -> None:
    clock = FakeClock()
    playback = Playback(clock=clock)
    playback.set_span(0, 3_725_000_000_000)
    assert describe(playback).startswith("1:02:05/1:02:05 ") and describe(playback).endswith(" end")
    playback.jump("start")
    playback.seek(65)
    assert describe(playback).startswith("1:05/1:02:05 ") and describe(playback).endswith(" paused (1x)")
    playback.toggle()
    playback.change_speed(0.5)
    assert describe(playback).endswith(" playing 0.5x")
    assert [fmt_offset(s) for s in (0, 5.9, 600, 3600)] == ["0:00", "0:05", "10:00", "1:00:00"]


# -- reading the store back at one time -----------------------------------------------------------------------------
def test_the_store_names_its_nodes_span_and_where_its_last_rows_begin(store: Path, events: list[Event]) -> None:
    assert node_ids(store) == ["node-a", "node-b"]
    times = sorted(e.time_ns for e in events)
    assert time_span(store) == (times[0], times[-1])
    b_times = [e.time_ns for e in events if e.node_id == "node-b"]
    assert time_span(store, node_ids=["node-b"]) == (min(b_times), max(b_times))
    assert time_span(store, node_ids=["nobody"]) is None
    start = recent_start(store, times[-1], 100)
    assert start is not None and sum(t >= start for t in times) <= 100 < sum(t >= start - 1 for t in times)
    assert recent_start(store, times[-1], len(times)) is None, "fewer rows than that: from the beginning"


def test_a_rebuild_reads_every_event_up_to_its_time_in_time_order(
    store: Path, events: list[Event], span: tuple[int, int]
) -> None:
    con = connect(store, read_only=True)
    try:
        middle = span[0] + round(SWAP_AT_S * 1e9) + 500_000_000
        for end in (span[0], middle, span[1]):
            rebuilt = list(rebuild_events(con, end, lookback_ns=240 * 10**9))
            assert Counter(map(key, rebuilt)) == upto(events, end)
            for node in ("node-a", "node-b"):  # each node's events in stream order
                seqs = [e.seq for e in rebuilt if e.node_id == node]
                assert seqs == sorted(seqs)
        # a short lookback: only what the state keeps for longer comes from before the window
        rebuilt = list(rebuild_events(con, span[1], lookback_ns=1_000_000_000))
        before = [e for e in rebuilt if e.time_ns < span[1] - 1_000_000_000]
        assert {e.__struct_config__.tag for e in before} <= CARRIED_KINDS
        assert sum(isinstance(e, NodeHello) for e in before) == 2
        assert any(isinstance(e, ControlAudit) for e in before) and any(isinstance(e, Alert) for e in before)
        assert Counter(map(key, (e for e in rebuilt if e.time_ns >= span[1] - 1_000_000_000))) == Counter(
            key(e) for e in events if e.time_ns >= span[1] - 1_000_000_000
        )
        bounded = list(rebuild_events(con, span[1], lookback_ns=240 * 10**9, max_events=500))
        assert sum(not isinstance(e, NodeHello | ControlAudit | Alert) for e in bounded) <= 500
    finally:
        con.close()


def test_a_timeline_takes_events_up_to_a_time_and_loses_none(
    store: Path, events: list[Event], span: tuple[int, int]
) -> None:
    con = connect(store, read_only=True)
    try:
        timeline = read_back(con, span[0], lookback_ns=240 * 10**9)
        taken: list[Event] = []
        for end in range(span[0], span[1] + 500_000_000, 500_000_000):
            while chunk := timeline.take_until(end, 1000):
                assert all(e.time_ns <= end for e in chunk) and len(chunk) <= 1000
                taken.extend(chunk)
        assert Counter(map(key, taken)) == Counter(map(key, events)), "every event once"
        nodes = [e.node_id for e in taken]
        assert nodes.index("node-b") < len(nodes) // 2, "the nodes interleaved by time, not one after the other"
    finally:
        con.close()


def test_a_state_started_over_is_as_new_and_its_version_moves_on(events: list[Event]) -> None:
    state = ConsoleState()
    state.set_connection("file", Connection.REPLAY)
    state.apply(events, "file")
    version = state.version
    state.reset()
    assert state.version > version and not state.nodes and not state.alerts and state.num_events == 0
    assert state.now_ns == 0 and state.sources["file"].connection == Connection.REPLAY
    state.apply(events, "file")
    fresh = ConsoleState()
    fresh.set_connection("file", Connection.REPLAY)
    fresh.apply(events, "file")
    assert fleet_rows(state) == fleet_rows(fresh) and list(state.alerts) == list(fresh.alerts)


# -- the console replaying ------------------------------------------------------------------------------------------
def detail(app: ConsoleApp) -> str:
    return next(iter(app.state.sources.values())).detail


def shown_ns(app: ConsoleApp) -> int | None:
    feed = app.feeds[0]
    assert isinstance(feed, ReplayFeed)
    return feed.shown_ns


async def settled(pilot: Pilot[int], app: ConsoleApp, end_ns: int, what: str) -> None:
    """Until the feed has brought the state to the cursor at ``end_ns`` and the screen drew it."""
    await until(pilot, lambda: shown_ns(app) == end_ns and detail(app) != "", what)
    app.refresh_views(force=True)
    await pilot.pause()
    assert app.state.now_ns == end_ns


def unit_policy(app: ConsoleApp, node: str, unit: int) -> str:
    return {r.key: r.cell("policy") for r in fleet_rows(app.state)}[f"unit:{node}:{unit}"]


def test_a_replay_opens_at_its_end_and_seeks_back_and_forth_by_key(
    store: Path, events: list[Event], span: tuple[int, int]
) -> None:
    async def go() -> None:
        app = ConsoleApp([ReplayFeed(store, tick_s=0.01)], clock=None, refresh_s=0.05)
        playback = app.playback
        assert playback is not None
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: detail(app) == "end of file", "the end of the file")
            await settled(pilot, app, span[1], "the end")
            assert app.state.num_events == len(events), "opened at the end: the whole file"
            assert unit_policy(app, "node-a", 1) == "sarathi"
            assert "0:08/0:08" in app.sub_title and " end · " in app.sub_title
            # back to the start ([ seeks 10 s back; the file is 8 s long)
            await pilot.press("left_square_bracket")
            assert playback.position() == span[0]
            await settled(pilot, app, span[0], "the start")
            assert app.state.num_events == sum(upto(events, span[0]).values())
            assert "0:00/0:08" in app.sub_title and "paused" in app.sub_title
            # to a time before the swap, then after it: the state is rebuilt each way
            before_swap = span[0] + round((SWAP_AT_S - 1) * 1e9)
            await app.run_action(f"replay_seek({(before_swap - span[0]) / 1e9})")
            await settled(pilot, app, before_swap, "before the swap (read on)")
            assert unit_policy(app, "node-a", 1) == "vllm"
            await pilot.press("greater_than_sign")  # the end: read on from there
            await settled(pilot, app, span[1], "the end again")
            assert app.state.num_events == len(events) and unit_policy(app, "node-a", 1) == "sarathi"
            await app.run_action(f"replay_seek({(before_swap - span[1]) / 1e9})")  # back: rebuilt
            await settled(pilot, app, before_swap, "before the swap (rebuilt)")
            assert unit_policy(app, "node-a", 1) == "vllm"
            assert app.state.num_events == sum(upto(events, before_swap).values()), "every event up to then, once"
            assert not app.state.markers, "the swap is not there yet"
            await pilot.press("right_curly_bracket")  # +60 s: clamped at the end
            await settled(pilot, app, span[1], "the end once more")
            assert app.state.num_events == len(events) and [m.text for m in app.state.markers] == ["u1 vllm -> sarathi"]
            await pilot.press("less_than_sign")
            await settled(pilot, app, span[0], "the start again")
            assert app.state.num_events == sum(upto(events, span[0]).values())

    run(go, timeout_s=90)


def test_a_replay_plays_at_its_pace_pauses_and_changes_speed(
    store: Path, events: list[Event], span: tuple[int, int]
) -> None:
    async def go() -> None:
        clock = FakeClock()
        playback = Playback(speed=1.0, playing=True, start="start", clock=clock)
        app = ConsoleApp([ReplayFeed(store, playback=playback, tick_s=0.01)], clock=None, refresh_s=0.05)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.state.num_events > 0, "the first events")
            assert app.state.num_events == sum(upto(events, span[0]).values()), "at the start: its first events"
            clock.now += 2
            at = span[0] + 2_000_000_000
            await settled(pilot, app, at, "2 s in")
            assert app.state.num_events == sum(upto(events, at).values())
            assert "playing 1x" in app.sub_title and "0:02/0:08" in app.sub_title
            await pilot.press("space")  # pause
            clock.now += 3
            await pilot.pause(0.1)
            assert playback.position() == at and shown_ns(app) == at and app.state.now_ns == at
            assert "paused" in app.sub_title
            await pilot.press("space", "plus")  # play, twice as fast
            assert playback.speed == 2.0
            clock.now += 1
            await settled(pilot, app, at + 2_000_000_000, "2 s further in 1 s")
            assert app.state.num_events == sum(upto(events, at + 2_000_000_000).values())
            await pilot.press("minus", "minus")
            assert playback.speed == 0.5
            clock.now += 100
            await until(pilot, lambda: detail(app) == "end of file", "the end")
            await pilot.pause(0.1)
            assert not playback.playing and app.state.num_events == len(events), "every event once, in the end"

    run(go, timeout_s=60)


def test_every_screen_survives_a_seek_back(store: Path, span: tuple[int, int]) -> None:
    async def go() -> None:
        app = ConsoleApp([ReplayFeed(store, tick_s=0.01)], clock=None, refresh_s=0.05)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: detail(app) == "end of file", "the end of the file")
            await pilot.press("2", "left", "left", "down")  # the heatmap's cursor back in time
            view = app.screen.query_one(HeatmapView)
            assert view.cursor_bucket is not None
            for screen_key in "2345671":
                await pilot.press(screen_key)
                if screen_key == "7":
                    await pilot.press("tab")  # out of the SQL editor, which types [ and ] itself
                await pilot.press("left_square_bracket")
                await settled(pilot, app, span[0], f"the start on screen {screen_key}")
                await pilot.press("greater_than_sign")
                await settled(pilot, app, span[1], f"the end on screen {screen_key}")
            await pilot.press("2")
            assert isinstance(app.screen, HeatmapScreen)
            assert app.screen.query_one(HeatmapView).grid is not None
            assert len(app.screen.query_one(HeatmapView).units) == 6
            await pilot.press("1")
            assert len(app.screen.query_one(FleetTable).rows_shown) == 8

    run(go, timeout_s=90)


def test_replay_keys_have_ids_are_remappable_listed_and_in_the_palette(store: Path, span: tuple[int, int]) -> None:
    async def go() -> None:
        app = ConsoleApp([ReplayFeed(store, tick_s=0.01)], clock=None, keymap={"replay.back": "b"})
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: detail(app) == "end of file", "the end of the file")
            await pilot.press("b")
            assert app.playback is not None and app.playback.position() == span[0], "remapped by its id"
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            ids = {k.binding_id for k in app.screen.keys}
            assert {
                "replay.play_pause",
                "replay.back",
                "replay.forward",
                "replay.back_more",
                "replay.forward_more",
                "replay.start",
                "replay.end",
                "replay.faster",
                "replay.slower",
            } <= ids
            assert "b" in {k.key for k in app.screen.keys if k.binding_id == "replay.back"}
            await pilot.press("escape")
            commands = {c.title: c for c in app.get_system_commands(app.screen)}
            assert {"Replay: play/pause", "Replay: back 10 s", "Replay: to the end", "Replay: faster"} <= set(commands)
            await commands["Replay: to the end"].callback()
            assert app.playback.position() == span[1]
            assert "(key >)" in commands["Replay: to the end"].help

    run(go, timeout_s=60)


def test_a_live_console_has_no_replay_keys() -> None:
    async def go() -> None:
        app = ConsoleApp([], clock=None)
        async with app.run_test(size=(80, 24)) as pilot:
            assert app.playback is None and app.check_action("replay_toggle", ()) is False
            await pilot.press("space", "left_square_bracket")  # nothing happens, nothing breaks
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            assert not any(k.binding_id.startswith("replay.") for k in app.screen.keys)
            await pilot.press("escape")
            assert not any(c.title.startswith("Replay:") for c in app.get_system_commands(app.screen))

    run(go, timeout_s=30)


def test_the_header_shows_the_cursor(store: Path, span: tuple[int, int]) -> None:
    async def go() -> None:
        app = ConsoleApp([ReplayFeed(store, tick_s=0.01)], clock=None)
        async with app.run_test(size=(120, 30)) as pilot:
            await settled(pilot, app, span[1], "the end")
            title = text_of(app.screen.query_one("HeaderTitle"))
            assert "0:08/0:08" in title and " end · " in title, title

    run(go, timeout_s=30)


# -- the command line -----------------------------------------------------------------------------------------------
def test_replay_options_on_the_command_line(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["console", "--replay", str(store), "--speed", "50", "--exit-after", "0.5", "--headless"]) == 0
    assert main(["console", "ws://a:1", "--speed", "2"]) == 2
    assert "--speed paces a replay" in capsys.readouterr().err
    assert main(["console", "--replay", str(store), "--history-s", "60"]) == 2
    assert "--history-s shows a live console's recording" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["console", "--replay", str(store), "--speed", "0"])


def test_an_empty_store_replays_as_nothing_and_the_keys_do_nothing(tmp_path: Path) -> None:
    empty = tmp_path / "empty.duckdb"
    connect(empty).close()  # the schema, no events

    async def go() -> None:
        app = ConsoleApp([ReplayFeed(empty, tick_s=0.01)], clock=None)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: detail(app) == "end of file", "the end of an empty file")
            await pilot.press("left_square_bracket", "space", "greater_than_sign", "plus")
            assert app.playback is not None and app.playback.position() is None
            assert not app.state.nodes and app.sub_title == f"Overview · 0 nodes · {empty} replay", "no cursor shown"

    run(go, timeout_s=30)


def test_a_replayed_hello_gives_the_console_its_units_gpus(tmp_path: Path) -> None:
    from agent.telemetry import UnitStatus
    from console.model.placement import unit_label
    from store.writer import StoreWriter

    t0 = 1_800_000_000_000_000_000
    hello = NodeHello(seq=1, node_id="gpu-node", time_ns=t0, boot_ns=t0, profile="Llama-3.1-8B",
                      dispatch_policy="least_loaded",
                      units=(UnitStatus(unit_id=0, batch_policy="vllm", gpu_ids=(0, 1), tensor_parallel_size=2,
                                        pipeline_parallel_size=1),
                             UnitStatus(unit_id=1, batch_policy="vllm", gpu_ids=(2, 3, 4, 5), tensor_parallel_size=2,
                                        pipeline_parallel_size=2)))
    with StoreWriter(tmp_path / "gpus.duckdb") as writer:
        writer.write([hello])
    state = ConsoleState()
    state.apply(replay(tmp_path / "gpus.duckdb"))
    units = state.nodes["gpu-node"].units
    assert units[0].gpu_ids == (0, 1) and units[1].gpu_ids == (2, 3, 4, 5)
    assert (unit_label(units[0]), unit_label(units[1])) == ("0,1 TP2", "2-5 TP2 PP2")  # the Overview's GPU column
