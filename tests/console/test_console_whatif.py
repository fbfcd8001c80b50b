"""The What-if screen with a stand-in child (``tests/whatif_fake.py``, the real command's arguments, progress lines
and JSON): run, progress and the ranked table on a replay (the window copied out with only the node's rows, the
temporary files removed), cancel, the child's error, quitting mid-run, apply refused (a replay, read-only, no token,
keep) and apply through the Policies screen's dry run and confirmation against a real agent; then the pure side, and
the real ``trackside whatif`` (slow)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from console_fixtures import build_store
from console_pilot import fast_delays, text_of, until
from serve_harness import TOKEN, make_hub, make_server, run
from textual.binding import Binding
from textual.pilot import Pilot
from textual.widgets import ProgressBar, SelectionList, Static
from whatif_fake import result_document

from agent.service.hub import Hub
from agent.telemetry import NodeHello, ParamSchema, PolicySchema, UnitStatus
from console.app import ConsoleApp
from console.feeds import LiveFeed, ReplayFeed
from console.model.state import ConsoleState
from console.model.whatif import (
    Recommendation,
    Schemas,
    Window,
    child_args,
    error_line,
    fidelity_text,
    iso_time,
    notable_params,
    parse_progress,
    parse_result,
    parse_window,
    recommendation_text,
    recommended_change,
    result_rows,
    warning_text,
)
from console.recorder import ConsoleRecorder, RecordingFeed
from console.screens.confirm import ConfirmScreen
from console.screens.policies import PoliciesScreen
from console.screens.registry import SCREENS
from console.screens.whatif import WhatIfScreen
from console.sql import ReplayDatabase
from console.widgets.whatif_table import WhatIfTable

FAKE = Path(__file__).resolve().parents[1] / "whatif_fake.py"


def fake(mode: str) -> tuple[str, ...]:
    return (sys.executable, str(FAKE), mode)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("whatif") / "two-nodes.duckdb")


@pytest.fixture
def fake_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the stand-in child writes what it was given and what the copied store held."""
    log = tmp_path / "fake.json"
    monkeypatch.setenv("WHATIF_FAKE_LOG", str(log))
    return log


def replay_app(store: Path, mode: str = "switch", **options: object) -> ConsoleApp:
    return ConsoleApp(
        [ReplayFeed(store)], clock=None, database=ReplayDatabase(store), whatif_command=fake(mode), **options  # type: ignore[arg-type]
    )


async def whatif_screen(pilot: Pilot[int]) -> WhatIfScreen:
    """Wait for the replay's end, switch to the What-if screen (key 8), wait for its node."""
    app = pilot.app
    assert isinstance(app, ConsoleApp)
    await until(pilot, lambda: any(s.detail == "end of file" for s in app.state.sources.values()), "the replay")
    await pilot.press("8")
    screen = app.screen
    assert isinstance(screen, WhatIfScreen)
    app.refresh_views(force=True)
    await until(pilot, lambda: screen.node is not None and bool(screen.checked_candidates()), "the node")
    return screen


def status(screen: WhatIfScreen) -> str:
    return text_of(screen.query_one("#whatif-status", Static))


def recommendation(screen: WhatIfScreen) -> str:
    return text_of(screen.query_one("#whatif-recommendation", Static))


async def finished(pilot: Pilot[int], screen: WhatIfScreen) -> None:
    await until(pilot, lambda: screen.job is None and (screen.result is not None or bool(screen.error)), "the result")


