"""The console's state model: events from any number of nodes folded into plain records (no Textual, no clock).

:meth:`ConsoleState.apply` takes the events of a frame (live or replayed; any mix of nodes); feeds report their
connection with :meth:`ConsoleState.set_connection`. Time comes only from the events and from
:meth:`ConsoleState.tick` (the app passes its injected clock in live mode), so a replay and a test see exactly
what a live console saw. Everything kept is bounded: per-unit and per-node series hold ``history_buckets`` fixed
time buckets (``bucket_s`` each, aligned on the epoch), alerts, audits and policy markers are capped deques.

What comes from where:

* units' mode, batch policy and parameters, the dispatcher's policy: the hello, then applied ``audit`` events
  (a step's ``policy`` also updates its unit's policy);
* units' placement (GPU ids, tensor and pipeline parallel sizes; :mod:`console.model.placement`): the hello;
* heatmap series (:mod:`console.model.metrics`): KV use, batch size and available capacity from steps and from the
  dispatcher's ``unit_load`` snapshots; step time from steps; queued prefill tokens and PAB from ``unit_load``;
* flow (rates, goodput, SLO attainment, TTFT/TPOT): output tokens are steps' decode tokens plus first tokens;
  requests from ``request_finished`` (and ``request_refused``, which count against attainment);
* holes in a node's stream (:class:`~console.model.records.GapSpan`): ``gap`` alerts (the agent no longer buffered
  what a resume asked for), from the node's newest stream event before the alert to its first one after;
* recent steps per unit (:mod:`console.model.steps`), slack samples and requests' progress (:mod:`console.model.slack`),
  stage changes, arrivals' lengths and migrations (:mod:`console.model.stages`): the Steps, Slack and Stages screens.

Queries (summaries, trends, heatmap grids, cursor cells) are in :mod:`console.model.queries`, over this model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Final

from agent.telemetry import (
    Alert,
    AlertCode,
    ControlAudit,
    Event,
    NodeHello,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestMigrated,
    RequestRefused,
    SlackSample,
    StageBoundaries,
    StepEvent,
    UnitLoadEvent,
)
from console.model.metrics import METRIC_INDEX, HeatMetric
from console.model.records import (
    MODE_STATES,
    AlertEntry,
    Connection,
    GapSpan,
    NodeInfo,
    PolicyMarker,
    SourceInfo,
    UnitInfo,
    UnitState,
)
from console.model.render import bucket_index
from console.model.series import BucketRing, FlowBucket, HeatBucket
from console.model.slack import SlackBook
from console.model.stages import StageBook
from console.model.steps import StepLog

_KV: Final = METRIC_INDEX[HeatMetric.KV]
_BATCH: Final = METRIC_INDEX[HeatMetric.BATCH]
_QUEUED: Final = METRIC_INDEX[HeatMetric.QUEUED_PREFILL]
_CAPACITY: Final = METRIC_INDEX[HeatMetric.CAPACITY]
_PAB: Final = METRIC_INDEX[HeatMetric.PAB]
_STEP: Final = METRIC_INDEX[HeatMetric.STEP_TIME]

HISTORY_BUCKETS: Final = 240
"""Time buckets a series keeps by default (4 minutes of 1 s buckets): how far back the state's pictures reach."""


