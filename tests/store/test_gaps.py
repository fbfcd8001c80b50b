"""Gaps stored as rows: a ``gap`` alert (the agent no longer buffered what a resume asked for) becomes a row of
``gaps``, written by the writer, kept by the recorder, read back as the alert where it belongs in the stream; a
version-2 store gains the table; and ``trackside record``'s recorder, resumed after an agent on loopback with a tiny
replay buffer overtook it, stores the hole it was told of."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import duckdb
import msgspec
import pytest
from serve_harness import NotingWriters, make_hub, make_server, run, stored_runs, wait_for
from test_store import NODE, T0, hello, step

from agent.telemetry import Alert, AlertCode, Event, NodeHello
from store import schema
from store.recorder import Recorder, record_agents
from store.replay import replay
from store.schema import StoreVersionError, connect
from store.writer import StoreWriter


def gap(first: int, last: int, at: int = T0) -> Alert:
    return Alert(node_id=NODE, time_ns=at, code=AlertCode.GAP, message="lost", first_seq=first, last_seq=last)


def gap_rows(con: duckdb.DuckDBPyConnection) -> list[tuple[object, ...]]:
    return con.execute("SELECT * FROM gaps ORDER BY ALL").fetchall()


# -- the writer and the recorder --------------------------------------------------------------------------------------
def test_a_gap_alert_is_a_row_of_gaps_in_its_run_not_an_alert() -> None:
    with StoreWriter(":memory:") as writer:
        writer.write([hello(), step(1), step(2), gap(3, 9, T0 + 5), step(10)])
        writer.flush()
        con = writer.cursor()
        assert gap_rows(con) == [(NODE, T0, 3, 9, T0 + 5)]
        assert con.execute("SELECT count(*) FROM alerts").fetchone() == (0,)
        assert writer.last_seq(NODE) == 10, "the position moves on past the hole, and the hole says what is missing"
        # announced again (a recorder killed before it committed what followed): one row, the hole widened
        writer.write([gap(3, 12, T0 + 50), step(13), gap(3, 11, T0 + 60)])
        writer.write([hello(boot_ns=T0 + 1), gap(1, 4, T0 + 70)])  # a new run of the agent: a hole of its own
        writer.flush()
        assert gap_rows(con) == [(NODE, T0, 3, 12, T0 + 5), (NODE, T0 + 1, 1, 4, T0 + 70)]
        assert writer.prune(T0 + 6) >= 1 and gap_rows(con) == [(NODE, T0 + 1, 1, 4, T0 + 70)], "pruned with its age"


def test_the_recorder_keeps_gap_alerts_and_leaves_other_notices_out(tmp_path: Path) -> None:
    db = tmp_path / "gaps.duckdb"
    flow = Alert(node_id=NODE, time_ns=T0, code=AlertCode.FLOW_CONTROL, message="dropped", num_dropped=2)
    with Recorder(StoreWriter(db), flush_s=0.05) as recorder:
        recorder.record([hello()])
        recorder.record([step(1), flow, gap(2, 5, T0 + 9), step(6)])
    con = connect(db, read_only=True)
    try:
        assert gap_rows(con) == [(NODE, T0, 2, 5, T0 + 9)]
        assert con.execute("SELECT count(*) FROM alerts").fetchone() == (0,)
    finally:
        con.close()


def test_replay_puts_the_gap_alert_where_the_hole_is() -> None:
    with StoreWriter(":memory:") as writer:
        writer.write([hello(), step(1), step(2), gap(3, 9, T0 + 10**9), step(10), step(11)])
        writer.flush()
        events = list(replay(writer.cursor()))
        assert [(type(e).__name__, e.seq) for e in events] == [
            ("NodeHello", 0),
            ("StepEvent", 1),
            ("StepEvent", 2),
            ("Alert", 0),
            ("StepEvent", 10),
            ("StepEvent", 11),
        ]
        alert = events[3]
        assert isinstance(alert, Alert) and alert.code == AlertCode.GAP
        assert (alert.first_seq, alert.last_seq) == (3, 9) and "events 3..9 are missing" in alert.message
        assert alert.time_ns == events[4].time_ns, "at the time the stream resumed"
        assert not [e for e in replay(writer.cursor(), kinds=["step"]) if isinstance(e, Alert)]
        assert not [e for e in replay(writer.cursor(), end_ns=events[4].time_ns) if isinstance(e, Alert)]


# -- version 3 ---------------------------------------------------------------------------------------------------------
def _v2_store(path: Path) -> None:
    """A version-2 store: every table as now but ``gaps`` (version 3 added only that) and the node's shape (version 4),
    a hello and a step."""
    con = duckdb.connect(str(path))
    for table in schema.TABLES:
        con.execute(schema.create_sql(table))
    for column in ("topology", "prefill_units", "lockstep", "instance_size"):
        con.execute(f"ALTER TABLE nodes DROP COLUMN {column}")
    con.execute(
        "INSERT INTO nodes VALUES ('old', ?, 0, ?, 2, 'h100', 'least_loaded', '{}', [], '[]', '[]')", [T0 - 1, T0 - 1]
    )
    for name, cols in schema.META_TABLES.items():
        if name != "gaps":
            con.execute(f"CREATE TABLE {name} ({cols})")
    con.execute("INSERT INTO schema_version VALUES (1, 0), (2, 0)")
    con.execute(
        "INSERT INTO steps VALUES ('old', ?, 1, ?, 0, 0, 1, 1, 'decode', 'vllm', 0, 1, 0, 1, 1, 0, 1, 10, 1, 0, 0, 0, "
        "'{}')",
        [T0, T0],
    )
    con.close()


def test_a_version_2_store_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "v2.duckdb"
    _v2_store(path)
    with pytest.raises(StoreVersionError, match="open it once for writing"):
        connect(path, read_only=True)
    with StoreWriter(path) as writer:  # migrates, then writes a hole beside the old rows
        writer.write([hello(node="old"), msgspec.structs.replace(gap(2, 4), node_id="old")])
    con = connect(path, read_only=True)
    try:
        assert con.execute("SELECT list(version ORDER BY version) FROM schema_version").fetchone() == ([1, 2, 3, 4, 5],)
        assert con.execute("SELECT count(*) FROM nodes WHERE topology IS NULL AND lockstep IS NULL "
                           "AND instance_size IS NULL").fetchone() == (1,)
        fresh = duckdb.connect(":memory:")
        fresh.execute(f"CREATE TABLE gaps ({schema.GAPS_COLUMNS})")
        assert con.execute("DESCRIBE gaps").fetchall() == fresh.execute("DESCRIBE gaps").fetchall()
        fresh.close()
        assert gap_rows(con) == [("old", T0, 2, 4, T0)]
        assert con.execute("SELECT count(*) FROM steps").fetchone() == (1,)
    finally:
        con.close()
    events = list(replay(path))
    assert [type(e).__name__ for e in events] == ["NodeHello", "NodeHello", "StepEvent", "Alert"]
    old, new = events[0], events[1]
    assert isinstance(old, NodeHello) and (old.topology, old.prefill_units, old.lockstep) == ("", 0, False)
    assert isinstance(new, NodeHello) and new.topology == hello(node="old").topology


# -- trackside record against a real agent ----------------------------------------------------------------------------
REPLAY_EVENTS = 200
"""The agent's replay buffer: overtaken in a fraction of a second."""


