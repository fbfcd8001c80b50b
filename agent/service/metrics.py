"""Prometheus text exposition of a node's state, written by hand (the format is simple; no client library).

Served by the agent at ``GET /metrics`` (``agent.service.server``). Where vLLM has a metric for the same thing, its
name and labels are used (``vllm:num_requests_running{model_name=...,engine="0"}``; vLLM v1 labels every
per-engine metric with ``model_name`` and ``engine``), so dashboards built for vLLM work on an agent. Ours
are prefixed ``trackside_``.

:class:`NodeMetrics` accumulates what is only seen as a stream (step durations, tokens, first tokens, SLO outcomes,
control changes); :func:`render` reads the rest from the node at scrape time. Nothing here does I/O.
``examples/grafana/`` holds a dashboard over these (a test checks that every name it queries is served).

Where ours differ from vLLM's, in what is counted or when:

* ``vllm:prompt_tokens_total``: the prefill tokens of each step (a preempted request's recompute counts again).
  ``vllm:generation_tokens_total``: the decode tokens of each step plus one per first token.
* ``vllm:time_to_first_token_seconds``: observed at the first token, from the request's arrival at the node
  (the dispatcher's wait included). ``vllm:request_time_per_output_token_seconds``: the mean TPOT of a request,
  observed when it finishes (none for a single output token); ``trackside_request_max_tpot_seconds``: its worst
  per-token TPOT, the one ``trackside_slo_attained_total`` judges by default (finer buckets around usual SLOs).
* ``trackside_event_loop_cpu_seconds_total``: CPU time of the thread that renders the exposition, which is the
  thread of the agent's event loop (every ``/metrics`` is served on it): the OpenAI front end, dispatch and
  telemetry of a vLLM node, the whole simulated node of a simulated one. Its rate is the loop's busy share; near 1
  the loop, not the engines, is what limits the node (``docs/vllm.md``, "GPU run: the front end's event loop").
* ``trackside_control_changes_total{action}``: control changes applied, by action (``set_batch_policy``,
  ``set_dispatch_policy``, ``set_params``, ``set_unit_mode``), counted once final: for a live node after its units
  answered (a change a unit refused is not counted).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from agent.engine.base import RequestOutcome, StepRecord
from agent.runtime.control import AuditRecord
from agent.runtime.port import ServedNode

STEP_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds of the step-duration histogram (seconds); ``+Inf`` is implicit."""
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)
"""vLLM's ``vllm:time_to_first_token_seconds`` buckets (vLLM 0.26), so panels can mix agents and vLLM servers."""
TPOT_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
"""vLLM's ``vllm:request_time_per_output_token_seconds`` buckets (vLLM 0.26)."""
MAX_TPOT_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 10.0,
)
"""``trackside_request_max_tpot_seconds`` buckets: finer than vLLM's around the usual TPOT SLOs (20-100 ms)."""
CONTROL_ACTIONS: tuple[str, ...] = ("set_batch_policy", "set_dispatch_policy", "set_params", "set_unit_mode")
"""The actions ``trackside_control_changes_total`` counts, each served from 0."""


@dataclass(slots=True)
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        i = bisect_left(self.bounds, value)  # the first bucket whose bound is >= value; none past the last
        if i < len(self.counts):
            self.counts[i] += 1


