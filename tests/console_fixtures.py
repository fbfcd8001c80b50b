"""A small store for the console's tests: two simulated nodes run through the hub into ``StoreWriter``.

The tests may import the engine (only the ``console`` package may not). Node ``node-a`` (4 units, vLLM's policy,
least-loaded dispatch) gets a batch-policy swap on unit 1 half-way and an alert; node ``node-b`` (2 units,
FairBatching with PAB, PAB dispatch) runs alongside.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from serve_harness import TOKEN

from agent.bench.runner import BenchConfig
from agent.cli.serve import make_node
from agent.runtime.node import Node
from agent.service.hub import Hub
from agent.telemetry import Alert, Event, OkReply, SetBatchPolicy
from agent.workload.spec import parse_workload
from store.writer import StoreWriter

SWAP_AT_S = 4.0
RUN_S = 8.0
SNAPSHOT_ORIGIN_NS = 1_800_000_000_000_000_000
"""A fixed wall-clock time for node time 0 (2027-01-15 08:00 UTC), for stores that must come out the same on
every run (the snapshot tests)."""


def node_clock(node: Node, origin_ns: int | None) -> Callable[[], int]:
    """The hub's wall clock: the real one, or ``origin_ns`` plus the node's simulated time (deterministic)."""
    if origin_ns is None:
        return time.time_ns
    return lambda: origin_ns + round(node.now_s * 1e9)


def make_node_hub(
    node_id: str, *, units: int, batch_policy: str, dispatch: str, workload: str, origin_ns: int | None = None
) -> Hub:
    config = BenchConfig(units=units, batch_policy=batch_policy, dispatch=dispatch)
    node = make_node(config, parse_workload(workload, seed=1))
    return Hub(
        node,
        node_id=node_id,
        profile=config.profile,
        token=TOKEN,
        replay_capacity=1 << 20,
        slack_sample_ms=0,
        get_time_ns=node_clock(node, origin_ns),
    )


def node_a_events(origin_ns: int | None = None) -> list[Event]:
    """node-a's hello and stream: a swap of unit 1 to sarathi at 4 s of node time, an alert, 8 s in all."""
    hub = make_node_hub(
        "node-a",
        units=4,
        batch_policy="vllm",
        dispatch="least_loaded",
        workload="bursty:n=600,rate=60",
        origin_ns=origin_ns,
    )
    hub.attach()
    hello = hub.hello()
    hub.node.advance(SWAP_AT_S)
    reply = hub.handle(SetBatchPolicy(policy="sarathi", unit_ids=(1,), token=TOKEN, control_id="swap"), who="test")
    assert isinstance(reply, OkReply), reply
    hub.publish(
        Alert(
            node_id="node-a",
            time_ns=hub.origin.ns(hub.node.now_s),
            code="slo_breach",
            severity="warning",
            unit_id=2,
            message="unit 2 is missing its TPOT target",
        )
    )
    hub.node.advance(RUN_S)
    return [hello, *hub.replay.since(0).events]


def node_b_events(origin_ns: int | None = None) -> list[Event]:
    hub = make_node_hub(
        "node-b",
        units=2,
        batch_policy="fairbatching+pab",
        dispatch="pab",
        workload="poisson:n=300,rate=30",
        origin_ns=origin_ns,
    )
    hub.attach()
    hello = hub.hello()
    hub.node.advance(RUN_S)
    return [hello, *hub.replay.since(0).events]


def build_store(path: Path) -> Path:
    """Write both nodes' events to a new store at ``path``: node-a from now, node-b half a second later, every event
    stamped with its node's simulated time, so the file is 8.5 s long however long the simulation takes (stamped by
    the real clock, it grew to 9 s when the machine was loaded)."""
    origin_ns = time.time_ns()
    with StoreWriter(path) as writer:
        writer.write(node_a_events(origin_ns))
        writer.write(node_b_events(origin_ns + 500_000_000))
        writer.flush()
    return path


# -- a staged node, for the Steps, Slack and Stages screens -------------------------------------------------------
STAGED_WORKLOAD = "poisson:n=400,rate=50,prompt=lognormal(mu=6,sigma=1.5)"
"""Short and long prompts mixed (median about 400 tokens, a long tail), so CascadeInfer cuts stages and migrates."""


def node_c_events(origin_ns: int | None = None) -> list[Event]:
    """node-c: 4 units of FairBatching (its reasons count urgent decodes) behind CascadeInfer, slack samples every
    250 ms: stage boundaries, migrations and slack samples, 8 s in all."""
    config = BenchConfig(
        units=4,
        batch_policy="fairbatching",
        dispatch="cascade",
        params={"min_partition_samples": "8", "repartition_interval_s": "0.5"},
    )
    node = make_node(config, parse_workload(STAGED_WORKLOAD, seed=1))
    hub = Hub(
        node,
        node_id="node-c",
        profile=config.profile,
        token=TOKEN,
        replay_capacity=1 << 20,
        slack_sample_ms=250,
        get_time_ns=node_clock(node, origin_ns),
    )
    hub.attach()
    hello = hub.hello()
    hub.node.advance(RUN_S)
    return [hello, *hub.replay.since(0).events]


def build_staged_store(path: Path) -> Path:
    """A store with node-b (PAB dispatch: no stages, no slack samples) and node-c (staged, sampled)."""
    with StoreWriter(path) as writer:
        writer.write(node_b_events())
        writer.write(node_c_events())
        writer.flush()
    return path


def build_snapshot_store(path: Path) -> Path:
    """All three nodes (node-a, node-b, node-c: every screen has something to show) with their node time 0 at
    :data:`SNAPSHOT_ORIGIN_NS`: the same store, byte for byte in its events, on every run."""
    with StoreWriter(path) as writer:
        for events in (node_a_events, node_b_events, node_c_events):
            writer.write(events(SNAPSHOT_ORIGIN_NS))
        writer.flush()
    return path
