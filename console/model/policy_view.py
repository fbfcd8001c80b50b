"""The Policies screen's plain side: targets as rows, parameters with their ranges, changes as control requests,
dry-run diffs and audit lines, and why control is refused.

Pure functions of the state model and the protocol's structs (no Textual, no sockets): the screen draws what they
return and sends what :meth:`PolicyChange.request` builds. Values typed by the operator are converted to their
parameter's type when they parse; otherwise they travel as text and the agent, which validates every value
against the policy's schema (type, range, choices, live), refuses them with its own message, so the console never
second-guesses the agent's rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from agent.telemetry import (
    ControlAudit,
    ParamSchema,
    PolicySchema,
    SetBatchPolicy,
    SetDispatchPolicy,
    SetParams,
    Setting,
)
from console.model.records import Connection, NodeInfo
from console.model.render import fmt_clock
from console.model.state import ConsoleState
from policies.params import ParamValue

TargetKind = Literal["batch", "dispatch"]
PolicyRequest = SetBatchPolicy | SetDispatchPolicy | SetParams

COLUMNS: Final[tuple[tuple[str, str], ...]] = (
    ("target", "node / target"),
    ("mode", "mode"),
    ("policy", "policy"),
    ("params", "parameters"),
)
"""Column keys and headers of the targets table."""


@dataclass(frozen=True, slots=True)
class TargetRow:
    """One row of the targets table: a node's dispatcher or one of its units."""

    key: str
    """Stable: ``dispatch:NODE`` or ``unit:NODE:UNIT``."""
    node_id: str
    unit_id: int | None
    """None: the dispatcher."""
    cells: tuple[str, ...]
    """One per :data:`COLUMNS` entry."""
    mode: str
    """The unit's mode (``active``, ``draining``, ``paused``); the node's connection for a dispatcher row."""

    @property
    def kind(self) -> TargetKind:
        return "dispatch" if self.unit_id is None else "batch"


def fmt_param_value(value: ParamValue) -> str:
    """A parameter value as typed back into a form: ``true``/``false`` for booleans, ``%g``-style floats."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.1f}" if value.is_integer() and abs(value) < 1e16 else repr(value)
    return str(value)


def params_text(params: Mapping[str, ParamValue]) -> str:
    return " ".join(f"{k}={fmt_param_value(v)}" for k, v in params.items()) or "-"


def target_rows(state: ConsoleState) -> list[TargetRow]:
    """Every node's dispatcher, then its units in id order (nodes in the order first seen)."""
    rows: list[TargetRow] = []
    for node in state.nodes.values():
        connection = state.node_connection(node).value
        rows.append(
            TargetRow(
                f"dispatch:{node.node_id}",
                node.node_id,
                None,
                (
                    f"{node.node_id} dispatch",
                    connection,
                    node.dispatch_policy or "-",
                    params_text(node.dispatch_params),
                ),
                connection,
            )
        )
        for unit_id in sorted(node.units):
            unit = node.units[unit_id]
            rows.append(
                TargetRow(
                    f"unit:{node.node_id}:{unit_id}",
                    node.node_id,
                    unit_id,
                    (f"  u{unit_id}", unit.mode, unit.batch_policy or "-", params_text(unit.batch_params)),
                    unit.mode,
                )
            )
    return rows


def schemas_of(node: NodeInfo, kind: TargetKind) -> tuple[PolicySchema, ...]:
    """The policies a target of ``kind`` may run (from the node's hello)."""
    return node.dispatch_policies if kind == "dispatch" else node.batch_policies


def current_of(node: NodeInfo, unit_id: int | None) -> tuple[str, dict[str, ParamValue]]:
    """A target's current policy and parameters (as folded from the hello and applied audits)."""
    if unit_id is None:
        return node.dispatch_policy, dict(node.dispatch_params)
    unit = node.units.get(unit_id)
    return ("", {}) if unit is None else (unit.batch_policy, dict(unit.batch_params))


def find_schema(schemas: Iterable[PolicySchema], name: str) -> PolicySchema | None:
    return next((s for s in schemas if s.name == name), None)


def describe_range(param: ParamSchema) -> str:
    """``int 0..inf tokens``, ``float 0.01..1``, ``str auto|exclusive|mixed``, ``bool``; ``fixed`` when it may not
    change while the policy runs."""
    if param.choices:
        span = "|".join(param.choices)
    elif param.type == "bool":
        span = "true|false"
    elif param.min is None and param.max is None:
        span = "any"
    else:
        lo = "-inf" if param.min is None else _bound(param.min)
        hi = "inf" if param.max is None else _bound(param.max)
        span = f"{lo}..{hi}"
    text = f"{param.type} {span}" + (f" {param.unit}" if param.unit else "")
    return text if param.live else text + ", fixed while running"


def _bound(value: float) -> str:
    """An integral bound in full (``1048576``, not ``1.04858e+06``), any other as ``%g``."""
    return str(int(value)) if value.is_integer() else f"{value:g}"


def param_lines(schema: PolicySchema | None, values: Mapping[str, ParamValue]) -> list[str]:
    """One line per parameter of ``schema``: ``name = value  [range]  help`` (values not given: the default)."""
    if schema is None:
        return ["(no schema for this policy in the node's hello)"]
    if not schema.params:
        return ["(no parameters)"]
    width = max(len(p.name) for p in schema.params)
    lines = []
    for param in schema.params:
        value = fmt_param_value(values.get(param.name, param.default))
        lines.append(f"{param.name.ljust(width)} = {value}  [{describe_range(param)}]  {param.help}".rstrip())
    return lines


