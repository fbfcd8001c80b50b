"""The recorder's advisor: every period, a what-if on each node's last window; ``recommendation`` alerts; the autopilot.

    trackside record ws://gpu-7:7700 --db telemetry.duckdb --token-file token --advise-every 5m
    trackside record ws://gpu-7:7700 --db telemetry.duckdb --token-file token --advise-every 5m --autopilot

Every period (wall clock) the advisor takes each node the recorder follows in turn:

1. **What-if** (an :class:`Analyst`; :class:`agent.cli.advisor_window.StoreAnalyst` reads the recorder's own store
   and replays in worker processes): the requests that arrived in the node's last window are replayed under the
   running policy (the fidelity check) and under every candidate, then ranked and judged by
   :mod:`agent.bench.whatif`. A window with fewer than ``min_requests`` requests is skipped.
2. **Advice.** A ``switch`` whose replay is within ``max_fidelity_err`` of the record (goodput, SLO attainment) is a
   recommendation: a ``recommendation`` alert posted on the node's stream (``post_alert``, with the control token;
   without a token it is only printed). The console's Overview lists it, and the store records it.
3. **Autopilot** (only when asked): the recommendation's dry run first (if it is refused, nothing changes and an
   alert says why), then the change itself. After a full window, the rollback check compares SLO attainment over
   the window after the swap with the window that recommended it. A drop of more than ``rollback_drop`` restores
   the last good policy (the agent audits it like any change), with an alert that says why. At most one swap per
   node and period, and none while a check is pending.

Everything the advisor does is a line on stderr (``say``). The what-if step and the control calls are injected
(:class:`Analyst`, :class:`Control`), so the decisions are tested without a store or an agent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from websockets.exceptions import WebSocketException

from agent.telemetry import (
    DEFAULT_TPOT_METRIC,
    ControlAudit,
    ControlRequest,
    DryRun,
    ErrorReply,
    NodeHello,
    OkReply,
    PostAlert,
    Reply,
    SetBatchPolicy,
    SetDispatchPolicy,
    Status,
    StatusInfo,
    TpotMetric,
)
from agent.telemetry.client import open_session, unreachable
from agent.telemetry.commands import MAX_ALERT_MESSAGE_CHARS
from policies.registry import batch_policy_class

log = logging.getLogger(__name__)

MIN_PERIOD_S: Final = 10.0
"""The shortest period ``trackside record --advise-every`` takes."""
MIN_REQUESTS: Final = 50
"""A window with fewer finished or refused requests is skipped: too few to judge a policy by."""
MAX_FIDELITY_ERR: Final = 0.10
"""A recommendation needs the replay of the running policy within this of the record (goodput, relative; SLO
attainment, absolute)."""

Change = SetBatchPolicy | SetDispatchPolicy
Outcome = Literal["skipped", "keep", "untrusted", "printed", "alerted", "not_posted", "applied", "dry_run_refused",
                  "apply_refused", "pending", "held", "rolled_back"]
"""What :meth:`Advisor.advise` did for a node in one round."""


def default_jobs() -> int:
    """Half the CPUs, at least one: the replays leave the rest to the recorder and whatever runs beside it."""
    return max(1, (os.cpu_count() or 2) // 2)


@dataclass(frozen=True, slots=True)
class AdvisorSettings:
    every_s: float
    """Wall-clock seconds between two rounds."""
    window_s: float | None = None
    """The window replayed, by the node's clock (its events' times): the last ``window_s`` up to its latest recorded
    arrival, from its current run's start at the earliest (None: ``every_s``)."""
    compare: tuple[str, ...] = ()
    """Candidate batch policies (empty: every built-in one)."""
    dispatch: tuple[str, ...] = ()
    """Candidate dispatch policies (empty: the one that runs)."""
    min_gain: float = 0.05
    """The least effective-RPS gain over the replayed running policy worth a recommendation (the replay's own
    error, when larger, is the bar: :func:`agent.bench.whatif.trust_margin`)."""
    autopilot: bool = False
    rollback_drop: float = 0.05
    """The drop in SLO attainment (absolute) over the window after a swap that rolls it back."""
    jobs: int = 1
    """Worker processes for the replays."""
    min_requests: int = MIN_REQUESTS
    max_fidelity_err: float = MAX_FIDELITY_ERR
    tpot_metric: TpotMetric = DEFAULT_TPOT_METRIC

    @property
    def window(self) -> float:
        return self.window_s or self.every_s


