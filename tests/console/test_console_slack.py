"""The Slack screen: slack samples, request traces, the distribution and the envelope on hand-made events, then the
screen driven with Pilot from a replayed store."""

from __future__ import annotations

from pathlib import Path

import pytest
from console_fixtures import build_staged_store
from serve_harness import run
from test_console_app import replay_app, replayed, text_of
from test_console_state import step

from agent.telemetry import RequestArrived, RequestFinished, SlackPoint, SlackSample
from console.app import ConsoleApp
from console.model.metrics import HeatMetric
from console.model.slack import (
    SAMPLE_MAX_REQUESTS,
    Envelope,
    SlackBook,
    envelope,
    envelope_columns,
    slack_distribution,
    slack_summary,
)
from console.model.state import ConsoleState
from console.screens.slack import SlackScreen
from console.widgets.envelope_chart import EnvelopeChart, envelope_heading, envelope_rows
from console.widgets.nearest_requests import NearestRequests, nearest_rows
from console.widgets.rows import row_text
from console.widgets.slack_distribution import SlackDistribution, distribution_rows

S = 1_000_000_000
MS = 1_000_000
T0 = 1_800_000_000 * S


def arrived(rid: str, t: int, *, node: str = "n1", ttft: float = 500.0, tpot: float = 50.0) -> RequestArrived:
    return RequestArrived(
        node_id=node, time_ns=t, request_id=rid, prompt_tokens=100, ttft_slo_ms=ttft, tpot_slo_ms=tpot
    )


def sample(t: int, points: list[tuple[str, int, int]], *, unit: int = 0, node: str = "n1") -> SlackSample:
    """``points``: ``(request_id, deadline_ns, output_tokens)``; slack is the deadline minus ``t``."""
    return SlackSample(
        node_id=node,
        time_ns=t,
        unit_id=unit,
        sample_period_ms=250.0,
        requests=tuple(
            SlackPoint(request_id=r, deadline_ns=d, slack_ms=(d - t) / MS, output_tokens=n, computed_tokens=100 + n)
            for r, d, n in points
        ),
    )


def finished(rid: str, t: int, tokens: int, *, node: str = "n1") -> RequestFinished:
    return RequestFinished(
        node_id=node,
        time_ns=t,
        request_id=rid,
        unit_id=0,
        arrival_ns=T0,
        first_token_ns=T0,
        prompt_tokens=100,
        output_tokens=tokens,
        num_preemptions=0,
        ttft_ms=100.0,
        tpot_ms=60.0,
        ttft_slo_ms=500.0,
        tpot_slo_ms=40.0,
        met_slo=False,
    )


# -- the book ------------------------------------------------------------------------------------------------------
def test_a_request_trace_from_its_arrival_samples_and_finish() -> None:
    # r1 arrives at T0 (TTFT 500 ms, TPOT 50 ms): token j is due at T0 + 0.5 s + 0.05 s * j.
    state = ConsoleState()
    state.apply(
        [
            arrived("r1", T0),
            sample(T0 + S, [("r1", T0 + 750 * MS, 5)]),  # token 5 due at 0.75 s: 250 ms late
            sample(T0 + 2 * S, [("r1", T0 + 1500 * MS, 20)]),
            finished("r1", T0 + 3 * S, 45),
        ]
    )
    trace = state.slack.traces[("n1", "r1")]
    assert list(trace.points) == [(T0 + S, 5), (T0 + 2 * S, 20), (T0 + 3 * S, 45)]
    assert (trace.unit_id, trace.arrival_ns, trace.finished_ns) == (0, T0, T0 + 3 * S)
    assert state.slack.latest[("n1", 0)].requests[0].slack_ms == pytest.approx(-500.0)
    assert state.slack.tpot_ms("n1") == 40.0, "the latest request's target (the finish said 40)"
    assert state.slack.tpot_ms("other") == 50.0, "assumed"
    env = envelope(trace, 99.0)
    assert env is not None
    assert (env.first_deadline_ns, env.tpot_ns, env.start_ns) == (T0 + 500 * MS, 50 * MS, T0)
    assert [env.due(T0 + d * MS) for d in (400, 500, 549, 550, 1000, 3000)] == [0, 1, 1, 2, 11, 51]
    assert [env.done(T0 + d * MS) for d in (900, 1000, 1500, 3000)] == [None, 5, 5, 45]
    # three columns from the arrival to the finish: their right edges at 1, 2 and 3 s
    assert envelope_columns(env, 3, T0 + 10 * S) == [(5, 11), (20, 31), (45, 51)]


