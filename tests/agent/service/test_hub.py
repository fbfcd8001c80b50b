"""The Sans-I/O hub without sockets: stream stamping, resume bounds, control replies and audit events."""

from __future__ import annotations

from serve_harness import TOKEN, make_hub

from agent.telemetry import (
    Alert,
    ControlAudit,
    ErrorReply,
    Event,
    FailUnit,
    OkReply,
    PauseUnit,
    RecoverUnit,
    SetBatchPolicy,
    SetDispatchPolicy,
    SetParams,
    Status,
    StatusInfo,
    Subscribe,
    Subscribed,
)
from agent.telemetry.stream import Subscription


def drain(sub: Subscription | None) -> list[Event]:
    """Everything a subscription has for its sender now (a resume's replay included)."""
    assert sub is not None
    out = []
    while (event := sub.pop()) is not None:
        out.append(event)
    return out


def test_a_resume_longer_than_the_live_queue_drops_nothing() -> None:
    hub = make_hub(max_queued=16)
    hub.attach()
    hub.node.advance(3.0)
    assert hub.sequencer.last_seq > 500
    sub, reply, position = hub.subscribe(Subscribe(resume_after_seq=0), lambda: None)
    assert sub is not None and isinstance(reply, OkReply) and position == 0 and sub.replaying
    hub.node.advance(5.0)  # while it replays, live events wait in the replay buffer, not in its queue
    backlog = drain(sub)
    assert [e.seq for e in backlog] == list(range(1, hub.sequencer.last_seq + 1)) and sub.num_dropped == 0
    hub.node.advance(6.0)  # caught up: live events beyond the bound are dropped, and announced
    assert len(sub) == 16 + 1 and sub.num_dropped > 0
    first = sub.pop()
    assert isinstance(first, Alert) and first.code == "flow_control" and first.first_seq == backlog[-1].seq + 1


def test_a_resume_past_the_buffer_starts_with_a_gap_alert() -> None:
    hub = make_hub(replay_capacity=100)
    hub.attach()
    hub.node.advance(3.0)
    sub, _, _ = hub.subscribe(Subscribe(resume_after_seq=10, kinds=("step",)), lambda: None)
    backlog = drain(sub)
    gap = backlog[0]
    oldest = hub.replay.oldest_seq
    assert isinstance(gap, Alert) and (gap.code, gap.first_seq, gap.last_seq, gap.seq) == ("gap", 11, oldest - 1, 0)
    assert backlog[1:] and all(e.__struct_config__.tag == "step" and e.seq >= oldest for e in backlog[1:])


def test_a_resume_position_of_an_earlier_run_restarts_from_this_runs_first_event() -> None:
    hub = make_hub(replay_capacity=1000)
    hub.attach()
    hub.node.advance(0.5)
    assert 20 < hub.sequencer.last_seq < 1000, "seq 1 still buffered"
    earlier_run = hub.boot_ns - 10**9
    sub, reply, _ = hub.subscribe(Subscribe(resume_after_seq=10, resume_boot_ns=earlier_run), lambda: None)
    assert isinstance(reply, OkReply) and isinstance(reply.payload, Subscribed)
    assert reply.payload.resumed_after_seq == 0 and reply.payload.num_replayed == hub.sequencer.last_seq
    backlog = drain(sub)
    assert [e.seq for e in backlog] == list(range(1, hub.sequencer.last_seq + 1)), "nothing at or below 10 skipped"
    # its own run: as before; a position ahead of an earlier run's stream is no error either
    sub, reply, _ = hub.subscribe(Subscribe(resume_after_seq=10, resume_boot_ns=hub.boot_ns), lambda: None)
    assert isinstance(reply, OkReply) and isinstance(reply.payload, Subscribed)
    assert reply.payload.resumed_after_seq == 10 and drain(sub)[0].seq == 11
    _, reply, _ = hub.subscribe(Subscribe(resume_after_seq=10**6, resume_boot_ns=earlier_run), lambda: None)
    assert isinstance(reply, OkReply)
    _, reply, _ = hub.subscribe(Subscribe(resume_after_seq=10**6, resume_boot_ns=hub.boot_ns), lambda: None)
    assert isinstance(reply, ErrorReply) and reply.code == "bad_resume_seq"
    # once seq 1 is gone, the restart begins with a gap alert
    hub.node.advance(3.0)
    sub, _, _ = hub.subscribe(Subscribe(resume_after_seq=10, resume_boot_ns=earlier_run), lambda: None)
    backlog = drain(sub)
    gap = backlog[0]
    assert isinstance(gap, Alert) and (gap.code, gap.first_seq, gap.last_seq) == ("gap", 1, hub.replay.oldest_seq - 1)
    assert backlog[1].seq == hub.replay.oldest_seq


