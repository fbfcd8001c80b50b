"""Live control of a node: policy hot-swap, parameter changes, pause/drain/resume, fail/recover, with an audit trail.

The hot-swap contract (POLICIES.md section 5):

* **Validate first, once.** A new policy is built (name and every parameter checked) for every targeted unit
  before any unit changes; a parameter change is checked against every targeted policy's schema (known
  name, type, range, ``live``: :meth:`~policies.base.BatchPolicy.check_params`) before any is applied, and the
  units apply the checked values without checking them again. On any failure nothing changes and the last good
  configuration stays.
* **Between two steps.** The caller runs these methods in the loop that drives :meth:`Node.advance`, so no
  step is being planned; a unit's in-flight step finishes under the plan it was given and its next step
  asks the new policy (``SimUnit.set_policy``). A live vLLM unit receives the change on its control channel
  and applies it at the top of its next ``schedule()`` (``agent.runtime.live.node``); the hub waits for its
  acknowledgement (:meth:`agent.runtime.port.LiveNode.settle`) before it answers.
* **Audited.** Every request, applied, rejected or dry run, yields an :class:`AuditRecord` (who, when in
  wall-clock ns, what, old, new, result, error) passed to ``on_audit``; an applied change or a dry run records the
  values as the policy holds them (parsed and coerced by the schema: ``"0.5"`` becomes ``0.5``), a rejected one
  what was asked. A request refused before it could run (no or a wrong token, a missing or repeated
  ``control_id``: the hub decides) is recorded too (:meth:`NodeControl.refuse`).
* **Once.** The hub refuses a change whose ``control_id`` :class:`ControlIds` has seen recently, so a replayed
  frame or a retry after a lost reply is never applied twice.
* **Nothing dropped.** Requests live in the units and the node, not in policies: a swap carries every
  waiting, running and pending request over; none is restarted or duplicated (tested with request
  accounting across 100 swaps under load).

A new policy instance starts with fresh internal state (an EB phase, a FairBatching admission budget, the
EWMAs of EB+): a swap is a restart of the decision logic, not of the requests.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agent.runtime.port import ServedNode
from policies.base import BatchPolicy
from policies.params import ParamError, ParamValue
from policies.registry import UnknownPolicyError, make_batch_policy, make_dispatch_policy


class ControlError(ValueError):
    """A control request that cannot be carried out; ``code`` is machine-readable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One control action, whatever its outcome."""

    time_ns: int
    """Wall-clock time of the decision (ns since the epoch)."""
    who: str
    action: str
    """``set_batch_policy``, ``set_dispatch_policy``, ``set_params``, ``set_unit_mode``, ``post_alert``; the request's
    kind for one refused before it ran (:meth:`NodeControl.refuse`)."""
    unit_ids: tuple[int, ...]
    """Units concerned (empty for node-wide actions such as the dispatcher)."""
    old: Mapping[str, Any]
    new: Mapping[str, Any]
    result: str
    """``applied``, ``rejected`` or ``dry_run``."""
    error: str | None = None
    error_code: str | None = None
    note: str | None = None
    """A remark on an applied change (a live unit that has not acknowledged it yet)."""


@dataclass(slots=True)
class ControlIdUse:
    """The first use of a ``control_id``: when, and (once answered) its result and its audit event's ``seq``."""

    time_ns: int
    result: str = ""
    """``applied``, ``rejected``, ``dry_run``; "" while the change is being carried out."""
    audit_seq: int = 0


@dataclass(slots=True)
class ControlIds:
    """The ``control_id`` of every change seen recently, so that a repeat is refused rather than applied again.

    An id is remembered for ``window_ns`` and while it is among the last ``min_kept`` ids, whichever is longer, and
    never more than ``max_kept`` ids in all (the oldest go first), so memory stays bounded whatever clients send.
    Ids are remembered whatever the change's outcome (a rejected change's id is spent too), and only for
    authenticated changes: a client without the token cannot fill the window. Time is wall-clock ns, given.
    """

    window_ns: int = 600 * 10**9
    min_kept: int = 4096
    max_kept: int = 1 << 16
    _seen: OrderedDict[str, ControlIdUse] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.window_ns < 0 or self.min_kept < 0:
            raise ValueError("window_ns and min_kept must be >= 0")
        self.max_kept = max(self.max_kept, self.min_kept)

    def __len__(self) -> int:
        return len(self._seen)

    def first_use(self, control_id: str, now_ns: int) -> ControlIdUse | None:
        """The first use of ``control_id`` if it is still remembered at ``now_ns``, else None."""
        self._forget(now_ns)
        return self._seen.get(control_id)

    def use(self, control_id: str, now_ns: int) -> ControlIdUse:
        """Remember ``control_id`` as used now (it must not be remembered already)."""
        self._forget(now_ns)
        entry = self._seen[control_id] = ControlIdUse(now_ns)
        if len(self._seen) > self.max_kept:
            self._seen.popitem(last=False)
        return entry

    def settle(self, control_id: str, result: str, audit_seq: int) -> None:
        """Note how the first use of ``control_id`` turned out (told to a repeat)."""
        entry = self._seen.get(control_id)
        if entry is not None:
            entry.result, entry.audit_seq = result, audit_seq

    def _forget(self, now_ns: int) -> None:
        seen = self._seen
        while len(seen) > self.min_kept:
            oldest = next(iter(seen.values()))
            if now_ns - oldest.time_ns <= self.window_ns:
                break
            seen.popitem(last=False)


