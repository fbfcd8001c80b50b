"""Canned queries over a store, returning plain dicts; arbitrary read-only SQL; Parquet export.

Definitions are those of :mod:`agent.bench.report` (TTFT/TPOT percentiles with linear interpolation, DuckDB's
``quantile_cont`` = ``numpy.percentile``; a request meets its SLO when both TTFT and TPOT are within their
targets; ``slo_attainment`` = met / requests, refused included; ``goodput_rps`` = met / ``duration_s``;
``effective_rps`` = ``offered_rps`` x ``slo_attainment``), with these store-side choices:

* TPOT is the one ``tpot_metric`` names (``agent.telemetry.TpotMetric``; default
  ``agent.telemetry.DEFAULT_TPOT_METRIC``, as ``trackside bench``): ``worst`` reads ``max_tpot_ms``, ``mean``
  reads ``tpot_ms``, and whether a request met its SLO is decided again from its TTFT, that TPOT and its targets
  (not read from ``met_slo``, which holds the agent's verdict under its own default). Requests recorded before
  schema version 2 have no ``max_tpot_ms``: ``worst`` falls back to their mean TPOT (never above their worst).
* ``offered_rps`` = requests over the span of the finished requests' arrivals (a refused request has no arrival
  in the store).

* A finished request counts for the **batch policy of its unit** at its finish (``requests.policy``: the policy
  of the unit's latest step before it in the stream, set by the writer). A refused request counts for the
  policy that refused it (``RequestRefused.policy``: a dispatch policy or a unit's batch policy).
* A window keeps the requests that finished (or were refused) in ``[start_ns, end_ns)``. ``duration_s`` runs
  from ``start_ns`` (without one: the group's earliest arrival, the store not knowing the workload's time 0)
  to the group's last completion; with ``window_s`` buckets it is the bucket's length. Requests still
  running at the window's end are not counted (the store has no row for them yet).

Every function takes a connection (``StoreWriter.cursor()``, ``store.schema.connect(path, read_only=True)``)
or a path, which it opens read-only and closes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from agent.telemetry import DEFAULT_TPOT_METRIC, TPOT_METRICS, TpotMetric
from store.schema import TABLES, StoreError, connect

Db = str | Path | duckdb.DuckDBPyConnection
READ_ONLY_STATEMENTS = frozenset({duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN})


class StoreQueryError(StoreError):
    """A query that DuckDB refused (syntax, unknown column, ...), or one that would change the store."""


@dataclass(frozen=True, slots=True)
class SqlResult:
    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]


def _open(db: Db) -> tuple[duckdb.DuckDBPyConnection, bool]:
    if isinstance(db, duckdb.DuckDBPyConnection):
        return db, False
    return connect(db, read_only=True), True


def _dicts(cur: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    names = [d[0] for d in cur.description or ()]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def _window(column: str, start_ns: int | None, end_ns: int | None, params: list[Any]) -> str:
    clauses = ["TRUE"]
    if start_ns is not None:
        clauses.append(f"{column} >= ?")
        params.append(start_ns)
    if end_ns is not None:
        clauses.append(f"{column} < ?")
        params.append(end_ns)
    return " AND ".join(clauses)


# -- per policy ----------------------------------------------------------------------------------------------
_TPOT_COLUMNS: dict[str, str] = {"worst": "coalesce(max_tpot_ms, tpot_ms)", "mean": "tpot_ms"}
"""The SQL for each TPOT metric (rows before schema version 2 have no ``max_tpot_ms``: see the module)."""


def policy_summary(
    db: Db, *, start_ns: int | None = None, end_ns: int | None = None, window_s: float | None = None,
    tpot_metric: TpotMetric = DEFAULT_TPOT_METRIC,
) -> list[dict[str, Any]]:
    """One dict per batch policy (and per ``window_s`` bucket of finish time, keyed ``window_start_ns``):
    ``policy`` and the keys of :data:`agent.bench.report.SUMMARY_KEYS`, TPOT and SLO attainment by ``tpot_metric``."""
    if window_s is not None and window_s <= 0:
        raise ValueError("window_s must be positive")
    if tpot_metric not in TPOT_METRICS:
        raise ValueError(f"tpot_metric must be one of {', '.join(TPOT_METRICS)}")
    tpot = _TPOT_COLUMNS[tpot_metric]
    con, owned = _open(db)
    try:
        params: list[Any] = []
        where = _window("time_ns", start_ns, end_ns, params)
        bucket = "NULL::BIGINT" if window_s is None else f"(time_ns // {int(window_s * 1e9)}) * {int(window_s * 1e9)}"
        cur = con.execute(f"""
            SELECT policy, {bucket} AS window_start_ns,
                count(*) AS requests,
                count(*) FILTER (NOT refused) AS completed,
                count(*) FILTER (refused) AS rejected,
                count(*) FILTER (NOT refused AND ttft_ms <= ttft_slo_ms
                                 AND ({tpot} IS NULL OR {tpot} <= tpot_slo_ms)) AS met,
                coalesce(sum(output_tokens), 0) AS output_tokens,
                coalesce(sum(prompt_tokens) FILTER (NOT refused), 0) AS input_tokens,
                min(arrival_ns) AS first_arrival_ns,
                max(arrival_ns) AS last_arrival_ns,
                max(time_ns) FILTER (NOT refused) AS last_finish_ns,
                avg(ttft_ms) AS ttft_mean,
                quantile_cont(ttft_ms, [0.5, 0.9, 0.99]) AS ttft_q,
                avg({tpot}) AS tpot_mean,
                quantile_cont({tpot}, [0.5, 0.9, 0.99]) AS tpot_q,
                avg((time_ns - arrival_ns) / 1e6 / output_tokens) FILTER (output_tokens > 0) AS norm_mean,
                quantile_cont((time_ns - arrival_ns) / 1e6 / output_tokens, [0.5, 0.9, 0.99])
                    FILTER (output_tokens > 0) AS norm_q,
                avg((time_ns - arrival_ns) / 1e6) FILTER (NOT refused) AS e2e_mean,
                quantile_cont((time_ns - arrival_ns) / 1e6, [0.5, 0.9, 0.99]) FILTER (NOT refused) AS e2e_q
            FROM requests WHERE {where}
            GROUP BY ALL ORDER BY window_start_ns NULLS FIRST, policy NULLS LAST
        """, params)
        rows = _dicts(cur)
    finally:
        if owned:
            con.close()
    return [_summary(row, start_ns, window_s) for row in rows]


def _summary(row: dict[str, Any], start_ns: int | None, window_s: float | None) -> dict[str, Any]:
    completed, met = row["completed"], row["met"]
    if window_s is not None:
        duration_s = window_s
    elif row["last_finish_ns"] is None:
        duration_s = 0.0
    else:
        origin = start_ns if start_ns is not None else row["first_arrival_ns"]
        duration_s = (row["last_finish_ns"] - origin) / 1e9
    span = duration_s if duration_s > 0 else math.nan
    first, last = row["first_arrival_ns"], row["last_arrival_ns"]
    arrivals_s = (last - first) / 1e9 if first is not None and last is not None else 0.0
    offered = row["requests"] / arrivals_s if arrivals_s > 0 else 0.0
    attainment = met / row["requests"] if row["requests"] else 0.0
    out: dict[str, Any] = {"policy": row["policy"]}
    if window_s is not None:
        out["window_start_ns"] = row["window_start_ns"]
    out.update({
        "requests": row["requests"],
        "completed": completed,
        "rejected": row["rejected"],
        "duration_s": duration_s,
        "throughput_rps": completed / span if completed else 0.0,
        "output_tokens_per_s": row["output_tokens"] / span if completed else 0.0,
        "input_tokens_per_s": row["input_tokens"] / span if completed else 0.0,
        "goodput_rps": met / span if completed else 0.0,
        "offered_rps": offered,
        "effective_rps": offered * attainment,
        "slo_attainment": attainment,
        "ttft_ms": _latency(row["ttft_mean"], row["ttft_q"]),
        "tpot_ms": _latency(row["tpot_mean"], row["tpot_q"]),
        "normalized_latency_ms": _latency(row["norm_mean"], row["norm_q"]),
        "e2e_ms": _latency(row["e2e_mean"], row["e2e_q"]),
    })
    return out


def _latency(mean: float | None, quantiles: Sequence[float] | None) -> dict[str, float | None]:
    if mean is None or quantiles is None:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = quantiles
    return {"mean": float(mean), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


# -- per unit ------------------------------------------------------------------------------------------------
def unit_balance(db: Db, *, start_ns: int | None = None, end_ns: int | None = None) -> list[dict[str, Any]]:
    """One dict per (node, unit) over the steps that started in the window, with the keys of
    ``agent.bench.report.UnitStats.as_dict`` (``steps_by_mode`` aside) plus ``node_id``, ``busy_s`` and ``policies``.

    ``busy_fraction`` is busy time over the window's length (without both bounds: the node's span of steps).
    """
    con, owned = _open(db)
    params: list[Any] = []
    where = _window("time_ns", start_ns, end_ns, params)
    try:
        cur = con.execute(f"""
            SELECT node_id, unit_id,
                count(*) AS steps,
                sum(measured_ns) AS busy_ns,
                min(min(time_ns)) OVER (PARTITION BY node_id) AS node_first_ns,
                max(max(time_ns + measured_ns)) OVER (PARTITION BY node_id) AS node_last_ns,
                sum(num_prefill_reqs + num_decode_reqs) AS batch_sum,
                sum(num_prefill_tokens) AS prefill_tokens,
                sum(num_decode_tokens) AS decode_tokens,
                sum(CASE WHEN num_blocks > 0 THEN kv_used_blocks / num_blocks ELSE 0 END * measured_ns)
                    AS kv_weighted_ns,
                max(CASE WHEN num_blocks > 0 THEN kv_used_blocks / num_blocks ELSE 0 END) AS kv_usage_max,
                sum(num_preempted) AS preemptions,
                sum(num_finished) AS completed,
                sum(CASE WHEN measured_ns > 0 THEN abs(predicted_ns - measured_ns) / measured_ns ELSE 0 END)
                    AS pred_abs_err,
                list(DISTINCT policy ORDER BY policy) AS policies
            FROM steps WHERE {where}
            GROUP BY node_id, unit_id ORDER BY node_id, unit_id
        """, params)
        rows = _dicts(cur)
    finally:
        if owned:
            con.close()
    out = []
    for r in rows:
        steps, busy_ns = r["steps"], int(r["busy_ns"])
        window_ns = end_ns - start_ns if start_ns is not None and end_ns is not None else (
            r["node_last_ns"] - r["node_first_ns"]
        )
        out.append({
            "node_id": r["node_id"],
            "unit_id": r["unit_id"],
            "steps": steps,
            "busy_s": busy_ns / 1e9,
            "busy_fraction": busy_ns / window_ns if window_ns > 0 else 0.0,
            "mean_batch_size": r["batch_sum"] / steps,
            "mean_step_ms": busy_ns / steps / 1e6,
            "kv_usage_mean": r["kv_weighted_ns"] / busy_ns if busy_ns > 0 else 0.0,
            "kv_usage_max": float(r["kv_usage_max"]),
            "prefill_tokens": int(r["prefill_tokens"]),
            "decode_tokens": int(r["decode_tokens"]),
            "preemptions": int(r["preemptions"]),
            "completed": int(r["completed"]),
            "step_model_mape": r["pred_abs_err"] / steps,
            "policies": list(r["policies"]),
        })
    return out


# -- step records (calibration) ---------------------------------------------------------------------------------
STEP_RECORD_COLUMNS = (
    "time_ns", "unit_id", "measured_ns", "num_prefill_tokens", "num_decode_tokens", "num_prefill_reqs",
    "num_decode_reqs", "context_tokens", "budget_tokens", "kv_used_blocks", "num_blocks",
)
"""The columns of ``steps`` that :func:`step_records` returns (what a step-time fit needs)."""


@dataclass(frozen=True, slots=True)
class StepRecords:
    """Steps of one node (or of every node when none was named), in time order, as numpy columns."""

    steps_per_node: dict[str, int]
    """Steps in the selection of every node that has some (before the node filter)."""
    stored: dict[str, tuple[int, tuple[int, ...]]]
    """What the store has, whatever the selection: node -> (steps, its unit ids)."""
    columns: dict[str, Any]
    """:data:`STEP_RECORD_COLUMNS` -> 1-D int64 numpy array, one entry per step."""
    max_num_seqs: int | None
    """The units' ``max_num_seqs`` (largest reported in ``unit_loads`` of the selection; None without any)."""

    @property
    def num_steps(self) -> int:
        return len(self.columns["time_ns"])