def test_control_replies_and_audit_events() -> None:
    hub = make_hub(units=2)
    hub.attach()
    seen: list[ControlAudit] = []
    sub, _, _ = hub.subscribe(Subscribe(kinds=("audit",)), lambda: None)
    assert sub is not None

    ok = hub.handle(SetBatchPolicy(policy="sarathi", params={"tbt_target_ms": 40}, unit_ids=(1,), token=TOKEN,
                                   control_id="a"), who="test")
    assert isinstance(ok, OkReply) and isinstance(ok.payload, ControlAudit) and ok.control_id == "a"
    audit = ok.payload
    assert audit.result == "applied" and audit.unit_ids == (1,) and audit.actor == "test"
    assert [(s.unit_id, s.policy) for s in audit.old] == [(1, "vllm")]
    assert [(s.unit_id, s.policy, s.params["tbt_target_ms"]) for s in audit.new] == [(1, "sarathi", 40.0)]

    bad = hub.handle(SetParams(target="dispatch", params={"nope": 1}, token=TOKEN, control_id="b"), who="test")
    assert isinstance(bad, ErrorReply) and bad.code == "bad_param" and bad.control_id == "b"
    mode = hub.handle(PauseUnit(unit_id=0, token=TOKEN, control_id="c"), who="test")
    assert isinstance(mode, OkReply) and isinstance(mode.payload, ControlAudit)
    assert [(s.unit_id, s.mode) for s in mode.payload.old] == [(0, "active")]
    assert [(s.unit_id, s.mode) for s in mode.payload.new] == [(0, "paused")]
    disp = hub.handle(SetDispatchPolicy(policy="round_robin", token=TOKEN, control_id="d"), who="test")
    assert isinstance(disp, OkReply) and isinstance(disp.payload, ControlAudit)
    assert disp.payload.old[0].policy == "least_loaded" and disp.payload.new[0].unit_id is None

    while (frame := sub.pop()) is not None:
        assert isinstance(frame, ControlAudit)
        seen.append(frame)
    assert [a.result for a in seen] == ["applied", "rejected", "applied", "applied"], "every action is audited"
    status = hub.handle(Status(), who="test")
    assert isinstance(status, OkReply) and isinstance(status.payload, StatusInfo)
    assert [u.mode for u in status.payload.units] == ["paused", "active"]


def test_without_a_token_control_is_disabled() -> None:
    hub = make_hub(token="")
    reply = hub.handle(PauseUnit(unit_id=0, token=""), who="test")
    assert isinstance(reply, ErrorReply) and reply.code == "unauthorized" and "disabled" in reply.message
    assert hub.node.unit_modes[0] == "active"


def test_fail_and_recover_a_unit_through_the_control_plane() -> None:
    hub = make_hub(units=2)
    hub.attach()
    node = hub.node
    sub, _, _ = hub.subscribe(Subscribe(kinds=("audit", "alert")), lambda: None)
    assert sub is not None
    hub.node.advance(2.0)
    on_0 = {rid for rid, s in node.states.items() if s.unit_id == 0 and s.outcome is None}
    assert on_0

    failed = hub.handle(FailUnit(unit_id=0, reason="maintenance", token=TOKEN, control_id="f"), who="test")
    assert isinstance(failed, OkReply) and isinstance(failed.payload, ControlAudit) and failed.control_id == "f"
    audit = failed.payload
    assert (audit.action, audit.result) == ("set_unit_mode", "applied")
    assert [(s.unit_id, s.mode) for s in audit.old] == [(0, "active")]
    assert [(s.unit_id, s.mode) for s in audit.new] == [(0, "failed")]
    assert audit.message == "failed by test: maintenance"
    assert node.unit_modes == ["failed", "active"]
    assert all(node.states[r].unit_id == 1 for r in on_0 if node.states[r].outcome is None)

    again = hub.handle(FailUnit(unit_id=0, token=TOKEN, control_id="g"), who="test")
    assert isinstance(again, ErrorReply) and again.code == "bad_request" and "has failed already" in again.message
    not_failed = hub.handle(RecoverUnit(unit_id=1, token=TOKEN, control_id="h"), who="test")
    assert isinstance(not_failed, ErrorReply) and "has not failed" in not_failed.message
    unknown = hub.handle(FailUnit(unit_id=9, token=TOKEN, control_id="i"), who="test")
    assert isinstance(unknown, ErrorReply) and unknown.code == "unknown_unit"
    denied = hub.handle(RecoverUnit(unit_id=0, token="wrong", control_id="j"), who="test")
    assert isinstance(denied, ErrorReply) and denied.code == "unauthorized" and node.unit_modes[0] == "failed"

    back = hub.handle(RecoverUnit(unit_id=0, token=TOKEN, control_id="k"), who="test")
    assert isinstance(back, OkReply) and isinstance(back.payload, ControlAudit)
    assert [(s.unit_id, s.mode) for s in back.payload.old] == [(0, "failed")]
    assert [(s.unit_id, s.mode) for s in back.payload.new] == [(0, "active")]
    assert node.unit_modes == ["active", "active"]

    frames = []
    while (frame := sub.pop()) is not None:
        frames.append(frame)
    alerts = [(f.code, f.unit_id, f.severity) for f in frames if isinstance(f, Alert)]
    assert alerts == [("unit_failed", 0, "error"), ("unit_restarted", 0, "info")]
    fault = next(f for f in frames if isinstance(f, Alert))
    assert fault.message.startswith("unit 0 failed: failed by test: maintenance (")
    assert [f.result for f in frames if isinstance(f, ControlAudit)] == ["applied", "rejected", "rejected",
                                                                            "rejected", "rejected", "applied"]
    node.run()
    assert node.num_finished + node.num_rejected == len(node.arrivals) and not node.unfinished()
