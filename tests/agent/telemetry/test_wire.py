"""The Sans-I/O wire core: sequence numbers, replay and gaps, subscriptions, control parsing, tokens."""

from __future__ import annotations

import hmac
import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.telemetry import (
    JSON,
    MAX_FRAME_BYTES,
    MSGPACK,
    PROTOCOL_VERSION,
    Alert,
    AlertCode,
    ControlAudit,
    ControlRequest,
    DrainUnit,
    DryRun,
    ErrorCode,
    ErrorReply,
    Event,
    FailUnit,
    ListPolicies,
    NodeHello,
    PauseUnit,
    RecoverUnit,
    RequestArrived,
    RequestMigrated,
    ResumeUnit,
    SetBatchPolicy,
    SetDispatchPolicy,
    SetParams,
    Setting,
    Status,
    StepEvent,
    Subscribe,
)
from agent.telemetry.stream import ReplayBuffer, ResumeError, Sequencer, Subscription, parse_control, token_matches
from policies.types import StepMode

NOW_NS = 1_800_000_000_000_000_000


def clock() -> int:
    return NOW_NS


def step(unit_id: int = 0, step_id: int = 0, seq: int = 0) -> StepEvent:
    return StepEvent(
        seq=seq, node_id="n", time_ns=NOW_NS, unit_id=unit_id, step_id=step_id, measured_ns=1, predicted_ns=1,
        mode=StepMode.DECODE, policy="vllm", num_prefill_tokens=0, num_decode_tokens=1, num_prefill_reqs=0,
        num_decode_reqs=1, context_tokens=10, budget_tokens=2048, kv_used_blocks=1, num_blocks=10, num_running=1,
        num_waiting=0, num_preempted=0, num_finished=0,
    )


def stream(n: int, units: int = 1) -> list[StepEvent]:
    seq = Sequencer()
    return [seq.stamp(step(unit_id=i % units, step_id=i)) for i in range(n)]


# -- sequencer and replay buffer -----------------------------------------------------------------------------
def test_sequencer_numbers_copies_from_one() -> None:
    sequencer = Sequencer()
    original = step()
    stamped = [sequencer.stamp(original) for _ in range(3)]
    assert [e.seq for e in stamped] == [1, 2, 3] and sequencer.last_seq == 3
    assert original.seq == 0
    assert msgspec.structs.replace(stamped[0], seq=0) == original


def test_replay_without_a_gap() -> None:
    buffer = ReplayBuffer(8)
    events = stream(5)
    for e in events:
        buffer.append(e)
    assert (buffer.oldest_seq, buffer.last_seq, len(buffer)) == (1, 5, 5)
    replay = buffer.since(2)
    assert replay.gap is None and replay.events == tuple(events[2:])
    assert buffer.since(0).events == tuple(events)
    assert buffer.since(5).events == () and buffer.since(5).gap is None


def test_replay_announces_a_gap_once_the_ring_wrapped() -> None:
    buffer = ReplayBuffer(4)
    events = stream(10)
    for e in events:
        buffer.append(e)
    assert (buffer.oldest_seq, buffer.last_seq, len(buffer)) == (7, 10, 4)
    replay = buffer.since(3)
    assert replay.gap == (4, 6)
    assert [e.seq for e in replay.events] == [7, 8, 9, 10]
    assert buffer.since(6).gap is None and [e.seq for e in buffer.since(6).events] == [7, 8, 9, 10]


@pytest.mark.parametrize("after", [11, -1])
def test_replay_refuses_positions_outside_the_stream(after: int) -> None:
    buffer = ReplayBuffer(4)
    for e in stream(10):
        buffer.append(e)
    with pytest.raises(ResumeError) as info:
        buffer.since(after)
    assert info.value.code is ErrorCode.BAD_RESUME_SEQ


def test_replay_buffer_needs_consecutive_numbers() -> None:
    buffer = ReplayBuffer(4)
    buffer.append(step(seq=1))
    with pytest.raises(ValueError, match="expected seq 2"):
        buffer.append(step(seq=3))
    empty = ReplayBuffer(4)
    assert (empty.oldest_seq, empty.last_seq, empty.since(0).events) == (1, 0, ())


