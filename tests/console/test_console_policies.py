"""The Policies screen against a real agent on loopback (hub + server with a token): edit with a dry run and a
confirmation (applied, cancelled, refused at the dry run, rejected at the apply), pause / drain / resume, the audit
log, and the refusals (read-only, no token, replay); then the screen's pure side (rows, ranges, changes, diffs)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from console_fixtures import build_store
from console_pilot import fast_delays, text_of, until
from serve_harness import TOKEN, make_hub, make_server, run
from textual.pilot import Pilot
from textual.widgets import Checkbox, Select, SelectionList, Static

from agent.service.hub import Hub
from agent.service.server import AgentServer
from agent.telemetry import (
    ControlAudit,
    NodeHello,
    ParamSchema,
    PolicySchema,
    SetBatchPolicy,
    SetDispatchPolicy,
    SetParams,
    Setting,
    UnitStatus,
)
from console.app import ConsoleApp
from console.feeds import LiveFeed, ReplayFeed
from console.model.policy_view import (
    audit_line,
    build_change,
    control_refusal,
    describe_range,
    diff_lines,
    param_lines,
    parse_value,
    target_rows,
)
from console.model.state import ConsoleState
from console.screens.confirm import ConfirmScreen
from console.screens.policies import PoliciesScreen
from console.screens.policy_edit import PolicyEditScreen
from console.widgets.audit_log import AuditLog
from console.widgets.policy_table import PolicyTable

WORKLOAD = "poisson:n=20000,rate=5"


@asynccontextmanager
async def agent() -> AsyncIterator[tuple[Hub, AgentServer]]:
    hub = make_hub(units=2, workload=WORKLOAD)
    server = make_server(hub, speed=1.0)
    await server.start()
    try:
        yield hub, server
    finally:
        await server.stop()


@asynccontextmanager
async def fleet(hubs: list[Hub]) -> AsyncIterator[ConsoleApp]:
    """Each hub served by an agent of its own, and a console of all of them with the control token."""
    servers = [make_server(hub, speed=1.0) for hub in hubs]
    for server in servers:
        await server.start()
    try:
        yield ConsoleApp([LiveFeed(s.url, delays=fast_delays) for s in servers], refresh_s=0.25, token=TOKEN)
    finally:
        for server in servers:
            await server.stop()


def live_app(server: AgentServer, **kwargs: object) -> ConsoleApp:
    return ConsoleApp([LiveFeed(server.url, delays=fast_delays)], refresh_s=0.25, **kwargs)  # type: ignore[arg-type]


async def policies_screen(pilot: Pilot[int], row_key: str) -> PoliciesScreen:
    """Switch to the Policies screen, wait for the agent's units and put the cursor on ``row_key``."""
    app = pilot.app
    await pilot.press("6")
    screen = app.screen
    assert isinstance(screen, PoliciesScreen)
    table = screen.query_one(PolicyTable)
    await until(pilot, lambda: table.select_key(row_key), f"the row {row_key}")
    await pilot.pause()
    return screen


def reply_text(screen: PoliciesScreen) -> str:
    return text_of(screen.query_one("#policies-reply", Static))


def results(hub: Hub) -> list[str]:
    return [record.result for record in hub.control.audit_log]


async def edit(pilot: Pilot[int], policy: str | None = None, **values: str) -> None:
    """Open the edit form on the selected row, choose ``policy`` and type ``values``, ask for the dry run."""
    await pilot.press("e")
    form = pilot.app.screen
    assert isinstance(form, PolicyEditScreen)
    if policy is not None:
        form.query_one("#edit-policy", Select).value = policy
        await until(pilot, lambda: not policy or form.chosen_policy == policy, "the policy choice")
        await pilot.pause()
    for name, text in values.items():
        form.inputs[name].value = text
    await pilot.press("ctrl+s")


async def confirm_screen(pilot: Pilot[int]) -> ConfirmScreen:
    await until(pilot, lambda: isinstance(pilot.app.screen, ConfirmScreen), "the confirmation")
    screen = pilot.app.screen
    assert isinstance(screen, ConfirmScreen)
    return screen


