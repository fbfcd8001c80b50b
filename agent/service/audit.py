"""The control plane's audit events: an :class:`~agent.runtime.control.AuditRecord` as a stream event, and the message
of a repeated ``control_id`` (the hub's, ``agent.service.hub``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.runtime.control import AuditRecord, ControlIdUse
from agent.telemetry import ControlAudit, Setting


def audit_event(record: AuditRecord, node_id: str, control_id: str) -> ControlAudit:
    """An :class:`AuditRecord` as a stream event (settings per target; see ``NodeControl`` for the shapes)."""
    old: list[Setting] = []
    new: list[Setting] = []
    targets: list[int | None] = list(record.unit_ids) or [None]
    if not (record.old or record.new) or record.action == "post_alert":
        pass  # refused before it ran (NodeControl.refuse), or an alert posted: no settings to show
    elif record.action == "set_batch_policy":
        old = [_setting(int(uid), v) for uid, v in record.old.items()]
        new = [_setting(uid, record.new) for uid in targets]
    elif record.action == "set_dispatch_policy":
        old = [_setting(None, record.old)] if record.old else []
        new = [_setting(None, record.new)]
    elif record.action == "set_params":
        old = [Setting(unit_id=None if k == "dispatch" else int(k), params=dict(v)) for k, v in record.old.items()]
        new = [Setting(unit_id=uid, params=dict(record.new)) for uid in targets]
    else:
        if record.old:
            old = [Setting(unit_id=targets[0], mode=record.old["mode"])]
        mode = record.new.get("mode")
        new = [Setting(unit_id=targets[0], mode=mode if mode in ("active", "draining", "paused", "failed") else None)]
    return ControlAudit(
        node_id=node_id, time_ns=record.time_ns, actor=record.who, control_id=control_id,
        action=record.action,
        unit_ids=record.unit_ids, old=tuple(old), new=tuple(new),
        result=record.result,  # type: ignore[arg-type]
        error_code=record.error_code or "", message=record.error or record.note or "",
    )


def repeated_control_id(control_id: str, first: ControlIdUse, now_ns: int) -> str:
    """Why a repeated ``control_id`` is refused, and where its first use's outcome is."""
    ago = f"{max(0, now_ns - first.time_ns) / 1e9:.1f} s ago"
    if first.result:
        seq = f" (its audit event: seq {first.audit_seq})" if first.audit_seq else ""
        outcome = f"that one was {first.result.replace('_', ' ')}{seq}"
    else:
        outcome = "that one is still being carried out (its audit event follows on the stream)"
    return (f"control_id {control_id!r} was used {ago}, nothing was done again: {outcome}; a retry after a lost "
            "reply finds its outcome there, a new request needs a new control_id")


def _setting(unit_id: int | None, value: Mapping[str, Any]) -> Setting:
    return Setting(unit_id=unit_id, policy=str(value.get("policy", "")), params=dict(value.get("params", {})))
