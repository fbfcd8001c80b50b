"""A resume read from the shared replay buffer (``ReplayCursor``, ``Subscription.replay_from``), without sockets:
nothing copied per subscriber, nothing lost or repeated when it goes live, a gap when the ring overtook it."""

from __future__ import annotations

import pytest

from agent.telemetry import Alert, AlertCode, ErrorCode, Event, StepEvent
from agent.telemetry.stream import ReplayBuffer, ResumeError, Sequencer, Subscription
from policies.types import StepMode


def step(unit_id: int = 0) -> StepEvent:
    return StepEvent(node_id="n", time_ns=0, unit_id=unit_id, step_id=0, measured_ns=1, predicted_ns=1,
                     mode=StepMode.DECODE, policy="vllm", num_prefill_tokens=0, num_decode_tokens=1,
                     num_prefill_reqs=0, num_decode_reqs=1, context_tokens=1, budget_tokens=1, kv_used_blocks=0,
                     num_blocks=1, num_running=1, num_waiting=0, num_preempted=0, num_finished=0)


class Stream:
    """A hub's order of things: number, append to the buffer, then offer."""

    def __init__(self, capacity: int) -> None:
        self.sequencer = Sequencer()
        self.buffer = ReplayBuffer(capacity)
        self.subs: list[Subscription] = []

    def publish(self, n: int, units: int = 1) -> None:
        for i in range(n):
            event = self.sequencer.stamp(step(unit_id=i % units))
            self.buffer.append(event)
            for sub in self.subs:
                sub.offer(event)


def drain(sub: Subscription, batch: int = 3) -> list[Event]:
    out: list[Event] = []
    while frame := sub.pop_many(batch):
        out += frame
    return out


def test_the_ring_reads_any_buffered_position_and_wraps() -> None:
    stream = Stream(5)
    stream.publish(12)
    buffer = stream.buffer
    assert (buffer.oldest_seq, buffer.last_seq, len(buffer)) == (8, 12, 5)
    assert [buffer.get(s).seq for s in range(8, 13)] == [8, 9, 10, 11, 12]
    events, after = buffer.read(9, 10)
    assert [e.seq for e in events] == [9, 10, 11, 12] and after == 13, "across the ring's end"
    assert buffer.read(13, 4) == ([], 13)
    with pytest.raises(IndexError):
        buffer.get(7)


def test_a_resume_reads_the_buffer_as_it_is_sent_then_goes_live_without_a_loss_or_a_repeat() -> None:
    stream = Stream(1000)
    stream.publish(100)
    sub = Subscription("n", max_queued=4)  # a live queue far smaller than the resume
    stream.subs.append(sub)
    assert sub.replay_from(stream.buffer, 10) == 90
    assert sub.replaying and len(sub) == 90
    first = sub.pop_many(7)
    stream.publish(50)  # while it replays, live events stay in the buffer: nothing queued, nothing dropped
    assert sub.replaying and sub.num_dropped == 0
    rest = drain(sub)
    assert not sub.replaying, "caught up: live from now on"
    stream.publish(3)
    live = drain(sub)
    assert [e.seq for e in first + rest + live] == list(range(11, 154))
    assert sub.num_dropped == 0 and sub.num_delivered == 143


def test_a_resume_overtaken_by_the_ring_gets_a_gap_alert_and_carries_on() -> None:
    stream = Stream(8)
    stream.publish(8, units=2)
    sub = Subscription("n", unit_ids=(1,), max_batch=4)
    stream.subs.append(sub)
    assert sub.replay_from(stream.buffer, 0) == 4, "the filter counts: units 1 of 0, 1, 0, 1, ..."
    assert [e.seq for e in sub.pop_many(2)] == [2, 4]
    stream.publish(20, units=2)  # the ring (8 events) moves past the cursor's position
    gap, *events = drain(sub, batch=100)
    assert isinstance(gap, Alert) and gap.code is AlertCode.GAP and gap.seq == 0
    assert (gap.first_seq, gap.last_seq) == (5, 20)
    assert [e.seq for e in events] == [22, 24, 26, 28]


def test_a_resume_from_before_the_buffer_starts_with_the_gap_and_one_ahead_of_it_is_refused() -> None:
    stream = Stream(4)
    stream.publish(10)
    sub = Subscription("n")
    assert sub.replay_from(stream.buffer, 2) == 1 + 4, "the gap notice and 7..10"
    frames = drain(sub)
    assert isinstance(frames[0], Alert) and (frames[0].first_seq, frames[0].last_seq) == (3, 6)
    assert [e.seq for e in frames[1:]] == [7, 8, 9, 10]
    caught_up = Subscription("n")
    assert caught_up.replay_from(stream.buffer, 10) == 0 and not caught_up.replaying
    with pytest.raises(ResumeError) as info:
        Subscription("n").replay_from(stream.buffer, 11)
    assert info.value.code is ErrorCode.BAD_RESUME_SEQ