# -- edit, dry run, confirm, apply ---------------------------------------------------------------------------------
def test_a_policy_swap_is_dry_run_confirmed_applied_and_audited() -> None:
    async def go() -> None:
        async with agent() as (hub, server):
            app = live_app(server, token=TOKEN)
            async with app.run_test(size=(80, 24)) as pilot:
                screen = await policies_screen(pilot, "unit:test-node:1")
                assert "control on" in text_of(screen.query_one("#policies-control", Static))
                assert "long_prefill_token_threshold = 0  [int 0..1048576 tokens]" in text_of(
                    screen.query_one("#policies-params", Static)
                ), "the running policy's parameters with their ranges"
                await edit(pilot, "sarathi", tbt_target_ms="40")
                confirm = await confirm_screen(pilot)
                assert results(hub) == ["dry_run"], "the dry run reached the agent and changed nothing"
                assert hub.node.units[1].policy.name == "vllm"
                assert "u1: policy vllm -> sarathi" in confirm.lines
                assert "u1:   tbt_target_ms = 40.0" in confirm.lines, "the agent's diff, with the new parameters"
                await pilot.press("y")
                await until(pilot, lambda: results(hub) == ["dry_run", "applied"], "the change applied")
                assert hub.node.units[1].policy.name == "sarathi" and hub.node.units[0].policy.name == "vllm"
                assert hub.node.units[1].policy.params["tbt_target_ms"] == 40.0
                await until(pilot, lambda: "applied" in reply_text(screen), "the reply")
                # the audit comes back on the feed: the state, the table and the audit log follow it
                unit = app.state.nodes["test-node"].units[1]
                await until(pilot, lambda: unit.batch_policy == "sarathi", "the applied audit in the state")
                applied = [a for a in app.state.audits if a.result == "applied"]
                assert len(applied) == 1 and applied[0].action == "set_batch_policy" and applied[0].unit_ids == (1,)
                await until(pilot, lambda: "sarathi" in screen.query_one(PolicyTable).rows_shown[2].cells[2], "row")
                log = screen.query_one(AuditLog).lines_shown
                assert "set_batch_policy applied: u1: policy vllm -> sarathi" in log[0]
                assert "dry_run" in log[1]

    run(go, timeout_s=90)


def test_cancelling_sends_nothing() -> None:
    async def go() -> None:
        async with agent() as (hub, server):
            app = live_app(server, token=TOKEN)
            async with app.run_test(size=(80, 24)) as pilot:
                screen = await policies_screen(pilot, "unit:test-node:0")
                await pilot.press("e")
                assert isinstance(app.screen, PolicyEditScreen)
                await pilot.press("escape")
                assert isinstance(app.screen, PoliciesScreen)
                assert "edit cancelled: nothing sent" in reply_text(screen)
                assert results(hub) == []
                # cancel at the confirmation: only the dry run was sent
                await edit(pilot, "sarathi")
                await confirm_screen(pilot)
                await pilot.press("n")
                assert isinstance(app.screen, PoliciesScreen)
                assert "cancelled: nothing applied" in reply_text(screen)
                await pilot.pause(0.3)
                assert results(hub) == ["dry_run"] and hub.node.units[0].policy.name == "vllm"

    run(go, timeout_s=90)


def test_a_value_the_agent_refuses_shows_its_error_and_asks_nothing() -> None:
    async def go() -> None:
        async with agent() as (hub, server):
            app = live_app(server, token=TOKEN)
            async with app.run_test(size=(80, 24)) as pilot:
                screen = await policies_screen(pilot, "unit:test-node:0")
                await edit(pilot, max_num_batched_tokens="-5")
                await until(pilot, lambda: "refused" in reply_text(screen), "the refusal")
                assert isinstance(app.screen, PoliciesScreen), "no confirmation for a refused change"
                assert "dry run refused by test-node: bad_param" in reply_text(screen)
                assert "below the minimum 0" in reply_text(screen)
                assert screen.query_one("#policies-reply").has_class("-error")
                assert results(hub) == ["rejected"]
                log = screen.query_one(AuditLog)
                await until(pilot, lambda: any("rejected: bad_param" in line for line in log.lines_shown), "the log")
                assert [a.result for a in app.state.audits] == ["rejected"]

    run(go, timeout_s=90)


