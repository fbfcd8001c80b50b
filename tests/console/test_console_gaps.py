"""Gaps shown: a ``gap`` alert (events the agent no longer buffered when a stream resumed) is an alert in the list and
a hole the heatmap marks over the time span without data, live or read back from a store; and a recording console
resumed after an agent on loopback overtook it stores the hole as a row of ``gaps``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import cast

import msgspec
from console_pilot import until
from serve_harness import make_hub, make_server, run, stored_runs, wait_for
from test_console_state import T0, S, hello, step

from agent.telemetry import Alert, AlertCode, Event, StepEvent
from console.app import ConsoleApp
from console.cli import live_feeds
from console.feeds import FeedUpdate, ReplayFeed
from console.model.metrics import HeatMetric
from console.model.queries import cell, heatmap
from console.model.state import ConsoleState
from console.recorder import ConsoleRecorder
from console.screens.heatmap import HeatmapScreen
from console.widgets import AlertList, CellPanel, HeatmapView
from console.widgets.cell_panel import cell_text
from console.widgets.heatmap import GAP_GLYPH
from store.schema import connect
from store.writer import StoreWriter

MS = 1_000_000


def steps(first_seq: int, start_ns: int, count: int, every_ns: int = 100 * MS) -> list[StepEvent]:
    """``count`` steps of unit 0 of ``n1``, numbered from ``first_seq``, every ``every_ns``."""
    return [msgspec.structs.replace(step(start_ns + i * every_ns), seq=first_seq + i) for i in range(count)]


def gap(first: int, last: int, at: int) -> Alert:
    return Alert(
        node_id="n1",
        time_ns=at,
        code=AlertCode.GAP,
        message=f"events {first}..{last} are no longer buffered",
        first_seq=first,
        last_seq=last,
    )


def stream() -> list[Event]:
    """A node's stream with a hole: steps 1..30 over 0-2.9 s, events 31..120 lost, steps 121..150 from 10 s on (the
    agent said so at 20 s, when the stream resumed; what it still buffered comes after its alert)."""
    return [hello(units=1), *steps(1, T0, 30), gap(31, 120, T0 + 20 * S), *steps(121, T0 + 10 * S, 30)]


# -- the state model ------------------------------------------------------------------------------------------------
def test_a_gap_spans_from_the_last_event_before_it_to_the_first_after() -> None:
    state = ConsoleState(history_buckets=30)
    events = stream()
    state.apply(events[:32])  # up to the alert: the hole runs on to it
    node = state.nodes["n1"]
    [hole] = node.gaps
    assert (hole.first_seq, hole.last_seq, hole.boot_ns) == (31, 120, T0)
    assert hole.start_ns == T0 + 2900 * MS and hole.end_ns is None and node.open_gap is hole
    grid = heatmap(state, HeatMetric.BATCH, 21, last_bucket=T0 // S + 20)
    assert grid.rows[0].gaps == frozenset(range(3, 21)), "every empty bucket from the hole's start to the alert"
    state.apply(events[32:])
    assert hole.end_ns == T0 + 10 * S and node.open_gap is None
    grid = heatmap(state, HeatMetric.BATCH, 21, last_bucket=T0 // S + 20)
    assert grid.rows[0].gaps == frozenset(range(3, 10)), "only the buckets without data, up to the first event after"
    assert [a.code for a in state.alerts] == ["gap"] and "31..120" in state.alerts[0].message
    info = cell(state, "n1", 0, T0 // S + 5)
    assert info is not None and info.gap is hole
    assert "lost: events 31..120 of n1" in cell_text(info, HeatMetric.BATCH, state.newest_bucket, 1.0)
    data = cell(state, "n1", 0, T0 // S + 2)
    assert data is not None and data.gap is None, "a bucket with data is not lost"


def test_a_gap_before_any_event_starts_at_the_runs_start_and_a_new_run_ends_it() -> None:
    state = ConsoleState()
    state.apply([hello(units=1, t=T0), gap(1, 40, T0 + 9 * S)])
    [hole] = state.nodes["n1"].gaps
    assert hole.start_ns == T0 and hole.end_ns is None
    state.apply([hello(units=1, t=T0 + 12 * S)])  # the agent restarted before anything after the hole arrived
    assert hole.end_ns == T0 + 9 * S and state.nodes["n1"].open_gap is None, "at its announcement at the latest"


def test_a_gap_read_back_before_a_rebuilds_window_ends_where_it_was_announced() -> None:
    """A rebuild reads alerts from before its window (``console.history``): the first event after such a hole is the
    window's, much later; the hole ended where the store placed its alert (the first event after it, not read)."""
    state = ConsoleState()
    state.apply([hello(units=1), *steps(1, T0, 30), gap(31, 120, T0 + 10 * S), *steps(500, T0 + 60 * S, 5)])
    [hole] = state.nodes["n1"].gaps
    assert (hole.start_ns, hole.end_ns) == (T0 + 2900 * MS, T0 + 10 * S)


