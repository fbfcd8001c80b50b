"""The typed messages of a vLLM unit's channel (agent <-> our scheduler in the engine core): round trips, refusals,
and the inbox's handling of bad frames (no vLLM needed)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from agent.engine.base import StepRecord
from agent.engine.vllm.messages import (
    ControlReply,
    ControlRequest,
    EngineMessage,
    FrameError,
    Ping,
    SetParams,
    SetPolicy,
    StepMessage,
    decode_control,
    decode_engine,
    encode,
)
from policies.types import StepMode


def step(**changes: Any) -> StepMessage:
    fields: dict[str, Any] = dict(
        unit_id=2, step_id=7, start_s=1_764_000_000.25, duration_s=0.012, predicted_s=0.011, mode=StepMode.MIXED,
        policy="fairbatching", num_prefill_tokens=480, num_decode_tokens=32, num_prefill_reqs=1, num_decode_reqs=32,
        context_tokens=9000, budget_tokens=512, kv_used_blocks=600, num_blocks=1023, num_running=33, num_waiting=4,
        num_preempted=1, num_finished=2, reasons={"slack_s": 0.25, "why": "ttft", "held": 3, "urgent": True},
        preempted=("r1-1a2b3c4d",), plan_us=41.5, admission_budget=1234.5, queued_prefill_tokens=2048,
    )
    return StepMessage(**{**fields, **changes})


@pytest.mark.parametrize(
    "message",
    [
        SetPolicy(id="m1", name="sarathi", params={"token_budget": 64, "ratio": 0.5, "strict": True, "mode": "x"}),
        SetPolicy(id="m2", name="vllm"),
        SetParams(id="m3", changes={"token_budget": 32}),
        Ping(id="m4"),
    ],
)
def test_control_requests_round_trip(message: ControlRequest) -> None:
    frame = encode(message)
    assert decode_control(frame) == message
    wire = msgspec.msgpack.decode(frame)
    assert wire["op"] == type(message).__struct_config__.tag and wire["id"] == message.id


@pytest.mark.parametrize(
    "message",
    [
        step(),
        step(admission_budget=None, preempted=(), reasons={}, mode=StepMode.DECODE, dropped_before=12),
        ControlReply(unit_id=2, id="m1", ok=True, policy="sarathi", params={"token_budget": 64}),
        ControlReply(unit_id=2, id="m3", ok=True, old={"token_budget": 64}, params={"token_budget": 32}),
        ControlReply(unit_id=2, id="m5", ok=False, error="unknown batch policy 'nope'"),
    ],
)
def test_engine_messages_round_trip(message: EngineMessage) -> None:
    assert decode_engine(encode(message)) == message


def test_a_step_keeps_the_names_on_the_wire_and_makes_its_record() -> None:
    from agent.engine.vllm.unit import record_from

    msg = step()
    wire = msgspec.msgpack.decode(encode(msg))
    assert wire["kind"] == "step" and wire["mode"] == "mixed" and wire["preempted"] == ["r1-1a2b3c4d"]
    assert "dropped_before" not in wire, "defaults stay off the wire"
    record = record_from(decode_engine(encode(msg)))
    shared = set(StepRecord.__struct_fields__)
    assert {name: getattr(record, name) for name in shared} == {name: getattr(msg, name) for name in shared}


@pytest.mark.parametrize(
    ("wire", "mid", "match"),
    [
        ({"op": "reboot", "id": "a"}, "a", "Invalid value 'reboot'"),
        ({"id": "b", "name": "vllm"}, "b", "missing required field `op`"),
        ({"op": "set_policy", "id": "c"}, "c", "missing required field `name`"),
        ({"op": "set_params", "id": "d", "changes": {"token_budget": [1]}}, "d", "changes"),
        ({"op": "ping", "id": "e", "extra": 1}, "e", "unknown field `extra`"),
        ({"op": "ping", "id": 5}, None, "Expected `str`"),
        (["ping"], None, "Expected `object`"),
    ],
)
def test_a_bad_control_frame_is_refused_with_its_id(wire: Any, mid: str | None, match: str) -> None:
    with pytest.raises(FrameError, match=match) as info:
        decode_control(msgspec.msgpack.encode(wire))
    assert info.value.id == mid


def test_malformed_frames_are_refused() -> None:
    with pytest.raises(FrameError, match="malformed") as info:
        decode_control(b"\xc1")
    assert info.value.id is None
    with pytest.raises(FrameError, match="truncated"):
        decode_engine(encode(step())[:-3])


def test_an_unknown_kind_or_field_from_the_engine_is_refused() -> None:
    wire = msgspec.msgpack.decode(encode(step()))
    with pytest.raises(FrameError, match="Invalid value 'stats'"):
        decode_engine(msgspec.msgpack.encode({**wire, "kind": "stats"}))
    with pytest.raises(FrameError, match="unknown field `note`"):
        decode_engine(msgspec.msgpack.encode({**wire, "note": 1}))
    with pytest.raises(FrameError, match="step_id"):
        decode_engine(msgspec.msgpack.encode({k: v for k, v in wire.items() if k != "step_id"}))
    with pytest.raises(FrameError, match="missing required field `kind`"):
        decode_engine(encode(Ping(id="x")))


def test_the_inbox_hands_requests_and_refusals_in_order(tmp_path: Any) -> None:
    zmq = pytest.importorskip("zmq")
    from agent.engine.vllm.channel import ControlInbox, ControlSender

    addr = f"ipc://{tmp_path}/control"
    inbox = ControlInbox(addr)
    sender = ControlSender(addr)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(addr)
    try:
        got: list[ControlRequest | FrameError] = []
        deadline = time.monotonic() + 30

        def poll_until(num: int) -> None:
            nonlocal got
            while len(got) < num and time.monotonic() < deadline:
                got += inbox.poll()
                time.sleep(0.005)

        sender.send(SetPolicy(id="a", name="sarathi"))
        poll_until(1)  # two sockets: the first frame taken before the others are sent (a 50 ms sleep was a guess)
        raw.send(b"\xc1")
        raw.send(msgspec.msgpack.encode({"op": "reboot", "id": "b"}))
        poll_until(3)
        assert got[0] == SetPolicy(id="a", name="sarathi")
        assert [type(m) for m in got[1:]] == [FrameError, FrameError]
        assert [m.id for m in got[1:] if isinstance(m, FrameError)] == [None, "b"]
    finally:
        raw.close()
        sender.close()
        inbox.close()


def test_the_sink_carries_the_drop_count_on_the_next_message(tmp_path: Any) -> None:
    zmq = pytest.importorskip("zmq")
    from agent.engine.vllm.channel import ZmqSink

    addr = f"ipc://{tmp_path}/steps"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(addr)
    sink = ZmqSink(addr)
    try:
        sink.dropped = 3
        sink.emit(ControlReply(unit_id=1, id="a", ok=True))
        assert sink.dropped == 0
        assert pull.poll(5000)
        assert decode_engine(pull.recv()) == ControlReply(unit_id=1, id="a", ok=True, dropped_before=3)
    finally:
        sink.close()
        pull.close()
