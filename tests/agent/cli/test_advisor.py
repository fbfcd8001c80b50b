"""The recorder's advisor (``trackside record --advise-every``) and the ``post_alert`` request it posts with.

Its decisions run against a fake what-if step (:class:`FakeAnalyst`, scripted assessments) and a real hub's control
plane without sockets (:class:`HubControl`: dry runs, swaps and audits as an agent does them); the end to end test
runs a real agent with a bad policy (``static``), the recorder with the advisor beside it, and reads the alert back
from the store.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import msgspec
import pytest
from serve_harness import TOKEN, make_hub, make_server, run, wait_for

from agent.cli.advisor import (
    Advisor,
    AdvisorSettings,
    Assessment,
    Observed,
    SessionControl,
    Skipped,
    WatchedNode,
    recommendation_changes,
    recommendation_message,
    restore_changes,
    status_label,
)
from agent.cli.common import ServeError
from agent.cli.serve import add_serve_commands, advisor_settings, record
from agent.service.hub import Hub
from agent.telemetry import (
    Alert,
    ControlAudit,
    ControlRequest,
    DryRun,
    ErrorReply,
    Event,
    OkReply,
    PostAlert,
    Reply,
    SetBatchPolicy,
    SetDispatchPolicy,
)
from agent.telemetry.client import open_session
from policies.registry import UnknownPolicyError
from store.window import recorded_window
from store.writer import StoreWriter

MINUTES_5 = 300.0


# -- post_alert on a real agent ---------------------------------------------------------------------------------------
class WatchingWriter(StoreWriter):
    """A store writer that also keeps the alerts it is given (the test waits for one to be written), and the
    audits when given a list for them."""

    def __init__(self, path: Path, alerts: list[Alert], audits: list[ControlAudit] | None = None) -> None:
        super().__init__(path)
        self.alerts = alerts
        self.audits = audits

    def write(self, events: Any) -> None:
        super().write(events)
        self.alerts.extend(e for e in events if isinstance(e, Alert) and e.seq)
        if self.audits is not None:
            self.audits.extend(e for e in events if isinstance(e, ControlAudit))


def recommendations(alerts: list[Alert]) -> list[Alert]:
    return [a for a in alerts if a.code == "recommendation"]


def test_post_alert_needs_the_token_and_is_published_audited_and_recorded(tmp_path: Path) -> None:
    db = tmp_path / "t.duckdb"

    async def go() -> tuple[list[Reply], list[Event]]:
        hub = make_hub(units=2)
        async with make_server(hub) as server:
            alerts: list[Alert] = []
            audits: list[ControlAudit] = []
            stop = asyncio.Event()
            recording = asyncio.create_task(record([server.url], db, stop=stop, flush_s=0.2,
                                                   writer_factory=lambda p: WatchingWriter(p, alerts, audits)))
            async with open_session(server.url) as anonymous:
                refused = await anonymous.call(PostAlert(code="recommendation", message="sarathi would do better"))
            async with open_session(server.url, token=TOKEN) as session:
                posted = await session.call(PostAlert(code="recommendation", message="sarathi would do better",
                                                      severity="warning"))
                other = await session.call(PostAlert(code="unit_failed", message="no"))  # type: ignore[arg-type]
                long = await session.call(PostAlert(code="recommendation", message="x" * 501))
            # the alert and, after it in the stream (the agent publishes the audit of a post_alert after the alert
            # itself), its audit: waiting for the alert alone could stop the recorder before the audit came
            await wait_for(lambda: bool(recommendations(alerts)) and any(a.result == "applied" for a in audits),
                           what="the alert and its audit written to the store")
            stop.set()
            assert await recording == 0
            return [refused, posted, other, long], list(hub.replay.since(0).events)

    replies, events = run(go)
    refused, posted, other, long = replies
    assert isinstance(refused, ErrorReply) and refused.code == "unauthorized"
    assert isinstance(other, ErrorReply) and other.code == "invalid_field" and "code" in other.message
    assert isinstance(long, ErrorReply) and long.code == "invalid_field"
    assert isinstance(posted, OkReply) and isinstance(posted.payload, ControlAudit)
    assert posted.payload.action == "post_alert" and posted.payload.result == "applied"
    assert posted.payload.message == "warning recommendation: sarathi would do better"
    alerts = [e for e in events if isinstance(e, Alert) and e.code == "recommendation"]
    assert len(alerts) == 1 and alerts[0].seq > 0  # a stream event, not a notice
    assert (alerts[0].severity, alerts[0].message) == ("warning", "sarathi would do better")
    audits = [(e.action, e.result, e.error_code) for e in events if isinstance(e, ControlAudit)]
    assert audits == [("post_alert", "rejected", "unauthorized"), ("post_alert", "applied", "")]
    con = duckdb.connect(str(db), read_only=True)
    try:
        stored = con.execute("SELECT code, severity, message FROM alerts WHERE seq > 0").fetchall()
        actions = con.execute("SELECT action, result FROM audits ORDER BY seq").fetchall()
    finally:
        con.close()
    assert stored == [("recommendation", "warning", "sarathi would do better")]
    assert actions == [("post_alert", "rejected"), ("post_alert", "applied")]
    assert recorded_window(db).changes == ()  # an alert changes no policy: a what-if does not count it as a change


def test_the_overview_lists_a_recommendation_alert() -> None:
    from console.model.state import ConsoleState
    from console.widgets.alert_list import alert_line

    hub = make_hub(units=2)
    reply = hub.handle(PostAlert(code="recommendation", message="sarathi + least_loaded would gain +12.3%",
                                 token=TOKEN, control_id="c1"), who="test")
    assert isinstance(reply, OkReply)
    state = ConsoleState()
    state.apply([hub.hello(), *hub.replay.since(0).events], source="ws://test")
    assert [a.code for a in state.alerts] == ["recommendation"]
    assert "info    test-node recommendation: sarathi + least_loaded would gain +12.3%" in alert_line(state.alerts[0])


# -- the decisions, on a fake what-if and a real hub ------------------------------------------------------------------
@dataclass
class HubControl:
    """The control calls of an agent, without sockets: each request goes to ``hub.handle`` with the token."""

    hub: Hub
    sent: list[ControlRequest] = field(default_factory=list)

    async def call(self, uri: str, request: ControlRequest) -> Reply:
        self.sent.append(request)
        signed = msgspec.structs.replace(request, token=TOKEN, control_id=uuid.uuid4().hex)
        return self.hub.handle(signed, who="advisor")

    def kinds(self) -> list[str]:
        out = []
        for r in self.sent:
            kind = str(r.__struct_config__.tag)
            out.append(f"dry_run:{r.change.__struct_config__.tag}" if isinstance(r, DryRun) else kind)
        return out


@dataclass
class FakeAnalyst:
    assessments: list[Assessment | Skipped] = field(default_factory=list)
    observations: list[Observed | None] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    async def assess(self, node: WatchedNode, window_s: float, since_ns: int) -> Assessment | Skipped:
        self.calls.append(f"assess since {since_ns}")
        return self.assessments.pop(0)

    async def observe_after(self, node: WatchedNode, after_seq: int, window_s: float) -> Observed | None:
        self.calls.append(f"observe after {after_seq}")
        return self.observations.pop(0)


def assessment(action: str = "switch", batch: str = "sarathi", *, gain: float | None = 0.123,
               goodput_err: float | None = 0.012, slo_err: float = 0.004, attainment: float = 0.9,
               params: dict[str, Any] | None = None, mark_ns: int = 100) -> Assessment:
    rec = {"action": action, "batch_policy": batch if action == "switch" else "vllm", "dispatch": "least_loaded",
           "params": params or {}, "expected_gain": gain, "reason": "the best candidate, sarathi, gains +1.0%"}
    return Assessment(start_ns=0, end_ns=mark_ns, num_requests=500, batch_policy="vllm", dispatch="least_loaded",
                      slo_attainment=attainment, fidelity={"goodput_rel_err": goodput_err,
                                                           "slo_attainment_abs_err": slo_err},
                      recommendation=rec, mark_ns=mark_ns)


def advisor_on(hub: Hub, analyst: FakeAnalyst, *, autopilot: bool = False, control: bool = True
               ) -> tuple[Advisor, HubControl, list[str]]:
    lines: list[str] = []
    ctl = HubControl(hub)
    advisor = Advisor(AdvisorSettings(every_s=MINUTES_5, autopilot=autopilot), control=ctl if control else None,
                      analyst=analyst, say=lines.append)
    advisor.watch("ws://gpu-7", hub.hello())
    return advisor, ctl, lines


def one_round(advisor: Advisor) -> str | None:
    return asyncio.run(advisor.round())["test-node"]


def posted(hub: Hub) -> list[Alert]:
    return [e for e in hub.replay.since(0).events if isinstance(e, Alert) and e.code == "recommendation"]


def policies(hub: Hub) -> list[str]:
    return [u.policy.name for u in hub.node.units]


def test_a_trusted_switch_is_posted_and_not_applied() -> None:
    hub = make_hub(units=2)
    advisor, ctl, lines = advisor_on(hub, FakeAnalyst([assessment()]))
    assert one_round(advisor) == "alerted"
    message = ("sarathi + least_loaded would gain +12.3% effective RPS over vllm + least_loaded on the last 5 min "
               "(fidelity: goodput 1.2%, SLO 0.4%)")
    assert [a.message for a in posted(hub)] == [message]
    assert ctl.kinds() == ["post_alert"] and policies(hub) == ["vllm", "vllm"]
    assert lines == [f"test-node: posted a recommendation alert: {message}"]
    assert advisor.nodes["ws://gpu-7"].since_ns == 100


def test_poor_fidelity_keep_and_skipped_windows_post_nothing() -> None:
    hub = make_hub(units=2)
    analyst = FakeAnalyst([assessment(goodput_err=0.15), assessment(slo_err=0.11), assessment("keep"),
                           Skipped("12 finished or refused requests in the window, fewer than 50", 300)])
    advisor, ctl, lines = advisor_on(hub, analyst)
    assert [one_round(advisor) for _ in range(4)] == ["untrusted", "untrusted", "keep", "skipped"]
    assert ctl.sent == [] and posted(hub) == []
    assert "too far from the record to trust it (goodput 15.0%, SLO 0.4%; the bound is 10%)" in lines[0]
    assert lines[2] == ("test-node: 500 requests over the last 5 min: keep vllm + least_loaded: the best candidate, "
                        "sarathi, gains +1.0%")
    assert lines[3] == "test-node: skipped: 12 finished or refused requests in the window, fewer than 50"
    assert analyst.calls[-1] == "assess since 100" and advisor.nodes["ws://gpu-7"].since_ns == 300


def test_without_a_token_the_recommendation_is_printed_only() -> None:
    hub = make_hub(units=2)
    advisor, _, lines = advisor_on(hub, FakeAnalyst([assessment(goodput_err=None, gain=None)]), control=False)
    assert one_round(advisor) == "printed" and posted(hub) == []
    assert lines == ["test-node: recommendation (printed only: no --token-file to post it): sarathi + least_loaded "
                     "would meet SLOs where vllm + least_loaded met none in the replay on the last 5 min (fidelity: "
                     "goodput n/a, SLO 0.4%)"]
    with pytest.raises(ValueError, match="autopilot needs control"):
        Advisor(AdvisorSettings(every_s=60, autopilot=True))


def test_autopilot_applies_after_a_dry_run_and_rolls_back_when_attainment_drops() -> None:
    hub = make_hub(units=2)
    analyst = FakeAnalyst([assessment(attainment=0.9)], [None, Observed(0, 1, 400, 0.80)])
    advisor, ctl, _ = advisor_on(hub, analyst, autopilot=True)
    assert one_round(advisor) == "applied"
    assert ctl.kinds() == ["status", "dry_run:set_batch_policy", "set_batch_policy", "post_alert"]
    assert policies(hub) == ["sarathi", "sarathi"]
    check = advisor.nodes["ws://gpu-7"].check
    assert check is not None and check.last_good == "vllm + least_loaded"
    swap = next(e for e in hub.replay.since(0).events if isinstance(e, ControlAudit) and e.result == "applied")
    assert swap.action == "set_batch_policy" and check.after_seq == swap.seq
    assert posted(hub)[-1].message.startswith("autopilot: switched vllm + least_loaded to sarathi + least_loaded: "
                                              "sarathi + least_loaded would gain +12.3%")
    assert one_round(advisor) == "pending"  # no full window after the swap yet: no what-if, no swap
    assert analyst.calls == ["assess since 0", f"observe after {swap.seq}"]
    assert one_round(advisor) == "rolled_back"
    assert analyst.calls[2:] == [f"observe after {swap.seq}"]  # a rollback is the round's swap: no what-if after it
    assert policies(hub) == ["vllm", "vllm"] and advisor.nodes["ws://gpu-7"].check is None
    assert posted(hub)[-1].severity == "warning"
    assert posted(hub)[-1].message == (
        "autopilot: rolled sarathi + least_loaded back to vllm + least_loaded: SLO attainment fell from 90.0% to "
        "80.0% over the 5 min after the swap (400 requests), more than 5.0 points")
    applied = [(e.action, e.new[0].policy) for e in hub.replay.since(0).events
               if isinstance(e, ControlAudit) and e.result == "applied" and e.action != "post_alert"]
    assert applied == [("set_batch_policy", "sarathi"), ("set_batch_policy", "vllm")]


def test_autopilot_keeps_a_swap_whose_attainment_holds_then_advises_again() -> None:
    hub = make_hub(units=2)
    analyst = FakeAnalyst([assessment(attainment=0.9), assessment("keep", mark_ns=200)],
                          [Observed(0, 1, 400, 0.86)])
    advisor, _, lines = advisor_on(hub, analyst, autopilot=True)
    assert one_round(advisor) == "applied"
    assert one_round(advisor) == "keep"  # held (a drop of 4 points is within 5), then the what-if on the new window
    seq = advisor_seq(hub)
    assert analyst.calls == ["assess since 0", f"observe after {seq}", "assess since 100"]
    assert policies(hub) == ["sarathi", "sarathi"] and advisor.nodes["ws://gpu-7"].check is None
    assert any("autopilot: sarathi + least_loaded holds: SLO attainment 90.0% before the swap, 86.0%" in line
               for line in lines)


def advisor_seq(hub: Hub) -> int:
    """The stream position of the hub's first applied policy swap."""
    return next(e.seq for e in hub.replay.since(0).events
                if isinstance(e, ControlAudit) and e.result == "applied" and e.action == "set_batch_policy")


