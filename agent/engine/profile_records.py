"""The step records behind a calibration profile: the ``<name>.records.csv.gz`` layout, read and written.

One row per engine step (:data:`RECORD_COLUMNS`), held as a numpy structured array of :data:`RECORD_DTYPE`.
:func:`format_records` writes the CSV text at fixed precision (``t_s`` to 0.1 us, ``kv`` to 1e-10) and
:func:`parse_records` reads it back; every statistic of a profile is computed from records rounded this way,
so the shipped CSV reproduces the shipped JSON. :func:`select` and :func:`stats_on` evaluate a step model on
a subset of them. The shipped files are found by :mod:`agent.engine.profiles`.
"""

from __future__ import annotations

import csv
import gzip
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from policies.cost.fit import FitStats, evaluate
from policies.cost.step_model import StepCoefficients

RECORD_COLUMNS = ("workload", "t_s", "new", "pre_tok", "dec", "npre", "ctx", "nreq", "kv")
"""Columns of ``<name>.records.csv.gz``: workload tag, step seconds, tokens computed, prefill tokens,
decode tokens, prefilling requests, context tokens, scheduled requests, KV usage fraction after the step."""
RECORD_DTYPE = np.dtype(
    [("workload", "U16"), ("t_s", "f8"), ("new", "i8"), ("pre_tok", "i8"), ("dec", "i8"),
     ("npre", "i8"), ("ctx", "i8"), ("nreq", "i8"), ("kv", "f8")]
)
"""numpy dtype of :func:`agent.engine.profiles.load_records` (same fields as :data:`RECORD_COLUMNS`)."""

Records = npt.NDArray[np.void]

_FORMATS = {"t_s": "{:.7f}", "kv": "{:.10f}"}


def record_line(cells: Sequence[Any]) -> str:
    """One CSV line of a record (``cells`` in :data:`RECORD_COLUMNS` order), at the file's fixed precision."""
    out = [str(cells[0])]
    for col, value in zip(RECORD_COLUMNS[1:], cells[1:], strict=True):
        out.append(_FORMATS[col].format(float(value)) if col in _FORMATS else str(int(value)))
    return ",".join(out)


def format_records(records: Records) -> str:
    """CSV text of a records array (header :data:`RECORD_COLUMNS`, fixed float formats)."""
    lines = [",".join(RECORD_COLUMNS)]
    lines += [record_line(tuple(row)) for row in records.tolist()]
    return "\n".join(lines) + "\n"


def parse_records(text: str) -> Records:
    """Parse the CSV text of a records file into a structured array of :data:`RECORD_DTYPE`."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or tuple(header) != RECORD_COLUMNS:
        raise ValueError(f"records header {header!r}, expected {','.join(RECORD_COLUMNS)}")
    rows = [tuple(row) for row in reader if row]
    out = np.empty(len(rows), dtype=RECORD_DTYPE)
    for j, field in enumerate(RECORD_COLUMNS):
        out[field] = [row[j] for row in rows]
    return out


def read_records_file(path: str | Path) -> Records:
    """The records of a ``.records.csv.gz`` file (or a plain ``.csv``) written with a profile."""
    raw = Path(path).read_bytes()
    text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")
    return parse_records(text)


def select(records: Records, workloads: tuple[str, ...]) -> Records:
    """The rows of ``records`` whose workload is one of ``workloads``."""
    return records[np.isin(records["workload"], workloads)]


def stats_on(coefs: StepCoefficients, records: Records) -> FitStats:
    """:func:`policies.cost.fit.evaluate` on a records array."""
    return evaluate(coefs, records["new"], records["ctx"], records["t_s"])