def test_a_change_rejected_at_apply_shows_the_agents_error() -> None:
    async def go() -> None:
        async with agent() as (hub, server):
            app = live_app(server, token=TOKEN)
            async with app.run_test(size=(80, 24)) as pilot:
                screen = await policies_screen(pilot, "unit:test-node:0")
                await edit(pilot, max_num_batched_tokens="4096")
                confirm = await confirm_screen(pilot)
                assert confirm.lines == ("u0: max_num_batched_tokens 0 -> 4096",)
                # someone else swaps the unit meanwhile: the confirmed change no longer fits its policy
                swap = SetBatchPolicy(policy="sarathi", unit_ids=(0,), token=TOKEN, control_id="other")
                hub.handle(swap, who="someone")
                await pilot.press("y")
                await until(pilot, lambda: "rejected" in reply_text(screen), "the rejection")
                assert "rejected: bad_param: sarathi has no parameter max_num_batched_tokens" in reply_text(screen)
                assert results(hub) == ["dry_run", "applied", "rejected"]
                assert screen.last_result is not None and not screen.last_result.ok

    run(go, timeout_s=90)


def test_drain_and_resume_a_unit_with_confirmation() -> None:
    async def go() -> None:
        async with agent() as (hub, server):
            app = live_app(server, token=TOKEN)
            async with app.run_test(size=(80, 24)) as pilot:
                screen = await policies_screen(pilot, "unit:test-node:1")
                assert screen.check_action("set_mode", ("resume",)) is None, "an active unit cannot be resumed"
                assert screen.check_action("set_mode", ("drain",)) is True
                await pilot.press("d")
                confirm = await confirm_screen(pilot)
                assert confirm.lines == ("u1: active -> drain: it gets no new requests and finishes those it holds",)
                await pilot.press("y")
                await until(pilot, lambda: hub.node.unit_modes[1] == "draining", "the unit draining")
                unit = app.state.nodes["test-node"].units[1]
                await until(pilot, lambda: unit.mode == "draining", "the audit in the state")
                await until(pilot, lambda: screen.check_action("set_mode", ("resume",)) is True, "resume allowed")
                assert screen.check_action("set_mode", ("drain",)) is None
                commands = {c.title: c for c in app.get_system_commands(screen)}
                assert "Policies: drain (u1)" not in commands, "the palette offers what can run"
                commands["Policies: resume (u1)"].callback()  # the palette calls the same action as the key
                await confirm_screen(pilot)
                await pilot.press("y")
                await until(pilot, lambda: hub.node.unit_modes[1] == "active", "the unit active again")
                assert hub.node.unit_modes[0] == "active"
                # a dispatcher row has no mode actions
                screen.query_one(PolicyTable).select_key("dispatch:test-node")
                await pilot.pause()
                assert screen.check_action("set_mode", ("pause",)) is None and screen.check_action("edit", ()) is True

    run(go, timeout_s=90)


def test_dispatch_parameters_are_edited_with_the_dispatchers_schema() -> None:
    async def go() -> None:
        async with agent() as (hub, server):
            app = live_app(server, token=TOKEN)
            async with app.run_test(size=(80, 24)) as pilot:
                screen = await policies_screen(pilot, "dispatch:test-node")
                await edit(pilot, waiting_weight="2")
                confirm = await confirm_screen(pilot)
                assert confirm.lines == ("dispatch: waiting_weight 4.0 -> 2.0",)
                await pilot.press("y")
                await until(pilot, lambda: "applied" in reply_text(screen), "the reply")
                assert hub.node.dispatcher.params["waiting_weight"] == 2.0

    run(go, timeout_s=90)


