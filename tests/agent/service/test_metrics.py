"""``agent.service.metrics`` without sockets: the token, latency and control counters agree with what the node did."""

from __future__ import annotations

import math
import re
import time

from serve_harness import TOKEN, make_hub

from agent.engine.base import RequestOutcome
from agent.service.hub import Hub
from agent.service.metrics import CONTROL_ACTIONS
from agent.telemetry import DryRun, ErrorReply, OkReply, PauseUnit, SetBatchPolicy, SetParams

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")


def samples(hub: Hub) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The hub's exposition as sample name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in hub.metrics_text().splitlines():
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, line
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return out


def total(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str) -> float:
    return sum(v for labels, v in found[name] if all(labels.get(k) == want for k, want in match.items()))


def finished_run() -> tuple[Hub, list[RequestOutcome]]:
    hub = make_hub(units=2, workload="poisson:n=200,rate=30")
    hub.attach()
    hub.node.run()
    outcomes = [s.outcome for s in hub.node.states.values() if s.outcome is not None]
    assert len(outcomes) == 200
    return hub, outcomes


def test_tokens_and_latencies_agree_with_the_outcomes() -> None:
    hub, outcomes = finished_run()
    found = samples(hub)
    # No request was preempted, so every prefill token and every output token was computed once.
    assert sum(o.num_preemptions for o in outcomes) == total(found, "vllm:num_preemptions_total") == 0
    assert total(found, "vllm:prompt_tokens_total") == sum(o.prompt_tokens for o in outcomes)
    assert total(found, "vllm:generation_tokens_total") == sum(o.output_tokens for o in outcomes)
    for unit in ("0", "1"):
        mine = [o for o in outcomes if str(o.unit_id) == unit]
        assert mine, unit
        assert total(found, "vllm:time_to_first_token_seconds_count", engine=unit) == len(mine)
        assert math.isclose(total(found, "vllm:time_to_first_token_seconds_sum", engine=unit),
                            sum(o.ttft_s for o in mine), rel_tol=1e-9)
        several = [o for o in mine if o.output_tokens >= 2]
        for name in ("vllm:request_time_per_output_token_seconds", "trackside_request_max_tpot_seconds"):
            assert total(found, f"{name}_count", engine=unit) == len(several)
            buckets = [v for labels, v in found[f"{name}_bucket"] if labels["engine"] == unit]
            assert buckets == sorted(buckets) and buckets[-1] == len(several)
        mean_sum = total(found, "vllm:request_time_per_output_token_seconds_sum", engine=unit)
        assert math.isclose(mean_sum, sum(o.tpot_s or 0.0 for o in several), rel_tol=1e-9)
        assert total(found, "trackside_request_max_tpot_seconds_sum", engine=unit) >= mean_sum  # the worst >= the mean


def test_every_unit_has_its_latency_series_before_its_first_request() -> None:
    found = samples(make_hub(units=3))
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:request_time_per_output_token_seconds_count",
                 "trackside_request_max_tpot_seconds_count", "vllm:generation_tokens_total"):
        assert found[name] == [({"model_name": "h100-llama31-8b", "engine": u}, 0.0) for u in ("0", "1", "2")], name


def test_control_changes_count_what_was_applied() -> None:
    hub = make_hub(units=2)
    hub.attach()
    ok = [SetBatchPolicy(policy="sarathi", token=TOKEN, control_id="c1"),
          SetParams(target="batch", params={"token_budget": 2048}, token=TOKEN, control_id="c2"),
          PauseUnit(unit_id=1, token=TOKEN, control_id="c3")]
    refused = [SetBatchPolicy(policy="sarathi", token="wrong", control_id="c4"),
               SetBatchPolicy(policy="nosuch", token=TOKEN, control_id="c5"),
               DryRun(change=SetParams(target="batch", params={"token_budget": 64}), token=TOKEN,
                      control_id="c6")]
    for request in ok:
        assert isinstance(hub.handle(request, who="op"), OkReply)
    assert [type(hub.handle(r, who="op")) for r in refused] == [ErrorReply, ErrorReply, OkReply]
    found = samples(hub)
    counted = {action: total(found, "trackside_control_changes_total", action=action) for action in CONTROL_ACTIONS}
    assert counted == {"set_batch_policy": 1, "set_dispatch_policy": 0, "set_params": 1, "set_unit_mode": 1}


def test_the_event_loops_cpu_is_the_rendering_threads() -> None:
    """``trackside_event_loop_cpu_seconds_total`` is the CPU time of the thread that renders it, the loop's (every
    ``/metrics`` is served there): CPU burnt on this thread between two scrapes shows in it, a sleep does not."""
    hub = make_hub(units=1)

    def loop_cpu() -> float:
        return total(samples(hub), "trackside_event_loop_cpu_seconds_total")

    before = loop_cpu()
    t = time.thread_time()
    while time.thread_time() - t < 0.2:
        pass
    burnt = loop_cpu()
    time.sleep(0.2)
    slept = loop_cpu()
    assert burnt - before >= 0.2
    assert slept - burnt < 0.1