class ConsoleState:
    """Nodes, units, sources, alerts and policy changes, folded from protocol events."""

    def __init__(
        self,
        *,
        bucket_s: float = 1.0,
        history_buckets: int = HISTORY_BUCKETS,
        window_s: float = 30.0,
        max_alerts: int = 200,
        max_markers: int = 1000,
        max_steps: int = 256,
    ) -> None:
        if not (bucket_s > 0 and window_s > 0 and history_buckets >= 2):
            raise ValueError("bucket_s and window_s must be positive, history_buckets at least 2")
        self._limits = (max_alerts, max_markers, max_steps)
        self.bucket_ns = round(bucket_s * 1e9)
        """Width of a time bucket (ns)."""
        self.history_buckets = history_buckets
        """Buckets kept per series."""
        self.window_ns = round(window_s * 1e9)
        """The sliding window of rates and percentiles (ns)."""
        self.sources: dict[str, SourceInfo] = {}
        """By feed (URI or file), in the order they were added."""
        self.version = 0
        """Bumped by every change (views skip work when it has not moved)."""
        self._handlers: dict[type, Callable[[Any, NodeInfo], None]] = {
            StepEvent: self._on_step,
            UnitLoadEvent: self._on_load,
            RequestFirstToken: self._on_first_token,
            RequestFinished: self._on_finished,
            RequestRefused: self._on_refused,
            Alert: self._on_alert,
            ControlAudit: self._on_audit,
            StageBoundaries: self._on_stages,
            RequestArrived: self._on_arrived,
            SlackSample: self._on_slack,
            RequestMigrated: self._on_migrated,
        }
        self._clear()

    def _clear(self) -> None:
        """Forget every event (the sources stay)."""
        max_alerts, max_markers, max_steps = self._limits
        history_buckets = self.history_buckets
        self.nodes: dict[str, NodeInfo] = {}
        """By node id, in the order they were first seen."""
        self.alerts: deque[AlertEntry] = deque(maxlen=max_alerts)
        self.num_alerts = 0
        """Alerts ever added (a widget appends those it has not shown yet)."""
        self.markers: deque[PolicyMarker] = deque(maxlen=max_markers)
        """Applied control actions, oldest first."""
        self.audits: deque[ControlAudit] = deque(maxlen=max_markers)
        """Every audit event (applied, dry runs, rejected), oldest first."""
        self.now_ns = 0
        """The latest time seen: an event's or a :meth:`tick`'s."""
        self.num_events = 0
        self.steps = StepLog(max_steps)
        """The latest ``max_steps`` steps of every unit (the Steps screen)."""
        self.slack = SlackBook()
        """Latest slack samples and recent requests' progress (the Slack screen)."""
        self.stages = StageBook(history_buckets=history_buckets)
        """Stage changes, recent lengths and migrations per node (the Stages screen)."""

    # -- input -------------------------------------------------------------------------------------------------
    def apply(self, events: Iterable[Event], source: str | None = None) -> int:
        """Fold ``events`` (any nodes, stream order per node) into the state; ``source`` names the feed they came
        from (its connection becomes their nodes'). Returns how many were applied."""
        handlers = self._handlers
        count = 0
        now = self.now_ns
        for event in events:
            node = self.nodes.get(event.node_id) or self._new_node(event.node_id, event.time_ns)
            t = event.time_ns
            node.num_events += 1
            if t > node.last_ns:
                node.last_ns = t
            if t < node.first_ns:
                node.first_ns = t
            if t > now:
                now = t
            if isinstance(event, NodeHello):
                self._on_hello(event, node, source)
            else:
                handler = handlers.get(type(event))
                if handler is not None:
                    handler(event, node)
                if event.seq:
                    if t > node.stream_ns:
                        node.stream_ns = t
                    if node.open_gap is not None and event.seq > node.open_gap.last_seq:
                        self._close_gap(node, t)  # the first event after the hole
            count += 1
        self.now_ns = now
        self.num_events += count
        if count:
            self.version += 1
        return count

    def reset(self) -> None:
        """Start over: forget every event and alert (a replay rebuilding its view at another time). The sources
        and their connections stay; the version moves on, so every view redraws."""
        self._clear()
        for info in self.sources.values():
            info.node_ids.clear()
        self.version += 1

    def tick(self, now_ns: int) -> None:
        """Move the state's time forward to ``now_ns`` (never back): windows slide even while nothing arrives."""
        if now_ns > self.now_ns:
            self.now_ns = now_ns
            self.version += 1

    def set_connection(self, source: str, connection: Connection, detail: str = "") -> None:
        """Record a feed's connection state; losing or regaining a connection is also an alert."""
        info = self.sources.get(source)
        if info is None:
            self.sources[source] = SourceInfo(source, connection, detail, since_ns=self.now_ns)
            self.version += 1
            return
        previous = info.connection
        if previous == connection and info.detail == detail:
            return
        info.connection, info.detail, info.since_ns = connection, detail, self.now_ns
        self.version += 1
        where = ",".join(info.node_ids) or source
        if connection in (Connection.RECONNECTING, Connection.OFFLINE) and previous != connection:
            severity = "error" if connection == Connection.OFFLINE else "warning"
            self._alert(
                AlertEntry(
                    self.now_ns,
                    where,
                    "connection",
                    severity,
                    f"{source}: {connection.value}" + (f" ({detail})" if detail else ""),
                )
            )
        elif connection == Connection.LIVE and previous == Connection.RECONNECTING:
            self._alert(AlertEntry(self.now_ns, where, "connection", "info", f"{source}: connected again"))

    # -- reads -------------------------------------------------------------------------------------------------
    def node_connection(self, node: NodeInfo) -> Connection:
        """The connection of the feed ``node`` came from (live for events applied without a source)."""
        if node.source is None or node.source not in self.sources:
            return Connection.LIVE
        return self.sources[node.source].connection

    def unit_state(self, node: NodeInfo, unit: UnitInfo) -> UnitState:
        """The unit's mode while its node is connected (or replayed), else its connection's state."""
        connection = self.node_connection(node)
        if connection in (Connection.LIVE, Connection.REPLAY):
            return MODE_STATES.get(unit.mode, UnitState.RUNNING)
        return UnitState.OFFLINE if connection == Connection.OFFLINE else UnitState.RECONNECTING

    @property
    def newest_bucket(self) -> int:
        """The bucket holding :attr:`now_ns`."""
        return bucket_index(self.now_ns, self.bucket_ns)

    @property
    def oldest_bucket(self) -> int:
        """The oldest bucket the series still hold."""
        return self.newest_bucket - self.history_buckets + 1

    def unit_keys(self) -> list[tuple[str, int]]:
        """Every ``(node_id, unit_id)``, grouped by node (first seen first), units in id order."""
        return [(node.node_id, uid) for node in self.nodes.values() for uid in sorted(node.units)]

    # -- events ------------------------------------------------------------------------------------------------
    def _new_node(self, node_id: str, time_ns: int) -> NodeInfo:
        node = NodeInfo(node_id, BucketRing(self.history_buckets, FlowBucket), first_ns=time_ns, last_ns=time_ns)
        self.nodes[node_id] = node
        return node

    def _unit(self, node: NodeInfo, unit_id: int) -> UnitInfo:
        unit = node.units.get(unit_id)
        if unit is None:
            unit = UnitInfo(
                unit_id, BucketRing(self.history_buckets, HeatBucket), BucketRing(self.history_buckets, FlowBucket)
            )
            node.units[unit_id] = unit
        return unit

    def _on_hello(self, event: NodeHello, node: NodeInfo, source: str | None) -> None:
        if source is not None:
            node.source = source
            info = self.sources.get(source)
            if info is None:
                info = self.sources[source] = SourceInfo(source, Connection.LIVE, since_ns=self.now_ns)
            if node.node_id not in info.node_ids:
                info.node_ids.append(node.node_id)
        node.num_hellos += 1
        if node.open_gap is not None and node.open_gap.boot_ns != event.boot_ns:  # its run ended inside the hole
            self._close_gap(node, event.time_ns)
        node.boot_ns, node.profile = event.boot_ns, event.profile
        node.dispatch_policy, node.dispatch_params = event.dispatch_policy, dict(event.dispatch_params)
        node.batch_policies, node.dispatch_policies = event.batch_policies, event.dispatch_policies
        listed = set()
        for status in event.units:
            unit = self._unit(node, status.unit_id)
            listed.add(status.unit_id)
            unit.mode, unit.batch_policy = status.mode, status.batch_policy
            unit.batch_params = dict(status.batch_params)
            unit.num_blocks, unit.max_num_seqs = status.num_blocks, status.max_num_seqs
            unit.num_waiting = status.num_waiting
            unit.gpu_ids = status.gpu_ids
            unit.tensor_parallel_size = status.tensor_parallel_size
            unit.pipeline_parallel_size = status.pipeline_parallel_size
        for gone in set(node.units) - listed:
            del node.units[gone]

    def _on_step(self, event: StepEvent, node: NodeInfo) -> None:
        unit = self._unit(node, event.unit_id)
        index = event.time_ns // self.bucket_ns
        step_ms = event.measured_ns / 1e6
        unit.latest[HeatMetric.STEP_TIME] = step_ms
        unit.last_step_ns = event.time_ns
        unit.num_waiting = event.num_waiting
        unit.num_blocks = event.num_blocks
        if event.policy:
            unit.batch_policy = event.policy
        self.steps.add(node.node_id, event)
        heat = unit.heat.at(index)
        self._occupancy(unit, heat, event.kv_used_blocks, event.num_blocks, event.num_running)
        if heat is not None:
            heat.add(_STEP, step_ms)
        tokens = event.num_decode_tokens
        for flow in (unit.flow.at(index), node.flow.at(index)):
            if flow is not None:
                flow.out_tokens += tokens
                flow.steps += 1

    def _on_load(self, event: UnitLoadEvent, node: NodeInfo) -> None:
        unit = self._unit(node, event.unit_id)
        unit.healthy = event.healthy
        unit.num_waiting = event.num_waiting
        if event.max_num_seqs:
            unit.max_num_seqs = event.max_num_seqs
        heat = unit.heat.at(event.time_ns // self.bucket_ns)
        self._occupancy(unit, heat, event.kv_used_blocks, event.num_blocks, event.num_running)
        queued = float(event.queued_prefill_tokens)
        unit.latest[HeatMetric.QUEUED_PREFILL] = queued
        if heat is not None:
            heat.add(_QUEUED, queued)
        if event.pab_tokens is not None:
            unit.latest[HeatMetric.PAB] = event.pab_tokens
            if heat is not None:
                heat.add(_PAB, event.pab_tokens)

    def _occupancy(self, unit: UnitInfo, heat: HeatBucket | None, kv_used: int, num_blocks: int, running: int) -> None:
        """KV use, batch size and available capacity from one observation (a step or a load snapshot)."""
        latest = unit.latest
        latest[HeatMetric.BATCH] = running
        free: float | None = None
        if num_blocks:
            kv = kv_used / num_blocks
            latest[HeatMetric.KV] = kv
            free = 1.0 - kv
            if heat is not None:
                heat.add(_KV, kv)
        if unit.max_num_seqs:
            slots = 1.0 - running / unit.max_num_seqs
            free = slots if free is None else min(free, slots)
        if heat is not None:
            heat.add(_BATCH, running)
        if free is not None:
            free = max(0.0, free)
            latest[HeatMetric.CAPACITY] = free
            if heat is not None:
                heat.add(_CAPACITY, free)

    def _flows(self, node: NodeInfo, unit_id: int | None, time_ns: int) -> list[FlowBucket]:
        index = time_ns // self.bucket_ns
        rings = [node.flow] if unit_id is None else [node.flow, self._unit(node, unit_id).flow]
        return [bucket for ring in rings if (bucket := ring.at(index)) is not None]

    def _on_first_token(self, event: RequestFirstToken, node: NodeInfo) -> None:
        for flow in self._flows(node, event.unit_id, event.time_ns):
            flow.out_tokens += 1

    def _on_finished(self, event: RequestFinished, node: NodeInfo) -> None:
        self.slack.on_finished(event, node.node_id)
        for flow in self._flows(node, event.unit_id, event.time_ns):
            flow.finished += 1
            flow.met += event.met_slo
            flow.ttft_ms.append(event.ttft_ms)
            # The TPOT met_slo judged (the worst per-token one; the mean from an agent that does not send it).
            tpot = event.max_tpot_ms if event.max_tpot_ms is not None else event.tpot_ms
            if tpot is not None:
                flow.tpot_ms.append(tpot)

    def _on_refused(self, event: RequestRefused, node: NodeInfo) -> None:
        for flow in self._flows(node, event.unit_id, event.time_ns):
            flow.refused += 1

    def _on_alert(self, event: Alert, node: NodeInfo) -> None:
        self._alert(AlertEntry(event.time_ns, node.node_id, event.code, event.severity, event.message, event.unit_id))
        if event.code == AlertCode.GAP and event.first_seq:
            start = max(node.stream_ns, node.boot_ns)
            gap = GapSpan(node.boot_ns, event.first_seq, event.last_seq, start, max(start, event.time_ns))
            node.gaps.append(gap)
            node.open_gap = gap

    @staticmethod
    def _close_gap(node: NodeInfo, time_ns: int) -> None:
        """End ``node``'s open hole at ``time_ns`` (at its announcement if earlier: a hole read back from before a
        rebuild's window is followed by the window's first event, not by the one that ended it)."""
        gap = node.open_gap
        if gap is not None:
            gap.end_ns = max(gap.start_ns, min(time_ns, gap.announced_ns))
            node.open_gap = None

    def _on_stages(self, event: StageBoundaries, node: NodeInfo) -> None:
        node.stages = event
        self.stages.on_stages(event, node.node_id)

    def _on_arrived(self, event: RequestArrived, node: NodeInfo) -> None:
        self.slack.on_arrived(event, node.node_id)
        self.stages.on_arrived(event, node.node_id)

    def _on_slack(self, event: SlackSample, node: NodeInfo) -> None:
        self._unit(node, event.unit_id)
        self.slack.on_sample(event, node.node_id)

    def _on_migrated(self, event: RequestMigrated, node: NodeInfo) -> None:
        self.stages.on_migrated(event, event.time_ns // self.bucket_ns, node.node_id)

    def _on_audit(self, event: ControlAudit, node: NodeInfo) -> None:
        self.audits.append(event)
        if event.result != "applied" or not event.new:
            return  # nothing changed (a posted alert has no settings: it comes as an alert event of its own)
        for setting in event.new:
            if setting.unit_id is None:
                if event.action == "set_dispatch_policy":
                    node.dispatch_policy, node.dispatch_params = setting.policy, dict(setting.params)
                elif event.action == "set_params":
                    node.dispatch_params.update(setting.params)
                continue
            unit = self._unit(node, setting.unit_id)
            if event.action == "set_batch_policy":
                unit.batch_policy, unit.batch_params = setting.policy, dict(setting.params)
            elif event.action == "set_params":
                unit.batch_params.update(setting.params)
            elif event.action == "set_unit_mode" and setting.mode is not None:
                unit.mode = setting.mode
        self.markers.append(PolicyMarker(event.time_ns, node.node_id, event.action, event.unit_ids, marker_text(event)))

    def _alert(self, entry: AlertEntry) -> None:
        self.alerts.append(entry)
        self.num_alerts += 1


def marker_text(event: ControlAudit) -> str:
    """An applied control action in a few words: ``u1 vllm -> sarathi``, ``dispatch alpha=0.5``."""
    where = ",".join(f"u{u}" for u in event.unit_ids) if event.unit_ids else "dispatch"
    new = event.new[0] if event.new else None
    if new is None:
        return f"{where} {event.action}"
    if event.action in ("set_batch_policy", "set_dispatch_policy"):
        before = sorted({s.policy for s in event.old if s.policy})
        arrow = f"{'/'.join(before)} -> " if before else "-> "
        return f"{where} {arrow}{new.policy}"
    if event.action == "set_params":
        return f"{where} " + " ".join(f"{k}={v}" for k, v in new.params.items())
    return f"{where} -> {new.mode}"