def step_records(
    db: Db,
    *,
    node_id: str | None = None,
    unit_ids: Sequence[int] | None = None,
    start_ns: int | None = None,
    end_ns: int | None = None,
) -> StepRecords:
    """The steps that started in ``[start_ns, end_ns)`` on ``unit_ids`` (all units when None) of ``node_id``
    (all nodes when None), ordered by start time then unit."""
    con, owned = _open(db)
    try:
        stored = {str(n): (int(c), tuple(int(u) for u in units)) for n, c, units in con.execute(
            "SELECT node_id, count(*), list(DISTINCT unit_id ORDER BY unit_id) FROM steps GROUP BY node_id "
            "ORDER BY node_id"
        ).fetchall()}
        params: list[Any] = []
        where = _window("time_ns", start_ns, end_ns, params)
        if unit_ids is not None:
            where += f" AND unit_id IN ({', '.join(str(int(u)) for u in unit_ids) or 'NULL'})"
        per_node = {str(n): int(c) for n, c in con.execute(
            f"SELECT node_id, count(*) FROM steps WHERE {where} GROUP BY node_id ORDER BY node_id", params
        ).fetchall()}
        if node_id is not None:
            where += " AND node_id = ?"
            params.append(node_id)
        cur = con.execute(
            f"SELECT {', '.join(STEP_RECORD_COLUMNS)} FROM steps WHERE {where} ORDER BY time_ns, unit_id", params
        )
        columns = {name: np.asarray(values, dtype=np.int64) for name, values in cur.fetchnumpy().items()}
        row = con.execute(f"SELECT max(max_num_seqs) FROM unit_loads WHERE {where}", params).fetchone()
    finally:
        if owned:
            con.close()
    return StepRecords(per_node, stored, columns, int(row[0]) if row and row[0] is not None else None)