# -- run, progress, the table ----------------------------------------------------------------------------------------
def test_a_run_copies_the_window_shows_progress_and_the_ranked_table(
    store: Path, fake_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "gate"
    monkeypatch.setenv("WHATIF_FAKE_GATE", str(gate))  # the child waits for it: "one at a time" is checked mid-run

    async def go() -> None:
        app = replay_app(store)
        async with app.run_test(size=(120, 36)) as pilot:
            screen = await whatif_screen(pilot)
            node = app.state.nodes["node-a"]
            names = [schema.name for schema in node.batch_policies]
            assert screen.node_id == "node-a" and screen.checked_candidates() == names, "every batch policy, checked"
            assert "node-a (1/2)" in text_of(screen.query_one("#whatif-heading", Static))
            window = text_of(screen.query_one("#whatif-window-text", Static))
            assert "(10m), up to the replay's cursor" in window, window
            await pilot.press("r")
            assert screen.job is not None and screen.check_action("run", ()) is None, "one at a time"
            gate.touch()
            await finished(pilot, screen)
            assert screen.result is not None, screen.error
            total = 1 + len(names)
            assert screen.progress is not None and (screen.progress.done, screen.progress.total) == (total, total)
            assert screen.progress.label == f"{names[-1]} + least_loaded", "the bar is fed by the child's lines"
            bar = screen.query_one(ProgressBar)
            assert (bar.progress, bar.total) == (total, total)
            rows = screen.query_one(WhatIfTable).rows_shown
            assert [r.kind for r in rows[:1]] == ["recorded"] and len(rows) == 1 + total
            assert rows[1].cells[:5] == ("1", "sarathi", "least_loaded", "11.20", "+12.0%")
            assert rows[1].recommended and not any(r.recommended for r in rows[2:])
            assert any(r.cells[1] == "vllm (replay)" for r in rows)
            assert "good: every error within 10%" in text_of(screen.query_one("#whatif-fidelity", Static))
            assert "switch to sarathi + least_loaded: expected +12.0% effective req/s" in recommendation(screen)
            assert status(screen).startswith("done: 8 runs of"), status(screen)
            # apply: refused in a replay, greyed out, and said when called anyway
            assert "apply: refused: a replay" in recommendation(screen)
            assert screen.check_action("apply", ()) is None
            screen.action_apply()
            await pilot.pause()
            assert isinstance(app.screen, WhatIfScreen) and "a replay" in recommendation(screen)
        seen = json.loads(fake_log.read_text())
        argv = seen["argv"]
        assert seen["nodes"] == ["node-a"], "the copy holds only the node's rows (the store has node-b too)"
        assert argv[argv.index("--node") + 1] == "node-a" and argv[argv.index("--progress") + 1] == "jsonl"
        assert argv[argv.index("--compare") + 1] == ",".join(names)
        assert argv[argv.index("--since") + 1].endswith("+00:00")
        assert abs(seen["until_ns"] - seen["since_ns"] - 600e9) < 2e3, "the last 10 minutes"
        db = Path(argv[argv.index("--db") + 1])
        assert not db.parent.exists(), "the temporary folder is removed"

    run(go, timeout_s=60)


def test_the_childs_error_cancel_the_candidates_and_quitting_mid_run(store: Path) -> None:
    async def go() -> tuple[int, Path]:
        app = replay_app(store, "error")
        async with app.run_test(size=(80, 24)) as pilot:
            screen = await whatif_screen(pilot)
            assert status(screen).startswith("r runs the window under each checked candidate")
            # no history to copy (a live console with --no-record): Run greyed out, the status line says why
            database, app.database = app.database, None
            screen.redraw()
            assert screen.check_action("run", ()) is None
            assert status(screen) == "cannot run: no history: a live console with --no-record keeps none to replay"
            app.database = database
            screen.redraw()
            # the child's error: its one line, not its warnings
            await pilot.press("r")
            await finished(pilot, screen)
            shown = status(screen)
            assert shown.startswith("trackside whatif: error: no finished requests of node-a between "), shown
            assert "warning" not in shown and screen.query_one("#whatif-status").has_class("-error")
            assert screen.result is None and screen.query_one(WhatIfTable).rows_shown == ()
            # the candidates: toggled, none checked greys Run out; another node lists its own, all checked
            candidates = screen.query_one(SelectionList)
            candidates.deselect_all()
            await pilot.pause()
            assert screen.run_refusal() == "check at least one candidate" and screen.check_action("run", ()) is None
            await pilot.press("n")
            assert screen.node_id == "node-b" and screen.checked_candidates(), "another node: every policy again"
            await pilot.press("N")
            assert screen.node_id == "node-a" and len(screen.checked_candidates()) == 7
            candidates.deselect("static")
            # cancel: the child killed mid-run, its folder removed
            assert screen.check_action("cancel", ()) is False, "Cancel is hidden while nothing runs"
            app.whatif_command = fake("hang")
            await pilot.press("r")
            await until(pilot, lambda: screen.progress is not None, "the first progress line")
            job = screen.job
            assert job is not None and job.proc is not None and "static" not in job.argv()[-5]
            bar = screen.query_one(ProgressBar)
            assert (bar.progress, bar.total) == (1, 7) and status(screen).startswith("1/7 runs")
            assert screen.check_action("cycle_node", ()) is None and screen.check_action("cancel", ()) is True
            await pilot.press("c")
            await until(pilot, lambda: screen.job is None, "the end of the run")
            assert job.proc.returncode is not None and job.proc.returncode < 0, "killed"
            assert status(screen).startswith("cancelled") and screen.result is None and not screen.error
            assert not job.folder.exists()
            # quitting while one runs
            await pilot.press("r")
            await until(pilot, lambda: screen.progress is not None, "the first progress line")
            assert screen.job is not None and screen.job.proc is not None
            pid, folder = screen.job.proc.pid, screen.job.folder
            await pilot.press("q")
        return pid, folder

    pid, folder = run(go, timeout_s=60)
    assert not folder.exists()
    status_file = Path(f"/proc/{pid}/status")
    state = status_file.read_text() if status_file.exists() else ""
    assert "State:\tZ" in state or not state, f"the child {pid} is still running after the console quit: {state[:80]}"


# -- apply -----------------------------------------------------------------------------------------------------------
def test_apply_refused_then_through_the_dry_run_and_the_confirmation_in_a_live_console(tmp_path: Path) -> None:
    """A recording console on a real agent, the window copied from its live recording: apply refused read-only and
    without a token (the same console, its options changed), sent once it may be, and refused for a keep."""

    async def refused(pilot: Pilot[int], screen: WhatIfScreen, hub: Hub, why: str, sent: int = 0) -> None:
        await until(pilot, lambda: f"apply: refused: {why}" in recommendation(screen), why)
        assert screen.query_one("#whatif-recommendation").has_class("-refused")
        assert screen.check_action("apply", ()) is None and not screen.active_bindings["a"].enabled
        assert not [c for c in pilot.app.get_system_commands(screen) if c.title == "What-if: apply"]
        screen.action_apply()  # as the palette or a remapped key could: refused, nothing sent
        await pilot.pause()
        assert isinstance(pilot.app.screen, WhatIfScreen) and len(hub.control.audit_log) == sent

    async def go() -> None:
        hub = make_hub(units=2, workload="poisson:n=20000,rate=5")
        server = make_server(hub, speed=1.0)
        await server.start()
        recorder = ConsoleRecorder(tmp_path / "console.duckdb", flush_s=0.1)
        try:
            feeds = [RecordingFeed(LiveFeed(server.url, delays=fast_delays, resume=recorder.resume_from), recorder)]
            app = ConsoleApp(
                feeds, refresh_s=0.25, token=TOKEN, read_only=True, database=recorder, whatif_command=fake("switch")
            )
            async with app.run_test(size=(80, 24)) as pilot:
                # actions called as their keys call them (but for apply's): Pilot's key presses wait for the process
                # to idle, up to 2 s each, and the agent running in this process never idles
                await app.action_show_mode("whatif")
                screen = app.screen
                assert isinstance(screen, WhatIfScreen)
                await until(pilot, lambda: screen.check_action("run", ()) is True, "the agent's hello")
                await until(pilot, lambda: recorder.num_written > 0, "the hello written")
                flushed = recorder.num_flushes  # a flush may come before any event: wait for one after them
                await until(pilot, lambda: recorder.num_flushes > flushed, "a commit of the recording")
                screen.action_run()  # the window copied from the live recording, while it is written
                await finished(pilot, screen)
                assert screen.result is not None, screen.error
                await refused(pilot, screen, hub, "read-only console")
                app.read_only, app.token = False, ""
                await refused(pilot, screen, hub, "no control token")
                app.token = TOKEN
                await until(pilot, lambda: "a applies it on every unit" in recommendation(screen), "apply allowed")
                assert screen.check_action("apply", ()) is True
                palette = [c.title for c in app.get_system_commands(screen) if c.title.startswith("What-if: ")]
                assert palette == ["What-if: run", "What-if: apply"], "the palette offers what the keys can do"
                await pilot.press("a")
                await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
                confirm = app.screen
                assert isinstance(confirm, ConfirmScreen)
                assert "u0: policy vllm -> sarathi" in confirm.lines and "u1: policy vllm -> sarathi" in confirm.lines
                assert [r.result for r in hub.control.audit_log] == ["dry_run"], "a dry run first, nothing changed"
                confirm.action_answer(True)
                await until(pilot, lambda: [u.policy.name for u in hub.node.units] == ["sarathi"] * 2, "applied")
                assert isinstance(app.screen, PoliciesScreen)
                await app.action_show_mode("whatif")
                app.whatif_command = fake("keep")
                screen.action_run()
                await finished(pilot, screen)
                await refused(pilot, screen, hub, "the recommendation is to keep the running policy", sent=2)
        finally:
            recorder.close()
            await server.stop()

    run(go, timeout_s=90)


# -- keys ------------------------------------------------------------------------------------------------------------
def test_the_screen_key_and_every_binding_have_ids_and_tooltips() -> None:
    spec = next(s for s in SCREENS if s.name == "whatif")
    assert (spec.key, spec.binding_id, spec.screen) == ("8", "console.whatif", WhatIfScreen)
    ids = []
    for binding in WhatIfScreen.BINDINGS:
        assert isinstance(binding, Binding) and binding.id and binding.tooltip, binding
        ids.append(binding.id)
    assert {"whatif.run", "whatif.cancel", "whatif.apply", "whatif.next_node"} <= set(ids) and len(set(ids)) == len(ids)


# -- the pure side ---------------------------------------------------------------------------------------------------
END = 1_800_000_600_000_000_000


@pytest.fixture
def utc() -> Iterator[None]:
    import time

    zone = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    try:
        yield
    finally:
        if zone is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = zone
        time.tzset()


def test_windows_are_lengths_or_clock_times(utc: None) -> None:
    assert parse_window("10m", END) == Window(END - 600 * 10**9, END)
    assert parse_window(" 1h30m ", END).seconds == 5400 and parse_window("90s", END).seconds == 90
    assert parse_window("2m30s", END).describe() == "08:07:30-08:10:00 (2m30s)"
    clock = parse_window("07:55-08:00:30", END)
    assert clock.describe() == "07:55:00-08:00:30 (5m30s)" and clock.end_ns < END
    assert parse_window("23:50-00:10", END).seconds == 1200, "over midnight: the start on the day before"
    for bad in ("", "10", "ten minutes", "0s", "25:00-26:00", "5m x"):
        with pytest.raises(ValueError):
            parse_window(bad, END)


def test_the_child_gets_iso_times_that_hold_the_window() -> None:
    assert iso_time(1_800_000_000_123_456_789) == "2027-01-15T08:00:00.123456+00:00"
    assert iso_time(1_800_000_000_123_456_789, round_up=True) == "2027-01-15T08:00:00.123457+00:00"
    assert iso_time(1_800_000_000_000_000_000, round_up=True) == "2027-01-15T08:00:00.000000+00:00"
    args = child_args(db="w.duckdb", node_id="n", window=Window(0, 10**9), candidates=["vllm", "eb+"], json_path="r")
    assert args == ["--db", "w.duckdb", "--node", "n", "--since", "1970-01-01T00:00:00.000000+00:00", "--until",
                    "1970-01-01T00:00:01.000000+00:00", "--compare", "vllm,eb+", "--json", "r", "--progress", "jsonl"]
    assert "--compare" not in child_args(db="w", node_id="n", window=Window(0, 1), candidates=[], json_path="r")


def test_progress_lines_and_the_error_line() -> None:
    progress = parse_progress('{"event": "progress", "done": 2, "total": 6, "label": "sarathi + least_loaded"}')
    assert progress is not None and (progress.done, progress.total, progress.label) == (2, 6, "sarathi + least_loaded")
    for other in ("warning: slow", "{not json", '{"event": "other"}', '{"event": "progress", "done": "2", "total": 6}',
                  '{"event": "progress", "done": true, "total": 6}', "[1, 2]"):
        assert parse_progress(other) is None, other
    lines = ["warning: x", "trackside whatif: error: no requests in the window", "Traceback? no"]
    assert error_line(lines, 2) == "trackside whatif: error: no requests in the window"
    assert error_line(["", "boom  "], 1) == "boom" and "status 9" in error_line([], 9)
    assert warning_text("trackside whatif: warning: 3 unfinished ") == "3 unfinished" == warning_text("3 unfinished")


def test_the_result_as_rows_fidelity_and_recommendation() -> None:
    result = parse_result(result_document(candidates=("sarathi", "eb")))
    assert [run.rank for run in result.runs] == [1, 2, 3] and result.runs[0].batch_policy == "sarathi"
    rows = result_rows(result)
    assert rows[0].cells == ("", "vllm (recorded)", "least_loaded", "10.00", "", "90.0%", "800 ms", "45 ms")
    assert rows[1].cells == ("1", "sarathi", "least_loaded", "11.20", "+12.0%", "95.0%", "700 ms", "38 ms")
    assert rows[2].cells[1] == "vllm (replay)" and rows[2].cells[4] == "-2.0%" and rows[2].kind == "replay"
    slow = parse_result(result_document(candidates=("static",)))
    assert [r.cells[6] for r in result_rows(slow)][-1] == "2.50 s"
    assert [r.recommended for r in rows] == [False, True, False, False]
    text, poor = fidelity_text(result.fidelity)
    assert not poor and "goodput 2.1% · SLO 1.0 pt · TTFT p50 3.4% p99 2.5% · TPOT p50 4.1% p99 4.4%" in text
    assert text.endswith("· good: every error within 10%")
    bad = parse_result(result_document(fidelity={"goodput_rel_err": 0.02, "tpot_p99_rel_err": 0.25})).fidelity
    text, poor = fidelity_text(bad)
    assert poor and text.endswith("TPOT p50 n/a p99 25.0% · POOR: an error over 10%, read the ranking with care")
    assert "SLO n/a" in text
    assert fidelity_text(parse_result(result_document(fidelity={})).fidelity)[1], "unknown reads as poor"
    assert recommendation_text(result.recommendation) == (
        "switch to sarathi + least_loaded: expected +12.0% effective req/s (highest effective req/s, SLO not worse)"
    )
    keep = parse_result(result_document(action="keep"))
    assert recommendation_text(keep.recommendation).startswith("keep vllm + least_loaded")
    assert [r.kind for r in result_rows(keep) if r.recommended] == ["replay"], "keep: the policy that ran"
    with pytest.raises(ValueError, match="runs is not a list"):
        parse_result({**result_document(), "runs": None})
    with pytest.raises(ValueError, match=r"recommendation\.action"):
        parse_result({**result_document(), "recommendation": {"action": "maybe"}})


SARATHI = PolicySchema(
    name="sarathi", params=(ParamSchema(name="tbt_target_ms", type="float", default=50.0, min=1.0, unit="ms"),)
)


def test_notable_parameters_are_those_off_their_defaults() -> None:
    least = PolicySchema(name="least_loaded", params=(ParamSchema(name="waiting_weight", type="float", default=4.0),))
    params = {"tbt_target_ms": 50, "waiting_weight": 4.0, "other": 1}
    assert notable_params(params, SARATHI, least) == {"other": 1}
    assert notable_params({**params, "tbt_target_ms": 40.0}, SARATHI, least) == {"tbt_target_ms": 40.0, "other": 1}
    schemas = Schemas((SARATHI,), (least,))
    doc = result_document(candidates=("sarathi",))
    doc["runs"][1]["params"] = {"tbt_target_ms": 40.0, "waiting_weight": 4.0}  # type: ignore[index]
    rows = result_rows(parse_result(doc), schemas)
    assert rows[1].cells[1] == "sarathi tbt_target_ms=40.0", "every parameter a run carries; the notable shown"
    assert rows[2].cells[1] == "vllm (replay)"


def test_the_recommendation_as_a_change() -> None:
    state = ConsoleState()
    state.apply([NodeHello(
        node_id="n", time_ns=1, boot_ns=1, profile="p", dispatch_policy="least_loaded",
        units=(UnitStatus(unit_id=0, batch_policy="vllm"), UnitStatus(unit_id=1, batch_policy="sarathi",
                                                                      batch_params={"tbt_target_ms": 50.0})),
        batch_policies=(PolicySchema(name="vllm"), SARATHI),
    )])
    node = state.nodes["n"]

    def rec(policy: str, action: str = "switch", dispatch: str = "least_loaded", **params: float) -> Recommendation:
        return Recommendation(action, policy, dispatch, dict(params), 0.1, "")  # type: ignore[arg-type]

    change = recommended_change(rec("sarathi", tbt_target_ms=40.0, waiting_weight=4.0), node)
    assert (change.swap, change.policy, change.unit_ids) == (True, "sarathi", ())
    assert change.params == {"tbt_target_ms": 40.0}
    assert change.describe() == "n every unit: -> sarathi tbt_target_ms=40.0"
    for bad, why in [
        (rec("vllm", "keep"), "keep the running policy"),
        (rec("sarathi", dispatch="sbs"), "runs dispatch sbs"),
        (rec("eb"), "does not offer the batch policy eb"),
    ]:
        with pytest.raises(ValueError, match=why):
            recommended_change(bad, node)
    node.units[0].batch_policy = "sarathi"
    node.units[0].batch_params = {"tbt_target_ms": 50.0}
    with pytest.raises(ValueError, match="every unit of n already runs sarathi"):
        recommended_change(rec("sarathi", tbt_target_ms=50.0, waiting_weight=4.0), node)
    assert recommended_change(rec("vllm"), node).params == {}, "a swap: only what differs from the defaults"
    params_only = recommended_change(rec("sarathi", tbt_target_ms=30.0), node)
    assert not params_only.swap and params_only.params == {"tbt_target_ms": 30.0}


# -- the real child ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_real_trackside_whatif_on_a_replayed_store(store: Path) -> None:
    """``python -m agent.cli whatif`` itself on node-a's window (two candidates, to keep it short)."""

    async def go() -> None:
        app = ConsoleApp([ReplayFeed(store)], clock=None, database=ReplayDatabase(store), token=TOKEN)
        async with app.run_test(size=(120, 36)) as pilot:
            screen = await whatif_screen(pilot)
            candidates = screen.query_one(SelectionList)
            candidates.deselect_all()
            candidates.select("sarathi")
            candidates.select("fairbatching")
            await pilot.pause()
            await pilot.press("r")
            await until(pilot, lambda: screen.job is None, "trackside whatif", timeout_s=120)
            assert screen.result is not None, screen.error
            rows = screen.query_one(WhatIfTable).rows_shown
            assert [r.kind for r in rows].count("replay") == 1 and len(rows) == 4, rows
            assert {r.cells[1] for r in rows[1:]} >= {"sarathi", "fairbatching"}
            assert all(r.cells[3] != "-" for r in rows), "every run has its effective req/s"
            assert screen.progress is not None and screen.progress.done == screen.progress.total == 3
            assert text_of(screen.query_one("#whatif-fidelity", Static)).startswith("replay fidelity: ")
            assert recommendation(screen).startswith(("recommendation: switch to ", "recommendation: keep "))
            assert "apply: refused: a replay" in recommendation(screen)
            warnings = text_of(screen.query_one("#whatif-warnings", Static))
            assert warnings.startswith("2 warnings: 1 control changes inside the window"), "the child's, unprefixed"

    run(go, timeout_s=180)