# -- subscriptions -------------------------------------------------------------------------------------------
def test_filters_by_unit_and_kind_and_let_node_events_through() -> None:
    sub = Subscription("n", unit_ids={1}, kinds={"step", "hello", "request_migrated", "audit"})
    hello = NodeHello(node_id="n", time_ns=0, boot_ns=0, profile="p", units=(), dispatch_policy="round_robin")
    change = ControlAudit(
        node_id="n", time_ns=0, actor="op", action="set_batch_policy", unit_ids=(0, 1),
        old=(Setting(unit_id=0, policy="vllm"), Setting(unit_id=1, policy="eb")),
        new=(Setting(unit_id=0, policy="sarathi"), Setting(unit_id=1, policy="sarathi")), result="applied",
    )
    assert sub.wants(step(unit_id=1)) and not sub.wants(step(unit_id=2))
    assert sub.wants(hello)
    assert not sub.wants(RequestArrived(node_id="n", time_ns=0, request_id="r", prompt_tokens=1, ttft_slo_ms=1,
                                        tpot_slo_ms=1))
    assert sub.wants(RequestMigrated(node_id="n", time_ns=0, request_id="r", from_unit_id=1, unit_id=3))
    assert sub.wants(RequestMigrated(node_id="n", time_ns=0, request_id="r", from_unit_id=3, unit_id=1))
    assert not sub.wants(RequestMigrated(node_id="n", time_ns=0, request_id="r", from_unit_id=3, unit_id=4))
    assert sub.wants(change) and not sub.wants(msgspec.structs.replace(change, unit_ids=(2,)))
    assert sub.offer(step(unit_id=1)) and not sub.offer(step(unit_id=2))
    assert len(sub) == 1
    everything = Subscription("n")
    assert all(everything.wants(e) for e in (hello, change, step(unit_id=9)))


def test_unknown_kinds_are_refused_at_subscription() -> None:
    with pytest.raises(ValueError, match="unknown event kinds: stp"):
        Subscription("n", kinds={"stp"})


def drain(sub: Subscription) -> list[Event]:
    out = []
    while (frame := sub.pop()) is not None:
        out.append(frame)
    return out


def test_a_slow_subscriber_drops_the_oldest_and_announces_once() -> None:
    sub = Subscription("n", max_queued=3, get_time_ns=clock)
    events = stream(10)
    assert all(sub.offer(e) for e in events)  # never refuses, never blocks
    assert len(sub) == 4 and sub.num_dropped == 7  # 3 queued + 1 pending announcement
    frames = drain(sub)
    alert = frames[0]
    assert isinstance(alert, Alert) and alert.code is AlertCode.FLOW_CONTROL
    assert (alert.num_dropped, alert.first_seq, alert.last_seq, alert.seq, alert.time_ns) == (7, 1, 7, 0, NOW_NS)
    assert frames[1:] == events[7:]
    # once announced, the next drops start a new announcement
    more = stream(15)[10:]
    for e in more:
        sub.offer(e)
    frames = drain(sub)
    assert isinstance(frames[0], Alert) and (frames[0].num_dropped, frames[0].first_seq, frames[0].last_seq) == (
        2, 11, 12,
    )
    assert frames[1:] == more[2:] and sub.num_dropped == 9 and sub.num_delivered == 6


def test_a_stuck_subscriber_stays_bounded() -> None:
    sub = Subscription("n", max_queued=100)
    seq = Sequencer()
    for i in range(100_000):
        sub.offer(seq.stamp(step(step_id=i)))
    assert len(sub) == 101 and sub.num_dropped == 99_900


