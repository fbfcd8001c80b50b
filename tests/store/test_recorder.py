"""The store's recorder without sockets: the two ways frames are handed to it (waiting or dropping), a writer's
error, retention on injected clocks, and a real file written through it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import duckdb
from serve_harness import run, step_events

from agent.telemetry import Alert, Event
from store.recorder import Recorder
from store.schema import StoreError
from store.writer import StoreWriter


class ListWriter:
    """The writer interface in memory; ``gate`` (when given) holds every ``write`` until it is set."""

    def __init__(self, gate: threading.Event | None = None, fail_writes: int = 0) -> None:
        self.gate = gate
        self.fail_writes = fail_writes
        self.writes: list[list[Event]] = []
        self.num_flushes = 0
        self.prunes: list[int] = []
        self.closed = False

    def write(self, events: Sequence[Event]) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_writes:
            self.fail_writes -= 1
            raise StoreError("disk full")
        self.writes.append(list(events))

    def flush(self) -> None:
        self.num_flushes += 1

    def last_seq(self, node_id: str, boot_ns: int | None = None) -> int:
        return max((e.seq for w in self.writes for e in w), default=0)

    def prune(self, older_than_ns: int) -> int:
        self.prunes.append(older_than_ns)
        return 0

    def close(self) -> None:
        self.closed = True


def test_put_waits_while_frames_are_queued_and_loses_nothing() -> None:
    gate = threading.Event()
    writer = ListWriter(gate)
    events = step_events(40)

    async def go() -> list[bool]:
        recorder = Recorder(writer, flush_s=0.05, max_frames=2)
        try:
            await recorder.put(events[:1])  # taken by the thread, which then waits at the gate
            await asyncio.sleep(0.1)
            await recorder.put(events[1:2])
            await recorder.put(events[2:3])
            blocked = asyncio.create_task(recorder.put(events[3:4]))
            await asyncio.sleep(0.1)
            waited = not blocked.done()
            gate.set()
            await asyncio.wait_for(blocked, 5)
            for i in range(4, 40):
                await recorder.put(events[i : i + 1])
        finally:
            recorder.close()
        return [waited, recorder.num_dropped == 0]

    assert run(go) == [True, True]
    assert [e.seq for w in writer.writes for e in w] == list(range(1, 41))
    assert writer.closed and writer.num_flushes >= 1


def test_record_drops_beyond_the_backlog_and_leaves_notices_out() -> None:
    gate = threading.Event()
    writer = ListWriter(gate)
    notice = Alert(node_id="n", time_ns=1, code="flow_control", message="dropped 3", num_dropped=3)
    with Recorder(writer, max_backlog=4) as recorder:
        recorder.record([notice])
        recorder.record(step_events(3))
        recorder.record(step_events(2))  # 3 + 2 > 4: dropped
        gate.set()
    assert recorder.num_dropped == 2 and recorder.num_written == 3
    assert [e.seq for w in writer.writes for e in w] == [1, 2, 3]


def test_a_write_error_is_kept_and_later_frames_are_still_written() -> None:
    writer = ListWriter(fail_writes=1)
    with Recorder(writer, flush_s=0.05) as recorder:
        recorder.record(step_events(2))
        # until the thread has failed that write (it went on after 1 s whatever happened: a thread not scheduled
        # by then wrote both frames in the one failing write)
        deadline = time.monotonic() + 30
        while recorder.failure is None:
            assert time.monotonic() < deadline, "the first write never failed"
            time.sleep(0.01)
        recorder.record(step_events(3)[2:])
    assert isinstance(recorder.failure, StoreError) and recorder.error == "disk full"
    assert [e.seq for w in writer.writes for e in w] == [3]


def test_retention_prunes_at_the_start_on_the_injected_clocks() -> None:
    """Both clocks injected: the monotonic one too, so that "a tenth of the retention later" is the test's to say
    (with the real one and 0.2 s of sleep, a thread not scheduled in time pruned never, or twice)."""
    writer = ListWriter()
    now = [0.0]

    def until(predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.005)

    with Recorder(writer, flush_s=0.05, retention_s=10.0, clock=lambda: now[0],
                  wall_clock_ns=lambda: 100 * 10**9) as recorder:

        def turn() -> None:
            """Two frames written one after the other: the thread's turn that wrote the first has looked at the
            clock and decided whether to prune."""
            for events in (step_events(1), step_events(1)):
                num = len(writer.writes)
                recorder.record(events)
                until(lambda n=num: len(writer.writes) > n, "a write")  # type: ignore[misc]

        until(lambda: bool(writer.prunes), "the first prune")
        assert writer.prunes == [90 * 10**9], "the first prune: at the start, ten seconds back from the wall clock"
        now[0] = 0.9
        turn()
        assert len(writer.prunes) == 1, "the next one is a tenth of the retention later"
        now[0] = 1.0
        turn()
        assert writer.prunes == [90 * 10**9] * 2


def test_a_store_file_written_through_the_recorder(tmp_path: Path) -> None:
    db = tmp_path / "r.duckdb"
    with Recorder(StoreWriter(db), flush_s=0.05, batch_size=3) as recorder:
        recorder.record(step_events(10))
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT seq FROM steps ORDER BY seq").fetchall() == [(s,) for s in range(1, 11)]
    finally:
        con.close()
