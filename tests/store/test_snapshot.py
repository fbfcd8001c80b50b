"""A node's window copied out of a store into a file of its own (``store.snapshot.copy_window``), against real DuckDB
files: from a store opened read-only and from a cursor of a live writer, only that node's rows from the window's
start (its hellos whatever their time, its positions and gaps), a file that opens read-only as a store."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from test_store import NODE, T0, count, hello, mixed_stream, step

from agent.telemetry import Alert, AlertCode
from store.schema import SCHEMA_VERSION, TABLES, StoreError, connect
from store.snapshot import copy_window
from store.writer import StoreWriter

OTHER = "node-b"


def two_nodes(path: Path | str) -> StoreWriter:
    """A writer on ``path`` holding both nodes' streams (node-a's with a gap), committed."""
    writer = StoreWriter(path)
    writer.write(mixed_stream(NODE, T0))
    writer.write([step(18, node=NODE), Alert(node_id=NODE, time_ns=T0 + 30, code=AlertCode.GAP, message="lost",
                                             first_seq=19, last_seq=25), step(26, node=NODE)])
    writer.write(mixed_stream(OTHER, T0 + 5))
    writer.flush()
    return writer


def rows_of(con: duckdb.DuckDBPyConnection, table: str, where: str = "") -> list[tuple[object, ...]]:
    return con.execute(f"SELECT * FROM {table} {where} ORDER BY ALL").fetchall()


def test_the_whole_node_is_copied_and_nothing_of_another(tmp_path: Path) -> None:
    with two_nodes(tmp_path / "src.duckdb"):
        pass
    source = connect(tmp_path / "src.duckdb", read_only=True)  # a replay's connection: read-only
    try:
        copied = copy_window(source, tmp_path / "window.duckdb", node_id=NODE)
        copy = connect(tmp_path / "window.duckdb", read_only=True)
        try:
            expected = 0
            for table in TABLES:
                mine = "WHERE node_id = 'node-a'"
                assert rows_of(copy, table) == rows_of(source, table, mine), table
                expected += len(rows_of(source, table, mine))
            assert copied == expected > 0
            for table in ("positions", "gaps"):
                assert rows_of(copy, table) == rows_of(source, table, "WHERE node_id = 'node-a'") != [], table
            assert copy.execute("SELECT max(version) FROM schema_version").fetchone() == (SCHEMA_VERSION,)
        finally:
            copy.close()
        assert {row[0] for row in source.execute("SELECT database_name FROM duckdb_databases()").fetchall()} == {
            "src", "system", "temp"}, "the copy is detached"
    finally:
        source.close()


def test_a_window_keeps_the_hello_and_the_rows_from_its_start_from_a_live_writer(tmp_path: Path) -> None:
    with two_nodes(tmp_path / "live.duckdb") as writer:
        writer.write([step(27, node=NODE)])  # written, not committed: a cursor sees only what is committed
        start_ns = T0 + 3_000_000  # after step 2 (2 ms) and every other event of the stream (ns after T0)
        copied = copy_window(writer.cursor(), tmp_path / "w.duckdb", node_id=NODE, start_ns=start_ns)
        writer.flush()
    copy = connect(tmp_path / "w.duckdb", read_only=True)
    try:
        assert count(copy, "nodes") == 1 and rows_of(copy, "nodes")[0][0] == NODE, "the hello, older than the window"
        times = [t for table in TABLES if table != "nodes" for (t,) in rows_of(copy, f"(SELECT time_ns FROM {table})")]
        assert times and min(times) >= start_ns
        assert [s for (s,) in copy.sql("SELECT seq FROM steps ORDER BY 1").fetchall()] == [17, 18, 26], (
            "not step 2 (before the window), not 27 (not committed)"
        )
        assert count(copy, "slack_samples") == count(copy, "audits") == count(copy, "requests") == 0
        assert copied == sum(count(copy, table) for table in TABLES)
        assert rows_of(copy, "(SELECT DISTINCT node_id FROM steps)") == [(NODE,)]
    finally:
        copy.close()


def test_an_existing_destination_is_refused_and_a_failed_copy_leaves_no_file(tmp_path: Path) -> None:
    dest = tmp_path / "w.duckdb"
    dest.write_text("not mine")
    with StoreWriter(":memory:") as writer:
        writer.write([hello(), step(1)])
        writer.flush()
        with pytest.raises(StoreError, match="exists"):
            copy_window(writer.cursor(), dest, node_id=NODE)
        assert dest.read_text() == "not mine"
        con = duckdb.connect(":memory:")  # not a store: the copy fails, its new file is removed
        with pytest.raises(StoreError, match="cannot copy node-a's window"):
            copy_window(con, tmp_path / "other.duckdb", node_id=NODE)
        assert not (tmp_path / "other.duckdb").exists()
