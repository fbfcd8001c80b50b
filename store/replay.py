"""Read a store back as the protocol events it was written from (STYLE example 13).

:func:`replay` yields events in stream order, ``(node_id, boot_ns, seq)``, merged across tables, so tests, examples and
snapshots can feed a console's state model from a file instead of a running agent. Filters mirror a subscription's:
``kinds`` (event kinds, :data:`agent.telemetry.EVENT_KINDS`), ``unit_ids`` (node-level events, which concern no unit,
always pass, as in ``agent.telemetry.stream.event_unit_ids``), and a time range on ``time_ns``. The holes a recorder was
told of (table ``gaps``) come back as the ``gap`` alerts that announced them (:func:`gap_alerts`), where they belong in
their stream: after the last event before the hole, at the time of the first one after it. :func:`areplay` is the same
as an async iterator, optionally paced by the events' own timestamps at ``speed`` times real time; the database is read
in a worker thread. :func:`node_ids`, :func:`time_span` and :func:`recent_start` tell a reader which nodes and times
there are, and where "the last rows, at most so many" begin (a console rebuilding its view at a time of the store, or
loading its history).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Generator, Iterator
from pathlib import Path
from typing import Any

import duckdb

from agent.telemetry import EVENT_KINDS, Alert, AlertCode, Event
from store.convert import TABLE_KINDS, event_from_row, slack_from_rows
from store.schema import TABLES, connect

FETCH_ROWS = 4096
_UNIT_FILTERS = {
    "steps": "list_contains($units, unit_id)",
    "unit_loads": "list_contains($units, unit_id)",
    "slack_samples": "list_contains($units, unit_id)",
    "requests": "unit_id IS NULL OR list_contains($units, unit_id)",
    "alerts": "unit_id IS NULL OR list_contains($units, unit_id)",
    "request_events": "unit_id IS NULL OR list_contains($units, unit_id) OR list_contains($units, from_unit_id)",
    "audits": "len(unit_ids) = 0 OR list_has_any(unit_ids, $units)",
}
"""Tables without an entry (nodes, stage boundaries) hold node-level events only."""

Source = str | Path | duckdb.DuckDBPyConnection
"""A database file (opened read-only), or a connection (e.g. ``StoreWriter.cursor()``)."""


def replay(
    source: Source,
    *,
    kinds: Collection[str] | None = None,
    unit_ids: Collection[int] | None = None,
    node_ids: Collection[str] | None = None,
    start_ns: int | None = None,
    end_ns: int | None = None,
) -> Generator[Event, None, None]:
    """The stored events, in ``(node_id, boot_ns, seq)`` order, with ``start_ns <= time_ns < end_ns``."""
    unknown = sorted(set(kinds or ()) - EVENT_KINDS)
    if unknown:
        raise ValueError(f"unknown event kinds: {', '.join(unknown)}")
    owned = not isinstance(source, duckdb.DuckDBPyConnection)
    con = connect(source, read_only=True) if not isinstance(source, duckdb.DuckDBPyConnection) else source
    try:
        streams = []
        for index, table in enumerate(TABLES):
            table_kinds = TABLE_KINDS[table] if kinds is None else TABLE_KINDS[table] & set(kinds)
            if table == "requests":
                table_kinds = table_kinds & {"request_finished"}  # refusals replay from request_events
            if table_kinds:
                sql, params = _query(table, table_kinds, unit_ids, node_ids, start_ns, end_ns)
                streams.append(_keyed(index, table, con.cursor().execute(sql, params)))
        if kinds is None or "alert" in kinds:
            gaps = gap_alerts(con, node_ids=node_ids, start_ns=start_ns, end_ns=end_ns)
            streams.append(iter([(e.node_id, boot, e.last_seq, len(TABLES), e) for boot, e in gaps]))
        for *_, event in heapq.merge(*streams):
            yield event
    finally:
        if owned:
            con.close()


async def areplay(
    source: Source,
    *,
    speed: float | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    kinds: Collection[str] | None = None,
    unit_ids: Collection[int] | None = None,
    node_ids: Collection[str] | None = None,
    start_ns: int | None = None,
    end_ns: int | None = None,
) -> AsyncIterator[Event]:
    """:func:`replay` as an async iterator. With ``speed``, waits ``delta time_ns / speed`` between events whose
    time goes forward (``speed=1``: as recorded; 10: ten times faster); without it, yields as fast as it reads."""
    if speed is not None and speed <= 0:
        raise ValueError("speed must be positive")
    events = replay(
        source, kinds=kinds, unit_ids=unit_ids, node_ids=node_ids, start_ns=start_ns, end_ns=end_ns
    )
    last_ns: int | None = None
    try:
        while chunk := await asyncio.to_thread(_take, events, FETCH_ROWS):
            for event in chunk:
                if speed is not None and last_ns is not None and event.time_ns > last_ns:
                    await sleep((event.time_ns - last_ns) / 1e9 / speed)
                last_ns = event.time_ns if last_ns is None else max(last_ns, event.time_ns)
                yield event
    finally:
        events.close()


def gap_alerts(
    source: Source,
    *,
    node_ids: Collection[str] | None = None,
    start_ns: int | None = None,
    end_ns: int | None = None,
) -> list[tuple[int, Alert]]:
    """The stored gaps as the ``gap`` alerts that announced them, with their runs' ``boot_ns``, in stream order: each
    at the time of the first stored event after its hole (the stream resumed there; its ``detected_ns`` when none is
    stored), kept when that time is in ``[start_ns, end_ns)``."""
    with _opened(source) as con:
        params: dict[str, Any] = {}
        where = ""
        if node_ids is not None:
            where, params["nodes"] = " WHERE list_contains($nodes, node_id)", sorted(node_ids)
        query = f"SELECT node_id, boot_ns, from_seq, to_seq, detected_ns FROM gaps{where}"
        rows = con.execute(query, params).fetchall()
        after = " UNION ALL ".join(
            f"SELECT min(time_ns) AS t FROM {table} WHERE node_id = $node AND boot_ns = $boot AND seq = $seq"
            for table in TABLES
        )
        out = []
        for node, boot, first, last, detected in rows:
            row = con.execute(f"SELECT min(t) FROM ({after})", {"node": node, "boot": boot, "seq": last + 1}).fetchone()
            at = int(row[0]) if row and row[0] is not None else int(detected)
            if (start_ns is None or at >= start_ns) and (end_ns is None or at < end_ns):
                message = f"events {first}..{last} are missing: the agent no longer buffered them when it resumed"
                alert = Alert(
                    node_id=node, time_ns=at, code=AlertCode.GAP, message=message, first_seq=first, last_seq=last
                )
                out.append((int(boot), alert))
    return sorted(out, key=lambda pair: (pair[1].node_id, pair[0], pair[1].last_seq))


def node_ids(source: Source) -> list[str]:
    """Every node with stored events (or a stored hello), sorted."""
    with _opened(source) as con:
        union = " UNION ".join(f"SELECT DISTINCT node_id FROM {table}" for table in TABLES)
        return sorted(row[0] for row in con.execute(union).fetchall())


def time_span(source: Source, *, node_ids: Collection[str] | None = None) -> tuple[int, int] | None:
    """The first and the last ``time_ns`` of the stored events (hellos included) of ``node_ids`` (None: every
    node); None when there are none."""
    params: dict[str, Any] = {}
    where = ""
    if node_ids is not None:
        where, params["nodes"] = " WHERE list_contains($nodes, node_id)", sorted(node_ids)
    parts = " UNION ALL ".join(f"SELECT min(time_ns) AS lo, max(time_ns) AS hi FROM {t}{where}" for t in TABLES)
    with _opened(source) as con:
        row = con.execute(f"SELECT min(lo), max(hi) FROM ({parts})", params).fetchone()
    if row is None or row[0] is None:
        return None
    return int(row[0]), int(row[1])


def recent_start(source: Source, end_ns: int, max_rows: int, *, node_ids: Collection[str] | None = None) -> int | None:
    """The earliest time from which at most ``max_rows`` stored rows (of any table; a slack sample is a row per
    sampled request) have ``time_ns <= end_ns``; None when no more than ``max_rows`` rows lie there at all. Bounds
    how much a reader takes back ("the last minutes, but no more than ``max_rows`` rows")."""
    if max_rows < 0:
        raise ValueError("max_rows must not be negative")
    params: dict[str, Any] = {"end": end_ns, "skip": max_rows}
    where = "time_ns <= $end"
    if node_ids is not None:
        where += " AND list_contains($nodes, node_id)"
        params["nodes"] = sorted(node_ids)
    parts = " UNION ALL ".join(f"SELECT time_ns FROM {t} WHERE {where}" for t in TABLES)
    with _opened(source) as con:
        query = f"SELECT time_ns FROM ({parts}) ORDER BY time_ns DESC LIMIT 1 OFFSET $skip"
        row = con.execute(query, params).fetchone()
    return None if row is None else int(row[0]) + 1


@contextlib.contextmanager
def _opened(source: Source) -> Iterator[duckdb.DuckDBPyConnection]:
    """A cursor of ``source`` (a connection's own, or a file opened read-only and closed after)."""
    if isinstance(source, duckdb.DuckDBPyConnection):
        cur = source.cursor()
        try:
            yield cur
        finally:
            cur.close()
        return
    con = connect(source, read_only=True)
    try:
        yield con
    finally:
        con.close()


def _take(events: Iterator[Event], n: int) -> list[Event]:
    return list(itertools.islice(events, n))


def _query(
    table: str,
    kinds: Collection[str],
    unit_ids: Collection[int] | None,
    node_ids: Collection[str] | None,
    start_ns: int | None,
    end_ns: int | None,
) -> tuple[str, dict[str, Any]]:
    where: list[str] = []
    params: dict[str, Any] = {}
    if table == "request_events" and set(kinds) != TABLE_KINDS[table]:
        where.append("list_contains($kinds, kind)")
        params["kinds"] = sorted(kinds)
    if table == "requests":
        where.append("NOT refused")
    if unit_ids is not None and table in _UNIT_FILTERS:
        where.append(f"({_UNIT_FILTERS[table]})")
        params["units"] = sorted(unit_ids)
    if node_ids is not None:
        where.append("list_contains($nodes, node_id)")
        params["nodes"] = sorted(node_ids)
    if start_ns is not None:
        where.append("time_ns >= $start")
        params["start"] = start_ns
    if end_ns is not None:
        where.append("time_ns < $end")
        params["end"] = end_ns
    order = "node_id, boot_ns, seq, time_ns, idx" if table == "slack_samples" else "node_id, boot_ns, seq"
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    return f"SELECT * FROM {table}{clause} ORDER BY {order}", params


def _keyed(index: int, table: str, cur: duckdb.DuckDBPyConnection) -> Iterator[tuple[str, int, int, int, Event]]:
    names = [d[0] for d in cur.description or ()]
    rows = _rows(cur, names)
    if table == "slack_samples":  # one event per group of rows; idx 0 starts a sample
        group: list[dict[str, Any]] = []
        for row in rows:
            if row["idx"] == 0 and group:
                yield _key(index, group[0], slack_from_rows(group))
                group = []
            group.append(row)
        if group:
            yield _key(index, group[0], slack_from_rows(group))
        return
    for row in rows:
        node, boot, seq = row["node_id"], row["boot_ns"], row["seq"]
        yield node, boot, seq, index, event_from_row(table, row)


def _key(index: int, row: dict[str, Any], event: Event) -> tuple[str, int, int, int, Event]:
    return row["node_id"], row["boot_ns"], row["seq"], index, event


def _rows(cur: duckdb.DuckDBPyConnection, names: list[str]) -> Iterator[dict[str, Any]]:
    while chunk := cur.fetchmany(FETCH_ROWS):
        for values in chunk:
            yield dict(zip(names, values, strict=True))