# -- arbitrary SQL, export -----------------------------------------------------------------------------------
def sql(db: Db, text: str) -> SqlResult:
    """Run one read-only statement (SELECT, including DESCRIBE/SHOW/SUMMARIZE, or EXPLAIN): its columns and
    rows. Raises :class:`StoreQueryError` with DuckDB's first line for anything DuckDB refuses."""
    con, owned = _open(db)
    try:
        try:
            check_read_only(con, text)
            cur = con.execute(text)
            return SqlResult(tuple(d[0] for d in cur.description or ()), cur.fetchall())
        except duckdb.Error as exc:
            raise StoreQueryError(one_line(exc)) from None
    finally:
        if owned:
            con.close()


def check_read_only(con: duckdb.DuckDBPyConnection, text: str) -> None:
    """Raise :class:`StoreQueryError` unless ``text`` is exactly one read-only statement (SELECT, EXPLAIN); a
    statement DuckDB cannot parse raises ``duckdb.Error``."""
    statements = con.extract_statements(text)
    if len(statements) != 1:
        raise StoreQueryError(f"expected one SQL statement, got {len(statements)}")
    kind = statements[0].type
    if kind not in READ_ONLY_STATEMENTS:
        raise StoreQueryError(f"only read-only queries (SELECT, EXPLAIN) are allowed, not {kind.name}")


def export_parquet(db: Db, directory: str | Path) -> list[Path]:
    """Write every event table and the ``gaps`` table (what the stream is missing) to ``directory/<table>.parquet``
    (created if missing); the files written."""
    out_dir = Path(directory)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create {out_dir}: {exc.strerror or exc}") from None
    con, owned = _open(db)
    paths = []
    try:
        for table in (*TABLES, "gaps"):
            path = out_dir / f"{table}.parquet"
            quoted = str(path).replace("'", "''")
            try:
                con.execute(f"COPY {table} TO '{quoted}' (FORMAT parquet)")
            except duckdb.Error as exc:
                raise StoreError(f"cannot export {table} to {path}: {one_line(exc)}") from None
            paths.append(path)
    finally:
        if owned:
            con.close()
    return paths


def one_line(exc: BaseException) -> str:
    """DuckDB's error in one line (its first, and where the parser stopped)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    head = lines[0] if lines else type(exc).__name__
    for line in lines[1:]:  # "LINE 1: selec 1": where the parser stopped
        if line.startswith("LINE "):
            return f"{head} ({line})"
    return head