# -- what the what-if step gives back -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Assessment:
    """A what-if on one node's last window: the record, the replay's fidelity and the recommendation."""

    start_ns: int
    end_ns: int
    num_requests: int
    batch_policy: str
    """The batch policy that ran (the replay's)."""
    dispatch: str
    slo_attainment: float
    """The record's SLO attainment over the window (what a rollback check compares the next window with)."""
    fidelity: Mapping[str, float | None]
    """:func:`agent.bench.whatif.fidelity`."""
    recommendation: Mapping[str, Any]
    """:func:`agent.bench.whatif.recommend`: ``action``, ``batch_policy``, ``dispatch``, ``params``,
    ``expected_gain``, ``reason``."""
    warnings: tuple[str, ...] = ()
    mark_ns: int = 0
    """The node's latest recorded arrival or outcome when the window was read: the next round needs a later one."""

    @property
    def running(self) -> str:
        return f"{self.batch_policy} + {self.dispatch}"


@dataclass(frozen=True, slots=True)
class Skipped:
    """A window not assessed, and why."""

    reason: str
    mark_ns: int = 0
    """The node's latest recorded arrival or outcome when it was read (0: none): the next round needs a later one."""


@dataclass(frozen=True, slots=True)
class Observed:
    """The record of the window after a swap."""

    start_ns: int
    end_ns: int
    num_requests: int
    slo_attainment: float


@dataclass(frozen=True, slots=True)
class RollbackCheck:
    """An autopilot swap waiting for its next window."""

    boot_ns: int
    """The run of the agent it was applied in (a restart drops it)."""
    after_seq: int
    """The swap's (last) audit event: the window after the swap starts at the first arrival after it."""
    before_attainment: float
    applied: str
    last_good: str
    restore: tuple[Change, ...]
    """The changes that bring the last good policy back."""


@dataclass(slots=True)
class WatchedNode:
    uri: str
    hello: NodeHello
    since_ns: int = 0
    """The node's latest recorded arrival or outcome at the last window read: the next one needs something
    recorded after it (a window is not read twice as it was)."""
    check: RollbackCheck | None = None

    @property
    def node_id(self) -> str:
        return self.hello.node_id


class Analyst(Protocol):
    """The what-if step (:class:`agent.cli.advisor_window.StoreAnalyst` on the recorder's store)."""

    async def assess(self, node: WatchedNode, window_s: float, since_ns: int) -> Assessment | Skipped:
        """The what-if on the node's last ``window_s`` (node clock), or why not (skipped when nothing was recorded
        after ``since_ns``: no arrival, no outcome)."""
        ...

    async def observe_after(self, node: WatchedNode, after_seq: int, window_s: float) -> Observed | None:
        """The record of the first ``window_s`` after stream position ``after_seq``; None until it is all recorded."""
        ...


class Control(Protocol):
    """Sends one control request to the agent at a URI (a fresh ``control_id`` each time) and returns its reply."""

    async def call(self, uri: str, request: ControlRequest) -> Reply: ...


@dataclass(slots=True)
class SessionControl:
    """:class:`Control` over a connection per call (``agent.telemetry.client.open_session``) with the token."""

    token: str
    ssl_context: ssl.SSLContext | None = None
    timeout_s: float = 10.0

    async def call(self, uri: str, request: ControlRequest) -> Reply:
        async with open_session(uri, token=self.token, ssl_context=self.ssl_context) as session:
            return await session.call(request, self.timeout_s)


def _say(line: str) -> None:
    print(f"trackside record: advisor: {line}", file=sys.stderr, flush=True)


