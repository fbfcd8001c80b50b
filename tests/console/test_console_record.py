"""The console records what it shows: a live console against a real agent writes the events it receives into its
DuckDB file (queried live by its SQL screen), and a console restarted on that file resumes where the first stopped,
without receiving anything twice and without a gap; the recorder's filter, backlog cap and command-line errors."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import duckdb
import pytest
from console_pilot import until
from serve_harness import TOKEN, make_hub, make_server, run, step_events, stored_runs
from textual.widgets import TextArea

from agent.service.server import AgentServer
from agent.telemetry import Alert, NodeHello, UnitStatus
from console.app import ConsoleApp
from console.cli import live_feeds, main
from console.feeds import Feed, FeedUpdate, LiveFeed
from console.recorder import ConsoleRecorder, RecordError, RecordingFeed
from console.screens.sql import SqlScreen


class SeqSpy:
    """A feed that notes the sequence numbers of the stream events passing through it."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.seqs: list[int] = []

    @property
    def source(self) -> str:
        return self.feed.source

    async def updates(self) -> AsyncIterator[FeedUpdate]:
        async for update in self.feed.updates():
            self.seqs.extend(e.seq for e in update.events if e.seq)
            yield update


async def watch(server: AgentServer, db: Path, num_events: int, *, query: bool = False) -> tuple[list[int], int]:
    """A recording console on ``server`` until it received ``num_events`` stream events; the sequence numbers it
    received and the steps its SQL screen counted in its own file while running (``query``)."""
    recorder = ConsoleRecorder(db, flush_s=0.2)
    spy = SeqSpy(live_feeds([server.url], recorder)[0])
    counted = -1
    try:
        app = ConsoleApp([spy], refresh_s=0.25, token=TOKEN, database=recorder)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: len(spy.seqs) >= num_events, f"{num_events} events", timeout_s=40)
            if query:
                # a commit after steps were written (num_flushes >= 2 could count flushes from before any step on a
                # loaded machine, where the writer thread lags behind the feed)
                await until(pilot, lambda: recorder.num_written >= num_events, "the events written")
                flushed = recorder.num_flushes
                await until(pilot, lambda: recorder.num_flushes > flushed, "a commit")
                await pilot.press("7")
                screen = app.screen
                assert isinstance(screen, SqlScreen)
                assert f"recording to {db}" in str(screen.query_one("#sql-source").render())
                screen.query_one(TextArea).load_text("SELECT count(*) FROM steps")
                await pilot.press("f5")
                await until(pilot, lambda: screen.last_result is not None or bool(screen.last_error), "the query")
                assert screen.last_result is not None, screen.last_error
                counted = int(screen.last_result.rows[0][0])
    finally:
        recorder.close()
    assert recorder.error == "" and recorder.num_dropped == 0
    return spy.seqs, counted


def test_a_live_console_records_and_a_restarted_one_resumes_without_duplicates(tmp_path: Path) -> None:
    db = tmp_path / "console.duckdb"

    async def go() -> tuple[list[int], list[int], int, int]:
        hub = make_hub(units=2, workload="poisson:n=20000,rate=40")
        server = make_server(hub, speed=2.0)
        await server.start()
        try:
            first, counted = await watch(server, db, 600, query=True)
            second, _ = await watch(server, db, 300)
        finally:
            await server.stop()
        return first, second, counted, hub.boot_ns

    first, second, counted, boot_ns = run(go, timeout_s=120)
    assert first[0] == 1, "a new file: the agent sends everything it buffers"
    assert counted > 0, "the SQL screen saw committed steps while the console ran"
    assert second[0] == max(first) + 1, "the restarted console resumed after the last recorded event"
    assert not set(first) & set(second), "nothing received twice"
    runs = stored_runs(db)
    assert list(runs) == [boot_ns]
    assert runs[boot_ns] == list(range(1, max(second) + 1)), "every event once, no gap"
    con = duckdb.connect(str(db), read_only=True)
    try:
        nodes = con.execute("SELECT node_id, boot_ns FROM nodes").fetchall()
        steps = con.execute("SELECT count(*) FROM steps").fetchone()
    finally:
        con.close()
    assert nodes == [("test-node", boot_ns)] and steps is not None and steps[0] >= counted


