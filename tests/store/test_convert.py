"""Events -> Arrow: the columnar conversion keeps every value (checked against a plain per-row reference and through a
file and back), whatever the chunking, the NULLs and the text in ``reasons``."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from test_store import NODE, T0, hello

from agent.telemetry import (
    Alert,
    Event,
    RequestArrived,
    RequestDispatched,
    RequestFirstToken,
    RequestMigrated,
    RequestPreempted,
    RequestRefused,
    StageBoundaries,
    StepEvent,
    UnitLoadEvent,
)
from policies.types import ReasonValue, StepMode
from store.convert import SCHEMAS, to_arrow
from store.replay import replay
from store.writer import CONVERT_ROWS, StoreWriter

BIG = 2**63 - 1
REASONS: tuple[dict[str, ReasonValue], ...] = (
    {},
    {"budget_tokens": 2048, "theta": 0.25, "limit": "inf", "greedy": True},
    {"line\nbreak": "a\nb\r\tc", 'quote"d': "back\\slash", "é": "ünïcödé ✓", "tiny": 1e-7, "neg": -BIG - 1},
    {"big": BIG, "off": False, "empty": "", "exp": 1.5e300, "zero": -0.0},
)


def varied_step(seq: int) -> StepEvent:
    """A step whose every field differs from its neighbours', with the extremes of each type now and then."""
    edge = seq % 11 == 0
    return StepEvent(
        seq=seq, node_id=NODE, time_ns=T0 + seq, unit_id=seq % 5, step_id=BIG if edge else seq * 3,
        measured_ns=seq * 7 + 1, predicted_ns=-BIG - 1 if edge else seq * 5, mode=list(StepMode)[seq % len(StepMode)],
        policy=("vllm", "sarathi", "pölicy ✓", "")[seq % 4], num_prefill_tokens=seq % 2048,
        num_decode_tokens=seq % 64, num_prefill_reqs=seq % 3, num_decode_reqs=seq % 63, context_tokens=seq * 11,
        budget_tokens=seq % 4096, kv_used_blocks=seq % 997, num_blocks=1000 + seq % 3, num_running=seq % 61,
        num_waiting=seq % 59, num_preempted=seq % 2, num_finished=seq % 13, reasons=REASONS[seq % len(REASONS)],
    )


def varied_load(seq: int) -> UnitLoadEvent:
    return UnitLoadEvent(
        seq=seq, node_id=NODE, time_ns=T0 + seq, unit_id=seq % 4, dispatch_id=seq, healthy=seq % 3 != 0,
        num_running=seq % 9, num_waiting=seq % 7, kv_used_blocks=seq % 100, num_blocks=100, kv_tokens=seq * 16,
        queued_prefill_tokens=seq % 500, max_num_seqs=seq % 256, pab_tokens=None if seq % 2 else seq / 3,
        last_step_ns=None if seq % 3 else seq * 1000, mean_step_ns=None if seq % 5 else BIG,
    )


def reference(table: str, events: list[Any], boots: list[int]) -> pa.Table:
    """The rows as a per-row reading of the events would make them (the conversion must give exactly these)."""
    schema = SCHEMAS[table]
    data: dict[str, list[Any]] = {name: [] for name in schema.names}
    for event, boot in zip(events, boots, strict=True):
        for name in schema.names:
            value = boot if name == "boot_ns" else event.__struct_config__.tag if name == "kind" else getattr(
                event, name, None)  # (a request event of a type without the column's field: NULL)
            data[name].append(msgspec.json.encode(value).decode() if name == "reasons" else value)
    return pa.Table.from_pydict(data, schema=schema)


