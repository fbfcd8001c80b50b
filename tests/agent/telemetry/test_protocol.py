"""The wire protocol: every event, command and reply round-trips through both codecs; converters; codec errors."""

from __future__ import annotations

import math
from typing import Any, get_args

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.engine.base import RequestOutcome, StepRecord
from agent.runtime.events import (
    NodeOrigin,
    param_schema,
    policy_schemas,
    request_finished,
    step_event,
    unit_load_event,
    wire_reasons,
)
from agent.telemetry import (
    CODECS,
    CONTROL_KINDS,
    EVENT_KINDS,
    JSON,
    MSGPACK,
    AgentFrame,
    Alert,
    AlertCode,
    Codec,
    ControlRequest,
    ErrorCode,
    ErrorReply,
    Event,
    EventBatch,
    OkReply,
    PolicyList,
    ProtocolError,
    Reply,
    RequestFinished,
    StepEvent,
)
from policies.params import ParamSpec
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES
from policies.types import ReasonValue, StepMode, UnitLoad

INT64 = (-(2**63), 2**63 - 1)
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)


def strategy(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values of a msgspec type (as ``msgspec.inspect`` describes it), for every type the protocol uses."""
    if isinstance(t, mi.IntType):
        lo = INT64[0] if t.ge is None else t.ge
        return st.integers(lo, INT64[1] if t.le is None else t.le)
    if isinstance(t, mi.FloatType):
        return FLOATS
    if isinstance(t, mi.StrType):
        if t.min_length:  # a bounded text (post_alert's message): within its bounds
            return st.text(st.characters(exclude_categories=["Cs"]), min_size=t.min_length, max_size=12)
        return TEXT
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.EnumType):
        return st.sampled_from(list(t.cls))
    if isinstance(t, mi.UnionType):
        return st.one_of(*(strategy(u) for u in t.types))
    if isinstance(t, mi.VarTupleType):
        return st.lists(strategy(t.item_type), max_size=4).map(tuple)
    if isinstance(t, mi.DictType):
        return st.dictionaries(strategy(t.key_type), strategy(t.value_type), min_size=t.min_length or 0, max_size=6)
    if isinstance(t, mi.StructType):
        return st.fixed_dictionaries({f.name: strategy(f.type) for f in t.fields}).map(lambda kw: t.cls(**kw))
    raise TypeError(f"no strategy for {t!r}: extend the test with the new wire type")


def members(union: object) -> list[type[msgspec.Struct]]:
    return list(get_args(union))


def assert_same(a: object, b: object) -> None:
    """Equal, and of the same types all the way down (``True == 1`` and ``1.0 == 1`` do not count)."""
    assert a == b
    assert repr(a) == repr(b)


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize("cls", members(Event), ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_event_round_trips(fmt: str, cls: type[msgspec.Struct], data: st.DataObject) -> None:
    codec = CODECS[fmt]  # type: ignore[index]
    event = data.draw(strategy(mi.type_info(cls)))
    frame = codec.encode(event)
    assert_same(codec.decode_event(frame), event)
    assert_same(codec.decode_agent_frame(frame), event)


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize("cls", members(ControlRequest) + members(Reply), ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_command_and_reply_round_trips(fmt: str, cls: type[msgspec.Struct], data: st.DataObject) -> None:
    codec = CODECS[fmt]  # type: ignore[index]
    message = data.draw(strategy(mi.type_info(cls)))
    frame = codec.encode(message)
    decoded = codec.decode_request(frame) if cls in members(ControlRequest) else codec.decode_agent_frame(frame)
    assert_same(decoded, message)


def test_kinds_are_unique_and_complete() -> None:
    kinds = [c.__struct_config__.tag for c in members(AgentFrame)]
    assert len(kinds) == len(set(kinds)) == len(EVENT_KINDS) + 3  # and batch, ok, error
    assert len(CONTROL_KINDS) == len(members(ControlRequest)) == 13
    assert not CONTROL_KINDS & EVENT_KINDS


REASONS = st.dictionaries(TEXT, st.one_of(st.integers(*INT64), FLOATS, TEXT, st.booleans()), max_size=8)


@given(reasons=REASONS)
@settings(max_examples=200)
def test_reasons_keep_their_types_in_both_codecs(reasons: dict[str, int | float | str | bool]) -> None:
    event = make_step_event(reasons)
    for codec in (MSGPACK, JSON):
        back = codec.decode_event(codec.encode(event))
        assert isinstance(back, StepEvent)
        assert [(k, type(v), v) for k, v in back.reasons.items()] == [(k, type(v), v) for k, v in reasons.items()]


def make_step_event(reasons: dict[str, int | float | str | bool]) -> StepEvent:
    return StepEvent(
        seq=7, node_id="n0", time_ns=1_700_000_000_000_000_000, unit_id=1, step_id=42, measured_ns=12_500_000,
        predicted_ns=12_000_000, mode=StepMode.MIXED, policy="sarathi", num_prefill_tokens=1500,
        num_decode_tokens=48, num_prefill_reqs=2, num_decode_reqs=48, context_tokens=65_000, budget_tokens=2048,
        kv_used_blocks=4000, num_blocks=10_000, num_running=50, num_waiting=3, num_preempted=0, num_finished=1,
        reasons=reasons,
    )


# -- converters ----------------------------------------------------------------------------------------------
ORIGIN = NodeOrigin("node-a", 1_700_000_000_000_000_000)


def test_step_record_converts_with_wall_clock_times() -> None:
    record = StepRecord(
        unit_id=3, step_id=17, start_s=2.5, duration_s=0.0125, predicted_s=0.012, mode=StepMode.DECODE,
        policy="fairbatching", num_prefill_tokens=0, num_decode_tokens=64, num_prefill_reqs=0, num_decode_reqs=64,
        context_tokens=90_000, budget_tokens=512, kv_used_blocks=6000, num_blocks=8000, num_running=64,
        num_waiting=5, num_preempted=1, num_finished=2,
        reasons={"min_slack_ms": 3.25, "urgent": True, "n": 7, "by": "time", "r_adv": math.inf, "x": -math.inf,
                 "y": math.nan},
    )
    ev = step_event(record, ORIGIN)
    assert ev.seq == 0 and ev.node_id == "node-a"
    assert ev.time_ns == 1_700_000_002_500_000_000
    assert (ev.unit_id, ev.step_id, ev.measured_ns, ev.predicted_ns) == (3, 17, 12_500_000, 12_000_000)
    assert ev.mode is StepMode.DECODE and ev.policy == "fairbatching"
    assert (ev.num_decode_tokens, ev.num_decode_reqs, ev.context_tokens, ev.budget_tokens) == (64, 64, 90_000, 512)
    assert (ev.kv_used_blocks, ev.num_blocks, ev.num_running, ev.num_waiting) == (6000, 8000, 64, 5)
    assert (ev.num_preempted, ev.num_finished) == (1, 2)
    assert ev.reasons == {"min_slack_ms": 3.25, "urgent": True, "n": 7, "by": "time", "r_adv": "inf", "x": "-inf",
                          "y": "nan"}
    for codec in (MSGPACK, JSON):  # non-finite floats would not survive JSON; their strings do
        assert_same(codec.decode_event(codec.encode(ev)), ev)


def test_wire_reasons_leaves_finite_values_alone() -> None:
    reasons: dict[str, ReasonValue] = {"a": 1, "b": 1.5, "c": "s", "d": False}
    assert_same(wire_reasons(reasons), reasons)
    assert wire_reasons(reasons) is not reasons


def test_wire_reasons_turns_numpy_scalars_into_python_values() -> None:
    reasons = {"f": np.float64(1.5), "i": np.int64(3), "b": np.bool_(True), "inf": np.float64(np.inf), "s": "x"}
    out = wire_reasons(reasons)  # type: ignore[arg-type]
    assert_same(out, {"f": 1.5, "i": 3, "b": True, "inf": "inf", "s": "x"})
    assert_same(MSGPACK.decode_event(MSGPACK.encode(make_step_event(out))), make_step_event(out))


def test_request_outcome_converts_with_ttft_and_tpot() -> None:
    outcome = RequestOutcome(
        request_id="r1", unit_id=2, arrival_s=1.0, first_token_s=1.25, finish_s=2.25, prompt_tokens=900,
        output_tokens=11, num_preemptions=1, ttft_slo_s=0.5, tpot_slo_s=0.05,
    )
    ev = request_finished(outcome, ORIGIN)
    assert (ev.arrival_ns, ev.first_token_ns, ev.time_ns) == (
        ORIGIN.origin_ns + 1_000_000_000, ORIGIN.origin_ns + 1_250_000_000, ORIGIN.origin_ns + 2_250_000_000,
    )
    assert ev.ttft_ms == pytest.approx(250.0) and ev.tpot_ms == pytest.approx(100.0)
    assert (ev.ttft_slo_ms, ev.tpot_slo_ms) == (500.0, 50.0)
    assert ev.met_slo is False  # TPOT 100 ms over a 50 ms SLO
    assert (ev.request_id, ev.unit_id, ev.prompt_tokens, ev.output_tokens, ev.num_preemptions) == ("r1", 2, 900, 11, 1)
    single = request_finished(
        RequestOutcome("r2", 0, 0.0, 0.1, 0.1, 10, 1, 0, ttft_slo_s=1.0, tpot_slo_s=0.1), ORIGIN
    )
    assert single.tpot_ms is None and single.met_slo is True
    assert ev.max_tpot_ms == pytest.approx(100.0)  # built by hand, nothing tracked its worst: the mean stands in
    assert single.max_tpot_ms is None


def test_the_worst_per_token_tpot_goes_on_the_wire_and_decides_met_slo() -> None:
    # A mean TPOT of 40 ms, but one token 120 ms late on the running mean: seed 003's metric misses 50 ms.
    outcome = RequestOutcome("r1", 0, 1.0, 1.1, 1.5, 100, 11, 0, ttft_slo_s=0.5, tpot_slo_s=0.05, max_tpot_s=0.12)
    ev = request_finished(outcome, ORIGIN)
    assert ev.tpot_ms == pytest.approx(40.0) and ev.max_tpot_ms == pytest.approx(120.0)
    assert ev.met_slo is False and outcome.meets_slo("mean")
    for codec in CODECS.values():
        assert codec.decode_event(codec.encode(ev)) == ev


def test_a_request_finished_frame_from_an_older_agent_decodes_without_the_worst_tpot() -> None:
    ev = request_finished(RequestOutcome("r1", 0, 1.0, 1.1, 1.5, 100, 11, 0, ttft_slo_s=0.5, tpot_slo_s=0.05,
                                         max_tpot_s=0.03), ORIGIN)
    for codec, decode, encode in ((JSON, msgspec.json.decode, msgspec.json.encode),
                                  (MSGPACK, msgspec.msgpack.decode, msgspec.msgpack.encode)):
        raw = decode(codec.encode(ev))
        del raw["max_tpot_ms"]  # the frame as an agent before the field wrote it
        old = codec.decode_event(encode(raw))
        assert isinstance(old, RequestFinished) and old.max_tpot_ms is None
        assert old == msgspec.structs.replace(ev, max_tpot_ms=None)


def test_unit_load_converts() -> None:
    load = UnitLoad(
        unit_id=1, healthy=True, num_running=12, num_waiting=4, kv_used_blocks=300, num_blocks=1000, kv_tokens=4800,
        queued_prefill_tokens=2048, last_step_s=0.015, mean_step_s=None, prefill_admission_budget=1234.5,
        max_num_seqs=256,
    )
    ev = unit_load_event(load, ORIGIN, now_s=10.0, dispatch_id=99)
    assert ev.time_ns == ORIGIN.origin_ns + 10_000_000_000 and ev.dispatch_id == 99
    assert (ev.num_running, ev.num_waiting, ev.kv_used_blocks, ev.num_blocks, ev.kv_tokens) == (12, 4, 300, 1000, 4800)
    assert (ev.queued_prefill_tokens, ev.max_num_seqs, ev.pab_tokens) == (2048, 256, 1234.5)
    assert (ev.last_step_ns, ev.mean_step_ns) == (15_000_000, None)


def test_param_spec_converts_every_field() -> None:
    spec = ParamSpec("chunk", "int", 512, "chunk size", unit="tokens", min=16, max=8192, choices=(), live=False)
    schema = param_schema(spec)
    for name in ("name", "type", "default", "help", "unit", "min", "max", "choices", "live"):
        assert getattr(schema, name) == getattr(spec, name), name


def test_registry_schemas_round_trip() -> None:
    for registry in (BATCH_POLICIES, DISPATCH_POLICIES):
        schemas = policy_schemas(registry.values())
        assert [s.name for s in schemas] == sorted(registry)
        for schema in schemas:
            specs = registry[schema.name].params_schema
            assert [p.name for p in schema.params] == [s.name for s in specs]
            assert [p.default for p in schema.params] == [s.default for s in specs]
        reply = OkReply(control_id="c1", payload=PolicyList(batch_policies=schemas, dispatch_policies=()))
        for codec in (MSGPACK, JSON):
            assert_same(codec.decode_agent_frame(codec.encode(reply)), reply)


# -- codec errors --------------------------------------------------------------------------------------------
def error_code(decode: Any, frame: bytes | str) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    return info.value.code


def test_oversized_frames_are_refused_before_decoding() -> None:
    small = Codec("json", max_frame_bytes=64)
    frame = JSON.encode(make_step_event({}))
    assert len(frame) > 64
    assert error_code(small.decode_event, frame) is ErrorCode.FRAME_TOO_LARGE
    assert JSON.decode_event(frame) == make_step_event({})


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"\xc1", ErrorCode.MALFORMED_FRAME),  # a byte MessagePack never uses
        (b"\x91" * 100_000 + b"\xc0", ErrorCode.MALFORMED_FRAME),  # nested too deeply
        (b"\x93\x01\x02\x03", ErrorCode.NOT_AN_OBJECT),
        (msgspec.msgpack.encode({"kind": "nope"}), ErrorCode.UNKNOWN_KIND),
        (msgspec.msgpack.encode({"node_id": "n"}), ErrorCode.UNKNOWN_KIND),
        (msgspec.msgpack.encode({"kind": "step", "node_id": "n"}), ErrorCode.INVALID_FIELD),
        ("{}", ErrorCode.MALFORMED_FRAME),  # a text frame
    ],
)
def test_msgpack_event_decode_errors(frame: bytes | str, code: ErrorCode) -> None:
    assert error_code(MSGPACK.decode_event, frame) is code


def test_events_ignore_unknown_fields_from_newer_agents() -> None:
    raw = msgspec.json.decode(JSON.encode(make_step_event({"a": 1})))
    raw["gpu_temperature_c"] = 71.5
    assert JSON.decode_event(msgspec.json.encode(raw)) == make_step_event({"a": 1})


def test_unknown_event_kind_from_a_newer_agent_is_a_clear_error() -> None:
    with pytest.raises(ProtocolError, match="unknown event kind 'hologram'") as info:
        JSON.decode_event(b'{"kind": "hologram", "seq": 1}')
    assert info.value.code is ErrorCode.UNKNOWN_KIND


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown format"):
        Codec("xml")  # type: ignore[arg-type]


def test_error_and_alert_codes_are_open_sets() -> None:
    """A newer agent may add codes: an older client still decodes the frame."""
    reply = JSON.decode_agent_frame(b'{"kind": "error", "code": "quota_exceeded", "message": "m"}')
    assert isinstance(reply, ErrorReply) and reply.code == "quota_exceeded"
    alert = JSON.decode_event(b'{"kind": "alert", "node_id": "n", "time_ns": 1, "code": "fan_failure", "message": "m"}')
    assert isinstance(alert, Alert) and alert.code == "fan_failure"
    back = JSON.decode_event(JSON.encode(msgspec.structs.replace(alert, code=AlertCode.GAP)))
    assert isinstance(back, Alert) and back.code == AlertCode.GAP


# -- batch frames --------------------------------------------------------------------------------------------
def numbered_steps(n: int, reasons: dict[str, int | float | str | bool] | None = None) -> list[StepEvent]:
    base = make_step_event(reasons or {"a": 1})
    return [msgspec.structs.replace(base, seq=i + 1, step_id=i) for i in range(n)]


@pytest.mark.parametrize("codec", [MSGPACK, JSON], ids=["msgpack", "json"])
@settings(max_examples=30, deadline=None)
@given(events=st.lists(st.sampled_from(numbered_steps(3)), min_size=1, max_size=40))
def test_a_batch_frame_decodes_as_the_batch_struct_encodes(codec: Codec, events: list[StepEvent]) -> None:
    frame, num = codec.encode_batch(events)
    assert num == len(events)
    decoded = codec.decode_agent_frame(frame)
    assert isinstance(decoded, EventBatch)
    assert_same(decoded, EventBatch(events=tuple(events)))
    assert_same(codec.decode_agent_frame(codec.encode(decoded)), decoded)


@pytest.mark.parametrize("codec", [MSGPACK, JSON], ids=["msgpack", "json"])
def test_a_batch_frame_holds_the_longest_prefix_under_the_size_cap(codec: Codec) -> None:
    events = numbered_steps(50, {f"reason_{i}": i * 0.5 for i in range(20)})
    one = len(codec.encode(events[0]))
    cap = 10 * one + 100
    frame, num = codec.encode_batch(events, max_bytes=cap)
    assert len(frame) <= cap and 8 <= num < 50
    assert len(codec.encode_batch(events[: num + 1], max_bytes=10**9)[0]) > cap, "one more event would not fit"
    batch = codec.decode_agent_frame(frame)
    assert isinstance(batch, EventBatch) and batch.events == tuple(events[:num])
    # the rest goes in the next frames, nothing lost or reordered; a single event over the cap still goes alone
    rest, _ = codec.encode_batch(events[num:], max_bytes=cap)
    assert [e.seq for e in codec.decode_agent_frame(rest).events][:1] == [num + 1]  # type: ignore[union-attr]
    alone, num_alone = codec.encode_batch(events, max_bytes=one // 2)
    assert num_alone == 1 and codec.decode_agent_frame(alone).events == (events[0],)  # type: ignore[union-attr]


def test_an_older_client_sees_a_batch_as_an_unknown_kind() -> None:
    """Why an agent sends batches only to subscribers that ask for them (``Subscribe.max_batch``)."""
    frame, _ = JSON.encode_batch(numbered_steps(2))
    with pytest.raises(ProtocolError, match="unknown event kind 'batch'"):
        JSON.decode_event(frame)
