"""The store's writer, schema and replay against real DuckDB files and ``:memory:``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import msgspec
import pytest

from agent.telemetry import (
    Alert,
    ControlAudit,
    Event,
    NodeHello,
    ParamSchema,
    PolicySchema,
    RequestArrived,
    RequestDispatched,
    RequestFinished,
    RequestFirstToken,
    RequestMigrated,
    RequestPreempted,
    RequestRefused,
    Setting,
    SlackPoint,
    SlackSample,
    StageBoundaries,
    StepEvent,
    UnitLoadEvent,
    UnitStatus,
)
from policies.types import StepMode
from store import schema
from store.convert import ROUTES
from store.replay import areplay, replay
from store.schema import StoreError, StoreLockedError, StoreVersionError, connect
from store.writer import CONVERT_ROWS, StoreWriteError, StoreWriter

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000_000_000_000
NODE = "node-a"


def hello(node: str = NODE, boot_ns: int = T0, seq: int = 0) -> NodeHello:
    return NodeHello(
        seq=seq, node_id=node, time_ns=boot_ns, boot_ns=boot_ns, profile="h100-llama31-8b",
        units=(UnitStatus(unit_id=0, batch_policy="vllm", batch_params={"budget": 2048}, num_blocks=100),
               UnitStatus(unit_id=1, mode="draining", batch_policy="sarathi")),
        dispatch_policy="least_loaded", dispatch_params={"alpha": 0.5, "on": True},
        batch_policies=(PolicySchema(name="vllm", params=(ParamSchema(name="budget", type="int", default=2048,
                                                                      min=1.0),)),),
        topology="disaggregated", prefill_units=2, instance_size=2,
    )


def step(seq: int, unit_id: int = 0, node: str = NODE, *, policy: str = "vllm", measured_ns: int = 10_000_000,
         time_ns: int | None = None) -> StepEvent:
    return StepEvent(
        seq=seq, node_id=node, time_ns=T0 + seq * 1_000_000 if time_ns is None else time_ns, unit_id=unit_id,
        step_id=seq, measured_ns=measured_ns, predicted_ns=measured_ns + 1000, mode=StepMode.MIXED, policy=policy,
        num_prefill_tokens=100, num_decode_tokens=seq % 7, num_prefill_reqs=1, num_decode_reqs=seq % 7,
        context_tokens=500, budget_tokens=2048, kv_used_blocks=seq % 50, num_blocks=100, num_running=3,
        num_waiting=1, num_preempted=0, num_finished=seq % 2,
        reasons={"budget_tokens": 2048, "theta": 0.25, "limit": "inf", "greedy": True} if seq % 3 else {},
    )


def mixed_stream(node: str = NODE, boot_ns: int = T0) -> list[Event]:
    """One event of every kind, in stream order (seq 1..), with the corner cases the store must keep."""
    t = boot_ns
    events: list[Event] = [
        hello(node, boot_ns, seq=1),
        step(2, node=node),
        RequestArrived(seq=3, node_id=node, time_ns=t + 3, request_id="r1", prompt_tokens=10, ttft_slo_ms=500.0,
                       tpot_slo_ms=50.0),
        RequestDispatched(seq=4, node_id=node, time_ns=t + 4, request_id="r1", unit_id=1, num_rounds_waited=2),
        UnitLoadEvent(seq=5, node_id=node, time_ns=t + 5, unit_id=1, dispatch_id=7, healthy=True, num_running=4,
                      num_waiting=0, kv_used_blocks=10, num_blocks=100, kv_tokens=160, queued_prefill_tokens=0,
                      pab_tokens=12.5, mean_step_ns=9_000_000),
        RequestFirstToken(seq=6, node_id=node, time_ns=t + 6, request_id="r1", unit_id=1, ttft_ms=12.25),
        RequestPreempted(seq=7, node_id=node, time_ns=t + 7, request_id="r1", unit_id=1, step_id=9),
        RequestMigrated(seq=8, node_id=node, time_ns=t + 8, request_id="r1", from_unit_id=1, unit_id=0,
                        reason="drain"),
        RequestFinished(seq=9, node_id=node, time_ns=t + 9, request_id="r1", unit_id=0, arrival_ns=t + 3,
                        first_token_ns=t + 6, prompt_tokens=10, output_tokens=1, num_preemptions=1, ttft_ms=12.25,
                        tpot_ms=None, ttft_slo_ms=500.0, tpot_slo_ms=50.0, met_slo=True),
        RequestRefused(seq=10, node_id=node, time_ns=t + 10, request_id="r2", policy="pab", reason="over budget"),
        RequestRefused(seq=11, node_id=node, time_ns=t + 11, request_id="r3", unit_id=1, policy="eb"),
        SlackSample(seq=12, node_id=node, time_ns=t + 12, unit_id=0, sample_period_ms=100.0, requests=(
            SlackPoint(request_id="r4", deadline_ns=t + 99, slack_ms=-1.5, output_tokens=3, computed_tokens=40),
            SlackPoint(request_id="r5", deadline_ns=t + 98, slack_ms=2.0, output_tokens=0, computed_tokens=8),
        )),
        SlackSample(seq=13, node_id=node, time_ns=t + 13, unit_id=1, sample_period_ms=100.0, requests=()),
        StageBoundaries(seq=14, node_id=node, time_ns=t + 14, policy="cascade", boundaries_tokens=(1024, 8192),
                        stage_unit_ids=((0,), (1,), ()), reason="rebalance"),
        ControlAudit(seq=15, node_id=node, time_ns=t + 15, actor="op", control_id="c1", action="set_params",
                     unit_ids=(0, 1), old=(Setting(unit_id=0, params={"budget": 2048}),),
                     new=(Setting(unit_id=0, params={"budget": 4096, "ratio": 0.5}),), result="applied"),
        Alert(seq=16, node_id=node, time_ns=t + 16, code="slo_breach", severity="error", unit_id=1, message="late"),
        step(17, unit_id=1, node=node, policy="sarathi"),
    ]
    assert {type(e) for e in events} == set(ROUTES)
    return events


def count(con: duckdb.DuckDBPyConnection, table: str) -> int:
    row = con.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


# -- write and read back -------------------------------------------------------------------------------------
def test_every_event_kind_replays_equal_from_a_file(tmp_path: Path) -> None:
    events = mixed_stream()
    with StoreWriter(tmp_path / "s.duckdb", batch_rows=4) as writer:
        writer.write(events)
    assert list(replay(tmp_path / "s.duckdb")) == events


def test_replay_merges_nodes_and_runs_in_stream_order() -> None:
    a1, b, a2 = mixed_stream("a", T0), mixed_stream("b", T0 + 5), mixed_stream("a", T0 + 10)
    with StoreWriter(":memory:") as writer:
        writer.write([e for pair in zip(b, a1, strict=True) for e in pair])  # interleaved on the wire
        writer.write(a2)
        writer.flush()
        assert list(replay(writer.cursor())) == a1 + a2 + b


def test_replay_filters_kinds_units_and_time() -> None:
    events = mixed_stream()
    with StoreWriter(":memory:") as writer:
        writer.write(events)
        writer.flush()
        con = writer.cursor()
        kinds = {"step", "request_refused", "request_finished"}
        assert list(replay(con, kinds=kinds)) == [e for e in events if e.__struct_config__.tag in kinds]
        unit0 = list(replay(con, unit_ids=[0]))
        tags = [e.__struct_config__.tag for e in unit0]
        assert "hello" in tags and "stage_boundaries" in tags  # node-level events always pass
        assert all(getattr(e, "unit_id", 0) in (0, None) or isinstance(e, RequestMigrated) for e in unit0)
        assert events[10] not in unit0 and events[9] in unit0  # refused by unit 1 / by the dispatcher
        window = list(replay(con, start_ns=T0 + 5, end_ns=T0 + 9))
        assert [e.seq for e in window] == [5, 6, 7, 8]
        with pytest.raises(ValueError, match="unknown event kinds"):
            list(replay(con, kinds=["stepz"]))


def test_async_replay_paces_by_event_time() -> None:
    events = [step(i, time_ns=T0 + i * 1_000_000_000) for i in (1, 2, 4)]
    waits: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)

    async def collect(con: duckdb.DuckDBPyConnection) -> list[Event]:
        return [e async for e in areplay(con, speed=2.0, sleep=fake_sleep)]

    with StoreWriter(":memory:") as writer:
        writer.write(events)
        writer.flush()
        assert asyncio.run(collect(writer.cursor())) == events
    assert waits == [0.5, 1.0]


# -- duplicates, resume, runs --------------------------------------------------------------------------------
def test_rewriting_the_same_positions_stores_each_once() -> None:
    events = mixed_stream()
    with StoreWriter(":memory:", batch_rows=1000) as writer:
        writer.write(events)
        writer.write(events)  # the same events again, before a commit
        writer.flush()
        writer.write(events[3:12])  # a resume that overlaps what is committed
        writer.write([step(17, unit_id=1, policy="sarathi")] * 3)
        writer.flush()
        assert list(replay(writer.cursor())) == events
        con = writer.cursor()
        assert count(con, "requests") == 3 and count(con, "request_events") == 7 and count(con, "slack_samples") == 3
        assert writer.last_seq(NODE) == 17
    with StoreWriter(":memory:", batch_rows=5) as writer:  # commits inside each write
        for _ in range(3):
            writer.write(events)
        writer.flush()
        assert list(replay(writer.cursor())) == events


def test_gap_fill_below_the_high_water_mark_is_stored() -> None:
    with StoreWriter(":memory:", batch_rows=1000) as writer:
        writer.write([step(i) for i in [1, 2, 3, 8, 9, 10]])
        writer.flush()
        writer.write([step(i) for i in [4, 5, 6, 7, 8]])  # a resume fetching the dropped range
        writer.flush()
        rows = writer.cursor().execute("SELECT seq FROM steps ORDER BY seq").fetchall()
        assert [r[0] for r in rows] == list(range(1, 11))


def test_a_restarted_agent_starts_a_new_run_with_its_own_positions(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    with StoreWriter(path) as writer:
        writer.write([hello(boot_ns=T0), *(step(i) for i in range(1, 21))])
        writer.flush()
        assert writer.last_seq(NODE) == 20
        writer.write([hello(boot_ns=T0 + 10**12), *(step(i) for i in range(1, 6))])  # seq restarts at 1
        assert writer.last_seq(NODE) == 0  # nothing of the new run committed yet
        writer.flush()
        assert writer.last_seq(NODE) == 5 and writer.last_seq("unknown") == 0
    with StoreWriter(path) as reopened:
        assert reopened.last_seq(NODE) == 5
        con = reopened.cursor()
        assert count(con, "steps") == 25 and count(con, "nodes") == 2
        reopened.write([step(i) for i in range(3, 8)])  # belongs to the latest run
        reopened.flush()
        assert reopened.last_seq(NODE) == 7 and count(con, "steps") == 27
        # The recorder asks by run: the old run's position is still known, a new run starts at 0.
        assert reopened.last_seq(NODE, T0) == 20 and reopened.last_seq(NODE, T0 + 10**12) == 7
        assert reopened.last_seq(NODE, T0 + 2 * 10**12) == 0
        # A hello seen again on a reconnect does not add a run.
        reopened.write([hello(boot_ns=T0 + 10**12)])
        reopened.flush()
        assert count(con, "nodes") == 2 and reopened.last_seq(NODE) == 7


def finished(seq: int, unit_id: int, node: str = NODE) -> RequestFinished:
    return RequestFinished(
        seq=seq, node_id=node, time_ns=T0 + seq, request_id=f"r{seq}", unit_id=unit_id, arrival_ns=T0,
        first_token_ns=T0 + 1, prompt_tokens=1, output_tokens=2, num_preemptions=0, ttft_ms=1.0, tpot_ms=2.0,
        ttft_slo_ms=5.0, tpot_slo_ms=5.0, met_slo=True,
    )


def test_finished_requests_count_for_their_units_policy_at_the_time(tmp_path: Path) -> None:
    path = tmp_path / "policy.duckdb"
    with StoreWriter(path) as writer:
        writer.write([
            hello(seq=1), finished(2, 1),  # before any step: the hello's policy of unit 1
            step(3, 0, policy="vllm"), finished(4, 0),
            step(5, 0, policy="eb"), finished(6, 0),  # after a swap
            RequestRefused(seq=7, node_id=NODE, time_ns=T0 + 7, request_id="x", policy="pab"),
        ])
    with StoreWriter(path) as writer:  # a reopened writer takes the unit's policy from the stored steps
        writer.write([finished(8, 0), finished(9, 3)])
        writer.flush()
        rows = writer.cursor().execute("SELECT seq, policy, refused FROM requests ORDER BY seq").fetchall()
    assert rows == [(2, "sarathi", False), (4, "vllm", False), (6, "eb", False), (7, "pab", True),
                    (8, "eb", False), (9, None, False)]


def test_notices_with_seq_zero_are_always_kept() -> None:
    notice = Alert(node_id=NODE, time_ns=T0, code="flow_control", message="dropped 7", num_dropped=7)
    with StoreWriter(":memory:") as writer:  # a gap alert is a row of gaps instead (tests/store/test_gaps.py)
        writer.write([step(1), notice, step(2), msgspec.structs.replace(notice, time_ns=T0 + 1)])
        writer.flush()
        assert count(writer.cursor(), "alerts") == 2 and writer.last_seq(NODE) == 2


def test_a_failed_commit_stores_nothing_of_its_batch_and_says_where_to_resume() -> None:
    with StoreWriter(":memory:") as writer:
        writer.write([step(i) for i in range(1, 4)])
        writer.flush()
        writer.write([step(4), step(5, measured_ns=2**70)])  # beyond BIGINT
        with pytest.raises(StoreWriteError, match="nothing of them was stored"):
            writer.flush()
        assert writer.last_seq(NODE) == 3 and count(writer.cursor(), "steps") == 3 and writer.num_pending == 0
        writer.write([step(4), step(5)])
        writer.flush()
        assert writer.last_seq(NODE) == 5


def test_an_event_that_cannot_be_converted_fails_its_batch_in_the_write_that_converts_it() -> None:
    with StoreWriter(":memory:") as writer:
        writer.write([step(i) for i in range(1, 4)])
        writer.flush()
        bad = [step(i) for i in range(4, 4 + CONVERT_ROWS)]
        bad[7] = step(11, measured_ns=2**70)  # beyond BIGINT
        with pytest.raises(StoreWriteError, match="nothing of them was stored"):
            writer.write(bad)
        assert writer.last_seq(NODE) == 3 and writer.num_pending == 0
        writer.write([step(4), step(5)])
        writer.flush()
        assert writer.last_seq(NODE) == 5 and count(writer.cursor(), "steps") == 5


def test_batches_commit_on_their_own_and_writes_are_columnar() -> None:
    with StoreWriter(":memory:", batch_rows=10) as writer:
        writer.write([step(i) for i in range(1, 10)])
        assert writer.num_pending == 9 and writer.last_seq(NODE) == 0
        writer.write([step(10)])
        assert writer.num_pending == 0 and writer.last_seq(NODE) == 10
        with pytest.raises(TypeError, match="not a protocol event"):
            writer.write([Setting()])  # type: ignore[list-item]


def test_prune_deletes_old_rows_but_keeps_hellos_and_positions() -> None:
    with StoreWriter(":memory:") as writer:
        writer.write([hello(seq=1), *(step(i) for i in range(2, 12))])
        deleted = writer.prune(T0 + 7 * 1_000_000)  # steps 2..6 started before
        con = writer.cursor()
        assert deleted == 5 and count(con, "steps") == 5 and count(con, "nodes") == 1
        assert writer.last_seq(NODE) == 11


def test_closed_writer_refuses_work() -> None:
    writer = StoreWriter(":memory:")
    writer.close()
    writer.close()
    with pytest.raises(StoreError, match="closed"):
        writer.write([step(1)])


# -- durability and other processes --------------------------------------------------------------------------
CHILD = """
import os, sys
sys.path.insert(0, {tests!r})
from test_store import step, NODE
from store.writer import StoreWriter
writer = StoreWriter({path!r}, batch_rows=1_000_000)
writer.write([step(i) for i in range(1, 501)])
writer.flush()
writer.write([step(i) for i in range(501, 601)])  # written, never committed
print("flushed", writer.last_seq(NODE), flush=True)
sys.stdin.readline()
os._exit(0)  # killed: no close, no checkpoint
"""


def test_a_killed_writer_loses_nothing_it_reported_committed(tmp_path: Path) -> None:
    path = tmp_path / "kill.duckdb"
    code = textwrap.dedent(CHILD.format(tests=str(Path(__file__).resolve().parent), path=str(path)))
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().split() == ["flushed", "500"]
        with pytest.raises(StoreLockedError, match="open for writing by another process"):
            connect(path, read_only=True)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
    con = connect(path, read_only=True)
    assert count(con, "steps") == 500
    con.close()
    with StoreWriter(path) as writer:
        assert writer.last_seq(NODE) == 500


# -- schema version ------------------------------------------------------------------------------------------
def _set_version(path: Path, version: int) -> None:
    con = connect(path)
    con.execute("DELETE FROM schema_version")
    con.execute("INSERT INTO schema_version VALUES (?, 0)", [version])
    con.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.duckdb"
    _set_version(path, schema.SCHEMA_VERSION + 1)
    for read_only in (False, True):
        with pytest.raises(StoreVersionError, match="newer than this trackside knows"):
            connect(path, read_only=read_only)


def test_an_older_schema_is_migrated_or_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "old.duckdb"
    current = schema.SCHEMA_VERSION
    _set_version(path, current)
    monkeypatch.setattr(schema, "SCHEMA_VERSION", current + 1)
    with pytest.raises(StoreVersionError, match=f"no migration from version {current} to {current + 1}"):
        StoreWriter(path)

    def add_column(con: duckdb.DuckDBPyConnection) -> None:
        con.execute("ALTER TABLE alerts ADD COLUMN extra BIGINT")

    monkeypatch.setitem(schema.MIGRATIONS, current, add_column)
    with pytest.raises(StoreVersionError, match="open it once for writing"):
        connect(path, read_only=True)
    StoreWriter(path).close()
    con = connect(path, read_only=True)
    assert con.execute("SELECT max(version) FROM schema_version").fetchone() == (current + 1,)
    assert "extra" in {r[0] for r in con.execute("DESCRIBE alerts").fetchall()}
    con.close()


def test_files_that_are_not_stores_give_clear_errors(tmp_path: Path) -> None:
    other = tmp_path / "other.duckdb"
    con = duckdb.connect(str(other))
    con.execute("CREATE TABLE t (a INTEGER)")
    con.close()
    with pytest.raises(StoreError, match="not a trackside store"):
        StoreWriter(other)
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(os.urandom(8192))
    with pytest.raises(StoreError, match="cannot open"):
        connect(junk)
    with pytest.raises(StoreError, match="no database at"):
        connect(tmp_path / "missing.duckdb", read_only=True)


# -- schema version 2: the worst per-token TPOT, the units' placement ---------------------------------------------
V1_NODES = (
    "CREATE TABLE nodes (node_id VARCHAR NOT NULL, boot_ns BIGINT NOT NULL, seq BIGINT NOT NULL, time_ns BIGINT NOT "
    "NULL, protocol_version BIGINT NOT NULL, profile VARCHAR NOT NULL, dispatch_policy VARCHAR NOT NULL, "
    "dispatch_params VARCHAR NOT NULL, units STRUCT(unit_id BIGINT, mode VARCHAR, batch_policy VARCHAR, batch_params "
    "VARCHAR, num_blocks BIGINT, max_num_seqs BIGINT, num_running BIGINT, num_waiting BIGINT)[] NOT NULL, "
    "batch_policies VARCHAR NOT NULL, dispatch_policies VARCHAR NOT NULL)"
)
V1_REQUESTS = (
    "CREATE TABLE requests (node_id VARCHAR NOT NULL, boot_ns BIGINT NOT NULL, seq BIGINT NOT NULL, time_ns BIGINT "
    "NOT NULL, request_id VARCHAR NOT NULL, unit_id BIGINT, refused BOOLEAN NOT NULL, arrival_ns BIGINT, "
    "first_token_ns BIGINT, prompt_tokens BIGINT, output_tokens BIGINT, num_preemptions BIGINT, ttft_ms DOUBLE, "
    "tpot_ms DOUBLE, ttft_slo_ms DOUBLE, tpot_slo_ms DOUBLE, met_slo BOOLEAN NOT NULL, policy VARCHAR, reason VARCHAR)"
)
"""The two tables version 2 changed, as version 1 created them (``store.schema.create_sql`` at 699f9f3)."""


def _v1_store(path: Path) -> None:
    """A version-1 store: the other tables as now (unchanged since), ``nodes`` and ``requests`` as they were, one
    hello and two finished requests in them."""
    con = duckdb.connect(str(path))
    for table in schema.TABLES:
        con.execute({"nodes": V1_NODES, "requests": V1_REQUESTS}.get(table) or schema.create_sql(table))
    for name, cols in schema.META_TABLES.items():
        if name != "gaps":  # since version 3
            con.execute(f"CREATE TABLE {name} ({cols})")
    con.execute("INSERT INTO schema_version VALUES (1, 0)")
    con.execute(
        "INSERT INTO nodes VALUES ('old', ?, 1, ?, 2, 'h100-llama31-8b', 'least_loaded', '{}', [{'unit_id': 0, "
        "'mode': 'active', 'batch_policy': 'vllm', 'batch_params': '{}', 'num_blocks': 100, 'max_num_seqs': 8, "
        "'num_running': 0, 'num_waiting': 0}], '[]', '[]')", [T0, T0])
    for seq, tokens, tpot in ((2, 11, 40.0), (3, 1, None)):
        con.execute("INSERT INTO requests VALUES ('old', ?, ?, ?, ?, 0, false, ?, ?, 10, ?, 0, 100.0, ?, 500.0, 50.0, "
                    "true, 'vllm', NULL)", [T0, seq, T0 + seq * 10**9, f"r{seq}", T0, T0 + 10**8, tokens, tpot])
    con.close()


def test_a_version_1_store_is_migrated_and_replays(tmp_path: Path) -> None:
    path = tmp_path / "v1.duckdb"
    _v1_store(path)
    with pytest.raises(StoreVersionError, match="open it once for writing"):
        connect(path, read_only=True)
    new_hello = NodeHello(
        seq=1, node_id="new", time_ns=T0, boot_ns=T0, profile="Llama-3.1-8B", dispatch_policy="least_loaded",
        units=(UnitStatus(unit_id=0, batch_policy="vllm", gpu_ids=(4, 5), tensor_parallel_size=2,
                          pipeline_parallel_size=1),),
    )
    with StoreWriter(path) as writer:  # migrates, then writes version-2 rows beside the old ones
        writer.write([new_hello])
    con = connect(path, read_only=True)
    try:
        assert con.execute("SELECT list(version ORDER BY version) FROM schema_version").fetchone() == ([1, 2, 3, 4, 5],)
        for table in schema.TABLES:  # the migrated tables have the columns a new store has (names and types)
            fresh = duckdb.connect(":memory:")
            fresh.execute(schema.create_sql(table))
            assert con.execute(f"DESCRIBE {table}").fetchall() == fresh.execute(f"DESCRIBE {table}").fetchall(), table
            fresh.close()
        assert con.execute("SELECT max_tpot_ms FROM requests ORDER BY seq").fetchall() == [(None,), (None,)]
    finally:
        con.close()
    events = list(replay(path))
    old = [e for e in events if e.node_id == "old"]
    assert isinstance(old[0], NodeHello) and old[0].units[0].gpu_ids == () and old[0].units[0].num_blocks == 100
    assert old[0].units[0].tensor_parallel_size == old[0].units[0].pipeline_parallel_size == 0
    assert [(e.request_id, e.tpot_ms, e.max_tpot_ms) for e in old[1:] if isinstance(e, RequestFinished)] == [
        ("r2", 40.0, None), ("r3", None, None)]
    assert [e for e in events if e.node_id == "new"] == [new_hello]


def test_the_worst_tpot_and_the_units_placement_replay_equal(tmp_path: Path) -> None:
    placed = hello()
    first = msgspec.structs.replace(placed.units[0], gpu_ids=(0, 1, 2, 3), tensor_parallel_size=2,
                                    pipeline_parallel_size=2)
    placed = msgspec.structs.replace(placed, units=(first, placed.units[1]))
    finished = RequestFinished(seq=2, node_id=NODE, time_ns=T0 + 9, request_id="r1", unit_id=0, arrival_ns=T0,
                               first_token_ns=T0 + 6, prompt_tokens=10, output_tokens=5, num_preemptions=0,
                               ttft_ms=6e-6, tpot_ms=40.0, ttft_slo_ms=500.0, tpot_slo_ms=50.0, met_slo=False,
                               max_tpot_ms=120.0)
    with StoreWriter(tmp_path / "s.duckdb") as writer:
        writer.write([placed, finished])
    back = list(replay(tmp_path / "s.duckdb"))
    assert back == [placed, finished]
    assert isinstance(back[0], NodeHello) and back[0].units[0].gpu_ids == (0, 1, 2, 3)