def parse_value(param: ParamSchema, text: str) -> ParamValue:
    """``text`` as ``param``'s type when it parses (``int``, ``float``, ``bool``), else the text itself (the agent
    then refuses it with its own message)."""
    raw = text.strip()
    try:
        if param.type == "int":
            return int(raw)
        if param.type == "float":
            return float(raw)
    except ValueError:
        return raw
    if param.type == "bool":
        lowered = raw.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
    return raw


@dataclass(frozen=True, slots=True)
class PolicyChange:
    """What the operator asked for on one node: a policy swap (with parameters), or parameter changes."""

    node_id: str
    kind: TargetKind
    policy: str
    """The policy to run (the current one for a parameter change)."""
    swap: bool
    """True: swap to :attr:`policy`; False: change parameters of the running policy."""
    params: dict[str, ParamValue] = field(default_factory=dict)
    unit_ids: tuple[int, ...] = ()
    """The units (batch); empty: every unit of the node."""
    also: tuple[str, ...] = ()
    """Other nodes that get the same change (the agents of one node run with ``--agents N``, or a fleet): it is
    applied only if every node accepts it in a dry run."""

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node the change goes to, the edited one first."""
        return (self.node_id, *self.also)

    def request(self) -> PolicyRequest:
        if self.swap and self.kind == "dispatch":
            return SetDispatchPolicy(policy=self.policy, params=self.params)
        if self.swap:
            return SetBatchPolicy(policy=self.policy, params=self.params, unit_ids=self.unit_ids)
        return SetParams(target=self.kind, params=self.params, unit_ids=self.unit_ids)

    def describe(self) -> str:
        """``node-a u1: vllm -> sarathi``, ``node-a dispatch: waiting_weight=2.0``."""
        where = "dispatch" if self.kind == "dispatch" else _units(self.unit_ids)
        what = f"-> {self.policy}" if self.swap else ""
        nodes = self.node_id + (f" and {len(self.also)} more node{'s' if len(self.also) > 1 else ''}" if self.also
                                else "")
        return " ".join(x for x in (f"{nodes} {where}:", what, params_text(self.params) if self.params else "") if x)


def _units(unit_ids: tuple[int, ...]) -> str:
    return ",".join(f"u{u}" for u in unit_ids) if unit_ids else "every unit"


def build_change(
    node: NodeInfo,
    unit_id: int | None,
    policy: str,
    texts: Mapping[str, str],
    *,
    every_unit: bool = False,
    also: Iterable[str] = (),
) -> PolicyChange:
    """The change the edit form describes: ``policy`` chosen for the target (a swap when it is not the current one)
    and ``texts`` typed per parameter. A swap carries the values that differ from the new policy's defaults; a
    parameter change those that differ from the current values; ``also``: other nodes that get the same change.
    Raises ValueError when nothing would change."""
    kind: TargetKind = "dispatch" if unit_id is None else "batch"
    current, values = current_of(node, unit_id)
    schema = find_schema(schemas_of(node, kind), policy)
    params_by_name = {p.name: p for p in schema.params} if schema else {}
    swap = policy != current
    changed: dict[str, ParamValue] = {}
    for name, text in texts.items():
        param = params_by_name.get(name)
        if param is None:
            continue
        value = parse_value(param, text)
        base = param.default if swap else values.get(name, param.default)
        if fmt_param_value(value) != fmt_param_value(parse_value(param, fmt_param_value(base))):
            changed[name] = value
    if not swap and not changed:
        raise ValueError("nothing to change: the policy and every parameter are as they are now")
    units = () if unit_id is None or every_unit else (unit_id,)
    return PolicyChange(node.node_id, kind, policy, swap, changed, units, tuple(also))


def _where(setting: Setting) -> str:
    return "dispatch" if setting.unit_id is None else f"u{setting.unit_id}"


def diff_lines(audit: ControlAudit) -> list[str]:
    """What a control action changes (a dry run's answer): per target, the policy and every parameter that moves."""
    old = {s.unit_id: s for s in audit.old}
    lines: list[str] = []
    for new in audit.new:
        before = old.get(new.unit_id, Setting(unit_id=new.unit_id))
        where = _where(new)
        if new.mode is not None:
            lines.append(f"{where}: mode {before.mode or '?'} -> {new.mode}")
            continue
        if new.policy and new.policy != before.policy:
            lines.append(f"{where}: policy {before.policy or '?'} -> {new.policy}")
            for name, value in new.params.items():
                lines.append(f"{where}:   {name} = {fmt_param_value(value)}")
            continue
        moved = [
            f"{where}: {name} {fmt_param_value(before.params[name]) if name in before.params else '?'} -> "
            f"{fmt_param_value(value)}"
            for name, value in new.params.items()
            if before.params.get(name) != value
        ]
        lines.extend(moved or [f"{where}: no change"])
    return lines or ["no change"]


def audit_line(audit: ControlAudit) -> str:
    """One audit event: time, node, targets, action, result, what (or the error), actor."""
    where = _units(audit.unit_ids) if audit.unit_ids else "dispatch"
    if audit.result == "rejected":
        what = f"{audit.error_code}: {audit.message}" if audit.error_code else audit.message
    else:
        what = "; ".join(diff_lines(audit))
    return f"{fmt_clock(audit.time_ns)} {audit.node_id} {where} {audit.action} {audit.result}: {what}" + (
        f" ({audit.actor})" if audit.actor else ""
    )


def control_refusal(*, read_only: bool, token: str, connection: Connection | None = None) -> str | None:
    """Why control cannot be used now (None: it can): read-only, a replay, no token, or the node not connected."""
    if read_only:
        return "read-only console (--read-only): control is off"
    if connection == Connection.REPLAY:
        return "a replay: recorded history cannot be changed"
    if not token:
        return "no control token: start the console with --token-file FILE"
    if connection is not None and connection != Connection.LIVE:
        return f"the node is {connection.value}: control waits for its connection"
    return None
