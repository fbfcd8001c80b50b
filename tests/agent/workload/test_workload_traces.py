"""Trace files: the Azure LLM inference trace (CSV), the JSONL format, dispatch and error messages."""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import itertools
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.workload import (
    RequestSpec,
    WorkloadError,
    generate,
    load_azure_csv,
    load_jsonl,
    load_trace,
    parse_azure_timestamp,
    parse_workload,
    write_jsonl,
)
from agent.workload.synthetic import GammaArrivals, Lognormal, Uniform

TRACES = Path(__file__).resolve().parents[3] / "examples" / "traces"
AZURE_CODE = TRACES / "azure_code_2023.csv"
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _reference_seconds(stamp: str, origin: str) -> float:
    """Independent parse: datetime takes 6 fractional digits, the 7th (100 ns) is added by hand."""

    def parse(text: str) -> tuple[dt.datetime, int]:
        return dt.datetime.strptime(text[:26], "%Y-%m-%d %H:%M:%S.%f"), int(text[26:] or 0)

    (when, extra), (start, start_extra) = parse(stamp), parse(origin)
    return (when - start).total_seconds() + (extra - start_extra) * 1e-7


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ Azure CSV


def test_azure_code_trace_matches_an_independent_parse() -> None:
    with AZURE_CODE.open(newline="") as handle:
        rows = list(csv.reader(handle))[1:]
    requests = load_trace(AZURE_CODE)

    assert len(requests) == len(rows) == 8_819
    assert requests[0].arrival_s == 0.0
    assert 3_300 < requests[-1].arrival_s < 3_700  # about one hour
    for index in (0, 1, 2, 1_234, 4_410, 8_817, 8_818):
        request, (stamp, context, generated) = requests[index], rows[index]
        assert request.request_id == f"r{index:06d}"
        assert request.arrival_s == pytest.approx(_reference_seconds(stamp, rows[0][0]), abs=1e-9)
        assert (request.prompt_tokens, request.output_tokens) == (int(context), int(generated))
    assert sum(r.prompt_tokens for r in requests) == sum(int(row[1]) for row in rows)
    assert sum(r.output_tokens for r in requests) == sum(int(row[2]) for row in rows)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(requests))


def test_azure_code_trace_loads_in_well_under_a_second() -> None:
    start = time.perf_counter()
    load_azure_csv(AZURE_CODE)
    assert time.perf_counter() - start < 1.0


def test_small_azure_is_the_head_of_the_full_trace() -> None:
    small = load_trace(TRACES / "small_azure.csv")
    assert len(small) == 200
    assert small == load_trace(AZURE_CODE, limit=200)


def test_timestamps_are_exact_to_100ns_across_midnight_and_new_year(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "t.csv", HEADER + "2023-12-31 23:59:59.9999999,5,6\n2024-01-01 00:00:00.0000011,7,8\n"
    )
    requests = load_azure_csv(path)
    assert requests[1].arrival_s == pytest.approx(1.2e-6, abs=1e-15)
    assert (
        parse_azure_timestamp("2024-01-01 00:00:00.0000011")
        - parse_azure_timestamp("2023-12-31 23:59:59.9999999")
        == 1_200
    )


def test_microseconds_are_not_rounded(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "t.csv", HEADER + "2023-11-16 18:17:03.9799600,1,1\n2023-11-16 18:17:04.0000010,1,1\n"
    )
    assert load_azure_csv(path)[1].arrival_s == pytest.approx(0.020041, abs=1e-12)


@given(
    when=st.datetimes(min_value=dt.datetime(1971, 1, 1), max_value=dt.datetime(2200, 1, 1)),
    tenth_of_us=st.integers(0, 9),
)
def test_timestamp_parse_agrees_with_datetime(when: dt.datetime, tenth_of_us: int) -> None:
    text = when.strftime("%Y-%m-%d %H:%M:%S.%f") + str(tenth_of_us)
    expected_us = (when - dt.datetime(1970, 1, 1)) // dt.timedelta(microseconds=1)
    assert parse_azure_timestamp(text) == expected_us * 1_000 + tenth_of_us * 100


def test_time_scale_multiplies_gaps_and_limit_keeps_the_first(tmp_path: Path) -> None:
    base = load_azure_csv(TRACES / "small_azure.csv")
    slow = load_azure_csv(TRACES / "small_azure.csv", time_scale=2.0)
    assert [r.arrival_s * 2 for r in base] == pytest.approx([r.arrival_s for r in slow], rel=1e-12)
    assert [r.prompt_tokens for r in base] == [r.prompt_tokens for r in slow]
    assert load_azure_csv(TRACES / "small_azure.csv", limit=10) == base[:10]


