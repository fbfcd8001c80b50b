"""The hub holds the node's events and publishes them in runs (``Hub.flush``), and keeps steps unbuilt while nobody
subscribes: what subscribers, resumes and the metrics see must be exactly what publishing each event at its hook
(``max_held=0`` with a subscriber) gives, numbers and order included."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
from serve_harness import TOKEN

from agent.bench.runner import BenchConfig
from agent.cli.serve import make_node
from agent.engine.base import StepRecord
from agent.runtime.node import Node
from agent.service.hub import Hub
from agent.telemetry import Event, OkReply, PauseUnit, ResumeUnit, SetBatchPolicy, StepEvent, Subscribe
from agent.telemetry.stream import ReplayBuffer, Sequencer, Subscription
from agent.workload.spec import parse_workload
from policies.types import StepMode

BOOT_NS = 10**18


def make(max_held: int, *, batch_policy: str = "vllm", dispatch: str = "least_loaded", capacity: int = 65536,
         max_queued: int = 1 << 20) -> Hub:
    config = BenchConfig(units=3, batch_policy=batch_policy, dispatch=dispatch)
    node = make_node(config, parse_workload("bursty:n=300", seed=3))
    hub = Hub(node, node_id="n", profile=config.profile, token=TOKEN, boot_ns=BOOT_NS, get_time_ns=lambda: BOOT_NS,
              max_held=max_held, replay_capacity=capacity, max_queued=max_queued, slack_sample_ms=100.0)
    hub.attach()
    return hub


def drain(sub: Subscription | None) -> list[Event]:
    assert sub is not None
    out: list[Event] = []
    while frames := sub.pop_many(7):
        out += frames
    return out


def wire(events: list[Event]) -> list[bytes]:
    return [msgspec.msgpack.encode(e) for e in events]


def times(hub: Hub) -> Iterator[float]:
    """The node's event times, a control action between two of them now and then."""
    node = hub.node
    assert isinstance(node, Node)
    for i in range(10**9):
        t = node.next_event_s()
        if t is None:
            return
        node.advance(t)
        yield t
        if i == 400:
            assert isinstance(hub.handle(PauseUnit(token=TOKEN, control_id="p", unit_id=1), who="t"), OkReply)
        if i == 900:
            assert isinstance(hub.handle(ResumeUnit(token=TOKEN, control_id="r", unit_id=1), who="t"), OkReply)
        if i == 1300:
            change = SetBatchPolicy(token=TOKEN, control_id="s", policy="sarathi", params={}, unit_ids=(0,))
            assert isinstance(hub.handle(change, who="t"), OkReply)


@pytest.mark.parametrize(("batch_policy", "dispatch"), [("vllm", "least_loaded"), ("fairbatching", "pab"),
                                                        ("eb", "cascade"), ("sarathi", "sbs")])
def test_subscribers_get_what_publishing_each_event_at_once_gives(batch_policy: str, dispatch: str) -> None:
    """Held (the default) and at once (``max_held=0``): the same frames, live, filtered, and read a few at a time
    between steps; the same replay and metrics."""
    hubs = [make(0, batch_policy=batch_policy, dispatch=dispatch), make(256, batch_policy=batch_policy,
                                                                        dispatch=dispatch)]
    got: list[dict[str, list[Event]]] = [{"all": [], "unit 1": [], "steps": []} for _ in hubs]
    for hub, out in zip(hubs, got, strict=True):
        subs = {"all": hub.subscribe(Subscribe(), lambda: None)[0],
                "unit 1": hub.subscribe(Subscribe(unit_ids=(1,), max_batch=64), lambda: None)[0],
                "steps": hub.subscribe(Subscribe(kinds=("step", "audit")), lambda: None)[0]}
        for i, _ in enumerate(times(hub)):
            if i % 5 == 0:  # read as a sender would, between steps
                for name, sub in subs.items():
                    out[name] += drain(sub)
        for name, sub in subs.items():
            out[name] += drain(sub)
    eager, held = got
    assert eager["all"] and any(isinstance(e, StepEvent) for e in eager["all"])
    for name in eager:
        assert wire(held[name]) == wire(eager[name]), name
        assert held[name] == eager[name], name
    assert [e.seq for e in eager["all"]] == list(range(1, hubs[0].sequencer.last_seq + 1))
    assert wire(list(hubs[1].replay.since(0).events)) == wire(list(hubs[0].replay.since(0).events))
    assert node_metrics(hubs[1]) == node_metrics(hubs[0])


