"""Trace files in and out: the Azure LLM inference trace (CSV) and the project's own JSONL format.

Every loader returns requests sorted by arrival (a stable sort, so ties keep file order), applies
``time_scale`` to arrival times (2.0 doubles every gap: half the load) and then keeps the first ``limit``
requests. Every problem with a file is a :class:`~agent.workload.types.WorkloadError` whose message reads
``path:line: what is wrong (got 'the offending value')``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agent.workload.types import RequestSpec, WorkloadError, request_id_for

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
"""The header of the Azure LLM inference traces (2023 code and conversation traces)."""

JSONL_REQUIRED_KEYS = ("arrival_s", "prompt_tokens", "output_tokens")
JSONL_OPTIONAL_KEYS = ("request_id", "ttft_slo_ms", "tpot_slo_ms")
_JSONL_KEYS = frozenset(JSONL_REQUIRED_KEYS + JSONL_OPTIONAL_KEYS)

_TIMESTAMP = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")
_EPOCH_ORDINAL = dt.date(1970, 1, 1).toordinal()
_NS_PER_S = 1_000_000_000

# (sort key in the file's own time unit, index in file order, prompt, output, ttft_slo_ms, tpot_slo_ms, id)
_Row = tuple[float, int, int, int, float | None, float | None, str]
PathLike = str | os.PathLike[str]


def parse_azure_timestamp(text: str) -> int:
    """Nanoseconds since 1970-01-01 00:00 of a trace timestamp such as ``2023-11-16 18:17:03.9799600``.

    The Azure traces write 7 fractional digits (100 ns), more than ``datetime`` parses; this parser takes
    up to 9 and is exact. The time zone is whatever the trace used: only differences matter.
    """
    match = _TIMESTAMP.fullmatch(text.strip())
    if match is None:
        raise WorkloadError(f"bad timestamp, expected YYYY-MM-DD HH:MM:SS.fffffff (got {text!r})")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    try:
        days = dt.date(year, month, day).toordinal() - _EPOCH_ORDINAL
    except ValueError:
        raise WorkloadError(f"bad date in timestamp (got {text!r})") from None
    if hour > 23 or minute > 59 or second > 59:
        raise WorkloadError(f"bad time of day in timestamp (got {text!r})")
    fraction_ns = int((match.group(7) or "").ljust(9, "0"))
    return (days * 86_400 + hour * 3_600 + minute * 60 + second) * _NS_PER_S + fraction_ns


def load_azure_csv(path: PathLike, *, time_scale: float = 1.0, limit: int | None = None) -> list[RequestSpec]:
    """Load an Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Arrival of a request = (its timestamp - the earliest timestamp) * ``time_scale``, in seconds, exact to
    the trace's 100 ns. Request ids follow file order (``r000000`` is the first data row). Rows out of time
    order are accepted and sorted (stably); the published traces are sorted already. A row with 0
    ContextTokens or 0 GeneratedTokens is kept with the count raised to 1 token: the request did arrive,
    and dropping it would change the arrival process. Blank lines are skipped. A bad header, a wrong
    column count, a non-integer or negative count, a malformed timestamp or a file without rows raises
    :class:`WorkloadError` naming the line.
    """
    _check_options(time_scale, limit)
    name = os.fspath(path)
    lines = _read_lines(name)
    if not lines or not lines[0].strip():
        raise WorkloadError(f"{name}:1: empty file, expected the header {','.join(AZURE_COLUMNS)!r}")
    if tuple(column.strip() for column in lines[0].split(",")) != AZURE_COLUMNS:
        raise WorkloadError(f"{name}:1: expected the header {','.join(AZURE_COLUMNS)!r} (got {lines[0]!r})")
    rows: list[_Row] = []
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        fields = line.split(",")
        if len(fields) != len(AZURE_COLUMNS):
            raise WorkloadError(
                f"{where}: expected {len(AZURE_COLUMNS)} columns, found {len(fields)} (got {line!r})"
            )
        try:
            time_ns = parse_azure_timestamp(fields[0])
        except WorkloadError as error:
            raise WorkloadError(f"{where}: {error}") from None
        prompt = max(1, _parse_count(fields[1], AZURE_COLUMNS[1], where))
        output = max(1, _parse_count(fields[2], AZURE_COLUMNS[2], where))
        index = len(rows)
        rows.append((time_ns, index, prompt, output, None, None, request_id_for(index)))
    if not rows:
        raise WorkloadError(f"{name}:2: no requests after the header")
    return _finish(rows, units_per_s=_NS_PER_S, rebase=True, time_scale=time_scale, limit=limit)


def load_jsonl(path: PathLike, *, time_scale: float = 1.0, limit: int | None = None) -> list[RequestSpec]:
    """Load a JSONL workload: one JSON object per line.

    Keys: ``arrival_s`` (seconds from the start of the workload, >= 0; taken as written, not rebased),
    ``prompt_tokens`` and ``output_tokens`` (whole numbers >= 1), and optionally ``request_id`` (default:
    ``r`` + the zero-padded index among the file's requests), ``ttft_slo_ms`` and ``tpot_slo_ms`` (> 0, or
    null for the run's default). Blank lines and lines starting with ``#`` are ignored. Unknown keys are
    errors, so that a typo never passes silently; so are duplicate request ids. Arrivals are multiplied by
    ``time_scale`` and sorted stably. Every problem raises :class:`WorkloadError` naming the line.
    """
    _check_options(time_scale, limit)
    name = os.fspath(path)
    rows: list[_Row] = []
    first_line_of: dict[str, int] = {}
    for lineno, line in enumerate(_read_lines(name), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{name}:{lineno}"
        record = _parse_json_object(text, where)
        index = len(rows)
        request_id = record.get("request_id", request_id_for(index))
        if not isinstance(request_id, str) or not request_id:
            raise WorkloadError(f"{where}: request_id must be a non-empty string (got {request_id!r})")
        if request_id in first_line_of:
            first = first_line_of[request_id]
            raise WorkloadError(f"{where}: duplicate request_id, first on line {first} (got {request_id!r})")
        first_line_of[request_id] = lineno
        rows.append(
            (
                _json_number(record, "arrival_s", where, minimum=0.0),
                index,
                _json_tokens(record, "prompt_tokens", where),
                _json_tokens(record, "output_tokens", where),
                _json_slo(record, "ttft_slo_ms", where),
                _json_slo(record, "tpot_slo_ms", where),
                request_id,
            )
        )
    if not rows:
        raise WorkloadError(f"{name}:1: no requests in the file (every line is blank or a comment)")
    return _finish(rows, units_per_s=1, rebase=False, time_scale=time_scale, limit=limit)


def load_trace(path: PathLike, *, time_scale: float = 1.0, limit: int | None = None) -> list[RequestSpec]:
    """Load a trace file, choosing the format by extension: ``.csv`` (Azure) or ``.jsonl`` / ``.ndjson``."""
    name = os.fspath(path)
    if not os.path.exists(name):
        raise WorkloadError(f"{name}: no such file")
    suffix = Path(name).suffix.lower()
    if suffix == ".csv":
        return load_azure_csv(name, time_scale=time_scale, limit=limit)
    if suffix in (".jsonl", ".ndjson"):
        return load_jsonl(name, time_scale=time_scale, limit=limit)
    raise WorkloadError(
        f"{name}: unknown trace format {suffix or '(no extension)'!r}; expected .csv (Azure LLM inference "
        "trace), .jsonl or .ndjson"
    )


def write_jsonl(requests: Iterable[RequestSpec], path: PathLike) -> int:
    """Write ``requests`` as JSONL that :func:`load_jsonl` reads back unchanged; returns the count written.

    SLO keys are written only when set. Floats are written with ``repr`` precision, so arrivals round-trip
    exactly.
    """
    count = 0
    with open(os.fspath(path), "w", encoding="utf-8", newline="\n") as out:
        for request in requests:
            record: dict[str, Any] = {
                "request_id": request.request_id,
                "arrival_s": request.arrival_s,
                "prompt_tokens": request.prompt_tokens,
                "output_tokens": request.output_tokens,
            }
            if request.ttft_slo_ms is not None:
                record["ttft_slo_ms"] = request.ttft_slo_ms
            if request.tpot_slo_ms is not None:
                record["tpot_slo_ms"] = request.tpot_slo_ms
            out.write(json.dumps(record, allow_nan=False) + "\n")
            count += 1
    return count


def _check_options(time_scale: float, limit: int | None) -> None:
    if isinstance(time_scale, bool) or not isinstance(time_scale, int | float):
        raise WorkloadError(f"time_scale must be a number > 0 (got {time_scale!r})")
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise WorkloadError(f"time_scale must be finite and > 0 (got {time_scale!r})")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise WorkloadError(f"limit must be a whole number >= 1 or None (got {limit!r})")


def _read_lines(name: str) -> list[str]:
    """The file's lines without line endings; a UTF-8 byte-order mark is dropped."""
    try:
        with open(name, encoding="utf-8-sig", newline="") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise WorkloadError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise WorkloadError(f"{name}: is a directory, not a trace file") from None
    except UnicodeDecodeError as error:
        raise WorkloadError(f"{name}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise WorkloadError(f"{name}: cannot read ({error.strerror})") from None
    return [line.removesuffix("\r") for line in text.split("\n")]


def _parse_count(text: str, column: str, where: str) -> int:
    """A non-negative whole number of tokens from a CSV field."""
    value = text.strip()
    if value.isascii() and value.isdigit():
        return int(value)
    try:
        number = float(value)
    except ValueError:
        raise WorkloadError(f"{where}: {column} is not a number (got {text!r})") from None
    if number < 0:
        raise WorkloadError(f"{where}: {column} must not be negative (got {text!r})")
    raise WorkloadError(f"{where}: {column} must be a whole number of tokens (got {text!r})")


def _parse_json_object(text: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise WorkloadError(
            f"{where}: not valid JSON, {error.msg} at column {error.colno} (got {text!r})"
        ) from None
    if not isinstance(record, dict):
        raise WorkloadError(f"{where}: expected a JSON object (got {text!r})")
    unknown = sorted(set(record) - _JSONL_KEYS)
    if unknown:
        valid = ", ".join(JSONL_REQUIRED_KEYS + JSONL_OPTIONAL_KEYS)
        raise WorkloadError(f"{where}: unknown key {unknown[0]!r} (valid keys: {valid})")
    for key in JSONL_REQUIRED_KEYS:
        if key not in record:
            raise WorkloadError(f"{where}: missing key {key!r} (required: {', '.join(JSONL_REQUIRED_KEYS)})")
    return record


def _json_number(record: dict[str, Any], key: str, where: str, *, minimum: float) -> float:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WorkloadError(f"{where}: {key} must be a finite number (got {value!r})")
    if value < minimum:
        raise WorkloadError(f"{where}: {key} must be >= {minimum:g} (got {value!r})")
    return float(value)


def _json_tokens(record: dict[str, Any], key: str, where: str) -> int:
    value = record[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{where}: {key} must be a whole number of tokens (got {value!r})")
    if value < 1:
        raise WorkloadError(f"{where}: {key} must be >= 1 (got {value!r})")
    return value


def _json_slo(record: dict[str, Any], key: str, where: str) -> float | None:
    value = record.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise WorkloadError(f"{where}: {key} must be a number > 0 or null (got {value!r})")
    return float(value)


def _finish(
    rows: list[_Row], *, units_per_s: int, rebase: bool, time_scale: float, limit: int | None
) -> list[RequestSpec]:
    """Sort stably by time, convert to seconds (optionally from the earliest row), scale, cut to ``limit``."""
    rows.sort(key=lambda row: (row[0], row[1]))
    if limit is not None:
        del rows[limit:]
    origin = rows[0][0] if rebase else 0
    return [
        RequestSpec(
            request_id=request_id,
            arrival_s=(time - origin) / units_per_s * time_scale,
            prompt_tokens=prompt,
            output_tokens=output,
            ttft_slo_ms=ttft,
            tpot_slo_ms=tpot,
        )
        for time, _, prompt, output, ttft, tpot, request_id in rows
    ]