def test_autopilot_applies_nothing_when_the_dry_run_is_refused() -> None:
    hub = make_hub(units=2)
    advisor, ctl, _ = advisor_on(hub, FakeAnalyst([assessment(params={"tbt_target_ms": 0.5})]), autopilot=True)
    assert one_round(advisor) == "dry_run_refused"
    assert ctl.kinds() == ["status", "dry_run:set_batch_policy", "post_alert"]
    assert policies(hub) == ["vllm", "vllm"] and advisor.nodes["ws://gpu-7"].check is None
    alert = posted(hub)[-1]
    assert alert.severity == "warning"
    assert alert.message.startswith("autopilot: the dry run of set_batch_policy sarathi was refused (bad_param: ")
    assert alert.message.endswith("nothing applied. " + recommendation_message(assessment(), MINUTES_5))


def test_the_changes_of_a_swap_and_of_its_rollback() -> None:
    hub = make_hub(units=3)
    hub.handle(SetBatchPolicy(policy="sarathi", params={"tbt_target_ms": 40.0}, unit_ids=(2,), token=TOKEN,
                              control_id="c1"), who="test")
    rec = {"batch_policy": "eb", "dispatch": "round_robin", "params": {"tbt_target_ms": 1.0, "x": 2}}
    swap = recommendation_changes({**rec, "batch_policy": "sarathi"}, "vllm", "least_loaded")
    assert swap == [SetBatchPolicy(policy="sarathi", params={"tbt_target_ms": 1.0}),
                    SetDispatchPolicy(policy="round_robin", params={"x": 2})]
    assert recommendation_changes({**rec, "dispatch": "least_loaded"}, "vllm", "least_loaded") == [
        SetBatchPolicy(policy="eb", params={})]
    status = hub.status()
    vllm_params = dict(hub.node.units[0].policy.params)
    assert restore_changes(status, swap) == (
        SetBatchPolicy(policy="vllm", params=vllm_params, unit_ids=(0, 1)),
        SetBatchPolicy(policy="sarathi", params=dict(hub.node.units[2].policy.params), unit_ids=(2,)),
        SetDispatchPolicy(policy="least_loaded", params=dict(hub.node.dispatcher.params)))
    assert status_label(status) == "sarathi/vllm + least_loaded"