@pytest.mark.parametrize("num", [0, 1, 7, CONVERT_ROWS + 3])
def test_field_tables_convert_to_exactly_the_per_row_values(num: int) -> None:
    boots = [T0 + (i // 5) for i in range(num)]  # several runs within one conversion
    cases: dict[str, list[Any]] = {
        "steps": [varied_step(i + 1) for i in range(num)],
        "unit_loads": [varied_load(i + 1) for i in range(num)],
        "alerts": [Alert(seq=i + 1, node_id=NODE, time_ns=T0 + i, code="slo_breach" if i % 2 else "gap",
                         unit_id=None if i % 3 else i, message=f"m\n{i}", num_dropped=i, first_seq=i, last_seq=BIG)
                   for i in range(num)],
        "stage_boundaries": [StageBoundaries(seq=i + 1, node_id=NODE, time_ns=T0 + i, policy="cascade",
                                             boundaries_tokens=tuple(range(i % 3)),
                                             stage_unit_ids=tuple((j,) * (i % 2) for j in range(i % 4)),
                                             reason="r" * (i % 2))
                             for i in range(num)],
    }
    for table, events in cases.items():
        got = to_arrow(table, events, boots)
        assert got.schema == SCHEMAS[table]
        assert got.equals(reference(table, events, boots)), table


def request_event(seq: int) -> Event:
    """One of the six kinds of request event, by ``seq``, its optional fields set or not."""
    base: dict[str, Any] = {"seq": seq, "node_id": NODE, "time_ns": T0 + seq, "request_id": f"r{seq % 97}✓"}
    unit = None if seq % 4 == 0 else seq % 8
    match seq % 6:
        case 0:
            return RequestArrived(**base, prompt_tokens=seq, ttft_slo_ms=seq / 7, tpot_slo_ms=50.0)
        case 1:
            return RequestDispatched(**base, unit_id=seq % 8, num_rounds_waited=seq % 3)
        case 2:
            return RequestFirstToken(**base, unit_id=seq % 8, ttft_ms=seq / 3)
        case 3:
            return RequestPreempted(**base, unit_id=seq % 8, step_id=BIG if seq % 5 == 0 else seq)
        case 4:
            return RequestMigrated(**base, from_unit_id=seq % 8, unit_id=unit, reason="drain\n" * (seq % 2))
        case _:
            return RequestRefused(**base, unit_id=unit, policy="pab", reason="over budget" if seq % 2 else "")


@pytest.mark.parametrize("num", [0, 1, 6, 50, CONVERT_ROWS + 3])
def test_request_events_convert_to_exactly_the_per_row_values_in_their_order(num: int) -> None:
    for events in ([request_event(i + 1) for i in range(num)],  # interleaved kinds
                   [request_event(6 * i + 3) for i in range(num)]):  # one kind
        boots = [T0 + (i // 7) for i in range(num)]
        assert to_arrow("request_events", events, boots).equals(reference("request_events", events, boots))


def test_steps_in_every_chunking_replay_equal_from_a_file(tmp_path: Path) -> None:
    """Steps written in small writes (converted as they come), one large write (converted at its commit) and beside
    other events (the writer's general path) all come back equal, reasons and NULLs included."""
    num = 2 * CONVERT_ROWS + 150
    events: list[Event] = [hello(seq=1)]
    for seq in range(2, num + 1):
        if seq == 500:
            events.append(RequestArrived(seq=seq, node_id=NODE, time_ns=T0 + seq, request_id="r", prompt_tokens=1,
                                         ttft_slo_ms=1.0, tpot_slo_ms=1.0))
        else:
            events.append(varied_load(seq) if seq > num - 50 else varied_step(seq))
    for writes in ([events], [events[i:i + 37] for i in range(0, len(events), 37)]):
        path = tmp_path / f"s{len(writes)}.duckdb"
        with StoreWriter(path, batch_rows=3 * CONVERT_ROWS) as writer:
            for write in writes:
                writer.write(write)
        assert list(replay(path)) == events


def test_a_write_refused_midway_keeps_each_buffered_step_with_its_run() -> None:
    """Steps buffered before a non-event in the same write keep their run (``boot_ns``) and are stored later."""
    with StoreWriter(":memory:") as writer:
        writer.write([hello(seq=1)])
        with pytest.raises(TypeError, match="not a protocol event"):
            writer.write([varied_step(2), varied_step(3), object()])  # type: ignore[list-item]
        writer.write([varied_step(4)])
        writer.flush()
        rows = writer.cursor().execute("SELECT seq, boot_ns FROM steps ORDER BY seq").fetchall()
    assert rows == [(2, T0), (3, T0), (4, T0)]


@pytest.mark.parametrize("bad", [1.5, None, 2**63])
def test_a_value_a_bigint_column_cannot_hold_fails_the_conversion(bad: object) -> None:
    events = [varied_step(1), msgspec.structs.replace(varied_step(2), step_id=bad)]
    with pytest.raises(struct.error):
        to_arrow("steps", events, [T0, T0])