@dataclass(slots=True)
class NodeMetrics:
    """The streamed part of the metrics: fed by the agent's node hooks."""

    step_s: dict[int, _Histogram] = field(default_factory=dict)
    """Step durations per unit (node time, seconds)."""
    ttft_s: dict[int, _Histogram] = field(default_factory=dict)
    """Time to first token per unit (node time, seconds), observed at the first token."""
    tpot_s: dict[int, _Histogram] = field(default_factory=dict)
    """Each finished request's mean TPOT per unit (seconds)."""
    max_tpot_s: dict[int, _Histogram] = field(default_factory=dict)
    """Each finished request's worst per-token TPOT per unit (seconds)."""
    num_prompt_tokens: dict[int, int] = field(default_factory=dict)
    num_generation_tokens: dict[int, int] = field(default_factory=dict)
    num_preemptions: dict[int, int] = field(default_factory=dict)
    num_finished: dict[int, int] = field(default_factory=dict)
    num_slo_attained: dict[int, int] = field(default_factory=dict)
    num_control_changes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CONTROL_ACTIONS, 0))
    """Applied control changes by action."""

    def observe_steps(self, records: Iterable[StepRecord]) -> None:
        """Count ``records``: each step's duration in its unit's histogram, its prompt and generated tokens and its
        preemptions (the hub's flush: one pass over a run of steps)."""
        step_s, prompt, generation, preemptions = (self.step_s, self.num_prompt_tokens, self.num_generation_tokens,
                                                   self.num_preemptions)
        num_buckets = len(STEP_BUCKETS_S)
        for record in records:
            uid = record.unit_id
            hist = step_s.get(uid)
            if hist is None:
                hist = step_s[uid] = _Histogram(STEP_BUCKETS_S)
            value = record.duration_s
            hist.total += value
            hist.count += 1
            i = bisect_left(STEP_BUCKETS_S, value)  # as _Histogram.observe
            if i < num_buckets:
                hist.counts[i] += 1
            prompt[uid] = prompt.get(uid, 0) + record.num_prefill_tokens
            generation[uid] = generation.get(uid, 0) + record.num_decode_tokens
            preemptions[uid] = preemptions.get(uid, 0) + record.num_preempted

    def observe_first_token(self, unit_id: int, ttft_s: float) -> None:
        """A request's first token on ``unit_id``, ``ttft_s`` after it arrived."""
        _histogram(self.ttft_s, unit_id, TTFT_BUCKETS_S).observe(ttft_s)
        self.num_generation_tokens[unit_id] = self.num_generation_tokens.get(unit_id, 0) + 1

    def observe_outcome(self, outcome: RequestOutcome) -> None:
        uid = outcome.unit_id
        self.num_finished[uid] = self.num_finished.get(uid, 0) + 1
        if outcome.met_slo:
            self.num_slo_attained[uid] = self.num_slo_attained.get(uid, 0) + 1
        mean = outcome.tpot_s
        if mean is not None:
            _histogram(self.tpot_s, uid, TPOT_BUCKETS_S).observe(mean)
            worst = outcome.max_tpot_s if outcome.max_tpot_s is not None else mean  # as tpot_by("worst")
            _histogram(self.max_tpot_s, uid, MAX_TPOT_BUCKETS_S).observe(worst)

    def observe_control(self, record: AuditRecord) -> None:
        """A control request's final audit record: counted when it was applied (not refused, not a dry run)."""
        if record.result == "applied" and record.action in self.num_control_changes:
            self.num_control_changes[record.action] += 1


