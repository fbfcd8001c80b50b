"""The Stages screen: the log length axis, stage loads and migration rates on hand-made events, then the screen
driven with Pilot from a replayed store."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from console_fixtures import build_staged_store
from serve_harness import run
from test_console_app import replay_app, replayed, text_of

from agent.telemetry import NodeHello, RequestArrived, RequestMigrated, StageBoundaries, UnitLoadEvent, UnitStatus
from console.model.stages import (
    column_low,
    fmt_tokens,
    fmt_units,
    length_histogram,
    log_column,
    migration_rates,
    migration_trend,
    stage_loads,
    stage_of,
    stage_range,
)
from console.model.state import ConsoleState
from console.screens.stages import NO_STAGES, StagesScreen, stages_heading
from console.widgets.boundary_history import EMPTY, BoundaryHistory, history_rows
from console.widgets.length_chart import LengthChart, length_rows
from console.widgets.migration_panel import REASON_WIDTH, MigrationPanel, migration_rows
from console.widgets.rows import row_text
from console.widgets.stage_load import StageLoadPanel, load_rows

S = 1_000_000_000
T0 = 1_800_000_000 * S
OCTAVES = 13
"""The axis 16..131072 tokens spans 13 octaves: with 13 columns, one column per octave."""


def hello(units: int = 4) -> NodeHello:
    return NodeHello(
        node_id="n1",
        time_ns=T0,
        boot_ns=T0,
        profile="p",
        dispatch_policy="cascade",
        units=tuple(UnitStatus(unit_id=u, mode="active", batch_policy="vllm", num_blocks=100) for u in range(units)),
    )


def stages(t: int, cuts: tuple[int, ...], groups: tuple[tuple[int, ...], ...]) -> StageBoundaries:
    return StageBoundaries(
        node_id="n1", time_ns=t, policy="cascade", boundaries_tokens=cuts, stage_unit_ids=groups, reason="repartition"
    )


def load(unit: int, running: int, waiting: int, kv: int, queued: int) -> UnitLoadEvent:
    return UnitLoadEvent(
        node_id="n1",
        time_ns=T0 + S,
        unit_id=unit,
        dispatch_id=1,
        healthy=True,
        num_running=running,
        num_waiting=waiting,
        kv_used_blocks=kv,
        num_blocks=100,
        kv_tokens=0,
        queued_prefill_tokens=queued,
    )


def migrated(t: int, reason: str) -> RequestMigrated:
    return RequestMigrated(node_id="n1", time_ns=t, request_id=f"r{t}", from_unit_id=0, unit_id=1, reason=reason)


def arrival(t: int, tokens: int) -> RequestArrived:
    return RequestArrived(
        node_id="n1", time_ns=t, request_id=f"a{t}", prompt_tokens=tokens, ttft_slo_ms=500.0, tpot_slo_ms=50.0
    )


# -- the axis --------------------------------------------------------------------------------------------------------
def test_the_log_axis_puts_one_octave_in_each_of_13_columns() -> None:
    assert [log_column(t, OCTAVES) for t in (10, 16, 31, 32, 1023, 1024, 131072, 10**6)] == [0, 0, 0, 1, 5, 6, 12, 12]
    assert column_low(6, OCTAVES) == pytest.approx(1024.0) and column_low(0, OCTAVES) == 16.0
    assert length_histogram([16, 20, 32, 1024, 1500, 200_000], OCTAVES) == [2, 1, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 1]
    assert [stage_of(t, (512, 1024)) for t in (100, 511, 512, 1023, 1024, 9999)] == [0, 0, 1, 1, 2, 2]
    assert stage_of(5, ()) == 0
    assert [fmt_tokens(t) for t in (512, 1024, 131072, 1500)] == ["512", "1k", "128k", "1.5k"]
    assert [stage_range(0, 512), stage_range(512, 1024), stage_range(4096, None), stage_range(0, None)] == [
        "<512",
        "512-1k",
        ">=4k",
        "all",
    ]
    assert fmt_units((2, 3)) == "u2,3" and fmt_units(()) == "-"


def test_length_chart_bars_by_stage_with_the_cuts() -> None:
    rows = length_rows([16] * 4 + [1024] * 2 + [5000], (1024,), 7 + OCTAVES, 4)  # two bar rows
    # counts: 4 in column 0, 2 in column 6 (1024: the cut's column, stage 1), 1 in column 8; scaled to 4 on 2 rows
    assert row_text(rows[0]) == "     4 █     │      "
    assert row_text(rows[1]) == "     0 █     █ █    "
    assert rows[0][1] == ("█", "stage-even") and rows[1][7] == ("█", "stage-odd") and rows[0][7] == ("│", "cut")
    assert row_text(rows[2]) == "cuts         ┴1k    "
    assert row_text(rows[3]) == "tokens 16  256 4k   ", "ticks that fit, each after a blank"
    no_stages = length_rows([100], None, 7 + OCTAVES, 4)
    assert "│" not in row_text(no_stages[0]) and row_text(no_stages[2]).strip() == "cuts"


def test_history_rows_newest_first_with_each_stage_labelled() -> None:
    changes = [stages(T0, (), ((0, 1, 2, 3),)), stages(T0 + 5 * S, (1024,), ((0, 1), (2, 3)))]
    rows = history_rows(changes, T0 + 10 * S, 7 + OCTAVES, 5)
    assert [row_text(r) for r in rows] == ["   -5s ─u0,1─│─u2,3─", "  -10s ──u0,1,2,3───"]
    assert (
        rows[0][7] == ("│", "cut")
        and rows[0][2] == ("u", "stage-even-label")
        and rows[0][9] == ("u", "stage-odd-label")
    )
    assert len(history_rows(changes, T0, 20, 1)) == 1
    assert row_text(history_rows([], T0, 20, 5)[0]) == EMPTY


# -- load and migrations -------------------------------------------------------------------------------------------
def test_stage_loads_sum_their_units_latest_load() -> None:
    state = ConsoleState()
    boundaries = stages(T0 + S, (512,), ((0, 1), (2, 3)))
    state.apply([hello(), load(0, 3, 1, 10, 50), load(1, 5, 0, 30, 0), load(2, 2, 2, 50, 100), boundaries])
    node = state.nodes["n1"]
    assert node.stages is boundaries and list(state.stages.record("n1").changes) == [boundaries]
    first, second = stage_loads(node, boundaries, [100, 200, 600, 5000])
    assert (first.low_tokens, first.high_tokens, first.unit_ids) == (0, 512, (0, 1))
    assert (first.num_running, first.num_waiting, first.queued_prefill_tokens) == (8, 1, 50)
    assert first.kv == pytest.approx(0.2) and first.share == 0.5
    assert (second.low_tokens, second.high_tokens, second.num_running, second.num_waiting) == (512, None, 2, 2)
    assert second.kv == pytest.approx(0.5), "u3 reported nothing: the mean of u2 alone"
    assert second.share == 0.5 and stage_loads(node, boundaries)[0].share is None
    lines = [row_text(r) for r in load_rows(stage_loads(node, boundaries, [100, 200, 600, 5000]))]
    assert lines[1] == "0  <512      u0,1        8    1  20%     50   50%"
    assert row_text(load_rows(None)[0]) == "no stages: no staged dispatcher is running on this node"


def test_migrations_per_second_by_reason_over_the_window() -> None:
    state = ConsoleState(bucket_s=1.0, window_s=30.0)
    times = [(1, "handover:live"), (2, "handover:live"), (2.5, "handover:live"), (3, "rebalance:live")]
    state.apply([hello(), *(migrated(T0 + round(t * S), r) for t, r in times), migrated(T0 + 4 * S, "fault:lost")])
    state.apply([arrival(T0 + 10 * S, 300)])  # the state's time: 10 s after the node was first seen
    record = state.stages.record("n1")
    assert record.num_migrations == 5 and list(record.lengths) == [300]
    rates = migration_rates(record, state.now_ns, state.window_ns, state.bucket_ns, state.nodes["n1"].first_ns)
    assert rates == [("handover:live", 0.3, 3), ("fault:lost", 0.1, 1), ("rebalance:live", 0.1, 1)]
    bucket = T0 // S
    assert migration_trend(record, bucket + 4, 5) == [0.0, 1.0, 2.0, 1.0, 1.0]
    assert migration_trend(record, bucket + 10, 3) == [0.0, 0.0, 0.0]
    lines = [row_text(r) for r in migration_rows(rates, [0.0, 2.0], 30.0, 5)]
    assert lines[:2] == ["migr/s 0.5 · 5 in 30s", "handover:live    0.3/s"]
    assert lines[-1] == "▁█"
    assert row_text(migration_rows([], [], 30.0, 7)[1]) == "none in the window (7 in all)"
    assert "x" not in state.stages.nodes and state.stages.record("x").num_migrations == 0
    assert "x" not in state.stages.nodes, "reading a node's record keeps nothing"


# -- the screen ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_staged_store(tmp_path_factory.mktemp("stages") / "staged.duckdb")


def counted(store: Path, sql: str) -> list[tuple[object, ...]]:
    con = duckdb.connect(str(store), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


class TestStagesScreen:
    def test_a_staged_node_its_lengths_boundaries_load_and_migrations(self, store: Path) -> None:
        async def go() -> None:
            app = replay_app(store)
            async with app.run_test(size=(80, 24)) as pilot:
                await replayed(pilot)
                await pilot.press("5")
                screen = app.screen
                assert app.current_mode == "stages" and isinstance(screen, StagesScreen)
                assert screen.node_id == "node-c", "node-b has no stages: the first node with stages"
                node = app.state.nodes["node-c"]
                assert node.stages is not None
                title = text_of(screen.query_one("#stages-title"))
                assert title == stages_heading(app.state, node) and title.startswith("node-c (2/2) · cascade · ")
                # everything the store holds, once each
                [(num_changes,)] = counted(store, "SELECT count(*) FROM stage_boundaries WHERE node_id = 'node-c'")
                history = screen.query_one(BoundaryHistory)
                assert len(history.changes) == num_changes >= 2 and history.changes[-1] == node.stages
                [(num_arrivals,)] = counted(
                    store, "SELECT count(*) FROM request_events WHERE node_id = 'node-c' AND kind = 'request_arrived'"
                )
                chart = screen.query_one(LengthChart)
                assert len(chart.lengths) == num_arrivals and chart.boundaries == node.stages.boundaries_tokens
                cuts = node.stages.boundaries_tokens
                load = text_of(screen.query_one(StageLoadPanel)).splitlines()
                assert len(load) == 1 + len(cuts) + 1 and load[1].startswith(f"0  <{fmt_tokens(cuts[0])} ")
                by_reason = dict(
                    counted(
                        store,
                        "SELECT reason, count(*) FROM request_events WHERE node_id = 'node-c' "
                        "AND kind = 'request_migrated' GROUP BY reason",
                    )
                )
                whys, hows = ("handover", "rebalance", "starvation"), ("live", "recompute")
                reasons = {f"{why}:{how}" for why in whys for how in hows}
                assert by_reason and set(by_reason) <= reasons
                panel = text_of(screen.query_one(MigrationPanel))
                span_s = (app.state.now_ns - node.first_ns) / 1e9  # under the 30 s window
                assert panel.startswith(f"migr/s {sum(by_reason.values()) / span_s:.3g} · ")
                # Each reason, cut to the panel's label width as the widget cuts it ("rebalance:recomp").
                assert all(reason[: REASON_WIDTH - 1] in panel for reason in by_reason)

        run(go, timeout_s=60)

    def test_a_node_without_a_staged_dispatcher_says_so(self, store: Path) -> None:
        async def go() -> None:
            app = replay_app(store)
            async with app.run_test(size=(80, 24)) as pilot:
                await replayed(pilot)
                await pilot.press("5")
                screen = app.screen
                assert isinstance(screen, StagesScreen) and screen.check_action("cycle_node", (1,))
                await pilot.press("n")
                assert screen.node_id == "node-b"
                title = text_of(screen.query_one("#stages-title"))
                assert title == f"node-b (1/2) · dispatch pab · {NO_STAGES}"
                assert "no staged dispatcher is running" in text_of(screen.query_one(StageLoadPanel))
                assert str(screen.query_one(BoundaryHistory).render()) == EMPTY
                assert screen.query_one(LengthChart).boundaries is None
                assert "none in the window (0 in all)" in text_of(screen.query_one(MigrationPanel))
                await pilot.press("N")
                assert screen.node_id == "node-c"

        run(go, timeout_s=60)
