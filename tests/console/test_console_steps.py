"""The Steps screen: the per-unit step log and its pure queries on hand-made steps, then the screen driven with
Pilot from a replayed store."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
from console_fixtures import build_staged_store
from serve_harness import run
from test_console_app import replay_app, replayed, text_of

from agent.telemetry import StepEvent
from console.model.render import sparkline
from console.model.state import ConsoleState
from console.model.steps import (
    MODE_GLYPHS,
    StepLog,
    bar_rows,
    fmt_reason,
    level_row,
    move_cursor,
    prediction_error,
    reason_lines,
    step_index,
    step_stats,
    step_window,
)
from console.screens.help import HelpScreen
from console.screens.steps import StepsScreen
from console.widgets.rows import row_text
from console.widgets.step_detail import StepDetail, detail_rows
from console.widgets.step_timeline import StepTimeline, timeline_rows
from policies.types import ReasonValue, StepMode

S = 1_000_000_000
T0 = 1_800_000_000 * S


def step(
    i: int,
    *,
    unit: int = 0,
    node: str = "n1",
    prefill: int = 0,
    decode: int = 10,
    budget: int = 100,
    predicted_ms: float = 10.0,
    measured_ms: float = 11.0,
    mode: StepMode = StepMode.DECODE,
    reasons: Mapping[str, ReasonValue] | None = None,
) -> StepEvent:
    """Step ``i`` of a unit, starting at ``T0 + i`` ms."""
    return StepEvent(
        node_id=node,
        time_ns=T0 + i * 1_000_000,
        unit_id=unit,
        step_id=i,
        measured_ns=round(measured_ms * 1e6),
        predicted_ns=round(predicted_ms * 1e6),
        mode=mode,
        policy="fairbatching",
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        num_prefill_reqs=1 if prefill else 0,
        num_decode_reqs=decode,
        context_tokens=1000,
        budget_tokens=budget,
        kv_used_blocks=25,
        num_blocks=100,
        num_running=decode,
        num_waiting=2,
        num_preempted=0,
        num_finished=1,
        reasons=dict(reasons or {}),
    )


# -- the log ---------------------------------------------------------------------------------------------------------
def test_the_state_keeps_the_latest_steps_of_each_unit() -> None:
    state = ConsoleState(max_steps=3)
    state.apply([step(i) for i in range(1, 6)] + [step(9, unit=1), step(7, node="n2")])
    assert [s.step_id for s in state.steps.steps("n1", 0)] == [3, 4, 5]
    assert [s.step_id for s in state.steps.steps("n1", 1)] == [9]
    assert [s.step_id for s in state.steps.steps("n2", 0)] == [7]
    assert state.steps.steps("n1", 5) == () and state.steps.latest("n1", 5) is None
    latest = state.steps.latest("n1", 0)
    assert latest is not None and latest.step_id == 5
    assert state.steps.num_steps == 7
    with pytest.raises(ValueError):
        StepLog(0)


def test_the_cursor_is_a_step_start_and_none_follows_the_newest() -> None:
    steps = [step(i) for i in (10, 20, 30, 40)]
    t = {i: T0 + i * 1_000_000 for i in (10, 20, 30, 40)}
    assert step_index(steps, None) == 3 and step_index([], None) == -1
    assert step_index(steps, t[20]) == 1
    assert step_index(steps, t[20] + 5) == 1, "between two steps: the one before"
    assert step_index(steps, T0) == 0, "a step no longer held: the oldest"
    assert move_cursor(steps, None, -1) == t[30]
    assert move_cursor(steps, t[30], 1) is None, "reaching the newest follows again"
    assert move_cursor(steps, None, -10) == t[10]
    assert move_cursor(steps, t[10], -1) == t[10], "clamped at the oldest"
    assert move_cursor(steps, None, 5) is None and move_cursor([], None, -1) is None


def test_the_window_ends_at_the_newest_or_starts_at_the_cursor() -> None:
    steps = [step(i, prefill=10 * i, decode=5) for i in range(10)]  # tokens 5, 15, ..., 95
    follow = step_window(steps, 4, None)
    assert follow.first == 6 and [s.step_id for s in follow.steps] == [6, 7, 8, 9] and follow.cursor == 3
    assert follow.top_tokens == 100.0, "nice ceiling of 95"
    assert follow.top_ms == 11.0
    back = step_window(steps, 4, steps[2].time_ns)
    assert back.first == 2 and back.cursor == 0 and [s.step_id for s in back.steps] == [2, 3, 4, 5]
    assert back.top_tokens == 100.0  # 55 -> 100 (1, 2, 2.5, 5 times a power of ten)
    inside = step_window(steps, 4, steps[7].time_ns)
    assert inside.first == 6 and inside.cursor == 1
    empty = step_window([], 4, None)
    assert empty.steps == () and empty.cursor == -1


def test_bars_levels_and_prediction_error() -> None:
    assert bar_rows(0, 50, 100, 10) == (5, 0)
    assert bar_rows(30, 20, 100, 10) == (2, 3)
    assert bar_rows(1, 99, 100, 10) == (9, 1), "a small prefill still gets its row"
    assert bar_rows(99, 1, 100, 10) == (1, 9), "and a small decode"
    assert bar_rows(1, 2, 100, 10) == (1, 0), "one row: the larger part"
    assert bar_rows(300, 0, 100, 4) == (0, 4), "clipped at the top"
    assert bar_rows(0, 0, 100, 10) == (0, 0)
    assert level_row(50, 100, 10) == 5 and level_row(100, 100, 10) == 10 and level_row(4, 100, 10) == 1
    assert level_row(101, 100, 10) is None and level_row(0, 100, 10) is None
    assert prediction_error(step(1, predicted_ms=10, measured_ms=11)) == pytest.approx(0.1)
    assert prediction_error(step(1, predicted_ms=0)) is None
    stats = step_stats(
        [
            step(1, mode=StepMode.MIXED, prefill=20, predicted_ms=10, measured_ms=12),
            step(2, predicted_ms=10, measured_ms=9),
            step(3, predicted_ms=0),
        ]
    )
    assert stats.num_by_mode == {"mixed": 1, "prefill": 0, "decode": 2, "idle": 0}
    assert stats.mean_abs_error == pytest.approx(0.15) and stats.mean_tokens == pytest.approx(50 / 3)


def test_reasons_in_the_policy_order() -> None:
    reasons = {
        "urgent_decodes": 3,
        "admission_blocked_by_kv": True,
        "time_budget_ms": 556.771,
        "min_slack_ms": "inf",
        "pab": 12.5,
    }
    assert reason_lines(reasons) == [
        ("urgent_decodes", "3"),
        ("admission_blocked_by_kv", "yes"),
        ("time_budget_ms", "557"),
        ("min_slack_ms", "inf"),
        ("pab", "12.5"),
    ]
    assert fmt_reason(False) == "no" and fmt_reason(0.5) == "0.5"


def test_timeline_rows_stack_decode_under_prefill_with_the_budget() -> None:
    steps = [
        step(1, prefill=0, decode=40, budget=100, mode=StepMode.DECODE, measured_ms=10, predicted_ms=5),
        step(2, prefill=60, decode=20, budget=100, mode=StepMode.MIXED, measured_ms=20, predicted_ms=20),
    ]
    window = step_window(steps, 20, None)
    assert window.top_tokens == 100.0 and window.cursor == 1
    rows = timeline_rows(window, 27, 8)  # 3 bar rows
    assert len(rows) == 8
    # 40 decode tokens of 100 on 3 rows: ceil(1.2) = 2 rows; 20 + 60: 3 rows, round(20 / 80 * 3) = 1 of decode.
    assert rows[0] == [("   100 ", "label"), ("╌", "budget"), ("█", "prefill")]
    assert rows[1] == [("   tok ", "label"), ("█", "decode"), ("█", "prefill")]
    assert rows[2] == [("     0 ", "label"), ("█", "decode"), ("█", "decode")]
    assert rows[3] == [("mode   ", "label"), ("D", "mode-decode"), ("M", "cursor")]
    assert row_text(rows[4]) == "meas   " + sparkline([10.0, 20.0], 2, high=20.0)
    assert row_text(rows[5]) == "pred   " + sparkline([5.0, 20.0], 2, high=20.0)
    assert row_text(rows[6]) == "step    ^"
    assert "budget" in row_text(rows[7]) and "20 ms" in row_text(rows[7])
    back = timeline_rows(step_window(steps, 20, steps[0].time_ns), 27, 8)
    assert back[1][2:] == [("█", "prefill")] and back[0][1] == ("╌", "budget")
    assert back[3] == [("mode   ", "label"), ("D", "cursor"), ("M", "mode-mixed")]
    assert row_text(timeline_rows(step_window([], 5, None), 20, 8)[0]) == "no steps from this unit yet"


def test_detail_lists_the_numbers_then_the_reasons() -> None:
    chosen = step(7, prefill=64, decode=3, mode=StepMode.MIXED, reasons={"urgent_decodes": 2, "admitted": 1})
    text = [row_text(r) for r in detail_rows("n1", chosen, chosen.time_ns + 2 * S)]
    assert text[0] == "step #7 · n1 u0 · -2s"
    assert "prefill   64 tok · 1 req" in text and "decode    3 tok · 3 req" in text
    assert "budget    100 tok" in text and "measured  11 ms (+10.0%)" in text
    assert "KV        25/100 (25%)" in text
    why = text.index("why (the policy's reasons)")
    assert text[why + 1 :] == ["urgent_decodes 2", "admitted       1"]
    assert row_text(detail_rows("n1", None, 0)[0]) == "no step selected"


# -- the screen ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_staged_store(tmp_path_factory.mktemp("steps") / "staged.duckdb")


class TestStepsScreen:
    def test_keys_pick_the_unit_and_move_along_its_steps(self, store: Path) -> None:
        async def go() -> None:
            app = replay_app(store)
            async with app.run_test(size=(80, 24)) as pilot:
                await replayed(pilot)
                await pilot.press("3")
                screen = app.screen
                assert app.current_mode == "steps" and isinstance(screen, StepsScreen)
                assert app.check_action("show_mode", ("steps",)) is None
                timeline, detail = screen.query_one(StepTimeline), screen.query_one(StepDetail)
                units = app.state.unit_keys()
                assert screen.unit == units[0] == ("node-b", 0)
                steps = tuple(app.state.steps.steps("node-b", 0))
                assert len(steps) == 256, "the ring is full: node-b ran 8 s"
                assert timeline.steps == steps and timeline.cursor_ns is None
                # 80 columns: the side panel takes 34, the labels 7: 39 steps across
                window = timeline.window()
                assert len(window.steps) == 39 and window.steps[-1] is steps[-1] and window.cursor == 38
                assert f"step #{steps[-1].step_id} · node-b u0" in text_of(detail)
                assert screen.check_action("follow", ()) is None, "already following"
                await pilot.press("left", "left")
                assert screen.cursor_ns == steps[-3].time_ns
                assert f"step #{steps[-3].step_id} " in text_of(detail) and screen.check_action("follow", ())
                await pilot.press("end")
                assert screen.cursor_ns is None
                await pilot.press("home")
                assert screen.cursor_ns == steps[0].time_ns
                assert timeline.window().first == 0 and timeline.window().cursor == 0
                await pilot.press("pagedown")
                assert screen.cursor_ns == steps[10].time_ns
                assert timeline.window().first == 10, "a cursor back in time is at the left edge"
                await pilot.press("down")
                assert screen.unit == units[1] and screen.cursor_ns is None
                await pilot.press("up", "U")
                assert screen.unit == units[-1], "wraps"
                await pilot.press("u", "u", "u")
                assert screen.unit == ("node-c", 0)

        run(go, timeout_s=60)

    def test_it_shows_the_mode_row_and_the_policy_reasons(self, store: Path) -> None:
        async def go() -> None:
            app = replay_app(store)
            async with app.run_test(size=(80, 24)) as pilot:
                await replayed(pilot)
                await pilot.press("3", "down", "down")  # node-b u0, u1, node-c u0
                screen = app.screen
                assert isinstance(screen, StepsScreen) and screen.unit == ("node-c", 0)
                timeline = screen.query_one(StepTimeline)
                window = timeline.window()
                rows = timeline_rows(window, timeline.size.width, timeline.size.height)
                modes = [row_text(r) for r in rows if row_text(r).startswith("mode ")]
                assert modes == ["mode   " + "".join(MODE_GLYPHS[str(s.mode)] for s in window.steps)]
                newest = app.state.steps.steps("node-c", 0)[-1]
                text = text_of(screen.query_one(StepDetail))
                assert "fairbatching" in text and "why (the policy's reasons)" in text
                assert "urgent_decodes" in text and f"{newest.num_decode_tokens} tok" in text
                title = text_of(screen.query_one("#steps-title"))
                assert title.startswith("node-c u0 (3/6) · fairbatching · 256 steps held")
                await pilot.press("f1")
                assert isinstance(app.screen, HelpScreen)
                ids = {k.binding_id for k in app.screen.keys}
                assert {"console.steps", "steps.next_unit", "steps.older", "steps.follow", "steps.oldest"} <= ids

        run(go, timeout_s=60)


def test_the_three_screens_with_nothing_to_show_yet() -> None:
    from console.app import ConsoleApp

    async def go() -> None:
        app = ConsoleApp([], clock=None)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("3")
            assert text_of(app.screen.query_one("#steps-title")) == "Steps · no units yet"
            assert app.screen.check_action("cycle_unit", (1,)) is None
            await pilot.press("down", "left", "home", "end")  # nothing to move: no error
            await pilot.press("4")
            assert text_of(app.screen.query_one("#slack-title")) == "Slack · no units yet"
            await pilot.press("u", "down", "home")
            await pilot.press("5")
            assert text_of(app.screen.query_one("#stages-title")) == "Stages · no nodes yet"
            assert app.screen.check_action("cycle_node", (1,)) is None
            assert app.sub_title.startswith("Stages · ")

    run(go, timeout_s=30)


def test_every_binding_of_the_three_screens_has_an_id_and_a_tooltip() -> None:
    from textual.binding import Binding

    from console.app import ConsoleApp
    from console.screens.slack import SlackScreen
    from console.screens.stages import StagesScreen

    ids: list[str] = []
    for cls in (StepsScreen, SlackScreen, StagesScreen):
        for binding in cls.BINDINGS:
            assert isinstance(binding, Binding) and binding.id and binding.tooltip, (cls, binding)
            ids.append(binding.id)
    assert len(ids) == len(set(ids))
    modes = {b.id: b.key for b in ConsoleApp.BINDINGS if isinstance(b, Binding)}
    assert (modes["console.steps"], modes["console.slack"], modes["console.stages"]) == ("3", "4", "5")