@pytest.mark.parametrize("time_scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_time_scale(time_scale: float) -> None:
    with pytest.raises(WorkloadError, match="time_scale"):
        load_trace(TRACES / "small_azure.csv", time_scale=time_scale)


def test_bad_limit() -> None:
    with pytest.raises(WorkloadError, match="limit"):
        load_trace(TRACES / "small.jsonl", limit=0)


def test_unsorted_rows_are_sorted_stably_and_keep_file_order_ids(tmp_path: Path) -> None:
    rows = ["2023-11-16 18:00:05.0,10,1", "2023-11-16 18:00:01.0,20,2", "2023-11-16 18:00:05.0,30,3"]
    requests = load_azure_csv(_write(tmp_path, "u.csv", HEADER + "\n".join(rows) + "\n"))
    assert [(r.request_id, r.arrival_s, r.prompt_tokens) for r in requests] == [
        ("r000001", 0.0, 20),
        ("r000000", 4.0, 10),
        ("r000002", 4.0, 30),
    ]


def test_zero_token_counts_are_raised_to_one(tmp_path: Path) -> None:
    path = _write(tmp_path, "z.csv", HEADER + "2023-11-16 18:00:00.0,0,5\n2023-11-16 18:00:01.0,7,0\n")
    assert [(r.prompt_tokens, r.output_tokens) for r in load_azure_csv(path)] == [(1, 5), (7, 1)]


def test_crlf_bom_and_blank_lines_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "w.csv"
    path.write_bytes(
        b"\xef\xbb\xbf" + HEADER.encode().replace(b"\n", b"\r\n") + b"2023-11-16 18:00:00.5,3,4\r\n\r\n"
    )
    assert load_azure_csv(path) == [RequestSpec("r000000", 0.0, 3, 4)]


ROW = "2023-11-16 18:17:03.9799600,4808,10\n"


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("", 1, "empty file"),
        ("time,ctx,gen\n" + ROW, 1, "expected the header"),
        (HEADER, 2, "no requests"),
        (HEADER + ROW + "2023-11-16 18:17:04.0319600,3180\n", 3, "expected 3 columns, found 2"),
        (HEADER + ROW + ROW + "2023-11-16 18:17:04.0319600,3180,8,1\n", 4, "found 4"),
        (HEADER + "2023-11-16 18:17:03.9799600,abc,10\n", 2, "ContextTokens is not a number (got 'abc')"),
        (
            HEADER + "2023-11-16 18:17:03.9799600,12,-5\n",
            2,
            "GeneratedTokens must not be negative (got '-5')",
        ),
        (HEADER + "2023-11-16 18:17:03.9799600,12.5,5\n", 2, "whole number"),
        (HEADER + ROW + "yesterday,1,1\n", 3, "bad timestamp"),
        (HEADER + "2023-02-30 18:17:03.9799600,1,1\n", 2, "bad date"),
        (HEADER + "2023-11-16 25:17:03.9799600,1,1\n", 2, "bad time of day"),
    ],
)
def test_bad_azure_files_name_the_line(tmp_path: Path, text: str, line: int, fragment: str) -> None:
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(WorkloadError) as caught:
        load_trace(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:{line}: ")
    assert fragment in message
    assert "\n" not in message


def test_missing_file_and_unknown_extension(tmp_path: Path) -> None:
    for loader in (load_trace, load_azure_csv, load_jsonl):
        with pytest.raises(WorkloadError, match="no such file"):
            loader(tmp_path / "absent.csv")
    with pytest.raises(WorkloadError, match=r"unknown trace format '\.txt'.*\.csv.*\.jsonl"):
        load_trace(_write(tmp_path, "trace.txt", HEADER + ROW))
    with pytest.raises(WorkloadError, match="is a directory"):
        load_azure_csv(tmp_path)


# ------------------------------------------------------------------------------------------ JSONL


def test_jsonl_round_trip_keeps_everything(tmp_path: Path) -> None:
    original = generate(
        300, GammaArrivals(7.0, 3.0), Lognormal(5.2, 1.0), Uniform(1, 50), seed=3, ttft_slo_ms=500.0
    )
    original[7] = dataclasses.replace(original[7], ttft_slo_ms=None, tpot_slo_ms=40.5)
    path = tmp_path / "w.jsonl"
    assert write_jsonl(original, path) == 300
    assert load_jsonl(path) == original
    assert load_trace(path) == original


def test_azure_trace_round_trips_through_jsonl(tmp_path: Path) -> None:
    original = load_trace(TRACES / "small_azure.csv")
    write_jsonl(original, tmp_path / "a.ndjson")
    assert load_trace(tmp_path / "a.ndjson") == original


def test_example_jsonl() -> None:
    requests = load_trace(TRACES / "small.jsonl")
    assert len(requests) == 40
    with_slo = [r for r in requests if r.ttft_slo_ms is not None or r.tpot_slo_ms is not None]
    assert [r.request_id for r in with_slo] == ["r000005", "r000017", "r000031"]
    assert with_slo[2].tpot_slo_ms is None


def test_jsonl_defaults_ids_skips_comments_and_scales_time(tmp_path: Path) -> None:
    text = (
        "# a comment\n\n"
        '{"arrival_s": 2.0, "prompt_tokens": 5, "output_tokens": 6, "ttft_slo_ms": null}\n'
        '{"arrival_s": 1.0, "prompt_tokens": 7.0, "output_tokens": 8, "request_id": "x"}\n'
    )
    requests = load_jsonl(_write(tmp_path, "c.jsonl", text), time_scale=0.5)
    assert requests == [RequestSpec("x", 0.5, 7, 8), RequestSpec("r000000", 1.0, 5, 6)]


@pytest.mark.parametrize(
    ("line_text", "fragment"),
    [
        (
            '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 6, "ttft_slo": 100}',
            "unknown key 'ttft_slo'",
        ),
        ('{"arrival_s": 0, "prompt_tokens": 5}', "missing key 'output_tokens'"),
        ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 6', "not valid JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
        ('{"arrival_s": -1, "prompt_tokens": 5, "output_tokens": 6}', "arrival_s must be >= 0"),
        ('{"arrival_s": "0", "prompt_tokens": 5, "output_tokens": 6}', "arrival_s must be a finite number"),
        ('{"arrival_s": NaN, "prompt_tokens": 5, "output_tokens": 6}', "arrival_s must be a finite number"),
        ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 6}', "prompt_tokens must be >= 1 (got 0)"),
        ('{"arrival_s": 0, "prompt_tokens": 1.5, "output_tokens": 6}', "whole number of tokens (got 1.5)"),
        ('{"arrival_s": 0, "prompt_tokens": true, "output_tokens": 6}', "whole number of tokens"),
        ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 6, "tpot_slo_ms": 0}', "tpot_slo_ms must be"),
        ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 6, "request_id": ""}', "request_id must be"),
        ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 6, "request_id": "r000000"}', "duplicate"),
    ],
)
def test_bad_jsonl_lines_name_the_line(tmp_path: Path, line_text: str, fragment: str) -> None:
    good = '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 6}'
    path = _write(tmp_path, "bad.jsonl", f"# header\n{good}\n\n{line_text}\n{good}\n")
    with pytest.raises(WorkloadError) as caught:
        load_jsonl(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:4: ")
    assert fragment in message
    assert "\n" not in message


def test_jsonl_unknown_key_lists_the_valid_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, "k.jsonl", '{"arrival": 0, "prompt_tokens": 5, "output_tokens": 6}\n')
    with pytest.raises(
        WorkloadError, match=r":1: unknown key 'arrival' \(valid keys: arrival_s, prompt_tokens"
    ):
        load_jsonl(path)


def test_jsonl_without_requests(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=r":1: no requests"):
        load_jsonl(_write(tmp_path, "e.jsonl", "# only a comment\n\n"))


# ------------------------------------------------------------------------------------------ RequestSpec


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt_tokens": 0},
        {"output_tokens": 0},
        {"arrival_s": -0.5},
        {"arrival_s": float("nan")},
        {"ttft_slo_ms": 0.0},
        {"tpot_slo_ms": float("inf")},
        {"request_id": ""},
    ],
)
def test_request_spec_rejects_impossible_requests(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {"request_id": "a", "arrival_s": 0.0, "prompt_tokens": 1, "output_tokens": 1}
    with pytest.raises(WorkloadError):
        RequestSpec(**(fields | kwargs))  # type: ignore[arg-type]


def test_request_spec_is_frozen() -> None:
    request = parse_workload("all-at-once:n=1", seed=0)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.prompt_tokens = 5  # type: ignore[misc]
