"""The SQL screen's plain side: read-only queries on the console's database, export, and the query history.

No Textual: the screen runs :func:`run_query` and :func:`export_query` in thread workers and shows what they return.
Queries go through :func:`store.queries.check_read_only` (one SELECT or EXPLAIN statement; anything else is
refused), results are read as Arrow batches so that only the first ``max_rows`` rows become Python values (the
rest are counted), and an export runs the query again straight into the file with DuckDB's ``COPY`` (no row cap,
nothing held in memory; on a live recording it includes rows committed since the query ran).

Which database: :class:`ReplayDatabase` (a replayed store file, opened read-only) or the console's own recording
(:class:`console.recorder.ConsoleRecorder`, whose writer's connection serves the queries: DuckDB lets one process
open a file for writing, and reads in that process go through a cursor of the writer's connection).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import duckdb

from store.queries import StoreQueryError, check_read_only, one_line
from store.schema import connect

MAX_ROWS: Final = 1000
"""Rows of a result shown at most (the rest are counted)."""
EXPORT_FORMATS: Final = {".csv": "(FORMAT csv, HEADER)", ".parquet": "(FORMAT parquet)", ".pq": "(FORMAT parquet)"}
"""File suffixes an export understands, and DuckDB's ``COPY`` options for each."""


class Database(Protocol):
    """Where the SQL screen's queries run."""

    @property
    def description(self) -> str:
        """What it is, for the operator (``replay of x.duckdb``, ``recording to y.duckdb``)."""
        ...

    def query_connection(self) -> duckdb.DuckDBPyConnection:
        """A connection for queries (called from a worker thread; one query at a time)."""
        ...


class ReplayDatabase:
    """A store file opened read-only (the replayed file), on first use."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._con: duckdb.DuckDBPyConnection | None = None
        self._lock = threading.Lock()

    @property
    def description(self) -> str:
        return f"replay of {self.path}"

    def query_connection(self) -> duckdb.DuckDBPyConnection:
        with self._lock:
            if self._con is None:
                self._con = connect(self.path, read_only=True)
            return self._con

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None


@dataclass(frozen=True, slots=True)
class QueryResult:
    """A query's answer: its columns, its first rows, how many there were, how long it took."""

    text: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    """The first ``max_rows`` rows."""
    num_rows: int
    elapsed_s: float

    def summary(self) -> str:
        shown = f"{len(self.rows):,} of {self.num_rows:,} rows" if len(self.rows) < self.num_rows else None
        rows = shown or f"{self.num_rows:,} row{'s' if self.num_rows != 1 else ''}"
        columns = f"{len(self.columns)} column{'s' if len(self.columns) != 1 else ''}"
        return f"{rows}, {columns} in {fmt_seconds(self.elapsed_s)}"


@dataclass(frozen=True, slots=True)
class ExportResult:
    path: Path
    num_rows: int
    elapsed_s: float


def fmt_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def statement_of(text: str) -> str:
    """The query without surrounding blanks and trailing semicolons."""
    return text.strip().rstrip(";").strip()


def run_query(
    con: duckdb.DuckDBPyConnection,
    text: str,
    *,
    max_rows: int = MAX_ROWS,
    clock: Callable[[], float] = time.perf_counter,
) -> QueryResult:
    """Run one read-only statement on ``con``; raises :class:`StoreQueryError` with DuckDB's message in one line."""
    statement = statement_of(text)
    if not statement:
        raise StoreQueryError("type a query first (SELECT ...)")
    start = clock()
    try:
        with contextlib.closing(con.cursor()) as cur:  # its own connection: no result of another call in the way
            check_read_only(cur, statement)
            relation = cur.sql(statement)
            columns = tuple(relation.columns)
            reader = relation.to_arrow_reader(max(1, min(max_rows, 8192)))
            rows: list[tuple[Any, ...]] = []
            num_rows = 0
            for batch in reader:
                if len(rows) < max_rows:
                    part = batch.slice(0, max_rows - len(rows))
                    rows.extend(zip(*(column.to_pylist() for column in part.columns), strict=True))
                num_rows += batch.num_rows
    except duckdb.Error as exc:
        raise StoreQueryError(one_line(exc)) from None
    return QueryResult(statement, columns, tuple(rows), num_rows, clock() - start)


def export_query(
    con: duckdb.DuckDBPyConnection,
    text: str,
    path: str | Path,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> ExportResult:
    """Write the rows of the read-only query ``text`` to ``path`` (CSV with a header, or Parquet, by its suffix;
    folders created as needed)."""
    target = Path(path).expanduser()
    options = EXPORT_FORMATS.get(target.suffix.lower())
    if options is None:
        raise StoreQueryError(f"export to a .csv or .parquet file, not {target.name!r}")
    statement = statement_of(text)
    start = clock()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreQueryError(f"cannot create {target.parent}: {exc.strerror or exc}") from None
    quoted = str(target).replace("'", "''")
    try:
        with contextlib.closing(con.cursor()) as cur:
            check_read_only(cur, statement)
            row = cur.execute(f"COPY ({statement}) TO '{quoted}' {options}").fetchone()
    except duckdb.Error as exc:
        raise StoreQueryError(one_line(exc)) from None
    return ExportResult(target, int(row[0]) if row else 0, clock() - start)


def cell_text(value: Any, width: int = 60) -> str:
    """A value as a result cell: NULL, short floats, ISO times, at most ``width`` characters."""
    if value is None:
        text = "NULL"
    elif isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, datetime.datetime | datetime.date):
        text = value.isoformat()
    else:
        text = str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


class SqlHistory:
    """Queries run so far (oldest first, each once: running one again moves it to the end), walked with
    :meth:`older` and :meth:`newer` like a shell's history; walking past the newest gives back the draft."""

    def __init__(self, limit: int = 200) -> None:
        self.limit = limit
        self.entries: list[str] = []
        self._position: int | None = None
        """Index into :attr:`entries` while walking (None: at the draft)."""
        self._draft = ""

    def add(self, text: str) -> None:
        text = text.strip()
        if text:
            if text in self.entries:
                self.entries.remove(text)
            self.entries.append(text)
            del self.entries[: -self.limit]
        self._position = None

    def older(self, current: str) -> str | None:
        """The query before the one shown (``current`` is kept as the draft when the walk starts)."""
        if not self.entries:
            return None
        if self._position is None:
            self._draft = current
            self._position = len(self.entries)
        self._position = max(0, self._position - 1)
        return self.entries[self._position]

    def newer(self) -> str | None:
        """The query after the one shown, or the draft after the newest (None: not walking)."""
        if self._position is None:
            return None
        self._position += 1
        if self._position >= len(self.entries):
            self._position = None
            return self._draft
        return self.entries[self._position]