# -- the screens, on a store that holds a gap -----------------------------------------------------------------------
def test_a_replay_shows_the_gap_in_the_alerts_and_on_the_heatmap(tmp_path: Path) -> None:
    db = tmp_path / "gap.duckdb"
    with StoreWriter(db) as writer:
        writer.write(stream())

    async def go() -> None:
        app = ConsoleApp([ReplayFeed(db)], clock=None)
        async with app.run_test(size=(100, 24)) as pilot:
            await until(pilot, lambda: any(s.detail == "end of file" for s in app.state.sources.values()), "replay")
            app.refresh_views(force=True)
            await pilot.pause()
            alerts = str(app.screen.query_one(AlertList).render())
            assert "n1 gap: events 31..120 are missing" in alerts
            await pilot.press("2")
            screen = app.screen
            assert isinstance(screen, HeatmapScreen)
            view = screen.query_one(HeatmapView)
            assert view.grid is not None
            row = view.grid.rows[0]
            lost = sorted(row.gaps)
            assert len(lost) == 7 and all(row.values[c] is None for c in lost), "3 s to 10 s: seven empty buckets"
            assert row.values[lost[0] - 1] is not None and row.values[lost[-1] + 1] is not None
            line = view.render_line(1).text
            columns = line[view.label_width :]
            assert columns[lost[0] : lost[-1] + 1] == GAP_GLYPH * 7 and GAP_GLYPH not in columns[: lost[0]]
            assert "lost (gap)" in view.render_line(len(view.grid.rows) + 2).text, "the legend says what it is"
            await pilot.press(*["left"] * (view.newest - (view.grid.first_bucket + lost[0])))
            assert "lost: events 31..120" in str(screen.query_one(CellPanel).render())

    run(go, timeout_s=60)


# -- a recording console against a real agent ---------------------------------------------------------------------
def test_a_recording_console_resumed_too_late_stores_and_shows_the_hole(tmp_path: Path) -> None:
    db = tmp_path / "console.duckdb"

    async def watch(url: str, num_events: int) -> tuple[ConsoleState, list[int]]:
        """A recording console's feed folded into a state until ``num_events`` stream events arrived."""
        recorder = ConsoleRecorder(db, flush_s=0.05)
        state, seqs = ConsoleState(), []
        feed = cast(AsyncGenerator[FeedUpdate, None], live_feeds([url], recorder)[0].updates())
        try:
            async for update in feed:
                state.apply(update.events, update.source)
                seqs.extend(e.seq for e in update.events if e.seq)
                if len(seqs) >= num_events:
                    break
        finally:
            with contextlib.suppress(Exception):
                await feed.aclose()
            recorder.close()
        return state, seqs

    async def go() -> tuple[list[int], ConsoleState, list[int], int]:
        hub = make_hub(units=2, workload="poisson:n=20000,rate=40", replay_capacity=200)
        server = make_server(hub, speed=5.0)
        await server.start()
        try:
            _, first = await watch(server.url, 100)
            await wait_for(lambda: hub.replay.oldest_seq > max(first) + 1, what="the agent to overtake the console")
            state, second = await watch(server.url, 50)
        finally:
            await server.stop()
        return first, state, second, hub.boot_ns

    first, state, second, boot_ns = run(go, timeout_s=60)
    stored = max(first)
    con = connect(db, read_only=True)
    try:
        rows = con.execute("SELECT from_seq, to_seq FROM gaps WHERE from_seq = ?", [stored + 1]).fetchall()
    finally:
        con.close()
    assert rows == [(stored + 1, second[0] - 1)], "the store says what it will never have"
    assert min(s for s in stored_runs(db)[boot_ns] if s > stored) == second[0]
    node = state.nodes["test-node"]
    holes = [g for g in node.gaps if g.first_seq == stored + 1]
    assert holes and holes[0].last_seq == second[0] - 1 and holes[0].end_ns is not None
    assert any(a.code == "gap" and f"{stored + 1}..{second[0] - 1}" in a.message for a in state.alerts)
