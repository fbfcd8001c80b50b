"""The control plane's semantics without sockets (issue #16): a change applies once per ``control_id``, parameters are
audited as parsed, refused tokens are audited, and a read token opens reads only."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from serve_harness import TOKEN

from agent.bench.runner import BenchConfig
from agent.cli.serve import make_node
from agent.runtime.control import ControlIds
from agent.service.hub import Hub
from agent.telemetry import (
    ControlAudit,
    DryRun,
    ErrorReply,
    Event,
    ListPolicies,
    OkReply,
    PauseUnit,
    SetBatchPolicy,
    SetParams,
    Status,
    Subscribe,
)
from agent.telemetry.stream import Subscription
from agent.workload.spec import parse_workload

READ_TOKEN = "r3ad-only-for-tests"


def hub_of(*, token: str = TOKEN, read_token: str = "", clock: Callable[[], int] = time.time_ns,
           window_s: float = 600.0, kept: int = 4096) -> Hub:
    config = BenchConfig(units=2, batch_policy="vllm", dispatch="least_loaded")
    node = make_node(config, parse_workload("poisson:n=50,rate=20", seed=1))
    hub = Hub(node, node_id="n", profile=config.profile, token=token, read_token=read_token, get_time_ns=clock,
              control_id_window_s=window_s, control_ids_kept=kept)
    hub.attach()
    return hub


def audits_of(sub: Subscription | None) -> list[ControlAudit]:
    assert sub is not None
    out: list[Event] = []
    while (event := sub.pop()) is not None:
        out.append(event)
    return [e for e in out if isinstance(e, ControlAudit)]


def audit_sub(hub: Hub) -> Subscription | None:
    sub, reply, _ = hub.subscribe(Subscribe(kinds=("audit",), token=TOKEN), lambda: None)
    assert isinstance(reply, OkReply)
    return sub


# -- control ids ----------------------------------------------------------------------------------------------
def test_a_repeated_control_id_is_refused_and_applies_nothing() -> None:
    hub = hub_of()
    sub = audit_sub(hub)
    first = hub.handle(SetParams(target="dispatch", params={"waiting_weight": 2.0}, token=TOKEN, control_id="x1"),
                       who="op")
    assert isinstance(first, OkReply)
    again = hub.handle(SetParams(target="dispatch", params={"waiting_weight": 9.0}, token=TOKEN, control_id="x1"),
                       who="op")
    assert isinstance(again, ErrorReply) and again.code == "duplicate_control_id" and again.control_id == "x1"
    applied = audits_of(sub)
    assert "nothing was done again" in again.message and f"seq {applied[0].seq}" in again.message
    assert "applied" in again.message and "lost reply" in again.message
    assert hub.node.dispatcher.params["waiting_weight"] == 2.0, "the repeat was applied"
    assert [(a.result, a.error_code) for a in applied] == [("applied", ""), ("rejected", "duplicate_control_id")]
    # a dry run, a rejected change and a unit mode change spend their ids too
    assert isinstance(hub.handle(DryRun(change=SetParams(target="batch", params={"max_num_batched_tokens": 64}),
                                        token=TOKEN, control_id="x2"), who="op"), OkReply)
    assert isinstance(hub.handle(SetBatchPolicy(policy="nosuch", token=TOKEN, control_id="x3"), who="op"), ErrorReply)
    assert isinstance(hub.handle(PauseUnit(unit_id=0, token=TOKEN, control_id="x4"), who="op"), OkReply)
    for cid in ("x2", "x3", "x4"):
        reply = hub.handle(PauseUnit(unit_id=1, token=TOKEN, control_id=cid), who="op")
        assert isinstance(reply, ErrorReply) and reply.code == "duplicate_control_id", cid
    assert hub.node.unit_modes == ["paused", "active"]


def test_a_change_without_a_control_id_is_refused_and_audited() -> None:
    hub = hub_of()
    sub = audit_sub(hub)
    reply = hub.handle(PauseUnit(unit_id=0, token=TOKEN), who="op")
    assert isinstance(reply, ErrorReply) and reply.code == "invalid_field" and "control_id" in reply.message
    assert hub.node.unit_modes == ["active", "active"]
    (audit,) = audits_of(sub)
    assert (audit.action, audit.result, audit.error_code, audit.actor) == ("pause_unit", "rejected", "invalid_field",
                                                                           "op")


def test_reads_need_no_control_id_and_may_repeat_it() -> None:
    hub = hub_of()
    for _ in range(2):
        assert isinstance(hub.handle(Status(control_id="s"), who="op"), OkReply)
        assert isinstance(hub.handle(ListPolicies(), who="op"), OkReply)
    assert len(hub.control_ids) == 0 and hub.control.audit_log == []


def test_the_window_keeps_ids_for_its_time_and_its_count_whichever_is_longer() -> None:
    ids = ControlIds(window_ns=100, min_kept=2, max_kept=4)
    for i, t in enumerate((0, 10, 20)):
        ids.use(f"c{i}", t)
    assert ids.first_use("c0", 50) is not None, "within the time window"
    assert ids.first_use("c0", 111) is None and ids.first_use("c1", 111) is not None, "past it, beyond the count"
    assert ids.first_use("c1", 10_000) is not None and len(ids) == 2, "the last min_kept stay, however old"
    for i in range(3, 9):
        ids.use(f"c{i}", 10_001)
    assert len(ids) == 4 and ids.first_use("c4", 10_001) is None, "never more than max_kept"
    with pytest.raises(ValueError):
        ControlIds(window_ns=-1)


def test_the_hub_forgets_an_id_after_its_window() -> None:
    now = [0]
    hub = hub_of(clock=lambda: now[0], window_s=60.0, kept=1)
    assert isinstance(hub.handle(PauseUnit(unit_id=0, token=TOKEN, control_id="w"), who="op"), OkReply)
    assert isinstance(hub.handle(PauseUnit(unit_id=1, token=TOKEN, control_id="v"), who="op"), OkReply)
    now[0] = 59 * 10**9
    reply = hub.handle(PauseUnit(unit_id=0, token=TOKEN, control_id="w"), who="op")
    assert isinstance(reply, ErrorReply) and reply.code == "duplicate_control_id"
    now[0] = 61 * 10**9
    assert isinstance(hub.handle(PauseUnit(unit_id=0, token=TOKEN, control_id="w"), who="op"), OkReply)


# -- parameters -------------------------------------------------------------------------------------------------
def test_a_string_parameter_is_applied_and_audited_as_the_schemas_type() -> None:
    hub = hub_of()
    reply = hub.handle(SetParams(target="dispatch", params={"waiting_weight": "0.5"}, token=TOKEN, control_id="p1"),
                       who="op")
    assert isinstance(reply, OkReply) and isinstance(reply.payload, ControlAudit)
    (new,) = reply.payload.new
    assert new.params == {"waiting_weight": 0.5} and type(new.params["waiting_weight"]) is float
    assert hub.control.audit_log[-1].new == {"waiting_weight": 0.5}
    assert type(hub.node.dispatcher.params["waiting_weight"]) is float
    units = hub.handle(SetParams(target="batch", params={"max_num_batched_tokens": "2048.0"}, token=TOKEN,
                                 control_id="p2"), who="op")
    assert isinstance(units, OkReply) and isinstance(units.payload, ControlAudit)
    assert [s.params for s in units.payload.new] == [{"max_num_batched_tokens": 2048}] * 2
    assert type(units.payload.new[0].params["max_num_batched_tokens"]) is int
    swap = hub.handle(SetBatchPolicy(policy="sarathi", params={"tbt_target_ms": "40"}, token=TOKEN, control_id="p3"),
                      who="op")
    assert isinstance(swap, OkReply) and isinstance(swap.payload, ControlAudit)
    assert type(swap.payload.new[0].params["tbt_target_ms"]) is float


@pytest.mark.parametrize("value", [2**63 - 1, "9223372036854775807", 1 << 21, "12.5", "lots", True])
def test_an_integer_out_of_range_or_not_an_integer_is_refused(value: int | str | bool) -> None:
    hub = hub_of()
    reply = hub.handle(SetParams(target="batch", params={"max_num_batched_tokens": value}, token=TOKEN,
                                 control_id="big"), who="op")
    assert isinstance(reply, ErrorReply) and reply.code == "bad_param", reply
    assert len(reply.message) < 200
    assert all(u.policy.params["max_num_batched_tokens"] == 0 for u in hub.node.units)


# -- tokens -----------------------------------------------------------------------------------------------------
def test_a_refused_token_is_audited_without_the_token() -> None:
    hub = hub_of()
    sub = audit_sub(hub)
    wrong = "not-the-token-" + "x" * 20
    reply = hub.handle(SetParams(target="dispatch", params={"waiting_weight": 1.0}, token=wrong, control_id="t1"),
                       who="ws:10.0.0.9:5555")
    assert isinstance(reply, ErrorReply) and reply.code == "unauthorized"
    missing = hub.handle(PauseUnit(unit_id=0, control_id="t2"), who="ws:10.0.0.9:5556")
    assert isinstance(missing, ErrorReply) and missing.code == "unauthorized"
    audits = audits_of(sub)
    assert [(a.actor, a.action, a.result, a.error_code, a.control_id) for a in audits] == [
        ("ws:10.0.0.9:5555", "set_params", "rejected", "unauthorized", "t1"),
        ("ws:10.0.0.9:5556", "pause_unit", "rejected", "unauthorized", "t2"),
    ]
    assert all(wrong not in str(a) for a in audits) and audits[0].new == ()
    assert len(hub.control_ids) == 0, "a refused token spends no control id"
    assert hub.node.dispatcher.params["waiting_weight"] == 4.0


def test_with_a_read_token_reads_need_a_token_and_changes_the_control_token() -> None:
    hub = hub_of(read_token=READ_TOKEN)
    sub = audit_sub(hub)
    for token in (READ_TOKEN, TOKEN):
        assert isinstance(hub.handle(Status(token=token), who="op"), OkReply)
        assert isinstance(hub.handle(ListPolicies(token=token), who="op"), OkReply)
        ok_sub, ok, _ = hub.subscribe(Subscribe(token=token), lambda: None, who="op")
        assert ok_sub is not None and isinstance(ok, OkReply)
    for token in ("", "wrong"):
        status = hub.handle(Status(token=token), who="op")
        assert isinstance(status, ErrorReply) and status.code == "unauthorized"
        none_sub, refused, _ = hub.subscribe(Subscribe(token=token), lambda: None, who="dash")
        assert none_sub is None and isinstance(refused, ErrorReply) and refused.code == "unauthorized"
    change = hub.handle(PauseUnit(unit_id=0, token=READ_TOKEN, control_id="r1"), who="dash")
    assert isinstance(change, ErrorReply) and change.code == "unauthorized" and "read token" in change.message
    assert hub.node.unit_modes == ["active", "active"]
    audits = audits_of(sub)
    assert [(a.action, a.actor) for a in audits] == [("status", "op"), ("subscribe", "dash"), ("status", "op"),
                                                     ("subscribe", "dash"), ("pause_unit", "dash")]
    assert {(a.result, a.error_code) for a in audits} == {("rejected", "unauthorized")}
    assert hub.accepts_token(READ_TOKEN) and hub.reads_need_token


def test_without_a_read_token_reads_stay_open() -> None:
    hub = hub_of()
    assert isinstance(hub.handle(Status(), who="op"), OkReply) and not hub.reads_need_token
    sub, reply, _ = hub.subscribe(Subscribe(), lambda: None)
    assert sub is not None and isinstance(reply, OkReply)
    with pytest.raises(ValueError, match="differ"):
        hub_of(read_token=TOKEN)