def test_nobody_listening_builds_no_step_but_a_resume_gets_the_same_events() -> None:
    """With no subscriber the ring keeps the step records; a resume (from the start, and from the middle of a ring
    that wrapped) gets the events a subscriber present all along got."""
    eager = make(0, capacity=1500)
    live = eager.subscribe(Subscribe(), lambda: None)[0]
    quiet = make(256, capacity=1500)
    runs = {hub: times(hub) for hub in (eager, quiet)}
    for run in runs.values():
        for t in run:
            if t > 4.0:
                break
    assert any(isinstance(entry, StepRecord) for entry in quiet._replay._ring), "steps kept unbuilt"
    resumed = quiet.subscribe(Subscribe(resume_after_seq=0), lambda: None)[0]
    first = drain(resumed)
    position = quiet.sequencer.last_seq - 100
    late = quiet.subscribe(Subscribe(resume_after_seq=position, kinds=("step",)), lambda: None)[0]
    steps = drain(late)  # its resume, from the ring; then live
    for run in runs.values():
        for _ in run:
            pass
    expected = drain(live)
    gap = first.pop(0)
    assert (gap.seq, gap.code, gap.first_seq) == (0, "gap", 1), "the ring wrapped"  # type: ignore[union-attr]
    assert [e.seq for e in first] == list(range(gap.last_seq + 1, position + 101))  # type: ignore[union-attr]
    by_seq = {e.seq: e for e in expected}
    assert wire(first) == wire([by_seq[e.seq] for e in first])
    assert wire(steps + drain(late)) == wire([e for e in expected if isinstance(e, StepEvent) and e.seq > position])
    assert wire(list(quiet.replay.since(0).events)) == wire(list(eager.replay.since(0).events))
    assert resumed is not None
    quiet.unsubscribe(resumed)  # one subscriber each
    assert node_metrics(quiet) == node_metrics(eager)


def node_metrics(hub: Hub) -> list[str]:
    """The hub's exposition without the lines that measure this process (its loop thread's CPU time)."""
    return [line for line in hub.metrics_text().splitlines() if not line.startswith("trackside_event_loop_cpu")]


# -- the stream core ------------------------------------------------------------------------------------------
def step(seq: int = 0) -> StepEvent:
    return StepEvent(seq=seq, node_id="n", time_ns=1, unit_id=0, step_id=seq, measured_ns=1, predicted_ns=1,
                     mode=StepMode.DECODE, policy="vllm", num_prefill_tokens=0, num_decode_tokens=1,
                     num_prefill_reqs=0, num_decode_reqs=1, context_tokens=1, budget_tokens=1, kv_used_blocks=0,
                     num_blocks=1, num_running=1, num_waiting=0, num_preempted=0, num_finished=0)


def test_deferred_entries_become_their_events_once_when_read_and_wrap_like_events() -> None:
    built: list[int] = []

    def convert(entry: object, seq: int) -> Event:
        assert entry == ("deferred", seq)
        built.append(seq)
        return step(seq)

    buffer = ReplayBuffer(5, convert=convert)
    sequencer = Sequencer()
    buffer.append(sequencer.stamp_new(step()))
    first = sequencer.take(3)
    buffer.append_deferred([("deferred", first + k) for k in range(3)], first)
    assert (first, buffer.last_seq, len(buffer), built) == (2, 4, 4, [])
    assert [e.seq for e in buffer.since(0).events] == [1, 2, 3, 4] and built == [2, 3, 4]
    assert buffer.get(3) is buffer.get(3) and built == [2, 3, 4], "built once, then kept"
    first = sequencer.take(4)
    buffer.append_deferred([("deferred", first + k) for k in range(4)], first)  # wraps: 1..4 are gone
    buffer.append(sequencer.stamp_new(step()))
    assert (buffer.oldest_seq, buffer.last_seq) == (5, 9)
    assert [e.seq for e in buffer.read(5, 10)[0]] == [5, 6, 7, 8, 9] and built == [2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError):
        buffer.append_deferred([("deferred", 12)], 12)
    with pytest.raises(ValueError):
        ReplayBuffer(5).append_deferred([("deferred", 1)], 1)


@pytest.mark.parametrize("kinds", [None, ("step",), ("alert",)])
@pytest.mark.parametrize("max_queued", [3, 50])
def test_offer_many_queues_and_drops_as_offering_one_by_one(kinds: tuple[str, ...] | None, max_queued: int) -> None:
    one, many = (Subscription("n", kinds=kinds, max_queued=max_queued, get_time_ns=lambda: BOOT_NS) for _ in "ab")
    sequencer = Sequencer()
    for size in (1, 2, 10, 0, 4):
        events: list[Event] = [sequencer.stamp_new(step()) for _ in range(size)]
        took = [one.offer(e) for e in events]
        assert many.offer_many(events) == any(took)
        assert len(many) == len(one)
    assert many.num_dropped == one.num_dropped
    assert drain(many) == drain(one)