# -- the advisor ----------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Advisor:
    """Advises on every node it is told of (:meth:`watch`), a round every ``settings.every_s`` (:meth:`run`)."""

    settings: AdvisorSettings
    control: Control | None = None
    """None: recommendations are printed only (no token), and the autopilot cannot run."""
    analyst: Analyst | None = None
    """Set before :meth:`run` (``advise_beside`` sets the recorder's)."""
    say: Callable[[str], None] = _say
    nodes: dict[str, WatchedNode] = field(default_factory=dict)
    """By the agent's URI."""

    def __post_init__(self) -> None:
        if self.settings.autopilot and self.control is None:
            raise ValueError("the autopilot needs control of the agents (their control token)")

    def watch(self, uri: str, hello: NodeHello) -> None:
        """The agent at ``uri`` said hello (a connection's first frame): follow that node, in that run."""
        node = self.nodes.get(uri)
        if node is None or (node.node_id, node.hello.boot_ns) != (hello.node_id, hello.boot_ns):
            if node is not None and node.check is not None:
                self.say(f"{node.node_id}: the agent restarted since the autopilot's swap to {node.check.applied}: "
                         "the swap went with that run, no rollback check")
            self.nodes[uri] = WatchedNode(uri, hello)
        else:
            node.hello = hello

    async def run(self) -> None:
        """A round every period, until cancelled."""
        while True:
            await asyncio.sleep(self.settings.every_s)
            await self.round()

    async def round(self) -> dict[str, Outcome | None]:
        """Advise on every node once (one failing says so and does not stop the others); each node's outcome (None:
        an error)."""
        if not self.nodes:
            self.say("no agent has said hello yet: nothing to advise on")
        outcomes: dict[str, Outcome | None] = {}
        for node in list(self.nodes.values()):
            outcome: Outcome | None = None
            try:
                outcome = await self.advise(node)
            except (OSError, TimeoutError, WebSocketException) as exc:
                self.say(f"{node.node_id}: {unreachable(node.uri, exc)}")
            except Exception as exc:  # a bug or a broken store must not stop the recording: say it, go on
                log.exception("advising on %s failed", node.node_id)
                self.say(f"{node.node_id}: failed: {type(exc).__name__}: {exc}")
            outcomes[node.node_id] = outcome
        return outcomes

    async def advise(self, node: WatchedNode) -> Outcome:
        """One round for one node: the pending rollback check, else (or once it holds) the what-if and its advice."""
        if self.analyst is None:
            raise RuntimeError("the advisor has no analyst")
        if node.check is not None:
            checked = await self._check(node, self.analyst)
            if checked != "held":
                return checked
        window = self.settings.window
        found = await self.analyst.assess(node, window, node.since_ns)
        node.since_ns = max(node.since_ns, found.mark_ns)
        if isinstance(found, Skipped):
            self.say(f"{node.node_id}: skipped: {found.reason}")
            return "skipped"
        rec = found.recommendation
        head = f"{node.node_id}: {found.num_requests:,} requests over the last {span(window)}"
        for warning in found.warnings:
            self.say(f"{node.node_id}: warning: {warning}")
        if rec["action"] != "switch":
            self.say(f"{head}: keep {found.running}: {rec['reason']}")
            return "keep"
        if not fidelity_within(found.fidelity, self.settings.max_fidelity_err):
            self.say(f"{head}: {label(rec)} looks better, but the replay is too far from the record to trust it "
                     f"({fidelity_text(found.fidelity)}; the bound is {self.settings.max_fidelity_err:.0%}): no "
                     "recommendation")
            return "untrusted"
        message = recommendation_message(found, window)
        if self.settings.autopilot:
            return await self._autopilot(node, found, message)
        return await self._post(node, message)

    # -- alerts ---------------------------------------------------------------------------------------------------
    async def _post(self, node: WatchedNode, message: str, severity: Literal["info", "warning"] = "info") -> Outcome:
        """Post ``message`` as a ``recommendation`` alert on the node's stream (printed only without control)."""
        if len(message) > MAX_ALERT_MESSAGE_CHARS:
            message = message[:MAX_ALERT_MESSAGE_CHARS - 3] + "..."
        if self.control is None:
            self.say(f"{node.node_id}: recommendation (printed only: no --token-file to post it): {message}")
            return "printed"
        reply = await self.control.call(node.uri, PostAlert(code="recommendation", message=message,
                                                            severity=severity))
        if isinstance(reply, ErrorReply):
            self.say(f"{node.node_id}: recommendation not posted ({reply.code}: {reply.message}): {message}")
            return "not_posted"
        self.say(f"{node.node_id}: posted a recommendation alert: {message}")
        return "alerted"

    # -- the autopilot --------------------------------------------------------------------------------------------
    async def _autopilot(self, node: WatchedNode, found: Assessment, message: str) -> Outcome:
        """Dry run, apply, and leave a rollback check."""
        assert self.control is not None  # __post_init__
        rec = found.recommendation
        changes = recommendation_changes(rec, found.batch_policy, found.dispatch)
        status = await self.control.call(node.uri, Status())
        if not (isinstance(status, OkReply) and isinstance(status.payload, StatusInfo)):
            why = f"{status.code}: {status.message}" if isinstance(status, ErrorReply) else "no status"
            await self._post(node, f"autopilot: not applied, the agent's status is unavailable ({why}). {message}",
                             "warning")
            return "apply_refused"
        last_good, restore = status_label(status.payload), restore_changes(status.payload, changes)
        for change in changes:
            reply = await self.control.call(node.uri, DryRun(change=change))
            if isinstance(reply, ErrorReply):
                await self._post(node, f"autopilot: the dry run of {describe(change)} was refused ({reply.code}: "
                                 f"{reply.message}): nothing applied. {message}", "warning")
                return "dry_run_refused"
        seqs: list[int] = []
        for change in changes:
            reply = await self.control.call(node.uri, change)
            if isinstance(reply, ErrorReply):
                undone = ""
                if seqs:  # half applied: back to the last good policy at once
                    errors = await self._restore(node, restore)
                    undone = f"; rolled back to {last_good}" + (f" ({'; '.join(errors)})" if errors else "")
                await self._post(node, f"autopilot: {describe(change)} was refused ({reply.code}: {reply.message})"
                                 + (undone or ": nothing applied"), "warning")
                return "apply_refused"
            if isinstance(reply.payload, ControlAudit):
                seqs.append(reply.payload.seq)
        node.check = RollbackCheck(boot_ns=node.hello.boot_ns, after_seq=max(seqs, default=0),
                                   before_attainment=found.slo_attainment, applied=label(rec), last_good=last_good,
                                   restore=restore)
        window = span(self.settings.window)
        await self._post(node, f"autopilot: switched {last_good} to {label(rec)}: {message}; it rolls back if SLO "
                         f"attainment (now {found.slo_attainment:.1%}) drops more than "
                         f"{100 * self.settings.rollback_drop:.1f} points over the next {window}")
        return "applied"

    async def _check(self, node: WatchedNode, analyst: Analyst) -> Outcome:
        """The pending rollback check: ``pending`` until a full window after the swap is recorded, then ``held`` or
        ``rolled_back``."""
        check = node.check
        assert check is not None
        window = self.settings.window
        observed = await analyst.observe_after(node, check.after_seq, window)
        if observed is None:
            self.say(f"{node.node_id}: autopilot: {check.applied} applied; the rollback check waits for a full "
                     f"{span(window)} after the swap")
            return "pending"
        node.check = None
        before, after = check.before_attainment, observed.slo_attainment
        if before - after <= self.settings.rollback_drop:
            self.say(f"{node.node_id}: autopilot: {check.applied} holds: SLO attainment {before:.1%} before the swap, "
                     f"{after:.1%} over the {span(window)} after it ({observed.num_requests:,} requests)")
            return "held"
        errors = await self._restore(node, check.restore)
        why = (f"SLO attainment fell from {before:.1%} to {after:.1%} over the {span(window)} after the swap "
               f"({observed.num_requests:,} requests), more than {100 * self.settings.rollback_drop:.1f} points")
        if errors:
            await self._post(node, f"autopilot: rolling {check.applied} back to {check.last_good} failed "
                             f"({'; '.join(errors)}): {why}; set the policy by hand", "warning")
        else:
            await self._post(node, f"autopilot: rolled {check.applied} back to {check.last_good}: {why}", "warning")
        return "rolled_back"

    async def _restore(self, node: WatchedNode, restore: Sequence[Change]) -> list[str]:
        """Send the last good policy's changes; the refusals, as ``what: code: message``."""
        assert self.control is not None
        errors = []
        for change in restore:
            reply = await self.control.call(node.uri, change)
            if isinstance(reply, ErrorReply):
                errors.append(f"{describe(change)}: {reply.code}: {reply.message}")
        return errors