def test_one_edit_on_every_node_or_on_none() -> None:
    """Two agents (as one node run with ``--agents 2``): "the same on every node" sends the dry run to both, shows
    both diffs, and applies on both; a change one of them refuses is applied on neither."""

    async def go() -> None:
        hubs = [make_hub(units=2, workload=WORKLOAD), make_hub(units=3, workload=WORKLOAD, node_id="node-b")]
        async with fleet(hubs) as app, app.run_test(size=(100, 30)) as pilot:
            screen = await policies_screen(pilot, "unit:node-b:2")
            await until(pilot, lambda: len(app.state.nodes) == 2, "both nodes")
            await pilot.press("e")
            form = app.screen
            assert isinstance(form, PolicyEditScreen) and form.others == ("test-node",)
            form.query_one("#edit-policy", Select).value = "sarathi"
            await until(pilot, lambda: form.chosen_policy == "sarathi", "the policy choice")
            form.query_one("#edit-every-node", Checkbox).value = True  # unit 2: test-node has none
            await until(pilot, lambda: form.also == ("test-node",), "every node chosen")
            await pilot.press("ctrl+s")
            await until(pilot, lambda: "nothing sent to any node" in reply_text(screen), "the refusal")
            assert "test-node: unknown_unit" in reply_text(screen)
            assert [results(h) for h in hubs] == [["rejected"], ["dry_run"]]
            await pilot.press("e")
            form = app.screen
            assert isinstance(form, PolicyEditScreen)
            form.query_one("#edit-policy", Select).value = "sarathi"
            await until(pilot, lambda: form.chosen_policy == "sarathi", "the policy choice")
            form.query_one("#edit-every-unit", Checkbox).value = True
            form.query_one("#edit-every-node", Checkbox).value = True
            await until(pilot, lambda: form.also == ("test-node",), "every node chosen")
            await pilot.press("ctrl+s")
            confirm = await confirm_screen(pilot)
            assert "node-b: u2: policy vllm -> sarathi" in confirm.lines
            assert "test-node: u1: policy vllm -> sarathi" in confirm.lines
            await pilot.press("y")
            await until(pilot, lambda: "applied on 2 nodes" in reply_text(screen), "the reply")
            assert [[u.policy.name for u in h.node.units] for h in hubs] == [["sarathi"] * 2, ["sarathi"] * 3]

    run(go, timeout_s=90)


def test_one_edit_on_the_nodes_chosen() -> None:
    """Three nodes: the form offers the other two; "every node" chooses both, and taking one out of the list leaves
    the other (and clears "every node"). The change goes to the edited node and the one chosen, not the third."""

    async def go() -> None:
        hubs = [make_hub(units=2, workload=WORKLOAD, node_id=n) for n in ("test-node", "node-b", "node-c")]
        async with fleet(hubs) as app, app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: len(app.state.nodes) == 3, "three nodes")
            screen = await policies_screen(pilot, "unit:test-node:1")
            await pilot.press("e")
            form = app.screen
            assert isinstance(form, PolicyEditScreen) and sorted(form.others) == ["node-b", "node-c"]
            assert form.also == ()  # none chosen until asked
            form.query_one("#edit-policy", Select).value = "sarathi"
            await until(pilot, lambda: form.chosen_policy == "sarathi", "the policy choice")
            every = form.query_one("#edit-every-node", Checkbox)
            every.value = True
            await until(pilot, lambda: sorted(form.also) == ["node-b", "node-c"], "every node chosen")
            form.query_one("#edit-nodes", SelectionList).deselect("node-b")
            await until(pilot, lambda: not every.value, "every node unticked")
            assert form.also == ("node-c",)
            await pilot.press("ctrl+s")
            confirm = await confirm_screen(pilot)
            assert "test-node: u1: policy vllm -> sarathi" in confirm.lines
            assert "node-c: u1: policy vllm -> sarathi" in confirm.lines
            assert not [line for line in confirm.lines if "node-b" in line]
            await pilot.press("y")
            await until(pilot, lambda: "applied on 2 nodes" in reply_text(screen), "the reply")
            assert [[u.policy.name for u in h.node.units] for h in hubs] == [
                ["vllm", "sarathi"], ["vllm", "vllm"], ["vllm", "sarathi"]]
            assert results(hubs[1]) == []

    run(go, timeout_s=90)