@given(
    ops=st.lists(st.one_of(st.integers(0, 3), st.just("pop")), max_size=300),
    max_queued=st.integers(1, 8),
)
@settings(max_examples=300)
def test_every_wanted_event_is_delivered_or_announced_once_in_order(ops: list[int | str], max_queued: int) -> None:
    sub = Subscription("n", unit_ids={0, 1}, max_queued=max_queued, get_time_ns=clock)
    seq = Sequencer()
    wanted: list[int] = []
    frames: list[Event] = []
    for op in ops:
        if op == "pop":
            frame = sub.pop()
            if frame is not None:
                frames.append(frame)
        else:
            event = seq.stamp(step(unit_id=int(op)))
            if sub.offer(event):
                wanted.append(event.seq)
            assert len(sub) <= max_queued + 1
    frames.extend(drain(sub))
    accounted: list[int] = []
    for frame in frames:
        if isinstance(frame, Alert):
            assert frame.num_dropped == frame.last_seq - frame.first_seq + 1 - sum(
                1 for s in range(frame.first_seq, frame.last_seq + 1) if s not in wanted
            )
            accounted.extend(s for s in range(frame.first_seq, frame.last_seq + 1) if s in wanted)
        else:
            accounted.append(frame.seq)
    assert accounted == wanted
    assert sub.num_dropped + sub.num_delivered == len(wanted)


@given(
    ops=st.lists(st.one_of(st.integers(0, 3), st.just("pop"), st.integers(1, 9).map(lambda n: ("many", n))),
                 max_size=200),
    max_queued=st.integers(1, 8),
)
@settings(max_examples=300)
def test_pop_many_gives_what_pop_would_in_the_same_order(ops: list[object], max_queued: int) -> None:
    one, many = (Subscription("n", unit_ids={0, 1}, max_queued=max_queued, get_time_ns=clock) for _ in range(2))
    seq = Sequencer()
    by_one: list[Event] = []
    by_many: list[Event] = []
    for op in ops:
        if isinstance(op, tuple):
            limit = op[1]
            frames = many.pop_many(limit)
            assert len(frames) <= limit
            by_many.extend(frames)
            for _ in range(limit):
                if (frame := one.pop()) is not None:
                    by_one.append(frame)
        elif op == "pop":
            by_one.extend(f for f in [one.pop()] if f is not None)
            by_many.extend(many.pop_many(1))
        else:
            event = seq.stamp(step(unit_id=int(op)))  # type: ignore[call-overload]
            one.offer(event)
            many.offer(event)
    assert by_many == by_one
    assert (many.num_delivered, many.num_dropped, len(many)) == (one.num_delivered, one.num_dropped, len(one))


def test_resume_queues_a_gap_notice_then_the_buffered_events() -> None:
    buffer = ReplayBuffer(4)
    for e in stream(10, units=2):
        buffer.append(e)
    sub = Subscription.from_request(Subscribe(unit_ids=(1,), resume_after_seq=2), "n", get_time_ns=clock)
    sub.resume(buffer.since(2))
    frames = drain(sub)
    gap = frames[0]
    assert isinstance(gap, Alert) and gap.code is AlertCode.GAP and (gap.first_seq, gap.last_seq) == (3, 6)
    assert [f.seq for f in frames[1:]] == [8, 10]  # unit 1 only
    fresh = Subscription("n")
    fresh.resume(buffer.since(8))
    assert [f.seq for f in drain(fresh)] == [9, 10]


# -- control parsing -----------------------------------------------------------------------------------------
VALID: list[ControlRequest] = [
    Status(control_id="c1"),
    ListPolicies(),
    SetBatchPolicy(policy="sarathi", params={"chunk_tokens": 512, "x": 0.5, "y": True, "z": "s"}, unit_ids=(0, 2),
                   token="t"),
    SetDispatchPolicy(policy="least_loaded"),
    SetParams(target="batch", params={"time_budget_ms": 40.0}),
    DryRun(change=SetParams(target="dispatch", params={"a": 1})),
    PauseUnit(unit_id=1),
    DrainUnit(unit_id=1),
    ResumeUnit(unit_id=1),
    FailUnit(unit_id=1, reason="maintenance"),
    RecoverUnit(unit_id=1),
    Subscribe(unit_ids=(0,), kinds=("step", "alert"), resume_after_seq=41),
    Subscribe(resume_after_seq=41, resume_boot_ns=1_800_000_000_000_000_000, max_batch=512),
]