def test_without_its_arrival_the_deadline_line_comes_from_the_sampled_deadline() -> None:
    book = SlackBook()
    book.on_sample(sample(T0 + S, [("r2", T0 + 2 * S, 4)]), "n1")
    trace = book.traces[("n1", "r2")]
    env = envelope(trace, 50.0)
    assert env is not None and env.arrival_ns is None
    assert env.first_deadline_ns == T0 + 2 * S - 4 * 50 * MS and env.start_ns == T0 + S
    # first token due at 1.8 s: at 2 s, (2 - 1.8) / 0.05 + 1 = 5 tokens due; at 3 s, 25
    assert envelope_columns(env, 2, T0 + 3 * S) == [(4, 5), (4, 25)]
    assert env.due(T0 + 2 * S) == 5


def test_traces_are_bounded_least_recently_seen_first() -> None:
    book = SlackBook(max_requests=2, max_points=2)
    for i, rid in enumerate(("a", "b", "c")):
        book.on_arrived(arrived(rid, T0 + i * S), "n1")
    assert list(book.traces) == [("n1", "b"), ("n1", "c")]
    book.on_sample(sample(T0 + 5 * S, [("b", T0 + 6 * S, 1)]), "n1")
    book.on_arrived(arrived("d", T0 + 6 * S), "n1")
    assert list(book.traces) == [("n1", "b"), ("n1", "d")], "b was seen again: c goes"
    for k in range(3):
        book.on_sample(sample(T0 + (7 + k) * S, [("b", T0 + 9 * S, k)]), "n1")
    assert [p[1] for p in book.traces[("n1", "b")].points] == [1, 2]
    book.on_finished(finished("zz", T0 + 9 * S, 3), "n1")
    assert ("n1", "zz") not in book.traces, "a finish alone traces nothing"
    with pytest.raises(ValueError):
        SlackBook(max_points=1)


def test_distribution_edges_are_multiples_of_the_tpot_target() -> None:
    buckets = slack_distribution([-10, 0, 49.9, 50, 120, 5000, 2499], 50.0)
    assert [(b.label, b.count) for b in buckets] == [
        ("late <0", 1),
        ("0-50", 2),
        ("50-100", 1),
        ("100-250", 1),
        ("250-500", 0),
        ("500-1k", 0),
        ("1k-2.5k", 1),
        (">=2.5k", 1),
    ]


def test_summary_counts_urgent_late_and_progress_in_tokens() -> None:
    t = T0 + 10 * S
    s = sample(t, [("c", t + 75 * MS, 3), ("a", t - 100 * MS, 9), ("d", t + 500 * MS, 1), ("b", t + 25 * MS, 2)])
    summary = slack_summary(s, 50.0, policy_urgent=4)
    assert [r.request_id for r in summary.rows] == ["a", "b", "c", "d"], "least slack first"
    assert (summary.num_late, summary.num_urgent, summary.policy_urgent) == (1, 2, 4)
    assert (summary.num_ahead, summary.num_behind) == (3, 1)
    assert summary.tokens_ahead == pytest.approx(0.5 + 1.5 + 10.0) and summary.tokens_behind == pytest.approx(-2.0)
    assert [b.count for b in summary.buckets] == [1, 1, 1, 0, 0, 1, 0, 0]
    lines = [row_text(r) for r in distribution_rows(summary, 40)]
    assert lines[0] == "4 running · TPOT 50 ms"
    assert lines[1] == "late <0        1 " + "█" * 23, "the longest bar fills the width"
    assert lines[-2:] == ["urgent 2 · late 1 · policy 4", "ahead 3 +12 tok · behind 1 -2 tok"]
    assert row_text(distribution_rows(None, 40)[0]) == "no slack sample from this unit"