# -- refusals ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "why"),
    [({"read_only": True, "token": TOKEN}, "read-only console"), ({}, "no control token")],
)
def test_control_is_greyed_out_and_nothing_is_sent(options: dict[str, object], why: str) -> None:
    async def go() -> None:
        async with agent() as (hub, server):
            app = live_app(server, **options)
            async with app.run_test(size=(80, 24)) as pilot:
                screen = await policies_screen(pilot, "unit:test-node:1")
                assert why in text_of(screen.query_one("#policies-control", Static))
                assert screen.query_one("#policies-control").has_class("-refused")
                for action, params in [("edit", ()), ("set_mode", ("pause",)), ("set_mode", ("drain",))]:
                    assert screen.check_action(action, params) is None, action
                bindings = screen.active_bindings
                assert not bindings["e"].enabled and not bindings["p"].enabled and not bindings["d"].enabled
                assert not [c for c in app.get_system_commands(screen) if c.title.startswith("Policies: ")]
                await pilot.press("e", "p", "d", "r")
                assert isinstance(app.screen, PoliciesScreen), "no form, no confirmation"
                screen.action_edit()  # as the palette or a remapped key could: refused with the reason
                assert why in reply_text(screen)
                await pilot.pause(0.3)
                assert results(hub) == [] and hub.node.unit_modes == ["active", "active"]

    run(go, timeout_s=90)


def test_a_replay_cannot_be_controlled(tmp_path: Path) -> None:
    store = build_store(tmp_path / "two-nodes.duckdb")

    async def go() -> None:
        app = ConsoleApp([ReplayFeed(store)], clock=None, token=TOKEN)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = await policies_screen(pilot, "unit:node-a:1")
            assert "a replay: recorded history cannot be changed" in text_of(screen.query_one("#policies-control"))
            assert screen.check_action("edit", ()) is None
            rows = {r.key: r for r in screen.query_one(PolicyTable).rows_shown}
            assert rows["unit:node-a:1"].cells[2] == "sarathi" and rows["dispatch:node-b"].cells[2] == "pab"
            lines = screen.query_one(AuditLog).lines_shown
            assert len(lines) == 1 and "node-a u1 set_batch_policy applied: u1: policy vllm -> sarathi" in lines[0]

    run(go, timeout_s=60)


def test_every_new_binding_has_a_stable_id_and_a_tooltip() -> None:
    from textual.binding import Binding

    from console.screens.confirm import PromptScreen
    from console.screens.sql import SqlScreen

    ids = []
    for cls in (ConsoleApp, PoliciesScreen, PolicyEditScreen, ConfirmScreen, PromptScreen, SqlScreen):
        for binding in cls.BINDINGS:
            assert isinstance(binding, Binding) and binding.id and binding.tooltip, (cls, binding)
            ids.append(binding.id)
    assert len(ids) == len(set(ids))
    assert {"console.policies", "console.sql", "policies.edit", "policies.drain", "sql.run", "sql.export"} <= set(ids)


# -- the pure side -------------------------------------------------------------------------------------------------
SARATHI = PolicySchema(
    name="sarathi",
    params=(
        ParamSchema(name="tbt_target_ms", type="float", default=50.0, min=1.0, max=10000.0, unit="ms"),
        ParamSchema(name="token_budget", type="int", default=0, min=0.0, unit="tokens"),
    ),
)
VLLM = PolicySchema(name="vllm", params=(ParamSchema(name="max_num_batched_tokens", type="int", default=0, min=0),))
EB = PolicySchema(
    name="eb",
    params=(
        ParamSchema(name="window", type="int", default=2000, min=16.0, live=False),
        ParamSchema(name="mode", type="str", default="auto", choices=("auto", "mixed")),
        ParamSchema(name="memory_safe", type="bool", default=True),
    ),
)


def state_with_one_node() -> ConsoleState:
    state = ConsoleState()
    hello = NodeHello(
        node_id="n",
        time_ns=1,
        boot_ns=1,
        profile="p",
        units=(
            UnitStatus(unit_id=0, batch_policy="vllm", batch_params={"max_num_batched_tokens": 0}),
            UnitStatus(unit_id=1, mode="paused", batch_policy="sarathi", batch_params={"tbt_target_ms": 50.0}),
        ),
        dispatch_policy="least_loaded",
        dispatch_params={"waiting_weight": 4.0},
        batch_policies=(VLLM, SARATHI, EB),
    )
    state.apply([hello])
    return state