def _histogram(series: dict[int, _Histogram], unit_id: int, bounds: tuple[float, ...]) -> _Histogram:
    hist = series.get(unit_id)
    if hist is None:
        hist = series[unit_id] = _Histogram(bounds)
    return hist


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items()) + "}"


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[Mapping[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {format_value(value)}")

    def histogram(self, name: str, help_text: str, series: Sequence[tuple[Mapping[str, str], _Histogram]]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} histogram")
        for labels, hist in series:
            cumulative = 0
            for bound, count in zip(hist.bounds, hist.counts, strict=True):
                cumulative += count
                self.lines.append(f"{name}_bucket{_labels({**labels, 'le': format_value(bound)})} {cumulative}")
            self.lines.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {hist.count}")
            self.lines.append(f"{name}_sum{_labels(labels)} {format_value(hist.total)}")
            self.lines.append(f"{name}_count{_labels(labels)} {hist.count}")


def _unit_series(
    units: Iterable[tuple[int, Mapping[str, str]]], series: Mapping[int, _Histogram], bounds: tuple[float, ...]
) -> list[tuple[Mapping[str, str], _Histogram]]:
    """Every unit's histogram (unit id, labels), an empty one for a unit that has observed nothing yet: each series
    exists from the first scrape, as vLLM's do."""
    return [(labels, series.get(uid) or _Histogram(bounds)) for uid, labels in units]


def render(
    node: ServedNode, metrics: NodeMetrics, *, model_name: str, num_dropped: int, num_subscribers: int,
    num_slow_dropped: int = 0,
) -> str:
    """The exposition text (format 0.0.4) for ``node`` now."""
    w = _Writer()
    units = [(u, {"model_name": model_name, "engine": str(u.unit_id)}, u.load()) for u in node.units]
    ids = [(u.unit_id, labels) for u, labels, _ in units]
    w.family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
             ((labels, load.num_running) for _, labels, load in units))
    w.family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
             ((labels, load.num_waiting) for _, labels, load in units))
    w.family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             ((labels, load.kv_used_blocks / load.num_blocks if load.num_blocks else 0.0) for _, labels, load in units))
    w.family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             ((labels, metrics.num_prompt_tokens.get(u.unit_id, 0)) for u, labels, _ in units))
    w.family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
             ((labels, metrics.num_generation_tokens.get(u.unit_id, 0)) for u, labels, _ in units))
    w.family("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
             ((labels, metrics.num_preemptions.get(u.unit_id, 0)) for u, labels, _ in units))
    w.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                _unit_series(ids, metrics.ttft_s, TTFT_BUCKETS_S))
    w.histogram("vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                _unit_series(ids, metrics.tpot_s, TPOT_BUCKETS_S))
    w.histogram("trackside_request_max_tpot_seconds",
                "Worst per-token TPOT of each finished request (what SLO attainment judges by default), seconds.",
                _unit_series(ids, metrics.max_tpot_s, MAX_TPOT_BUCKETS_S))
    w.histogram("trackside_step_duration_seconds", "Duration of engine steps (node time).",
                [(labels, metrics.step_s[u.unit_id]) for u, labels, _ in units if u.unit_id in metrics.step_s])
    w.family("trackside_prefill_admission_budget_tokens", "gauge",
             "Prefill admission budget of the unit's batch policy (FairBatching PAB), where it computes one.",
             ((labels, load.prefill_admission_budget) for _, labels, load in units
              if load.prefill_admission_budget is not None))
    w.family("trackside_batch_policy_info", "gauge", "The batch policy each unit runs (value 1).",
             (({**labels, "policy": u.policy.name}, 1) for u, labels, _ in units))
    w.family("trackside_unit_mode_info", "gauge", "Each unit's mode: active, draining or paused (value 1).",
             (({**labels, "mode": node.unit_modes[i]}, 1) for i, (_, labels, _) in enumerate(units)))
    w.family("trackside_dispatch_policy_info", "gauge", "The node's dispatch policy (value 1).",
             [({"model_name": model_name, "policy": node.dispatcher.name}, 1)])
    w.family("trackside_requests_arrived_total", "counter", "Requests that reached the node's dispatcher.",
             [({"model_name": model_name}, node.num_arrived)])
    w.family("trackside_requests_finished_total", "counter", "Requests finished, per unit.",
             ((labels, metrics.num_finished.get(u.unit_id, 0)) for u, labels, _ in units))
    w.family("trackside_slo_attained_total", "counter", "Finished requests that met their TTFT and TPOT SLOs.",
             ((labels, metrics.num_slo_attained.get(u.unit_id, 0)) for u, labels, _ in units))
    w.family("trackside_requests_refused_total", "counter",
             "Requests refused: by a unit's admission control (by=unit) or by the dispatcher (by=dispatcher).",
             [({"model_name": model_name, "by": "unit"}, node.num_refused),
              ({"model_name": model_name, "by": "dispatcher"}, node.num_rejected - node.num_refused)])
    w.family("trackside_control_changes_total", "counter",
             "Control changes applied (policy swaps, parameter changes, unit modes), by action.",
             (({"model_name": model_name, "action": action}, n) for action, n in metrics.num_control_changes.items()))
    w.family("trackside_telemetry_dropped_total", "counter",
             "Telemetry events dropped for subscribers too slow to take them.", [({}, num_dropped)])
    w.family("trackside_telemetry_subscribers", "gauge", "Connected telemetry subscribers.", [({}, num_subscribers)])
    w.family("trackside_telemetry_slow_subscribers_closed_total", "counter",
             "Telemetry subscribers closed for not reading within the subscriber timeout.", [({}, num_slow_dropped)])
    w.family("trackside_event_loop_cpu_seconds_total", "counter",
             "CPU time of the agent's event-loop thread; its rate near 1 means the loop is saturated.",
             [({}, time.thread_time())])
    return "\n".join(w.lines) + "\n"