def test_the_running_count_is_the_samples_own() -> None:
    """The header read "23 of 21 running": a sample of 23 requests against the batch size of a step at another
    instant. Below the cap a sample lists every running request; only at the cap does a larger batch size say more."""
    t = T0 + 10 * S

    def heading(num_sampled: int, batch_size: float | None) -> str:
        points = [(f"r{i}", t + i * MS, 1) for i in range(num_sampled)]
        summary = slack_summary(sample(t, points), 50.0, batch_size=batch_size)
        assert summary.num_running >= len(summary.rows)
        return row_text(distribution_rows(summary, 40)[0]).split(" · ")[0]

    assert [heading(23, 21), heading(23, 30), heading(23, None), heading(0, 3)] == [
        "23 running",
        "23 running",
        "23 running",
        "0 running",
    ]
    assert [heading(SAMPLE_MAX_REQUESTS, 62), heading(SAMPLE_MAX_REQUESTS, None)] == ["64 of 64+ running"] * 2
    assert heading(SAMPLE_MAX_REQUESTS, 80) == "64 of 80 running"


def test_the_screen_counts_from_the_sample_not_an_older_step() -> None:
    state = ConsoleState()
    t = T0 + 10 * S
    state.apply([step(t - 100 * MS, running=21), sample(t, [(f"r{i}", t + i * MS, 1) for i in range(23)])])
    assert state.nodes["n1"].units[0].latest[HeatMetric.BATCH] == 21

    async def go() -> None:
        app = ConsoleApp([], clock=None, state=state)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("4")
            screen = app.screen
            assert isinstance(screen, SlackScreen) and screen.summary is not None
            assert str(screen.query_one(SlackDistribution).render()).startswith("23 running · TPOT 50 ms")

    run(go, timeout_s=30)


def test_nearest_list_scrolls_to_the_selected_request() -> None:
    t = T0 + 10 * S
    rows = slack_summary(sample(t, [(f"r{i}", t + i * 10 * MS, i) for i in range(5)]), 50.0).rows
    shown = nearest_rows(rows, "r3", 3)
    assert [row_text(r).split()[0] for r in shown[1:]] == ["r2", "r3"] and shown[2][0][1] == "cursor"
    assert row_text(shown[2]) == "r3" + " " * 14 + "30" + " " * 4 + "3" + " " * 3 + "103" + " " * 3 + "+0.6"
    assert [row_text(r).split()[0] for r in nearest_rows(rows, None, 3)[1:]] == ["r0", "r1"]


def test_envelope_chart_draws_done_against_due() -> None:
    # first token due at 1 s, then every 100 ms; 0 tokens at 1 s, 4 at 2 s: due 1 and 11, so behind.
    env = Envelope("r", 0, T0 + S, 100 * MS, T0, T0, ((T0 + S, 0), (T0 + 2 * S, 4)), None)
    rows = envelope_rows(env, T0 + 2 * S, 7 + 2, 6)  # two columns, four chart rows, top 11 tokens
    assert rows[0] == [("    11 ", "label"), (" ", ""), ("─", "deadline")]
    assert rows[3] == [("     0 ", "label"), ("─", "deadline"), ("█", "behind")]
    assert row_text(rows[1]) == "   tok   " and row_text(rows[2]) == "         "
    wide = envelope_rows(env, T0 + 2 * S, 7 + 30, 6)
    assert row_text(wide[4]) == " " * 7 + "arrival (2s)".ljust(27) + "now"
    assert envelope_heading(env, T0 + 2 * S) == (
        "r u0 · started -2s · 4 done, 11 due · first token due +1k ms, then every 100 ms"
    )
    assert row_text(envelope_rows(None, 0, 20, 5)[0]).startswith("no request to draw")