@pytest.mark.parametrize("request_", VALID, ids=lambda r: type(r).__name__)
def test_valid_commands_parse_in_both_formats(request_: ControlRequest) -> None:
    assert parse_control(JSON.encode(request_)) == request_
    assert parse_control(JSON.encode(request_).decode()) == request_
    assert parse_control(MSGPACK.encode(request_), fmt="msgpack") == request_


def test_only_read_only_commands_skip_the_token() -> None:
    assert {type(r).__name__ for r in VALID if not r.needs_token} == {"Status", "ListPolicies", "Subscribe"}


BAD = [
    (b"x" * (MAX_FRAME_BYTES + 1), ErrorCode.FRAME_TOO_LARGE),
    (b'{"kind": "status"', ErrorCode.MALFORMED_FRAME),
    (b"\xff\xfe", ErrorCode.MALFORMED_FRAME),
    (b"[" * 50_000 + b"]" * 50_000, ErrorCode.MALFORMED_FRAME),
    (b"[1, 2]", ErrorCode.NOT_AN_OBJECT),
    (b'"status"', ErrorCode.NOT_AN_OBJECT),
    (b"{}", ErrorCode.UNKNOWN_KIND),
    (b'{"kind": 3}', ErrorCode.UNKNOWN_KIND),
    (b'{"kind": "reboot"}', ErrorCode.UNKNOWN_KIND),
    (b'{"kind": "step"}', ErrorCode.UNKNOWN_KIND),  # an event is not a command
    (b'{"kind": "pause_unit"}', ErrorCode.INVALID_FIELD),  # missing unit_id
    (b'{"kind": "pause_unit", "unit_id": "1"}', ErrorCode.INVALID_FIELD),
    (b'{"kind": "pause_unit", "unit_id": -1}', ErrorCode.INVALID_FIELD),
    (b'{"kind": "pause_unit", "unit": 1}', ErrorCode.INVALID_FIELD),  # unknown field
    (b'{"kind": "set_params", "target": "batch", "params": {}}', ErrorCode.INVALID_FIELD),
    (b'{"kind": "set_params", "target": "engine", "params": {"a": 1}}', ErrorCode.INVALID_FIELD),
    (b'{"kind": "set_batch_policy", "policy": "eb", "params": {"a": [1]}}', ErrorCode.INVALID_FIELD),
    (b'{"kind": "dry_run", "change": {"kind": "pause_unit", "unit_id": 1}}', ErrorCode.INVALID_FIELD),
    (b'{"kind": "subscribe", "protocol_version": 999}', ErrorCode.UNSUPPORTED_VERSION),
    (b'{"kind": "subscribe", "kinds": ["step", "stepp"]}', ErrorCode.UNKNOWN_EVENT_KIND),
    (b'{"kind": "subscribe", "resume_after_seq": -5}', ErrorCode.INVALID_FIELD),
]


@pytest.mark.parametrize(("frame", "code"), BAD, ids=[f"{c.value}-{i}" for i, (_, c) in enumerate(BAD)])
def test_every_bad_command_gets_a_specific_error(frame: bytes, code: ErrorCode) -> None:
    reply = parse_control(frame)
    assert isinstance(reply, ErrorReply) and reply.code is code, reply
    assert reply.message
    JSON.decode_agent_frame(JSON.encode(reply))  # the reply itself is sendable


def test_msgpack_specific_errors() -> None:
    assert parse_control('{"kind": "status"}', fmt="msgpack") == ErrorReply(
        code=ErrorCode.MALFORMED_FRAME, message="a MessagePack command frame must be binary, got text"
    )
    reply = parse_control(msgspec.msgpack.encode({"kind": "pause_unit", "unit_id": 1.5}), fmt="msgpack")
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.INVALID_FIELD and "unit_id" in reply.message
    reply = parse_control(b"\x81\xa4kind\xa2\xff\xfe", fmt="msgpack")  # invalid UTF-8 in a str
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.MALFORMED_FRAME