def test_record_flags() -> None:
    parser = argparse.ArgumentParser()
    add_serve_commands(parser.add_subparsers(dest="command"))

    def settings(*args: str, token: str = "") -> AdvisorSettings | None:
        return advisor_settings(parser.parse_args(["record", "ws://h:1", "--db", "x.duckdb", *args]), token)

    def refused(*args: str, token: str = "") -> str:
        with pytest.raises((ServeError, UnknownPolicyError)) as info:
            settings(*args, token=token)
        return str(info.value.args[0])

    assert settings() is None
    got = settings("--advise-every", "5m", "--advise-compare", "vllm,sarathi", "--autopilot", token=TOKEN)
    assert got is not None and (got.every_s, got.window, got.compare) == (300, 300, ("vllm", "sarathi"))
    assert (got.autopilot, got.min_gain, got.rollback_drop, got.jobs >= 1) == (True, 0.05, 0.05, True)
    assert refused("--advise-every", "5s") == "--advise-every must be at least 10s (a what-if takes seconds)"
    assert refused("--autopilot", token=TOKEN) == "--autopilot needs --advise-every DURATION (the advisor's period)"
    assert refused("--advise-every", "5m", "--autopilot") == (
        "--autopilot needs --token-file with the agents' control token")
    assert "nosuch" in refused("--advise-every", "5m", "--advise-compare", "vllm,nosuch")