def test_target_rows_and_parameter_lines() -> None:
    state = state_with_one_node()
    rows = target_rows(state)
    assert [r.key for r in rows] == ["dispatch:n", "unit:n:0", "unit:n:1"]
    assert rows[0].cells == ("n dispatch", "live", "least_loaded", "waiting_weight=4.0") and rows[0].kind == "dispatch"
    assert rows[2].cells == ("  u1", "paused", "sarathi", "tbt_target_ms=50.0") and rows[2].mode == "paused"
    assert param_lines(SARATHI, {"tbt_target_ms": 20.0}) == [
        "tbt_target_ms = 20.0  [float 1..10000 ms]",
        "token_budget  = 0  [int 0..inf tokens]",
    ]
    assert [describe_range(p) for p in EB.params] == [
        "int 16..inf, fixed while running",
        "str auto|mixed",
        "bool true|false",
    ]


def test_values_are_typed_when_they_parse_and_sent_as_text_otherwise() -> None:
    window, mode, safe = EB.params
    assert parse_value(window, " 64 ") == 64 and parse_value(window, "lots") == "lots"
    assert parse_value(SARATHI.params[0], "2.5") == 2.5 and parse_value(safe, "off") is False
    assert parse_value(mode, "mixed") == "mixed" and parse_value(safe, "maybe") == "maybe"


def test_changes_become_the_right_requests() -> None:
    node = state_with_one_node().nodes["n"]
    swap = build_change(node, 0, "sarathi", {"tbt_target_ms": "50", "token_budget": "128"})
    assert swap.request() == SetBatchPolicy(policy="sarathi", params={"token_budget": 128}, unit_ids=(0,))
    assert swap.describe() == "n u0: -> sarathi token_budget=128"
    every = build_change(node, 1, "sarathi", {"tbt_target_ms": "25"}, every_unit=True)
    assert every.request() == SetParams(target="batch", params={"tbt_target_ms": 25.0}, unit_ids=())
    dispatch = build_change(node, None, "round_robin", {})
    assert dispatch.request() == SetDispatchPolicy(policy="round_robin", params={})
    with pytest.raises(ValueError, match="nothing to change"):
        build_change(node, 1, "sarathi", {"tbt_target_ms": "50.0"})
    fleet = build_change(node, 0, "sarathi", {}, also=("m", "o"))  # the same request for every node
    assert fleet.nodes == ("n", "m", "o") and fleet.request() == SetBatchPolicy(policy="sarathi", unit_ids=(0,))
    assert fleet.describe() == "n and 2 more nodes u0: -> sarathi"


def test_diff_lines_and_audit_lines() -> None:
    swap = ControlAudit(
        node_id="n",
        time_ns=0,
        actor="op",
        action="set_batch_policy",
        unit_ids=(0,),
        old=(Setting(unit_id=0, policy="vllm", params={"max_num_batched_tokens": 0}),),
        new=(Setting(unit_id=0, policy="sarathi", params={"tbt_target_ms": 50.0}),),
        result="dry_run",
    )
    assert diff_lines(swap) == ["u0: policy vllm -> sarathi", "u0:   tbt_target_ms = 50.0"]
    params = ControlAudit(
        node_id="n",
        time_ns=0,
        actor="op",
        action="set_params",
        old=(Setting(unit_id=None, params={"waiting_weight": 4.0}),),
        new=(Setting(unit_id=None, params={"waiting_weight": 2.0}),),
        result="applied",
    )
    assert diff_lines(params) == ["dispatch: waiting_weight 4.0 -> 2.0"]
    rejected = ControlAudit(
        node_id="n", time_ns=0, actor="op", action="set_params", result="rejected", error_code="bad_param", message="x"
    )
    assert audit_line(rejected).endswith("n dispatch set_params rejected: bad_param: x (op)")


def test_control_refusal_reasons() -> None:
    from console.model.records import Connection

    assert control_refusal(read_only=False, token="t", connection=Connection.LIVE) is None
    assert "read-only" in (control_refusal(read_only=True, token="t") or "")
    assert "replay" in (control_refusal(read_only=False, token="t", connection=Connection.REPLAY) or "")
    assert "--token-file" in (control_refusal(read_only=False, token="") or "")
    assert "reconnecting" in (control_refusal(read_only=False, token="t", connection=Connection.RECONNECTING) or "")