def test_a_recorder_resumed_after_the_agent_overtook_it_stores_the_hole(tmp_path: Path) -> None:
    db = tmp_path / "record.duckdb"

    async def record_until(server_url: str, stored: Callable[[Event], bool], what: str) -> None:
        """``trackside record``'s recorder on the agent until it has written an event that is ``stored`` (it had 0.3 s
        after the hello, which a loaded machine could spend before the first events after the hole came)."""
        stop = asyncio.Event()
        writers = NotingWriters()
        task = asyncio.create_task(record_agents([server_url], db, stop=stop, flush_s=0.05,
                                                 writer_factory=writers.make))
        await wait_for(lambda: writers.wrote(stored) or task.done(), what=what)
        stop.set()
        await task

    async def go() -> tuple[int, int]:
        hub = make_hub(units=2, workload="poisson:n=20000,rate=40", replay_capacity=REPLAY_EVENTS)
        server = make_server(hub, speed=5.0)
        await server.start()
        try:
            await record_until(server.url, lambda e: e.seq > 0, "the first events recorded")
            stored = max(stored_runs(db)[hub.boot_ns])
            await wait_for(lambda: hub.replay.oldest_seq > stored + 1, what="the agent to overtake the store")
            await record_until(server.url, lambda e: e.seq > stored + 1, "the events after the hole recorded")
        finally:
            await server.stop()
        return stored, hub.boot_ns

    stored, boot_ns = run(go, timeout_s=60)
    seqs = stored_runs(db)[boot_ns]
    con = connect(db, read_only=True)
    try:
        rows = gap_rows(con)
        position = con.execute("SELECT last_seq FROM positions").fetchone()
    finally:
        con.close()
    resumed = [row for row in rows if row[2] == stored + 1]  # (the first recording may have started late too)
    assert resumed, f"the hole after {stored} is a row: {rows}"
    node, boot, first, last, _ = resumed[0]
    assert (node, boot) == ("test-node", boot_ns)
    assert last >= first and min(s for s in seqs if s > stored) == last + 1, "to the last one the agent had lost"
    lost = {s for _, _, a, b, _ in rows for s in range(a, b + 1)}
    assert position is not None and sorted(set(seqs) | lost) == list(range(1, position[0] + 1)), (
        "every position up to the store's is either stored or a row of gaps"
    )