def test_the_recorder_stores_hellos_and_stream_events_not_notices(tmp_path: Path) -> None:
    db = tmp_path / "r.duckdb"
    hello = NodeHello(
        node_id="n",
        time_ns=0,
        boot_ns=7,
        profile="p",
        units=(UnitStatus(unit_id=0, batch_policy="vllm"),),
        dispatch_policy="least_loaded",
    )
    notice = Alert(node_id="n", time_ns=1, code="flow_control", message="dropped 3", num_dropped=3)
    with ConsoleRecorder(db, flush_s=0.05) as recorder:
        recorder.record([hello])
        recorder.record([notice, *step_events(5)])
        recorder.record([notice])
    assert recorder.num_written == 6 and recorder.num_flushes >= 1
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM alerts").fetchone() == (0,)
        assert con.execute("SELECT boot_ns, seq FROM steps ORDER BY seq").fetchall() == [(7, s) for s in range(1, 6)]
    finally:
        con.close()
    with ConsoleRecorder(db) as again:
        assert again.resume_from(hello) == 5, "the store's last position in the hello's run"
        other_run = NodeHello(**{**{f: getattr(hello, f) for f in hello.__struct_fields__}, "boot_ns": 8})
        assert again.resume_from(other_run) == 0


def test_a_recorder_that_falls_behind_drops_and_counts(tmp_path: Path) -> None:
    recorder = ConsoleRecorder(tmp_path / "r.duckdb", max_backlog=3)
    try:
        recorder._lock.acquire()  # the writer thread is stuck (a long commit, say)
        recorder.record(step_events(2))
        recorder.record(step_events(2))
        assert recorder.num_dropped == 2
    finally:
        recorder._lock.release()
        recorder.close()
    assert recorder.num_written == 2


def test_recording_feed_passes_updates_through(tmp_path: Path) -> None:
    class Fixed:
        source = "fixed"

        async def updates(self) -> AsyncIterator[FeedUpdate]:
            yield FeedUpdate("fixed", tuple(step_events(3)))

    async def go() -> list[FeedUpdate]:
        with ConsoleRecorder(tmp_path / "f.duckdb") as recorder:
            feed = RecordingFeed(Fixed(), recorder)
            updates = [u async for u in feed.updates()]
        assert recorder.num_written == 3 and feed.source == "fixed"
        return updates

    assert len(run(go)[0].events) == 3
    assert isinstance(live_feeds(["ws://a:1"], None)[0], LiveFeed), "--no-record: the plain live feed"


def test_a_file_that_is_not_a_store_or_is_locked_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "notes.duckdb"
    bogus.write_text("not a database")
    with pytest.raises(RecordError, match="cannot record to"):
        ConsoleRecorder(bogus)
    assert main(["console", "ws://127.0.0.1:1", "--db", str(bogus), "--headless", "--exit-after", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot record to" in err and "(use --db PATH or --no-record)" in err and err.count("\n") == 1
    locked = tmp_path / "locked.duckdb"
    code = f"from store.writer import StoreWriter; w = StoreWriter({str(locked)!r}); print('open', flush=True); input()"
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        assert main(["console", "ws://127.0.0.1:1", "--db", str(locked), "--headless", "--exit-after", "1"]) == 2
        assert "cannot record to" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()


def test_the_consoles_store_has_a_memory_limit(tmp_path: Path) -> None:
    """DuckDB's cache of the console's file is bounded (512MB by default; DuckDB's own default is 80% of the
    machine), and a limit given is the one the SQL screen's connection runs under."""
    with ConsoleRecorder(tmp_path / "m.duckdb") as recorder:
        setting = recorder.query_connection().execute("SELECT current_setting('memory_limit')").fetchone()
        assert setting == ("488.2 MiB",)
    with ConsoleRecorder(tmp_path / "m.duckdb", memory_limit="64MB") as recorder:
        setting = recorder.query_connection().execute("SELECT current_setting('memory_limit')").fetchone()
        assert setting == ("61.0 MiB",)