def test_errors_echo_the_control_id_when_one_can_be_read() -> None:
    reply = parse_control(b'{"kind": "pause_unit", "unit_id": "x", "control_id": "abc"}')
    assert isinstance(reply, ErrorReply) and reply.control_id == "abc"
    reply = parse_control(b'{"kind": "subscribe", "protocol_version": 0, "control_id": "v"}')
    assert isinstance(reply, ErrorReply) and reply.control_id == "v"
    reply = parse_control(b'{"kind": "subscribe", "control_id": 7}')
    assert isinstance(reply, ErrorReply) and reply.control_id == ""


@given(frame=st.one_of(st.binary(max_size=64), st.text(max_size=64)))
@settings(max_examples=500)
def test_parse_control_never_raises(frame: bytes | str) -> None:
    for fmt in ("json", "msgpack"):
        result = parse_control(frame, fmt=fmt)
        assert not isinstance(result, ErrorReply) or result.message
        MSGPACK.encode(result)  # whatever came back can be sent


@given(base=st.sampled_from([JSON.encode(r) for r in VALID]), data=st.data())
@settings(max_examples=300)
def test_corrupted_commands_never_raise(base: bytes, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(base) - 1))
    b = data.draw(st.integers(0, 255))
    for frame in (base[:i] + bytes([b]) + base[i + 1 :], base[:i]):
        JSON.encode(parse_control(frame))


def test_version_1_subscribers_are_served_without_the_version_2_fields() -> None:
    old = parse_control(b'{"kind": "subscribe", "protocol_version": 1, "resume_after_seq": 5}')
    assert isinstance(old, Subscribe) and old.max_batch == 1 and old.resume_boot_ns is None
    for field in ('"max_batch": 64', '"resume_boot_ns": 7'):
        reply = parse_control(f'{{"kind": "subscribe", "protocol_version": 1, {field}}}'.encode())
        assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.INVALID_FIELD and "protocol_version 2" in (
            reply.message)
    reply = parse_control(b'{"kind": "subscribe", "protocol_version": 3}')
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.UNSUPPORTED_VERSION
    assert reply.message == "this agent speaks protocol 1 to 2, not 3"
    reply = parse_control(b'{"kind": "subscribe", "max_batch": 0}')
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.INVALID_FIELD


def test_subscribe_defaults_to_this_version_and_everything() -> None:
    sub = parse_control(b'{"kind": "subscribe"}')
    assert sub == Subscribe() and isinstance(sub, Subscribe)
    assert (sub.protocol_version, sub.unit_ids, sub.kinds, sub.resume_after_seq) == (PROTOCOL_VERSION, None, None, None)
    assert (sub.max_batch, sub.resume_boot_ns) == (1, None)  # one event per frame unless asked


# -- tokens --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given_", "expected", "ok"),
    [
        ("s3cret", "s3cret", True),
        ("s3cret", "s3cres", False),
        ("s3cre", "s3cret", False),
        ("", "s3cret", False),
        ("", "", False),  # no token configured: control is off
        ("anything", "", False),
        ("clé-ü", "clé-ü", True),
    ],
)
def test_token_matches(given_: str, expected: str, ok: bool) -> None:
    assert token_matches(given_, expected) is ok


def test_token_check_uses_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = itertools.count()
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        next(calls)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert token_matches("a", "a") and next(calls) == 1


def test_stamp_new_numbers_in_place_and_continues_the_sequence() -> None:
    sequencer = Sequencer()
    first = sequencer.stamp(step())
    fresh = step()
    second = sequencer.stamp_new(fresh)
    assert second is fresh and (first.seq, second.seq) == (1, 2)
    assert sequencer.stamp(step()).seq == 3 and sequencer.last_seq == 3


def test_a_request_sent_back_by_a_fault_concerns_only_its_old_unit() -> None:
    from agent.telemetry import RequestMigrated
    from agent.telemetry.stream import event_unit_ids

    back = RequestMigrated(node_id="n", time_ns=1, request_id="r", from_unit_id=2, unit_id=None, reason="fault:lost")
    moved = RequestMigrated(node_id="n", time_ns=1, request_id="r", from_unit_id=2, unit_id=3, reason="rebalance:live")
    assert event_unit_ids(back) == (2,)
    assert event_unit_ids(moved) == (2, 3)