# -- helpers (pure) -------------------------------------------------------------------------------------------------
def fidelity_within(fid: Mapping[str, float | None], bound: float) -> bool:
    """Whether the replay's goodput (relative) and SLO attainment (absolute) errors are within ``bound``. The goodput
    error is undefined when the record served nothing within its SLO: then the SLO attainment error bounds it."""
    slo, goodput = fid.get("slo_attainment_abs_err"), fid.get("goodput_rel_err")
    return slo is not None and slo <= bound and (goodput is None or goodput <= bound)


def fidelity_text(fid: Mapping[str, float | None]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    return f"goodput {pct(fid.get('goodput_rel_err'))}, SLO {pct(fid.get('slo_attainment_abs_err'))}"


def span(seconds: float) -> str:
    """``300`` as ``5 min``, ``3600`` as ``1 h``, ``45`` as ``45 s``."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def label(rec: Mapping[str, Any]) -> str:
    return f"{rec['batch_policy']} + {rec['dispatch']}"


def recommendation_message(found: Assessment, window_s: float) -> str:
    """``sarathi + least_loaded would gain +12.3% effective RPS over vllm + least_loaded on the last 5 min (fidelity:
    goodput 1.2%, SLO 0.4%)``."""
    rec = found.recommendation
    gain = rec.get("expected_gain")
    what = (f"would gain {gain:+.1%} effective RPS over {found.running}" if gain is not None
            else f"would meet SLOs where {found.running} met none in the replay")
    return f"{label(rec)} {what} on the last {span(window_s)} (fidelity: {fidelity_text(found.fidelity)})"


def recommendation_changes(rec: Mapping[str, Any], batch_policy: str, dispatch: str) -> list[Change]:
    """The changes that apply a ``switch`` to a node running ``batch_policy`` + ``dispatch``: the batch policy on
    every unit and/or the dispatcher, each with its own parameters (as ``trackside whatif --apply``)."""
    params = dict(rec.get("params") or {})
    batch_names = {p.name for p in batch_policy_class(rec["batch_policy"]).params_schema}
    changes: list[Change] = []
    if rec["batch_policy"] != batch_policy:
        changes.append(SetBatchPolicy(policy=rec["batch_policy"],
                                      params={k: v for k, v in params.items() if k in batch_names}))
    if rec["dispatch"] != dispatch:
        changes.append(SetDispatchPolicy(policy=rec["dispatch"],
                                         params={k: v for k, v in params.items() if k not in batch_names}))
    return changes


def restore_changes(status: StatusInfo, changes: Sequence[Change]) -> tuple[Change, ...]:
    """The changes that bring back what ``status`` shows, for what ``changes`` will change: each group of units with
    the same batch policy and parameters, the dispatcher."""
    out: list[Change] = []
    if any(isinstance(c, SetBatchPolicy) for c in changes):
        groups: dict[str, tuple[str, dict[str, Any], list[int]]] = {}
        for unit in status.units:
            key = json.dumps([unit.batch_policy, unit.batch_params], sort_keys=True, default=str)
            groups.setdefault(key, (unit.batch_policy, dict(unit.batch_params), []))[2].append(unit.unit_id)
        out.extend(SetBatchPolicy(policy=policy, params=params, unit_ids=tuple(ids))
                   for policy, params, ids in groups.values())
    if any(isinstance(c, SetDispatchPolicy) for c in changes):
        out.append(SetDispatchPolicy(policy=status.dispatch_policy, params=dict(status.dispatch_params)))
    return tuple(out)


def status_label(status: StatusInfo) -> str:
    """``vllm + least_loaded`` (units on different batch policies: ``vllm/sarathi + least_loaded``)."""
    batch = sorted({u.batch_policy for u in status.units})
    return f"{'/'.join(batch) or '?'} + {status.dispatch_policy}"


def describe(change: Change) -> str:
    """``set_batch_policy sarathi`` (``... on units 0,1`` for some units), ``set_dispatch_policy pab``."""
    if isinstance(change, SetDispatchPolicy):
        return f"set_dispatch_policy {change.policy}"
    where = f" on units {','.join(map(str, change.unit_ids))}" if change.unit_ids else ""
    return f"set_batch_policy {change.policy}{where}"
