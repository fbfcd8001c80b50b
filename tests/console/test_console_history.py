"""A restarted live console shows what it recorded before: at each agent's first hello, the node's last minutes
from the console's own file come first (the recorder's history, the recording feed's order), then the live stream,
which resumes after them: nothing twice, against a real agent too."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from console_fixtures import node_a_events, node_b_events
from console_pilot import until
from serve_harness import make_hub, make_server, run

from agent.telemetry import Event, NodeHello, StepEvent
from console.app import ConsoleApp
from console.cli import build_parser, history_s, live_feeds
from console.feeds import FeedUpdate
from console.history import CARRIED_KINDS
from console.model.records import Connection
from console.recorder import ConsoleRecorder, RecordingFeed


def key(event: Event) -> tuple[str, str, int, int]:
    return event.node_id, type(event).__name__, event.seq, event.time_ns


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Event], list[Event]]:
    """A console's file holding node-a's and node-b's streams (as a recording console writes them)."""
    db = tmp_path_factory.mktemp("history") / "console.duckdb"
    a, b = node_a_events(), node_b_events()
    with ConsoleRecorder(db, flush_s=0.05) as recorder:
        recorder.record(a)
        recorder.record(b)
    assert recorder.error == "" and recorder.num_written == len(a) + len(b)
    return db, a, b


def test_the_recorder_reads_back_a_nodes_recent_history(recorded: tuple[Path, list[Event], list[Event]]) -> None:
    db, a, b = recorded
    with ConsoleRecorder(db) as recorder:
        history = list(recorder.history("node-a", lookback_s=240))
        assert Counter(map(key, history)) == Counter(map(key, a)), "all of node-a (8 s), none of node-b"
        assert [e.seq for e in history] == sorted(e.seq for e in history), "in stream order"
        assert list(recorder.history("node-c", lookback_s=240)) == [], "a node the file has not seen"
        last = max(e.time_ns for e in b)
        recent = list(recorder.history("node-b", lookback_s=1.0))
        older = [e for e in recent if e.time_ns < last - 1_000_000_000]
        assert older and {e.__struct_config__.tag for e in older} <= CARRIED_KINDS, "from before: the hello"
        assert sum(e.time_ns >= last - 1_000_000_000 for e in recent) == sum(
            e.time_ns >= last - 1_000_000_000 for e in b
        ), "the last second whole"
        bounded = list(recorder.history("node-a", lookback_s=240, max_events=300))
        assert 0 < sum(isinstance(e, StepEvent) for e in bounded) <= 300
        assert recorder.num_written == 0, "reading writes nothing"


class Scripted:
    """A live feed's updates: connecting, a hello (live), then a frame of events."""

    def __init__(self, hello: NodeHello, frame: list[Event]) -> None:
        self.hello = hello
        self.frame = frame

    @property
    def source(self) -> str:
        return "ws://agent:7700"

    async def updates(self) -> AsyncIterator[FeedUpdate]:
        yield FeedUpdate(self.source, connection=Connection.CONNECTING)
        yield FeedUpdate(self.source, (self.hello,), Connection.LIVE)
        yield FeedUpdate(self.source, tuple(self.frame))
        yield FeedUpdate(self.source, (self.hello,), Connection.LIVE)  # a reconnect: no history again


def test_the_recording_feed_puts_the_history_before_the_first_hello(
    recorded: tuple[Path, list[Event], list[Event]], tmp_path: Path
) -> None:
    db, a, _ = recorded
    copy = tmp_path / "copy.duckdb"
    copy.write_bytes(db.read_bytes())
    hello = a[0]
    assert isinstance(hello, NodeHello)
    step = next(e for e in a if isinstance(e, StepEvent))
    live: list[Event] = [msgspec.structs.replace(step, seq=10**6)]

    async def go(history: float) -> list[FeedUpdate]:
        with ConsoleRecorder(copy) as recorder:
            feed = RecordingFeed(Scripted(hello, live), recorder, history_s=history)
            updates = [u async for u in feed.updates()]
        assert recorder.num_written == 1 + 1 + 1, "the live hello (twice) and event, not the history"
        return updates

    updates = run(lambda: go(240.0))
    assert updates[0].connection == Connection.CONNECTING
    hello_at = next(i for i, u in enumerate(updates) if u.connection == Connection.LIVE)
    history = [e for u in updates[1:hello_at] for e in u.events]
    assert Counter(map(key, history)) == Counter(map(key, a)), "node-a's history, before its live hello"
    assert all(u.connection is None for u in updates[1:hello_at])
    assert [len(u.events) for u in updates[hello_at:]] == [1, 1, 1], "then the live updates, unchanged"
    without = run(lambda: go(0.0))
    assert len(without) == 4, "history_s 0: none"


def test_history_options_on_the_command_line() -> None:
    parser = build_parser()
    args = parser.parse_args(["console", "ws://a:1"])
    assert history_s(args) == 240.0, "by default the heatmap's span"
    assert history_s(parser.parse_args(["console", "ws://a:1", "--bucket-s", "0.5"])) == 120.0
    assert history_s(parser.parse_args(["demo", "--history-s", "0"])) == 0.0
    with pytest.raises(SystemExit):
        parser.parse_args(["console", "ws://a:1", "--history-s", "-1"])
    with ConsoleRecorder(":memory:") as recorder:
        feed = live_feeds(["ws://a:1"], recorder, history_s=30.0)[0]
        assert isinstance(feed, RecordingFeed) and feed.history_s == 30.0


def test_a_restarted_console_shows_what_it_recorded_then_goes_on_live(tmp_path: Path) -> None:
    db = tmp_path / "console.duckdb"

    def step_ids(app: ConsoleApp, unit_id: int) -> list[int]:
        return [s.step_id for s in app.state.steps.steps("test-node", unit_id)]

    async def go() -> None:
        hub = make_hub(units=2, workload="poisson:n=20000,rate=40")
        # Half speed: the steps made while no console is connected (the first one closing, the second starting,
        # slower on a loaded machine) must not push what the first console showed out of the state's window.
        server = make_server(hub, speed=0.5)
        await server.start()
        try:
            with ConsoleRecorder(db, flush_s=0.2) as recorder:
                first = ConsoleApp(live_feeds([server.url], recorder, history_s=240.0), refresh_s=0.1)
                async with first.run_test(size=(100, 30)) as pilot:
                    await until(pilot, lambda: len(step_ids(first, 0)) >= 40, "steps of unit 0", timeout_s=40)
                    seen = step_ids(first, 0)
                    first_events = first.state.nodes["test-node"].num_events
            with ConsoleRecorder(db, flush_s=0.2) as recorder:
                second = ConsoleApp(live_feeds([server.url], recorder, history_s=240.0), refresh_s=0.1)
                async with second.run_test(size=(100, 30)) as pilot:
                    await until(
                        pilot, lambda: len(step_ids(second, 0)) > len(seen) + 10, "history, then live", timeout_s=40
                    )
                    ids = step_ids(second, 0)
                    assert ids[: len(seen)] == seen, "what the first console showed comes first, from the file"
                    assert len(ids) == len(set(ids)) and ids == sorted(ids), "nothing twice, in order"
                    assert second.state.nodes["test-node"].num_events > first_events
                    assert second.state.sources[server.url].connection == Connection.LIVE
        finally:
            await server.stop()

    run(go, timeout_s=120)