# -- the screen ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_staged_store(tmp_path_factory.mktemp("slack") / "staged.duckdb")


class TestSlackScreen:
    def test_the_first_sampled_unit_its_distribution_and_nearest_request(self, store: Path) -> None:
        async def go() -> None:
            app = replay_app(store)
            async with app.run_test(size=(80, 24)) as pilot:
                await replayed(pilot)
                await pilot.press("4")
                screen = app.screen
                assert app.current_mode == "slack" and isinstance(screen, SlackScreen)
                assert screen.unit == ("node-c", 0), "node-b samples no slack: the first unit with samples"
                latest = app.state.slack.latest[("node-c", 0)]
                summary = screen.summary
                assert summary is not None and summary.tpot_ms == 50.0, "the agent's default TPOT target"
                slacks = sorted(p.slack_ms for p in latest.requests)
                assert [r.slack_ms for r in summary.rows] == slacks
                assert sum(b.count for b in summary.buckets) == len(latest.requests)
                assert summary.num_urgent == sum(1 for s in slacks if s < 50.0)
                assert summary.num_late == sum(1 for s in slacks if s < 0)
                step = app.state.steps.latest("node-c", 0)
                assert step is not None and summary.policy_urgent == step.reasons["urgent_decodes"]
                nearest = min(latest.requests, key=lambda p: p.slack_ms).request_id
                assert screen.selected == nearest and screen.request is None
                assert screen.query_one(NearestRequests).selected == nearest
                chart = screen.query_one(EnvelopeChart)
                assert chart.envelope is not None and chart.envelope.request_id == nearest
                trace = app.state.slack.traces[("node-c", nearest)]
                assert trace.arrival_ns is not None
                assert chart.envelope.first_deadline_ns == trace.arrival_ns + 500 * MS, "arrival + TTFT target"
                assert text_of(screen.query_one("#slack-envelope-title")).startswith(f"{nearest} u0 · ")
                widget = screen.query_one(SlackDistribution)
                assert widget.summary is summary and summary.num_running >= len(summary.rows)

        run(go, timeout_s=60)

    def test_keys_select_requests_and_units(self, store: Path) -> None:
        async def go() -> None:
            app = replay_app(store)
            async with app.run_test(size=(80, 24)) as pilot:
                await replayed(pilot)
                await pilot.press("4")
                screen = app.screen
                assert isinstance(screen, SlackScreen) and screen.summary is not None
                rows = screen.summary.rows
                assert screen.check_action("nearest", ()) is None, "already following the nearest"
                await pilot.press("down", "down")
                assert screen.request == rows[2].request_id and screen.check_action("nearest", ())
                chart = screen.query_one(EnvelopeChart)
                assert chart.envelope is not None and chart.envelope.request_id == rows[2].request_id
                await pilot.press("up", "up", "up")
                assert screen.request == rows[0].request_id, "clamped at the top"
                # the request with the most tokens done has a trace over many samples
                longest = max(rows, key=lambda r: r.output_tokens)
                await pilot.press(*["down"] * rows.index(longest))
                env = chart.envelope
                assert env is not None and env.request_id == longest.request_id
                tokens = [n for _, n in env.points]
                assert len(tokens) >= 4 and tokens == sorted(tokens) and longest.output_tokens in tokens
                await pilot.press("home")
                assert screen.request is None and screen.selected == rows[0].request_id
                await pilot.press("u")
                assert screen.unit == ("node-c", 1) and screen.request is None
                await pilot.press("U", "U")
                assert screen.unit == ("node-b", 1) and screen.summary is None
                assert "no slack sample from this unit" in str(screen.query_one(SlackDistribution).render())
                assert screen.query_one(EnvelopeChart).envelope is None

        run(go, timeout_s=60)
