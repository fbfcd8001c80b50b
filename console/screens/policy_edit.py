"""The policy edit form: choose a policy for a unit (or a node's dispatcher) and type parameter values; it is
dismissed with the :class:`~console.model.policy_view.PolicyChange` they describe (None: cancelled). Nothing is sent
from here: the Policies screen asks the agent for a dry run, then for confirmation, then applies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Select, SelectionList, Static

from console.model.policy_view import (
    PolicyChange,
    TargetKind,
    build_change,
    current_of,
    describe_range,
    find_schema,
    fmt_param_value,
    schemas_of,
)
from console.model.records import NodeInfo


class PolicyEditScreen(ModalScreen[PolicyChange | None]):
    """A policy chooser, one input per parameter of the chosen policy (with its range; the help is the input's
    tooltip), for a unit whether the change goes to every unit of its node, and which other nodes get it too."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(
            "ctrl+s",
            "submit",
            "Dry run",
            id="policy_edit.dry_run",
            tooltip="Ask the agent what this change would do (a dry run); then confirm to apply",
            priority=True,
        ),
        Binding("escape", "cancel", "Cancel", id="policy_edit.cancel", tooltip="Close the form: nothing is sent"),
    ]

    def __init__(self, node: NodeInfo, unit_id: int | None, others: Sequence[str] = ()) -> None:
        super().__init__()
        self.node = node
        self.unit_id = unit_id
        self.others = tuple(others)
        """The other nodes the console can control: offered for the same change ("the same on every node", or a
        choice of them: the agents of one machine run with ``--agents N``, say)."""
        self.kind: TargetKind = "dispatch" if unit_id is None else "batch"
        self.current_policy, self.current_params = current_of(node, unit_id)
        self.inputs: dict[str, Input] = {}
        """The parameter inputs of the chosen policy, by parameter name."""

    @property
    def target_text(self) -> str:
        return f"{self.node.node_id} " + ("dispatch" if self.unit_id is None else f"u{self.unit_id}")

    def compose(self) -> ComposeResult:
        schemas = schemas_of(self.node, self.kind)
        names = [s.name for s in schemas]
        if self.current_policy and self.current_policy not in names:
            names.insert(0, self.current_policy)
        with Vertical(id="edit-box", classes="dialog"):
            yield Static(f"Edit {self.target_text} (now {self.current_policy or '?'})", classes="pane-title")
            yield Select(
                [(name, name) for name in names],
                value=self.current_policy if self.current_policy in names else Select.NULL,
                allow_blank=not names,
                id="edit-policy",
            )
            yield Static(id="edit-summary", markup=False)
            if self.unit_id is not None:
                yield Checkbox(f"every unit of {self.node.node_id}", id="edit-every-unit")
            if self.others:
                yield Checkbox(f"the same on every node ({len(self.others)} more), or on these:", id="edit-every-node")
                yield SelectionList[str](*((node_id, node_id) for node_id in self.others), id="edit-nodes")
            yield VerticalScroll(id="edit-params")
            yield Static(id="edit-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Dry run (ctrl+s)", variant="primary", id="edit-submit")
                yield Button("Cancel (esc)", id="edit-cancel")

    async def on_mount(self) -> None:
        await self._show_params(self.current_policy)

    @property
    def chosen_policy(self) -> str:
        value = self.query_one("#edit-policy", Select).value
        return value if isinstance(value, str) else ""

    async def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        self.query_one("#edit-error", Static).update("")
        await self._show_params(self.chosen_policy)

    async def _show_params(self, policy: str) -> None:
        """One row per parameter of ``policy``: current values for the running policy, defaults for another; a
        parameter that may not change while running is read-only unless the policy is swapped."""
        schema = find_schema(schemas_of(self.node, self.kind), policy)
        swap = policy != self.current_policy
        self.query_one("#edit-summary", Static).update(schema.summary if schema else "")
        box = self.query_one("#edit-params", VerticalScroll)
        await box.remove_children()
        self.inputs = {}
        rows = []
        for param in schema.params if schema else ():
            value = param.default if swap else self.current_params.get(param.name, param.default)
            field = Input(fmt_param_value(value), disabled=not (param.live or swap), classes="param-input")
            field.tooltip = param.help or None
            self.inputs[param.name] = field
            rows.append(
                Horizontal(
                    Label(f"{param.name} [{describe_range(param)}]", classes="param-label", markup=False),
                    field,
                    classes="param-row",
                )
            )
        if not rows:
            rows.append(Horizontal(Label("(no parameters)", classes="param-label")))
        await box.mount_all(rows)

    @property
    def also(self) -> tuple[str, ...]:
        """The other nodes chosen to get the same change, in the order offered."""
        if not self.others:
            return ()
        chosen = set(self.query_one("#edit-nodes", SelectionList).selected)
        return tuple(node_id for node_id in self.others if node_id in chosen)

    def on_checkbox_changed(self, event: Checkbox.Changed) -> None:
        if event.checkbox.id == "edit-every-node":
            event.stop()
            nodes = self.query_one("#edit-nodes", SelectionList)
            with nodes.prevent(SelectionList.SelectedChanged):
                nodes.select_all() if event.value else nodes.deselect_all()

    def on_selection_list_selected_changed(self, event: SelectionList.SelectedChanged[str]) -> None:
        event.stop()
        every = self.query_one("#edit-every-node", Checkbox)
        with every.prevent(Checkbox.Changed):
            every.value = len(event.selection_list.selected) == len(self.others)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "edit-submit":
            self.action_submit()
        else:
            self.action_cancel()

    def action_submit(self) -> None:
        """Dismiss with the change the form describes (or say why there is none)."""
        policy = self.chosen_policy
        if not policy:
            self.query_one("#edit-error", Static).update("choose a policy")
            return
        every = self.query("#edit-every-unit")
        every_unit = bool(every) and self.query_one("#edit-every-unit", Checkbox).value
        texts = {name: field.value for name, field in self.inputs.items() if not field.disabled}
        try:
            change = build_change(self.node, self.unit_id, policy, texts, every_unit=every_unit, also=self.also)
        except ValueError as exc:
            self.query_one("#edit-error", Static).update(str(exc))
            return
        self.dismiss(change)

    def action_cancel(self) -> None:
        self.dismiss(None)