@dataclass(slots=True)
class NodeControl:
    """The control plane of one node (no I/O: the agent's server calls it between steps)."""

    node: ServedNode
    on_audit: Callable[[AuditRecord], None] | None = None
    clock_ns: Callable[[], int] = time.time_ns
    audit_log: list[AuditRecord] = field(default_factory=list)

    # -- reads ----------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Policies, parameters, modes and load of every unit, and the node's request accounting."""
        node = self.node
        units = []
        for index, unit in enumerate(node.units):
            load = unit.load()
            units.append({
                "unit_id": unit.unit_id, "mode": node.unit_modes[index], "batch_policy": unit.policy.name,
                "params": dict(unit.policy.params), "num_running": load.num_running,
                "num_waiting": load.num_waiting, "kv_used_blocks": load.kv_used_blocks,
                "num_blocks": load.num_blocks, "prefill_admission_budget": load.prefill_admission_budget,
            })
        return {
            "dispatch_policy": node.dispatcher.name, "dispatch_params": dict(node.dispatcher.params),
            "now_s": node.now_s, "num_pending": node.num_pending, "num_finished": node.num_finished,
            "num_rejected": node.num_rejected, "num_refused": node.num_refused,
            "num_arrived": node.num_arrived, "units": units,
        }

    # -- writes ---------------------------------------------------------------------------------------
    def set_batch_policy(
        self, name: str, params: Mapping[str, ParamValue] | None = None, *, units: Sequence[int] | None = None,
        who: str = "unknown", dry_run: bool = False,
    ) -> AuditRecord:
        """Swap the batch policy of ``units`` (all when None) to a fresh, validated ``name`` instance."""
        params = dict(params or {})
        try:
            indexes = self._indexes(units)
            fresh = [make_batch_policy(name, params) for _ in indexes]
        except (UnknownPolicyError, ParamError, ControlError) as exc:
            return self._record("set_batch_policy", who, units or (), {}, {"policy": name, "params": params}, exc)
        unit_ids = tuple(self.node.units[i].unit_id for i in indexes)
        old = {str(self.node.units[i].unit_id): _describe(self.node.units[i].policy) for i in indexes}
        new = {"policy": name, "params": dict(fresh[0].params)} if fresh else {"policy": name}
        if not dry_run:
            for index, policy in zip(indexes, fresh, strict=True):
                self.node.units[index].set_policy(policy)
        return self._record("set_batch_policy", who, unit_ids, old, new, None, dry_run)

    def set_dispatch_policy(
        self, name: str, params: Mapping[str, ParamValue] | None = None, *, who: str = "unknown",
        dry_run: bool = False,
    ) -> AuditRecord:
        """Replace the node's dispatcher with a fresh, validated ``name`` instance."""
        params = dict(params or {})
        old = {"policy": self.node.dispatcher.name, "params": dict(self.node.dispatcher.params)}
        try:
            fresh = make_dispatch_policy(name, params)
        except (UnknownPolicyError, ParamError) as exc:
            return self._record("set_dispatch_policy", who, (), old, {"policy": name, "params": params}, exc)
        if not dry_run:
            self.node.set_dispatcher(fresh)
        return self._record(
            "set_dispatch_policy", who, (), old, {"policy": name, "params": dict(fresh.params)}, None, dry_run
        )

    def set_params(
        self, changes: Mapping[str, ParamValue], *, target: str = "batch", units: Sequence[int] | None = None,
        who: str = "unknown", dry_run: bool = False,
    ) -> AuditRecord:
        """Change live parameters of the batch policies of ``units`` (or of the dispatcher, ``target="dispatch"``)."""
        changes = dict(changes)
        indexes: list[int] = []
        try:
            if target == "dispatch":
                policies: list[Any] = [self.node.dispatcher]
                unit_ids: tuple[int, ...] = ()
            elif target == "batch":
                indexes = self._indexes(units)
                policies = [self.node.units[i].policy for i in indexes]
                unit_ids = tuple(self.node.units[i].unit_id for i in indexes)
            else:
                raise ControlError("bad_target", f"target must be batch or dispatch, not {target!r}")
            if not changes:
                raise ControlError("no_change", "no parameters given")
            # Validate once, against every policy before touching any: all change, or none does.
            checked = [policy.check_params(changes) for policy in policies]
        except (ParamError, ControlError) as exc:
            return self._record("set_params", who, units or (), {}, changes, exc)
        keys = [str(uid) for uid in unit_ids] if unit_ids else ["dispatch"]
        old = {key: {n: p.params[n] for n in changes} for key, p in zip(keys, policies, strict=True)}
        if not dry_run:
            if target == "dispatch":
                self.node.dispatcher.apply_params(checked[0])
            else:
                for index, values in zip(indexes, checked, strict=True):
                    self.node.units[index].set_policy_params(values)
        # The values as the (first) policy holds them, not as sent: "0.5" was parsed to 0.5.
        return self._record("set_params", who, unit_ids, old, checked[0], None, dry_run)

    def set_unit_mode(self, unit_id: int, mode: str, *, who: str = "unknown") -> AuditRecord:
        """Pause, drain or resume one unit (see :meth:`Node.set_unit_mode`)."""
        try:
            index = self._indexes([unit_id])[0]
            old = self.node.unit_modes[index]
            self.node.set_unit_mode(unit_id, mode)
        except (ValueError, ControlError) as exc:
            return self._record("set_unit_mode", who, (unit_id,), {}, {"mode": mode}, exc)
        return self._record("set_unit_mode", who, (unit_id,), {"mode": old}, {"mode": mode}, None)

    def fail_unit(self, unit_id: int, reason: str = "", *, who: str = "unknown") -> AuditRecord:
        """Take one unit out as a failure would, until :meth:`recover_unit` (see ``ServedNode.fail_unit``); audited as
        ``set_unit_mode`` to ``failed``, the reason (after who asked) in the unit's alert and the audit's note."""
        why = f"failed by {who}" + (f": {reason}" if reason else "")
        try:
            index = self._indexes([unit_id])[0]
            old = self.node.unit_modes[index]
            self.node.fail_unit(unit_id, why)
        except (ValueError, ControlError) as exc:
            return self._record("set_unit_mode", who, (unit_id,), {}, {"mode": "failed"}, exc)
        return self._record("set_unit_mode", who, (unit_id,), {"mode": old}, {"mode": "failed"}, None, note=why)

    def recover_unit(self, unit_id: int, *, who: str = "unknown") -> AuditRecord:
        """Bring a failed unit back, empty (see ``ServedNode.recover_unit``); audited as ``set_unit_mode`` from
        ``failed`` to ``active``."""
        try:
            self._indexes([unit_id])
            self.node.recover_unit(unit_id)
        except (ValueError, ControlError) as exc:
            return self._record("set_unit_mode", who, (unit_id,), {}, {"mode": "active"}, exc)
        return self._record("set_unit_mode", who, (unit_id,), {"mode": "failed"}, {"mode": "active"}, None)

    def post_alert(self, code: str, message: str, severity: str, *, who: str = "unknown") -> AuditRecord:
        """Audit an alert a client posts on the node's stream (the hub publishes it): nothing on the node changes;
        the record's note says the alert (``severity code: message``)."""
        return self._record("post_alert", who, (), {}, {"code": code, "severity": severity}, None,
                            note=f"{severity} {code}: {message}")

    def refuse(self, action: str, code: str, message: str, *, who: str = "unknown") -> AuditRecord:
        """Record a request refused before it could run (``code``: ``unauthorized``, ``invalid_field``,
        ``duplicate_control_id``); ``action`` is the request's kind. Nothing changes."""
        return self._record(action, who, (), {}, {}, ControlError(code, message))

    def amend(self, record: AuditRecord, *, result: str | None = None, error: str | None = None,
              error_code: str | None = None, note: str | None = None) -> AuditRecord:
        """``record`` as it turned out once a live node's units answered: the audit log keeps the amended one."""
        amended = replace(record, result=result or record.result, error=error or record.error,
                          error_code=error_code or record.error_code, note=note or record.note)
        for i in range(len(self.audit_log) - 1, -1, -1):
            if self.audit_log[i] is record:
                self.audit_log[i] = amended
                break
        return amended

    # -- helpers --------------------------------------------------------------------------------------
    def _indexes(self, units: Sequence[int] | None) -> list[int]:
        if units is None:
            return list(range(len(self.node.units)))
        if not units:
            raise ControlError("no_units", "an empty unit list")
        out = []
        for unit_id in units:
            try:
                out.append(self.node.unit_index(unit_id))
            except KeyError as exc:
                raise ControlError("unknown_unit", str(exc.args[0])) from None
        return out

    def _record(
        self, action: str, who: str, unit_ids: Sequence[int], old: Mapping[str, Any], new: Mapping[str, Any],
        error: Exception | None, dry_run: bool = False, *, note: str | None = None,
    ) -> AuditRecord:
        if error is not None:
            code = getattr(error, "code", None) or _error_code(error)
            message = str(error.args[0]) if error.args else str(error)
            result, err = "rejected", message
        else:
            code, err, result = None, None, "dry_run" if dry_run else "applied"
        record = AuditRecord(
            self.clock_ns(), who, action, tuple(unit_ids), dict(old), dict(new), result, err, code, note
        )
        self.audit_log.append(record)
        if self.on_audit is not None:
            self.on_audit(record)
        return record


def _describe(policy: BatchPolicy) -> dict[str, Any]:
    return {"policy": policy.name, "params": dict(policy.params)}


def _error_code(error: Exception) -> str:
    if isinstance(error, UnknownPolicyError):
        return "unknown_policy"
    if isinstance(error, ParamError):
        return "bad_param"
    return "bad_request"
