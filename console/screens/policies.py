"""Policies: every node's dispatcher and units with their policy and parameters (ranges from the hello's schemas),
editing with a dry run and a confirmation, pause / drain / resume, and the audit log.

Control flow (STYLE examples 8-10): an action opens a modal (the edit form, or a ``ConfirmScreen``); its answer starts a
worker that sends one request over :func:`console.control.send_control` and posts
:class:`PoliciesScreen.ControlReplied`; the handler shows the reply and, after a dry run, asks for confirmation with the
agent's diff before the change itself is sent. An edit for several nodes (the form's "the same on every node", or the
nodes chosen in its list: the agents of a machine run with ``--agents N``, say) goes to each of them at once, dry runs
first, and is applied only if every one accepted it (:class:`PoliciesScreen.GroupReplied`). The applied change comes
back as an ``audit`` event on the feed, which updates the table and the audit log. Every control action is greyed out
(``check_action``) in ``--read-only``, in a replay, without a token, for a node that is not connected, and while a
request is in flight; a line above the table says why."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Protocol, runtime_checkable

from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import DataTable, Footer, Header, Static

from agent.telemetry import ControlRequest, DrainUnit, DryRun, PauseUnit, ResumeUnit
from console.control import ControlResult, send_control
from console.model.policy_view import (
    PolicyChange,
    TargetRow,
    control_refusal,
    current_of,
    diff_lines,
    find_schema,
    param_lines,
    schemas_of,
    target_rows,
)
from console.model.records import NodeInfo
from console.model.state import ConsoleState
from console.screens.base import StateScreen
from console.screens.confirm import ConfirmScreen
from console.screens.policy_edit import PolicyEditScreen
from console.widgets.audit_log import AuditLog
from console.widgets.policy_table import PolicyTable

MODE_REQUESTS: dict[str, tuple[type[PauseUnit | DrainUnit | ResumeUnit], str]] = {
    "pause": (PauseUnit, "it runs no steps until resumed; its requests wait"),
    "drain": (DrainUnit, "it gets no new requests and finishes those it holds"),
    "resume": (ResumeUnit, "it runs and takes new requests again"),
}
"""Unit mode actions: the request each sends, and what it does."""


@runtime_checkable
class ControlHost(Protocol):
    """What the screen needs of the app: whether control is allowed, the token it is sent with, and how a ``wss://``
    agent is verified (None: the system's trust store)."""

    read_only: bool
    token: str
    ssl_context: ssl.SSLContext | None


class PoliciesScreen(StateScreen):
    """Targets in a table, the selected one's parameters below, the last reply, the audit log."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(
            "e",
            "edit",
            "Edit policy",
            id="policies.edit",
            tooltip="Choose a policy and parameters for the selected unit or dispatcher; dry run, confirm, apply",
        ),
        # pause / drain / resume: not in the footer (it fits 80 columns); the control line above the table names
        # them, and the help screen and the palette list them
        Binding(
            "p",
            "set_mode('pause')",
            "Pause",
            show=False,
            id="policies.pause",
            tooltip="Pause the selected unit (confirm)",
        ),
        Binding(
            "d",
            "set_mode('drain')",
            "Drain",
            show=False,
            id="policies.drain",
            tooltip="Drain the selected unit (confirm)",
        ),
        Binding(
            "r",
            "set_mode('resume')",
            "Resume",
            show=False,
            id="policies.resume",
            tooltip="Resume a paused or draining unit",
        ),
    ]

    @dataclass
    class ControlReplied(Message):
        """A control request got its answer (or failed to reach the agent); ``change``: the edit a dry run was
        for (to apply once confirmed)."""

        result: ControlResult
        change: PolicyChange | None = None

    @dataclass
    class GroupReplied(Message):
        """Every node of a change for several nodes answered (``results`` in the order of ``change.nodes``)."""

        results: list[ControlResult]
        change: PolicyChange

    def __init__(self) -> None:
        super().__init__()
        self._state: ConsoleState | None = None
        self.in_flight = False
        """A control request is on its way (further actions wait)."""
        self.last_result: ControlResult | None = None
        self._allowed: tuple[bool, ...] = ()
        self._shown: tuple[str, str] = ("", "")

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="policies-control", markup=False)
        with Vertical(id="policies-pane"):
            yield PolicyTable(id="policies-table")
        with VerticalScroll(id="policies-params-pane"):
            yield Static(id="policies-params", markup=False)
        yield Static("", id="policies-reply", markup=False)
        yield Static("Audit log", classes="pane-title")
        with VerticalScroll(id="audit-pane"):
            yield AuditLog(id="audit-log")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(PolicyTable).focus()

    # -- drawing ------------------------------------------------------------------------------------------------
    def show_state(self, state: ConsoleState) -> None:
        self._state = state
        if not self.query(AuditLog):  # a refresh while the screen's widgets are still being mounted: draw after
            self.call_after_refresh(self.show_state, state)
            return
        self.query_one(PolicyTable).show_rows(target_rows(state))
        self.query_one(AuditLog).show_audits(state.audits)
        self._show_selection()

    def _show_selection(self) -> None:
        """The selected target's parameters, the control line, and the footer when what can run changed."""
        row, node = self._selected()
        if row is None or node is None:
            text = "no target selected" if self._state and self._state.nodes else "no nodes yet"
        else:
            policy, values = current_of(node, row.unit_id)
            schema = find_schema(schemas_of(node, row.kind), policy)
            where = "dispatch" if row.unit_id is None else f"u{row.unit_id}"
            head = f"{node.node_id} {where}: {policy or '?'}" + (f" - {schema.summary}" if schema else "")
            text = "\n".join([head, *param_lines(schema, values)])
        refusal = self.refusal(node)
        control = f"control off: {refusal}" if refusal else "control on: e edit · p pause · d drain · r resume"
        if (text, control) != self._shown:  # redrawn only when they change, not at every refresh
            self._shown = (text, control)
            self.query_one("#policies-params", Static).update(text)
            line = self.query_one("#policies-control", Static)
            line.update(control)
            line.set_class(refusal is not None, "-refused")
        allowed = tuple(self.check_action(a, p) is True for a, p in self._actions())
        if allowed != self._allowed:
            self._allowed = allowed
            self.refresh_bindings()

    @staticmethod
    def _actions() -> list[tuple[str, tuple[object, ...]]]:
        return [("edit", ()), *(("set_mode", (verb,)) for verb in MODE_REQUESTS)]

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_selection()

    def _selected(self) -> tuple[TargetRow | None, NodeInfo | None]:
        tables = self.query(PolicyTable)
        row = tables.first().selected_row if tables else None
        node = self._state.nodes.get(row.node_id) if row is not None and self._state is not None else None
        return row, node

    def refusal(self, node: NodeInfo | None = None) -> str | None:
        """Why control cannot be used on ``node`` now (None: it can)."""
        app = self.app
        read_only = app.read_only if isinstance(app, ControlHost) else True
        token = app.token if isinstance(app, ControlHost) else ""
        connection = self._state.node_connection(node) if node is not None and self._state is not None else None
        return control_refusal(read_only=read_only, token=token, connection=connection)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Control actions are greyed out when control is refused, while a request is in flight, without a
        target; a unit's mode action also when the unit is already in that mode (or for a dispatcher)."""
        if action not in ("edit", "set_mode"):
            return True
        row, node = self._selected()
        if row is None or node is None or self.in_flight or self.refusal(node) is not None:
            return None
        if action == "set_mode":
            verb = parameters[0] if parameters else ""
            if row.unit_id is None or verb not in MODE_REQUESTS:
                return None
            blocked = {"pause": "paused", "drain": "draining", "resume": "active"}[str(verb)]
            return None if row.mode == blocked or (verb == "drain" and row.mode == "paused") else True
        return True

    # -- actions ------------------------------------------------------------------------------------------------
    def system_commands(self) -> Iterator[SystemCommand]:
        """The command palette's entries for this screen: the same actions as the keys, when they can run."""
        row, _ = self._selected()
        target = "" if row is None else f" ({row.cells[0].strip()})"
        if self.check_action("edit", ()) is True:
            yield SystemCommand(
                f"Policies: edit{target}", "Policy and parameters, dry run, confirm (key e)", self.action_edit
            )
        for verb in MODE_REQUESTS:
            if self.check_action("set_mode", (verb,)) is True:
                yield SystemCommand(
                    f"Policies: {verb}{target}",
                    f"{MODE_REQUESTS[verb][1]} (key {verb[0]})",
                    partial(self.action_set_mode, verb),
                )

    def action_edit(self) -> None:
        row, node = self._selected()
        if row is None or node is None or not self._allowed_now("edit", ()):
            return
        nodes = self._state.nodes.values() if self._state else ()
        others = [n.node_id for n in nodes if n.node_id != node.node_id and n.source and not self.refusal(n)]
        self.app.push_screen(PolicyEditScreen(node, row.unit_id, others), self._edited)

    def _edited(self, change: PolicyChange | None) -> None:
        if change is None:
            self._say("edit cancelled: nothing sent", error=False)
            return
        self._say(f"dry run: {change.describe()} ...", error=False)
        if change.also:
            self._send_group(change, dry_run=True)
            return
        self._send(change.node_id, DryRun(change=change.request()), change)

    def propose(self, change: PolicyChange) -> None:
        """Send ``change``, made elsewhere (the What-if screen's recommendation), as an edit is sent: a dry run, then
        the confirmation with the agent's diff, then the change itself; refused with the reason as an edit is."""
        node = self._state.nodes.get(change.node_id) if self._state is not None else None
        refusal = self.refusal(node)
        if node is None or refusal is not None or self.in_flight:
            busy = "a request is in flight" if self.in_flight else f"no node {change.node_id}"
            self._say(f"not sent: {refusal or busy}", error=True)
            return
        self._edited(change)

    def action_set_mode(self, verb: str) -> None:
        row, node = self._selected()
        if row is None or node is None or row.unit_id is None or not self._allowed_now("set_mode", (verb,)):
            return
        request_type, what = MODE_REQUESTS[verb]
        request = request_type(unit_id=row.unit_id)
        node_id = node.node_id

        def answered(yes: bool | None) -> None:
            if yes:
                self._send(node_id, request)
            else:
                self._say(f"{verb} cancelled: nothing sent", error=False)

        title = f"{verb.capitalize()} {node_id} u{row.unit_id}?"
        self.app.push_screen(
            ConfirmScreen(title, [f"u{row.unit_id}: {row.mode} -> {verb}: {what}"], yes=verb), answered
        )

    def _allowed_now(self, action: str, parameters: tuple[object, ...]) -> bool:
        """Whether the action may run (the palette or a remapped key may call it while it is greyed out)."""
        if self.check_action(action, parameters) is True:
            return True
        _, node = self._selected()
        self._say(self.refusal(node) or ("a request is in flight" if self.in_flight else "select a target"), error=True)
        return False

    # -- control ------------------------------------------------------------------------------------------------
    def _send(self, node_id: str, request: ControlRequest, change: PolicyChange | None = None) -> None:
        """Send ``request`` to the node's agent in a worker; the answer arrives as :class:`ControlReplied`."""
        node = self._state.nodes.get(node_id) if self._state else None
        refusal = self.refusal(node)
        if node is None or node.source is None or refusal is not None:
            self._say(f"not sent: {refusal or 'no connection to ' + node_id}", error=True)
            return
        app = self.app
        token, ssl_context = (app.token, app.ssl_context) if isinstance(app, ControlHost) else ("", None)
        uri = node.source
        self.in_flight = True
        self._show_selection()

        async def control() -> None:
            result = await send_control(uri, token, request, ssl_context=ssl_context)
            self.post_message(self.ControlReplied(result, change))

        self.run_worker(control(), name=f"control {node_id}", group="control", exit_on_error=False)

    def _send_group(self, change: PolicyChange, *, dry_run: bool) -> None:
        """Send ``change`` (or its dry run) to each of its nodes at once, in a worker; the answers arrive together as
        :class:`GroupReplied`."""
        nodes = [self._state.nodes.get(n) if self._state else None for n in change.nodes]
        lost = [n for n, node in zip(change.nodes, nodes, strict=True)
                if node is None or node.source is None or self.refusal(node) is not None]
        if lost:
            self._say(f"not sent to any node: no connection to {', '.join(lost)}", error=True)
            return
        app = self.app
        token, ssl_context = (app.token, app.ssl_context) if isinstance(app, ControlHost) else ("", None)
        request: ControlRequest = DryRun(change=change.request()) if dry_run else change.request()
        uris = [node.source for node in nodes if node is not None and node.source is not None]
        self.in_flight = True
        self._show_selection()

        async def control() -> None:
            results = await asyncio.gather(*(send_control(uri, token, request, ssl_context=ssl_context)
                                             for uri in uris))
            self.post_message(self.GroupReplied(list(results), change))

        self.run_worker(control(), name=f"control {len(uris)} nodes", group="control", exit_on_error=False)

    def on_policies_screen_group_replied(self, message: GroupReplied) -> None:
        results, change = message.results, message.change
        self.in_flight = False
        self.last_result = results[0]
        self._show_selection()
        failed = [(node, r) for node, r in zip(change.nodes, results, strict=True) if not r.ok]
        if results[0].is_dry_run:
            if failed:
                why = "; ".join(f"{node}: {r.code}: {r.message}" for node, r in failed)
                self._say(f"dry run refused by {why}: nothing sent to any node", error=True)
                return
            lines = []
            for node, r in zip(change.nodes, results, strict=True):
                lines += [f"{node}: {line}" for line in (diff_lines(r.audit) if r.audit else ["(no diff)"])]
            self._say(f"dry run: {change.describe()}: confirm to apply", error=False)
            self.app.push_screen(ConfirmScreen(f"Apply to {len(change.nodes)} nodes?", lines),
                                 self._confirmed(change))
            return
        if failed:
            why = "; ".join(f"{node}: {r.describe()}" for node, r in failed)
            self._say(f"applied on {len(results) - len(failed)} of {len(results)} nodes; {why}", error=True)
        else:
            self._say(f"applied on {len(results)} nodes: {change.describe()}", error=False)

    def on_policies_screen_control_replied(self, message: ControlReplied) -> None:
        result, change = message.result, message.change
        self.in_flight = False
        self.last_result = result
        self._show_selection()
        if result.is_dry_run and change is not None:
            if not result.ok:
                self._say(f"dry run refused by {change.node_id}: {result.code}: {result.message}", error=True)
                return
            lines = diff_lines(result.audit) if result.audit is not None else ["(no diff in the reply)"]
            self._say(f"dry run: {change.describe()}: confirm to apply", error=False)
            self.app.push_screen(ConfirmScreen(f"Apply to {change.node_id}?", lines), self._confirmed(change))
            return
        if result.ok:
            diff = "; ".join(diff_lines(result.audit)) if result.audit is not None else ""
            self._say(f"applied: {diff}" if diff else result.describe(), error=False)
        else:
            self._say(result.describe(), error=True)

    def _confirmed(self, change: PolicyChange) -> Callable[[bool | None], None]:
        def answered(yes: bool | None) -> None:
            if yes:
                self._say(f"applying: {change.describe()} ...", error=False)
                if change.also:
                    self._send_group(change, dry_run=False)
                else:
                    self._send(change.node_id, change.request(), None)
            else:
                self._say("cancelled: nothing applied", error=False)

        return answered

    def _say(self, text: str, *, error: bool) -> None:
        reply = self.query_one("#policies-reply", Static)
        reply.update(text)
        reply.set_class(error, "-error")