# -- end to end -------------------------------------------------------------------------------------------------------
def test_the_recorders_advisor_posts_a_recommendation_that_is_recorded(tmp_path: Path) -> None:
    """A real agent running ``static`` (nearly every request misses its SLO), recorded with the advisor every 2 s on
    a window that holds the whole run: the what-if replays it in a worker process, ``vllm`` beats it, the alert is
    posted with the token, recorded, and nothing is applied."""
    db = tmp_path / "t.duckdb"

    async def go() -> tuple[int, list[str], list[str]]:
        hub = make_hub(units=2, workload="poisson:n=120,rate=20", batch_policy="static")
        async with make_server(hub, speed=20.0) as server:
            lines: list[str] = []
            advisor = Advisor(AdvisorSettings(every_s=2.0, window_s=600.0, compare=("vllm",), jobs=1),
                              control=SessionControl(TOKEN), say=lines.append)
            alerts: list[Alert] = []
            stop = asyncio.Event()
            recording = asyncio.create_task(record([server.url], db, stop=stop, flush_s=0.2, token=TOKEN,
                                                   advisor=advisor,
                                                   writer_factory=lambda p: WatchingWriter(p, alerts)))
            await wait_for(lambda: bool(recommendations(alerts)) or recording.done(), timeout_s=60,
                           what=f"a recommendation alert recorded ({lines})")
            stop.set()
            return await recording, lines, policies(hub)

    code, lines, running = run(go, timeout_s=90)
    assert code == 0 and running == ["static", "static"], lines
    con = duckdb.connect(str(db), read_only=True)
    try:
        stored = con.execute("SELECT node_id, message FROM alerts WHERE code = 'recommendation'").fetchall()
    finally:
        con.close()
    assert stored, lines
    node_id, message = stored[0]
    assert node_id == "test-node"
    assert message.startswith("vllm + least_loaded would gain +") and "effective RPS over static + least_loaded on " \
        "the last 10 min (fidelity: goodput " in message, message
    assert any(line.startswith("test-node: posted a recommendation alert: vllm + least_loaded") for line in lines)
